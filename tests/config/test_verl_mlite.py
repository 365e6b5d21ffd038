"""verl's Megatron Lite launch lines (`hydra.searchpath=[pkg://verl_mlite.config]`,
`actor@actor_rollout_ref.actor=mlite_actor`, `<role>.engine.*`; megarl.config.verl_groups) load with each
engine key meaning what Megatron Lite makes of it. The oracles are Megatron Lite's own code (NVIDIA/Megatron-LM
dev d48bd6b, experimental/lite), transcribed below where it is not installed, and megatron-core's."""
import dataclasses
import logging
import os
import re
import types

import pytest

from megarl.config import ConfigError, load_config, to_yaml
from megarl.engines.megatron.optim import optimizer_config_fields, optimizer_kwargs
from megarl.engines.megatron.parallel import role_layout
from megarl.engines.megatron.transformer_overrides import apply_overrides, transformer_config_fields

MLITE = ["hydra.searchpath=[pkg://verl_mlite.config]", "actor@actor_rollout_ref.actor=mlite_actor"]
ARGS = ["actor_rollout_ref.model.path=/m", "trainer.nnodes=4", "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64"]


def _mlite_parallel_state_kwargs(tp=1, etp=None, ep=1, pp=1, vpp=1, cp=1):
    """Megatron Lite's megatron-core parallel state for its engine keys (defaults: verl_mlite/config/engine/
    mlite.yaml): primitive/optimizers/megatron_wrap.py `_ensure_dist_opt_mpu_parallel_state`, transcribed."""
    return dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=None if int(vpp or 1) <= 1 else vpp, context_parallel_size=cp,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=int(etp if etp is not None else 1))


def _megarl_parallel_state_kwargs(megatron_cfg):
    """What megarl's engine passes to megatron-core's initialize_model_parallel (parallel.py init_role_parallel_state)."""
    layout = role_layout(megatron_cfg, "actor")
    return dict(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                virtual_pipeline_model_parallel_size=layout.vpp_or_none, context_parallel_size=layout.cp,
                expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp)


@pytest.mark.parametrize("engine", [dict(tp=2, pp=2, cp=2, ep=4), dict(tp=2, pp=4, vpp=2, ep=2, etp=2),
                                    dict(tp=4, vpp=1, etp=None)])
def test_engine_layout_is_the_parallel_state_megatron_lite_builds(engine):
    overrides = [f"actor_rollout_ref.actor.engine.{k}={'null' if v is None else v}" for k, v in engine.items()]
    config = load_config(None, [*MLITE, *ARGS, *overrides])
    assert _megarl_parallel_state_kwargs(config.actor_rollout_ref.actor.megatron) == _mlite_parallel_state_kwargs(**engine)


