"""gpt-oss (attention sinks, sliding windows on alternate layers, biases on every linear, the
clamped SwiGLU with its +1 offset, YaRN; experts fused on disk) through real megatron-core layers
on CPU (gloo, 4 processes): HF -> torch_dist -> megatron at EP2, TP2 x EP2 (ETP1) and PP2 x EP2
gives logits equal to HF's own model (transformers 5.25 `GptOssForCausalLM`, eager attention:
the implementation that applies the sinks and the window mask) within 1e-5 in fp32, with
megatron's local attention and with megarl's CPU reference attention; what megatron saves at
those layouts exports back to HF's fused tensors bit for bit; the weight push's resharder at those
layouts and at TP1 x EP1 emits exactly the HF checkpoint's tensors, fused experts included, under
the names SGLang's gpt-oss loader takes; what megatron-core cannot express is refused by name.
"""
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.bridge import ConversionError, ParallelLayout, arch_from_hf_config, check_layout, merge_model
from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf
from megarl.bridge.megatron_config import transformer_config_kwargs
from megarl.testing import run_gloo_workers
from gptoss_world import ATTENTIONS, LAYOUTS, PUSH_LAYOUTS, world
from moe_world import DIVISIBLE_BY, layout_of, saved_dir, weights_for
from tiny_hf import INPUT_IDS, hf_tensors, logits, randomise_norms_and_biases, save_tokenizer

pytestmark = pytest.mark.slow  # one 4-process megatron world for the module

# odd shapes: heads * head_dim != hidden, GQA, 8 experts of width 40 (top 2), 4 layers (sliding, full,
# sliding, full: each PP2 stage holds both kinds), a window of 5 over 12 tokens, a clamp the
# activations reach, YaRN with a non-integer correction range (truncate=false)
CONFIG = dict(vocab_size=100, hidden_size=64, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
              swiglu_limit=0.6, rms_norm_eps=1e-6, initializer_range=0.1, max_position_embeddings=128,
              rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 8.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})


def make_gptoss(seed: int = 0, **overrides):
    """The fp32 HF model; norms, biases and sinks randomised (HF initialises them to 1, 0 and ~0)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**{**CONFIG, **overrides})
    model = randomise_norms_and_biases(
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def gptoss_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptoss")
    model = make_gptoss()
    model.save_pretrained(root / "hf")  # fused experts on disk, as transformers writes them
    save_tokenizer(root / "hf")
    ckpt = convert_hf_to_torch_dist(root / "hf", root / "mcore", ParallelLayout(ep=2),
                                    make_vocab_size_divisible_by=DIVISIBLE_BY).out
    case = dict(hf_dir=root / "hf", ckpt_dir=ckpt / "release", input_ids=INPUT_IDS, hf_logits=logits(model))
    out_dir = root / "saved"
    ranks = run_gloo_workers(world, 4, args=(case, str(out_dir)), timeout_s=400)
    print("gpt-oss megatron world, rank 0, seconds since start:", ranks[0]["seconds"])
    merged = {field: {k: v for r in ranks for k, v in r[field].items()}
              for field in ("state_dicts", "logit_diffs", "negative_diffs", "pushed")}
    print("max |logits - HF|:", merged["logit_diffs"], "negative controls:", merged["negative_diffs"])
    return case, merged, out_dir


def test_the_tiny_model_exercises_every_gpt_oss_feature(gptoss_run):
    """HF's own logits move when the clamp, the sinks, the windows or YaRN are taken away: the
    exactness tests below would catch a bridge that dropped any of them."""
    case, _, _ = gptoss_run
    base = case["hf_logits"]
    variants = {"clamp": dict(swiglu_limit=1e9), "window": dict(sliding_window=64),
                "yarn": dict(rope_parameters={"rope_type": "default", "rope_theta": 1000.0})}
    for what, overrides in variants.items():
        assert (logits(make_gptoss(**overrides)) - base).abs().max() > 1e-3, what
    no_sinks = make_gptoss()
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert (logits(no_sinks) - base).abs().max() > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"TP{t[0]}-PP{t[1]}-EP{t[2]}-ETP{t[3] or t[0]}" for t in LAYOUTS])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gptoss_megatron_logits_equal_hf_logits(layout, attention, gptoss_run):
    """HF's own model (eager attention with sinks and window masks, fused experts) is the oracle; fp32, 1e-5."""
    _, result, _ = gptoss_run
    assert result["logit_diffs"][(layout, attention)] <= 1e-5


