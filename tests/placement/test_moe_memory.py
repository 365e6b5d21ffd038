"""`megarl plan`'s model of an MoE: total and active parameters of Qwen3-30B-A3B's real config.json
against the model card (30.5 B total, 3.3 B activated), experts split over EP x ETP ranks in
training and over a rollout server's EP x MoE TP ranks."""
import json
from pathlib import Path

import pytest

from megarl.bridge import arch_from_hf_config
from megarl.config.schema import MegatronConfig
from megarl.placement.colocation import OffloadParts
from megarl.placement.memory import (
    _train_role,
    active_params,
    kv_elements_per_token_layer,
    server_gpu_params,
    stage_expert_params,
    stage_params,
    total_params,
)

CONFIG = Path(__file__).resolve().parents[2] / "configs/recipes/models/qwen3-30b-a3b/config.json"


@pytest.fixture(scope="module")
def arch():
    return arch_from_hf_config(json.loads(CONFIG.read_text()), source=str(CONFIG))


def test_qwen3_30b_a3b_total_and_active_parameters_match_the_model_card(arch):
    # huggingface.co/Qwen/Qwen3-30B-A3B: "Number of Parameters: 30.5B in total and 3.3B activated"
    assert total_params(arch) / 1e9 == pytest.approx(30.5, abs=0.05)
    assert active_params(arch) / 1e9 == pytest.approx(3.3, abs=0.06)  # 3.353 B; the card rounds to 3.3


def test_experts_are_split_over_expert_parallel_ranks(arch):
    """bf16 weights per GPU = dense / TP + experts / (EP x ETP), by hand; optimizer states of the
    experts over expert-DP = TP x DP / (EP x ETP) ranks with the distributed optimizer."""
    dense, experts = stage_params(arch, 1), stage_expert_params(arch, 1)
    assert dense + experts == total_params(arch)
    m = MegatronConfig(tensor_model_parallel_size=2, expert_model_parallel_size=8, expert_tensor_parallel_size=1)
    role = _train_role("actor", arch, m, dp=4, dtype="bfloat16", seq=1024, micro=1, trains=True, offload=OffloadParts())
    params = dense / 2 + experts / 8
    optimizer = dense / 2 * 12 / 4 + experts / 8 * 12 / 1  # expert-DP = 2 x 4 / 8 = 1
    assert role.states == int(params * 2 + params * 4 + optimizer)


def test_fsdp2_shards_the_experts_over_expert_dp(arch):
    """Qwen3-30B-A3B with FSDP2 at TP 1, EP 4, DP 8 (8 GPUs; megarl.engines.megatron.fsdp2 shards the experts
    over megatron's expert-DP group, TP x DP / (EP x ETP) = 2 ranks, the rest over DP = 8), by hand from
    config.json: an expert is gate, up [768, 2048] and down [2048, 768], 128 a layer, 48 layers; a GPU holds
    32 experts a layer (EP 4) in halves over expert DP 2, and 16 bytes each of its shards' parameters;
    the root (untied embedding and head [151936, 2048], final norm) and one layer whole in bf16: the layer's
    attention, norms and router, and its 32 experts."""
    from megarl.placement.memory import fsdp2_states

    expert = 3 * 2048 * 768
    experts = 48 * 128 * expert
    dense = total_params(arch) - experts
    root = 2 * 151936 * 2048 + 2048
    layer = (dense - root) / 48 + 32 * expert  # one layer outside its experts, and this rank's experts of it
    m = MegatronConfig(expert_model_parallel_size=4, use_torch_fsdp2=True)
    shards = dense / 8 + experts / 4 / 2
    assert fsdp2_states(arch, m, 8, "bfloat16", dense, experts / 4) == shards * 16 + (root + layer) * 2 + layer * 4
    role = _train_role("actor", arch, m, dp=8, dtype="bfloat16", seq=1024, micro=1, trains=True,
                       offload=OffloadParts(params=True, grads=True, optimizer=True))
    assert role.states == int(shards * 16 + (root + layer) * 2 + layer * 4)
    assert (role.offloadable, role.offloadable_params) == (int(shards * 16), int(shards * 4))


