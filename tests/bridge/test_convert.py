"""Offline conversion HF <-> torch_dist: bit-exact round trips, streaming I/O, clear failures,
the command-line tools and their memory bound."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.bridge import ConversionError, ParallelLayout
from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf
from megarl.bridge.safetensors_io import HFCheckpointReader, ShardedSafetensorsWriter
from megarl.bridge.torch_dist_io import TorchDistReader
from tiny_hf import DIVISIBLE_BY, VARIANTS, hf_tensors, logits

REPO = Path(__file__).resolve().parents[2]


def run_tool(name, *args, timeout=120):
    return subprocess.run([sys.executable, str(REPO / "tools" / name), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_to_torch_dist_to_hf_is_bit_exact(variant, tp, tiny_models, tmp_path):
    hf_dir = tiny_models[variant][0]
    convert_hf_to_torch_dist(hf_dir, tmp_path / "mcore", ParallelLayout(tp=tp), DIVISIBLE_BY)
    reader = TorchDistReader(tmp_path / "mcore")
    padded = {1: 104, 2: 112, 4: 128}[tp]
    assert reader.tensors["embedding.word_embeddings.weight"].global_shape == (padded, 64)
    recorded = json.loads((tmp_path / "mcore" / "release" / "megarl_bridge.json").read_text())
    assert (recorded["vocab_size"], recorded["padded_vocab_size"], recorded["layout"]["tp"]) == (100, padded, tp)
    assert ("output_layer.weight" in reader.tensors) != (variant == "qwen2")  # tied: no key of its own
    convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "hf", max_shard_bytes=100_000)
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(hf_dir))
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    original, exported = (json.loads((d / "config.json").read_text()) for d in (hf_dir, tmp_path / "hf"))
    assert {k: v for k, v in exported.items() if k != "transformers_version"} == \
           {k: v for k, v in original.items() if k != "transformers_version"}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (hf_dir / name).read_bytes()


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_converted_checkpoints_are_as_readable_as_the_umask_allows(umask, file_mode, dir_mode, tiny_models, tmp_path):
    """Both directions: every file and directory gets the mode a plain open/mkdir gives under the
    umask (safetensors alone writes 0600 and mkdtemp 0700, unreadable to a cluster's teammates)."""
    previous = os.umask(umask)
    try:
        convert_hf_to_torch_dist(tiny_models["llama"][0], tmp_path / "mcore", ParallelLayout(tp=2), DIVISIBLE_BY)
        convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "hf", max_shard_bytes=100_000)
    finally:
        os.umask(previous)
    for out in (tmp_path / "mcore", tmp_path / "hf"):
        paths = [out, *out.rglob("*")]
        assert any(p.suffix == ".safetensors" for p in paths) or out.name == "mcore"
        for path in paths:
            expected = dir_mode if path.is_dir() else file_mode
            assert path.stat().st_mode & 0o777 == expected, (path, oct(path.stat().st_mode & 0o777))


def test_bf16_checkpoint_stays_bf16(tmp_path):
    from tiny_hf import write_checkpoint

    write_checkpoint("qwen3", tmp_path / "src", dtype=torch.bfloat16)
    convert_hf_to_torch_dist(tmp_path / "src", tmp_path / "mcore", ParallelLayout(2, 2), DIVISIBLE_BY)
    assert TorchDistReader(tmp_path / "mcore").tensors["decoder.layers.mlp.linear_fc1.weight"].dtype == torch.bfloat16
    convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "hf")
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "src"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_sharded_writer_bounds_files_and_owns_its_tensors(tmp_path):
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=1000)
    fused = torch.arange(200, dtype=torch.float32).reshape(20, 10)
    gate, up = fused.chunk(2)  # views of one storage: written as separate tensors
    for name, tensor in [("gate", gate), ("up", up), ("big", torch.ones(300)), ("small", torch.ones(3))]:
        writer.add(name, tensor)
    weight_map = writer.close()
    assert sorted(set(weight_map.values())) == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == weight_map and index["metadata"]["total_size"] == 4 * (200 + 303)
    with HFCheckpointReader(tmp_path) as reader:
        assert torch.equal(reader.read("up"), up) and torch.equal(reader.read("gate"), gate)


