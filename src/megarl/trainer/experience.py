"""Pure steps of the RL loop between generation and the update: building the experience batch,
scoring, KL-in-reward, advantages and the step's data metrics. No Ray, no HTTP, no engines.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from megarl.algos import apply_kl_in_reward, compute_advantages, overlong_penalty
from megarl.algos.expert_load import expert_load
from megarl.algos.from_config import rollout_correction_kwargs
from megarl.algos.opd import (TOPK_LOSS_MODE, advantages_with_loss, forward_kl_topk, opd_advantages, opd_metrics,
                              reverse_kl)
from megarl.algos.rollout_correction import offpolicy_metrics
from megarl.algos.rollout_correction import rollout_correction as correct_rollout
from megarl.config import ExperimentConfig
from megarl.data.batch import Batch
from megarl.data.prompts import Prompt
from megarl.rewards.batch import score_batch, token_level_scores


def experience_batch(prompts: Sequence[Prompt], responses: Sequence[Sequence[Any]], uid_prefix: str) -> Batch:
    """One row per (prompt, sample): `responses[i]` holds prompt i's samples, each with `.token_ids`,
    `.logprobs` and `.finish_reason` (megarl.rollout.client.Sample). Samples of one prompt share
    the uid `f"{uid_prefix}-{prompt.index}"`; `rollout_log_probs` [B, R] are the rollout's own."""
    prompt_ids, response_ids, uids, rows, logprobs, finish = [], [], [], [], [], []
    for prompt, samples in zip(prompts, responses):
        for sample in samples:
            prompt_ids.append(prompt.input_ids)
            response_ids.append(sample.token_ids)
            uids.append(f"{uid_prefix}-{prompt.index}")
            rows.append(prompt.row)
            logprobs.append(sample.logprobs or [0.0] * len(sample.token_ids))
            finish.append(sample.finish_reason)
    batch = Batch.from_token_lists(
        prompt_ids, response_ids, uid=uids, data_source=[r.data_source for r in rows],
        ground_truth=[r.ground_truth for r in rows], extra_info=[r.extra_info for r in rows], finish_reason=finish,
    )
    width = batch.response_length
    batch["rollout_log_probs"] = torch.tensor([lp + [0.0] * (width - len(lp)) for lp in logprobs], dtype=torch.float32)
    routes = [s.routed_experts for samples in responses for s in samples]
    if any(r is not None for r in routes):
        batch["prompt_routed_experts"], batch["routed_experts"] = routed_experts_grids(
            routes, batch["prompt_mask"], batch["response_mask"])
    return batch


