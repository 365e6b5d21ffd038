"""The body of the MoE bridge checks: 4 spawned gloo processes running real megatron-core MoE
layers (SequentialMLP, alltoall dispatcher, CPU shims of engines/megatron/moe_cpu.py).

For every (variant, layout), each rank builds its `GPTModel` chunks, loads its piece of the pure
`shard_model` output with `load_state_dict(strict=True)` (so megatron checks every name and
shape), runs a forward pass and returns its state dict and, on the reporting rank, the logits.
"""
from __future__ import annotations

import dataclasses
import time

from megarl.bridge import ParallelLayout, WeightMap, arch_from_hf_config, load_hf_config, shard_model
from megarl.bridge.megatron_config import gpt_model_kwargs, layer_spec, transformer_config_kwargs
from megarl.bridge.transforms import padded_vocab_size
from megarl.engines.megatron.cpu import apply_cpu_shims, init_gloo_model_parallel
from megarl.engines.megatron.groups import initialize_model_parallel, release_model_parallel
from megarl.engines.megatron.moe_cpu import apply_moe_cpu_shims
from megatron_world import DIVISIBLE_BY, forward_logits, full_tensors, local_state, read_hf

# (tp, pp, ep, etp): etp 0 means etp = tp. Qwen3-MoE at every layout; the others where their
# extra parts are split (shared expert over TP, tied embedding over PP), to fit the CI budget.
LAYOUTS = [(1, 1, 2, 0), (2, 1, 2, 1), (2, 1, 2, 0), (1, 2, 2, 0)]
CASES = [("qwen3_moe", t) for t in LAYOUTS] + [("qwen2_moe", (2, 1, 2, 0)), ("qwen2_moe", (1, 2, 2, 0)),
                                               ("mixtral", (2, 1, 2, 1))]


def layout_of(t: tuple) -> ParallelLayout:
    tp, pp, ep, etp = t
    return ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp)


def weights_for(hf_dir, tp: int) -> WeightMap:
    arch = arch_from_hf_config(load_hf_config(hf_dir))
    return WeightMap(arch, padded_vocab_size(arch.vocab_size, DIVISIBLE_BY, tp))


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


def world(rank: int, world_size: int, port: int, cases: dict) -> dict:
    from megatron.core import parallel_state as ps

    init_gloo_model_parallel(rank, world_size, port)
    apply_moe_cpu_shims()
    started = time.monotonic()
    result = {"state_dicts": {}, "logit_diffs": {}, "seconds": {}}
    hf = {name: read_hf(case["hf_dir"]) for name, case in cases.items()}
    result["seconds"]["init"] = round(time.monotonic() - started, 1)
    for t in LAYOUTS:
        layout = layout_of(t)
        _reinit(layout)
        for name in [n for n, lay in CASES if lay == t]:
            case = cases[name]
            weights = weights_for(case["hf_dir"], layout.tp)
            chunks = _build(weights, layout)
            shards = shard_model(weights, full_tensors(weights, hf[name]), layout)
            key = rank_key(layout)
            chunks[0].load_state_dict({**chunks[0].state_dict(), **shards[key]}, strict=True)
            logits = forward_logits(chunks, case["input_ids"])
            result["state_dicts"][(name, t, key)] = local_state(chunks[0])  # DP replicas: the same key
            if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                vocab = weights.arch.vocab_size
                result["logit_diffs"][(name, t)] = (logits[..., :vocab] - case["hf_logits"]).abs().max().item()
        result["seconds"][str(t)] = round(time.monotonic() - started, 1)

    # negative controls (qwen3_moe at TP1/EP2): each breaks one thing the logits test must catch
    layout, case = layout_of(LAYOUTS[0]), cases["qwen3_moe"]
    _reinit(layout)
    weights = weights_for(case["hf_dir"], 1)
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
