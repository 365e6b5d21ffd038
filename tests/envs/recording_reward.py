"""megarl's default reward (the one a run without custom_reward_function uses), each call written to the
jsonl file `record` (one line: data_source, solution_str, extra_info, score), so a test can score the same
completions with the environment library itself."""
import json

from megarl.rewards.dispatch import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, record=None):
    score = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    with open(record, "a") as f:
        f.write(json.dumps({"data_source": data_source, "solution_str": solution_str, "extra_info": extra_info,
                            "score": score}) + "\n")
    return score
