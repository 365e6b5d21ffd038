"""A push after an update leaves an FP8 server's weights equal, bit for bit, to the trainer's weights
quantized by an oracle: the values and scales it holds, and the dequantized weights it computes with.

The trainer: real megatron-core on 2 gloo ranks (`fp8_world.py`), a dense Qwen2 at TP 2 pushed through
the distributed, tensor and disk transports after an update each, and a Qwen3-MoE at EP 2 (each EP rank
sends its own experts) through the distributed one. The servers: megarl's CPU engine in this process
(so that the test reads its parameters), each serving the FP8 checkpoint megarl wrote of *another*
random model of the same shapes, so only a push makes them equal. The dense model has ragged blocks in
every quantized weight (hidden 192 = 1.5 blocks) and a fused qkv_proj kept unquantized (k and v of 64
rows). The oracle: transformers 5.25's quantizer and dequantizer (`integrations/finegrained_fp8.py`) on
the zero-padded HF weights, cropped (it takes whole blocks only), of the actor's state merged by the
bridge from the ranks' shards."""
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import uvicorn

from megarl.bridge import ParallelLayout
from megarl.bridge.sharding import merge_model
from megarl.data.tiny_model import make_tiny_model
from megarl.net import free_port
from megarl.rollout.cpu.checkpoint_names import checkpoint_tensor
from megarl.rollout.cpu.engine import CPUEngine
from megarl.rollout.cpu.server import build_app
from megarl.sync.fp8_checkpoint import write_rollout_checkpoint
from megarl.testing import run_gloo_workers
from fp8_world import DIVISIBLE_BY, fp8_world
from sync_world import weight_map

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from fp8_oracles import same_bits, transformers_dequantize, transformers_quantize  # noqa: E402

DENSE = dict(arch="qwen2", layers=2, hidden=192, heads=6, kv_heads=2, intermediate=384)
MOE = dict(arch="qwen3_moe", layers=2, hidden=128, heads=2, kv_heads=2, intermediate=128, tie=False)
TRANSPORTS = ("distributed", "tensor", "disk")


class InProcessServer:
    """A CPU engine behind SGLang's endpoints (`build_app`) on a thread of this process."""

    def __init__(self, model_dir: Path):
        self.engine = CPUEngine(str(model_dir), dtype="bfloat16")
        port = free_port("127.0.0.1")
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.engine), host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name=f"fp8-server-{port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the in-process server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.engine.shutdown()


def oracle_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    values, scale_inv = transformers_quantize(F.pad(w, (0, -cols % 128, 0, -rows % 128)))
    return values[:rows, :cols].contiguous(), scale_inv


def oracle_dequantize(values: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = values.shape
    padded = F.pad(values.view(torch.uint8), (0, -cols % 128, 0, -rows % 128)).view(values.dtype)  # zeros
    return transformers_dequantize(padded, scale_inv, dtype)[:rows, :cols]


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """(per push: (transport, metrics, the actor's HF weights, the server's engine, quantized names))."""
    root = tmp_path_factory.mktemp("fp8-push")
    cases, servers = {}, []
    try:
        for name, sizes in (("dense", DENSE), ("moe", MOE)):
            actor = make_tiny_model(out_dir=root / name, seed=1, **sizes)
            served = make_tiny_model(out_dir=root / f"{name}-served", seed=2, **sizes)
            plan = write_rollout_checkpoint(served, root / f"{name}-fp8", tp_size=1)
            cases[name] = dict(hf_dir=str(actor), fp8_dir=str(root / f"{name}-fp8"), quantized=plan.quantized,
                               bucket_bytes=96 * 1024, disk_dir=str(root / f"{name}-disk"), ignored=plan.ignored_layers)
        dense_servers = [InProcessServer(cases["dense"]["fp8_dir"]) for _ in TRANSPORTS]
        servers += dense_servers
        servers.append(InProcessServer(cases["moe"]["fp8_dir"]))
        cases["dense"]["servers"] = [(t, s.url) for t, s in zip(TRANSPORTS, dense_servers)]
        cases["moe"]["url"] = servers[-1].url
        ranks = run_gloo_workers(fp8_world, 2, args=(cases["dense"], cases["moe"]), timeout_s=600)
        pushes = []
        for k, transport in enumerate(TRANSPORTS):
            pushes.append((transport, ranks[0]["dense"][k]["metrics"],
                           actor_hf(cases["dense"], [r["dense"][k]["state"] for r in ranks], ParallelLayout(2, 1), 2),
                           dense_servers[k].engine, cases["dense"]))
        pushes.append(("distributed, EP 2", ranks[0]["moe"]["metrics"],
                       actor_hf(cases["moe"], [r["moe"]["state"] for r in ranks], ParallelLayout(tp=1, ep=2, etp=1),
                                1),
                       servers[-1].engine, cases["moe"]))
        yield pushes
    finally:
        for server in servers:
            server.stop()


def actor_hf(case: dict, states: list, layout: ParallelLayout, tp: int) -> dict:
    """The actor's HF weights: the ranks' chunk states merged (`bridge.merge_model`) and named as HF's."""
    weights = weight_map(Path(case["hf_dir"]), tp, DIVISIBLE_BY)
    shards = {key: sd for state in states for key, sd in state.items()}
    full = merge_model(weights, shards, layout)
    return {hf_name: t for name, tensor in full.items() for hf_name, t in weights.to_hf(name, tensor)}


@pytest.mark.parametrize("push", range(len(TRANSPORTS) + 1), ids=[*TRANSPORTS, "distributed-ep2"])
def test_the_servers_weights_are_the_trainers_quantized_ones_bit_for_bit(pushed, push):
    transport, metrics, actor, engine, case = pushed[push]
    assert metrics["sync/checked_tensors"] > 0  # the servers' checksums of values and scales equaled the emitters'
    state = engine.model.state_dict()
    quantized = case["quantized"]
    assert engine.fp8.quantized == quantized and len(quantized) >= 8
    ragged = 0
    for name, tensor in actor.items():
        served = checkpoint_tensor(state, name)
        if name in quantized:
            values, scale_inv = oracle_quantize(tensor)
            held_values, held_scale = engine.fp8.held[name]
            assert same_bits(held_values, values) and torch.equal(held_scale, scale_inv), (transport, name)
            assert same_bits(served, oracle_dequantize(values, scale_inv, torch.bfloat16)), (transport, name)
            ragged += any(d % 128 for d in tensor.shape)
        else:
            assert same_bits(served, tensor.to(torch.bfloat16)), (transport, name)
    if push < len(TRANSPORTS):  # the dense model: ragged blocks everywhere, qkv_proj unquantized
        assert ragged == len(quantized) and len(case["ignored"]) == 6
