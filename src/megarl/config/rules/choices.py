"""Rules on choices that need other keys: an estimator and its critic or groups, the reward
model's settings, the lr schedule's step count, dynamic batches and sampling, the rollout engine."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Optional

from megarl.config.engine_kwargs import deprecated_sglang_kwargs, engine_kwargs_problems, other_engines_kwargs
from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig

log = logging.getLogger("megarl.config")

# Estimators whose baseline comes from the other responses of the same prompt.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "gpg")


def token_budget_holds_a_sequence(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """With dynamic batch sizes, one micro-batch's token budget must hold a whole sequence: the
    actor's update and its old-log-prob pass. The budget is per GPU, as verl's: with context
    parallelism a micro-batch holds CP x the budget, each CP rank 1/CP of each sequence.

    Reads: actor_rollout_ref.actor.use_dynamic_bsz, actor_rollout_ref.actor.ppo_max_token_len_per_gpu,
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz, actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu,
    actor_rollout_ref.actor.megatron.context_parallel_size, data.max_prompt_length, data.max_response_length
    """
    d, actor, rollout = config.data, config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    cp = max(actor.megatron.context_parallel_size, 1)
    sequence = -(-(d.max_prompt_length + d.max_response_length) // cp)  # tokens of a sequence per CP rank
    budgets = {"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": (actor.use_dynamic_bsz,
                                                                     actor.ppo_max_token_len_per_gpu)}
    old_log_probs = (rollout.log_prob_use_dynamic_bsz, rollout.log_prob_max_token_len_per_gpu)
    if old_log_probs not in budgets.values():  # not merely the actor's (its null default): one message
        budgets["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] = old_log_probs
    for key, (on, budget) in budgets.items():
        if on and budget < sequence:
            share = "" if cp == 1 else (f", over actor_rollout_ref.actor.megatron.context_parallel_size={cp} GPUs: "
                                        f"{sequence} tokens each")
            yield (f"{key}={budget} tokens is less than one full sequence (data.max_prompt_length + "
                   f"data.max_response_length = {d.max_prompt_length + d.max_response_length} tokens{share})")


def group_estimator_has_groups(config: ExperimentConfig, sizes: DerivedSizes) -> Iterable[str]:
    """Warns (no error) when a group-baseline estimator gets one response per prompt.

    Reads: algorithm.adv_estimator, actor_rollout_ref.rollout.n, distillation.enabled, distillation.use_task_rewards
    """
    estimator, n = config.algorithm.adv_estimator, config.actor_rollout_ref.rollout.n
    pure_opd = config.distillation.enabled and not config.distillation.use_task_rewards  # the teacher's signal alone
    if estimator in GROUP_ESTIMATORS and n < 2 and not pure_opd:
        log.warning(
            "algorithm.adv_estimator=%s compares responses to the same prompt, but actor_rollout_ref.rollout.n=%d: "
            "every group has one response and every advantage will be 0; set rollout.n >= 2 to learn",
            estimator, n,
        )
    return ()


def gae_has_critic(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """GAE needs a critic.

    Reads: algorithm.adv_estimator, critic.enable
    """
    if config.algorithm.adv_estimator == "gae" and not config.critic.enable:
        yield "algorithm.adv_estimator=gae needs a critic: remove critic.enable=false or pick another estimator"


def reward_model_holds_a_sequence(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The reward model's length must hold a whole prompt + response.

    Reads: reward_model.enable, reward_model.max_length, data.max_prompt_length, data.max_response_length
    """
    d, rm_length = config.data, config.reward_model.max_length
    if config.reward_model.enable and rm_length is not None and rm_length < d.max_prompt_length + d.max_response_length:
        yield (
            f"reward_model.max_length={rm_length} tokens is less than a whole sequence (data.max_prompt_length + "
            f"data.max_response_length = {d.max_prompt_length + d.max_response_length} tokens): the reward model "
            "scores prompt and response as the policy produced them and never truncates; raise it or leave it unset"
        )


