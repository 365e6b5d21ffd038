"""verl's own fully async and one-step-off Megatron launch scripts, module renamed (`verl.` -> `megarl.`), run
their asynchronous mode on CPU for 2 steps. The launch lines are those of tests/config/verl/corpus.json (verl
main of 2026-08-22); only what cannot fit this machine is swapped (`swapped`: the model and data, GPU counts and
parallel sizes, batch sizes and lengths, the rollout engine, a logger that needs the network), and
`trainer.device=cpu` is added. Every other key of the script stays.

Each run is `python -m megarl.experimental...` in its own process session (killed as a group if it overruns),
checked through what it prints and its metrics.jsonl. The synchronous loop logs no `async/*` metric; the async
loops log each step's staleness (the actor's version minus the version that generated the batch).
"""
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests/config/verl/corpus.json"
TIMEOUT_S = 400

FULLY_ASYNC = "verl/experimental/fully_async_policy/shell/grpo_8b_base_math_megatron_4_4_trtllm.sh"
ONE_STEP_OFF = "verl/experimental/one_step_off_policy/shell/dapo_7b_math_megatron_4_12.sh"


def launch_line(path: str) -> tuple[str, list[str]]:
    """(module, arguments) of the corpus's one launch line of the script at `path`."""
    [entry] = [s for s in json.loads(CORPUS.read_text())["scripts"] if s["path"] == path]
    return entry["module"], entry["args"]


def key_of(arg: str) -> str:
    return arg.lstrip("+").partition("=")[0]


def swapped(args: list[str], swaps: dict[str, object]) -> list[str]:
    """`args` with the value of each key of `swaps` replaced where the script sets it (its `+` kept); every
    key of `swaps` must be one the script sets, so that nothing else changes."""
    assert set(swaps) <= {key_of(a) for a in args}, set(swaps) - {key_of(a) for a in args}
    out = []
    for arg in args:
        key = key_of(arg)
        out.append(f"{arg[:len(arg) - len(arg.lstrip('+'))]}{key}={swaps[key]}" if key in swaps else arg)
    return out


def tiny_paths(tiny: Path, out: Path) -> dict[str, object]:
    return {"actor_rollout_ref.model.path": tiny / "model", "data.train_files": tiny / "data/train.parquet",
            "data.val_files": tiny / "data/val.parquet", "trainer.default_local_dir": out / "ckpt"}


