"""`megarl submit`: the sbatch script rendered from a config always asks for the config's size."""
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.cli import main as megarl_main
from megarl.config import ConfigError, load_and_validate
from megarl.launch.sbatch import (
    default_template,
    render_sbatch,
    sbatch_options,
    slurm_seconds,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "tests" / "slurm" / "tiny_2node.yaml"  # 2 nodes x 2 GPUs


@pytest.fixture(scope="module")
def config():
    return load_and_validate(str(CONFIG))


def sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_rendered_script_asks_for_the_configs_size_and_keeps_the_rest(config):
    options = sbatch_options(config, output="/logs/%x-%j.out", chdir="/work", time="1-00:00:00", partition="gpu",
                             account="proj", requeue=True, extra=("--qos=high",))
    text = render_sbatch(default_template().read_text(), options, python="/venv/bin/python",
                         experiment_args=["--config", "/cfg/exp.yaml", "trainer.total_epochs=2"])
    lines = sbatch_lines(text)
    for expected in ("--job-name=launch-test", "--nodes=2", "--gpus-per-node=2", "--time=1-00:00:00",
                     "--partition=gpu", "--account=proj", "--requeue", "--qos=high", "--output=/logs/%x-%j.out",
                     "--chdir=/work", "--exclusive", "--signal=B:USR1@300"):
        assert f"#SBATCH {expected}" in lines
    for option in ("--nodes", "--time", "--job-name", "--output"):  # the template's own lines are gone
        assert sum(line.startswith(f"#SBATCH {option}") for line in lines) == 1
    assert ': "${MEGARL_PYTHON:=/venv/bin/python}"' in text
    assert "[ $# -gt 0 ] || set -- --config /cfg/exp.yaml trainer.total_epochs=2" in text
    body = text.splitlines()
    baked = body.index(': "${MEGARL_PYTHON:=/venv/bin/python}"')
    assert body.index(lines[-1]) < baked < body.index("set -euo pipefail")
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_a_size_that_contradicts_the_config_is_an_error(config):
    with pytest.raises(ConfigError) as err:
        sbatch_options(config, output="o", chdir="d", nodes=4, gpus_per_node=8,
                       extra=("-N4", "--gres=gpu:8", "--qos=x"))
    message = str(err.value)
    assert "--nodes=4 but trainer.nnodes=2" in message
    assert "--gpus-per-node=8 but trainer.n_gpus_per_node=2" in message
    assert "'-N4' sizes the job" in message and "'--gres=gpu:8' sizes the job" in message
    assert "--qos" not in message
    same = sbatch_options(config, output="o", chdir="d", nodes=2, gpus_per_node=2)
    assert same.options["nodes"] == "2"


@pytest.mark.parametrize("text, seconds", [("30", 1800), ("10:30", 630), ("4:00:00", 14400), ("2-0", 172800),
                                           ("1-12:30", 131400), ("1-00:00:05", 86405), ("UNLIMITED", None)])
def test_slurm_times(text, seconds):
    assert slurm_seconds(text) == seconds


def test_a_time_limit_shorter_than_the_checkpoint_warning_is_an_error(config):
    template = default_template().read_text()  # --signal=B:USR1@300
    short = sbatch_options(config, output="o", chdir="d", time="5")
    with pytest.raises(ConfigError, match="--time=5 is not longer than the time-limit warning"):
        render_sbatch(template, short, python="p", experiment_args=[])
    render_sbatch(template, sbatch_options(config, output="o", chdir="d", time="10"), python="p", experiment_args=[])
    with pytest.raises(ConfigError, match="not a Slurm time"):
        slurm_seconds("4h")


def test_megarl_submit_writes_a_script_that_runs_this_config_from_anywhere(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = megarl_main(["submit", "--config", str(CONFIG), "--time", "02:00:00", "--log-dir", "logs", "--no-submit",
                      "trainer.experiment_name=exp1"])
    assert rc == 0
    script = tmp_path / "logs" / "exp1.sbatch"
    assert f"wrote {script}" in capsys.readouterr().out
    text = script.read_text()
    assert f"#SBATCH --chdir={tmp_path}" in text and f"#SBATCH --output={tmp_path}/logs/%x-%j.out" in text
    assert f"set -- --config {CONFIG} trainer.experiment_name=exp1" in text
    assert f'MEGARL_PYTHON:={sys.executable}' in text  # the job finds megarl without an activated venv

    with pytest.raises(SystemExit) as exit_info:  # a config mistake: exit 2 before anything is written
        megarl_main(["submit", "--config", str(CONFIG), "--nodes", "3", "--no-submit", "--log-dir", "other"])
    assert exit_info.value.code == 2
    assert "--nodes=3 but trainer.nnodes=2" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("device, added", [
    ("auto", ["trainer.device=cuda"]),  # the batch step that would resolve auto may see none of the job's GPUs
    ("cuda", []),
    ("cpu", []),  # a CPU cluster with logical GPUs keeps its choice
])
def test_the_job_never_leaves_the_device_to_its_batch_step(device, added):
    from megarl.launch import sbatch

    assert sbatch.device_overrides(device) == added


def test_megarl_submit_says_trainer_device_cuda_for_a_config_that_says_auto(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = megarl_main(["submit", "--config", str(CONFIG), "--log-dir", "logs", "--no-submit",
                      "trainer.experiment_name=exp2", "trainer.device=auto"])
    assert rc == 0
    text = (tmp_path / "logs" / "exp2.sbatch").read_text()
    # after the user's overrides, so the job's controller is told, whatever the config file says
    assert f"set -- --config {CONFIG} trainer.experiment_name=exp2 trainer.device=auto trainer.device=cuda" in text
    # and the template's own usage line says it too
    usage = [line for line in default_template().read_text().splitlines() if line.startswith("#   sbatch ")]
    assert usage and all("trainer.device=cuda" in line for line in usage)


def test_an_installed_megarl_finds_its_sbatch_template(tmp_path):
    """`pip install --no-deps --target` (a real, non-editable install of this source tree) ships
    the template as package data; the installed megarl, not this checkout, finds it. The checkout's
    slurm/megarl.sbatch is the same file."""
    source = tmp_path / "source"
    (source / "src").mkdir(parents=True)
    for name in ("setup.py", "README.md"):
        (source / name).write_bytes((REPO / name).read_bytes())
    subprocess.run(["cp", "-r", str(REPO / "src" / "megarl"), str(source / "src")], check=True, timeout=60)
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "--target", str(target), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    probe = ("import megarl, megarl.launch.sbatch as s; t = s.default_template(); "
             "print(megarl.__file__); print(t); print(t.is_file())")
    found = subprocess.run([sys.executable, "-c", probe], env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(target)},
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    module, template, exists = found.stdout.split()
    assert module.startswith(str(target)) and template.startswith(str(target)) and exists == "True"
    assert Path(template).read_text() == (REPO / "slurm" / "megarl.sbatch").read_text()
