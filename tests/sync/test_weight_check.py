"""The pure parts of the equality check and of DP sharing, against hand-computed values."""
import hashlib

import torch

from megarl.rollout.weight_group import bucket_layout
from megarl.sync.groups import ParallelGroups
from megarl.sync.resharder import HFBucket
from megarl.sync.weight_check import MAX_LISTED, bucket_checksums, mismatches


def groups(dp_rank: int, dp_size: int, split: bool) -> ParallelGroups:
    return ParallelGroups(tp_group=None, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=dp_rank,
                          emitter_group=None, dp_size=dp_size, split_dp=split)


def test_replicas_own_disjoint_shares_and_replica_0_the_last_bucket():
    shares = [[k for k in range(7) if groups(d, 3, True).owns(k, 7)] for d in range(3)]
    assert shares == [[0, 3, 6], [2, 5], [1, 4]]
    assert [k for k in range(7) if groups(0, 3, False).owns(k, 7)] == list(range(7))  # replica 0 sends all
    assert not groups(1, 3, False).gathers and groups(1, 3, True).gathers
    assert groups(0, 3, True).is_coordinator and not groups(1, 3, True).is_coordinator


def test_bucket_checksums_hash_each_tensor_in_the_servers_dtype():
    a, b = torch.tensor([1.0, 2.5, -3.0]), torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7
    slots = bucket_layout(["a", "b"], ["float32", "float32"], [[3], [2, 3]])
    flat = torch.cat([a.view(torch.uint8), b.reshape(-1).view(torch.uint8)])
    bucket = HFBucket(0, 1, flat, tuple(slots))

    def sha(t):  # SGLang's CPU tensor_hash: first 8 bytes of sha256, 16 hex digits
        return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).digest()[:8].hex()

    assert bucket_checksums(bucket, None) == {"a": sha(a), "b": sha(b)}
    assert bucket_checksums(bucket, torch.bfloat16) == {"a": sha(a.bfloat16()), "b": sha(b.bfloat16())}
    assert sha(b.bfloat16()) != sha(b)


def test_mismatches_name_each_differing_or_missing_tensor_and_the_server():
    sent = {"x": "1" * 16, "y": "2" * 16, "z": "3" * 16}
    held = {"x": "1" * 16, "y": "f" * 16, "extra.buffer": "0" * 16}
    assert mismatches("http://s", sent, [dict(sent, other="9" * 16)]) == []  # tensors not sent are not compared
    assert mismatches("http://s", sent, [held]) == [
        f"http://s: tensor y: the server holds checksum {'f' * 16}, the actor sent {'2' * 16}",
        "http://s: tensor z was sent but the server holds no tensor of that name",
    ]
    assert "2 TP ranks" in mismatches("http://s", sent, [held, held])[0]
    many = {f"t{i:02d}": "a" * 16 for i in range(MAX_LISTED + 3)}
    found = mismatches("http://s", many, [{}])
    assert len(found) == MAX_LISTED + 1 and found[-1] == "http://s: and 3 more tensors differ"
