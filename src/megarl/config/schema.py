"""The experiment schema: verl's config groups as typed dataclasses.

Units are stated where a number could mean two things. Batch sizes named `*_batch_size` count
**prompts**; a prompt yields `actor_rollout_ref.rollout.n` responses. Micro-batch sizes named
`*_per_gpu` count **responses** (sequences) on one data-parallel rank.

Fields typed `dict[str, Any]` are free-form: `+a.b.new_key=value` may add keys below them. Every
other key is fixed by this schema, and an unknown one is an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "rloo",
    "remax",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "gpg",
)
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
DISTILLATION_LOSS_MODES = (*KL_TYPES, "forward_kl_topk")  # verl's distillation_loss.loss_mode (megarl.algos.opd)


# --------------------------------------------------------------------------------------------
# global_profiler.*, <role>.profiler.* (verl's profiler: verl/utils/profiler/config.py)
# --------------------------------------------------------------------------------------------
PROFILER_TOOLS = ("nsys", "npu", "torch", "torch_memory")
TORCH_PROFILER_CONTENTS = ("cuda", "cpu", "memory", "shapes", "stack")  # verl's TorchProfilerToolConfig


@dataclass
class NsysToolConfig:
    discrete: bool = False  # verl's NsightToolConfig: one capture per stage instead of per step


@dataclass
class NpuToolConfig:  # verl's NPUToolConfig (Ascend only: refused, megarl.config.rules.profiler)
    contents: list[str] = field(default_factory=list)
    level: str = "level0"
    analysis: bool = True
    discrete: bool = False


@dataclass
class TorchProfilerToolConfig:
    # what torch.profiler records (verl's TorchProfilerToolConfig.contents): cuda (CUDA activity), cpu (always
    # recorded), memory (profile_memory), shapes (record_shapes), stack (with_stack); empty: CPU and CUDA activity
    contents: list[str] = field(default_factory=list)
    discrete: bool = False  # verl: one trace per stage instead of one per step


@dataclass
class TorchMemoryToolConfig:  # verl's TorchMemoryToolConfig (torch.cuda.memory._record_memory_history)
    trace_alloc_max_entries: int = 100_000
    stack_depth: int = 32


@dataclass
class ProfilerToolConfigs:
    nsys: NsysToolConfig = field(default_factory=NsysToolConfig)
    npu: NpuToolConfig = field(default_factory=NpuToolConfig)
    torch: TorchProfilerToolConfig = field(default_factory=TorchProfilerToolConfig)
    torch_memory: TorchMemoryToolConfig = field(default_factory=TorchMemoryToolConfig)


@dataclass
class RoleProfilerConfig:
    """verl's per-role `profiler` (ProfilerConfig): whether this role's ranks are profiled in the
    steps of global_profiler.steps with global_profiler.tool."""

    enable: bool = False
    all_ranks: bool = False  # every rank of the role; false: `ranks`
    ranks: list[int] = field(default_factory=list)  # the role's ranks (0 .. its world size - 1); empty: rank 0
    tool_config: ProfilerToolConfigs = field(default_factory=ProfilerToolConfigs)


@dataclass
class GlobalProfilerConfig:
    """verl's `global_profiler`: which tool profiles, in which steps, and where its files go."""

    tool: Optional[Literal[PROFILER_TOOLS]] = None  # None: no profiling
    steps: Optional[list[int]] = None  # training steps (the first is 1, as in verl); None: none
    save_path: str = "outputs/profile"


# --------------------------------------------------------------------------------------------
# algorithm.*
# --------------------------------------------------------------------------------------------
@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000  # adaptive: steps over which the coefficient moves toward target_kl
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose `metric` is equal for every response."""

    enable: bool = False
    metric: str = "acc"
    max_num_gen_batches: int = 0  # 0: no cap on extra generation rounds


@dataclass
class DPOConfig:
    """Direct preference optimisation (`python -m megarl.trainer.main_dpo`)."""

    beta: float = 0.1  # strength of the implicit KL to the reference model
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"  # sigmoid: Rafailov et al. 2023; ipo: Azar et al. 2023
    label_smoothing: float = 0.0  # > 0: conservative DPO (sigmoid only)


@dataclass
class RolloutCorrectionConfig:
    """Corrections of the rollout/trainer mismatch from the rollout's log-probs, verl 0.9.1's
    `algorithm.rollout_correction` (megarl.algos.rollout_correction; verl's presets:
    megarl.config.rollout_correction_presets). Decoupled mode (the default): the trainer's old
    log-probs are computed before the update (actor_rollout_ref.actor.old_log_probs_in_update does
    not apply), the weights and the rejection mask once per batch before the advantages. Bypass
    mode: the rollout's log-probs are the old ones, without the trainer's pass; both are made per
    micro-batch in the loss from the current policy's log-probs."""

    # importance weights per token or per sequence (the product of the tokens' ratios); null: none
    rollout_is: Optional[Literal["token", "sequence"]] = None
    # a number C: truncated IS, weight min(rho, C); "lower_upper" (e.g. "0.5_2.0"): IcePop, weight
    # rho inside [lower, upper] and 0 outside. A band needs a decimal point in its upper bound:
    # YAML reads 0.5_2 as the number 0.52
    rollout_is_threshold: str = "2.0"
    # divide the weights by their batch mean (over tokens, or over rows at sequence level)
    rollout_is_batch_normalize: bool = False
    # rejection: comma-separated options, all of which must keep a token (verl's names, e.g.
    # "token_k1", "seq_mean_k3", "token_k1,seq_max_k2"): token_* per token, seq_sum/seq_mean/seq_max_*
    # whole rows, of k1 (the ratio), k2 ((log rho)^2 / 2) or k3 (rho - 1 - log rho); null: none
    rollout_rs: Optional[str] = None
    # one threshold for every option or one per option, comma-separated: a k1 option's ratio band
    # "lower_upper" (e.g. "0.5_2.0") or a number U for [1/U, U]; a k2/k3 option's upper bound
    rollout_rs_threshold: Optional[str] = None
    # true: the rollout's log-probs are the old ones (no trainer pass before the update)
    bypass_mode: bool = False
    # bypass mode's policy loss: ppo_clip (the PPO ratio to the rollout policy, no weights) or
    # reinforce (-A * w * log pi with the rollout_is weights, no clipping)
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"

    @property
    def enabled(self) -> bool:
        """Whether a correction is on (importance weights or a mask)."""
        return self.rollout_is is not None or self.rollout_rs is not None


