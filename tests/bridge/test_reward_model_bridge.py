"""Reward models (HF *ForSequenceClassification, num_labels=1) through the bridge: the [1, H]
`score.weight` is megatron's `output_layer.weight`, replicated on TP ranks; HF -> torch_dist -> HF
is bit-exact and loads back as a sequence classifier."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_hf import DIVISIBLE_BY, INPUT_IDS, hf_config, hf_tensors, save_tokenizer

from megarl.bridge import ConversionError, ParallelLayout, WeightMap, arch_from_hf_config, merge_model, shard_model
from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf
from megarl.bridge.torch_dist_io import TorchDistReader

REPO = Path(__file__).resolve().parents[2]


def write_reward_model(variant: str, out: Path, num_labels: int = 1, seed: int = 0):
    """A tiny seq-cls checkpoint of `variant` (pad id 0, random norms) with a tokenizer; returns the model."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(hf_config(variant, num_labels=num_labels, pad_token_id=0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.eval().save_pretrained(out)
    save_tokenizer(out)
    return model


@pytest.mark.parametrize("variant", ["qwen2", "llama"])  # tied and untied embeddings
def test_seq_cls_round_trip_is_bit_exact_and_loads_as_a_classifier(variant, tmp_path):
    from transformers import AutoModelForSequenceClassification

    model = write_reward_model(variant, tmp_path / "src")
    assert "lm_head.weight" not in hf_tensors(tmp_path / "src")
    convert_hf_to_torch_dist(tmp_path / "src", tmp_path / "mcore", ParallelLayout(tp=2), DIVISIBLE_BY)
    reader = TorchDistReader(tmp_path / "mcore")
    assert reader.tensors["output_layer.weight"].global_shape == (1, 64)
    assert torch.equal(reader.read("output_layer.weight"), model.score.weight.detach())
    convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "hf")
    original, exported = hf_tensors(tmp_path / "src"), hf_tensors(tmp_path / "hf")
    assert original.keys() == exported.keys()
    for name in original:
        assert original[name].dtype == exported[name].dtype and torch.equal(original[name], exported[name]), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [f"{type(model).__name__}"] and config["id2label"] == {"0": "LABEL_0"}
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(INPUT_IDS).logits, model(INPUT_IDS).logits)


def test_score_head_is_replicated_across_tp_and_kept_on_the_last_stage(tmp_path):
    write_reward_model("qwen2", tmp_path / "src")
    arch = arch_from_hf_config(json.loads((tmp_path / "src" / "config.json").read_text()))
    assert arch.score_head and not arch.lm_head_tied
    weights = WeightMap(arch, 112)
    full = {n: weights.to_mcore(n, hf_tensors(tmp_path / "src").__getitem__) for n in weights.mcore_names()}
    layout = ParallelLayout(tp=2, pp=2)
    shards = shard_model(weights, full, layout)
    for tp_rank in range(2):
        assert torch.equal(shards[(1, 0, tp_rank)]["output_layer.weight"], full["output_layer.weight"])
        assert "output_layer.weight" not in shards[(0, 0, tp_rank)]  # not tied to the embedding
    merged = merge_model(weights, shards, layout)
    assert merged.keys() == full.keys() and all(torch.equal(merged[n], full[n]) for n in full)


def test_num_labels_other_than_one_is_a_clear_error(tmp_path):
    write_reward_model("qwen3", tmp_path / "src", num_labels=2)
    with pytest.raises(ConversionError, match=r"config.json: .*Qwen3ForSequenceClassification.* num_labels=2"):
        convert_hf_to_torch_dist(tmp_path / "src", tmp_path / "mcore", ParallelLayout(), DIVISIBLE_BY)
    tool = subprocess.run([sys.executable, str(REPO / "tools/convert_hf_to_megatron.py"), "--hf", str(tmp_path / "src"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert tool.returncode == 2 and f"{tmp_path / 'src' / 'config.json'}" in tool.stderr
    assert "num_labels=2; a reward model needs num_labels=1" in tool.stderr
    assert not (tmp_path / "mcore").exists() and not (tmp_path / "out").exists()