def filter_groups_has_groups(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """DAPO's group filter needs groups of at least two responses.

    Reads: algorithm.filter_groups.enable, actor_rollout_ref.rollout.n
    """
    if config.algorithm.filter_groups.enable and config.actor_rollout_ref.rollout.n < 2:
        yield "algorithm.filter_groups.enable=true drops groups of equal rewards: needs actor_rollout_ref.rollout.n >= 2"


def gen_batch_only_with_dynamic_sampling(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A generation batch other than the train batch is DAPO's dynamic sampling only.

    Reads: data.gen_batch_size, data.train_batch_size, algorithm.filter_groups.enable
    """
    d = config.data
    if d.gen_batch_size not in (None, d.train_batch_size) and not config.algorithm.filter_groups.enable:
        yield (
            f"data.gen_batch_size={d.gen_batch_size} differs from data.train_batch_size={d.train_batch_size}, which "
            "only DAPO's dynamic sampling uses: set algorithm.filter_groups.enable=true, or remove data.gen_batch_size"
        )


def lr_schedule_has_step_count(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A warmup ratio or a non-constant schedule needs the number of steps (or lr_decay_steps).

    Reads: actor_rollout_ref.actor.optim, critic.optim, trainer.total_training_steps
    """
    sections = (("actor_rollout_ref.actor.optim", config.actor_rollout_ref.actor.optim),
                ("critic.optim", config.critic.optim))
    for section, optim in sections:
        needs_total = optim.lr_warmup_steps < 0 and optim.lr_warmup_steps_ratio > 0 or optim.warmup_style != "constant"
        known = (optim.lr_decay_steps is not None or optim.total_training_steps > 0
                 or config.trainer.total_training_steps)
        if needs_total and not known:
            yield (f"{section}: lr_warmup_steps_ratio / warmup_style={optim.warmup_style} need the number of "
                   f"steps: set trainer.total_training_steps (or {section}.total_training_steps)")


def warmup_fits_schedule(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The learning-rate warm-up ends before the schedule does (the engine refuses it when it builds
    its scheduler, after the cluster is up: this says so at load time).

    Reads: actor_rollout_ref.actor.optim, critic.optim, critic.enable
    """
    sections = [("actor_rollout_ref.actor.optim", config.actor_rollout_ref.actor.optim)]
    if config.critic.enable:
        sections.append(("critic.optim", config.critic.optim))
    for section, optim in sections:
        warmup, decay = optim.schedule_steps()  # resolve() filled total_training_steps from the trainer's
        if decay <= 0 or warmup < decay:
            continue
        if optim.lr_warmup_steps >= 0:
            source = f"{section}.lr_warmup_steps={optim.lr_warmup_steps}"
        else:
            source = f"{section}.lr_warmup_steps_ratio={optim.lr_warmup_steps_ratio} ({warmup} steps)"
        # megatron-core's OptimizerParamScheduler asserts lr_warmup_steps < lr_decay_steps
        # (optimizer_param_scheduler.py), the decay steps being the training steps unless set (as in verl)
        rule = "megatron-core's OptimizerParamScheduler asserts lr_warmup_steps < lr_decay_steps"
        if optim.lr_decay_steps is None:
            yield (f"{source}: the warm-up must end before the last of the {decay} training steps "
                   f"(trainer.total_training_steps or {section}.total_training_steps; {rule}); lower the warm-up "
                   "or raise the step count")
        else:
            yield f"{source}: the warm-up must end before {section}.lr_decay_steps={decay} ({rule})"


def min_lr_fits(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The decay's floor is set once (min_lr, verl's Megatron key, or min_lr_ratio, its FSDP one) and lies in
    [0, lr] (megatron's OptimizerParamScheduler asserts min_lr >= 0 and max_lr >= min_lr).

    Reads: actor_rollout_ref.actor.optim, critic.optim
    """
    for section, optim in (("actor_rollout_ref.actor.optim", config.actor_rollout_ref.actor.optim),
                           ("critic.optim", config.critic.optim)):
        if optim.min_lr is not None and optim.min_lr_ratio != 0:
            yield (f"{section}.min_lr={optim.min_lr} and {section}.min_lr_ratio={optim.min_lr_ratio} both set where "
                   "the learning rate decays to: set one")
        elif not 0 <= optim.final_lr() <= optim.lr:
            yield (f"{section}: the learning rate decays to {optim.final_lr()} (min_lr, or lr x min_lr_ratio), "
                   f"which must lie in [0, lr={optim.lr}]")


def reward_model_settings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Reward-model options need the reward model, and the reward model needs its path.

    Reads: reward_model.enable, reward_model.add_rule_reward, reward_model.model.path
    """
    rm = config.reward_model
    if rm.add_rule_reward and not rm.enable:
        yield ("reward_model.add_rule_reward=true adds the rule reward to a reward model's score: "
               "set reward_model.enable=true too, or drop it")
    if rm.enable and not rm.model.path:
        yield "reward_model.enable=true needs reward_model.model.path"


OFFLOAD_KEYS = ("param_offload", "grad_offload", "optimizer_offload")


def _offload_keys(config: ExperimentConfig) -> dict[str, list[str]]:
    """Role prefix -> the offload keys set true under it."""
    arr = config.actor_rollout_ref
    sections = {"actor_rollout_ref.actor.megatron": arr.actor.megatron, "actor_rollout_ref.ref.megatron":
                arr.ref.megatron, "critic.megatron": config.critic.megatron,
                "reward_model.megatron": config.reward_model.megatron}
    return {prefix: keys for prefix, m in sections.items()
            if (keys := [f"{prefix}.{key}" for key in OFFLOAD_KEYS if getattr(m, key)])}


def offload_only_where_it_happens(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The reward model is never offloaded (megarl.placement.colocation): it scores while the
    servers hold their memory.

    Reads: placement.mode, actor_rollout_ref.actor.megatron, actor_rollout_ref.ref.megatron, critic.megatron,
    reward_model.megatron
    """
    keys = _offload_keys(config).get("reward_model.megatron")
    if keys and config.placement.mode == "colocate":
        yield (f"{', '.join(keys)}: the reward model scores while the rollout servers hold their memory, so it "
               "is never offloaded; set them to false")


def offload_in_split_placement(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A warning (WARNING_RULES): offload keys in split placement, where the rollout servers have GPUs of
    their own and nothing is offloaded (megarl.placement.colocation). verl's split-placement scripts
    (fully async, one-step-off) set them; the run goes on without offload.

    Reads: placement.mode, actor_rollout_ref.actor.megatron, actor_rollout_ref.ref.megatron,
    critic.megatron, reward_model.megatron
    """
    if config.placement.mode == "colocate":
        return
    for keys in _offload_keys(config).values():
        yield (f"{', '.join(keys)}: offload happens only with placement.mode=colocate (split pools give the "
               "rollout servers their own GPUs, so nothing is offloaded); ignored")


def batched_requests_fit_rollout(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """`batch_requests_per_server` sends each server its share of a generation's prompts in one
    request, around the router (`megarl.rollout.client.RolloutClient`'s `batch_per_server`). For the
    CPU engine only: SGLang 0.5.23 answers a batch with n > 1 by prefilling its prompts one after
    the other before it samples any (`managers/tokenizer_manager.py::_handle_batch_request`, whose
    FIXME and warning say so), where one request per prompt prefills them together. Agent turns
    are single requests, which would then all go to the first server, and routing replay reads each
    prompt's routes against its own request.

    Reads: actor_rollout_ref.rollout.batch_requests_per_server, actor_rollout_ref.rollout.name,
    actor_rollout_ref.rollout.agent.path, actor_rollout_ref.actor.router_replay.mode
    """
    arr = config.actor_rollout_ref
    if not arr.rollout.batch_requests_per_server:
        return
    key = "actor_rollout_ref.rollout.batch_requests_per_server=true"
    if arr.rollout.name != "cpu":
        yield (f"{key} needs actor_rollout_ref.rollout.name=cpu (got {arr.rollout.name!r}): SGLang prefills the "
               "prompts of a batch with n > 1 one after the other; set it false")
    if arr.rollout.agent.path:
        yield f"{key} with actor_rollout_ref.rollout.agent.path: agent turns are single requests; set it false"
    if arr.actor.router_replay.mode == "R3":
        yield (f"{key} with actor_rollout_ref.actor.router_replay.mode=R3: routing replay sends each prompt on its "
               "own; set it false")


def rollout_engine_fits_device(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Real SGLang serves on a CPU one process per server (docs/sglang-on-cpu.md): its CPU all-reduce
    across TP ranks is a kernel of `sgl_kernel` (`shm_allreduce`), a compiled CPU build PyPI does not
    have, so a server of more than one TP rank cannot run there. Nor can SGLang 0.5.23 start there
    with routing replay or LoRA adapters: both pin host memory, which a CPU build of torch cannot
    (the routed-experts capturer's host buffer goes through `cudaHostRegister`:
    `srt/state_capturer/base.py::BaseHostCache`, `srt/mem_cache/pool_host/common.py::_cuda_host_register`,
    "Torch not compiled with CUDA enabled"; every LoRA layer makes a `pin_memory=True` tensor:
    `srt/lora/layers.py::ColumnParallelLinearWithLoRA`, whatever `--lora-backend`); the server exits at start.

    Reads: actor_rollout_ref.rollout.name, actor_rollout_ref.rollout.tensor_model_parallel_size, trainer.device,
    actor_rollout_ref.actor.router_replay.mode, actor_rollout_ref.model.lora.rank, actor_rollout_ref.model.lora.sync
    """
    arr = config.actor_rollout_ref
    r, lora = arr.rollout, arr.model.lora
    if r.name != "sglang" or config.trainer.device != "cpu":
        return
    where = "with rollout.name=sglang and trainer.device=cpu"
    if r.tensor_model_parallel_size > 1:
        yield (f"actor_rollout_ref.rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} {where}: "
               "SGLang on a CPU serves one TP rank per server (its CPU all-reduce is a compiled sgl_kernel op that "
               "PyPI lacks); set 1")
    if arr.actor.router_replay.mode == "R3":
        yield (f"actor_rollout_ref.actor.router_replay.mode=R3 {where}: SGLang 0.5.23 cannot return routed experts "
               "on a CPU (its capturer pins host memory through CUDA) and exits at start; use "
               "actor_rollout_ref.rollout.name=cpu")
    if lora.rank > 0 and lora.sync == "adapter":
        yield (f"actor_rollout_ref.model.lora.sync=adapter {where}: SGLang 0.5.23 cannot serve LoRA adapters on a "
               "CPU (its LoRA layers pin host memory, which needs CUDA) and exits at start; use lora.sync=merged or "
               "actor_rollout_ref.rollout.name=cpu")


def deterministic_inference_default(resume_mode: str, rollout_name: str, device: str) -> Optional[bool]:
    """`actor_rollout_ref.rollout.deterministic_inference` left unset: on unless resuming is off
    (the per-prompt sampling seeds that make a resume exact are read by SGLang 0.5.23 only in its
    deterministic mode, `sampling/sampling_batch_info.py`), and off where SGLang serves on a CPU,
    where that mode cannot start (`deterministic_inference_fits_device`). None while
    `trainer.device=auto`: the launch decides it again on the device it resolved."""
    if rollout_name == "sglang" and device == "auto":
        return None
    return resume_mode != "disable" and not (rollout_name == "sglang" and device == "cpu")


def deterministic_inference_fits_device(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """SGLang 0.5.23's deterministic inference takes only GPU attention backends
    (`srt/arg_groups/overrides.py::_deterministic_attention_backend`: ascend, fa3, fa4, flashinfer,
    intel_xpu, triton) and refuses the torch-native one a CPU uses, so the server would not start.
    Left unset it is off there (`validate.py`).

    Reads: actor_rollout_ref.rollout.name, actor_rollout_ref.rollout.deterministic_inference, trainer.device
    """
    r = config.actor_rollout_ref.rollout
    if r.name == "sglang" and config.trainer.device == "cpu" and r.deterministic_inference:
        yield ("actor_rollout_ref.rollout.deterministic_inference=true with rollout.name=sglang and trainer.device=cpu: "
               "SGLang's deterministic inference needs a GPU attention backend; set it false (a resumed run then "
               "samples anew) or use rollout.name=cpu, whose seeds always hold")


def rollout_engine_kwargs_are_sglangs(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """verl's engine_kwargs: SGLang 0.5.23's own server arguments for rollout.name=sglang, nothing
    megarl sets itself (megarl.config.engine_kwargs).

    Reads: actor_rollout_ref.rollout.engine_kwargs, actor_rollout_ref.rollout.name
    """
    r = config.actor_rollout_ref.rollout
    yield from engine_kwargs_problems(r.engine_kwargs, r.name)


def rollout_engine_kwargs_warnings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Warnings: verl's engine_kwargs.vllm / trtllm, ignored, and SGLang's deprecated switches, passed on
    (megarl.config.engine_kwargs.other_engines_kwargs, deprecated_sglang_kwargs).

    Reads: actor_rollout_ref.rollout.engine_kwargs
    """
    yield from other_engines_kwargs(config.actor_rollout_ref.rollout.engine_kwargs)
    yield from deprecated_sglang_kwargs(config.actor_rollout_ref.rollout.engine_kwargs)