@dataclass
class AlgorithmConfig:
    adv_estimator: Literal[ADV_ESTIMATORS] = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True  # False gives Dr.GRPO
    use_kl_in_reward: bool = False
    kl_penalty: Literal[KL_TYPES] = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


# --------------------------------------------------------------------------------------------
# data.*
# --------------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    tokenizer: Optional[str] = None  # default: the model's own tokenizer
    train_files: list[str] = field(default_factory=list)  # parquet; a single path is accepted
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    response_key: str = "response"  # SFT data: the reference response column
    # SFT data as chats (verl's MultiTurnSFTDataset): the column of {role, content} messages, trained on the
    # assistant turns (megarl.data.conversations); null: prompt_key + response_key
    messages_key: Optional[str] = None
    max_length: int = 1024  # tokens of a whole chat (messages_key data), limited by `truncation`
    # messages_key data: a chat whose turns, rendered one by one, differ from the whole chat rendered at once
    # (e.g. Qwen3's <think> on the last turn) trains on the turns one by one; false: refused
    ignore_input_ids_mismatch: bool = False
    chosen_key: str = "chosen"  # DPO data: the preferred response column
    rejected_key: str = "rejected"  # DPO data: the dispreferred response column
    reward_fn_key: str = "data_source"
    # verl's multimodal columns (its RLHFDataset's defaults): megarl trains text-only models, so a data file
    # whose image or video column holds a value is refused before any process starts (megarl.trainer.inputs),
    # rather than trained without its images
    image_key: str = "images"
    video_key: str = "videos"
    max_prompt_length: int = 512  # tokens
    max_response_length: int = 512  # tokens
    train_batch_size: int = 1024  # prompts per RL step
    # prompts per generation round; differs from train_batch_size only with DAPO's dynamic sampling
    # (algorithm.filter_groups), which generates rounds until train_batch_size groups are kept
    gen_batch_size: Optional[int] = None  # None: train_batch_size
    val_batch_size: Optional[int] = None  # prompts; None: the whole validation set at once
    shuffle: bool = True
    seed: int = 1
    filter_overlong_prompts: bool = True
    truncation: Literal["error", "left", "right"] = "error"  # when not filtering overlong prompts
    return_raw_chat: bool = False
    # variables of the chat template (verl's key), e.g. {enable_thinking: false} for Qwen3: every prompt
    # rendered (RL, SFT, DPO data; the agents' endpoint, where a call's chat_template_kwargs override them)
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # A dataset by name instead of train_files/val_files (docs/environments.md): "reasoning_gym:<task>", written
    # as verl parquet (train: source_seed, val: source_seed + 1) before any process starts, to source_dir
    # (null: <trainer.default_local_dir>/data/<task>-<hash of these keys>; kept and reused when it exists)
    source: Optional[str] = None
    source_config: dict[str, Any] = field(default_factory=dict)  # the task's config (its config class's fields)
    source_train_size: int = 1000  # rows
    source_val_size: int = 64  # rows
    source_seed: int = 0
    source_system_prompt: Optional[str] = None  # a system message before each question
    source_dir: Optional[str] = None

    @property
    def prompts_per_generation(self) -> int:
        """Prompts drawn per generation round: gen_batch_size, or train_batch_size."""
        return self.gen_batch_size or self.train_batch_size


