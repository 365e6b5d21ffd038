"""Math and GSM8K answers: extraction, normalisation, exact comparison, adversarial outputs."""
import pytest

from megarl.rewards.math_reward import (
    answers_match,
    compute_gsm8k_score,
    compute_math_score,
    gsm8k_answer,
    last_boxed,
    last_number,
    normalize_answer,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\frac{1}{\sqrt{2}}} done", r"\frac{1}{\sqrt{2}}"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are not structure
        (r"answer: \boxed 5$", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed{}", ""),
        (r"\boxed{3} and finally \boxed{\frac{1}{2}", None),  # truncated last box: no answer
        ("no box at all", None),
        ("", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_gsm8k_and_last_number_extraction():
    assert gsm8k_answer("She pays 3 + 4 = 7.\n#### 72") == "72"
    assert gsm8k_answer("#### $1,000.50 dollars") == "1,000.50"
    assert gsm8k_answer("#### twelve") is None and gsm8k_answer("72") is None
    assert last_number("first 3, then 4.5 and finally -2.") == "-2"
    assert last_number("it costs 1,000 dollars") == "1,000"
    assert last_number("half is 1/2") == "1/2"
    assert last_number("a list 1,2") == "2"
    assert last_number("no digits") is None


@pytest.mark.parametrize(
    "prediction, truth, expected",
    [
        ("1,000", "1000", True),
        ("1000.0", "1000", True),
        ("0.5", "1/2", True),
        (r"\frac{1}{2}", "0.5", True),
        (r"\dfrac12", "1/2", True),
        ("0.50", ".5", True),
        (r"-\frac{3}{4}", "-0.75", True),
        (r"50\%", "50", True),
        (r"90^\circ", "90", True),
        (r"\$18.90", "18.9", True),
        ("x = 5", "5", True),
        (r"5\text{ cm}", "5", True),
        (r"\left( 1, 2 \right)", "(1,2)", True),
        (r"\sqrt2", r"\sqrt{2}", True),
        ("0.5", "0.51", False),
        ("1,2", "12", False),
        ("1/3", "0.333", False),  # exact, not approximate
        ("1/0", "2/0", False),
        ("", "0", False),
        ("5", "", False),
    ],
)
def test_answers_match(prediction, truth, expected):
    assert answers_match(prediction, truth) is expected


def test_normalize_answer_examples():
    assert normalize_answer(r" \left[ 3,\! 4 \right] ") == "[3,4]"
    assert normalize_answer("12,345,678.") == "12345678"
    assert normalize_answer(7) == "7"


def test_math_scores_and_format_score():
    assert compute_math_score(r"... \boxed{0.5}", r"\frac{1}{2}") == {"score": 1.0, "acc": 1.0, "pred": "0.5"}
    wrong = compute_math_score(r"\boxed{3}", "4", format_score=0.1)
    assert wrong == {"score": 0.1, "acc": 0.0, "pred": "3"}
    assert compute_math_score("the answer is 4", "4")["score"] == 0.0  # strict: needs a box
    assert compute_math_score("the answer is 4", "4", method="flexible")["score"] == 1.0
    # a ground truth that is a whole solution is reduced to its box
    assert compute_math_score(r"\boxed{10}", r"We add 3 and 7 to get \boxed{10}.")["acc"] == 1.0
    with pytest.raises(ValueError, match="unknown answer extraction method 'loose'"):
        compute_math_score("x", "1", method="loose")


def test_gsm8k_scores():
    assert compute_gsm8k_score("5 + 5 = 10\n#### 1,000", "It is 1000.\n#### 1000")["score"] == 1.0
    assert compute_gsm8k_score(r"\boxed{72}", "72")["score"] == 1.0
    assert compute_gsm8k_score("#### 71", 72, format_score=0.2)["score"] == 0.2
    assert compute_gsm8k_score("I think 72", "72")["score"] == 0.0
    assert compute_gsm8k_score("I think 72", "72", method="flexible")["score"] == 1.0


def test_empty_and_huge_outputs():
    assert compute_math_score("", "1") == {"score": 0.0, "acc": 0.0, "pred": ""}
    assert compute_gsm8k_score("", "1")["score"] == 0.0
    huge = "blah 123 " * 500_000 + r"\boxed{42}"  # ~4.5 MB
    assert compute_math_score(huge, "42")["score"] == 1.0
    assert compute_gsm8k_score(huge + " #### 42", "42")["score"] == 1.0
    assert compute_math_score(huge, "41", method="flexible")["score"] == 0.0
    unclosed = r"\boxed{" + "{" * 1_000_000
    assert compute_math_score(unclosed, "1")["score"] == 0.0
    digits = "9" * 1_000_000
    assert compute_math_score(digits, "9", method="flexible")["score"] == 0.0
