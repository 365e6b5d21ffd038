"""Uneven pipeline stages (megatron's `num_layers_in_first_pipeline_stage` /
`num_layers_in_last_pipeline_stage`, verl's Qwen3-235B-A22B example; CPU, gloo;
uneven_stages_world.py): megatron builds the stages asked for, the actor's log-probs equal HF's at
PP2 ([1, 3] and [3, 1] layers of the tiny 4-layer Qwen2) and PP3 ([2, 1, 1], and [1, 2, 1] by
`account_for_embedding/loss_in_pipeline_split`), one PPO step equals
the PP1 step, the weight-sync resharder sends the PP1 run's tensors, and a checkpoint saved at the
uneven PP2 loads at PP1 bit for bit.
"""
import pytest
import torch
from test_context_parallel import _whole
from test_megatron_engine import close, hf_reference
from uneven_stages_world import TEMPERATURE, pp3_world, uneven_world

from engine_world import training_batch
from megarl.testing import run_gloo_workers

pytestmark = pytest.mark.slow  # a 2-rank world (4 actors) and a 3-rank one (1 actor)


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("uneven_ckpt") / "actor"
    return run_gloo_workers(uneven_world, 2, args=(str(tiny_models["qwen2"]), str(checkpoint)), timeout_s=600)


@pytest.fixture(scope="module")
def run3(tiny_models):
    return run_gloo_workers(pp3_world, 3, args=(str(tiny_models["qwen2"]),), timeout_s=600)


def test_megatron_builds_the_stages_asked_for(run, run3):
    assert [rank["first1"]["layers"] for rank in run] == [[1], [2, 3, 4]]
    assert [rank["last1"]["layers"] for rank in run] == [[1, 2, 3], [4]]
    assert [rank["layers"] for rank in run3] == [[1, 2], [3], [4]]
    # account_for_embedding/loss_in_pipeline_split: megatron's own split, [1, 2, 1]
    assert [rank["split"]["layers"] for rank in run3] == [[1], [2, 3], [4]]


def test_uneven_stages_score_as_hf(run, run3, tiny_models):
    hf_log_probs, hf_entropy, _ = hf_reference(tiny_models["qwen2"], training_batch(), TEMPERATURE)
    for case in ("pp1", "first1", "last1"):
        close(_whole(run, case, None, "scored", "log_probs"), hf_log_probs)
        close(_whole(run, case, None, "scored", "entropy"), hf_entropy)
    assert run3[0]["scored"] is None and run3[1]["scored"] is None  # the last stage's rank outputs
    close(run3[2]["scored"]["log_probs"], hf_log_probs)
    close(run3[2]["scored"]["entropy"], hf_entropy)
    close(run3[2]["split"]["scored"]["log_probs"], hf_log_probs)
    close(run3[2]["split"]["scored"]["entropy"], hf_entropy)


@pytest.mark.parametrize("case", ["first1", "last1"])
def test_an_uneven_step_equals_the_pp1_step_and_syncs_its_tensors(run, case):
    base, mine = run[0]["pp1"]["metrics"], run[0][case]["metrics"]
    for key, value in base.items():
        assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert mine["actor/ppo_kl"] == 0.0 and mine["actor/grad_norm"] > 0
    close(_whole(run, case, None, "after", "log_probs"), _whole(run, "pp1", None, "after", "log_probs"))
    synced = {name: t for rank in run if rank[case]["synced"] for name, t in rank[case]["synced"].items()}
    expected = run[0]["pp1"]["synced"]
    assert synced.keys() == expected.keys() and len(expected) > 0
    for name in expected:
        torch.testing.assert_close(synced[name], expected[name], rtol=0, atol=1e-5)


def test_a_checkpoint_saved_at_uneven_pp2_loads_at_pp1_bit_for_bit(run):
    saved = {name: t for rank in run for name, t in rank["first1"]["saved"].items()}
    resumed = run[0]["resumed"]["state"]
    assert run[0]["resumed"]["updates"] == 1
    layers = {name for name in resumed if name.startswith("decoder.layers.")}
    assert {name.split(".")[2] for name in layers} == {"0", "1", "2", "3"}
    assert layers <= saved.keys()
    for name in resumed:
        assert torch.equal(resumed[name], saved[name]), name
