"""`on_all`, the admin round over every server (the weight push's and the fleet's): calls run at
once, every failure is named, and rounds reuse the process's threads (also in a forked child,
whose pool is its own)."""
import multiprocessing
import threading
import time

import pytest

from megarl.rollout.control import ServerControl, ServerError, on_all


def servers(n: int) -> list[ServerControl]:
    return [ServerControl(f"http://127.0.0.1:{9000 + i}") for i in range(n)]  # nothing listens: no call is HTTP


def test_the_calls_of_a_round_run_at_once_and_come_back_in_server_order():
    fleet = servers(3)
    all_started = threading.Barrier(3, timeout=10)  # broken (an error) unless all three wait at once

    def call(server):
        all_started.wait()
        return server.url

    assert on_all(fleet, call) == [s.url for s in fleet]


def test_every_failing_server_is_named_and_the_others_finish():
    fleet = servers(3)
    finished = []

    def call(server):
        if server is not fleet[1]:
            raise ServerError(f"{server.url}/flush_cache: HTTP 400: requests are running")
        finished.append(server.url)

    with pytest.raises(ServerError) as info:
        on_all(fleet, call)
    assert fleet[0].url in str(info.value) and fleet[2].url in str(info.value)
    assert fleet[1].url not in str(info.value) and finished == [fleet[1].url]


def admin_threads() -> set:
    return {t.ident for t in threading.enumerate() if t.name.startswith("server-admin-http")}


def test_rounds_start_no_threads_once_the_pool_has_enough():
    fleet = servers(2)
    on_all(fleet, lambda s: s.url)
    before = admin_threads()
    seen = set()
    for _ in range(20):
        seen.update(on_all(fleet, lambda s: threading.get_ident()))
    assert admin_threads() == before and seen <= before


def _round_in_child(results) -> None:
    results.put(on_all(servers(2), lambda s: s.url))


def test_a_forked_child_runs_rounds_on_threads_of_its_own():
    both = threading.Barrier(2, timeout=10)
    on_all(servers(2), lambda s: both.wait())  # two threads, now idle: a fork does not copy them, and a
    time.sleep(0.2)                            # pool that counted them would wait for them forever
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_round_in_child, args=(results,))
    child.start()
    try:
        assert results.get(timeout=30) == [s.url for s in servers(2)]
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
    assert child.exitcode == 0
