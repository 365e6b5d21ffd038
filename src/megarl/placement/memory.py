"""Per-GPU memory estimate of a plan: a first-order model to catch impossible jobs before they
queue, not a profiler. All figures are bytes unless a name says GiB.

Training role, per GPU (mixed precision with megatron DDP and Adam):
  parameters      stage_params / TP x dtype bytes (2 for bf16/fp16, 4 for fp32); MoE experts are
                  split over EP x ETP ranks instead of TP (and their optimizer over the expert-DP
                  ranks, TP x CP x DP / (EP x ETP))
  gradients       stage_params / TP x 4 (fp32 grad buffer)
  optimizer       stage_params / TP x (8 for Adam m, v + 4 fp32 master copy unless fp32) / (DP x CP) if
                  the distributed optimizer is on (megatron-core shards it over the data-and-context-
                  parallel group, `dp_cp_group` in optimizer/__init__.py: CP ranks hold the same weights)
  activations     per layer and micro-batch, s = seq / CP tokens on the GPU (context parallelism splits every
                  sequence over its CP ranks), b = micro, h = hidden (Korthikanti et al. 2022, "Reducing
                  Activation Recomputation in Large Transformer Models", table 2, with flash attention's
                  scores term 5as/h dropped: it stores none):
                    with sequence parallelism (TP > 1):  A = s x b x h x 34 / TP bytes
                    without it:                          A = s x b x h x (10 + 24 / TP) bytes (layer norms,
                                                         dropouts and the residual are replicated over TP)
                  x L layers on the stage, x PP micro-batches in flight on stage 0 (1F1B),
                  plus fp32 logits s x b x vocab / TP x 4 (vocab-parallel, with or without SP).
                  Full activation recompute (`recompute_granularity=full`: the role's
                  `megatron.override_transformer_config`, or `model.enable_gradient_checkpointing`) keeps
                  of a recomputed layer only its input, I = s x b x h x dtype bytes (/ TP with sequence
                  parallelism, which splits it; the paper's 2sbh), and rematerialises one chunk of one
                  micro-batch at a time in its backward:
                    uniform, N layers a chunk:  PP x ceil(L / N) x I  +  min(N, L) x A
                    block, first N layers:      PP x (n x I + (L - n) x A)  +  A,  n = min(N, L)
                  (block: an upper bound by at most one layer's A). Selective recompute (megatron's default
                  module, core attention) changes nothing here: with flash attention A already leaves out
                  the attention scores it drops (the paper's sections 4.1-4.2).
With LoRA (`actor_rollout_ref.model.lora.rank` or `critic.model.lora.rank` > 0) the role's base weights
are frozen: they hold parameters only (no gradient buffer, no optimizer state), and gradients and
Adam states are those of the adapters (`lora_params`; the critic's also of its [1, H] value head),
whose activations are not counted apart (rank << hidden).
A reference model holds parameters and logits only, and so does an on-policy-distillation teacher
(its own architecture and layout, `distillation.teacher`; on a pool of its own, phase `teacher_pool`).
A rollout server reserves `gpu_memory_utilization` of the GPU (SGLang's static pool: weights + KV
cache); of its weights a GPU holds (`server_gpu_params`) the dense part / rollout TP (its attention /
attention TP = TP / `rollout.attention_data_parallel_size`) and, of an MoE, E / EP whole experts per
layer, each split over MoE TP = TP / EP ranks (`rollout.expert_parallel_size`).
Colocated, the peak is the largest of three phases (`colocation.COLOCATED_ORDER`, the order the
trainer executes):
  training   all training states + the largest activations (+ the rollout pool if the servers
             keep it: `rollout.free_cache_engine` false)
  push       the training states left on the GPU once the planned roles offloaded all but the
             actor's parameters (the push reads those) + the servers' weights, resumed
             (`server_gpu_params` x rollout dtype bytes) + the push's own buffers: one
             bucket and its copy for the server (`update_weights_bucket_megabytes` each; gpt-oss:
             at least a layer's experts, which one bucket holds fused) and the
             largest tensor gathered whole (the vocabulary matrix); the KV cache is still released
             (the servers keep their whole pool when they do not release it)
  rollout    rollout pool + training states not offloaded
What is offloaded is `colocation.offload_plan`, the plan the trainer executes: nothing in split
placement, parameters only for the reference model, nothing for the reward model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from megarl.bridge import ModelArch
from megarl.bridge.errors import ConversionError
from megarl.bridge.fused_experts import fuses_experts
from megarl.bridge.sharding import ParallelLayout, stage_layers
from megarl.config import ExperimentConfig
from megarl.config.rules.fsdp2 import fsdp2_switch
from megarl.config.rules.lora import lora_targets
from megarl.config.schema import MegatronConfig
from megarl.config.transformer_overrides import Recompute, recompute_of, role_overrides
from megarl.placement.colocation import OffloadParts, offload_plan
from megarl.placement.planner import Plan

GIB = 1024**3
TRAINED = ("actor", "critic")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def expert_layer_params(arch: ModelArch, experts: int = 0) -> int:
    """Parameters of `experts` routed experts of one layer (gated MLPs, with gpt-oss's biases
    [2F] and [H] each); 0 for a dense model."""
    if not arch.moe:
        return 0
    h, f = arch.hidden_size, arch.moe.expert_ffn_hidden_size
    return (3 * h * f + ((2 * f + h) if arch.linear_bias else 0)) * experts


def attention_params(arch: ModelArch) -> int:
    """Parameters of one layer's attention and its two norms, with the q/k/v biases where the model has them
    (`qkv_bias`: Qwen2's), gpt-oss's biases on every linear (q/k/v and o) and its sinks (one logit per head). Multi-latent attention
    (HF DeepseekV3Attention): q_a [ql, H] + its norm + q_b [heads x (nope + rope), ql] (or one q_proj),
    kv_a [kvl + rope, H] + its norm, kv_b [heads x (nope + v), kvl], o [H, heads x v]."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    if arch.mla is not None:
        m = arch.mla
        q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.q_head_dim if m.q_lora_rank
             else h * heads * m.q_head_dim)
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * heads * (
            m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h + 2 * h
    q, kv = heads * arch.kv_channels, arch.num_query_groups * arch.kv_channels
    biases = ((q + 2 * kv + h if arch.linear_bias else q + 2 * kv if arch.qkv_bias else 0)
              + (heads if arch.attention_sinks else 0))
    return h * q + 2 * h * kv + q * h + 2 * h + biases


def moe_layers(arch: ModelArch) -> int:
    """Layers with experts (DeepSeek-V3's first `first_k_dense_replace` layers are dense)."""
    return sum(arch.is_moe_layer(i) for i in range(arch.num_layers))


def moe_layer_non_expert_params(arch: ModelArch) -> int:
    """Parameters of one MoE layer outside its routed experts: attention, two norms, the router (with
    gpt-oss's bias), the shared expert and its gate."""
    h = arch.hidden_size
    shared = 3 * h * arch.moe.shared_expert_ffn_hidden_size + (h if arch.moe.shared_expert else 0)
    router_bias = arch.moe.num_experts if arch.linear_bias else 0
    return attention_params(arch) + arch.moe.num_experts * h + router_bias + shared


def dense_layer_params(arch: ModelArch) -> int:
    """Parameters of one decoder layer outside its routed experts: attention, two norms, and the
    gated MLP (dense) or router + shared expert and its gate (MoE). With dense first layers in an MoE
    model, the larger of a dense layer's and an MoE layer's (per-stage bounds)."""
    dense = attention_params(arch) + 3 * arch.hidden_size * arch.ffn_hidden_size
    if arch.moe is None:
        return dense
    moe = moe_layer_non_expert_params(arch)
    return max(dense, moe) if arch.moe.first_dense_layers else moe


def kv_layer_tokens(arch: ModelArch, seq: int) -> int:
    """Key/value rows (summed over layers) one sequence of `seq` tokens keeps in a rollout server's
    KV cache: every layer holds all its tokens, except where windows alternate with full layers
    (gpt-oss's `layer_types`): SGLang 0.5.23 serves those models with a hybrid sliding-window pool
    (configs/model_config.py `SWA_SINK_ARCHS`, `is_hybrid_swa_model`), whose windowed layers keep
    the last `sliding_window` tokens only."""
    if arch.window_layers is None or arch.sliding_window is None:
        return arch.num_layers * seq
    windowed = sum(arch.window_layers)
    return (arch.num_layers - windowed) * seq + windowed * min(seq, arch.sliding_window)


def layer_params(arch: ModelArch) -> int:
    """Parameters of one decoder layer (all experts of an MoE layer)."""
    return dense_layer_params(arch) + expert_layer_params(arch, arch.moe.num_experts if arch.moe else 0)


def _non_expert_params(arch: ModelArch) -> int:
    """Parameters of all layers outside their routed experts (dense first layers counted as dense)."""
    dense = attention_params(arch) + 3 * arch.hidden_size * arch.ffn_hidden_size
    if arch.moe is None:
        return arch.num_layers * dense
    return (arch.num_layers - moe_layers(arch)) * dense + moe_layers(arch) * moe_layer_non_expert_params(arch)


def server_gpu_params(arch: ModelArch, tp: int, ep: int, attn_dp: int = 1) -> float:
    """Parameters one GPU of a rollout server of `tp` GPUs and expert parallel size `ep` holds
    (SGLang 0.5.23): the dense part (attention, embeddings, norms, router, shared expert) over its TP
    ranks; the routed experts of a layer over its EP ranks, E / EP whole experts each
    (`layers/moe/fused_moe_triton/layer.py`: num_local_experts = E / ep_size), each expert's width
    over the MoE TP = TP / EP ranks (`runtime_context.derive_parallel_widths`). Their product is TP,
    so EP changes how a GPU's experts are cut (fewer experts, wider slices), not how much it holds.
    With `attn_dp` attention groups (--attn-dp-size) each layer's attention is split over a group's
    attention TP = TP / attn_dp ranks only (`models/qwen3_moe.py` Qwen3MoeAttention: its qkv and output
    projections in parallel_group "attn_tp", heads / attn_tp_size), so every group holds it whole."""
    experts = arch.moe.num_experts if arch.moe else 0
    dense = total_params(arch) - moe_layers(arch) * expert_layer_params(arch, experts)
    attention = arch.num_layers * attention_params(arch)
    return ((dense - attention) / tp + attention / (tp // attn_dp)
            + moe_layers(arch) * expert_layer_params(arch, experts // ep) / (tp // ep))


def active_params(arch: ModelArch) -> int:
    """Parameters one token passes through: every expert layer counts only its top-k experts."""
    topk = arch.moe.topk if arch.moe else 0
    layers = _non_expert_params(arch) + moe_layers(arch) * expert_layer_params(arch, topk)
    embed = arch.vocab_size * arch.hidden_size
    return layers + embed * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size


def total_params(arch: ModelArch) -> int:
    embed = arch.vocab_size * arch.hidden_size
    layers = _non_expert_params(arch) + moe_layers(arch) * expert_layer_params(arch, arch.moe.num_experts if arch.moe else 0)
    return layers + embed * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size


def kv_elements_per_token_layer(arch: ModelArch, tp: int) -> int:
    """KV-cache elements one token takes in one layer on one GPU of a `tp`-GPU SGLang server: keys and
    values of its KV heads (at least one per GPU), or with multi-latent attention the latent and the
    rope key, kv_lora_rank + qk_rope_head_dim, whole on every TP rank (SGLang 0.5.23
    mem_cache/memory_pool.py `MLATokenToKVPool`: one [kv_lora_rank + qk_rope_head_dim] row per token
    and layer; its attention backends read the latent whole on each rank)."""
    if arch.mla is not None:
        return arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim
    return 2 * max(1, arch.num_query_groups // tp) * arch.kv_channels


def most_stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None,
                      embedding_in_split: bool = False, loss_in_split: bool = False) -> int:
    """Layers of the pipeline stage holding the most, as megatron-core splits them
    (`megarl.bridge.sharding.stage_layers`; `first` / `last`: num_layers_in_first/last_pipeline_stage;
    `embedding_in_split` / `loss_in_split`: account_for_embedding/loss_in_pipeline_split).
    A split megatron refuses (the engine names it when it builds) is counted as ceil(layers / pp)."""
    try:
        return max(stage_layers(num_layers, ParallelLayout(pp=pp, first_stage_layers=first, last_stage_layers=last,
                                                           embedding_in_split=embedding_in_split,
                                                           loss_in_split=loss_in_split)))
    except ConversionError:
        return math.ceil(num_layers / pp)


def stage_layers_of(arch: ModelArch, m: MegatronConfig) -> int:
    """`most_stage_layers` of a role's `megatron` section."""
    overrides = m.override_transformer_config
    return most_stage_layers(arch.num_layers, m.pipeline_model_parallel_size,
                             overrides.get("num_layers_in_first_pipeline_stage"),
                             overrides.get("num_layers_in_last_pipeline_stage"),
                             bool(overrides.get("account_for_embedding_in_pipeline_split", False)),
                             bool(overrides.get("account_for_loss_in_pipeline_split", False)))


def stage_params(arch: ModelArch, pp: int, stage_layers: int | None = None) -> int:
    """Parameters of the largest pipeline stage (embedding on the first, output layer on the last),
    routed experts excluded (`stage_expert_params`); `stage_layers`: its layers (None: an even split)."""
    layers = (stage_layers or math.ceil(arch.num_layers / pp)) * dense_layer_params(arch)
    if pp == 1:
        return layers + root_params(arch)
    return layers + arch.vocab_size * arch.hidden_size + arch.hidden_size  # first or last stage: one vocab matrix each


def root_params(arch: ModelArch) -> int:
    """Parameters outside the decoder layers of a one-stage model: the embedding, the output layer
    (none when tied) and the final norm."""
    return arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size


def lora_params(arch: ModelArch, rank: int, targets, tp: int, pp: int, stage_layers: int | None = None) -> int:
    """Adapter parameters of one rank of the largest pipeline stage: per target A [r, in] and
    B [out, r]; a column-parallel base (q/k/v, gate/up) splits B over TP, a row-parallel one
    (o, down) splits A (megarl.bridge.lora)."""
    from megarl.bridge.lora import TARGETS

    q, kv, h, f = (arch.num_attention_heads * arch.kv_channels, arch.num_query_groups * arch.kv_channels,
                   arch.hidden_size, arch.ffn_hidden_size)
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (f, h),
              "up_proj": (f, h), "down_proj": (h, f)}  # (out, in)
    per_layer = 0
    for target in targets:
        out, inp = shapes[target]
        column = TARGETS[target][1]
        per_layer += rank * inp + out * rank / tp if column else rank * inp / tp + out * rank
    return int((stage_layers or math.ceil(arch.num_layers / pp)) * per_layer)


def stage_expert_params(arch: ModelArch, pp: int, stage_layers: int | None = None) -> int:
    """Routed-expert parameters of the largest pipeline stage (0 for a dense model)."""
    layers = stage_layers or math.ceil(arch.num_layers / pp)
    return layers * expert_layer_params(arch, arch.moe.num_experts if arch.moe else 0)


def layer_activation_bytes(tokens: float, micro: int, hidden: int, tp: int, sp: bool,
                           dtype_bytes: int) -> tuple[float, float]:
    """(A, I): bytes one decoder layer keeps of one micro-batch for its backward, and bytes of its
    input alone (what full recompute keeps), on one GPU holding `tokens` tokens of each sequence
    (seq / CP). Korthikanti et al. 2022 table 2, flash attention (no 5as/h scores term): with
    sequence parallelism A = sbh x 34 / TP and the input is split over TP; without it only the
    attention and MLP internals (24 sbh) are split, the layer norms, dropouts and residual
    (10 sbh) and the input are replicated on every TP rank."""
    sbh = tokens * micro * hidden
    if sp:
        return sbh * 34 / tp, sbh * dtype_bytes / tp
    return sbh * (10 + 24 / tp), sbh * dtype_bytes


def activation_label(tp: int, cp: int, sp: bool) -> str:
    """How a trained role's activations are divided, for the plan: 'activations / CP 2, / TP 4 with
    sequence parallelism', 'activations / CP 2, TP 4 without sequence parallelism: 10 sbh of 34
    replicated', or '' at TP 1 and CP 1."""
    parts = [f"/ CP {cp}"] if cp > 1 else []
    if tp > 1:
        parts.append(f"/ TP {tp} with sequence parallelism" if sp else
                     f"TP {tp} without sequence parallelism: 10 sbh of 34 replicated")
    return "activations " + ", ".join(parts) if parts else ""


ACTIVATION_SOURCE = ("activations per layer (Korthikanti et al. 2022, table 2, flash attention): 34 sbh / TP bytes with "
                     "sequence parallelism, sbh (10 + 24 / TP) without; s = sequence / CP")


def stage_activations(layers: int, pp: int, layer_bytes: float, input_bytes: float, recompute: Recompute) -> float:
    """Activation bytes of the busiest stage in training (see the module docstring): `layers` L on
    the stage, `pp` micro-batches in flight, `layer_bytes` A of one layer and one micro-batch,
    `input_bytes` I of one layer's input."""
    if recompute.granularity != "full":
        return pp * layers * layer_bytes
    n = min(recompute.num_layers, layers)
    if recompute.method == "uniform":
        return pp * math.ceil(layers / recompute.num_layers) * input_bytes + n * layer_bytes
    return pp * (n * input_bytes + (layers - n) * layer_bytes) + (layer_bytes if n else 0)  # block


def recompute_label(recompute: Recompute) -> str:
    """'full recompute: uniform, 1 layer(s) a chunk', ..., or '' when off."""
    if recompute.granularity == "full":
        unit = "a chunk" if recompute.method == "uniform" else "a stage"
        return f"full recompute: {recompute.method}, {recompute.num_layers} layer(s) {unit}"
    if recompute.granularity == "selective":
        return f"selective recompute: {', '.join(recompute.modules)}"
    return ""


@dataclass
class RoleMemory:
    role: str
    states: int  # parameters + gradients + optimizer: held across phases
    offloadable: int  # part of `states` moved to host when the role offloads
    activations: int  # transient, during its own forward/backward
    trainable: int | None = None  # LoRA: adapter parameters on this GPU (the rest frozen); None: all train
    offloadable_params: int = 0  # the parameters' part of `offloadable` (the actor's move after the push)
    recompute: str = ""  # `recompute_label` of a trained role's activation recompute
    split: str = ""  # `activation_label` of a trained role: how CP, TP and SP divide its activations


@dataclass
class GpuEstimate:
    roles: list[RoleMemory]
    rollout_reserved: int
    kv_cache_needed_per_server: int
    peak: int
    gpu_memory: int
    phases: dict[str, int] = field(default_factory=dict)  # {"training", "push", "rollout": peak bytes per GPU}
    server_weights: int = 0  # one rollout server GPU's weights (`server_gpu_params`), inside `rollout_reserved`

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_memory


def _train_role(name: str, arch: ModelArch, m: MegatronConfig, dp: int, dtype: str, seq: int, micro: int,
                trains: bool, offload: OffloadParts, trainable: int | None = None,
                recompute: Recompute = Recompute()) -> RoleMemory:
    """`trainable`: parameters with gradients and optimizer state on this GPU (LoRA's adapters,
    held in `dtype` beside the frozen base); None: all of them. `recompute`: a trained role's
    activation recompute."""
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    sp = m.sequence_parallel and tp > 1
    ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size or tp
    layers = stage_layers_of(arch, m)
    expert_params = stage_expert_params(arch, pp, layers) / (ep * etp)
    dense_params = stage_params(arch, pp, layers) / tp
    params = dense_params + expert_params
    logits = seq / cp * micro * arch.vocab_size / tp * 4
    if not trains:
        weight_bytes = params * DTYPE_BYTES[dtype]
        offloaded = int(weight_bytes) if offload.params else 0
        return RoleMemory(name, int(weight_bytes), offloaded, int(logits), offloadable_params=offloaded)
    layer, layer_input = layer_activation_bytes(seq / cp, micro, arch.hidden_size, tp, sp, DTYPE_BYTES[dtype])
    acts = stage_activations(layers, pp, layer, layer_input, recompute) + logits
    labels = (recompute_label(recompute), activation_label(tp, cp, sp))
    if fsdp2_switch(m) is not None:  # an offload moves the float32 shards: 4 bytes a parameter each, 8 AdamW's
        shard = fsdp2_shard_params(m, dp, dense_params, expert_params)
        moved = shard * (4 * offload.params + 4 * offload.grads + 8 * offload.optimizer)
        return RoleMemory(name, int(fsdp2_states(arch, m, dp, dtype, dense_params, expert_params)), int(moved),
                          int(acts), None, int(shard * 4) if offload.params else 0, *labels)
    if trainable is not None:  # LoRA: the adapters' gradients and optimizer states, over DP
        params, weight_bytes = trainable, (params + trainable) * DTYPE_BYTES[dtype]
        dense_params, expert_params = trainable, 0
    else:
        weight_bytes = params * DTYPE_BYTES[dtype]
    grads = params * 4
    per_param = 8 + (0 if dtype == "float32" else 4)
    optimizer = params * per_param
    if m.use_distributed_optimizer:  # dense states over DP x CP, expert states over expert-DP = TP x CP x DP / (EP x ETP)
        optimizer = dense_params * per_param / (dp * cp) + expert_params * per_param / max(1, tp * cp * dp // (ep * etp))
    offloadable = (weight_bytes if offload.params else 0) + (grads if offload.grads else 0) + (
        optimizer if offload.optimizer else 0)
    return RoleMemory(name, int(weight_bytes + grads + optimizer), int(offloadable), int(acts), trainable,
                      int(weight_bytes) if offload.params else 0, *labels)


def fsdp2_shard_params(m: MegatronConfig, dp: int, dense_params: float, expert_params: float) -> float:
    """Parameters of a GPU's FSDP2 shards (megarl.engines.megatron.fsdp2): `dense_params` (its TP rank's, of its
    pipeline stage) sharded over the DP x CP ranks, `expert_params` (its EP x ETP rank's routed experts) over
    megatron's expert-DP ranks, TP x CP x DP / (EP x ETP)."""
    tp, cp = m.tensor_model_parallel_size, m.context_parallel_size
    ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size or tp
    return dense_params / (dp * cp) + expert_params / max(1, tp * cp * dp // (ep * etp))


def fsdp2_states(arch: ModelArch, m: MegatronConfig, dp: int, dtype: str, dense_params: float,
                 expert_params: float = 0.0) -> float:
    """Bytes a GPU holds for a role trained with FSDP2 (`megatron.use_torch_fsdp2` / `use_megatron_fsdp`,
    megarl.engines.megatron.fsdp2), `dense_params` its TP rank's parameters of its pipeline stage outside the
    routed experts, `expert_params` its EP x ETP rank's experts: the float32 shards of the parameters, their
    gradients and AdamW's two moments (16 bytes a parameter of `fsdp2_shard_params`); whole, in the model's
    dtype, the root module (embedding, output layer, final norm: FSDP2 keeps the root gathered after its
    forward; with PP counted whole, a bound of the first stage's embedding and the last stage's output layer)
    and the one transformer layer being gathered (an MoE layer: its non-expert part and its experts module,
    this rank's EP x ETP share), with its float32 gradient before the reduce-scatter."""
    tp = m.tensor_model_parallel_size
    ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size or tp
    experts = expert_layer_params(arch, arch.moe.num_experts) if arch.moe else 0
    layer = dense_layer_params(arch) / tp + experts / (ep * etp)
    root = root_params(arch) / tp
    shard = fsdp2_shard_params(m, dp, dense_params, expert_params)
    return shard * 16 + (root + layer) * DTYPE_BYTES[dtype] + layer * 4


def _lora_trainable(arch: ModelArch, lora, megatron_cfg) -> int | None:
    """A role's adapter parameters per GPU (None: no LoRA, every weight trains)."""
    if lora.rank <= 0:
        return None
    return lora_params(arch, lora.rank, lora_targets(lora.target_modules), megatron_cfg.tensor_model_parallel_size,
                       megatron_cfg.pipeline_model_parallel_size, stage_layers_of(arch, megatron_cfg))


def _recompute(m: MegatronConfig, gradient_checkpointing: bool) -> Recompute:
    """A trained role's activation recompute (megarl.config.transformer_overrides)."""
    return recompute_of(role_overrides(m.override_transformer_config, gradient_checkpointing))


def estimate(plan: Plan, config: ExperimentConfig, arch: ModelArch,
             teacher_arch: ModelArch | None = None) -> GpuEstimate:
    """The busiest GPU's estimate. `config` must be validated (resolved defaults). A plan with an
    on-policy-distillation teacher needs its architecture (`teacher_arch`): on the training pool
    it counts as a reference does (parameters and logits, its parameters offloaded as planned);
    on a pool of its own it is the phase `teacher_pool` of those GPUs."""
    arr, placement = config.actor_rollout_ref, config.placement
    dtype = arr.model.dtype
    seq = config.data.max_prompt_length + config.data.max_response_length
    micro = arr.actor.ppo_micro_batch_size_per_gpu or 1
    offloads = offload_plan(config, plan.roles)
    roles = []
    if "actor" in plan.roles:
        m = arr.actor.megatron
        roles.append(_train_role("actor", arch, m, plan.roles["actor"].dp, dtype, seq, micro, True,
                                 offloads.get("actor", OffloadParts()), _lora_trainable(arch, arr.model.lora, m),
                                 _recompute(m, arr.model.enable_gradient_checkpointing)))
    if "ref" in plan.roles:
        roles.append(_train_role("ref", arch, arr.ref.megatron, plan.roles["ref"].dp, dtype, seq,
                                 arr.ref.log_prob_micro_batch_size_per_gpu or 1, False, offloads.get("ref", OffloadParts())))
    if "critic" in plan.roles:
        m, lora = config.critic.megatron, config.critic.model.lora
        head = arch.hidden_size if lora.rank > 0 else 0  # a LoRA critic's value head [1, H] trains too
        trainable = _lora_trainable(arch, lora, m)
        roles.append(_train_role("critic", arch, m, plan.roles["critic"].dp, dtype, seq,
                                 config.critic.ppo_micro_batch_size_per_gpu or 1, True,
                                 offloads.get("critic", OffloadParts()), None if trainable is None else trainable + head,
                                 _recompute(m, arr.model.enable_gradient_checkpointing)))
    if "reward_model" in plan.roles:
        roles.append(_train_role("reward_model", arch, config.reward_model.megatron, plan.roles["reward_model"].dp,
                                 dtype, seq, config.reward_model.micro_batch_size_per_gpu or 1, False,
                                 offloads.get("reward_model", OffloadParts())))
    own_teacher = None
    if "teacher" in plan.roles:
        if teacher_arch is None:
            raise ValueError("the plan places a distillation teacher: give its architecture (teacher_arch)")
        t = config.distillation.teacher
        teacher = _train_role("teacher", teacher_arch, t.megatron, plan.roles["teacher"].dp, dtype, seq,
                              t.log_prob_micro_batch_size_per_gpu or 1, False, offloads.get("teacher", OffloadParts()))
        if plan.roles["teacher"].pool == plan.roles["actor"].pool:
            roles.append(teacher)
        else:
            own_teacher = teacher
    gpu_memory = int(placement.gpu_memory_gib * GIB)
    states = sum(r.states for r in roles)
    train_phase = states + max((r.activations for r in roles), default=0)
    rollout = plan.roles.get("rollout")
    if rollout is None:  # an offline trainer (SFT, DPO)
        return GpuEstimate(roles, 0, 0, int(train_phase), gpu_memory)
    reserved = int(arr.rollout.gpu_memory_utilization * gpu_memory)
    # with attention DP each of a server's attn_dp groups runs its own scheduler and KV pool over its
    # TP / attn_dp ranks (SGLang 0.5.23 fields/parallel.py attn_dp_size: "one scheduler each"), and holds
    # the KV of the responses sent to it: a step's responses spread over the groups
    responses_per_group = math.ceil(config.data.prompts_per_generation * arr.rollout.n / (rollout.dp * rollout.attn_dp))
    kv_needed = responses_per_group * kv_layer_tokens(arch, seq) * \
        kv_elements_per_token_layer(arch, rollout.tp // rollout.attn_dp) * DTYPE_BYTES[arr.rollout.dtype]
    server_weights = server_gpu_params(arch, rollout.tp, rollout.ep, rollout.attn_dp) * DTYPE_BYTES[arr.rollout.dtype]
    if placement.mode == "split":
        phases = {"training": train_phase, "rollout": reserved}
    else:
        releases = arr.rollout.free_cache_engine
        if not releases:
            train_phase += reserved
        offloaded = sum(r.offloadable for r in roles)
        actor_params = next((r.offloadable_params for r in roles if r.role == "actor"), 0)
        bucket = arr.rollout.update_weights_bucket_megabytes * 2**20
        if fuses_experts(arch):  # gpt-oss: a layer's experts, fused, go in one bucket (sync/resharder.py)
            bucket = max(bucket, expert_layer_params(arch, arch.moe.num_experts) * DTYPE_BYTES[arr.rollout.dtype])
        push_buffers = 2 * bucket + arch.vocab_size * arch.hidden_size * DTYPE_BYTES[arr.rollout.dtype]
        push_phase = (states - offloaded + actor_params + server_weights if releases else states + reserved) + push_buffers
        phases = {"training": train_phase, "push": push_phase, "rollout": reserved + states - offloaded}
    if own_teacher is not None:
        phases["teacher_pool"] = own_teacher.states + own_teacher.activations
        roles.append(own_teacher)  # listed; its GPUs are its own
    phases = {name: int(b) for name, b in phases.items()}
    return GpuEstimate(roles, reserved, int(kv_needed), max(phases.values()), gpu_memory, phases, int(server_weights))


def _count(n: int) -> str:
    """'14.770 B', '302.1 M', '12,345'."""
    if n >= 1e9:
        return f"{n / 1e9:.3f} B"
    if n >= 1e6:
        return f"{n / 1e6:.1f} M"
    return f"{n:,}"


def format_estimate(est: GpuEstimate, plan: Plan, arch: ModelArch) -> str:
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    lines = [f"model: {_count(total_params(arch))} parameters ({arch.num_layers} layers, hidden {arch.hidden_size})"]
    if arch.moe:
        lines[0] += f", {_count(active_params(arch))} active ({arch.moe.topk} of {arch.moe.num_experts} experts per token)"
    for r in est.roles:
        lines.append(f"  {r.role:<13} states {gib(r.states):>12}  activations {gib(r.activations):>12}"
                     f"  offloadable {gib(r.offloadable):>12}"
                     + "".join(f"  ({note})" for note in (r.split, r.recompute) if note))
        if r.trainable is not None:
            lines.append(f"  {'':<13} LoRA: {r.trainable / 1e6:.1f} M trainable parameters per GPU; the frozen base "
                         "holds no gradients or optimizer state")
    if "rollout" in plan.roles:
        server = plan.roles["rollout"]
        lines.append(f"  {'rollout':<13} reserved {gib(est.rollout_reserved):>10}  (SGLang's static pool: weights "
                     f"{gib(est.server_weights)} per GPU and KV cache)")
        if arch.moe:
            moe_tp = server.tp // server.ep
            cut = "whole" if moe_tp == 1 else f"split over {moe_tp} GPUs"
            lines.append(f"  {'':<13} experts per server GPU: {arch.moe.num_experts // server.ep} of "
                         f"{arch.moe.num_experts} per layer, each {cut} (EP {server.ep} x MoE TP {moe_tp} = TP {server.tp})")
        lines.append(f"  a whole step's responses at once would need {gib(est.kv_cache_needed_per_server)} of KV cache "
                     f"per GPU of a TP {plan.roles['rollout'].tp} server; SGLang runs what its pool holds and queues the "
                     "rest (slower, not a failure; not part of the verdict)")
    if any(r.role in TRAINED for r in est.roles):  # their activations follow the paper's formula
        lines.append(f"  {ACTIVATION_SOURCE}")
    if len(est.phases) > 2:  # colocated: the training, push and rollout phases share the GPU (or a teacher pool)
        lines.append("  phases per GPU: " + ", ".join(f"{name} {gib(b)}" for name, b in est.phases.items()))
    verdict = "fits" if est.fits else "DOES NOT FIT"
    lines.append(f"peak per GPU: {gib(est.peak)} of {gib(est.gpu_memory)} (placement.gpu_memory_gib): {verdict}")
    return "\n".join(lines)
