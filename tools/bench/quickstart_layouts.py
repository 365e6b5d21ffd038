"""Benchmark: which parallel layout and server count suit the quickstart on this machine.

The quickstart (configs/quickstart.yaml, from the SFT warm start of megarl_run.py) in each layout,
the same steps and seed, interleaved repetitions (layout A, B, C, A, B, C, ...), load averages
around each run. Per layout: mean and median s/step over the steps after the first, the phases
(generate, old_log_prob, update_actor, sync_weights, reward), and the greedy validation score.

    .venv/bin/python tools/bench/quickstart_layouts.py --steps 20 --repeats 2
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench_common import DEFAULT_OUT, load_average, print_table, spread, write_result
from megarl_run import run_grpo, steady, warm_start

TP2 = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"
TP1 = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1"
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={}"  # one micro-batch per mini-batch and rank
LAYOUTS = {  # name -> overrides of configs/quickstart.yaml (whose own layout is tp1_colocated_1_server)
    "tp2_colocated_2_servers": ["trainer.n_gpus_per_node=2", TP2, MICRO.format(128)],
    "tp1_colocated_1_server": ["trainer.n_gpus_per_node=1", TP1, MICRO.format(128)],
    "tp1_split_1_server": ["trainer.n_gpus_per_node=2", TP1, "placement.mode=split", "placement.rollout_gpus=1",
                           MICRO.format(128)],
    "tp1_dp2_colocated_2_servers": ["trainer.n_gpus_per_node=2", TP1, MICRO.format(64)],
}
PHASES = ("generate", "reward", "old_log_prob", "update_actor", "sync_weights")


def summary(name: str, rep: int, run: dict) -> dict:
    step = steady(run["step_s"])
    row = {"layout": name, "repeat": rep, "s_per_step": sum(step) / len(step),
           "median": statistics.median(step), "val_before": run["val_score_before"], "val": run["val_score"],
           "load_1m_before": run["load_before"]["1m"], "load_1m_after": run["load_after"]["1m"]}
    for phase in PHASES:
        values = steady(run["phases_s"].get(phase, [0.0] * len(run["step_s"])))
        row[phase] = sum(values) / len(values)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--sft-steps", type=int, default=240, help="megarl SFT warm-up steps (made once per --workdir)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_OUT / "work")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()

    warm = warm_start(args.workdir, args.sft_steps)
    load_before = load_average()
    rows = []
    for rep in range(args.repeats):
        for name in args.layouts:
            print(f"repeat {rep + 1}/{args.repeats}: {name} ...", flush=True)
            run = run_grpo(warm, args.workdir, f"layout-{name}-{rep}", args.steps, 0, LAYOUTS[name])
            rows.append(summary(name, rep, run))
    print(f"\nseconds per GRPO step (mean over steps 2..{args.steps}) and phases, per layout and repeat")
    print_table(rows, [("layout", "layout", "s"), ("repeat", "rep", "d"), ("s_per_step", "s/step", ".3f"),
                       ("median", "median", ".3f"), *[(ph, ph[:10], ".3f") for ph in PHASES],
                       ("val", "val after", ".3f"), ("load_1m_before", "load", ".1f")])
    means = {name: spread([r["s_per_step"] for r in rows if r["layout"] == name]) for name in args.layouts}
    for name, s in means.items():
        print(f"  {name:<26} {s['mean']:.3f} s/step [min {s['min']:.3f}, max {s['max']:.3f}]")
    write_result("quickstart_layouts", {"settings": vars(args) | {"out": str(args.out), "workdir": str(args.workdir)},
                                        "layouts": LAYOUTS, "warm_start": warm, "load_before": load_before,
                                        "load_after": load_average(), "rows": rows, "mean_s_per_step": means},
                 args.out)


if __name__ == "__main__":
    main()
