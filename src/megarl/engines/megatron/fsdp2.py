"""PyTorch FSDP2 for a trained role (`<role>.megatron.use_torch_fsdp2`, megatron-LM's `--use-torch-fsdp2`,
verl's Megatron Lite `impl_cfg.optimizer=fsdp2`): the model chunks' parameters, gradients and
optimizer state sharded over the data-parallel x context-parallel ranks by torch's `fully_shard`,
in place of megatron's DDP and optimizer.

- Wrap (`wrap_chunks`): `fully_shard` on each transformer layer, then on the chunk (the root, which
  holds the embedding, the final norm and the output layer or value head). An MoE layer's experts
  module is wrapped first, on its own, over megatron's expert-data-parallel group (`ExpertGroups`; the
  router and shared experts stay with their layer, over DP x CP); its gradients are scaled as megatron's
  DDP scales expert gradients (summed over expert DP, divided by DP x CP). Each parameter's shard is
  `Shard(0)` of a 1-D DeviceMesh over megatron's DP x CP group, kept in float32; under a bf16 model
  the forward and backward compute in bf16 (`MixedPrecisionPolicy.param_dtype`) and the gradients
  are reduce-scattered in float32 (as megatron's DDP with `grad_reduce_in_fp32`). The reduce-scatter
  *averages* over the mesh (torch's default gradient divide factor is the mesh size), as megatron's
  DDP averages over DP x CP, so megarl's loss scaling (`training`) is the same for both
  (tests/engines/test_fsdp2.py checks the first update's gradient norm against HF's, in one process).
  Each micro-batch's gradient is reduce-scattered after its backward (ZeRO-3: no whole gradient is
  kept), where megatron's DDP sums the micro-batches before one all-reduce: the same up to rounding.
  The root is not resharded after its forward (`reshard_after_forward=False`, torch's own choice for a
  root), so the heads read the output layer's weight (or the value head) whole inside a forward step
  (`MegatronEngine.output_weight`); it is resharded after the backward, or on leaving `gathered`.
- Optimizer (`Fsdp2Optimizer`): torch's AdamW on the float32 DTensor shards, with megatron's
  settings as megarl's megatron optimizer applies them (lr, betas, eps, weight decay none on biases
  and 1-D parameters, in a second group with `wd_mult` 0 for megatron's `OptimizerParamScheduler`);
  gradients clipped by the global norm, each TP-split gradient counted once per TP rank and each
  TP-replicated one once (megatron's `param_is_not_tensor_parallel_duplicate`), summed over the
  pipeline stages with a tied embedding counted once (megatron's `param_is_not_shared`), as megatron's
  `clip_grad_norm_fp32`; an MoE's expert gradients reduced over their own groups and combined with the
  dense ones, as megatron's `ChainedOptimizer` of a dense and an expert optimizer (`grad_norm`).
- Pipeline parallelism (1F1B, or interleaved with virtual stages): each stage's chunks are sharded
  over that stage's DP x CP group, and megatron's schedules run them with no DDP hooks (the model
  config's `no_sync_func` and `finalize_model_grads_func` stay unset: FSDP2 reduce-scatters each
  micro-batch's gradient in its own backward). With tied embeddings (`share_embeddings_and_output_weights`)
  the first stage's word embedding and the last stage's output layer are two copies of one weight:
  `reduce_tied_embedding_grads` sums their gradients after the backward, as megatron's
  `finalize_model_grads` does for DDP, so both take the same step.
- An MoE router's expert bias (DeepSeek-V3 / GLM-4-MoE `e_score_correction_bias`, megatron's
  `moe_router_enable_expert_bias`): `update_router_expert_bias` runs megatron's own update after the
  backward, before the optimizer step and whether that step is skipped or not, as `finalize_model_grads`
  does for DDP (megarl pins `moe_router_bias_update_rate` to 0, bridge.moe, so the bias stays HF's; the
  routers' token counts are zeroed each step all the same). The bias and the counts are buffers, which
  FSDP2 leaves whole and unsharded.
- Reading weights whole (`gathered`): every FSDP module unsharded, so `named_parameters()` give this
  rank's whole TP shards (the weight push, the HF export); resharded on exit.

Checkpoints: engines.megatron.fsdp2_checkpoint. Offload between phases (`MegatronEngine.offload`,
engines.megatron.offload): every FSDP module resharded, then each parameter's, gradient's and AdamW
moment's local shard moved. Not built: LoRA, QAT, MTP training, sequence parallelism, background
checkpoint writes, the `optim.override_optimizer_config` fields this AdamW does not run (refused at
config time: megarl.config.rules.fsdp2).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch
import torch.distributed as dist

from megarl.engines.megatron.optim import ADAM_EPS

# megatron's marks on a parameter (tensor_parallel/layers.py set_tensor_model_parallel_attributes, and
# `sequence_parallel`, `shared`, `allreduce`): fully_shard replaces each parameter by a new DTensor one,
# and the gradient-norm rule reads them
MEGATRON_PARAM_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                        "shared", "allreduce")
SHARD_GROUP = "fsdp2_shard_group"  # the attribute holding each FSDP2 parameter's shard group (`shard_group`)


class ExpertGroups(NamedTuple):
    """megatron's expert process groups an MoE model's FSDP2 needs (parallel_state): `dp` the expert-
    data-parallel group (the experts' FSDP2 mesh), `tp` expert TP, `tp_ep_pp` expert TP x EP x PP."""
    dp: object
    tp: object
    tp_ep_pp: object

    @classmethod
    def from_parallel_state(cls) -> ExpertGroups:
        from megatron.core import parallel_state as ps

        return cls(ps.get_expert_data_parallel_group(), ps.get_expert_tensor_parallel_group(),
                   ps.get_expert_tensor_model_pipeline_parallel_group())


def mesh_device_type(backend: str) -> str:
    """The DeviceMesh device type of a process group with torch.distributed `backend` ("gloo",
    "nccl"). Rule (torch.distributed docs, "Backends": gloo runs its collectives on CPU tensors, NCCL
    on CUDA tensors only): `DeviceMesh.from_group(group, device_type)` names the device whose tensors
    the group's collectives carry, and FSDP2 puts its all-gather and reduce-scatter buffers there
    (torch/distributed/fsdp/_fully_shard/_fsdp_init.py `_get_device_from_mesh`)."""
    types = {"gloo": "cpu", "nccl": "cuda"}
    if backend not in types:
        raise ValueError(f"megatron.use_torch_fsdp2: the data-parallel group's backend {backend!r} is not one of "
                         f"{sorted(types)}, whose device FSDP2's mesh needs")
    return types[backend]


def expert_modules(chunk) -> list:
    """The experts modules (megatron's `SequentialMLP` / `TEGroupedMLP`, `layer.mlp.experts`) of the
    chunk's MoE layers; [] for a dense model."""
    return [layer.mlp.experts for layer in chunk.decoder.layers if getattr(layer.mlp, "experts", None) is not None]


def wrap_chunks(chunks: list, group, params_dtype: torch.dtype, expert_group=None) -> None:
    """`fully_shard` each chunk in place over the DP x CP `group` (module docstring): each MoE
    layer's experts over the expert-DP `expert_group`, then each transformer layer, then the chunk.
    Parameters become float32 `Shard(0)` DTensors carrying megatron's marks (MEGATRON_PARAM_ATTRS)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, mesh_device_type(str(dist.get_backend(group))))
    policy = MixedPrecisionPolicy(param_dtype=params_dtype, reduce_dtype=torch.float32)
    expert_mesh = None if expert_group is None else DeviceMesh.from_group(
        expert_group, mesh_device_type(str(dist.get_backend(expert_group))))
    # the experts' inputs come from their layer in the compute dtype already; the routing probabilities
    # keep megatron's dtype (a cast would round them where megatron's DDP does not)
    expert_policy = MixedPrecisionPolicy(param_dtype=params_dtype, reduce_dtype=torch.float32,
                                         cast_forward_inputs=False)
    for chunk in chunks:
        marks = {name: {a: getattr(p, a) for a in MEGATRON_PARAM_ATTRS if hasattr(p, a)}
                 for name, p in chunk.named_parameters()}
        chunk.float()  # float32 shards (megatron's main parameters); the forward computes in params_dtype
        for layer in chunk.decoder.layers:
            experts = getattr(layer.mlp, "experts", None)  # an MoE layer's (`expert_modules`)
            if experts is not None:
                if expert_mesh is None:
                    raise ValueError("megatron.use_torch_fsdp2: an MoE model's experts need the expert-DP group")
                fully_shard(experts, mesh=expert_mesh, mp_policy=expert_policy, reshard_after_forward=True)
                # megatron's DDP scales expert gradients by 1 / (DP x CP) and sums them over expert DP
                # (distributed_data_parallel.py: expert_gradient_scaling_factor): each EP rank's experts
                # saw the tokens of all EP ranks. Over several ranks: summed, then divided (gloo has no
                # PREMUL_SUM); over one, torch 2.13 divides in its copy and would divide again after a
                # forced sum (_fsdp_collectives.py foreach_reduce), so it is not forced there.
                experts.set_gradient_divide_factor(float(dist.get_world_size(group)))
                experts.set_force_sum_reduction_for_comms(dist.get_world_size(expert_group) > 1)
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        fully_shard(chunk, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        expert_params = {id(p) for m in expert_modules(chunk) for p in m.parameters()}
        for name, param in chunk.named_parameters():
            for attr, value in marks[name].items():
                setattr(param, attr, value)
            setattr(param, SHARD_GROUP, expert_group if id(param) in expert_params else group)


def shard_group(param):
    """The process group an FSDP2 parameter is sharded over (`wrap_chunks`): DP x CP, or expert DP for
    an MoE layer's experts. Recorded at the wrap: a DTensor's mesh resolves its group by a registered
    name, which megatron's groups need not have."""
    return getattr(param, SHARD_GROUP)


def fsdp_modules(chunks: list) -> list:
    """Every FSDP-wrapped module of the chunks (layers and roots)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(chunks: list) -> Iterator[None]:
    """A context in which the chunks' parameters are whole (this rank's TP shards, all-gathered over
    DP x CP, in the forward's dtype): `named_parameters()` give plain tensors. Every rank of the DP x
    CP group enters it together (an all-gather per FSDP module); resharded on exit."""
    modules = fsdp_modules(chunks)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()


def local_grads(chunks: list) -> list[torch.Tensor]:
    """This rank's shards of the chunks' gradients (those that have one)."""
    return [p.grad.to_local() for chunk in chunks for p in chunk.parameters() if p.grad is not None]


def reduce_tied_embedding_grads(chunks: list) -> None:
    """Sum the gradient of a tied embedding over its two copies under pipeline parallelism: the
    first stage's word embedding (`chunks[0]`) and the last stage's output layer (`chunks[-1]`),
    all-reduced over megatron's embedding group (the first and last stage ranks of the same TP, DP
    and CP ranks), as megatron-core's `finalize_model_grads` (`_allreduce_word_embedding_grads`)
    does for DDP. Both copies are sharded alike over DP x CP (the same [vocab rows / TP, H] shape,
    the same DP x CP rank in the group), so the local shards hold the same rows and are summed as
    they are. A no-op without PP, without tied embeddings, or on a stage that holds neither."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group(ignore_virtual=True):
        return
    chunk = chunks[0] if ps.is_pipeline_first_stage(ignore_virtual=True) else chunks[-1]
    if not chunk.share_embeddings_and_output_weights:
        return
    grad = chunk.shared_embedding_or_output_weight().grad
    # a training backward always reaches both copies (the embedding's lookup, the head's logits)
    dist.all_reduce(grad.to_local(), group=ps.get_embedding_group())


