"""`SendLock`: the pipeline stages' emitters send their buckets to the rollout servers one at a time.

Why. A SGLang server runs one weight update at a time: `/update_weights_from_distributed` and
`/update_weights_from_tensor` each hold the tokenizer manager's `model_update_lock.writer_lock`
while the scheduler loads (SGLang 0.5.23 `managers/tokenizer_control_mixin.py`), and the others
queue. With the distributed transport every stage's weight-update group holds every server, so two
stages sending at once can deadlock: server 1 serves stage A's update and waits in A's broadcast,
which needs server 2, which serves stage B's and waits in B's broadcast, which needs server 1.
Each stage sends to every server, so one lock for the whole server set is the per-server lock
taken in one order. (slime serializes its stages' updates with one Ray lock for the same reason.)

How. The emitters are processes on different nodes, so the lock lives in a `torch.distributed`
TCPStore that the coordinator hosts (port chosen by the OS) and the others join; `compare_set`
makes taking it atomic: key empty -> this emitter's name. Gathering and converting the next bucket
still overlap with the other stages' sends; only the send itself is serialized.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

KEY = "megarl-weight-sync-send"


class SendLockTimeout(RuntimeError):
    pass


class SendLock:
    def __init__(self, store: dist.Store, owner: str, timeout_s: float, poll_s: float = 0.002):
        self.store, self.owner, self.timeout_s, self.poll_s = store, owner, timeout_s, poll_s

    @classmethod
    def host(cls, address: str, owner: str, timeout_s: float) -> tuple["SendLock", int]:
        """The coordinator's lock and the port its store listens on."""
        store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        store.set(KEY, "")
        return cls(store, owner, timeout_s), store.port

    @classmethod
    def join(cls, address: str, port: int, owner: str, timeout_s: float) -> "SendLock":
        store = dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, owner, timeout_s)

    def holder(self) -> str:
        return self.store.get(KEY).decode()

    def acquire(self) -> None:
        """Wait until this emitter holds the lock; raises `SendLockTimeout` after `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            holder = self.store.compare_set(KEY, "", self.owner).decode()
            if holder == self.owner:
                return
            if time.monotonic() > deadline:
                raise SendLockTimeout(
                    f"weight sync: {self.owner} waited {self.timeout_s:g} s for {holder} to finish sending to the "
                    "rollout servers"
                )
            time.sleep(self.poll_s)

    def release(self) -> None:
        holder = self.store.compare_set(KEY, self.owner, "").decode()
        if holder != "":
            raise RuntimeError(f"weight sync: {self.owner} released a send lock held by {holder!r}")

    def __enter__(self) -> "SendLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> Optional[bool]:
        self.release()
        return None
