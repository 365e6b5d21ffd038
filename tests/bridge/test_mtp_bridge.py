"""DeepSeek-V3's multi-token-prediction (MTP) layer through the bridge: a hub checkpoint stores MTP layer k as
`model.layers.{num_hidden_layers + k}` (its own enorm, hnorm, eh_proj, shared_head.norm, a decoder layer, and
copies of the embedding and LM head); `WeightMap(mtp=True)` maps it onto megatron-core's MTP block
(`mtp.layers.{k}.*`). Checked: the names are exactly those of a real megatron `GPTModel(mtp_block_spec=...)`,
HF -> megatron -> HF is bit-exact, and megatron's MTP forward equals an oracle written from HF's own modules
following SGLang's draft model (models/deepseek_nextn.py DeepseekModelNextN.forward:
eh_proj(cat(enorm(embed(next token)), hnorm(h))), the decoder layer, shared_head.norm, the LM head), with h
the main model's final (normed) hidden state, as megatron and SGLang hand it on.
"""
import pytest
import torch

from megarl.bridge import ConversionError, WeightMap, arch_from_hf_config
from megarl.testing import run_gloo_workers
from mtp_bridge_world import world
from tiny_hf import hf_tensors

L = 2  # main decoder layers: one dense, one MoE; the MTP layer (index 2) is an MoE layer as in DeepSeek-V3
CONFIG = dict(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=4, rms_norm_eps=1e-6, initializer_range=0.1, q_lora_rank=40, kv_lora_rank=24,
              qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
              n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
              norm_topk_prob=True, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
PADDED_VOCAB = 104
INPUT_IDS = torch.tensor([[0, 55, 56, 27, 28, 99, 31, 32, 64, 3], [99, 1, 2, 54, 57, 41, 42, 95, 7, 8]])


def hf_config() -> dict:
    return {**CONFIG, "model_type": "deepseek_v3", "num_hidden_layers": L, "num_nextn_predict_layers": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(HF model with L + 1 layers, its layer L the MTP layer's decoder layer; the MTP layer's own modules;
    every tensor of the hub checkpoint by name)."""
    import transformers

    torch.manual_seed(0)
    big = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG, num_hidden_layers=L + 1),
                                             ).eval()
    with torch.no_grad():
        for name, p in big.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for name, b in big.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    H = CONFIG["hidden_size"]
    own = {"enorm": torch.nn.RMSNorm(H, eps=1e-6), "hnorm": torch.nn.RMSNorm(H, eps=1e-6),
           "eh_proj": torch.nn.Linear(2 * H, H, bias=False), "shared_head.norm": torch.nn.RMSNorm(H, eps=1e-6)}
    with torch.no_grad():
        for module in own.values():
            module.weight.copy_((1 + 0.2 * torch.randn_like(module.weight)) if module.weight.dim() == 1
                                else 0.1 * torch.randn_like(module.weight))
    saved = tmp_path_factory.mktemp("mtp")
    big.save_pretrained(saved)  # per-expert names on disk, as the hub has them
    hf = hf_tensors(saved)
    hf.update({f"model.layers.{L}.{n}.weight": m.weight.detach().clone() for n, m in own.items()})
    hf[f"model.layers.{L}.embed_tokens.weight"] = hf["model.embed_tokens.weight"].clone()
    hf[f"model.layers.{L}.shared_head.head.weight"] = hf["lm_head.weight"].clone()
    return big, own, hf


def oracle_logits(big, own) -> tuple[torch.Tensor, torch.Tensor]:
    """(main logits, MTP logits) [b, s, V] from HF's modules: the main model is `big`'s first L layers and
    its final norm; the MTP layer reads token i + 1's embedding (the last position: token 0, as megatron's
    roll_tensor fills it) and the main model's normed hidden state at i."""
    model = big.model
    b, s = INPUT_IDS.shape
    position_ids = torch.arange(s).expand(b, -1)
    causal = torch.full((s, s), float("-inf")).triu(1)[None, None]  # eager attention adds it as given
    with torch.no_grad():
        x = model.embed_tokens(INPUT_IDS)
        rope = model.rotary_emb(x, position_ids)
        for layer in model.layers[:L]:
            x = layer(x, attention_mask=causal, position_ids=position_ids, position_embeddings=rope)
        h = model.norm(x)
        following = torch.cat([INPUT_IDS[:, 1:], torch.zeros(b, 1, dtype=INPUT_IDS.dtype)], dim=1)
        e = model.embed_tokens(following)
        y = own["eh_proj"](torch.cat([own["enorm"](e), own["hnorm"](h)], dim=-1))
        y = model.layers[L](y, attention_mask=causal, position_ids=position_ids, position_embeddings=rope)
        return big.lm_head(h), big.lm_head(own["shared_head.norm"](y))


def test_mtp_tensors_round_trip_bit_exact_and_only_with_mtp(checkpoint):
    _, _, hf = checkpoint
    arch = arch_from_hf_config(hf_config())
    weights = WeightMap(arch, PADDED_VOCAB, mtp=True)
    weights.check_hf_names(set(hf), "hub")  # the MTP layer's embedding / head copies: allowed, not read
    mtp_names = [n for n in weights.mcore_names() if n.startswith("mtp.")]
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight", "mtp.layers.0.transformer_layer.mlp.router.weight",
            "mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight"} <= set(mtp_names)
    exported = {}
    for name in weights.mcore_names():
        for hf_name, tensor in weights.to_hf(name, weights.to_mcore(name, hf.__getitem__)):
            exported[hf_name] = tensor
    copies = {f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight"}
    assert set(exported) == set(hf) - copies
    assert all(torch.equal(exported[n], hf[n]) for n in exported)
    assert weights.hf_names_of("mtp.layers.0.final_layernorm.weight") == (f"model.layers.{L}.shared_head.norm.weight",)
    assert weights.tp_split("mtp.layers.0.eh_proj.weight").dim == 0  # column-parallel, as megatron builds it

    plain = WeightMap(arch, PADDED_VOCAB)  # no MTP block: its tensors are ignored, its names refused
    plain.check_hf_names(set(hf), "hub")
    assert not any(n.startswith("mtp.") for n in plain.mcore_names())
    with pytest.raises(ConversionError, match="mapped without them"):
        plain.hf_names_of("mtp.layers.0.enorm.weight")
    with pytest.raises(ConversionError, match="MTP layer 1 >= num_nextn_predict_layers 1"):
        weights.hf_names_of("mtp.layers.1.enorm.weight")
    with pytest.raises(ConversionError, match="1 tensor"):  # a missing MTP tensor
        weights.check_hf_names(set(hf) - {f"model.layers.{L}.eh_proj.weight"}, "hub")
    with pytest.raises(ConversionError, match="no multi-token-prediction layers"):
        WeightMap(arch_from_hf_config({**hf_config(), "num_nextn_predict_layers": 0}), PADDED_VOCAB, mtp=True)


@pytest.mark.slow
def test_megatron_mtp_block_loads_the_checkpoint_and_predicts_as_hf(checkpoint):
    big, own, hf = checkpoint
    (result,) = run_gloo_workers(world, 1, args=(hf_config(), hf, PADDED_VOCAB, INPUT_IDS), timeout_s=300)
    weights = WeightMap(arch_from_hf_config(hf_config()), PADDED_VOCAB, mtp=True)
    assert result["names"] == sorted(weights.mcore_names())  # every megatron MTP parameter mapped, nothing more
    main, mtp = oracle_logits(big, own)
    main_diff = (result["main_logits"] - main).abs().max().item()
    mtp_diff = (result["mtp_logits"] - mtp).abs().max().item()
    print(f"max |megatron - HF oracle| logits: main {main_diff:.2e}, MTP {mtp_diff:.2e}")
    assert main_diff < 1e-4 and mtp_diff < 1e-4
    assert (mtp - main).abs().max() > 1.0  # the MTP head predicts something else than the main one
