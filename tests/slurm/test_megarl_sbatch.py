"""slurm/megarl.sbatch on a real Slurm with 4 simulated nodes x 2 fake GPUs (see conftest.py):
Ray across two nodes, the placement plan realised and checked, the experiment's exit status as
the job's, a node whose Ray crashes or hangs named within seconds, and the time-limit warning ->
checkpoint -> requeue -> resume cycle. Every job is submitted from a directory outside the
repository."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.config import load_and_validate
from megarl.placement import plan_from_config

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SBATCH = HERE.parents[1] / "slurm" / "megarl.sbatch"
MEGARL = Path(sys.executable).parent / "megarl"
CONFIG = HERE / "tiny_2node.yaml"
BREAK_RAY = HERE / "break_ray_on_node.sh"
FAKE_TRAINER = HERE / "fake_trainer.py"
# The experiment of the successful job: two GRPO steps of the tiny model across both nodes.
SUCCESS_ENTRY = "-m megarl.trainer.main_ppo"
# pool, rank, plan node, its name, plan GPU, Ray node, Slurm node, GPU id, CUDA index, CUDA_VISIBLE_DEVICES
ROW = re.compile(r"^megarl launch: (\S+)\s+(\d+)\s+(\d+) \((\S+)\)\s+(\d+)\s+([0-9a-f]{8})\s+(\S+)\s+(\S+)\s+(\d+)\s+(\S+)$",
                 re.M)


def test_two_node_job_realises_the_plan_and_the_experiment_finishes(sandbox, tmp_path):
    from megarl.data.synthetic import write_task_dataset
    from megarl.data.tiny_model import make_tiny_model

    make_tiny_model("qwen2", tmp_path / "model", seed=0)
    write_task_dataset("add", tmp_path / "data", train_size=64, val_size=8, sft_size=0, seed=0)
    experiment = [f"actor_rollout_ref.model.path={tmp_path / 'model'}", f"data.train_files={tmp_path / 'data/train.parquet'}",
                  f"data.val_files={tmp_path / 'data/val.parquet'}", "trainer.total_training_steps=2",
                  f"trainer.default_local_dir={tmp_path / 'runs'}"]
    logs = tmp_path / "logs"
    done = subprocess.run([str(MEGARL), "submit", "--config", str(CONFIG), "--time", "00:10:00",
                           "--log-dir", str(logs), *experiment], cwd=tmp_path,
                          # SLURM_EXPORT_ENV=NONE (what `sbatch --export=NONE` gives its steps) would strip the
                          # Ray nodes' environment but for the steps' own --export=ALL; the socket interface
                          # variable must reach every worker
                          env=sandbox.env(MEGARL_ENTRY=SUCCESS_ENTRY, SLURM_EXPORT_ENV="NONE", GLOO_SOCKET_IFNAME="lo"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    job_id = re.search(r"submitted job (\d+)", done.stdout).group(1)
    info = sandbox.wait_finished(job_id)
    log = (logs / f"launch-test-{job_id}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log

    # Ray saw every node of the allocation, each under its Slurm name and node rank.
    nodes = tuple(re.search(rf"job {job_id} on (\S+);", log).group(1).split(","))
    assert len(nodes) == 2 and f"Ray node 0 ({nodes[0]}) joined" in log and f"Ray node 1 ({nodes[1]}) joined" in log
    # The realised placement is the plan: each rank on its planned node, which is the Slurm node
    # its process runs on, one distinct GPU each, visible as itself.
    plan = plan_from_config(load_and_validate(str(CONFIG)), node_names=nodes)
    expected = [(pool.name, str(rank), str(d.node), plan.cluster.name(d.node), str(d.gpu), plan.cluster.name(d.node))
                for rank, (pool, d) in enumerate((p, d) for p in plan.pools.values() for d in p.devices)]
    rows = ROW.findall(log)
    assert [(r[0], r[1], r[2], r[3], r[4], r[6]) for r in rows] == expected, log
    assert len({r[5] for r in rows}) == 2  # two Ray nodes
    for node in nodes:
        gpus = [r[7] for r in rows if r[6] == node]
        assert sorted(gpus) == ["0", "1"]
    assert all(r[7] == r[9] for r in rows)  # CUDA_VISIBLE_DEVICES is the GPU id
    assert all(r[4] == r[8] for r in rows)  # each pool has its whole node: the planned GPU is the real one
    assert (f"cluster check OK: 2 node(s) {list(nodes)} x 2 GPU(s); gloo all-reduce over 4 ranks = 10; socket "
            "interfaces on every rank: GLOO_SOCKET_IFNAME=lo") in log
    # Then the experiment trained on the cluster and its status became the job's.
    assert "the experiment exited with status 0" in log
    metrics = (tmp_path / "runs" / "megarl" / "launch-test" / "logs" / "metrics.jsonl").read_text()
    assert '"step": 2' in metrics and "sync/bytes" in metrics
    sandbox.assert_cleaned_up(job_id)


def test_the_experiments_failure_status_becomes_the_jobs(sandbox, tmp_path):
    # Submitted with plain sbatch, the venv on PATH; main_ppo finds no model and exits with 2.
    job_id = sandbox.sbatch(["--nodes=1", "--gpus-per-node=2", "--time=10", f"--output={tmp_path}/job.out",
                             str(SBATCH), "--config", str(CONFIG), "trainer.nnodes=1", "placement.mode=colocate",
                             "placement.rollout_gpus=0"], cwd=tmp_path)
    info = sandbox.wait_finished(job_id)
    log = (tmp_path / "job.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), log
    assert "cluster check OK" in log
    assert "not a local HF checkpoint directory" in log and "the experiment exited with status 2" in log
    sandbox.assert_cleaned_up(job_id)


def test_a_node_whose_ray_crashes_or_hangs_fails_the_job_fast_naming_it(sandbox, tmp_path):
    # Two jobs at once: on n1+n2 the Ray of n2 exits with an error, on n3+n4 the Ray of n4 never
    # starts (a node that hangs).
    jobs = {}
    for mode, nodes, why in (("crash", "n1,n2", "exited with status 2 before joining"),
                             ("hang", "n3,n4", "did not join within 30 s")):
        bad = nodes.split(",")[1]
        job_id = sandbox.sbatch([f"--nodelist={nodes}", "--nodes=2", "--gpus-per-node=2", "--time=10",
                                 f"--output={tmp_path}/{mode}.out", str(SBATCH), "--config", str(CONFIG)], cwd=tmp_path,
                                MEGARL_RAY_WRAPPER=str(BREAK_RAY), BREAK_RAY_ON_NODE=bad, BREAK_RAY_MODE=mode,
                                MEGARL_JOIN_TIMEOUT="30")
        jobs[mode] = (job_id, bad, why)
    for mode, (job_id, bad, why) in jobs.items():
        info = sandbox.wait_finished(job_id, timeout_s=400)
        log = (tmp_path / f"{mode}.out").read_text()
        assert (info["JobState"], info["ExitCode"]) == ("FAILED", "3:0"), log
        minutes, seconds = map(int, info["RunTime"].split(":")[-2:])
        assert minutes * 60 + seconds < 90, f"{mode}: took {info['RunTime']} of a 10-minute limit"
        assert f"Ray on node {bad} (plan node 1) {why}" in log, log
        assert f"--exclude={bad}" in log and "running the experiment" not in log
        sandbox.assert_cleaned_up(job_id)
    crash_log = (tmp_path / "crash.out").read_text()
    assert "'not-a-number' is not a valid integer" in crash_log  # the node's own error, quoted


def test_time_limit_warning_checkpoints_requeues_and_resumes(sandbox, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    job_id = sandbox.sbatch(["--nodes=1", "--gpus-per-node=2", "--time=10", "--requeue", f"--output={tmp_path}/job.out",
                             str(SBATCH), "--config", str(CONFIG), "trainer.nnodes=1", "placement.mode=colocate",
                             "placement.rollout_gpus=0"], cwd=tmp_path,
                            MEGARL_ENTRY=str(FAKE_TRAINER), FAKE_TRAINER_CHECKPOINT=str(checkpoint))
    log = tmp_path / "job.out"
    sandbox.wait_for(job_id, lambda _: log.exists() and "fake trainer: training" in log.read_text(), 90,
                     "the experiment running")
    # What Slurm sends the batch script before the time limit (#SBATCH --signal=B:USR1@300).
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=sandbox.env(), check=True, timeout=30)
    sandbox.wait_for(job_id, lambda i: (i.get("JobState"), i.get("Reason")) == ("PENDING", "BeginTime"), 60,
                     "the requeue")
    # Skip Slurm's 2-minute hold on requeued jobs (an update starts the job at once), but not within
    # the second of the requeue: slurmd would reject that run's credential as revoked.
    time.sleep(1.5)
    sandbox.scontrol("update", f"JobId={job_id}", "StartTime=now")
    info = sandbox.wait_finished(job_id, timeout_s=120)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    assert "fake trainer: connected to Ray, 2 GPU(s)" in text
    step = re.search(r"fake trainer: checkpoint saved at step (\d+)", text).group(1)
    assert f"requeueing job {job_id}" in text
    assert f"fake trainer: resumed from checkpoint at step {step}; finished" in text
    sandbox.assert_cleaned_up(job_id)
