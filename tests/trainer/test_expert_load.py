"""Expert-load metrics of a step, against a hand count of HF's own routing on a tiny forward."""
from collections import Counter

import pytest
import torch

from megarl.data.batch import Batch
from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.cpu_engine import load_causal_lm
from megarl.trainer.experience import expert_load_metrics, routed_experts_grids


def test_expert_load_equals_a_hand_count_of_hf_routing(tmp_path):
    model = load_causal_lm(str(make_tiny_model("qwen3_moe", tmp_path / "m", layers=2, hidden=32, heads=2, kv_heads=1,
                                               intermediate=16, seed=4)), torch.float32)
    experts, k = model.config.num_experts, model.config.num_experts_per_tok
    prompts, responses = [[5, 6, 7], [9, 10]], [[11, 12], [13, 14, 15, 16]]
    routes, counts = [], Counter()
    for p, r in zip(prompts, responses):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r]), output_router_logits=True).router_logits
        picks = [torch.topk(torch.softmax(layer, -1), k, -1).indices for layer in logits]  # per layer [T, K]
        routes.append(torch.stack(picks, 1)[:-1].int())  # the rollout's rows: all but the last token
        for layer, pick in enumerate(picks):
            for token in range(len(p) + len(r) - 1):
                for expert in pick[token].tolist():
                    counts[layer, expert] += 1
    batch = Batch.from_token_lists(prompts, responses)
    batch["prompt_routed_experts"], batch["routed_experts"] = routed_experts_grids(
        routes, batch["prompt_mask"], batch["response_mask"])
    metrics = expert_load_metrics(batch, experts)

    tokens = sum(len(p) + len(r) - 1 for p, r in zip(prompts, responses))  # 4 + 5
    mean = tokens * k / experts
    per_layer_max = [max(counts[layer, e] for e in range(experts)) for layer in range(2)]
    assert metrics["moe/tokens_per_expert_mean"] == mean
    assert metrics["moe/tokens_per_expert_max"] == max(per_layer_max)
    assert abs(metrics["moe/load_imbalance"] - sum(m / mean for m in per_layer_max) / 2) < 1e-12
    assert expert_load_metrics(Batch.from_token_lists(prompts, responses), experts) == {}


def test_replay_needs_an_moe_model(tmp_path):
    from megarl.config import ConfigError, load_and_validate
    from megarl.trainer.routing import routed_experts_layout

    def layout(arch):
        model = make_tiny_model(arch, tmp_path / arch, layers=2, hidden=32, heads=2, kv_heads=1, intermediate=16)
        return routed_experts_layout(load_and_validate(None, [
            "data.train_files=/d.parquet", f"actor_rollout_ref.model.path={model}", "trainer.nnodes=1",
            "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.router_replay.mode=R3"]))

    assert layout("qwen3_moe") == (2, 2, 8)  # layers, top_k, experts of the tiny Qwen3-MoE
    with pytest.raises(ConfigError, match="router_replay.mode=R3 needs an MoE model"):
        layout("qwen2")
