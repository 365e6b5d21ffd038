"""Benchmark: the asynchronous training modes, seconds per GRPO step and the share of generation
hidden behind training, from the same warm start.

configs/quickstart.yaml in split placement (a TP=1 actor on one logical GPU, one CPU-engine server
on the other), from the SFT-warmed tiny model of megarl_run.py, the same steps and seed once per
mode and seed: sync, one_step_off, fully_async (max_staleness 2) and fully_async with partial rollouts,
every run with truncated importance sampling (cap 2: the off-policy correction the async modes
need; in sync it only corrects the engine/trainer mismatch, ~1 per token), except the
`*_rollout_logp` modes, whose correction is the rollout's log-probs as the PPO ratio's old ones
(`actor.use_rollout_log_probs`, TIS off). Default modes: all but those two.
Per mode (steps after the first): mean s/step, and the hidden share of generation:
  hidden = timing/generate_hidden_s (seconds of the step's batch generated while the trainer did
  something else), waited = timing/generate_wait_s; share = hidden / (hidden + waited).
In sync mode nothing is hidden (share 0). The modes run one after the other for each seed in turn, with load averages
recorded before and after each run: on a machine shared with other work the figures say so.
Greedy validation accuracy (512 prompts) before and after; the mean TIS weight and the
trainer/rollout log-prob gap show how far off-policy the batches were.

    .venv/bin/python tools/bench/async_modes.py --steps 40 --seeds 0 1
    .venv/bin/python tools/bench/async_modes.py --steps 40 --seeds 0 1 2 --modes sync one_step_off --lr 1e-4 \
        --out outputs/bench/lr1e-4   # runs named async-<mode>-lr0.0001-seed<s>; --out keeps the results apart
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_common import DEFAULT_OUT, by_group, print_table, write_result
from megarl_run import run_grpo, steady, warm_start

SPLIT = ["placement.mode=split", "trainer.n_gpus_per_node=2", "placement.rollout_gpus=1",
         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",  # one micro-batch per mini-batch (one rank)
         "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0"]
MODES = {
    "sync": ["async_training.mode=sync"],
    "one_step_off": ["async_training.mode=one_step_off"],
    "fully_async": ["async_training.mode=fully_async", "async_training.max_staleness=2"],
    "fully_async_partial": ["async_training.mode=fully_async", "async_training.max_staleness=2",
                            "async_training.partial_rollout=true"],
}
# the other off-policy correction: the rollout's log-probs as the PPO ratio's old ones, TIS off
ROLLOUT_LOGP = ["actor_rollout_ref.actor.use_rollout_log_probs=true", "actor_rollout_ref.actor.tis_imp_ratio_cap=-1"]
MODES |= {"one_step_off_rollout_logp": [*MODES["one_step_off"], *ROLLOUT_LOGP],
          "fully_async_rollout_logp": [*MODES["fully_async"], *ROLLOUT_LOGP]}


def mode_summary(run: dict) -> dict:
    """Mean and median s/step (the median resists the load spikes of a shared machine), the hidden
    share of generation over the steps after the first, and the greedy accuracy gain."""
    step = steady(run["step_s"])
    zeros = [0.0] * len(run["step_s"])
    hidden = sum(steady(run["phases_s"].get("generate_hidden", zeros)))
    waited = sum(steady(run["phases_s"].get("generate_wait", run["phases_s"].get("generate", zeros))))
    return {"s_per_step": sum(step) / len(step), "s_per_step_median": statistics.median(step),
            "hidden_share": hidden / (hidden + waited) if hidden + waited else 0.0,
            "val_score": run["val_score"], "val_gain": run["val_score"] - run["val_score_before"]}


def off_policy_summary(metrics_jsonl: Path) -> dict:
    """Means over the run's steps of the TIS weight and |trainer - rollout| log-prob gap (nats)."""
    rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines()]
    train = [r for r in rows if "timing/step_s" in r]

    def mean(key):
        values = [r[key] for r in train if key in r]
        return sum(values) / len(values) if values else None

    return {"tis_weight_mean": mean("actor/tis_weight_mean"), "tis_capfrac": mean("actor/tis_capfrac"),
            "logprob_gap_max": mean("training/rollout_log_probs_diff_max"),
            "staleness_mean": mean("async/staleness_mean")}


