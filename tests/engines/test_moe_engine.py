"""A tiny Qwen3-MoE in the megatron engine with expert parallelism (TP1 / EP2, CPU, gloo): the
actor's log-probs and entropies equal HF's own model (fp32), the reference model's equal the
actor's exactly at step 0, two PPO updates train (step 0's ppo_kl is exactly 0), and the weight-sync
resharder gathers the experts of both EP ranks into the checkpoint's HF tensors."""
import math

import pytest
import torch
from safetensors.torch import load_file

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


def test_moe_engine_tp2_log_probs_and_resharded_weights_equal_hf(moe_run):
    """TP2 / EP1: log-probs equal HF's; the resharder gathers every expert's TP shards into the
    HF names and tensors of the checkpoint, bit for bit (the weights a push sends)."""
    model_dir, ranks = moe_run
    hf_log_probs, _, _ = hf_reference(model_dir, ragged_batch(8), TEMPERATURE)
    scored = [r["tp2_scored"] for r in ranks if r["tp2_scored"] is not None]
    assert len(scored) == 1
    close(scored[0]["log_probs"], hf_log_probs)
    assert_synced_equal_hf([r["tp2_synced"] for r in ranks], model_dir)


def test_moe_engine_ep2_resharder_gathers_every_expert_equal_to_hf(moe_run):
    """TP1 / EP2: the engine's chunks (each rank 4 of the 8 experts) resharded: rank 0 emits all
    8 experts under their HF names, equal to the checkpoint's save_pretrained tensors."""
    model_dir, ranks = moe_run
    assert_synced_equal_hf([r["ep2_synced"] for r in ranks], model_dir)


def assert_synced_equal_hf(per_rank: list, model_dir) -> None:
    synced = [s for s in per_rank if s is not None]
    assert len(synced) == 1
    hf = load_file(model_dir / "model.safetensors")
    assert synced[0].keys() == hf.keys() - {"lm_head.weight"}
    for name, tensor in synced[0].items():
        assert torch.equal(tensor, hf[name]), name


def test_moe_engine_updates_at_ep2_equal_updates_at_ep1(moe_run):
    """The same two PPO updates with the experts spread over 2 EP ranks and with every expert on
    every rank: expert gradients are reduced over the right ranks (loss, grad norm, KL agree)."""
    _, ranks = moe_run
    for rank in ranks:
        for ep2, ep1 in zip(rank["updates"], rank["ep1_updates"]):
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"):
                assert ep2[key] == pytest.approx(ep1[key], rel=1e-4, abs=1e-7), key