# --------------------------------------------------------------------------------------------
# Megatron parallelism and optimizer, shared by actor, reference, critic, reward model.
# --------------------------------------------------------------------------------------------
@dataclass
class QatConfig:
    """verl's quantization-aware training (engine/megatron.yaml `qat`), the actor's only: NVFP4 fake
    quantization of its Megatron linears' weights in the forward (megarl.engines.megatron.qat),
    pushed to the rollout servers as the same dequantized values (docs/running.md, QAT)."""

    enable: bool = False
    mode: Literal["w4a16", "w4a4"] = "w4a16"  # w4a16 only (w4a4's activation quantization is not built)
    group_size: int = 16  # NVFP4's group along a weight's input dimension (NVFP4 requires 16)
    # fnmatch patterns of the linears left in full precision, matched against "<megatron module
    # name>.weight_quantizer" (verl's ModelOpt names; "lm_head" and "*mlp.gate" mean the output layer and
    # the MoE routers, which ModelOpt leaves out anyway)
    ignore_patterns: list[str] = field(default_factory=lambda: ["lm_head", "*mlp.gate"])
    activation_observer: Optional[str] = None  # verl: W4A4 only
    # verl's quantization config JSON for its vLLM servers (verl-recipe qat/config/nvfp4_w4a16_megatron.json):
    # read and checked (NVFP4, the group size); megarl's servers get the dequantized weights
    quantization_config_path: Optional[str] = None


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # each sequence split over CP GPUs in megatron's 2 x CP chunk layout (megarl.engines.megatron.context_parallel);
    # on GPUs transformer-engine's attention, its communication `override_transformer_config.cp_comm_type`
    context_parallel_size: int = 1
    # MoE models: experts of a layer spread over EP ranks; each expert split over ETP ranks
    # (null: TP, megatron's default). Ignored by dense models (EP must then be 1).
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    # megatron-core's sequence parallelism: the activations outside attention and the MLP split along
    # the sequence over the TP ranks (micro-batches padded to a multiple of TP). Off at TP 1, as in verl
    # (megarl.engines.megatron.parallel.sequence_parallel_on); not with LoRA; an MoE actor at TP > 1 needs it.
    sequence_parallel: bool = False
    # MoE router losses (megatron TransformerConfig's names): load-balancing (aux) loss and z-loss
    # coefficients; 0 / null: off. Only training roles use them.
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    # MoE experts as one grouped GEMM (megatron's TEGroupedMLP) or one MLP each (SequentialMLP);
    # null: grouped wherever it can run (CUDA with transformer-engine layers), megarl.config.expert_mlp
    moe_grouped_gemm: Optional[bool] = None
    use_distributed_optimizer: bool = True
    # verl's Megatron-FSDP (ZeRO-3: parameters, gradients and optimizer state sharded over DP; megatron-core's
    # DistributedDataParallelConfig.use_megatron_fsdp). On a trained role megarl shards the same way with PyTorch
    # FSDP2, as use_torch_fsdp2 below (with a warning: megatron-core's own Megatron-FSDP is CUDA-only and not
    # built; use_distributed_optimizer, which megatron-core's requires, is then not read). No effect on a
    # forward-only role (megarl.config.rules.fsdp2)
    use_megatron_fsdp: bool = False
    # PyTorch FSDP2 (megatron-LM's --use-torch-fsdp2; verl's Megatron Lite impl_cfg.optimizer=fsdp2) on a trained
    # role in place of megatron's DDP and optimizer: parameters (float32), gradients and AdamW state sharded by
    # torch's fully_shard over the DP x CP ranks (each transformer layer, then the model chunk), clipped by the
    # global gradient norm (megarl.engines.megatron.fsdp2; with PP / VPP each stage over its own DP x CP ranks).
    # MoE experts over megatron's expert-DP group. Needs use_distributed_optimizer=false. Not built yet with
    # sequence parallelism, LoRA, QAT, MTP training, fp16, SGD, the optim.override_optimizer_config fields it does
    # not run or background checkpoint writes (megarl.config.rules.fsdp2). Offload moves the shards. No effect on
    # a forward-only role.
    use_torch_fsdp2: bool = False
    # megatron-core `TransformerConfig` fields set on top of megarl's own (verl's key), e.g. activation
    # recompute: recompute_granularity (full | selective), recompute_method (uniform | block, full only),
    # recompute_num_layers, recompute_modules (selective). Each name must be a field of the installed
    # megatron-core's TransformerConfig (checked by the preflight / --dry-run and when the engine builds); a
    # name megarl sets from another key (the layout above, model.dtype, enable_gradient_checkpointing, the
    # model's config.json) is refused where it differs (megarl.config.transformer_overrides). The reference's
    # {} means the actor's, as in verl.
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    seed: int = 42
    # verl's initial weights from a megatron-core distributed checkpoint (engine/megatron.yaml): the
    # directory `dist_checkpointing.save(model.sharded_state_dict(), dir)` wrote (verl's
    # scripts/converter_hf_to_mcore.py), the architecture and tokenizer still from the role's model path.
    # The actor and the reference only (a critic or reward model is built from an HF checkpoint).
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: Optional[str] = None
    qat: QatConfig = field(default_factory=QatConfig)


