"""The commands users type: the seed command line, `megarl config show`, exit codes."""
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]

SEED = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=/data/train.parquet",
    "data.val_files=/data/val.parquet",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct",
    "actor_rollout_ref.rollout.name=sglang",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
]


def run(*args, cwd=REPO, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def test_seed_command_line_validates_and_dry_run_checks_this_machine(tmp_path):
    """--dry-run runs the checks the real run does before Ray starts: here the data files, the model
    (a hub id, not in an empty HF cache, offline) and the GPU are missing, and it says so."""
    r = run("-m", "megarl.trainer.main_ppo", *SEED, "--dry-run", cwd=tmp_path,
            env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert "config OK" in r.stdout
    assert "1 node(s) x 8 = 8" in r.stdout
    assert "1024 prompts x n=1 = 1024 responses" in r.stdout
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "data.train_files: file not found: /data/train.parquet" in r.stderr
    assert "actor_rollout_ref.model.path='Qwen/Qwen2.5-7B-Instruct': HF_HUB_OFFLINE=1 and it is not in the HF cache" \
        in r.stderr
    assert "no CUDA GPU" in r.stderr


def test_config_show_prints_nested_resolved_yaml(tmp_path):
    r = run("-m", "megarl.cli", "config", "show", *SEED, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    tree = yaml.safe_load(r.stdout)
    assert tree["algorithm"]["adv_estimator"] == "grpo"
    assert tree["trainer"]["n_gpus_per_node"] == 8
    assert tree["actor_rollout_ref"]["actor"]["clip_ratio_low"] == 0.2  # resolved from clip_ratio


def test_config_show_with_file_and_overrides_after_options():
    r = run("-m", "megarl.cli", "config", "show", "trainer.nnodes=1", "--config", "configs/quickstart.yaml",
            "trainer.total_training_steps=17")
    assert r.returncode == 0, r.stderr
    tree = yaml.safe_load(r.stdout)
    assert tree["trainer"]["total_training_steps"] == 17  # more than the 10 warm-up steps
    assert tree["trainer"]["logger"] == ["console", "tensorboard"]  # from configs/base.yaml via defaults:
    assert tree["algorithm"]["adv_estimator"] == "grpo"


def test_plan_into_a_closed_pipe_stops_without_a_traceback():
    """`megarl plan ... | head`: the reader is gone before the plan is printed (its end of the pipe
    is closed before the command has even imported), and the command stops quietly."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "megarl.cli", "plan", *SEED], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO)
    finally:
        os.close(write_end)
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.returncode == 1


def test_config_mistake_exits_2_with_one_message_and_no_traceback():
    r = run("-m", "megarl.cli", "config", "show", *SEED, "trainer.n_gpu_per_node=8")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "did you mean 'trainer.n_gpus_per_node'?" in r.stderr
    r = run("-m", "megarl.trainer.main_ppo", *SEED, "data.train_batch_size=1000", "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "ppo_mini_batch_size=256 prompts must divide data.train_batch_size=1000 prompts" in r.stderr


def test_megarl_console_script_installed():
    exe = Path(sys.executable).parent / "megarl"
    r = subprocess.run([str(exe), "config", "show", "--config", str(REPO / "configs/quickstart.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "adv_estimator: grpo" in r.stdout


def test_config_package_imports_no_heavy_frameworks():
    code = "import sys, megarl.config, megarl.cli; print(sorted(m for m in ('torch','ray','megatron') if m in sys.modules))"
    r = run("-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_every_shipped_config_validates():
    configs = sorted((REPO / "configs").rglob("*.yaml"))
    experiments = [c for c in configs if c.name != "base.yaml"]
    assert experiments
    for path in experiments:  # validation only: their data and models are made by the quickstart tools
        r = run("-m", "megarl.cli", "config", "show", "--config", str(path))
        assert r.returncode == 0, f"{path}: {r.stderr}"


def test_commands_log_megarl_lines_but_not_every_http_request():
    code = ("import logging\n"
            "from megarl.config.args import entry_point\n"
            "def main():\n"
            "    logging.getLogger('httpx').info('HTTP Request: POST http://127.0.0.1/generate')\n"
            "    logging.getLogger('httpx').warning('httpx warning kept')\n"
            "    logging.getLogger('megarl.rollout').info('rollout info kept')\n"
            "entry_point(main)()\n")
    r = run("-c", code)
    assert r.returncode == 0, r.stderr
    assert "rollout info kept" in r.stderr and "httpx warning kept" in r.stderr
    assert "HTTP Request" not in r.stderr
