"""The RL controller: PPO and the GRPO family, one loop that reads top to bottom.

    for each step:
        prompts -> generate n responses each -> score -> (ref log-probs, old log-probs, values)
        -> rewards and advantages -> update actor (and critic; the actor's update makes the old
        log-probs itself where nothing needs them before it) -> sync weights to the rollout
        servers -> log -> validate every test_freq -> checkpoint every save_freq

The controller owns no accelerator: it drives the runtime (megarl.runtime.cluster: worker groups
of Megatron engines and the rollout fleet, placed by the planner) through the phases of a step,
named as the colocation order names them: `training_phase`, `push_phase`, `push_weights`,
`rollout_phase`. Colocated and split placements run the same loop; colocated, each phase carries
out its memory moves (the servers release their memory and the offloaded roles come back for
training; around the push, the training states leave and the servers' weights, then their KV
cache, come back: megarl.placement.colocated_memory). Restarts of dead servers and retries stay
inside the runtime.

The step takes its batch from the producer of `async_training.mode` and pushes the weights inside
the producer's `push` (megarl.trainer.producers): in sync the step generates its batch itself; in
one_step_off and fully_async a producer thread generates the coming steps' batches while this one
trains, and the push waits for the generation running (with `async_training.partial_rollout`,
interrupts it: pause, push, continue with the new weights).
"""
from __future__ import annotations

import hashlib
import logging
import time
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import torch

from megarl.algos import DynamicSampler, make_kl_controller
from megarl.algos.opd import OPD_TEMPERATURE, TOPK_LOSS_MODE, student_needs_own_pass
from megarl.config import ExperimentConfig
from megarl.data.batch import Batch
from megarl.data.partition import balance_batch_order, balance_metrics
from megarl.data.prompts import PromptDataset
from megarl.data.sampler import EpochSampler
from megarl.rollout.protocol import SamplingParams
from megarl.trainer import experience
from megarl.trainer.async_rollout import Rollout, RolloutInterrupted
from megarl.runtime.cluster import Cluster
from megarl.trainer.preemption import Preempted, StopRequest
from megarl.trainer.producers import make_producer
from megarl.runtime.rollout_fleet import GenerationInterrupted
from megarl.trainer.teacher import Teacher
from megarl.trainer.timing import Timer

log = logging.getLogger("megarl.trainer")


def sampling_params(config: ExperimentConfig, validation: bool = False) -> SamplingParams:
    r = config.actor_rollout_ref.rollout
    v = r.val_kwargs
    greedy = validation and (not v.do_sample or v.temperature == 0)
    return SamplingParams(
        max_new_tokens=r.response_length,
        temperature=0.0 if greedy else (v.temperature if validation else r.temperature),
        top_p=v.top_p if validation else r.top_p,
        top_k=v.top_k if validation else r.top_k,
        n=v.n if validation else r.n,
        ignore_eos=r.ignore_eos,  # verl's rollout.ignore_eos holds for validation too (schema.RolloutConfig)
    )


class NonFiniteTrainingError(RuntimeError):
    """Too many steps in a row had non-finite losses or gradients."""


def skipped_steps_in_a_row(previous: int, metrics: dict, limit: int, step: int) -> int:
    """Steps in a row, up to this one, whose actor or critic skipped an update (non-finite loss or
    gradients); logged as `faults/skipped_steps_in_a_row`. Reaching `limit` stops the run."""
    skipped = metrics.get("actor/skipped_updates", 0.0) + metrics.get("critic/skipped_updates", 0.0)
    in_a_row = previous + 1 if skipped else 0
    metrics["faults/skipped_steps_in_a_row"] = float(in_a_row)
    if in_a_row >= limit:
        raise NonFiniteTrainingError(
            f"step {step}: updates skipped for non-finite loss or gradients in {in_a_row} steps in a row "
            f"(trainer.max_consecutive_skipped_steps={limit}); check the learning rate, the rewards and the "
            "data; the last checkpoint is intact"
        )
    return in_a_row


