"""Benchmark: the compute floor of megarl's two training phases on the quickstart, in plain PyTorch.

On the quickstart's SFT-warmed tiny Qwen2 (megarl_run.warm_start, as grpo_vs_trl.py and overhead.py)
and its shapes (32 prompts x 8 samples = 256 rows of at most 16 + 8 tokens), plain transformers
times what megarl's phases compute, at 1 and 2 torch threads:
  old_log_prob: one forward without gradients over the 256 rows, log-softmax of the logits;
  update_actor: for each of the 2 mini-batches of 128 rows, forward, backward of the mean token
                log-prob, one AdamW step.
Compare with the `timing/old_log_prob` and `timing/update_actor` of a grpo_vs_trl.py run: what
is above this floor is the framework's. Best and median of `--repeats` calls, after one warm-up.

    .venv/bin/python tools/bench/training_floor.py
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench_common import DEFAULT_OUT, load_average, print_table, write_result
from megarl_run import warm_start

ROWS, MINI_BATCHES, TOKENS = 256, 2, 16 + 8


def old_log_prob_like(model, ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(input_ids=ids).logits.log_softmax(-1)


def update_actor_like(model, optimizer, ids: torch.Tensor) -> None:
    for rows in ids.chunk(MINI_BATCHES):
        log_probs = model(input_ids=rows).logits.log_softmax(-1)
        log_probs[:, :-1].gather(-1, rows[:, 1:, None]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def main() -> None:
    p = argparse.ArgumentParser(description="plain-PyTorch floor of the quickstart's training phases")
    p.add_argument("--sft-steps", type=int, default=240, help="megarl SFT warm-up steps (made once per --workdir)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_OUT / "work")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    warm = warm_start(args.workdir, args.sft_steps)
    model = AutoModelForCausalLM.from_pretrained(warm["model"], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)  # small: the weights barely move between calls
    ids = torch.randint(3, model.config.vocab_size, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))
    phases = {"old_log_prob": lambda: old_log_prob_like(model, ids),
              "update_actor": lambda: update_actor_like(model, optimizer, ids)}
    load_before, rows = load_average(), []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for phase, fn in phases.items():
            fn()  # warm-up
            seconds = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - start)
            rows.append({"threads": threads, "phase": phase, "best_s": min(seconds),
                         "median_s": statistics.median(seconds), "seconds": seconds})
    print(f"quickstart shapes: {ROWS} rows x {TOKENS} tokens, {MINI_BATCHES} mini-batches; model {warm['model']}")
    print_table(rows, [("threads", "threads", "d"), ("phase", "phase", "s"), ("best_s", "best s", ".4f"),
                       ("median_s", "median s", ".4f")])
    write_result("training_floor", {"settings": {k: str(v) for k, v in vars(args).items() if k != "out"},
                                    "load_before": load_before, "load_after": load_average(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
