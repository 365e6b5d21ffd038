"""Expert-load metrics of a step from the actor's per-DP-rank expert counts, against hand-computed
values (the counts themselves are checked against HF's routing in tests/engines/test_moe_engine.py)."""
import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.runtime.engine_group import join_outputs
from megarl.trainer.experience import expert_load_metrics


def test_expert_load_metrics_of_hand_built_counts():
    """2 DP ranks of one sample each, of 3 and 2 routed tokens, top-2 of 4 experts, 2 layers: each
    rank returns its [layers, experts] total and the controller sums them (`join_outputs`): 10
    (token, k) pairs per layer, mean 2.5; layer totals [4, 3, 2, 1] and [5, 5, 0, 0]: max 5,
    imbalance (4 + 5) / 2.5 / 2. Per-sample keys are joined in DP order beside them."""
    ranks = [{"log_probs": torch.tensor([[0.5, 0.25]]),
              "expert_tokens": torch.tensor([[3, 2, 1, 0], [3, 3, 0, 0]], dtype=torch.int32)},
             {"log_probs": torch.tensor([[0.125, 0.0]]),
              "expert_tokens": torch.tensor([[1, 1, 1, 1], [2, 2, 0, 0]], dtype=torch.int32)}]
    joined = join_outputs(ranks, 2, padded=False)
    assert torch.equal(joined["log_probs"], torch.tensor([[0.5, 0.25], [0.125, 0.0]]))
    assert torch.equal(joined["expert_tokens"], torch.tensor([[4, 3, 2, 1], [5, 5, 0, 0]], dtype=torch.int32))
    assert expert_load_metrics(joined["expert_tokens"]) == {
        "moe/tokens_per_expert_max": 5.0, "moe/tokens_per_expert_mean": 2.5, "moe/load_imbalance": 1.8}
    assert expert_load_metrics(torch.zeros(2, 4, dtype=torch.int32)) == {}
    # a batch of 1 sample padded to 2 (rank 1 scores a copy): per-sample rows cut to 1, and the
    # totals, which would count the copy, left out
    padded = join_outputs(ranks, 1, padded=True)
    assert padded.keys() == {"log_probs"} and torch.equal(padded["log_probs"], torch.tensor([[0.5, 0.25]]))


def test_replay_needs_an_moe_model(tmp_path):
    from megarl.config import ConfigError, load_and_validate
    from megarl.runtime.routing import routed_experts_layout

    def layout(arch):
        model = make_tiny_model(arch, tmp_path / arch, layers=2, hidden=32, heads=2, kv_heads=1, intermediate=16)
        return routed_experts_layout(load_and_validate(None, [
            "data.train_files=/d.parquet", f"actor_rollout_ref.model.path={model}", "trainer.nnodes=1",
            "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.router_replay.mode=R3"]))

    assert layout("qwen3_moe") == (2, 2, 8)  # layers, top_k, experts of the tiny Qwen3-MoE
    with pytest.raises(ConfigError, match="router_replay.mode=R3 needs an MoE model"):
        layout("qwen2")
