"""Counts the tensor transport's bucket copies in one process: wraps the functions that allocate
them (`ipc_copies.fresh_copy`, a copy of a reused bucket buffer, and `ipc_copies.shareable_empty`: a
relayed copy, or a bucket the resharder writes for the tensor transport)
where they are looked up, and records, at each allocation, the bytes of the copies still alive
(weak references) plus the new one. The peak is the most bucket-copy memory the process held at
once: no server is involved, so the figure is exact and free of the process's other noise."""
from __future__ import annotations

import weakref

from megarl.sync import ipc_copies, transports


class CopyTracker:
    def __init__(self):
        self.alive: list[weakref.ref] = []
        self.made: list[weakref.ref] = []  # every copy since `reset`
        self.files: set[str] = set()  # their shared-memory files (CPU copies)
        self.peak_bytes = 0
        self.largest = 0  # bytes of the largest copy
        self.copies = 0
        self.copied = 0  # of which `fresh_copy`s: a bucket copied out of a reused buffer

    def _record(self, copy, copied: bool = False):
        self.alive = [r for r in self.alive if r() is not None]
        self.alive.append(weakref.ref(copy))
        self.made.append(self.alive[-1])
        if not copy.is_cuda:  # torch's file_system sharing: the file is named after its creator's pid
            _, name, _ = copy.untyped_storage()._share_filename_cpu_()
            self.files.add("/dev/shm" + (name.decode() if isinstance(name, bytes) else name))
        self.copies += 1
        self.copied += copied
        self.largest = max(self.largest, copy.numel() * copy.element_size())
        self.peak_bytes = max(self.peak_bytes, sum(r().numel() * r().element_size() for r in self.alive))
        return copy

    def install(self) -> "CopyTracker":
        """Wrap the allocators (in this process, for good: the worlds are throwaway processes)."""
        fresh, empty = ipc_copies.fresh_copy, ipc_copies.shareable_empty
        transports.fresh_copy = lambda flat: self._record(fresh(flat), copied=True)
        ipc_copies.shareable_empty = lambda nbytes, on_gpu: self._record(empty(nbytes, on_gpu))
        return self

    def reset(self) -> None:
        """Start a new count (copies still alive still count towards the peak)."""
        self.alive = [r for r in self.alive if r() is not None]
        self.made, self.files, self.peak_bytes, self.largest, self.copies, self.copied = [], set(), 0, 0, 0, 0
