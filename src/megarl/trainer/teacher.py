"""The on-policy-distillation teacher as the controller sees it (`distillation`, megarl.algos.opd):
one call, `Teacher.log_probs(batch)` (or `Teacher.top_k(batch, k)` for forward_kl_topk), whichever form it takes.

  type megatron  the `teacher` role's engine group (a `TeacherEngine` per rank, placed by the
                 planner on the training pool or its own, offloaded with the reference's rules)
  type sglang    a teacher SGLang server or router at `distillation.teacher.url`, asked for the input
                 log-probs of prompt + response (`RolloutClient.score`: `return_logprob`,
                 `logprob_start_len` = prompt length - 1, `max_new_tokens` 0), with the key in the
                 environment variable `distillation.teacher.api_key_env` where its server has one

Either way the result is `teacher_log_probs` [B, R] float32 aligned with `response_ids`: at response
position t, log p_teacher(response_ids[t] | prompt, response[:t]) under softmax(logits) (T =
`OPD_TEMPERATURE`, whatever the rollout's: SGLang's input log-probs are at T = 1 only), 0 at
padding. A multi-turn row is scored whole (its tool tokens are context); the reverse KL keeps only
its `response_mask` tokens. The teacher must share the student's tokenizer: `check_same_tokenizer`
refuses a run whose tokenizers differ, naming both paths.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megarl.algos.opd import OPD_TEMPERATURE
from megarl.config import ConfigError, ExperimentConfig
from megarl.data.batch import Batch
from megarl.rollout.client import RolloutClient, RolloutRequestError
from megarl.runtime.roles import TeacherRole


def student_tokenizer_path(config: ExperimentConfig) -> str:
    """The policy's tokenizer: data.tokenizer, or the actor's model directory."""
    return config.data.tokenizer or config.actor_rollout_ref.model.path


def check_same_tokenizer(student_path: str, teacher_path: str) -> None:
    """Raise ConfigError naming both paths unless the two tokenizers map the same strings to the same
    ids (vocabulary, added and special tokens): the teacher scores the student's token ids as they are."""
    from transformers import AutoTokenizer

    student, teacher = (AutoTokenizer.from_pretrained(p) for p in (student_path, teacher_path))
    differences = []
    if student.get_vocab() != teacher.get_vocab():
        only = set(student.get_vocab().items()) ^ set(teacher.get_vocab().items())
        differences.append(f"vocabularies differ ({len(student.get_vocab())} vs {len(teacher.get_vocab())} tokens, "
                           f"{len(only)} (token, id) pairs in one only)")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            differences.append(f"{name} {getattr(student, name)} vs {getattr(teacher, name)}")
    if differences:
        raise ConfigError(
            f"distillation.teacher.model_path={teacher_path!r}: its tokenizer is not the student's "
            f"({student_path!r}, data.tokenizer or actor_rollout_ref.model.path): {'; '.join(differences)}. "
            "On-policy distillation scores the student's token ids as they are: use a teacher of the same tokenizer")


def served_vocab_size(model_path: str) -> int:
    """The `vocab_size` of the teacher's HF config (a multimodal config's text model's: transformers'
    `get_text_config`), which SGLang's `ModelConfig.vocab_size` is (`srt/configs/model_config.py`:
    `hf_text_config.vocab_size`): the score client needs it to read the input token ids SGLang
    reports (`megarl.rollout.client.reported_input_id_matches`)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).get_text_config().vocab_size


def unauthorized_message(url: str, api_key_env: Optional[str]) -> str:
    """Why the teacher server at `url` answered HTTP 401, and which key to set (never the key)."""
    if api_key_env is None:
        return (f"the teacher server at {url} refused to score (HTTP 401 Unauthorized): it was started with "
                "--api-key; set distillation.teacher.api_key_env to the name of an environment variable holding "
                "that key")
    return (f"the teacher server at {url} refused the key in ${api_key_env} (distillation.teacher.api_key_env; "
            "HTTP 401 Unauthorized): it is not the key the server was started with (--api-key)")


def scoring_requests(batch: Batch) -> tuple[list[list[int]], list[int]]:
    """(sequences, starts) for `RolloutClient.score`: each row's real prompt tokens then its real
    response tokens (tool tokens of a multi-turn row included), and the index of its last prompt
    token, so the scores are those of the response tokens."""
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])]
    responses = [ids[mask.bool()].tolist() for ids, mask in zip(batch["response_ids"], batch.response_tokens())]
    return [p + r for p, r in zip(prompts, responses)], [len(p) - 1 for p in prompts]


def response_grid(scores: list[list], batch: Batch, k: Optional[int] = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, R] (or [B, R, k] when each score is a list of k) of `dtype`: row i's scores from column 0
    (its response tokens in order), 0 after them."""
    trailing = () if k is None else (k,)
    grid = torch.zeros((*batch["response_ids"].shape, *trailing), dtype=dtype)
    lengths = batch.response_tokens().sum(1).tolist()
    for i, (row, length) in enumerate(zip(scores, lengths)):
        if len(row) != length:
            raise ValueError(f"teacher scores of row {i}: {len(row)} values for {length} response tokens")
        if length:
            grid[i, :length] = torch.tensor(row, dtype=dtype)
    return grid


