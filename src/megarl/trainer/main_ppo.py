"""`python -m megarl.trainer.main_ppo [--config X.yaml] [--dry-run] key.path=value ...`

The PPO / GRPO-family entry point, with verl's command line (only the module name differs).
"""
from __future__ import annotations

import argparse
import gc
import sys

from megarl.config import batch_plan, load_and_validate
from megarl.config.args import add_experiment_args, entry_point, experiment_file
from megarl.trainer.failures import run_and_report
from megarl.trainer.preemption import signals_held
from megarl.trainer.preflight import DRY_RUN_HELP, DRY_RUN_OK, check_environment


def build_parser(prog: str = "python -m megarl.trainer.main_ppo", description: str = __doc__) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_experiment_args(parser)
    parser.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    return parser


def _ep(size: int) -> str:
    """', EP 8' where the experts are split (expert parallel size > 1), else ''."""
    return f", EP {size}" if size > 1 else ""


def _mode(async_training) -> str:
    """How generation and training take turns (async_training.*), in words."""
    a = async_training
    if a.mode == "fully_async":
        return f"fully_async, samples at most {a.max_staleness} weight version(s) old" + (
            ", partial rollouts" if a.partial_rollout else "")
    if a.mode == "one_step_off":
        return "one_step_off, step k+1's batch generated while step k trains"
    return "sync, generate -> train -> push in turn"


def describe(config) -> str:
    """One paragraph a user can check before a job waits in a queue."""
    plan = batch_plan(config)
    a, arr = config.algorithm, config.actor_rollout_ref
    rollout, m = arr.rollout, arr.actor.megatron
    return (
        f"experiment {config.trainer.project_name}/{config.trainer.experiment_name}: "
        f"{a.adv_estimator} on {arr.model.path}\n"
        f"  GPUs: {config.trainer.nnodes} node(s) x {config.trainer.n_gpus_per_node} = {plan.total_gpus} "
        f"({config.placement.mode}: {plan.train_gpus} training, {plan.rollout_gpus} rollout in "
        f"{plan.rollout_servers} server(s) of TP {rollout.tensor_model_parallel_size}{_ep(rollout.expert_parallel_size)})\n"
        f"  actor: TP {m.tensor_model_parallel_size} x PP {m.pipeline_model_parallel_size}"
        f" x DP {plan.actor_dp}{_ep(m.expert_model_parallel_size)}\n"
        f"  step: {config.data.train_batch_size} prompts x n={arr.rollout.n} = {plan.responses_per_step} responses; "
        f"{plan.actor_mini_batches_per_epoch} mini-batch(es) per epoch, "
        f"{plan.actor_responses_per_mini_batch_per_rank} responses per DP rank per mini-batch\n"
        f"  mode: {_mode(config.async_training)}"
    )


@entry_point
def main(argv: list[str] | None = None) -> int:
    return main_with_defaults(argv)


def main_with_defaults(argv: list[str] | None, defaults: tuple[str, ...] = (), prog: str = "python -m megarl.trainer.main_ppo",
                       description: str = __doc__) -> int:
    """main(), with `defaults` (overrides) before the command line's: the entry points of verl's other
    trainers (megarl.config.verl_compat.VERL_MODULES) run this loop in their mode."""
    args = build_parser(prog, description).parse_intermixed_args(argv)
    config = load_and_validate(experiment_file(args), [*defaults, *args.overrides])
    print(describe(config))
    print("config OK; checking data, model and this machine")
    config = check_environment(config, "rl")  # seconds, before Ray or any server starts
    if args.dry_run:
        print(DRY_RUN_OK)
        return 0
    return run_and_report(run, config)


def run(config) -> dict:
    """Train per `config` on the Ray cluster (joined or started here); returns the last metrics."""
    from transformers import AutoTokenizer

    from megarl.checkpoint import find_resume_dir
    from megarl.rewards.custom import select_score_fn
    from megarl.tracking import Tracker
    from megarl.runtime.cluster import Cluster, connect_ray
    from megarl.trainer.rl import RLTrainer

    c, t = config, config.trainer
    score_fn = select_score_fn(c.custom_reward_function.path, c.custom_reward_function.name,
                               c.custom_reward_function.reward_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(c.data.tokenizer or c.actor_rollout_ref.model.path)
    resume_dir = find_resume_dir(c)
    connect_ray(c)
    cluster = Cluster(c)
    tracker = trainer = None
    try:
        trainer = RLTrainer(c, cluster, tokenizer, score_fn)
        if resume_dir is not None:
            trainer.load_state_dict(cluster.load_checkpoint(resume_dir))
            print(f"resumed from {resume_dir} at step {trainer.step}")
        tracker = Tracker(t.logger, t.project_name, t.experiment_name, trainer.checkpoint_dir() / "logs",
                          total_steps=trainer.total_steps)
        # What exists now (libraries, the tokenised datasets, the cluster's handles) lives for the
        # whole run: frozen, the collector's full passes no longer walk it (in the CPU quickstart each
        # took 0.1-0.2 s of one step, about every 60 steps; docs/benchmarks.md, issue 28)
        gc.freeze()
        return trainer.fit(tracker)
    finally:
        with signals_held("the run stops its workers, servers and router"):
            if trainer is not None and trainer.agent is not None:
                trainer.agent.close()
            if trainer is not None and trainer.teacher is not None:
                trainer.teacher.close()
            cluster.shutdown()
        if tracker is not None:
            plot = tracker.finish()
            print(tracker.summary())
            if plot:
                print(f"plot: {plot}")


if __name__ == "__main__":
    sys.exit(main())
