"""Benchmark: generated tokens/s of megarl's CPU engine vs plain `transformers` `generate`.

Same randomly initialised Qwen2 model (built here, no download), same batch (`--prompts` prompts of
`--prompt-len` tokens, `--n` samples each), same sampling (temperature 1, EOS ignored so every sample
has exactly `--max-new-tokens` tokens), same number of torch threads. Three ways:

* `hf_generate`:  `model.generate(do_sample=True)` on the left-padded batch of prompts x n;
* `engine`:       `CPUEngine` in-process (batched sampling with a KV cache, log-probs computed);
* `engine_http`:  the CPU engine as a server (`megarl.rollout.cpu.server`), driven through `RolloutClient`.

Each is run once to warm up, then `--repeats` rounds of all three in turn (interleaved, so load
from other processes hits each alike). Reported per method: the best round's wall seconds, the
spread of the per-round speed ratio vs `hf_generate`, and CPU seconds (this process's for the first
two; the server's plus the client's for HTTP), which move less than wall time on a shared machine;
with the load averages before and after, in outputs/bench/rollout_engine.json.

    .venv/bin/python tools/bench/rollout_engine.py --hidden 64 --layers 2 --vocab 128
"""
from __future__ import annotations

import argparse
from pathlib import Path
import tempfile
import threading
import time

import psutil

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

from bench_common import DEFAULT_OUT, load_average, print_table, spread, write_result

from megarl.net import free_port
from megarl.rollout.client import RolloutClient
from megarl.rollout.cpu.engine import CPUEngine
from megarl.rollout.launch import cpu_server_command
from megarl.rollout.process import ServerProcess
from megarl.rollout.protocol import SamplingParams


def build_model(path: str, hidden: int, layers: int, vocab: int) -> None:
    torch.manual_seed(0)
    heads = max(hidden // 32, 2)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), max_position_embeddings=4096,
        eos_token_id=1, tie_word_embeddings=False,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def make_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, vocab, (count, length), generator=g).tolist()


def run_hf_generate(model, prompts, n, max_new_tokens) -> float:
    batch = torch.tensor([p for p in prompts for _ in range(n)])  # equal lengths: no padding needed
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(batch, attention_mask=torch.ones_like(batch), generation_config=config)
    assert out.shape[1] == batch.shape[1] + max_new_tokens


def run_engine(engine, prompts, sampling) -> None:
    done = threading.Semaphore(0)
    groups = [engine.submit(p, sampling, True, None, lambda s: done.release()) for p in prompts]
    for _ in range(sum(len(g) for g in groups)):
        assert done.acquire(timeout=3600)
    assert all(len(s.output_ids) == sampling.max_new_tokens for g in groups for s in g)


def run_http(client, prompts, sampling) -> None:
    result = client.generate(prompts, sampling)
    assert result.metrics.response_tokens == len(prompts) * sampling.n * sampling.max_new_tokens


def cpu_seconds(pids: tuple[int, ...]) -> float:
    """User + system CPU seconds so far of these processes (all their threads)."""
    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def measure(fn, pids: tuple[int, ...]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of `pids`) of one call of `fn`."""
    cpu, start = cpu_seconds(pids), time.perf_counter()
    fn()
    return time.perf_counter() - start, cpu_seconds(pids) - cpu


def ratio_or_none(numerator: float, denominator: float) -> float | None:
    """numerator / denominator; None when the denominator is 0 (a tiny batch's CPU time can be below the
    clock's tick, 10 ms on Linux), printed as '-'."""
    return numerator / denominator if denominator > 0 else None


def main() -> None:
    p = argparse.ArgumentParser(description="CPU engine vs transformers generate, tokens/s")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="writes rollout_engine.json here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before = load_average()

    with tempfile.TemporaryDirectory() as model_dir:
        build_model(model_dir, args.hidden, args.layers, args.vocab)
        prompts = make_prompts(args.prompts, args.prompt_len, args.vocab)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.n, ignore_eos=True)
        tokens = args.prompts * args.n * args.max_new_tokens
        batch = args.prompts * args.n
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        params = sum(t.numel() for t in model.parameters())
        engine = CPUEngine(model_dir, max_running_requests=batch)
        port = free_port("127.0.0.1")
        command = cpu_server_command(model_dir, port, max_running_requests=batch, num_threads=args.threads)
        server = ServerProcess("bench-cpu-server", command, f"http://127.0.0.1:{port}", startup_timeout_s=300)
        server.start()
        me = (psutil.Process().pid,)
        client = RolloutClient(server.url, max_concurrency=args.prompts)
        try:
            methods = {
                "hf_generate": (lambda: run_hf_generate(model, prompts, args.n, args.max_new_tokens), me),
                "engine": (lambda: run_engine(engine, prompts, sampling), me),
                "engine_http": (lambda: run_http(client, prompts, sampling), (*me, server.pid)),
            }
            runs = {name: [] for name in methods}
            for round_ in range(args.repeats + 1):  # round 0 warms up
                for name, (fn, pids) in methods.items():
                    wall, cpu = measure(fn, pids)
                    if round_:
                        runs[name].append((wall, cpu))
        finally:
            client.close()
            server.stop()
            engine.shutdown()

    print(f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} ({params / 1e6:.2f} M params), "
          f"float32, {args.threads} torch threads")
    print(f"batch: {args.prompts} prompts x n={args.n} = {batch} sequences, prompt {args.prompt_len} tokens, "
          f"{args.max_new_tokens} new tokens each ({tokens} generated tokens)")
    hf = runs["hf_generate"]
    rows = []
    for name, values in runs.items():
        wall, cpu = min(w for w, _ in values), min(c for _, c in values)
        ratios = [h / w for (h, _), (w, _) in zip(hf, values)]
        rows.append({"method": name, "seconds": wall, "tokens_per_s": tokens / wall,
                     "speed_vs_hf_generate": min(w for w, _ in hf) / wall, "ratio_per_round": spread(ratios),
                     "cpu_seconds": cpu, "cpu_vs_hf_generate": ratio_or_none(min(c for _, c in hf), cpu),
                     "runs": values})
    for row in rows:
        row["ratio_min"], row["ratio_max"] = row["ratio_per_round"]["min"], row["ratio_per_round"]["max"]
    print_table(rows, [("method", "method", "s"), ("seconds", "best s", ".3f"), ("tokens_per_s", "tokens/s", ".0f"),
                       ("speed_vs_hf_generate", "vs hf", ".2f"), ("ratio_min", "round min", ".2f"),
                       ("ratio_max", "round max", ".2f"), ("cpu_seconds", "cpu s", ".2f"),
                       ("cpu_vs_hf_generate", "cpu vs hf", ".2f")])
    write_result("rollout_engine", {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                                    "parameters": params, "generated_tokens": tokens, "load_before": load_before,
                                    "load_after": load_average(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
