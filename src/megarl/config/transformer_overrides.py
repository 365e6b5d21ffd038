"""A role's megatron-core `TransformerConfig` overrides (`<role>.megatron.override_transformer_config`,
verl's key) and the activation recompute they ask for. Pure; megatron-core is not imported here: the
engine checks each name against the installed megatron-core's `TransformerConfig` fields and refuses
a name it sets itself from the model (`megarl.engines.megatron.transformer_overrides`).

Activation recompute (megatron-core's `TransformerConfig.recompute_*`; the forward in 0.16.1's
transformer/transformer_block.py `_checkpointed_forward`, 0.19.2's recompute.py `checkpointed_forward`):
- full: a layer's activations are dropped in the forward and recomputed in the backward from the
  layer's input. uniform: the stage's layers in chunks of `recompute_num_layers`, each chunk's
  input kept; block: only the first `recompute_num_layers` layers of each stage recomputed, one by one.
- selective: only `recompute_modules` (default ["core_attn"]) inside each layer are recomputed.
`actor_rollout_ref.model.enable_gradient_checkpointing=true` means full, uniform, 1 layer
(`GRADIENT_CHECKPOINTING`) for the actor and the critic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

KEY = "megatron.override_transformer_config"
GRADIENT_CHECKPOINTING_KEY = "actor_rollout_ref.model.enable_gradient_checkpointing"
GRADIENT_CHECKPOINTING = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
GRANULARITIES = (None, "full", "selective")
METHODS = (None, "uniform", "block")
# TransformerConfig fields that megarl sets from a `<role>.megatron` key of the same name
LAYOUT_NAMES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
                "sequence_parallel", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_grouped_gemm")
# TransformerConfig fields that cut the layers into uneven pipeline stages: megarl follows the first
# four (the bridge, weight sync, checkpoints and `megarl plan` read megarl.bridge.sharding.stage_layers)
# and refuses pipeline_model_parallel_layout set to other than megatron-core's default (None)
UNEVEN_STAGE_LAYERS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
STAGE_SPLIT_FLAGS = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
OTHER_STAGE_NAMES = {"pipeline_model_parallel_layout": None}
DTYPE_NAMES = ("params_dtype", "pipeline_dtype", "bf16", "fp16")  # from actor_rollout_ref.model.dtype


@dataclass(frozen=True)
class Recompute:
    """A role's activation recompute: `granularity` None (off), "full" or "selective"; `method`
    "uniform" or "block" and `num_layers` (layers per chunk, or per stage) for full; `modules` for selective."""

    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None
    modules: tuple[str, ...] = ("core_attn",)


def role_overrides(overrides: Mapping[str, Any], gradient_checkpointing: bool) -> dict[str, Any]:
    """The TransformerConfig fields a role sets on top of megarl's own: its `override_transformer_config`,
    and enable_gradient_checkpointing's full recompute where it is on (`gradient_checkpointing`: the
    role trains with it: the actor and the critic) and the overrides do not say otherwise
    (`recompute_problems` refuses their differing)."""
    return {**(GRADIENT_CHECKPOINTING if gradient_checkpointing else {}), **overrides}


def recompute_of(overrides: Mapping[str, Any]) -> Recompute:
    """The recompute of a role's `role_overrides` (checked by `recompute_problems`)."""
    modules = overrides.get("recompute_modules")
    return Recompute(overrides.get("recompute_granularity"), overrides.get("recompute_method"),
                     overrides.get("recompute_num_layers"), tuple(modules) if modules is not None else ("core_attn",))