class Teacher:
    """`distillation.teacher` for the controller. `engines`: the `teacher` role's handle
    (type megatron; the cluster builds it with the other roles)."""

    def __init__(self, config: ExperimentConfig, engines: Optional[TeacherRole] = None):
        d = config.distillation
        check_same_tokenizer(student_tokenizer_path(config), d.teacher.model_path)
        self.type, self.engines, self.client, self.api_key_env = d.type, engines, None, d.teacher.api_key_env
        if d.type == "megatron" and engines is None:
            raise ValueError("distillation.type=megatron: the cluster has no teacher role")
        if d.type == "sglang":
            key = os.environ[self.api_key_env] if self.api_key_env else None  # never logged
            self.client = RolloutClient(d.teacher.url, api_key=key,
                                        max_concurrency=d.teacher.max_concurrent_requests,
                                        request_timeout_s=d.teacher.request_timeout_s,
                                        vocab_size=served_vocab_size(d.teacher.model_path))

    @classmethod
    def from_config(cls, config: ExperimentConfig, engines: Optional[TeacherRole] = None) -> Optional[Teacher]:
        """The teacher, or None when `distillation.enabled` is false."""
        return cls(config, engines) if config.distillation.enabled else None

    def log_probs(self, batch: Batch) -> torch.Tensor:
        """`teacher_log_probs` [B, R] float32 of the batch's responses at `OPD_TEMPERATURE` (module
        docstring). An SGLang teacher that refuses the key (HTTP 401) raises ConfigError naming
        `distillation.teacher.api_key_env`."""
        if self.type == "megatron":
            return self.engines.compute_teacher_log_prob(batch, OPD_TEMPERATURE)["teacher_log_probs"]
        return response_grid([scores for scores, _, _ in self._scored(batch, 0)], batch)

    def top_k(self, batch: Batch, k: int) -> dict[str, torch.Tensor]:
        """`teacher_log_probs` [B, R] as `log_probs`, plus `teacher_topk_log_probs` [B, R, k] float32
        and `teacher_topk_ids` [B, R, k] int64: the teacher's k most likely tokens at each response
        position at `OPD_TEMPERATURE` (distillation.loss_mode=forward_kl_topk), 0 at padding: from
        the Megatron teacher's head, or from the SGLang teacher's input top log-probs
        (`RolloutClient.score_top_k`, at T = 1 as `log_probs`)."""
        if self.type == "megatron":
            return self.engines.compute_teacher_top_k(batch, OPD_TEMPERATURE, k)
        scored = self._scored(batch, k)
        return {"teacher_log_probs": response_grid([s for s, _, _ in scored], batch),
                "teacher_topk_log_probs": response_grid([v for _, v, _ in scored], batch, k),
                "teacher_topk_ids": response_grid([i for _, _, i in scored], batch, k, dtype=torch.int64)}

    def _scored(self, batch: Batch, k: int) -> list[tuple[list[float], list[list[float]], list[list[int]]]]:
        """The SGLang teacher's answer for the batch's responses: `RolloutClient.score_top_k` (k > 0)
        or `score` (k = 0, the top lists empty). A refused key (HTTP 401) raises ConfigError naming
        `distillation.teacher.api_key_env`."""
        sequences, starts = scoring_requests(batch)
        try:
            if k:
                return self.client.score_top_k(sequences, starts, k)
            return [(scores, [], []) for scores in self.client.score(sequences, starts)]
        except RolloutRequestError as e:
            if e.status == 401:
                raise ConfigError(unauthorized_message(self.client.url, self.api_key_env)) from e
            raise

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
