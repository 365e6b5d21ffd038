"""LoRA on the megatron engine (real megatron-core on CPU/gloo), checked against HF and PEFT in fp32.

One 2-rank world (lora_world.py) trains the same LoRA PPO updates at TP1 (DP2), TP2 and PP2,
scores the base model, exports merged weights through the resharder, checkpoints and resumes.
Oracles: the base model's own log-probs (B = 0), the TP1 run, HF transformers on the merged
export, and the `peft` library loading our PEFT-format export onto the HF base model.
"""
import pytest
import torch
from engine_world import training_batch
from lora_world import CHECKPOINT, SAVE_AFTER, UPDATES, lora_config, lora_world
from transformers import AutoModelForCausalLM

from megarl.bridge.lora import is_lora_param
from megarl.cli import main as megarl_main
from megarl.config import to_yaml
from megarl.testing import run_gloo_workers

pytestmark = pytest.mark.slow  # one 2-rank megatron world: ~60 s on 2 cores


@pytest.fixture(scope="module")
def lora_run(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    ranks = run_gloo_workers(lora_world, 2, args=(tiny_models, str(out)), timeout_s=600)
    return ranks, out


def model_log_probs(model, batch) -> torch.Tensor:
    """[B, R] log-probs of the responses under an HF (or PEFT-wrapped) causal LM, fp32."""
    log_probs = torch.zeros(batch["response_mask"].shape)
    for i in range(len(batch)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        response = batch["response_ids"][i][batch["response_mask"][i].bool()]
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0].float()
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
        log_probs[i, : len(response)] = logits.log_softmax(-1)[at, response]
    return log_probs


def dp_gather(ranks, layout, key) -> torch.Tensor:
    """The whole batch's [B, R] result from the output ranks, in DP order."""
    parts = sorted((r[layout]["dp_rank"], r[layout][key]) for r in ranks if r[layout][key] is not None)
    return torch.cat([p for _, p in parts])


def test_at_initialisation_log_probs_equal_the_base_model_exactly(lora_run):
    ranks, _ = lora_run
    assert torch.equal(dp_gather(ranks, "tp1", "init_log_probs"), dp_gather(ranks, "tp1", "base_log_probs"))


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_only_adapters_have_gradients_and_change(layout, lora_run):
    for rank in lora_run[0]:
        run = rank[layout]
        assert run["trainable"] and all(is_lora_param(n) for n in run["trainable"])
        assert run["frozen_count"] > 0
        # megatron's DDP buffers (the gradient all-reduce) and optimizer cover exactly the adapters
        assert run["grad_buffer_numel"] == run["adapter_numel"] > 0
        assert run["changed"] == sorted(f"0.{n}" for n in run["trainable"])  # every adapter moved, no base weight


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_adapter_sync_gathers_every_stage_and_tp_shard_on_the_first_stage(layout, lora_run):
    """`sync.adapter_sync.gather_full_adapters` (what an adapter push writes) holds every layer's
    full factors on pipeline rank 0: those the test gathers its own way (`full_adapters`)."""
    gathered = [rank[layout]["sync_adapters"] for rank in lora_run[0]]
    first = [g for g in gathered if g is not None]
    assert len(first) == (1 if layout == "pp2" else 2)  # pipeline rank 0 only
    expected = lora_run[0][0][layout]["adapters"]
    for adapters in first:
        assert sorted(adapters) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(adapters[name], tensor.float()), name


def test_a_lora_critic_trains_only_its_adapters_and_its_value_head(lora_run):
    """`critic.model.lora`: the backbone is frozen, the adapters and the (new) value head train."""
    for rank in lora_run[0]:
        run = rank["critic_tp2"]
        head = [n for n in run["trainable"] if not is_lora_param(n)]
        assert head == ["output_layer.weight"], run["trainable"]
        assert len(run["trainable"]) > 1
        # DDP's gradient buffers (the all-reduce) and the optimizer hold exactly these
        assert run["grad_buffer_numel"] == run["trainable_numel"] == run["adapter_numel"] + 64  # head [1, H=64]
        assert run["changed"] == sorted(f"0.{n}" for n in run["trainable"])  # all of them moved, nothing else
        assert all(m["critic/grad_norm"] > 0 for m in run["metrics"]), run["metrics"]


def test_tp2_and_pp2_updates_equal_tp1(lora_run):
    ranks, _ = lora_run
    tp1 = dp_gather(ranks, "tp1", "final_log_probs")
    initial = dp_gather(ranks, "tp1", "init_log_probs")
    assert (tp1 - initial).abs().max() > 1e-2  # the updates changed the policy
    for layout in ("tp2", "pp2"):
        torch.testing.assert_close(dp_gather(ranks, layout, "final_log_probs"), tp1, rtol=0, atol=1e-5)
        a, b = ranks[0]["tp1"]["adapters"], ranks[0][layout]["adapters"]
        assert a.keys() == b.keys() and len(a) == 4 * 7 * 2
        for name in a:
            # B carries the update; A starts moving from a zero gradient, where Adam's first steps
            # (g / sqrt(g^2)) amplify fp32 summation-order differences: a looser bound (lr = 1e-2)
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5 if name.endswith("_B") else 2e-4)
        for m1, m2 in zip(ranks[0]["tp1"]["metrics"], ranks[0][layout]["metrics"]):
            assert m2["actor/pg_loss"] == pytest.approx(m1["actor/pg_loss"], rel=1e-5, abs=1e-7)


