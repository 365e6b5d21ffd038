"""The megatron engine on real megatron-core (CPU, gloo), checked against HF transformers in fp32.

Two process worlds run once for the module (engine_world.py): four ranks score one ragged batch
at TP2 x PP2, PP2 x VPP2 (and an untied llama at TP2 x PP2), train at TP2 x PP2 and PP2 x VPP2, and
check the step-0 invariant; two ranks score the same batch at TP2 and PP2 (TRAINING_WORLD_LAYOUTS:
qwen2 with the actors they build anyway, before they train or load a checkpoint; the bridge's
torch_dist conversion at TP2 and verl's torch_dist weights at PP2), train the same PPO updates at
TP1 and TP2, offload and checkpoint, resume at TP1 and TP1 x PP2, and train critics. The tests
compare what the ranks returned.
"""
import pytest
import torch
from engine_world import (
    ACTOR_LOSS,
    LAYOUTS,
    SAVE_AFTER,
    TEMPERATURE,
    TRAINED_LAYOUTS,
    TRAINING_WORLD_LAYOUTS,
    UPDATES,
    config,
    layouts_world,
    ragged_batch,
    training_batch,
    training_world,
)
from transformers import AutoModelForCausalLM

from megarl.algos.from_config import actor_loss_kwargs
from megarl.algos.losses import actor_loss
from megarl.bridge import ParallelLayout, WeightMap, arch_from_hf_config, load_hf_config, merge_model
from megarl.testing import run_gloo_workers
from megarl.engines.megatron.model import padded_vocab

pytestmark = pytest.mark.slow  # two megatron worlds for the module (4 and 2 processes): ~60 s on 2 cores


