"""Benchmark: megarl's framework overhead, seconds per GRPO step vs the minimal single-process loop.

megarl: configs/quickstart.yaml through its CLI (Megatron on gloo at the config's layout: TP=1, DP=2
and two CPU-engine servers behind the router since 2026-12-03, TP=1 and one server before, TP=2 and
two servers at first; Ray, a weight push per step), from the SFT-warmed tiny model of megarl_run.py.
Reference: ../shared/reference/tiny_grpo.py run as is (its own SFT warm-up, then GRPO in one
process with a KV-cached sampling loop). Same settings: the 302k-parameter Qwen2, 2-digit
addition, 32 prompts x 8 samples, at most 4 new tokens (the reference's fixed length for this task;
megarl's max_response_length is set to 4 to match), 2 optimizer steps per batch, lr 3e-4, clip 0.2,
no KL. The reference trains only on groups whose rewards differ; megarl's update leaves the rows of
advantage 0 out of its forward and backward too (configs/quickstart.yaml: actor.skip_zero_advantage_rows=auto,
the same update),
but still scores them before it (old log-probs and entropy for its metrics) and keeps a row on a rank
with none to learn from.

Where megarl's time goes (its timing/* metrics, per step after the first):
  generation    = generate + reward          (reference: gen_s, which includes its reward)
  training      = old_log_prob + update_actor + advantages   (reference: train_s)
  sync          = sync_weights               (reference: none, one process holds the only copy)
  orchestration = step - the phases above    (reference: none by construction)
Runs are interleaved (megarl, reference, ...) with load averages recorded before and after each.

    .venv/bin/python tools/bench/overhead.py --steps 30 --repeats 3
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_common import DEFAULT_OUT, REPO, load_average, print_table, spread, write_result
from megarl_run import python_for_megarl, run_grpo, run_logged, steady, warm_start

REFERENCE = REPO.parent / "shared" / "reference" / "tiny_grpo.py"
CATEGORIES = {"generation": ("generate", "reward"), "training": ("old_log_prob", "ref_log_prob", "values",
              "update_critic", "update_actor", "advantages"), "sync": ("sync_weights",)}


def megarl_breakdown(run: dict) -> dict:
    """Mean seconds per step (after the first) by category; orchestration = step - the categories."""
    step = steady(run["step_s"])
    out = {"step": sum(step) / len(step)}
    for category, phases in CATEGORIES.items():
        per_step = [sum(run["phases_s"].get(p, [0.0] * len(run["step_s"]))[i] for p in phases)
                    for i in range(len(run["step_s"]))]
        values = steady(per_step)
        out[category] = sum(values) / len(values)
    out["orchestration"] = out["step"] - sum(out[c] for c in CATEGORIES)
    return out


def run_reference(workdir: Path, name: str, steps: int, seed: int, reference: Path) -> dict:
    out = workdir / "reference" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [python_for_megarl(), str(reference), "--seed", str(seed), "--grpo_steps", str(steps),
               "--eval_every", str(steps), "--out", str(out)]
    load_before = load_average()
    run_logged(command, out.with_suffix(".log"), timeout_s=1800)
    log = json.loads(out.read_text())
    grpo = log["grpo"]
    gen, train = steady([s["gen_s"] for s in grpo]), steady([s["train_s"] for s in grpo])
    step = [g + t for g, t in zip(gen, train)]
    return {"framework": "reference", "command": " ".join(command[1:]), "steps": len(grpo),
            "load_before": load_before, "load_after": load_average(),
            "breakdown": {"step": sum(step) / len(step), "generation": sum(gen) / len(gen),
                          "training": sum(train) / len(train), "sync": 0.0, "orchestration": 0.0},
            "val_score_before": log["after_sft"]["greedy"], "val_score": log["after_grpo"]["greedy"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sft-steps", type=int, default=240, help="megarl SFT warm-up steps (made once per --workdir)")
    p.add_argument("--reference", type=Path, default=REFERENCE, help="the minimal loop, tiny_grpo.py")
    p.add_argument("--megarl-override", action="append", default=[], help="extra key=value for megarl (tests)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_OUT / "work")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    if not args.reference.exists():
        raise SystemExit(f"reference loop not found: {args.reference} (pass --reference)")

    warm = warm_start(args.workdir, args.sft_steps)
    runs = []
    for rep in range(args.repeats):
        print(f"run {rep + 1}/{args.repeats}: megarl ...", flush=True)
        m = run_grpo(warm, args.workdir, f"overhead-megarl-{rep}", args.steps, rep,
                     ["data.max_response_length=4", *args.megarl_override])
        runs.append({"repeat": rep, **m, "breakdown": megarl_breakdown(m)})
        print(f"run {rep + 1}/{args.repeats}: reference ...", flush=True)
        runs.append({"repeat": rep, **run_reference(args.workdir, f"overhead-reference-{rep}", args.steps, rep,
                                                    args.reference)})

    by = {fw: [r for r in runs if r["framework"] == fw] for fw in ("megarl", "reference")}
    keys = ("step", "generation", "training", "sync", "orchestration")
    mean = {fw: {k: spread([r["breakdown"][k] for r in rs]) for k in keys} for fw, rs in by.items()}
    ratio = spread([m["breakdown"]["step"] / r["breakdown"]["step"] for m, r in zip(by["megarl"], by["reference"])])
    extra = {k: mean["megarl"][k]["mean"] - mean["reference"][k]["mean"] for k in keys}
    rows = [{"framework": r["framework"], "repeat": r["repeat"], **r["breakdown"]} for r in runs]
    print(f"\nseconds per GRPO step (mean over steps 2..{args.steps}), 32 prompts x 8, <= 4 new tokens")
    print_table(rows, [("framework", "framework", "s"), ("repeat", "repeat", "d"), ("step", "step", ".3f"),
                       ("generation", "generation", ".3f"), ("training", "training", ".3f"), ("sync", "sync", ".3f"),
                       ("orchestration", "orchestr.", ".3f")])
    print(f"megarl / reference seconds per step: {ratio['mean']:.2f} [min {ratio['min']:.2f}, max {ratio['max']:.2f}]"
          if ratio["n"] else "megarl / reference seconds per step: n/a")
    total_extra = extra["step"]
    for k in keys[1:]:
        share = extra[k] / total_extra if total_extra else 0.0
        print(f"  extra {k:<13} {extra[k]:+.3f} s/step ({share:.0%} of megarl's extra time)")
    write_result("overhead", {"settings": {"steps": args.steps, "repeats": args.repeats, "sft_steps": args.sft_steps},
                              "warm_start": warm, "runs": runs, "mean_s_per_step": mean,
                              "ratio_megarl_over_reference": ratio, "extra_s_per_step": extra}, args.out)


if __name__ == "__main__":
    main()