@dataclass
class OptimConfig:
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-6
    min_lr_ratio: float = 0.0
    # the learning rate the decay ends at, absolute (megatron's OptimizerParamScheduler min_lr, verl's Megatron
    # key); null: lr x min_lr_ratio
    min_lr: Optional[float] = None
    lr_warmup_steps: int = -1  # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    # the decay after warm-up (verl's Megatron key lr_decay_style means the same), over lr_decay_steps
    warmup_style: Literal["constant", "cosine", "linear"] = "constant"
    total_training_steps: int = -1  # -1: filled in from the trainer's step count
    # updates over which the learning rate decays to final_lr(), warm-up included (megatron's
    # OptimizerParamScheduler lr_decay_steps; verl's Megatron key); null: total_training_steps. Past it the
    # rate stays at the minimum
    lr_decay_steps: Optional[int] = None
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    clip_grad: float = 1.0
    # megatron-core `OptimizerConfig` fields set on top of megarl's own (verl's key), e.g. the optimizer's CPU
    # offload (optimizer_cpu_offload, optimizer_offload_fraction, overlap_cpu_optimizer_d2h_h2d) or the
    # precision-aware optimizer (use_precision_aware_optimizer, exp_avg_dtype, ...; both GPU-only, refused on a
    # CPU: megarl.config.devices.CUDA_ONLY_OPTIMIZER_FIELDS). Each name must be a field
    # of the installed megatron-core's OptimizerConfig (checked by the preflight / --dry-run and when the
    # engine builds); a name megarl sets from another key (lr, weight_decay, betas, clip_grad, the dtype, the
    # distributed optimizer) is refused where it differs (megarl.engines.megatron.optim.optimizer_kwargs)
    override_optimizer_config: dict[str, Any] = field(default_factory=dict)

    def final_lr(self) -> float:
        """The learning rate the decay ends at: min_lr, else lr x min_lr_ratio."""
        return self.lr * self.min_lr_ratio if self.min_lr is None else self.min_lr

    def schedule_steps(self) -> tuple[int, int]:
        """(warm-up, decay) updates of megatron's OptimizerParamScheduler, as verl reads these keys
        (verl/utils/megatron/optimizer.py `get_megatron_optimizer_param_scheduler`): the decay runs over
        lr_decay_steps, else total_training_steps, and a warm-up ratio is a fraction of it. decay <= 0:
        neither is known (then a ratio gives no warm-up here)."""
        decay = self.total_training_steps if self.lr_decay_steps is None else self.lr_decay_steps
        if self.lr_warmup_steps >= 0:
            return self.lr_warmup_steps, decay
        if self.lr_warmup_steps_ratio > 0 and decay > 0:
            return int(self.lr_warmup_steps_ratio * decay), decay
        return 0, decay


# --------------------------------------------------------------------------------------------
# actor_rollout_ref.*
# --------------------------------------------------------------------------------------------
# PEFT's names of the linear layers a LoRA adapter can target (megatron: q/k/v -> linear_qkv,
# o -> linear_proj, gate/up -> linear_fc1, down -> linear_fc2); "all-linear" means all seven
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    rank: int = 0  # adapter rank r; 0: no LoRA (full fine-tuning)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # PEFT's lora_dropout: on the adapters' input in training passes (log-prob passes: none)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # PEFT names, or ["all-linear"]
    # A's initial values (B starts at 0): kaiming, PEFT's U(+-1/sqrt(in)); xavier, Megatron-Bridge's (verl's
    # Megatron LoRA, its default) N(0, 2 / (in + rank)) (megarl.engines.megatron.lora.initial_factor)
    lora_A_init_method: Literal["kaiming", "xavier"] = "kaiming"
    sync: Literal["merged", "adapter"] = "merged"  # merged: push base + scale x B A as full weights
    # sync=adapter, how the adapters reach the servers: tensors: in the request (SGLang's
    # /load_lora_adapter_from_tensors, no shared filesystem); disk: a PEFT directory under
    # trainer.default_local_dir/lora_sync that every server reads (/load_lora_adapter)
    sync_via: Literal["tensors", "disk"] = "tensors"


@dataclass
class MtpConfig:
    """verl's `model.mtp` (verl/workers/config/model.py MtpConfig): the checkpoint's multi-token-prediction
    layers. Read only with `enable`. enable_rollout: SGLang drafts with them (speculative decoding,
    `speculative_*` as SGLang's --speculative-* flags); enable_train: the actor builds them in megatron-core's
    MTP block and trains them (megarl.engines.megatron.mtp); method / num_speculative_tokens are vLLM's."""
    enable: bool = False
    enable_train: bool = False
    enable_rollout: bool = False
    detach_encoder: bool = False  # training: the MTP loss reaches neither the embedding nor the main decoder
    mtp_loss_scaling_factor: float = 0.1  # training: megatron-core's mtp_loss_scaling_factor
    speculative_algorithm: str = "EAGLE"  # SGLang's --speculative-algorithm: EAGLE or NEXTN (its alias)
    speculative_num_steps: int = 3  # draft steps per verification
    speculative_eagle_topk: int = 1  # draft branches per step
    speculative_num_draft_tokens: int = 4  # tokens verified per step (SGLang: num_steps + 1 when topk is 1)
    method: str = "mtp"  # vLLM's speculative method
    num_speculative_tokens: int = 1  # vLLM's


@dataclass
class ModelConfig:
    path: str = ""  # HF checkpoint directory (or hub id on machines that can download)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    tokenizer_path: Optional[str] = None
    trust_remote_code: bool = False
    # activation recompute of the actor and the critic: full, every layer (megatron's recompute_granularity=full,
    # recompute_method=uniform, recompute_num_layers=1); finer choices: <role>.megatron.override_transformer_config
    enable_gradient_checkpointing: bool = False
    override_config: dict[str, Any] = field(default_factory=dict)  # free-form HF config overrides
    lora: LoraConfig = field(default_factory=LoraConfig)  # the actor's adapters (the reference stays the base)
    mtp: MtpConfig = field(default_factory=MtpConfig)  # multi-token prediction (megarl.config.rules.mtp)


