"""The pure planner: split and colocated layouts, node sizes, multi-node shapes, every error."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import load_and_validate
from megarl.placement import ClusterSpec, Device, PlanError, RoleSpec, format_gpu_map, plan_from_config, plan_placement
from megarl.bridge import arch_from_hf_config
from megarl.placement.memory import estimate, stage_params, total_params

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]


def cfg(*overrides):
    return load_and_validate(None, REQUIRED + list(overrides))


def train(name, pool, tp=1, pp=1, cp=1):
    return RoleSpec(name, pool, "train", tp=tp, pp=pp, cp=cp, tp_key=f"{name}.tp", pp_key=f"{name}.pp")


def rollout(pool, tp=1):
    return RoleSpec("rollout", pool, "rollout", tp=tp, tp_key="rollout.tp")


def test_colocated_roles_share_every_gpu_with_fractions():
    plan = plan_placement(ClusterSpec(2, 4), {"shared": 8},
                          [train("actor", "shared", tp=2), train("ref", "shared"), rollout("shared", tp=2)])
    actor, ref, roll = plan.roles["actor"], plan.roles["ref"], plan.roles["rollout"]
    assert actor.devices == ref.devices == roll.devices
    assert actor.devices[0] == Device(0, 0) and actor.devices[7] == Device(1, 3)
    assert (actor.dp, ref.dp, roll.dp) == (4, 8, 4)
    assert actor.gpu_fraction == pytest.approx(1 / 3)
    assert roll.server_devices(1) == [Device(0, 2), Device(0, 3)]
    assert plan.occupants()[Device(1, 1)] == [("actor", 5), ("ref", 5), ("rollout", 5)]


def test_split_pools_are_disjoint_contiguous_and_node_aligned():
    plan = plan_placement(ClusterSpec(4, 8), {"train": 16, "rollout": 16},
                          [train("actor", "train", tp=4, pp=2), train("critic", "train", tp=2), rollout("rollout", tp=8)])
    train_devs = set(plan.pools["train"].devices)
    roll_devs = set(plan.pools["rollout"].devices)
    assert not train_devs & roll_devs
    assert plan.pools["train"].nodes == [0, 1] and plan.pools["rollout"].nodes == [2, 3]
    assert plan.roles["actor"].dp == 2 and plan.roles["critic"].dp == 8 and plan.roles["rollout"].dp == 2
    assert plan.roles["actor"].gpu_fraction == 0.5  # actor and critic share the train pool
    assert plan.roles["rollout"].gpu_fraction == 1.0
    # megatron rank order: TP fastest, so ranks 0-3 are one TP group on node 0
    assert {d.node for d in plan.roles["actor"].devices[0:4]} == {0}


@pytest.mark.parametrize("gpus_per_node, tp, ok", [(4, 4, True), (4, 8, False), (8, 8, True), (8, 4, True), (6, 4, False)])
def test_tp_group_never_spans_nodes(gpus_per_node, tp, ok):
    cluster = ClusterSpec(2, gpus_per_node)
    size = 2 * gpus_per_node
    if ok:
        plan = plan_placement(cluster, {"p": size}, [train("actor", "p", tp=tp)])
        for start in range(0, size, tp):
            assert len({d.node for d in plan.roles["actor"].devices[start:start + tp]}) == 1
    else:
        with pytest.raises(PlanError, match="would span nodes|does not divide"):
            plan_placement(cluster, {"p": size}, [train("actor", "p", tp=tp)])


def test_rollout_server_starting_mid_node_cannot_span_nodes():
    # train pool of 6 GPUs leaves the rollout pool starting at gpu 6 of node 0: a TP-4 server would
    # take gpus 6,7 of node0 and 0,1 of node1.
    with pytest.raises(PlanError) as info:
        plan_placement(ClusterSpec(2, 8), {"train": 6, "rollout": 8}, [train("actor", "train"), rollout("rollout", tp=4)])
    msg = str(info.value)
    assert "rollout server" in msg and "would span nodes node0, node1" in msg and "rollout.tp=4" in msg


def test_plan_errors_name_keys():
    with pytest.raises(PlanError, match=r"the pools need 20 GPUs \(train=12, rollout=8\) but trainer.nnodes x trainer.n_gpus_per_node = 2 x 8 = 16"):
        plan_placement(ClusterSpec(2, 8), {"train": 12, "rollout": 8}, [])
    with pytest.raises(PlanError, match=r"one model replica needs TP x CP x PP = 4 x 1 x 4 = 16 GPUs but pool 'p' has 8; lower actor.tp / actor.pp"):
        plan_placement(ClusterSpec(1, 8), {"p": 8}, [train("actor", "p", tp=4, pp=4)])
    with pytest.raises(PlanError, match="TP x CP x PP = 3 GPUs per replica does not divide the 8 GPUs"):
        plan_placement(ClusterSpec(1, 8), {"p": 8}, [train("actor", "p", pp=3)])
    with pytest.raises(PlanError, match="rollout.tp=3 GPUs per server does not divide the 8 GPUs of pool 'p'; try rollout.tp=2"):
        plan_placement(ClusterSpec(1, 8), {"p": 8}, [rollout("p", tp=3)])
    with pytest.raises(PlanError, match="names pool 'nope'"):
        plan_placement(ClusterSpec(1, 8), {"p": 8}, [train("actor", "nope")])
    with pytest.raises(PlanError, match="every pool needs at least one"):
        plan_placement(ClusterSpec(1, 8), {"p": 8, "q": 0}, [])
    with pytest.raises(PlanError, match="3 node names given for trainer.nnodes=2"):
        plan_placement(ClusterSpec(2, 8, ("a", "b", "c")), {"p": 8}, [])


def test_plan_from_config_roles_follow_the_algorithm():
    grpo = plan_from_config(cfg("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"))
    assert sorted(grpo.roles) == ["actor", "rollout"]
    kl = plan_from_config(cfg("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                              "actor_rollout_ref.actor.use_kl_loss=true"))
    assert sorted(kl.roles) == ["actor", "ref", "rollout"]
    ppo = plan_from_config(cfg("algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true"))
    assert sorted(ppo.roles) == ["actor", "critic", "ref", "rollout"]
    assert ppo.roles["actor"].gpu_fraction == 0.25


def test_split_from_config_and_gpu_map_text():
    plan = plan_from_config(cfg("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "placement.mode=split",
                                "placement.rollout_gpus=4", "trainer.n_gpus_per_node=4", "trainer.nnodes=2",
                                "actor_rollout_ref.rollout.tensor_model_parallel_size=2"))
    text = format_gpu_map(plan)
    assert "node0:\n  gpu0: [train] actor rank 0" in text
    assert "node1:\n  gpu0: [rollout] rollout server 0" in text
    assert "  gpu3: [rollout] rollout server 1" in text


def test_a_rollout_server_larger_than_a_node_takes_whole_nodes_one_process_per_node():
    plan = plan_placement(ClusterSpec(4, 4), {"train": 8, "rollout": 8},
                          [train("actor", "train", tp=4), rollout("rollout", tp=8)])
    r = plan.roles["rollout"]
    assert r.dp == 1 and {d.node for d in r.server_devices(0)} == {2, 3}
    assert r.server_processes() == [(0, 0, 0), (0, 1, 4)]  # node rank 0 (HTTP) first
    shared = plan_placement(ClusterSpec(4, 2), {"shared": 8}, [train("actor", "shared", tp=2), rollout("shared", tp=4)])
    assert shared.roles["rollout"].server_processes() == [(0, 0, 0), (0, 1, 2), (1, 0, 4), (1, 1, 6)]
    small = plan_placement(ClusterSpec(1, 8), {"shared": 8}, [rollout("shared", tp=2)])
    assert small.roles["rollout"].server_processes() == [(0, 0, 0), (1, 0, 2), (2, 0, 4), (3, 0, 6)]
    with pytest.raises(PlanError, match=r"rollout.tp=6 spans nodes, so it must be a multiple of "
                                        r"trainer.n_gpus_per_node=4 \(try 4\)"):
        plan_placement(ClusterSpec(3, 4), {"rollout": 12}, [rollout("rollout", tp=6)])
    with pytest.raises(PlanError, match="would start on gpu2 of node0: a server of rollout.tp=8 GPUs takes whole nodes"):
        plan_placement(ClusterSpec(3, 4), {"train": 2, "rollout": 8}, [train("actor", "train"), rollout("rollout", tp=8)])


def test_plans_1024_nodes():
    # how long this takes is measured by tools/bench/planner.py, never asserted in a test
    plan = plan_placement(ClusterSpec(1024, 8), {"train": 4096, "rollout": 4096},
                          [train("actor", "train", tp=8, pp=4), train("ref", "train", tp=4), rollout("rollout", tp=4)])
    assert plan.roles["actor"].dp == 128 and plan.roles["rollout"].dp == 1024
    rollout_role = plan.roles["rollout"]  # the second half of the nodes: 512..1023, two servers each
    assert rollout_role.server_processes()[-1] == (1023, 0, 4092)
    assert (rollout_role.devices[4092].node, rollout_role.devices[4092].gpu) == (1023, 4)


QWEN7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28,
          "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
          "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": False}


def test_memory_estimate_by_hand():
    arch = arch_from_hf_config(QWEN7B)
    assert round(total_params(arch) / 1e9, 2) == 7.62  # Qwen2.5-7B without biases: 7.6 B
    c = cfg("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "placement.mode=split",
            "placement.rollout_gpus=4", "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4", "data.max_prompt_length=100",
            "data.max_response_length=100", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    plan = plan_from_config(c)
    est = estimate(plan, c, arch)
    actor = est.roles[0]
    params = stage_params(arch, 1) / 4
    assert actor.states == int(params * 2 + params * 4 + params * 12 / 1)  # DP 1: optimizer not sharded further
    # TP 4 without sequence parallelism: 10 sbh of a layer's 34 replicated, 24 split (Korthikanti et al. table 2)
    assert actor.activations == int(200 * 1 * 3584 * (10 + 24 / 4) * 28 + 200 * 152064 / 4 * 4)
    assert est.rollout_reserved == int(0.5 * 80 * 1024**3)
    assert est.peak == max(actor.states + actor.activations, est.rollout_reserved)
    assert est.fits


RECOMPUTE = "+actor_rollout_ref.actor.megatron.override_transformer_config"


@pytest.mark.parametrize("overrides, kept, rematerialised", [
    ([], "14 A", 0),
    ([f"{RECOMPUTE}.recompute_granularity=selective"], "14 A", 0),  # flash attention: no scores to drop
    (["actor_rollout_ref.model.enable_gradient_checkpointing=true"], "14 I", 1),  # full, uniform, 1 layer a chunk
    ([f"{RECOMPUTE}.recompute_granularity=full", f"{RECOMPUTE}.recompute_method=uniform",
      f"{RECOMPUTE}.recompute_num_layers=4"], "4 I", 4),  # ceil(14 / 4) chunk inputs; one chunk of 4 layers back
    ([f"{RECOMPUTE}.recompute_granularity=full", f"{RECOMPUTE}.recompute_method=block",
      f"{RECOMPUTE}.recompute_num_layers=3"], "3 I + 11 A", 1),  # first 3 layers' inputs, the other 11 whole
])
def test_activation_recompute_in_the_memory_estimate_by_hand(overrides, kept, rematerialised):
    """Qwen2-7B at TP4 x PP2 with sequence parallelism (14 layers a stage, 2 micro-batches in flight on
    stage 0), bf16, 200 tokens: a layer's activations A = 200 x 3584 x 34 / 4 bytes, its input
    I = 200 x 3584 x 2 / 4 bytes (split over TP by SP)."""
    arch = arch_from_hf_config(QWEN7B)
    c = cfg("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.max_prompt_length=100",
            "data.max_response_length=100", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.sequence_parallel=true", *overrides)
    actor = estimate(plan_from_config(c), c, arch).roles[0]
    layer, layer_input, logits = 200 * 3584 * 34 / 4, 200 * 3584 * 2 / 4, 200 * 152064 / 4 * 4
    per_micro_batch = sum(int(n) * (layer if unit == "A" else layer_input)
                          for n, unit in (term.split() for term in kept.split(" + ")))
    assert actor.activations == int(2 * per_micro_batch + rematerialised * layer + logits)
    assert ("recompute" in actor.recompute) == bool(overrides)


@pytest.mark.parametrize("tp, cp, sp, layer, layer_input", [
    # Korthikanti et al. 2022 table 2 (flash attention: no 5as/h term), s = 4096 / CP tokens, h = 3584, bf16
    (1, 1, False, 4096 * 3584 * 34, 4096 * 3584 * 2),
    (4, 1, False, 4096 * 3584 * (10 + 24 / 4), 4096 * 3584 * 2),  # LN, dropout, residual on every TP rank
    (4, 1, True, 4096 * 3584 * 34 / 4, 4096 * 3584 * 2 / 4),  # SP splits those and the layer input too
    (2, 2, True, 2048 * 3584 * 34 / 2, 2048 * 3584 * 2 / 2),  # CP 2: half of each sequence per GPU
    (2, 4, False, 1024 * 3584 * (10 + 24 / 2), 1024 * 3584 * 2),
    (1, 8, False, 512 * 3584 * 34, 512 * 3584 * 2),
])
def test_activations_divided_by_cp_and_by_tp_only_with_sequence_parallelism(tp, cp, sp, layer, layer_input):
    """A layer's activations and input, with and without full recompute (uniform, 1 layer a chunk:
    every layer's input kept, one layer rematerialised), and the fp32 logits: all over CP; over TP
    only as the paper's table says."""
    arch = arch_from_hf_config(QWEN7B)
    base = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8", "data.max_prompt_length=1024",
            "data.max_response_length=3072", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
            f"actor_rollout_ref.actor.megatron.context_parallel_size={cp}",
            f"actor_rollout_ref.actor.megatron.sequence_parallel={str(sp).lower()}"]
    logits = 4096 / cp * 152064 / tp * 4
    for recompute, expected in ((False, 28 * layer), (True, 28 * layer_input + layer)):
        c = cfg(*base, f"actor_rollout_ref.model.enable_gradient_checkpointing={str(recompute).lower()}")
        actor = estimate(plan_from_config(c), c, arch).roles[0]
        assert actor.activations == int(expected + logits)
        assert ("/ CP" in actor.split) == (cp > 1) and ("with sequence parallelism" in actor.split) == (tp > 1 and sp)


