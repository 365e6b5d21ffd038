"""GPU smoke test of megarl's rollout stack against a real SGLang server (needs `pip install -e .[gpu]`).

    python tools/sglang_smoke.py /path/to/small-hf-model [--tp-size 1] [--base-gpu-id 0] [--enable-memory-saver]

What it does, printing a figure or a check for every step (exit code 1 if a check fails):

 1. starts `python -m sglang.launch_server` on the model through megarl's `ServerProcess`, waits for
    `/health_generate`, reads `/model_info` and `/server_info`;
 2. starts the real `sglang-router` in front of it and generates `--prompts` x `--n` samples through
    `RolloutClient` (tokens/s, latency percentiles, the longest sample);
 3. scores fixed token sequences (teacher-forced `input_token_logprobs`) and compares them with
    `transformers` in float32 on the same weights (max |diff|; bf16 serving is expected around 1e-2);
 4. `/update_weights_from_disk` to a perturbed copy (final norm x 0.5), then back: the scores move,
    then return to the baseline;
 5. the distributed path: a gloo or NCCL group with this process as the trainer (rank 0),
    `begin_weight_update`, bucketed `flattened_bucket` broadcasts of the perturbed weights,
    `end_weight_update`: the scores must equal those of the disk-perturbed model (GB/s reported);
 6. with `--enable-memory-saver`: release all memory, resume weights, push the original weights over
    the same group, resume the KV cache, and score again (must equal the baseline).

NCCL needs the trainer on a GPU the server does not use (`--trainer-gpu`); otherwise gloo is used,
with the trainer's tensors on the CPU. The server, the router and their children are stopped by PID
at the end, also after a failure.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import torch
from transformers import AutoModelForCausalLM

from megarl.net import free_port
from megarl.rollout.client import RolloutClient
from megarl.rollout.control import ServerControl, ServerError
from megarl.rollout.launch import (
    apply_env_overrides,
    sglang_env_overrides,
    sglang_server_command,
)
from megarl.rollout.process import ServerProcess
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.router import Router
from megarl.rollout.weight_group import (
    destroy_process_group,
    flatten_tensors,
    init_custom_process_group,
    send_bucket,
)

FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        FAILURES.append(what)


def score(url: str, sequences: list[list[int]]) -> list[list[float]]:
    """Teacher-forced log-probs of every token after the first, from SGLang's input_token_logprobs."""
    body = {
        "input_ids": sequences,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    resp = requests.post(url + "/generate", json=body, timeout=600)
    resp.raise_for_status()
    return [[e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None] for out in resp.json()]


def hf_score(model, sequences: list[list[int]]) -> list[list[float]]:
    scores = []
    for seq in sequences:
        ids = torch.tensor([seq], device=model.device)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        scores.append(logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return scores


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def perturbed_copy(model_dir: str, out_dir: str) -> dict[str, torch.Tensor]:
    """Save the model with its final norm halved; return those perturbed parameters (HF names)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    with torch.no_grad():
        model.model.norm.weight.mul_(0.5)
    model.save_pretrained(out_dir)
    for name in os.listdir(model_dir):  # tokenizer files, so the copy is a complete checkpoint
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            shutil.copy(os.path.join(model_dir, name), out_dir)
    return {n: p.detach() for n, p in model.named_parameters()}


def original_params(model_dir: str) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    return {n: p.detach() for n, p in model.named_parameters()}


def buckets(params: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Group tensors by dtype (keeps every offset aligned), then cut into buckets of about `bucket_bytes`."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    for dtype in sorted({t.dtype for t in params.values()}, key=lambda d: -d.itemsize):
        current, size = [], 0
        for name, tensor in params.items():
            if tensor.dtype != dtype:
                continue
            if current and size + tensor.nbytes > bucket_bytes:
                out.append(current)
                current, size = [], 0
            current.append((name, tensor))
            size += tensor.nbytes
        if current:
            out.append(current)
    return out


def push_distributed(control, group, params, device, bucket_bytes, version) -> float:
    """Send all `params` in flattened buckets inside one weight-update session; returns GB/s."""
    total, start = 0, time.perf_counter()
    control.begin_weight_update()
    with ThreadPoolExecutor(1) as pool:
        for bucket in buckets(params, bucket_bytes):
            bucket = [(n, t.to(device)) for n, t in bucket]
            flat, fields = flatten_tensors(bucket)
            call = pool.submit(
                control.update_weights_from_distributed, fields["names"], fields["dtypes"], fields["shapes"],
                "megarl_smoke", "flattened_bucket", version,
            )
            send_bucket(group, bucket, "flattened_bucket")
            call.result(timeout=600)
            total += flat.numel()
    control.end_weight_update()
    seconds = time.perf_counter() - start
    return total / seconds / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--mem-fraction-static", type=float, default=0.5)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--trainer-gpu", type=int, default=None, help="trainer-side GPU (NCCL); default: gloo on CPU")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--startup-timeout-s", type=float, default=900)
    p.add_argument("--log-dir", default=tempfile.mkdtemp(prefix="megarl-sglang-smoke-"))
    args = p.parse_args()
    backend = "nccl" if args.trainer_gpu is not None else "gloo"
    trainer_device = f"cuda:{args.trainer_gpu}" if args.trainer_gpu is not None else "cpu"
    port = free_port("127.0.0.1")
    server = ServerProcess(
        "sglang",
        sglang_server_command(
            args.model_dir, port, tp_size=args.tp_size, base_gpu_id=args.base_gpu_id,
            mem_fraction_static=args.mem_fraction_static, enable_memory_saver=args.enable_memory_saver,
        ),
        f"http://127.0.0.1:{port}",
        health_path="/health_generate",
        env=apply_env_overrides(os.environ, sglang_env_overrides(args.enable_memory_saver)),
        log_path=os.path.join(args.log_dir, "sglang.log"),
        startup_timeout_s=args.startup_timeout_s,
    )
    router_log = os.path.join(args.log_dir, "router.log")
    router = Router([server.url], free_port("127.0.0.1"), prometheus_port=free_port("127.0.0.1"), log_path=router_log)
    print(f"logs: {args.log_dir}", flush=True)
    group = None
    control = ServerControl(server.url)
    client = RolloutClient(router.url, abort_urls=[server.url])
    try:
        print("1. SGLang server", flush=True)
        start = time.perf_counter()
        server.start()
        print(f"  started in {time.perf_counter() - start:.1f} s (pid {server.pid})")
        info, sinfo = control.model_info(), control.server_info()
        print(f"  sglang {sinfo.get('version')}, model {info['model_path']}, weight_version {info['weight_version']}")

        print("2. router + client", flush=True)
        router.start()
        print(f"  router workers: {router.worker_urls(healthy_only=True)}")
        vocab = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype="auto").config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, min(vocab, 30000), (args.prompts, 64), generator=g).tolist()
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.n, ignore_eos=True)
        result = client.generate(prompts, sampling)
        m = result.metrics
        check(all(len(s) == args.n for s in result.samples), f"{args.prompts} prompts x n={args.n} all answered")
        print(f"  {m.response_tokens} tokens in {m.wall_s:.2f} s = {m.tokens_per_s:.0f} tokens/s; latency p50 "
              f"{m.latency_p50_s:.2f} s p99 {m.latency_p99_s:.2f} s; longest {m.longest_sample_tokens} tokens "
              f"in {m.longest_sample_s:.2f} s")

        print("3. log-probs vs transformers (float32)", flush=True)
        sequences = [prompt + result.samples[i][0].token_ids[:32] for i, prompt in enumerate(prompts[:8])]
        baseline = score(server.url, sequences)
        hf = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(f"cuda:{args.base_gpu_id}")
        diff = max_diff(baseline, hf_score(hf, sequences))
        print(f"  max |sglang - hf| over {sum(map(len, baseline))} tokens: {diff:.4f}")
        del hf
        torch.cuda.empty_cache()

        print("4. update_weights_from_disk", flush=True)
        perturbed_dir = tempfile.mkdtemp(prefix="megarl-smoke-perturbed-")
        perturbed = perturbed_copy(args.model_dir, perturbed_dir)
        start = time.perf_counter()
        control.update_weights_from_disk(perturbed_dir, weight_version="disk-perturbed")
        print(f"  perturbed checkpoint loaded in {time.perf_counter() - start:.2f} s")
        disk_scores = score(server.url, sequences)
        check(max_diff(disk_scores, baseline) > 0.05, f"scores moved (max diff {max_diff(disk_scores, baseline):.3f})")
        check(control.weight_version() == "disk-perturbed", "weight_version reported")
        control.update_weights_from_disk(args.model_dir, weight_version="disk-original")
        back = score(server.url, sequences)
        check(max_diff(back, baseline) < 1e-2, f"original weights restored (max diff {max_diff(back, baseline):.4f})")

        print(f"5. update_weights_from_distributed ({backend})", flush=True)
        group_port = free_port("127.0.0.1")
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(
                control.init_weights_update_group, "127.0.0.1", group_port, 1, args.tp_size + 1, "megarl_smoke", backend
            )
            group = init_custom_process_group(backend, "127.0.0.1", group_port, 0, args.tp_size + 1, "megarl_smoke")
            joined.result(timeout=300)
        gbps = push_distributed(control, group, perturbed, trainer_device, args.bucket_mb << 20, "dist-perturbed")
        size = sum(t.nbytes for t in perturbed.values()) / 1e9
        print(f"  pushed {size:.2f} GB in buckets of {args.bucket_mb} MB: {gbps:.2f} GB/s")
        dist_scores = score(server.url, sequences)
        check(max_diff(dist_scores, disk_scores) < 1e-2,
              f"equals the disk-perturbed model (max diff {max_diff(dist_scores, disk_scores):.4f})")
        query = {"name": "model.norm.weight", "truncate_size": 4}
        norm = requests.post(server.url + "/get_weights_by_name", json=query, timeout=60).json()
        sent = perturbed["model.norm.weight"][:4].tolist()
        print(f"  /get_weights_by_name model.norm.weight[:4] = {norm}, sent {sent}")

        original = original_params(args.model_dir)
        if args.enable_memory_saver:
            print("6. release -> resume weights -> push original -> resume kv_cache", flush=True)
            control.flush_cache()
            start = time.perf_counter()
            control.release_memory_occupation()
            control.resume_memory_occupation(["weights"])
            gbps = push_distributed(control, group, original, trainer_device, args.bucket_mb << 20, "dist-original")
            control.resume_memory_occupation(["kv_cache", "cuda_graph"])
            print(f"  cycle in {time.perf_counter() - start:.2f} s (push {gbps:.2f} GB/s)")
        else:
            print("6. push the original weights back (no memory saver)", flush=True)
            push_distributed(control, group, original, trainer_device, args.bucket_mb << 20, "dist-original")
        final = score(server.url, sequences)
        check(max_diff(final, baseline) < 1e-2, f"baseline scores again (max diff {max_diff(final, baseline):.4f})")
        result = client.generate(prompts[:8], SamplingParams(max_new_tokens=16, n=2))
        check(all(len(s) == 2 for s in result.samples), "generation works after the cycle")
    finally:
        client.close()
        if group is not None:
            try:
                control.destroy_weights_update_group("megarl_smoke")
            except ServerError as e:
                print(f"  could not destroy the server's group: {e}")
            destroy_process_group(group)
        router.stop()
        server.stop(timeout_s=60)
    print("FAILED: " + "; ".join(FAILURES) if FAILURES else "all checks passed", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
