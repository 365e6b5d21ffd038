"""Agent rollouts: run the user's `run_episode` for every prompt `n` times, concurrently, each
episode with its own OpenAI client tagged with its trajectory id, and build the step's Batch.

    runner = AgentRunner.from_config(config, rollout_client, tokenizer, score_fn)   # starts the endpoint
    batch, metrics = runner.generate_and_score(prompts, timer, uid_prefix)
    batch, metrics = runner.generate_and_score(prompts, uid_prefix="val", sampling=val_sampling)  # validation
    runner.close()                                                                # stops it

Limits (actor_rollout_ref.rollout.agent.*): `max_concurrent_episodes` episodes run at once;
`max_turns` and `max_tokens_per_episode` are enforced by the endpoint (a call beyond them gets
HTTP 400, code `episode_limit`); `episode_timeout_s` cancels an episode. An exception or a
timeout fails that episode (counted in `agent/failed_episodes` and `agent/failed/<reason>`) and
never the step; batch.py says how failed and truncated episodes enter the batch. User code must
be async: a blocking call inside `run_episode` stalls every episode of the step.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import openai

from megarl.agents.batch import EpisodeOutcome, episode_batch, episode_metrics, episode_score
from megarl.agents.endpoint import GenerateFn, OpenAIEndpoint
from megarl.agents.judge import JudgeScorer
from megarl.agents.loader import EpisodeFn, load_episode_fn
from megarl.agents.openai_api import TRAJECTORY_HEADER, SamplingDefaults
from megarl.agents.records import TrajectoryRecorder
from megarl.agents.trajectory import PrefixMismatchError, assemble_trajectory
from megarl.data.prompts import Prompt
from megarl.rollout.client import RolloutClient
from megarl.rollout.protocol import SamplingParams

log = logging.getLogger("megarl.agents")
MODEL_NAME = "policy"


@dataclass(frozen=True)
class EpisodeSample:
    """What `run_episode(client, sample)` receives: the prompt's row, and the model name to call."""

    messages: list[dict]  # the prompt as chat messages (the parquet `prompt` column)
    data_source: str
    ground_truth: Any
    extra_info: Optional[dict]
    prompt_index: int
    episode_index: int  # 0..n-1 within the prompt's group
    model: str = MODEL_NAME


def rollout_generate(client: RolloutClient) -> GenerateFn:
    """The endpoint's token-in/token-out call: one prompt, one sample, with log-probs."""

    async def generate(prompt_ids: list[int], sampling: SamplingParams):
        return (await client.agenerate([prompt_ids], sampling)).samples[0][0]

    return generate


def fixed_sampling(sampling: SamplingParams) -> SamplingDefaults:
    """The endpoint's sampling for episodes sampled with `sampling` (its n and seed aside)."""
    return SamplingDefaults(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                            top_p=sampling.top_p, top_k=sampling.top_k, fixed=True)


def judge_from_config(judge) -> Optional[JudgeScorer]:
    """The scorer of `actor_rollout_ref.rollout.agent.judge`, or None when no URL is set."""
    if not judge.url:
        return None
    api_key = os.environ[judge.api_key_env] if judge.api_key_env else "megarl"
    return JudgeScorer(judge.url, judge.model, api_key=api_key, max_tokens=judge.max_tokens)


