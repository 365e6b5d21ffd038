"""Rollout expert parallelism against SGLang 0.5.23's own code, taken from the wheel (as
test_sglang_flags.py does; sglang itself needs a GPU stack) and run as is:

* the layout: megarl's config rule refuses exactly the (TP, EP) pairs SGLang's topology check
  refuses (`runtime_context.py`: derive_parallel_widths, derive_spawn_ranks, _validate_parallel);
* the weight push: every expert tensor megarl sends (the HF names of `WeightMap`, which are the
  names transformers writes) is mapped by the model's `load_weights` expert mapping
  (`FusedMoE.make_expert_params_mapping`, with the checkpoint names each model file passes it) to
  its own expert, and kept by exactly the ranks of the EP rank that owns it
  (`FusedMoE._map_global_expert_id_to_local_expert_id`), at every EP a server of TP 8 takes.
"""
from __future__ import annotations

import ast
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors import safe_open

from megarl.bridge import WeightMap, arch_from_hf_config, load_hf_config
from megarl.config import load_config
from megarl.config.rules import DerivedSizes
from megarl.config.rules.experts import rollout_expert_parallel_fits_server
from megarl.config.validate import resolve
from megarl.data.tiny_model import MOE_ARCHITECTURES, make_tiny_model

sys.path.insert(0, str(Path(__file__).parent))  # the wheel's download and cache, shared with the flag checks
from test_sglang_flags import sglang_wheel  # noqa: E402

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]
MODEL_FILES = {"qwen3_moe": "qwen3_moe.py", "qwen2_moe": "qwen2_moe.py", "mixtral": "mixtral.py"}
FUSED_MOE = "sglang/srt/layers/moe/fused_moe_triton/layer.py"


def wheel_code(wheel, path: str, names: set[str], cls: str | None = None) -> dict:
    """The functions (and module-level assignments) `names` of the wheel's `path` (methods of class
    `cls`, their decorators dropped so that they run as plain functions), executed as written."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read(path))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body if cls else tree.body
    nodes = []
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            nodes.append(node)
        elif isinstance(node, ast.Assign) and {getattr(t, "id", None) for t in node.targets} & names:
            nodes.append(node)
    found = {getattr(n, "name", None) or n.targets[0].id for n in nodes}
    assert found == names, f"{path}: the wheel's layout changed, missing {names - found}"
    namespace: dict = {"Any": object, "Optional": object, "List": list, "Tuple": tuple}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def wheel():
    return sglang_wheel()


# ----------------------------------------------------------------------------- layout
def sglang_refuses(topology: dict, tp: int, ep: int) -> bool:
    """Whether SGLang cannot lay out a server of `tp` GPUs at `ep_size` ep (moe_dp_size 1, no
    attention DP/CP, as megarl starts it): its topology check fails, or ranks cannot be derived."""
    widths = topology["derive_parallel_widths"](tp_size=tp, attn_cp_size=1, attn_dp_size=1, moe_ep_size=ep,
                                                moe_dp_size=1, dcp_size=1, dcp_enabled=False)
    try:
        for rank in range(tp):
            ranks = topology["derive_spawn_ranks"](world_rank=rank, tp_size=tp, ep_join_rank_offset=0, attn_cp_size=1,
                                                   attn_tp_size=widths["attn_tp_size"], moe_dp_size=1, moe_ep_size=ep)
            parallel = SimpleNamespace(tp_size=tp, tp_rank=ranks["tp_rank"], moe_ep_size=ep, moe_dp_size=1,
                                       moe_ep_rank=ranks["moe_ep_rank"], moe_tp_size=widths["moe_tp_size"])
            topology["_validate_parallel"](parallel, "megarl's test")
    except (ValueError, ZeroDivisionError):
        return True
    return False


def megarl_refuses(tp: int, ep: int, engine: str = "sglang") -> list[str]:
    config = resolve(load_config(None, [*REQUIRED, f"actor_rollout_ref.rollout.name={engine}",
                                        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                                        f"actor_rollout_ref.rollout.expert_parallel_size={ep}"]))
    return list(rollout_expert_parallel_fits_server(config, DerivedSizes.from_config(config)))


def test_the_rollout_ep_rule_refuses_exactly_what_sglangs_topology_check_refuses(wheel):
    topology = wheel_code(wheel, "sglang/srt/runtime_context.py", {
        "derive_attn_tp_size", "derive_parallel_widths", "derive_spawn_ranks", "_validate_parallel",
        "_RANK_AND_WIDTH", "_WIDTH_AND_GROUP", "_UNREADABLE"})
    assert not sglang_refuses(topology, 8, 4) and sglang_refuses(topology, 8, 3)  # the oracle tells them apart
    cases = [(tp, ep) for tp in (1, 2, 3, 4, 6, 8, 12, 16) for ep in range(1, 17)]
    differ = [(tp, ep) for tp, ep in cases if bool(megarl_refuses(tp, ep)) != sglang_refuses(topology, tp, ep)]
    assert differ == []
    assert sum(sglang_refuses(topology, tp, ep) for tp, ep in cases) > len(cases) // 2  # most pairs are refused


def test_the_rollout_ep_messages_name_the_keys_and_a_size_that_works():
    assert megarl_refuses(4, 4) == megarl_refuses(8, 2) == []
    assert megarl_refuses(4, 3) == [
        "actor_rollout_ref.rollout.expert_parallel_size=3 must divide "
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4: SGLang splits a server's experts over its own 4 "
        "GPU(s), its TP ranks (tp_size = ep_size x MoE TP size), so try expert_parallel_size=2"]
    assert megarl_refuses(4, 8)[0].endswith("so try expert_parallel_size=4 or tensor_model_parallel_size=8")
    assert megarl_refuses(1, 1, "cpu") == []
    assert megarl_refuses(1, 2, "cpu") == [
        "actor_rollout_ref.rollout.expert_parallel_size=2: megarl's CPU engine (actor_rollout_ref.rollout.name=cpu) "
        "serves a whole model in one process and splits no experts, so it takes 1 only; SGLang "
        "(rollout.name=sglang) splits them"]


# ----------------------------------------------------------------------------- weight push
@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe")
    return {a: make_tiny_model(a, root / a, layers=2, hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=8,
                               seed=i) for i, a in enumerate(MOE_ARCHITECTURES)}


def expert_checkpoint_names(wheel, model_file: str) -> dict[str, str]:
    """The checkpoint names (`ckpt_gate_proj_name`, ...) the model file of the wheel gives
    `FusedMoE.make_expert_params_mapping` in its `load_weights`."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read(f"sglang/srt/models/{model_file}"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "make_expert_params_mapping"]
    assert len(calls) == 1, model_file
    return {k.arg: k.value.value for k in calls[0].keywords if isinstance(k.value, ast.Constant)}


