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

`--trees old=/tmp/old/src new=src` runs the same passes side by side: each round runs this script
once per tree in a child process with that tree's megarl first on PYTHONPATH (the trees' order
alternating from round to round), `--rounds` rounds; a tree's figure is its best pass over every
round. `--memory` adds each emitter's peak extra resident memory over one pass per bucket size, in
buckets (`megarl.tracking.memory`, after the timed passes: it lowers glibc's mmap threshold; a
tree without that module gets it loaded from this script's own tree); with `--push`, also every
rank's over one more push (the first bucket size), the transport's copies included.

With `--push`, also times `WeightSync.push()` into one freshly started server of an HF checkpoint
of the same model: end-to-end GB/s, wire included. `--server sglang --device cuda` is the GPU check
of the transports against real SGLang (one GPU, layout 1x1; the distributed transport then uses
gloo, as NCCL cannot join a server on the trainer's own GPU); it prints the served final norm
next to the actor's, which must agree (to the served dtype) after the push.

    .venv/bin/python tools/bench/weight_sync.py --layouts 1x1 2x1 1x2 2x2 --bucket-mb 64 256 1024
    .venv/bin/python tools/bench/weight_sync.py --layouts 1x1x2 1x1x4 --bucket-mb 64   # DP sharing
    git worktree add /tmp/old main && .venv/bin/python tools/bench/weight_sync.py --layouts 2x1 2x2 \
        --trees old=/tmp/old/src new=src --memory      # old against new, interleaved
    python tools/bench/weight_sync.py --layouts 1x1 --push --server sglang --device cuda --dtype bfloat16 \
        --transport tensor        # GPU: also --transport distributed, --transport disk
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_common import DEFAULT_OUT, load_average, print_table, write_result

from megarl.bridge import ParallelLayout, WeightMap, arch_from_hf_config
from megarl.bridge.megatron_config import gpt_model_kwargs, layer_spec, transformer_config_kwargs
from megarl.bridge.transforms import padded_vocab_size
from megarl.testing import init_gloo_model_parallel, run_gloo_workers


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


def resident_peak():
    """`megarl.tracking.memory.resident_peak`, from this script's own tree if megarl has none (an old tree)."""
    try:
        from megarl.tracking import memory
    except ImportError:
        path = Path(__file__).resolve().parents[2] / "src" / "megarl" / "tracking" / "memory.py"
        spec = importlib.util.spec_from_file_location("megarl_tracking_memory", path)
        memory = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(memory)
    return memory.resident_peak()


def bare_transfers(chunks: list, repeats: int) -> dict:
    """Seconds (best of `repeats`) to move every TP rank's parameter bytes to TP rank 0 with one
    `dist.gather` (gloo receives into its own buffer, then copies out) and with point-to-point
    sends into preallocated rows (what the resharder does); TP rank 0 reports them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    size = dist.get_world_size(group)
    nbytes = sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())
    send = torch.empty(nbytes, dtype=torch.uint8).random_()
    rows = [torch.empty_like(send) for _ in range(size)] if tp_rank == 0 else None
    root = dist.get_global_rank(group, 0)

    def p2p():
        if tp_rank == 0:
            ops = [dist.P2POp(dist.irecv, rows[r], dist.get_global_rank(group, r), group) for r in range(1, size)]
        else:
            ops = [dist.P2POp(dist.isend, send, root, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    gather_s = min(timed(repeats, lambda: dist.gather(send, rows, dst=root, group=group)))
    p2p_s = min(timed(repeats, p2p))
    return {"bare_gather_s": gather_s, "bare_p2p_s": p2p_s, "bare_bytes": nbytes * size} if tp_rank == 0 else {}


def reshard_rank(rank: int, world_size: int, port: int, config: dict, layout: tuple, args: dict,
                 split_dp: bool = False) -> list[dict]:
    import torch.distributed as dist

    from megarl.sync import ParallelGroups, Resharder
    from megarl.sync.resharder import gathered_bytes, local_params

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
    if tp > 1:  # the wire alone: this rank's shards' bytes to TP rank 0 by gloo's gather and by point-to-point
        bare = bare_transfers(chunks, args["repeats"])
        for out in results:
            out.update(bare)
    if args["memory"]:  # after every timed pass: it changes the allocator's behaviour for good
        for out, bucket_mb in zip(results, args["bucket_mbs"]):
            resharder = Resharder(chunks, weights, groups, bucket_mb * 2**20)
            largest = max(gathered_bytes(p, tp) for p in local_params(chunks, weights, tp))
            dist.barrier()
            with resident_peak() as memory:
                for _ in resharder.buckets():
                    pass
            out["peak_extra_buckets"] = memory["extra"] / max(bucket_mb * 2**20, largest)
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
    if args["memory"]:  # after the timed pushes: it changes the allocator's behaviour for good
        from megarl.sync.resharder import gathered_bytes, local_params

        largest = max(gathered_bytes(p, tp) for p in local_params(chunks, weights, tp))
        with resident_peak() as memory:
            sync.push()
        metrics["peak_extra_buckets"] = memory["extra"] / max(args["bucket_mbs"][0] * 2**20, largest)
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
    if args.memory:  # this rank's own figure, and every rank's
        by_rank = [r["peak_extra_buckets"] for r in ranks]
        return dict(ranks[-1], peak_extra_buckets=max(by_rank), peak_extra_buckets_by_rank=by_rank)
    return ranks[-1]


def side_by_side(args) -> None:
    """Every tree of `--trees` in its own child run of this script, interleaved over `--rounds`."""
    trees = dict(item.split("=", 1) for item in args.trees)
    child = [sys.executable, str(Path(__file__).resolve()), "--layouts", *args.layouts, "--hidden", str(args.hidden),
             "--layers", str(args.layers), "--vocab", str(args.vocab), "--dtype", args.dtype, "--repeats",
             str(args.repeats), "--device", args.device, "--bucket-mb", *map(str, args.bucket_mbs)]
    child += ["--ffn", str(args.ffn)] if args.ffn else []
    child += ["--memory"] if args.memory else []
    load_before, runs = load_average(), []
    with tempfile.TemporaryDirectory(prefix="megarl-bench-trees-") as tmp:
        for round_ in range(args.rounds):
            for name in list(trees) if round_ % 2 == 0 else list(trees)[::-1]:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(trees[name]).resolve()),
                                                                     os.environ.get("PYTHONPATH", "")]))
                out = Path(tmp) / f"{name}-{round_}"
                subprocess.run(child + ["--out", str(out)], env=env, check=True, capture_output=True, timeout=3600)
                result = json.loads((out / "weight_sync.json").read_text())
                runs.append(dict(tree=name, round=round_, load_before=result["load_before"],
                                 load_after=result["load_after"], rows=result["rows"]))
                print(f"round {round_}: {name} done, load {result['load_after']['1m']:.1f}", flush=True)
    rows = []
    for name in trees:
        mine = [row for run in runs if run["tree"] == name for row in run["rows"]]
        for key in dict.fromkeys((r["layout"], r["senders"], r["bucket_mb"]) for r in mine):
            same = [r for r in mine if (r["layout"], r["senders"], r["bucket_mb"]) == key]
            best, clone = min(same, key=lambda r: r["reshard_s"]), max(r["clone_gb_per_s"] for r in same)
            rows.append(dict(tree=name, layout=key[0], senders=key[1], bucket_mb=key[2], gb=best["gb"],
                             reshard_s=best["reshard_s"], reshard_gb_per_s=best["reshard_gb_per_s"],
                             clone_gb_per_s=clone, fraction_of_clone=best["reshard_gb_per_s"] / clone,
                             fractions_per_round=[r["fraction_of_clone"] for r in same],
                             gather_s=best["gather_s"], convert_s=best["convert_s"],
                             peak_buffer_gb=best["peak_buffer_gb"],
                             bare_gather_gb_per_s=max((r.get("bare_gather_gb_per_s") or 0) for r in same) or None,
                             bare_p2p_gb_per_s=max((r.get("bare_p2p_gb_per_s") or 0) for r in same) or None,
                             peak_extra_buckets=max((r["peak_extra_buckets"] for r in same
                                                     if r.get("peak_extra_buckets") is not None), default=None)))
    rows.sort(key=lambda r: (r["layout"], r["senders"], r["bucket_mb"], list(trees).index(r["tree"])))
    loads = [run[k]["1m"] for run in runs for k in ("load_before", "load_after")]
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.dtype}; best of {args.repeats} "
          f"x {args.rounds} rounds per tree; 1-minute load average {min(loads):.1f} to {max(loads):.1f}")
    print_table(rows, [("layout", "TPxPP[xDP]", "s"), ("tree", "tree", "s"), ("bucket_mb", "bucket MiB", "d"),
                       ("reshard_s", "reshard s", ".3f"), ("reshard_gb_per_s", "GB/s", ".2f"),
                       ("clone_gb_per_s", "clone GB/s", ".2f"), ("fraction_of_clone", "fraction", ".2f"),
                       ("gather_s", "gather s", ".3f"), ("convert_s", "convert s", ".3f"),
                       ("peak_buffer_gb", "peak buf GB", ".3f"), ("peak_extra_buckets", "peak extra bkts", ".2f"),
                       ("bare_gather_gb_per_s", "gather GB/s", ".2f"), ("bare_p2p_gb_per_s", "p2p GB/s", ".2f")])
    write_result("weight_sync_trees", {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                                       "load_before": load_before, "load_after": load_average(), "runs": runs,
                                       "rows": rows}, args.out)


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
    p.add_argument("--trees", nargs="+", metavar="NAME=SRC", help="side by side: these megarl trees' src "
                   "directories, each run in a child process, interleaved (writes weight_sync_trees.json)")
    p.add_argument("--rounds", type=int, default=2, help="--trees: runs of every tree")
    p.add_argument("--memory", action="store_true", help="also each emitter's peak extra resident memory of a pass")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="writes weight_sync.json here")
    args = p.parse_args()
    if args.trees:
        side_by_side(args)
        return
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
                             peak_extra_buckets=max((r["peak_extra_buckets"] for r in emitters if "peak_extra_buckets" in r),
                                                    default=None),
                             **{k: slowest[k] for k in ("reshard_s", "gather_s", "convert_s", "peak_buffer_bytes")},
                             **({"bare_gather_gb_per_s": slowest["bare_bytes"] / slowest["bare_gather_s"] / 1e9,
                                 "bare_p2p_gb_per_s": slowest["bare_bytes"] / slowest["bare_p2p_s"] / 1e9}
                                if "bare_bytes" in slowest else {}),
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
                       ("convert_s", "convert s", ".3f"), ("peak_buffer_gb", "peak buf GB", ".3f"),
                       ("peak_extra_buckets", "peak extra bkts", ".2f")])
    for row in rows:
        if "push" in row:
            m = row["push"]
            print(f"{row['layout']}: push ({args.transport}) into 1 {args.server} server: {m['sync/bytes'] / 1e9:.3f} GB "
                  f"in {m['sync/seconds']:.2f} s = {m['sync/gb_per_s']:.2f} GB/s (slowest stage: gather "
                  f"{m['sync/slowest_stage_gather_s']:.2f} s, convert {m['sync/slowest_stage_convert_s']:.2f} s, "
                  f"send {m['sync/slowest_stage_send_s']:.2f} s)")
            if "peak_extra_buckets_by_rank" in m:
                print(f"  peak extra resident memory of a push, per rank, in buckets: "
                      f"{[round(x, 2) for x in m['peak_extra_buckets_by_rank']]}")
            if "norm_check" in m:
                print(f"  served model.norm.weight[:8] {m['norm_check']['server']}\n  actor's "
                      f"{m['norm_check']['actor']}; served weight_version {m['norm_check']['server_version']}")
    write_result("weight_sync", {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                                 "load_before": load_before, "load_after": load_average(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
