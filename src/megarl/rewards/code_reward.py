"""Code reward: run the model's program against test cases in the sandbox (`sandbox.run_python`).

Test cases (`ground_truth`, a dict or its JSON string):
  {"inputs": [stdin, ...], "outputs": [expected stdout, ...]}   APPS / TACO / CodeContests style;
      outputs are compared line by line, whitespace-separated tokens per line, trailing blank
      lines ignored
  {"test_list": ["assert f(1) == 2", ...]}                        MBPP style; each assert runs after
      the program, and the test passes if the run exits cleanly

The program is the last fenced code block of the response (```python ... ```), or the whole
response if it has none. A test that times out or crashes counts as failed; the scorer never
raises for the program's behaviour, only for malformed test cases.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from megarl.rewards.sandbox import RunResult, run_python

_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class CodeTest:
    stdin: str
    expected_stdout: Optional[str]  # None: an assert test, judged by the exit status
    check_code: str  # appended to the program ("" for stdin/stdout tests)


def extract_code(solution_str: str) -> str:
    """The last fenced code block, or the whole text."""
    blocks = _FENCED.findall(solution_str)
    return blocks[-1] if blocks else solution_str


def _as_text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def parse_tests(ground_truth: Any) -> list[CodeTest]:
    """Test cases from a dict or JSON string; ValueError naming what is wrong."""
    spec = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(spec, dict):
        raise ValueError(f"code tests must be a dict or a JSON object, got {type(spec).__name__}")
    if "fn_name" in spec:
        raise ValueError("call-based code tests (fn_name) are not supported; use inputs/outputs or test_list")
    if "inputs" in spec or "outputs" in spec:
        inputs, outputs = spec.get("inputs", []), spec.get("outputs", [])
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError(f"code tests need as many inputs as outputs (>0): {len(inputs)} inputs, "
                             f"{len(outputs)} outputs")
        return [CodeTest(_as_text(i), _as_text(o), "") for i, o in zip(inputs, outputs)]
    if "test_list" in spec:
        if not spec["test_list"]:
            raise ValueError("code tests: test_list is empty")
        return [CodeTest("", None, str(test)) for test in spec["test_list"]]
    raise ValueError(f"code tests need 'inputs'/'outputs' or 'test_list'; got keys {sorted(spec)}")


def outputs_match(actual: str, expected: str) -> bool:
    """Line by line, comparing whitespace-separated tokens; trailing blank lines ignored."""
    def tokens(text: str) -> list[list[str]]:
        return [line.split() for line in text.strip().splitlines()]

    return tokens(actual) == tokens(expected)


def _passed(test: CodeTest, result: RunResult) -> bool:
    if result.status != "ok":
        return False
    return test.expected_stdout is None or outputs_match(result.stdout, test.expected_stdout)


def compute_code_score(
    solution_str: str,
    ground_truth: Any,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    continuous: bool = False,
) -> dict[str, Any]:
    """Score = 1.0 if every test passes (stopping at the first failure), or with `continuous` the
    share of tests passed. Returns {"score", "acc" (all passed), "tests_passed", "tests_total",
    "timed_out" (1.0 if any test ran out of time), "crashed" (1.0 if any run failed with an
    error), "network_isolated"}. `timeout_s`, `memory_mb`: per test, see `run_python`."""
    tests = parse_tests(ground_truth)
    code = extract_code(solution_str)
    passed = timed_out = crashed = 0
    isolated = True
    for test in tests:
        source = code if not test.check_code else f"{code}\n\n{test.check_code}\n"
        result = run_python(source, test.stdin, timeout_s=timeout_s, memory_mb=memory_mb)
        isolated = isolated and result.network_isolated
        timed_out += result.status == "timeout"
        crashed += result.status == "error" and result.returncode != 2  # 2: a failed assertion
        if _passed(test, result):
            passed += 1
        elif not continuous:
            break
    all_passed = passed == len(tests)
    return {
        "score": passed / len(tests) if continuous else float(all_passed),
        "acc": float(all_passed),
        "tests_passed": float(passed),
        "tests_total": float(len(tests)),
        "timed_out": float(timed_out > 0),
        "crashed": float(crashed > 0),
        "network_isolated": float(isolated),
    }
