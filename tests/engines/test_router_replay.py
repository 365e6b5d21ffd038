"""Routing replay (R3): the rollout's routed experts, replayed by the megatron actor, make its
log-probs equal the rollout's own (fp32, CPU) on a tiny Qwen3-MoE whose routers have near ties
(experts 0-3 of every layer share one router row up to 1e-9 noise, so the last bits of the hidden
states decide among them, and HF and megatron decide differently); without replay the existing
mismatch metrics show the gap. The reference model replays them too (step-0 KL exactly 0)."""
import itertools

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.data.batch import Batch
from megarl.data.tiny_model import make_tiny_model
from megarl.testing import run_gloo_workers
from megarl.engines.megatron.sequences import make_micro_batch
from megarl.trainer.experience import routed_experts_grids
from replay_world import replay_world


def near_tie_moe(out_dir):
    model_dir = make_tiny_model("qwen3_moe", out_dir, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=32, seed=3)
    weights = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [k for k in weights if k.endswith("mlp.gate.weight")]:
        row = weights[name][0].clone()
        for expert in range(4):
            weights[name][expert] = 4 * row + 1e-9 * torch.randn(row.shape, generator=g)
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


@pytest.mark.slow  # one spawned megatron process, two actor engines
def test_replayed_log_probs_equal_the_rollouts_and_step0_ppo_kl_is_zero(tmp_path):
    (out,) = run_gloo_workers(replay_world, 1, args=(str(near_tie_moe(tmp_path / "moe")),), timeout_s=400)
    replayed, free = out["R3"], out["disabled"]
    assert out["batch"]["routed_experts"].dtype == torch.uint8  # 8 experts: one byte per route
    assert replayed["training/rollout_log_probs_diff_max"] <= 1e-5
    assert free["training/rollout_log_probs_diff_max"] > 1e-3  # routes differ: the gap replay removes
    assert replayed["update"]["actor/ppo_kl"] == 0.0
    # the reference replays the routes too: KL(actor || ref) is exactly 0 at step 0, where the
    # reference routing on its own (as the actor without replay does) would differ
    assert torch.equal(replayed["ref_log_probs"], replayed["log_probs"])
    assert replayed["update"]["actor/kl_loss"] == 0.0
    assert (free["log_probs"] - replayed["log_probs"]).abs().max() > 1e-3
    # expert counts [L, E]: with replay, a hand count of the rollout's routes; without, the trainer's own
    rollout_counts = torch.zeros_like(replayed["expert_tokens"])
    for routes in (r for per_prompt in out["routes"] for r in per_prompt):
        for token, layer, k in itertools.product(*map(range, routes.shape)):
            rollout_counts[layer, int(routes[token, layer, k])] += 1  # (a uint8 index would be a mask)
    assert torch.equal(replayed["expert_tokens"], rollout_counts)
    assert not torch.equal(free["expert_tokens"], rollout_counts)
    assert replayed["update"]["actor/grad_norm"] > 0  # with the router losses of the config:
    assert out["R3_router_losses"] == out["disabled_router_losses"] == ("aux_loss", 0.01, 0.001)


def test_routes_reach_megatrons_router_rows_in_its_token_order():
    """Padded layout: hidden states are [S, b, H] and the router reads rows s * b + j. Hand-built
    routes (expert = 10 * sample + position, layer l adds 100 * l) land where that rule says;
    the unrecorded last response token and padding get experts 0..K-1."""
    prompts, responses = [[5, 6], [7]], [[8, 9, 10], [11, 12]]
    batch = Batch.from_token_lists(prompts, responses)
    routes = []
    for j, (p, r) in enumerate(zip(prompts, responses)):
        positions = torch.arange(len(p) + len(r) - 1)
        per_layer = [10 * j + positions + 100 * layer for layer in range(2)]
        routes.append(torch.stack([torch.stack([x, x + 1000], -1) for x in per_layer], 1).int())  # [T-1, L=2, K=2]
    batch["prompt_routed_experts"], batch["routed_experts"] = routed_experts_grids(
        routes, batch["prompt_mask"], batch["response_mask"])
    mb = make_micro_batch(batch, [0, 1], "padded", 64, torch.device("cpu"), with_routes=True)
    assert mb.routes.shape == (2, 5 * 2, 2)  # [L, S * b, K], S = 5, b = 2
    for j, length in enumerate((5, 3)):
        for s in range(5):
            for layer in range(2):
                got = mb.routes[layer, s * 2 + j].tolist()
                if s < length - 1:
                    assert got == [10 * j + s + 100 * layer, 10 * j + s + 100 * layer + 1000]
                else:  # the last token (never fed to the rollout engine) and padding
                    assert got == [0, 1]
