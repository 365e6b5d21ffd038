"""megatron-core `torch_dist` checkpoints, written and read one tensor chunk at a time.

The format is the one `megatron.core.dist_checkpointing.save` produces for a `GPTModel`: a
PyTorch Distributed Checkpoint (`.metadata` + `*.distcp`) holding every tensor under its
*global* shape, plus megatron's `metadata.json` and `common.pt`. Per-layer parameters are
stacked: `decoder.layers.{i}.X` is row i of key `decoder.layers.X` with shape [L, ...]. The
embedding and output layer have the padded vocabulary; a tied output layer has no key of its
own. Each linear of a layer also has an `_extra_state` object (None for the local spec), which a
stock `GPTModel` asks for when it loads. Because sharding is resolved at load time, one
checkpoint loads at any TP / PP / VPP / EP layout.

MoE layers, as megatron-core (0.16.1 and 0.19.2) saves them (read from its `sharded_state_dict`,
tests/bridge/moe_world.py compares):
- experts: SequentialMLP stores local expert k of EP rank r under its global index
  g = r * E / EP + k, in one key per projection with a layer and an expert axis:
  `decoder.layers.{i}.mlp.experts.local_experts.{g}.linear_fc1.weight` is [i, g] of
  `decoder.layers.mlp.experts.experts.linear_fc1.weight` [L, E, 2F, H] (fc2: [L, E, H, F]),
  split over expert-TP like a dense fc1 / fc2 (transformer/moe/experts.py `SequentialMLP.sharded_state_dict`).
  TEGroupedMLP saves under the same keys ("interchangeable with SequentialMLP's", experts.py
  `TEGroupedMLP.sharded_state_dict`). `_extra_state` objects per (layer, expert):
  `decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_{i}.{g}_{L}.{E}`.
- router `decoder.layers.mlp.router.weight` [L, E, H]; Qwen2-MoE's shared expert
  `decoder.layers.mlp.shared_experts.linear_fc1.weight` [L, 2S, H], `.linear_fc2.weight`
  [L, H, S] and its gate `decoder.layers.mlp.shared_experts.gate_weight` [L, 1, H].
- the pre-MLP norm: the transformer-engine spec saves it as `decoder.layers.pre_mlp_layernorm.weight`;
  the local spec's `sharded_state_dict_keys_map` renames it to `decoder.layers.mlp.linear_fc1.layer_norm_weight`
  (gpt_layer_specs.py, both versions). Checkpoints are written with the TE key, the engine saves
  and loads it there on either spec (`engines.megatron.checkpoint_io`), and both are read.
With `singleton_local_shards`, megatron keys every layer (`decoder.layers.{i}.X`) and expert
(`decoder.layers.{i}.mlp.experts.experts.{g}.linear_fc1.weight`) separately, and fc1 as `_w` / `_v`
halves; those are read too. A model whose layers differ (DeepSeek-V3's dense first layers: megatron's
`moe_layer_freq` list, transformer_block.py `non_homogeneous_layers`) is keyed per layer too, its
experts stacked per layer (`decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight` [E, 2F, H]),
and each layer's `_extra_state` objects as `decoder.layers.{i}.<module>._extra_state/shard_0_1`
(experts `/shard_{g}_{E}`); those are written so, and a dense layer's pre-MLP norm in such an MoE
model is written under `pre_mlp_layernorm.weight`, as the engine saves it.

Multi-token-prediction layers (`WeightMap.mtp`) are keyed per layer, as megatron-core 0.16.1 and 0.19
save them (MultiTokenPredictionBlock / MultiTokenPredictionLayer `sharded_state_dict`; 0.19 maps its
`mtp_model_layer` back to `transformer_layer`): `mtp.layers.{k}.{enorm,hnorm,eh_proj,final_layernorm}.weight`
and the layer's decoder layer as a per-layer decoder layer under `mtp.layers.{k}.transformer_layer.`
(experts `mtp.layers.{k}.transformer_layer.mlp.experts.experts.linear_fc1.weight` [E, 2F, H]), objects
`/shard_0_1` (experts `/shard_{g}_{E}`), the pre-MLP norm under its TE key as the decoder's
(tests/bridge/test_mtp_convert.py compares megatron's own keys).

Checkpoint directory layout (megatron's): `<root>/latest_checkpointed_iteration.txt` names the
iteration directory (`release` or `iter_0000123`) that holds the files above.
"""
from __future__ import annotations

