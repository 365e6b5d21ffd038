"""Code rewards in the sandbox: correct, wrong, crashing, looping, networking, hostile programs."""
import json
import os
import socket

import pytest

from megarl.rewards.code_reward import compute_code_score, extract_code, parse_tests
from megarl.rewards.sandbox import run_python

ADD = {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7"]}
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def fenced(code):
    return f"Here is my solution:\n```python\n{code}```\nIt reads two numbers."


def test_extract_code():
    assert extract_code(fenced("print(1)\n")) == "print(1)\n"
    assert extract_code("```py\nx = 1\n```\n```python\nx = 2\n```") == "x = 2\n"
    assert extract_code("print(3)") == "print(3)"


def test_correct_wrong_and_partial_programs():
    ok = compute_code_score(fenced(ADD_PROGRAM), json.dumps(ADD), timeout_s=30)
    assert ok["score"] == 1.0 and ok["tests_passed"] == 2 and ok["timed_out"] == 0 and ok["crashed"] == 0
    wrong = compute_code_score(fenced("print(3)\n"), ADD, timeout_s=30)
    assert wrong["score"] == 0.0 and wrong["tests_passed"] == 1 and wrong["tests_total"] == 2
    partial = compute_code_score(fenced("print(3)\n"), ADD, timeout_s=30, continuous=True)
    assert partial["score"] == 0.5 and partial["acc"] == 0.0


def test_assert_style_tests():
    tests = {"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
    assert compute_code_score("def add(a, b):\n    return a + b\n", tests, timeout_s=30)["score"] == 1.0
    failed = compute_code_score("def add(a, b):\n    return a - b\n", tests, timeout_s=30)
    assert failed["score"] == 0.0 and failed["crashed"] == 0.0  # a failed assertion is a wrong answer
    crashed = compute_code_score("def add(a, b):\n    return a + undefined\n", tests, timeout_s=30)
    assert crashed["score"] == 0.0 and crashed["crashed"] == 1.0


def test_infinite_loop_times_out_and_scores_zero():
    result = compute_code_score(fenced("while True:\n    pass\n"), ADD, timeout_s=1)
    assert result["score"] == 0.0 and result["timed_out"] == 1.0


def test_sleeping_program_is_killed_on_wall_clock():
    result = run_python("import time\ntime.sleep(60)\n", timeout_s=0.5)
    assert result.status == "timeout" and result.returncode is None
    assert result.wall_s < 10


def test_network_is_unreachable():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    program = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "    print('connected')\n"
        "except OSError as error:\n"
        "    print('blocked', error)\n"
    )
    try:
        result = compute_code_score(program, {"inputs": [""], "outputs": ["connected"]}, timeout_s=3)
        assert result["score"] == 0.0
        with pytest.raises(socket.timeout):
            server.accept()  # nothing ever connected
    finally:
        server.close()
    # the audit hook alone, without a network namespace, already refuses sockets and ctypes
    for code in ("import socket\nsocket.socket()\n", "import ctypes\nctypes.CDLL(None)\n"):
        run = run_python(code, isolate_network=False, timeout_s=2)
        assert run.status == "error" and "PermissionError: sandbox" in run.stderr and not run.network_isolated


def test_hostile_programs_are_contained(tmp_path):
    outside = tmp_path / "outside.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    scratch_root = tmp_path / "scratch"
    scratch_root.mkdir()
    cases = {
        "write outside": f"open({str(outside)!r}, 'w').write('x')\n",
        "delete outside": f"import os\nos.remove({str(victim)!r})\n",
        "spawn": "import subprocess\nsubprocess.run(['echo', 'hi'])\n",
        "fork": "import os\nos.fork()\n",
        "raise limits": "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))\n",
        "memory": "x = bytearray(4 * 1024 ** 3)\n",
    }
    for name, code in cases.items():
        run = run_python(code, timeout_s=2, memory_mb=512, scratch_root=str(scratch_root))
        assert run.status == "error", name
    assert not outside.exists() and victim.read_text() == "keep me"
    inside = run_python("open('notes.txt', 'w').write('ok')\nprint(open('notes.txt').read())\n",
                        scratch_root=str(scratch_root))
    assert inside.status == "ok" and inside.stdout == "ok\n"
    assert os.listdir(scratch_root) == []  # every scratch directory was removed


def test_output_is_capped():
    run = run_python("print('x' * 10 ** 8)\n", max_output_mb=1, timeout_s=5)
    assert run.status == "error" and len(run.stdout) <= 1024 * 1024


def test_malformed_tests_are_clear():
    with pytest.raises(ValueError, match="as many inputs as outputs"):
        parse_tests({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="fn_name"):
        parse_tests({"fn_name": "f", "inputs": [[1]], "outputs": [[2]]})
    with pytest.raises(ValueError, match="need 'inputs'/'outputs' or 'test_list'"):
        parse_tests('{"tests": []}')
    with pytest.raises(ValueError, match="timeout_s=0"):
        run_python("print(1)", timeout_s=0)
