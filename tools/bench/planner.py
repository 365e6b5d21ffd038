"""Benchmark: time to validate a config and plan its placement, for clusters of 8 to 4,096 nodes.

For each node count and each placement mode (colocated; split with half the GPUs for rollout), the
experiment configs/base.yaml with 8 GPUs per node, actor TP=4 x PP=2, a reference model (KL
loss), rollout TP=4 and batch sizes scaled with the cluster is (1) loaded and validated
(`megarl.config.load_and_validate`), (2) planned (`megarl.placement.plan_from_config`: every rank
of every role placed on a GPU, TP groups checked against node boundaries) and (3) rendered as the
printable GPU map (`format_gpu_map`). Each is timed `--repeats` times; the best is reported, and
every time is kept in the row (`times_s`).

    .venv/bin/python tools/bench/planner.py
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench_common import DEFAULT_OUT, REPO, load_average, print_table, write_result

from megarl.config import load_and_validate
from megarl.placement import format_gpu_map, plan_from_config

GPUS_PER_NODE = 8


def overrides(nodes: int, mode: str) -> list[str]:
    gpus = nodes * GPUS_PER_NODE
    keys = [f"trainer.nnodes={nodes}", f"trainer.n_gpus_per_node={GPUS_PER_NODE}",
            "actor_rollout_ref.model.path=unused", "data.train_files=[unused.parquet]",
            f"data.train_batch_size={64 * gpus}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={16 * gpus}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "actor_rollout_ref.rollout.n=8"]
    if mode == "split":
        keys += ["placement.mode=split", f"placement.rollout_gpus={gpus // 2}"]
    return keys


def timed(repeats: int, fn) -> tuple[list[float], object]:
    """The seconds of each of `repeats` calls of `fn`, and the last call's value."""
    times, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return times, value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128, 512, 1024, 2048, 4096])
    p.add_argument("--modes", nargs="+", default=["colocate", "split"], choices=["colocate", "split"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    load_before = load_average()
    rows = []
    for nodes in args.nodes:
        for mode in args.modes:
            keys = overrides(nodes, mode)
            validate_times, config = timed(args.repeats, lambda: load_and_validate(REPO / "configs/base.yaml", keys))
            plan_times, plan = timed(args.repeats, lambda: plan_from_config(config))
            map_times, text = timed(args.repeats, lambda: format_gpu_map(plan))
            validate_s, plan_s, map_s = min(validate_times), min(plan_times), min(map_times)
            ranks = sum(r.world_size for r in plan.roles.values())
            rows.append({"nodes": nodes, "gpus": nodes * GPUS_PER_NODE, "mode": mode, "validate_s": validate_s,
                         "plan_s": plan_s, "gpu_map_s": map_s, "total_s": validate_s + plan_s + map_s,
                         "placed_ranks": ranks, "gpu_map_lines": text.count("\n") + 1,
                         "times_s": {"validate": validate_times, "plan": plan_times, "gpu_map": map_times}})
    print(f"validate + plan + GPU map, {GPUS_PER_NODE} GPUs/node, actor TP4xPP2 + ref TP4, rollout TP4; "
          f"best of {args.repeats}")
    print_table(rows, [("nodes", "nodes", "d"), ("gpus", "GPUs", "d"), ("mode", "mode", "s"),
                       ("validate_s", "validate s", ".4f"), ("plan_s", "plan s", ".4f"),
                       ("gpu_map_s", "GPU map s", ".4f"), ("total_s", "total s", ".4f")])
    write_result("planner", {"settings": vars(args), "load_before": load_before, "load_after": load_average(),
                             "rows": rows}, args.out)


if __name__ == "__main__":
    main()
