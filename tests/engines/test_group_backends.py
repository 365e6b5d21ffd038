"""The engine names the backend of each of megatron's process groups once, at INFO, when it
initialises them: on CPU the worker group's world is gloo, and every group inherits it. Switching
layouts destroys the old layout's groups (each gloo group holds three threads until destroyed).
One 2-rank world (backends_world.py) serves both tests."""
import pytest
from backends_world import backends_world

from megarl.testing import run_gloo_workers

GROUPS = ("world", "tensor_model_parallel", "pipeline_model_parallel", "data_parallel", "model_parallel",
          "data_parallel_gloo")


@pytest.fixture(scope="module")
def ranks():
    return run_gloo_workers(backends_world, 2, timeout_s=300)


def test_rank_0_logs_every_megatron_group_as_gloo_in_a_gloo_world(ranks):
    # the world was started with "gloo" (engine_world.init_world); megatron's groups are created with
    # backend=None, so they inherit it; its explicit DP gloo group is gloo by construction
    expected = "INFO actor_rollout_ref.actor: process group backends " + " ".join(f"{g}=gloo" for g in GROUPS)
    assert ranks[0]["lines"] == [expected]
    assert ranks[1]["lines"] == []  # once per role, not once per rank


def test_switching_layouts_destroys_the_old_layouts_groups_and_their_threads(ranks):
    """"first" is counted after one switch already (from the PP2 layout the log check initialised): a leak
    there would sit in both counts, and the three switches after it would still add theirs."""
    for rank in ranks:
        assert rank["first"]["groups"] > 10  # megatron's groups besides the world, each with its threads
        # megatron's destroy_model_parallel alone left them registered: 3 more layouts, ~3x the groups
        assert rank["after"]["groups"] == rank["first"]["groups"], rank
        assert rank["after"]["threads"] <= rank["first"]["threads"], rank
