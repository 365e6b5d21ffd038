"""DeepSeek-V3 (model_type deepseek_v3: also DeepSeek-V3.1 and Kimi-K2) and GLM-4.5 (glm4_moe) through real megatron-core
multi-latent attention and sigmoid-routed MoE layers (CPU, gloo, 4 processes), against HF's own
DeepseekV3ForCausalLM (fp32): a tiny model with odd shapes and every option of the family on (q LoRA,
key/value head dims that differ, YaRN with both mscales, a nonzero selection bias, group-limited top-k,
routed scaling, two shared experts, two dense first layers). The converter writes the keys megatron
saves; HF -> torch_dist -> megatron at TP2 x EP2 (ETP 2 and 1) and PP2 x EP2 gives HF's logits; what
megatron writes at those layouts exports back to HF bit for bit. GLM-4.5 the same, on its
Glm4MoeForCausalLM: grouped-query attention with q/k/v biases, q/k norms, partial rotary (half of each
head), the same router (selection bias, groups, scaling), a shared expert and a dense first layer.
"""
import pytest
import torch

from megarl.bridge import ConversionError, ParallelLayout, arch_from_hf_config, check_layout
from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf
from megarl.bridge.torch_dist_io import expected_objects, expected_tensors, te_moe_norm_key
from megarl.testing import run_gloo_workers
from mla_world import world
from moe_world import DIVISIBLE_BY, saved_dir, weights_for
from tiny_hf import INPUT_IDS, hf_tensors, randomise_norms_and_biases, save_tokenizer

pytestmark = pytest.mark.slow  # one 4-process megatron world for the module

CONFIG = dict(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6, initializer_range=0.1,
              q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
              n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
              routed_scaling_factor=2.5, first_k_dense_replace=2, norm_topk_prob=True, max_position_embeddings=256,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
                               "original_max_position_embeddings": 64})
