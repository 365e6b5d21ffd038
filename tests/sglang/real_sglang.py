"""Starting real SGLang 0.5.23 servers on the CPU for the tests, through the launch code users run
(`sglang_server_command`, `sglang_server_env`) and megarl's `ServerProcess` (stopped by PID); the
tests' oracle, HF transformers' float32 log-probs of a checkpoint (`hf_logprobs`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

import pytest
import torch
from transformers import AutoModelForCausalLM

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.launch import cpu_server_command, sglang_server_command, sglang_server_env
from megarl.rollout.process import ServerProcess, start_on_a_free_port

REPO = Path(__file__).resolve().parents[2]
CONTEXT = 256  # the tiny models' max_position_embeddings
TOLERANCE = 1e-4  # float32 SGLang (torch-native attention) vs HF float32: measured at most 5.2e-7
CHANGED = 1e-2  # two checkpoints' log-probs of the same tokens differ by more than this (measured >= 0.16)


def sglang_python() -> str:
    """The interpreter with SGLang: $MEGARL_SGLANG_PYTHON (`make test` sets it) or the repository's
    .venv-sglang. Fails the test, never skips it, when it is missing."""
    python = os.environ.get("MEGARL_SGLANG_PYTHON") or str(REPO / ".venv-sglang" / "bin" / "python")
    if not os.access(python, os.X_OK):
        pytest.fail(f"no SGLang interpreter at {python}: run `make install-sglang` (or `make test`, which does)")
    return python


def make_model(arch: str, out_dir, **sizes) -> str:
    """A tiny random `arch` checkpoint in float32 with the character tokenizer (SGLang loads a tokenizer)."""
    return str(make_tiny_model(arch, out_dir, dtype="float32", **sizes))


def start_sglang(model_dir: str, log_dir, *, name: str = "sglang", api_key: Optional[str] = None,
                 dtype: str = "float32", max_running_requests: int = 8, extra_args: Sequence[str] = (),
                 startup_timeout_s: float = 300.0, env: Optional[Mapping[str, str]] = None,
                 **command_args) -> ServerProcess:
    """A started SGLang server on a free port of 127.0.0.1, its log in `log_dir`/<name>.log; `env`:
    variables set for it besides the launch code's."""

    def server_on(port: int) -> ServerProcess:
        command = sglang_server_command(model_dir, port, device="cpu", max_running_requests=max_running_requests,
                                        api_key=api_key, dtype=dtype, context_length=CONTEXT,
                                        extra_args=extra_args, python=sglang_python(), **command_args)
        server_env = {**sglang_server_env(os.environ, device="cpu", enable_memory_saver=False, colocated=False),
                      **(env or {})}
        return ServerProcess(name, command, f"http://127.0.0.1:{port}", env=server_env,
                             log_path=str(Path(log_dir) / f"{name}.log"), startup_timeout_s=startup_timeout_s)

    return start_on_a_free_port(server_on, "127.0.0.1")


def start_cpu_engine(model_dir: str, log_dir, *, name: str = "cpu-engine", api_key: Optional[str] = None,
                     startup_timeout_s: float = 120.0) -> ServerProcess:
    """megarl's CPU engine serving `model_dir` in float32 on a free port of 127.0.0.1, with the context
    length the SGLang servers get (`start_sglang`): the stand-in to hold to SGLang's answers."""

    def server_on(port: int) -> ServerProcess:
        command = cpu_server_command(model_dir, port, api_key=api_key, dtype="float32", context_length=CONTEXT,
                                     num_threads=1)
        return ServerProcess(name, command, f"http://127.0.0.1:{port}", log_path=str(Path(log_dir) / f"{name}.log"),
                             startup_timeout_s=startup_timeout_s)

    return start_on_a_free_port(server_on, "127.0.0.1")


def sglang_client_env() -> dict:
    """The environment of a process that imports SGLang on the CPU (a sender of SGLang's own payload
    classes): what the launch code gives a server (`sglang_server_env`: its CPU site first on PYTHONPATH),
    with megarl's `src` after it."""
    env = sglang_server_env(os.environ, device="cpu", enable_memory_saver=False, colocated=False)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(REPO / "src")])
    return env


def hf_logprobs(model, prompt: Sequence[int], response: Sequence[int]) -> torch.Tensor:
    """HF transformers' float32 log-probs of `response` given `prompt`: log_softmax(logits), what SGLang
    reports for greedy samples (and for sampled ones at temperature 1); float64, [len(response)]."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(list(response))[:, None])[:, 0]


def logprob_error(model, prompt: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float]) -> float:
    """The largest |logprobs[t] - HF's log-prob of tokens[t]| of one sample (`hf_logprobs`)."""
    return (hf_logprobs(model, prompt, tokens) - torch.tensor(list(logprobs), dtype=torch.float64)).abs().max().item()


def max_diff(hf_model, samples) -> float:
    """The largest |server log-prob - HF log-prob| over every token of `samples` (tuples of prompt,
    tokens, log-probs and weight version, as tests/sync/sync_world.py's server_samples gives them)."""
    return max(logprob_error(hf_model, prompt, tokens, logprobs) for prompt, tokens, logprobs, _ in samples)


def load_hf(model_dir) -> torch.nn.Module:
    """The checkpoint in HF transformers, float32, eval mode: the oracle of the servers' log-probs."""
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

