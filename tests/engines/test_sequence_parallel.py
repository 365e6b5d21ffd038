"""Sequence parallelism in the megatron engine (CPU, gloo, 2 ranks at TP2; sequence_parallel_world.py):
the actor's log-probs and entropies with `sequence_parallel` equal HF's own model (fp32), and the
same actor and critic steps with and without it give the same scores, update metrics and weights.
A tiny MoE actor trains at TP2 with it (megatron-core's condition for MoE layers at TP > 1) as at
TP1: the same log-probs (and HF's), update, expert counts, and with routing replay the same
log-probs on the replayed routes, whose counts equal a hand count of those routes.

To fp32 rounding, not bit for bit: sequence parallelism reduce-scatters where TP alone all-reduces
(the same two-term sums), but it also pads each micro-batch to an even length (another attention
shape) and sums the norms' weight gradients per rank before the TP all-reduce (another order of the
same float additions). Measured on 0.16.1: log-probs within 4.8e-7, weights after one Adam step within
6e-7 (Adam's first step is about lr x sign(g), so rounding in a tiny gradient shows in the weights).
"""
import pytest
import torch
from engine_world import training_batch
from sequence_parallel_world import TEMPERATURE, forced_routes, sequence_parallel_world
from test_megatron_engine import close, hf_reference

from megarl.bridge import arch_from_hf_config, load_hf_config
from megarl.data.tiny_model import make_tiny_model
from megarl.testing import run_gloo_workers

pytestmark = pytest.mark.slow  # one 2-rank megatron world, six actors and two critics: about 70 s on 2 cores


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe", layers=2, hidden=64, heads=4,
                           kv_heads=2, intermediate=32, seed=3)


@pytest.fixture(scope="module")
def run(tiny_models, moe_dir):
    return run_gloo_workers(sequence_parallel_world, 2, args=(tiny_models, str(moe_dir)), timeout_s=500)