@pytest.mark.parametrize("control", ["zero_sinks", "no_windows"])
def test_gptoss_negative_controls_break_the_logit_test(control, gptoss_run):
    _, result, _ = gptoss_run
    assert result["negative_diffs"][control] > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"TP{t[0]}-PP{t[1]}-EP{t[2]}-ETP{t[3] or t[0]}" for t in LAYOUTS])
def test_gptoss_round_trip_through_real_megatron_is_bit_exact(layout, gptoss_run, tmp_path):
    """HF -> torch_dist -> megatron chunks at the layout -> their state dicts -> merge -> HF equals
    the HF tensors; megatron's own save at that layout (weights doubled) exports to exactly 2 x the
    HF file's tensors, fused expert tensors (gate/up interleaved) included."""
    case, result, out_dir = gptoss_run
    lay = layout_of(layout)
    shards = {key: sd for (t, key), sd in result["state_dicts"].items() if t == layout}
    weights = weights_for(case["hf_dir"], lay.tp)
    back = {h: t for name, full in merge_model(weights, shards, lay).items() for h, t in weights.to_hf(name, full)}
    hf = hf_tensors(case["hf_dir"])
    assert back.keys() == hf.keys()
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name
    convert_torch_dist_to_hf(saved_dir(str(out_dir), "gpt_oss", layout), tmp_path / "hf", hf_config_dir=case["hf_dir"])
    original = load_file(case["hf_dir"] / "model.safetensors")  # the files themselves: fused names and layout
    exported = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported.keys() == original.keys()
    assert "model.layers.1.mlp.experts.gate_up_proj" in exported
    for name in original:
        assert torch.equal(exported[name], 2 * original[name]), name


SGLANG = Path("/work/main/.venv-sglang/lib/python3.11/site-packages/sglang/srt")


def sglang_gpt_oss_expert_names() -> set[str]:
    """The expert tensor names SGLang 0.5.23's GptOssForCausalLM loads, read from its source: the
    `ckpt_*_name` arguments `_load_normal_weights` passes to `FusedMoE.make_expert_params_mapping_fused`,
    which maps `experts.{ckpt name}` (every other expert name matches no parameter and is skipped)."""
    model = (SGLANG / "models" / "gpt_oss.py").read_text()
    normal = model[model.index("def _load_normal_weights"):]
    call = normal[normal.index("make_expert_params_mapping_fused("):]
    args = dict(re.findall(r'(ckpt_\w+_name)="(\w+)"', call[: call.index(")")]))
    mapping = (SGLANG / "layers" / "moe" / "fused_moe_triton" / "layer.py").read_text()
    fused = mapping[mapping.index("def make_expert_params_mapping_fused("):]
    fused = fused[: fused.index("@classmethod")]
    weight_names = re.findall(r'f"experts\.\{(ckpt_\w+_name)\}"', fused)
    assert len(args) == len(weight_names) == 4
    return {f"mlp.experts.{args[w]}" for w in weight_names}