import contextlib
import io
import json
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megarl.bridge.arch import ModelArch
from megarl.bridge.errors import ConversionError
from megarl.bridge.mapping import WeightMap

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE_DIR = "release"
MEGATRON_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
# Modules of a local-spec layer that carry an `_extra_state` object in a checkpoint.
ATTENTION_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj")
MLA_EXTRA_STATE = ("self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
                   "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj", "self_attention.linear_proj")
MLA_Q_EXTRA_STATE = ("self_attention.linear_q_proj", "self_attention.linear_kv_down_proj",
                     "self_attention.linear_kv_up_proj", "self_attention.linear_proj")
DENSE_MLP_EXTRA_STATE = ("mlp.linear_fc1", "mlp.linear_fc2")
SHARED_EXPERT_EXTRA_STATE = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_EXTRA_STATE = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
MOE_NORM = "pre_mlp_layernorm.weight"  # an MoE layer's pre-MLP norm, TE spelling
MOE_NORM_LOCAL = "mlp.linear_fc1.layer_norm_weight"  # its local-spec checkpoint spelling
_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
_MTP_LAYER_PREFIX = re.compile(r"^mtp\.layers\.(\d+)\.transformer_layer\.")
_EXPERT_PART = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class Location:
    """Where a checkpoint holds a parameter: `index` (layer, expert...) into key `key`'s leading axes."""

    key: str
    index: tuple[int, ...] = ()
    axes: tuple[str, ...] = ()  # what each index counts: "layers", "experts"


def per_layer_keys(arch: ModelArch) -> bool:
    """megatron keys `arch`'s checkpoint per layer: its layers differ (dense first layers)."""
    return arch.moe is not None and arch.moe.first_dense_layers > 0


def checkpoint_locations(global_name: str, arch: Optional[ModelArch] = None) -> list[Location]:
    """Where a `torch_dist` checkpoint may hold global megatron parameter `global_name` (TE
    spelling, SequentialMLP expert names), the form `write_torch_dist` writes for `arch` first:
    stacked (`decoder.layers.X` at [i], experts `decoder.layers.mlp.experts.experts.X` at [i, e]),
    per-layer (`decoder.layers.{i}.X`, experts `decoder.layers.{i}.mlp.experts.experts.X` at [e];
    first where `per_layer_keys(arch)`), per-expert (`singleton_local_shards`), each also, for a
    pre-MLP norm, under the other spelling (an MoE layer's local-spec key; in an MoE model a dense
    layer's is `pre_mlp_layernorm`). fc1 may also be stored as `<key>_w` / `<key>_v` halves (the reader's business).
    An MTP layer's decoder layer (`mtp.layers.{k}.transformer_layer.X`) has a decoder layer's per-layer forms."""
    mtp = _MTP_LAYER_PREFIX.match(global_name)
    if mtp is not None:
        decoder = f"decoder.layers.{mtp.group(1)}."
        return [Location(mtp.group(0) + loc.key[len(decoder):], loc.index, loc.axes)
                for loc in checkpoint_locations(decoder + global_name[mtp.end():], arch) if loc.key.startswith(decoder)]
    m = _LAYER_PREFIX.match(global_name)
    if m is None:
        return [Location(global_name)]
    layer, rest = int(m.group(1)), global_name[m.end():]
    spellings = {MOE_NORM: [rest, MOE_NORM_LOCAL], MOE_NORM_LOCAL: [rest, MOE_NORM]}.get(rest, [rest])
    if arch is not None and arch.moe is not None and rest == MOE_NORM_LOCAL:
        spellings.reverse()
    out = []
    for part in spellings:
        e = _EXPERT_PART.match(part)
        if e is None:
            forms = [Location(f"decoder.layers.{part}", (layer,), ("layers",)),
                     Location(f"decoder.layers.{layer}.{part}")]
        else:
            expert, tail = int(e.group(1)), part[e.end():]
            forms = [Location(f"decoder.layers.mlp.experts.experts.{tail}", (layer, expert), ("layers", "experts")),
                     Location(f"decoder.layers.{layer}.mlp.experts.experts.{tail}", (expert,), ("experts",)),
                     Location(f"decoder.layers.{layer}.mlp.experts.experts.{expert}.{tail}")]
        if arch is not None and per_layer_keys(arch):
            forms = forms[1:] + forms[:1]
        out += forms
    return out


