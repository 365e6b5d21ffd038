"""Quick checks of a run's inputs, before any process starts: data files (parquet footers and the
first rows of each file), the model's config.json and tokenizer files, the step schedule the data
allows, and the GPUs this machine shows. Each problem is one line naming the key to fix.

Each check reads kilobytes, not the data set: a 100 GB parquet file costs its footer and one batch.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Literal, Optional

from megarl.config import ExperimentConfig

Kind = Literal["rl", "sft", "dpo"]
FIRST_ROWS = 64  # rows read from the head of each data file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _file_problem(key: str, name: str) -> Optional[str]:
    path = Path(name)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.parquet"))[:3]
        example = f" (it holds {', '.join(inside)}{', ...' if len(inside) == 3 else ''})" if inside else ""
        return f"{key}: {name} is a directory{example}; list the parquet files, e.g. {key}=\"[{name}/a.parquet]\""
    if not path.is_file():
        return f"{key}: file not found: {name}"
    return None


def data_problems(config: ExperimentConfig, kind: Kind) -> tuple[list[str], int]:
    """(problems, rows in data.train_files by their footers) for the columns trainer `kind` reads."""
    import pyarrow.parquet as pq

    from megarl.data.errors import DataError
    from megarl.data.parquet import read_rows

    d = config.data
    response_key = {"rl": None, "sft": d.response_key, "dpo": d.chosen_key}[kind]
    chats = kind == "sft" and d.messages_key is not None  # SFT chats: the messages column alone
    prompt_key, response_key = (d.messages_key, None) if chats else (d.prompt_key, response_key)
    problems, train_rows = [], 0
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        present = []
        for name in files:
            problem = _file_problem(key, name)
            problems.extend([problem] if problem else [])
            present += [] if problem else [name]
        if not present:
            continue
        try:
            read_rows(present, prompt_key=prompt_key, reward_fn_key=d.reward_fn_key, response_key=response_key,
                      limit=FIRST_ROWS, chats=chats)
        except DataError as error:
            problems += [f"{key}: {line.strip()[2:]}" for line in str(error).splitlines()[1:]]
            continue
        for name in present:
            footer = pq.ParquetFile(name)
            problems += [f"{key}: {name}: {problem}" for problem in multimodal_problems(footer, d.image_key,
                                                                                         d.video_key)]
            if kind == "dpo" and d.rejected_key not in footer.schema_arrow.names:
                problems.append(f"{key}: {name}: missing column '{d.rejected_key}' (data.rejected_key)")
            if key == "data.train_files":
                train_rows += footer.metadata.num_rows
    return problems, train_rows


def multimodal_problems(footer, image_key: str, video_key: str) -> list[str]:
    """Why a parquet file (`footer`: its pyarrow ParquetFile) cannot be trained here: its
    `data.image_key` / `data.video_key` column (verl's multimodal inputs, RLHFDataset) holds a value
    in some row, which megarl's text-only models would drop; the first such row of each column.
    Read a row group at a time, that column alone."""
    problems = []
    for key, column in (("data.image_key", image_key), ("data.video_key", video_key)):
        if column not in footer.schema_arrow.names:
            continue
        first = 0
        for group in range(footer.num_row_groups):
            values = footer.read_row_group(group, columns=[column]).column(0).to_pylist()
            row = next((i for i, v in enumerate(values) if v not in (None, [], "", b"")), None)
            if row is not None:
                problems.append(f"row {first + row}: column '{column}' ({key}) holds images or videos; megarl trains "
                                "text-only models (vision-language models are not built)")
                break
            first += len(values)
    return problems


def schedule_problems(config: ExperimentConfig, kind: Kind, train_rows: int) -> list[str]:
    """The data holds at least one batch (rows by the footers, before length filtering)."""
    d = config.data
    batch, key = (d.prompts_per_generation, "data.gen_batch_size" if d.gen_batch_size else "data.train_batch_size")
    if kind != "rl":
        batch, key = d.train_batch_size, "data.train_batch_size"
    if 0 < train_rows < batch:
        return [f"data.train_files hold {train_rows} rows, fewer than one batch ({key}={batch}): the run would "
                "have no step to take; lower the batch size or add data"]
    return []


def model_inputs(config: ExperimentConfig) -> tuple[list[str], ExperimentConfig]:
    """(problems, config with every hub id replaced by its directory in the HF cache) for the
    actor, critic, reward model and Megatron distillation teacher checkpoints and the tokenizer."""
    from megarl.bridge import ConversionError, arch_from_hf_config, load_hf_config
    from megarl.bridge.hub import is_hub_id, local_model_dir

    problems: list[str] = []

    def checked(key: str, path: Optional[str], architecture: bool = True) -> Optional[str]:
        if not path:
            return path
        try:
            local = local_model_dir(path, key)
            if architecture:
                arch_from_hf_config(load_hf_config(local), f"{key}={path!r}: {Path(local) / 'config.json'}")
        except ConversionError as error:
            problems.append(str(error))
            return path
        return str(local)

    arr, c, rm = config.actor_rollout_ref, config.critic, config.reward_model
    model = checked("actor_rollout_ref.model.path", arr.model.path)
    critic = model if c.model.path == arr.model.path else (checked("critic.model.path", c.model.path)
                                                           if c.enable else c.model.path)
    reward = checked("reward_model.model.path", rm.model.path) if rm.enable else rm.model.path
    d = config.distillation  # an SGLang teacher's path names its tokenizer only: not fetched whole
    teacher = (checked("distillation.teacher.model_path", d.teacher.model_path) if d.enabled and d.type == "megatron"
               else d.teacher.model_path)
    tokenizer, tok_key = config.data.tokenizer, "data.tokenizer"
    if tokenizer and is_hub_id(tokenizer):
        tokenizer = checked(tok_key, tokenizer, architecture=False)
    elif not tokenizer:
        tokenizer, tok_key = model, "actor_rollout_ref.model.path"
    if tokenizer and Path(tokenizer).is_dir() and not any((Path(tokenizer) / f).is_file() for f in TOKENIZER_FILES):
        problems.append(f"{tok_key}: no tokenizer files in {tokenizer} (one of {', '.join(TOKENIZER_FILES)})")
    resolved = replace(
        config,
        data=replace(config.data, tokenizer=tokenizer if config.data.tokenizer else None),
        actor_rollout_ref=replace(arr, model=replace(arr.model, path=model)),
        critic=replace(c, model=replace(c.model, path=critic)),
        reward_model=replace(rm, model=replace(rm.model, path=reward)),
        distillation=replace(d, teacher=replace(d.teacher, model_path=teacher)),
    )
    return problems, resolved


def moe_tensor_parallel_problem(config: ExperimentConfig) -> Optional[str]:
    """An MoE actor with TP > 1 without sequence parallelism: megatron-core trains an MoE layer with
    tensor parallelism only with sequence parallelism (transformer/moe/moe_layer.py raises in
    training mode), so the first update would fail after the cluster is up. Call with the config
    `model_inputs` resolved (a local model directory)."""
    from megarl.bridge import ConversionError, arch_from_hf_config, load_hf_config

    arr = config.actor_rollout_ref
    tp = arr.actor.megatron.tensor_model_parallel_size
    if tp <= 1 or arr.actor.megatron.sequence_parallel:
        return None
    try:
        moe = arch_from_hf_config(load_hf_config(arr.model.path)).moe
    except (ConversionError, OSError):
        return None  # model_inputs names the problem
    if moe is None:
        return None
    return (f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}: the model is a mixture of experts, "
            "and megatron-core trains MoE layers with TP > 1 only with sequence parallelism; set "
            "actor_rollout_ref.actor.megatron.sequence_parallel=true")


def rollout_expert_split_problem(config: ExperimentConfig) -> Optional[str]:
    """A rollout expert parallel size the model cannot take: a dense model, or experts that do not
    split evenly over the EP ranks (`megarl.rollout.launch.expert_split_problem`, SGLang's rule), found
    before any server starts. Call with the config `model_inputs` resolved (a local model directory)."""
    from megarl.bridge import ConversionError, arch_from_hf_config, load_hf_config
    from megarl.rollout.launch import expert_split_problem

    arr = config.actor_rollout_ref
    if arr.rollout.expert_parallel_size == 1:
        return None
    try:
        moe = arch_from_hf_config(load_hf_config(arr.model.path)).moe
    except (ConversionError, OSError):
        return None  # model_inputs names the problem
    return expert_split_problem(moe.num_experts if moe else None, arr.rollout.expert_parallel_size)


def mtp_model_problem(config: ExperimentConfig) -> Optional[str]:
    """`actor_rollout_ref.model.mtp.enable` on a checkpoint without multi-token-prediction layers (its
    config.json's `num_nextn_predict_layers`, read for the families that have them: `megarl.bridge.arch`),
    found before any process starts; verl refuses the same (verl/utils/megatron_utils.py
    `check_mtp_config`: "enable mtp while model has no mtp layer"). Call with the config `model_inputs` resolved."""
    if not config.actor_rollout_ref.model.mtp.enable:
        return None
    arch = _model_arch(config)
    if arch is None or arch.mtp_layers:
        return None  # model_inputs names an unreadable model
    return (f"actor_rollout_ref.model.mtp.enable=true: the model ({arch.model_type}) has no "
            "multi-token-prediction layers (config.json num_nextn_predict_layers; megarl reads them for "
            "deepseek_v3 and glm4_moe); verl refuses this too")


# SGLang 0.5.23 serving on a CPU (float32): the mixture-of-experts families whose greedy log-probs equal
# HF transformers' (within 4e-7, untied tiny checkpoints: tests/sglang/test_moe_on_cpu.py,
# tests/sglang/test_glm4_moe_serving.py), and why the others cannot be served there
SGLANG_CPU_MOE_SERVED = ("qwen3_moe", "glm4_moe", "mixtral")
SGLANG_CPU_MOE_CANNOT = {
    "qwen2_moe": "its shared expert's gate runs a Triton kernel (srt/models/qwen2_moe.py "
                 "Qwen2MoeSparseMoeBlock.forward: fused_gate_sigmoid_mul_add), which finds no driver on a CPU: "
                 "the server exits at the first request",
    "deepseek_v3": "its MLA attention's rotary embedding on a CPU requires rope_scaling (srt/layers/rotary_embedding/"
                   "factory.py get_rope_cpu asserts it): the server exits at start",
    "gpt_oss": "no CPU attention backend has its sinks and sliding windows (docs/sglang-on-cpu.md)",
}
# SGLang 0.5.23's MoE model classes that never tie the output layer to the embedding: each builds its own
# ParallelLMHead and its load_weights fills it only from a checkpoint's lm_head.weight, which a tied checkpoint
# lacks (srt/models/{model_type}.py reads no tie_word_embeddings; qwen2.py, qwen3.py, deepseek_v2.py do)
SGLANG_UNTIED_HEAD = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss")


def _model_arch(config: ExperimentConfig):
    """The actor's ModelArch, or None where its config.json cannot be read (model_inputs names that)."""
    from megarl.bridge import ConversionError, arch_from_hf_config, load_hf_config

    try:
        return arch_from_hf_config(load_hf_config(config.actor_rollout_ref.model.path))
    except (ConversionError, OSError):
        return None


def sglang_tied_head_problem(config: ExperimentConfig) -> Optional[str]:
    """Why real SGLang (on any device) would not serve the model's own output layer, or None: a tied
    checkpoint (tie_word_embeddings=true) of a family in `SGLANG_UNTIED_HEAD` is served with an output
    layer never loaded (measured on the CPU, the tiny tied qwen3_moe: log-probs 0.07 nats from HF's,
    even with every expert's output zero). Call with the config `model_inputs` resolved."""
    arch = _model_arch(config)
    if arch is None or not arch.lm_head_tied or arch.model_type not in SGLANG_UNTIED_HEAD:
        return None
    return (f"actor_rollout_ref.rollout.name=sglang with a tied {arch.model_type} checkpoint (tie_word_embeddings=true "
            f"in {config.actor_rollout_ref.model.path}/config.json): SGLang 0.5.23's srt/models/{arch.model_type}.py "
            "never ties its output layer to the embedding and loads it only from lm_head.weight, which a tied "
            "checkpoint lacks, so it would sample from an unloaded layer; save the checkpoint untied (lm_head.weight "
            "= the embedding, tie_word_embeddings=false)")


def sglang_cpu_model_problem(config: ExperimentConfig) -> Optional[str]:
    """Why real SGLang must not serve the model on a CPU, or None: a mixture-of-experts family not in
    `SGLANG_CPU_MOE_SERVED` (the cause from `SGLANG_CPU_MOE_CANNOT`, or not measured). Call only where
    SGLang serves on a CPU, with the config `model_inputs` resolved."""
    arch = _model_arch(config)
    if arch is None or arch.moe is None or arch.model_type in SGLANG_CPU_MOE_SERVED:
        return None
    cause = SGLANG_CPU_MOE_CANNOT.get(
        arch.model_type, "its log-probs on SGLang's CPU path have not been measured against HF's (served right: "
                         f"{', '.join(SGLANG_CPU_MOE_SERVED)}; docs/sglang-on-cpu.md)")
    return (f"actor_rollout_ref.rollout.name=sglang on the CPU with a {arch.model_type} model: SGLang 0.5.23 cannot "
            f"serve it there: {cause}; use actor_rollout_ref.rollout.name=cpu, megarl's CPU engine, which does")


def transformer_override_problems(config: ExperimentConfig) -> list[str]:
    """Each training role's `megatron.override_transformer_config` names that are no field of the
    installed megatron-core's TransformerConfig, found before any worker starts (the engine checks
    them again with their values when it builds)."""
    from megarl.config.rules.experts import training_roles
    from megarl.config.transformer_overrides import KEY

    roles = [(section, m.override_transformer_config) for section, m in training_roles(config)
             if m.override_transformer_config]
    if not roles:
        return []
    from megarl.engines.megatron.transformer_overrides import transformer_config_fields, unknown_names

    fields = transformer_config_fields()
    return [problem for section, overrides in roles for problem in unknown_names(overrides, f"{section}.{KEY}", fields)]


def optimizer_override_problems(config: ExperimentConfig) -> list[str]:
    """The trained roles' `optim.override_optimizer_config` names that are no field of the installed
    megatron-core's OptimizerConfig, found before any worker starts (the engine checks them again with
    their values when it builds its optimizer)."""
    roles = [(section, optim.override_optimizer_config) for section, optim in
             (("actor_rollout_ref.actor", config.actor_rollout_ref.actor.optim), ("critic", config.critic.optim))
             if optim.override_optimizer_config]
    if not roles:
        return []
    from megarl.engines.megatron.optim import optimizer_config_fields
    from megarl.engines.megatron.transformer_overrides import unknown_names

    fields = optimizer_config_fields()
    return [problem for section, overrides in roles
            for problem in unknown_names(overrides, f"{section}.optim.override_optimizer_config", fields,
                                        "OptimizerConfig")]


def gpu_count_problem(config: ExperimentConfig, cuda: bool, visible: int) -> Optional[str]:
    """On one CUDA node, the run needs trainer.n_gpus_per_node visible GPUs. (Several nodes: the
    controller sees only its own; launch/check.py checks the whole cluster.)"""
    t = config.trainer
    if cuda and t.nnodes == 1 and visible < t.n_gpus_per_node:
        return (f"trainer.n_gpus_per_node={t.n_gpus_per_node}, but this machine shows {visible} CUDA GPU(s) "
                "(CUDA_VISIBLE_DEVICES); lower trainer.n_gpus_per_node or run on a larger node")
    return None


def trainer_of_data(config: ExperimentConfig) -> tuple[Kind, str]:
    """(trainer, why) from the columns of the first readable data.train_files footer: DPO pairs have
    data.chosen_key and data.rejected_key, SFT examples data.response_key; anything else is RL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = config.data
    for name in d.train_files:
        try:
            columns = pq.read_schema(name).names
        except (pa.ArrowException, OSError):
            continue
        if d.chosen_key in columns and d.rejected_key in columns:
            return "dpo", f"{name} has '{d.chosen_key}' and '{d.rejected_key}' columns"
        if d.response_key in columns:
            return "sft", f"{name} has a '{d.response_key}' column"
        return "rl", f"{name} has neither response nor preference columns"
    return "rl", "no data.train_files to read the trainer from"
