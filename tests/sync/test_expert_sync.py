"""Weight sync of a mixture-of-experts actor with expert parallelism, in real megatron-core.

The shared gloo world (conftest `sync_run`, sync_world.expert_checks) loads a tiny Qwen3-MoE (8
experts, top-2) into `GPTModel` chunks at TP1/EP2, TP2/EP2/ETP1, TP2/EP2/ETP2 and PP2/EP2 and runs
the resharder with buckets smaller than one layer's experts. The oracle is the checkpoint's own
`model.safetensors`, as transformers' `save_pretrained` wrote it, read with safetensors: every HF
tensor, per expert, bit for bit. Each EP rank of expert-DP replica 0 emits its own experts (global
names), gathered over its expert-TP ranks only. Then a distributed push at TP1/EP2, checked tensor
by tensor against the server's checksums (DP 4, default weight-update groups: DP replica 0 sends
the dense buckets, EP ranks 0 and 1 of expert-DP replica 0 their own experts, so the server joins 2
groups) into a CPU-engine server that started with another checkpoint, and log-probs of its greedy
samples against the actor's; then a disk and a tensor push of updates (no groups: the 4 replicas
share the dense buckets), checked likewise.
"""
import re

import pytest
import torch
from safetensors.torch import load_file

from sync_world import EXPERT_BUCKET_BYTES, EXPERT_LAYOUTS, expert_layout_of

pytestmark = pytest.mark.slow  # part of the shared 4-process megatron world (conftest sync_run)


@pytest.fixture(scope="module")
def experts(sync_run):
    _, _, ranks, case = sync_run
    return load_file(f"{case['hf_dir']}/model.safetensors"), [rank["experts"] for rank in ranks]


def emitted(runs: list) -> dict:
    """The union of every emitter's HF tensors (each name emitted once)."""
    out = {}
    for run in runs:
        if not run["emitter"]:
            assert run["tensors"] == {} and run["buckets"] == [], "a rank that is no emitter emitted"
        for name, tensor in run["tensors"].items():
            assert name not in out, f"{name} emitted twice"
            out[name] = tensor
    return out


def experts_in(names) -> set:
    """The global expert indices among HF names."""
    return {int(m.group(1)) for m in (re.search(r"\.experts\.(\d+)\.", n) for n in names) if m}


@pytest.mark.parametrize("layout", EXPERT_LAYOUTS, ids=lambda t: "TP%d-PP%d-EP%d-ETP%d" % t)
def test_expert_parallel_resharder_equals_the_hf_checkpoint_bit_for_bit(layout, experts):
    oracle, ranks = experts
    runs = [rank[str(expert_layout_of(layout))] for rank in ranks]
    tensors = emitted(runs)
    assert tensors.keys() == oracle.keys()
    assert any(".experts.7.down_proj." in name for name in tensors)  # HF per-expert names, every expert
    for name, tensor in oracle.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
    # each EP rank's expert emitter emits exactly its own experts (EP rank r: global 4r..4r+3), one
    # emitter per EP rank and stage; no other rank emits an expert
    expert_emitters = [run for run in runs if run["emits_experts"]]
    assert sorted((run["pp_rank"], run["ep_rank"]) for run in expert_emitters) == \
        [(pp, ep) for pp in range(expert_layout_of(layout).pp) for ep in range(2)]
    for run in runs:
        own = set(range(4 * run["ep_rank"], 4 * run["ep_rank"] + 4)) if run["emits_experts"] else set()
        assert experts_in(run["tensors"]) == own, (run["ep_rank"], run["pp_rank"])
        if not run["emits_dense"]:
            assert all(".experts." in name for name in run["tensors"])


def test_expert_buckets_are_numbered_and_never_hold_all_experts(experts):
    """A stage's buckets, numbered across its emitters (dense, then EP rank 0's experts, then EP
    rank 1's): each number once. At TP1/EP2 nothing is gathered (expert TP 1): an emitter's
    buffers are one HF bucket, so EP rank 1's experts never reach rank 0."""
    _, ranks = experts
    # 2 layers x 8 experts x (fc1 [64, 64] + fc2 [64, 32]) fp32
    all_experts = 2 * 8 * (64 * 64 + 64 * 32) * 4
    for layout in EXPERT_LAYOUTS:
        runs = [rank[str(expert_layout_of(layout))] for rank in ranks if rank[str(expert_layout_of(layout))]["emitter"]]
        for pp in {run["pp_rank"] for run in runs}:
            numbers = sorted(b for run in runs if run["pp_rank"] == pp for b in run["buckets"])
            count = numbers[0][1]
            assert count > 4 and numbers == [(i, count) for i in range(count)], (layout, pp)
        for run in runs:
            # send share + gathered rows + HF buffer of one bucket; the largest gathered parameter
            # (an expert's fc1 over 2 expert-TP ranks, 32 KiB) fits a bucket
            assert 0 < run["peak_buffer_bytes"] <= 3 * EXPERT_BUCKET_BYTES < all_experts / 2
            if layout == (1, 1, 2, 0):
                assert run["peak_buffer_bytes"] == run["largest_bucket"], run["ep_rank"]