def test_uneven_pipeline_stages_are_planned_by_their_largest_stage():
    """megatron's uneven split: Qwen2-7B's 28 layers at PP4 with 4 on the first and last stages
    leave 10 on each middle stage; at PP2 with 20 on the first stage, 20 (not 14) layers' activations
    of 2 micro-batches in flight, and more parameters than the even split."""
    from megarl.placement.memory import most_stage_layers

    assert most_stage_layers(28, 4, 4, 4) == 10 and most_stage_layers(28, 4) == 7 and most_stage_layers(28, 2, 20) == 20
    assert most_stage_layers(94, 4, None, 22) == 24  # 72 layers over the 3 other stages
    arch = arch_from_hf_config(QWEN7B)
    base = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.max_prompt_length=100",
            "data.max_response_length=100", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.sequence_parallel=true"]
    even = estimate(plan_from_config(cfg(*base)), cfg(*base), arch).roles[0]
    c = cfg(*base, f"{RECOMPUTE}.num_layers_in_first_pipeline_stage=20")
    uneven = estimate(plan_from_config(c), c, arch).roles[0]
    layer, logits = 200 * 3584 * 34 / 4, 200 * 152064 / 4 * 4
    assert even.activations == int(2 * 14 * layer + logits)
    assert uneven.activations == int(2 * 20 * layer + logits)
    assert uneven.states > even.states