def loaded_experts(fused_moe: dict, mapping: list, names: list[str], experts: int, ep: int, ep_rank: int) -> dict:
    """{name: (local expert, shard)} of the expert tensors among `names` that a rank of EP rank
    `ep_rank` keeps, as the models' load_weights loop and FusedMoE.weight_loader decide; the
    FusedMoE fields as its __init__ sets them without shared experts or elastic EP
    (_num_global_routed = E, _num_local_routed = E / ep, _expert_storage_rank = moe_ep_rank)."""
    layer = SimpleNamespace(_expert_storage_rank=ep_rank, _num_local_routed=experts // ep, _has_fused_shared=False,
                            _num_global_routed=experts)
    kept = {}
    for name in names:
        for _, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:  # the loop's `if weight_name not in name: continue`
                local = fused_moe["_map_global_expert_id_to_local_expert_id"](layer, expert_id)
                if local != -1:
                    kept[name] = (local, shard_id)
                break
    return kept


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_each_expert_tensor_of_a_push_is_kept_by_the_ep_rank_that_owns_it(arch, wheel, moe_dirs):
    fused_moe = wheel_code(wheel, FUSED_MOE, {"make_expert_params_mapping", "_map_global_expert_id_to_local_expert_id"},
                           cls="FusedMoE")
    topology = wheel_code(wheel, "sglang/srt/runtime_context.py", {"derive_spawn_ranks"})
    weights = WeightMap(arch_from_hf_config(load_hf_config(moe_dirs[arch])), 128)
    with safe_open(str(moe_dirs[arch] / "model.safetensors"), "pt") as f:
        assert sorted(weights.hf_names()) == sorted(f.keys())  # what the push sends: transformers' own names
    experts = weights.arch.moe.num_experts
    assert experts == 8
    mapping = fused_moe["make_expert_params_mapping"](None, num_experts=experts,
                                                      **expert_checkpoint_names(wheel, MODEL_FILES[arch]))
    pushed = [n for n in weights.hf_names() if ".experts." in n]
    assert len(pushed) == 2 * experts * 3  # 2 layers x 8 experts x gate, up, down
    shards = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
    tp = 8
    for ep in (1, 2, 4, 8):
        keepers: dict[str, list[int]] = {n: [] for n in pushed}
        for tp_rank in range(tp):
            ep_rank = topology["derive_spawn_ranks"](world_rank=tp_rank, tp_size=tp, ep_join_rank_offset=0,
                                                     attn_cp_size=1, attn_tp_size=tp, moe_dp_size=1,
                                                     moe_ep_size=ep)["moe_ep_rank"]
            kept = loaded_experts(fused_moe, mapping, weights.hf_names(), experts, ep, ep_rank)
            assert set(kept) <= set(pushed)  # no dense tensor is taken for an expert
            for name, (local, shard) in kept.items():
                expert = int(name.split(".experts.")[1].split(".")[0])
                assert expert // (experts // ep) == ep_rank and local == expert % (experts // ep), (ep, name)
                assert shard == shards[name.split(".")[-2]], name
                keepers[name].append(tp_rank)
        # every expert tensor reaches the tp / ep ranks of its EP rank (its MoE TP group), and no other
        assert all(len(ranks) == tp // ep for ranks in keepers.values()), ep
        assert {tuple(ranks) for ranks in keepers.values()} == {
            tuple(range(r * tp // ep, (r + 1) * tp // ep)) for r in range(ep)}


def test_a_misnamed_expert_reaches_no_rank(wheel):
    """Negative control: Mixtral's expert names under Qwen3-MoE's mapping are no expert to SGLang."""
    fused_moe = wheel_code(wheel, FUSED_MOE, {"make_expert_params_mapping", "_map_global_expert_id_to_local_expert_id"},
                           cls="FusedMoE")
    mapping = fused_moe["make_expert_params_mapping"](None, num_experts=8,
                                                      **expert_checkpoint_names(wheel, "qwen3_moe.py"))
    names = ["model.layers.0.block_sparse_moe.experts.3.w1.weight", "model.layers.0.mlp.experts.3.gate_proj.weight"]
    assert loaded_experts(fused_moe, mapping, names, 8, 1, 0) == {names[1]: (3, "w1")}
