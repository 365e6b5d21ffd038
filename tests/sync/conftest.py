"""One gloo world for every multi-process check of the weight sync (sync_world.world), with the
tiny HF checkpoints, their offline conversions and two CPU-engine servers it needs. The servers
are restarted by a monitor if they die (the failure check kills one) and stopped by PID."""
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# the helper modules next to this file are imported by name, also by gloo workers
sys.path.insert(0, str(Path(__file__).parent))

from megarl.bridge import ParallelLayout  # noqa: E402
from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf  # noqa: E402
from megarl.bridge.safetensors_io import HFCheckpointReader  # noqa: E402
from megarl.data.tiny_model import make_tiny_model  # noqa: E402
from megarl.testing import run_gloo_workers  # noqa: E402
from megarl.rollout.launch import cpu_server_command  # noqa: E402
from megarl.rollout.process import ProcessMonitor, ServerProcess, start_on_a_free_port  # noqa: E402
from sync_world import (  # noqa: E402
    EXPERT_BUCKET_BYTES,
    EXPERT_MODEL,
    RESHARD_BUCKET_BYTES,
    RESHARD_DIVISIBLE_BY,
    RESHARD_LAYOUTS,
    RESHARD_MODELS,
    STORY_BUCKET_BYTES,
    STORY_LAYOUT,
    world,
)


def read_all(hf_dir):
    with HFCheckpointReader(hf_dir) as reader:
        return {name: reader.read(name) for name in reader.names()}


def start_server(model_dir: Path, log_dir: Path, name: str) -> ServerProcess:
    return start_on_a_free_port(
        lambda port: ServerProcess(name, cpu_server_command(str(model_dir), port, num_threads=1),
                                   f"http://127.0.0.1:{port}", log_path=str(log_dir / f"{name}.log"),
                                   startup_timeout_s=180),
        "127.0.0.1")


def reshard_cases(root: Path):
    """The resharder's models (tiny HF checkpoints) and their offline HF -> torch_dist -> HF conversions."""
    cases, offline = {}, {}
    for i, (name, (kwargs, dtype, ddp, wire_dtype)) in enumerate(RESHARD_MODELS.items()):
        hf_dir = make_tiny_model(out_dir=root / name, layers=4, hidden=64, heads=4, kv_heads=2, seed=i, **kwargs)
        ckpt = root / f"{name}-mcore"
        convert_hf_to_torch_dist(hf_dir, ckpt, ParallelLayout(), make_vocab_size_divisible_by=RESHARD_DIVISIBLE_BY)
        convert_torch_dist_to_hf(ckpt, root / f"{name}-offline")
        offline[name] = {k: v.to(wire_dtype or v.dtype) for k, v in read_all(root / f"{name}-offline").items()}
        cases[name] = dict(hf_dir=hf_dir, divisible_by=RESHARD_DIVISIBLE_BY, dtype=dtype, ddp=ddp,
                           wire_dtype=wire_dtype)
    return cases, offline


@pytest.fixture(scope="session")
def sync_run(tmp_path_factory):
    """(offline conversions, story case, per-rank results of sync_world.world, expert case)."""
    root = tmp_path_factory.mktemp("sync")
    story_model = make_tiny_model("qwen2", root / "story-model", seed=0)  # q/k/v bias, tied embeddings
    # the expert checks: the actor loads one MoE checkpoint, its server starts with another (other seed)
    expert_model = make_tiny_model(out_dir=root / "moe-model", seed=11, **EXPERT_MODEL)
    expert_served = make_tiny_model(out_dir=root / "moe-served", seed=12, **EXPERT_MODEL)
    servers: list[ServerProcess] = []
    monitor = None
    try:
        with ThreadPoolExecutor(3) as pool:
            starts = [pool.submit(start_server, story_model, root, f"sync-server-{i}") for i in range(2)]
            starts.append(pool.submit(start_server, expert_served, root, "sync-moe-server"))
            try:
                cases, offline = reshard_cases(root)
            finally:
                servers += [f.result() for f in starts if f.exception() is None]  # waits for both
            failed = [f.exception() for f in starts if f.exception() is not None]
            if failed:
                raise failed[0]
        monitor = ProcessMonitor(servers, interval_s=0.5).start()
        story = dict(layout=STORY_LAYOUT, hf_dir=str(story_model), urls=[s.url for s in servers[:2]],
                     pids=[s.pid for s in servers[:2]], bucket_bytes=STORY_BUCKET_BYTES, disk_dir=str(root / "disk-sync"))
        reshard = dict(cases=cases, layouts=RESHARD_LAYOUTS, bucket_bytes=RESHARD_BUCKET_BYTES)
        experts = dict(hf_dir=str(expert_model), url=servers[2].url, bucket_bytes=EXPERT_BUCKET_BYTES,
                       disk_dir=str(root / "moe-disk-sync"))
        ranks = run_gloo_workers(world, 4, args=(reshard, story, experts, str(root / "memory")), timeout_s=600)
        print(f"sync world: resharder checks {ranks[0]['reshard_s']} s, expert checks {ranks[0]['experts_s']} s; "
              "servers story, seconds since its start:", ranks[0]["servers"]["seconds"])
        yield offline, story, ranks, experts
    finally:
        if monitor is not None:
            monitor.stop()
        for proc in servers:
            proc.stop(timeout_s=15)