@dataclass
class PolicyLossConfig:
    # gspo: sequence-level importance ratios; gpg: the plain policy gradient -A log pi; dppo_tv / dppo_kl: PPO's
    # ratio clip replaced by a trust region on the token's probability (clip_ratio_low/high its TV / binary-KL
    # thresholds, clip_ratio_c the truncation of the ratio); sapo: a smooth gate (actor.tau_pos / tau_neg);
    # cispo: the clipped ratio weighs -A log pi; clip_cov / kl_cov: PPO with the gradient cut / a KL penalty on
    # high-covariance tokens; geo_mean (GMPO): each response's geometric-mean ratio; dro: -A log pi plus a
    # quadratic log-ratio penalty. megarl.algos.losses.policy_loss; verl 0.9.1's names and defaults
    loss_mode: Literal["vanilla", "gspo", "gpg", "dppo_tv", "dppo_kl", "sapo", "cispo", "clip_cov", "kl_cov",
                       "geo_mean", "dro"] = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: the share of valid tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: the covariance range (lb, ub) the cut tokens are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: the share of valid tokens (largest covariance) penalised
    ppo_kl_coef: float = 0.1  # kl_cov: the penalty's coefficient on |log ratio|
    dro_beta: Optional[float] = None  # dro: the quadratic penalty's coefficient, required (> 0) with loss_mode=dro


@dataclass
class RouterReplayConfig:
    """Routing replay for MoE models (verl's `actor_rollout_ref.actor.router_replay.mode`):
    "R3" replays the experts the rollout engine routed each token to in the actor's log-prob and
    update passes; "disabled": the trainer routes on its own."""

    mode: Literal["disabled", "R3"] = "disabled"


@dataclass
class CheckpointConfig:
    """What a role's checkpoints hold (verl's `actor.checkpoint` / `critic.checkpoint`,
    verl/trainer/config/config.py CheckpointConfig): `save_contents` of model (megatron's sharded
    weights), optimizer (its state and the learning-rate schedule), extra (RNG states) and hf_model
    (an HF copy, `<checkpoint>/actor_hf`); `load_contents` what a resume loads of them (None: what the
    checkpoint holds, its run's save_contents; megarl.checkpoint.loads_optimizer);
    megarl.config.rules.checkpoint says which lists load.
    `async_save`: the role's state written by megatron's asynchronous dist-checkpoint save while
    training goes on, the checkpoint committed once every such write finished
    (megarl.checkpoint.Checkpoints). `strict` (verl: Megatron-Bridge's check that the HF copy holds
    exactly the model's tensors) and `save_lora_only` (verl: adapter-only checkpoints, read by its FSDP
    manager only): rules.checkpoint.checkpoint_export_options."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: Optional[list[str]] = None
    async_save: bool = False
    strict: bool = True
    save_lora_only: bool = False


@dataclass
class ActorConfig:
    strategy: Literal["megatron"] = "megatron"
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n responses)
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # responses per forward/backward
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384  # tokens per micro-batch when use_dynamic_bsz
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # None: clip_ratio
    clip_ratio_high: Optional[float] = None  # None: clip_ratio (DAPO clip-higher sets e.g. 0.28)
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (dppo_*: the ratio's truncation)
    # truncated importance sampling: weight each token's policy loss by
    # min(exp(old_log_prob - rollout_log_prob), cap) to correct rollout/trainer mismatch; -1: off.
    # verl <= 0.5's key; verl 0.9 spells it algorithm.rollout_correction.rollout_is=token with
    # rollout_is_threshold=cap (set one of the two). This one works inside the update, with
    # old_log_probs_in_update
    tis_imp_ratio_cap: float = -1.0
    # the PPO ratio's old log-probs are the rollout's own (verl's use_rollout_log_probs, slime's
    # --use-rollout-logprobs): the ratio is then the importance weight to the behaviour policy and the
    # clip a trust region around it; false: the trainer's, recomputed before the update (decoupled PPO)
    use_rollout_log_probs: bool = False
    # the update makes the PPO ratio's old log-probs itself: the first mini-batch's are its own
    # training forward's, detached (the weights have not moved yet: its ratio is exactly 1), the
    # other rows' come from a no-grad pass before the first optimizer step; saves the forward over
    # the first mini-batch's rows and a call (megarl.engines.megatron.old_log_probs). Applies
    # where nothing needs them before the update: not with algorithm.use_kl_in_reward,
    # use_rollout_log_probs, algorithm.rollout_correction or distillation (then, and in critic_warmup steps, a
    # separate pass as with false); with algorithm.rollout_correction.bypass_mode there is no pass
    old_log_probs_in_update: bool = True
    # megarl's key: the update's forward and backward leave out the rows whose advantages are all exactly 0
    # (GRPO groups of equal rewards), which add exactly 0 to the policy loss and its gradient; the loss keeps
    # the whole mini-batch's token and sequence counts, and the mini-batches and optimizer steps stay those
    # of the whole batch, so the update is the same (to float rounding). auto: where that is exact (no KL
    # loss, entropy bonus, direct distillation, MTP loss, MoE router loss: megarl.config.rules.skip_rows; and
    # not where the trainer's own pass made the old log-probs before the update, which its first pass then
    # recomputes bit for bit);
    # true: refused where not exact; false (the default): every row. Metrics of the update's forward
    # (pg_clipfrac, ppo_kl, entropy, tis_*, bypass mode's rollout_corr/*, tokens) are then over the rows
    # trained, verl's over every row, hence off by default; actor/rows_trained_frac says how many
    skip_zero_advantage_rows: Literal["auto", True, False] = False
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"
    # policy_loss.loss_mode=sapo's gate temperatures for tokens with advantage > 0 / <= 0 (verl's keys, here as there)
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: Literal[KL_TYPES] = "low_var_kl"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # responses; None: actor's
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)


@dataclass
class ValSamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    do_sample: bool = False


@dataclass
class AgentJudgeConfig:
    """LLM-as-judge for agent episodes that return no score: a judge model behind an
    OpenAI-compatible URL ranks each group of trajectories."""

    url: Optional[str] = None  # e.g. http://judge-host:30000/v1; None: no judge
    model: str = "judge"
    api_key_env: Optional[str] = None  # the environment variable holding the key; None: no key
    max_tokens: int = 512


@dataclass
class AgentConfig:
    """Agentic rollouts: the user's `async def <name>(client, sample) -> reward | dict` in the file
    `path` talks to megarl's OpenAI-compatible endpoint for as many turns as it likes."""

    path: Optional[str] = None  # a Python file; None: plain single-turn generation
    name: str = "run_episode"
    max_turns: int = 8  # model calls per episode
    max_tokens_per_episode: int = 4096  # prompt + generated tokens of the whole trajectory
    episode_timeout_s: float = 300.0
    max_concurrent_episodes: int = 64
    host: str = "127.0.0.1"  # where the OpenAI-compatible endpoint listens
    port: int = 0  # 0: a free port
    judge: AgentJudgeConfig = field(default_factory=AgentJudgeConfig)