def test_megatron_actor_etp_default_differs_from_mlite():
    """ETP unset: megarl's megatron actor (verl's megatron.yaml null) takes TP, Megatron Lite's 1."""
    megatron = load_config(None, [*ARGS, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    mlite = load_config(None, [*MLITE, *ARGS, "actor_rollout_ref.actor.engine.tp=2"])
    assert _megarl_parallel_state_kwargs(megatron.actor_rollout_ref.actor.megatron)["expert_tensor_parallel_size"] == 2
    assert _megarl_parallel_state_kwargs(mlite.actor_rollout_ref.actor.megatron)["expert_tensor_parallel_size"] == 1


def test_offload_and_optimizer_are_megatron_lite_s():
    """engine.optimizer_offload / override_optimizer_config.offload_fraction: Megatron Lite's megatron-core optimizer
    (megatron_wrap.build_dist_opt_optimizer_config: offload > 0 adds the three CPU-offload fields, distributed
    optimizer always); param_offload moves the gradients too (MegatronLiteEngine.initialize: grad=param_offload)."""
    import torch

    config = load_config(None, [*MLITE, *ARGS, "actor_rollout_ref.actor.engine.param_offload=True",
                                "actor_rollout_ref.actor.engine.optimizer_offload=True",
                                "+actor_rollout_ref.actor.engine.impl_cfg.optimizer=dist_opt",
                                "+actor_rollout_ref.actor.optim.override_optimizer_config.offload_fraction=0.5"])
    actor = config.actor_rollout_ref.actor
    assert (actor.megatron.param_offload, actor.megatron.grad_offload, actor.megatron.optimizer_offload) == (True,) * 3
    kwargs = optimizer_kwargs(actor.optim, torch.bfloat16, actor.megatron.use_distributed_optimizer, False,
                              optimizer_config_fields(), "actor_rollout_ref.actor")
    assert {k: kwargs[k] for k in ("use_distributed_optimizer", "optimizer_offload_fraction", "optimizer_cpu_offload",
                                   "overlap_cpu_optimizer_d2h_h2d")} == {
        "use_distributed_optimizer": True, "optimizer_offload_fraction": 0.5, "optimizer_cpu_offload": True,
        "overlap_cpu_optimizer_d2h_h2d": True}


# Megatron Lite's attention backends: (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN), runtime.py
# `_apply_attention_backend_env`, transcribed
_MLITE_NVTE = {"auto": ("1", "1", "1"), "flash": ("1", "0", "0"), "fused": ("0", "1", "0"), "unfused": ("0", "0", "1"),
               "local": ("0", "0", "0")}


@pytest.mark.parametrize("backend", [None, *_MLITE_NVTE])
def test_attention_backend_sets_what_megatron_lite_sets(backend, monkeypatch):
    """megarl's override_transformer_config.attention_backend, given to megatron-core's own
    LanguageModule._set_attention_backend, sets the transformer-engine variables Megatron Lite sets (no key:
    Megatron Lite's default, flash)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    given = [] if backend is None else [f"actor_rollout_ref.actor.engine.attention_backend_override={backend}"]
    config = load_config(None, [*MLITE, *ARGS, *given])
    fields = transformer_config_fields()
    kwargs = apply_overrides({}, config.actor_rollout_ref.actor.megatron.override_transformer_config,
                             prefix="p", fields=fields, derived={}, sources={})
    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    for name in names:  # megatron sets them in os.environ: restored (or removed) after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    from megatron.core.transformer import TransformerConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig) if f.default is not dataclasses.MISSING}
    # megatron-core 0.19 also reads fields such as flash_attention_version: the config's defaults, then megarl's
    LanguageModule._set_attention_backend(types.SimpleNamespace(config=types.SimpleNamespace(**{**defaults, **kwargs})))
    assert tuple(os.environ[n] for n in names) == _MLITE_NVTE[backend or "flash"]


def test_recompute_full_is_every_layer_whole():
    """Megatron Lite's recompute=[full] checkpoints each layer whole (primitive/recompute.py apply_recompute:
    wrap_checkpoint(layer) for every layer): megatron-core's full granularity, uniform chunks of one layer."""
    config = load_config(None, [*MLITE, *ARGS, "+actor_rollout_ref.actor.engine.impl_cfg.recompute=[full]"])
    overrides = config.actor_rollout_ref.actor.megatron.override_transformer_config
    assert {k: overrides[k] for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")} == {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    selective = load_config(None, [*MLITE, *ARGS, "+actor_rollout_ref.actor.engine.impl_cfg.recompute=[core_attn,moe]"])
    overrides = selective.actor_rollout_ref.actor.megatron.override_transformer_config
    assert (overrides["recompute_granularity"], overrides["recompute_modules"]) == ("selective", ["core_attn", "moe"])


def test_mlite_ref_mirrors_the_actor_and_offloads():
    """ref/mlite_ref.yaml: the actor's tp/pp/cp/ep/etp, param_offload true by default."""
    config = load_config(None, [*MLITE, *ARGS, "ref@actor_rollout_ref.ref=mlite_ref", "actor_rollout_ref.actor.engine.tp=2",
                                "actor_rollout_ref.actor.engine.ep=2", "actor_rollout_ref.ref.engine.pp=2"])
    ref = config.actor_rollout_ref.ref.megatron
    assert _megarl_parallel_state_kwargs(ref) == _mlite_parallel_state_kwargs(tp=2, ep=2, pp=2)
    assert ref.param_offload


def test_mlite_ref_beside_a_megatron_actor_takes_megatron_lite_s_defaults():
    """mlite_ref.yaml reads actor_rollout_ref.actor.engine.* (oc.select, default 1), which a megatron actor lacks."""
    config = load_config(None, [*MLITE[:1], *ARGS, "ref@actor_rollout_ref.ref=mlite_ref",
                                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    assert _megarl_parallel_state_kwargs(config.actor_rollout_ref.ref.megatron) == _mlite_parallel_state_kwargs()


def test_sft_engine_mlite_is_the_actors_engine():
    config = load_config(None, ["hydra.searchpath=[pkg://verl_mlite.config]", "engine=mlite", "engine.tp=2",
                                "engine.cp=2", "model.path=/m"], verl_sft=True)
    assert _megarl_parallel_state_kwargs(config.actor_rollout_ref.actor.megatron) == _mlite_parallel_state_kwargs(tp=2, cp=2)


@pytest.mark.parametrize("overrides, message", [
    (["actor@actor_rollout_ref.actor=mlite_actor"], "mlite_actor is Megatron Lite's, found with hydra.searchpath"),
    ([*MLITE[:1], "actor@actor_rollout_ref.actor=big_actor"],
     "'big_actor' is not an option of verl's actor@actor_rollout_ref.actor (options: dp_actor, megatron_actor, "
     "torchtitan_actor, veomni_actor, mlite_actor)"),
    (["actor@actor_rollout_ref.actor=dp_actor"], "megarl trains with Megatron only"),
    (["hydra.searchpath=[pkg://other.config]"], "not pkg://other.config"),
    (["actor_rollout_ref.actor.engine.tp=2"], "engine.* keys only with Megatron Lite's config (actor@actor_rollout_ref.actor=mlite_actor)"),
    ([*MLITE, "+actor_rollout_ref.actor.engine.impl_cfg.optimizer=adam"], "Megatron Lite's optimizers are dist_opt and fsdp2"),
    ([*MLITE, "actor_rollout_ref.actor.engine.impl_cfg.use_thd=False"], "THD-packed sequences only"),
    ([*MLITE, "actor_rollout_ref.actor.engine.attention_backend_override=magi"], "MagiAttention is not built"),
    ([*MLITE, "+actor_rollout_ref.actor.engine.impl_cfg.recompute=[router]"], "router: no megatron-core recompute"),
    (["trainer.use_legacy_worker_impl=sometimes"], "verl accepted auto, enable or disable"),
    ([*MLITE, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], "has no megatron group"),
    ([*MLITE, "actor_rollout_ref.actor.engine.model_name=kimi_k2"], "megarl accepts auto only"),
    ([*MLITE, "actor_rollout_ref.actor.engine.tpp=2"], "not a key of Megatron Lite's engine config"),
])
def test_refusals_name_the_override_and_the_reason(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [*ARGS, *overrides])
    assert message in str(info.value)


def test_accepted_without_meaning_warn_once(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_config(None, [*MLITE, *ARGS, "trainer.use_legacy_worker_impl=disable",
                                    "critic@critic=megatron_critic"])
    lines = [r.getMessage() for r in caplog.records]
    assert sum("trainer.use_legacy_worker_impl=disable" in line for line in lines) == 1
    assert sum("hydra.searchpath" in line for line in lines) == 1
    text = to_yaml(config)  # `megarl config show`: megarl's keys only, each value once
    assert not re.search(r"^\s*engine:", text, re.MULTILINE) and "mlite" not in text
    assert text.count("context_parallel_size") == 5  # actor, ref, critic, reward model, OPD teacher
    assert text.count("expert_tensor_parallel_size: 1") == 1  # the actor's, Megatron Lite's etp default
