"""The benchmarks of tools/bench, each run in a tiny mode: they finish and write a JSON result with
their fields. No speed is asserted (a benchmark is a script with figures, never a timed test), but
the planner's and the weight sync's figures are recomputed from the raw times and sizes in their
JSON, and those are held against what the test knows itself: the wall time of the run it timed, the
size of the model."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tools" / "bench"


def run_bench(script, *args, timeout=300):
    """The script's stdout and its wall time in seconds, as this test measured it."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    wall_s = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, wall_s


def load(path):
    result = json.loads(Path(path).read_text())
    assert {"benchmark", "command", "machine"} <= result.keys()
    assert result["machine"]["nproc"] >= 1 and result["machine"]["ram_gib"] > 0
    return result


def test_planner_writes_times_per_cluster_size(tmp_path):
    out, wall_s = run_bench("planner.py", "--nodes", "8", "64", "--modes", "colocate", "split", "--repeats", "2",
                            "--out", tmp_path)
    rows = load(tmp_path / "planner.json")["rows"]
    assert [(r["nodes"], r["mode"]) for r in rows] == [(8, "colocate"), (8, "split"), (64, "colocate"), (64, "split")]
    for r in rows:
        assert r["gpus"] == 8 * r["nodes"] and r["placed_ranks"] > r["gpus"]  # actor, ref and rollout share GPUs
        raw = r["times_s"]
        assert all(len(raw[phase]) == 2 and min(raw[phase]) > 0 for phase in ("validate", "plan", "gpu_map"))
        best = {phase: min(times) for phase, times in raw.items()}  # the best of the repeats is reported
        assert (r["validate_s"], r["plan_s"], r["gpu_map_s"]) == (best["validate"], best["plan"], best["gpu_map"])
        assert r["total_s"] == pytest.approx(best["validate"] + best["plan"] + best["gpu_map"])
    # every timed call happened inside the run this test timed (seconds, not ms or ns)
    assert sum(t for r in rows for times in r["times_s"].values() for t in times) < wall_s
    assert "validate s" in out


@pytest.mark.slow
def test_gpu_bench_runs_on_cpu_in_tiny_mode(tmp_path):
    out, _ = run_bench("gpu_bench.py", "--device", "cpu", "--tiny", "--bucket-mb", "1", "4", "--repeats", "1",
                       "--json", tmp_path / "gpu.json")
    result = json.loads((tmp_path / "gpu.json").read_text())
    t = result["train_step"]
    assert t["tokens_per_step"] == 4 * (16 + 24) and t["tflops"] > 0 and t["mfu"] is None  # no peak on CPU
    assert [r["bucket_mb"] for r in result["sync_path"]] == [1, 4]
    for r in result["sync_path"]:
        assert r["bytes"] > 0 and r["reshard_gb_per_s"] > 0 and r["clone_gb_per_s"] > 0
    assert "MFU n/a" in out


@pytest.mark.slow
def test_gpu_sh_installs_into_a_temporary_target_and_imports_from_it():
    proc = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--dry-run", "--python", sys.executable], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    megarl_line = next(line for line in proc.stderr.splitlines() if line.strip().startswith("megarl "))
    assert "/megarl-gpu-bench." in megarl_line  # megarl came from the temporary target, not the checkout
    assert "dry run, imports OK" in proc.stderr


def test_gpu_sh_rejects_a_wheel_directory_without_wheels(tmp_path):
    proc = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--dry-run", "--python", sys.executable, "--wheels",
                           tmp_path], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no .whl files" in proc.stderr


def llama_bytes(hidden, layers, vocab, ffn, kv_dim):
    """float32 bytes of an untied Llama's HF weights, counted from its shapes."""
    attention = 2 * hidden * hidden + 2 * kv_dim * hidden  # q, o; k, v
    mlp = 3 * hidden * ffn  # gate, up, down
    return 4 * (2 * vocab * hidden + layers * (attention + mlp + 2 * hidden) + hidden)