@dataclass
class RolloutConfig:
    name: Literal["sglang", "cpu"] = "sglang"  # cpu: megarl's CPU engine speaking SGLang's protocol
    n: int = 1  # responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    do_sample: bool = True
    # verl's key: every request (validation's too) keeps generating past EOS up to its length limit;
    # SGLang's sampling_params.ignore_eos (verl's vLLM server sets it on every request:
    # verl/workers/rollout/vllm_rollout/vllm_async_server.py, sampling_params.setdefault("ignore_eos", ...))
    ignore_eos: bool = False
    prompt_length: Optional[int] = None  # None: data.max_prompt_length
    response_length: Optional[int] = None  # None: data.max_response_length
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # verl's key: fp8 serves block-FP8 weights (e4m3 values, 128 x 128 blocks, float32 weight_scale_inv:
    # megarl.rollout.fp8) while training stays in its own precision: megarl writes the servers' first
    # checkpoint in FP8 (trainer.default_local_dir/rollout_fp8) and quantizes every push; null: `dtype`
    quantization: Optional[Literal["fp8"]] = None
    tensor_model_parallel_size: int = 1  # GPUs per rollout server
    # verl's key, SGLang's --ep-size: the ranks each MoE layer's routed experts are split over inside one server.
    # SGLang 0.5.23 lays them over the server's TP ranks (no GPU is added), so it divides tensor_model_parallel_size;
    # 1: no split. The CPU engine serves a model in one process: 1 only.
    expert_parallel_size: int = 1
    # SGLang's --attn-dp-size (alias --attention-data-parallel-size): attention runs data parallel inside one server,
    # its tensor_model_parallel_size GPUs split into this many groups of tensor_model_parallel_size / this ranks,
    # each with its own requests and KV cache, while the MLP and experts span all of them (no GPU is added).
    # verl's rollout data_parallel_size with expert_parallel_size > 1 means this. 1: none. SGLang on GPUs only.
    attention_data_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5  # fraction of GPU memory SGLang may take
    free_cache_engine: bool = True  # release KV cache while training (colocated)
    max_concurrent_requests: int = 256  # in-flight /generate requests per client
    request_timeout_s: float = 600.0
    # seconds a rollout server (and each restart of one) may take to answer /health after its process
    # starts; None: megarl.rollout.launch.server_startup_timeout_s decides (longer for SGLang on GPUs)
    server_startup_timeout_s: Optional[float] = None
    # the environment variable holding the API key of the rollout servers and the router (SGLang's --api-key);
    # None: a fresh random key for each run. The key itself is never in a config, a log or a metric.
    api_key_env: Optional[str] = None
    max_server_restarts: int = 3  # per server over the run; a dead server beyond this stops the run
    # name=sglang: the Python interpreter that runs the SGLang servers, where SGLang lives in an environment of
    # its own (on a CPU, `make install-sglang`'s .venv-sglang/bin/python); None: the rollout workers' own
    server_python: Optional[str] = None
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # responses, for old log-probs
    # verl's keys of the old-log-prob pass (the actor's compute_log_prob, and the no-grad pass of
    # actor.old_log_probs_in_update): micro-batches under a token budget per GPU instead of
    # log_prob_micro_batch_size_per_gpu responses; null: the actor's use_dynamic_bsz / ppo_max_token_len_per_gpu
    log_prob_use_dynamic_bsz: Optional[bool] = None
    log_prob_max_token_len_per_gpu: Optional[int] = None  # tokens
    update_weights_bucket_megabytes: int = 512
    # auto: tensor (CUDA IPC) colocated on GPUs with SGLang, else distributed (NCCL on GPUs, gloo on CPU);
    # megarl.config.devices decides it
    weight_sync_transport: Literal["auto", "distributed", "tensor", "disk"] = "auto"
    # distributed transport: per_stage, one weight-update group per actor pipeline stage, sent by DP replica 0
    # (slime's and AReaL's layout; plus one per EP rank's experts at EP > 1); per_emitter, one per DP replica x
    # stage, each replica sending its share of the buckets: faster resharding, but every rollout server rank then
    # holds PP x DP NCCL communicators, whose buffers lie outside SGLang's mem_fraction_static (docs/gpu.md;
    # `megarl plan` prints the count). The tensor and disk transports make no groups and ignore it.
    weight_update_groups: Literal["per_stage", "per_emitter"] = "per_stage"
    # after every push, compare each server's per-tensor checksums (SGLang's /weights_checker) with the
    # HF tensors the actor sent; a difference stops the run naming tensor and server. CPU engine only.
    check_weight_update: bool = False
    # verl's key: prefix caching, SGLang's radix cache (on by default in SGLang; false passes its
    # --disable-radix-cache). The CPU engine's counterpart: one prefill per distinct prompt of a batch,
    # its keys and values copied to the prompt's samples; false prefills every sample on its own.
    enable_prefix_caching: bool = True
    # verl's key: extra server arguments, {sglang: {arg: value}}: each one of SGLang 0.5.23's command-line server
    # arguments (by its ServerArgs name), put on the command of every SGLang server megarl launches; one megarl sets
    # itself, vllm / trtllm and anything for the CPU engine are refused (megarl.config.engine_kwargs)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # CPU engine: each generation sends every server its prompts in one batched /generate (a list of
    # prompts with their sampling_params), straight to the server, instead of one request per prompt
    # through the router (whose batches take one sampling_params, which cannot hold each prompt's
    # seed); the servers then start a batch at once. Fewer requests, no router hop; a dead server's
    # batch is retried and then sent again after its restart, not moved to another server. Not with
    # SGLang (it prefills a batch's prompts one after the other when n > 1), agents (their turns are
    # single requests) or routing replay (routes are read per prompt's request).
    batch_requests_per_server: bool = False
    # SGLang's --enable-deterministic-inference, the only mode in which it honours the per-prompt
    # sampling seeds that make a resumed run exact; None: on unless trainer.resume_mode=disable, off
    # where SGLang serves on a CPU (with trainer.device=auto: decided at launch on the resolved device).
    # Costs generation speed (docs/checkpoints.md). The CPU engine always honours seeds.
    deterministic_inference: Optional[bool] = None
    val_kwargs: ValSamplingConfig = field(default_factory=ValSamplingConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # seconds (verl's key): the bound of every collective of the training worlds, megatron's groups,
    # checkpoint saves/loads and the weight-update groups. 1800 is megatron-core's own
    # distributed_timeout_minutes=30 default, which fits a large model's slowest legitimate collective
    # (a checkpoint's gathers, the first NCCL communicator set-up).
    nccl_timeout: float = 1800.0


# --------------------------------------------------------------------------------------------
# critic.*, reward_model.*, custom_reward_function.*
# --------------------------------------------------------------------------------------------
@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # None: actor_rollout_ref.model.path
    tokenizer_path: Optional[str] = None
    override_config: dict[str, Any] = field(default_factory=dict)
    lora: LoraConfig = field(default_factory=LoraConfig)  # the critic's adapters (its value head trains whole)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None: on exactly when algorithm.adv_estimator is gae
    strategy: Literal["megatron"] = "megatron"
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: Optional[int] = None  # prompts; None: actor's
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # responses
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    ppo_epochs: Optional[int] = None  # None: actor's
    cliprange_value: float = 0.5
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)


