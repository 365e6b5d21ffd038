"""verl's Hydra config-group choices (`group@package=option`, `hydra.searchpath`) and the Megatron Lite
engine keys they open (`<role>.engine.*`), onto megarl's keys.

verl picks a role's base config with a Hydra defaults-list override, e.g. `actor@actor_rollout_ref.actor=
megatron_actor` (verl/trainer/config/ppo_trainer.yaml `defaults`). Megatron Lite's launchers add
`hydra.searchpath=[pkg://verl_mlite.config]` and choose `actor@actor_rollout_ref.actor=mlite_actor`
(NVIDIA/Megatron-LM dev, experimental/lite/examples/verl/verl_mlite/config/actor/mlite_actor.yaml: the
actor's engine is `engine/mlite.yaml`, under `actor_rollout_ref.actor.engine`), `ref@actor_rollout_ref.ref=
mlite_ref`, or, for verl's SFT trainer, `engine=mlite`. Megatron Lite builds megatron-core's parallel state
from the engine's tp/pp/vpp/cp/ep/etp and megatron-core's distributed optimizer (`impl_cfg.optimizer=dist_opt`,
primitive/optimizers/megatron_wrap.py) or torch FSDP2 with AdamW on the shards (`impl_cfg.optimizer=fsdp2`,
primitive/optimizers/fsdp2/: megarl's `megatron.use_torch_fsdp2`), which is megarl's Megatron engine: each key
goes to the `<role>.megatron.*` key of the same meaning. Hydra applies group choices before any other override, and
so does `split_groups`, whatever their place on the command line.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import yaml

from megarl.config.transformer_overrides import GRADIENT_CHECKPOINTING
from megarl.config.verl_compat import _PACKED, _get, _set

log = logging.getLogger("megarl.config")

MLITE_SEARCHPATH = "pkg://verl_mlite.config"
MLITE_LAUNCHER = "verl_mlite.launch"
ACTOR, REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"

# Hydra `group@package` -> the options verl ships (verl/trainer/config/<group>/*.yaml at verl main 2026-08-22),
# and the one megarl reads (None: the group has one option, verl's default)
GROUPS: dict[str, tuple[tuple[str, ...], str | None]] = {
    f"actor@{ACTOR}": (("dp_actor", "megatron_actor", "torchtitan_actor", "veomni_actor"), "megatron_actor"),
    f"ref@{REF}": (("dp_ref", "megatron_ref", "torchtitan_ref", "veomni_ref"), "megatron_ref"),
    "critic@critic": (("dp_critic", "megatron_critic", "torchtitan_critic", "veomni_critic"), "megatron_critic"),
    "data@data": (("legacy_data",), None),
    "rollout@actor_rollout_ref.rollout": (("rollout",), None),
    "model@actor_rollout_ref.model": (("hf_model",), None),
    "model@critic.model": (("hf_model",), None),
    "reward@reward": (("reward",), None),
    "algorithm@algorithm.rollout_correction": (("rollout_correction",), None),
    "distillation@distillation": (("distillation",), None),
}
# the options of verl_mlite.config (its actor/, ref/ and engine/ folders), found with hydra.searchpath only
MLITE_OPTIONS = {f"actor@{ACTOR}": ("mlite_actor", ACTOR), f"ref@{REF}": ("mlite_ref", REF)}
SFT_ENGINE_OPTIONS = ("automodel", "fsdp", "megatron", "torchtitan", "veomni")  # verl's engine/*.yaml

# Megatron Lite's engine keys (verl_mlite/config/engine/mlite.yaml, engine/config.py MegatronLiteEngineConfig)
# -> megarl's <role>.megatron key; megatron-core's parallel state takes them as megatron_wrap.py
# `_ensure_dist_opt_mpu_parallel_state` passes them
LAYOUT = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
          "vpp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
          "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size"}
# megatron-core TransformerConfig.attention_backend values; Megatron Lite's override sets the same
# NVTE_{FLASH,FUSED,UNFUSED}_ATTN (runtime.py `_apply_attention_backend_env`)
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
# Megatron Lite's recompute module names with a megatron-core `recompute_modules` name of the same module
RECOMPUTE_MODULES = ("core_attn", "moe", "moe_act", "mlp")
_BUILD = ("megarl builds the model with megatron-core from the HF checkpoint (megarl.bridge) and pushes the weights "
          "in actor_rollout_ref.model.dtype")
_WORKER = "verl's workers set it from the role's own keys (use_dynamic_bsz, ppo_max_token_len_per_gpu, ...)"
# Megatron Lite's engine keys without meaning here: key -> (the one value accepted, None: any; why)
_IGNORED = {
    "strategy": ("mlite", _BUILD),
    "custom_backend_module": (None, _BUILD),
    "impl": ("lite", _BUILD),
    "model_name": ("auto", _BUILD),
    "load_hf_weights": (True, _BUILD),
    "export_dtype": (None, _BUILD),
    "resync_format": (None, _BUILD),
    "resync_config": (None, _BUILD),
    "use_remove_padding": (None, _PACKED),
    "use_fused_kernels": (None, "megarl computes log-probs from Megatron's logits with its own code"),
    "cross_entropy_fusion": (None, "megarl computes log-probs from Megatron's logits with its own code"),
    "use_dynamic_bsz": (None, _WORKER),
    "max_token_len_per_gpu": (None, _WORKER),
    "micro_batch_size_per_gpu": (None, _WORKER),
    "infer_max_token_len_per_gpu": (None, _WORKER),
    "infer_micro_batch_size_per_gpu": (None, _WORKER),
}


@dataclass
class Groups:
    """What the group choices of one command line leave to `apply_groups`: the roles whose engine is
    Megatron Lite's (role prefix -> {key path under engine: (value, source)}) and verl's worker switch."""

    mlite: dict[str, dict[str, tuple[Any, str]]] = field(default_factory=dict)
    legacy_worker_impl: tuple[Any, str] | None = None


def _parse(text: str) -> tuple[str, str, Any]:
    key, _, raw = text.lstrip("+").partition("=")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, raw, value


def split_groups(overrides: list[str], verl_sft: bool, errors: list[str]) -> tuple[list[str], Groups]:
    """Take verl's group choices, hydra.searchpath, trainer.use_legacy_worker_impl and the Megatron Lite
    engine keys out of `overrides`; the rest, and the choices made. Problems go to `errors`, each naming
    its override."""
    groups = Groups()
    keys = [(text, *_parse(text)) for text in overrides]
    searchpath = [v for _, k, _, v in keys if k == "hydra.searchpath"]
    mlite_found = any(MLITE_SEARCHPATH in (v if isinstance(v, list) else [v]) for v in searchpath)
    rest = []
    for text, key, _, value in keys:
        source = f"override '{text}'"
        if key == "hydra.searchpath":
            unknown = [p for p in (value if isinstance(value, list) else [value]) if p != MLITE_SEARCHPATH]
            if unknown:
                errors.append(f"{source}: megarl knows the config groups of {MLITE_SEARCHPATH} (Megatron Lite) only, "
                              f"not {', '.join(map(str, unknown))}")
            else:
                log.warning("hydra.searchpath (verl key, %s): megarl reads Megatron Lite's config groups (mlite_actor, "
                            "mlite_ref, engine=mlite) itself; ignored", source)
        elif "@" in key or (verl_sft and key == "engine" and value == "mlite"):  # other engines: verl_sft.SFT_KEYS
            choice = _choose(key, value, source, mlite_found, errors)
            if choice is not None:
                groups.mlite.setdefault(choice, {})
        elif key == "trainer.use_legacy_worker_impl":
            groups.legacy_worker_impl = (value, source)
        else:
            rest.append(text)
    # the engine keys, once the choices are known (Hydra applies the defaults list first)
    out = []
    for text in rest:
        key, _, value = _parse(text)
        if verl_sft and key.startswith("engine.") and ACTOR in groups.mlite:
            key = f"{ACTOR}.{key}"  # verl's SFT engine is the actor's (megarl.config.verl_sft)
        role = next((r for r in (ACTOR, REF) if key.startswith(f"{r}.engine.")), None)
        mixed = next((r for r in groups.mlite if key.startswith(f"{r}.megatron.")), None)
        if mixed is not None:  # verl's actor.yaml / ref.yaml have no megatron group; megatron_*.yaml add it
            errors.append(f"override '{text}': with Megatron Lite's {_option_of(mixed, verl_sft)} verl's "
                          f"{mixed.rsplit('.', 1)[1]} has no megatron group (Hydra refuses the key); its engine is "
                          f"{'engine' if verl_sft else mixed + '.engine'}.*")
        elif role is None:
            out.append(text)
        elif role in groups.mlite:
            groups.mlite[role][key.removeprefix(f"{role}.engine.")] = (value, f"override '{text}'")
        else:
            errors.append(f"override '{text}': verl's {role.rsplit('.', 1)[1]} has engine.* keys only with Megatron "
                          f"Lite's config ({_option_of(role, verl_sft)}); its Megatron layout is {role}.megatron.* "
                          "(Hydra refuses the key too)")
    return out, groups


def _option_of(role: str, verl_sft: bool) -> str:
    """The group choice that gives `role` Megatron Lite's engine, as a command line writes it."""
    if verl_sft:
        return "engine=mlite"
    return next(f"{group}={option}" for group, (option, r) in MLITE_OPTIONS.items() if r == role)


