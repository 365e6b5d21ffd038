"""LoRA parts without a process group: the fused-layer layout of the adapters' merged weights
against the bridge's own HF -> megatron transforms, the PEFT names, and the TE decision."""
import math
import zlib

import torch

from megarl.bridge import arch_from_hf_config, load_hf_config
from megarl.bridge.lora import AdapterName, is_lora_param, parse
from megarl.bridge.sharding import shard_tp
from megarl.bridge.transforms import merge_gate_up, merge_qkv
from megarl.engines.megatron.lora import LoraAdapter, LoraSpec, builds_with_transformer_engine, refuse_expert_targets


def _adapter(arch, kind, targets, tp, tp_rank):
    spec = LoraSpec(rank=3, alpha=6.0, targets=tuple(targets))
    adapter = LoraAdapter(kind, 1, targets, spec, arch, tp, tp_rank, seed=0, dtype=torch.float32,
                          device=torch.device("cpu"))
    g = torch.Generator().manual_seed(tp_rank)
    with torch.no_grad():
        for name, p in adapter.named_parameters():  # B is 0 at init: give every factor values
            p.copy_(torch.randn(p.shape, generator=g))
    return adapter


def test_merged_qkv_and_fc1_deltas_follow_the_bridges_layout(tiny_models):
    arch = arch_from_hf_config(load_hf_config(tiny_models["qwen2"]))
    nh, ng, d = arch.num_attention_heads, arch.num_query_groups, arch.kv_channels
    for tp in (1, 2):
        for rank in range(tp):
            qkv = _adapter(arch, "qkv", ["q_proj", "v_proj"], tp, rank)  # k not adapted: its rows stay 0
            full = {}
            for t in ("q_proj", "v_proj"):
                a, b = qkv.factors(t)
                full[t] = 2.0 * b @ a  # this rank's rows of scale x B A in HF order
            k_rows = torch.zeros(ng // tp * d, arch.hidden_size)
            # the bridge's merge_qkv on this rank's groups (TP splits whole query groups) is the oracle
            expected = merge_qkv(full["q_proj"], k_rows, full["v_proj"], nh // tp, ng // tp, d)
            torch.testing.assert_close(qkv.delta_weight(), expected)
            fc1 = _adapter(arch, "fc1", ["gate_proj", "up_proj"], tp, rank)
            gate, up = (2.0 * fc1.factors(t)[1] @ fc1.factors(t)[0] for t in ("gate_proj", "up_proj"))
            torch.testing.assert_close(fc1.delta_weight(), merge_gate_up(gate, up))


def test_row_parallel_adapters_split_a_and_start_the_same_at_every_tp(tiny_models):
    arch = arch_from_hf_config(load_hf_config(tiny_models["qwen2"]))
    spec = LoraSpec(rank=3, alpha=6.0, targets=("down_proj",))
    whole = LoraAdapter("row", 1, ["down_proj"], spec, arch, 1, 0, 0, torch.float32, torch.device("cpu"))
    for rank in range(2):
        half = LoraAdapter("row", 1, ["down_proj"], spec, arch, 2, rank, 0, torch.float32, torch.device("cpu"))
        assert torch.equal(half.down_proj_A, shard_tp(AdapterName(1, "down_proj", "A").tp, whole.down_proj_A, 2, rank))
        assert half.down_proj_A.shape == (3, arch.ffn_hidden_size // 2) and half.down_proj_A.partition_dim == 1
        assert torch.equal(half.down_proj_B, torch.zeros(arch.hidden_size, 3))  # B = 0: the model starts as the base


def test_names():
    name = "module.decoder.layers.7.self_attention.linear_qkv_lora.k_proj_B"
    assert is_lora_param(name) and not is_lora_param("decoder.layers.7.self_attention.linear_qkv.weight")
    assert parse(name).peft == "base_model.model.model.layers.7.self_attn.k_proj.lora_B.weight"
    assert parse(name).hf_base == "model.layers.7.self_attn.k_proj.weight"


def test_a_lora_role_never_uses_transformer_engine_layers():
    assert builds_with_transformer_engine(True, local_linears=False)
    assert not builds_with_transformer_engine(True, local_linears=True)
    assert not builds_with_transformer_engine(False, local_linears=False)


def test_lora_on_the_experts_of_a_moe_model_is_refused_naming_the_key(tmp_path, tiny_models):
    import pytest

    from megarl.data.tiny_model import make_tiny_model

    make_tiny_model("qwen3_moe", tmp_path / "moe", seed=0)
    moe = arch_from_hf_config(load_hf_config(tmp_path / "moe"))
    with pytest.raises(NotImplementedError, match=r"lora.target_modules: \['gate_proj', 'down_proj'\]"):
        refuse_expert_targets(moe, ("q_proj", "gate_proj", "down_proj"))
    refuse_expert_targets(moe, ("q_proj", "k_proj", "v_proj", "o_proj"))  # attention only: allowed
    refuse_expert_targets(arch_from_hf_config(load_hf_config(tiny_models["qwen2"])), ("gate_proj", "down_proj"))


def test_dropout_is_peft_lora_dropout_in_training_and_off_in_eval(tiny_models, monkeypatch):
    """`lora.dropout`: in a training pass the adapter adds s B A dropout(x) with the mask PEFT's
    own LoRA layer draws from the same generator state (the oracle: `peft` on an nn.Linear with
    the same factors); in eval mode (the engine's log-prob passes) it adds s B A x exactly."""
    from megatron.core.tensor_parallel import mappings
    from peft import LoraConfig, get_peft_model

    def tp1_mapping_double(x):  # megatron's TP mappings at TP1 (no process group here): identities
        return x

    monkeypatch.setattr(mappings, "reduce_from_tensor_model_parallel_region", tp1_mapping_double)
    monkeypatch.setattr(mappings, "copy_to_tensor_model_parallel_region", tp1_mapping_double)
    arch = arch_from_hf_config(load_hf_config(tiny_models["qwen2"]))
    spec = LoraSpec(rank=3, alpha=6.0, targets=("o_proj",), dropout=0.4)
    adapter = LoraAdapter("row", 1, ["o_proj"], spec, arch, 1, 0, 0, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        adapter.o_proj_B.copy_(torch.randn(adapter.o_proj_B.shape, generator=torch.Generator().manual_seed(3)))
    a, b = adapter.factors("o_proj")

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.o_proj = torch.nn.Linear(a.shape[1], b.shape[0], bias=False)

    peft = get_peft_model(One(), LoraConfig(r=3, lora_alpha=6.0, lora_dropout=0.4, target_modules=["o_proj"]))
    layer = peft.base_model.model.o_proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(a)
        layer.lora_B["default"].weight.copy_(b)
    x = torch.randn(5, a.shape[1], generator=torch.Generator().manual_seed(4))
    base = layer.base_layer(x).detach()

    for training in (True, False):
        adapter.train(training)
        peft.train(training)
        torch.manual_seed(11)
        ours = adapter(x).detach()
        torch.manual_seed(11)
        theirs = layer(x).detach() - base
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        exact = 2.0 * (x @ a.T) @ b.T
        if training:
            assert (ours - exact).abs().max() > 1e-3  # the mask changed the output
        else:
            assert torch.equal(ours, adapter(x).detach())  # eval is deterministic
            torch.testing.assert_close(ours, exact, rtol=1e-5, atol=1e-6)


def test_xavier_init_of_a_is_megatron_bridges_and_reaches_every_tp_layout(tiny_models):
    """verl's Megatron LoRA default, lora_A_init_method=xavier: Megatron-Bridge's ParallelLinearAdapter
    initialises A with nn.init.xavier_normal_, N(0, std^2) with std = sqrt(2 / (fan_in + fan_out)) = sqrt(2 /
    (in + r)) for A [r, in]. Drawn from the adapter's seeded generator, sharded like kaiming's A."""
    from megarl.config import load_and_validate
    from megarl.engines.megatron.lora import initial_factor
    from megarl.engines.megatron.roles import lora_spec

    arch = arch_from_hf_config(load_hf_config(tiny_models["qwen2"]))
    rank = 64
    name = AdapterName(1, "gate_proj", "A")
    a = initial_factor(name, arch, rank, seed=5, init_A="xavier")
    inp = arch.hidden_size
    assert a.shape == (rank, inp)
    std = math.sqrt(2 / (inp + rank))  # hand-computed: 0.102 for in 128, r 64
    assert abs(a.mean().item()) < 0.05 * std and abs(a.std().item() / std - 1) < 0.05  # 8192 draws: ~1% noise
    beyond = (a.abs() > 2 * std).double().mean().item()
    assert 0.035 < beyond < 0.06  # a normal's 4.55%; a uniform of that std never passes 1.73 std
    generator = torch.Generator().manual_seed(5 + zlib.crc32(name.mcore.encode()))  # the adapter's own seed
    assert torch.equal(a, torch.nn.init.xavier_normal_(torch.empty(rank, inp), generator=generator))
    kaiming = initial_factor(name, arch, rank, seed=5)
    assert kaiming.abs().max() <= inp ** -0.5 and not torch.equal(kaiming, a)  # the default stays PEFT's

    spec = LoraSpec(rank=3, alpha=6.0, targets=("down_proj",), init_A="xavier")
    whole = LoraAdapter("row", 1, ["down_proj"], spec, arch, 1, 0, 0, torch.float32, torch.device("cpu"))
    down_a = AdapterName(1, "down_proj", "A")
    assert torch.equal(whole.down_proj_A, initial_factor(down_a, arch, 3, 0, "xavier"))
    for tp_rank in range(2):
        half = LoraAdapter("row", 1, ["down_proj"], spec, arch, 2, tp_rank, 0, torch.float32, torch.device("cpu"))
        assert torch.equal(half.down_proj_A, shard_tp(down_a.tp, whole.down_proj_A, 2, tp_rank))
    # verl's key, under verl's name
    config = load_and_validate(None, ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet",
                                      "actor_rollout_ref.model.lora.rank=8",
                                      "actor_rollout_ref.model.lora.lora_A_init_method=xavier"])
    assert lora_spec(config.actor_rollout_ref.model.lora).init_A == "xavier"