@pytest.mark.slow
def test_weight_sync_rows_per_layout_and_bucket(tmp_path):
    _, wall_s = run_bench("weight_sync.py", "--hidden", "128", "--layers", "2", "--vocab", "1000", "--layouts", "1x1",
                          "1x2", "--bucket-mb", "1", "4", "--repeats", "2", "--out", tmp_path)
    rows = load(tmp_path / "weight_sync.json")["rows"]
    assert [(r["layout"], r["bucket_mb"]) for r in rows] == [("1x1", 1), ("1x1", 4), ("1x2", 1), ("1x2", 4)]
    # every HF weight exactly once, vocab unpadded, however the model is split: ffn = 8/3 x 128 rounded
    # down to 64 = 320; 2 heads of 64, 1 KV head
    model_bytes = llama_bytes(hidden=128, layers=2, vocab=1000, ffn=320, kv_dim=64)
    assert [r["bytes"] for r in rows] == [model_bytes] * 4
    for r in rows:
        emitters = r["emitters"]
        assert sorted(e["stage"] for e in emitters) == list(range(int(r["layout"].split("x")[1])))
        assert sum(e["bytes"] for e in emitters) == model_bytes
        for e in emitters:  # each emitter timed its calls one after another, inside the run this test timed
            times = e["reshard_times_s"] + e["clone_times_s"] + e["warm_copy_times_s"]
            assert len(times) == 3 * 2 and 0 < min(times) and sum(times) < wall_s
        # the figures, recomputed from the raw times: the best of the repeats, the slowest stage
        slowest = max(emitters, key=lambda e: min(e["reshard_times_s"]))
        reshard_gb_per_s = model_bytes / min(slowest["reshard_times_s"]) / 1e9
        clone_gb_per_s = slowest["bytes"] / min(slowest["clone_times_s"]) / 1e9
        assert r["reshard_s"] == min(slowest["reshard_times_s"])
        assert r["reshard_gb_per_s"] == pytest.approx(reshard_gb_per_s)
        assert r["clone_gb_per_s"] == pytest.approx(clone_gb_per_s)
        assert r["fraction_of_clone"] == pytest.approx(reshard_gb_per_s / clone_gb_per_s)


@pytest.mark.slow
def test_rollout_engine_rows_for_the_three_methods(tmp_path):
    run_bench("rollout_engine.py", "--hidden", "32", "--layers", "1", "--vocab", "64", "--prompts", "2", "--n", "2",
              "--prompt-len", "4", "--max-new-tokens", "4", "--repeats", "1", "--out", tmp_path)
    result = load(tmp_path / "rollout_engine.json")
    assert result["generated_tokens"] == 2 * 2 * 4
    assert [r["method"] for r in result["rows"]] == ["hf_generate", "engine", "engine_http"]
    assert all(r["tokens_per_s"] > 0 and r["cpu_seconds"] >= 0 for r in result["rows"])
    hf_best = min(wall for wall, _ in result["rows"][0]["runs"])
    hf_cpu = min(cpu for _, cpu in result["rows"][0]["runs"])
    for row in result["rows"]:  # the ratios are recomputed from the raw per-round (wall, cpu) seconds
        assert row["speed_vs_hf_generate"] == pytest.approx(hf_best / min(wall for wall, _ in row["runs"]))
        cpu = min(c for _, c in row["runs"])  # this tiny batch's CPU time can be below the clock's 10 ms tick
        assert row["cpu_vs_hf_generate"] == (pytest.approx(hf_cpu / cpu) if cpu > 0 else None)


# overhead.py, grpo_vs_trl.py, training_floor.py and opd_vs_grpo.py are not run here: each trains the quickstart's
# SFT model (the first two then two GRPO runs; grpo_vs_trl.py also installs TRL into .venv-bench; opd_vs_grpo.py a
# teacher, a student and three runs per seed), minutes of work, not a test (opd_vs_grpo.py at its smallest: 138 s).
# generate_profile.py neither: it starts the quickstart's two servers and the router and runs 30 steps' generation
# (about 45 s).
# push_profile.py neither: it brings up the quickstart's whole cluster (Ray, two actor ranks, two servers and the
# router) for a run, about a minute.