def test_cp_groups_follow_megatron_rank_order_and_may_span_nodes():
    """TP 2 x CP 2 x DP 4 on 2 nodes of 8: rank r's TP index is r % 2, its CP index (r // 2) % 2, so a
    CP group is ranks {b + t, b + t + 2} of each run of 4 (megatron-core's order tp-cp-dp-pp). CP 4 x
    TP 4 makes runs of 16: every CP group (ranks t, t + 4, t + 8, t + 12) spans both nodes, which
    megatron allows, and the layout says so."""
    plan = plan_placement(ClusterSpec(2, 8), {"shared": 16}, [train("actor", "shared", tp=2, cp=2)])
    actor = plan.roles["actor"]
    assert actor.dp == 4 and len(actor.cp_groups()) == 8
    assert actor.cp_groups()[:3] == [[Device(0, 0), Device(0, 2)], [Device(0, 1), Device(0, 3)],
                                     [Device(0, 4), Device(0, 6)]]
    assert actor.cp_groups()[-1] == [Device(1, 5), Device(1, 7)]
    assert not actor.cp_spans_nodes() and "span nodes" not in actor.layout()
    wide = plan_placement(ClusterSpec(2, 8), {"shared": 16}, [train("actor", "shared", tp=4, cp=4)]).roles["actor"]
    assert wide.dp == 1 and wide.cp_groups()[1] == [Device(0, 1), Device(0, 5), Device(1, 1), Device(1, 5)]
    assert wide.cp_spans_nodes() and "CP groups span nodes" in wide.layout()


