"""A tiny Qwen3-MoE in the megatron engine with expert parallelism (TP1 / EP2, CPU, gloo): the
actor's log-probs and entropies equal HF's own model (fp32), the reference model's equal the
actor's exactly at step 0, two PPO updates train (step 0's ppo_kl is exactly 0), and the weight-sync
resharder emits each EP rank's experts from that rank, together the checkpoint's HF tensors; the expert counts
of the actor's own routing equal a hand count of HF's routing. The trained actor's checkpoint exports
to HF with the engine's log-probs; an actor starts from the bridge's torch_dist conversion."""
import math

import pytest
import torch
from safetensors.torch import load_file

from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf
from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.cpu.engine import load_causal_lm
from megarl.runtime.engine_group import join_outputs
from megarl.trainer.experience import expert_load_metrics
from megarl.testing import run_gloo_workers
from engine_world import ragged_batch
from moe_engine_world import TEMPERATURE, moe_world
from test_megatron_engine import close, hf_reference

pytestmark = pytest.mark.slow  # one 2-process megatron world


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    model_dir = make_tiny_model("qwen3_moe", root / "qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2,
                                intermediate=32, seed=3)
    mcore_dir = convert_hf_to_torch_dist(model_dir, root / "qwen3_moe_mcore").out
    args = (str(model_dir), str(mcore_dir), str(root / "actor_checkpoint"))
    return model_dir, run_gloo_workers(moe_world, 2, args=args, timeout_s=400)


def test_moe_engine_checkpoint_exports_to_hf_with_the_engine_log_probs(moe_run, tmp_path):
    """The EP2 actor's checkpoint after two updates (model, optimizer, schedule: what `megarl
    export` converts) exported to HF: transformers' log-probs on the batch equal the engine's on the
    same trained weights (fp32), and the weights moved (so this is not the starting checkpoint)."""
    model_dir, ranks = moe_run
    out = tmp_path / "hf"
    convert_torch_dist_to_hf(model_dir.parent / "actor_checkpoint", out, hf_config_dir=model_dir)
    ranks = sorted(ranks, key=lambda r: r["dp_rank"])
    batch = ragged_batch(8)
    exported, _, _ = hf_reference(out, batch, TEMPERATURE)
    ours = torch.cat([r["trained"]["log_probs"] for r in ranks])
    torch.testing.assert_close(exported, ours, rtol=0, atol=1e-5)
    start = torch.cat([r["scored"]["log_probs"] for r in ranks])
    assert (ours - start)[batch["response_mask"].bool()].abs().max() > 1e-4


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
    """TP2 / EP1, started from the bridge's torch_dist conversion of the HF checkpoint: log-probs
    equal HF's; the resharder gathers every expert's TP shards into the HF names and tensors of the
    checkpoint, bit for bit (the weights a push sends)."""
    model_dir, ranks = moe_run
    hf_log_probs, _, _ = hf_reference(model_dir, ragged_batch(8), TEMPERATURE)
    scored = [r["tp2_scored"] for r in ranks if r["tp2_scored"] is not None]
    assert len(scored) == 1
    close(scored[0]["log_probs"], hf_log_probs)
    assert_synced_equal_hf([r["tp2_synced"] for r in ranks], model_dir, emitters=1)


def test_moe_engine_ep2_resharder_gathers_every_expert_equal_to_hf(moe_run):
    """TP1 / EP2: the engine's chunks (each rank 4 of the 8 experts) resharded: each EP rank emits
    its own 4 experts under their HF names (rank 0 the dense tensors too), together equal to the
    checkpoint's save_pretrained tensors."""
    model_dir, ranks = moe_run
    assert_synced_equal_hf([r["ep2_synced"] for r in ranks], model_dir, emitters=2)


def assert_synced_equal_hf(per_rank: list, model_dir, emitters: int) -> None:
    """The emitters' HF tensors (None: a rank that emits nothing), each name once, equal the checkpoint's."""
    synced = [s for s in per_rank if s is not None]
    assert len(synced) == emitters
    union = {}
    for tensors in synced:
        assert not union.keys() & tensors.keys()
        union.update(tensors)
    hf = load_file(model_dir / "model.safetensors")
    assert union.keys() == hf.keys() - {"lm_head.weight"}
    for name, tensor in union.items():
        assert torch.equal(tensor, hf[name]), name


def test_moe_engine_updates_at_ep2_equal_updates_at_ep1(moe_run):
    """The same two PPO updates with the experts spread over 2 EP ranks and with every expert on
    every rank: expert gradients are reduced over the right ranks (loss, grad norm, KL agree)."""
    _, ranks = moe_run
    for rank in ranks:
        for ep2, ep1 in zip(rank["updates"], rank["ep1_updates"]):
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"):
                assert ep2[key] == pytest.approx(ep1[key], rel=1e-4, abs=1e-7), key


def hf_expert_counts(model_dir, batch) -> torch.Tensor:
    """The oracle: [B, layers, experts], a hand count of HF's own routing (top-k of its router's
    softmax, one forward per sample) over every token but each sample's last."""
    model = load_causal_lm(str(model_dir), torch.float32)
    c = model.config
    counts = torch.zeros(len(batch), c.num_hidden_layers, c.num_experts, dtype=torch.int32)
    for i in range(len(batch)):
        ids = torch.cat([batch["prompt_ids"][i][batch["prompt_mask"][i].bool()],
                         batch["response_ids"][i][batch["response_mask"][i].bool()]])
        with torch.no_grad():
            router_logits = model(input_ids=ids[None], output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            for token in range(len(ids) - 1):
                for expert in torch.topk(torch.softmax(logits[token], -1), c.num_experts_per_tok).indices.tolist():
                    counts[i, layer, expert] += 1
    return counts


def test_moe_engine_expert_counts_equal_a_hand_count_of_hf_routing(moe_run):
    """Replay off: the actor's routers' own choices, counted over every token but each sample's
    last and summed over the rank's samples ([L, E]), at EP2 (DP 2: each rank its half's total),
    TP2 (one output rank) and PP2 (a layer per stage, summed over the pipeline), equal HF's; the
    controller's sum over the DP ranks gives the step's metrics."""
    model_dir, ranks = moe_run
    batch = ragged_batch(8)
    expected = hf_expert_counts(model_dir, batch)
    ranks = sorted(ranks, key=lambda r: r["dp_rank"])
    for rank, half in zip(ranks, expected.chunk(2)):
        assert torch.equal(rank["scored"]["expert_tokens"], half.sum(0)), rank["dp_rank"]
    for layout in ("tp2_scored", "pp2_scored"):
        (scored,) = [r[layout] for r in ranks if r[layout] is not None]
        assert torch.equal(scored["expert_tokens"], expected.sum(0)), layout
    for rank, half in zip(ranks, expected.chunk(2)):  # an update that made its own old log-probs counted them too
        assert torch.equal(rank["ep1_in_update"]["expert_tokens"], half.sum(0)), rank["dp_rank"]
        close(rank["ep1_in_update"]["log_probs"], rank["scored"]["log_probs"])
    joined = join_outputs([r["scored"] for r in ranks], len(batch), padded=False)["expert_tokens"]
    assert torch.equal(joined, expected.sum(0))
    tokens = int(batch.token_lengths().sum()) - len(batch)
    metrics = expert_load_metrics(joined)
    assert metrics["moe/tokens_per_expert_mean"] == tokens * 2 / 8  # top-2 of 8 experts
    assert metrics["moe/tokens_per_expert_max"] == expected.sum(0).max()