_LOCAL_MOE_NORM_KEY = re.compile(r"^(decoder\.layers\.(?:\d+\.)?|mtp\.layers\.\d+\.transformer_layer\.)"
                                 + re.escape(MOE_NORM_LOCAL) + "$")


def te_moe_norm_key(key: str) -> str:
    """The TE key of an MoE layer's pre-MLP norm given its local-spec checkpoint key
    (`decoder.layers.[{i}.]mlp.linear_fc1.layer_norm_weight` -> `decoder.layers.[{i}.]pre_mlp_layernorm.weight`,
    an MTP layer's `mtp.layers.{k}.transformer_layer.` alike); any other key unchanged. Only for keys of an MoE
    model: a dense layer's fused norm has that local key itself (an MTP layer is the decoder's last, MoE, layer)."""
    return _LOCAL_MOE_NORM_KEY.sub(lambda m: m.group(1) + MOE_NORM, key)


@dataclass(frozen=True)
class TensorEntry:
    """One checkpoint tensor: its key, global shape and dtype."""

    key: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype


def expected_tensors(weights: WeightMap, dtype_of: Callable[[str], torch.dtype]) -> dict[str, TensorEntry]:
    """The tensor keys and global shapes a `GPTModel` of `weights.arch` saves and asks for
    (an MoE layer's pre-MLP norm under the TE key)."""
    entries: dict[str, TensorEntry] = {}
    a = weights.arch
    for name in weights.mcore_names():
        location = checkpoint_locations(name, a)[0]
        if location.key not in entries:
            sizes = {"layers": a.num_layers, "experts": a.moe.num_experts if a.moe else 0}
            lead = tuple(sizes[axis] for axis in location.axes)
            entries[location.key] = TensorEntry(location.key, (*lead, *weights.mcore_shape(name)), dtype_of(name))
    return entries


def expected_objects(arch: ModelArch, mtp_layers: int = 0) -> list[str]:
    """Keys of the `_extra_state` objects a local-spec `GPTModel` of `arch` saves and asks for, with
    `mtp_layers` multi-token-prediction layers (`WeightMap.mtp_layers`)."""
    num_layers = arch.num_layers
    if arch.mla is None:
        attention = ATTENTION_EXTRA_STATE
    else:
        attention = MLA_EXTRA_STATE if arch.mla.q_lora_rank is not None else MLA_Q_EXTRA_STATE

    def modules(i: int) -> tuple[str, ...]:
        if not arch.is_moe_layer(i):
            return attention + DENSE_MLP_EXTRA_STATE
        return attention + (SHARED_EXPERT_EXTRA_STATE if arch.moe.shared_expert else ())

    experts = arch.moe.num_experts if arch.moe else 0

    def per_layer(prefix: str, i: int) -> list[str]:  # one layer keyed alone, as `prefix`
        keys = [f"{prefix}{module}._extra_state/shard_0_1" for module in modules(i)]
        if arch.is_moe_layer(i):
            keys += [f"{prefix}{module}._extra_state/shard_{e}_{experts}" for e in range(experts)
                     for module in EXPERT_EXTRA_STATE]
        return keys

    mtp = [key for k in range(mtp_layers) for key in [f"mtp.layers.{k}.eh_proj._extra_state/shard_0_1",
                                                      *per_layer(f"mtp.layers.{k}.transformer_layer.", num_layers + k)]]
    if per_layer_keys(arch):
        return [key for i in range(num_layers) for key in per_layer(f"decoder.layers.{i}.", i)] + mtp
    moe_layers = [i for i in range(num_layers) if arch.is_moe_layer(i)]
    keys = [f"decoder.layers.{module}._extra_state/shard_{i}_{num_layers}"
            for i in range(num_layers) for module in modules(i)]
    keys += [f"decoder.layers.{module}._extra_state/shard_{i}.{e}_{num_layers}.{experts}"
             for i in moe_layers for e in range(experts) for module in EXPERT_EXTRA_STATE]
    return keys + mtp


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Run a DCP save or load in this process alone: silence DCP's warning that it runs without
    torch.distributed, and re-raise the original error DCP wraps in a CheckpointException."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except dcp.CheckpointException as e:
            original, _ = next(iter(e.failures.values()))
            raise original from None


