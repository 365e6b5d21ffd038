"""The CPU engine serves LoRA adapters as SGLang 0.5.23 does (`rollout.cpu.lora_adapters`): loaded by
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
from megarl.rollout.cpu.engine import CPUEngine
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
    from megarl.rollout.cpu.lora_adapters import LoraAdapters

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

    from megarl.rollout.cpu.lora_adapters import LoraAdapters

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


# ------------------------------------------------------------------ /load_lora_adapter_from_tensors
def tensors_body(name, seed, tp_size=1, **fields):
    """What adapter-only sync sends (`sync.adapter_sync`): the PEFT config and tensors of
    `trained_adapters(seed)`, by value, one entry per TP rank."""
    from megarl.sync.adapter_sync import from_tensors_request, peft_adapter, serialize_by_value

    config, tensors = peft_adapter(trained_adapters(seed), RANK, ALPHA, "base")
    return {**from_tensors_request(name, config, serialize_by_value(tensors), tp_size), **fields}


def greedy_logprobs(url, lora_name):
    body = {"input_ids": PROMPTS, "lora_path": lora_name, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    outs = requests.post(url + "/generate", json=body, timeout=60).json()
    return [[lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] for out in outs]


def test_an_adapter_sent_as_tensors_serves_what_its_peft_directory_serves(
        server, adapter_dirs, tiny_model_dir, tiny_hf, helpers):
    """The same adapter (seed 1) loaded from the request and from its PEFT directory: greedy
    generation gives identical log-probs, and sampled ones equal `peft`'s on that directory."""
    control = SyncServer(server.url)
    reply = control._call("POST", "/load_lora_adapter_from_tensors", tensors_body("tensor-v1", 1))
    assert reply["success"] and reply["loaded_adapters"]["tensor-v1"] == "__tensor__"  # SGLang's lora_path
    control.load_lora_adapter("dir-v1", adapter_dirs[0])
    assert greedy_logprobs(server.url, "tensor-v1") == greedy_logprobs(server.url, "dir-v1")
    oracle = peft_model(tiny_model_dir, adapter_dirs[0], helpers)
    adapted = generate(server.url, "tensor-v1")
    assert max_logprob_gap(adapted, oracle, helpers) <= 1e-4
    assert max_logprob_gap(adapted, tiny_hf, helpers) > 1e-2  # negative control: the adapter changed the policy
    control.unload_lora_adapter("dir-v1")
    # SGLang registers it with the path "__tensor__": named after its unload, it cannot be reloaded
    control.unload_lora_adapter("tensor-v1")
    body = {"input_ids": [5, 6], "lora_path": "tensor-v1", "sampling_params": {"max_new_tokens": 2}}
    resp = requests.post(server.url + "/generate", json=body, timeout=30)
    assert resp.status_code == 400 and "Failed to implicitly load LoRA adapter tensor-v1" in resp.text


