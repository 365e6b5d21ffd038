"""Benchmark: the resharder's throughput as a fraction of a plain host-memory copy of the same bytes.

Builds a megatron-core `GPTModel` (Llama-style, random weights, no download) at each requested
TP x PP layout in local gloo processes (CPU; the same code runs on GPU with NCCL), then times full
passes of `Resharder.buckets()`: TP gather to the stage's emitter, merge, HF conversion (QKV and
fc1 split, vocab unpadding) and packing into flat buckets, with nothing sent anywhere. The
baselines, on the same emitter, copy a contiguous buffer of the same byte count: `clone()` (into
fresh memory, as a pass allocates its buffers) and `copy_` into a buffer already touched. Each is
run `--repeats` times for each bucket size (`--bucket-mb`); the best is reported, and each row keeps
every emitter's bytes and times (`emitters`). The stages of a PP layout run in parallel; a layout's
time is its slowest stage's, and its fraction is its throughput over the clone's. `--device cuda`
times the same on the GPU (layouts without TP: the processes form a gloo world).

A layout `TPxPPxDP` (DP > 1) is timed twice: replica 0 resharding every bucket (`split_dp`
off, megarl before DP sharing) and every replica resharding its own share (`split_dp` on, the
default of `SyncConfig.split_across_dp`); a layout's time is then its slowest emitter's.

With `--push`, also times `WeightSync.push()` into one freshly started server of an HF checkpoint
of the same model: end-to-end GB/s, wire included. `--server sglang --device cuda` is the GPU check
of the transports against real SGLang (one GPU, layout 1x1; the distributed transport then uses
gloo, as NCCL cannot join a server on the trainer's own GPU); it prints the served final norm
next to the actor's, which must agree (to the served dtype) after the push.

    .venv/bin/python tools/bench/weight_sync.py --layouts 1x1 2x1 1x2 2x2 --bucket-mb 64 256 1024
    .venv/bin/python tools/bench/weight_sync.py --layouts 1x1x2 1x1x4 --bucket-mb 64   # DP sharing
    python tools/bench/weight_sync.py --layouts 1x1 --push --server sglang --device cuda --dtype bfloat16 \
        --transport tensor        # GPU: also --transport distributed, --transport disk
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench_common import DEFAULT_OUT, load_average, print_table, write_result

from megarl.bridge import ParallelLayout, WeightMap, arch_from_hf_config
from megarl.bridge.megatron_config import gpt_model_kwargs, layer_spec, transformer_config_kwargs
from megarl.bridge.transforms import padded_vocab_size
from megarl.engines.megatron.cpu import init_gloo_model_parallel, run_gloo_workers


def hf_config(args) -> dict:
    heads = args.hidden // 64
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": args.hidden,
        "intermediate_size": args.ffn or int(args.hidden * 8 / 3) // 64 * 64, "num_hidden_layers": args.layers,
        "num_attention_heads": heads, "num_key_value_heads": max(heads // 4, 1), "vocab_size": args.vocab,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "float32",
    }


def build_chunks(weights: WeightMap, layout: ParallelLayout, dtype: torch.dtype) -> list:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**transformer_config_kwargs(weights.arch, layout, dtype), use_cpu_initialization=True,
                               perform_initialization=False)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = [GPTModel(config, layer_spec(weights.arch), **gpt_model_kwargs(weights.arch, weights.padded_vocab_size),
                       pre_process=layout.is_first(pp_rank, 0), post_process=layout.is_last(pp_rank, 0)).to(dtype)]
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.uniform_(-0.05, 0.05)
    return chunks


def timed(repeats: int, run) -> list[float]:
    """The seconds of each of `repeats` calls of `run` (the GPU's work included)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def reshard_rank(rank: int, world_size: int, port: int, config: dict, layout: tuple, args: dict,
                 split_dp: bool = False) -> list[dict]:
    import torch.distributed as dist

    from megarl.sync import ParallelGroups, Resharder

    tp, pp = layout[:2]
    init_gloo_model_parallel(rank, world_size, port, tp=tp, pp=pp)
    arch = arch_from_hf_config(config)
    weights = WeightMap(arch, padded_vocab_size(arch.vocab_size, 128, tp))
    dtype = getattr(torch, args["dtype"])
    chunks = [c.to(args["device"]) for c in build_chunks(weights, ParallelLayout(tp, pp), dtype)]
    groups = ParallelGroups.from_parallel_state(split_dp=split_dp)
    results = []
    for bucket_mb in args["bucket_mbs"]:
        resharder = Resharder(chunks, weights, groups, bucket_mb * 2**20)

        def one_pass():
            for _ in resharder.buckets():
                pass

        one_pass()  # warm-up
        dist.barrier()
        reshard_times = timed(args["repeats"], one_pass)
        out = {"rank": rank, "emitter": groups.is_emitter, "stage": groups.pp_rank, "bucket_mb": bucket_mb}
        if groups.is_emitter:
            nbytes = resharder.timings.bytes
            src = torch.empty(nbytes, dtype=torch.uint8, device=args["device"]).random_()
            clone_times = timed(args["repeats"], src.clone)
            dst = src.clone()
            warm_copy_times = timed(args["repeats"], lambda: dst.copy_(src))
            del src, dst
            t = resharder.timings
            out.update(bytes=nbytes, reshard_s=min(reshard_times), clone_s=min(clone_times),
                       warm_copy_s=min(warm_copy_times), reshard_times_s=reshard_times, clone_times_s=clone_times,
                       warm_copy_times_s=warm_copy_times, buckets=t.buckets, gather_s=t.gather_s,
                       convert_s=t.convert_s, peak_buffer_bytes=t.peak_buffer_bytes)
        results.append(out)
        dist.barrier()
    return results