@pytest.mark.parametrize("layout", PUSH_LAYOUTS, ids=[f"TP{t[0]}-PP{t[1]}-EP{t[2]}" for t in PUSH_LAYOUTS])
def test_gptoss_push_sends_the_hf_checkpoint_under_sglang_names_bit_for_bit(layout, gptoss_run):
    """The push's resharder at the layout (buckets smaller than a layer's experts) emits each HF
    tensor once, equal bit for bit to transformers' own `model.safetensors` (the oracle): a layer's
    experts as the four fused tensors of all 8 experts ([E, H, 2F] gate/up interleaved, ...), the
    expert names exactly those SGLang's gpt-oss loader maps (its source), each whole in one bucket
    (SGLang's `weight_loader_fused` copies one tensor into all the layer's experts). At EP2 EP rank 0
    alone emits experts (its gather brings EP rank 1's)."""
    case, result, _ = gptoss_run
    runs = {rank: run for (t, rank), run in result["pushed"].items() if t == layout}
    sent = {}
    for run in runs.values():
        for name, tensor in run["tensors"].items():
            assert name not in sent, f"{name} emitted twice"
            sent[name] = tensor
    oracle = load_file(case["hf_dir"] / "model.safetensors")
    assert sent.keys() == oracle.keys()
    for name, tensor in oracle.items():
        assert sent[name].dtype == tensor.dtype and torch.equal(sent[name], tensor), name
    experts = {re.sub(r"^model\.layers\.\d+\.", "", n) for n in sent if ".experts." in n}
    assert experts == sglang_gpt_oss_expert_names()
    assert sent["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 80)
    if layout[2] > 1:  # EP2: the expert emitters are EP rank 0's, one per stage
        emitters = sorted((run["pp_rank"], run["ep_rank"]) for run in runs.values() if run["emits_experts"])
        assert emitters == [(pp, 0) for pp in range(layout[1])]
    # a stage's buckets are numbered once each, 0..count-1 (across its emitters)
    for pp in range(layout[1]):
        numbers = sorted((i, n) for run in runs.values() if run["pp_rank"] == pp for i, n, _ in run["buckets"])
        assert [i for i, _ in numbers] == list(range(numbers[0][1])), numbers


def test_gptoss_export_loads_in_transformers_with_hf_logits(gptoss_run, tmp_path):
    """The converter's HF output (of the unmodified torch_dist checkpoint) is a checkpoint
    transformers loads into the same model: logits equal bit for bit."""
    import transformers

    case, _, _ = gptoss_run
    convert_torch_dist_to_hf(case["ckpt_dir"], tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    assert torch.equal(logits(model), case["hf_logits"])


def config_of(**overrides) -> dict:
    import transformers

    return {**transformers.GptOssConfig(**CONFIG).to_dict(), **overrides}


@pytest.mark.parametrize("overrides, message", [
    (dict(quantization_config={"quant_method": "mxfp4"}), r"Mxfp4Config\(dequantize=True\)"),
    (dict(swiglu_alpha=1.5), "swiglu_alpha"),
    (dict(attention_bias=False), "attention_bias"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention", "full_attention"]), "layer_types"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(rope_parameters={**CONFIG["rope_parameters"], "attention_factor": 2.0}), "attention_factor"),
])
def test_gptoss_settings_megatron_cannot_express_are_refused(overrides, message):
    with pytest.raises(ConversionError, match=message):
        arch_from_hf_config(config_of(**overrides))


def test_gptoss_expert_tp_is_refused_and_config_maps_features():
    """megatron-core biases experts only at ETP 1 (transformer_config.py); the config carries
    sinks, the per-layer window pattern (layer 1, 3 full), biases, the clamped GLU and YaRN."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    arch = arch_from_hf_config(config_of())
    with pytest.raises(ConversionError, match="expert TP size 1"):
        check_layout(arch, ParallelLayout(tp=2, ep=2, etp=2))
    kwargs = transformer_config_kwargs(arch)
    assert (kwargs["softmax_type"], kwargs["window_size"], kwargs["window_attn_skip_freq"]) == ("learnable", (4, 0),
                                                                                                [1, 0, 1, 0])
    assert (kwargs["add_bias_linear"], kwargs["activation_func"], kwargs["activation_func_clamp_value"],
            kwargs["glu_linear_offset"], kwargs["moe_router_pre_softmax"]) == (True, quick_gelu, 0.6, 1.0, False)
