"""The benchmarks of tools/bench, each run in a tiny mode: they finish and write a JSON result with
their fields. No figure is asserted (a benchmark is a script with figures, never a timed test)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tools" / "bench"



def run_bench(script, *args, timeout=300):
    proc = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def load(path):
    result = json.loads(Path(path).read_text())
    assert {"benchmark", "command", "machine"} <= result.keys()
    assert result["machine"]["nproc"] >= 1 and result["machine"]["ram_gib"] > 0
    return result


def test_planner_writes_times_per_cluster_size(tmp_path):
    out = run_bench("planner.py", "--nodes", "8", "64", "--modes", "colocate", "split", "--repeats", "1",
                    "--out", tmp_path)
    rows = load(tmp_path / "planner.json")["rows"]
    assert [(r["nodes"], r["mode"]) for r in rows] == [(8, "colocate"), (8, "split"), (64, "colocate"), (64, "split")]
    for r in rows:
        assert r["gpus"] == 8 * r["nodes"] and r["placed_ranks"] > r["gpus"]  # actor, ref and rollout share GPUs
        assert r["total_s"] == pytest.approx(r["validate_s"] + r["plan_s"] + r["gpu_map_s"])
    assert "validate s" in out


@pytest.mark.slow
def test_gpu_bench_runs_on_cpu_in_tiny_mode(tmp_path):
    out = run_bench("gpu_bench.py", "--device", "cpu", "--tiny", "--bucket-mb", "1", "4", "--repeats", "1",
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


@pytest.mark.slow
def test_weight_sync_rows_per_layout_and_bucket(tmp_path):
    run_bench("weight_sync.py", "--hidden", "128", "--layers", "2", "--vocab", "1000", "--layouts", "1x1", "1x2",
              "--bucket-mb", "1", "4", "--repeats", "1", "--out", tmp_path)
    rows = load(tmp_path / "weight_sync.json")["rows"]
    assert [(r["layout"], r["bucket_mb"]) for r in rows] == [("1x1", 1), ("1x1", 4), ("1x2", 1), ("1x2", 4)]
    assert rows[0]["bytes"] == rows[2]["bytes"]  # the same model, however it is split
    for r in rows:
        assert r["fraction_of_clone"] == pytest.approx(r["reshard_gb_per_s"] / r["clone_gb_per_s"])


@pytest.mark.slow
def test_rollout_engine_rows_for_the_three_methods(tmp_path):
    run_bench("rollout_engine.py", "--hidden", "32", "--layers", "1", "--vocab", "64", "--prompts", "2", "--n", "2",
              "--prompt-len", "4", "--max-new-tokens", "4", "--repeats", "1", "--out", tmp_path)
    result = load(tmp_path / "rollout_engine.json")
    assert result["generated_tokens"] == 2 * 2 * 4
    assert [r["method"] for r in result["rows"]] == ["hf_generate", "engine", "engine_http"]
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])


# overhead.py and grpo_vs_trl.py are not run here: each trains the quickstart's SFT model and two
# GRPO runs (grpo_vs_trl.py also installs TRL into .venv-bench), minutes of work, not a test.