def recompute_problems(prefix: str, overrides: Mapping[str, Any], gradient_checkpointing: bool) -> list[str]:
    """Messages for a role's recompute overrides, `prefix` being `<section>.megatron.override_transformer_config`:
    values megatron-core refuses (its TransformerConfig.__post_init__, transformer_config.py:1154-1185 in
    0.16.1, :1724-1755 in 0.19.2: a granularity of full or selective; full needs a method of uniform or block
    and recompute_num_layers; selective takes no recompute_num_layers), recompute_num_layers < 1 (which
    megatron-core accepts, but its uniform loop then never advances: 0.16.1 transformer_block.py:532-542,
    0.19.2 recompute.py:157-166), and values differing from enable_gradient_checkpointing's full recompute
    where that is on (`gradient_checkpointing`)."""
    problems = []
    if gradient_checkpointing:
        for name, value in GRADIENT_CHECKPOINTING.items():
            if name in overrides and overrides[name] != value:
                problems.append(f"{prefix}.{name}={overrides[name]} conflicts with {GRADIENT_CHECKPOINTING_KEY}=true, "
                                f"which means {name}={value}; set one of them only")
    settings = role_overrides(overrides, gradient_checkpointing)
    granularity, method = settings.get("recompute_granularity"), settings.get("recompute_method")
    layers = settings.get("recompute_num_layers")
    if granularity not in GRANULARITIES:
        problems.append(f"{prefix}.recompute_granularity={granularity}: must be full, selective or null")
    if method not in METHODS:
        problems.append(f"{prefix}.recompute_method={method}: must be uniform, block or null")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        problems.append(f"{prefix}.recompute_num_layers={layers}: must be a positive integer or null")
    if granularity == "full" and (method is None or layers is None):
        problems.append(f"{prefix}.recompute_granularity=full needs recompute_method (uniform or block) and "
                        "recompute_num_layers (megatron-core's rule)")
    if granularity == "selective" and layers is not None:
        problems.append(f"{prefix}.recompute_granularity=selective takes no recompute_num_layers "
                        "(megatron-core's rule); use recompute_modules")
    modules = settings.get("recompute_modules")
    if modules is not None and (not isinstance(modules, list) or not all(isinstance(m, str) for m in modules)):
        problems.append(f"{prefix}.recompute_modules={modules}: must be a list of module names, e.g. [core_attn]")
    return problems


def uneven_stage_problems(prefix: str, overrides: Mapping[str, Any], pp: int) -> list[str]:
    """Messages for uneven pipeline stages (`prefix` = `<section>.megatron.override_transformer_config`,
    `pp` its role's pipeline_model_parallel_size): `UNEVEN_STAGE_LAYERS` must be positive integers and
    need PP > 1; `STAGE_SPLIT_FLAGS` must be booleans and cannot join them (megatron-core 0.16.1
    transformer_config.py `__post_init__`: "num_layers_in_first_pipeline_stage and
    num_layers_in_last_pipeline_stage cannot be set at the same time with account_for_..."); `OTHER_STAGE_NAMES`
    are refused. Whether the model's layers split that way is checked when the engine reads the model
    (megarl.bridge.sharding.stage_layers)."""
    problems = []
    for name in UNEVEN_STAGE_LAYERS:
        value = overrides.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{prefix}.{name}={value!r}: must be a positive integer or null")
        elif pp == 1:
            problems.append(f"{prefix}.{name}={value} needs pipeline_model_parallel_size > 1 (one stage holds every "
                            "layer)")
    flags = [name for name in STAGE_SPLIT_FLAGS if overrides.get(name, False) is not False]
    problems += [f"{prefix}.{name}={overrides[name]!r}: must be true or false" for name in flags
                 if not isinstance(overrides[name], bool)]
    uneven = [name for name in UNEVEN_STAGE_LAYERS if overrides.get(name) is not None]
    if uneven and any(overrides[name] is True for name in flags):
        problems.append(f"{prefix}: {' / '.join(uneven)} cannot be set together with {' / '.join(flags)} "
                        "(megatron-core's TransformerConfig refuses it: transformer_config.py __post_init__)")
    problems += [f"{prefix}.{name}={overrides[name]}: megarl cuts uneven pipeline stages with "
                 f"{' / '.join((*UNEVEN_STAGE_LAYERS, *STAGE_SPLIT_FLAGS))} only; remove it"
                 for name, default in OTHER_STAGE_NAMES.items() if name in overrides and overrides[name] != default]
    return problems


def megarl_key_problems(prefix: str, section: str, overrides: Mapping[str, Any], megatron_cfg,
                        dtype: str) -> list[str]:
    """Messages for override names megarl sets from its own keys, where the values differ: the
    layout names from `<section>.megatron.<same name>`, bf16/fp16 from actor_rollout_ref.model.dtype;
    params_dtype and pipeline_dtype always (torch dtypes, which YAML cannot write)."""
    problems = []
    for name in LAYOUT_NAMES:
        if name in overrides and overrides[name] != getattr(megatron_cfg, name):
            problems.append(f"{prefix}.{name}={overrides[name]} conflicts with {section}.megatron.{name}="
                            f"{getattr(megatron_cfg, name)}; set {section}.megatron.{name} only")
    flags = {"bf16": dtype == "bfloat16", "fp16": dtype == "float16"}
    for name in DTYPE_NAMES:
        if name in overrides and (name not in flags or overrides[name] != flags[name]):
            problems.append(f"{prefix}.{name}={overrides[name]} conflicts with actor_rollout_ref.model.dtype={dtype}, "
                            "from which megarl sets it; set actor_rollout_ref.model.dtype only")
    return problems


