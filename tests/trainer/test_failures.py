"""How a run says it stopped (issue 26 items 5 and 6): one line per failing rank, the remote
tracebacks in <run>/logs/failure.txt, the resume hint only when a checkpoint exists; SIGTERM asks
for a checkpoint, a second one or Ctrl-C stops at once (issue 42), and the teardown holds signals."""
import signal

import pytest

from megarl.config import load_and_validate
from megarl.placement.worker_group import WorkerGroupError
from megarl.trainer.failures import INTERRUPTED, console_lines, run_and_report
from megarl.trainer.preemption import PREEMPTED_EXIT_CODE, Preempted, StopRequest, signals_held

# The shape WorkerGroup._gather gives a failed call: one item per rank, each with Ray's remote
# traceback (which itself repeats the cause) indented under it; the cause here spans two lines.
REMOTE = ("ray::TrainWorker.train_step() (pid=4242, ip=10.0.0.7)\n      Traceback (most recent call last):\n"
          '        File "engine.py", line 80, in train_step\n      ValueError: shapes differ\n      at layer 3')
FAILED = WorkerGroupError(
    "actor.train_step failed:\n"
    f"  - actor rank 0 on node0 raised ValueError: shapes differ\nat layer 3\n      {REMOTE}\n"
    f"  - actor rank 1 on node1 raised ValueError: shapes differ\nat layer 3\n      {REMOTE}\n"
    f"  - actor rank 1 on node1 raised ValueError: shapes differ\nat layer 3\n      {REMOTE}")


def _config(tmp_path):
    return load_and_validate(None, ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet",
                                    f"trainer.default_local_dir={tmp_path}", "trainer.project_name=p",
                                    "trainer.experiment_name=e"])


def _fail(error):
    def run(config):
        raise error
    return run


def test_console_lines_keep_one_line_per_rank():
    assert console_lines(str(FAILED)) == ["actor.train_step failed:",
                                          "  - actor rank 0 on node0 raised ValueError: shapes differ",
                                          "  - actor rank 1 on node1 raised ValueError: shapes differ"]


def test_a_failure_is_a_few_lines_with_details_in_a_file_and_no_hint_without_a_checkpoint(tmp_path, capsys):
    assert run_and_report(_fail(FAILED), _config(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "engine.py" not in err, err
    assert err.count("shapes differ") == 2  # rank 0 and rank 1, once each
    assert err.splitlines()[0] == "megarl: the run stopped: WorkerGroupError: actor.train_step failed:"
    failure_file = tmp_path / "p/e/logs/failure.txt"
    assert f"details (remote tracebacks): {failure_file}" in err
    assert 'File "engine.py", line 80' in failure_file.read_text()
    assert "resume_mode=auto" not in err
    assert "no checkpoint was written yet" in err


def test_the_resume_hint_names_the_last_complete_checkpoint(tmp_path, capsys):
    for step, complete in ((2, True), (4, True), (6, False)):  # step 6 was cut short
        (tmp_path / f"p/e/global_step_{step}").mkdir(parents=True)
        if complete:
            (tmp_path / f"p/e/global_step_{step}/COMPLETE").write_text("")
    assert run_and_report(_fail(RuntimeError("model.safetensors is truncated")), _config(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "megarl: the run stopped: RuntimeError: model.safetensors is truncated" in err
    assert f"with trainer.resume_mode=auto the next run continues from step 4 ({tmp_path}/p/e/global_step_4)" in err


def test_sigterm_is_a_stop_request_a_second_one_and_ctrl_c_stop_at_once():
    # raise_signal signals this thread and runs the Python handler before it returns. The handler
    # restored is whatever the process had (SIG_IGN once an earlier test's library ignored SIGINT).
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with StopRequest() as stop:
        signal.raise_signal(signal.SIGTERM)  # no exception: the step goes on, then the checkpoint
        assert stop.signum == signal.SIGTERM
        stop.step = 3
        with pytest.raises(Preempted, match="stopped by SIGTERM after step 3: no new checkpoint") as second:
            signal.raise_signal(signal.SIGTERM)
        assert second.value.exit_code == 128 + signal.SIGTERM == 143
    with StopRequest() as stop:
        with pytest.raises(Preempted, match="stopped by SIGINT after step 0: no new checkpoint") as ctrl_c:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C: at once, the first time
        assert stop.signum == signal.SIGINT and ctrl_c.value.exit_code == 130
    assert {s: signal.getsignal(s) for s in before} == before  # restored


def test_stop_signals_are_held_during_the_teardown(caplog):
    before = signal.getsignal(signal.SIGINT)
    with signals_held("the run stops its workers"):
        signal.raise_signal(signal.SIGINT)  # neither KeyboardInterrupt nor Preempted: the teardown goes on
        signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) is before
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "SIGINT received while the run stops its workers", "SIGTERM received while the run stops its workers"]


def test_ctrl_c_outside_the_loop_and_a_preempted_run_exit_cleanly(tmp_path, capsys):
    assert run_and_report(_fail(KeyboardInterrupt()), _config(tmp_path)) == 130
    assert capsys.readouterr().err == INTERRUPTED + "\n"
    assert INTERRUPTED.startswith("megarl: interrupted (Ctrl-C); the interruption saved nothing")
    stopped = Preempted(signal.SIGTERM, 5, "/ckpt/global_step_5")
    assert run_and_report(_fail(stopped), _config(tmp_path)) == PREEMPTED_EXIT_CODE
    assert "stopped by SIGTERM after step 5: checkpoint /ckpt/global_step_5; exit status 75" in capsys.readouterr().err
    abandoned = Preempted(signal.SIGINT, 6, None)
    assert run_and_report(_fail(abandoned), _config(tmp_path)) == 130
    err = capsys.readouterr().err
    assert "stopped by SIGINT after step 6: no new checkpoint (the step was abandoned); exit status 130 (no checkpoint" in err
