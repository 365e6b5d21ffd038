"""gpt-oss in the megatron engine on CPU (one gloo process): routing replay makes the actor's
log-probs equal the rollout's (megarl's CPU engine, HF transformers) within 1e-5 in fp32 on a
model whose routers have near ties, where routing freely misses them; one update with replay has
ppo_kl exactly 0 and KL to the (replaying) reference exactly 0; the trained actor's checkpoint,
exported to HF as `megarl export` does, gives transformers log-probs equal to the engine's."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.bridge.convert import convert_torch_dist_to_hf
from megarl.data.tiny_model import make_tiny_model
from megarl.testing import run_gloo_workers
from gptoss_engine_world import gptoss_engine_world
from replay_world import TEMPERATURE
from test_megatron_engine import hf_reference

pytestmark = pytest.mark.slow  # one spawned megatron process

SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=24, intermediate=40)


def near_tie_gptoss(out_dir):
    """Experts 0-3 of every layer share one router row (up to 1e-9 noise) and bias."""
    model_dir = make_tiny_model("gpt_oss", out_dir, seed=3, **SHAPE)
    weights = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [k for k in weights if k.endswith("mlp.router.weight")]:
        row = weights[name][0].clone()
        for expert in range(4):
            weights[name][expert] = 4 * row + 1e-9 * torch.randn(row.shape, generator=g)
        weights[name.replace("weight", "bias")][:4] = 0.0
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def gptoss_engine_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptoss_engine")
    plain = make_tiny_model("gpt_oss", root / "plain", seed=4, tie=False, **SHAPE)
    args = (str(near_tie_gptoss(root / "near_tie")), str(plain), str(root / "actor_checkpoint"))
    (out,) = run_gloo_workers(gptoss_engine_world, 1, args=args, timeout_s=400)
    return root, out


def test_gptoss_routing_replay_reproduces_the_rollouts_log_probs(gptoss_engine_run):
    _, out = gptoss_engine_run
    for name in ("near_tie", "plain"):
        assert out[name]["replayed"]["training/rollout_log_probs_diff_max"] <= 1e-5, name
    assert out["near_tie"]["free"]["training/rollout_log_probs_diff_max"] > 1e-3  # what replay removes


def test_gptoss_replayed_update_has_zero_step1_ppo_kl(gptoss_engine_run):
    _, out = gptoss_engine_run
    update = out["plain"]["update"]
    assert out["plain"]["ref_equal"]
    assert update["actor/ppo_kl"] == 0.0 and update["actor/kl_loss"] == 0.0
    assert update["actor/grad_norm"] > 0


def test_gptoss_trained_checkpoint_exports_with_the_engine_log_probs(gptoss_engine_run, tmp_path):
    """transformers' log-probs of the exported checkpoint equal the trained engine's (free routing
    on both sides), and the weights moved."""
    root, out = gptoss_engine_run
    convert_torch_dist_to_hf(root / "actor_checkpoint", tmp_path / "hf", root / "plain")
    exported, _, _ = hf_reference(tmp_path / "hf", out["plain"]["batch"], TEMPERATURE)
    mask = out["plain"]["batch"]["response_mask"].bool()
    torch.testing.assert_close(exported[mask], out["plain"]["trained"][mask], rtol=0, atol=1e-5)
    before, _, _ = hf_reference(root / "plain", out["plain"]["batch"], TEMPERATURE)
    assert (before[mask] - exported[mask]).abs().max() > 1e-4
