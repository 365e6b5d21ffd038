"""Peak resident memory of a piece of code, from the kernel's own accounting (Linux).

`resident_peak` resets this process's high-water mark (`/proc/self/clear_refs`, value 5: proc(5))
and reads `VmHWM` from `/proc/self/status` afterwards. glibc's mmap threshold is lowered first
(`mallopt(M_MMAP_THRESHOLD)`, which also turns off its dynamic raising), so every allocation of
that size or more is mapped fresh and unmapped when freed: the high-water mark then counts the
memory really live at the peak; `malloc_trim` first returns the free blocks the allocator had
kept from earlier (reusing them would raise no resident count). Allocations of
every thread count (a collective's own buffers too). This module imports nothing of megarl.
"""
from __future__ import annotations

import ctypes
import gc
from contextlib import contextmanager
from typing import Iterator

M_MMAP_THRESHOLD = -3  # glibc malloc.h


def status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


@contextmanager
def resident_peak(mmap_threshold: int = 64 * 1024) -> Iterator[dict]:
    """Yields a dict that, on exit, holds `base` (resident bytes on entry), `peak` (the high-water
    mark inside) and `extra` (peak - base)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
    gc.collect()
    libc.malloc_trim(0)  # free blocks the allocator kept resident leave: they would be reused unseen
    out: dict = {}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now
    out["base"] = status_bytes("VmRSS")
    yield out
    out["peak"] = status_bytes("VmHWM")
    out["extra"] = out["peak"] - out["base"]
