"""An SGLang teacher of on-policy distillation (`distillation.type=sglang`, megarl.trainer.teacher)
against real SGLang 0.5.23: a server started with --api-key scores only with the key that
`distillation.teacher.api_key_env` names; the scores are HF transformers' own log-probs of the tiny
Qwen2 at OPD's temperature (1) whatever the rollout's; a token equal to the last vocabulary id
(which SGLang reports as 0) is read; and a student distilled from itself at rollout temperature 0.7
gets no signal end to end. One server for the module, with a key (the tests that are not about the
key pass it as a run would)."""
import json
import sys

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from megarl.algos.opd import OPD_TEMPERATURE
from megarl.config import ConfigError, load_and_validate
from megarl.data.batch import Batch
from megarl.data.synthetic import write_task_dataset
from megarl.trainer.teacher import Teacher, served_vocab_size
from megarl.testing import run_to_completion
from real_sglang import REPO, start_sglang

VOCAB = 47  # the tiny Qwen2's character vocabulary: id 46 ('z') is vocab_size - 1
ROLLOUT_TEMPERATURE = 0.7
KEY = "teacher-key-0123"
KEY_ENV = "MEGARL_TEST_TEACHER_KEY"
WITH_KEY = f"distillation.teacher.api_key_env={KEY_ENV}"
# prompts and responses (token ids) with 46 in a prompt, inside a response and last in a response
PROMPTS = [[5, 6, 7], [9, 46]]
RESPONSES = [[8, 46, 10, 11], [12, 13, 46]]


@pytest.fixture(scope="module")
def server(qwen2_dir, tmp_path_factory):
    """The teacher: real SGLang serving the tiny Qwen2 in float32, started with --api-key KEY."""
    proc = start_sglang(qwen2_dir, tmp_path_factory.mktemp("sglang-teacher-logs"), name="sglang-teacher", api_key=KEY)
    yield proc
    proc.stop()


@pytest.fixture
def key_set(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture(scope="module")
def hf(qwen2_dir):
    return AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()


def teacher(model_dir: str, url: str, *overrides: str) -> Teacher:
    """The trainer's `Teacher` of a run whose rollout samples at ROLLOUT_TEMPERATURE, the student
    and the teacher both the tiny Qwen2 (the tokenizer check passes)."""
    config = load_and_validate(None, [
        "data.train_files=/d/train.parquet", f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.rollout.temperature={ROLLOUT_TEMPERATURE}", "distillation.enabled=true",
        "distillation.type=sglang", f"distillation.teacher.url={url}", f"distillation.teacher.model_path={model_dir}",
        *overrides])
    return Teacher(config)


def scores(t: Teacher) -> torch.Tensor:
    try:
        return t.log_probs(Batch.from_token_lists(PROMPTS, RESPONSES))
    finally:
        t.close()


def hf_response_log_probs(model, temperature: float) -> torch.Tensor:
    """[B, R] float32, the oracle: log softmax(logits / temperature) of each response token given
    what precedes it, from one HF forward per row; 0 after a row's response."""
    grid = torch.zeros(len(RESPONSES), max(map(len, RESPONSES)))
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
        grid[i, : len(response)] = logp.gather(-1, torch.tensor(response)[:, None])[:, 0]
    return grid


def test_a_keyed_teacher_scores_only_with_the_key_its_variable_holds(server, qwen2_dir, monkeypatch):
    with pytest.raises(ConfigError, match="HTTP 401.*set distillation.teacher.api_key_env"):
        scores(teacher(qwen2_dir, server.url))
    monkeypatch.setenv(KEY_ENV, "not-the-key")
    with pytest.raises(ConfigError, match=rf"refused the key in \${KEY_ENV} \(distillation.teacher.api_key_env") as info:
        scores(teacher(qwen2_dir, server.url, WITH_KEY))
    assert "not-the-key" not in str(info.value)
    monkeypatch.setenv(KEY_ENV, KEY)
    assert scores(teacher(qwen2_dir, server.url, WITH_KEY)).shape == (2, 4)


def test_scores_are_the_hf_models_at_opds_temperature_whatever_the_rollouts(server, qwen2_dir, hf, key_set):
    got = scores(teacher(qwen2_dir, server.url, WITH_KEY))
    assert OPD_TEMPERATURE == 1.0
    diff = (got - hf_response_log_probs(hf, OPD_TEMPERATURE)).abs().max().item()
    assert diff < 1e-4, f"max |teacher - HF at T=1| = {diff}"
    # the oracle tells the temperatures apart: at the rollout's, HF's numbers are far from these
    assert (got - hf_response_log_probs(hf, ROLLOUT_TEMPERATURE)).abs().max().item() > 0.1


def test_top_k_are_the_hf_models_top_k_of_log_softmax(server, qwen2_dir, hf, key_set):
    """forward_kl_topk from an SGLang teacher (`Teacher.top_k` through `RolloutClient.score_top_k`):
    at each response position HF's k most likely tokens under log_softmax(logits) (T = 1), in the
    shapes and dtypes of the Megatron teacher's `compute_teacher_top_k`, 0 after a row's response;
    the last vocabulary id (46) comes back as itself in the top ids."""
    k = 4
    t = teacher(qwen2_dir, server.url, WITH_KEY, "distillation.loss_mode=forward_kl_topk",
                "distillation.use_policy_gradient=false", f"distillation.topk={k}")
    try:
        got = t.top_k(Batch.from_token_lists(PROMPTS, RESPONSES), k)
    finally:
        t.close()
    assert sorted(got) == ["teacher_log_probs", "teacher_topk_ids", "teacher_topk_log_probs"]
    assert got["teacher_topk_log_probs"].dtype == torch.float32 and got["teacher_topk_ids"].dtype == torch.int64
    assert got["teacher_topk_ids"].shape == got["teacher_topk_log_probs"].shape == (2, 4, k)
    assert (got["teacher_log_probs"] - hf_response_log_probs(hf, 1.0)).abs().max().item() < 1e-4
    values, ids = torch.zeros(2, 4, k), torch.zeros(2, 4, k, dtype=torch.int64)
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + response])).logits[0].float()
        top = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).topk(k, dim=-1)
        values[i, : len(response)], ids[i, : len(response)] = top.values, top.indices
    diff = (got["teacher_topk_log_probs"] - values).abs().max().item()
    assert diff < 1e-4, f"max |teacher top-k - HF top-k| = {diff}"
    assert torch.equal(got["teacher_topk_ids"], ids)
    assert (ids == VOCAB - 1).any()  # an id SGLang would clip in input_token_logprobs is read as itself


