"""`torch_dist` distributed checkpoints of a role: model chunks, optimizer, LR schedule and the
engine's update count, saved and loaded with megatron's `dist_checkpointing` (resharded to the
loading rank's TP/PP/EP layout), and the model weights alone for a model loaded from a checkpoint.

Checkpoint keys do not depend on the layer spec (local on CPU and for LoRA, transformer-engine on
GPUs): `_extra_state` objects are neither saved nor loaded, and an MoE layer's pre-MLP norm is kept
under the TE spec's key (`megarl.bridge.torch_dist_io.te_moe_norm_key`), which is also what the
bridge's converter writes."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megarl.bridge.mapping import is_extra_state
from megarl.bridge.torch_dist_io import check_metadata_is_data, te_moe_norm_key


def localize_extra_states(sharded: Any) -> Any:
    """Turn every `_extra_state` ShardedObject into a non-persistent local object (not saved, not
    loaded), so checkpoints do not depend on the layer spec (local vs transformer-engine)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject

    if isinstance(sharded, dict):
        return {k: localize_extra_states(v) for k, v in sharded.items()}
    if isinstance(sharded, list):
        return [localize_extra_states(v) for v in sharded]
    if isinstance(sharded, ShardedObject) and is_extra_state(sharded.key):
        return LocalNonpersistentObject(sharded.data)
    return sharded


def te_moe_norm_keys(sharded: Any) -> Any:
    """Rename, in place, the local-spec key of every MoE layer's pre-MLP norm to the TE spec's
    (`te_moe_norm_key`); call it on the sharded state dict of an MoE model only."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(sharded, dict):
        for value in sharded.values():
            te_moe_norm_keys(value)
    elif isinstance(sharded, list):
        for value in sharded:
            te_moe_norm_keys(value)
    elif isinstance(sharded, ShardedTensor):
        sharded.key = te_moe_norm_key(sharded.key)
    return sharded


def _chunk_sharded_state_dict(chunk) -> dict:
    from megatron.core.utils import get_model_config

    sharded = localize_extra_states(chunk.sharded_state_dict())
    return te_moe_norm_keys(sharded) if get_model_config(chunk).num_moe_experts else sharded


def model_sharded_state_dict(chunks) -> dict:
    """{"model" or "model<v>": sharded state dict} in megatron's own checkpoint layout, keys
    independent of the layer spec (module docstring)."""
    if len(chunks) == 1:
        return {"model": _chunk_sharded_state_dict(chunks[0])}
    return {f"model{v}": _chunk_sharded_state_dict(c) for v, c in enumerate(chunks)}


def load_torch_dist_weights(chunks, ckpt_dir: Path) -> None:
    """Load (and reshard) the model weights of a `torch_dist` checkpoint into the chunks."""
    from megatron.core import dist_checkpointing

    check_metadata_is_data(ckpt_dir)
    request = model_sharded_state_dict(chunks)
    loaded = dist_checkpointing.load(request, str(ckpt_dir))
    for key, chunk in zip(request, chunks):
        chunk.load_state_dict(loaded[key], strict=True)


def save_checkpoint(path: Path, chunks: list, optimizer, scheduler, updates: int, distributed_optimizer: bool,
                    background: Optional[AsyncSaves] = None) -> None:
    """Save into the directory `path` (created by rank 0); every rank of the role calls it.
    Model and (non-distributed) optimizer state load at any TP/PP layout; the distributed
    optimizer's state needs the same TP/PP. `optimizer` None: the model alone. `background`: the
    tensors are staged and written by a background process (`AsyncSaves`), finished by its `finish`."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded_state(chunks, optimizer, scheduler, updates, distributed_optimizer, is_loading=False)
    if background is not None:
        background.save(state, path)
        return
    dist_checkpointing.save(state, str(path))
    dist.barrier()