# ------------------------------------------------------------------------------------------ write
class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans the given write items and produces each item's data only when it is written."""

    def __init__(self, items: list[WriteItem], resolve: Callable[[WriteItem], torch.Tensor | io.BytesIO]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items = items
        self._resolve = resolve

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        super().set_up_planner({}, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        return self._resolve(write_item)


def _tensor_item(entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(entry.key, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=entry.dtype),
            size=torch.Size(entry.global_shape),
        ),
    )


def write_torch_dist(
    iter_dir: str | Path,
    weights: WeightMap,
    dtype_of: Callable[[str], torch.dtype],
    produce: Callable[[str], torch.Tensor],
    on_tensor: Optional[Callable[[str], None]] = None,
) -> None:
    """Write a `torch_dist` checkpoint of every parameter of `weights` into `iter_dir`.

    `produce(global_name)` returns the full megatron tensor (padded vocab); it is called once per
    parameter, when that parameter is written, and each tensor goes to its own file, so memory
    stays at about one parameter. `on_tensor(name)` is called as each parameter is produced.
    """
    iter_dir = Path(iter_dir)
    iter_dir.mkdir(parents=True)
    entries = expected_tensors(weights, dtype_of)
    items: list[WriteItem] = []
    param_of: dict[tuple[str, tuple[int, ...]], tuple[str, Optional[slice]]] = {}
    for name in weights.mcore_names():
        location = checkpoint_locations(name, weights.arch)[0]
        entry = entries[location.key]
        shape = weights.mcore_shape(name)
        lead, lead_size = location.index, (1,) * len(location.index)
        # fc1 is stored as its gate and up halves, like megatron's own saves
        halves = 2 if name.endswith("mlp.linear_fc1.weight") else 1
        rows = shape[0] // halves
        for h in range(halves):
            offsets = (*lead, h * rows, *(0,) * (len(shape) - 1))
            sizes = (*lead_size, rows, *shape[1:])
            items.append(_tensor_item(entry, offsets, sizes))
            param_of[(entry.key, offsets)] = (name, slice(h * rows, (h + 1) * rows) if halves > 1 else None)
    objects = expected_objects(weights.arch, weights.mtp_layers)
    items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in objects]

    current: dict[str, torch.Tensor] = {}  # the parameter being written (fc1: shared by its halves)

    def resolve(item: WriteItem) -> torch.Tensor | io.BytesIO:
        if item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save([None], buffer)  # megatron stores a list of the rank's objects per key
            return buffer
        name, rows = param_of[(item.index.fqn, tuple(item.index.offset))]
        if name not in current:
            current.clear()
            tensor = produce(name)
            expected = weights.mcore_shape(name)
            if tuple(tensor.shape) != expected or tensor.dtype != dtype_of(name):
                raise ConversionError(
                    f"{name}: produced {tuple(tensor.shape)} {tensor.dtype}, expected {expected} {dtype_of(name)}"
                )
            current[name] = tensor
            if on_tensor:
                on_tensor(name)
        tensor = current[name] if rows is None else current[name][rows]
        return tensor.reshape(tuple(item.tensor_data.chunk.sizes))

    # one file per item: DCP's writer keeps every tensor of a file alive until the file is closed
    writer = FileSystemWriter(str(iter_dir), single_file_per_rank=False, sync_files=True, thread_count=1)
    with _single_process():
        dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(items, resolve), no_dist=True)
    current.clear()
    (iter_dir / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
    torch.save({}, iter_dir / "common.pt")


def write_tracker(root: str | Path, iteration: str = RELEASE_DIR) -> None:
    """Point megatron's `latest_checkpointed_iteration.txt` in `root` at `iteration`."""
    (Path(root) / TRACKER_FILE).write_text(f"{iteration}\n")


# ------------------------------------------------------------------------------------------ read
def resolve_iteration_dir(path: str | Path) -> Path:
    """The directory holding the checkpoint files: `path` itself, or the iteration that
    `path/latest_checkpointed_iteration.txt` names."""
    path = Path(path)
    if (path / "metadata.json").is_file():
        return path
    tracker = path / TRACKER_FILE
    if not tracker.is_file():
        raise ConversionError(f"{path}: not a megatron checkpoint (no metadata.json and no {TRACKER_FILE})")
    text = tracker.read_text().strip()
    name = RELEASE_DIR if text == RELEASE_DIR else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None:
        raise ConversionError(f"{tracker}: expected 'release' or an iteration number, got {text!r}")
    if not (path / name / "metadata.json").is_file():
        raise ConversionError(f"{tracker}: names {name}, but {path / name}/metadata.json does not exist")
    return path / name


class _RegionLoadPlanner(DefaultLoadPlanner):
    """Reads the region `offsets` + `dest.shape` of checkpoint tensor `key` into `dest`."""

    def __init__(self, key: str, offsets: tuple[int, ...], dest: torch.Tensor):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.key, self.offsets, self.dest = key, offsets, dest
        self.elements_read = 0

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.dest.shape)
        items = create_read_items_for_chunk_list(self.key, self.metadata.state_dict_metadata[self.key], [chunk])
        self.elements_read = sum(torch.Size(item.lengths).numel() for item in items)
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        view = self.dest
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # `tensor` is a view of `dest`: already in place


