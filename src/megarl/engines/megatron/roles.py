"""The role API the controller's workers call: `ActorEngine`, `RefEngine`, `CriticEngine`,
`TeacherEngine` (on-policy distillation's teacher, a `RefEngine` of its own model).

Each is built from the validated `ExperimentConfig` inside a process whose torch.distributed
world is exactly the role's ranks, reads its own config section, and takes `Batch`es holding this
data-parallel rank's samples (all TP/PP ranks of a replica get the same slice). Results come back
on the replica's output rank (TP rank 0 of the last pipeline stage) and None elsewhere; training
metrics come back on every rank. Engines know nothing about Ray or HTTP.

Per-token results are [B, R] float32 on the CPU, aligned with `response_ids`, 0 at padding. The
log-prob at response position t is log p(response_ids[t] | prompt, response[:t]) under
softmax(logits / temperature); the value at t is the critic's output at the same position (the
hidden state before token t, as verl defines it).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megarl.algos.advantages import zero_advantage_rows
from megarl.algos.dpo import dpo_loss
from megarl.algos.from_config import actor_loss_kwargs, bypass_kwargs, value_loss_kwargs
from megarl.algos.losses import actor_loss, agg_loss, value_loss
from megarl.algos.metrics import Metrics, Reduction
from megarl.algos.opd import (OPD_TEMPERATURE, TOPK_LOSS_MODE, clamp_losses, direct_distillation_loss,
                              estimator_losses, forward_kl_topk)
from megarl.config.rules.skip_rows import skips_in_update, skips_zero_advantage_rows
from megarl.config.schema import ExperimentConfig
from megarl.config.validate import resolve
from megarl.data.batch import Batch
from megarl.engines.megatron.engine import MegatronEngine
from megarl.engines.megatron.heads import token_log_probs, token_top_k, token_values
from megarl.engines.megatron.lora import LoraSpec
from megarl.engines.megatron.qat import QatSpec
from megarl.engines.megatron.mtp import MtpTraining
from megarl.engines.megatron.metrics import broadcast_from_last_stage
from megarl.engines.megatron.old_log_probs import OldLogProbsInUpdate
from megarl.engines.megatron.optim import finish_param_gather
from megarl.engines.megatron.sequences import Layout, MicroBatch


def _response_length(config: ExperimentConfig) -> int:
    """T of `seq-mean-token-sum-norm`: the configured maximum response length."""
    return config.actor_rollout_ref.rollout.response_length or config.data.max_response_length


def _log_prob_head(engine: MegatronEngine, temperature: float, with_entropy: bool, key: str):
    def head(mb: MicroBatch, hidden: torch.Tensor):
        log_probs, entropy = token_log_probs(
            hidden, engine.output_weight(), mb.targets, vocab_size=engine.arch.vocab_size,
            temperature=temperature, with_entropy=with_entropy,
        )
        out = {"rows": mb.rows, key: mb.to_grid(log_probs)}
        if with_entropy:
            out["entropy"] = mb.to_grid(entropy)
        return log_probs.new_zeros(()), out

    return head


def _sequence_sums(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] float64: the sum of each row's response-token log-probs ([B, R], 0 at padding)."""
    return (log_probs.double() * mask).sum(1)


def _policy_model(config: ExperimentConfig) -> dict:
    """The `MegatronEngine` keywords the actor and the reference share: the policy's model
    (`actor_rollout_ref.model`), the actor's routing replay (the reference replays the batch's
    routes too) and the collective timeout."""
    arr = config.actor_rollout_ref
    return dict(model_path=arr.model.path, model_key="actor_rollout_ref.model.path",
                override_config=arr.model.override_config, dtype=arr.model.dtype,
                router_replay=arr.actor.router_replay.mode == "R3", collective_timeout_s=arr.nccl_timeout)


def mtp_training(mtp) -> Optional[MtpTraining]:
    """The actor's MTP training from verl's `model.mtp` (None unless `enable` and `enable_train`: verl's
    mtp_patch.py runs the MTP block only with the labels of a training pass)."""
    if not (mtp.enable and mtp.enable_train):
        return None
    return MtpTraining(mtp.mtp_loss_scaling_factor, mtp.detach_encoder)


