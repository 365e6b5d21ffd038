"""Surviving a dead rollout server: how an exit is described, which answers carry the wrong
weights, a client that keeps going past prompts that got no answer, and a server whose port was
taken before it bound it."""
import socket
import sys

import pytest

from megarl.rollout.client import RolloutClient, Sample, stale_reason
from megarl.rollout.process import exit_description
from megarl.rollout.protocol import SamplingParams


def test_exit_description():
    assert exit_description(-9) == "killed by SIGKILL"
    assert exit_description(-15) == "killed by SIGTERM"
    assert exit_description(3) == "exit code 3"
    assert exit_description(None) == "exit code unknown"


def sample(version, finish="length"):
    return Sample([5], [-0.1], finish, None, "x", version)


def test_stale_reason_keeps_only_the_current_weight_version():
    assert stale_reason([sample("3"), sample("3")], "3") is None
    assert stale_reason([sample("3"), sample("2")], "3") == "answered with weight_version '2', expected '3'"
    assert stale_reason([sample("2")], None) is None  # nothing pushed yet: the servers' start-up weights
    assert stale_reason([sample(None, finish="abort")], "3") is None  # aborted: no weights used


def test_stale_reason_keeps_the_versions_pushed_during_a_partial_rollout():
    assert stale_reason([sample("2"), sample("3")], "3", ["2"]) is None  # one finished before the push
    assert stale_reason([sample("1")], "3", ["2"]) == "answered with weight_version '1', expected one of ['2', '3']"
    assert stale_reason([sample("default")], "1", [None]) is None  # started before any push


def test_stale_reason_checks_every_token_of_a_continued_sample():
    from dataclasses import replace

    continued = replace(sample("3"), token_ids=[5, 6, 7], weight_versions=["2", "default", "3"])
    assert stale_reason([continued], "3", ["2"]) == (
        "answered with weight_version 'default', expected one of ['2', '3']")  # its last part's is fine
    assert stale_reason([replace(continued, weight_versions=["2", "2", "3"])], "3", ["2"]) is None


def test_keep_going_returns_the_prompts_that_got_no_answer():
    with socket.socket() as s:  # a port nobody listens on: every attempt is refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with RolloutClient(dead, max_retries=1, retry_backoff_s=0.01) as client:
        result = client.generate([[1, 2], [3]], SamplingParams(max_new_tokens=2), keep_going=True)
    assert result.samples == [[], []] and sorted(result.failed) == [0, 1]
    assert "gave up after 2 attempts" in result.failed[0]
    assert [r.attempts for r in result.records] == [2, 2] and result.metrics.retried_requests == 2


def test_a_server_whose_port_was_taken_starts_again_on_another_port(tiny_model_dir, tmp_path):
    """A free port is only free until someone binds it. The first start gets a port another
    process listens on: the CPU server's uvicorn says so in its log, and the server starts again on
    a new port. A start that fails for another reason is not retried."""
    from megarl.rollout.launch import cpu_server_command
    from megarl.rollout.process import ServerProcess, ServerStartError, start_on_a_free_port

    ports = []

    def server_on(port, model=tiny_model_dir):
        ports.append(port if ports else taken.getsockname()[1])
        return ServerProcess("cpu-port", cpu_server_command(model, ports[-1], num_threads=1),
                             f"http://127.0.0.1:{ports[-1]}", log_path=str(tmp_path / "cpu-port.log"),
                             startup_timeout_s=120)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = start_on_a_free_port(server_on, "127.0.0.1")
        try:
            assert len(ports) == 2 and ports[0] != ports[1] and server.url == f"http://127.0.0.1:{ports[1]}"
            assert server.is_running()
        finally:
            server.stop()
    assert "address already in use" in (tmp_path / "cpu-port.log").read_text()

    ports.clear()  # a start that fails for another reason (a process that exits at once): no retry
    exits = lambda port: ServerProcess("exits", [sys.executable, "-c", "raise SystemExit(3)"],  # noqa: E731
                                       f"http://127.0.0.1:{ports.append(port) or port}",
                                       log_path=str(tmp_path / "exits.log"), startup_timeout_s=30)
    with pytest.raises(ServerStartError) as failed:
        start_on_a_free_port(exits, "127.0.0.1")
    assert len(ports) == 1 and not failed.value.port_taken


def test_a_stopped_server_is_seen_within_bounds_killed_by_pid_and_started_again(helpers, tiny_model_dir, tmp_path):
    """A CPU server stopped with SIGSTOP (alive, answering nothing): its `/health` probe and a
    `/generate` request both end within their bounds (the kernel still accepts the connections, so
    only the read timeout ends them); `ServerProcess.kill` ends it by PID (SIGKILL to its group) and
    reaps it, and `ensure_running` starts it again at the same URL."""
    import os
    import signal
    import time

    from megarl.rollout.control import ServerControl

    server = helpers.start_cpu_server(tiny_model_dir, tmp_path, "stopped")
    stopped_pid = server.pid
    try:
        os.kill(stopped_pid, signal.SIGSTOP)
        started = time.monotonic()
        assert not ServerControl(server.url).health(timeout_s=1.0)
        assert time.monotonic() - started < 3

        started = time.monotonic()
        with RolloutClient(server.url, request_timeout_s=2.0, max_retries=0) as client:
            result = client.generate([[1, 2]], SamplingParams(max_new_tokens=2), keep_going=True)
        assert time.monotonic() - started < 6  # one attempt: its 2 s total timeout and the client's start
        assert result.samples == [[]] and "no answer within request_timeout_s=2 s" in result.failed[0], result.failed

        assert server.is_running()  # a stopped process is alive
        server.kill("no answer to /health within 1 s")
        assert server.returncode == -signal.SIGKILL and not server.is_running()
        with pytest.raises(ProcessLookupError):  # reaped: not even a zombie is left
            os.kill(stopped_pid, 0)
        assert "killed (SIGKILL to its process group): no answer to /health within 1 s" in \
            (tmp_path / "stopped.log").read_text()

        assert server.ensure_running() and server.pid != stopped_pid and server.restarts == 1
        assert ServerControl(server.url).health(timeout_s=5.0)
    finally:
        server.stop()
