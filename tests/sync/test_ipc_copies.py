"""Per-TP-rank copies for the colocated tensor transport (sync/ipc_copies.py), on a real 4-rank
gloo world with test-double servers (ipc_world.py): SGLang's TP worker r opens entry r
(0.5.23 `managers/tp_worker.py::deserialize_own_rank`), so entry r must come from the actor rank
on TP rank r's GPU. The oracle for "which rank serialised it" is the process id torch writes into
the name of the shared-memory file it creates, compared with each rank's own `os.getpid()`; the
oracle for the contents is the seeded tensors, rebuilt here."""
import pytest
import torch

from ipc_world import EMITTERS, SERVER_TP, bucket_tensors, relay_world
from megarl.testing import run_gloo_workers
from megarl.sync.ipc_copies import copies_on_gpu

# the planner's colocated layout, by hand: actor rank g on GPU g; server 0 on GPU 0, server 1 on GPUs 1, 2, 3
PEERS = [[0], [1, 2, 3]]
# (emitter, bucket) in the relay's order: round by round, emitters by rank; (0, 1) is the commit's
STREAM = [(0, 0), (2, 0), (2, 1), (2, 2)]


@pytest.fixture(scope="module")
def ranks():
    return run_gloo_workers(relay_world, 4, timeout_s=120)


def check_entries(record: dict, server: int, emitter: int, index: int, pids: list[int]) -> None:
    assert len(record["entries"]) == SERVER_TP[server]
    for r, entry in enumerate(record["entries"]):
        assert entry["pid"] == pids[PEERS[server][r]], (server, r, emitter, index)
        expected = dict(bucket_tensors(emitter, index))
        assert entry["tensors"].keys() == expected.keys()
        for name, tensor in expected.items():
            assert entry["tensors"][name].dtype == tensor.dtype and torch.equal(entry["tensors"][name], tensor)


def test_each_tp_rank_gets_a_copy_serialised_by_the_actor_rank_on_its_gpu(ranks):
    pids = [r["pid"] for r in ranks]
    assert len(set(pids)) == 4  # the check below tells every rank apart
    assert ranks[0]["emitters"] == sorted(EMITTERS)
    for server, records in enumerate(ranks[0]["first_records"]):
        assert len(records) == len(STREAM) + 1
        for record, (emitter, index) in zip(records, STREAM):
            check_entries(record, server, emitter, index, pids)
            assert (record["weight_version"], record["flush_cache"]) == (None, False)
        commit = records[-1]  # the coordinator's last bucket, with the version
        check_entries(commit, server, 0, EMITTERS[0] - 1, pids)
        assert (commit["weight_version"], commit["flush_cache"]) == ("7", True)


def test_copies_live_until_their_requests_were_answered_then_are_dropped(ranks):
    """Per-bucket lifetime: an emitter's copy goes to the relay in the round it was made; every
    rank holds at most one step's copy plus the commit's (2 buckets; the old lifetime, every copy
    until the stream ended, held 4 on every rank here), and only the commit's after the rounds."""
    assert all(r["first"]["error"] is None for r in ranks)
    for r in ranks:
        first = r["first"]
        assert first["copies"] == sum(EMITTERS.values())  # each rank made (or received) a copy of every bucket
        assert first["peak_copy_bytes"] <= 2 * first["bucket_bytes"], (first["peak_copy_bytes"], first["bucket_bytes"])
    assert [ranks[e]["first"]["pending"] for e in sorted(EMITTERS)] == [[1], [1, 1, 1]]  # then taken by the round
    assert [r["first"]["held_after_rounds"] for r in ranks] == [1, 1, 1, 1]  # the commit bucket's copy
    assert [r["first"]["held_after_release"] for r in ranks] == [0, 0, 0, 0]


def test_a_refused_request_ends_that_emitters_turn_with_an_error_naming_the_server(ranks):
    url = "http://127.0.0.1:"
    errors = [r["refused"]["error"] for r in ranks]
    assert errors[0] is None and errors[1] is None and errors[3] is None
    assert url in errors[2] and "/update_weights_from_tensor: HTTP 500: refused by the test double" in errors[2]
    for server, records in enumerate(ranks[0]["refused_records"]):
        # the coordinator's first bucket, then stage 1's first (refused by server 1); nothing more, no commit
        assert [r["weight_version"] for r in records] == [None, None]
        assert [r["refused"] for r in records] == [False, server == 1]
    # every rank kept its copy of the refused bucket (the server may still read it) and the commit's, until reset
    assert [r["refused"]["held_after_rounds"] for r in ranks] == [2, 2, 2, 2]
    assert [r["refused"]["held_after_release"] for r in ranks] == [0, 0, 0, 0]


@pytest.mark.parametrize("device_types, on_gpu", [
    (["cuda", "cuda"], True),  # the actor trains on its GPU: CUDA IPC handles
    (["cpu", "cpu"], False),  # trainer.device=cpu, on any host (a GPU host too): shared memory
    (["cuda", "cpu"], True),  # some parameters on the GPU: the buckets are gathered there
    ([], False),
])
def test_the_copies_live_on_the_actors_device_not_the_hosts(device_types, on_gpu):
    assert copies_on_gpu(device_types) is on_gpu
