"""verl's SFT script runs under megarl's module name: the override list of verl's
examples/sft/gsm8k/run_nemotron_nano_v3_megatron.sh (tests/config/verl/corpus.json) through
`python -m megarl.trainer.sft_trainer` on CPU, 2 steps, with only the model, data, sizes, dtype,
logger and save_freq swapped (megarl's SFT writes no mid-run checkpoint yet: save_freq=500 is
refused) and the optimizer's CPU offload / precision-aware optimizer left out (megatron-core builds
them with transformer-engine only, a GPU package). verl's keys (engine.*, optim.*, model.*,
data.messages_key chats) must mean what they mean in verl: the first step's loss and gradient
norm are HF transformers' cross-entropy of the chats' assistant tokens (each turn's tokens found
by HF's own rendering of the chat up to it), on the same weights.
"""
import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
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
    cmd = [sys.executable, "-m", "megarl.trainer.sft_trainer", *script_overrides(),
           f"data.train_files={root / 'train.parquet'}", f"data.train_batch_size={len(CHATS)}", f"model.path={model}",
           "engine.tensor_model_parallel_size=1", "engine.expert_model_parallel_size=1", "engine.dtype=float32",
           "optim.lr_warmup_steps=1", "trainer.logger=[console]", f"trainer.default_local_dir={out}",
           "trainer.save_freq=-1", "trainer.total_epochs=2", "trainer.device=cpu", "trainer.n_gpus_per_node=1"]
    output = run_to_completion(cmd, root, TIMEOUT_S, "verl SFT script")
    logs = next(out.glob("*/*/logs"))
    return root, [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()], output


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