def _choose(key: str, value: Any, source: str, mlite_found: bool, errors: list[str]) -> str | None:
    """The role prefix whose engine becomes Megatron Lite's, for one group choice (None: another choice,
    accepted with a warning or refused into `errors`)."""
    if key == "engine":  # verl's SFT trainer: sft_trainer_engine.yaml `engine@engine`
        known, mlite = SFT_ENGINE_OPTIONS, ("mlite", ACTOR)
    elif key in GROUPS:
        known, mlite = GROUPS[key][0], MLITE_OPTIONS.get(key)
    else:
        errors.append(f"{source}: verl's config has no group choice {key} (it has {', '.join(GROUPS)})")
        return None
    options = (*known, mlite[0]) if mlite and mlite_found else known
    if value not in options:
        hint = (f"; {mlite[0]} is Megatron Lite's, found with hydra.searchpath=[{MLITE_SEARCHPATH}]"
                if mlite and value == mlite[0] else "")
        errors.append(f"{source}: {value!r} is not an option of verl's {key} (options: {', '.join(options)}){hint}")
        return None
    if mlite and value == mlite[0]:
        log.warning("%s=%s (verl group, %s): Megatron Lite's engine keys (%s.engine.*) go to megarl's %s.megatron.* "
                    "(megatron-core's layout and distributed optimizer, as Megatron Lite builds them)",
                    key, value, source, mlite[1], mlite[1])
        return mlite[1]
    megarl = GROUPS[key][1]
    if megarl is not None and value != megarl:
        errors.append(f"{source}: megarl trains with Megatron only; {key} accepts {megarl}"
                      f"{' or ' + mlite[0] if mlite else ''} (verl's {value} is not built)")
        return None
    log.warning("%s=%s (verl group, %s): megarl's schema defaults stand for verl's %s config; ignored",
                key, value, source, value)
    return None


