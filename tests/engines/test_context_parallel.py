"""Context parallelism in the megatron engine (CPU, gloo, 2 ranks; context_parallel_world.py): at CP2
(megarl's CPU reference CP attention, each rank holding 2 of 4 sequence chunks) the actor's
log-probs and entropies equal HF's own model (fp32) and the CP1 actor's, and one PPO step gives
the CP1 step's metrics (gradient norm included) and weights; the critic's values and update, the
reward model's scores (HF's sequence classification) and an MoE actor's log-probs, update and
expert counts (its own routing and replayed routes) are those at CP1; a checkpoint saved at CP2
loads at CP1 with identical weights; one output rank per replica, and only CP rank 0 sends the
weights to the rollout (the CP1 run's tensors). Packed (THD) sequences, each padded to a multiple of
2 CP and cut into chunks one sequence at a time, give the same at CP1 and CP2 (actor, critic, reward
model, MoE actor). On 4 ranks, TP2 x CP2, with and without sequence parallelism and packing, scores
as HF and steps as TP1, and an odd-shaped GQA model (6 query heads over 2 groups, head_dim 12 with
hidden 40, 3 layers) scores as HF at TP2 + SP, CP2 and TP2 x CP2, packed and not.

To fp32 rounding, not bit for bit: at CP2 the attention runs over the gathered keys in another
order and shape, sequences are padded to a multiple of 4, and each weight gradient is the sum of
two CP ranks' parts. Measured on 0.16.1: log-probs within 4.8e-7, weights after one Adam step
within 9.1e-7.
"""
import pytest
import torch
from context_parallel_world import ODD_CASES, TEMPERATURE, context_parallel_world, tp2_cp2_world
from engine_world import ragged_batch, training_batch
from sequence_parallel_world import forced_routes
from test_megatron_engine import close, hf_reference
from test_reward_model import hf_scores, reward_model  # noqa: F401  (reward_model: the fixture)
from test_sequence_parallel import _hand_count, moe_dir  # noqa: F401  (moe_dir: the fixture)

from megarl.bridge import arch_from_hf_config, load_hf_config
from megarl.testing import run_gloo_workers
from megarl.engines.megatron.sequences import micro_batch_groups

pytestmark = pytest.mark.slow  # a 2-rank megatron world (11 engines), a 4-rank one (2 actors): ~2 min on 2 cores


@pytest.fixture(scope="module")
def run(tiny_models, reward_model, moe_dir, tmp_path_factory):  # noqa: F811
    checkpoint = tmp_path_factory.mktemp("cp_ckpt") / "actor"
    return run_gloo_workers(context_parallel_world, 2,
                            args=(tiny_models, str(reward_model), str(moe_dir), str(checkpoint)), timeout_s=600)


@pytest.fixture(scope="module")
def hf_qwen2(tiny_models):
    """HF's (log-probs, entropies) of training_batch() at TEMPERATURE: the oracle of several tests, computed once."""
    return hf_reference(tiny_models["qwen2"], training_batch(), TEMPERATURE)[:2]


def _whole(run, case, role, key, part):
    """`key`'s `part` over the whole batch: each DP replica's output rank, in DP order (`role` None:
    the case holds the role's results itself)."""
    results = [rank[case] if role is None else rank[case][role] for rank in run]
    found = sorted((r["dp_rank"], r[key][part]) for r in results if r[key] is not None)
    return torch.cat([value for _, value in found])


def test_cp2_runs_the_cpu_reference_attention_on_half_of_each_sequence_with_one_output_rank(run):
    for rank in run:
        cp1, cp2 = rank["cp1"]["actor"], rank["cp2"]["actor"]
        assert cp1["core_attention"] == cp2["core_attention"] == "CpuReferenceAttention"  # CP1: its causal kernel path
        # CP1 at DP2 holds half of the batch; CP2 the whole batch, each sequence padded to a multiple of 4, halved
        assert all(n % 2 == 0 for n in cp2["input_lengths"]) and any(n % 4 for n in cp1["input_lengths"])
    assert [rank["cp2"]["actor"]["output_rank"] for rank in run] == [True, False]  # CP rank 0 of DP replica 0
    assert [rank["cp1"]["actor"]["output_rank"] for rank in run] == [True, True]  # DP2


def test_a_token_budget_is_per_gpu_as_verls(run):
    """A budget of 30 tokens per GPU: at CP2 a micro-batch holds 60 tokens (30 on each CP rank)."""
    lengths = training_batch().token_lengths().tolist()
    for rank in run:
        groups = rank["cp2"]["actor"]["budget_groups"]
        assert groups == micro_batch_groups(lengths, max_tokens=60) != micro_batch_groups(lengths, max_tokens=30)
        assert max(sum(lengths[i] for i in g) for g in groups) > 30