def sampling_seed(seed: int, uid_prefix: str, prompt_index: int) -> int:
    """The sampling seed of one prompt's responses, a function of (trainer.seed, step and round,
    prompt): a resumed run samples exactly what the uninterrupted run sampled."""
    digest = hashlib.blake2b(f"{seed}/{uid_prefix}/{prompt_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 1  # 31 bits: an int any server accepts


def sampling_seeds(seed: int, uid_prefix: str, prompts) -> list[int]:
    """`sampling_seed` of each of `prompts` (with `.index`), in order."""
    return [sampling_seed(seed, uid_prefix, p.index) for p in prompts]


def balanced_over_ranks(batch: Batch, dp_size: int, metrics: dict) -> Batch:
    """`trainer.balance_batch`, verl's: `batch` reordered so that each of the actor's `dp_size`
    data-parallel ranks, which take equal consecutive pieces, gets a near-equal token workload
    (`megarl.data.partition.balance_batch_order`); verl's `global_seqlen/*` metrics added to
    `metrics`. Advantages group by uid, so only which rows share a rank and a mini-batch changes.
    A batch that does not split evenly over the ranks is left as it is (the update refuses it)."""
    if len(batch) % dp_size:
        return batch
    lengths = batch.token_lengths().tolist()
    order = balance_batch_order(lengths, dp_size)
    metrics.update(balance_metrics(lengths, order))
    return batch.select([i for part in order for i in part])


class RLTrainer:
    def __init__(self, config: ExperimentConfig, cluster: Cluster, tokenizer, score_fn):
        self.config, self.cluster, self.tokenizer, self.score_fn = config, cluster, tokenizer, score_fn
        self.train_data = PromptDataset.from_config(config.data, tokenizer, "train")
        self.val_data = PromptDataset.from_config(config.data, tokenizer, "val") if config.data.val_files else None
        self.sampler = EpochSampler.from_config(config.data, len(self.train_data))
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.step = 0
        self.skipped_in_a_row = 0
        t = config.trainer
        self.total_steps = t.total_training_steps or t.total_epochs * self.sampler.batches_per_epoch
        self.teacher = Teacher.from_config(config, cluster.teacher)  # on-policy distillation (None: off)
        self.agent = None  # agentic rollouts (megarl.agents): the user's episodes behind an OpenAI endpoint
        if config.actor_rollout_ref.rollout.agent.path:
            from megarl.agents.runner import AgentRunner

            self.agent = AgentRunner.from_config(config, cluster.rollout.client, tokenizer, score_fn)
        self.producer = make_producer(config.async_training, cluster, self.total_steps,
                                      collect=self.collect_experience, generate=self.generate_rollout,
                                      score=self.score_rollout)

    # ------------------------------------------------------------------ experience
    def generate_and_score(self, prompts, timer: Timer, uid_prefix: str) -> tuple:
        """`rollout.n` responses per prompt, scored: (batch, metrics). Responses to one prompt share
        the uid `<uid_prefix>-<prompt index>`. ReMax also generates its greedy baseline
        (`reward_baselines`)."""
        if self.agent is not None:
            return self.agent.generate_and_score(prompts, timer, uid_prefix)
        c, cl = self.config, self.cluster
        rollout = c.actor_rollout_ref.rollout
        metrics: dict[str, float] = {}
        with timer("generate"):
            seeds = sampling_seeds(c.trainer.seed, uid_prefix, prompts)
            result = cl.generate([p.input_ids for p in prompts], sampling_params(c), seeds=seeds)
            batch = experience.experience_batch(prompts, result.samples, uid_prefix=uid_prefix)
            metrics.update(result.metrics.as_dict())
            if c.algorithm.adv_estimator == "remax":  # ReMax's baseline: the reward of a greedy response
                greedy = cl.generate([p.input_ids for p in prompts],
                                             SamplingParams(max_new_tokens=rollout.response_length, temperature=0.0))
                baseline = experience.experience_batch(prompts, greedy.samples, uid_prefix=uid_prefix)
        with timer("reward"):
            metrics.update(self.score(batch))
            if c.algorithm.adv_estimator == "remax":
                self.score(baseline)
                batch["reward_baselines"] = baseline["scores"].repeat_interleave(rollout.n)
                metrics["reward/remax_baseline_mean"] = baseline["scores"].mean().item()
        return batch, metrics

    def generate_rollout(self, index: int, version: int, prompt_indices: list[int] | None = None,
                         partial=None) -> Rollout:
        """Async modes, in the producer thread: rollout `index` (step `index`'s batch: the sampler's
        next prompts, or `prompt_indices`, with the uids and seeds the synchronous step would use)
        from the servers at weight `version`. Dead servers are not restarted here (the controller
        may be training): `RolloutInterrupted`, finished later by passing its `partial` back."""
        c = self.config
        prompts = self.train_data.take(self.sampler.next_batch() if prompt_indices is None else prompt_indices)
        uid_prefix = f"s{index}"
        seeds = sampling_seeds(c.trainer.seed, uid_prefix, prompts)
        start = time.perf_counter()
        try:
            result = self.cluster.rollout.generate([p.input_ids for p in prompts], sampling_params(c), seeds=seeds,
                                                   partial=partial)
        except GenerationInterrupted as cut:
            raise RolloutInterrupted([p.index for p in prompts], cut) from cut
        return Rollout(index, uid_prefix, [p.index for p in prompts], result.samples, version,
                       result.metrics.as_dict(), time.perf_counter() - start)

    def score_rollout(self, rollout: Rollout, timer: Timer) -> tuple:
        """Async modes: a rollout the producer generated, as a scored batch: (batch, metrics)."""
        batch = experience.experience_batch(self.train_data.take(rollout.prompt_indices), rollout.samples,
                                            uid_prefix=rollout.uid_prefix)
        samples = [s for per_prompt in rollout.samples for s in per_prompt]  # in batch order
        batch["weight_versions"] = [s.weight_versions or [s.weight_version] * len(s.token_ids) for s in samples]
        metrics = {"async/partial_rollouts": float(sum(s.weight_versions is not None for s in samples))}
        metrics.update(rollout.metrics)
        with timer("reward"):
            metrics.update(self.score(batch))
        return batch, metrics

    def score(self, batch: Batch) -> dict:
        """Sets `scores` and `token_level_scores`: the rule/custom reward, or the reward model's
        score (plus the rule reward with `reward_model.add_rule_reward`). Returns reward metrics."""
        metrics = experience.score(batch, self.score_fn, self.tokenizer, self.config)
        if self.cluster.reward_model is not None:
            rm_scores = self.cluster.reward_model.compute_rm_scores(batch)["rm_scores"]
            metrics.update(experience.combine_rm_scores(batch, rm_scores, self.config))
        return metrics

    def collect_experience(self, timer: Timer) -> tuple:
        """One step's scored responses: (batch, metrics). With DAPO's dynamic sampling
        (`algorithm.filter_groups`), groups whose responses all score the same are dropped and
        further batches of `data.gen_batch_size` prompts are generated until `data.train_batch_size`
        groups are kept (groups past that are dropped, as in verl).
        `filter_groups.metric` names a value the reward function returns in its dict (e.g. "acc");
        when it returns none of that name, the score is the metric."""
        f = self.config.algorithm.filter_groups
        if not f.enable:
            return self.generate_and_score(self.train_data.take(self.sampler.next_batch()), timer, f"s{self.step}")
        target = self.config.data.train_batch_size
        sampler = DynamicSampler(target, f.max_num_gen_batches)
        kept, rounds = [], []
        while not sampler.is_full:
            prompts = self.train_data.take(self.sampler.next_batch())
            batch, metrics = self.generate_and_score(prompts, timer, f"s{self.step}r{sampler.rounds}")
            rounds.append(metrics)
            values = batch[f.metric] if f.metric in batch.meta else batch["scores"].tolist()
            keep = sampler.add(batch["uid"], values)
            if keep:
                kept.append(batch.select(keep))
        batch = Batch.concat(kept)
        metrics = experience.merge_round_metrics(rounds)
        metrics.update({"dynamic_sampling/rounds": float(sampler.rounds),
                        "dynamic_sampling/kept_groups": float(sampler.kept_groups),
                        "dynamic_sampling/seen_groups": float(sampler.seen_groups),
                        "dynamic_sampling/kept_ratio": sampler.kept_groups / sampler.seen_groups})
        return batch, metrics

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        c, cl, timer = self.config, self.cluster, Timer()
        rollout = c.actor_rollout_ref.rollout
        step_start = time.perf_counter()

        batch, metrics = self.producer.take(timer)
        if c.trainer.balance_batch:
            batch = balanced_over_ranks(batch, cl.actor.dp_size, metrics)
        cl.training_phase()  # colocated: the servers release their memory, offloaded roles come back

        update_actor = self.step >= c.trainer.critic_warmup
        # the actor's update makes the old log-probs itself where nothing needs them before it
        old_in_update = update_actor and experience.old_log_probs_in_update(c)
        if c.algorithm.rollout_correction.bypass_mode:  # verl's apply_bypass_mode: no trainer pass
            batch["old_log_probs"] = batch["rollout_log_probs"]
        elif not old_in_update:
            with timer("old_log_prob"):
                out = cl.actor.compute_log_prob(batch, rollout.temperature, with_entropy=True)
                metrics.update(experience.take_old_log_probs(batch, out, c))
        if cl.ref is not None:
            with timer("ref_log_prob"):
                batch["ref_log_probs"] = cl.ref.compute_ref_log_prob(batch, rollout.temperature)["ref_log_probs"]
        if self.teacher is not None:  # both sides of OPD's reverse KL at OPD_TEMPERATURE (megarl.algos.opd)
            with timer("teacher_log_prob"):
                if c.distillation.loss_mode == TOPK_LOSS_MODE:
                    for key, value in self.teacher.top_k(batch, c.distillation.topk).items():
                        batch[key] = value
                else:
                    batch["teacher_log_probs"] = self.teacher.log_probs(batch)
            if student_needs_own_pass(rollout.temperature):
                with timer("opd_student_log_prob"):
                    batch["opd_student_log_probs"] = cl.actor.compute_log_prob(batch, OPD_TEMPERATURE)["log_probs"]
            else:  # the old-log-prob pass above (distillation keeps it before the update) ran at OPD_TEMPERATURE
                batch["opd_student_log_probs"] = out["log_probs"]
            if c.distillation.loss_mode == TOPK_LOSS_MODE and c.distillation.use_policy_gradient:
                with timer("opd_student_log_prob"):  # the student at the teacher's top-k, for the advantage
                    batch["opd_student_topk_log_probs"] = cl.actor.compute_log_prob_at(
                        batch, OPD_TEMPERATURE, "teacher_topk_ids")["log_probs"]
        if cl.critic is not None:
            with timer("values"):
                batch["values"] = cl.critic.compute_values(batch)["values"]

        with timer("advantages"):
            metrics.update(experience.rewards_and_advantages(batch, c, self.kl_ctrl))

        if cl.critic is not None:
            with timer("update_critic"):
                metrics.update(cl.critic.update_critic(batch))
        if update_actor:
            with timer("update_actor"):
                if old_in_update:
                    update, out = cl.actor.update_policy_with_old_log_probs(batch)
                    metrics.update(experience.take_old_log_probs(batch, out, c))
                else:
                    update = cl.actor.update_policy(batch)
                metrics.update(update)

        self.skipped_in_a_row = skipped_steps_in_a_row(self.skipped_in_a_row, metrics,
                                                       c.trainer.max_consecutive_skipped_steps, self.step + 1)
        # async modes: the generation ahead pauses for the push, or the push interrupts it (producers)
        with self.producer.push(timer, version=self.step + 1), timer("sync_weights"):
            cl.push_phase()  # colocated: training states off but the actor's parameters, the servers' weights back
            metrics.update(cl.push_weights())
            cl.rollout_phase()  # colocated: the actor's parameters off, the servers' KV cache back
        metrics.update(cl.step_metrics())  # offloads and rollout faults since the last step

        metrics.update(experience.data_metrics(batch))
        metrics.update(timer.metrics())
        step_s = time.perf_counter() - step_start
        tokens = int(batch.token_lengths().sum())
        metrics.update({
            "timing/step_s": step_s,
            "throughput/tokens_per_s": tokens / step_s,
            "throughput/tokens_per_s_per_gpu": tokens / step_s / cl.num_gpus,
            "throughput/rollout_share": timer.seconds["generate"] / step_s,
        })
        return metrics

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict:
        """Score `val_kwargs.n` responses per validation prompt with `rollout.val_kwargs` (one, greedy,
        by default): `val/score` (their mean) and, with n > 1, `val/best@<n>/score` (each prompt's
        best, averaged: pass@n for a 0/1 reward); and one sampled at the training temperature:
        `val/sampled_score`. With an agent, episodes instead, scored as in training; the
        `val_kwargs` episodes' metrics are logged as `val/agent/...`."""
        if self.val_data is None:
            return {}
        prompts = self.val_data.take(range(len(self.val_data)))
        ids = [p.input_ids for p in prompts]
        metrics = {}
        sampled = replace(sampling_params(self.config), n=1)
        for prefix, sampling in (("val", sampling_params(self.config, True)), ("val_sampled", sampled)):
            if self.agent is not None:
                batch, agent_metrics = self.agent.generate_and_score(prompts, uid_prefix="val", sampling=sampling)
                if prefix == "val":
                    metrics.update({f"val/{k}": v for k, v in agent_metrics.items() if k.startswith("agent/")})
            else:
                result = self.cluster.generate(ids, sampling)
                batch = experience.experience_batch(prompts, result.samples, uid_prefix="val")
                self.score(batch)
            metrics.update(experience.mean_scores(batch["scores"], batch["data_source"], prefix))
            if prefix == "val" and sampling.n > 1:
                metrics.update(experience.mean_scores(*experience.best_of_n(batch), f"val/best@{sampling.n}"))
        metrics["val/sampled_score"] = metrics.pop("val_sampled/score")
        return metrics

    # ------------------------------------------------------------------ the loop
    def fit(self, tracker) -> dict:
        """Train to `total_steps`. On SIGTERM/SIGUSR1 the current step finishes, a checkpoint is
        written and `Preempted` is raised (see megarl.trainer.preemption). A checkpoint written in the
        background (async_save) is committed at a later step boundary, and before the loop ends or
        `Preempted` is raised at the latest."""
        t = self.config.trainer
        if t.val_before_train and self.val_data is not None and self.step == 0:
            tracker.log(self.validate(), step=self.step)
        metrics = {}
        with StopRequest() as stop, closing(self.producer):  # the producer stops with the loop however it ends
            while self.step < self.total_steps:
                stop.step = self.step
                with self.cluster.profile_step(self.step + 1):  # verl's global_profiler (steps from 1)
                    metrics = self.train_step()
                self.step += 1
                if t.test_freq > 0 and (self.step % t.test_freq == 0 or self.step == self.total_steps):
                    metrics.update(self.validate())
                tracker.log(metrics, step=self.step)
                self.cluster.checkpoints.poll()
                saved = t.save_freq > 0 and (self.step % t.save_freq == 0 or self.step == self.total_steps)
                if saved:
                    self.save_checkpoint()
                if stop.signum is not None:
                    if not saved:
                        self.save_checkpoint()
                    raise Preempted(stop.signum, self.step, str(self.cluster.checkpoints.finish()))
            self.cluster.checkpoints.finish()
        return metrics

    def save_checkpoint(self) -> Path | None:
        return self.cluster.save_checkpoint(self.checkpoint_dir(), self.step, self.state_dict())

    def checkpoint_dir(self) -> Path:
        t = self.config.trainer
        return Path(t.default_local_dir) / t.project_name / t.experiment_name

    def state_dict(self) -> dict:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "torch_rng": torch.get_rng_state(), **self.producer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        torch.set_rng_state(state["torch_rng"])
        self.producer.load_state_dict(state, self.step)
