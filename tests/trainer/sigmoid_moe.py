"""What the end-to-end runs of the sigmoid-routed MoE families share (tests/trainer/test_deepseek_e2e.py,
test_glm4_moe_e2e.py): a tiny checkpoint whose routers' selection bias is nonzero, and the checks of a
2-step GRPO run with routing replay and of its exported checkpoint. `grpo_two_steps` (the run itself,
in the test's process) and `check_engine_is_the_export` serve gpt-oss's test too (test_gptoss_e2e.py)."""
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megarl.bridge.safetensors_io import HFCheckpointReader
from megarl.cli import main as megarl_main
from megarl.data.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
SELECTION_BIAS = "e_score_correction_bias"
SEQUENCE = [1, 6, 7, 14, 8, 9, 16, 4, 5, 6, 11, 12, 13]  # "<bos>23+45=012789" in the character tokenizer  # the router's `mlp.gate.e_score_correction_bias` [E]


def biased_tiny_model(family: str, out: Path, **shape) -> dict[str, torch.Tensor]:
    """A tiny `family` checkpoint (2 layers, hidden 64, 4 heads, experts 32 wide, untied) in `out`, its
    selection biases set to 0.1 N(0, 1) (HF initialises them to 0, which would hide a bias lost on the way);
    returns its tensors by HF name."""
    make_tiny_model(family, out, **{"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "intermediate": 32,
                                    "tie": False, "seed": 0, **shape})
    weights = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith(SELECTION_BIAS)]:
        weights[name] = 0.1 * torch.randn(weights[name].shape, generator=g)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return weights


def check_two_replayed_steps(train: list[dict], weights: dict[str, torch.Tensor]) -> None:
    """`train`: the two steps' metrics. Step 1's PPO KL is exactly 0 (the old-log-prob pass replays the
    rollout's routes on the weights the update starts from) and its gradients are not all 0; the push after
    it put every trained tensor into the engine under its HF name, each compared there (the selection bias
    is a buffer: never trained, never pushed); step 2's rollout log-probs, on the pushed weights, equal the
    replaying actor's."""
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["actor/ppo_kl"] == 0.0 and train[0]["actor/grad_norm"] > 0
    assert train[0]["sync/checked_tensors"] == len([n for n in weights if not n.endswith(SELECTION_BIAS)])
    assert train[1]["training/rollout_log_probs_diff_max"] < 1e-5


def export_and_check(checkpoint: Path, out: Path, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`megarl export` of `checkpoint` into `out`: the starting checkpoint's names, its selection biases
    unchanged (megarl never moves them), some tensor trained; returns the exported tensors."""
    assert megarl_main(["export", str(checkpoint), "--out", str(out)]) == 0
    with HFCheckpointReader(out) as reader:
        exported = {name: reader.read(name) for name in reader.names()}
    assert exported.keys() == weights.keys()
    for name in [n for n in weights if n.endswith(SELECTION_BIAS)]:
        assert torch.equal(exported[name], weights[name]), name
    assert any(not torch.equal(exported[n], weights[n]) for n in weights if not n.endswith(SELECTION_BIAS))
    return exported



def grpo_two_steps(model: Path, tiny_assets: Path, tmp_path: Path) -> tuple[list[dict], list[float], Path]:
    """Two GRPO steps with routing replay of the tiny MoE checkpoint `model` (configs/tiny/grpo_moe.yaml, a
    reward whose gradients are not all 0), the trainer in this process (the caller holds a Ray cluster:
    the `ray_two_gpus` fixture), each step ending with the push of its updated weights, then a checkpoint:
    (the two steps' metrics, the CPU engine's log-probs of SEQUENCE after the last push, the checkpoint's
    directory)."""
    from transformers import AutoTokenizer

    from megarl.config import load_and_validate
    from megarl.rewards.custom import select_score_fn
    from megarl.rollout.client import RolloutClient
    from megarl.runtime.cluster import Cluster
    from megarl.trainer.rl import RLTrainer

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
        with RolloutClient(cluster.rollout.urls[0], api_key=cluster.api_key, vocab_size=len(trainer.tokenizer)) as client:
            (engine,) = client.score([SEQUENCE], [0])
    finally:
        cluster.shutdown()
    return train, engine, trainer.checkpoint_dir() / "global_step_2"


def hf_log_probs(hf_dir: Path) -> torch.Tensor:
    """transformers' own log p(SEQUENCE[t] | SEQUENCE[:t]), t >= 1, under the checkpoint in `hf_dir` (fp32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([SEQUENCE]), use_cache=False).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(SEQUENCE[1:])[:, None])[:, 0]


def check_engine_is_the_export(engine: list[float], export: Path, start: Path) -> None:
    """The CPU engine's log-probs after the last push (`engine`) equal transformers' own under the HF
    export of the pushed weights (`export`) within 1e-5, and not the starting checkpoint's (`start`)."""
    engine = torch.tensor(engine, dtype=torch.float64)
    torch.testing.assert_close(engine, hf_log_probs(export), atol=1e-5, rtol=0)
    assert (engine - hf_log_probs(start)).abs().max() > 1e-3  # negative control: the untrained model's differ
