"""A training rank that fails ends the call on every rank within seconds (issue 42), on the real
trainer: megatron engines over gloo behind Ray, the actor's `torch_dist` checkpoint collectives.

Rank 1 raises before the checkpoint's first collective while rank 0 has entered it, the way the
LoRA TP2 run hung at its first checkpoint (rank 0 raised in megatron's sharding check, rank 1 went
on into the save): the call ends within the failure grace, not at the group's timeout, rank 1's
error first; rank 0, stuck, is stopped with its group; the last complete checkpoint still exports."""
import time

import psutil
import pytest
from transformers import AutoModelForCausalLM

from megarl.checkpoint import complete_checkpoints
from megarl.cli import main as megarl_main
from megarl.placement import worker_group
from megarl.placement.worker_group import WorkerGroupError
from megarl.workers.train_worker import TrainWorker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def grpo(ray_two_gpus, tiny_assets, tiny_grpo_cluster, tmp_path_factory):
    """The tiny GRPO cluster (TP=2 actor); the world's collectives would wait 300 s for a rank."""
    with tiny_grpo_cluster(tiny_assets, tmp_path_factory.mktemp("out"),
                           "actor_rollout_ref.nccl_timeout=300") as cluster_and_trainer:
        yield cluster_and_trainer


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_rank_raising_before_the_checkpoint_collectives_ends_the_call_on_every_rank(grpo, tmp_path, monkeypatch):
    cluster, trainer = grpo
    trainer.train_step()
    trainer.step = 1
    saved = trainer.save_checkpoint()
    pids = [info["pid"] for info in cluster.actor.workers.call(TrainWorker.node_info, timeout_s=60)]
    monkeypatch.setattr(worker_group, "FAILURE_GRACE_S", 3.0)

    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError) as error:  # rank 0 loads; rank 1 fails before any collective
        cluster.actor.workers.call_each(TrainWorker.run_engine, [("load_checkpoint", str(saved / "actor")),
                                                                 ("load_checkpoint", str(tmp_path / "missing"))],
                                        timeout_s=600, call_name="load_checkpoint")
    elapsed = time.monotonic() - t0
    assert elapsed < 15, elapsed  # the grace (3 s) and Ray's answers, not the collective's 300 s
    lines = str(error.value).splitlines()
    assert lines[0] == "actor.load_checkpoint failed:"
    node = cluster.actor.workers.locations[1]  # one local node: its Ray id's first characters
    assert lines[1] == (f"  - actor rank 1 on {node} raised FileNotFoundError: actor_rollout_ref.actor: checkpoint "
                        f"directory {tmp_path / 'missing'} does not exist")
    assert lines[-1] == (f"  - actor rank 0 on {node} was still inside the call 3 s after actor rank 1 on {node} "
                         "failed: stopped (presumably blocked in a collective with it)")
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids):  # both actor ranks' processes end
        assert time.monotonic() < deadline, [pid for pid in pids if alive(pid)]
        time.sleep(0.1)

    t0 = time.monotonic()  # the next step fails at once, naming why
    with pytest.raises(WorkerGroupError, match=r"actor's workers were stopped after an earlier failure \(actor."
                                               r"load_checkpoint: actor rank 1 on \S+ failed while its peers were"):
        trainer.train_step()
    assert time.monotonic() - t0 < 5

    # the last complete checkpoint stands and leaves megarl as an HF model
    assert complete_checkpoints(saved.parent)[-1] == (1, saved)
    assert megarl_main(["export", str(saved), "--out", str(tmp_path / "hf")]) == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").num_parameters() > 0