class AgentRunner:
    def __init__(self, episode_fn: EpisodeFn, generate: GenerateFn, tokenizer, defaults: SamplingDefaults,
                 score_fn: Callable[..., Any], *, n: int = 1, max_turns: Optional[int] = None,
                 max_tokens_per_episode: Optional[int] = None, episode_timeout_s: float = 300.0,
                 max_concurrent_episodes: int = 64, host: str = "127.0.0.1", port: int = 0,
                 judge: Optional[JudgeScorer] = None, chat_template_kwargs: Optional[Mapping[str, Any]] = None):
        """`judge`: scores, per group, the episodes that returned no score (else `score_fn` does);
        `chat_template_kwargs`: the endpoint's chat-template variables (data.apply_chat_template_kwargs)."""
        self.judge, self.defaults = judge, defaults
        self.episode_fn, self.tokenizer, self.score_fn, self.n = episode_fn, tokenizer, score_fn, n
        self.episode_timeout_s = episode_timeout_s
        self.max_concurrent_episodes = max_concurrent_episodes
        self.recorder = TrajectoryRecorder(max_turns, max_tokens_per_episode)
        self.endpoint = OpenAIEndpoint(generate, tokenizer, defaults, self.recorder, model_name=MODEL_NAME,
                                       host=host, port=port, chat_template_kwargs=chat_template_kwargs)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @classmethod
    def from_config(cls, config, rollout_client: RolloutClient, tokenizer, score_fn) -> "AgentRunner":
        """The runner of `actor_rollout_ref.rollout.agent`, its endpoint started. Every call samples
        with the rollout's temperature/top_p/top_k; `rollout.response_length` caps each call."""
        r = config.actor_rollout_ref.rollout
        a = r.agent
        defaults = SamplingDefaults(max_new_tokens=r.response_length or config.data.max_response_length,
                                    temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, fixed=True)
        runner = cls(load_episode_fn(a.path, a.name), rollout_generate(rollout_client), tokenizer, defaults, score_fn,
                     n=r.n, max_turns=a.max_turns, max_tokens_per_episode=a.max_tokens_per_episode,
                     episode_timeout_s=a.episode_timeout_s, max_concurrent_episodes=a.max_concurrent_episodes,
                     host=a.host, port=a.port, judge=judge_from_config(a.judge),
                     chat_template_kwargs=config.data.apply_chat_template_kwargs)
        runner.start()
        return runner

    def start(self) -> None:
        self.endpoint.start()
        log.info("agent endpoint at %s", self.endpoint.base_url)

    def close(self) -> None:
        self.endpoint.stop()

    # ------------------------------------------------------------------ the step
    def generate_and_score(self, prompts: Sequence[Prompt], timer=None, uid_prefix: str = "agent",
                           sampling: Optional[SamplingParams] = None):
        """`n` episodes per prompt, scored: (batch, metrics), as RLTrainer.generate_and_score.
        `sampling` (validation: `rollout.val_kwargs`) replaces the training sampling: `sampling.n`
        episodes per prompt, every call sampled with its temperature/top_p/top_k and capped at its
        `max_new_tokens` (the episodes' own sampling arguments are ignored, as in training)."""
        timer = timer or (lambda phase: nullcontext())
        n, defaults = (self.n, self.defaults) if sampling is None else (sampling.n, fixed_sampling(sampling))
        with timer("generate"):
            samples = [[EpisodeSample(p.row.messages, p.row.data_source, p.row.ground_truth, p.row.extra_info,
                                      p.index, j) for j in range(n)] for p in prompts]
            flat = asyncio.run(self.run_episodes([s for group in samples for s in group], defaults))
            outcomes = [flat[i * n:(i + 1) * n] for i in range(len(prompts))]
        metrics = episode_metrics(flat)
        with timer("reward"):
            if self.judge is not None:
                outcomes, failed_groups = asyncio.run(self.judge_groups(prompts, outcomes))
                metrics["agent/judge_failed_groups"] = float(failed_groups)
            batch, reward_metrics = episode_batch(prompts, outcomes, uid_prefix, self.pad_id, self.score_fn)
        metrics.update(reward_metrics)
        return batch, metrics

    async def judge_groups(self, prompts: Sequence[Prompt], outcomes: Sequence[Sequence[EpisodeOutcome]]):
        """Outcomes with the judge's score as the result of every kept episode that returned none,
        and the number of groups the judge could not score (left to `score_fn`)."""
        failed_groups = 0

        async def judge_one(prompt: Prompt, episodes: Sequence[EpisodeOutcome]) -> list[EpisodeOutcome]:
            nonlocal failed_groups
            picked = [k for k, o in enumerate(episodes) if o.status == "ok" and o.result is None]
            if not picked:
                return list(episodes)
            task = "\n".join(m["content"] for m in prompt.row.messages)
            texts = [self.tokenizer.decode(episodes[k].trajectory.response_ids, skip_special_tokens=True) for k in picked]
            scores = await self.judge.score_group(task, texts)
            if scores is None:
                failed_groups += 1
                return list(episodes)
            judged = list(episodes)
            for k, score in zip(picked, scores):
                judged[k] = replace(episodes[k], result={"score": score, "judge_score": score})
            return judged

        judged = await asyncio.gather(*(judge_one(p, o) for p, o in zip(prompts, outcomes)))
        return list(judged), failed_groups

    async def run_episodes(self, samples: Sequence[EpisodeSample], defaults: SamplingDefaults) -> list[EpisodeOutcome]:
        """One outcome per sample, in order, its calls sampled with `defaults`; at most
        `max_concurrent_episodes` at a time."""
        semaphore = asyncio.Semaphore(self.max_concurrent_episodes)

        async def bounded(sample: EpisodeSample) -> EpisodeOutcome:
            async with semaphore:
                return await self.run_episode(sample, defaults)

        return list(await asyncio.gather(*(bounded(s) for s in samples)))

    async def run_episode(self, sample: EpisodeSample, defaults: SamplingDefaults) -> EpisodeOutcome:
        trajectory_id = uuid.uuid4().hex
        self.recorder.open(trajectory_id, defaults)
        client = openai.AsyncOpenAI(base_url=self.endpoint.base_url, api_key="megarl", max_retries=0,
                                    timeout=self.episode_timeout_s, default_headers={TRAJECTORY_HEADER: trajectory_id})
        started = time.monotonic()
        result, failure = None, None
        try:
            result = await asyncio.wait_for(self.episode_fn(client, sample), self.episode_timeout_s)
        except asyncio.TimeoutError:
            failure = "timeout"
        except Exception as error:
            failure = "exception"
            _log_failure(sample, failure, error)
        else:
            try:
                episode_score(result)
            except ValueError as error:
                failure = "bad_return"
                _log_failure(sample, failure, error)
        finally:
            record = self.recorder.close(trajectory_id)
            await client.close()
        seconds = time.monotonic() - started
        final_text = (self.tokenizer.decode(record.calls[-1].output_ids, skip_special_tokens=True)
                      if record.calls else "")

        def outcome(status, reason, trajectory=None):
            return EpisodeOutcome(status, reason, trajectory, result, final_text, seconds, record.limit_hit)

        if failure == "exception" and record.limit_hit is not None:
            status, reason = "truncated", record.limit_hit  # the user's code gave up at a limit: train on it
        elif failure is not None:
            return outcome("failed", failure)
        else:
            status, reason = "ok", None
        if not record.calls:
            return outcome("failed", "no_calls")
        try:
            trajectory = assemble_trajectory(record.calls)
        except PrefixMismatchError as error:
            log.warning("episode %d/%d: %s", sample.prompt_index, sample.episode_index, error)
            return outcome("failed", "prefix_mismatch")
        return outcome(status, reason, trajectory)


def _log_failure(sample: EpisodeSample, reason: str, error: BaseException) -> None:
    log.warning("episode %d/%d failed (%s): %s: %s", sample.prompt_index, sample.episode_index, reason,
                type(error).__name__, error)
