"""The body of the real megatron-core checks: runs in 4 gloo processes (CPU shims on).

One world is reused for every layout (parallel_state is re-initialised in place), so the cost of
starting processes and importing megatron is paid once. Each rank asserts what it can check
locally (its state dict against the pure sharding functions) and returns the rest (state dicts,
logits differences, saved checkpoint paths) for the test process to check.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.bridge import ParallelLayout, WeightMap, arch_from_hf_config, is_extra_state, load_hf_config, shard_model
from megarl.bridge.megatron_config import gpt_model_kwargs, layer_spec, transformer_config_kwargs
from megarl.bridge.safetensors_io import HFCheckpointReader
from megarl.bridge.sharding import layer_offset, shift_layer
from megarl.bridge.transforms import padded_vocab_size
from megarl.testing import init_gloo_model_parallel, reinit_model_parallel

DIVISIBLE_BY = 8
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 4, 2), (4, 1, 1)]
# megatron's uneven pipeline stages over the tiny models' 8 layers: [3, 5]; [1, 3, 3, 1];
# [2, 6] in 2 virtual chunks each (chunks of 1 and 3 layers)
UNEVEN_LAYOUTS = [ParallelLayout(2, 2, first_stage_layers=3), ParallelLayout(1, 4, first_stage_layers=1, last_stage_layers=1),
                  ParallelLayout(1, 2, 2, first_stage_layers=2)]


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def read_hf(hf_dir: Path) -> dict[str, torch.Tensor]:
    with HFCheckpointReader(hf_dir) as reader:
        return {name: reader.read(name) for name in reader.names()}


def weights_for(hf_dir: Path, tp: int) -> WeightMap:
    arch = arch_from_hf_config(load_hf_config(hf_dir))
    return WeightMap(arch, padded_vocab_size(arch.vocab_size, DIVISIBLE_BY, tp))


def full_tensors(weights: WeightMap, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: weights.to_mcore(name, hf.__getitem__) for name in weights.mcore_names()}


def build_chunks(weights: WeightMap, layout: ParallelLayout) -> list:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = transformer_config_kwargs(weights.arch, layout)
    config = TransformerConfig(**kwargs, use_cpu_initialization=True, perform_initialization=False)
    pp_rank = _ps().get_pipeline_model_parallel_rank()
    return [
        GPTModel(
            config, layer_spec(weights.arch), **gpt_model_kwargs(weights.arch, weights.padded_vocab_size),
            pre_process=layout.is_first(pp_rank, v), post_process=layout.is_last(pp_rank, v),
            vp_stage=v if layout.vpp > 1 else None,
        ).eval()
        for v in range(layout.vpp)
    ]


def load_checkpoint(chunks: list, ckpt_dir: Path) -> None:
    """Stock megatron loading: `dist_checkpointing.load` of the chunks' sharded state dicts."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({f"model{v}": c.sharded_state_dict() for v, c in enumerate(chunks)}, str(ckpt_dir))
    for v, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{v}"], strict=True)


def local_state(chunk) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in chunk.state_dict().items() if not is_extra_state(k)}


def assert_matches_pure_shards(chunks, weights, full, layout, what):
    ps = _ps()
    expected = shard_model(weights, full, layout)
    key = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    for v, chunk in enumerate(chunks):
        got, want = local_state(chunk), expected[(key[0], v, key[1])]
        assert got.keys() == want.keys(), f"{what} chunk {v}: {sorted(got.keys() ^ want.keys())}"
        for name in want:
            assert torch.equal(got[name], want[name]), f"{what} chunk {v}: {name} differs from the pure shard"


