"""Benchmark: the asynchronous training modes, seconds per GRPO step and the share of generation
hidden behind training, from the same warm start.

configs/quickstart.yaml in split placement (a TP=1 actor on one logical GPU, one CPU-engine server
on the other), from the SFT-warmed tiny model of megarl_run.py, the same steps and seed once per
mode: sync, one_step_off, fully_async (max_staleness 2) and fully_async with partial rollouts.
Per mode (steps after the first): mean s/step, and the hidden share of generation:
  hidden = timing/generate_hidden_s (seconds of the step's batch generated while the trainer did
  something else), waited = timing/generate_wait_s; share = hidden / (hidden + waited).
In sync mode nothing is hidden (share 0). The modes run one after the other, with load averages
recorded before and after each run: on a machine shared with other work the figures say so.

    .venv/bin/python tools/bench/async_modes.py --steps 12
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench_common import DEFAULT_OUT, print_table, spread, write_result
from megarl_run import run_grpo, steady, warm_start

SPLIT = ["placement.mode=split", "placement.rollout_gpus=1",
         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1"]
MODES = {
    "sync": ["async_training.mode=sync"],
    "one_step_off": ["async_training.mode=one_step_off"],
    "fully_async": ["async_training.mode=fully_async", "async_training.max_staleness=2"],
    "fully_async_partial": ["async_training.mode=fully_async", "async_training.max_staleness=2",
                            "async_training.partial_rollout=true"],
}


def mode_summary(run: dict) -> dict:
    """Mean s/step and the hidden share of generation over the steps after the first."""
    step = steady(run["step_s"])
    zeros = [0.0] * len(run["step_s"])
    hidden = sum(steady(run["phases_s"].get("generate_hidden", zeros)))
    waited = sum(steady(run["phases_s"].get("generate_wait", run["phases_s"].get("generate", zeros))))
    return {"s_per_step": sum(step) / len(step), "hidden_share": hidden / (hidden + waited) if hidden + waited else 0.0,
            "val_score": run["val_score"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="more than the quickstart's 10 warm-up steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--sft-steps", type=int, default=240, help="megarl SFT warm-up steps (made once per --workdir)")
    p.add_argument("--override", action="append", default=[], help="extra key=value for every run")
    p.add_argument("--workdir", type=Path, default=DEFAULT_OUT / "work")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()

    warm = warm_start(args.workdir, args.sft_steps)
    runs = []
    for mode in args.modes:
        print(f"{mode} ...", flush=True)
        run = run_grpo(warm, args.workdir, f"async-{mode}", args.steps, args.seed,
                       [*SPLIT, *MODES[mode], *args.override])
        runs.append({"mode": mode, **run, **mode_summary(run)})
    print(f"\nquickstart, split placement, {args.steps} steps per mode (means over steps 2..{args.steps})")
    print_table(runs, [("mode", "mode", "s"), ("s_per_step", "s/step", ".3f"), ("hidden_share", "hidden", ".0%")])
    for r in runs:
        s = spread(steady(r["step_s"]))
        print(f"  {r['mode']}: s/step min {s['min']:.3f} max {s['max']:.3f}; load (1 min) "
              f"{r['load_before']['1m']:.1f} before, {r['load_after']['1m']:.1f} after")
    write_result("async_modes", {"settings": vars(args) | {"workdir": str(args.workdir), "out": str(args.out)},
                                 "warm_start": warm, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
