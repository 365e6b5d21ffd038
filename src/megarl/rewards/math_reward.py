"""Verifiable rewards for math answers: extract the final answer, normalise it, compare exactly.

Extraction (from the model's response):
  - `\\boxed{...}` / `\\fbox{...}`: the last one, with nested braces matched (`\\boxed 5` also);
    an unclosed last box (a truncated response) gives no answer
  - GSM8K style: the number after the last `####`
  - the last number in the text (only with method="flexible")

Comparison: both sides are normalised (LaTeX spacing and `\\left`/`\\right`, `\\dfrac`, `$`, `%`,
degrees, a trailing unit in `\\text{}`, `x = ...`, thousands separators, whitespace); they match
if the strings are equal or if both are rational numbers of equal value (so 0.5 = 1/2 =
\\frac{1}{2} = 0.50, and 1,000 = 1000 = 1000.0), compared exactly with `fractions.Fraction`.

Scores: 1.0 for a correct answer, `format_score` for a wrong answer that was found in the
expected format, 0.0 when no answer is found. Scorers return
`{"score": float, "acc": 1.0 | 0.0, "pred": extracted answer or ""}`.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Optional

_NUMBER = r"-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_LAST_NUMBER = re.compile(_NUMBER + r"(?:/\d+)?")
_GSM8K_ANSWER = re.compile(r"\s*\$?\s*(" + _NUMBER + r")")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` (braces matched), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", i):  # "\boxed 5": one token up to whitespace or '$'
        match = re.match(r" +([^\s$]+)", text[i:i + 200])
        return match.group(1) if match else None
    if not text.startswith("{", i):
        return None
    depth, j = 0, i
    while j < len(text):
        char = text[j]
        if char == "\\":  # \{ and \} are literal braces, not structure
            j += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
        j += 1
    return None


def gsm8k_answer(text: str) -> Optional[str]:
    """The number after the last `####`, or None."""
    start = text.rfind("####")
    if start < 0:
        return None
    match = _GSM8K_ANSWER.match(text, start + 4)
    return match.group(1) if match else None


def last_number(text: str) -> Optional[str]:
    """The last number in the text (integers, decimals, 1,000 separators, a/b), or None."""
    last = None
    for last in _LAST_NUMBER.finditer(text):
        pass
    return last.group(0) if last else None


def _unwrap(command: str, s: str) -> str:
    """Replace `\\command{X}` (no nested braces in X) with X."""
    return re.sub(r"\\" + command + r"\{([^{}]*)\}", r"\1", s)


def normalize_answer(answer: Any) -> str:
    """A canonical string for comparison (see the module docstring for what is removed)."""
    s = str(answer).strip()
    unit = re.fullmatch(r"(.+?)\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z][a-zA-Z ]*\}", s)
    if unit:  # "5\text{ cm}" -> "5"
        s = unit.group(1)
    for command in ("text", "textbf", "mbox", "mathrm", "mathbf", "boxed"):
        s = _unwrap(command, s)
    for pattern in (r"\\left", r"\\right", r"\\displaystyle", r"\\[!,;: ]", r"\\quad", r"\\qquad",
                    r"\^\{?\\circ\}?", r"\\%", "%", r"\\\$", r"\$", "°"):
        s = re.sub(pattern, "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)  # \sqrt2 -> \sqrt{2}
    s = s.rstrip(".")
    if re.fullmatch(r"[a-zA-Z]{1,2}=.+", s):  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


_MAX_NUMERAL_CHARS = 400  # longer "numbers" are compared as strings (int() refuses > 4300 digits)


def _rational(s: str) -> Optional[Fraction]:
    """The exact value of a normalised integer, decimal, a/b or \\frac{a}{b}, or None."""
    number = r"-?(?:\d+(?:\.\d+)?|\.\d+)"
    if len(s) > _MAX_NUMERAL_CHARS:
        return None
    try:
        if re.fullmatch(number, s):
            return Fraction(s)
        match = re.fullmatch(rf"(-?)\\frac\{{({number})\}}\{{({number})\}}", s) or re.fullmatch(
            rf"()({number})/({number})", s)
        if match:
            value = Fraction(match.group(2)) / Fraction(match.group(3))
            return -value if match.group(1) else value
    except ZeroDivisionError:
        return None
    return None


def answers_match(prediction: Any, ground_truth: Any) -> bool:
    """Equal after normalisation, or both rational with the same exact value."""
    pred, truth = normalize_answer(prediction), normalize_answer(ground_truth)
    if not pred:
        return False
    if pred == truth:
        return True
    pred_value, truth_value = _rational(pred), _rational(truth)
    return pred_value is not None and pred_value == truth_value


def _score(prediction: Optional[str], truth: str, format_score: float) -> dict[str, Any]:
    if prediction is None:
        return {"score": 0.0, "acc": 0.0, "pred": ""}
    correct = answers_match(prediction, truth)
    return {"score": 1.0 if correct else float(format_score), "acc": float(correct), "pred": prediction}


def _check_method(method: str) -> None:
    if method not in ("strict", "flexible"):
        raise ValueError(f"unknown answer extraction method {method!r}; choose 'strict' or 'flexible'")


def compute_math_score(solution_str: str, ground_truth: Any, method: str = "strict",
                       format_score: float = 0.0) -> dict[str, Any]:
    """MATH-style: the answer is the last \\boxed{} (method="flexible": else the last number).
    A ground truth that is a whole solution is reduced to its last \\boxed{}."""
    _check_method(method)
    prediction = last_boxed(solution_str)
    if prediction is None and method == "flexible":
        prediction = last_number(solution_str)
    truth = str(ground_truth)
    return _score(prediction, last_boxed(truth) or truth, format_score)


def compute_gsm8k_score(solution_str: str, ground_truth: Any, method: str = "strict",
                        format_score: float = 0.0) -> dict[str, Any]:
    """GSM8K-style: the answer follows the last `####` (or is the last \\boxed{}; method="flexible":
    else the last number). A ground truth with `####` (the raw GSM8K answer) is reduced to its number."""
    _check_method(method)
    prediction = gsm8k_answer(solution_str) or last_boxed(solution_str)
    if prediction is None and method == "flexible":
        prediction = last_number(solution_str)
    truth = str(ground_truth)
    return _score(prediction, gsm8k_answer(truth) or truth, format_score)
