"""The megarl side of the GRPO benchmarks (grpo_vs_trl.py, overhead.py): a warm-started tiny model
and one GRPO run of configs/quickstart.yaml through megarl's CLI, summarised from its metrics.jsonl.

The warm start is the quickstart's first two stages (megarl.demo): the 302k-parameter Qwen2 with the
character tokenizer, the 2-digit addition task in verl parquet, and megarl's SFT
(configs/quickstart_sft.yaml) to about 33-44% greedy accuracy, so that GRPO has a reward signal.
It is made once per work directory and reused.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench_common import REPO, load_average

MEGARL_PYTHON = REPO / ".venv" / "bin" / "python"


def python_for_megarl() -> str:
    return str(MEGARL_PYTHON if MEGARL_PYTHON.exists() else Path(sys.executable))


def run_logged(command: list[str], log_path: Path, timeout_s: float, env: dict | None = None) -> None:
    """Run `command` in the repository root, stdout+stderr to log_path; raise with the log's tail on failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the run's Ray processes go with it
            proc.wait(timeout=60)
            raise RuntimeError(f"{command[:4]} timed out after {timeout_s} s; log: {log_path}")
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(command[:4])} ... exited with {code}; log {log_path}:\n{tail}")


def warm_start(workdir: Path, sft_steps: int, timeout_s: float = 900) -> dict:
    """Tiny model, addition data and megarl's SFT warm-up under workdir (made once); returns paths
    {"model": SFT'd HF checkpoint, "train": RL train parquet, "val": RL val parquet}."""
    from megarl.data.synthetic import write_task_dataset
    from megarl.data.tiny_model import make_tiny_model

    workdir = Path(workdir).resolve()
    ready = workdir / "warm_start.json"
    if ready.exists():
        paths = json.loads(ready.read_text())
        if paths.get("sft_steps") == sft_steps and Path(paths["model"]).exists():
            return paths
    make_tiny_model("qwen2", workdir / "model", seed=0)
    data = write_task_dataset("add", workdir / "data", seed=0)
    runs = workdir / "runs"
    run_logged([python_for_megarl(), "-m", "megarl.trainer.main_sft", "--config", "configs/quickstart_sft.yaml",
                f"actor_rollout_ref.model.path={workdir / 'model'}", f"data.train_files={data['sft_train']}",
                f"data.val_files={data['sft_val']}", f"trainer.default_local_dir={runs}",
                f"trainer.total_training_steps={sft_steps}", f"trainer.test_freq={sft_steps}",
                "trainer.logger=[console]"], workdir / "sft.log", timeout_s)
    paths = {"model": str(runs / "quickstart" / "sft" / "hf"), "train": str(data["train"]), "val": str(data["val"]),
             "sft_steps": sft_steps}
    ready.write_text(json.dumps(paths, indent=2))
    return paths


def run_grpo(warm: dict, workdir: Path, name: str, steps: int, seed: int, overrides: list[str],
             timeout_s: float = 1800, config: str = "configs/quickstart.yaml") -> dict:
    """One `python -m megarl.trainer.main_ppo --config <config>` run (the quickstart's by default) from
    the warm start, its logs under <workdir>/runs/quickstart/<name>; returns its summary (see
    `summarize`) with its metrics.jsonl path, the exact command and the load averages before and after."""
    runs = Path(workdir).resolve() / "runs"
    shutil.rmtree(runs / "quickstart" / name, ignore_errors=True)
    command = [python_for_megarl(), "-m", "megarl.trainer.main_ppo", "--config", config,
               f"actor_rollout_ref.model.path={warm['model']}", f"data.train_files={warm['train']}",
               f"data.val_files={warm['val']}", f"trainer.default_local_dir={runs}",
               "trainer.project_name=quickstart", f"trainer.experiment_name={name}",
               f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", f"trainer.seed={seed}",
               f"data.seed={seed}", *overrides]
    load_before = load_average()
    run_logged(command, runs / f"{name}.log", timeout_s)
    metrics = runs / "quickstart" / name / "logs" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {**summarize(rows), "metrics": str(metrics), "command": " ".join(command[1:]),
            "load_before": load_before, "load_after": load_average()}


def summarize(rows: list[dict]) -> dict:
    """Per-step lists from megarl's metrics rows: step seconds, response tokens, timing/* phases, and
    the greedy validation score before and after training."""
    train = [r for r in rows if "timing/step_s" in r]
    scored = [r for r in rows if "val/score" in r]
    phases = sorted({k for r in train for k in r if k.startswith("timing/") and k != "timing/step_s"})
    return {
        "framework": "megarl", "steps": len(train),
        "step_s": [r["timing/step_s"] for r in train],
        "response_tokens": [int(r["rollout/response_tokens"]) for r in train],
        "phases_s": {k.removeprefix("timing/").removesuffix("_s"): [r.get(k, 0.0) for r in train] for k in phases},
        "train_reward": [r["reward/mean"] for r in train],
        "val_score_before": scored[0]["val/score"] if scored and scored[0]["step"] == 0 else None,
        "val_score": scored[-1]["val/score"] if scored else None,
    }


def steady(values: list[float], skip: int = 1) -> list[float]:
    """The values after the first `skip` (warm-up) steps; all of them when there are no more."""
    return values[skip:] if len(values) > skip else values
