"""Shared fixtures: a tiny HF model built locally, free ports, CPU-engine servers stopped by PID."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from megarl.net import free_port
from megarl.rollout.launch import cpu_server_command
from megarl.rollout.process import ServerProcess, start_on_a_free_port

VOCAB = 128
CONTEXT = 256
EOS = 1


def make_tiny_model(path, seed=0):
    """A random 2-layer Qwen2 (hidden 64, vocab 128, no tokenizer) saved as an HF checkpoint."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return str(path)


def load_hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(model, prompt, response, temperature):
    """Log-probs of `response` given `prompt` under softmax(logits / T), recomputed in one forward."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / scale, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def start_cpu_server(model_dir, tmp_path, name, api_key=None):
    def server_on(port):
        return ServerProcess(name, cpu_server_command(model_dir, port, api_key=api_key, num_threads=1),
                             f"http://127.0.0.1:{port}", log_path=str(tmp_path / f"{name}.log"), startup_timeout_s=120)

    return start_on_a_free_port(server_on, "127.0.0.1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_dir):
    return load_hf(tiny_model_dir)


@pytest.fixture(scope="session")
def helpers():
    """Plain functions the test modules share (conftest is not importable under importlib mode)."""

    class Helpers:
        make_tiny_model = staticmethod(make_tiny_model)
        load_hf = staticmethod(load_hf)
        hf_logprobs = staticmethod(hf_logprobs)
        free_port = staticmethod(free_port)
        start_cpu_server = staticmethod(start_cpu_server)

    return Helpers
