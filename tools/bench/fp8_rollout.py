"""Benchmark: GRPO with an FP8 rollout, with and without a rollout correction, beside a bf16 rollout.

The quickstart's GRPO (configs/quickstart.yaml: fp32 Megatron actor, two colocated CPU-engine
servers) from the warm start of megarl_run.py, at equal steps and seeds, with the servers in
  bf16           actor_rollout_ref.rollout.dtype=bfloat16
  fp8            ... and rollout.quantization=fp8 (block FP8 weights, megarl.rollout.fp8)
  fp8+is         ... and algorithm.rollout_correction.rollout_is=token, threshold 2.0
                 (configs/recipes/grpo_fp8.yaml's correction)
Per arm and seed: the rollout/trainer gap each step (training/rollout_probs_diff_mean,
training/rollout_log_probs_diff_max) and verl's diagnostics (rollout_corr/kl, k3_kl,
log_ppl_abs_diff, chi2_token), averaged over the steps; the greedy validation score before and
after; seconds per step.

    .venv/bin/python tools/bench/fp8_rollout.py --steps 60 --seeds 0 1
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_common import DEFAULT_OUT, load_average, print_table, spread, write_result
from megarl_run import run_grpo, steady, warm_start

ARMS = {
    "bf16": ["actor_rollout_ref.rollout.dtype=bfloat16"],
    "fp8": ["actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.quantization=fp8"],
    "fp8+is": ["actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.quantization=fp8",
               "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"],
}
GAP = ("training/rollout_probs_diff_mean", "training/rollout_log_probs_diff_max", "rollout_corr/kl",
       "rollout_corr/k3_kl", "rollout_corr/log_ppl_abs_diff", "rollout_corr/chi2_token")


def gap_means(metrics_path: str) -> dict:
    """Each GAP metric's mean over the run's training steps (None where never logged)."""
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines()]
    train = [r for r in rows if "timing/step_s" in r]
    out = {}
    for key in GAP:
        values = [r[key] for r in train if key in r]
        out[key] = sum(values) / len(values) if values else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--sft-steps", type=int, default=240)
    p.add_argument("--workdir", type=Path, default=DEFAULT_OUT / "work")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    warm = warm_start(args.workdir, args.sft_steps)
    runs = []
    for seed in args.seeds:
        for arm, overrides in ARMS.items():  # interleaved: the machine's load falls on every arm alike
            print(f"seed {seed}: {arm} ...", flush=True)
            run = run_grpo(warm, args.workdir, f"fp8-{arm}-{seed}", args.steps, seed,
                           ["data.max_response_length=4", *overrides])
            step = steady(run["step_s"])
            runs.append({"arm": arm, "seed": seed, "step_s": sum(step) / len(step), "val_before": run["val_score_before"],
                         "val_after": run["val_score"], **gap_means(run["metrics"]), "run": run})
    columns = [("arm", "arm", "s"), ("seed", "seed", "d"), ("val_before", "val before", ".3f"),
               ("val_after", "val after", ".3f"), ("step_s", "s/step", ".3f")]
    columns += [(k, k.split("/")[-1], ".2e") for k in GAP]
    print(f"\nGRPO, {args.steps} steps per run from the warm start; gap metrics: means over the steps")
    print_table(runs, columns)
    summary = {arm: {k: spread([r[k] for r in runs if r["arm"] == arm and r[k] is not None])
                     for k in ("val_after", "step_s", *GAP)} for arm in ARMS}
    write_result("fp8_rollout", {"settings": {"steps": args.steps, "seeds": args.seeds, "arms": ARMS},
                                 "warm_start": warm, "runs": runs, "summary": summary, "load_after": load_average()},
                 args.out)


if __name__ == "__main__":
    main()
