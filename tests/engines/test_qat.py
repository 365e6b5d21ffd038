"""Quantization-aware training (verl's `actor.megatron.qat`, NVFP4 W4A16) on the megatron engine, float32 on CPU.

The world (qat_world.py): a QAT actor of a tiny Qwen2 at TP 1 (DP 2) and at TP 2, a reference from the
same config, each actor pushing into a CPU engine. The oracle: HF transformers' own Qwen2 whose linear
weights are replaced by their NVFP4 values, quantized as ModelOpt quantizes megatron's tensors (one
global scale per megatron tensor, which at TP 1 fuses q/k/v and gate/up, and per TP shard at TP 2:
megatron's column-parallel layers split the query groups and the MLP's gate and up rows, its row-parallel
ones the input columns). `nvfp4_dequantized` is ModelOpt's NVFP4 bit for bit
(tests/algos/test_nvfp4_modelopt.py). Checked: the actor's log-probs are the oracle's; the gradient of an
SFT step is the oracle's gradient with respect to the quantized weights (straight-through) while the
masters stay full precision (in the checkpoint, which resumes exactly, and the HF export too); the reference (forward-only) is not quantized (verl's rule); after a push the
rollout server's log-probs of the responses are the trainer's quantized ones, at TP 1 and at TP 2.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_world import hf_log_probs, ragged_batch
from megarl.algos.nvfp4 import nvfp4_dequantized
from megarl.data.tiny_model import make_tiny_model
from megarl.engines.megatron.qat import is_quantized
from megarl.rollout.launch import cpu_server_command
from megarl.rollout.process import ServerProcess, start_on_a_free_port
from megarl.testing import run_gloo_workers
from qat_world import GRADS, qat_world, served_log_probs

pytestmark = pytest.mark.slow  # one 2-rank megatron world and a CPU engine: ~40 s on 2 cores

LAYERS, HIDDEN, HEADS, KV_HEADS = 2, 64, 4, 2
ATTENTION = ("q_proj", "k_proj", "v_proj")


def quantized_hf(model_dir, tp: int):
    """HF's model with every weight megatron's QAT quantizes replaced by its NVFP4 values at TP `tp`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    head_dim, q_per_kv = HIDDEN // HEADS, HEADS // KV_HEADS
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        with torch.no_grad():
            # column-parallel linear_qkv: TP rank r holds query groups r * G/tp .. (each: its q heads, k, v)
            for r in range(tp):
                groups = range(r * KV_HEADS // tp, (r + 1) * KV_HEADS // tp)
                rows = {"q_proj": [h for g in groups for h in range(g * q_per_kv * head_dim, (g + 1) * q_per_kv * head_dim)],
                        "k_proj": [h for g in groups for h in range(g * head_dim, (g + 1) * head_dim)],
                        "v_proj": [h for g in groups for h in range(g * head_dim, (g + 1) * head_dim)]}
                _quantize_together([(getattr(attn, p).weight, rows[p]) for p in ATTENTION])
            # column-parallel linear_fc1: TP rank r holds gate rows and up rows r * F/tp ..
            width = mlp.gate_proj.weight.shape[0] // tp
            for r in range(tp):
                rows = list(range(r * width, (r + 1) * width))
                _quantize_together([(mlp.gate_proj.weight, rows), (mlp.up_proj.weight, rows)])
            # row-parallel linear_proj, linear_fc2: TP rank r holds input columns r * in/tp ..
            for weight in (attn.o_proj.weight, mlp.down_proj.weight):
                columns = weight.shape[1] // tp
                for r in range(tp):
                    piece = weight[:, r * columns:(r + 1) * columns]
                    piece.copy_(nvfp4_dequantized(piece.clone()))
    return model


def _quantize_together(parts):
    """Quantize the rows `rows` of each weight as one tensor (one global scale), in place."""
    whole = torch.cat([weight[rows] for weight, rows in parts])
    values = nvfp4_dequantized(whole).split([len(rows) for _, rows in parts])
    for (weight, rows), v in zip(parts, values):
        weight[rows] = v


def oracle_sft_grads(model, batch) -> dict[str, torch.Tensor]:
    """The gradients of the token-mean NLL of the batch's responses with respect to the (quantized)
    weights of layer 0's o_proj and layer 1's down_proj, under megatron's names."""
    weights = {GRADS[0]: model.model.layers[0].self_attn.o_proj.weight,
               GRADS[1]: model.model.layers[1].mlp.down_proj.weight}
    for w in weights.values():
        w.requires_grad_(True)
    total, count = 0.0, 0
    for i in range(len(batch)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        response = batch["response_ids"][i][batch["response_mask"][i].bool()]
        logits = model(torch.cat([prompt, response])[None]).logits[0]
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
        total = total - logits.log_softmax(-1)[at, response].sum()
        count += len(response)
    grads = torch.autograd.grad(total / count, list(weights.values()))
    return dict(zip(weights, grads))


def scored_by(model, batch) -> torch.Tensor:
    """[B, R]: the model's log-probs of the batch's responses, 0 at padding."""
    out = torch.zeros(batch["response_mask"].shape)
    with torch.no_grad():
        for i in range(len(batch)):
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
            response = batch["response_ids"][i][batch["response_mask"][i].bool()]
            logits = model(torch.cat([prompt, response])[None]).logits[0]
            at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
            out[i, :len(response)] = logits.log_softmax(-1)[at, response]
    return out


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("qat")
    model_dir = make_tiny_model("qwen2", root / "qwen2", layers=LAYERS, hidden=HIDDEN, heads=HEADS,
                                kv_heads=KV_HEADS, seed=0)
    batch = ragged_batch(8, seed=3)
    server = start_on_a_free_port(lambda port: ServerProcess(
        "qat-rollout", cpu_server_command(str(model_dir), port, dtype="float32", num_threads=1),
        f"http://127.0.0.1:{port}", log_path=str(root / "server.log"), startup_timeout_s=120), "127.0.0.1")
    try:
        before_push = served_log_probs(server.url, batch)
        ranks = run_gloo_workers(qat_world, 2, args=(str(model_dir), batch, server.url, str(root)), timeout_s=600)
        after_tp2_push = served_log_probs(server.url, batch)
    finally:
        server.stop(timeout_s=15)
    return dict(model_dir=model_dir, root=root, batch=batch, out=ranks[0], before_push=before_push,
                after_tp2_push=after_tp2_push)


def test_quantized_linears_are_modelopts_under_verls_default_patterns(qat_run):
    names = qat_run["out"]["quantized"]
    expected = [f"decoder.layers.{i}.{m}" for i in range(LAYERS)
                for m in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")]
    assert sorted(names) == sorted(expected)  # the output layer is left out
    assert not is_quantized("output_layer", ["lm_head", "*mlp.gate"])
    assert not is_quantized("decoder.layers.0.mlp.router", [])
    assert not is_quantized("decoder.layers.3.mlp.linear_fc1", ["*layers.3.*"])
    assert is_quantized("decoder.layers.3.mlp.linear_fc1", ["*mlp.linear_fc1"])  # fnmatch on "...weight_quantizer"
    assert not is_quantized("decoder.layers.3.self_attention.linear_qkv", ["*self_attn*"])


def test_log_probs_and_gradients_are_those_of_the_quantized_model(qat_run):
    out, batch = qat_run["out"], qat_run["batch"]
    oracle = quantized_hf(qat_run["model_dir"], tp=1)
    expected = scored_by(oracle, batch)
    full_precision = hf_log_probs(qat_run["model_dir"], batch, 1.0)
    print(f"max |actor - quantized oracle| {(out['log_probs'] - expected).abs().max():.2e}; "
          f"max |quantized - full precision| {(expected - full_precision).abs().max():.2e}")
    torch.testing.assert_close(out["log_probs"], expected, atol=2e-5, rtol=1e-5)
    assert (expected - full_precision).abs().max() > 1e-3  # the quantization shows
    grads = oracle_sft_grads(oracle, batch)
    plain = AutoModelForCausalLM.from_pretrained(qat_run["model_dir"], dtype=torch.float32)
    for name, grad in grads.items():
        torch.testing.assert_close(out["grads"][name], grad, rtol=1e-4, atol=1e-7)
    # the masters stay full precision: what the step started from is the checkpoint's weight, unquantized
    assert torch.equal(out["masters"][GRADS[0]], plain.model.layers[0].self_attn.o_proj.weight)
    assert not torch.equal(out["masters"][GRADS[0]], nvfp4_dequantized(out["masters"][GRADS[0]]))


def test_checkpoints_and_the_hf_export_keep_the_master_weights(qat_run):
    """The checkpoint resumes exactly; the HF export holds the full-precision masters, as verl's HF save
    (its checkpoint managers save the module's parameters; only its weight sync quantizes)."""
    out = qat_run["out"]
    assert out["resumed_equal"] and torch.equal(out["resumed_log_probs"], out["trained_log_probs"])
    exported = AutoModelForCausalLM.from_pretrained(qat_run["root"] / "hf", dtype=torch.float32)
    o_proj = exported.model.layers[0].self_attn.o_proj.weight
    assert torch.equal(o_proj, out["trained_masters"][GRADS[0]])
    assert not torch.equal(o_proj, nvfp4_dequantized(o_proj))


def test_the_reference_is_not_quantized(qat_run):
    out, batch = qat_run["out"], qat_run["batch"]
    torch.testing.assert_close(out["ref_log_probs"], hf_log_probs(qat_run["model_dir"], batch, 1.0),
                               atol=2e-5, rtol=1e-5)


def test_after_a_push_the_rollout_computes_with_the_trainers_quantized_weights(qat_run):
    out, batch = qat_run["out"], qat_run["batch"]
    assert out["push_tp1"]["sync/checked_tensors"] > 0 and out["push_tp2"]["sync/checked_tensors"] > 0
    # before any push the server computes in full precision (the negative control)
    assert (qat_run["before_push"] - out["log_probs"]).abs().max() > 1e-3
    # TP 2's global scales are per shard: other values than TP 1's, which the push reproduces exactly
    tp2_oracle = scored_by(quantized_hf(qat_run["model_dir"], tp=2), batch)
    torch.testing.assert_close(out["tp2_log_probs"], tp2_oracle, atol=2e-5, rtol=1e-5)
    assert (tp2_oracle - out["log_probs"]).abs().max() > 1e-6
    torch.testing.assert_close(out["served_after_tp1_push"], out["trained_log_probs"], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(qat_run["after_tp2_push"], out["tp2_log_probs"], atol=2e-5, rtol=1e-5)
