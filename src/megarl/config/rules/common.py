"""What several rules share: the GPU counts and data-parallel sizes derived once from the config,
and the messages for a number that must be positive or in a range."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from megarl.config.schema import ExperimentConfig, MegatronConfig


@dataclass(frozen=True)
class DerivedSizes:
    """GPU counts and data-parallel sizes that several rules need, derived once from the config.

    A size is 0 where the config makes it impossible (a rule says why).
    """

    total_gpus: int
    train_gpus: int
    rollout_gpus: int
    actor_dp: int
    critic_dp: int

    @classmethod
    def from_config(cls, config: ExperimentConfig) -> DerivedSizes:
        t, p, arr = config.trainer, config.placement, config.actor_rollout_ref
        total = t.nnodes * t.n_gpus_per_node if t.nnodes > 0 and t.n_gpus_per_node > 0 else 0
        teacher = teacher_pool_gpus(config)
        train = total - teacher if 0 <= teacher < total else 0
        if p.mode == "split":
            train = train - p.rollout_gpus if 0 < p.rollout_gpus < train else 0
        return cls(
            total_gpus=total,
            train_gpus=train,
            rollout_gpus=p.rollout_gpus if p.mode == "split" else train,
            actor_dp=data_parallel_size(arr.actor.megatron, train, t.n_gpus_per_node),
            critic_dp=data_parallel_size(config.critic.megatron, train, t.n_gpus_per_node),
        )


def teacher_pool_gpus(config: ExperimentConfig) -> int:
    """GPUs of the OPD teacher's own pool (`distillation.teacher.gpus` of an enabled Megatron
    teacher; 0: none, the teacher shares the training pool or is an SGLang server elsewhere)."""
    d = config.distillation
    return d.teacher.gpus if d.enabled and d.type == "megatron" else 0


def model_parallel_size(m: MegatronConfig) -> int:
    """GPUs per model replica: TP x PP x CP."""
    return m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size


def data_parallel_size(m: MegatronConfig, train_gpus: int, gpus_per_node: int) -> int:
    """The role's data-parallel size; 0 when its parallel sizes do not fit the GPUs."""
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if not train_gpus or min(tp, pp, cp) <= 0 or gpus_per_node % tp:
        return 0
    replica = model_parallel_size(m)
    return 0 if train_gpus % replica else train_gpus // replica


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of `n` that is <= `limit` (a size to suggest)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def positive(path: str, value, allow_minus_one: bool = False) -> Iterator[str]:
    """A message unless `value` is a positive integer (or -1 where allowed); None is not checked."""
    if value is None:
        return
    if allow_minus_one and value == -1:
        return
    if value <= 0:
        extra = " or -1 (never)" if allow_minus_one else ""
        yield f"{path}={value}: must be a positive integer{extra}"


def in_range(path: str, value, low: float, high: float, low_open: bool = False) -> Iterator[str]:
    """A message unless low <= value <= high (low < value when low_open); None is not checked."""
    if value is None:
        return
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        yield f"{path}={value}: must be in {bracket}{low}, {high}]"
