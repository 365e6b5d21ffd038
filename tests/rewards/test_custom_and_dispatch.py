"""Loading a user's reward function, and the default dispatch by data_source."""

import pytest

from megarl.config import ConfigError
from megarl.rewards.code_reward import compute_code_score
from megarl.rewards.custom import load_custom_reward_fn, select_score_fn
from megarl.rewards.dispatch import UnknownDataSourceError, default_compute_score, scorer_for
from megarl.rewards.math_reward import compute_gsm8k_score, compute_math_score

USER_FILE = '''
from dataclasses import dataclass

@dataclass
class Verdict:
    ok: bool

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    verdict = Verdict(solution_str.strip() == ground_truth)
    return {"score": float(verdict.ok) + bonus, "source": data_source}

def helper():
    pass

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return str(path)


def test_load_and_call(user_file):
    fn = load_custom_reward_fn(user_file, "compute_score", {"bonus": 0.5})
    assert fn(data_source="d", solution_str=" 7 ", ground_truth="7", extra_info={}) == {"score": 1.5, "source": "d"}
    assert select_score_fn(user_file)(data_source="d", solution_str="1", ground_truth="2", extra_info=None)["score"] == 0
    assert select_score_fn(None) is default_compute_score


def test_start_up_errors_name_the_problem(user_file, tmp_path):
    with pytest.raises(ConfigError, match="custom_reward_function.path='/no/such.py': no such file"):
        load_custom_reward_fn("/no/such.py")
    with pytest.raises(ConfigError, match=r"has no function custom_reward_function.name='score'; it defines "
                                          r"\['compute_score', 'helper'\]"):
        load_custom_reward_fn(user_file, "score")
    with pytest.raises(ConfigError, match="'NOT_A_FUNCTION' is a int, not a function"):
        load_custom_reward_fn(user_file, "NOT_A_FUNCTION")
    with pytest.raises(ConfigError, match=r"helper\(\) cannot be called as helper\(data_source, solution_str"):
        load_custom_reward_fn(user_file, "helper")
    with pytest.raises(ConfigError, match="cannot be called as .*, temperature"):
        load_custom_reward_fn(user_file, "compute_score", {"temperature": 1})
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(ConfigError, match="importing it failed: SyntaxError"):
        load_custom_reward_fn(str(broken))


def test_default_dispatch():
    assert scorer_for("openai/gsm8k") is compute_gsm8k_score
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "aime2024"):
        assert scorer_for(source) is compute_math_score
    for source in ("codecontests", "apps", "codeforces", "taco"):
        assert scorer_for(source) is compute_code_score
    assert default_compute_score("HuggingFaceH4/MATH-500", r"\boxed{\frac{1}{2}}", "0.5")["score"] == 1.0
    with pytest.raises(UnknownDataSourceError, match=r"data_source='my/data'; known: .*'openai/gsm8k'"):
        scorer_for("my/data")


def test_synthetic_scorers_are_dispatched():
    from megarl.rewards.synthetic import SYNTHETIC_SCORERS

    assert set(SYNTHETIC_SCORERS) == {"megarl/add", "megarl/rev", "megarl/sort"}
    for source, fn in SYNTHETIC_SCORERS.items():
        assert scorer_for(source) is fn