def hf_reference(model_dir, batch, temperature=1.0):
    """HF fp32 log-probs and entropies [B, R] of softmax(logits / temperature), and the final
    hidden states (after the last norm) at the positions that predict each response token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    shape = batch["response_mask"].shape
    log_probs, entropy, hidden = torch.zeros(shape), torch.zeros(shape), torch.zeros(*shape, model.config.hidden_size)
    for i in range(len(batch)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        response = batch["response_ids"][i][batch["response_mask"][i].bool()]
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            states = model.model(ids).last_hidden_state[0]
            logp = (model.lm_head(states).float() / temperature).log_softmax(-1)
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
        log_probs[i, : len(response)] = logp[at, response]
        entropy[i, : len(response)] = -(logp[at].exp() * logp[at]).sum(-1)
        hidden[i, : len(response)] = states[at]
    return log_probs, entropy, hidden


def close(actual, expected, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------------ scoring
@pytest.fixture(scope="module")
def layouts_run(tiny_models):
    return run_gloo_workers(layouts_world, 4, args=(tiny_models,), timeout_s=500)


@pytest.fixture(scope="module")
def hf_layout_reference(tiny_models):
    """name -> hf_reference of ragged_batch(8) at TEMPERATURE by HF model `name`, computed once for the
    layouts that share it."""
    found = {}

    def of(name):
        if name not in found:
            found[name] = hf_reference(tiny_models[name], ragged_batch(8), TEMPERATURE)
        return found[name]

    return of


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay[0]}-TP{lay[1]}-PP{lay[2]}-VPP{lay[3] or 1}")
def test_log_probs_and_entropy_equal_hf(layout, layouts_run, training_run, hf_layout_reference):
    name, tp, pp, _ = layout
    if layout in TRAINING_WORLD_LAYOUTS:  # scored in the 2-rank world
        ranks = [rank[TRAINING_WORLD_LAYOUTS[layout]]["layout_scores"] for rank in training_run]
        scores = {r["dp_rank"]: r["scored"] for r in ranks if r["scored"] is not None}
        world, output_ranks = 2, sum(r["output_rank"] for r in ranks)
    else:
        scores = {dp: s for rank in layouts_run for (lay, dp), s in rank["scores"].items() if lay == layout}
        world, output_ranks = 4, sum(rank["output_ranks"][layout] for rank in layouts_run)
    assert sorted(scores) == list(range(world // (tp * pp)))  # one output rank per DP replica
    assert output_ranks == len(scores)
    batch = ragged_batch(8)
    log_probs = torch.cat([scores[dp]["log_probs"] for dp in sorted(scores)])
    entropy = torch.cat([scores[dp]["entropy"] for dp in sorted(scores)])
    # a torch_dist model is checked against its HF source
    hf_log_probs, hf_entropy, _ = hf_layout_reference(name.removesuffix("_mcore").removesuffix("_verl"))
    close(log_probs, hf_log_probs)
    close(entropy, hf_entropy)
    padding = ~batch["response_mask"].bool()
    assert log_probs.dtype == torch.float32 and bool((log_probs[padding] == 0).all() and (entropy[padding] == 0).all())


def test_step0_reference_equals_actor_and_first_ppo_kl_is_zero(layouts_run):
    ref_equal = [rank["ref_equal"] for rank in layouts_run if "ref_equal" in rank]
    assert ref_equal == [True]  # one DP replica at TP2 x PP2, bit-identical
    for layout in TRAINED_LAYOUTS:
        metrics = [rank["updates"][layout] for rank in layouts_run]
        assert all(m == metrics[0] for m in metrics)  # the same metrics on every rank
        first = metrics[0][0]
        assert first["actor/ppo_kl"] == 0.0
        assert first["actor/pg_clipfrac"] == 0.0
        assert first["actor/ratio_max"] == first["actor/ratio_min"] == 1.0


def test_interleaved_pipeline_trains_like_1f1b(layouts_run):
    """PP2 x VPP2 at DP2 (interleaved schedule) and TP2 x PP2 at DP1 (1F1B): the same gradients
    (norm) and the same loss after an update."""
    one_f_one_b, interleaved = (layouts_run[0]["updates"][layout] for layout in TRAINED_LAYOUTS)
    for a, b in zip(one_f_one_b, interleaved):
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], rel=1e-5, abs=1e-7)
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-5)
    assert one_f_one_b[1]["actor/pg_loss"] < one_f_one_b[0]["actor/pg_loss"]


# ------------------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def training_run(tiny_models, tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("engine_ckpt") / "actor"
    ranks = run_gloo_workers(training_world, 2, args=(tiny_models, str(checkpoint)), timeout_s=500)
    return ranks


def _old_log_probs(run, layout):
    parts = sorted((rank[layout]["dp_rank"], rank[layout]["old_log_probs"]) for rank in run
                   if rank[layout]["old_log_probs"] is not None)
    return torch.cat([p for _, p in parts])


def test_updates_lower_the_loss_and_metrics_agree_on_every_rank(training_run):
    for layout in ("tp1", "tp2"):
        runs = [rank[layout]["metrics"] for rank in training_run]
        assert runs[0] == runs[1]
        losses = [m["actor/pg_loss"] for m in runs[0]]
        assert all(b < a for a, b in zip(losses, losses[1:])), losses
        assert {"actor/grad_norm", "actor/lr", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac",
                "actor/tokens"} <= set(runs[0][0])


def test_a_non_finite_loss_on_one_rank_skips_the_update_on_every_rank(training_run):
    for layout in ("tp1_resumed", "resumed"):
        for rank in training_run:
            assert rank[layout]["poisoned"] == {"skipped": 1.0, "unchanged": True, "next_skipped": 0.0}, layout


def test_first_update_loss_is_the_hf_mini_batch_loss(training_run, tiny_models):
    """Micro-batch losses (fixed size over DP2, or token-budget at DP1) add up to the loss of the
    whole mini-batch computed at once from HF log-probs."""
    batch = training_batch()
    cfg = config(tiny_models["qwen2"], 2, 1, 1, None, None, *ACTOR_LOSS)
    hf_log_probs, hf_entropy, _ = hf_reference(tiny_models["qwen2"], batch)
    for layout in ("tp1", "tp2"):
        loss, _ = actor_loss(hf_log_probs, _old_log_probs(training_run, layout), batch["advantages"],
                             batch["response_mask"], entropy=hf_entropy, ref_log_prob=batch["ref_log_probs"],
                             **actor_loss_kwargs(cfg.actor_rollout_ref.actor))
        first = training_run[0][layout]["metrics"][0]
        assert first["actor/actor_loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)


def test_tp1_and_tp2_updates_give_the_same_weights(training_run, tiny_models):
    arch = arch_from_hf_config(load_hf_config(tiny_models["qwen2"]))
    weights = WeightMap(arch, padded_vocab(arch.vocab_size, 1))
    tp1 = merge_model(weights, training_run[0]["tp1"]["state"], ParallelLayout(1, 1, 1))
    tp2 = merge_model(weights, {**training_run[0]["tp2"]["state"], **training_run[1]["tp2"]["state"]},
                      ParallelLayout(2, 1, 1))
    initial = {name: weights.to_mcore(name, _hf_tensors(tiny_models["qwen2"]).__getitem__) for name in tp1}
    assert max((tp1[n] - initial[n]).abs().max() for n in tp1) > 1e-4  # the updates moved the weights
    assert max((tp1[n] - tp2[n]).abs().max() for n in tp1) < 1e-5
    for a, b in zip(training_run[0]["tp1"]["metrics"], training_run[0]["tp2"]["metrics"]):
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], rel=1e-5, abs=1e-7)
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-5)


def _hf_tensors(model_dir):
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


@pytest.mark.parametrize("layout", ["tp1", "tp2"])  # distributed optimizer (DDP param buffers) / not
def test_offload_frees_and_onload_restores_exactly(layout, training_run):
    for rank in training_run:
        run = rank[layout]
        assert run["freed"] and run["refused_while_offloaded"] and run["restored"]
        assert run["offload"]["bytes"] > 0 and run["onload"]["bytes"] == run["offload"]["bytes"]
        assert run["offload"]["freed_bytes"] > run["offload"]["bytes"]  # gradient buffers are dropped, not copied
        # in two steps (colocated: grads and optimizer before the push, parameters after) each part
        # moves once, the same bytes in all, and everything comes back exactly
        first, second = run["staged_offload"]
        assert run["params_kept_for_the_push"] and first["params_bytes"] == 0 and first["grads_bytes"] > 0
        assert second["grads_bytes"] == second["optimizer_bytes"] == 0 and second["params_bytes"] > 0
        for key in ("bytes", "freed_bytes", "params_bytes", "grads_bytes", "optimizer_bytes"):
            assert first[key] + second[key] == run["offload"][key], key
        assert run["staged_onload"]["bytes"] == run["onload"]["bytes"] and run["staged_restored"]


def test_on_cpu_the_engine_builds_with_no_fusion_and_overlaps_only_dp2_with_the_distributed_optimizer(training_run):
    """The CPU decisions of model.fusion_flags and optim.ddp_overlap (tests/engines/test_gpu_defaults.py)
    are what the engine really builds with; "tp1" (DP2, distributed optimizer) trains with both
    overlaps, and the tests above find the same weights, losses and checkpoints as without."""
    no_fusion = {"bias_activation_fusion": False, "bias_dropout_fusion": False, "apply_rope_fusion": False,
                 "gradient_accumulation_fusion": False, "masked_softmax_fusion": False, "persist_layer_norm": False,
                 "cross_entropy_loss_fusion": False}
    for rank in training_run:
        assert rank["tp1"]["built_with"] == {"fusions": no_fusion, "overlap": {
            "overlap_grad_reduce": True, "overlap_param_gather": True, "align_param_gather": False}}
        assert rank["tp2"]["built_with"] == {"fusions": no_fusion, "overlap": {  # DP1, plain optimizer
            "overlap_grad_reduce": False, "overlap_param_gather": False, "align_param_gather": False}}


def test_distributed_optimizer_checkpoint_resumes_exactly(training_run):
    for rank in training_run:
        assert rank["tp1_resumed"]["updates"] == SAVE_AFTER
        assert rank["tp1_resumed"]["metrics"] == rank["tp1"]["metrics"][SAVE_AFTER:]


def test_checkpoint_at_tp2_resumes_at_tp1_pp2_with_the_same_losses(training_run):
    continued = training_run[0]["tp2"]["metrics"][SAVE_AFTER:]
    for rank in training_run:
        assert rank["resumed"]["updates"] == SAVE_AFTER
        resumed = rank["resumed"]["metrics"]
        assert len(resumed) == UPDATES - SAVE_AFTER
        for a, b in zip(resumed, continued):
            assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], rel=1e-5, abs=1e-7)
            assert a["actor/lr"] == b["actor/lr"]


@pytest.mark.parametrize("source", ["qwen2", "qwen2_rm"])
def test_critic_values_equal_hf_hidden_states_through_the_head(source, training_run, tiny_models):
    result = training_run[0][source + "_critic"]
    _, _, hidden = hf_reference(tiny_models[source], training_batch())
    mask = training_batch()["response_mask"].bool()
    expected = torch.where(mask, (hidden @ result["head"].T).squeeze(-1), 0.0)
    close(result["values"], expected)
    if source == "qwen2_rm":
        assert torch.equal(result["head"], _hf_tensors(tiny_models[source])["score.weight"])
    losses = [m["critic/vf_loss"] for m in result["metrics"]]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert result["metrics"] == training_run[1][source + "_critic"]["metrics"]
