"""The `megarl` command. Each subcommand hands off to the package that owns the work."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.config import load_and_validate, load_config, to_yaml, validate
from megarl.config.args import add_experiment_args, entry_point, experiment_file


def _config_show(args) -> int:
    config = load_config(args.config, args.overrides)
    if not args.no_validate:
        config = validate(config)
    sys.stdout.write(to_yaml(config))
    return 0


def _plan(args) -> int:
    from megarl.bridge import ConversionError, arch_from_hf_config, load_hf_config
    from megarl.bridge.fused_experts import fuses_experts
    from megarl.bridge.hub import local_model_dir, shipped_architecture
    from megarl.config.devices import devices_from_config
    from megarl.placement import format_gpu_map, plan_from_config
    from megarl.placement.from_config import offline_plan
    from megarl.placement.memory import estimate, format_estimate
    from megarl.rollout.launch import expert_split_problem
    from megarl.sync.groups import format_update_groups

    from megarl.trainer.inputs import trainer_of_data

    config = load_and_validate(args.config, args.overrides)
    trainer = args.trainer
    if trainer is None:
        trainer, why = trainer_of_data(config)
        print(f"planning for the {trainer} trainer ({why}; --trainer rl|sft|dpo chooses)")
    plan = plan_from_config(config) if trainer == "rl" else offline_plan(config, with_ref=trainer == "dpo")
    print(format_gpu_map(plan))
    for role in plan.roles.values():
        print(f"{role.name}: {role.layout()}, {gpu_share(role.gpu_fraction)}")

    def read_arch(model: str, key: str):
        try:  # a hub id: its config.json alone, into the HF cache
            model_dir = local_model_dir(model, key, allow_patterns=["config.json"])
        except (ConversionError, OSError) as error:
            model_dir = shipped_architecture(model, args.config)
            if model_dir is None:
                raise error
            print(f"model architecture: {model_dir / 'config.json'} (shipped beside {args.config}; {model} is not "
                  "at hand)")
        return arch_from_hf_config(load_hf_config(model_dir), f"{model}: config.json")

    try:
        arch, arch_error = read_arch(config.actor_rollout_ref.model.path, "actor_rollout_ref.model.path"), None
    except (ConversionError, OSError) as error:
        arch, arch_error = None, error
    if trainer == "rl":  # the plan is for GPUs unless trainer.device=cpu
        devices = devices_from_config(config, cuda_available=config.trainer.device != "cpu")
        print(devices.summary())
        actor, m = plan.roles["actor"], config.actor_rollout_ref.actor.megatron
        print(format_update_groups(devices.weight_sync_transport, config.actor_rollout_ref.rollout.weight_update_groups,
                                   actor.pp, actor.dp * actor.cp, actor.tp, m.expert_model_parallel_size,
                                   m.expert_tensor_parallel_size, fuses_experts(arch) if arch else None))
    teacher_arch = None
    if arch_error is None and "teacher" in plan.roles:
        try:
            teacher_arch = read_arch(config.distillation.teacher.model_path, "distillation.teacher.model_path")
        except (ConversionError, OSError) as error:
            arch_error = error
    if arch_error is not None:
        print(f"memory estimate skipped: {arch_error}")
        return 0
    if "rollout" in plan.roles:
        problem = expert_split_problem(arch.moe.num_experts if arch.moe else None, plan.roles["rollout"].ep)
        if problem:
            print(f"memory estimate impossible: {problem}")
            return 1
    est = estimate(plan, config, arch, teacher_arch)
    print(format_estimate(est, plan, arch))
    return 0 if est.fits else 1


def gpu_share(fraction: float) -> str:
    """'1 GPU per rank', or '1/3 of a GPU per rank (3 ranks share each GPU)'."""
    from fractions import Fraction

    share = Fraction(fraction).limit_denominator(64)
    if share >= 1:
        return f"{share} GPU per rank"
    return f"{share} of a GPU per rank ({share.denominator} ranks share each GPU)"


def _trainer(module: str):
    """The subcommand that runs `python -m megarl.trainer.<module>` with the same arguments."""

    def run(args) -> int:
        import importlib

        argv = (["--config", args.config] if args.config else []) + (["--dry-run"] if args.dry_run else [])
        return importlib.import_module(f"megarl.trainer.{module}").main(argv + args.overrides)

    return run


def _check_cluster(args) -> int:
    config = load_and_validate(args.config, args.overrides)
    from megarl.launch.check import check_running_cluster

    names = tuple(n for n in args.node_names.split(",") if n) if args.node_names else ()
    return check_running_cluster(config, node_names=names, timeout_s=args.timeout)


def _submit(args) -> int:
    from megarl.launch.sbatch import submit, write_script

    config = load_and_validate(args.config, args.overrides)
    script, output = write_script(config, args.config, args.overrides, log_dir=args.log_dir, template=args.script,
                                  time=args.time, partition=args.partition, account=args.account,
                                  job_name=args.job_name, requeue=args.requeue, nodes=args.nodes,
                                  gpus_per_node=args.gpus_per_node, extra=tuple(args.sbatch_arg))
    if args.no_submit:
        print(f"wrote {script}; submit it with: sbatch {script}")
        return 0
    job_id = submit(script)
    print(f"submitted job {job_id} ({config.trainer.nnodes} node(s) x {config.trainer.n_gpus_per_node} GPU(s)); "
          f"output: {output.replace('%j', job_id)}")
    return 0


def _export(args) -> int:
    from megarl.bridge import ConversionError
    from megarl.bridge.convert import progress_bar
    from megarl.checkpoint import export_hf, export_lora
    from megarl.config import ConfigError

    if args.lora and args.fp8:
        print("megarl export: --fp8 quantizes full weights; --lora writes an adapter", file=sys.stderr)
        return 2
    try:
        if args.lora:
            out = export_lora(args.checkpoint, args.out)
            print(f"wrote the actor's LoRA adapter (PEFT format) to {out}")
            return 0
        with progress_bar("export actor -> hf") as show:
            out = export_hf(args.checkpoint, args.out, on_progress=show)
        print(f"wrote the actor as an HF checkpoint to {out}")
        if args.fp8:
            print(f"wrote it in block FP8 to {export_fp8(args.checkpoint, out)}")
    except (ConversionError, ConfigError, ValueError) as error:
        print(f"megarl export: {error}", file=sys.stderr)
        return 2
    return 0


def export_fp8(checkpoint: str, hf_dir: Path) -> Path:
    """`<hf_dir>_fp8`: the export `hf_dir` in block FP8 (megarl.sync.fp8_checkpoint), planned for the
    checkpoint's run's rollout servers (their TP and EP sizes), as its rollout.quantization=fp8 serves it."""
    from megarl.checkpoint import resolve_checkpoint
    from megarl.sync.fp8_checkpoint import fp8_plan_of, write_fp8_checkpoint

    rollout = load_config(resolve_checkpoint(checkpoint) / "config.yaml").actor_rollout_ref.rollout
    plan = fp8_plan_of(hf_dir, rollout.tensor_model_parallel_size, rollout.expert_parallel_size)
    return write_fp8_checkpoint(hf_dir, Path(f"{hf_dir}_fp8"), plan)


def _doctor(args) -> int:
    from megarl.launch.doctor import run_doctor

    config = load_and_validate(args.config, args.overrides) if args.config or args.overrides else None
    return run_doctor(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="Megatron-native RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    config = sub.add_parser("config", help="inspect experiment configs")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config as YAML (after validation)")
    add_experiment_args(show)
    show.add_argument("--no-validate", action="store_true", help="print even if the config does not validate")
    show.set_defaults(func=_config_show)

    plan = sub.add_parser("plan", help="print the GPU map and a per-GPU memory estimate; non-zero if impossible")
    add_experiment_args(plan)
    plan.add_argument("--trainer", choices=["rl", "sft", "dpo"], default=None,
                      help="which trainer's roles to plan: rl (actor, rollout servers, and ref/critic/reward model "
                           "as the config needs them), sft (the actor alone) or dpo (actor and frozen reference); "
                           "default: read from the columns of data.train_files, else rl")
    plan.set_defaults(func=_plan)

    train = sub.add_parser("train", help="run an RL experiment (same as python -m megarl.trainer.main_ppo)")
    add_experiment_args(train)
    train.add_argument("--dry-run", action="store_true", help="validate and check data, model and GPUs, then stop "
                       "before Ray starts")
    train.set_defaults(func=_trainer("main_ppo"))

    sft = sub.add_parser("sft", help="run supervised fine-tuning (same as python -m megarl.trainer.main_sft)")
    add_experiment_args(sft)
    sft.add_argument("--dry-run", action="store_true", help="validate and check data, model and GPUs, then stop "
                       "before Ray starts")
    sft.set_defaults(func=_trainer("main_sft"))

    dpo = sub.add_parser("dpo", help="run offline DPO (same as python -m megarl.trainer.main_dpo)")
    add_experiment_args(dpo)
    dpo.add_argument("--dry-run", action="store_true", help="validate and check data, model and GPUs, then stop "
                       "before Ray starts")
    dpo.set_defaults(func=_trainer("main_dpo"))

    check = sub.add_parser("check-cluster", help="check the running Ray cluster against the config's placement plan "
                           "(every node, GPU ids, gloo across all ranks); non-zero naming the bad node")
    add_experiment_args(check)
    check.add_argument("--node-names", metavar="N0,N1,...", help="expected node names in plan order "
                       "(default: the Slurm node names the launchers put on the Ray nodes)")
    check.add_argument("--timeout", type=float, default=180.0, help="seconds for each step (default 180)")
    check.set_defaults(func=_check_cluster)

    submit = sub.add_parser("submit", help="render slurm/megarl.sbatch sized from the config "
                            "(trainer.nnodes x trainer.n_gpus_per_node) and sbatch it")
    add_experiment_args(submit)
    submit.add_argument("--time", help="time limit, e.g. 04:00:00 (default: the script's)")
    submit.add_argument("--partition", "-p")
    submit.add_argument("--account", "-A")
    submit.add_argument("--job-name", help="default: trainer.experiment_name")
    submit.add_argument("--nodes", type=int, help="optional; must equal trainer.nnodes")
    submit.add_argument("--gpus-per-node", type=int, help="optional; must equal trainer.n_gpus_per_node")
    submit.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=None,
                        help="requeue the job after its time-limit warning (default: the cluster's)")
    submit.add_argument("--sbatch-arg", action="append", default=[], metavar="--OPTION=VALUE",
                        help="another #SBATCH option, e.g. --sbatch-arg=--qos=high (repeatable)")
    submit.add_argument("--log-dir", default="outputs/slurm", help="job output and the rendered script "
                        "(default outputs/slurm)")
    submit.add_argument("--script", help="the sbatch template (default: the one megarl ships, "
                        "slurm/megarl.sbatch in a checkout)")
    submit.add_argument("--no-submit", action="store_true", help="write the script, do not submit it")
    submit.set_defaults(func=_submit)

    doctor = sub.add_parser("doctor", help="print the installed versions (Python, torch + CUDA/NCCL, megatron-core, "
                            "TE, SGLang, Ray, ...) and GPUs; non-zero on a known-bad combination")
    add_experiment_args(doctor)  # optional: also check that this machine can run that experiment
    doctor.set_defaults(func=_doctor)

    export = sub.add_parser("export", help="write a checkpoint's actor as an HF checkpoint (transformers, SGLang)")
    export.add_argument("checkpoint", help="a global_step_N directory, an experiment directory (its newest "
                        "complete checkpoint), or the trainer.default_local_dir of a single experiment")
    export.add_argument("--out", help="output directory (default: <checkpoint>/actor_hf); must not exist or be empty")
    kind = export.add_mutually_exclusive_group()
    kind.add_argument("--lora", action="store_true", help="a LoRA run: write its adapter in PEFT format "
                      "(adapter_config.json + adapter_model.safetensors; default --out <checkpoint>/actor_lora)")
    kind.add_argument("--merged", action="store_true", help="a LoRA run: write base + adapters merged as a full HF "
                      "checkpoint (what export does for a LoRA run without --lora)")
    export.add_argument("--fp8", action="store_true", help="also write the export in block FP8 to <out>_fp8 (e4m3, "
                        "128 x 128 blocks: what rollout.quantization=fp8 serves; transformers and SGLang load it)")
    export.set_defaults(func=_export, overrides=[])
    return parser


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = list(args.overrides) + extra  # overrides given after an option
    if hasattr(args, "config"):
        args.config = experiment_file(args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
