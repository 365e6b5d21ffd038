"""The MoE expert module on CPU (megatron-core's SequentialMLP) and the engine's checks around the
grouped-GEMM one (TEGroupedMLP, GPU only: right by reading, megarl.config.expert_mlp)."""
import functools
from types import SimpleNamespace

import pytest
import torch

from megarl.bridge import arch_from_hf_config
from megarl.bridge.megatron_config import layer_spec
from megarl.config import ConfigError
from megarl.config.schema import MegatronConfig
from megarl.engines.megatron.model import _mark_tensor_parallel, check_experts_built, moe_settings

MOE = dict(model_type="qwen3_moe", vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128,
           rope_theta=10000.0, num_experts=8, moe_intermediate_size=32, num_experts_per_tok=2)


def test_on_cpu_the_engine_runs_sequential_experts_and_refuses_grouped_gemm_by_key():
    arch = arch_from_hf_config(MOE)
    section = "actor_rollout_ref.actor"
    assert moe_settings(arch, MegatronConfig(), False, section)["moe_grouped_gemm"] is False  # auto
    assert moe_settings(arch, MegatronConfig(moe_grouped_gemm=False), False, section)["moe_grouped_gemm"] is False
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.megatron\.moe_grouped_gemm=true cannot run: "
                                          "the role trains on cpu"):
        moe_settings(arch, MegatronConfig(moe_grouped_gemm=True), False, section)


def module_and_submodules(spec):
    """(class, submodules) of a layer-spec entry: a `ModuleSpec` (megatron-core 0.16) or a
    `functools.partial(cls, submodules=...)` (0.19)."""
    if isinstance(spec, functools.partial):
        return spec.func, spec.keywords.get("submodules")
    return spec.module, spec.submodules


def test_the_local_spec_builds_sequential_experts_and_refuses_grouped_gemm():
    """megatron-core's local spec would take grouped GEMM as its legacy GroupedMLP."""
    arch = arch_from_hf_config(MOE)
    _, moe = module_and_submodules(layer_spec(arch).submodules.mlp)
    experts, _ = module_and_submodules(moe.experts)
    assert experts.__name__ == "SequentialMLP"
    with pytest.raises(ValueError, match="legacy GroupedMLP"):
        layer_spec(arch, transformer_engine=False, grouped_gemm=True)


class SequentialMLP:
    pass


class TEGroupedMLP:
    pass


class GroupedMLP:  # megatron-core 0.16's legacy grouped experts
    pass


def chunk_of(*experts):
    layers = [SimpleNamespace(layer_number=i + 1, mlp=SimpleNamespace() if e is None else SimpleNamespace(experts=e))
              for i, e in enumerate(experts)]
    return SimpleNamespace(decoder=SimpleNamespace(layers=layers))


def test_a_silent_fallback_to_another_expert_module_is_caught():
    check_experts_built(chunk_of(SequentialMLP(), SequentialMLP()), grouped=False)
    check_experts_built(chunk_of(TEGroupedMLP()), grouped=True)
    check_experts_built(chunk_of(None), grouped=True)  # a dense layer has no experts
    with pytest.raises(RuntimeError, match="layer 1: megatron-core built SequentialMLP experts, megarl decided TEGroupedMLP"):
        check_experts_built(chunk_of(TEGroupedMLP(), SequentialMLP()), grouped=True)
    with pytest.raises(RuntimeError, match="built GroupedMLP"):
        check_experts_built(chunk_of(GroupedMLP()), grouped=True)


def module_with(names: list) -> torch.nn.Module:
    """A module tree holding a [4, 4] parameter under each dotted name."""
    root = torch.nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(torch.zeros(4, 4)))
    return root


@pytest.mark.parametrize("spelling", ["grouped", "sequential"])
def test_tensor_parallel_tags_of_experts_follow_the_expert_tp_size_in_both_spellings(spelling):
    experts = ({"fc1": "decoder.layers.0.mlp.experts.linear_fc1.weight1", "fc2": "decoder.layers.0.mlp.experts.linear_fc2.weight1"}
               if spelling == "grouped" else
               {"fc1": "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
                "fc2": "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"})
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    for expert_tp, tagged in ((1, False), (2, True)):
        chunk = module_with([qkv, *experts.values()])
        _mark_tensor_parallel(chunk, expert_tp)
        params = dict(chunk.named_parameters())
        assert params[qkv].tensor_model_parallel and params[qkv].partition_dim == 0
        assert getattr(params[experts["fc1"]], "tensor_model_parallel", False) is tagged
        if tagged:  # fc1 column-, fc2 row-parallel over the expert-TP ranks
            assert (params[experts["fc1"]].partition_dim, params[experts["fc2"]].partition_dim) == (0, 1)
