"""megatron-core's `parallel_state` for one role, inside an already started torch.distributed world.

The worker group starts torch.distributed over exactly the role's ranks (gloo on CPU; on GPUs
"cpu:gloo,cuda:nccl", as megarl.config.devices decides); `init_role_parallel_state` then applies
the CPU shims when CUDA is absent, initialises TP x PP (x VPP) on top and logs the groups'
backends. It never calls `init_process_group` itself. Engines of several roles may share a
process only when they use the same layout (megatron's parallel state is global).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megarl.bridge.sharding import ParallelLayout
from megarl.engines.megatron.cpu.shims import apply_cpu_shims
from megarl.engines.megatron.groups import initialize_model_parallel
from megarl.engines.megatron.cpu.moe_shims import apply_moe_cpu_shims

log = logging.getLogger("megarl.engines")


@dataclass(frozen=True)
class RoleLayout:
    """The parallel sizes of one role (from its `megatron` config section)."""

    tp: int
    pp: int
    vpp: int  # model chunks per pipeline rank; 1 without virtual pipeline
    ep: int = 1  # expert parallel (MoE models)
    etp: Optional[int] = None  # expert tensor parallel; None: tp
    sp: bool = False  # sequence parallel (only with tp > 1: `sequence_parallel_on`)
    cp: int = 1  # context parallel
    # uneven pipeline stages: layers of the first / last stage (override_transformer_config's
    # num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage; None: an even split)
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    # override_transformer_config's account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split
    embedding_in_split: bool = False
    loss_in_split: bool = False

    @property
    def bridge_layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp, self.pp, self.vpp, ep=self.ep, etp=self.etp or 0,
                              first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
                              embedding_in_split=self.embedding_in_split, loss_in_split=self.loss_in_split)

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def vpp_or_none(self) -> Optional[int]:
        return self.vpp if self.vpp > 1 else None


def role_layout(megatron_cfg, section: str) -> RoleLayout:
    """Read and check TP/PP/VPP/CP/EP and sequence parallelism of a `MegatronConfig`; `section` names it in errors."""
    tp = megatron_cfg.tensor_model_parallel_size
    pp = megatron_cfg.pipeline_model_parallel_size
    vpp = megatron_cfg.virtual_pipeline_model_parallel_size or 1
    cp = megatron_cfg.context_parallel_size
    if cp < 1:
        raise ValueError(f"{section}.context_parallel_size={cp}: must be a positive integer")
    if vpp > 1 and pp == 1:
        raise ValueError(f"{section}.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1")
    overrides = megatron_cfg.override_transformer_config
    return RoleLayout(tp, pp, vpp, megatron_cfg.expert_model_parallel_size, megatron_cfg.expert_tensor_parallel_size,
                      sp=sequence_parallel_on(megatron_cfg.sequence_parallel, tp), cp=cp,
                      first_stage_layers=overrides.get("num_layers_in_first_pipeline_stage"),
                      last_stage_layers=overrides.get("num_layers_in_last_pipeline_stage"),
                      embedding_in_split=bool(overrides.get("account_for_embedding_in_pipeline_split", False)),
                      loss_in_split=bool(overrides.get("account_for_loss_in_pipeline_split", False)))


def sequence_parallel_on(requested: bool, tp: int) -> bool:
    """Whether a role runs sequence parallelism: where `<role>.megatron.sequence_parallel` asks for it
    and TP > 1. At TP 1 there is no tensor-parallel group to split the sequence over (megatron-core
    refuses it there: model_parallel_config.py "Cannot use sequence parallelism without tensor
    parallelism"), and verl turns it off there, so a verl script's `sequence_parallel=true` runs at any TP."""
    return requested and tp > 1


def init_role_parallel_state(layout: RoleLayout, seed: int, section: str, *, collective_timeout_s: float) -> None:
    """Initialise megatron's parallel state for `layout` (or check that it already is) and seed
    megatron's RNG tracker. torch.distributed must already be initialised by the caller.
    `collective_timeout_s` (seconds, actor_rollout_ref.nccl_timeout) bounds every collective of
    megatron's groups (its `distributed_timeout_minutes`, 30 by default)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.cuda.is_available():
        apply_cpu_shims()
    apply_moe_cpu_shims()  # CPU only, but for a megatron bug without transformer-engine (cpu/moe_shims.py)
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: the worker group must call init_process_group over the "
            f"role's ranks before building an engine ({section})"
        )
    world = dist.get_world_size()
    if world % (layout.tp * layout.pp * layout.cp):
        raise ValueError(
            f"{section}: tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size = "
            f"{layout.tp} x {layout.pp} x {layout.cp} does not divide the {world} ranks of this role"
        )
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
        )
        if current != (layout.tp, layout.pp, layout.vpp, layout.ep, layout.expert_tp, layout.cp):
            raise RuntimeError(
                f"{section}: megatron's parallel state is already initialised in this process as TP={current[0]} "
                f"PP={current[1]} VPP={current[2]} EP={current[3]} ETP={current[4]} CP={current[5]}, but this role "
                f"wants TP={layout.tp} PP={layout.pp} VPP={layout.vpp} EP={layout.ep} ETP={layout.expert_tp} "
                f"CP={layout.cp}; roles sharing a process must share a layout"
            )
    else:
        initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp_or_none,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.expert_tp,
            # megatron-core 0.16 and 0.19 use it only as timedelta(minutes=...): a float is exact
            distributed_timeout_minutes=collective_timeout_s / 60,
        )
        if dist.get_rank() == 0:
            log.info("%s: process group backends %s", section,
                     " ".join(f"{name}={backend}" for name, backend in group_backends().items()))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    if not torch.cuda.is_available():
        apply_cpu_shims()  # reach megatron modules imported since the first call


def group_backends() -> dict[str, str]:
    """The torch.distributed backend of the world and of megatron's groups of this rank (they
    inherit the world's: parallel_state.create_group(backend=None)); names as in parallel_state."""
    from megatron.core import parallel_state as ps

    groups = {
        "world": None,
        "tensor_model_parallel": ps.get_tensor_model_parallel_group(),
        "pipeline_model_parallel": ps.get_pipeline_model_parallel_group(),
        "data_parallel": ps.get_data_parallel_group(),
        "model_parallel": ps.get_model_parallel_group(),
        "data_parallel_gloo": ps.get_data_parallel_group_gloo(),
    }
    return {name: str(dist.get_backend(group)) for name, group in groups.items()}


def compute_device() -> torch.device:
    """Where the engine's tensors live: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
