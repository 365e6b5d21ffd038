"""Checkpoints of an actor that trains DeepSeek-V3's multi-token-prediction (MTP) layer
(`model.mtp.enable_train`), on a tiny model on CPU: saved after update 1 and resumed, update 2 gives the
uninterrupted run's weights (the MTP layer's too), optimizer state and metrics bit for bit; the engine's checkpoint
converts to HF with the MTP layer (`convert_torch_dist_to_hf`, as `megarl export` does), each tensor the
saved parameter mapped by hand; and the converter's `torch_dist` copy of the HF checkpoint loads into an actor
with its MTP layer, each MTP parameter the HF tensor mapped by hand."""
import pytest
import torch
from safetensors.torch import load_file

from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf
from megarl.data.tiny_model import make_tiny_model
from megarl.testing import run_gloo_workers
from mtp_checkpoint_world import mtp_checkpoint_world

pytestmark = pytest.mark.slow  # three actor engines in one gloo process

L = 2  # a dense and an MoE decoder layer; the MTP layer (HF layer 2) is an MoE layer
EH_PROJ = "mtp.layers.0.eh_proj.weight"


def by_hand(hf: dict) -> dict[str, torch.Tensor]:
    """Some of the MTP layer's megatron parameters from the HF tensors of layer L, mapped by hand: its own
    projections and norms, its decoder layer's attention, router, selection bias, an expert's fc1 ([gate; up])
    and the shared expert's fc2."""
    h = f"model.layers.{L}."
    m = "mtp.layers.0.transformer_layer."
    return {
        "mtp.layers.0.enorm.weight": hf[h + "enorm.weight"],
        "mtp.layers.0.hnorm.weight": hf[h + "hnorm.weight"],
        EH_PROJ: hf[h + "eh_proj.weight"],
        "mtp.layers.0.final_layernorm.weight": hf[h + "shared_head.norm.weight"],
        m + "input_layernorm.weight": hf[h + "input_layernorm.weight"],
        m + "self_attention.linear_q_down_proj.weight": hf[h + "self_attn.q_a_proj.weight"],
        m + "self_attention.linear_kv_up_proj.weight": hf[h + "self_attn.kv_b_proj.weight"],
        m + "self_attention.linear_proj.weight": hf[h + "self_attn.o_proj.weight"],
        m + "pre_mlp_layernorm.weight": hf[h + "post_attention_layernorm.weight"],
        m + "mlp.router.weight": hf[h + "mlp.gate.weight"],
        m + "mlp.router.expert_bias": hf[h + "mlp.gate.e_score_correction_bias"],
        m + "mlp.experts.local_experts.5.linear_fc1.weight": torch.cat([hf[h + "mlp.experts.5.gate_proj.weight"],
                                                                        hf[h + "mlp.experts.5.up_proj.weight"]]),
        m + "mlp.shared_experts.linear_fc2.weight": hf[h + "mlp.shared_experts.down_proj.weight"],
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_checkpoints")
    model_dir = make_tiny_model("deepseek_v3", root / "hf", layers=L, hidden=64, heads=4, tie=False, seed=3,
                                mtp_layers=1)
    convert_hf_to_torch_dist(model_dir, root / "mcore")
    (out,) = run_gloo_workers(mtp_checkpoint_world, 1, args=(str(model_dir), str(root / "mcore"),
                                                             str(root / "checkpoint")), timeout_s=400)
    return model_dir, root, out


def test_a_resumed_mtp_actor_makes_the_uninterrupted_update_bit_for_bit(run):
    _, _, out = run
    (metrics, params, state), (resumed_metrics, resumed_params, resumed_state) = out["continued"], out["resumed"]
    assert out["resumed_updates"] == 1
    assert resumed_metrics == metrics and metrics["actor/mtp_1_loss"] > 0
    assert resumed_params.keys() == params.keys() and EH_PROJ in params
    for name in params:
        assert torch.equal(resumed_params[name], params[name]), name
    assert not torch.equal(params[EH_PROJ], out["saved"][EH_PROJ])  # update 2 moved the MTP layer
    assert resumed_state.keys() == state.keys() and EH_PROJ in state
    for name in state:
        assert state[name].keys() == resumed_state[name].keys() and state[name], name
        for key, value in state[name].items():
            assert torch.equal(resumed_state[name][key], value), (name, key)
    assert state[EH_PROJ]["exp_avg"].abs().max() > 0


def test_the_engine_checkpoint_exports_the_trained_mtp_layer(run, tmp_path):
    model_dir, root, out = run
    convert_torch_dist_to_hf(root / "checkpoint", tmp_path / "hf", hf_config_dir=model_dir)
    exported = {}
    for path in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(path))
    assert exported.keys() == load_file(model_dir / "model.safetensors").keys()
    saved = out["saved"]
    for name, tensor in by_hand(exported).items():
        assert torch.equal(tensor, saved[name]), name
    assert not torch.equal(saved[EH_PROJ], out["initial"][EH_PROJ])  # the export is the trained layer
    # the MTP layer's copies of the embedding and head are the trained model's own (vocabulary rows only)
    embedding, head = saved["embedding.word_embeddings.weight"], saved["output_layer.weight"]
    assert torch.equal(exported[f"model.layers.{L}.embed_tokens.weight"], embedding[:47])
    assert torch.equal(exported[f"model.layers.{L}.shared_head.head.weight"], head[:47])


def test_a_converted_checkpoint_loads_the_mtp_layer_into_the_actor(run):
    model_dir, _, out = run
    hf = load_file(model_dir / "model.safetensors")
    for name, tensor in by_hand(hf).items():
        assert torch.equal(out["converted"][name], tensor), name
    assert all(torch.equal(out["converted"][n], out["initial"][n]) for n in out["initial"])  # as from HF