def apply_groups(tree: dict, groups: Groups, origins: dict) -> list[str]:
    """Set megarl's keys from the Megatron Lite engines chosen (the raw config tree, in place); the
    problems found, one message each."""
    errors = []
    if groups.legacy_worker_impl is not None:
        value, source = groups.legacy_worker_impl
        # verl before #6067 (2026-04-20), main_ppo.py: auto|enable|disable, else ValueError("Invalid
        # use_legacy_worker_impl"); the key is gone from verl's config since
        if value not in ("auto", "enable", "disable"):
            errors.append(f"trainer.use_legacy_worker_impl={value} ({source}): verl accepted auto, enable or "
                          "disable (main_ppo.py: ValueError 'Invalid use_legacy_worker_impl')")
        else:
            log.warning("trainer.use_legacy_worker_impl=%s (verl key, %s): verl's choice between its legacy and its "
                        "engine workers; megarl has one worker implementation; ignored", value, source)
    for role in sorted(groups.mlite):  # the actor first: the reference's defaults are its layout
        errors += _mlite_engine(tree, role, groups.mlite[role], origins, mirror_actor=ACTOR in groups.mlite)
    return errors


def _mlite_engine(tree: dict, role: str, keys: dict[str, tuple[Any, str]], origins: dict,
                  mirror_actor: bool) -> list[str]:
    """One role's Megatron Lite engine onto `<role>.megatron.*`: its defaults (engine/mlite.yaml; the
    reference's are the actor's Megatron Lite engine where it has one, `mirror_actor`: ref/mlite_ref.yaml
    `oc.select:actor_rollout_ref.actor.engine.*`), then the keys given."""
    errors = []
    megatron = f"{role}.megatron"
    default = f"Megatron Lite's default ({'ref/mlite_ref.yaml' if role == REF else 'engine/mlite.yaml'})"
    values: dict[str, tuple[Any, str]] = {"tp": (1, default), "pp": (1, default), "vpp": (1, default),
                                          "cp": (1, default), "ep": (1, default), "etp": (None, default),
                                          "attention_backend_override": ("flash", default)}
    if role == REF:  # mlite_ref.yaml: parameters offloaded (the reference only runs forward)
        values["param_offload"] = (True, default)
        if mirror_actor:
            actor = _get(tree, f"{ACTOR}.megatron")
            values.update({key: (actor[name], f"{default}: the actor's engine.{key}") for key, name in LAYOUT.items()})
            values["attention_backend_override"] = (actor["override_transformer_config"].get("attention_backend"),
                                                    f"{default}: the actor's engine.attention_backend_override")
    values.update(keys)
    for key, (value, source) in values.items():
        path = f"{role}.engine.{key}"
        if key in LAYOUT:
            if key == "etp" and value is None:  # MegatronLiteEngine._build_mlite_config: etp or 1
                value = 1
            if key == "vpp":  # megatron_wrap.py: None if vpp <= 1 (one model chunk per stage)
                value = None if value is None or value <= 1 else value
            _set(tree, f"{megatron}.{LAYOUT[key]}", value, origins, f"verl key {path} ({source})")
        elif key in ("param_offload", "optimizer_offload"):
            _set(tree, f"{megatron}.{key}", value, origins, f"verl key {path} ({source})")
            if key == "param_offload":  # MegatronLiteEngine.initialize: grads move with the parameters
                _set(tree, f"{megatron}.grad_offload", value, origins, f"verl key {path} ({source})")
        elif key == "grad_offload":
            log.warning("%s (verl key, %s): Megatron Lite offloads gradients with the parameters (param_offload) and "
                        "does not read grad_offload; ignored", path, source)
        elif key == "attention_backend_override":
            if value == "magi":
                errors.append(f"{path}=magi ({source}): MagiAttention is not built; megatron-core's attention backends "
                              f"are {', '.join(ATTENTION_BACKENDS)}")
            elif value is not None and value not in ATTENTION_BACKENDS:
                errors.append(f"{path}={value} ({source}): Megatron Lite accepts {', '.join(ATTENTION_BACKENDS)}, magi "
                              "(runtime.py _apply_attention_backend_env raises ValueError)")
            elif value is not None:
                _set(tree, f"{megatron}.override_transformer_config.attention_backend", value, origins,
                     f"verl key {path} ({source})")
        elif key == "impl_cfg.use_thd":
            if value is not True:  # MegatronLiteEngine._build_impl_cfg raises ValueError
                errors.append(f"{path}={value} ({source}): Megatron Lite trains THD-packed sequences only "
                              "(MegatronLiteEngine raises ValueError: set engine.impl_cfg.use_thd=True)")
            else:
                log.warning("%s (verl key, %s): %s; ignored", path, source, _PACKED)
        elif key == "impl_cfg.optimizer":
            errors += _optimizer(tree, role, path, value, source, origins)
        elif key == "impl_cfg.recompute":
            errors += _recompute(tree, role, path, value, source, origins)
        elif key == "router_aux_loss_coef":  # null: 0.0 (MegatronLiteEngine._build_mlite_config)
            _set(tree, f"{megatron}.moe_aux_loss_coeff", 0.0 if value is None else value, origins,
                 f"verl key {path} ({source})")
        elif key == "dtype":
            _set(tree, "actor_rollout_ref.model.dtype", value, origins, f"verl key {path} ({source})")
        elif key == "seed":
            _set(tree, f"{megatron}.seed", value, origins, f"verl key {path} ({source})")
        elif key == "full_determinism":
            if value:
                errors.append(f"{path}=true ({source}): deterministic training (verl's enable_full_determinism) is "
                              "not built yet")
        elif key in ("router_replay_mode", "router_replay.mode") and role == ACTOR:
            _set(tree, f"{ACTOR}.router_replay.mode", value, origins, f"verl key {path} ({source})")
        elif key == "forward_only":
            if value is not (role == REF):
                errors.append(f"{path}={value} ({source}): megarl's {role.rsplit('.', 1)[1]} "
                              f"{'only runs forward' if role == REF else 'trains'}")
        elif key in _IGNORED:
            only, why = _IGNORED[key]
            if only is not None and value != only:
                errors.append(f"{path}={value} ({source}): {why}; megarl accepts {only} only")
            else:
                log.warning("%s (verl key, %s): %s; ignored", path, source, why)
        else:
            errors.append(f"{path} ({source}): not a key of Megatron Lite's engine config that megarl reads "
                          "(verl_mlite/config/engine/mlite.yaml)")
    if role == ACTOR:
        errors += _offload_fraction(tree, origins)
    return errors