_DCP = "torch.distributed.checkpoint."
# Every global a PyTorch Distributed Checkpoint's `.metadata` pickle may name (torch 2.x), plus
# torch dtypes. Anything else is refused before the file is unpickled for real.
SAFE_METADATA_GLOBALS = frozenset({
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    (_DCP + "filesystem", "_StorageInfo"),
    *((_DCP + "metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *((_DCP + "planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
})


class _CheckingUnpickler(pickle.Unpickler):
    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not dtype and (module, name) not in SAFE_METADATA_GLOBALS:
            raise ConversionError(f"{self.source}: refers to {module}.{name}, which a checkpoint's metadata never "
                                  "holds; refusing to load it (a checkpoint is data, never code)")
        return super().find_class(module, name)


def check_metadata_is_data(ckpt_dir: str | Path) -> None:
    """Unpickle `<ckpt_dir>/.metadata` with only the classes of checkpoint metadata allowed:
    ConversionError naming the file and the global otherwise. Call it before handing the
    directory to torch.distributed.checkpoint, which unpickles the file without restriction."""
    path = Path(ckpt_dir) / ".metadata"
    with open(path, "rb") as f:
        _CheckingUnpickler(f, path).load()


class _CachedMetadataReader(FileSystemReader):
    def __init__(self, path: Path):
        super().__init__(str(path))
        self._metadata = super().read_metadata()

    def read_metadata(self):
        return self._metadata


class TorchDistReader:
    """Global tensors of a `torch_dist` checkpoint, read one parameter (one layer) at a time.

    Accepts every form of `checkpoint_locations`: stacked (`decoder.layers.X` [L, ...], experts
    [L, E, ...]) and per-layer / per-expert keys, fc1 saved as `_w` / `_v` halves (megatron's
    `singleton_local_shards`), and both spellings of an MoE layer's pre-MLP norm.
    Opening checks that every data file exists and is long enough.
    """

    def __init__(self, path: str | Path):
        self.dir = resolve_iteration_dir(path)
        try:
            backend = json.loads((self.dir / "metadata.json").read_text()).get("sharded_backend")
        except json.JSONDecodeError as e:
            raise ConversionError(f"{self.dir / 'metadata.json'}: not valid JSON ({e})") from None
        if backend != "torch_dist":
            raise ConversionError(f"{self.dir}: sharded_backend is {backend!r}; only 'torch_dist' is supported")
        try:
            check_metadata_is_data(self.dir)
            self._reader = _CachedMetadataReader(self.dir)
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as e:  # missing or corrupt
            raise ConversionError(f"{self.dir / '.metadata'}: unreadable ({e})") from None
        metadata = self._reader.read_metadata()
        self.tensors = {
            key: TensorEntry(key, tuple(md.size), md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        self.objects = [key for key in metadata.state_dict_metadata if key not in self.tensors]
        file_ends: dict[str, int] = {}
        for info in metadata.storage_data.values():
            file_ends[info.relative_path] = max(file_ends.get(info.relative_path, 0), info.offset + info.length)
        for file, end in sorted(file_ends.items()):
            path = self.dir / file
            if not path.is_file():
                raise ConversionError(f"{self.dir}: data file {file} is missing")
            if path.stat().st_size < end:
                raise ConversionError(
                    f"{path}: truncated ({path.stat().st_size} bytes, the checkpoint index needs {end})"
                )

    def _read_region(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        dest = torch.empty(shape, dtype=self.tensors[key].dtype)
        planner = _RegionLoadPlanner(key, offsets, dest)
        with _single_process():
            dcp.load({}, storage_reader=self._reader, planner=planner, no_dist=True)
        if planner.elements_read != dest.numel():
            raise ConversionError(f"{self.dir}: tensor {key!r} is not fully covered by the checkpoint's chunks")
        return dest

    def parts(self, name: str) -> list[tuple[Location, int]]:
        """Where this checkpoint holds global parameter `name` (`checkpoint_locations`, first form
        present): [(location, rows)], one whole tensor or fc1's `_w` / `_v` halves, which stack
        along dim 0. `rows` is the part's dim 0 size."""
        for location in checkpoint_locations(name):
            keys = [location.key]
            if location.key not in self.tensors and name.endswith("linear_fc1.weight"):
                keys = [location.key + "_w", location.key + "_v"]
            if not all(k in self.tensors for k in keys):
                continue
            found = []
            for key in keys:
                shape = self.tensors[key].global_shape
                depth = len(location.index)
                for axis, i in enumerate(location.index):
                    if i >= shape[axis]:
                        what = location.axes[axis]
                        raise ConversionError(f"{self.dir}: {key!r} has {shape[axis]} {what}, no {what[:-1]} {i}")
                found.append((Location(key, location.index, location.axes), shape[depth]))
            return found
        tried = [loc.key for loc in checkpoint_locations(name)]
        raise ConversionError(f"{self.dir}: no tensor for {name!r} (looked for {tried})")

    def read(self, name: str) -> torch.Tensor:
        """The full tensor of global megatron parameter `name` (TE spelling, SequentialMLP expert names)."""
        pieces = []
        for location, _ in self.parts(name):
            shape = self.tensors[location.key].global_shape
            depth = len(location.index)
            region = (*(1,) * depth, *shape[depth:])
            tensor = self._read_region(location.key, (*location.index, *(0,) * (len(shape) - depth)), region)
            pieces.append(tensor.reshape(shape[depth:]))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of global parameter `name`, from the metadata only."""
        parts = self.parts(name)
        location, _ = parts[0]
        tail = self.tensors[location.key].global_shape[len(location.index):]
        return (sum(rows for _, rows in parts), *tail[1:])

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[self.parts(name)[0][0].key].dtype
