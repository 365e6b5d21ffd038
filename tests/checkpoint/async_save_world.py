"""One gloo rank saving checkpoints in the background (async_save) as an engine does: megatron-core's
asynchronous dist-checkpoint save (megarl.engines.megatron.checkpoint_io.AsyncSaves) under
megarl.checkpoint.Checkpoints. Each background writer waits, before writing, until the file `gate`
exists (the test opens and closes it), so a write is held unfinished for as long as the test wants.

    python async_save_world.py ROOT GATE PORT

Prints `<stage>\t<value>` per stage, then `pending 4\tTrue` (its writer alive) and waits to be
SIGKILLed (at most 120 s) with the write of step 4 unfinished: what a crash after a save returned leaves.
"""
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megarl import checkpoint
from megarl.config import load_config

gate_file = Path()  # set by main


def gated(write):
    """megatron's writer `write` (run in the forked process), once `gate_file` exists (at most 120 s)."""
    def gated_write(*args, **kwargs):
        for _ in range(1200):
            if gate_file.exists():
                break
            time.sleep(0.1)
        return write(*args, **kwargs)
    return gated_write


class Actor:
    """What Checkpoints calls on the actor's role: here one tensor `w`, saved by megatron."""

    def __init__(self):
        from megarl.engines.megatron.checkpoint_io import AsyncSaves

        self.w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        self.saves = AsyncSaves()

    @staticmethod
    def sharded(tensor: torch.Tensor) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        return {"w": ShardedTensor.from_rank_offsets("w", tensor, replica_id=0)}

    def save_checkpoint(self, path: str, optimizer: bool, background: bool) -> None:
        assert background
        Path(path).mkdir(parents=True)
        self.saves.save(self.sharded(self.w), Path(path))

    def finish_saves(self, blocking: bool, timeout_s: float) -> bool:
        return self.saves.finish(blocking, timeout_s)


def say(what: str, value) -> None:
    print(f"{what}\t{value}", flush=True)


def saved_w(directory: Path) -> torch.Tensor:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(Actor.sharded(torch.empty(3, 4)), str(directory / "actor"))["w"]


def main(root: Path, gate: Path, port: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    global gate_file
    gate_file = gate
    from megarl.engines.megatron.cpu.shims import apply_cpu_shims

    apply_cpu_shims()  # megatron's async save calls torch.cuda.synchronize / current_device
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(
        gated(FileSystemWriterAsync.write_preloaded_data_multiproc))
    config = load_config(None, ["actor_rollout_ref.actor.checkpoint.async_save=true",
                                "trainer.max_actor_ckpt_to_keep=2"])
    actor = Actor()
    checkpoints = checkpoint.Checkpoints(config, actor)
    before = actor.w.clone()
    state = {"step": 1, "sampler": {"position": 4}}

    def complete() -> list[int]:
        return [step for step, _ in checkpoint.complete_checkpoints(root)]

    say("save 1 returned", checkpoints.save(root, 1, state))
    state["sampler"]["position"] = 8  # the controller goes on: the checkpoint keeps the state of its step
    actor.w += 100  # training goes on while the write is held: the checkpoint keeps the staged values
    say("poll while held", checkpoints.poll())
    say("complete while held", complete())
    say("latest while held", (root / checkpoint.LATEST).exists())
    gate.touch()
    committed = None
    for _ in range(600):  # a bound that rules out a hang; the write of 48 bytes takes well under a second
        committed = checkpoints.poll()
        if committed is not None:
            break
        time.sleep(0.1)
    say("poll after the write", committed.name)
    say("saved w is the staged w", torch.equal(saved_w(committed), before))
    say("saved controller state", checkpoint.load_controller_state(committed))

    say("save 2 returned", checkpoints.save(root, 2, {"step": 2}))
    say("save 3 returned", checkpoints.save(root, 3, {"step": 3}))
    say("complete after save 3", complete())
    say("finish", checkpoints.finish().name)
    say("complete after finish", complete())

    gate.unlink()
    say("save 4 returned", checkpoints.save(root, 4, {"step": 4}))
    (call,) = actor.saves.queue.async_calls
    say("pending 4", call.async_caller.process.is_alive())
    time.sleep(120)  # killed here by the test


if __name__ == "__main__":  # megatron's results queue lives in a spawned process, which imports this file
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
