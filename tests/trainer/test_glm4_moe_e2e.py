"""A tiny GLM-4.5 (glm4_moe: grouped-query attention with q/k/v biases and q/k norms, rotary on half of
each head, a dense first layer, DeepSeek-V3's sigmoid group-limited router with a nonzero selection bias
and a shared expert) trained by GRPO on CPU with routing replay (configs/tiny/grpo_moe.yaml), the
trainer in this process: step 1's ppo_kl is exactly 0 (a separate old-log-prob pass replaying the CPU
engine's routes), every pushed tensor is compared in the CPU engine (HF's Glm4MoeForCausalLM), step 2's
rollout log-probs equal the actor's, and after step 2's push the CPU engine's log-probs of a sequence
equal transformers' own on the step-2 checkpoint's HF export.

The push names are SGLang's: SGLang 0.5.23's `Glm4MoeForCausalLM.load_weights` (srt/models/glm4_moe.py)
takes the hub checkpoint's names (q/k/v_proj into qkv_proj, gate/up_proj into gate_up_proj, each
`mlp.experts.<e>.{gate,up,down}_proj.weight` into the fused experts, the rest by name: `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.shared_experts.*`, q/k norms and biases) and skips any other name
without a word; the push is checked to send exactly the starting checkpoint's names but the selection
bias, which SGLang holds from the checkpoint and megarl never moves. (DeepSeek-V3: test_deepseek_e2e.py.)"""
from pathlib import Path

import pytest
import torch

from megarl.rollout.client import RolloutClient
from sigmoid_moe import biased_tiny_model, check_two_replayed_steps, export_and_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
SEQUENCE = [1, 6, 7, 14, 8, 9, 16, 4, 5, 6, 11, 12, 13]  # "<bos>23+45=012789" in the character tokenizer


def test_glm4_moe_grpo_with_routing_replay_pushes_sglangs_names_and_exports_the_engines_model(
        tiny_assets, tmp_path, ray_two_gpus):
    from transformers import AutoTokenizer

    from megarl.bridge import arch_from_hf_config, load_hf_config
    from megarl.bridge.mapping import WeightMap
    from megarl.config import load_and_validate
    from megarl.rewards.custom import select_score_fn
    from megarl.runtime.cluster import Cluster
    from megarl.trainer.rl import RLTrainer

    model = tmp_path / "model"
    weights = biased_tiny_model("glm4_moe", model, kv_heads=2)
    # the bridge's HF names, those the push sends (all but the selection bias: check_two_replayed_steps
    # counts them), are the checkpoint's: the names SGLang's loader takes
    assert sorted(WeightMap(arch_from_hf_config(load_hf_config(model)), 128).hf_names()) == sorted(weights)
    config = load_and_validate(str(REPO / "configs/tiny/grpo_moe.yaml"), [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={tiny_assets / 'data/train.parquet'}",
        "data.val_files=[]", f"trainer.default_local_dir={tmp_path / 'runs'}",
        f"custom_reward_function.path={Path(__file__).with_name('varied_reward.py')}",  # gradients not all 0
        "trainer.total_training_steps=2"])
    c = config.custom_reward_function
    cluster = Cluster(config)
    try:
        trainer = RLTrainer(config, cluster, AutoTokenizer.from_pretrained(str(model)),
                            select_score_fn(c.path, c.name, c.reward_kwargs))
        train = []
        for step in (1, 2):
            train.append({"step": step, **trainer.train_step()})  # ends with the push of the updated weights
            trainer.step = step
        trainer.save_checkpoint()  # global_step_2: the weights of the last push
        check_two_replayed_steps(train, weights)
        with RolloutClient(cluster.rollout.urls[0], api_key=cluster.api_key, vocab_size=len(trainer.tokenizer)) as client:
            (engine,) = client.score([SEQUENCE], [0])
    finally:
        cluster.shutdown()
    export_and_check(trainer.checkpoint_dir() / "global_step_2", tmp_path / "hf", weights)
    engine = torch.tensor(engine, dtype=torch.float64)
    torch.testing.assert_close(engine, hf_log_probs(tmp_path / "hf"), atol=1e-5, rtol=0)
    assert (engine - hf_log_probs(model)).abs().max() > 1e-3  # negative control: the untrained model's differ


def hf_log_probs(hf_dir: Path) -> torch.Tensor:
    """transformers' own log p(SEQUENCE[t] | SEQUENCE[:t]), t >= 1, under the checkpoint in `hf_dir` (fp32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([SEQUENCE]), use_cache=False).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(SEQUENCE[1:])[:, None])[:, 0]
