"""`MegatronEngine`: one role's megatron-core model on this rank, and what every role does with it.

It builds the model chunks (from an HF or `torch_dist` checkpoint, via the bridge) and composes
the parts that use them: `schedule` runs micro-batches through megatron's pipeline schedules with
a head on the last stage, `training` holds the update's parts (loss scaling, the non-finite
check), `metrics` reduces the loss heads' metrics, `offload` moves memory to the host and back,
`checkpoint_io` saves and loads distributed checkpoints. The role classes in `roles.py` add the
config plumbing and the heads.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from megarl.bridge import WeightMap
from megarl.config.fp8_training import DEFAULT_RECIPE, fp8_device_problem, fp8_format
from megarl.config.rules.fsdp2 import fsdp2_switch
from megarl.config.transformer_overrides import role_overrides
from megarl.data.batch import Batch
from megarl.engines.megatron import checkpoint_io, fsdp2, fsdp2_checkpoint
from megarl.engines.megatron.expert_counts import ExpertCounter
from megarl.engines.megatron.metrics import broadcast_from_last_stage, reduce_over_micro_batches
from megarl.engines.megatron.model import (
    DTYPES,
    ModelSource,
    apex_grad_accumulation_available,
    backbone_arch,
    build_chunks,
    fusion_flags,
    moe_settings,
    load_hf_weights,
    read_arch,
    sequence_parallel_problem,
    te_version,
    transformer_engine_available,
    vocab_rows_of,
)
from megarl.engines.megatron.lora import (LoraSpec, attach_lora, builds_with_transformer_engine, merged,
                                          unfreeze_value_head)
from megarl.engines.megatron.offload import Offloader
from megarl.engines.megatron.qat import QatSpec, attach_qat, transformer_overrides as qat_overrides
from megarl.engines.megatron.optim import (build_optimizer, build_scheduler, ddp_overlap, finish_param_gather,
                                          gather_params_now, wrap_ddp)
from megarl.engines.megatron.parallel import compute_device, init_role_parallel_state, role_layout
from megarl.engines.megatron.replay import REPLAY_KEYS, RouteReplay, router_rows
from megarl.engines.megatron.schedule import Head, run_schedule
from megarl.engines.megatron.mtp import MtpTraining, mtp_loss_metrics
from megarl.engines.megatron.sequences import (Layout, MicroBatch, default_sequence_layout, fixed_shape,
                                               length_multiple, make_micro_batch, micro_batch_groups,
                                               sequence_layout_problems)
from megarl.engines.megatron.training import (
    LossHead,
    check_mini_batches,
    global_counts,
    grads_finite,
    mean_over_mini_batches,
    mini_batch_rows,
    rows_to_train,
    scaled_loss_head,
)


class MegatronEngine:
    """A role's model on this rank. Parallel state is global to the process (see `parallel.py`).

    Attributes for other components (the weight-sync resharder):
      model_chunks        this rank's `GPTModel` chunks (one per virtual stage), NOT DDP-wrapped (with
                          `megatron.use_torch_fsdp2` FSDP2-sharded in place: read them in `weights_for_sync`);
                          parameter names are megatron's local ones (layer indices local to the chunk)
      transformer_config  their megatron `TransformerConfig`
      arch, weight_map    the bridge `ModelArch` and `WeightMap` (padded vocabulary = `vocab_rows`)
      offloader           the `Offloader` of its parameters, gradient buffers and optimizer state
    """

    def __init__(
        self,
        *,
        section: str,
        model_path: str,
        model_key: str,
        override_config: dict,
        dtype: str,
        megatron_cfg,
        value_head: bool = False,
        optim_cfg=None,
        recompute: bool = False,  # enable_gradient_checkpointing: full recompute unless the overrides say otherwise
        sequence_layout: Optional[Layout] = None,
        lora: Optional[LoraSpec] = None,
        qat: Optional[QatSpec] = None,
        router_replay: bool = False,
        mtp: Optional[MtpTraining] = None,
        collective_timeout_s: float,
    ):
        from megatron.core import parallel_state

        self.section = section
        # FSDP2 shards a trained role only: use_torch_fsdp2, or verl's use_megatron_fsdp (config.rules.fsdp2)
        self.fsdp2 = optim_cfg is not None and fsdp2_switch(megatron_cfg) is not None
        self.layout = role_layout(megatron_cfg, f"{section}.megatron")
        init_role_parallel_state(self.layout, megatron_cfg.seed, section, collective_timeout_s=collective_timeout_s)
        self._ps = parallel_state
        self.device = compute_device()
        if dtype not in DTYPES:
            raise ValueError(f"{section}: model dtype {dtype!r} is not one of {list(DTYPES)}")
        self.params_dtype = DTYPES[dtype]
        source = ModelSource.resolve(model_path, model_key)
        if megatron_cfg.use_dist_checkpointing:  # verl's initial weights from a distributed checkpoint
            source = ModelSource.dist_checkpoint(megatron_cfg.dist_checkpointing_path,
                                                 f"{section}.megatron.dist_checkpointing_path", source.config_dir)
        self.arch = read_arch(source, override_config, model_key)
        if value_head and source.kind != "hf":
            raise NotImplementedError(f"{model_key}: a critic is built from an HF checkpoint (an LM or a reward model)")
        self.vocab_rows = vocab_rows_of(source, self.arch, self.layout.tp)
        self.mtp = None if value_head else mtp  # the multi-token-prediction layers, trained (engines.megatron.mtp)
        self.weight_map = WeightMap(backbone_arch(self.arch) if value_head else self.arch, self.vocab_rows,
                                    mtp=self.mtp is not None)
        te_available = transformer_engine_available()
        # LoRA and QAT wrap megatron's local linears (engines.megatron.lora, engines.megatron.qat)
        local_linears = lora is not None or qat is not None
        uses_te = builds_with_transformer_engine(te_available, local_linears)
        where = dict(section=section, cp=self.layout.cp, on_cuda=self.device.type == "cuda",
                     cp_comm_type=megatron_cfg.override_transformer_config.get("cp_comm_type"),
                     transformer_engine_layers=uses_te)
        self.sequence_layout: Layout = sequence_layout or default_sequence_layout(**where)
        problems = sequence_layout_problems(self.sequence_layout, **where)
        if problems:
            raise ValueError("; ".join(problems))
        problem = sequence_parallel_problem(self.layout.sp, on_cuda=self.device.type == "cuda",
                                            transformer_engine_layers=uses_te)
        if problem:
            raise ValueError(f"{section}.megatron.{problem}")
        fp8 = fp8_format(megatron_cfg.override_transformer_config)
        if fp8:  # transformer-engine would assert in the first forward (megarl.config.fp8_training)
            on_cuda = self.device.type == "cuda"
            problem = fp8_device_problem(
                fp8, megatron_cfg.override_transformer_config.get("fp8_recipe", DEFAULT_RECIPE), on_cuda=on_cuda,
                transformer_engine_layers=uses_te, cuda_version=torch.version.cuda, te_version=te_version(),
                capability=torch.cuda.get_device_capability(self.device) if on_cuda else None)
            if problem:
                raise ValueError(f"{section}.megatron.override_transformer_config.fp8={fp8}: {problem}")
        overrides = role_overrides(megatron_cfg.override_transformer_config, recompute)
        if qat is not None:
            overrides = qat_overrides(overrides)
        self.model_chunks, self.transformer_config = build_chunks(
            self.weight_map.arch, self.layout, vocab_rows=self.vocab_rows, params_dtype=self.params_dtype,
            value_head=value_head, transformer_engine=uses_te, packed=self.sequence_layout == "packed", section=section,
            overrides=overrides,
            moe_settings=moe_settings(self.arch, megatron_cfg, router_replay, section, uses_te),
            fusions=fusion_flags(on_cuda=self.device.type == "cuda", transformer_engine=te_available,
                                 lora=local_linears, trains=optim_cfg is not None,
                                 # FSDP2 gives parameters no `main_grad` to accumulate into
                                 apex_grad_accumulation=apex_grad_accumulation_available() and not self.fsdp2,
                                 arch=self.arch),
            mtp=self.mtp,
        )
        replay = RouteReplay(self.model_chunks) if router_replay else None
        self._replay = replay if replay else None  # None: no replay, or no MoE router on this rank
        if source.kind == "hf":
            load_hf_weights(self.model_chunks, self.weight_map, self.layout, source.path, value_head, megatron_cfg.seed)
        else:
            checkpoint_io.load_torch_dist_weights(self.model_chunks, source.path)
        self.lora = lora
        self.lora_adapters = [] if lora is None else attach_lora(
            self.model_chunks, self.weight_map.arch, lora, self.layout.tp,
            parallel_state.get_tensor_model_parallel_rank(), megatron_cfg.seed, self.params_dtype, self.device,
        )
        if lora is not None and value_head:
            unfreeze_value_head(self.model_chunks)
        self.qat_linears = [] if qat is None else attach_qat(self.model_chunks, qat)  # before DDP: its params' marks
        self.optimizer = self.scheduler = None
        self._ddp_chunks = None
        if self.fsdp2:  # torch FSDP2 over DP x CP in place of megatron's DDP and optimizer (engines.megatron.fsdp2)
            # an MoE model's experts: sharded over megatron's expert-DP group
            experts = fsdp2.ExpertGroups.from_parallel_state() if self.arch.moe is not None else None
            fsdp2.wrap_chunks(self.model_chunks, self._dp_cp_group(),
                              self.params_dtype, None if experts is None else experts.dp)
            self.optimizer = fsdp2.Fsdp2Optimizer(
                self.model_chunks, lr=optim_cfg.lr, min_lr=optim_cfg.final_lr(), betas=tuple(optim_cfg.betas),
                weight_decay=optim_cfg.weight_decay, clip_grad=optim_cfg.clip_grad,
                dp_cp_group=self._dp_cp_group(),
                tp_group=parallel_state.get_tensor_model_parallel_group(),
                pp_group=parallel_state.get_pipeline_model_parallel_group(), expert_groups=experts)
            self.scheduler = build_scheduler(self.optimizer, optim_cfg, section)
        elif optim_cfg is not None:
            overlap = ddp_overlap(trains=True, dp_size=parallel_state.get_data_parallel_world_size(),
                                  distributed_optimizer=megatron_cfg.use_distributed_optimizer)
            self._ddp_chunks = wrap_ddp(
                self.model_chunks, self.transformer_config, megatron_cfg.use_distributed_optimizer, overlap
            )
            self.optimizer = build_optimizer(
                self._ddp_chunks, optim_cfg, self.params_dtype, megatron_cfg.use_distributed_optimizer,
                self.transformer_config, overlap_param_gather=overlap["overlap_param_gather"], section=section,
            )
            self.scheduler = build_scheduler(self.optimizer, optim_cfg, section)
        # FSDP2 shards the optimizer state itself (use_megatron_fsdp leaves megatron's flag on, as verl needs it)
        self.use_distributed_optimizer = optim_cfg is not None and not self.fsdp2 and megatron_cfg.use_distributed_optimizer
        self.updates = 0  # update calls so far (the LR schedule's step)
        self._seed = megatron_cfg.seed
        self.offloader = Offloader(section, self.model_chunks, self._ddp_chunks, self.optimizer, self.device)
        self.async_saves: Optional[checkpoint_io.AsyncSaves] = None  # made by the first background save

    # ------------------------------------------------------------------ ranks
    @property
    def dp_rank(self) -> int:
        return self._ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return self._ps.get_data_parallel_world_size()

    @property
    def cp_rank(self) -> int:
        return self._ps.get_context_parallel_rank()

    @property
    def is_output_rank(self) -> bool:
        """True on exactly one rank per DP replica: TP rank 0 and CP rank 0 of the last pipeline stage."""
        return (self._ps.is_pipeline_last_stage() and self._ps.get_tensor_model_parallel_rank() == 0
                and self.cp_rank == 0)

    def _is_last_stage(self) -> bool:
        return self._ps.is_pipeline_last_stage()

    # ------------------------------------------------------------------ forward / backward
    def micro_batches(
        self, batch: Batch, *, max_samples: Optional[int], max_tokens: Optional[int], data_keys: Sequence[str] = ()
    ) -> list[MicroBatch]:
        """`batch` cut into micro-batches of at most `max_samples` samples, or of at most
        `max_tokens` tokens per GPU when that is given (CP x `max_tokens` tokens in all). With VPP,
        a multiple of PP of them, all padded to one shape: megatron then sends no shapes between
        stages (its shape exchange pairs messages wrongly when both neighbours are the same rank,
        PP=2 on gloo). Sequences are padded to `length_multiple`; with CP each micro-batch is this
        CP rank's part."""
        interleaved = self.layout.vpp > 1
        groups = micro_batch_groups(
            batch.token_lengths().tolist(), max_samples=max_samples,
            # a budget per GPU, as verl's: a CP rank holds 1/CP of each sequence
            max_tokens=None if max_tokens is None else max_tokens * self.layout.cp,
            multiple_of=self.layout.pp if interleaved else 1,
        )
        multiple = length_multiple(self.layout.tp, self.layout.sp, self.layout.cp)
        shape = fixed_shape(batch, groups, self.sequence_layout, multiple, self.layout.cp) if interleaved else None
        routes = self._replay is not None and all(k in batch for k in REPLAY_KEYS)
        return [make_micro_batch(batch, g, self.sequence_layout, self.arch.vocab_size, self.device, data_keys, shape,
                                 with_routes=routes, multiple=multiple, cp=self.layout.cp, cp_rank=self.cp_rank)
                for g in groups]

    def run(self, micro_batches: list[MicroBatch], head: Head, forward_only: bool,
            counter: Optional[ExpertCounter] = None) -> list[dict]:
        """Run the micro-batches through megatron's schedule (`schedule.run_schedule`): on the last
        pipeline stage `head(mb, hidden [N, H])` returns (loss, outputs) per micro-batch, and the
        list of outputs comes back there ([] on other stages). Without `forward_only` the loss is
        back-propagated (gradients accumulate in DDP buffers). `counter`: told each micro-batch
        before its forward (an open `ExpertCounter`)."""
        self.offloader.check_onloaded()
        replay = self._replay

        def before_forward(mb: MicroBatch, chunk: int) -> None:
            if replay is not None:  # a batch without routes (REPLAY_KEYS): the routers route on their own
                replay.before_forward(chunk, None if mb.routes is None else mb.routes[:, self._router_rows(mb)])
            if counter is not None:
                counter.before_forward(mb)

        def after_forward(mb: MicroBatch, chunk: int) -> None:
            replay.after_forward(chunk)  # a recomputation in the backward replays this micro-batch's routes

        try:
            return run_schedule(self._ddp_chunks or self.model_chunks, micro_batches, head, forward_only,
                                before_forward, after_forward if replay is not None else None, mtp=self.mtp is not None)
        finally:
            if replay is not None:
                replay.clear()

    def _router_rows(self, mb: MicroBatch) -> torch.Tensor:
        """The rows of `mb`'s flattened hidden states this rank's MoE routers see (`replay.router_rows`)."""
        return router_rows(mb.input_ids.numel(), self.layout.tp, self._ps.get_tensor_model_parallel_rank(),
                           self.layout.sp, mb.held_rows)

    def output_weight(self) -> torch.Tensor:
        """The output layer (this rank's vocabulary rows) of the last stage; the embedding when tied.
        Read outside the output layer's forward: its all-gather is waited for here (`finish_param_gather`).
        With FSDP2, read in a forward step only (a head), where the root chunk holds it whole (`fsdp2`)."""
        last = self.model_chunks[-1]
        if last.share_embeddings_and_output_weights:
            weight = last.shared_embedding_or_output_weight()
        else:
            weight = last.output_layer.weight
        finish_param_gather(self._ddp_chunks, weight)
        return weight

    def forward_outputs(
        self, batch: Batch, head: Head, *, max_samples, max_tokens, count_experts: bool = False,
        data_keys: Sequence[str] = (),
    ) -> tuple[list[dict], Optional[torch.Tensor]]:
        """Forward-only pass over `batch`: `head`'s outputs per micro-batch on the last pipeline
        stage ([] elsewhere), and with `count_experts` on an MoE model the [L, E] int32 tokens of
        all of `batch`'s samples its routers sent to each expert (`expert_counts`, complete on
        output ranks), else None."""
        micro_batches = self.micro_batches(batch, max_samples=max_samples, max_tokens=max_tokens, data_keys=data_keys)
        if not (count_experts and self.arch.moe is not None):
            return self.run(micro_batches, head, True), None
        with ExpertCounter(self.model_chunks, self.arch.num_layers, self.arch.moe.num_experts,
                           self.device, rows_of=self._router_rows) as counter:
            outputs = self.run(micro_batches, head, True, counter)
        return outputs, counter.totals(self._ps.get_pipeline_model_parallel_group(),
                                       self._ps.get_tensor_model_parallel_group() if self.layout.sp else None,
                                       self._ps.get_context_parallel_group() if self.layout.cp > 1 else None)

    def forward_tokens(
        self, batch: Batch, head: Head, *, max_samples, max_tokens, keys: Sequence[str], count_experts: bool = False,
        data_keys: Sequence[str] = (),
    ) -> Optional[dict]:
        """Forward-only pass over `batch`; `head` returns per micro-batch {"key": [b, R, ...] tensor}
        for every name in `keys`. On output ranks: {key: [B, R, ...] on CPU, float32 (integer
        results keep their dtype)}, rows in batch
        order (plus "expert_tokens" with `count_experts`, see `forward_outputs`); None elsewhere.
        `data_keys`: the batch's tensors the head reads (`MicroBatch.data`)."""
        outputs, counts = self.forward_outputs(batch, head, max_samples=max_samples, max_tokens=max_tokens,
                                               count_experts=count_experts, data_keys=data_keys)
        if not self.is_output_rank:
            return None
        width = batch["response_mask"].shape[1]
        result = {}
        for out in outputs:
            for key in keys:
                values = out[key].cpu()
                values = values.float() if values.is_floating_point() else values  # integer results (token ids) stay
                if key not in result:
                    result[key] = values.new_zeros((len(batch), width, *values.shape[2:]))
                result[key][out["rows"]] = values
        for key in keys:
            result.setdefault(key, torch.zeros(len(batch), width, dtype=torch.float32))
        if counts is not None:
            result["expert_tokens"] = counts
        return result

    # ------------------------------------------------------------------ training
    def train_batch(
        self,
        batch: Batch,
        *,
        mini_batch_size: int,
        epochs: int,
        shuffle: bool,
        max_samples: Optional[int],
        max_tokens: Optional[int],
        data_keys: Sequence[str],
        loss_head: LossHead,
        prefix: str,
        before_mini_batch: Optional[Callable[[int, torch.Tensor], None]] = None,
        skippable: Optional[torch.Tensor] = None,
    ) -> dict[str, float]:
        """`epochs` passes over `batch` (this DP rank's samples) in mini-batches of
        `mini_batch_size` samples, one optimizer step each. `loss_head(mb, hidden, counts)`
        returns (loss, `Metrics`) with `counts` the mini-batch's `training.global_counts` (the
        loss's normalisers num_tokens/num_seqs; see `training` for the loss scaling). Returns
        metrics named `prefix/...`, the same on every rank: each mini-batch's value over all DP
        ranks, averaged over mini-batches; `tokens` is the sum (response tokens trained on, all
        ranks and epochs), `lr` the learning rate of this update. `before_mini_batch(index,
        rows)`: called before each mini-batch is taken from `batch` and stepped on, with its index
        in the update and its rows of `batch` that run.
        `skippable` ([B] bool): rows whose loss and gradient are exactly 0, left out of the forward
        and backward (`training.rows_to_train`; the loss keeps the whole mini-batch's counts); the
        loss heads' metrics are then over the rows trained, and `rows_trained_frac` (the share of
        rows that ran, all ranks and mini-batches) is added."""
        if self.optimizer is None:
            raise RuntimeError(f"{self.section}: this engine has no optimizer")
        self.offloader.check_onloaded()
        check_mini_batches(len(batch), mini_batch_size, self.section, self.device, self._ps.get_data_parallel_group())
        self.updates += 1
        self.scheduler.step(1)
        lr = self.optimizer.param_groups[0]["lr"]
        generator = torch.Generator().manual_seed(self._seed + self.updates)  # the same on a replica's ranks
        mini_batches = list(mini_batch_rows(len(batch), mini_batch_size, epochs, shuffle, generator))
        # the interleaved schedule needs PP micro-batches: as many rows at least
        min_rows = self.layout.pp if self.layout.vpp > 1 else 1
        trained = mini_batches if skippable is None else [rows_to_train(rows, skippable, min_rows)
                                                          for rows in mini_batches]
        group = self._ps.get_data_parallel_group()
        counts = global_counts(batch["response_mask"], mini_batches, trained, self.device, group)
        per_mini, losses = [], []
        for index, (rows, mini_counts) in enumerate(zip(trained, counts)):
            if before_mini_batch is not None:
                before_mini_batch(index, rows)
            metrics, outputs = self._train_mini_batch(batch.select(rows), mini_counts, max_samples, max_tokens,
                                                      data_keys, loss_head)
            if skippable is not None:
                metrics["rows_trained_frac"] = mini_counts["trained_rows"] / mini_counts["rows"]
            per_mini.append(metrics)
            losses.append(([out["metrics"] for out in outputs], [out["tokens"] for out in outputs]))
        if self._is_last_stage():  # the loss heads' metrics over all DP ranks, every mini-batch in one collective
            reduced = reduce_over_micro_batches(losses, [c["trained_tokens"] for c in counts], group, self.device)
            per_mini = [{**loss_metrics, **metrics} for loss_metrics, metrics in zip(reduced, per_mini)]
        # With overlap_param_gather the last step's parameters would be gathered only by the next
        # forward: gather them now, for the weight push, checkpoints and exports that read them.
        gather_params_now(self._ddp_chunks)
        return broadcast_from_last_stage(mean_over_mini_batches(per_mini, prefix, lr))

    def _train_mini_batch(self, mini: Batch, counts: dict[str, float], max_samples, max_tokens, data_keys,
                          loss_head) -> tuple[dict[str, float], list[dict]]:
        """One optimizer step on `mini` (`counts`: its `global_counts`). Returns its
        {"grad_norm", "tokens", "skipped_updates"} and the schedule's outputs (on the last stage: each
        micro-batch's {"metrics", "tokens"}, reduced over the DP ranks by the caller)."""
        micro_batches = self.micro_batches(mini, max_samples=max_samples, max_tokens=max_tokens, data_keys=data_keys)
        head = scaled_loss_head(loss_head, counts, scale=self.dp_size * len(micro_batches))
        for chunk in self._ddp_chunks or ():
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self.run(micro_batches, head, forward_only=False)
        if self.fsdp2:  # what megatron's finalize_model_grads does for DDP: under PP a tied embedding's sum; the
            # routers' expert bias, before the optimizer step and also when it is skipped
            fsdp2.reduce_tied_embedding_grads(self.model_chunks)
            fsdp2.update_router_expert_bias(self.model_chunks, self.transformer_config)
        finite = grads_finite(self._local_grads(), self.device, self.section)
        grad_norm = self.optimizer.step()[1] if finite else None  # a non-finite update is skipped
        metrics = {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                   "tokens": counts["trained_tokens"], "skipped_updates": 0.0 if finite else 1.0}
        if self.mtp is not None and self._is_last_stage():  # each MTP layer's loss, on the stage that holds them
            metrics.update(mtp_loss_metrics(len(micro_batches)))
        return metrics, outputs

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's gradients: megatron DDP's buffers, or FSDP2's shards."""
        if self.fsdp2:
            return fsdp2.local_grads(self.model_chunks)
        return [buffer.grad_data for chunk in self._ddp_chunks
                for buffer in chunk.buffers + chunk.expert_parallel_buffers]

    def weights_for_sync(self):
        """A context in which the model chunks hold the weights to push or export: with FSDP2, whole
        (all-gathered over DP x CP, resharded on exit; every rank of the role enters it); with LoRA,
        the base weights merged with their adapters (restored exactly on exit); else the weights as they are."""
        return fsdp2.gathered(self.model_chunks) if self.fsdp2 else merged(self.lora_adapters)

    # ------------------------------------------------------------------ offload
    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict:
        """Move the chosen parts off the device (parameters and optimizer state to host memory;
        gradient buffers freed). Returns `Offloader.offload`'s {"bytes": copied to host,
        "freed_bytes", "seconds", "params_bytes", "grads_bytes", "optimizer_bytes"}. With FSDP2 every
        FSDP module is resharded first: the root stays whole after a forward-only pass
        (`reshard_after_forward=False`), and resharding frees its all-gathered parameters and puts the
        sharded DTensors back on the modules, whose local shards are what moves."""
        if self.fsdp2:
            for module in fsdp2.fsdp_modules(self.model_chunks):
                module.reshard()
        return self.offloader.offload(params=params, grads=grads, optimizer=optimizer)

    def onload(self) -> dict:
        """Bring back what `offload` moved. Returns {"bytes": copied to the device, "seconds"}."""
        return self.offloader.onload()

    def empty_cache(self) -> dict:
        """Give the device memory this process's caching allocator keeps but no tensor uses back to
        the GPU (`torch.cuda.empty_cache`): otherwise it keeps the training peak (activations,
        logits, buckets), which a colocated SGLang server resuming its memory needs physically
        free (its memory saver maps new pages). Returns {"reserved_before", "reserved_after"}
        (bytes the allocator held; 0 on CPU, where nothing is cached)."""
        if self.device.type != "cuda":
            return {"reserved_before": 0, "reserved_after": 0}
        before = torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return {"reserved_before": before, "reserved_after": torch.cuda.memory_reserved(self.device)}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path, optimizer: bool = True, background: bool = False) -> None:
        """Save model (+ optimizer + LR schedule where `optimizer`) as a `torch_dist` distributed
        checkpoint in the directory `path`. Every rank of the role calls it. Model and (non-distributed)
        optimizer state load at any TP/PP layout; the distributed optimizer's state needs the same TP/PP.
        `background`: return once the tensors are staged, the write going on in the background
        (checkpoint_io.AsyncSaves) until `finish_saves` finalises it. With FSDP2: the model in the same
        format, the optimizer state beside it (fsdp2_checkpoint), written in the foreground."""
        self.offloader.check_onloaded()
        if self.fsdp2:
            if background:  # refused at config time too (config.rules.fsdp2)
                raise NotImplementedError(f"{self.section}.checkpoint.async_save=true with "
                                          f"{self.section}.megatron.use_torch_fsdp2=true: not built yet")
            fsdp2_checkpoint.save(Path(path), self.model_chunks, self.optimizer if optimizer else None,
                                  self.scheduler, self.updates, self.params_dtype, self._dp_cp_group())
            return
        if background and self.async_saves is None:
            self.async_saves = checkpoint_io.AsyncSaves()
        checkpoint_io.save_checkpoint(Path(path), self.model_chunks, self.optimizer if optimizer else None,
                                      self.scheduler, self.updates, self.use_distributed_optimizer,
                                      self.async_saves if background else None)

    @staticmethod
    def _dp_cp_group():
        """The DP x CP group (FSDP2's mesh)."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group(with_context_parallel=True)

    def finish_saves(self, blocking: bool, timeout_s: float) -> bool:
        """Finalise the background writes of `save_checkpoint` that every rank finished; True when
        none is left. `blocking`: wait for them, at most `timeout_s` seconds (then TimeoutError).
        Every rank calls it."""
        return self.async_saves is None or self.async_saves.finish(blocking, timeout_s)

    def load_checkpoint(self, path: str | Path, optimizer: bool = True) -> None:
        """Load what `save_checkpoint` saved (possibly at another TP/PP layout); `optimizer` False: the
        weights alone (a checkpoint saved without its optimizer), the optimizer and schedule kept as
        they are. Every rank calls it. With FSDP2 (fsdp2_checkpoint): the optimizer state at the saved TP,
        PP and EP sizes only (any DP and CP sizes); the weights alone at any layout."""
        self.offloader.check_onloaded()
        if not Path(path).is_dir():
            raise FileNotFoundError(f"{self.section}: checkpoint directory {path} does not exist")
        if self.fsdp2:
            group = self._dp_cp_group()
            self.updates = (fsdp2_checkpoint.load(Path(path), self.model_chunks, self.optimizer, self.scheduler, group)
                            if optimizer else
                            fsdp2_checkpoint.load_weights(Path(path), self.model_chunks, self.params_dtype))
            return
        if optimizer and self.optimizer is not None and (Path(path) / fsdp2_checkpoint.STATE_DIR).is_dir():
            raise ValueError(f"{self.section}: {path} is a megatron.use_torch_fsdp2 checkpoint: its optimizer state "
                             f"is FSDP2's ({fsdp2_checkpoint.STATE_DIR}/), which megatron's optimizer cannot load; "
                             "resume it with megatron.use_torch_fsdp2=true, or load its weights alone")
        self.updates = checkpoint_io.load_checkpoint(Path(path), self.model_chunks,
                                                     self.optimizer if optimizer else None, self.scheduler,
                                                     self.use_distributed_optimizer)
