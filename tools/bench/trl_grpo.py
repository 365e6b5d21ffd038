"""One GRPO run with TRL's `GRPOTrainer`, the TRL side of grpo_vs_trl.py (run in .venv-bench).

Same model directory, parquet files and reward (megarl's exact match of the synthetic task) as the
megarl side, and the same step: `--batch` prompts x `--n` completions of at most
`--response-length` tokens, split into `--batch / --mini-batch` optimizer steps of
`--mini-batch x --n` completions (TRL: per_device_train_batch_size = mini-batch x n,
steps_per_generation = batch / mini-batch), one epoch, clip 0.2, no KL, token-mean loss
(TRL's "dapo" on one process), group-std-normalised advantages, AdamW lr with linear warm-up.
After training, greedy accuracy on the validation parquet, scored like megarl's `val/score`.

    .venv-bench/bin/python tools/bench/trl_grpo.py --model M --train T.parquet --val V.parquet --json out.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from datasets import Dataset
from hf_greedy import greedy_accuracy, load_rows
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from megarl.rewards.synthetic import exact_match


class StepClock(TrainerCallback):
    """perf_counter() at the end of every optimizer step."""

    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


class ExactMatchReward:
    """TRL reward function: megarl's exact match; also counts the generated tokens of each call
    (one call per generation batch = one RL step)."""

    __name__ = "exact_match"

    def __init__(self):
        self.tokens_per_call: list[int] = []

    def __call__(self, completions, ground_truth, completion_ids, **kwargs) -> list[float]:
        self.tokens_per_call.append(sum(len(ids) for ids in completion_ids))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [exact_match(text, answer) for text, answer in zip(texts, ground_truth)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--out-dir", required=True, help="TRL's output_dir (nothing is saved there)")
    p.add_argument("--json", required=True)
    p.add_argument("--steps", type=int, default=20, help="RL steps (generation batches)")
    p.add_argument("--batch", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--mini-batch", type=int, default=16, help="prompts per optimizer step")
    p.add_argument("--response-length", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=10, help="optimizer steps of linear warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.batch % args.mini_batch:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --mini-batch {args.mini_batch}")
    torch.set_num_threads(args.threads)
    opt_steps_per_rl_step = args.batch // args.mini_batch

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    train = Dataset.from_list(load_rows(args.train, limit=args.steps * args.batch * 2))
    val_rows = load_rows(args.val)
    config = GRPOConfig(
        output_dir=args.out_dir, use_cpu=True, seed=args.seed, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True,
        max_steps=args.steps * opt_steps_per_rl_step,
        per_device_train_batch_size=args.mini_batch * args.n, steps_per_generation=opt_steps_per_rl_step,
        gradient_accumulation_steps=1, num_generations=args.n, num_iterations=1,
        max_completion_length=args.response_length, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=args.warmup,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        epsilon=0.2, beta=0.0, loss_type="dapo", scale_rewards="group",
    )
    reward = ExactMatchReward()
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=train,
                          processing_class=tokenizer, callbacks=[clock])
    val_before = greedy_accuracy(model, tokenizer, val_rows, args.response_length)
    model.train()
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    val_after = greedy_accuracy(trainer.model, tokenizer, val_rows, args.response_length)

    # RL step k ends with optimizer step k x opt_steps_per_rl_step
    rl_ends = [start] + clock.ends[opt_steps_per_rl_step - 1::opt_steps_per_rl_step]
    step_s = [b - a for a, b in zip(rl_ends, rl_ends[1:])]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]  # one per generation batch
    result = {
        "framework": "trl", "steps": len(step_s), "step_s": step_s, "train_s": train_s,
        "response_tokens": reward.tokens_per_call, "val_score_before": val_before, "val_score": val_after,
        "train_reward": rewards, "trl_version": __import__("trl").__version__,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