def _optimizer(tree: dict, role: str, path: str, value: Any, source: str, origins: dict) -> list[str]:
    if value == "dist_opt":  # megatron_wrap.build_dist_opt_optimizer_config: use_distributed_optimizer=True
        _set(tree, f"{role}.megatron.use_distributed_optimizer", True, origins, f"verl key {path} ({source})")
        return []
    if value is None and role == REF:  # forward only
        return []
    if value == "fsdp2":  # torch FSDP2 over DP x CP with AdamW on the shards (primitive/optimizers/fsdp2)
        _set(tree, f"{role}.megatron.use_torch_fsdp2", True, origins, f"verl key {path} ({source})")
        _set(tree, f"{role}.megatron.use_distributed_optimizer", False, origins, f"verl key {path} ({source})")
        return []
    return [f"{path}={value} ({source}): Megatron Lite's optimizers are dist_opt and fsdp2"]


def _recompute(tree: dict, role: str, path: str, value: Any, source: str, origins: dict) -> list[str]:
    # megatron.lite.primitive.recompute.parse_recompute_spec: null / "none" -> [], "full" -> ["full"], "a,b" -> [a, b]
    spec = [] if value in (None, "none") else value if isinstance(value, list) else str(value).split(",")
    target = f"{role}.megatron.override_transformer_config"
    if not spec:
        return []
    if "full" in spec:  # apply_recompute: each layer checkpointed whole
        for name, v in GRADIENT_CHECKPOINTING.items():
            _set(tree, f"{target}.{name}", v, origins, f"verl key {path} ({source})")
        return []
    unknown = [m for m in spec if m not in RECOMPUTE_MODULES]
    if unknown:
        return [f"{path}={value} ({source}): {', '.join(unknown)}: no megatron-core recompute module of the same scope "
                f"(megarl recomputes full, or selectively {', '.join(RECOMPUTE_MODULES)})"]
    _set(tree, f"{target}.recompute_granularity", "selective", origins, f"verl key {path} ({source})")
    _set(tree, f"{target}.recompute_modules", list(spec), origins, f"verl key {path} ({source})")
    return []


