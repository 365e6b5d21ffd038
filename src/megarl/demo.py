"""`make demo`: the CPU quickstart, end to end, with nothing downloaded.

1. a tiny Qwen2-architecture model (302k parameters, character tokenizer) and the synthetic
   2-digit addition task in verl's parquet format;
2. SFT warm-up on the Megatron engine (configs/quickstart_sft.yaml), exported as an HF checkpoint;
3. GRPO from that checkpoint (configs/quickstart.yaml): megatron-core on gloo (TP=1, DP=2 on two
   logical GPUs, one rank per core of a 2-core machine), two colocated CPU-engine rollout servers
   behind the real sglang-router, placed by Ray, weights pushed to the servers after every update;
4. greedy and sampled accuracy on 512 held-out prompts after SFT and after GRPO, TensorBoard logs
   and a plot.

`python -m megarl.demo [--seed N] [--grpo-steps N] [--placement colocate|split]`; outputs under
outputs/quickstart/.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megarl.config import load_and_validate
from megarl.config.args import entry_point

REPO = Path(__file__).resolve().parents[2]
OUT = Path("outputs/quickstart")


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="model, data and training seed")
    parser.add_argument("--grpo-steps", type=int, default=None, help="default: configs/quickstart.yaml's")
    parser.add_argument("--placement", choices=("colocate", "split"), default="colocate",
                        help="colocate (default): training and rollout time-share the config's logical GPUs; split: "
                        "1 logical GPU for training (TP=1) and 1 for one rollout server")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    from megarl.data.synthetic import write_task_dataset
    from megarl.data.tiny_model import make_tiny_model
    from megarl.trainer.main_ppo import run as run_grpo
    from megarl.trainer.sft import run_sft

    out = OUT / f"seed{args.seed}"
    print(f"== 1/3 tiny model and data under {out}", flush=True)
    make_tiny_model("qwen2", out / "model", seed=args.seed)
    write_task_dataset("add", out / "data", seed=args.seed)
    common = [f"trainer.default_local_dir={out / 'runs'}", f"trainer.seed={args.seed}", f"data.seed={args.seed}"]

    sft = load_and_validate(REPO / "configs/quickstart_sft.yaml", common + [
        f"actor_rollout_ref.model.path={out / 'model'}", f"data.train_files={out / 'data/sft_train.parquet'}",
        f"data.val_files={out / 'data/sft_val.parquet'}"])
    print(f"== 2/3 SFT warm-up (Megatron engine, TP={sft.actor_rollout_ref.actor.megatron.tensor_model_parallel_size} "
          "on gloo)", flush=True)
    warm = run_sft(sft)
    import ray

    ray.shutdown()  # the GRPO stage starts Ray again with its own number of logical GPUs

    print("== 3/3 GRPO from the SFT checkpoint", flush=True)
    steps = [f"trainer.total_training_steps={args.grpo_steps}"] if args.grpo_steps else []
    if args.placement == "split":
        steps += ["placement.mode=split", "placement.rollout_gpus=1", "trainer.n_gpus_per_node=2",
                  "trainer.experiment_name=grpo-add-split"]
    grpo = load_and_validate(REPO / "configs/quickstart.yaml", common + steps + [
        f"actor_rollout_ref.model.path={warm}", f"data.train_files={out / 'data/train.parquet'}",
        f"data.val_files={out / 'data/val.parquet'}"])
    run_grpo(grpo)

    log_dir = Path(grpo.trainer.default_local_dir) / grpo.trainer.project_name / grpo.trainer.experiment_name / "logs"
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "val/score" in r]
    before, after = scored[0], scored[-1]
    print(f"\n== results (seed {args.seed}, {time.perf_counter() - started:.0f} s)")
    print(f"  greedy accuracy : after SFT {before['val/score']:.3f} -> after GRPO {after['val/score']:.3f} "
          f"({(after['val/score'] - before['val/score']) * 100:+.1f} points)")
    print(f"  sampled accuracy: after SFT {before['val/sampled_score']:.3f} -> after GRPO "
          f"{after['val/sampled_score']:.3f}")
    print(f"  TensorBoard: tensorboard --logdir {log_dir / 'tensorboard'}   plot: {log_dir / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
