"""The body of the MoE bridge checks: 4 gloo processes running real megatron-core MoE
layers (SequentialMLP, alltoall dispatcher, CPU shims of engines/megatron/cpu/moe_shims.py).

First, what megatron's MoE layers save: the keys and global shapes of a stock `GPTModel`'s
`sharded_state_dict` and of the engine's checkpoint request, for the test to compare with the
converter's expected map. Then, for every (variant, layout), each rank builds its `GPTModel`
chunks, loads the bridge-converted `torch_dist` checkpoint with the engine's loader
(`dist_checkpointing`), asserts that its state dict equals the pure `shard_model` output, runs a
forward pass (logits returned by the reporting rank), doubles every weight (exact in floating
point) and saves the chunks with the engine's checkpoint writer, so the test can export what
megatron wrote at that layout. Finally checkpoints move between EP sizes (EP2 -> EP1 -> EP2), and
negative controls break the logit check.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.bridge import ParallelLayout, WeightMap, arch_from_hf_config, load_hf_config, shard_model
from megarl.bridge.megatron_config import gpt_model_kwargs, layer_spec, transformer_config_kwargs
from megarl.bridge.transforms import padded_vocab_size
from megarl.engines.megatron.checkpoint_io import load_torch_dist_weights, model_sharded_state_dict, save_checkpoint
from megarl.engines.megatron.cpu.shims import apply_cpu_shims
from megarl.engines.megatron.groups import initialize_model_parallel, release_model_parallel
from megarl.engines.megatron.cpu.moe_shims import apply_moe_cpu_shims
from megarl.testing import init_gloo_model_parallel
from megatron_world import DIVISIBLE_BY, forward_logits, full_tensors, local_state, read_hf, sharded_keys

# (tp, pp, ep, etp): etp 0 means etp = tp. Every variant at EP2, TP2 x EP2 and PP2 x EP2; Qwen3-MoE
# also at TP2 x EP2 with ETP2, Mixtral with ETP1 (Qwen2-MoE's shared expert is split over TP, its
# tied embedding over PP).
LAYOUTS = [(1, 1, 2, 0), (2, 1, 2, 1), (2, 1, 2, 0), (1, 2, 2, 0)]
CASES = ([("qwen3_moe", t) for t in LAYOUTS] + [("qwen2_moe", t) for t in (LAYOUTS[0], LAYOUTS[2], LAYOUTS[3])]
         + [("mixtral", t) for t in (LAYOUTS[0], LAYOUTS[1], LAYOUTS[3])])
EP1 = (1, 1, 1, 0)
SINGLETON = ("qwen2_moe", (1, 2, 2, 0))  # also saved by stock megatron with singleton_local_shards


def layout_of(t: tuple) -> ParallelLayout:
    tp, pp, ep, etp = t
    return ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp)


def weights_for(hf_dir, tp: int) -> WeightMap:
    arch = arch_from_hf_config(load_hf_config(hf_dir))
    return WeightMap(arch, padded_vocab_size(arch.vocab_size, DIVISIBLE_BY, tp))


def saved_dir(out_dir: str, name: str, t: tuple, how: str = "engine") -> Path:
    return Path(out_dir) / f"{name}_tp{t[0]}_pp{t[1]}_ep{t[2]}_etp{t[3] or t[0]}_{how}"


def _reinit(layout: ParallelLayout) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    release_model_parallel()
    initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
    )
    model_parallel_cuda_manual_seed(1234)


def _build(weights: WeightMap, layout: ParallelLayout) -> list:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**transformer_config_kwargs(weights.arch, layout), use_cpu_initialization=True,
                               perform_initialization=False)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = [GPTModel(config, layer_spec(weights.arch), **gpt_model_kwargs(weights.arch, weights.padded_vocab_size),
                       pre_process=layout.is_first(pp_rank, 0), post_process=layout.is_last(pp_rank, 0)).eval()]
    apply_cpu_shims()  # reach the MoE modules imported by the build
    return chunks


def rank_key(layout: ParallelLayout) -> tuple:
    from megatron.core import parallel_state as ps

    return layout.key(ps.get_pipeline_model_parallel_rank(), 0, ps.get_tensor_model_parallel_rank(),
                      ps.get_expert_model_parallel_rank())


def _assert_loaded(chunks, weights: WeightMap, full: dict, layout: ParallelLayout, what: str) -> None:
    """This rank's loaded state dict is the pure sharding functions' piece of `full`, exactly."""
    got, want = local_state(chunks[0]), shard_model(weights, full, layout)[rank_key(layout)]
    assert got.keys() == want.keys(), f"{what}: {sorted(got.keys() ^ want.keys())}"
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs from the pure shard"


def _double(chunks) -> None:
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                p.mul_(2)  # exact in binary floating point


def _save_stock(chunks, path: Path, metadata: dict) -> None:
    """megatron's own save of the chunks' `sharded_state_dict` (local-spec keys, `_extra_state` objects)."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        path.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"model": chunks[0].sharded_state_dict(metadata=metadata)}, str(path))
    dist.barrier()