class AsyncSaves:
    """megatron-core's asynchronous dist-checkpoint save on one rank (every rank of the role holds
    one and calls each method together): `dist_checkpointing.save(..., async_sharded_save=True)`
    writes the common part (common.pt, sharded objects) at once and returns the request writing the
    tensors, which `AsyncCallsQueue.schedule_async_request` starts: it stages the tensors
    (strategies/filesystem_async.py `FileSystemWriterAsync.preload_tensors`: a copy to host memory
    of device tensors) and forks the process writing them (strategies/async_utils.py
    `TemporalAsyncCaller`, megatron's default, as megatron/training/async_utils.py and verl's
    MegatronCheckpointManager use it). Host tensors are not copied (`.to("cpu")` returns them):
    the forked writer sees them as they were at the fork, copy-on-write, whatever training does
    to them afterwards. megatron's persistent writer (`AsyncCallsQueue(persistent=True)`, a spawned
    process) would instead receive host tensors in shared memory and could write them half-updated,
    so it is not used. A write is done once every rank's writer exited and the finalisation ran
    (the results checked, metadata.json written by rank 0, a barrier)."""

    POLL_S = 0.1  # between the checks of a bounded wait

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue()

    def save(self, state: dict, path: Path) -> None:
        """Start writing the sharded state dict `state` into `path`; returns once it is staged."""
        from megatron.core import dist_checkpointing

        request = dist_checkpointing.save(state, str(path), async_sharded_save=True)
        self.queue.schedule_async_request(request)

    def finish(self, blocking: bool, timeout_s: float) -> bool:
        """Finalise the writes every rank finished (a collective per check); True when none is left.
        `blocking`: check again every POLL_S seconds, at most timeout_s / POLL_S times (the same
        count on every rank, so their collectives pair up), then raise TimeoutError on every rank."""
        checks = max(1, int(timeout_s / self.POLL_S)) if blocking else 1
        for check in range(checks):
            self.queue.maybe_finalize_async_calls(blocking=False)
            if self.queue.get_num_unfinalized_calls() == 0:
                return True
            if check + 1 < checks:
                time.sleep(self.POLL_S)
        if blocking:
            raise TimeoutError(f"a checkpoint's background write did not finish within {timeout_s:.0f} s on "
                               "every rank")
        return False


def load_checkpoint(path: Path, chunks: list, optimizer, scheduler, distributed_optimizer: bool) -> int:
    """Load what `save_checkpoint` saved (possibly at another TP/PP layout) into the chunks, the
    optimizer and the LR schedule (`optimizer` None: the chunks alone); returns the saved update
    count. Every rank calls it."""
    from megatron.core import dist_checkpointing

    if distributed_optimizer and optimizer is not None:  # megatron's dp_reshardable load fills existing state tensors
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()
    check_metadata_is_data(path)  # torch.distributed.checkpoint itself unpickles it unrestricted
    # the request's plain values (the update count, the schedule) are replaced by the checkpoint's
    state = _sharded_state(chunks, optimizer, scheduler, 0, distributed_optimizer, is_loading=True)
    loaded = dist_checkpointing.load(state, str(path))
    for key, chunk in zip([k for k in state if k.startswith("model")], chunks):
        chunk.load_state_dict(loaded[key], strict=True)
    if optimizer is not None:
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        if distributed_optimizer:
            _restore_adam_steps(optimizer)
        scheduler.load_state_dict(loaded["scheduler"])
    return loaded["engine"]["updates"]


def _sharded_state(chunks, optimizer, scheduler, updates: int, distributed_optimizer: bool, is_loading: bool) -> dict:
    """What a checkpoint holds: "model"/"model<v>", "optimizer" and "scheduler" (with an
    optimizer), "engine": {"updates"}."""
    state = model_sharded_state_dict(chunks)
    if optimizer is not None:
        model_state = dict(state)
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=_optimizer_metadata(distributed_optimizer)
        )
        state["scheduler"] = scheduler.state_dict()
    state["engine"] = {"updates": updates}
    return state


def _optimizer_metadata(distributed_optimizer: bool) -> Optional[dict]:
    return {"distrib_optim_sharding_type": "dp_reshardable"} if distributed_optimizer else None


def _restore_adam_steps(optimizer) -> None:
    """Work around megatron-core 0.16.1: loading a `dp_reshardable` distributed-optimizer
    checkpoint with torch's Adam (no apex / TE optimizer) leaves every parameter's Adam `step` at
    the dummy step taken before loading, and as ONE tensor shared by all parameters (so each
    later step would add the parameter count to it). Give every parameter its own step, set to
    the saved one, which is in the loaded param groups."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = torch_optimizer.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype,
                                                 device=state["step"].device)
