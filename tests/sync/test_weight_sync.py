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
    _, case, ranks, _ = sync_run
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


def test_tensor_push_makes_colocated_servers_serve_each_update(story):
    """Two actor updates, each pushed through /update_weights_from_tensor (CPU shared memory): the
    servers' log-probs follow the actor's, as closely as after a distributed push."""
    _, ranks = story
    t = ranks[0]["tensor"]
    assert t["pushes"][0]["before"]["max_diff"] > 1e-2  # the update changed the actor; the servers were behind
    for i, push in enumerate(t["pushes"]):
        assert push["after"]["max_diff"] < 1e-5  # fp32 megatron (TP 2 x PP 2) vs HF noise, as after a distributed push
        assert push["after"]["versions"] == [[str(5 + i)], [str(5 + i)]]
        assert push["metrics"]["sync/bytes"] == ranks[0]["metrics"]["sync/bytes"]
    assert all(rank["tensor"]["pushes"][0]["metrics"] == t["pushes"][0]["metrics"] for rank in ranks)


def test_tensor_push_drops_each_bucket_copy_once_the_servers_answered(story):
    """One shared copy (2 servers for 4 actor ranks): on each emitter the resharder writes each
    bucket straight into shared memory (no copy of a reused buffer) and that memory lives only
    until the servers answered its request, so no more than one bucket is alive at once
    (`CopyTracker`; the old lifetime, every copy until the stream ended, held all 5-6 of a
    stage's); none is held between buckets, none is alive after the push and their shared-memory
    files are gone."""
    _, ranks = story
    emitters = [r["tensor"] for r in ranks if r["tensor"]["pushes"][0]["held_after"] is not None]
    assert len(emitters) == 2  # one per pipeline stage
    for t in emitters:
        for push in t["pushes"]:
            assert push["copies"] >= 4 and push["largest_copy_bytes"] > 0
            assert push["copied"] == 0, push  # written in place by the resharder (`hf_memory`), sent as is
            assert push["peak_copy_bytes"] <= push["largest_copy_bytes"], push  # one copy at a time: <= 1 bucket
            assert push["in_flight"] == [0] * len(push["in_flight"]) and push["in_flight"]
            assert push["alive_after"] == 0 and push["held_after"] == 0
            assert push["files"] == push["copies"] and push["files_after"] == []
    assert all(p["copies"] == 0 for r in ranks if r["tensor"]["pushes"][0]["held_after"] is None
               for p in r["tensor"]["pushes"])  # the other ranks hold none


def test_tensor_push_refused_by_a_server_fails_naming_it_and_the_retry_completes(story):
    case, ranks = story
    refused = case["urls"][1]
    for rank in ranks:
        t = rank["tensor"]
        assert t["failure"] is not None and refused in t["failure"] and "begin_weight_update" in t["failure"]
        assert t["version_after_failure"] == 6
    t = ranks[0]["tensor"]
    assert t["retry"]["max_diff"] < 1e-5
    assert t["retry"]["versions"] == [["7"], ["7"]] and t["version"] == 7


def hf_checksums(hf_dir, out_dir) -> dict:
    """The oracle: HF's own save_pretrained of the checkpoint, each tensor hashed here as SGLang
    does on CPU (mm_utils.tensor_hash: first 8 bytes of sha256 of the bytes, 16 hex digits)."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).save_pretrained(out_dir)
    return {name: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).digest()[:8].hex()
            for file in sorted(out_dir.glob("*.safetensors")) for name, t in load_file(file).items()}


def test_pushed_tensors_equal_hf_save_pretrained_of_the_same_weights(story, tmp_path):
    """After an update-free push of the HF checkpoint (TP 2 x PP 2 -> HF), every server holds, bit for
    bit, what transformers' save_pretrained writes of it; before the push they held an update."""
    case, ranks = story
    expected = hf_checksums(case["hf_dir"], tmp_path)
    c = ranks[0]["checked"]
    for before, after in zip(c["before"], c["after"]):
        assert after == expected
        assert sum(before[name] != digest for name, digest in expected.items()) == len(expected)
    assert c["metrics"]["sync/checked_tensors"] == len(expected) and c["metrics"]["sync/check_s"] > 0