@pytest.mark.parametrize("change, message", [
    ({"lora_name": "held"}, "Failed to load LoRA adapter held because it is already loaded"),
    ({"config_dict": {"r": RANK, "lora_alpha": ALPHA}}, "adapter config lacks ['target_modules']"),
    ({"config_dict": {"r": RANK + 1, "lora_alpha": ALPHA, "target_modules": list(TARGETS)}},
     "is incompatible with the current LoRA memory pool"),  # --max-lora-rank RANK
    ({"config_dict": {"r": RANK, "lora_alpha": ALPHA, "target_modules": [*TARGETS, "embed_tokens"]}},
     "`--lora-target-modules`"),  # embed_tokens is not served
    ({"config_dict": {"r": RANK, "lora_alpha": ALPHA, "target_modules": list(TARGETS), "use_dora": True}},
     "doesn't support DoRA adapters"),
    ({"added_tokens_config": {"<new>": 500}}, "doesn't support adapters that add tokens to the vocabulary"),
    ({"serialized_named_tensors": ["not base64!"]}, "is not valid base64"),
    ({"tp_size": 2}, "serialized_named_tensors has 2 entries; this server has TP size 1"),
    ({"payload": ["a", "list"]}, "the tensors must be a dict {PEFT name: tensor}, got list"),
    ({"payload": {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(RANK, 64)}},
     "lack lora_A or lora_B"),
    ({"payload": {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(RANK, 32),
                  "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, RANK)}},
     "does not fit the served model"),
    ({"forbidden": True}, "is not allowed in a weight payload"),
    ({"expected_checksums": {"x": "0" * 64}}, "[LORA-CHECK] rank0 adapter sync MISMATCH"),
], ids=["duplicate-name", "config-lacks-key", "rank-above-max", "target-not-served", "dora", "added-tokens",
        "bad-base64", "entries-not-tp-size", "not-a-dict", "lacks-B", "wrong-shape", "forbidden-global",
        "checksum-mismatch"])
def test_load_from_tensors_refuses_what_sglang_refuses(server, change, message):
    """SGLang 0.5.23's refusals (HTTP 400, `success` false, `error_message`): a name in use, a
    config it cannot read, a rank above --max-lora-rank, targets not served, DoRA, added tokens;
    and malformed tensors (an unpicklable entry or a checksum mismatch, which end SGLang's
    scheduler, are refused here)."""
    import base64
    import os
    import pickle

    from megarl.sync.adapter_sync import serialize_by_value

    control = SyncServer(server.url)
    change = dict(change)
    name = change.pop("lora_name", "bad")
    if name == "held":
        control._call("POST", "/load_lora_adapter_from_tensors", tensors_body("held", 1))
    body = tensors_body(name, 1, tp_size=change.pop("tp_size", 1))
    if "payload" in change:
        body["serialized_named_tensors"] = [serialize_by_value(change.pop("payload"))]
    if change.pop("forbidden", False):
        body["serialized_named_tensors"] = [base64.b64encode(pickle.dumps({"x": os.getcwd})).decode()]
    body.update(change)
    try:
        resp = requests.post(server.url + "/load_lora_adapter_from_tensors", json=body, timeout=30)
        assert resp.status_code == 400, resp.text
        reply = resp.json()
        assert reply["success"] is False and message in reply["error_message"], reply
        assert "bad" not in reply["loaded_adapters"]
    finally:
        if name == "held":
            control.unload_lora_adapter("held")


def test_adapter_sync_pushes_by_tensors_and_writes_nothing(server, tiny_model_dir, adapter_dirs, helpers, tmp_path):
    """`AdapterSync` (sync_via=tensors, the default) on one server: version 7 is served with PEFT's
    log-probs; version 8 replaces it (7 unloaded) and the server names version 8. No directory is
    written (there is none to give it); sync_via=disk writes one and loads it by path."""
    import os

    from megarl.sync.adapter_sync import AdapterSync

    cwd = os.getcwd()
    os.chdir(tmp_path)  # anything written relative to the working directory would show here
    try:
        sync = AdapterSync([], RANK, ALPHA, tiny_model_dir, [server.url], tp_group="n/a", pp_group="n/a")
        assert sync.out_dir is None
        error, metrics = sync._send(trained_adapters(1), 7)
        assert error is None and metrics["sync/adapter_tensors"] == 2 * 5 * 2, error
        oracle = peft_model(tiny_model_dir, adapter_dirs[0], helpers)
        assert max_logprob_gap(generate(server.url, "megarl-actor-v7"), oracle, helpers) <= 1e-4
        error, _ = sync._send(trained_adapters(2), 8)
        held = SyncServer(server.url)._call("POST", "/unload_lora_adapter", {"lora_name": "megarl-actor-v8"})
        assert error is None and "megarl-actor-v7" not in held["loaded_adapters"], (error, held)
        assert SyncServer(server.url).weight_version() == "8"
        assert list(tmp_path.iterdir()) == []

        disk = AdapterSync([], RANK, ALPHA, tiny_model_dir, [server.url], str(tmp_path / "lora_sync"), via="disk",
                           tp_group="n/a", pp_group="n/a")
        error, _ = disk._send(trained_adapters(1), 9)
        (written,) = (tmp_path / "lora_sync").iterdir()
        held = SyncServer(server.url)._call("POST", "/unload_lora_adapter", {"lora_name": "megarl-actor-v9"})
        assert error is None and (written / "adapter_model.safetensors").is_file(), error
    finally:
        os.chdir(cwd)
