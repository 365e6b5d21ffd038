"""GRPO with FP8 rollout trains end to end on CPU (configs/tiny/grpo_fp8.yaml): a float32 megatron-core
actor, a CPU-engine server holding block-FP8 weights, 2 steps. The FP8 format and pushes are checked
against their oracles in tests/rollout/test_fp8*.py, tests/sglang/test_fp8_oracle.py and
tests/sync/test_fp8_push.py; here, the loop: the first checkpoint megarl wrote, every push checked tensor
by tensor (values and scales: check_weight_update), the correction and its diagnostics in the metrics;
then `megarl export --fp8` of its checkpoint, loaded by HF transformers."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from megarl.cli import main as megarl_main
from megarl.rollout import fp8

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from fp8_oracles import same_bits, transformers_dequantize, transformers_quantize  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_grpo_with_fp8_rollout_trains(tiny_assets, tmp_path, run_to_completion):
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/grpo_fp8.yaml"),
           f"actor_rollout_ref.model.path={tiny_assets / 'model'}",
           f"data.train_files={tiny_assets / 'data/train.parquet'}", "data.val_files=[]",
           f"trainer.default_local_dir={tmp_path}",
           f"custom_reward_function.path={Path(__file__).with_name('varied_reward.py')}",  # gradients not all 0
           "trainer.save_freq=2"]
    run_to_completion(cmd, tmp_path, 400, "FP8 rollout experiment")
    config = json.loads((tmp_path / "rollout_fp8" / "config.json").read_text())
    attention = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in ("k", "q", "v")]
    assert config["quantization_config"] == fp8.quantization_config(sorted(attention))  # k, v: 64 rows
    with safe_open(str(tiny_assets / "model" / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())  # noqa: SIM118
    quantized = [n for n in names if n.endswith(("o_proj.weight", "gate_proj.weight", "up_proj.weight",
                                                 "down_proj.weight"))]
    rows = [json.loads(line) for line in
            (tmp_path / "megarl-tiny" / "grpo_fp8" / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "timing/step_s" in r]
    assert [r["step"] for r in train] == [1, 2]
    for row in train:
        assert all(math.isfinite(v) for v in row.values()), row
        # every pushed tensor, each quantized weight's values and scale, equals the server's (SGLang's hash)
        assert row["sync/checked_tensors"] == len(names) + len(quantized) == len(names) + 8
        assert row["training/rollout_log_probs_diff_max"] > 1e-3  # FP8 sampling is visibly off the trainer
        assert any(key.startswith("rollout_corr/") for key in row)  # the correction ran
        assert row["actor/grad_norm"] > 0 and row["sync/bytes"] > 0  # an update, pushed
    # the trained actor exported, and in FP8 as its servers held it: transformers dequantizes the FP8 export to
    # what its own quantizer and dequantizer make of the plain export's weights
    assert megarl_main(["export", str(tmp_path), "--fp8", "--out", str(tmp_path / "hf")]) == 0
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
    served = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_fp8"), dtype=torch.bfloat16).state_dict()
    assert json.loads((tmp_path / "hf_fp8" / "config.json").read_text())["quantization_config"] == \
        config["quantization_config"]
    for name, tensor in plain.items():
        expected = (transformers_dequantize(*transformers_quantize(tensor), torch.bfloat16) if name in quantized
                    else tensor.to(torch.bfloat16))
        assert same_bits(served[name], expected), name