def test_equality_check_catches_a_corrupted_bucket_naming_tensor_and_servers(story):
    """Negative control: stage 1's emitter corrupts its first bucket after hashing it; every rank's
    push fails naming that tensor on each server; the next push (no corruption) passes the check."""
    case, ranks = story
    (corrupted,) = [r["checked"]["corrupted"] for r in ranks if r["checked"]["corrupted"]]
    version = ranks[0]["checked"]["version_after_failure"]
    for rank in ranks:
        failure = rank["checked"]["failure"]
        assert failure is not None and "not the actor's" in failure
        for url in case["urls"]:
            assert f"{url}: tensor {corrupted}: the server holds checksum" in failure
        assert rank["checked"]["version_after_failure"] == version
        assert rank["checked"]["version"] == version + 1  # the retry pushed the version that failed
    assert ranks[0]["checked"]["retry_metrics"]["sync/checked_tensors"] > 0


def test_dp_replicas_share_the_push_with_disjoint_buckets(story):
    """TP 2 x DP 2, weight_update_groups=per_emitter: both replicas' emitters send, each a disjoint
    share of the buckets over a weight-update group of its own (each server joins 2), together
    every bucket once (the coordinator's held last bucket included), and the servers then hold
    exactly the tensors sent (the equality check passed on every tensor)."""
    case, ranks = story
    runs = [r["split"] for r in ranks]
    joins = runs[0]["joins"]
    assert sorted(joins) == sorted(case["urls"]) and all(len(names) == 2 == len(set(names)) for names in joins.values())
    assert joins[case["urls"][0]] == joins[case["urls"][1]]  # every server joins every emitter's group
    emitters = [r for r in runs if r["emitter"]]
    assert sorted(r["dp_rank"] for r in emitters) == [0, 1]
    assert all(r["sent"] == [] for r in runs if not r["emitter"])
    count = runs[0]["count"]
    assert count >= 4
    shares = [set(r["sent"]) | ({count - 1} if r["coordinator"] else set()) for r in emitters]
    assert all(len(share) >= count // 2 for share in shares)  # each replica sends half the buckets
    assert shares[0].isdisjoint(shares[1]) and shares[0] | shares[1] == set(range(count))
    m = runs[0]["metrics"]
    assert m["sync/senders"] == 2 and m["sync/stages"] == 1 and m["sync/buckets"] == count
    assert m["sync/checked_tensors"] == ranks[0]["checked"]["metrics"]["sync/checked_tensors"]
    assert all(r["metrics"] == m for r in runs) and runs[0]["version"] == ranks[0]["checked"]["version"] + 1


def test_dp2_pp2_servers_join_one_group_per_pipeline_stage_by_default(story):
    """TP 1 x PP 2 x DP 2, default weight_update_groups (per_stage): each server is asked to join
    exactly 2 weight-update groups (PP; per emitter it would be PP x DP = 4), one per stage, and only
    DP replica 0's stage emitters send; the servers then hold exactly the tensors of the actor (the
    equality check passed on every tensor) at the new version."""
    case, ranks = story
    runs = [r["stage_groups"] for r in ranks]
    joins = runs[0]["joins"]
    assert sorted(joins) == sorted(case["urls"])
    for url in case["urls"]:
        assert len(joins[url]) == 2 and len(set(joins[url])) == 2, joins
        assert sorted(name.split("-")[2] for name in joins[url]) == ["pp0", "pp1"]  # megarl-sync-pp{stage}-...
    assert sorted((r["pp_rank"], r["dp_rank"]) for r in runs if r["emitter"]) == [(0, 0), (1, 0)]
    assert all(r["sent"] == [] for r in runs if r["dp_rank"] == 1)
    assert any(r["sent"] for r in runs if r["emitter"] and r["pp_rank"] == 1)
    m = runs[0]["metrics"]
    assert m["sync/senders"] == 2 and m["sync/stages"] == 2
    assert m["sync/checked_tensors"] == ranks[0]["checked"]["metrics"]["sync/checked_tensors"]  # every tensor
    assert all(r["metrics"] == m for r in runs) and runs[0]["version"] == ranks[0]["split"]["version"] + 1


def test_report_log_prob_differences(story):
    """Not a check: the figures of this run, printed for the record (pytest -s)."""
    _, ranks = story
    r = ranks[0]
    print("max |server - actor| log-prob: same weights", r["initial"]["max_diff"], "distributed", r["after"]["max_diff"],
          "disk", r["disk"]["max_diff"], "tensor", [p["after"]["max_diff"] for p in r["tensor"]["pushes"]],
          "tensor retry", r["tensor"]["retry"]["max_diff"], "seconds", r["seconds"])