def push_rank(rank: int, world_size: int, port: int, config: dict, layout: tuple, args: dict, url: str,
              model_dir: str) -> dict:
    import requests

    from megarl.sync import SyncConfig, WeightSync

    tp, pp = layout
    init_gloo_model_parallel(rank, world_size, port, tp=tp, pp=pp)
    arch = arch_from_hf_config(config)
    weights = WeightMap(arch, padded_vocab_size(arch.vocab_size, 128, tp))
    dtype = getattr(torch, args["dtype"])
    chunks = [c.to(args["device"]) for c in build_chunks(weights, ParallelLayout(tp, pp), dtype)]
    sync_config = SyncConfig(
        transport=args["transport"], bucket_bytes=args["bucket_mbs"][0] * 2**20, timeout_s=600,
        backend="gloo",  # NCCL cannot join a server on the trainer's own GPU
        disk_dir=str(Path(model_dir) / "pushes"), hf_assets_dir=model_dir,
    )
    sync = WeightSync(chunks, weights, [url], sync_config)
    sync.push()  # warm-up: forms the weight-update groups
    metrics = min((sync.push() for _ in range(args["repeats"])), key=lambda m: m["sync/seconds"])
    sync.close()
    last = chunks[-1]
    if args["server"] == "sglang" and hasattr(last.decoder, "final_layernorm") and rank == world_size - 1:
        # the server's final norm must now be the actor's (HF initialises it to ones; ours is uniform)
        got = requests.post(url + "/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 8},
                            timeout=60).json()
        version = requests.get(url + "/model_info", timeout=60).json()["weight_version"]
        metrics["norm_check"] = {"server": got, "actor": last.decoder.final_layernorm.weight[:8].tolist(),
                                 "server_version": version}
    return metrics


