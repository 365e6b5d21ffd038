"""Converted checkpoints in real megatron-core (CPU, gloo, 4 processes): loading at every layout,
logits against HF, negative controls, and resharding a megatron-saved checkpoint.

The world runs once for the module (megatron_world.world); each test checks one part of it.
"""
import pytest
import torch

from megarl.bridge import ParallelLayout, WeightMap, arch_from_hf_config, load_hf_config, merge_model
from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf
from megarl.bridge.torch_dist_io import expected_objects, expected_tensors
from megarl.bridge.transforms import padded_vocab_size
from megarl.testing import run_gloo_workers
from megatron_world import LAYOUTS, UNEVEN_LAYOUTS, world
from tiny_hf import DIVISIBLE_BY, INPUT_IDS, VARIANTS, hf_tensors, logits, make_model

pytestmark = pytest.mark.slow  # one 4-process megatron world for the module: 35-60 s on 2 cores


@pytest.fixture(scope="module")
def megatron_run(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    cases = {}
    for variant, (hf_dir, model) in tiny_models.items():
        ckpt = root / f"{variant}_mcore"
        convert_hf_to_torch_dist(hf_dir, ckpt, ParallelLayout(1, 1, 1), make_vocab_size_divisible_by=DIVISIBLE_BY)
        cases[variant] = dict(hf_dir=hf_dir, ckpt_dir=ckpt / "release", input_ids=INPUT_IDS, hf_logits=logits(model))
    ranks = run_gloo_workers(world, 4, args=(cases, str(root / "saves")), timeout_s=400)
    merged = {key: value for rank in ranks for key, value in rank.items() if not isinstance(value, dict)}
    for field in ("state_dicts", "sharded_keys", "logit_diffs", "negative_diffs", "saved"):
        merged[field] = {k: v for rank in ranks for k, v in rank.get(field, {}).items()}
    print("megatron world, rank 0, seconds since start:", ranks[0]["seconds"])
    return cases, merged, root


def weights_for(hf_dir, tp):
    arch = arch_from_hf_config(load_hf_config(hf_dir))
    return WeightMap(arch, padded_vocab_size(arch.vocab_size, DIVISIBLE_BY, tp))


@pytest.mark.parametrize("variant", VARIANTS)
def test_converter_writes_exactly_what_a_gpt_model_saves(variant, megatron_run):
    cases, result, _ = megatron_run
    weights = weights_for(cases[variant]["hf_dir"], 1)
    ours = {k: e.global_shape for k, e in expected_tensors(weights, lambda n: torch.float32).items()}
    ours.update({k: None for k in expected_objects(weights.arch)})
    assert ours == result["sharded_keys"][variant]


@pytest.mark.parametrize("layout", [ParallelLayout(*t) for t in LAYOUTS] + UNEVEN_LAYOUTS, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_through_real_megatron_is_bit_exact(variant, layout, megatron_run):
    """HF -> torch_dist -> stock GPTModel chunks at the layout -> merge -> HF, bit for bit.
    (Each rank also asserted that its loaded state dict equals the pure shard functions' output:
    with uneven stages, megatron's own layer numbering against `sharding.stage_layers`.)"""
    cases, result, _ = megatron_run
    shards = {key: sd for (name, lay, key), sd in result["state_dicts"].items() if name == variant and lay == str(layout)}
    assert len(shards) == layout.tp * layout.pp * layout.vpp
    weights = weights_for(cases[variant]["hf_dir"], layout.tp)
    merged = merge_model(weights, shards, layout)
    back = {h: t for name, full in merged.items() for h, t in weights.to_hf(name, full)}
    hf = hf_tensors(cases[variant]["hf_dir"])
    assert back.keys() == set(weights.hf_names())
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_megatron_logits_at_tp2_pp2_equal_hf_logits(variant, megatron_run):
    _, result, _ = megatron_run
    assert result["logit_diffs"][variant] <= 1e-4


@pytest.mark.parametrize("variant, feature", [("mistral", {"sliding_window": None}),
                                              ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})])
def test_logit_inputs_are_sensitive_to_window_and_rope_scaling(variant, feature, megatron_run):
    """Without its sliding window / llama3 rope scaling, the HF model's logits move at least 10x
    the 1e-4 tolerance on the test input, so the match above shows megatron applies them."""
    cases, _, _ = megatron_run
    seed = list(VARIANTS).index(variant)  # as in the tiny_models fixture: same weights
    assert (logits(make_model(variant, seed, **feature)) - cases[variant]["hf_logits"]).abs().max() > 1e-3


@pytest.mark.parametrize("control", ["wrong_qkv_layout", "naive_fc1_tp_split", "rotary_permutation"])
def test_negative_controls_break_the_logit_test(control, megatron_run):
    _, result, _ = megatron_run
    assert result["negative_diffs"]["correct"] <= 1e-4  # the same load path without the bug passes
    assert result["negative_diffs"][control] > 1e-2


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_checkpoint_saved_by_megatron_at_one_layout_exports_exactly(variant, megatron_run, tmp_path):
    """llama: saved at TP2 (and loaded at TP1 x PP2 in the world, exactly); qwen2: tied, saved at
    TP2 x PP2 with singleton_local_shards (per-layer keys, fc1 as _w/_v). Both hold 2 x HF."""
    cases, result, _ = megatron_run
    out = tmp_path / "hf"
    convert_torch_dist_to_hf(result["saved"][variant], out, hf_config_dir=cases[variant]["hf_dir"])
    original, exported = hf_tensors(cases[variant]["hf_dir"]), hf_tensors(out)
    assert exported.keys() == original.keys()
    for name in original:
        assert torch.equal(exported[name], 2 * original[name]), name

