"""MoE checkpoints (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) through real megatron-core
MoE layers with expert parallelism (CPU, gloo, 4 processes): the converter writes the keys megatron
saves; HF -> torch_dist -> megatron at TP1/EP2, TP2/EP2 (ETP 1 and 2) and PP2/EP2 gives logits equal
to HF's own model (fp32); what megatron writes at those layouts exports back to HF bit for bit;
checkpoints move between EP sizes.
"""
import pytest
import torch

from megarl.bridge import ConversionError, ParallelLayout, arch_from_hf_config, check_layout, merge_model
from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf
from megarl.bridge.moe import moe_from_hf_config
from megarl.bridge.torch_dist_io import expected_objects, expected_tensors
from megarl.testing import run_gloo_workers
from moe_world import CASES, DIVISIBLE_BY, EP1, SINGLETON, layout_of, saved_dir, weights_for, world
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
    # head_dim * heads != hidden here too
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, intermediate_size=32, head_dim=24)),
}
MOE_NORM_TE, MOE_NORM_LOCAL = "decoder.layers.pre_mlp_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight"


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
        ckpt = convert_hf_to_torch_dist(root / variant, root / f"{variant}_mcore", ParallelLayout(ep=2),
                                        make_vocab_size_divisible_by=DIVISIBLE_BY).out
        cases[variant] = dict(hf_dir=root / variant, ckpt_dir=ckpt / "release", input_ids=INPUT_IDS,
                              hf_logits=logits(model))
    out_dir = root / "saved"
    ranks = run_gloo_workers(world, 4, args=(cases, str(out_dir)), timeout_s=400)
    print("MoE megatron world, rank 0, seconds since start:", ranks[0]["seconds"])
    merged = {field: {k: v for r in ranks for k, v in r[field].items()}
              for field in ("state_dicts", "logit_diffs", "negative_diffs")}
    for field in ("sharded_keys", "engine_keys"):  # a rank holds the objects of its own experts: the union
        merged[field] = {v: {k: s for r in ranks for k, s in r[field][v].items()} for v in MOE_VARIANTS}
    merged["out_dir"] = str(out_dir)
    return cases, merged


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_converter_writes_the_keys_megatron_moe_layers_save(variant, moe_run):
    """megatron's own `sharded_state_dict` (local spec) is the oracle: the same tensor keys and
    global shapes (experts [L, E, ...] under their global index) and `_extra_state` objects, except
    the pre-MLP norm, which the local spec renames and the converter writes under the TE spec's key;
    the engine's checkpoint request uses exactly the converter's keys."""
    cases, result = moe_run
    weights = weights_for(cases[variant]["hf_dir"], 1)
    ours = {k: e.global_shape for k, e in expected_tensors(weights, lambda n: torch.float32).items()}
    megatron = result["sharded_keys"][variant]
    assert {k: v for k, v in megatron.items() if v is not None and k != MOE_NORM_LOCAL} == \
           {k: v for k, v in ours.items() if k != MOE_NORM_TE}
    assert megatron[MOE_NORM_LOCAL] == ours[MOE_NORM_TE] == (2, 64)
    assert {k for k, v in megatron.items() if v is None} == set(expected_objects(weights.arch))
    assert result["engine_keys"][variant] == ours
    assert ours["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, 8, 64, 64)  # [L, E, 2F, H]


@pytest.mark.parametrize("variant, layout", CASES, ids=[f"{v}-TP{t[0]}-PP{t[1]}-EP{t[2]}-ETP{t[3] or t[0]}" for v, t in CASES])
def test_moe_round_trip_through_real_megatron_is_bit_exact(variant, layout, moe_run, tmp_path):
    """HF -> torch_dist (converter) -> megatron MoE chunks at the layout (the engine's loader; each
    rank asserted its state dict equals the pure shards) -> their state dicts -> merge -> HF; and
    megatron's own save at that layout (weights doubled after loading) -> converter -> 2 x HF."""
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
    convert_torch_dist_to_hf(saved_dir(result["out_dir"], variant, layout), tmp_path / "hf",
                             hf_config_dir=cases[variant]["hf_dir"])
    exported = hf_tensors(tmp_path / "hf")
    assert exported.keys() == hf.keys()
    for name in hf:
        assert torch.equal(exported[name], 2 * hf[name]), name


def test_moe_checkpoints_move_between_ep_sizes_and_stock_singleton_saves_export(moe_run, tmp_path):
    """In the world, Qwen3-MoE written at EP2 loaded at EP1 and the EP1 save loaded at EP2, each
    equal to the pure shards of what was written. Here: the EP1 save (4 x HF) and stock megatron's
    singleton_local_shards save of Qwen2-MoE at PP2 x EP2 (per-layer and per-expert keys, fc1 as
    _w / _v, the local spec's pre-MLP norm key; 2 x HF) export exactly."""
    cases, result = moe_run
    for (variant, layout, how), factor in {("qwen3_moe", EP1, "engine"): 4, (*SINGLETON, "singleton"): 2}.items():
        out = tmp_path / how
        convert_torch_dist_to_hf(saved_dir(result["out_dir"], variant, layout, how), out,
                                 hf_config_dir=cases[variant]["hf_dir"])
        hf, exported = hf_tensors(cases[variant]["hf_dir"]), hf_tensors(out)
        assert exported.keys() == hf.keys()
        for name in hf:
            assert torch.equal(exported[name], factor * hf[name]), (how, name)


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
