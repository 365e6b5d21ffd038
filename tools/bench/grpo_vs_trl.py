"""Benchmark: end-to-end GRPO with megarl (CPU path) vs TRL's `GRPOTrainer`, same everything.

Both start from the same SFT-warmed tiny Qwen2 (megarl_run.warm_start), train on the same 2-digit
addition parquet with the same reward (megarl's exact match), `--batch` prompts x `--n` samples of at
most `--response-length` tokens per step, `--batch / --mini-batch` optimizer steps per step, lr 3e-4
with 10 warm-up optimizer steps, clip 0.2, no KL, for `--steps` steps; then greedy accuracy on the
512 validation prompts. megarl runs configs/quickstart.yaml through its CLI (Megatron on gloo at the
config's layout: TP=1, DP=2 and two CPU-engine servers since 2026-12-03, TP=1 and one server before,
TP=2 and two servers at first; Ray, a weight push per step); TRL runs tools/bench/trl_grpo.py in
.venv-bench (made by setup_bench_env.sh; .venv is not touched). The runs are interleaved
(megarl, TRL, megarl, TRL, ...) so that other load on the machine hits both alike; the load
averages before and after each run are recorded.

Per run: seconds per step and generated tokens/s over the steps after the first (warm-up; start-up
time is excluded for both), validation reward after training. Ratios megarl/TRL are given as
mean [min, max] over the repetitions.

    .venv/bin/python tools/bench/grpo_vs_trl.py --steps 20 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from bench_common import DEFAULT_OUT, REPO, load_average, print_table, spread, write_result
from megarl_run import run_grpo, run_logged, steady, warm_start


def bench_python() -> str:
    """The python of .venv-bench (created on first use)."""
    out = subprocess.run([str(REPO / "tools" / "bench" / "setup_bench_env.sh")], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"setup_bench_env.sh failed:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def run_trl(python: str, warm: dict, workdir: Path, name: str, args, seed: int) -> dict:
    out = workdir / "trl" / name
    out.mkdir(parents=True, exist_ok=True)
    command = [python, str(REPO / "tools" / "bench" / "trl_grpo.py"), "--model", warm["model"], "--train",
               warm["train"], "--val", warm["val"], "--out-dir", str(out), "--json", str(out / "result.json"),
               "--steps", str(args.steps), "--batch", str(args.batch), "--n", str(args.n), "--mini-batch",
               str(args.mini_batch), "--response-length", str(args.response_length), "--seed", str(seed)]
    load_before = load_average()
    run_logged(command, out / "run.log", timeout_s=1800, env={"TOKENIZERS_PARALLELISM": "false"})
    result = json.loads((out / "result.json").read_text())
    return {**result, "command": " ".join(command[1:]), "load_before": load_before, "load_after": load_average()}


def quickstart_dp() -> int:
    """The actor's data-parallel size in configs/quickstart.yaml's layout."""
    from megarl.config import load_and_validate
    from megarl.config.validate import batch_plan

    return batch_plan(load_and_validate(str(REPO / "configs" / "quickstart.yaml"))).actor_dp


def figures(run: dict) -> dict:
    """Steady-state seconds per step and generated tokens/s of one run."""
    seconds, tokens = steady(run["step_s"]), steady(run["response_tokens"])
    return {"s_per_step": sum(seconds) / len(seconds), "gen_tokens_per_s": sum(tokens) / sum(seconds),
            "val_score": run["val_score"], "val_score_before": run["val_score_before"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="GRPO steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each framework, interleaved")
    p.add_argument("--batch", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--mini-batch", type=int, default=16, help="prompts per optimizer step")
    p.add_argument("--response-length", type=int, default=8, help="max new tokens")
    p.add_argument("--sft-steps", type=int, default=240, help="megarl SFT warm-up steps (made once per --workdir)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_OUT / "work")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()

    python = bench_python()
    warm = warm_start(args.workdir, args.sft_steps)
    megarl_overrides = [f"data.train_batch_size={args.batch}", f"actor_rollout_ref.rollout.n={args.n}",
                        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.mini_batch}",
                        # one micro-batch per mini-batch on each data-parallel rank
                        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.mini_batch * args.n // quickstart_dp()}",
                        f"data.max_response_length={args.response_length}"]
    runs = []
    for rep in range(args.repeats):
        for framework in ("megarl", "trl"):
            name = f"grpo-vs-trl-{framework}-{rep}"
            print(f"run {rep + 1}/{args.repeats}: {framework} ...", flush=True)
            if framework == "megarl":
                run = run_grpo(warm, args.workdir, name, args.steps, rep, megarl_overrides)
            else:
                run = run_trl(python, warm, args.workdir, name, args, rep)
            runs.append({"repeat": rep, **run, **figures(run)})

    by = {fw: [r for r in runs if r["framework"] == fw] for fw in ("megarl", "trl")}
    ratios = {key: spread([m[key] / t[key] for m, t in zip(by["megarl"], by["trl"]) if t[key]])
              for key in ("s_per_step", "gen_tokens_per_s", "val_score")}
    summary = {fw: {key: spread([r[key] for r in rs]) for key in ("s_per_step", "gen_tokens_per_s", "val_score")}
               for fw, rs in by.items()}
    print(f"\nGRPO, {args.batch} prompts x n={args.n}, <= {args.response_length} new tokens, {args.steps} steps, "
          f"{args.repeats} interleaved repetitions (figures after the first step of each run)")
    print_table(runs, [("framework", "framework", "s"), ("repeat", "repeat", "d"), ("s_per_step", "s/step", ".3f"),
                       ("gen_tokens_per_s", "gen tok/s", ".0f"), ("val_score_before", "val before", ".3f"),
                       ("val_score", "val after", ".3f")])
    for key, r in ratios.items():
        text = "n/a (a TRL figure is 0)" if r["n"] == 0 else f"{r['mean']:.2f}  [min {r['min']:.2f}, max {r['max']:.2f}]"
        print(f"megarl/TRL {key:<17} {text}")
    write_result("grpo_vs_trl", {
        "settings": {k: v for k, v in vars(args).items() if k not in ("workdir", "out")}, "warm_start": warm,
        "runs": runs, "summary": summary, "ratio_megarl_over_trl": ratios,
    }, args.out)


if __name__ == "__main__":
    main()
