"""`megarl plan`'s model of an MoE: total and active parameters of Qwen3-30B-A3B's real config.json
against the model card (30.5 B total, 3.3 B activated), and experts split over EP x ETP ranks."""
import json
from pathlib import Path

import pytest

from megarl.bridge import arch_from_hf_config
from megarl.config.schema import MegatronConfig
from megarl.placement.colocation import OffloadParts
from megarl.placement.memory import _train_role, active_params, stage_expert_params, stage_params, total_params

CONFIG = Path(__file__).resolve().parents[2] / "configs/recipes/models/qwen3-30b-a3b/config.json"


@pytest.fixture(scope="module")
def arch():
    return arch_from_hf_config(json.loads(CONFIG.read_text()), source=str(CONFIG))


def test_qwen3_30b_a3b_total_and_active_parameters_match_the_model_card(arch):
    # huggingface.co/Qwen/Qwen3-30B-A3B: "Number of Parameters: 30.5B in total and 3.3B activated"
    assert total_params(arch) / 1e9 == pytest.approx(30.5, abs=0.05)
    assert active_params(arch) / 1e9 == pytest.approx(3.3, abs=0.06)  # 3.353 B; the card rounds to 3.3


def test_experts_are_split_over_expert_parallel_ranks(arch):
    """bf16 weights per GPU = dense / TP + experts / (EP x ETP), by hand; optimizer states of the
    experts over expert-DP = TP x DP / (EP x ETP) ranks with the distributed optimizer."""
    dense, experts = stage_params(arch, 1), stage_expert_params(arch, 1)
    assert dense + experts == total_params(arch)
    m = MegatronConfig(tensor_model_parallel_size=2, expert_model_parallel_size=8, expert_tensor_parallel_size=1)
    role = _train_role("actor", arch, m, dp=4, dtype="bfloat16", seq=1024, micro=1, trains=True, offload=OffloadParts())
    params = dense / 2 + experts / 8
    optimizer = dense / 2 * 12 / 4 + experts / 8 * 12 / 1  # expert-DP = 2 x 4 / 8 = 1
    assert role.states == int(params * 2 + params * 4 + optimizer)