def test_swapping_two_experts_fails_the_oracle_for_exactly_those_experts(experts):
    """Negative control: local experts 0 and 1 of layer 0 swapped on every rank (global 0, 1 on EP
    rank 0 and 4, 5 on EP rank 1) at TP1/EP2."""
    oracle, ranks = experts
    tensors = emitted([rank["swapped"] for rank in ranks])
    differ = {name for name, tensor in oracle.items() if not torch.equal(tensors[name], tensor)}
    swapped = {f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in (0, 1, 4, 5)
               for p in ("gate_proj", "up_proj", "down_proj")}
    assert differ == swapped
    assert torch.equal(tensors["model.layers.0.mlp.experts.0.up_proj.weight"],
                       oracle["model.layers.0.mlp.experts.1.up_proj.weight"])


def test_expert_parallel_push_makes_the_server_serve_the_actor(experts):
    hf, ranks = experts
    push = [rank["push"] for rank in ranks]
    r = push[0]
    assert r["before"]["max_diff"] > 1e-2  # the server holds another checkpoint
    assert r["after"]["max_diff"] <= 1e-4, r["after"]
    assert r["metrics"]["sync/checked_tensors"] == len(hf)  # every checkpoint tensor, each expert's too
    assert r["after"]["versions"] == [["1"]]
    # default weight-update groups: replica 0's dense emitter (also EP rank 0's experts) and EP rank 1's
    # expert emitter, each over a group of its own (EP rank 1's experts live only on rank 1)
    assert r["metrics"]["sync/senders"] == 2
    assert [len(names) for names in r["joins"].values()] == [2]
    assert all(experts_in([n]) for p in push[1:] for n in p["sent"])  # only rank 0 sent dense tensors
    roles = [p["roles"] for p in push]
    assert [x["emits_experts"] for x in roles] == [True, True, False, False]  # expert-DP replica 0: EP ranks 0, 1
    assert [x["gathers_experts"] for x in roles] == [True, True, False, False]
    # EP rank 1 (rank 1) sent every tensor of its experts 4-7 itself, and no other expert; rank 0
    # only experts 0-3 (its last bucket, held for the commit, is not in `sent`); ranks 2, 3 none
    every = {name for name in hf if experts_in([name])}
    assert {n for n in push[1]["sent"] if experts_in([n])} == {n for n in every if experts_in([n]) <= {4, 5, 6, 7}}
    assert experts_in(push[0]["sent"]) <= {0, 1, 2, 3} and experts_in(push[0]["sent"])
    assert experts_in(push[2]["sent"]) == experts_in(push[3]["sent"]) == set()
    # the disk and tensor transports, each after an update: every tensor checked, the server serves the update
    for transport in ("disk", "tensor"):
        assert r[transport]["sync/checked_tensors"] == len(hf) and r[transport]["sync/senders"] == 4, transport
        # (4: no groups, so every replica's emitter sends its share of the dense buckets)
    assert r["last"]["max_diff"] <= 1e-4 and r["last"]["versions"] == [["3"]], r["last"]
    print("expert sync (TP1/EP2, distributed, checked): log-prob gap before", r["before"]["max_diff"], "after", r["after"]["max_diff"])



def test_grouped_gemm_expert_names_export_and_load_bit_for_bit(experts):
    """The TP1/EP2 chunks with their experts renamed as megatron's TEGroupedMLP names them
    (`mlp.experts.linear_fc1.weight<k>`, the same tensors): the resharder emits the checkpoint bit
    for bit, and so it does after every parameter is zeroed and the engine's HF loader refills them
    through those names. Negative control: local experts given in reverse order (weight<k> holds
    local expert n-1-k) move every expert of both layers."""
    oracle, ranks = experts
    names = ranks[0]["grouped_names"]
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight3" in names and not any("local_experts" in n for n in names)
    for run in ("grouped", "grouped_loaded"):
        tensors = emitted([rank[run] for rank in ranks])
        assert tensors.keys() == oracle.keys(), run
        for name, tensor in oracle.items():
            assert torch.equal(tensors[name], tensor), (run, name)
    reversed_ = emitted([rank["grouped_reversed"] for rank in ranks])
    differ = {name for name, tensor in oracle.items() if not torch.equal(reversed_[name], tensor)}
    assert differ == {name for name in oracle if ".mlp.experts." in name}
    assert torch.equal(reversed_["model.layers.0.mlp.experts.0.gate_proj.weight"],
                       oracle["model.layers.0.mlp.experts.3.gate_proj.weight"])  # EP rank 0 holds experts 0-3
    print("grouped-name checks, seconds on rank 0:", ranks[0]["grouped_s"])
