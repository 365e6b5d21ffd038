"""A tiny Qwen3-MoE in the megatron engine with expert parallelism (TP1 / EP2, CPU, gloo): the
actor's log-probs and entropies equal HF's own model (fp32), the reference model's equal the
actor's exactly at step 0, and two PPO updates train (step 0's ppo_kl is exactly 0)."""
import math

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.engines.megatron.cpu import run_gloo_workers
from engine_world import ragged_batch
from moe_engine_world import TEMPERATURE, moe_world
from test_megatron_engine import close, hf_reference

pytestmark = pytest.mark.slow  # one 2-process megatron world


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    model_dir = make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe", layers=2, hidden=64,
                                heads=4, kv_heads=2, intermediate=32, seed=3)
    return model_dir, run_gloo_workers(moe_world, 2, args=(str(model_dir),), timeout_s=400)


def test_moe_engine_log_probs_equal_hf_with_expert_parallelism(moe_run):
    model_dir, ranks = moe_run
    ranks = sorted(ranks, key=lambda r: r["dp_rank"])
    batch = ragged_batch(8)
    hf_log_probs, hf_entropy, _ = hf_reference(model_dir, batch, TEMPERATURE)
    close(torch.cat([r["scored"]["log_probs"] for r in ranks]), hf_log_probs)
    close(torch.cat([r["scored"]["entropy"] for r in ranks]), hf_entropy)


def test_moe_engine_step0_reference_equals_actor_and_updates_train(moe_run):
    _, ranks = moe_run
    assert all(r["ref_equal"] for r in ranks)
    first, second = ranks[0]["updates"]
    assert first["actor/ppo_kl"] == 0.0
    assert math.isfinite(first["actor/grad_norm"]) and first["actor/grad_norm"] > 0
    assert second["actor/ppo_kl"] != 0.0  # the first update moved the policy