def update_router_expert_bias(chunks: list, config) -> None:
    """What megatron-core's `finalize_model_grads` does to the routers after the backward (0.16.1 and 0.19,
    distributed/finalize_model_grads.py), with its own functions, which read the chunks' modules and the
    model `config` and need no DDP: where `config.moe_router_enable_expert_bias`, each router's
    `expert_bias` [experts] moves by `moe_router_bias_update_rate` toward balance
    (`_update_router_expert_bias`: the routers' `local_tokens_per_expert` summed over TP x DP x CP, bias +=
    sign(mean count - count) x rate, moe_utils.py `get_updated_expert_bias`); then the token counts are
    zeroed (and megatron's global aux-loss trackers reset: `reset_model_temporary_tensors`). Every rank of
    the TP x DP x CP group calls it (an all-reduce where the chunks hold an expert bias)."""
    from megatron.core.distributed.finalize_model_grads import (_update_router_expert_bias,
                                                                reset_model_temporary_tensors)

    if config.moe_router_enable_expert_bias:
        _update_router_expert_bias(chunks, config)
    reset_model_temporary_tensors(config, chunks)


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """megatron's rule (optimizer/__init__.py get_standard_config_overrides, 0.16.1 and 0.19): no
    weight decay on biases and 1-D parameters (`param.shape` is the global shape of a DTensor)."""
    return name.endswith(".bias") or len(param.shape) == 1


