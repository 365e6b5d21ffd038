"""Per-GPU memory estimate of a plan: a first-order model to catch impossible jobs before they
queue, not a profiler. All figures are bytes unless a name says GiB.

Training role, per GPU (mixed precision with megatron DDP and Adam):
  parameters      stage_params / TP x dtype bytes (2 for bf16/fp16, 4 for fp32)
  gradients       stage_params / TP x 4 (fp32 grad buffer)
  optimizer       stage_params / TP x (8 for Adam m, v + 4 fp32 master copy unless fp32) / DP if the
                  distributed optimizer is on
  activations     seq x micro x hidden x 34 bytes per layer / TP (sequence-parallel layout, flash
                  attention), x layers on the stage, x PP micro-batches in flight on stage 0 (1F1B),
                  plus fp32 logits seq x micro x vocab / TP x 4
A reference model holds parameters and logits only. A rollout server reserves
`gpu_memory_utilization` of the GPU (SGLang's static pool: weights + KV cache).
Colocated, the peak is the larger of the training phase (all training states + the largest
activations, + the rollout pool if it is not released) and the rollout phase (rollout pool +
training states not offloaded).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megarl.config import ExperimentConfig
from megarl.config.schema import MegatronConfig
from megarl.placement.planner import Plan

GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelDims:
    vocab: int
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelDims":
        heads = cfg["num_attention_heads"]
        return cls(
            vocab=cfg["vocab_size"],
            hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            ffn=cfg["intermediate_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            tied=bool(cfg.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_checkpoint_dir(cls, path: str) -> "ModelDims | None":
        """Dims from DIR/config.json, or None when there is no such file."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            return None
        cfg = json.loads(config_file.read_text())
        return cls.from_hf_config(cfg.get("text_config", cfg))

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        return attention + 3 * self.hidden * self.ffn + 2 * self.hidden  # gated MLP + two norms

    @property
    def total_params(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def stage_params(self, pp: int) -> int:
        """Parameters of the largest pipeline stage (embedding on the first, output layer on the last)."""
        layers = math.ceil(self.layers / pp) * self.layer_params
        embed = self.vocab * self.hidden
        if pp == 1:
            return layers + embed * (1 if self.tied else 2) + self.hidden
        return layers + embed + self.hidden  # first or last stage: one vocab matrix each


@dataclass
class RoleMemory:
    role: str
    states: int  # parameters + gradients + optimizer: held across phases
    offloadable: int  # part of `states` moved to host when the role offloads
    activations: int  # transient, during its own forward/backward


@dataclass
class GpuEstimate:
    roles: list[RoleMemory]
    rollout_reserved: int
    kv_cache_needed_per_server: int
    peak: int
    gpu_memory: int

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_memory


def _train_role(name: str, dims: ModelDims, m: MegatronConfig, dp: int, dtype: str, seq: int, micro: int,
                trains: bool) -> RoleMemory:
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    params = dims.stage_params(pp) / tp
    weight_bytes = params * DTYPE_BYTES[dtype]
    logits = seq * micro * dims.vocab / tp * 4
    if not trains:
        return RoleMemory(name, int(weight_bytes), int(weight_bytes) if m.param_offload else 0, int(logits))
    grads = params * 4
    optimizer = params * (8 + (0 if dtype == "float32" else 4))
    if m.use_distributed_optimizer:
        optimizer /= dp
    offloadable = (weight_bytes if m.param_offload else 0) + (grads if m.grad_offload else 0) + (
        optimizer if m.optimizer_offload else 0)
    acts = seq * micro * dims.hidden * 34 / tp * math.ceil(dims.layers / pp) * pp + logits
    return RoleMemory(name, int(weight_bytes + grads + optimizer), int(offloadable), int(acts))


def estimate(plan: Plan, config: ExperimentConfig, dims: ModelDims) -> GpuEstimate:
    """The busiest GPU's estimate. `config` must be validated (resolved defaults)."""
    arr, placement = config.actor_rollout_ref, config.placement
    dtype = arr.model.dtype
    seq = config.data.max_prompt_length + config.data.max_response_length
    micro = arr.actor.ppo_micro_batch_size_per_gpu or 1
    roles = []
    if "actor" in plan.roles:
        roles.append(_train_role("actor", dims, arr.actor.megatron, plan.roles["actor"].dp, dtype, seq, micro, True))
    if "ref" in plan.roles:
        roles.append(_train_role("ref", dims, arr.ref.megatron, plan.roles["ref"].dp, dtype, seq,
                                 arr.ref.log_prob_micro_batch_size_per_gpu or 1, False))
    if "critic" in plan.roles:
        roles.append(_train_role("critic", dims, config.critic.megatron, plan.roles["critic"].dp, dtype, seq,
                                 config.critic.ppo_micro_batch_size_per_gpu or 1, True))
    if "reward_model" in plan.roles:
        roles.append(_train_role("reward_model", dims, config.reward_model.megatron, plan.roles["reward_model"].dp,
                                 dtype, seq, config.reward_model.micro_batch_size_per_gpu or 1, False))
    gpu_memory = int(placement.gpu_memory_gib * GIB)
    rollout = plan.roles["rollout"]
    reserved = int(arr.rollout.gpu_memory_utilization * gpu_memory)
    responses_per_server = math.ceil(config.data.train_batch_size * arr.rollout.n / rollout.dp)
    kv_heads_per_gpu = max(1, dims.kv_heads // rollout.tp)
    kv_needed = responses_per_server * seq * 2 * dims.layers * kv_heads_per_gpu * dims.head_dim * DTYPE_BYTES[
        arr.rollout.dtype]
    states = sum(r.states for r in roles)
    train_phase = states + max((r.activations for r in roles), default=0)
    if placement.mode == "split":
        peak = max(train_phase, reserved)
    else:
        if not arr.rollout.free_cache_engine:
            train_phase += reserved
        rollout_phase = reserved + states - sum(r.offloadable for r in roles)
        peak = max(train_phase, rollout_phase)
    return GpuEstimate(roles, reserved, int(kv_needed), int(peak), gpu_memory)


def format_estimate(est: GpuEstimate, plan: Plan, dims: ModelDims) -> str:
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    lines = [f"model: {dims.total_params / 1e9:.3f} B parameters ({dims.layers} layers, hidden {dims.hidden})"]
    for r in est.roles:
        lines.append(f"  {r.role:<13} states {gib(r.states):>12}  activations {gib(r.activations):>12}"
                     f"  offloadable {gib(r.offloadable):>12}")
    rollout = plan.roles["rollout"]
    lines.append(f"  {'rollout':<13} reserved {gib(est.rollout_reserved):>10}  (KV cache for a whole step's "
                 f"responses on one server of TP {rollout.tp}: {gib(est.kv_cache_needed_per_server)})")
    verdict = "fits" if est.fits else "DOES NOT FIT"
    lines.append(f"peak per GPU: {gib(est.peak)} of {gib(est.gpu_memory)} (placement.gpu_memory_gib): {verdict}")
    return "\n".join(lines)
