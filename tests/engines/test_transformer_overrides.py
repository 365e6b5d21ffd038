"""The transformer overrides against megatron-core's own `TransformerConfig` (the installed version):
names are its dataclass fields, the config-time recompute check refuses what its __post_init__
refuses, and the engine's merge keeps what megarl derives while letting fusion defaults change.
CPU only, no process world."""
import dataclasses

import pytest
import torch
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.config.errors import ConfigError
from megarl.config.transformer_overrides import DTYPE_NAMES, GRADIENT_CHECKPOINTING, LAYOUT_NAMES, recompute_problems
from megarl.engines.megatron.model import derived_sources
from megarl.engines.megatron.transformer_overrides import apply_overrides, transformer_config_fields

PREFIX = "actor_rollout_ref.actor.megatron.override_transformer_config"
FIELDS = transformer_config_fields()
TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4)


def test_the_names_megarl_derives_and_sets_are_transformer_config_fields():
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(FIELDS) == names
    assert set(LAYOUT_NAMES) | set(DTYPE_NAMES) | set(GRADIENT_CHECKPOINTING) <= names
    assert set(derived_sources("critic")) <= names
    assert "use_flash_attn" not in names  # Megatron-LM's flag; megarl.config.verl_compat drops it


def _megatron_accepts(settings: dict) -> bool:
    try:
        TransformerConfig(**TINY, **settings)
    except (ValueError, AssertionError):
        return False
    return True


FULL = dict(recompute_granularity="full")
# recompute settings -> whether megarl's config check is stricter than megatron-core on purpose
CASES = [
    ({}, False),
    (FULL, False),
    ({**FULL, "recompute_method": "uniform"}, False),
    ({**FULL, "recompute_method": "uniform", "recompute_num_layers": 1}, False),
    ({**FULL, "recompute_method": "block", "recompute_num_layers": 2}, False),
    ({**FULL, "recompute_method": "chunk", "recompute_num_layers": 1}, False),
    ({"recompute_granularity": "partial"}, False),
    ({"recompute_granularity": "selective"}, False),
    ({"recompute_granularity": "selective", "recompute_num_layers": 1}, False),
    ({"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}, False),
    # megatron-core accepts 0 layers, but its uniform loop then never advances (0.16.1 transformer_block.py:532-542,
    # 0.19.2 recompute.py:157-166)
    ({**FULL, "recompute_method": "uniform", "recompute_num_layers": 0}, True),
    # megatron-core reads recompute_method only with a granularity; megarl refuses an unknown one anyway
    ({"recompute_method": "chunk"}, True),
]


@pytest.mark.parametrize("settings, stricter", CASES, ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_the_config_check_refuses_what_megatron_core_refuses(settings, stricter):
    accepted_by_megatron = _megatron_accepts(settings)
    accepted_by_megarl = not recompute_problems(PREFIX, settings, gradient_checkpointing=False)
    if stricter:
        assert accepted_by_megatron and not accepted_by_megarl
    else:
        assert accepted_by_megarl == accepted_by_megatron


def _apply(overrides, kwargs=None, derived=None):
    kwargs = dict(TINY, bias_activation_fusion=False) if kwargs is None else kwargs
    derived = dict(TINY) if derived is None else derived
    return apply_overrides(kwargs, overrides, prefix=PREFIX, fields=FIELDS, derived=derived,
                           sources=derived_sources("actor_rollout_ref.actor"))


def test_unknown_names_are_refused_naming_the_key_with_a_suggestion():
    with pytest.raises(ConfigError) as info:
        _apply({"recompute_granularty": "full", "not_a_field": 1})
    message = str(info.value)
    assert f"{PREFIX}.recompute_granularty: not a field of megatron-core's TransformerConfig " \
           "(did you mean 'recompute_granularity'?)" in message
    assert f"{PREFIX}.not_a_field: not a field" in message


def test_derived_values_may_be_repeated_not_changed_and_fusion_defaults_may_change():
    out = _apply({"num_layers": 4, "bias_activation_fusion": True, **GRADIENT_CHECKPOINTING})
    assert out["bias_activation_fusion"] is True and out["recompute_granularity"] == "full"
    TransformerConfig(**out)  # megatron-core takes the merged arguments
    with pytest.raises(ConfigError, match=rf"{PREFIX}.num_layers=2 conflicts with num_layers=4, which megarl sets "
                                          r"from the model's config.json"):
        _apply({"num_layers": 2})
    layout = dict(TINY, tensor_model_parallel_size=1, params_dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 conflicts with tensor_model_parallel_size=1, "
                                          r"which megarl sets from actor_rollout_ref.actor.megatron."
                                          r"tensor_model_parallel_size"):
        _apply({"tensor_model_parallel_size": 2}, layout, layout)


def test_an_enum_field_takes_its_member_name_as_verl_writes_it():
    assert isinstance(FIELDS["attention_backend"].default, AttnBackend)
    out = _apply({"attention_backend": "flash"})
    assert out["attention_backend"] is AttnBackend.flash
    assert TransformerConfig(**out).attention_backend is AttnBackend.flash
    with pytest.raises(ConfigError, match=rf"{PREFIX}.attention_backend=flashy: not one of .*flash"):
        _apply({"attention_backend": "flashy"})