@dataclass
class RewardModelSubConfig:
    path: Optional[str] = None
    input_tokenizer: Optional[str] = None  # None: the model's own


@dataclass
class RewardModelConfig:
    enable: bool = False
    strategy: Literal["megatron"] = "megatron"
    model: RewardModelSubConfig = field(default_factory=RewardModelSubConfig)
    micro_batch_size_per_gpu: Optional[int] = None  # responses
    # tokens the reward model reads: must hold a whole prompt + response (it scores the policy's
    # tokens as they are, never truncated); None: no check
    max_length: Optional[int] = None
    reward_manager: Literal["naive", "dapo"] = "naive"
    overlong_buffer_len: int = 0  # DAPO soft overlong penalty window (tokens); 0: off
    overlong_penalty_factor: float = 1.0
    add_rule_reward: bool = False  # true: score = reward model + rule/custom reward; false: reward model alone
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None  # a Python file
    name: str = "compute_score"  # fn(data_source, solution_str, ground_truth, extra_info)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 60.0  # per sample, for whichever score function is used; a late sample scores 0


# --------------------------------------------------------------------------------------------
# distillation.* (on-policy distillation, OPD)
# --------------------------------------------------------------------------------------------
@dataclass
class TeacherConfig:
    """The OPD teacher (`distillation.teacher`): a frozen model whose tokenizer is the student's."""

    # HF checkpoint directory (verl's teacher_models.<name>.model_path). type=megatron: the teacher
    # loaded on the training GPUs; type=sglang: the model the server serves (its tokenizer is checked)
    model_path: str = ""
    # type=megatron: 0 puts the teacher on the reference's GPUs (the training pool, colocated and
    # offloaded like the reference); N > 0 gives it a pool of its own, the last N GPUs
    gpus: int = 0
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # type=megatron: its own TP/PP/EP layout
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # responses; None: the actor's ppo_micro_batch_size_per_gpu
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    # type=sglang: the teacher's SGLang server or router (slime's --rm-url for --opd-type sglang), e.g.
    # http://teacher-host:30000; it scores prompt + response with SGLang's input log-probs
    url: Optional[str] = None
    # type=sglang: the environment variable holding the key of the teacher's server (its --api-key); None: no
    # key. The key itself is never in a config, a log or a metric.
    api_key_env: Optional[str] = None
    max_concurrent_requests: int = 64  # type=sglang: scoring requests in flight
    request_timeout_s: float = 600.0


