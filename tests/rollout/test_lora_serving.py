"""The CPU engine serves LoRA adapters as SGLang 0.5.23 does (`rollout.lora_adapters`): loaded by
name from a PEFT directory, picked per request by `lora_path`, with SGLang's replies and errors.

The oracle is the `peft` library: the HF base with `PeftModel.from_pretrained` on the directory
megarl's trainer writes (`bridge.lora.write_peft_adapter`, what adapter-only sync pushes) gives
the log-probs the server answers with."""
import pytest
import requests
import torch

from megarl.bridge.lora import AdapterName, write_peft_adapter
from megarl.rollout.client import RolloutClient
from megarl.rollout.control import ServerError
from megarl.rollout.cpu_engine import CPUEngine
from megarl.rollout.launch import LoraServing, cpu_server_command
from megarl.rollout.process import ServerProcess, start_on_a_free_port
from megarl.rollout.protocol import BadRequestError, SamplingParams
from megarl.sync.servers import SyncServer

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [20, 21]]
# the tiny Qwen2 of conftest: hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, 2 layers
SHAPES = {"q_proj": (64, 64), "v_proj": (32, 64), "o_proj": (64, 64), "up_proj": (128, 64), "down_proj": (64, 128)}


def trained_adapters(seed: int) -> dict[str, torch.Tensor]:
    """Adapters as a trained actor holds them (megatron names, full tensors), B != 0."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for target in TARGETS:
            rows, cols = SHAPES[target]
            out[AdapterName(layer, target, "A").mcore] = torch.randn(RANK, cols, generator=g) * 0.3
            out[AdapterName(layer, target, "B").mcore] = torch.randn(rows, RANK, generator=g) * 0.3
    return out


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [str(write_peft_adapter(trained_adapters(seed), root / f"v{seed}", RANK, ALPHA, tiny_model_dir))
            for seed in (1, 2)]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")

    def server_on(port):
        command = cpu_server_command(tiny_model_dir, port, num_threads=1, lora=LoraServing(RANK, TARGETS))
        return ServerProcess("cpu-lora", command, f"http://127.0.0.1:{port}", log_path=str(logs / "cpu-lora.log"),
                             startup_timeout_s=120)

    proc = start_on_a_free_port(server_on, "127.0.0.1")
    yield proc
    proc.stop(timeout_s=15)


def peft_model(tiny_model_dir, adapter_dir, helpers):
    from peft import PeftModel

    return PeftModel.from_pretrained(helpers.load_hf(tiny_model_dir), adapter_dir).eval()


def max_logprob_gap(result, model, helpers, prompts=PROMPTS):
    gaps = [(torch.tensor(s.logprobs) - helpers.hf_logprobs(model, p, s.token_ids, 1.0)).abs().max()
            for p, samples in zip(prompts, result.samples) for s in samples]
    return float(max(gaps))


def generate(url, lora_name):
    with RolloutClient(url, max_retries=1, retry_backoff_s=0.1) as client:
        client.lora_name = lora_name
        return client.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, n=2))


def test_a_loaded_adapter_serves_peft_log_probs_and_the_base_stays_the_base(
        server, adapter_dirs, tiny_model_dir, tiny_hf, helpers):
    control = SyncServer(server.url)
    reply = control.load_lora_adapter("policy-v1", adapter_dirs[0])
    assert reply == {"success": True, "error_message": "", "loaded_adapters": {"policy-v1": adapter_dirs[0]}}
    oracle = peft_model(tiny_model_dir, adapter_dirs[0], helpers)
    adapted = generate(server.url, "policy-v1")
    assert max_logprob_gap(adapted, oracle, helpers) <= 1e-4
    assert max_logprob_gap(adapted, tiny_hf, helpers) > 1e-2  # negative control: the adapter changed the policy
    base = generate(server.url, None)
    assert max_logprob_gap(base, tiny_hf, helpers) <= 1e-4

    # a push: load the next version, unload the previous one; requests name the new one
    control.load_lora_adapter("policy-v2", adapter_dirs[1])
    reply = control.unload_lora_adapter("policy-v1")
    assert reply["loaded_adapters"] == {"policy-v2": adapter_dirs[1]}
    oracle2 = peft_model(tiny_model_dir, adapter_dirs[1], helpers)
    assert max_logprob_gap(generate(server.url, "policy-v2"), oracle2, helpers) <= 1e-4


def test_one_request_mixes_adapters_per_prompt(server, adapter_dirs, tiny_model_dir, tiny_hf, helpers):
    control = SyncServer(server.url)
    assert "mix" in control.load_lora_adapter("mix", adapter_dirs[0])["loaded_adapters"]
    body = {"input_ids": PROMPTS[:2], "lora_path": ["mix", None], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    outs = requests.post(server.url + "/generate", json=body, timeout=60).json()
    oracle = peft_model(tiny_model_dir, adapter_dirs[0], helpers)
    for prompt, out, model in zip(PROMPTS[:2], outs, (oracle, tiny_hf)):
        tokens = [t for _, t, _ in out["meta_info"]["output_token_logprobs"]]
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert (got - helpers.hf_logprobs(model, prompt, tokens, 0.0)).abs().max() <= 1e-4
    control.unload_lora_adapter("mix")


def test_sglangs_errors_for_unknown_duplicate_and_unloaded_adapters(server, adapter_dirs):
    control = SyncServer(server.url)
    body = {"input_ids": [5, 6], "lora_path": "nope", "sampling_params": {"max_new_tokens": 2}}
    resp = requests.post(server.url + "/generate", json=body, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("Got LoRA adapter that has never been loaded: nope\n")

    resp = requests.post(server.url + "/unload_lora_adapter", json={"lora_name": "nope"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert resp.json()["error_message"].startswith("LoRA with name nope does not exist. Loaded LoRAs:")

    control.load_lora_adapter("dup", adapter_dirs[0])
    with pytest.raises(ServerError, match="Failed to load LoRA adapter dup because it is already loaded"):
        control.load_lora_adapter("dup", adapter_dirs[1])
    # SGLang reloads an adapter it once loaded from its path when a request names it again
    control.unload_lora_adapter("dup")
    body["lora_path"] = "dup"
    assert requests.post(server.url + "/generate", json=body, timeout=30).status_code == 200
    control.unload_lora_adapter("dup")


def test_a_server_without_enable_lora_refuses_adapters_like_sglang(tiny_model_dir, adapter_dirs):
    from megarl.rollout.lora_adapters import LoraAdapters

    engine = CPUEngine(tiny_model_dir)
    try:
        with pytest.raises(BadRequestError, match="LoRA adapter 'x' was requested, but LoRA is not enabled"):
            engine.submit([5, 6], SamplingParams(max_new_tokens=1), False, None, lambda s: None, "x")
        with pytest.raises(BadRequestError, match="Please set `--enable-lora`"):
            engine.lora.load("x", adapter_dirs[0], engine.model)
        small = LoraAdapters(enabled=True, max_rank=RANK - 1, targets=TARGETS)
        with pytest.raises(BadRequestError, match="is incompatible with the current LoRA memory pool"):
            small.load("x", adapter_dirs[0], engine.model)
        narrow = LoraAdapters(enabled=True, max_rank=RANK, targets=("q_proj",))
        with pytest.raises(BadRequestError, match="`--lora-target-modules`"):
            narrow.load("x", adapter_dirs[0], engine.model)
    finally:
        engine.shutdown()


def test_a_late_request_joins_a_running_batch_of_its_adapter_only(tiny_model_dir, tiny_hf, adapter_dirs, helpers):
    """Continuous batching keeps one adapter per forward: while a base-model request decodes, a late
    base request joins its batch and finishes first; a late request for an adapter waits for the
    batch to end. Each gets its own model's log-probs (HF's base; PEFT on the adapter)."""
    import threading

    from megarl.rollout.lora_adapters import LoraAdapters

    engine = CPUEngine(tiny_model_dir, lora=LoraAdapters(True, RANK, TARGETS))
    try:
        engine.lora.load("v1", adapter_dirs[0], engine.model)
        order, done = [], threading.Semaphore(0)

        def on_done(seq):
            order.append(seq.rid)
            done.release()

        (long,) = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=200, ignore_eos=True), False, "long", on_done)
        while engine.decode_step == 0:
            threading.Event().wait(0.002)
        sampling = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)
        (base,) = engine.submit(PROMPTS[1], sampling, True, "base", on_done)
        (adapted,) = engine.submit(PROMPTS[2], sampling, True, "v1", on_done, lora_name="v1")
        assert done.acquire(timeout=60) and order == ["base"] and long.finish_reason is None
        engine.abort(rid="long")
        assert done.acquire(timeout=30) and done.acquire(timeout=60)
        assert order == ["base", "long", "v1"] and engine.num_joined == 1
    finally:
        engine.shutdown()
    oracle = peft_model(tiny_model_dir, adapter_dirs[0], helpers)
    for seq, model in ((base, tiny_hf), (adapted, oracle)):
        expected = helpers.hf_logprobs(model, seq.prompt_ids, seq.output_ids, 1.0)
        assert (torch.tensor(seq.logprobs) - expected).abs().max() <= 1e-4