class Fsdp2Optimizer:
    """torch AdamW over the FSDP2 chunks' shards, stepped as megatron's optimizer (`ChainedOptimizer.step`):
    the global gradient norm, the gradients clipped to it where `clip_grad` > 0, then the AdamW step;
    `step()` returns (True, grad norm, None) as megatron's. `param_groups` are the AdamW's (decay first,
    then no decay with `wd_mult` 0), which megatron's `OptimizerParamScheduler` sets."""

    def __init__(self, chunks: list, *, lr: float, min_lr: float, betas: tuple[float, float], weight_decay: float,
                 clip_grad: float, dp_cp_group, tp_group, pp_group, expert_groups: ExpertGroups | None = None):
        decay, no_decay = [], []
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if param.requires_grad:
                    (no_decay if no_weight_decay(name, param) else decay).append(param)
        groups = [{"params": params, "wd_mult": mult, "lr_mult": 1.0, "max_lr": lr, "min_lr": min_lr}
                  for params, mult in ((decay, 1.0), (no_decay, 0.0))]
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=ADAM_EPS, weight_decay=weight_decay)
        self.params = decay + no_decay
        self.clip_grad = clip_grad
        self.dp_cp_group, self.tp_group, self.pp_group = dp_cp_group, tp_group, pp_group
        self.expert_groups = expert_groups
        # ids of the experts' parameters (sharded over expert DP; the rest over DP x CP)
        self.expert_ids = {id(p) for chunk in chunks for m in expert_modules(chunk) for p in m.parameters()}
        if self.expert_ids and expert_groups is None:
            raise ValueError("megatron.use_torch_fsdp2: an MoE model's gradient norm needs the expert groups")

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self) -> float:
        """The L2 norm of the whole model's gradient, as megatron's `ChainedOptimizer` of a dense and
        an expert optimizer (optimizer/__init__.py: the experts' norm over the expert TP x EP x PP
        group, clip_grads.py `get_grad_norm_fp32`, the two combined): the dense gradients' squares of
        this rank's shards summed over DP x CP, then over TP, a TP-replicated gradient counted on TP
        rank 0 only, then over the pipeline stages, the last stage's copy of a tied embedding
        (megatron's `shared` mark) left out; the experts' summed over expert DP, then over expert TP x
        EP x PP, an expert-TP-replicated one counted on expert-TP rank 0 only (megatron-core 0.19
        `param_is_not_tensor_parallel_duplicate`)."""
        tp_rank = dist.get_rank(self.tp_group)
        etp_rank = dist.get_rank(self.expert_groups.tp) if self.expert_groups is not None else 0
        dense = torch.zeros((), dtype=torch.float32, device=self._device())
        experts = torch.zeros((), dtype=torch.float32, device=self._device())
        for param in self.params:
            if param.grad is None or getattr(param, "shared", False):
                continue
            is_expert = id(param) in self.expert_ids
            if getattr(param, "tensor_model_parallel", False) or (etp_rank if is_expert else tp_rank) == 0:
                square = param.grad.to_local().float().square().sum()
                if is_expert:
                    experts += square
                else:
                    dense += square
        dist.all_reduce(dense, group=self.dp_cp_group)
        dist.all_reduce(dense, group=self.tp_group)
        dist.all_reduce(dense, group=self.pp_group)
        if self.expert_groups is not None:  # on every rank of an MoE model, whether its stage has experts or not
            dist.all_reduce(experts, group=self.expert_groups.dp)
            dist.all_reduce(experts, group=self.expert_groups.tp_ep_pp)
        return float((dense + experts).sqrt())

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        grad_norm = self.grad_norm()  # always, as megatron's ChainedOptimizer.step (megarl's metric)
        if self.clip_grad > 0:
            coeff = self.clip_grad / (grad_norm + 1.0e-6)  # megatron's clip_grad_by_total_norm_fp32
            if coeff < 1.0:
                for param in self.params:
                    if param.grad is not None:
                        param.grad.mul_(coeff)
        self.optimizer.step()
        return True, grad_norm, None

    def _device(self) -> torch.device:
        return self.params[0].to_local().device if self.params else torch.device("cpu")