@dataclass
class DistillationConfig:
    """On-policy distillation (megarl.algos.opd): the teacher scores the student's sampled tokens and
    the per-token reverse KL, log p_student - log p_teacher, enters the advantage."""

    enabled: bool = False  # verl's distillation.enabled; slime's --use-opd
    type: Literal["megatron", "sglang"] = "megatron"  # slime's --opd-type
    kl_coef: float = 1.0  # slime's --opd-kl-coef: advantage - kl_coef x reverse KL
    # verl's distillation.distillation_loss.use_task_rewards: true, OPD + RL (the estimator's advantage
    # minus the KL term); false, pure OPD (the advantage is -kl_coef x reverse KL; rollout.n=1 works)
    use_task_rewards: bool = True
    # verl's distillation.distillation_loss.*: the per-token loss (megarl.algos.opd): k1 (kl), abs, k2 (mse),
    # k3 (low_var_kl) of the sampled token, or forward_kl_topk over the teacher's `topk` tokens per position
    loss_mode: Literal[DISTILLATION_LOSS_MODES] = "k1"
    # true: the loss in the advantage (reward -loss, above); false: backpropagated directly, added to the policy
    # loss times kl_coef (use_task_rewards=true) or alone (false)
    use_policy_gradient: bool = True
    topk: int = 32  # forward_kl_topk: the teacher's most likely tokens per position
    loss_max_clamp: Optional[float] = None  # the per-token loss clamped to [-c, c]; None: not clamped
    log_prob_min_clamp: Optional[float] = None  # forward_kl_topk: both log-probs floored here first; None: not
    teacher: TeacherConfig = field(default_factory=TeacherConfig)


# --------------------------------------------------------------------------------------------
# trainer.*, placement.*
# --------------------------------------------------------------------------------------------
@dataclass
class TrainerConfig:
    project_name: str = "megarl"
    experiment_name: str = "default"
    nnodes: int = 1
    n_gpus_per_node: int = 8  # logical GPUs on machines without one
    device: Literal["auto", "cuda", "cpu"] = "auto"
    total_epochs: int = 1
    total_training_steps: Optional[int] = None  # None: epochs x batches per epoch
    logger: list[str] = field(default_factory=lambda: ["console"])
    log_val_generations: int = 0
    val_before_train: bool = True
    test_freq: int = -1  # steps; -1: never
    save_freq: int = -1  # steps; -1: never
    critic_warmup: int = 0  # steps that update only the critic
    balance_batch: bool = True
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: Optional[str] = None
    default_local_dir: str = "checkpoints"  # checkpoints go to <dir>/<project>/<experiment>/
    max_actor_ckpt_to_keep: Optional[int] = None  # None: keep all
    max_critic_ckpt_to_keep: Optional[int] = None
    seed: int = 1
    max_consecutive_skipped_steps: int = 3  # updates skipped for non-finite loss/grads before the run stops
    # environment variables of every Ray worker the run starts (training ranks, rollout servers and the
    # processes they start): Ray's job-level runtime_env, which each worker's own env_vars extend
    worker_env: dict[str, str] = field(default_factory=dict)


@dataclass
class PlacementConfig:
    """How the trainer.nnodes x trainer.n_gpus_per_node GPUs are shared out.

    colocate: every role time-shares all GPUs. split: rollout servers get `rollout_gpus` GPUs
    and the training roles (actor, critic, reference, reward model) share the rest.
    """

    mode: Literal["colocate", "split"] = "colocate"
    rollout_gpus: int = 0  # split only
    gpu_memory_gib: float = 80.0  # per GPU, for `megarl plan`'s memory estimate


@dataclass
class AsyncTrainingConfig:
    """How generation overlaps training (verl's `async_training.*` in spirit; see
    megarl.trainer.async_rollout). sync: generate -> train -> push, strictly in turn.
    one_step_off: step k+1's batch generates with weights k while step k trains (staleness 1).
    fully_async: a producer generates batches whenever the servers are free, at most
    `max_staleness` weight versions ahead of training; split placement only."""

    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    max_staleness: int = 1  # weight versions (updates) a trained sample may lag the actor; fully_async
    stale_samples: Literal["drop", "regenerate"] = "drop"  # a batch past the bound: dropped, or generated again
    # fully_async: a push aborts the running generation (/pause_generation), and its samples continue
    # with the new weights after it (per-token versions), instead of the push waiting for it
    partial_rollout: bool = False


@dataclass
class ExperimentConfig:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