# megatron-core's context-parallel communication of transformer-engine's attention (TransformerConfig.cp_comm_type,
# transformer_config.py:732 in 0.16.1: "p2p" or "all_gather" or "a2a" or "a2a+p2p", one for all layers or one per layer;
# unset: "p2p", extensions/transformer_engine.py:1240). megarl's CPU reference attention all-gathers whatever it says.
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _cp_comm_types(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def cp_comm_type_problems(prefix: str, overrides: Mapping[str, Any]) -> list[str]:
    """Messages for `<prefix>.cp_comm_type` (`prefix` = `<section>.megatron.override_transformer_config`):
    each value one of CP_COMM_TYPES, and no "a2a+p2p": it runs over megatron's hierarchical CP groups
    (extensions/transformer_engine.py:1242-1249 `get_hierarchical_context_parallel_groups`), which exist only
    with `hierarchical_context_parallel_sizes` at initialize_model_parallel, and megarl does not make them."""
    if "cp_comm_type" not in overrides or overrides["cp_comm_type"] is None:
        return []
    values = _cp_comm_types(overrides["cp_comm_type"])
    problems = [f"{prefix}.cp_comm_type={v}: must be one of {', '.join(CP_COMM_TYPES)} (megatron-core's names)"
                for v in values if v not in CP_COMM_TYPES]
    if "a2a+p2p" in values:
        problems.append(f"{prefix}.cp_comm_type=a2a+p2p needs megatron's hierarchical context-parallel groups, which "
                        "megarl does not create; use p2p, all_gather or a2a")
    return problems


def packed_cp_problems(prefix: str, cp_comm_type, *, cp: int) -> list[str]:
    """Messages for packed (THD) sequences at context parallel size `cp` with a role's cp_comm_type
    (None: "p2p"): transformer-engine's all-gather and a2a CP attention refuse them (`assert qkv_format
    != "thd"` in AttnFuncWithCPAndKVAllGather and AttnFuncWithCPAndQKVOA2A, attention/dot_product_attention/
    context_parallel.py); only "p2p" (AttnFuncWithCPAndKVP2P, with cu_seqlens_padded) takes them. megarl's
    CPU reference attention refuses what transformer-engine refuses. None at CP 1."""
    if cp == 1:
        return []
    return [f"{prefix}.cp_comm_type={value} with context_parallel_size={cp}: transformer-engine's {value} context-"
            "parallel attention refuses packed (THD) sequences; use p2p, or the padded sequence layout"
            for value in dict.fromkeys(_cp_comm_types(cp_comm_type if cp_comm_type is not None else "p2p"))
            if value != "p2p"]


def cp_comm_type_model_problems(prefix: str, cp_comm_type, *, cp: int, tp: int, heads: int, query_groups: int,
                                sliding_window: bool) -> list[str]:
    """Messages for the combinations of a role's cp_comm_type (None: "p2p"), its layout and its model
    that transformer-engine's CP attention refuses (transformer_engine/pytorch/attention/dot_product_attention/
    context_parallel.py): "a2a" scatters heads over the CP ranks, so each TP rank's query heads and
    key/value heads must divide by CP ("The number of attention heads needs to be divisible by CP size!");
    a sliding window runs only with "a2a" or "all_gather" (`attn_forward_func_with_cp`: "The context parallel
    running configs cannot support sliding window attetnion!"). None at CP 1."""
    if cp == 1:
        return []
    problems = []
    for value in dict.fromkeys(_cp_comm_types(cp_comm_type if cp_comm_type is not None else "p2p")):
        if value == "a2a" and ((heads // tp) % cp or (query_groups // tp) % cp):
            problems.append(f"{prefix}.cp_comm_type=a2a with context_parallel_size={cp}: each of the "
                            f"{tp} tensor-parallel ranks holds {heads // tp} query and {query_groups // tp} key/value "
                            f"heads, which a2a must split evenly over the {cp} CP ranks; use p2p or all_gather")
        if value == "p2p" and sliding_window:
            problems.append(f"{prefix}.cp_comm_type=p2p (the default) with context_parallel_size={cp}: the model has a "
                            "sliding window, which transformer-engine's p2p context parallelism refuses; set "
                            f"{prefix}.cp_comm_type to a2a or all_gather")
    return problems
