"""Training DeepSeek-V3's multi-token-prediction layer in the actor (verl's model.mtp.enable_train), on a tiny
model on CPU, against an oracle written from HF transformers' own DeepSeek-V3 modules (the MTP layer's decoder
layer is HF's DeepseekV3DecoderLayer; its enorm / hnorm / eh_proj / shared_head.norm as SGLang's draft model
runs them, models/deepseek_nextn.py). Checked: the policy's log-probs are the main head's, equal with and
without the MTP block; the MTP loss the actor reports (in a policy update and in an SFT step) is the oracle's
cross-entropy of each response token predicted two positions back; the gradient megatron accumulates for the
MTP layer's eh_proj is mtp_loss_scaling_factor x the oracle's gradient of that cross-entropy
(MTPLossAutoScaler); with detach_encoder the MTP loss leaves the decoder without gradient; at PP 2 the same, the
MTP block on the last stage; at CP 2, padded and packed, the loss, the metric and every parameter's gradient
those of CP 1 (and the oracle's). The weight push sends the trained MTP layer under the checkpoint's names to
servers that draft with it, and nothing of it to servers that do not."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_world import ragged_batch
from megarl.data.tiny_model import make_tiny_model
from megarl.testing import run_gloo_workers
from mtp_engine_world import EH_PROJ, mtp_one_rank_world, mtp_two_rank_world

pytestmark = pytest.mark.slow  # a 1-rank world (6 actor engines) and a 2-rank one (4), once for the module

L = 2  # a dense and an MoE decoder layer; the MTP layer (HF layer 2) is an MoE layer
FACTOR = 0.1  # verl's default mtp_loss_scaling_factor
OWN = ("enorm", "hnorm", "eh_proj", "shared_head.norm")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the HF directory with one MTP layer, HF's model with that layer as its layer L, the MTP layer's own
    weights by name)."""
    import transformers

    root = tmp_path_factory.mktemp("mtp")
    full = make_tiny_model("deepseek_v3", root / "full", layers=L + 1, hidden=64, heads=4, tie=False, seed=3)
    model_dir = make_tiny_model("deepseek_v3", root / "mtp", layers=L + 1, hidden=64, heads=4, tie=False, seed=3)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    (model_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(11)
    hidden = config["hidden_size"]
    own = {"enorm": 1 + 0.2 * torch.randn(hidden, generator=g), "hnorm": 1 + 0.2 * torch.randn(hidden, generator=g),
           "eh_proj": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
           "shared_head.norm": 1 + 0.2 * torch.randn(hidden, generator=g)}
    tensors.update({f"model.layers.{L}.{name}.weight": w for name, w in own.items()})
    tensors[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32, attn_implementation="eager")
    return model_dir, hf.eval(), own


def oracle_mtp_loss(hf, own: dict, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token mean over the batch's response tokens of the MTP layer's cross-entropy, each token predicted
    from two positions back; its gradient wrt eh_proj [H, 2H]). The MTP layer at position i reads the main
    model's final normed hidden state at i and token i + 1's embedding (megatron's and SGLang's order:
    eh_proj(cat(enorm(embedding), hnorm(hidden))))."""
    model = hf.model
    eh_proj = own["eh_proj"].clone().requires_grad_(True)
    norms = {n: torch.nn.RMSNorm(w.shape[0], eps=hf.config.rms_norm_eps) for n, w in own.items() if n != "eh_proj"}
    with torch.no_grad():
        for n, module in norms.items():
            module.weight.copy_(own[n])
    total, count = 0.0, 0
    for i in range(len(batch)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        response = batch["response_ids"][i][batch["response_mask"][i].bool()]
        ids = torch.cat([prompt, response])[None]
        n, p = ids.shape[1], len(prompt)
        positions = torch.arange(n)[None]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = model.embed_tokens(ids)
        rope = model.rotary_emb(x, positions)
        with torch.no_grad():
            for layer in model.layers[:L]:
                x = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=rope)
            h = model.norm(x)
            e = model.embed_tokens(torch.cat([ids[:, 1:], torch.zeros(1, 1, dtype=ids.dtype)], dim=1))
        y = torch.nn.functional.linear(torch.cat([norms["enorm"](e), norms["hnorm"](h)], dim=-1), eh_proj)
        y = model.layers[L](y, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        logits = hf.lm_head(norms["shared_head.norm"](y))[0]
        at = torch.arange(p - 2, n - 2)  # response token p + j is predicted at position p + j - 2
        total = total + torch.nn.functional.cross_entropy(logits[at], ids[0, at + 2], reduction="sum")
        count += len(response)
    loss = total / count
    (grad,) = torch.autograd.grad(loss, eh_proj)
    return loss.detach(), grad


BATCH_SEED = 4


@pytest.fixture(scope="module")
def oracle(checkpoint):
    """`oracle_mtp_loss` of the batch every world trains on (ragged_batch(8, seed=BATCH_SEED))."""
    _, hf, own = checkpoint
    return oracle_mtp_loss(hf, own, ragged_batch(8, seed=BATCH_SEED))


@pytest.fixture(scope="module")
def one_rank(checkpoint):
    """mtp_one_rank_world's result: the plain actor, the policy update, detach_encoder, the SFT step, CP 1."""
    (out,) = run_gloo_workers(mtp_one_rank_world, 1, args=(str(checkpoint[0]), ragged_batch(8, seed=BATCH_SEED)),
                              timeout_s=400)
    return out


@pytest.fixture(scope="module")
def two_ranks(checkpoint):
    """mtp_two_rank_world's results of ranks 0 and 1: PP 2, then CP 2."""
    return run_gloo_workers(mtp_two_rank_world, 2, args=(str(checkpoint[0]), ragged_batch(8, seed=BATCH_SEED)),
                            timeout_s=400)


def test_mtp_training_adds_the_scaled_mtp_loss_and_keeps_the_policy(checkpoint, one_rank, oracle):
    model_dir, _, _ = checkpoint
    out = one_rank["policy"]
    assert torch.equal(out["with_mtp"], one_rank["plain"])  # the main head's log-probs, bit for bit
    assert EH_PROJ not in one_rank["plain_names"]
    loss, grad = oracle
    reported = out["metrics"]["actor/mtp_1_loss"]
    print(f"MTP loss: reported {reported:.6f}, oracle {loss.item():.6f}; "
          f"max |grad - factor x oracle grad| {(out['grads'][EH_PROJ] - FACTOR * grad).abs().max().item():.2e}")
    assert reported == pytest.approx(loss.item(), rel=1e-5)
    torch.testing.assert_close(out["grads"][EH_PROJ], FACTOR * grad, rtol=1e-4, atol=1e-7)
    assert out["grads"]["decoder.layers.0.mlp.linear_fc1.weight"].abs().max() > 0  # the MTP loss reaches the decoder
    # the push: to servers that draft with the MTP layer, the checkpoint's every tensor but the MTP layer's
    # copies of the embedding and head (SGLang's draft model takes the target's), the trained ones as trained
    # (the routers' selection biases are buffers that training leaves as they are: never pushed)
    on_disk = {n for n in load_file(model_dir / "model.safetensors") if not n.endswith("e_score_correction_bias")}
    copies = {f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight"}
    assert set(out["pushed_drafting"]) == on_disk - copies
    assert torch.equal(out["pushed_drafting"][f"model.layers.{L}.eh_proj.weight"], out["eh_proj"])
    assert set(out["pushed_names"]) == {n for n in on_disk if not n.startswith(f"model.layers.{L}.")}


def test_detach_encoder_keeps_the_mtp_loss_out_of_the_decoder(one_rank, oracle):
    out = one_rank["detach_encoder"]
    _, grad = oracle
    torch.testing.assert_close(out["grads"][EH_PROJ], FACTOR * grad, rtol=1e-4, atol=1e-7)
    decoder = [g for name, g in out["grads"].items() if name.startswith(("decoder.", "embedding."))]
    assert all(torch.count_nonzero(g) == 0 for g in decoder)


def test_an_sft_step_adds_the_mtp_loss_too(one_rank, oracle):
    """verl's SFT with model.mtp.enable_train: the MTP loss beside the NLL, which does not reach eh_proj."""
    out = one_rank["sft"]
    loss, grad = oracle
    assert out["metrics"]["sft/mtp_1_loss"] == pytest.approx(loss.item(), rel=1e-5)
    torch.testing.assert_close(out["grads"][EH_PROJ], FACTOR * grad, rtol=1e-4, atol=1e-7)


def test_pipeline_stages_train_the_mtp_layer_on_the_last(two_ranks, oracle):
    """PP 2: megatron builds the MTP block on the last stage with a copy of the embedding, whose gradient it
    all-reduces with the first stage's (finalize_model_grads); the push sends the embedding once."""
    first, last = (rank["pp"] for rank in two_ranks)
    assert torch.equal(last["with_mtp"], last["plain"])
    loss, grad = oracle
    assert last["metrics"]["actor/mtp_1_loss"] == first["metrics"]["actor/mtp_1_loss"] == pytest.approx(loss.item(),
                                                                                                       rel=1e-5)
    assert EH_PROJ not in first["grads"]
    torch.testing.assert_close(last["grads"][EH_PROJ], FACTOR * grad, rtol=1e-4, atol=1e-7)
    embedding = "embedding.word_embeddings.weight"
    assert torch.equal(first["grads"][embedding], last["grads"][embedding])
    assert first["grads"][embedding].abs().max() > 0
    pushed = first["pushed"] + last["pushed"]
    assert len(pushed) == len(set(pushed)) and "model.embed_tokens.weight" in pushed


def test_context_parallelism_trains_the_mtp_layer_as_one_rank(one_rank, two_ranks, oracle):
    """CP 2 (megatron's chunk layout: rank r holds chunks r and 3 - r of every sequence, megatron's roll_tensor
    rolls across their boundaries): each CP rank's MTP loss is normalised by the whole micro-batch's tokens
    (megarl.engines.megatron.mtp.cp_token_normaliser), so the reported loss, the eh_proj gradient and every
    other parameter's gradient equal CP 1's, padded and packed (each packed sequence padded to 4 positions
    there), and the oracle's."""
    one, two = one_rank["cp"], [rank["cp"] for rank in two_ranks]
    loss, grad = oracle
    for layout in ("padded", "packed"):
        (metrics1, grads1), (metrics2, grads2) = one[layout], two[0][layout]
        print(f"{layout}: MTP loss CP1 {metrics1['actor/mtp_1_loss']:.6f}, CP2 {metrics2['actor/mtp_1_loss']:.6f}, "
              f"oracle {loss.item():.6f}")
        assert metrics2["actor/mtp_1_loss"] == pytest.approx(metrics1["actor/mtp_1_loss"], rel=1e-5)
        assert metrics1["actor/mtp_1_loss"] == pytest.approx(loss.item(), rel=1e-5)
        torch.testing.assert_close(grads1[EH_PROJ], FACTOR * grad, rtol=1e-4, atol=1e-7)
        assert grads2.keys() == grads1.keys()
        for name in grads1:
            torch.testing.assert_close(grads2[name], grads1[name], rtol=1e-4, atol=1e-7, msg=name)
            torch.testing.assert_close(two[1][layout][1][name], grads2[name], rtol=0, atol=0, msg=name)
        assert grads2["decoder.layers.0.mlp.linear_fc1.weight"].abs().max() > 0