def test_a_rollout_server_gpu_holds_whole_experts_at_ep_and_the_same_bytes(arch):
    """SGLang 0.5.23, a server of TP 4: the dense part / 4; at EP e, 128 / e whole experts per layer
    (fused_moe_triton/layer.py: num_local_experts = E / ep_size), each over MoE TP = 4 / e GPUs
    (runtime_context.derive_parallel_widths). By hand from config.json: an expert is gate, up
    [768, 2048] and down [2048, 768]. EP x MoE TP = TP, so a GPU's bytes do not change with EP."""
    expert = 3 * 2048 * 768
    dense = total_params(arch) - 48 * 128 * expert
    for ep, whole in ((1, 128), (2, 64), (4, 32)):
        assert server_gpu_params(arch, 4, ep) == dense / 4 + 48 * whole * expert / (4 // ep)
        assert server_gpu_params(arch, 4, ep) == pytest.approx(total_params(arch) / 4, rel=1e-12)


def test_the_plan_counts_a_server_gpus_weights_in_the_push_phase(arch):
    """The recipe's colocated push phase holds each server GPU's resumed weights (bf16)."""
    from megarl.config import load_and_validate
    from megarl.placement import plan_from_config
    from megarl.placement.memory import estimate

    config = load_and_validate(CONFIG.parents[2] / "grpo_qwen3_30b_a3b.yaml", ["actor_rollout_ref.rollout.expert_parallel_size=4"])
    est = estimate(plan_from_config(config), config, arch)
    assert est.server_weights == int(server_gpu_params(arch, 4, 4) * 2)
    assert 14.2 < est.server_weights / 2**30 < 14.3  # 30.5 B / 4 x 2 bytes


def test_attention_dp_keeps_each_groups_attention_whole_over_its_attention_tp(arch):
    """With --attn-dp-size d a layer's attention is split over a group's TP / d ranks (SGLang 0.5.23
    models/qwen3_moe.py: qkv and output projections in parallel_group "attn_tp"), the rest as at d = 1.
    By hand from config.json: attention = q [4096, 2048] + k, v [512, 2048] each + o [2048, 4096] + two
    norms of 2048 (32 heads and 4 KV groups of 128), 48 layers. The recipe's push phase counts it, and a
    step's KV per GPU stays the same here (d groups of R / d responses, KV heads 4 / (4 / d) each)."""
    from megarl.config import load_and_validate
    from megarl.placement import plan_from_config
    from megarl.placement.memory import estimate

    attention = 48 * (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 2048)
    assert server_gpu_params(arch, 4, 4, attn_dp=1) == server_gpu_params(arch, 4, 4)
    for d in (2, 4):
        assert server_gpu_params(arch, 4, 4, attn_dp=d) - server_gpu_params(arch, 4, 4) == pytest.approx(
            attention / (4 // d) - attention / 4, rel=1e-12)
    recipe = CONFIG.parents[2] / "grpo_qwen3_30b_a3b.yaml"
    plain = load_and_validate(recipe, ["actor_rollout_ref.rollout.expert_parallel_size=4"])
    attn_dp = load_and_validate(recipe, ["actor_rollout_ref.rollout.expert_parallel_size=4",
                                         "actor_rollout_ref.rollout.attention_data_parallel_size=2"])
    est_plain, est = (estimate(plan_from_config(c), c, arch) for c in (plain, attn_dp))
    assert est.server_weights == int(server_gpu_params(arch, 4, 4, attn_dp=2) * 2)
    assert est.server_weights - est_plain.server_weights == pytest.approx(attention / 4 * 2, abs=2)
    assert est.kv_cache_needed_per_server == est_plain.kv_cache_needed_per_server


def deepseek_v3_arch():
    """DeepSeek-V3 as transformers' DeepseekV3Config defaults describe it (its published sizes: 61 layers,
    hidden 7168, 256 routed experts of width 2048 + 1 shared, top-8, MLA ranks 1536 / 512, 3 dense layers)."""
    import transformers

    return arch_from_hf_config(transformers.DeepseekV3Config().to_dict())


def test_deepseek_v3_parameter_counts_are_the_published_ones():
    """DeepSeek's README_WEIGHTS.md: the main model (no MTP module) has 671B parameters, 36.6B activated
    per token (the output head included; the input embedding is a lookup, not counted)."""
    arch = deepseek_v3_arch()
    assert round(total_params(arch) / 1e9) == 671
    assert round((active_params(arch) - arch.vocab_size * arch.hidden_size) / 1e9, 1) == 36.6


def test_mla_kv_cache_is_the_latent_whole_on_every_tp_rank():
    """SGLang's MLATokenToKVPool keeps kv_lora_rank + qk_rope_head_dim = 576 elements per token and layer,
    not split over TP."""
    arch = deepseek_v3_arch()
    assert kv_elements_per_token_layer(arch, 1) == kv_elements_per_token_layer(arch, 8) == 512 + 64


def test_fsdp2_shards_every_state_over_dp_and_keeps_the_root_and_a_layer_whole():
    """Qwen2.5-7B-Instruct (verl's run_qwen2-7b_math_megatron_fsdp.sh: TP 4, Megatron-FSDP, 8 GPUs: DP 2), by
    hand from its config.json: 28 layers of attention (q [3584, 3584] + bias, k and v [512, 3584] + bias, o
    [3584, 3584]), two norms and the MLP (gate, up [18944, 3584], down [3584, 18944]); untied embedding and head
    [152064, 3584], a final norm. FSDP2 holds 16 bytes a parameter / DP (float32 shards of the weights, their
    gradients and Adam's moments), the root (embedding, head, final norm) and one layer whole in bf16, that
    layer's float32 gradient; megatron's DDP with its distributed optimizer holds bf16 weights, float32
    gradients and 12 bytes a parameter / DP of optimizer state."""
    from megarl.placement.memory import fsdp2_states

    config = json.loads((CONFIG.parents[1] / "qwen2.5-7b-instruct/config.json").read_text())
    arch = arch_from_hf_config(config, source="qwen2.5-7b-instruct")
    hidden, ffn, vocab, kv = 3584, 18944, 152064, 512
    layer = (2 * hidden * hidden + hidden) + 2 * (kv * hidden + kv) + 2 * hidden + 3 * hidden * ffn
    root = 2 * vocab * hidden + hidden
    params = (28 * layer + root) / 4
    m = MegatronConfig(tensor_model_parallel_size=4, use_megatron_fsdp=True)
    assert fsdp2_states(arch, m, 2, "bfloat16", params) == params * 16 / 2 + (root + layer) / 4 * 2 + layer / 4 * 4
    role = _train_role("actor", arch, m, dp=2, dtype="bfloat16", seq=1024, micro=1, trains=True, offload=OffloadParts())
    assert role.states == int(params * 16 / 2 + (root + layer) / 4 * 2 + layer / 4 * 4)
    assert role.offloadable == 0
    # offloaded (engines.megatron.offload): the shards, 4 bytes a parameter / DP for the weights and the gradients
    # each, 8 for Adam's moments; the weights' part leaves after the push
    offloaded = _train_role("actor", arch, m, dp=2, dtype="bfloat16", seq=1024, micro=1, trains=True,
                            offload=OffloadParts(params=True, grads=True, optimizer=True))
    assert (offloaded.offloadable, offloaded.offloadable_params) == (int(params * 16 / 2), int(params * 4 / 2))
    staged = _train_role("actor", arch, m, dp=2, dtype="bfloat16", seq=1024, micro=1, trains=True,
                         offload=OffloadParts(grads=True, optimizer=True))
    assert (staged.offloadable, staged.offloadable_params) == (int(params * 12 / 2), 0)
    ddp = _train_role("actor", arch, MegatronConfig(tensor_model_parallel_size=4), dp=2, dtype="bfloat16", seq=1024,
                      micro=1, trains=True, offload=OffloadParts())
    assert ddp.states == int(params * 2 + params * 4 + params * 12 / 2)
    assert role.activations == ddp.activations
    assert role.states < ddp.states