def test_merged_export_through_the_resharder_equals_the_actor_and_restores_the_weights(lora_run):
    ranks, out = lora_run
    assert all(r["tp1"]["restored_after_export"] for r in ranks)
    hf = AutoModelForCausalLM.from_pretrained(out / "merged_hf", dtype=torch.float32).eval()
    ours = dp_gather(ranks, "tp1", "final_log_probs")
    torch.testing.assert_close(model_log_probs(hf, training_batch()) * (ours != 0), ours, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_checkpoint_resume_is_exact(layout, lora_run):
    """At TP2 every TP rank once claimed the main replica of the factors it holds whole (A of a
    column-parallel layer, B of a row-parallel one): megatron's sharding check raised on rank 0
    alone while rank 1 went on into the save's collectives, and a run hung at its first checkpoint."""
    ranks, _ = lora_run
    for rank in ranks:
        resumed, original = rank[f"{layout}_resumed"], rank[layout]
        assert resumed["updates"] == UPDATES
        assert resumed["metrics"] == original["metrics"][SAVE_AFTER:]
        assert all(torch.equal(resumed["adapters"][n], original["adapters"][n]) for n in original["adapters"])


@pytest.fixture(scope="module")
def checkpoint(lora_run, tiny_models):
    """The world's saved actor completed as a megarl experiment checkpoint (config + marker)."""
    _, out = lora_run
    directory = out / CHECKPOINT
    (directory / "config.yaml").write_text(to_yaml(lora_config(tiny_models["qwen2"], 2, 1, 1)))
    (directory / "COMPLETE").write_text(f"{SAVE_AFTER}\n")
    return directory


def test_peft_loads_the_exported_adapter_onto_the_hf_base_with_our_log_probs(lora_run, checkpoint, tiny_models):
    import json

    from peft import PeftModel

    assert megarl_main(["export", str(checkpoint), "--lora", "--out", str(checkpoint.parent / "peft")]) == 0
    config = json.loads((checkpoint.parent / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    base = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, checkpoint.parent / "peft").eval()
    # every adapter loaded (peft warns, not fails, on missing keys): its B is no longer zero
    loaded = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert len(loaded) == 4 * 7 and all(p.abs().max() > 0 for p in loaded.values())
    ours = dp_gather(lora_run[0], "tp1_resumed", "loaded_log_probs")  # the checkpointed weights
    batch = training_batch()
    torch.testing.assert_close(model_log_probs(model, batch) * (ours != 0), ours, rtol=0, atol=1e-5)


def test_merged_export_of_the_checkpoint_equals_our_log_probs(lora_run, checkpoint):
    out = checkpoint.parent / "merged_from_checkpoint"
    assert megarl_main(["export", str(checkpoint), "--merged", "--out", str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = dp_gather(lora_run[0], "tp1_resumed", "loaded_log_probs")
    torch.testing.assert_close(model_log_probs(hf, training_batch()) * (ours != 0), ours, rtol=0, atol=1e-5)