def world(rank: int, world_size: int, port: int, cases: dict, out_dir: str) -> dict:
    from megatron.core import parallel_state as ps

    init_gloo_model_parallel(rank, world_size, port)
    apply_moe_cpu_shims()
    started = time.monotonic()
    result = {"state_dicts": {}, "logit_diffs": {}, "seconds": {}, "sharded_keys": {}, "engine_keys": {}}
    hf = {name: read_hf(case["hf_dir"]) for name, case in cases.items()}

    # what megatron saves (global keys and shapes do not depend on the layout; EP2 here)
    _reinit(layout_of(LAYOUTS[0]))
    for name, case in cases.items():
        chunks = _build(weights_for(case["hf_dir"], 1), layout_of(LAYOUTS[0]))
        result["sharded_keys"][name] = sharded_keys(chunks[0].sharded_state_dict())
        result["engine_keys"][name] = sharded_keys(model_sharded_state_dict(chunks)["model"])
    result["seconds"]["init + keys"] = round(time.monotonic() - started, 1)

    for t in LAYOUTS:
        layout = layout_of(t)
        _reinit(layout)
        for name in [n for n, lay in CASES if lay == t]:
            case = cases[name]
            weights = weights_for(case["hf_dir"], layout.tp)
            chunks = _build(weights, layout)
            load_torch_dist_weights(chunks, case["ckpt_dir"])  # the bridge-converted checkpoint
            _assert_loaded(chunks, weights, full_tensors(weights, hf[name]), layout, f"{name} at {layout}")
            logits = forward_logits(chunks, case["input_ids"])
            result["state_dicts"][(name, t, rank_key(layout))] = local_state(chunks[0])  # DP replicas: the same key
            if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                vocab = weights.arch.vocab_size
                result["logit_diffs"][(name, t)] = (logits[..., :vocab] - case["hf_logits"]).abs().max().item()
            _double(chunks)
            save_checkpoint(saved_dir(out_dir, name, t), chunks, None, None, 0, False)
            if (name, t) == SINGLETON:
                _save_stock(chunks, saved_dir(out_dir, name, t, "singleton"), {"singleton_local_shards": True})
        result["seconds"][str(t)] = round(time.monotonic() - started, 1)

    # EP moves: written at EP2 (2 x HF) -> loaded at EP1 (DP 4), doubled, written -> loaded at EP2
    case = cases["qwen3_moe"]
    weights = weights_for(case["hf_dir"], 1)

    def times(k: int) -> dict:
        return {n: k * t for n, t in full_tensors(weights, hf["qwen3_moe"]).items()}

    _reinit(layout_of(EP1))
    chunks = _build(weights, layout_of(EP1))
    load_torch_dist_weights(chunks, saved_dir(out_dir, "qwen3_moe", LAYOUTS[0]))
    _assert_loaded(chunks, weights, times(2), layout_of(EP1), "EP2 checkpoint at EP1")
    _double(chunks)
    save_checkpoint(saved_dir(out_dir, "qwen3_moe", EP1), chunks, None, None, 0, False)
    _reinit(layout_of(LAYOUTS[0]))
    chunks = _build(weights, layout_of(LAYOUTS[0]))
    load_torch_dist_weights(chunks, saved_dir(out_dir, "qwen3_moe", EP1))
    _assert_loaded(chunks, weights, times(4), layout_of(LAYOUTS[0]), "EP1 checkpoint at EP2")
    result["seconds"]["EP moves"] = round(time.monotonic() - started, 1)

    # negative controls (qwen3_moe at TP1/EP2): each breaks one thing the logits test must catch
    layout = layout_of(LAYOUTS[0])
    shards = shard_model(weights, full_tensors(weights, hf["qwen3_moe"]), layout)
    key, other = rank_key(layout), layout.key(0, 0, 0, 1 - ps.get_expert_model_parallel_rank())
    controls = {
        "experts_on_the_wrong_ep_rank": (weights, {**shards[key], **{k: v for k, v in shards[other].items() if "experts" in k}}),
        "unnormalised_top_k": (dataclasses.replace(weights, arch=dataclasses.replace(
            weights.arch, moe=dataclasses.replace(weights.arch.moe, norm_topk_prob=False))), shards[key]),
    }
    result["negative_diffs"] = {}
    for control, (control_weights, sd) in controls.items():
        chunks = _build(control_weights, layout)
        chunks[0].load_state_dict({**chunks[0].state_dict(), **sd}, strict=True)
        logits = forward_logits(chunks, case["input_ids"])
        result["negative_diffs"][control] = (logits[..., :100] - case["hf_logits"]).abs().max().item()
    return result