def routed_experts_grids(routes: Sequence[Any], prompt_mask: torch.Tensor,
                         response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing replay: each sample's routes [P_i + R_i - 1, layers, top_k] (the rollout's, one row
    per input position) as `prompt_routed_experts` [B, P, layers, top_k] (left-padded like
    prompt_ids) and `routed_experts` [B, R, layers, top_k] (aligned with response_ids), in the
    routes' dtype (narrow: `megarl.rollout.routed_experts.route_dtype`). The last response token
    was never an input at generation, so it has no route: 0 there, as at padding (its place tells
    it: `megarl.engines.megatron.replay.token_routes`)."""
    if any(r is None for r in routes):
        raise ValueError("routing replay: some samples came back without routed experts")
    b, width = response_mask.shape
    prompt = torch.zeros(b, prompt_mask.shape[1], *routes[0].shape[1:], dtype=routes[0].dtype)
    response = torch.zeros(b, width, *routes[0].shape[1:], dtype=routes[0].dtype)
    for i, r in enumerate(routes):
        p, n = int(prompt_mask[i].sum()), int(response_mask[i].sum())
        if r.shape[0] != p + n - 1:
            raise ValueError(f"sample {i}: {r.shape[0]} routed positions for {p} prompt + {n} response tokens "
                             f"(expected {p + n - 1})")
        r = torch.cat([r.to(prompt.dtype), r.new_zeros((1, *r.shape[1:]), dtype=prompt.dtype)])  # + the last token
        prompt[i, prompt.shape[1] - p:] = r[:p]
        response[i, :n] = r[p:]
    return prompt, response


def score(batch: Batch, score_fn: Callable, tokenizer, config: ExperimentConfig, max_workers: int = 1) -> dict:
    """Score every response; sets `scores` [B] and `token_level_scores` [B, R] (the score on the last
    response token, plus DAPO's overlong penalty when configured). Returns reward metrics."""
    ids, masks = batch["response_ids"].tolist(), batch["response_mask"].bool().tolist()  # two copies, not 2 per row
    texts = tokenizer.batch_decode([[t for t, keep in zip(row, mask) if keep] for row, mask in zip(ids, masks)],
                                   skip_special_tokens=False)
    rewards = score_batch(score_fn, batch["data_source"], texts, batch["ground_truth"], batch["extra_info"],
                          max_workers=max_workers, timeout_s=config.custom_reward_function.timeout_s)
    scores = rewards.scores
    metrics = dict(rewards.metrics)
    rm = config.reward_model
    if rm.overlong_buffer_len > 0:
        lengths = batch["response_mask"].sum(-1)
        penalty = overlong_penalty(lengths, config.data.max_response_length, rm.overlong_buffer_len,
                                   rm.overlong_penalty_factor)
        scores = scores + penalty
        metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
    batch["scores"] = scores
    batch["token_level_scores"] = token_level_scores(scores, batch["response_mask"])
    for key, values in rewards.extra.items():
        if key not in batch.keys():
            batch.meta[key] = values
    return metrics


def combine_rm_scores(batch: Batch, rm_scores: torch.Tensor, config: ExperimentConfig) -> dict:
    """After `score`: the reward model's scores [B] become the score, plus the rule/custom score
    `score` set when reward_model.add_rule_reward (else that is kept as `rule_scores` only);
    DAPO's overlong penalty applies either way. Sets `rm_scores`, `rule_scores`, `scores` and
    `token_level_scores`; returns `reward/rm_score_*` and `reward/rule_score_mean`."""
    rm = config.reward_model
    if rm_scores.shape != (len(batch),):
        raise ValueError(f"reward model scores have shape {list(rm_scores.shape)}, expected [{len(batch)}]")
    rm_scores = rm_scores.float()
    rule_scores = batch["scores"]  # the overlong penalty included
    if rm.add_rule_reward:
        scores = rm_scores + rule_scores
    elif rm.overlong_buffer_len > 0:
        scores = rm_scores + overlong_penalty(batch["response_mask"].sum(-1), config.data.max_response_length,
                                              rm.overlong_buffer_len, rm.overlong_penalty_factor)
    else:
        scores = rm_scores
    batch["rm_scores"], batch["rule_scores"], batch["scores"] = rm_scores, rule_scores, scores
    batch["token_level_scores"] = token_level_scores(scores, batch["response_mask"])
    return {"reward/rm_score_mean": rm_scores.mean().item(), "reward/rm_score_max": rm_scores.max().item(),
            "reward/rm_score_min": rm_scores.min().item(), "reward/rule_score_mean": rule_scores.mean().item()}


def rewards_and_advantages(batch: Batch, config: ExperimentConfig, kl_ctrl=None) -> dict:
    """Token-level rewards (minus the KL penalty when `algorithm.use_kl_in_reward`, which also
    updates `kl_ctrl`), then `algorithm.rollout_correction`'s weights and rejection mask
    (`rollout_correction`), then the configured estimator's `advantages` and `returns` [B, R] on
    the kept tokens, in verl's order (ray_trainer.py: KL penalty, correction, compute_advantage):
    GAE and REINFORCE++ skip the rejected tokens, whose rewards still count in outcome scores."""
    a = config.algorithm
    metrics = {}
    if a.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_in_reward(
            batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_probs"], batch["response_mask"],
            kl_ctrl.value, a.kl_penalty,
        )
        kl_ctrl.update(kl_metrics["kl"], n_steps=len(batch))
        metrics.update({f"critic/{k}": v for k, v in kl_metrics.items()})
    else:
        rewards = batch["token_level_scores"]
    batch["token_level_rewards"] = rewards
    generated = batch["response_mask"]
    metrics.update(rollout_correction(batch, config))
    result = compute_advantages(
        a.adv_estimator, rewards, batch["response_mask"], uids=batch["uid"],
        values=batch["values"] if "values" in batch else None,
        reward_baselines=batch["reward_baselines"] if "reward_baselines" in batch else None,
        gamma=a.gamma, lam=a.lam, norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo, score_mask=generated,
    )
    batch["advantages"] = result.advantages
    batch["returns"] = result.returns
    metrics.update({f"advantages/{k}": v for k, v in result.metrics.items()})
    if config.distillation.enabled:
        metrics.update(distill(batch, config))
    return metrics


def distill(batch: Batch, config: ExperimentConfig) -> dict:
    """On-policy distillation (`distillation`, megarl.algos.opd): with use_policy_gradient,
    `advantages` become the estimator's minus kl_coef x the (clamped) loss `loss_mode` of
    `opd_student_log_probs` to `teacher_log_probs` [B, R], both at `OPD_TEMPERATURE` (or that term
    alone with use_task_rewards=false), on `response_mask` tokens only (a multi-turn row's tool
    tokens carry none); without, they stay and the actor's update adds the loss. Sets
    `opd_reverse_kl` [B, R], the k1 reverse KL d_t whatever the loss; returns the `opd/...` metrics."""
    d = config.distillation
    mask = batch["response_mask"]
    if d.use_policy_gradient and d.loss_mode == TOPK_LOSS_MODE:
        losses, _, _ = forward_kl_topk(batch["opd_student_topk_log_probs"], batch["teacher_topk_log_probs"],
                                       d.log_prob_min_clamp)
        batch["advantages"], _ = advantages_with_loss(
            batch["advantages"], losses, mask, kl_coef=d.kl_coef, use_task_rewards=d.use_task_rewards,
            loss_max_clamp=d.loss_max_clamp)
    elif d.use_policy_gradient:
        batch["advantages"], _ = opd_advantages(
            batch["advantages"], batch["opd_student_log_probs"], batch["teacher_log_probs"], mask, kl_coef=d.kl_coef,
            use_task_rewards=d.use_task_rewards, loss_mode=d.loss_mode, loss_max_clamp=d.loss_max_clamp)
    # else the loss goes to the actor's update directly (megarl.engines.megatron.roles, `actor/distillation_loss`)
    batch["opd_reverse_kl"] = reverse_kl(batch["opd_student_log_probs"], batch["teacher_log_probs"], mask)
    return opd_metrics(batch["opd_reverse_kl"], batch["teacher_log_probs"], mask)


def data_metrics(batch: Batch) -> dict:
    """Scores, advantages (over `response_mask`), lengths (of the real response tokens, as verl's
    from the attention mask: a rollout rejection mask leaves them) and finish reasons of the step's
    experience."""
    mask = batch["response_mask"].bool()
    lengths = batch.response_tokens().sum(-1).float()
    prompt_lengths = batch["prompt_mask"].sum(-1).float()
    adv = batch["advantages"][mask] if "advantages" in batch else None
    finish = batch["finish_reason"]
    metrics = {
        "reward/mean": batch["scores"].mean().item(),
        "reward/max": batch["scores"].max().item(),
        "reward/min": batch["scores"].min().item(),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/clip_ratio": sum(f == "length" for f in finish) / len(finish),
        "prompt_length/mean": prompt_lengths.mean().item(),
    }
    if adv is not None and adv.numel():
        metrics.update({"advantages/mean": adv.mean().item(), "advantages/max": adv.max().item(),
                        "advantages/min": adv.min().item()})
    return metrics


def expert_load_metrics(expert_tokens: torch.Tensor) -> dict:
    """`megarl.algos.expert_load` of the step's routing: `expert_tokens` [layers, experts], the
    tokens of the step's samples (summed over the DP ranks) the actor's routers sent to each expert
    (with routing replay: the rollout's routes, which the actor replays)."""
    return expert_load(expert_tokens)


def old_log_probs(trainer_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                  use_rollout_log_probs: bool) -> torch.Tensor:
    """The PPO ratio's old log-probs [B, R] (`actor_rollout_ref.actor.use_rollout_log_probs`):
    the trainer's, recomputed under its current weights before the update (decoupled PPO: the clip
    is centred on the current policy, the sampling policy is corrected by truncated importance
    sampling), or the rollout's own (verl's `use_rollout_log_probs`, slime's `--use-rollout-logprobs`:
    the ratio pi / pi_rollout is itself the importance weight and the clip a trust region around the
    weights that sampled the batch, however many versions old)."""
    return rollout_log_probs if use_rollout_log_probs else trainer_log_probs


def old_log_probs_in_update(config: ExperimentConfig) -> bool:
    """Whether the actor's update makes the step's old log-probs itself
    (`actor_rollout_ref.actor.old_log_probs_in_update`; megarl.engines.megatron.old_log_probs:
    the first mini-batch's from its own training forward, the other rows' in a pass before the
    first optimizer step) instead of a separate pass over the batch before it. Not when something
    needs them before the update: the KL penalty in the reward (`algorithm.use_kl_in_reward`)
    reads them with the advantages; nor with `use_rollout_log_probs`, where the rollout's are the
    old ones and the trainer's pass only measures the mismatch; nor with `algorithm.rollout_correction`,
    whose weights and mask are made from them before the update (`rollout_correction`); nor with
    on-policy distillation (`distillation.enabled`), whose reverse KL in the advantage reads the
    trainer's log-probs of the batch before the update (at `OPD_TEMPERATURE`: this pass's when the
    rollout temperature is that, megarl.algos.opd). (Steps in `trainer.critic_warmup` do not update the actor:
    the controller then runs the separate pass.) Nor in `algorithm.rollout_correction.bypass_mode`,
    where the rollout's log-probs are the old ones and nothing makes the trainer's."""
    actor, rc = config.actor_rollout_ref.actor, config.algorithm.rollout_correction
    return (actor.old_log_probs_in_update and not config.algorithm.use_kl_in_reward and not actor.use_rollout_log_probs
            and not rc.enabled and not rc.bypass_mode and not config.distillation.enabled)


def rollout_correction(batch: Batch, config: ExperimentConfig) -> dict:
    """`algorithm.rollout_correction` in decoupled mode, applied to `batch` as verl's
    `compute_rollout_correction_and_add_to_batch` applies it, once per batch from the old log-probs
    (`megarl.algos.rollout_correction`): sets `rollout_is_weights` [B, R] with `rollout_is`; with
    `rollout_rs`, `response_mask` loses the rejected tokens, which then leave the advantages, the
    critic's and the actor's losses and their token and sequence counts (`response_attention_mask`
    keeps the tokens the model reads). Returns the `rollout_corr/...` metrics; {} with no correction
    on, in bypass mode (the loss makes them there: megarl.algos.losses.bypass_policy_loss) or
    without a valid token."""
    rc = config.algorithm.rollout_correction
    if not rc.enabled or rc.bypass_mode:
        return {}
    mask = batch["response_mask"]
    weights, keep, metrics = correct_rollout(batch["old_log_probs"], batch["rollout_log_probs"], mask,
                                             **rollout_correction_kwargs(rc))
    if weights is not None:
        batch["rollout_is_weights"] = weights
    if rc.rollout_rs is not None:
        batch["response_attention_mask"] = batch.response_tokens()
        batch["response_mask"] = keep.to(mask.dtype)
    return metrics if mask.any() else {}


def take_old_log_probs(batch: Batch, scored: dict, config: ExperimentConfig) -> dict:
    """Sets `batch["old_log_probs"]` (`old_log_probs`) from the actor's log-probs of the batch
    before the update, `scored` ({"log_probs", "entropy"} [B, R], "expert_tokens" [L, E] for an
    MoE actor); returns their metrics: `actor/entropy_before_update`, the rollout mismatch
    (`rollout_mismatch`, and verl's off-policy diagnostics `rollout_corr/...` of the trainer's
    log-probs against the rollout's, which verl logs whenever the rollout's exist,
    `megarl.algos.rollout_correction.offpolicy_metrics`), the expert load."""
    batch["old_log_probs"] = old_log_probs(scored["log_probs"], batch["rollout_log_probs"],
                                           config.actor_rollout_ref.actor.use_rollout_log_probs)
    mask = batch["response_mask"].bool()
    metrics = {"actor/entropy_before_update": scored["entropy"][mask].mean().item() if mask.any() else 0.0}
    metrics.update(rollout_mismatch(scored["log_probs"], batch["rollout_log_probs"], mask))
    if mask.any():  # as rollout_mismatch: nothing to measure in a batch without a valid token
        metrics.update(offpolicy_metrics(scored["log_probs"], batch["rollout_log_probs"], mask))
    if "expert_tokens" in scored:  # an MoE actor
        metrics.update(expert_load_metrics(scored["expert_tokens"]))
    return metrics


def rollout_mismatch(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> dict:
    """How far the rollout engine's token probabilities are from the trainer's recomputed ones
    (same weights, same temperature), over valid tokens; [B, R] inputs. verl's names:
    training/rollout_probs_diff_{max,mean,std} (|p_actor - p_rollout|) and
    training/rollout_actor_probs_pearson_corr; plus training/rollout_log_probs_diff_max (nats)."""
    valid = mask.bool()
    actor, rollout = actor_log_probs[valid].double(), rollout_log_probs[valid].double()
    if actor.numel() == 0:
        return {}
    diff = (actor.exp() - rollout.exp()).abs()
    out = {"training/rollout_probs_diff_max": diff.max().item(),
           "training/rollout_probs_diff_mean": diff.mean().item(),
           "training/rollout_probs_diff_std": diff.std().item() if diff.numel() > 1 else 0.0,
           "training/rollout_log_probs_diff_max": (actor - rollout).abs().max().item()}
    corr = torch.corrcoef(torch.stack([actor.exp(), rollout.exp()]))[0, 1].item() if actor.numel() > 1 else math.nan
    if math.isfinite(corr):  # undefined when either side is constant
        out["training/rollout_actor_probs_pearson_corr"] = corr
    return out


def best_of_n(batch: Batch) -> tuple[torch.Tensor, list[str]]:
    """Per prompt (uid, in order of first appearance): the best score among its responses [P],
    and its data_source. With a 0/1 reward, the mean of these is pass@n."""
    best: dict[str, float] = {}
    sources: dict[str, str] = {}
    for uid, score, source in zip(batch["uid"], batch["scores"].tolist(), batch["data_source"]):
        best[uid] = max(best.get(uid, -math.inf), score)
        sources.setdefault(uid, source)
    return torch.tensor(list(best.values())), list(sources.values())


def mean_scores(scores: torch.Tensor, data_sources: Sequence[str], prefix: str = "val") -> dict:
    """Mean score overall (`<prefix>/score`) and per data_source."""
    out = {f"{prefix}/score": scores.mean().item()}
    for source in sorted(set(data_sources)):
        picked = torch.tensor([s == source for s in data_sources])
        out[f"{prefix}/{source}/score"] = scores[picked].mean().item()
    return out


_ROUND_SUMS = {"rollout/requests", "rollout/samples", "rollout/prompt_tokens", "rollout/response_tokens",
               "rollout/wall_s", "rollout/aborted_samples", "rollout/retried_requests", "rollout/retries",
               "reward/num_errors", "reward/num_timeouts"}


def merge_round_metrics(rounds: Sequence[dict]) -> dict:
    """The metrics of several generation rounds of one step (DAPO's dynamic sampling) as one set:
    counts and seconds add up, latencies and longest samples take the maximum, tokens/s is
    recomputed, everything else is the mean over rounds."""
    merged = {}
    for key in {k for r in rounds for k in r}:
        values = [r[key] for r in rounds if key in r]
        if key in _ROUND_SUMS:
            merged[key] = float(sum(values))
        elif key.startswith(("rollout/latency_", "rollout/longest_")):
            merged[key] = float(max(values))
        else:
            merged[key] = float(sum(values) / len(values))
    if merged.get("rollout/wall_s"):
        merged["rollout/tokens_per_s"] = merged["rollout/response_tokens"] / merged["rollout/wall_s"]
    return merged