def lora_spec(lora) -> Optional[LoraSpec]:
    """A role's adapters from its `model.lora` (None when its rank is 0)."""
    from megarl.config.rules.lora import lora_targets

    if lora.rank <= 0:
        return None
    return LoraSpec(lora.rank, lora.alpha, lora_targets(lora.target_modules), lora.dropout, lora.lora_A_init_method)


def qat_spec(qat) -> Optional[QatSpec]:
    """The actor's quantization-aware training from its `megatron.qat` (None when off). Only the actor's:
    verl quantizes trained engines only, so the reference (forward-only) computes in full precision."""
    return QatSpec(qat.group_size, tuple(qat.ignore_patterns)) if qat.enable else None


class ActorEngine(MegatronEngine):
    """The policy: log-probs of sampled responses and PPO/GRPO-family updates
    (`actor_rollout_ref.actor`, model `actor_rollout_ref.model`)."""

    def __init__(self, config: ExperimentConfig, sequence_layout: Optional[Layout] = None):
        config = resolve(config)
        arr = config.actor_rollout_ref
        self.config = config
        self.actor = arr.actor
        super().__init__(
            section="actor_rollout_ref.actor",
            megatron_cfg=arr.actor.megatron,
            optim_cfg=arr.actor.optim,
            recompute=arr.model.enable_gradient_checkpointing,
            sequence_layout=sequence_layout,
            lora=lora_spec(arr.model.lora),
            qat=qat_spec(arr.actor.megatron.qat),
            mtp=mtp_training(arr.model.mtp),
            **_policy_model(config),
        )
        # the update leaves out the rows whose advantages are all 0 (megarl.config.rules.skip_rows)
        self.skip_zero_advantage_rows = skips_zero_advantage_rows(config, moe=self.arch.moe is not None)

    def compute_log_prob(self, batch: Batch, temperature: float, with_entropy: bool = False) -> Optional[dict]:
        """{"log_probs": [B, R] (, "entropy": [B, R])} on output ranks, None elsewhere; an MoE
        model adds "expert_tokens" [L, E] int32 (its routing's expert load over this rank's samples,
        `MegatronEngine.forward_tokens`).
        Micro-batches: rollout.log_prob_micro_batch_size_per_gpu responses, or with
        rollout.log_prob_use_dynamic_bsz the token budget rollout.log_prob_max_token_len_per_gpu
        (verl's keys of this pass; null: the actor's use_dynamic_bsz and ppo_max_token_len_per_gpu)."""
        keys = ["log_probs", "entropy"] if with_entropy else ["log_probs"]
        return self.forward_tokens(
            batch, _log_prob_head(self, temperature, with_entropy, "log_probs"),
            **self._old_log_prob_micro_batches(), keys=keys, count_experts=True,
        )

    def compute_log_prob_at(self, batch: Batch, temperature: float, ids_key: str) -> Optional[dict]:
        """{"log_probs": [B, R, K]} on output ranks, None elsewhere: at each response position the
        log-probs of the K token ids `batch[ids_key]` [B, R, K] (e.g. a teacher's top-k) under
        softmax(logits / temperature); micro-batches as `compute_log_prob`'s."""
        def head(mb: MicroBatch, hidden: torch.Tensor):
            log_probs, _ = token_log_probs(hidden, self.output_weight(), mb.per_token(mb.data[ids_key]),
                                           vocab_size=self.arch.vocab_size, temperature=temperature)
            return log_probs.new_zeros(()), {"rows": mb.rows, "log_probs": mb.to_grid(log_probs)}

        return self.forward_tokens(batch, head, **self._old_log_prob_micro_batches(), keys=["log_probs"],
                                   data_keys=[ids_key])

    def _old_log_prob_micro_batches(self) -> dict:
        """{"max_samples", "max_tokens"} of the old-log-prob pass (`compute_log_prob`, and the
        no-grad pass of `update_policy_with_old_log_probs`)."""
        rollout = self.config.actor_rollout_ref.rollout
        return {"max_samples": rollout.log_prob_micro_batch_size_per_gpu,
                "max_tokens": rollout.log_prob_max_token_len_per_gpu if rollout.log_prob_use_dynamic_bsz else None}

    def update_policy(self, batch: Batch) -> dict[str, float]:
        """`ppo_epochs` passes over this rank's samples in mini-batches of
        ppo_mini_batch_size x rollout.n / DP responses, one optimizer step each, with the policy
        loss of `megarl.algos.actor_loss`. Needs `old_log_probs` and `advantages` (and
        `ref_log_probs` with use_kl_loss, `rollout_log_probs` with tis_imp_ratio_cap,
        `rollout_is_weights` with algorithm.rollout_correction.rollout_is: the controller's
        `megarl.algos.rollout_correction`, whose mask is already in `response_mask`). In
        algorithm.rollout_correction.bypass_mode `old_log_probs` are the rollout's and the loss makes
        the corrections per micro-batch (`megarl.algos.losses.bypass_policy_loss`). Logits are
        divided by rollout.temperature, as in `compute_log_prob`. With
        `skip_zero_advantage_rows` the rows whose advantages are all 0 run no forward or backward
        (`MegatronEngine.train_batch`'s `skippable`): the update is the same, the metrics of its
        forward (pg_clipfrac, ppo_kl, entropy, ...) are over the rows trained, and
        actor/rows_trained_frac is their share. Returns `actor/...` metrics averaged over
        mini-batches (the bypass corrections' as `rollout_corr/...`, verl's names), equal on every
        rank."""
        return self._update_policy(batch, None)

    def update_policy_with_old_log_probs(self, batch: Batch) -> tuple[dict[str, float], Optional[dict]]:
        """`update_policy` on a batch without `old_log_probs`: the update makes them
        (`megarl.engines.megatron.old_log_probs`; `actor_rollout_ref.actor.old_log_probs_in_update`).
        Returns (the update's metrics, equal on every rank; on output ranks what
        `compute_log_prob(batch, rollout.temperature, with_entropy=True)` would have returned
        before the update, None elsewhere)."""
        rollout = self.config.actor_rollout_ref.rollout
        old = OldLogProbsInUpdate(self, batch, _log_prob_head(self, rollout.temperature, True, "log_probs"),
                                  **self._old_log_prob_micro_batches())
        metrics = self._update_policy(old.batch, old)
        return metrics, old.outputs() if self.is_output_rank else None

    def _update_policy(self, batch: Batch, old: Optional[OldLogProbsInUpdate]) -> dict[str, float]:
        """`update_policy`; with `old`, the old log-probs come from it (see there)."""
        actor, rollout = self.actor, self.config.actor_rollout_ref.rollout
        rc = self.config.algorithm.rollout_correction
        keys = (["old_log_probs", "advantages"] + (["ref_log_probs"] if actor.use_kl_loss else [])
                + (["rollout_log_probs"] if actor.tis_imp_ratio_cap > 0 else [])
                + (["rollout_is_weights"] if rc.rollout_is is not None and not rc.bypass_mode else []))
        distillation = self.config.distillation
        direct = distillation.enabled and not distillation.use_policy_gradient  # megarl.algos.opd
        if direct:
            keys += (["teacher_topk_ids", "teacher_topk_log_probs"] if distillation.loss_mode == TOPK_LOSS_MODE
                     else ["teacher_log_probs"])
        loss_kwargs = actor_loss_kwargs(actor)
        bypass = bypass_kwargs(rc)
        norm_length = _response_length(self.config)
        separate_pass = old is None and not rc.bypass_mode and not actor.use_rollout_log_probs
        skippable = (zero_advantage_rows(batch["advantages"], batch["response_mask"])
                     if skips_in_update(self.skip_zero_advantage_rows, actor.skip_zero_advantage_rows, separate_pass)
                     else torch.zeros(len(batch), dtype=torch.bool))

        def loss_head(mb: MicroBatch, hidden: torch.Tensor, counts: dict):
            log_probs, entropy = token_log_probs(
                hidden, self.output_weight(), mb.targets, vocab_size=self.arch.vocab_size,
                temperature=rollout.temperature, with_entropy=True,
            )
            log_probs = mb.to_grid(log_probs)
            entropy = mb.to_grid(entropy if actor.entropy_coeff != 0 else entropy.detach())
            old_log_probs = mb.data["old_log_probs"] if old is None else old.old_log_probs(mb, log_probs, entropy)
            normalisers = dict(num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"])
            loss, metrics = actor_loss(
                log_probs, old_log_probs, mb.data["advantages"], mb.response_mask,
                entropy=entropy, ref_log_prob=mb.data.get("ref_log_probs"),
                rollout_log_prob=mb.data.get("rollout_log_probs"),
                rollout_is_weights=mb.data.get("rollout_is_weights"), bypass=bypass, **loss_kwargs, **normalisers,
                norm_length=norm_length,
                metric_counts=dict(num_tokens=counts["trained_tokens"], num_seqs=counts["trained_seqs"]),
            )
            if not direct:
                return loss, metrics
            term = direct_distillation_loss(
                clamp_losses(self._distillation_losses(mb, hidden, log_probs), distillation.loss_max_clamp),
                mb.response_mask, actor.loss_agg_mode, **normalisers, norm_length=norm_length)
            metrics.add("distillation_loss", term.detach(), Reduction.SUM)
            # verl's distillation_ppo_loss: with task rewards policy loss + coef x term; without, the term alone
            return (loss + distillation.kl_coef * term if distillation.use_task_rewards else term), metrics

        metrics = self.train_batch(
            batch,
            mini_batch_size=actor.ppo_mini_batch_size * rollout.n // self.dp_size,
            epochs=actor.ppo_epochs,
            shuffle=actor.shuffle,
            max_samples=actor.ppo_micro_batch_size_per_gpu,
            max_tokens=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
            data_keys=keys,
            loss_head=loss_head,
            prefix="actor",
            before_mini_batch=None if old is None else old.before_mini_batch,
            skippable=skippable,
        )
        # bypass mode's corrections under verl's names (rollout_corr/..., rollout_corr_megarl/...), not actor/
        return {name.removeprefix("actor/") if name.startswith("actor/rollout_corr") else name: value
                for name, value in metrics.items()}

    def _distillation_losses(self, mb: MicroBatch, hidden: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        """[b, R] per-token distillation loss of `distillation.loss_mode` (megarl.algos.opd) with
        gradients, the student's side at `OPD_TEMPERATURE` (as the teacher's): forward_kl_topk from
        the student's log-probs at the teacher's top-k ids; an estimator from the sampled tokens'
        (`log_probs` [b, R], at the rollout temperature, when that is OPD_TEMPERATURE)."""
        d, temperature = self.config.distillation, self.config.actor_rollout_ref.rollout.temperature
        if d.loss_mode == TOPK_LOSS_MODE:
            student, _ = token_log_probs(hidden, self.output_weight(), mb.per_token(mb.data["teacher_topk_ids"]),
                                         vocab_size=self.arch.vocab_size, temperature=OPD_TEMPERATURE)
            losses, _, _ = forward_kl_topk(mb.to_grid(student), mb.data["teacher_topk_log_probs"], d.log_prob_min_clamp)
            return losses
        if temperature != OPD_TEMPERATURE:
            student, _ = token_log_probs(hidden, self.output_weight(), mb.targets, vocab_size=self.arch.vocab_size,
                                         temperature=OPD_TEMPERATURE)
            log_probs = mb.to_grid(student)
        return estimator_losses(log_probs, mb.data["teacher_log_probs"], d.loss_mode)

    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on this rank's samples: the token-mean
        negative log-likelihood of `response_ids` (temperature 1) over all DP ranks' response
        tokens. Micro-batches as in `update_policy`. Returns `sft/nll`, `sft/grad_norm`, ..."""
        actor = self.actor

        def loss_head(mb: MicroBatch, hidden: torch.Tensor, counts: dict):
            log_probs, _ = token_log_probs(hidden, self.output_weight(), mb.targets,
                                           vocab_size=self.arch.vocab_size, temperature=1.0)
            nll = agg_loss(-mb.to_grid(log_probs), mb.response_mask, "token-mean", num_tokens=counts["num_tokens"])
            metrics = Metrics()
            metrics.add("nll", nll.detach(), Reduction.SUM)  # divided by the mini-batch's tokens: the parts add up
            return nll, metrics

        return self.train_batch(
            batch, mini_batch_size=len(batch), epochs=1, shuffle=False,
            max_samples=actor.ppo_micro_batch_size_per_gpu,
            max_tokens=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
            data_keys=[], loss_head=loss_head, prefix="sft",
        )

    # ------------------------------------------------------------------ DPO
    # Layout: rows 2i and 2i + 1 of a DPO batch are pair i's chosen and rejected response
    # (`megarl.data.preferences.pairs_to_batch`); every DP rank holds whole pairs.
    #
    # Design: sums first, loss after. The DPO loss couples two sequences, which megatron's
    # micro-batches (sample counts or token budgets) and DP slices may separate. So a DPO step is
    #   1. a forward-only pass: the policy's per-sequence log-prob sums s ([B], all last-stage ranks);
    #   2. the loss of `megarl.algos.dpo_loss` on (s, reference sums) with autograd over s alone,
    #      giving the metrics and g = dL/ds per sequence (L: the mean over all DP ranks' pairs);
    #   3. one optimizer step on the surrogate sum_i g_i * s_i (g held fixed), whose gradient with
    #      respect to the weights is exactly dL/dweights (chain rule; no dropout in our models).
    # Any micro-batching works and pairs may straddle micro-batches; the price is one extra policy
    # forward pass (about a quarter more compute per step, counting the reference's forward).

    def _dpo_sums_and_metrics(self, batch: Batch) -> tuple[Optional[torch.Tensor], dict[str, float]]:
        """Pass 1 + 2: (g [B] float64, metrics averaged over DP ranks) on last-stage ranks,
        (None, {}) elsewhere. Needs `ref_log_probs` [B, R] (temperature 1)."""
        if len(batch) % 2:
            raise ValueError(f"{self.section}: a DPO batch holds (chosen, rejected) pairs; got {len(batch)} samples")
        dpo, actor = self.config.algorithm.dpo, self.actor
        micro_batches = self.micro_batches(
            batch, max_samples=actor.ppo_micro_batch_size_per_gpu,
            max_tokens=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
        )
        outputs = self.run(micro_batches, _log_prob_head(self, 1.0, False, "log_probs"), forward_only=True)
        if not self._is_last_stage():
            return None, {}
        mask = batch["response_mask"].bool()
        log_probs = torch.zeros(mask.shape, dtype=torch.float32)
        for out in outputs:
            log_probs[out["rows"]] = out["log_probs"].float().cpu()
        policy = _sequence_sums(log_probs, mask).requires_grad_(True)
        ref = _sequence_sums(batch["ref_log_probs"].float(), mask)
        loss, parts = dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], beta=dpo.beta,
                               loss_type=dpo.loss_type, label_smoothing=dpo.label_smoothing)
        (loss / self.dp_size).backward()  # DP ranks hold equal numbers of pairs: L is the mean of their losses
        names = ["loss", "reward_margin", "reward_accuracy", "rewards_chosen", "rewards_rejected",
                 "logps_chosen", "logps_rejected", "ref_logps_chosen", "ref_logps_rejected"]
        values = torch.stack([parts["dpo_loss"], parts["reward_margin"], parts["reward_accuracy"],
                              parts["rewards_chosen"], parts["rewards_rejected"], policy[0::2].mean(),
                              policy[1::2].mean(), ref[0::2].mean(), ref[1::2].mean()]).detach().double()
        values = values.to(self.device)
        dist.all_reduce(values, group=self._ps.get_data_parallel_group())
        return policy.grad, {name: float(v) / self.dp_size for name, v in zip(names, values.cpu())}

    def dpo_eval(self, batch: Batch) -> dict[str, float]:
        """The DPO loss and its metrics on this batch of pairs, without an update (validation).
        Same names as `dpo_step` without the prefix; equal on every rank."""
        _, metrics = self._dpo_sums_and_metrics(batch)
        return broadcast_from_last_stage(metrics)

    def dpo_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of DPO (`algorithm.dpo`) on this rank's pairs, with the frozen
        reference's per-token `ref_log_probs` [B, R] in the batch (see the design note above).
        Returns `dpo/loss`, `dpo/reward_margin`, `dpo/reward_accuracy`, `dpo/rewards_chosen`,
        `dpo/rewards_rejected` (see `megarl.algos.dpo`), `dpo/logps_chosen` ... (mean sequence
        log-probs, nats, policy and reference), `dpo/grad_norm`, `dpo/lr`, `dpo/tokens`; all of
        them before the update, equal on every rank."""
        actor = self.actor
        seq_grads, metrics = self._dpo_sums_and_metrics(batch)
        if seq_grads is not None:
            seq_grads = seq_grads.float().to(self.device)

        def loss_head(mb: MicroBatch, hidden: torch.Tensor, counts: dict):
            log_probs, _ = token_log_probs(hidden, self.output_weight(), mb.targets,
                                           vocab_size=self.arch.vocab_size, temperature=1.0)
            surrogate = (mb.to_grid(log_probs).sum(1) * seq_grads[mb.rows.to(self.device)]).sum()
            return surrogate, Metrics()  # the DPO metrics come from the pass before the update

        update = self.train_batch(
            batch, mini_batch_size=len(batch), epochs=1, shuffle=False,  # rows of mb index this batch
            max_samples=actor.ppo_micro_batch_size_per_gpu,
            max_tokens=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
            data_keys=[], loss_head=loss_head, prefix="dpo",
        )
        return {**update, **broadcast_from_last_stage({f"dpo/{k}": v for k, v in metrics.items()})}

    def export_hf(self, out_dir: str, bucket_megabytes: int = 512) -> str:
        """Every rank: write the current weights as an HF checkpoint (megarl.sync.export)."""
        from megarl.sync.export import export_hf

        with self.weights_for_sync():  # with LoRA: the merged weights
            return str(export_hf(self.model_chunks, self.weight_map, out_dir, self.config.actor_rollout_ref.model.path,
                                 bucket_megabytes * 2**20))


class RefEngine(MegatronEngine):
    """The frozen reference policy (`actor_rollout_ref.ref`, same model as the actor); forward only.
    With the actor's routing replay on, it replays the batch's routes too: KL(actor || ref) then
    compares the two on the same routing (0 at step 0)."""

    def __init__(self, config: ExperimentConfig, sequence_layout: Optional[Layout] = None):
        config = resolve(config)
        arr = config.actor_rollout_ref
        self.ref = arr.ref
        super().__init__(
            section="actor_rollout_ref.ref",
            megatron_cfg=arr.ref.megatron,
            sequence_layout=sequence_layout,
            **_policy_model(config),
        )

    def compute_ref_log_prob(self, batch: Batch, temperature: float) -> Optional[dict]:
        """{"ref_log_probs": [B, R]} on output ranks, None elsewhere."""
        return self._frozen_log_probs(batch, temperature, "ref_log_probs", self.ref)

    def _frozen_log_probs(self, batch: Batch, temperature: float, key: str, settings) -> Optional[dict]:
        """{key: [B, R]} on output ranks, None elsewhere, in micro-batches of `settings`'
        log_prob_micro_batch_size_per_gpu responses (or its token budget with log_prob_use_dynamic_bsz)."""
        return self.forward_tokens(
            batch, _log_prob_head(self, temperature, False, key),
            max_samples=settings.log_prob_micro_batch_size_per_gpu,
            max_tokens=settings.log_prob_max_token_len_per_gpu if settings.log_prob_use_dynamic_bsz else None,
            keys=[key],
        )


class TeacherEngine(RefEngine):
    """The on-policy-distillation teacher (`distillation.teacher`, type megatron): a frozen model of
    its own checkpoint and TP/PP/EP layout (it may differ from the actor's), scored as the reference
    is. Its tokenizer is the student's (checked by the controller, megarl.trainer.teacher)."""

    def __init__(self, config: ExperimentConfig, sequence_layout: Optional[Layout] = None):
        config = resolve(config)
        self.teacher = config.distillation.teacher
        MegatronEngine.__init__(
            self,
            section="distillation.teacher",
            model_path=self.teacher.model_path,
            model_key="distillation.teacher.model_path",
            override_config={},
            dtype=config.actor_rollout_ref.model.dtype,
            megatron_cfg=self.teacher.megatron,
            sequence_layout=sequence_layout,
            collective_timeout_s=config.actor_rollout_ref.nccl_timeout,
        )

    def compute_teacher_log_prob(self, batch: Batch, temperature: float) -> Optional[dict]:
        """{"teacher_log_probs": [B, R]} on output ranks, None elsewhere: log p_teacher of each
        response token given what precedes it, under softmax(logits / temperature)."""
        return self._frozen_log_probs(batch, temperature, "teacher_log_probs", self.teacher)

    def compute_teacher_top_k(self, batch: Batch, temperature: float, k: int) -> Optional[dict]:
        """{"teacher_log_probs": [B, R], "teacher_topk_log_probs": [B, R, k] float32 (descending),
        "teacher_topk_ids": [B, R, k] int64} on output ranks, None elsewhere: at each response
        position the sampled token's log-prob and the teacher's k most likely next tokens under
        softmax(logits / temperature) (`heads.token_top_k`), 0 at padding."""
        def head(mb: MicroBatch, hidden: torch.Tensor):
            sampled, top_values, top_ids = token_top_k(hidden, self.output_weight(), mb.targets, k,
                                                       vocab_size=self.arch.vocab_size, temperature=temperature)
            return sampled.new_zeros(()), {"rows": mb.rows, "teacher_log_probs": mb.to_grid(sampled),
                                           "teacher_topk_log_probs": mb.to_grid(top_values),
                                           "teacher_topk_ids": mb.to_grid(top_ids)}

        t = self.teacher
        return self.forward_tokens(
            batch, head, max_samples=t.log_prob_micro_batch_size_per_gpu,
            max_tokens=t.log_prob_max_token_len_per_gpu if t.log_prob_use_dynamic_bsz else None,
            keys=["teacher_log_probs", "teacher_topk_log_probs", "teacher_topk_ids"],
        )


class CriticEngine(MegatronEngine):
    """The value model (`critic`): the backbone of `critic.model.path` (the actor's model, or a
    reward model) with a scalar head, read from the reward model's `score.weight` when it has
    one, else initialised from N(0, 0.02)."""

    def __init__(self, config: ExperimentConfig, sequence_layout: Optional[Layout] = None):
        config = resolve(config)
        self.config = config
        self.critic = config.critic
        super().__init__(
            section="critic",
            model_path=config.critic.model.path,
            model_key="critic.model.path",
            override_config=config.critic.model.override_config,
            dtype=config.actor_rollout_ref.model.dtype,
            megatron_cfg=config.critic.megatron,
            value_head=True,
            optim_cfg=config.critic.optim,
            recompute=config.actor_rollout_ref.model.enable_gradient_checkpointing,
            sequence_layout=sequence_layout,
            lora=lora_spec(config.critic.model.lora),
            collective_timeout_s=config.actor_rollout_ref.nccl_timeout,
        )

    def _value_weight(self) -> torch.Tensor:
        weight = self.model_chunks[-1].output_layer.weight
        finish_param_gather(self._ddp_chunks, weight)  # read outside the head's forward: wait for its all-gather
        return weight

    def compute_values(self, batch: Batch) -> Optional[dict]:
        """{"values": [B, R]} on output ranks, None elsewhere."""
        critic = self.critic

        def head(mb: MicroBatch, hidden: torch.Tensor):
            values = token_values(hidden, self._value_weight())
            return values.new_zeros(()), {"rows": mb.rows, "values": mb.to_grid(values)}

        return self.forward_tokens(
            batch, head, max_samples=critic.ppo_micro_batch_size_per_gpu,
            max_tokens=critic.ppo_max_token_len_per_gpu if critic.use_dynamic_bsz else None, keys=["values"],
        )

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss updates on `returns` with the rollout-time `values`; mini-batches of
        critic.ppo_mini_batch_size x rollout.n / DP responses. Returns `critic/...` metrics."""
        critic, n = self.critic, self.config.actor_rollout_ref.rollout.n
        loss_kwargs = value_loss_kwargs(critic)
        norm_length = _response_length(self.config)

        def loss_head(mb: MicroBatch, hidden: torch.Tensor, counts: dict):
            values = mb.to_grid(token_values(hidden, self._value_weight()))
            return value_loss(values, mb.data["returns"], mb.data["values"], mb.response_mask, **loss_kwargs,
                              num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"], norm_length=norm_length)

        return self.train_batch(
            batch,
            mini_batch_size=critic.ppo_mini_batch_size * n // self.dp_size,
            epochs=critic.ppo_epochs,
            shuffle=False,
            max_samples=critic.ppo_micro_batch_size_per_gpu,
            max_tokens=critic.ppo_max_token_len_per_gpu if critic.use_dynamic_bsz else None,
            data_keys=["returns", "values"],
            loss_head=loss_head,
            prefix="critic",
        )
