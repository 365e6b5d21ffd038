"""Benchmark: on-policy distillation (OPD) against GRPO and OPD + GRPO, greedy accuracy at equal steps.

The tiny model (megarl.data.tiny_model, 302k-parameter Qwen2, character tokenizer) on the 2-digit
addition task (megarl.data.synthetic), both made by megarl_run.warm_start, which also runs megarl's
SFT (configs/quickstart_sft.yaml) from the same random initialisation:
  teacher  SFT for --teacher-sft-steps (long: strong)
  student  SFT for --student-sft-steps (short: weaker; 0 is the untrained model)
Their greedy accuracy on the 512 validation prompts is measured with plain transformers `generate`
(hf_greedy.py). Then, from the same student checkpoint, for the same --steps and each seed:
  opd       configs/tiny/opd.yaml: pure OPD, advantage -kl_coef x (log p_student - log p_teacher)
  grpo      configs/tiny/grpo.yaml: group-normalised 0/1 exact-match reward
  opd_grpo  configs/tiny/opd.yaml with distillation.use_task_rewards=true: GRPO's advantage - kl_coef x d
every run with the same batch (--prompts x --n responses, also for pure OPD, whose config says
n=1; --prompts / --mini-batch optimizer steps of one micro-batch each), learning rate and warm-up,
on one logical GPU (the tiny configs' layout: a TP=1 actor, the Megatron teacher beside it, one
colocated CPU-engine server). Reported per run: megarl's
greedy validation accuracy before and after (`val/score`), the share of the teacher-student gap the
run closed, and for the OPD runs the reverse KL estimate (`opd/reverse_kl_mean`, nats per token, on
the training batch) over the first and the last steps. The student's accuracy before RL is measured
twice, by transformers and by megarl's validation (`val/score` at step 0): they should agree.
Learning figures: a benchmark, not a test.

    .venv/bin/python tools/bench/opd_vs_grpo.py --steps 60 --seeds 0 1 2   # the defaults; ~10 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench_common import DEFAULT_OUT, by_group, print_table, write_result
from hf_greedy import checkpoint_accuracy
from megarl_run import run_grpo, steady, warm_start

METHODS = {
    "opd": ("configs/tiny/opd.yaml", ["distillation.use_task_rewards=false"]),
    "grpo": ("configs/tiny/grpo.yaml", []),
    "opd_grpo": ("configs/tiny/opd.yaml", ["distillation.use_task_rewards=true"]),
}
MAX_RESPONSE_TOKENS = 8  # the tiny configs' data.max_response_length


def batch_overrides(prompts: int, n: int, mini_batch: int, lr: float, warmup: int) -> list[str]:
    """The step every method shares: prompts x n responses, prompts / mini_batch optimizer steps of one
    micro-batch (mini_batch x n responses) each, AdamW at lr after a linear warm-up over the first
    `warmup` RL steps (megarl's schedule counts updates)."""
    if prompts % mini_batch:
        raise SystemExit(f"--prompts {prompts} must be a multiple of --mini-batch {mini_batch}")
    return [f"data.train_batch_size={prompts}", f"actor_rollout_ref.rollout.n={n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mini_batch * n}",
            f"actor_rollout_ref.actor.optim.lr={lr}", f"actor_rollout_ref.actor.optim.lr_warmup_steps={warmup}",
            "trainer.logger=[console]"]


def opd_summary(metrics_jsonl: Path, last: int) -> dict:
    """The reverse KL estimate (nats per token) and the teacher's mean log-prob on the first step's
    batch and, averaged, on the last `last` steps' batches; None for a run without a teacher."""
    rows = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines()]
    train = [r for r in rows if "timing/step_s" in r and "opd/reverse_kl_mean" in r]
    if not train:
        return {"reverse_kl_first": None, "reverse_kl_last": None, "teacher_log_prob_last": None}

    def tail_mean(key):
        values = [r[key] for r in train[-last:]]
        return sum(values) / len(values)

    return {"reverse_kl_first": train[0]["opd/reverse_kl_mean"], "reverse_kl_last": tail_mean("opd/reverse_kl_mean"),
            "teacher_log_prob_last": tail_mean("opd/teacher_log_prob_mean")}


def gap_closed(before: float, after: float, teacher: float) -> float | None:
    """(after - before) / (teacher - before): the share of the student-teacher accuracy gap closed
    (1 = the teacher's accuracy; None when the teacher is no better than the student)."""
    return (after - before) / (teacher - before) if teacher > before else None