@pytest.mark.parametrize("tp, cp, pp", [(2, 2, 1), (4, 4, 1), (2, 2, 2), (1, 4, 2), (8, 2, 1)])
def test_cp_groups_are_megatron_cores_own(tp, cp, pp):
    """Oracle: megatron-core's RankGenerator with its default order (parallel_state.py,
    initialize_model_parallel's order="tp-cp-ep-dp-pp"), the ranks megarl's engine builds its CP groups from."""
    from megatron.core.parallel_state import RankGenerator

    plan = plan_placement(ClusterSpec(2, 8), {"shared": 16}, [train("actor", "shared", tp=tp, cp=cp, pp=pp)])
    actor = plan.roles["actor"]
    ours = {tuple(actor.devices.index(d) for d in group) for group in actor.cp_groups()}
    megatron = RankGenerator(tp=tp, ep=1, dp=actor.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp").get_ranks("cp")
    assert ours == {tuple(group) for group in megatron}


def test_the_push_phase_by_hand_colocated():
    """Issue 40 (finding 2): the push phase holds the servers' resumed weights, the push's buffers
    and what the training roles keep for it: all their states unless offloaded first (the
    actor's parameters stay: the push reads them)."""
    arch = arch_from_hf_config(QWEN7B)
    base = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8", "placement.gpu_memory_gib=80",
            "data.max_prompt_length=512", "data.max_response_length=512", "actor_rollout_ref.rollout.dtype=bfloat16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    offloads = [f"actor_rollout_ref.actor.megatron.{k}_offload=true" for k in ("param", "grad", "optimizer")]
    buffers = 2 * 512 * 2**20 + 152064 * 3584 * 2  # bucket + its copy, the vocabulary matrix gathered whole
    server_weights = total_params(arch) * 2  # bf16, rollout TP 1
    for keys in ([], offloads):
        c = cfg(*base, *keys)
        est = estimate(plan_from_config(c), c, arch)
        actor = est.roles[0]
        params = stage_params(arch, 1) * 2  # bf16, TP 1
        kept = actor.states if not keys else params  # offloaded first: all but the parameters
        assert est.phases["push"] == int(kept + server_weights + buffers)
        assert est.phases["training"] == actor.states + actor.activations
        assert est.phases["rollout"] == int(0.5 * 80 * 2**30) + actor.states - actor.offloadable
        assert est.peak == max(est.phases.values())
    # A LoRA actor (frozen base: no gradients or optimizer state to speak of) that offloads its
    # parameters while generating, on 28 GiB GPUs: the training and rollout phases fit, the push,
    # with the servers' weights beside the actor's, does not, and only it decides the verdict
    c = cfg(*base, "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.megatron.param_offload=true",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "placement.gpu_memory_gib=28")
    est = estimate(plan_from_config(c), c, arch)
    assert est.phases["training"] < est.gpu_memory and est.phases["rollout"] < est.gpu_memory
    assert est.peak == est.phases["push"] > est.gpu_memory and not est.fits


def test_megarl_plan_command(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN7B))
    base = [sys.executable, "-m", "megarl.cli", "plan", "data.train_files=/x", f"actor_rollout_ref.model.path={model}",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    r = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "gpu7: [shared] actor rank 7, rollout server 7" in r.stdout
    assert "actor: TP 2 x CP 1 x PP 1 x DP 4" in r.stdout
    # colocated on 8 GPUs: tensor (each server TP rank's CUDA IPC copy is made by the actor rank on its GPU)
    assert ("device cuda, training groups cpu:gloo,cuda:nccl, weight sync tensor, trainer env "
            "CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 TORCH_NCCL_ENABLE_MONITORING=1 "
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=1800\n"
            in r.stdout)
    assert ": fits" in r.stdout
    assert "  phases per GPU: training " in r.stdout and ", push " in r.stdout and ", rollout " in r.stdout
    r = subprocess.run(base + ["placement.gpu_memory_gib=24"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "DOES NOT FIT" in r.stdout
    r = subprocess.run(base + ["placement.mode=split", "placement.rollout_gpus=2", "trainer.n_gpus_per_node=4",
                               "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "data.train_batch_size=8",
                               "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=4" in r.stderr


def test_megarl_plan_without_a_local_model_prints_the_map_and_skips_the_estimate(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "plan", "data.train_files=/x",
                        f"actor_rollout_ref.model.path={tmp_path / 'absent'}", "algorithm.adv_estimator=grpo",
                        "actor_rollout_ref.rollout.n=4"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "gpu7: [shared] actor rank 7, rollout server 7" in r.stdout
    assert "memory estimate skipped:" in r.stdout and "not a local HF checkpoint directory (no config.json there)" in r.stdout


def test_megarl_plan_prints_the_weight_update_groups_per_server_rank(capsys):
    """Split placement (distributed transport), actor PP 2 x DP 2 on 4 of 8 GPUs: 2 groups per
    server rank by default (one per pipeline stage), 4 per emitter; colocated on GPUs the tensor
    transport makes none."""
    from megarl.cli import main

    split = ["plan", "--trainer", "rl", "data.train_files=/x", "actor_rollout_ref.model.path=/nowhere",
             "trainer.n_gpus_per_node=8", "placement.mode=split", "placement.rollout_gpus=4",
             "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", "data.train_batch_size=8",
             "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    main(split)
    out = capsys.readouterr().out
    assert "actor: TP 1 x CP 1 x PP 2 x DP 2" in out
    assert ("weight sync: 2 weight-update group(s) per rollout server rank (per_stage, PP 2 x DP 2 x EP 1; "
            "per_emitter: 4)\n") in out
    main(split + ["actor_rollout_ref.rollout.weight_update_groups=per_emitter"])
    assert ("weight sync: 4 weight-update group(s) per rollout server rank (per_emitter, PP 2 x DP 2 x EP 1; "
            "per_stage: 2)\n") in capsys.readouterr().out
    main(split[:5] + ["trainer.n_gpus_per_node=8", "data.train_batch_size=8",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=8"])
    assert "weight sync: no weight-update groups (the tensor transport)\n" in capsys.readouterr().out


def test_the_layout_lines_show_expert_parallelism_over_the_same_gpus():
    """Experts add no GPU: megatron lays EP x ETP over a stage's TP x CP x DP ranks, expert-DP =
    TP x CP x DP / (EP x ETP) (parallel_state.py: world / (ETP x EP x PP)); SGLang lays a server's EP
    ranks over its TP ranks, MoE TP = TP / EP. At EP 1 the lines are as they always were."""
    roles = [RoleSpec("actor", "shared", "train", tp=2, pp=2, ep=4, etp=1),
             RoleSpec("ref", "shared", "train", tp=2, pp=2, ep=2),
             RoleSpec("rollout", "shared", "rollout", tp=4, ep=2)]
    plan = plan_placement(ClusterSpec(2, 8), {"shared": 16}, roles)
    actor, ref, roll = plan.roles["actor"], plan.roles["ref"], plan.roles["rollout"]
    assert actor.world_size == ref.world_size == roll.world_size == 16
    assert actor.layout() == "TP 2 x CP 1 x PP 2 x DP 4 (experts: EP 4 x ETP 1 x expert-DP 2)"  # 2 x 4 / 4
    assert ref.layout() == "TP 2 x CP 1 x PP 2 x DP 4 (experts: EP 2 x ETP 2 x expert-DP 2)"  # ETP None: TP
    assert roll.layout() == "4 server(s) of TP 4 (experts: EP 2 x MoE TP 2)"
    plain = plan_placement(ClusterSpec(1, 8), {"shared": 8}, [train("actor", "shared", tp=2), rollout("shared", tp=2)])
    assert [r.layout() for r in plain.roles.values()] == ["TP 2 x CP 1 x PP 1 x DP 4", "4 server(s) of TP 2"]
    with pytest.raises(PlanError, match=r"rollout: rollout.ep=3 must divide rollout.tp=4 \(a server splits its experts "
                                        r"over its own TP ranks\)"):
        plan_placement(ClusterSpec(1, 8), {"shared": 8},
                       [RoleSpec("rollout", "shared", "rollout", tp=4, ep=3, tp_key="rollout.tp", ep_key="rollout.ep")])


def test_verls_rollout_data_parallel_with_experts_is_one_server_over_all_its_gpus():
    """verl's run_qwen3_5_397b_megatron.sh: rollout tp 8, data_parallel_size 16, expert_parallel_size 128
    on 16 nodes of 8 GPUs. verl's SGLang server takes tp x dp = 128 GPUs (async_sglang_server.py: tp_size
    = tensor_model_parallel_size x data_parallel_size): one server over all 16 nodes, one process per
    node, attention in 16 groups of 8 GPUs (one node each: 128 / 16), the experts over all 128."""
    r = "actor_rollout_ref.rollout."
    plan = plan_from_config(cfg(f"{r}tensor_model_parallel_size=8", f"{r}data_parallel_size=16",
                                f"{r}expert_parallel_size=128", "trainer.nnodes=16", "trainer.n_gpus_per_node=8"))
    roll = plan.roles["rollout"]
    assert roll.dp == 1 and len(roll.server_devices(0)) == 128
    assert roll.server_processes() == [(0, node, 8 * node) for node in range(16)]
    assert roll.layout() == "1 server(s) of TP 128 (attention: DP 16 x TP 8) (experts: EP 128 x MoE TP 1)"


def test_megarl_plan_prints_the_expert_layouts_of_an_moe_recipe(capsys):
    """Issue 45: the Qwen3-30B-A3B recipe's EP 8 actor shows its EP; with rollout EP 4 the servers
    show theirs, and the estimate says how a server GPU holds the experts."""
    from megarl.cli import main

    recipes = Path(__file__).resolve().parents[2] / "configs/recipes"
    recipe = ["plan", "--config", str(recipes / "grpo_qwen3_30b_a3b.yaml"),
              f"actor_rollout_ref.model.path={recipes / 'models/qwen3-30b-a3b'}"]
    assert main(recipe + ["actor_rollout_ref.rollout.expert_parallel_size=4"]) == 0
    out = capsys.readouterr().out
    assert "\nactor: TP 1 x CP 1 x PP 2 x DP 8 (experts: EP 8 x ETP 1 x expert-DP 1), 1/3 of a GPU" in out
    assert "\nrollout: 4 server(s) of TP 4 (experts: EP 4 x MoE TP 1), 1/3 of a GPU" in out
    assert "experts per server GPU: 32 of 128 per layer, each whole (EP 4 x MoE TP 1 = TP 4)\n" in out
    assert main(recipe) == 0
    out = capsys.readouterr().out
    assert "\nrollout: 4 server(s) of TP 4, 1/3 of a GPU" in out
    assert "experts per server GPU: 128 of 128 per layer, each split over 4 GPUs (EP 1 x MoE TP 4 = TP 4)\n" in out


def test_megarl_plan_refuses_a_rollout_ep_the_model_cannot_take(tmp_path, capsys):
    """SGLang gives each EP rank num_experts / ep_size experts and asserts the division is exact
    (fused_moe_triton/layer.py): 6 experts do not split over 4 EP ranks; a dense model has none."""
    from megarl.cli import main

    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({
        **QWEN7B, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 6,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "head_dim": 128, "norm_topk_prob": True}))
    args = ["plan", "--trainer", "rl", "data.train_files=/x", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"]
    assert main(args + [f"actor_rollout_ref.model.path={moe}", "actor_rollout_ref.rollout.expert_parallel_size=2"]) == 0
    assert "experts per server GPU: 3 of 6 per layer, each split over 2 GPUs" in capsys.readouterr().out
    assert main(args + [f"actor_rollout_ref.model.path={moe}", "actor_rollout_ref.rollout.expert_parallel_size=4"]) == 1
    assert ("memory estimate impossible: actor_rollout_ref.rollout.expert_parallel_size=4 must divide the model's 6 "
            "routed experts per layer (SGLang gives each EP rank the same number of them)\n") in capsys.readouterr().out
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps(QWEN7B))
    assert main(args + [f"actor_rollout_ref.model.path={dense}", "actor_rollout_ref.rollout.expert_parallel_size=2"]) == 1
    assert ("actor_rollout_ref.rollout.expert_parallel_size=2: the model is not a mixture of experts, so there are "
            "no experts to split; set 1") in capsys.readouterr().out


def test_a_dense_model_with_a_bad_layout_gets_only_the_dense_message():
    """Issue 45: TP 3 on 8 GPUs is one mistake, named once; the expert layout message belongs to
    roles whose experts lie apart from the dense layers (EP > 1, or ETP != TP)."""
    from megarl.config import ConfigError

    with pytest.raises(ConfigError) as info:
        cfg("trainer.n_gpus_per_node=6", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4")
    message = str(info.value)
    assert "actor_rollout_ref.actor.megatron: TP x PP x CP = 3 x 4 x 1 = 12 GPUs per model replica" in message
    assert "ETP x EP x PP" not in message
    with pytest.raises(ConfigError, match=r"ETP x EP x PP = 3 x 4 x 1 does not divide the 6 training GPUs"):
        cfg("trainer.n_gpus_per_node=6", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=4")