def test_only_cp_rank_0_emits_the_weights_and_they_are_cp1s(run):
    """The weight-sync resharder after the update: CP rank 1 holds the same weights and sends none;
    what CP rank 0 sends is every HF tensor, as the CP1 actor's replica 0 sends them."""
    cp2 = [rank["cp2"]["actor"]["synced"] for rank in run]
    cp1 = run[0]["cp1"]["actor"]["synced"]
    assert cp2[1] is None and run[1]["cp1"]["actor"]["synced"] is None
    assert cp2[0].keys() == cp1.keys() and len(cp1) > 0
    for name in cp1:
        torch.testing.assert_close(cp2[0][name], cp1[name], rtol=0, atol=1e-5)


def test_cp2_log_probs_equal_hf_and_cp1(run, hf_qwen2):
    hf_log_probs, hf_entropy = hf_qwen2
    for case in ("cp1", "cp2"):
        close(_whole(run, case, "actor", "scored", "log_probs"), hf_log_probs)
        close(_whole(run, case, "actor", "scored", "entropy"), hf_entropy)


def test_cp2_training_step_equals_cp1(run):
    cp1, cp2 = run[0]["cp1"]["actor"]["metrics"], run[0]["cp2"]["actor"]["metrics"]
    assert run[1]["cp2"]["actor"]["metrics"] == cp2  # the same on both CP ranks
    for key, value in cp1.items():
        assert cp2[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert cp2["actor/ppo_kl"] == 0.0 and cp2["actor/grad_norm"] > 0
    for rank in run:
        a, b = rank["cp1"]["actor"]["state"], rank["cp2"]["actor"]["state"]
        assert a.keys() == b.keys()
        for chunk in a:
            for name in a[chunk]:
                torch.testing.assert_close(b[chunk][name], a[chunk][name], rtol=0, atol=1e-5)
    after = _whole(run, "cp2", "actor", "after", "log_probs")
    close(after, _whole(run, "cp1", "actor", "after", "log_probs"))
    assert (after - _whole(run, "cp2", "actor", "scored", "log_probs")).abs().max() > 1e-4  # the step moved it


def test_a_cp2_checkpoint_loads_at_cp1_with_identical_weights(run):
    for rank in run:
        saved, loaded = rank["cp2"]["actor"]["state"], rank["resumed"]["state"]
        assert saved.keys() == loaded.keys() and rank["resumed"]["updates"] == 1
        assert all(torch.equal(saved[c][n], loaded[c][n]) for c in saved for n in saved[c])


def test_cp2_critic_equals_cp1(run):
    for key in ("values", "after"):
        close(_whole(run, "cp2", "critic", key, "values"), _whole(run, "cp1", "critic", key, "values"))
    cp1, cp2 = run[0]["cp1"]["critic"]["metrics"], run[0]["cp2"]["critic"]["metrics"]
    for key, value in cp1.items():
        assert cp2[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_cp2_reward_model_scores_equal_hf(run, reward_model):  # noqa: F811
    scores = [rank["rm_scores"] for rank in run]
    assert scores[1] is None  # CP rank 1 is no output rank
    close(scores[0]["rm_scores"], hf_scores(reward_model, ragged_batch(10, seed=3)))


def _moe(run, case, key, part="log_probs"):
    found = sorted((rank["moe"][case]["dp_rank"], rank["moe"][case][key][part]) for rank in run
                   if rank["moe"][case][key] is not None)
    return torch.cat([v for _, v in found]) if part != "expert_tokens" else sum(v for _, v in found)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("replay", [False, True], ids=["own_routing", "replay"])
def test_a_moe_actor_at_cp2_equals_cp1(run, moe_dir, replay, layout):  # noqa: F811
    cp2 = "cp2" if layout == "padded" else "cp2_packed"
    cp1, cp2 = ("cp1_replay", cp2 + "_replay") if replay else ("cp1", cp2)
    for key in ("scored", "after"):
        close(_moe(run, cp2, key), _moe(run, cp1, key))
    for key, value in run[0]["moe"][cp1]["metrics"].items():
        assert run[0]["moe"][cp2]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    counts = _moe(run, cp2, "scored", "expert_tokens")
    assert torch.equal(counts, _moe(run, cp1, "scored", "expert_tokens"))
    if replay:
        arch = arch_from_hf_config(load_hf_config(moe_dir))
        batch = training_batch()
        forced_routes(batch, arch.num_layers, arch.moe.num_experts, arch.moe.topk)
        assert torch.equal(counts, _hand_count(batch, arch.num_layers, arch.moe.num_experts))


# ---------------------------------------------------------------------------------- packed sequences
def test_packed_sequences_at_cp1_and_cp2_score_as_hf_and_step_as_padded_cp1(run, hf_qwen2):
    hf_log_probs, hf_entropy = hf_qwen2
    for case in ("cp1_packed", "cp2_packed"):
        for rank in run:
            actor = rank[case]["actor"]
            assert actor["sequence_layout"] == "packed" and actor["core_attention"] == "CpuReferenceAttention"
        close(_whole(run, case, "actor", "scored", "log_probs"), hf_log_probs)
        close(_whole(run, case, "actor", "scored", "entropy"), hf_entropy)
        base, mine = run[0]["cp1"]["actor"]["metrics"], run[0][case]["actor"]["metrics"]
        for key, value in base.items():
            assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (case, key)
        assert mine["actor/ppo_kl"] == 0.0
        close(_whole(run, case, "actor", "after", "log_probs"), _whole(run, "cp1", "actor", "after", "log_probs"))
    # CP2: one packed sequence per micro-batch, each rank holding half of every (padded) sample
    assert all(n % 2 == 0 for rank in run for n in rank["cp2_packed"]["actor"]["input_lengths"])
    assert [rank["cp2_packed"]["actor"]["output_rank"] for rank in run] == [True, False]
    for rank in run:
        a, b = rank["cp1"]["actor"]["state"], rank["cp2_packed"]["actor"]["state"]
        for chunk in a:
            for name in a[chunk]:
                torch.testing.assert_close(b[chunk][name], a[chunk][name], rtol=0, atol=1e-5)


def test_packed_cp2_critic_and_reward_model_equal_cp1_and_hf(run, reward_model):  # noqa: F811
    for key in ("values", "after"):
        close(_whole(run, "cp2_packed", "critic", key, "values"), _whole(run, "cp1", "critic", key, "values"))
    scores = [rank["rm_scores_packed"] for rank in run]
    assert scores[1] is None
    close(scores[0]["rm_scores"], hf_scores(reward_model, ragged_batch(10, seed=3)))


# ------------------------------------------------------------------------------------------ TP2 x CP2
@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    """Odd-shaped GQA: 3 layers, 6 query heads over 2 key/value groups, head_dim 12 (6 x 12 != hidden 40),
    q/k norms (Qwen3)."""
    from megarl.data.tiny_model import make_tiny_model

    return make_tiny_model("qwen3", tmp_path_factory.mktemp("odd") / "qwen3", layers=3, hidden=40, heads=6, kv_heads=2,
                           head_dim=12, intermediate=56, tie=False, seed=7)


@pytest.fixture(scope="module")
def hf_odd(odd_model):
    """HF's (log-probs, entropies) of training_batch() at TEMPERATURE by the odd-shaped model, computed once."""
    return hf_reference(odd_model, training_batch(), TEMPERATURE)[:2]


@pytest.fixture(scope="module")
def tp2_cp2_run(tiny_models, odd_model):
    return run_gloo_workers(tp2_cp2_world, 4, args=(tiny_models, str(odd_model)), timeout_s=600)


@pytest.mark.parametrize("case", [case[0] for case in ODD_CASES])
def test_an_odd_shaped_gqa_model_scores_as_hf_at_tp2_sp_cp2_and_tp2_cp2(tp2_cp2_run, hf_odd, case):
    hf_log_probs, hf_entropy = hf_odd
    assert tp2_cp2_run[0][case]["sequence_layout"] == ("packed" if "packed" in case else "padded")
    close(_whole(tp2_cp2_run, case, None, "scored", "log_probs"), hf_log_probs)
    close(_whole(tp2_cp2_run, case, None, "scored", "entropy"), hf_entropy)


@pytest.mark.parametrize("case", ["tp2_cp2_sp", "tp2_cp2_packed", "tp2_cp2_sp_packed"])
def test_tp2_cp2_scores_as_hf_and_steps_as_tp1(tp2_cp2_run, hf_qwen2, case):
    """4 ranks: TP2 x CP2, padded with sequence parallelism (sequences padded to a multiple of 4, each
    rank holding half of them and splitting that over TP) and packed without and with it, against
    TP1 at DP4."""
    hf_log_probs, hf_entropy = hf_qwen2
    assert [rank[case]["output_rank"] for rank in tp2_cp2_run] == [True, False, False, False]
    assert tp2_cp2_run[0][case]["sequence_layout"] == ("packed" if "packed" in case else "padded")
    assert all(n % 2 == 0 for rank in tp2_cp2_run for n in rank[case]["input_lengths"])
    close(_whole(tp2_cp2_run, case, None, "scored", "log_probs"), hf_log_probs)
    close(_whole(tp2_cp2_run, case, None, "scored", "entropy"), hf_entropy)
    base, mine = tp2_cp2_run[0]["tp1"]["metrics"], tp2_cp2_run[0][case]["metrics"]
    assert all(rank[case]["metrics"] == mine for rank in tp2_cp2_run)
    for key, value in base.items():
        assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    close(_whole(tp2_cp2_run, case, None, "after", "log_probs"),
          _whole(tp2_cp2_run, "tp1", None, "after", "log_probs"))