def by_method(runs: list[dict]) -> list[dict]:
    """Per method, over its seeds: mean, min and max of the final greedy accuracy, its gain, the gap
    closed and the reverse KL at the end; mean s/step after the first step."""
    return by_group(runs, "method",
                    ("val_score", "val_gain", "gap_closed", "reverse_kl_first", "reverse_kl_last", "s_per_step"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="RL steps of every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--teacher-sft-steps", type=int, default=800, help="SFT steps of the teacher")
    p.add_argument("--student-sft-steps", type=int, default=240, help="SFT steps of the student (fewer)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per RL step")
    p.add_argument("--n", type=int, default=4, help="responses per prompt, every method")
    p.add_argument("--mini-batch", type=int, default=16, help="prompts per optimizer step")
    p.add_argument("--lr", type=float, default=1e-4, help="actor learning rate (3e-4 lost accuracy in a calibration)")
    p.add_argument("--warmup", type=int, default=5, help="RL steps (updates) of linear learning-rate warm-up")
    p.add_argument("--kl-coef", type=float, default=1.0, help="distillation.kl_coef of the OPD runs")
    p.add_argument("--last", type=int, default=5, help="steps at the end the reverse KL is averaged over")
    p.add_argument("--override", action="append", default=[], help="extra key=value for every run")
    p.add_argument("--workdir", type=Path, default=DEFAULT_OUT / "opd_work")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    if args.student_sft_steps >= args.teacher_sft_steps:
        raise SystemExit("--student-sft-steps must be fewer than --teacher-sft-steps (the student is the weaker)")

    started = time.perf_counter()
    print(f"teacher: SFT {args.teacher_sft_steps} steps; student: SFT {args.student_sft_steps} steps ...", flush=True)
    teacher = warm_start(args.workdir / "teacher", args.teacher_sft_steps)
    student = warm_start(args.workdir / "student", args.student_sft_steps)  # the same model and data seeds
    teacher_acc = checkpoint_accuracy(teacher["model"], student["val"], MAX_RESPONSE_TOKENS)
    student_acc = checkpoint_accuracy(student["model"], student["val"], MAX_RESPONSE_TOKENS)
    print(f"greedy validation accuracy (transformers generate): teacher {teacher_acc:.3f}, student {student_acc:.3f}",
          flush=True)

    common = [*batch_overrides(args.prompts, args.n, args.mini_batch, args.lr, args.warmup),
              f"distillation.teacher.model_path={teacher['model']}", f"distillation.kl_coef={args.kl_coef}",
              *args.override]
    settings = vars(args) | {"workdir": str(args.workdir), "out": str(args.out)}
    result = {"settings": settings, "teacher": teacher, "student": student, "teacher_accuracy": teacher_acc,
              "student_accuracy": student_acc, "runs": []}
    for seed in args.seeds:
        for method in args.methods:
            print(f"{method} seed {seed} ...", flush=True)
            config, own = METHODS[method]
            overrides = [o for o in common if method != "grpo" or not o.startswith("distillation.")] + own
            name = f"opd-bench-{method}-seed{seed}"
            try:
                run = run_grpo(student, args.workdir, name, args.steps, seed, overrides, config=config)
            except RuntimeError as failed:  # e.g. Ray's start-up timing out on a loaded machine: once more
                print(f"  failed, running it again: {str(failed).splitlines()[-1]}", flush=True)
                run = run_grpo(student, args.workdir, name, args.steps, seed, overrides, config=config)
            step = steady(run["step_s"])
            run = {"method": method, "seed": seed, **run, **opd_summary(Path(run["metrics"]), args.last),
                   "val_gain": run["val_score"] - run["val_score_before"], "s_per_step": sum(step) / len(step),
                   "gap_closed": gap_closed(run["val_score_before"], run["val_score"], teacher_acc)}
            result["runs"].append(run)
            write_result("opd_vs_grpo", result, args.out)  # so far
            kl = "" if run["reverse_kl_first"] is None else \
                f", reverse KL {run['reverse_kl_first']:.3f} -> {run['reverse_kl_last']:.3f}"
            print(f"  greedy val {run['val_score_before']:.3f} -> {run['val_score']:.3f}{kl}, "
                  f"{run['s_per_step']:.2f} s/step, load (1 min) {run['load_before']['1m']:.1f} before, "
                  f"{run['load_after']['1m']:.1f} after", flush=True)
    result["by_method"] = by_method(result["runs"])
    result["wall_s"] = time.perf_counter() - started  # the whole bench, SFTs included
    print(f"\nteacher {teacher_acc:.3f}, student {student_acc:.3f} greedy; {args.steps} steps of {args.prompts} x "
          f"{args.n} per run, seeds {args.seeds} (mean over seeds, then min and max; reverse KL: first step -> mean "
          f"of the last {args.last})")
    print_table(result["by_method"], [
        ("method", "method", "s"), ("runs", "runs", "d"), ("val_score", "greedy", ".3f"),
        ("val_score_min", "min", ".3f"), ("val_score_max", "max", ".3f"), ("val_gain", "gain", "+.3f"),
        ("gap_closed", "gap closed", ".0%"), ("reverse_kl_first", "rKL first", ".3f"),
        ("reverse_kl_last", "rKL last", ".3f"), ("s_per_step", "s/step", ".2f")])
    write_result("opd_vs_grpo", result, args.out)


if __name__ == "__main__":
    main()