def test_broken_hf_checkpoints_are_named(tiny_models, tmp_path):
    src = tmp_path / "hf"
    convert_hf_to_torch_dist(tiny_models["llama"][0], tmp_path / "mcore", ParallelLayout(), DIVISIBLE_BY)
    convert_torch_dist_to_hf(tmp_path / "mcore", src, max_shard_bytes=200_000)
    shards = sorted(src.glob("model-*.safetensors"))
    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    (missing / shards[1].name).unlink()
    with pytest.raises(ConversionError, match=f"shard {shards[1].name} is missing"):
        HFCheckpointReader(missing)
    truncated = tmp_path / "truncated"
    shutil.copytree(src, truncated)
    data = (truncated / shards[0].name).read_bytes()
    (truncated / shards[0].name).write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match=f"{shards[0].name}: unreadable or truncated"):
        HFCheckpointReader(truncated)
    with pytest.raises(ConversionError, match="no model.safetensors"):
        HFCheckpointReader(tmp_path / "mcore")


def test_broken_torch_dist_checkpoints_are_named(tiny_models, tmp_path):
    ckpt = tmp_path / "mcore"
    convert_hf_to_torch_dist(tiny_models["qwen2"][0], ckpt, ParallelLayout(), DIVISIBLE_BY)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(ckpt, corrupt)
    index = corrupt / "release" / ".metadata"
    index.write_bytes(index.read_bytes()[:100])
    with pytest.raises(ConversionError, match=r"\.metadata: unreadable"):
        TorchDistReader(corrupt)
    files = sorted((ckpt / "release").glob("*.distcp"), key=lambda p: p.stat().st_size)
    biggest = files[-1]
    data = biggest.read_bytes()
    biggest.write_bytes(data[:-10])
    with pytest.raises(ConversionError, match=f"{biggest.name}: truncated"):
        TorchDistReader(ckpt)
    biggest.unlink()
    with pytest.raises(ConversionError, match=f"data file {biggest.name} is missing"):
        TorchDistReader(ckpt)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("12\n")
    with pytest.raises(ConversionError, match="iter_0000012"):
        TorchDistReader(ckpt)
    with pytest.raises(ConversionError, match="not a megatron checkpoint"):
        TorchDistReader(tmp_path)


def test_mismatched_config_is_rejected_before_writing(tiny_models, tmp_path):
    convert_hf_to_torch_dist(tiny_models["llama"][0], tmp_path / "mcore", ParallelLayout(), DIVISIBLE_BY)
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((tiny_models["llama"][0] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(ConversionError, match=r"linear_fc1.weight has shape \[192, 64\].*intermediate_size=128"):
        convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "hf", hf_config_dir=other)
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6}))
    with pytest.raises(ConversionError, match="stacks 8 layers, but the config has 6"):
        convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "hf", hf_config_dir=other)
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))  # would need q/k/v biases
    with pytest.raises(ConversionError, match="linear_qkv.bias"):
        convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "hf", hf_config_dir=other)
    assert not (tmp_path / "hf").exists()


def test_failure_midway_leaves_no_output(tiny_models, tmp_path, monkeypatch):
    from megarl.bridge.mapping import WeightMap

    calls = []
    original = WeightMap.to_mcore

    def flaky(self, name, read):
        calls.append(name)
        if len(calls) == 10:
            raise OSError("disk full")
        return original(self, name, read)

    monkeypatch.setattr(WeightMap, "to_mcore", flaky)
    with pytest.raises(OSError, match="disk full"):
        convert_hf_to_torch_dist(tiny_models["qwen3"][0], tmp_path / "out", ParallelLayout(), DIVISIBLE_BY)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(ConversionError, match="already exists and is not an empty directory"):
        convert_hf_to_torch_dist(tiny_models["qwen3"][0], tmp_path / "taken", ParallelLayout(), DIVISIBLE_BY)


