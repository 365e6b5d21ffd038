"""An output directory that appears whole or not at all: written in a hidden temporary directory
next to it, renamed into place when the writing succeeds. The converters (`convert`) and the PEFT
adapter writer (`lora.write_peft_adapter`) write through it."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from megarl.bridge.errors import ConversionError
from megarl.bridge.safetensors_io import as_umask_allows


@contextlib.contextmanager
def atomic_output_dir(out: str | Path) -> Iterator[Path]:
    """Yield a hidden temporary directory next to `out`; rename it to `out` when the block
    succeeds, delete it when it fails. `out` must not exist or be an empty directory."""
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"{out}: already exists and is not an empty directory; remove it or choose another output")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    as_umask_allows(tmp)  # mkdtemp makes it 0700; the renamed output is shared like any directory
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
