"""Which actor rank serialises the IPC copy for each server TP rank: the one on that rank's GPU.

The oracle is the placement planner's own GPU map (`plan_placement`), not the formula under test:
for each colocated layout, the actor rank found on a server TP rank's `Device` must be the one
`colocated_peers` / `planner_colocated_peers` name."""
import pytest

from megarl.placement import ClusterSpec, RoleSpec, plan_placement
from megarl.sync.colocation import ColocationError, colocated_peers, planner_colocated_peers


def plan(nnodes, gpus, pools, actor_pool, rollout_pool, tp, pp, cp, rollout_tp):
    return plan_placement(ClusterSpec(nnodes, gpus), pools, [
        RoleSpec("actor", actor_pool, "train", tp=tp, pp=pp, cp=cp, tp_key="a.tp", pp_key="a.pp"),
        RoleSpec("rollout", rollout_pool, "rollout", tp=rollout_tp, tp_key="r.tp"),
    ])


def peers_of(p):
    rollout = p.roles["rollout"]
    return colocated_peers(p.roles["actor"].devices, [rollout.server_devices(s) for s in range(rollout.dp)])


# (nodes, gpus per node, actor TP, PP, CP, rollout TP): every actor layout against every server TP
COLOCATED = [
    (1, 1, 1, 1, 1, 1),  # one GPU: the single-GPU check
    (1, 8, 1, 1, 1, 1),  # DP 8 actor, eight TP-1 servers
    (1, 8, 2, 1, 1, 4),  # actor TP 2 x DP 4, servers TP 4: a server spans two actor TP groups
    (1, 8, 4, 2, 1, 2),  # actor TP 4 x PP 2, servers TP 2: stage 1's ranks hold servers 2 and 3
    (1, 8, 2, 2, 2, 8),  # TP 2 x CP 2 x PP 2 on one TP-8 server
    (2, 4, 2, 2, 1, 4),  # two nodes: actor PP spans nodes, each server stays in its node
    (4, 8, 8, 4, 1, 2),  # 32 GPUs, actor TP 8 x PP 4, sixteen TP-2 servers
]


@pytest.mark.parametrize("nnodes,gpus,tp,pp,cp,rollout_tp", COLOCATED)
def test_each_server_rank_gets_the_actor_rank_on_its_own_gpu(nnodes, gpus, tp, pp, cp, rollout_tp):
    p = plan(nnodes, gpus, {"shared": nnodes * gpus}, "shared", "shared", tp, pp, cp, rollout_tp)
    actor, rollout = p.roles["actor"], p.roles["rollout"]
    peers = peers_of(p)
    assert len(peers) == rollout.dp and all(len(row) == rollout_tp for row in peers)
    for s, row in enumerate(peers):
        for r, k in enumerate(row):
            assert actor.devices[k] == rollout.server_devices(s)[r]  # same node, same GPU
            assert ("actor", k) in p.occupants()[rollout.server_devices(s)[r]]
    assert sorted(k for row in peers for k in row) == list(range(actor.world_size))  # each actor rank once
    # the transport's runtime form (TP sizes from /server_info, the actor's world size) agrees
    assert planner_colocated_peers([rollout_tp] * rollout.dp, actor.world_size) == peers


def test_pp_layout_needs_ranks_beyond_the_stage_emitters():
    """TP 4 x PP 2 on 8 GPUs, TP-2 servers: the emitters (ranks 0 and 4) sit on servers 0 and 2
    only; servers 1 and 3 read copies that ranks 2, 3, 6, 7 must serialise."""
    assert planner_colocated_peers([2, 2, 2, 2], 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_split_placement_is_refused_naming_the_rank_and_the_rule():
    p = plan(1, 8, {"train": 4, "rollout": 4}, "train", "rollout", 2, 1, 1, 2)
    with pytest.raises(ColocationError, match=r"server 0 TP rank 0 is on GPU .*holds no actor rank.*IPC"):
        peers_of(p)


def test_servers_and_actor_on_different_gpu_counts_are_refused():
    with pytest.raises(ColocationError, match="cover 4 GPUs .* actor has 8 ranks"):
        planner_colocated_peers([2, 2], 8)


def test_two_actor_ranks_on_one_gpu_are_refused():
    with pytest.raises(ColocationError, match=r"actor ranks \[0, 1\]"):
        colocated_peers(["g0", "g0"], [["g0"]])
