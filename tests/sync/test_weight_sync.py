"""Actor update -> sync -> the rollout servers serve the actor's weights (real megatron-core at
TP=2 x PP=2 on gloo, two CPU-engine servers).

The shared gloo world (conftest `sync_run`) runs the whole story (sync_world.servers_story); each
test checks one part: log-probs of the servers' greedy samples equal the actor's recomputed
log-probs within 1e-5 after a distributed push and after a disk push (and differ before), a server
killed mid-push makes the push fail naming it without bumping the version, the retry completes it,
and a push after a server restarted between pushes succeeds at once.
"""
import pytest
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow  # the shared 4-process megatron world with two servers: 35-75 s on 2 cores


@pytest.fixture(scope="module")
def story(sync_run):
    _, case, ranks = sync_run
    return case, [rank["servers"] for rank in ranks]


def test_before_any_update_servers_and_actor_agree(story):
    _, ranks = story
    assert ranks[0]["initial"]["max_diff"] < 1e-5
    assert ranks[0]["initial"]["versions"] == [["default"], ["default"]]


def test_distributed_push_makes_servers_serve_the_update(story):
    _, ranks = story
    r = ranks[0]
    assert r["before"]["max_diff"] > 1e-2  # the update changed the actor; the servers still had the old weights
    assert r["after"]["max_diff"] < 1e-5
    assert r["after"]["versions"] == [["1"], ["1"]]
    assert all(rank["metrics"] == r["metrics"] for rank in ranks)  # every rank returns the same metrics


def test_push_reports_its_measurements(story):
    case, ranks = story
    m = ranks[0]["metrics"]
    params = AutoModelForCausalLM.from_pretrained(case["hf_dir"]).num_parameters()  # the tied embedding once
    assert m["sync/bytes"] == 4 * params  # fp32 HF tensors, vocab padding dropped, no lm_head
    assert m["sync/stages"] == 2 and m["sync/buckets"] >= 8
    assert m["sync/seconds"] > 0 and m["sync/gb_per_s"] == pytest.approx(m["sync/bytes"] / m["sync/seconds"] / 1e9)
    assert m["sync/slowest_stage"] in (0, 1)
    assert 0 < m["sync/slowest_stage_s"] <= m["sync/seconds"]
    assert m["sync/peak_buffer_bytes"] > 0


def test_server_dying_mid_push_fails_loudly_without_bumping_the_version(story):
    case, ranks = story
    dead = case["urls"][1]
    for rank in ranks:  # every rank raised, naming the dead server
        assert rank["failure"] is not None and dead in rank["failure"]
        assert rank["version_after_failure"] == 1
    assert ranks[0]["survivor_version"] == "1"  # the live server got part of the update, not the version


def test_retry_after_the_failure_completes_the_update(story):
    _, ranks = story
    r = ranks[0]
    assert r["retry"]["max_diff"] < 1e-5
    assert r["retry"]["versions"] == [["2"], ["2"]]


def test_push_after_a_server_restarted_forms_new_groups(story):
    _, ranks = story
    r = ranks[0]
    assert r["after_restart"]["max_diff"] < 1e-5
    assert r["after_restart"]["versions"] == [["3"], ["3"]]


def test_disk_push_with_colocated_memory(story):
    _, ranks = story
    r = ranks[0]
    assert r["disk"]["max_diff"] < 1e-5  # generation works again: weights and KV cache were resumed
    assert r["disk"]["versions"] == [["4"], ["4"]]
    assert len(r["disk_dirs"]) == 1 and r["disk_dirs"][0].startswith("push-000001-")
    assert r["disk_metrics"]["sync/bytes"] == r["metrics"]["sync/bytes"]