def by_mode(runs: list[dict]) -> list[dict]:
    """Per mode, over its seeds: mean (min, max) of s/step, hidden share and greedy accuracy gain."""
    return by_group(runs, "mode",
                    ("s_per_step", "s_per_step_median", "hidden_share", "val_score", "val_gain", "tis_weight_mean"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="more than the quickstart's 10 warm-up steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--modes", nargs="+", default=[m for m in MODES if not m.endswith("_rollout_logp")],
                   choices=list(MODES))
    p.add_argument("--sft-steps", type=int, default=240, help="megarl SFT warm-up steps (made once per --workdir)")
    p.add_argument("--lr", type=float, default=None, help="actor learning rate (default: the quickstart's 3e-4)")
    p.add_argument("--override", action="append", default=[], help="extra key=value for every run")
    p.add_argument("--workdir", type=Path, default=DEFAULT_OUT / "work")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()

    warm = warm_start(args.workdir, args.sft_steps)
    extra = [*args.override, *([f"actor_rollout_ref.actor.optim.lr={args.lr}"] if args.lr is not None else [])]
    tag = f"-lr{args.lr:g}" if args.lr is not None else ""
    settings = vars(args) | {"workdir": str(args.workdir), "out": str(args.out)}
    runs = []
    for seed in args.seeds:
        for mode in args.modes:
            print(f"{mode} seed {seed} ...", flush=True)
            name = f"async-{mode}{tag}-seed{seed}"
            try:
                run = run_grpo(warm, args.workdir, name, args.steps, seed, [*SPLIT, *MODES[mode], *extra])
            except RuntimeError as failed:  # e.g. Ray's start-up timing out on a loaded machine: once more
                print(f"  failed, running it again: {str(failed).splitlines()[-1]}", flush=True)
                run = run_grpo(warm, args.workdir, name, args.steps, seed, [*SPLIT, *MODES[mode], *extra])
            metrics = Path(args.workdir).resolve() / "runs" / "quickstart" / name / "logs" / "metrics.jsonl"
            runs.append({"mode": mode, "seed": seed, "lr": args.lr, **run, **mode_summary(run), **off_policy_summary(metrics)})
            r = runs[-1]
            write_result("async_modes", {"settings": settings, "warm_start": warm, "runs": runs}, args.out)  # so far
            print(f"  s/step {r['s_per_step']:.3f}, hidden {r['hidden_share']:.0%}, greedy val "
                  f"{r['val_score_before']:.3f} -> {r['val_score']:.3f}, load (1 min) {r['load_before']['1m']:.1f} "
                  f"before, {r['load_after']['1m']:.1f} after", flush=True)
    print(f"\nquickstart, split placement, {args.steps} steps per run, seeds {args.seeds} "
          f"(s/step over steps 2..{args.steps}; mean over seeds, then min and max)")
    summary = by_mode(runs)
    print_table(summary, [("mode", "mode", "s"), ("runs", "runs", "d"), ("s_per_step", "s/step", ".3f"),
                          ("s_per_step_min", "min", ".3f"), ("s_per_step_max", "max", ".3f"),
                          ("s_per_step_median", "median", ".3f"), ("hidden_share", "hidden", ".0%"),
                          ("val_gain", "val gain", "+.3f"),
                          ("val_gain_min", "min", "+.3f"), ("val_gain_max", "max", "+.3f"),
                          ("tis_weight_mean", "TIS w", ".3f")])
    write_result("async_modes", {"settings": settings, "warm_start": warm, "runs": runs, "by_mode": summary}, args.out)


if __name__ == "__main__":
    main()
