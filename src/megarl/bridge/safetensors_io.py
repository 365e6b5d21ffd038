"""Streaming I/O of HF safetensors checkpoints: read one tensor at a time, write in bounded files.

Reading keeps only the file headers in memory; writing holds at most one output file's worth of
tensors (`max_shard_bytes`, or one tensor when that is larger).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megarl.bridge.errors import ConversionError
from megarl.bridge.fused_experts import fused_source, is_fused, per_expert_names, per_expert_shape, read_cut

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,  # block FP8 weights (megarl.rollout.fp8)
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class HFCheckpointReader:
    """The tensors of an HF checkpoint directory (`model.safetensors`, or shards listed in
    `model.safetensors.index.json`). Opening checks that every shard exists, has a complete
    header and holds the tensors the index says it holds; tensors are read on demand. gpt-oss's
    fused expert tensors are presented per expert (`megarl.bridge.fused_experts`)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index_path = self.dir / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConversionError(f"{index_path}: not a safetensors index ({e!r})") from None
        elif (self.dir / SINGLE_FILE).is_file():
            weight_map = None
        else:
            raise ConversionError(
                f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)"
            )
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        self._handles = {}
        self._file_of: dict[str, str] = {}
        for file in files:
            path = self.dir / file
            if not path.is_file():
                raise ConversionError(f"{index_path}: shard {file} is missing from {self.dir}")
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise ConversionError(f"{path}: unreadable or truncated safetensors file ({e})") from None
            self._handles[file] = handle
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                self._file_of[name] = file
        if weight_map:
            for name, file in weight_map.items():
                if self._file_of.get(name) != file:
                    raise ConversionError(f"{index_path}: lists {name!r} in {file}, which does not contain it")
        self._per_expert: dict[str, str] = {}  # per-expert name -> its fused tensor
        for name in [n for n in self._file_of if is_fused(n)]:
            for part in per_expert_names(name, self._raw_slice(name).get_shape()[0]):
                self._per_expert[part] = name

    def names(self) -> list[str]:
        return [n for n in self._file_of if not is_fused(n)] + list(self._per_expert)

    def _raw_slice(self, name: str):
        if name not in self._file_of:
            raise ConversionError(f"{self.dir}: the checkpoint has no tensor {name!r}")
        return self._handles[self._file_of[name]].get_slice(name)

    def _slice(self, name: str):
        return self._raw_slice(self._per_expert.get(name, name))

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._per_expert:
            _, _, proj, kind = fused_source(name)
            return per_expert_shape(tuple(self._slice(name).get_shape()), proj, kind)
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._slice(name).get_dtype()
        if code not in SAFETENSORS_DTYPES:
            raise ConversionError(f"{self.dir}: tensor {name!r} has unsupported dtype {code}")
        return SAFETENSORS_DTYPES[code]

    def read(self, name: str) -> torch.Tensor:
        if name in self._per_expert:
            return read_cut(self._raw_slice, name)
        if name not in self._file_of:
            raise ConversionError(f"{self.dir}: the checkpoint has no tensor {name!r}")
        return self._handles[self._file_of[name]].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "HFCheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def process_umask() -> int:
    """This process's umask (read from /proc on Linux, without changing it; elsewhere set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_umask_allows(path: str | Path) -> None:
    """Give `path` the mode a plain `open`/`mkdir` would have (0o666 / 0o777 less the umask):
    safetensors writes files 0600 and `tempfile.mkdtemp` makes directories 0700, which a shared
    cluster's teammates and services could not read."""
    full = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, full & ~process_umask())


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """`safetensors.torch.save_file` with metadata {"format": "pt"} (what transformers expects),
    the file readable as the umask allows."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    as_umask_allows(path)


def write_safetensors(named: list[tuple[str, torch.Tensor]], path: str | Path) -> None:
    """A safetensors file of `named` (views into one buffer allowed, unlike `save_safetensors`),
    in that order, metadata {"format": "pt"}: each tensor's bytes are written from its own memory
    (no copy of a contiguous CPU tensor; one tensor at a time of a GPU one)."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in named:
        end = offset + tensor.numel() * tensor.element_size()
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, tensor in named:
            f.write(memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    as_umask_allows(path)


class ShardedSafetensorsWriter:
    """Writes tensors into `model-0000k-of-0000n.safetensors` files of at most `max_shard_bytes`
    each (a larger tensor gets a file of its own), then `model.safetensors.index.json`."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._bucket: dict[str, torch.Tensor] = {}
        self._bucket_bytes = 0
        self._files: list[list[str]] = []  # tensor names per written file, in order
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._bucket or any(name in f for f in self._files):
            raise ConversionError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._bucket and self._bucket_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        if tensor.untyped_storage().nbytes() != nbytes or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)  # own storage: no shared views
        self._bucket[name] = tensor
        self._bucket_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        save_safetensors(self._bucket, self.dir / f".part-{len(self._files)}.safetensors")
        self._files.append(list(self._bucket))
        self._bucket, self._bucket_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Write the last file and the index; return the weight map (tensor name -> file)."""
        if self._bucket or not self._files:
            self._flush()
        n = len(self._files)
        weight_map = {}
        for k, names in enumerate(self._files):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f".part-{k}.safetensors", self.dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map


def read_safetensors_headers(hf_dir: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{tensor name: (shape, dtype)} of an HF checkpoint, from the file headers only."""
    with HFCheckpointReader(hf_dir) as reader:
        return {name: (reader.shape(name), reader.dtype(name)) for name in reader.names()}

