"""verl's SFT script runs under megarl's module name: the override list of verl's
examples/sft/gsm8k/run_nemotron_nano_v3_megatron.sh (tests/config/verl/corpus.json) through
`python -m megarl.trainer.sft_trainer` on CPU, 2 steps, with only the model, data, sizes, dtype,
logger and save_freq swapped (save_freq=1: a checkpoint after each step) and the optimizer's CPU
offload / precision-aware optimizer left out (megatron-core builds them with transformer-engine only,
a GPU package). verl's keys (engine.*, optim.*, model.*, data.messages_key chats) must mean what they
mean in verl: the first step's loss and gradient norm are HF transformers' cross-entropy of the
chats' assistant tokens (each turn's tokens found by HF's own rendering of the chat up to it), on the
same weights. The same run saving in the background (checkpoint.async_save=true, verl's fully async
scripts' setting) trains bit for bit as the one saving at once, and its checkpoints are complete. A
run left with only that run's step 1 checkpoint (verl's resume_mode=auto finds it) resumes and ends
exactly as the uninterrupted run: step 2's loss and gradient norm, and the exported weights; its own
checkpoint, also saved in the background, holds what its checkpoint.save_contents=[model,extra,hf_model]
names (verl's parts: no optimizer state, an HF copy equal to the exported weights). SIGTERM to a run
finishes its step, checkpoints it and exits 75, as an RL run.
"""
import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.data.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "examples/sft/gsm8k/run_nemotron_nano_v3_megatron.sh"
TIMEOUT_S = 300
# a chat template with per-turn markers in the tiny tokenizer's characters: "u:" / "a:" / "s:" open a turn,
# "," closes it, an assistant turn ends with eos before it; "a:" is the generation prompt
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %},{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
CHATS = [
    [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}],
    [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
     {"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}],
    [{"role": "user", "content": "5+5="}, {"role": "assistant", "content": "10"}],
    [{"role": "user", "content": "20+1="}, {"role": "assistant", "content": "21"}, {"role": "user", "content": "x2"},
     {"role": "assistant", "content": "42"}],
]
# the script's keys given other values here (the rest run as the script has them)
SWAPPED = ("data.train_files", "data.val_files", "data.train_batch_size", "model.path",
           "engine.tensor_model_parallel_size", "engine.expert_model_parallel_size", "engine.dtype", "optim.lr_warmup_steps", "trainer.logger",
           "trainer.default_local_dir", "trainer.save_freq", "trainer.total_epochs",
           *(f"optim.override_optimizer_config.{name}" for name in (
               "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer",
               "optimizer_cpu_offload")))

pytestmark = pytest.mark.slow


def script_overrides() -> list[str]:
    corpus = json.loads((REPO / "tests/config/verl/corpus.json").read_text())
    (entry,) = [s for s in corpus["scripts"] if s["path"] == SCRIPT]
    assert entry["module"] == "verl.trainer.sft_trainer"
    kept = [a for a in entry["args"] if a.lstrip("+").partition("=")[0] not in SWAPPED]
    assert len(entry["args"]) - len(kept) == len(SWAPPED)  # each once in the script
    return kept


@pytest.fixture(scope="module")
def run(tmp_path_factory, run_to_completion):
    root = tmp_path_factory.mktemp("verl_sft")
    model = make_tiny_model("qwen2", root / "model", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model)
    pd.DataFrame({"messages": CHATS}).to_parquet(root / "train.parquet")
    out = root / "out"
    output = run_to_completion(command(root, model, out), root, TIMEOUT_S, "verl SFT script")
    logs = next(out.glob("*/*/logs"))
    return root, [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()], output


def command(root: Path, model: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "megarl.trainer.sft_trainer", *script_overrides(),
            f"data.train_files={root / 'train.parquet'}", f"data.train_batch_size={len(CHATS)}", f"model.path={model}",
            "engine.tensor_model_parallel_size=1", "engine.expert_model_parallel_size=1", "engine.dtype=float32",
            "optim.lr_warmup_steps=1", "trainer.logger=[console]", f"trainer.default_local_dir={out}",
            "trainer.save_freq=1", "trainer.total_epochs=2", "trainer.device=cpu", "trainer.n_gpus_per_node=1"]


@pytest.fixture(scope="module")
def async_run(run, run_to_completion):
    """The uninterrupted run saving its checkpoints in the background (checkpoint.async_save=true)."""
    root, _, _ = run
    out = root / "async"
    output = run_to_completion([*command(root, root / "model", out), "checkpoint.async_save=true"], root, TIMEOUT_S,
                               "verl SFT script saving in the background")
    logs = next(out.glob("*/*/logs"))
    return out, [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()], output


@pytest.fixture(scope="module")
def resumed(run, async_run, run_to_completion):
    """A run whose experiment directory holds only the background-saving run's checkpoint of step 1
    (what a run stopped after it leaves): the script's resume_mode=auto continues from it."""
    root, _, _ = run
    saved, _, _ = async_run
    (experiment,) = [p.parent for p in saved.glob("*/*/global_step_1")]
    out = root / "resumed"
    shutil.copytree(experiment / "global_step_1", out / experiment.relative_to(saved) / "global_step_1")
    # its own checkpoints hold what verl's qwen35 fully async script asks for: no optimizer, an HF copy, saved
    # in the background (its HF copy is converted from the written weights once the write finished)
    cmd = [*command(root, root / "model", out), "checkpoint.save_contents=[model,extra,hf_model]",
           "checkpoint.async_save=true"]
    output = run_to_completion(cmd, root, TIMEOUT_S, "resumed verl SFT script")
    logs = next(out.glob("*/*/logs"))
    return out, [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()], output


def hf_chat_tokens(tokenizer, chat) -> tuple[list[int], list[int]]:
    """(ids, trained positions) of one chat by HF's own rendering: the whole chat at once, and each
    assistant turn's tokens after the "a:" generation prompt found by rendering the chat up to it."""
    ids = tokenizer.apply_chat_template(chat, tokenize=False)
    ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
    trained = []
    for i, message in enumerate(chat):
        if message["role"] == "assistant":
            before = tokenizer(tokenizer.apply_chat_template(chat[:i], tokenize=False, add_generation_prompt=True),
                               add_special_tokens=False)["input_ids"]
            through = tokenizer(tokenizer.apply_chat_template(chat[: i + 1], tokenize=False),
                                add_special_tokens=False)["input_ids"]
            trained += range(len(before), len(through))
    return ids, trained


def test_verl_sft_script_trains_on_the_assistant_tokens(run):
    root, rows, output = run
    train = [r for r in rows if "sft/nll" in r]
    assert [r["step"] for r in train] == [1, 2]
    # one warning each, naming the override as given
    for key, given in (("data.pad_mode", "data.pad_mode"),
                       ("actor_rollout_ref.actor.megatron.use_mbridge", "engine.use_mbridge")):
        assert output.count(f"{key} (verl key, override '{given}=") == 1

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    total, count = 0.0, 0
    for chat in CHATS:
        ids, trained = hf_chat_tokens(tokenizer, chat)
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        positions = torch.tensor(trained)
        total = total + torch.nn.functional.cross_entropy(logits[positions - 1], torch.tensor(ids)[positions],
                                                          reduction="sum")
        count += len(trained)
    loss = total / count
    assert train[0]["sft/nll"] == pytest.approx(loss.item(), rel=1e-5)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    assert train[0]["sft/grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)
    assert train[0]["sft/tokens"] == count
    assert train[1]["sft/nll"] < train[0]["sft/nll"]  # it learns


def test_a_run_saving_in_the_background_trains_as_one_saving_at_once(run, async_run):
    root, rows, _ = run
    out, async_rows, _ = async_run
    train = [r for r in rows if "sft/nll" in r]
    again = [r for r in async_rows if "sft/nll" in r]
    assert [r["step"] for r in again] == [1, 2]
    for ours, theirs in zip(again, train):
        for key in ("sft/nll", "sft/grad_norm", "sft/tokens"):
            assert ours[key] == theirs[key], key  # bit for bit
    (experiment,) = [p.parent for p in out.glob("*/*/global_step_1")]
    assert sorted(p.name for p in experiment.iterdir() if p.name.startswith("global_step_")) == [
        "global_step_1", "global_step_2"]  # both committed (the last at the end of the run), no .tmp left
    assert all((experiment / f"global_step_{n}" / "COMPLETE").is_file() for n in (1, 2))
    assert (experiment / "latest").read_text().strip() == "global_step_2"
    exported = load_file(next((root / "out").glob("*/*/hf/*.safetensors")))
    exported_async = load_file(next(out.glob("*/*/hf/*.safetensors")))
    assert exported.keys() == exported_async.keys()
    assert all(torch.equal(tensor, exported_async[name]) for name, tensor in exported.items())


def test_a_run_resumed_from_the_step_1_checkpoint_ends_as_the_uninterrupted_run(run, resumed):
    root, rows, _ = run
    out, resumed_rows, output = resumed
    (experiment,) = [p.parent for p in (root / "out").glob("*/*/global_step_1")]
    # save_freq=1: a complete checkpoint after each step, the actor's optimizer in it (the script's
    # checkpoint.save_contents=[model,optimizer,extra])
    assert sorted(p.name for p in experiment.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    assert all((experiment / f"global_step_{n}" / "COMPLETE").is_file() for n in (1, 2))
    assert "resumed from" in output and "(step 1)" in output
    train = {r["step"]: r for r in rows if "sft/nll" in r}
    again = [r for r in resumed_rows if "sft/nll" in r]
    assert [r["step"] for r in again] == [2]  # step 1 is not trained again
    for key in ("sft/nll", "sft/grad_norm", "sft/tokens"):
        assert again[0][key] == train[2][key], key  # bit for bit
    exported = load_file(next((root / "out").glob("*/*/hf/*.safetensors")))
    exported_again = load_file(next(out.glob("*/*/hf/*.safetensors")))
    assert exported.keys() == exported_again.keys()
    for name, tensor in exported.items():  # step 2's update needs step 1's Adam moments back, not fresh ones
        assert torch.equal(tensor, exported_again[name]), name


def saved_keys(actor_dir: Path) -> set[str]:
    """The top-level keys of a megatron dist checkpoint (torch.distributed.checkpoint's metadata)."""
    return {key.split(".")[0] for key in FileSystemReader(str(actor_dir)).read_metadata().state_dict_metadata}


def test_save_contents_decides_what_a_checkpoint_holds(run, resumed):
    root, _, _ = run
    out, _, _ = resumed
    (full,) = (root / "out").glob("*/*/global_step_2")
    (mine,) = out.glob("*/*/global_step_2")
    # megatron's sharded keys: the model's by module (decoder.layers..., embedding...), the optimizer's under optimizer
    assert {"decoder", "optimizer"} <= saved_keys(full / "actor")  # the script's [model,optimizer,extra]
    assert "decoder" in saved_keys(mine / "actor") and "optimizer" not in saved_keys(mine / "actor")
    assert not (full / "actor_hf").exists()
    exported = load_file(next(out.glob("*/*/hf/*.safetensors")))
    copy = load_file(next((mine / "actor_hf").glob("*.safetensors")))
    assert copy.keys() == exported.keys() and all(torch.equal(copy[n], t) for n, t in exported.items())


def test_sigterm_finishes_the_step_checkpoints_it_and_exits_75(run):
    """SIGTERM (what Slurm sends before a preemption) to a long SFT run that would never save
    (save_freq=-1): the step in progress finishes, is checkpointed, and the run exits 75, as an RL run
    (megarl.trainer.preemption); the checkpoint is the last logged step's, and resume_mode=auto finds it."""
    import os
    import signal
    import subprocess
    import time

    from megarl.checkpoint import complete_checkpoints, load_controller_state

    root, _, _ = run
    out = root / "stopped"
    cmd = [*command(root, root / "model", out), "trainer.save_freq=-1", "trainer.total_epochs=100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not list(out.glob("*/*/logs/metrics.jsonl")) or not next(out.glob("*/*/logs/metrics.jsonl")).read_text():
            assert proc.poll() is None, proc.stdout.read()[-5000:]
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # to the trainer alone, as the launchers do
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 75 and "stopped by SIGTERM" in output, output[-5000:]
    (logs,) = out.glob("*/*/logs")
    last_logged = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()][-1]["step"]
    experiment = logs.parent
    assert [step for step, _ in complete_checkpoints(experiment)] == [last_logged]  # the signal's alone
    assert (experiment / "latest").read_text().strip() == f"global_step_{last_logged}"
    assert load_controller_state(experiment / f"global_step_{last_logged}")["step"] == last_logged
    assert f"checkpoint {experiment / f'global_step_{last_logged}'}" in output