def run_push(config: dict, layout: tuple, args) -> dict:
    """`WeightSync.push` into one freshly started server of an HF checkpoint of the same model."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.rollout.launch import (
        apply_env_overrides,
        cpu_server_command,
        sglang_env_overrides,
        sglang_server_command,
    )
    from megarl.net import free_port
    from megarl.rollout.process import ServerProcess

    with tempfile.TemporaryDirectory(prefix="megarl-bench-sync-") as tmp:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        model.save_pretrained(tmp)
        del model
        port = free_port("127.0.0.1")
        if args.server == "cpu":
            command, env = cpu_server_command(tmp, port, num_threads=1), None
        else:
            command = sglang_server_command(tmp, port, mem_fraction_static=0.3, dtype=args.dtype)
            env = apply_env_overrides(os.environ, sglang_env_overrides(False))
        server = ServerProcess("bench-server", command, f"http://127.0.0.1:{port}", env=env, startup_timeout_s=900,
                               log_path=str(Path(tmp) / "server.log"))
        server.start()
        try:
            ranks = run_gloo_workers(push_rank, layout[0] * layout[1],
                                     args=(config, layout, vars(args), server.url, tmp), timeout_s=3600)
        finally:
            server.stop()
    return ranks[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2"], help="TPxPP, e.g. 2x1")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=None, help="default: 8/3 hidden rounded to 64")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--bucket-mb", dest="bucket_mbs", type=int, nargs="+", default=[64, 256, 1024],
                   help="bucket sizes in MiB (--push uses the first)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--push", action="store_true", help="also time WeightSync.push into a rollout server")
    p.add_argument("--server", default="cpu", choices=["cpu", "sglang"], help="--push into megarl's CPU engine or "
                   "real SGLang (GPU, `pip install -e .[gpu]`; then also checks the served final norm)")
    p.add_argument("--transport", default="distributed", choices=["distributed", "tensor", "disk"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the actor's weights live (cuda: layouts without TP, the world is gloo)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="writes weight_sync.json here")
    args = p.parse_args()
    config = hf_config(args)
    rows = []
    load_before = load_average()
    runs = []
    for text in args.layouts:
        layout = tuple(int(x) for x in text.split("x"))
        dp = layout[2] if len(layout) > 2 else 1
        runs += [(text, layout, dp, split) for split in ([False, True] if dp > 1 else [False])]
    for text, layout, dp, split in runs:
        ranks = run_gloo_workers(reshard_rank, layout[0] * layout[1] * dp, args=(config, layout, vars(args), split),
                                 timeout_s=3600)
        for i, bucket_mb in enumerate(args.bucket_mbs):
            emitters = [r[i] for r in ranks if r[i]["emitter"]]
            slowest = max(emitters, key=lambda r: r["reshard_s"])
            total = sum(r["bytes"] for r in emitters)
            gbps = total / slowest["reshard_s"] / 1e9
            clone_gbps = slowest["bytes"] / slowest["clone_s"] / 1e9
            rows.append(dict(layout=text, senders="all replicas" if split else "replica 0", bucket_mb=bucket_mb, bytes=total, gb=total / 1e9, reshard_gb_per_s=gbps,
                             clone_gb_per_s=clone_gbps, warm_copy_gb_per_s=slowest["bytes"] / slowest["warm_copy_s"] / 1e9,
                             fraction_of_clone=gbps / clone_gbps, buckets=sum(r["buckets"] for r in emitters),
                             peak_buffer_gb=slowest["peak_buffer_bytes"] / 1e9,
                             **{k: slowest[k] for k in ("reshard_s", "gather_s", "convert_s", "peak_buffer_bytes")},
                             emitters=[{k: r[k] for k in ("stage", "bytes", "reshard_times_s", "clone_times_s",
                                                          "warm_copy_times_s")} for r in emitters]))
        if args.push and dp == 1:
            rows[-1]["push"] = run_push(config, layout, args)
    print(f"model: hidden {args.hidden}, {args.layers} layers, ffn {config['intermediate_size']}, vocab {args.vocab}, "
          f"{args.dtype}; best of {args.repeats}; the stages of a PP layout run in parallel")
    print_table(rows, [("layout", "TPxPP[xDP]", "s"), ("senders", "senders", "s"), ("bucket_mb", "bucket MiB", "d"), ("gb", "GB", ".3f"),
                       ("buckets", "buckets", "d"), ("reshard_s", "reshard s", ".3f"), ("reshard_gb_per_s", "GB/s", ".2f"),
                       ("clone_gb_per_s", "clone GB/s", ".2f"), ("warm_copy_gb_per_s", "copy_ GB/s", ".2f"),
                       ("fraction_of_clone", "fraction", ".2f"), ("gather_s", "gather s", ".3f"),
                       ("convert_s", "convert s", ".3f"), ("peak_buffer_gb", "peak buf GB", ".3f")])
    for row in rows:
        if "push" in row:
            m = row["push"]
            print(f"{row['layout']}: push ({args.transport}) into 1 {args.server} server: {m['sync/bytes'] / 1e9:.3f} GB "
                  f"in {m['sync/seconds']:.2f} s = {m['sync/gb_per_s']:.2f} GB/s (slowest stage: gather "
                  f"{m['sync/slowest_stage_gather_s']:.2f} s, convert {m['sync/slowest_stage_convert_s']:.2f} s, "
                  f"send {m['sync/slowest_stage_send_s']:.2f} s)")
            if "norm_check" in m:
                print(f"  served model.norm.weight[:8] {m['norm_check']['server']}\n  actor's "
                      f"{m['norm_check']['actor']}; served weight_version {m['norm_check']['server_version']}")
    write_result("weight_sync", {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                                 "load_before": load_before, "load_after": load_average(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