def _offload_fraction(tree: dict, origins: dict) -> list[str]:
    """Megatron Lite's optimizer overrides (MegatronLiteEngine._build_mlite_optimizer_config): offload_fraction
    (or optimizer_offload_fraction, or 1.0 with optimizer_cpu_offload or engine.optimizer_offload) > 0 puts
    megatron-core's optimizer step on the CPU (megatron_wrap.build_dist_opt_optimizer_config:
    optimizer_cpu_offload, optimizer_offload_fraction, overlap_cpu_optimizer_d2h_h2d); eps is adam_eps."""
    path = f"{ACTOR}.optim.override_optimizer_config"
    override = _get(tree, path)
    fraction = override.pop("offload_fraction", override.get("optimizer_offload_fraction"))
    if fraction is None and (override.get("optimizer_cpu_offload") or _get(tree, f"{ACTOR}.megatron.optimizer_offload")):
        fraction = 1.0
    if "eps" in override:
        override["adam_eps"] = override.pop("eps")
    if fraction:
        source = f"Megatron Lite's optimizer offload ({path}.offload_fraction / {ACTOR}.engine.optimizer_offload)"
        for name, value in (("optimizer_offload_fraction", fraction), ("optimizer_cpu_offload", True),
                            ("overlap_cpu_optimizer_d2h_h2d", True)):
            _set(tree, f"{path}.{name}", value, origins, source)
    return []
