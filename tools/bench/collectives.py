"""Count: the torch.distributed collectives one quickstart training step makes on each actor rank, by caller.

Runs the actor of `configs/quickstart.yaml` (TP=1, DP=2 on gloo: two spawned ranks, a random tiny
Qwen2 of the quickstart's shape) through `update_policy_with_old_log_probs`, the call a quickstart step
makes, on a batch of the quickstart's size (32 prompts x 8 responses of at most 4 tokens, random
tokens and advantages), `--steps` times. Every collective is recorded with its caller
(`megarl.testing.CollectiveCounter`), so the figures are counts, the same on a busy machine and a
quiet one. Prints each step's count per rank and, for the last step, each collective with its caller.

    .venv/bin/python tools/bench/collectives.py [--steps 3] [KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

from bench_common import DEFAULT_OUT, REPO, load_average, write_result

PROMPTS, N, MAX_RESPONSE = 32, 8, 4  # the quickstart's batch (overhead.py's response length)


def quickstart_batch(seed: int = 0):
    """32 x 8 rows: prompts of 5-7 tokens ("12+34=" and the like), responses of 1-4, advantages in [-1, 1]."""
    import torch

    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(seed)

    def tokens(low, high):
        return torch.randint(4, 47, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g).tolist()

    batch = Batch.from_token_lists([tokens(5, 7) for _ in range(PROMPTS * N)],
                                   [tokens(1, MAX_RESPONSE) for _ in range(PROMPTS * N)])
    batch["advantages"] = (torch.rand(PROMPTS * N, 1, generator=g) * 2 - 1) * batch["response_mask"]
    return batch


def count_world(rank: int, world_size: int, port: int, model_dir: str, steps: int, overrides: list[str]) -> dict:
    """One actor rank: {"per_step": [collectives of each step], "last": [(name, caller) of the last step]}."""
    import datetime

    import torch.distributed as dist

    from megarl.config import load_config
    from megarl.engines.megatron.roles import ActorEngine
    from megarl.testing import CollectiveCounter

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        f"actor_rollout_ref.model.path={model_dir}", f"data.max_response_length={MAX_RESPONSE}",
        f"trainer.n_gpus_per_node={world_size}", *overrides])
    actor = ActorEngine(cfg)
    mine = quickstart_batch().chunk(actor.dp_size)[actor.dp_rank]
    per_step, last = [], []
    for _ in range(steps):
        with CollectiveCounter() as counter:
            actor.update_policy_with_old_log_probs(mine)
        per_step.append(len(counter.calls))
        last = counter.calls
    return {"per_step": per_step, "last": last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("overrides", nargs="*", help="config overrides (KEY=VALUE)")
    args = parser.parse_args()

    from megarl.data.tiny_model import make_tiny_model
    from megarl.testing import run_gloo_workers

    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="megarl-collectives-") as tmp:
        model = make_tiny_model("qwen2", Path(tmp) / "model", seed=0)
        ranks = run_gloo_workers(count_world, 2, args=(str(model), args.steps, args.overrides), timeout_s=600)
    for rank, result in enumerate(ranks):
        print(f"rank {rank}: collectives per step {result['per_step']}")
        for (name, caller), count in collections.Counter(result["last"]).items():
            print(f"  {count} x {name:22s} {caller}")
    write_result("collectives", {
        "overrides": args.overrides, "steps": args.steps, "load_before": load_before, "load_after": load_average(),
        "ranks": [{"per_step": r["per_step"], "last": [list(c) for c in r["last"]]} for r in ranks]}, args.out)


if __name__ == "__main__":
    main()
