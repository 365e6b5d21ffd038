"""GPU benchmark of one NVIDIA GPU: train-step MFU of the Megatron engine on a ~1B Llama in bf16, and
the weight-sync path's GB/s on the device. Run by gpu.sh (which makes megatron-core and megarl
importable offline); it reuses tools/gpu_check.py's model, batch and FLOPs helpers.

  1. train step: `ActorEngine.update_policy` on `--batch` sequences of `--prompt-len` +
     `--response-len` tokens (micro-batches of `--micro-batch`), 2 warm-up updates then `--steps`
     timed ones; tokens/s, TFLOP/s and MFU against `--peak-tflops` (default: looked up from the
     GPU's name, H100/H200 989 dense bf16).
  2. sync path: full passes of the `Resharder` (gather, HF conversion, bucketing) over the
     engine's bf16 weights on the GPU, per bucket size, vs a device-to-device clone and `copy_`
     of the same bytes.

`--device cpu --tiny` runs the same code on CPU (gloo, float32, a 2-layer model) to check the
script; its figures mean nothing.

    python tools/bench/gpu_bench.py --json outputs/bench/gpu.json
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/, for gpu_check
import gpu_check  # noqa: E402

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                    "L4": 121.0, "A10": 125.0, "B200": 2250.0, "GB200": 2500.0}


def peak_tflops(name: str) -> float | None:
    """Dense bf16 peak of a GPU named like 'NVIDIA H200' (longest matching key), else None."""
    matches = [k for k in PEAK_BF16_TFLOPS if k in name.upper()]
    return PEAK_BF16_TFLOPS[max(matches, key=len)] if matches else None


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        gpu_check.synchronize()
        start = time.perf_counter()
        fn()
        gpu_check.synchronize()
        times.append(time.perf_counter() - start)
    return times


def train_step(engine, args, peak: float | None) -> dict:
    batch = gpu_check.random_batch(args.batch, args.prompt_len, args.response_len, engine.arch.vocab_size,
                                   ragged=False, seed=2)
    batch["old_log_probs"] = engine.compute_log_prob(batch, 1.0)["log_probs"]
    p_lens, r_lens = batch["prompt_mask"].sum(1).tolist(), batch["response_mask"].sum(1).tolist()
    timed(lambda: engine.update_policy(batch), 2)  # warm-up
    times = timed(lambda: engine.update_policy(batch), args.steps)
    seconds = statistics.median(times)
    tokens = sum(p_lens) + sum(r_lens)
    tflops = gpu_check.train_flops(engine.arch, p_lens, r_lens) / seconds / 1e12
    return {"step_seconds_median": seconds, "step_seconds_all": times, "tokens_per_step": tokens,
            "tokens_per_second": tokens / seconds, "tflops": tflops, "mfu": tflops / peak if peak else None}


def sync_path(engine, args) -> list[dict]:
    from megarl.sync import ParallelGroups, Resharder

    groups = ParallelGroups.from_parallel_state()
    rows = []
    for bucket_mb in args.bucket_mb:
        resharder = Resharder(engine.model_chunks, engine.weight_map, groups, bucket_mb * 2**20)

        def one_pass():
            for _ in resharder.buckets():
                pass

        one_pass()  # warm-up
        seconds = min(timed(one_pass, args.repeats))
        nbytes = resharder.timings.bytes
        src = torch.empty(nbytes, dtype=torch.uint8, device=engine.device).random_()
        clone_s = min(timed(src.clone, args.repeats))
        dst = torch.empty_like(src)
        copy_s = min(timed(functools.partial(dst.copy_, src), args.repeats))
        del src, dst
        gpu_check.release_memory()
        rows.append({"bucket_mb": bucket_mb, "bytes": nbytes, "buckets": resharder.timings.buckets,
                     "reshard_seconds": seconds, "reshard_gb_per_s": nbytes / seconds / 1e9,
                     "clone_gb_per_s": nbytes / clone_s / 1e9, "copy_gb_per_s": nbytes / copy_s / 1e9,
                     "fraction_of_clone": clone_s / seconds,
                     "peak_buffer_bytes": resharder.timings.peak_buffer_bytes})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and tiny batch (checks the script on CPU)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=768)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None, help="default: from the GPU's name")
    p.add_argument("--json", type=Path, default=Path("outputs/bench/gpu.json"))
    args = p.parse_args()
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --device cpu --tiny to check the script", file=sys.stderr)
        return 2
    if args.tiny:
        args.batch, args.prompt_len, args.response_len, args.micro_batch, args.steps = 4, 16, 24, 2, 1
    gpu_name = "cpu" if cpu else torch.cuda.get_device_name(0)
    peak = args.peak_tflops or (None if cpu else peak_tflops(gpu_name))

    from megarl.engines.megatron.roles import ActorEngine

    gpu_check.init_single_process(cpu)
    with tempfile.TemporaryDirectory(prefix="megarl-gpu-bench-") as tmp:
        dtype = "float32" if cpu else "bfloat16"
        model_dir = gpu_check.build_1b_model(Path(tmp), cpu or args.tiny, dtype)
        engine = ActorEngine(gpu_check.experiment_config(model_dir, dtype, args.batch, args.micro_batch),
                             sequence_layout="padded")
        params = sum(p.numel() for c in engine.model_chunks for p in c.parameters())
        result = {"gpu": gpu_name, "torch": torch.__version__, "dtype": dtype, "parameters": params,
                  "peak_tflops": peak, "settings": {k: str(v) for k, v in vars(args).items()},
                  "train_step": train_step(engine, args, peak), "sync_path": sync_path(engine, args)}
        if torch.cuda.is_available():
            result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    torch.distributed.destroy_process_group()

    t = result["train_step"]
    mfu = f"{t['mfu']:.1%}" if t["mfu"] is not None else "n/a (pass --peak-tflops)"
    print(f"\n{gpu_name}, {dtype}, {params / 1e9:.2f} B parameters")
    print(f"train step: {args.batch} x ({args.prompt_len} + {args.response_len}) tokens, median "
          f"{t['step_seconds_median']:.3f} s, {t['tokens_per_second']:.0f} tokens/s, {t['tflops']:.1f} TFLOP/s, MFU {mfu}")
    print(f"{'bucket MiB':>10} {'GB':>7} {'buckets':>7} {'reshard GB/s':>12} {'clone GB/s':>10} {'copy_ GB/s':>10} "
          f"{'fraction':>8}")
    for r in result["sync_path"]:
        print(f"{r['bucket_mb']:>10} {r['bytes'] / 1e9:7.3f} {r['buckets']:7d} {r['reshard_gb_per_s']:12.2f} "
              f"{r['clone_gb_per_s']:10.2f} {r['copy_gb_per_s']:10.2f} {r['fraction_of_clone']:8.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"result: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