def test_tools_convert_both_ways_and_the_result_loads_in_transformers(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir, model = tiny_models["mistral"]
    to_mcore = run_tool("convert_hf_to_megatron.py", "--hf", hf_dir, "--out", tmp_path / "mcore", "--tp", 2, "--pp", 2,
                        "--make-vocab-size-divisible-by", DIVISIBLE_BY)
    assert to_mcore.returncode == 0, to_mcore.stderr
    assert "for TP=2 PP=2 VPP=1" in to_mcore.stdout and "tensors" in to_mcore.stderr
    to_hf = run_tool("convert_megatron_to_hf.py", "--ckpt", tmp_path / "mcore", "--out", tmp_path / "hf",
                     "--max-shard-size", "200KB")
    assert to_hf.returncode == 0, to_hf.stderr
    assert re.search(r"(\d+)/\1 tensors", to_hf.stderr), to_hf.stderr  # progress reached the end
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert torch.equal(logits(reloaded), logits(model))
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("w5 w7")["input_ids"] == [5, 7]


def test_tools_exit_2_with_a_clear_message(tiny_models, tmp_path):
    hf_dir = tiny_models["llama"][0]
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    (broken / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes()[:1000])
    r = run_tool("convert_hf_to_megatron.py", "--hf", broken, "--out", tmp_path / "a")
    assert r.returncode == 2 and "model.safetensors: unreadable or truncated" in r.stderr, r.stderr
    r = run_tool("convert_hf_to_megatron.py", "--hf", hf_dir, "--out", tmp_path / "b", "--tp", 3)
    assert r.returncode == 2 and "num_attention_heads=8 is not a multiple of tp=3" in r.stderr, r.stderr
    r = run_tool("convert_megatron_to_hf.py", "--ckpt", hf_dir, "--out", tmp_path / "c")
    assert r.returncode == 2 and "not a megatron checkpoint" in r.stderr, r.stderr
    convert_hf_to_torch_dist(hf_dir, tmp_path / "mcore", ParallelLayout(), DIVISIBLE_BY)
    r = run_tool("convert_megatron_to_hf.py", "--ckpt", tmp_path / "mcore", "--out", tmp_path / "d",
                 "--hf-config", tiny_models["qwen3"][0])  # another model's config
    assert r.returncode == 2, r.stderr
    assert re.search(r"error: .*linear_qkv.weight has shape .* but the config implies .*qwen3/config.json", r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "mcore"]  # nothing half-written


MEMORY_PROBE = r"""
import sys, threading, time
from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf

def anon_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

peak, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon_bytes())
        time.sleep(0.0005)

base = anon_bytes()
thread = threading.Thread(target=sample)
thread.start()
if sys.argv[1] == "to_mcore":
    convert_hf_to_torch_dist(sys.argv[2], sys.argv[3])
else:
    convert_torch_dist_to_hf(sys.argv[2], sys.argv[3], max_shard_bytes=int(sys.argv[4]))
done.set()
thread.join()
print(peak[0] - base)
"""


def test_peak_memory_is_about_the_largest_tensor_plus_a_bucket(tmp_path):
    """A 170 MiB model whose largest tensor is 16 MiB converts both ways in a small fraction of
    its size: the peak anonymous memory is measured in a fresh process by sampling."""
    from safetensors.torch import save_file

    from megarl.bridge.mapping import WeightMap
    from megarl.bridge.arch import arch_from_hf_config
    from tiny_hf import hf_config

    config = hf_config("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=8192).to_dict()
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    weights = WeightMap(arch_from_hf_config(config), 8192)
    generator = torch.Generator().manual_seed(0)
    names = weights.hf_names()
    for part in range(4):  # four files of about 48 MiB
        save_file({n: torch.randn(weights.hf_shape(n), generator=generator) for n in names[part::4]},
                  str(src / f"model-{part}.safetensors"))
    index = {"weight_map": {n: f"model-{i % 4}.safetensors" for i, n in enumerate(names)}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    model_bytes = sum(torch.Size(weights.hf_shape(n)).numel() * 4 for n in names)
    largest = max(torch.Size(weights.hf_shape(n)).numel() * 4 for n in names)
    bucket = 16 * 2**20
    runs = {"to_mcore": ("to_mcore", src, tmp_path / "mcore"), "to_hf": ("to_hf", tmp_path / "mcore", tmp_path / "hf", bucket),
            # control: one bucket as large as the model must show up as the whole model in memory
            "to_hf_one_bucket": ("to_hf", tmp_path / "mcore", tmp_path / "hf_one_file", 2**30)}
    peaks = {}
    for run, args in runs.items():
        r = subprocess.run([sys.executable, "-c", MEMORY_PROBE, *map(str, args)], capture_output=True,
                           text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        peaks[run] = int(r.stdout.split()[-1])
    print(f"model {model_bytes / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB, bucket {bucket / 2**20:.0f} MiB,"
          f" peak anon increase: " + ", ".join(f"{d} {p / 2**20:.0f} MiB" for d, p in peaks.items()))
    assert model_bytes > 160 * 2**20 and largest == 16 * 2**20
    assert peaks["to_mcore"] < 3 * largest + 16 * 2**20
    assert peaks["to_hf"] < bucket + 3 * largest + 16 * 2**20
    assert peaks["to_hf_one_bucket"] > 0.9 * model_bytes
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(src))