def _output(run, case, role, key):
    return next(rank[case][role][key] for rank in run if rank[case][role][key] is not None)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_sequence_parallelism_runs_where_asked(run, role):
    """With it, the final norm sees half of each (even-padded) sequence and the norms' gradients are
    tagged for the TP sum; without it, whole unpadded sequences."""
    for rank in run:
        plain, sp = rank["tp2"][role]["built"], rank["tp2_sp"][role]["built"]
        assert not plain["sequence_parallel"] and not plain["norms_tagged"]
        assert sp["sequence_parallel"] and sp["norms_tagged"]
        assert plain["padded_lengths"] == plain["lengths"] and any(n % 2 for n in plain["lengths"])
        assert sp["padded_lengths"] == [n + n % 2 for n in sp["lengths"]]
        assert sp["seen_rows"] == [n // 2 for n in sp["padded_lengths"]] * 3
        assert plain["seen_rows"] == plain["lengths"] * 3  # scoring, the update, scoring again


def test_actor_log_probs_with_sequence_parallelism_equal_hf(run, tiny_models):
    hf_log_probs, hf_entropy, _ = hf_reference(tiny_models["qwen2"], training_batch(), TEMPERATURE)
    scored = _output(run, "tp2_sp", "actor", "scored")
    close(scored["log_probs"], hf_log_probs)
    close(scored["entropy"], hf_entropy)


def _same_state(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for chunk in a:
        assert a[chunk].keys() == b[chunk].keys()
        for name in a[chunk]:
            torch.testing.assert_close(a[chunk][name], b[chunk][name], rtol=0, atol=atol)


def test_actor_step_with_sequence_parallelism_equals_the_step_without(run):
    plain, sp = (_output(run, case, "actor", "scored") for case in ("tp2", "tp2_sp"))
    close(sp["log_probs"], plain["log_probs"])
    close(sp["entropy"], plain["entropy"])
    for rank in run:
        a, b = rank["tp2"]["actor"], rank["tp2_sp"]["actor"]
        assert a["metrics"].keys() == b["metrics"].keys()
        for key, value in a["metrics"].items():
            assert b["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        assert a["metrics"]["actor/grad_norm"] > 0 and a["metrics"]["actor/ppo_kl"] == b["metrics"]["actor/ppo_kl"] == 0
        _same_state(a["state"], b["state"], atol=1e-5)
    after_plain, after_sp = (_output(run, case, "actor", "after")["log_probs"] for case in ("tp2", "tp2_sp"))
    close(after_sp, after_plain)
    assert (after_plain - plain["log_probs"]).abs().max() > 1e-4  # the update moved the policy


def test_critic_step_with_sequence_parallelism_equals_the_step_without(run):
    for key in ("values", "after"):
        plain, sp = (_output(run, case, "critic", key)["values"] for case in ("tp2", "tp2_sp"))
        close(sp, plain)
    for rank in run:
        a, b = rank["tp2"]["critic"], rank["tp2_sp"]["critic"]
        for key, value in a["metrics"].items():
            assert b["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        _same_state(a["state"], b["state"], atol=1e-5)
    before, after = (_output(run, "tp2", "critic", key)["values"] for key in ("values", "after"))
    assert (after - before).abs().max() > 1e-4


# ------------------------------------------------------------------------------------------ MoE
def _moe(run, case: str, key: str, part: str = "log_probs") -> torch.Tensor:
    """A MoE case's `key` output over the whole batch: its DP replicas' output ranks in DP order."""
    found = sorted((rank["moe"][case]["dp_rank"], rank["moe"][case][key][part]) for rank in run
                   if rank["moe"][case][key] is not None)
    return torch.cat([value for _, value in found]) if part != "expert_tokens" else sum(v for _, v in found)


def _hand_count(batch, num_layers: int, num_experts: int) -> torch.Tensor:
    """[L, E]: each expert's tokens in the batch's routes, over every real token but each sample's last."""
    counts = torch.zeros(num_layers, num_experts, dtype=torch.int32)
    for i in range(len(batch)):
        prompt = batch["prompt_routed_experts"][i][batch["prompt_mask"][i].bool()]
        response = batch["routed_experts"][i][batch["response_mask"][i].bool()][:-1]
        for routes in torch.cat([prompt, response]).long():  # [L, K] of one token
            for layer in range(num_layers):
                counts[layer, routes[layer]] += 1
    return counts


@pytest.mark.parametrize("replay", [False, True], ids=["own_routing", "replay"])
def test_a_moe_actor_trains_at_tp2_with_sequence_parallelism_as_at_tp1(run, moe_dir, replay):
    tp1, sp = ("tp1_replay", "tp2_sp_replay") if replay else ("tp1", "tp2_sp")
    for key in ("scored", "after"):
        close(_moe(run, sp, key), _moe(run, tp1, key))
    close(_moe(run, sp, "scored", "entropy"), _moe(run, tp1, "scored", "entropy"))
    assert (_moe(run, tp1, "after") - _moe(run, tp1, "scored")).abs().max() > 1e-4  # the update moved it
    a, b = run[0]["moe"][tp1]["metrics"], run[0]["moe"][sp]["metrics"]
    for key, value in a.items():
        assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert torch.equal(_moe(run, sp, "scored", "expert_tokens"), _moe(run, tp1, "scored", "expert_tokens"))
    if replay:  # the counts are those of the replayed routes
        arch = arch_from_hf_config(load_hf_config(moe_dir))
        batch = training_batch()
        forced_routes(batch, arch.num_layers, arch.moe.num_experts, arch.moe.topk)
        assert torch.equal(_moe(run, sp, "scored", "expert_tokens"),
                           _hand_count(batch, arch.num_layers, arch.moe.num_experts))
    else:  # its own routing: the log-probs are HF's model's
        hf_log_probs, _, _ = hf_reference(moe_dir, training_batch(), TEMPERATURE)
        close(_moe(run, sp, "scored"), hf_log_probs)