def test_sglang_reports_the_last_vocabulary_id_as_0_in_inputs_only(server, qwen2_dir):
    """The wire behaviour `reported_input_id_matches` follows, with the vocab_size the teacher reads
    from the HF config: an input id of vocab_size - 1 comes back as 0 (vocab_size - 2 as itself), at
    any temperature (with the same log-probs); an output id of it as sampled."""
    assert served_vocab_size(qwen2_dir) == VOCAB
    auth = {"Authorization": f"Bearer {KEY}"}
    ids = [9, 45, 46, 12, 46]
    answers = [requests.post(server.url + "/generate", headers=auth, timeout=60, json={
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0, "temperature": temperature}}).json() for temperature in (0.5, 1.0)]
    entries = [a["meta_info"]["input_token_logprobs"] for a in answers]
    assert [e[1] for e in entries[0]] == [9, 45, 0, 12, 0]
    assert entries[0] == entries[1]  # the request's temperature changes nothing
    forced = requests.post(server.url + "/generate", headers=auth, timeout=60, json={
        "input_ids": [5, 6, 7], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 2, "temperature": 1.0, "logit_bias": {"46": 100.0}}}).json()
    assert forced["output_ids"] == [46, 46]
    assert [e[1] for e in forced["meta_info"]["output_token_logprobs"]] == [46, 46]


@pytest.mark.slow
def test_a_student_distilled_from_itself_gets_no_signal_at_a_rollout_temperature_not_1(server, qwen2_dir, tmp_path,
                                                                                         key_set):
    """Pure OPD (configs/tiny/opd.yaml) for one step, the student sampling at 0.7 on the CPU engine,
    the teacher the student's own checkpoint served by real SGLang: log p_student - log p_teacher is
    0 on every token up to float32 rounding, so its mean is too (the old mix of the student at 0.7
    and SGLang's scores at 1 gave a mean of 0.028 nats here)."""
    write_task_dataset("add", tmp_path / "data", train_size=64, val_size=8, sft_size=0, seed=0)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/opd.yaml"),
           f"actor_rollout_ref.model.path={qwen2_dir}", f"data.train_files={tmp_path / 'data/train.parquet'}",
           "data.val_files=[]", f"trainer.default_local_dir={out}", "trainer.total_training_steps=1",
           "trainer.logger=[console]", f"actor_rollout_ref.rollout.temperature={ROLLOUT_TEMPERATURE}",
           "distillation.type=sglang", f"distillation.teacher.url={server.url}",
           f"distillation.teacher.model_path={qwen2_dir}", WITH_KEY]
    run_to_completion(cmd, tmp_path, 600, "OPD from itself with a real SGLang teacher")
    rows = [json.loads(line) for line in (out / "megarl-tiny/opd/logs/metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if "timing/step_s" in r]
    assert abs(step["opd/reverse_kl_mean"]) < 1e-4, step["opd/reverse_kl_mean"]
    assert step["opd/teacher_log_prob_mean"] < -0.5  # a random model's tokens: a real score, not zeros
    assert step["opd/coverage"] == 1.0 and step["timing/opd_student_log_prob_s"] > 0