def run_script(run_to_completion, path: str, swaps: dict, out: Path) -> tuple[str, list[dict]]:
    """Run the script's launch line, swapped, under megarl's module name: (its output, its metric rows)."""
    module, args = launch_line(path)
    cmd = [sys.executable, "-m", module.replace("verl.", "megarl.", 1), *swapped(args, swaps), "trainer.device=cpu"]
    output = run_to_completion(cmd, out, TIMEOUT_S, path)
    [metrics] = (out / "ckpt").glob("*/*/logs/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for row in rows:
        for key, value in row.items():
            assert math.isfinite(value), f"step {row['step']}: {key}={value}"
    return output, rows


def trained(rows: list[dict]) -> list[dict]:
    train = [r for r in rows if "timing/step_s" in r]
    assert [r["step"] for r in train] == [1, 2]
    return train


def fully_async_swaps(tiny: Path, out: Path) -> dict[str, object]:
    """What of FULLY_ASYNC must change here: a TP 1 actor on one logical GPU, two CPU-engine servers on two more
    (one GPU each beside the trainer's one would read as two 1-GPU nodes: megarl.config.verl_compat._add_pool),
    4 prompts x 4 responses a step (1 x 4 x 1 prompts), 8 prompts in all."""
    return {
        **tiny_paths(tiny, out),
        "data.max_prompt_length": 16, "data.max_response_length": 8,
        "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 1,
        "rollout.total_rollout_steps": 8,
        "actor_rollout_ref.rollout.name": "cpu",  # trtllm
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,  # the CPU engine is TP 1
        "trainer.n_gpus_per_node": 1, "rollout.n_gpus_per_node": 2,
        "trainer.logger": "[console]",  # [console,wandb]: no wandb here
    }


def test_verls_fully_async_script_runs_the_fully_async_mode(tiny_assets, tmp_path, run_to_completion):
    """Qwen3-8B on 4 + 4 GPUs (GB200), bypass_mode=False with token-level rollout IS, staleness_threshold 0.5,
    4 mini-batches per weight version, partial rollouts."""
    swaps = fully_async_swaps(tiny_assets, tmp_path)
    output, rows = run_script(run_to_completion, FULLY_ASYNC, swaps, tmp_path)
    assert "split: 1 training, 2 rollout in 2 server(s)" in output
    assert "step: 4 prompts x n=4 = 16 responses; 4 mini-batch(es) per epoch" in output  # 1 x 4 x 1 prompts
    assert "mode: fully_async, samples at most 1 weight version(s) old, partial rollouts" in output
    train = trained(rows)
    # the first batch can only come from the initial weights; none is more than ceil(0.5) = 1 version old
    assert train[0]["async/staleness_max"] == 0.0
    for row in train:
        assert row["async/staleness_max"] <= 1.0 and row["async/rollout_version"] <= row["step"] - 1
        assert row["async/dropped_samples"] == 0.0
        # the script's bypass_mode=False: the trainer recomputes the old log-probs, rollout IS weighs them
        assert row["timing/old_log_prob_s"] > 0 and "rollout_corr/rollout_is_mean" in row
        assert row["sync/weight_version"] == row["step"]
    # the script's lr_warmup_steps=10 with lr_decay_steps=51200 (longer than this run): megatron's linear
    # warm-up from 0, lr x step / 10, one scheduler step per training step as in verl
    assert [r["actor/lr"] for r in train] == pytest.approx([1e-7, 2e-7], rel=1e-9)


def test_verls_one_step_off_script_runs_the_one_step_off_mode(tiny_assets, tmp_path, run_to_completion):
    """DAPO on Qwen2.5-Math-7B, 2 nodes x (6 training + 2 rollout GPUs), actor TP 2 x PP 2, DAPO's overlong
    shaping. Here: the actor PP 2 (TP 1) on two logical GPUs, one CPU-engine server on a third, 4 prompts x 4
    responses a step."""
    swaps = {
        **tiny_paths(tiny_assets, tmp_path),
        "data.max_prompt_length": 16, "data.max_response_length": 8,
        "reward.reward_kwargs.max_resp_len": 8,  # must be data.max_response_length (it is in the script)
        "reward.reward_kwargs.overlong_buffer_cfg.len": 4,  # 4096 of 8192
        "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "trainer.total_training_steps": 2,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": 1,  # 10: must end before the last step (megatron asserts it)
        "actor_rollout_ref.rollout.name": "cpu",  # vllm
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "trainer.nnodes": 1, "trainer.n_gpus_per_node": 2, "rollout.nnodes": 1, "rollout.n_gpus_per_node": 1,
    }
    output, rows = run_script(run_to_completion, ONE_STEP_OFF, swaps, tmp_path)
    assert "split: 2 training, 1 rollout in 1 server(s)" in output and "actor: TP 1 x PP 2 x DP 1" in output
    assert "mode: one_step_off" in output
    train = trained(rows)
    # step k+1's batch comes from the weights of step k-1, whatever the timings (docs/async.md)
    assert [r["async/staleness_max"] for r in train] == [0.0, 1.0]
    assert [r["async/rollout_version"] for r in train] == [0.0, 0.0]
    for row in train:
        assert row["actor/grad_norm"] > 0 and row["sync/weight_version"] == row["step"]
        # DAPO's overlong shaping (verl's DAPORewardManager): min(0, -(length - (8 - 4)) / 4) per response, so
        # its mean is at least that of the mean length (equal when every response passes 4 tokens), at most 0
        penalty, length = row["reward/overlong_penalty_mean"], row["response_length/mean"]
        assert -(length - 4) / 4 - 1e-9 <= penalty < 0
    assert "val/score" in rows[0] and rows[0]["step"] == 0  # the script's val_before_train=True


def test_a_model_the_script_names_that_megarl_cannot_map_is_told_before_anything_starts(tiny_assets, tmp_path):
    """The same script on Nemotron-H (its config.json only, beside the tiny tokenizer): the run stops with the
    architecture, its config.json and what megarl maps, before Ray, the servers or the router start."""
    model = tmp_path / "nemotron_h"
    model.mkdir()
    for f in (tiny_assets / "model").glob("tokenizer*"):
        shutil.copy(f, model / f.name)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4480,
        "num_hidden_layers": 56, "num_attention_heads": 40, "vocab_size": 131072}))
    module, args = launch_line(FULLY_ASYNC)
    swaps = {**fully_async_swaps(tiny_assets, tmp_path), "actor_rollout_ref.model.path": model}
    r = subprocess.run([sys.executable, "-m", module.replace("verl.", "megarl.", 1), *swapped(args, swaps),
                        "trainer.device=cpu"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"megarl: this machine cannot run the experiment:\n  - actor_rollout_ref.model.path='{model}': "
            f"{model}/config.json: architecture NemotronHForCausalLM (`model_type`='nemotron_h') is not supported: "
            "megarl maps these HF architectures onto megatron-core: LlamaForCausalLM (llama),") in r.stderr
    assert "Qwen2ForCausalLM (qwen2)" in r.stderr
    assert "config OK; checking data, model and this machine" in r.stdout
    # no Cluster: it logs the devices and the placement first
    assert "devices:" not in r.stderr and "placement:" not in r.stderr and "the run stopped" not in r.stderr
