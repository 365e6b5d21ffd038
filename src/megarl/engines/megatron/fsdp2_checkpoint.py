"""Checkpoints of a role trained with torch FSDP2 (`megatron.use_torch_fsdp2`, engines.megatron.fsdp2), in
the directory a megatron-DDP role's checkpoint would take, in two parts:

- The model, the LR schedule and the update count: megatron's `torch_dist` checkpoint, the same keys,
  dtypes and format as the DDP path's (checkpoint_io): each parameter whole over DP x CP (this rank's
  TP shard) in the model's dtype, written through the chunks' `sharded_state_dict` with the
  FSDP2 DTensors swapped for their gathered values (`_plain_parameters`). `megarl export`, the HF
  conversion and a reference model read it as any megarl checkpoint; its weights load at any TP/PP
  layout (`load_weights`).
- The training state, in the subdirectory `fsdp2_optimizer/tp<t>/` (one torch.distributed.checkpoint
  (DCP) checkpoint per TP rank, written by that rank's DP x CP group; with pipeline parallelism one per
  TP rank and stage, `tp<t>_pp<p>/`, each stage's parameters under their local names): per parameter,
  by chunk and name, its float32 main shard (`param`, the FSDP2 DTensor) and torch AdamW's state
  (`exp_avg`, `exp_avg_sq` DTensors, `step`), an MoE expert's keyed by its EP rank too (`_optimized`),
  plus `fsdp2_optimizer/layout.json` (the TP / PP / DP / CP / EP / expert TP sizes).

A resume with the optimizer (`load`) reads the parameters and Adam state from the DCP part and the
schedule and count from the torch_dist part: at the same layout the next update is the uninterrupted
run's bit for bit (tests/engines/test_fsdp2.py). At another DP or CP size DCP reshards the DTensor
shards (the same values, each rank its new `Shard(0)` part); another TP, PP, EP or expert-TP size is
refused (ValueError naming the checkpoint and both layouts: the shards are of TP-split tensors, by each
stage's local names, each EP rank's of its own experts), where a resume without the optimizer state
(`load_weights`) still works. Each parameter is gathered over its own shard group (`fsdp2.shard_group`:
DP x CP, or an expert's expert DP)."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from megarl.bridge.torch_dist_io import check_metadata_is_data
from megarl.engines.megatron import fsdp2
from megarl.engines.megatron.checkpoint_io import model_sharded_state_dict

STATE_DIR = "fsdp2_optimizer"  # the DCP part's subdirectory of the checkpoint directory
LAYOUT_FILE = "layout.json"
ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")  # torch AdamW's per-parameter state (amsgrad off)


def current_layout() -> dict[str, int]:
    """This process's megatron layout: {TP, PP, DP, CP, EP, expert TP size key: size}."""
    from megatron.core import parallel_state as ps

    return {"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": ps.get_data_parallel_world_size(),
            "context_parallel_size": ps.get_context_parallel_world_size(),
            "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size()}


def state_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """The DCP part's directory of a TP rank and pipeline stage: "tp<t>", "tp<t>_pp<p>" with PP > 1
    (each stage holds other parameters under the same local names)."""
    return f"tp{tp_rank}" if pp_size == 1 else f"tp{tp_rank}_pp{pp_rank}"


def _state_dir(path: Path) -> Path:
    from megatron.core import parallel_state as ps

    return path / STATE_DIR / state_dir_name(ps.get_tensor_model_parallel_rank(),
                                             ps.get_pipeline_model_parallel_rank(),
                                             ps.get_pipeline_model_parallel_world_size())


@contextlib.contextmanager
def _plain_parameters(chunks: list, make) -> Iterator[None]:
    """A context in which every FSDP2 parameter of the chunks is replaced, in its module, by the plain
    tensor `make(parameter)` (made in the modules' order, the same on every rank), restored on exit.
    megatron's `sharded_state_dict` then maps plain tensors, as for a DDP model: given the DTensors
    it would map their local shards, each with a TP layout's offsets (wrong for a `Shard(0)` split)."""
    from torch.distributed.tensor import DTensor

    for module in fsdp2.fsdp_modules(chunks):
        module.reshard()  # FSDP2's state-dict hook would put the sharded parameters back otherwise
    made: dict[int, torch.Tensor] = {}
    swapped = []
    for chunk in chunks:
        for module in chunk.modules():
            for name, param in list(module._parameters.items()):
                if isinstance(param, DTensor):
                    if id(param) not in made:
                        made[id(param)] = make(param)
                    swapped.append((module, name, param))
                    module._parameters[name] = made[id(param)]
    try:
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def whole(param, group) -> torch.Tensor:
    """The whole tensor of an FSDP2 `Shard(0)` DTensor over `group` (its mesh's), all-gathered with
    plain collectives (a DTensor's own `full_tensor` resolves its mesh's group by a cached name). Rule
    (DTensor's Shard(0), torch.chunk): rank r holds rows [r * c, (r + 1) * c) of dim 0, c =
    ceil(rows / group size), the last ranks fewer or none; each part is padded to c rows, gathered,
    concatenated and cut to the rows."""
    local = param.to_local()
    rows = param.shape[0]
    size = dist.get_world_size(group)
    piece = -(-rows // size)
    padded = local.new_zeros((piece, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)[:rows]


def _whole_model_state(chunks: list, dtype: torch.dtype) -> dict:
    """The chunks' megatron sharded state dict (checkpoint_io keys) holding plain tensors: each
    parameter all-gathered over its shard group (a collective on every rank of it) in `dtype`."""
    with _plain_parameters(chunks, lambda d: whole(d.detach(), fsdp2.shard_group(d)).to(dtype)):
        return model_sharded_state_dict(chunks)


def _optimized(chunks: list, optimizer) -> dict:
    """{key: parameter} of the parameters optimized: "<chunk>.<name>", an expert's "<chunk>.ep<EP
    rank>.<name>" (its name is local to the EP rank: EP ranks hold other experts under the same names)."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    ids = {id(p) for p in optimizer.params}
    return {(f"{v}.ep{ep_rank}.{name}" if id(param) in optimizer.expert_ids else f"{v}.{name}"): param
            for v, chunk in enumerate(chunks) for name, param in chunk.named_parameters() if id(param) in ids}


def _train_state(chunks: list, optimizer, like: bool) -> dict[str, dict[str, torch.Tensor]]:
    """{"param" and each ADAM_KEYS: {key (`_optimized`): tensor}} of the parameters optimized: the
    float32 DTensor shards and AdamW's state (the parameters without state yet: none). `like`: fresh
    tensors of the same kind to load into (the Adam state of every parameter)."""
    torch_state = optimizer.optimizer.state
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in ("param",) + ADAM_KEYS}
    for key, param in _optimized(chunks, optimizer).items():
        out["param"][key] = torch.empty_like(param.detach()) if like else param.detach()
        state = torch_state.get(param, {})
        for k in ADAM_KEYS:
            if like:
                out[k][key] = (torch.zeros((), dtype=torch.float32) if k == "step"
                               else torch.zeros_like(param.detach()))
            elif k in state:
                out[k][key] = state[k]
    return out


def save(path: Path, chunks: list, optimizer, scheduler, updates: int, dtype: torch.dtype, group) -> None:
    """Save into the directory `path` (module docstring); every rank of the role calls it. `dtype`:
    the model's (the torch_dist part's tensors); `optimizer` None: the model alone; `group`: the DP x
    CP group (FSDP2's mesh)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _whole_model_state(chunks, dtype)
    if optimizer is not None:
        state["scheduler"] = scheduler.state_dict()
    state["engine"] = {"updates": updates}
    dist_checkpointing.save(state, str(path))  # refuses a non-empty directory: before the DCP part
    if optimizer is not None:
        if dist.get_rank() == 0:
            (path / STATE_DIR).mkdir()
            (path / STATE_DIR / LAYOUT_FILE).write_text(json.dumps(current_layout(), indent=1) + "\n")
        dist.barrier()
        train_state = {k: v for k, v in _train_state(chunks, optimizer, like=False).items() if v}
        dcp.save(train_state, checkpoint_id=str(_state_dir(path)), process_group=group)
    dist.barrier()


def check_layout(path: Path) -> None:
    """ValueError naming the checkpoint and both layouts where its TP, PP, EP or expert TP size is not
    this process's (its DP and CP sizes may differ: DCP reshards). A layout saved before the expert
    sizes were recorded (a dense model's) is checked on TP and PP."""
    saved = json.loads((path / STATE_DIR / LAYOUT_FILE).read_text())
    now = current_layout()
    fixed = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
             "expert_tensor_parallel_size")
    if any(saved.get(k, now[k]) != now[k] for k in fixed):
        raise ValueError(f"{path}: this megatron.use_torch_fsdp2 checkpoint's optimizer state was saved at layout "
                         f"{saved} and cannot load at {now}: its shards are of TP/PP/EP-split tensors (only the DP "
                         "and CP sizes may change); load it without the optimizer state (the weights alone) or at "
                         "its TP, PP and EP sizes")


def load(path: Path, chunks: list, optimizer, scheduler, group) -> int:
    """Load what `save` saved with its optimizer into the chunks' shards, the AdamW state and the LR
    schedule (module docstring: the layouts it loads at); returns the saved update count. Every rank
    calls it."""
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing

    if not (path / STATE_DIR / LAYOUT_FILE).is_file():
        raise FileNotFoundError(f"{path}: no {STATE_DIR}/{LAYOUT_FILE}: not a megatron.use_torch_fsdp2 checkpoint "
                                "with its optimizer state (a megatron DDP checkpoint, or one saved without the "
                                "optimizer, loads its weights alone)")
    check_layout(path)
    state_dir = _state_dir(path)
    check_metadata_is_data(state_dir)  # torch.distributed.checkpoint itself unpickles it unrestricted
    saved = dcp.FileSystemReader(str(state_dir)).read_metadata().state_dict_metadata
    request = {k: {name: t for name, t in tensors.items() if f"{k}.{name}" in saved}
               for k, tensors in _train_state(chunks, optimizer, like=True).items()}
    request = {k: v for k, v in request.items() if v}
    dcp.load(request, checkpoint_id=str(state_dir), process_group=group)
    names = _optimized(chunks, optimizer)
    if set(request["param"]) != set(names):
        raise ValueError(f"{path}: the parameters in {STATE_DIR} are not the model's (differing: "
                         f"{sorted(set(request['param']) ^ set(names))[:5]})")
    torch_state = optimizer.optimizer.state
    with torch.no_grad():
        for key, shard in request["param"].items():
            param = names[key]
            param.to_local().copy_(shard.to_local())
            if all(key in request.get(k, {}) for k in ADAM_KEYS):
                torch_state[param] = {k: request[k][key] for k in ADAM_KEYS}
            else:
                torch_state.pop(param, None)
    common = dist_checkpointing.load_common_state_dict(str(path))
    scheduler.load_state_dict(common["scheduler"])
    return common["engine"]["updates"]


def load_weights(path: Path, chunks: list, dtype: torch.dtype) -> int:
    """Load the model weights of a `torch_dist` checkpoint (this path's or a DDP role's, at any TP/PP
    layout: megatron resharding) into the FSDP2 shards: each parameter read whole in `dtype` (the
    model's, as saved), this rank's rows of it (`whole`'s rule, over its `fsdp2.shard_group`) copied into
    its float32 shard. Returns the saved update count. Every rank calls it."""
    from megatron.core import dist_checkpointing

    check_metadata_is_data(path)
    with _plain_parameters(chunks, lambda d: torch.empty(d.shape, dtype=dtype, device=d.to_local().device)):
        request = model_sharded_state_dict(chunks)
    request["engine"] = {"updates": 0}
    loaded = dist_checkpointing.load(request, str(path))
    with torch.no_grad():
        for key, chunk in zip([k for k in request if k.startswith("model")], chunks):
            for name, param in chunk.named_parameters():
                if name not in loaded[key]:
                    raise ValueError(f"{path}: no weight {name!r} in the checkpoint's {key}")
                group = fsdp2.shard_group(param)
                rank, size = dist.get_rank(group), dist.get_world_size(group)
                piece = -(-param.shape[0] // size)
                param.to_local().copy_(loaded[key][name][rank * piece:(rank + 1) * piece])
    return loaded["engine"]["updates"]
