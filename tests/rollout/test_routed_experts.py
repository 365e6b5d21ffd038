"""Routed experts from megarl's CPU engine, in SGLang 0.5.23's request and response names
(megarl.rollout.routed_experts): checked against HF's own router logits on the whole sequence."""
import base64
import threading

import numpy as np
import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.client import Sample
from megarl.rollout.cpu.engine import CPUEngine
from megarl.rollout.cpu.server import _output
from megarl.rollout.protocol import BadRequestError, SamplingParams, parse_generate_body
from megarl.rollout.routed_experts import encode_routed_experts, route_dtype


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe") / "m", layers=2, hidden=64, heads=4,
                           kv_heads=2, intermediate=32, seed=1)


def generate(engine, requests):
    """requests: [(prompt, sampling, start_len)] -> finished sequences, in submission order per request."""
    done, seqs = threading.Semaphore(0), []
    total = 0
    for i, (prompt, sampling, start) in enumerate(requests):
        engine.submit(prompt, sampling, True, f"r{i}", lambda s: (seqs.append(s), done.release()),
                      routed_experts_start_len=start)
        total += sampling.n
    for _ in range(total):
        assert done.acquire(timeout=120)
    return sorted(seqs, key=lambda s: (s.rid, s.index))


def hf_routes(model, ids: list[int]) -> torch.Tensor:
    """The oracle: [T, layers, top_k] experts of HF's own router logits (top-k of the softmax),
    one forward on the whole sequence, sorted within each top-k."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    picks = [torch.topk(torch.softmax(logits.float(), -1), k, -1).indices for logits in out.router_logits]
    return torch.stack(picks, 1).sort(-1).values


def test_cpu_engine_returns_the_routes_of_every_input_position(moe_dir):
    """Batched prefill (left-padded prompts of different lengths) and decode: rows for positions
    [start_len, prompt + output - 1) equal HF's routing of the finished sequence; through the
    server's JSON (base64 int32) and the client's decoding."""
    engine = CPUEngine(str(moe_dir), return_routed_experts=True)
    try:
        seqs = generate(engine, [([3, 4, 5, 6, 7], SamplingParams(max_new_tokens=6, n=2, ignore_eos=True), 0),
                                 ([9, 2], SamplingParams(max_new_tokens=4, ignore_eos=True), 1)])
    finally:
        engine.shutdown()
    layers, k = engine.config.num_hidden_layers, engine.config.num_experts_per_tok
    for seq in seqs:
        full = seq.prompt_ids + seq.output_ids
        rows = len(full) - 1 - seq.routed_experts_start_len
        out = _output(engine, seq, seq.sampling.n)
        # SGLang's own decoding (srt/state_capturer/routed_experts.py: extract_routed_experts_from_meta_info)
        flat = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        assert flat.size == rows * layers * k
        routes = Sample.from_sglang(out, (rows, layers, k)).routed_experts
        assert routes.shape == (rows, layers, k) and routes.dtype == torch.int32
        assert torch.equal(routes.reshape(-1), torch.from_numpy(flat.copy()))
        expected = hf_routes(engine.model, full)[seq.routed_experts_start_len: len(full) - 1]
        assert torch.equal(routes.sort(-1).values.long(), expected)


def test_no_routes_without_the_server_flag_or_the_request_field(moe_dir):
    engine = CPUEngine(str(moe_dir))  # no --enable-return-routed-experts: SGLang has no capturer then
    try:
        (seq,) = generate(engine, [([3, 4], SamplingParams(max_new_tokens=2), 0)])
    finally:
        engine.shutdown()
    assert "routed_experts" not in _output(engine, seq, 1)["meta_info"]
    with pytest.raises(ValueError, match="enable-return-routed-experts"):
        Sample.from_sglang(_output(engine, seq, 1), (3, 2, 2))


def test_request_fields_parse_as_sglang_reads_them():
    body = parse_generate_body({"input_ids": [[1, 2, 3], [4, 5]], "return_routed_experts": True,
                                "routed_experts_start_len": [2, 0]})
    assert [(p.return_routed_experts, p.routed_experts_start_len) for p in body.prompts] == [(True, 2), (True, 0)]
    assert parse_generate_body({"input_ids": [1, 2]}).prompts[0].return_routed_experts is False
    # SGLang refuses a start outside [0, input tokens] (scheduler.py, handle_generate_request)
    for start in (-1, 3):
        with pytest.raises(BadRequestError, match="routed_experts_start_len"):
            parse_generate_body({"input_ids": [1, 2], "return_routed_experts": True, "routed_experts_start_len": start})


def test_routes_are_narrowed_after_decoding_sglangs_int32():
    """The wire keeps SGLang's base64 int32; the client holds the routes in the narrowest dtype for
    the model's experts: 256 experts (0..255) fit one byte, 16 bytes of int32 become 4."""
    assert [route_dtype(e) for e in (8, 256, 257, 384, 2**15, 2**15 + 1)] == [
        torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int16, torch.int32]
    hand = torch.tensor([[[255, 0]], [[7, 128]]])  # 2 positions, 1 layer, top-2
    encoded = encode_routed_experts(hand)
    assert len(base64.b64decode(encoded)) == 16
    output = {"output_ids": [4, 5], "meta_info": {"routed_experts": encoded, "finish_reason": {"type": "length"}}}
    routes = Sample.from_sglang(output, (2, 1, 2), num_experts=256).routed_experts
    assert routes.dtype == torch.uint8 and routes.tolist() == [[[255, 0]], [[7, 128]]] and routes.nbytes == 4
    assert Sample.from_sglang(output, (2, 1, 2)).routed_experts.dtype == torch.int32  # as sent
    with pytest.raises(ValueError, match=r"outside \[0, 128\)"):  # the server runs another model
        Sample.from_sglang(output, (2, 1, 2), num_experts=128)
