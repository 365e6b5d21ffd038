"""Offline checkpoint conversion, HF safetensors <-> megatron-core `torch_dist`, one tensor at a time.

Both directions check the input against the config before writing anything, write into a hidden
temporary directory next to the output, verify what they wrote (tensor names, shapes and dtypes
against the expected map), and only then rename it to the output path. Peak memory is about the
largest parameter (HF -> megatron) or one output file plus the largest parameter (megatron -> HF).

Multi-token-prediction (MTP) layers (DeepSeek-V3, GLM-4.5: `num_nextn_predict_layers`, HF's
`model.layers.{num_hidden_layers + k}.*`, megatron-core's `mtp.layers.{k}.*`) are carried both ways when the
input holds them. An HF checkpoint holding none converts without them, as transformers saves such a model
(its DeepseekV3 / Glm4Moe classes have no MTP modules and skip those tensors on load, keeping
`num_nextn_predict_layers` in config.json); one holding some but not all is refused. Their copies of the
embedding and LM head (`WeightMap.mtp_copies`) must equal the main model's on import (megatron's MTP layers
share those; comparing two of them doubles the peak) and are written back from them on export.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from megarl.bridge.arch import ModelArch, arch_from_hf_config, load_hf_config
from megarl.bridge.errors import ConversionError
from megarl.bridge.fused_experts import ExpertFuser, fuses_experts
from megarl.bridge.lora import is_lora_param, merge_into_hf, read_adapters
from megarl.bridge.mapping import EMBEDDING, WeightMap, is_extra_state
from megarl.bridge.output_dir import atomic_output_dir
from megarl.bridge.safetensors_io import (
    HFCheckpointReader,
    ShardedSafetensorsWriter,
    read_safetensors_headers,
)
from megarl.bridge.sharding import ParallelLayout, check_layout
from megarl.bridge.torch_dist_io import (
    RELEASE_DIR,
    TorchDistReader,
    expected_objects,
    expected_tensors,
    write_torch_dist,
    write_tracker,
)
from megarl.bridge.transforms import padded_vocab_size

HF_ASSETS_DIR = "hf"  # inside a megatron iteration directory: the HF config and tokenizer files
BRIDGE_METADATA = "megarl_bridge.json"  # inside a megatron iteration directory
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".distcp")
_WEIGHT_FILES = {"model.safetensors.index.json", "pytorch_model.bin.index.json", ".metadata", "common.pt", "metadata.json"}



@dataclass(frozen=True)
class Progress:
    """Reported after each megatron parameter is converted."""

    name: str  # the parameter just converted (global megatron name)
    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int


OnProgress = Callable[[Progress], None]


@contextlib.contextmanager
def progress_bar(desc: str) -> Iterator[OnProgress]:
    """A tqdm bar on stderr (bytes, with tensors done / total) fed by Progress reports; created at
    the first report, so an early error prints no empty bar."""
    from tqdm import tqdm

    bars = []

    def show(p: Progress) -> None:
        if not bars:
            bars.append(tqdm(total=p.bytes_total, unit="B", unit_scale=True, file=sys.stderr, desc=desc))
        bars[0].update(p.bytes_done - bars[0].n)
        bars[0].set_postfix_str(f"{p.tensors_done}/{p.tensors_total} tensors")

    try:
        yield show
    finally:
        for bar in bars:
            bar.close()


class _ProgressCounter:
    def __init__(self, sizes: dict[str, int], report: Optional[OnProgress]):
        self.sizes, self.report = sizes, report
        self.tensors_done = self.bytes_done = 0

    def __call__(self, name: str) -> None:
        self.tensors_done += 1
        self.bytes_done += self.sizes[name]
        if self.report:
            self.report(Progress(name, self.tensors_done, len(self.sizes), self.bytes_done, sum(self.sizes.values())))


@dataclass(frozen=True)
class ConversionSummary:
    tensors: int  # megatron parameters converted
    bytes: int  # their size
    out: Path


def copy_hf_assets(src: Path, dst: Path, dtype: Optional[torch.dtype] = None, architecture: Optional[str] = None) -> None:
    """Copy config, tokenizer and generation files of an HF directory (no weights) into `dst`.
    With `dtype` / `architecture`, config.json states them."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in _WEIGHT_FILES and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(path, dst / path.name)  # a new file: its mode from the umask, not the source
    if dtype is not None or architecture is not None:
        config = json.loads((dst / "config.json").read_text())
        if dtype is not None:
            keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
            for key in keys:
                config[key] = str(dtype).removeprefix("torch.")
        if architecture is not None:
            config["architectures"] = [architecture]
        (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _arch_of(config_dir: Path) -> ModelArch:
    return arch_from_hf_config(load_hf_config(config_dir), source=str(config_dir / "config.json"))


# ------------------------------------------------------------------------------------------ HF -> megatron
def convert_hf_to_torch_dist(
    hf_dir: str | Path,
    out: str | Path,
    layout: ParallelLayout = ParallelLayout(),
    make_vocab_size_divisible_by: int = 128,
    on_progress: Optional[OnProgress] = None,
) -> ConversionSummary:
    """Write the HF checkpoint `hf_dir` as a megatron `torch_dist` checkpoint at `out`
    (`out/latest_checkpointed_iteration.txt` -> `out/release/`) for a `GPTModel` at `layout`,
    whose TP size fixes the padded vocabulary (EP only has to divide the experts). megatron
    reshards at load time, so other layouts (EP included) load it too; their embedding and output layer get the checkpoint's rows, zero-padded or
    trimmed to their own padded vocabulary (`allow_shape_mismatch`). The HF config and tokenizer
    are kept in `out/release/hf/`."""
    hf_dir = Path(hf_dir)
    arch = _arch_of(hf_dir)
    check_layout(arch, layout)
    vp = padded_vocab_size(arch.vocab_size, make_vocab_size_divisible_by, layout.tp)
    with HFCheckpointReader(hf_dir) as reader:
        names = set(reader.names())
        weights = WeightMap(arch, vp, mtp=_hf_holds_mtp(WeightMap(arch, vp), names, hf_dir))
        weights.check_hf_names(names, source=str(hf_dir))
        check_mtp_copies(reader, weights, hf_dir)
        dtypes = {}
        for name in weights.mcore_names():
            hf_names = weights.hf_names_of(name)
            for hf_name in hf_names:
                if reader.shape(hf_name) != weights.hf_shape(hf_name):
                    raise ConversionError(
                        f"{hf_dir}: tensor {hf_name!r} has shape {list(reader.shape(hf_name))}, but config.json "
                        f"implies {list(weights.hf_shape(hf_name))}"
                    )
            kinds = {reader.dtype(h) for h in hf_names}
            if len(kinds) > 1:
                raise ConversionError(f"{hf_dir}: tensors {hf_names} have different dtypes {sorted(map(str, kinds))}")
            dtypes[name] = kinds.pop()
        sizes = {n: torch.Size(weights.mcore_shape(n)).numel() * dtypes[n].itemsize for n in weights.mcore_names()}
        counter = _ProgressCounter(sizes, on_progress)
        with atomic_output_dir(out) as tmp:
            iter_dir = tmp / RELEASE_DIR
            write_torch_dist(iter_dir, weights, dtypes.__getitem__, lambda n: weights.to_mcore(n, reader.read), counter)
            copy_hf_assets(hf_dir, iter_dir / HF_ASSETS_DIR)
            metadata = {
                "source": str(hf_dir.absolute()),
                "vocab_size": arch.vocab_size,
                "padded_vocab_size": vp,
                "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
                "layout": {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "ep": layout.ep, "etp": layout.expert_tp},
            }
            (iter_dir / BRIDGE_METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
            write_tracker(tmp)
            verify_torch_dist(tmp, weights, dtypes.__getitem__)
    return ConversionSummary(len(sizes), sum(sizes.values()), Path(out))


def _hf_holds_mtp(plain: WeightMap, names: set[str], hf_dir: Path) -> bool:
    """Whether the HF checkpoint with tensors `names` holds its config's MTP layers (`plain`: its map without
    them): all of their tensors (their embedding / head copies aside), or none; some is an error."""
    if not any(plain.is_mtp_tensor(n) for n in names):
        return False
    weights = WeightMap(plain.arch, plain.padded_vocab_size, mtp=True)
    missing = [n for n in weights.hf_names() if weights.is_mtp_tensor(n) and n not in names]
    if missing:
        raise ConversionError(
            f"{hf_dir / 'config.json'} announces {plain.arch.mtp_layers} multi-token-prediction layer(s) "
            f"(num_nextn_predict_layers) and {hf_dir} holds some of their tensors, but not {len(missing)} of them, "
            f"e.g. {missing[:3]}")
    return True


def check_mtp_copies(reader: HFCheckpointReader, weights: WeightMap, hf_dir: Path) -> None:
    """Each MTP layer's copy of the embedding and LM head in the checkpoint (`WeightMap.mtp_copies`; a copy may
    be absent) has the bytes of the main model's tensor: megatron's MTP layers use the main model's, so a copy
    that differs could not come back."""
    names = set(reader.names())
    for copy, main in weights.mtp_copies().items():
        if copy not in names:
            continue
        a, b = reader.read(copy), reader.read(main)
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_bytes(a), _bytes(b)):
            raise ConversionError(
                f"{hf_dir}: tensor {copy!r} differs from {main!r}; megatron-core's multi-token-prediction layer "
                "uses the main model's embedding and output layer, so it cannot hold a copy of its own")


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def verify_torch_dist(ckpt: Path, weights: WeightMap, dtype_of: Callable[[str], torch.dtype]) -> None:
    """The checkpoint at `ckpt` holds exactly the tensors (keys, global shapes, dtypes) and
    `_extra_state` objects a `GPTModel` of `weights` saves."""
    reader = TorchDistReader(ckpt)
    expected = expected_tensors(weights, dtype_of)
    if set(reader.tensors) != set(expected):
        raise ConversionError(f"{ckpt}: tensor keys differ from the expected map: {sorted(set(reader.tensors) ^ set(expected))}")
    for key, entry in expected.items():
        if reader.tensors[key] != entry:
            raise ConversionError(f"{ckpt}: {key} is {reader.tensors[key]}, expected {entry}")
    if set(reader.objects) != set(expected_objects(weights.arch, weights.mtp_layers)):
        raise ConversionError(f"{ckpt}: _extra_state objects differ from the expected map")


# ------------------------------------------------------------------------------------------ megatron -> HF
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")


def _axes(sizes: tuple[int, ...], names: tuple[str, ...]) -> str:
    return " x ".join(f"{n} {axis}" for n, axis in zip(sizes, names))


def check_torch_dist_against_config(reader: TorchDistReader, weights: WeightMap, config_path: Path) -> None:
    """Every parameter of the config is in the checkpoint with the shape the config implies, and
    the checkpoint has no model tensor the config does not explain."""
    a = weights.arch
    hint = (
        f"({config_path}: num_hidden_layers={a.num_layers}, hidden_size={a.hidden_size}, "
        f"num_attention_heads={a.num_attention_heads}, num_key_value_heads={a.num_query_groups}, "
        f"head_dim={a.kv_channels}, intermediate_size={a.ffn_hidden_size}, vocab_size={a.vocab_size}, "
        f"tie_word_embeddings={a.tie_word_embeddings})"
    )
    if a.moe is not None:
        hint = hint[:-1] + f", experts={a.moe.num_experts}, expert width={a.moe.expert_ffn_hidden_size})"
    used = set()
    for name in weights.mcore_names():
        parts = reader.parts(name)
        shape = reader.shape(name)
        if shape != weights.mcore_shape(name):
            raise ConversionError(
                f"{reader.dir}: {name} has shape {list(shape)}, but the config implies "
                f"{list(weights.mcore_shape(name))} {hint}"
            )
        for location, _ in parts:
            used.add(location.key)
            stacked = reader.tensors[location.key].global_shape[: len(location.index)]
            sizes = {"layers": a.num_layers, "experts": a.moe.num_experts if a.moe else 0}
            axes = tuple(sizes[axis] for axis in location.axes)
            if stacked != axes:
                raise ConversionError(f"{reader.dir}: {location.key} stacks {_axes(stacked, location.axes)}, but the "
                                      f"config has {_axes(axes, location.axes)} {hint}")
    extra = [k for k in reader.tensors if k.startswith(_MODEL_PREFIXES) and k not in used and not is_extra_state(k)
             and not is_lora_param(k)]  # LoRA adapters: convert_torch_dist_to_hf merges or refuses them
    if extra:
        raise ConversionError(f"{reader.dir}: model tensors the config does not explain: {sorted(extra)[:5]} {hint}")


def convert_torch_dist_to_hf(
    ckpt: str | Path,
    out: str | Path,
    hf_config_dir: Optional[str | Path] = None,
    max_shard_bytes: int = 5 * 2**30,
    on_progress: Optional[OnProgress] = None,
    lora_scale: Optional[float] = None,
) -> ConversionSummary:
    """Write the megatron `torch_dist` checkpoint `ckpt` (a checkpoint root or an iteration
    directory) as an HF checkpoint at `out`: sharded safetensors with an index, config.json and
    the tokenizer files. The config and tokenizer come from `hf_config_dir`, else from the
    `hf/` directory the HF -> megatron conversion stored in the checkpoint. A checkpoint with LoRA
    adapters is written merged (W + lora_scale x B A, scale = alpha / rank of its run), and
    refused without `lora_scale`."""
    reader = TorchDistReader(ckpt)
    assets = Path(hf_config_dir) if hf_config_dir is not None else reader.dir / HF_ASSETS_DIR
    if not (assets / "config.json").is_file():
        raise ConversionError(
            f"{assets}: no config.json; pass --hf-config with the HF directory of this model's config and tokenizer"
        )
    arch = _arch_of(assets)
    mtp = any(key.startswith("mtp.") for key in reader.tensors)
    if mtp and not arch.mtp_layers:
        raise ConversionError(f"{reader.dir}: holds multi-token-prediction layers (mtp.layers.*), but "
                              f"{assets / 'config.json'} has no num_nextn_predict_layers")
    weights = WeightMap(arch, padded_vocab_size=reader.shape(EMBEDDING)[0], mtp=mtp)
    copies = {}  # HF tensor -> the MTP layers' copies of it
    for copy, main in weights.mtp_copies().items():
        copies.setdefault(main, []).append(copy)
    adapters = read_adapters(reader)  # first: refuses adapters it cannot merge by name
    check_torch_dist_against_config(reader, weights, assets / "config.json")
    dtypes = {reader.dtype(n) for n in weights.mcore_names()}
    if len(dtypes) > 1:
        raise ConversionError(f"{reader.dir}: parameters have mixed dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    if adapters and lora_scale is None:
        raise ConversionError(f"{reader.dir}: holds LoRA adapters; give their scale (alpha / rank) to merge them")
    sizes = {n: torch.Size(weights.mcore_shape(n)).numel() * dtype.itemsize for n in weights.mcore_names()}
    counter = _ProgressCounter(sizes, on_progress)
    with atomic_output_dir(out) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        # gpt-oss: per-expert tensors are written fused, a layer's tensor once all its experts are in
        fuser = ExpertFuser(arch.moe.num_experts) if fuses_experts(arch) else None
        for name in weights.mcore_names():
            hf = dict(weights.to_hf(name, reader.read(name)))
            if adapters:
                merge_into_hf(hf, adapters, lora_scale)
            for hf_name, tensor in hf.items():
                for written, fused in (fuser.add(hf_name, tensor) if fuser else [(hf_name, tensor)]):
                    writer.add(written, fused)
                for copy in copies.get(hf_name, ()):
                    writer.add(copy, tensor.clone())  # a file's tensors may not share storage
            counter(name)
        if fuser:
            fuser.close()
        writer.close()
        copy_hf_assets(assets, tmp, dtype=dtype, architecture=arch.hf_architecture)
        verify_hf(tmp, weights, dtype)
    return ConversionSummary(len(sizes), sum(sizes.values()), Path(out))


def verify_hf(hf_dir: Path, weights: WeightMap, dtype: torch.dtype) -> None:
    """The HF checkpoint at `hf_dir` holds exactly the tensors of `weights` and its MTP layers' copies of
    the embedding and head (`WeightMap.mtp_copies`), with their shapes and `dtype`."""
    headers = read_safetensors_headers(hf_dir)
    copies = weights.mtp_copies()
    expected = {**{name: name for name in weights.hf_names()}, **copies}  # name -> the tensor whose shape it has
    if set(headers) != set(expected):
        raise ConversionError(f"{hf_dir}: tensor names differ from the expected map: {sorted(set(headers) ^ set(expected))}")
    for name, like in expected.items():
        shape, got = headers[name]
        if shape != weights.hf_shape(like) or got != dtype:
            raise ConversionError(f"{hf_dir}: {name} is {list(shape)} {got}, expected {list(weights.hf_shape(like))} {dtype}")