def forward_logits(chunks, input_ids: torch.Tensor):
    """Full logits [b, s, Vp] on the last pipeline stage (gathered over TP), None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps = _ps()
    b, s = input_ids.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)

    def step(data_iterator, model):
        output = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
        return output, lambda out: (out.sum() * 0.0, {"logits": out.detach().clone()})

    with torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=step, data_iterator=[iter([None])] * len(chunks) if len(chunks) > 1 else iter([None]),
            model=chunks, num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True,
        )
    if not ps.is_pipeline_last_stage():
        return None
    local = store[0]["logits"]
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def load_shards(chunks, weights, full, layout, naive_fc1=False):
    """Load pure-function shards with `load_state_dict` (the path the negative controls tamper with).
    With `naive_fc1`, each TP rank gets a plain contiguous chunk of [gate; up] instead of [gate_k; up_k]."""
    ps = _ps()
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    shards = shard_model(weights, full, layout)
    for v, chunk in enumerate(chunks):
        sd = dict(chunk.state_dict())
        sd.update(shards[(pp_rank, v, tp_rank)])
        if naive_fc1:
            offset = layer_offset(weights.arch.num_layers, layout, pp_rank, v)
            for local in [k for k in sd if k.endswith("mlp.linear_fc1.weight")]:
                sd[local] = full[shift_layer(local, offset)].chunk(layout.tp, dim=0)[tp_rank].clone()
        chunk.load_state_dict(sd, strict=True)


def meta_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The legacy Meta -> HF 'sliced rotary' row permutation (must NOT be applied HF <-> megatron)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def world(rank: int, world_size: int, port: int, cases: dict, out_dir: str) -> dict:
    started = time.monotonic()
    init_gloo_model_parallel(rank, world_size, port)
    ps = _ps()
    result = {"state_dicts": {}, "sharded_keys": {}, "logit_diffs": {}, "negative_diffs": {}, "seconds": {}}

    def lap(phase):
        result["seconds"][phase] = round(time.monotonic() - started, 1)

    hf = {name: read_hf(case["hf_dir"]) for name, case in cases.items()}

    # what a stock GPTModel saves and asks for, to compare with the converter's expected map
    for name, case in cases.items():
        weights = weights_for(case["hf_dir"], 1)
        result["sharded_keys"][name] = sharded_keys(build_chunks(weights, ParallelLayout())[0].sharded_state_dict())
    lap("init + expected map")

    # load the converted checkpoint (made for TP=1) at every layout; compare with the pure shards
    for layout in [ParallelLayout(*t) for t in LAYOUTS] + UNEVEN_LAYOUTS:
        reinit_model_parallel(layout.tp, layout.pp, layout.vpp if layout.vpp > 1 else None)
        for name, case in cases.items():
            weights = weights_for(case["hf_dir"], layout.tp)
            chunks = build_chunks(weights, layout)
            load_checkpoint(chunks, case["ckpt_dir"])
            assert_matches_pure_shards(chunks, weights, full_tensors(weights, hf[name]), layout, f"{name} at {layout}")
            if ps.get_data_parallel_rank() == 0:
                for v, chunk in enumerate(chunks):
                    key = (ps.get_pipeline_model_parallel_rank(), v, ps.get_tensor_model_parallel_rank())
                    result["state_dicts"][(name, str(layout), key)] = local_state(chunk)
        lap(f"loads at {layout}")

    # real logits at TP=2 x PP=2, from the converted checkpoint
    layout = ParallelLayout(2, 2, 1)
    reinit_model_parallel(2, 2)
    last_reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    for name, case in cases.items():
        weights = weights_for(case["hf_dir"], 2)
        chunks = build_chunks(weights, layout)
        load_checkpoint(chunks, case["ckpt_dir"])
        logits = forward_logits(chunks, case["input_ids"])
        if last_reporter:
            vocab = weights.arch.vocab_size
            result["logit_diffs"][name] = (logits[..., :vocab] - case["hf_logits"]).abs().max().item()
    lap("logits")

    # negative controls (llama: GQA, 2 groups): the same load path, each with one deliberate bug
    name, case = "llama", cases["llama"]
    weights = weights_for(case["hf_dir"], 2)
    arch = weights.arch
    chunks = build_chunks(weights, layout)
    good = full_tensors(weights, hf[name])
    wrong_qkv = dict(good)  # [all q; all k; all v] instead of grouped per query group
    for i in range(arch.num_layers):
        q, k, v = (hf[name][f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv")
        wrong_qkv[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.cat([q, k, v])
    permuted = dict(hf[name])  # the legacy Meta rotary permutation applied to q and k
    for i in range(arch.num_layers):
        for proj, heads in (("q", arch.num_attention_heads), ("k", arch.num_query_groups)):
            key = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            permuted[key] = meta_permute(permuted[key], heads)
    variants = {
        "correct": (good, False),
        "wrong_qkv_layout": (wrong_qkv, False),
        "naive_fc1_tp_split": (good, True),
        "rotary_permutation": (full_tensors(weights, permuted), False),
    }
    for control, (full, naive_fc1) in variants.items():
        load_shards(chunks, weights, full, layout, naive_fc1=naive_fc1)
        logits = forward_logits(chunks, case["input_ids"])
        if last_reporter:
            diff = (logits[..., : arch.vocab_size] - case["hf_logits"]).abs().max().item()
            result["negative_diffs"][control] = diff
    lap("negative controls")

    # save at one layout with megatron itself, load at another
    out = Path(out_dir)
    saves = {"llama": (out / "llama_tp2", (2, 1), {}), "qwen2": (out / "qwen2_tp2pp2_singleton", (2, 2),
                                                          {"singleton_local_shards": True})}
    for name, (save_dir, (tp, pp), metadata) in saves.items():
        reinit_model_parallel(tp, pp)
        weights = weights_for(cases[name]["hf_dir"], tp)
        chunks = build_chunks(weights, ParallelLayout(tp, pp))
        load_checkpoint(chunks, cases[name]["ckpt_dir"])
        with torch.no_grad():
            for chunk in chunks:
                for p in chunk.parameters():
                    p.mul_(2)  # exact in binary floating point: the saved weights are 2 x HF
        _save(chunks, save_dir, metadata)
    reinit_model_parallel(1, 2)
    weights = weights_for(cases["llama"]["hf_dir"], 1)
    chunks = build_chunks(weights, ParallelLayout(1, 2))
    load_checkpoint(chunks, saves["llama"][0])
    doubled = {k: 2 * v for k, v in hf["llama"].items()}
    assert_matches_pure_shards(chunks, weights, full_tensors(weights, doubled), ParallelLayout(1, 2), "TP2 save at TP1xPP2")
    result["saved"] = {name: str(s[0]) for name, s in saves.items()}
    lap("megatron saves + reload")
    return result


def _save(chunks, save_dir: Path, metadata: dict) -> None:
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        save_dir.mkdir(parents=True)
    dist.barrier()
    request = {f"model{v}": c.sharded_state_dict(metadata=metadata) for v, c in enumerate(chunks)}
    dist_checkpointing.save(request, str(save_dir))
    dist.barrier()


def _leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree


def sharded_keys(sharded: dict) -> dict:
    """{key: global shape} of the ShardedTensors (after megatron's factories), {key: None} of the ShardedObjects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    apply_factories(sharded)
    keys = {}
    for item in _leaves(sharded):
        if isinstance(item, ShardedTensor):
            keys[item.key] = tuple(item.global_shape)
        elif isinstance(item, ShardedObject):
            keys[item.unique_key] = None
    return keys
