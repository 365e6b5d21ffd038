"""MoE checkpoints (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) through real megatron-core
MoE layers with expert parallelism (CPU, gloo, 4 processes): HF -> megatron -> HF bit-exact and
megatron logits equal to HF's own model (fp32) at TP1/EP2, TP2/EP2 (ETP 1 and 2) and PP2/EP2.
"""
import pytest
import torch

from megarl.bridge import ConversionError, ParallelLayout, arch_from_hf_config, check_layout, merge_model
from megarl.bridge.moe import moe_from_hf_config
from megarl.engines.megatron.cpu import run_gloo_workers
from moe_world import CASES, layout_of, weights_for, world
from tiny_hf import INPUT_IDS, hf_tensors, logits, randomise_norms_and_biases, save_tokenizer

pytestmark = pytest.mark.slow  # one 4-process megatron world for the module

COMMON = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.1, num_experts_per_tok=2)
MOE_VARIANTS = {
    # Qwen3-30B-A3B's routing: softmax, top-k, renormalised; q/k norms; head_dim * heads != hidden
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32)),
    # no renormalisation (megatron pre-softmax routing), q/k/v bias, a sigmoid-gated shared expert, tied
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=False,
                                         shared_expert_intermediate_size=48, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, intermediate_size=32)),
}


def make_moe_model(variant: str, seed: int):
    """The fp32 HF model of `variant`; norms and biases randomised (HF sets them to 1 and 0)."""
    import transformers

    class_name, kwargs = MOE_VARIANTS[variant]
    config = getattr(transformers, class_name)(**{**COMMON, **kwargs})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return randomise_norms_and_biases(model).eval()


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    cases = {}
    for seed, variant in enumerate(MOE_VARIANTS):
        model = make_moe_model(variant, seed)
        model.save_pretrained(root / variant)  # per-expert names on disk, as the hub has them
        save_tokenizer(root / variant)
        cases[variant] = dict(hf_dir=root / variant, input_ids=INPUT_IDS, hf_logits=logits(model))
    ranks = run_gloo_workers(world, 4, args=(cases,), timeout_s=400)
    print("MoE megatron world, rank 0, seconds since start:", ranks[0]["seconds"])
    merged = {field: {k: v for r in ranks for k, v in r[field].items()}
              for field in ("state_dicts", "logit_diffs", "negative_diffs")}
    return cases, merged


@pytest.mark.parametrize("variant, layout", CASES, ids=[f"{v}-TP{t[0]}-PP{t[1]}-EP{t[2]}-ETP{t[3] or t[0]}" for v, t in CASES])
def test_moe_round_trip_through_real_megatron_is_bit_exact(variant, layout, moe_run):
    """HF files -> shards -> megatron MoE chunks (strict load) -> their state dicts -> merge -> HF."""
    cases, result = moe_run
    lay = layout_of(layout)
    shards = {key: sd for (name, t, key), sd in result["state_dicts"].items() if name == variant and t == layout}
    assert set(shards) <= set(lay.rank_keys())
    weights = weights_for(cases[variant]["hf_dir"], lay.tp)
    back = {h: t for name, full in merge_model(weights, shards, lay).items() for h, t in weights.to_hf(name, full)}
    hf = hf_tensors(cases[variant]["hf_dir"])
    assert back.keys() == hf.keys()
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name


@pytest.mark.parametrize("variant, layout", CASES, ids=[f"{v}-TP{t[0]}-PP{t[1]}-EP{t[2]}-ETP{t[3] or t[0]}" for v, t in CASES])
def test_moe_megatron_logits_equal_hf_logits(variant, layout, moe_run):
    """HF's own model (experts fused in memory) is the oracle; fp32, 1e-5."""
    _, result = moe_run
    assert result["logit_diffs"][(variant, layout)] <= 1e-5


@pytest.mark.parametrize("control", ["experts_on_the_wrong_ep_rank", "unnormalised_top_k"])
def test_moe_negative_controls_break_the_logit_test(control, moe_run):
    """Experts loaded on the other EP rank, or Qwen3's renormalised top-k routed without
    renormalisation: the same load and forward path then misses HF's logits by far."""
    _, result = moe_run
    assert result["logit_diffs"][("qwen3_moe", (1, 1, 2, 0))] <= 1e-5
    assert result["negative_diffs"][control] > 1e-3


def test_moe_layouts_megatron_gets_wrong_are_rejected():
    config = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    with pytest.raises(ConversionError, match="etp=1 differs from tp=2 with ep=1"):
        ParallelLayout(tp=2, etp=1)
    arch = arch_from_hf_config({**COMMON, **config, "max_position_embeddings": 64, "rope_theta": 1e4})
    with pytest.raises(ConversionError, match="num_experts=8 is not a multiple of ep=3"):
        check_layout(arch, ParallelLayout(ep=3))
    with pytest.raises(ConversionError, match="mlp_only_layers"):
        moe_from_hf_config({**config, "mlp_only_layers": [0]}, "qwen", "config.json")
    dense = arch_from_hf_config({**COMMON, "model_type": "qwen3", "max_position_embeddings": 64, "rope_theta": 1e4})
    with pytest.raises(ConversionError, match="needs an MoE model"):
        check_layout(dense, ParallelLayout(ep=2))
