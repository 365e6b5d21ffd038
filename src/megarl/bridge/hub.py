"""HF checkpoints named by a hub id ("Qwen/Qwen2.5-7B-Instruct"), fetched into the HF cache.

`huggingface_hub` decides where the cache is (HF_HOME, HF_HUB_CACHE) and whether to go online
(HF_HUB_OFFLINE=1: the cache only). A local directory is used as it is. For planning alone, an
experiment may ship its model's architecture beside it (`shipped_architecture`).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Sequence

from megarl.bridge.errors import ConversionError

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*")


def is_hub_id(path: str) -> bool:
    """'org/name' that is not a local path."""
    return bool(_HUB_ID.fullmatch(path)) and not Path(path).exists()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def local_model_dir(path: str, key: str, allow_patterns: Optional[Sequence[str]] = None) -> Path:
    """The local directory of the checkpoint `path` (a directory, or a hub id fetched into the HF cache,
    only the files matching `allow_patterns` when given). ConversionError names `key` and what to do."""
    if not is_hub_id(path):
        if not (Path(path) / "config.json").is_file():
            raise ConversionError(f"{key}={path!r}: not a local HF checkpoint directory (no config.json there) "
                                  "and not a hub id (org/name)")
        return Path(path)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        out = Path(snapshot_download(path, allow_patterns=list(allow_patterns) if allow_patterns else None,
                                     local_files_only=_offline()))
    except LocalEntryNotFoundError:
        how = ("HF_HUB_OFFLINE=1 and it is not in the HF cache" if _offline() else
               "the Hugging Face hub cannot be reached from here and it is not in the HF cache")
        raise ConversionError(f"{key}={path!r}: {how}; fetch it where there is a network "
                              f"(huggingface-cli download {path}) into the same HF_HOME, or pass a local directory") from None
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise ConversionError(f"{key}={path!r}: cannot fetch it from the Hugging Face hub: {error}") from None
    if not (out / "config.json").is_file():
        raise ConversionError(f"{key}={path!r}: the hub snapshot {out} has no config.json (not a transformers model)")
    return out


def shipped_architecture(hub_id: str, experiment_file: Optional[str]) -> Optional[Path]:
    """`models/<name>/` beside `experiment_file` when it holds a config.json for the hub id
    `org/name` (`name` lower-cased), else None: configs/recipes/ ships there the architecture of
    each model its recipes name, without weights (`Qwen/Qwen3-30B-A3B` -> `models/qwen3-30b-a3b/`),
    so that `megarl plan` estimates memory without the hub."""
    if experiment_file is None or not _HUB_ID.fullmatch(hub_id):
        return None
    shipped = Path(experiment_file).parent / "models" / hub_id.split("/")[1].lower()
    return shipped if (shipped / "config.json").is_file() else None
