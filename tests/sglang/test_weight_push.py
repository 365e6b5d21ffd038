"""Every way megarl pushes weights, into a real SGLang 0.5.23 server (float32, on the CPU).

A megatron actor (one gloo rank, `push_world.py`) pushes HF checkpoints through `WeightSync` with each
transport: tensor (the colocated layout: per-TP-rank copies relayed by `IpcRelay`, load_format null
in shared memory), distributed (a gloo weight-update group, flattened buckets) and disk. A sender
under SGLang's interpreter pushes a `flattened_bucket` over /update_weights_from_tensor, built by
megarl's GPU-path code (`ipc_copies.flattened_bucket_entry`). After each push the server's greedy
log-probs (read by megarl's `RolloutClient`) equal HF transformers' float32 log-probs of the pushed
checkpoint within 1e-4, and not those of the weights it held before; `/generate`'s
`meta_info.weight_version` and `/model_info` report the version the push committed.
"""
import json
import subprocess
from pathlib import Path

import pytest

from push_world import push_story, server_samples
from real_sglang import CHANGED, TOLERANCE, load_hf, make_model, max_diff, sglang_client_env, sglang_python

from megarl.rollout.control import ServerControl
from megarl.testing import run_gloo_workers

pytestmark = pytest.mark.slow  # a real SGLang server (20-35 s to start) and a megatron rank

SENDER = Path(__file__).parent / "flattened_bucket_sender.py"


@pytest.fixture(scope="module")
def checkpoints(qwen2_dir, tmp_path_factory):
    """A: the server's at start (seed 0); B and C: other random weights of the same architecture."""
    root = tmp_path_factory.mktemp("push-checkpoints")
    return {"A": qwen2_dir, "B": make_model("qwen2", root / "B", seed=1), "C": make_model("qwen2", root / "C", seed=2)}


@pytest.fixture(scope="module")
def hf(checkpoints):
    return {name: load_hf(path) for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def pushes(sglang_server, checkpoints, tmp_path_factory):
    """What the server answered after each of the actor's pushes (push_world.PUSHES)."""
    disk_dir = tmp_path_factory.mktemp("disk-pushes")
    (result,) = run_gloo_workers(push_story, 1, args=(sglang_server.url, checkpoints, str(disk_dir)), timeout_s=600)
    return result


@pytest.mark.parametrize("transport, before", [("tensor", "A"), ("distributed", "B"), ("disk", "C")])
def test_each_transport_makes_the_server_serve_the_pushed_weights(pushes, hf, transport, before):
    """After the push the server's greedy log-probs are HF's of the pushed checkpoint, not of the
    one it served before (the push really happened)."""
    record = pushes[transport]
    assert max_diff(hf[record["checkpoint"]], record["samples"]) < TOLERANCE
    assert max_diff(hf[before], record["samples"]) > CHANGED
    assert record["buckets"] > 1  # several update requests, then the commit


@pytest.mark.parametrize("transport, version", [("tensor", 1), ("distributed", 2), ("disk", 3)])
def test_each_push_sets_the_version_it_commits(pushes, transport, version):
    record = pushes[transport]
    assert record["version"] == version
    assert {sample[3] for sample in record["samples"]} == {str(version)}  # /generate's meta_info.weight_version
    assert record["model_info_version"] == str(version)


def test_tensor_push_takes_the_colocated_path(pushes):
    """One server of one TP rank for one actor rank: the planner's colocated layout, so the bucket
    copies are relayed rank by rank (`IpcRelay`), as in a colocated run on the CPU."""
    assert pushes["tensor"]["peers"] == [[0]]


def test_closing_the_distributed_sync_destroys_the_servers_group(pushes):
    """`WeightSync.close` ends the group on the server too: destroying it again is refused by SGLang."""
    record = pushes["distributed"]
    assert record["group"].startswith("megarl-sync-pp0-")
    assert record["destroy_again"] is not None and "The group to be destroyed does not exist" in record["destroy_again"]


def test_flattened_bucket_push_from_a_sender_with_sglang(pushes, sglang_server, checkpoints, hf, tmp_path):
    """SGLang's `flattened_bucket` (its own FlattenedTensorMetadata, so the sender runs under SGLang's
    interpreter) of checkpoint C, in shared memory, inside begin/end_weight_update: the server then
    serves C at the version sent. Runs after the actor's pushes, which left B on the server."""
    out, err = tmp_path / "sender.out", tmp_path / "sender.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files: torch's shm manager keeps pipes open
        sender = subprocess.Popen([sglang_python(), str(SENDER), sglang_server.url, checkpoints["C"], "fb-4"],
                                  stdout=stdout, stderr=stderr, env=sglang_client_env())
        assert sender.wait(timeout=300) == 0, err.read_text()[-3000:]
    assert json.loads(out.read_text())["bytes"] == 4 * hf["C"].num_parameters()  # every fp32 weight once (tied: once)
    samples = server_samples(sglang_server.url)
    assert max_diff(hf["C"], samples) < TOLERANCE
    assert max_diff(hf["B"], samples) > CHANGED
    assert {sample[3] for sample in samples} == {"fb-4"}
    assert ServerControl(sglang_server.url).weight_version() == "fb-4"