GLM = dict(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6, initializer_range=0.1,
           attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
           n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=2, norm_topk_prob=True,
           max_position_embeddings=256,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
CONFIGS = {"deepseek_v3": ("DeepseekV3Config", CONFIG), "glm4_moe": ("Glm4MoeConfig", GLM)}
# (tp, pp, ep, etp), etp 0 meaning etp = tp; PP2 puts the dense layers on stage 0, the MoE ones on stage 1
LAYOUTS = [(2, 1, 2, 0), (2, 1, 2, 1), (1, 2, 2, 0)]


def make_model(seed: int = 0, family: str = "deepseek_v3", **overrides):
    """The fp32 HF model; norms and biases randomised, the routers' selection bias set to 0.1 N(0, 1) (HF: zeros)."""
    import transformers

    class_name, config = CONFIGS[family]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, class_name)(**{**config, **overrides}),
                                                          attn_implementation="eager")
    randomise_norms_and_biases(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model.eval()


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():  # one forward: no KV cache
        return model(INPUT_IDS, use_cache=False).logits


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    cases = {}
    for seed, family in enumerate(CONFIGS):
        model = make_model(seed, family)
        model.save_pretrained(root / family)  # per-expert names on disk, as the hub has them
        save_tokenizer(root / family)
        ckpt = convert_hf_to_torch_dist(root / family, root / f"{family}_mcore", ParallelLayout(ep=2),
                                        make_vocab_size_divisible_by=DIVISIBLE_BY).out
        cases[family] = dict(hf_dir=root / family, ckpt_dir=ckpt / "release", input_ids=INPUT_IDS,
                             hf_logits=hf_logits(model))
    ranks = run_gloo_workers(world, 4, args=(cases, LAYOUTS, str(root / "saved")), timeout_s=400)
    print("DeepSeek-V3 / GLM-4.5 megatron world, rank 0, seconds since start:", ranks[0]["seconds"])
    result = {"logit_diffs": {k: v for r in ranks for k, v in r["logit_diffs"].items()}}
    print("max |logits - HF| by (family, layout):", result["logit_diffs"])
    for field in ("sharded_keys", "engine_keys"):
        result[field] = {f: {k: v for r in ranks for k, v in r[field][f].items()} for f in CONFIGS}
    return cases, result, root


def test_the_selection_bias_and_groups_matter_to_hf():
    """The tiny model is sensitive to what the routing tests claim: zeroing the selection bias, or
    lifting the group limit, changes HF's own logits (so matching them checks both)."""
    model = make_model()
    base = hf_logits(model)
    assert (hf_logits(make_model(topk_group=4)) - base).abs().max() > 1e-3
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
    assert (hf_logits(model) - base).abs().max() > 1e-3


@pytest.mark.parametrize("family", CONFIGS)
def test_converter_writes_the_keys_megatron_saves(family, run):
    """megatron's own `sharded_state_dict` (local spec) is the oracle: per-layer keys (the layers
    differ), MLA's latent norms under the transformer-engine keys, the router's expert_bias, and the
    `_extra_state` objects, but for the pre-MLP norm, which megatron's local GQA spec renames (its
    `sharded_state_dict_keys_map`) and the engine saves under `pre_mlp_layernorm` in an MoE model; the
    engine's checkpoint request uses exactly the converter's keys."""
    cases, result, _ = run
    weights = weights_for(cases[family]["hf_dir"], 1)
    ours = {k: e.global_shape for k, e in expected_tensors(weights, lambda n: torch.float32).items()}
    megatron = {te_moe_norm_key(k): v for k, v in result["sharded_keys"][family].items()}
    assert {k: v for k, v in megatron.items() if v is not None} == ours
    assert {k for k, v in megatron.items() if v is None} == set(expected_objects(weights.arch))
    assert result["engine_keys"][family] == ours
    assert ours["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"] == (8, 64, 64)  # [E, 2F, H]
    assert ours["decoder.layers.3.mlp.router.expert_bias"] == (8,)
    assert ours["decoder.layers.0.mlp.linear_fc1.weight"] == (192, 64)  # dense layer 0


CASES = [(f, t) for f in CONFIGS for t in LAYOUTS]
CASE_IDS = [f"{f}-TP{t[0]}-PP{t[1]}-EP{t[2]}-ETP{t[3] or t[0]}" for f, t in CASES]


@pytest.mark.parametrize("family, layout", CASES, ids=CASE_IDS)
def test_megatron_logits_equal_hf(family, layout, run):
    _, result, _ = run
    assert result["logit_diffs"][(family, layout)] < 1e-5


@pytest.mark.parametrize("family, layout", CASES, ids=CASE_IDS)
def test_megatron_saves_export_to_hf_bit_exact(family, layout, run, tmp_path):
    """megatron's save at the layout (weights and expert_bias doubled after loading) -> converter -> 2 x HF."""
    cases, result, root = run
    case = cases[family]
    convert_torch_dist_to_hf(saved_dir(str(root / "saved"), family, layout), tmp_path / "hf",
                             hf_config_dir=case["hf_dir"])
    hf, exported = hf_tensors(case["hf_dir"]), hf_tensors(tmp_path / "hf")
    assert exported.keys() == hf.keys()
    for name in hf:
        assert torch.equal(exported[name], 2 * hf[name]), name


@pytest.mark.parametrize("family", CONFIGS)
def test_hf_to_torch_dist_to_hf_is_bit_exact(family, run, tmp_path):
    cases, _, root = run
    case = cases[family]
    convert_torch_dist_to_hf(root / f"{family}_mcore", tmp_path / "hf", hf_config_dir=case["hf_dir"])
    hf, back = hf_tensors(case["hf_dir"]), hf_tensors(tmp_path / "hf")
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


BASE = {**CONFIG, "model_type": "deepseek_v3"}


@pytest.mark.parametrize("overrides, field", [
    (dict(norm_topk_prob=False), "norm_topk_prob"),  # megatron renormalises sigmoid weights at top-k > 1
    (dict(topk_group=1), "topk_group"),  # groups ranked by their top-4, HF by their top-2
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="group_limited_greedy"), "topk_method"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(rope_parameters={**CONFIG["rope_parameters"], "mscale": 0}), "mscale_all_dim"),
    (dict(rope_parameters={**CONFIG["rope_parameters"], "truncate": False}), "truncate"),
    (dict(rope_parameters={**CONFIG["rope_parameters"], "attention_factor": 1.2}), "attention_factor"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "multi-latent attention"),
    (dict(first_k_dense_replace=4), "first_k_dense_replace"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_settings_megatron_cannot_express_are_refused_by_name(overrides, field):
    with pytest.raises(ConversionError, match=field):
        arch_from_hf_config({**BASE, **overrides})


def test_layouts_that_cannot_split_the_latents_are_refused():
    arch = arch_from_hf_config({**BASE, "q_lora_rank": 42})
    with pytest.raises(ConversionError, match="q_lora_rank=42 is not a multiple of tp=4"):
        check_layout(arch, ParallelLayout(tp=4))
    with pytest.raises(ConversionError, match=r"kv_lora_rank \+ qk_rope_head_dim=33 is not a multiple of tp=2"):
        check_layout(arch_from_hf_config({**BASE, "kv_lora_rank": 25}), ParallelLayout(tp=2))


def test_multi_token_prediction_layers_are_left_out_and_nothing_else():
    """A hub checkpoint stores its MTP module as layer num_hidden_layers (DeepSeek-V3: model.layers.61);
    megarl does not train it and ignores its tensors, as transformers does; a layer beyond it is refused."""
    from megarl.bridge import WeightMap

    weights = WeightMap(arch_from_hf_config({**BASE, "num_nextn_predict_layers": 1}), 104)
    names = set(weights.hf_names()) | {"model.layers.4.eh_proj.weight", "model.layers.4.mlp.experts.0.up_proj.weight"}
    weights.check_hf_names(names, "hub")
    with pytest.raises(ConversionError, match="model.layers.5.eh_proj.weight"):
        weights.check_hf_names(names | {"model.layers.5.eh_proj.weight"}, "hub")
    with pytest.raises(ConversionError, match="model.layers.4.eh_proj.weight"):
        WeightMap(arch_from_hf_config({**BASE, "num_nextn_predict_layers": 0}), 104).check_hf_names(names, "hub")


def test_glm4_moe_reads_its_switches_and_refuses_an_odd_rotary_part():
    glm = {**GLM, "model_type": "glm4_moe"}
    arch = arch_from_hf_config(glm)
    assert (arch.qkv_bias, arch.qk_layernorm, arch.rotary_percent, arch.moe.first_dense_layers) == (True, True, 0.5, 2)
    air = arch_from_hf_config({**glm, "attention_bias": False, "use_qk_norm": False})  # GLM-4.5-Air has q/k/v biases
    assert (air.qkv_bias, air.qk_layernorm) == (False, False)
    with pytest.raises(ConversionError, match="partial_rotary_factor"):
        arch_from_hf_config({**glm, "rope_parameters": {**GLM["rope_parameters"], "partial_rotary_factor": 0.3}})
