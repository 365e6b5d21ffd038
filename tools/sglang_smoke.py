"""Smoke test of megarl's rollout stack against a real SGLang server, on a GPU or on this machine's CPU.

    python tools/sglang_smoke.py MODEL_DIR                  # a GPU, SGLang beside megarl (pip install -e .[gpu])
    python tools/sglang_smoke.py MODEL_DIR --device cpu     # SGLang from .venv-sglang (make install-sglang)

MODEL_DIR: a small HF checkpoint, with its tokenizer, of an architecture megarl's bridge maps (qwen2,
llama, qwen3, ...). One SGLang server (TP 1) started as megarl starts a colocated one
(`rollout.launch.sglang_server_command`, `sglang_server_env`): with `--api-key` and, on a GPU,
`--enable-memory-saver` (`uses_memory_saver`; a CPU has none: there release and resume answer and free
nothing). It serves in `--dtype` (default float32 on cpu, bfloat16 on cuda). Two sets of log-probs are
"equal" when their gap is at most `--tol` nats and "differ" when it is more: the gap is the max |diff|
over the tokens in float32 (exact up to rounding; default 1e-3), the mean |diff| in bfloat16 (kernels
round differently, and a max over many tokens grows with their number; default 0.05). On a GPU the
server and the actor share GPU 0 (pick it with CUDA_VISIBLE_DEVICES). Every step prints a figure or a
check (`[ok]` / `[FAIL]`); the exit code is 1 if a check failed or a step raised.

 1. the server: started by megarl's `ServerProcess` (waits for /health); its /model_info, /server_info;
 2. the API key: /health answers without it; /model_info and /generate without it are refused 401, at
    the server and at the router; every other call of this script carries it;
 3. the real `sglang-router` in front, `--prompts` x `--n` samples through `RolloutClient`;
 4. teacher-forced scores (`input_token_logprobs`) against transformers in float32 on the same weights;
 5. teacher scoring at temperature 0.7: SGLang's input log-probs ignore the request's temperature (a
    plain log_softmax of the logits: `layers/logprob_processor.py::InputLogprobProcessor._forward_by_chunk`,
    which `layers/logits_processor.py::LogitsProcessor.forward` calls for input log-probs; only the
    output tokens' log-probs see the temperature), so scores asked at T=0.7 equal transformers'
    log_softmax at T=1 and differ from it at T=0.7;
 6. `/update_weights_from_disk` to a perturbed copy (final norm x 0.5), then back;
 7. the distributed push (`sync.transports.DistributedTransport`: gloo with the sender's tensors on the
    CPU, or NCCL from `--trainer-gpu`, a GPU the server does not use) of the perturbed weights: the
    scores equal the disk-perturbed model's; then the original weights the same way;
 8. the colocated cycle through the production push: megarl's actor (`ActorEngine`, megatron-core, the
    same checkpoint) in this process, first compared with the server (greedy samples, the actor's
    log-probs of them); then `placement.colocated_memory`'s order: release all memory (on a GPU the
    device's free memory grows), the actor "trains" (seeded noise, `--noise` x each tensor's RMS, on
    the checkpoint's weights), resume `weights`, `WeightSync` with the tensor transport (CUDA IPC handles
    on a GPU, `sync/ipc_copies.py`; shared memory on a CPU), resume `kv_cache` and `cuda_graph`
    (SGLang 0.5.23's tags, `srt/constants.py`); the server's greedy log-probs equal the actor's;
 9. `--rounds` rounds of generate-then-release, each: generate greedily (log-probs equal the actor's,
    the samples carry the last pushed weight version), release all, the actor trains, resume weights,
    push, resume the rest; seconds per round. A last generation checks the last push.

Everything it starts (the server, the router and their children) is stopped by PID at the end, also
after a failure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

import requests
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        FAILURES.append(what)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--server-python", default=None,
                   help="interpreter with SGLang (default: cuda, this one; cpu, $MEGARL_SGLANG_PYTHON or .venv-sglang)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the server's and the actor's (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--tol", type=float, default=None,
                   help="nats: of the max |diff| in float32 (default 1e-3), the mean |diff| in bfloat16 (default 0.05)")
    p.add_argument("--mem-fraction-static", type=float, default=0.5, help="cuda only")
    p.add_argument("--trainer-gpu", type=int, default=None,
                   help="step 7's sender on this GPU over NCCL (another than the server's); default gloo from the CPU")
    p.add_argument("--prompts", type=int, default=None, help="step 3 (default 64 on cuda, 4 on cpu)")
    p.add_argument("--n", type=int, default=None, help="step 3's samples per prompt (default 4 on cuda, 2 on cpu)")
    p.add_argument("--prompt-len", type=int, default=None, help="tokens (default 64 on cuda, 16 on cpu)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="step 3 (default 256 on cuda, 16 on cpu)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--noise", type=float, default=0.1, help="the actor's update: seeded noise x each tensor's RMS")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--startup-timeout-s", type=float, default=900)
    p.add_argument("--log-dir", default=None)
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.metric = "max" if args.dtype == "float32" else "mean"
    args.tol = args.tol if args.tol is not None else (1e-3 if args.dtype == "float32" else 0.05)
    args.prompts = args.prompts or (64 if cuda else 4)
    args.n = args.n or (4 if cuda else 2)
    args.prompt_len = args.prompt_len or (64 if cuda else 16)
    args.max_new_tokens = args.max_new_tokens or (256 if cuda else 16)
    if args.server_python is None:
        args.server_python = sys.executable if cuda else (
            os.environ.get("MEGARL_SGLANG_PYTHON") or str(REPO / ".venv-sglang" / "bin" / "python"))
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="megarl-sglang-smoke-")
    return args


# ---------------------------------------------------------------------------------------- scores
def raw_scores(url: str, api_key: str, sequences: list[list[int]], temperature: float) -> list[list[float]]:
    """SGLang's teacher-forced log-probs of every token after the first (`input_token_logprobs`), the
    request asking for `temperature`: the raw request, as a teacher-scoring client sends it."""
    body = {"input_ids": sequences, "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "return_logprob": True, "logprob_start_len": 0}
    resp = requests.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {api_key}"}, timeout=600)
    resp.raise_for_status()
    return [[e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None] for out in resp.json()]


def hf_scores(model, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
    """transformers' log_softmax(logits / temperature) of every token after the first (float32)."""
    scores = []
    for seq in sequences:
        ids = torch.tensor([seq], device=model.device)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, dim=-1)
        scores.append(logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return scores


def flat(scores: list[list[float]]) -> torch.Tensor:
    return torch.tensor([x for row in scores for x in row], dtype=torch.float64)


def gap_of(metric: str):
    """gap(a, b): the max or the mean (`metric`) of |a - b| over the tokens (flat tensors or score lists)."""
    def gap(a, b) -> float:
        a, b = (flat(x) if isinstance(x, list) else x.double() for x in (a, b))
        diff = (a - b).abs()
        return (diff.max() if metric == "max" else diff.mean()).item()
    return gap


def status_without_key(url: str, method: str, path: str, body=None) -> int:
    return requests.request(method, url + path, json=body, timeout=60).status_code


# ---------------------------------------------------------------------------------------- weights
def hf_params(model_dir: str, perturbed_dir: Optional[Path] = None) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters (HF names, its dtype); with `perturbed_dir`, the final norm halved,
    saved there as a complete checkpoint (the config and tokenizer files of `model_dir`)."""
    from megarl.bridge.convert import copy_hf_assets

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    if perturbed_dir is not None:
        with torch.no_grad():
            model.model.norm.weight.mul_(0.5)
        model.save_pretrained(perturbed_dir)
        copy_hf_assets(Path(model_dir), perturbed_dir)
    return {n: p.detach() for n, p in model.named_parameters()}


def hf_buckets(params: dict[str, torch.Tensor], device: str, bucket_bytes: int) -> list:
    """`params` as `HFBucket`s of about `bucket_bytes` on `device`, grouped by dtype (every offset aligned)."""
    from megarl.rollout.weight_group import bucket_layout, flatten_tensors
    from megarl.sync.resharder import HFBucket

    groups: list[list[tuple[str, torch.Tensor]]] = []
    for dtype in sorted({t.dtype for t in params.values()}, key=lambda d: -d.itemsize):
        current, size = [], 0
        for name, tensor in params.items():
            if tensor.dtype != dtype:
                continue
            if current and size + tensor.nbytes > bucket_bytes:
                groups.append(current)
                current, size = [], 0
            current.append((name, tensor))
            size += tensor.nbytes
        if current:
            groups.append(current)
    buckets = []
    for index, group in enumerate(groups):
        flat, fields = flatten_tensors(group)
        slots = tuple(bucket_layout(fields["names"], fields["dtypes"], fields["shapes"]))
        buckets.append(HFBucket(index, len(groups), flat.to(device), slots, final=index == len(groups) - 1))
    return buckets


def push_distributed(transport, server, buckets, version: str) -> float:
    """One push through `transport` (`DistributedTransport`) inside an update session; returns GB/s."""
    start = time.perf_counter()
    transport.open_stream(version)
    server.begin_weight_update()
    try:
        for bucket in buckets[:-1]:
            transport.send(bucket)
        transport.commit(buckets[-1], [], version)
    finally:
        server.end_weight_update()
    return sum(b.nbytes for b in buckets) / (time.perf_counter() - start) / 1e9


# ---------------------------------------------------------------------------------------- the actor
def greedy_vs_actor(client, engine, prompts, max_new_tokens: int, gap):
    """Greedy samples through `client`, scored by the actor (T=1): (gap(server, actor) over the
    tokens, the samples' weight versions, the batch, the actor's log-probs [B, R])."""
    from megarl.data.batch import Batch
    from megarl.rollout.protocol import SamplingParams

    out = client.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
    samples = [s[0] for s in out.samples]
    batch = Batch.from_token_lists(prompts, [s.token_ids for s in samples])
    ours = engine.compute_log_prob(batch, 1.0)["log_probs"]
    theirs = torch.zeros_like(ours)
    for i, s in enumerate(samples):
        theirs[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
    mask = batch["response_mask"].bool()
    return gap(ours[mask], theirs[mask]), {s.weight_version for s in samples}, batch, ours


def train_actor(engine, originals: list[torch.Tensor], seed: int, noise: float) -> None:
    """The actor's "update": every parameter = the checkpoint's + seeded noise x its RMS."""
    params = [p for chunk in engine.model_chunks for p in chunk.parameters()]
    g = torch.Generator(device=params[0].device).manual_seed(seed)
    with torch.no_grad():
        for param, original in zip(params, originals):
            rms = original.float().pow(2).mean().sqrt()
            step = torch.randn(param.shape, generator=g, device=param.device) * (noise * rms)
            param.copy_((original.float() + step).to(param.dtype))


def free_gpu_bytes(cuda: bool) -> int:
    return torch.cuda.mem_get_info()[0] if cuda else 0


class Colocated:
    """The colocated cycle as the trainer runs it (`runtime/cluster.py`): `placement.colocated_memory`
    says which memory each phase releases and resumes, the actor's allocator cache is emptied before
    a resume, and `WeightSync` (tensor transport) pushes. The actor offloads nothing (a small model)."""

    def __init__(self, server, engine, sync, cuda: bool):
        from megarl.placement.colocated_memory import ColocatedMemory
        from megarl.placement.colocation import OffloadParts

        self.server, self.engine, self.sync, self.cuda = server, engine, sync, cuda
        self.memory = ColocatedMemory(1, {"actor": OffloadParts()}, releases=True)

    def _do(self, moves) -> None:
        for tags in moves.release.values():
            self.server.release_memory_when_idle(list(tags))  # as the fleet does
        if moves.empty_cache:  # SGLang's memory saver maps its memory again from what is physically free
            self.engine.empty_cache()
        for tags in moves.resume.values():
            self.server.resume_memory_occupation(list(tags))
        self.memory.apply(moves)

    def release(self) -> dict:
        """Before training: every tag released. Returns seconds and the device's free bytes before/after."""
        free_before, start = free_gpu_bytes(self.cuda), time.perf_counter()
        self._do(self.memory.before_training())
        return {"release_s": time.perf_counter() - start, "freed_bytes": free_gpu_bytes(self.cuda) - free_before}

    def push(self) -> dict:
        """Resume weights, push, resume the KV cache and CUDA graphs. Returns seconds and the push's metrics."""
        start = time.perf_counter()
        self._do(self.memory.before_push())
        resumed = time.perf_counter()
        metrics = self.sync.push(flush=self.memory.flush_before_push())
        pushed = time.perf_counter()
        self._do(self.memory.after_push())
        return {"resume_weights_s": resumed - start, "push_s": pushed - resumed,
                "resume_rest_s": time.perf_counter() - pushed, **metrics}


# ---------------------------------------------------------------------------------------- main
def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check import experiment_config, init_single_process  # the actor's world and config, as gpu_check's
    from transformers.utils import logging as hf_logging

    from megarl.engines.megatron.roles import ActorEngine
    from megarl.net import free_port
    from megarl.rollout.client import RolloutClient
    from megarl.rollout.launch import rollout_api_key, sglang_server_command, sglang_server_env, uses_memory_saver
    from megarl.rollout.process import ServerProcess
    from megarl.rollout.protocol import SamplingParams
    from megarl.rollout.router import Router
    from megarl.sync import SyncConfig, WeightSync
    from megarl.sync.servers import SyncServer
    from megarl.sync.transports import DistributedTransport

    hf_logging.disable_progress_bar()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --device cpu", file=sys.stderr)
        return 2
    gap, tol, gap_name = gap_of(args.metric), args.tol, f"{args.metric} |diff|"
    api_key = rollout_api_key(None)
    saver = uses_memory_saver(args.device, colocated=True)
    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    vocab = config["vocab_size"]
    context = None if cuda else min(config.get("max_position_embeddings", 1024), 1024)  # sizes a CPU's KV pool
    port = free_port("127.0.0.1")
    server_process = ServerProcess(
        "sglang",
        sglang_server_command(
            args.model_dir, port, device=args.device, max_running_requests=64 if cuda else 8,
            mem_fraction_static=args.mem_fraction_static if cuda else None, enable_memory_saver=saver,
            api_key=api_key, dtype=args.dtype, context_length=context, python=args.server_python,
        ),
        f"http://127.0.0.1:{port}",
        env=sglang_server_env(os.environ, device=args.device, enable_memory_saver=saver, colocated=True),
        log_path=os.path.join(args.log_dir, "sglang.log"),
        startup_timeout_s=args.startup_timeout_s,
    )
    router = Router([server_process.url], free_port("127.0.0.1"), prometheus_port=free_port("127.0.0.1"),
                    api_key=api_key, log_path=os.path.join(args.log_dir, "router.log"))
    url = server_process.url
    server = SyncServer(url, api_key, timeout_s=600)
    client = RolloutClient(router.url, api_key=api_key, abort_urls=[url])
    transport = sync = None
    world = False
    print(f"logs: {args.log_dir}; device {args.device}, dtype {args.dtype}; equal: {gap_name} <= {tol} nats",
          flush=True)
    try:
        print("1. SGLang server", flush=True)
        start = time.perf_counter()
        server_process.start()
        print(f"  started in {time.perf_counter() - start:.1f} s (pid {server_process.pid}), memory saver "
              f"{'on' if saver else 'off (none on a CPU)'}")
        info, sinfo = server.model_info(), server.server_info()
        print(f"  sglang {sinfo.get('version')}, model {info['model_path']}, weight_version {info['weight_version']}")

        print("2. API key", flush=True)
        router.start()
        check(status_without_key(url, "GET", "/health") == 200, "/health answers without the key")
        probe = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
        for where, base, method, path, body in [("server", url, "GET", "/model_info", None),
                                                ("server", url, "POST", "/generate", probe),
                                                ("router", router.url, "POST", "/generate", probe)]:
            status = status_without_key(base, method, path, body)
            check(status == 401, f"{where} {method} {path} without the key: HTTP {status} (401 expected)")

        print("3. router + client", flush=True)
        print(f"  router workers: {router.worker_urls(healthy_only=True)}")
        g = torch.Generator().manual_seed(0)
        low, high = min(100, vocab // 4), min(vocab - 1, 30000)  # not the last id (SGLang reports it as 0)
        prompts = torch.randint(low, high, (args.prompts, args.prompt_len), generator=g).tolist()
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.n, ignore_eos=True)
        result = client.generate(prompts, sampling)
        m = result.metrics
        check(all(len(s) == args.n for s in result.samples), f"{args.prompts} prompts x n={args.n} all answered")
        print(f"  {m.response_tokens} tokens in {m.wall_s:.2f} s = {m.tokens_per_s:.0f} tokens/s; latency p50 "
              f"{m.latency_p50_s:.2f} s p99 {m.latency_p99_s:.2f} s; longest {m.longest_sample_tokens} tokens "
              f"in {m.longest_sample_s:.2f} s")

        print("4. teacher-forced scores vs transformers (float32)", flush=True)
        sequences = [prompt + result.samples[i][0].token_ids[:32] for i, prompt in enumerate(prompts[:8])]
        baseline = raw_scores(url, api_key, sequences, 1.0)
        hf = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to("cuda" if cuda else "cpu")
        hf_t1, hf_t07 = hf_scores(hf.eval(), sequences, 1.0), hf_scores(hf, sequences, 0.7)
        del hf
        if cuda:
            torch.cuda.empty_cache()
        check(gap(baseline, hf_t1) <= tol,
              f"{gap_name} sglang - hf over {len(flat(baseline))} tokens: {gap(baseline, hf_t1):.2e}")

        print("5. teacher scoring at T=0.7 (SGLang's input log-probs ignore the temperature)", flush=True)
        at_07 = raw_scores(url, api_key, sequences, 0.7)
        check(gap(at_07, hf_t1) <= tol,
              f"scores asked at T=0.7 equal hf's log_softmax at T=1: {gap_name} {gap(at_07, hf_t1):.2e}")
        check(gap(at_07, hf_t07) > tol, f"and differ from hf's at T=0.7: {gap_name} {gap(at_07, hf_t07):.3f}")

        print("6. update_weights_from_disk", flush=True)
        perturbed_dir = Path(args.log_dir) / "perturbed-checkpoint"
        perturbed = hf_params(args.model_dir, perturbed_dir)
        start = time.perf_counter()
        server.update_weights_from_disk(str(perturbed_dir), weight_version="disk-perturbed")
        print(f"  perturbed checkpoint loaded in {time.perf_counter() - start:.2f} s")
        disk_scores = raw_scores(url, api_key, sequences, 1.0)
        check(gap(disk_scores, baseline) > tol, f"scores moved ({gap_name} {gap(disk_scores, baseline):.3f})")
        check(server.weight_version() == "disk-perturbed", "weight_version reported")
        server.update_weights_from_disk(args.model_dir, weight_version="disk-original")
        back = raw_scores(url, api_key, sequences, 1.0)
        check(gap(back, baseline) <= tol, f"original weights restored ({gap_name} {gap(back, baseline):.2e})")

        backend = "nccl" if args.trainer_gpu is not None else "gloo"
        print(f"7. update_weights_from_distributed ({backend}, DistributedTransport)", flush=True)
        sender_device = f"cuda:{args.trainer_gpu}" if args.trainer_gpu is not None else "cpu"
        if args.trainer_gpu is not None:
            torch.cuda.set_device(args.trainer_gpu)
        transport = DistributedTransport([server], stage=0, backend=backend, master_address="127.0.0.1",
                                         group_timeout_s=600)
        bucket_bytes = args.bucket_mb << 20
        gbps = push_distributed(transport, server, hf_buckets(perturbed, sender_device, bucket_bytes), "dist-perturbed")
        size = sum(t.nbytes for t in perturbed.values())
        print(f"  pushed {size / 1e6:.1f} MB in buckets of {args.bucket_mb} MB (forming the group included): "
              f"{gbps:.3f} GB/s")
        dist_scores = raw_scores(url, api_key, sequences, 1.0)
        check(gap(dist_scores, disk_scores) <= tol,
              f"equals the disk-perturbed model ({gap_name} {gap(dist_scores, disk_scores):.2e})")
        push_distributed(transport, server, hf_buckets(hf_params(args.model_dir), sender_device, bucket_bytes),
                         "dist-original")
        back = raw_scores(url, api_key, sequences, 1.0)
        check(gap(back, baseline) <= tol, f"the original weights again ({gap_name} {gap(back, baseline):.2e})")
        transport.reset()  # the group goes, here and at the server
        transport = None

        print("8. colocated: megarl's actor; release -> train -> resume weights -> push (tensor transport) "
              "-> resume kv_cache, cuda_graph", flush=True)
        init_single_process(not cuda)
        world = True
        round_prompts, round_tokens = prompts[:4], min(args.max_new_tokens, 16)
        start = time.perf_counter()
        engine = ActorEngine(experiment_config(Path(args.model_dir), args.dtype, len(round_prompts), 2),
                             sequence_layout="padded")
        print(f"  actor built in {time.perf_counter() - start:.1f} s on {engine.device}")
        originals = [p.detach().clone() for chunk in engine.model_chunks for p in chunk.parameters()]
        sync = WeightSync(engine.model_chunks, engine.weight_map, [url],
                          SyncConfig(transport="tensor", bucket_bytes=bucket_bytes, dtype=getattr(torch, args.dtype),
                                     timeout_s=600, group_timeout_s=600), api_key=api_key)
        colocated = Colocated(server, engine, sync, cuda)
        diff, versions, batch, before = greedy_vs_actor(client, engine, round_prompts, round_tokens, gap)
        check(diff <= tol, f"the server and the actor on the checkpoint: {gap_name} sglang - actor {diff:.2e}")
        released = colocated.release()
        if cuda:
            check(released["freed_bytes"] > 0, f"release freed {released['freed_bytes'] / 2**30:.2f} GiB of the GPU")
        else:
            print(f"  released in {released['release_s']:.3f} s (no memory saver on a CPU: nothing freed)")
        train_actor(engine, originals, seed=0, noise=args.noise)
        mask = batch["response_mask"].bool()
        moved = gap(engine.compute_log_prob(batch, 1.0)["log_probs"][mask], before[mask])
        check(moved > tol, f"the actor's update moved its log-probs ({gap_name} {moved:.3f})")
        pushed = colocated.push()
        print(f"  resume weights {pushed['resume_weights_s']:.3f} s, push {pushed['push_s']:.3f} s "
              f"({pushed['sync/bytes'] / 1e6:.2f} MB, {pushed['sync/buckets']:.0f} buckets), "
              f"resume kv_cache + cuda_graph {pushed['resume_rest_s']:.3f} s")
        diff, versions, _, _ = greedy_vs_actor(client, engine, round_prompts, round_tokens, gap)
        check(diff <= tol and versions == {str(sync.version)},
              f"after the push: {gap_name} sglang - actor {diff:.2e}, samples of weight version {sorted(versions)}")

        print(f"9. {args.rounds} rounds of generate-then-release", flush=True)
        seconds, diffs = [], []
        for r in range(1, args.rounds + 1):
            start = time.perf_counter()
            diff, versions, _, _ = greedy_vs_actor(client, engine, round_prompts, round_tokens, gap)
            generated = time.perf_counter()
            released = colocated.release()
            train_actor(engine, originals, seed=r, noise=args.noise)
            pushed = colocated.push()
            seconds.append(time.perf_counter() - start)
            diffs.append(diff)
            check(diff <= tol and versions == {str(sync.version - 1)},
                  f"round {r}: {gap_name} sglang - actor {diff:.2e} (version {sorted(versions)}); generate "
                  f"{generated - start:.2f} s, release {released['release_s']:.2f} s, resume weights "
                  f"{pushed['resume_weights_s']:.2f} s, push {pushed['push_s']:.2f} s, resume the rest "
                  f"{pushed['resume_rest_s']:.2f} s; round {seconds[-1]:.2f} s")
        diff, versions, _, _ = greedy_vs_actor(client, engine, round_prompts, round_tokens, gap)
        check(diff <= tol and versions == {str(sync.version)},
              f"after round {args.rounds}'s push: {gap_name} sglang - actor {diff:.2e} (version {sorted(versions)})")
        if seconds:
            worst = max(diffs + [diff])
            check(worst <= tol, f"{args.rounds} rounds: greedy log-probs equal the actor's every round (worst "
                                f"{gap_name} {worst:.2e}); {statistics.mean(seconds):.2f} s per round (median "
                                f"{statistics.median(seconds):.2f}, max {max(seconds):.2f})")
    except Exception:
        traceback.print_exc()
        FAILURES.append("a step raised (traceback above)")
    finally:
        client.close()
        try:
            if transport is not None:  # step 7 failed: its group goes, here and at the server
                transport.reset()
            if sync is not None:
                sync.close()
        except Exception as e:
            print(f"  could not drop a weight-update group: {type(e).__name__}: {e}")
        router.stop()
        server_process.stop(timeout_s=60)
        if world:
            dist.destroy_process_group()
    print("FAILED: " + "; ".join(FAILURES) if FAILURES else "all checks passed", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
