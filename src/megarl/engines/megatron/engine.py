"""`MegatronEngine`: one role's megatron-core model on this rank, and what every role does with it.

It builds the model chunks (from an HF or `torch_dist` checkpoint, via the bridge), runs batches
through megatron's pipeline schedules (1F1B; interleaved with VPP) with a head on the last stage,
trains on mini-batches (one optimizer step each), offloads to host memory and back, and saves and
loads distributed checkpoints. The role classes in `roles.py` add the config plumbing and the heads.

Loss scaling across micro-batches and data-parallel ranks (what "the mini-batch loss" means):
at the start of each mini-batch the response tokens and the sequences of the whole mini-batch are
summed over the DP ranks, and every micro-batch's loss is aggregated with those global counts
(`agg_loss(num_tokens=, num_seqs=)`). The micro-batch losses of all ranks therefore *sum* to the
loss of the whole global mini-batch, as one process would compute it; token-mean is the mean
over all tokens of all DP ranks (not a mean of per-rank means). The loss handed to megatron is
multiplied by (DP size x micro-batches) to undo the schedule's division by the micro-batch count
and DDP's averaging over DP ranks, so the gradient is the gradient of that global loss.
"""
from __future__ import annotations

import contextlib
import logging
import functools
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.bridge import WeightMap
from megarl.bridge.torch_dist_io import check_metadata_is_data
from megarl.data.batch import Batch
from megarl.engines.megatron import offload as offloading
from megarl.engines.megatron.model import (
    DTYPES,
    ModelSource,
    backbone_arch,
    build_chunks,
    load_hf_weights,
    load_torch_dist_weights,
    model_sharded_state_dict,
    read_arch,
    transformer_engine_available,
    vocab_rows_of,
)
from megarl.engines.megatron.optim import build_optimizer, build_scheduler, wrap_ddp
from megarl.engines.megatron.parallel import compute_device, init_role_parallel_state, role_layout
from megarl.engines.megatron.sequences import Layout, MicroBatch, fixed_shape, make_micro_batch, micro_batch_groups

log = logging.getLogger("megarl.engines")

# How per-micro-batch metrics combine into a mini-batch value. Losses aggregated with the global
# mini-batch counts add up; extremes take the extreme; everything else is a mean over valid
# tokens, combined weighted by each micro-batch's token count.
SUMMED_METRICS = frozenset({"pg_loss", "entropy", "kl_loss", "actor_loss", "vf_loss", "nll"})
MAX_METRICS = frozenset({"ratio_max"})
MIN_METRICS = frozenset({"ratio_min"})
CONSTANT_METRICS = frozenset({"kl_coef"})

Head = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]]


class MegatronEngine:
    """A role's model on this rank. Parallel state is global to the process (see `parallel.py`).

    Attributes for other components (the weight-sync resharder):
      model_chunks        this rank's `GPTModel` chunks (one per virtual stage), NOT DDP-wrapped;
                          parameter names are megatron's local ones (layer indices local to the chunk)
      transformer_config  their megatron `TransformerConfig`
      arch, weight_map    the bridge `ModelArch` and `WeightMap` (padded vocabulary = `vocab_rows`)
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
        recompute: bool = False,
        sequence_layout: Optional[Layout] = None,
    ):
        from megatron.core import parallel_state

        self.section = section
        self.layout = role_layout(megatron_cfg, f"{section}.megatron")
        init_role_parallel_state(self.layout, megatron_cfg.seed, section)
        self._ps = parallel_state
        self.device = compute_device()
        if dtype not in DTYPES:
            raise ValueError(f"{section}: model dtype {dtype!r} is not one of {list(DTYPES)}")
        self.params_dtype = DTYPES[dtype]
        source = ModelSource.resolve(model_path, model_key)
        self.arch = read_arch(source, override_config, model_key)
        if value_head and source.kind != "hf":
            raise NotImplementedError(f"{model_key}: a critic is built from an HF checkpoint (an LM or a reward model)")
        self.vocab_rows = vocab_rows_of(source, self.arch, self.layout.tp)
        self.weight_map = WeightMap(backbone_arch(self.arch) if value_head else self.arch, self.vocab_rows)
        uses_te = transformer_engine_available()
        self.sequence_layout: Layout = sequence_layout or ("packed" if uses_te else "padded")
        if self.sequence_layout == "packed" and not uses_te:
            raise ValueError(f"{section}: packed sequences need transformer-engine attention (a GPU with TE installed)")
        self.model_chunks, self.transformer_config = build_chunks(
            self.weight_map.arch, self.layout, vocab_rows=self.vocab_rows, params_dtype=self.params_dtype,
            value_head=value_head, recompute=recompute, transformer_engine=uses_te,
        )
        if source.kind == "hf":
            load_hf_weights(self.model_chunks, self.weight_map, self.layout, source.path, value_head, megatron_cfg.seed)
        else:
            load_torch_dist_weights(self.model_chunks, source.path)
        self.optimizer = self.scheduler = None
        self._ddp_chunks = None
        if optim_cfg is not None:
            self._ddp_chunks = wrap_ddp(
                self.model_chunks, self.transformer_config, megatron_cfg.use_distributed_optimizer
            )
            self.optimizer = build_optimizer(
                self._ddp_chunks, optim_cfg, self.params_dtype, megatron_cfg.use_distributed_optimizer,
                self.transformer_config,
            )
            self.scheduler = build_scheduler(self.optimizer, optim_cfg, section)
        self.use_distributed_optimizer = optim_cfg is not None and megatron_cfg.use_distributed_optimizer
        self.updates = 0  # update calls so far (the LR schedule's step)
        self._seed = megatron_cfg.seed
        self._offloaded: Optional[offloading.OffloadedStorages] = None

    # ------------------------------------------------------------------ ranks
    @property
    def dp_rank(self) -> int:
        return self._ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return self._ps.get_data_parallel_world_size()

    @property
    def is_output_rank(self) -> bool:
        """True on exactly one rank per DP replica: TP rank 0 of the last pipeline stage."""
        return self._ps.is_pipeline_last_stage() and self._ps.get_tensor_model_parallel_rank() == 0

    def _is_last_stage(self) -> bool:
        return self._ps.is_pipeline_last_stage()

    # ------------------------------------------------------------------ forward / backward
    def micro_batches(
        self, batch: Batch, *, max_samples: Optional[int], max_tokens: Optional[int], data_keys: Sequence[str] = ()
    ) -> list[MicroBatch]:
        """`batch` cut into micro-batches of at most `max_samples` samples, or of at most
        `max_tokens` tokens when that is given. With VPP, a multiple of PP of them, all padded to
        one shape: megatron then sends no shapes between stages (its shape exchange pairs
        messages wrongly when both neighbours are the same rank, PP=2 on gloo)."""
        interleaved = self.layout.vpp > 1
        groups = micro_batch_groups(
            batch.token_lengths().tolist(), max_samples=max_samples, max_tokens=max_tokens,
            multiple_of=self.layout.pp if interleaved else 1,
        )
        shape = fixed_shape(batch, groups, self.sequence_layout) if interleaved else None
        return [make_micro_batch(batch, g, self.sequence_layout, self.arch.vocab_size, self.device, data_keys, shape)
                for g in groups]

    def run(self, micro_batches: list[MicroBatch], head: Head, forward_only: bool) -> list[dict]:
        """Run the micro-batches through megatron's schedule. On the last pipeline stage `head(mb,
        hidden)` gets each micro-batch's hidden states at its response positions ([N, H]) and
        returns (loss, outputs); the list of outputs comes back there ([] on other stages).
        Without `forward_only` the loss is back-propagated (gradients accumulate in DDP buffers)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self._check_onloaded()
        chunks = self._ddp_chunks or self.model_chunks
        for chunk in chunks:
            chunk.train(not forward_only)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            hidden = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None,
                           packed_seq_params=mb.packed_seq_params)
            return hidden, functools.partial(_apply_head, head, mb)

        shapes = [mb.input_ids.shape for mb in micro_batches]
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(micro_batches) for _ in chunks],
                model=chunks,
                num_microbatches=len(micro_batches),
                seq_length=max(s[1] for s in shapes),
                micro_batch_size=max(s[0] for s in shapes),
                forward_only=forward_only,
            )

    def output_weight(self) -> torch.Tensor:
        """The output layer (this rank's vocabulary rows) of the last stage; the embedding when tied."""
        last = self.model_chunks[-1]
        if last.share_embeddings_and_output_weights:
            return last.shared_embedding_or_output_weight()
        return last.output_layer.weight

    def forward_tokens(
        self, batch: Batch, head: Head, *, max_samples, max_tokens, keys: Sequence[str]
    ) -> Optional[dict]:
        """Forward-only pass over `batch`; `head` returns per micro-batch {"key": [b, R] tensor}
        for every name in `keys`. On output ranks: {key: [B, R] float32 on CPU}, rows in batch
        order; None elsewhere."""
        outputs = self.run(self.micro_batches(batch, max_samples=max_samples, max_tokens=max_tokens), head, True)
        if not self.is_output_rank:
            return None
        width = batch["response_mask"].shape[1]
        result = {key: torch.zeros(len(batch), width, dtype=torch.float32) for key in keys}
        for out in outputs:
            for key in keys:
                result[key][out["rows"]] = out[key].float().cpu()
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
        loss_head: Callable[..., tuple[torch.Tensor, dict]],
        prefix: str,
    ) -> dict[str, float]:
        """`epochs` passes over `batch` (this DP rank's samples) in mini-batches of
        `mini_batch_size` samples, one optimizer step each. `loss_head(mb, hidden, counts)`
        returns (loss, metrics) with `counts` the mini-batch's global num_tokens/num_seqs.
        Returns metrics named `prefix/...`, the same on every rank: each mini-batch's value over
        all DP ranks, averaged over mini-batches; `tokens` is the sum (response tokens trained on,
        all ranks and epochs), `lr` the learning rate of this update."""
        if self.optimizer is None:
            raise RuntimeError(f"{self.section}: this engine has no optimizer")
        self._check_onloaded()
        size = len(batch)
        sizes = torch.tensor([size, -size], dtype=torch.float64, device=self.device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self._ps.get_data_parallel_group())
        if sizes[0] != -sizes[1]:
            raise ValueError(
                f"{self.section}: data-parallel ranks hold different numbers of samples ({int(-sizes[1])} to "
                f"{int(sizes[0])}); every rank needs the same count (the controller slices the batch evenly)"
            )
        if mini_batch_size < 1 or size % mini_batch_size:
            raise ValueError(
                f"{self.section}: {size} samples on this rank do not split into mini-batches of {mini_batch_size} "
                "(ppo_mini_batch_size x rollout.n / data-parallel size)"
            )
        self.updates += 1
        self.scheduler.step(1)
        lr = self.optimizer.param_groups[0]["lr"]
        generator = torch.Generator().manual_seed(self._seed + self.updates)  # the same on a replica's ranks
        per_mini: list[dict[str, float]] = []
        for _ in range(epochs):
            order = torch.randperm(size, generator=generator) if shuffle else torch.arange(size)
            for start in range(0, size, mini_batch_size):
                mini = batch.select(order[start : start + mini_batch_size])
                metrics = self._train_mini_batch(mini, max_samples, max_tokens, data_keys, loss_head)
                per_mini.append(metrics)
        result = {f"{prefix}/{k}": sum(m[k] for m in per_mini) / len(per_mini) for k in per_mini[0]}
        result[f"{prefix}/tokens"] = sum(m["tokens"] for m in per_mini)
        result[f"{prefix}/skipped_updates"] = sum(m["skipped_updates"] for m in per_mini)
        result[f"{prefix}/lr"] = lr
        return self._broadcast_from_last_stage(result)

    def _train_mini_batch(self, mini: Batch, max_samples, max_tokens, data_keys, loss_head) -> dict[str, float]:
        mask = mini["response_mask"].bool()
        counts = torch.tensor([mask.sum(), (mask.sum(1) > 0).sum()], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=self._ps.get_data_parallel_group())
        global_counts = {"num_tokens": float(counts[0]), "num_seqs": float(counts[1])}
        micro_batches = self.micro_batches(mini, max_samples=max_samples, max_tokens=max_tokens, data_keys=data_keys)
        scale = self.dp_size * len(micro_batches)

        def head(mb: MicroBatch, hidden: torch.Tensor):
            loss, metrics = loss_head(mb, hidden, global_counts)
            reported = {k: v.detach().clone() for k, v in metrics.items()}  # copies: megatron divides the loss in place
            return loss * scale, {"metrics": reported, "tokens": mb.num_tokens}

        for chunk in self._ddp_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self.run(micro_batches, head, forward_only=False)
        finite = self._grads_finite()
        grad_norm = self.optimizer.step()[1] if finite else None  # a non-finite update is skipped
        metrics = self._reduce_over_dp(outputs, global_counts["num_tokens"]) if self._is_last_stage() else {}
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["tokens"] = global_counts["num_tokens"]
        metrics["skipped_updates"] = 0.0 if finite else 1.0
        return metrics

    def _grads_finite(self) -> bool:
        """Whether every gradient of every rank of this role is finite (one flag, all-reduced
        over the role's ranks, so that all of them skip or step together)."""
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for chunk in self._ddp_chunks:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                bad = torch.maximum(bad, (~torch.isfinite(buffer.grad_data)).any().float())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            log.warning("%s: non-finite loss or gradients: this update is skipped", self.section)
        return not bad.item()

    def _reduce_over_dp(self, outputs: list[dict], global_tokens: float) -> dict[str, float]:
        """Per-micro-batch metrics of this rank -> the mini-batch's metrics over all DP ranks."""
        names = list(outputs[0]["metrics"])
        sums = torch.zeros(len(names), dtype=torch.float64)
        extremes = torch.full((len(names),), float("-inf"), dtype=torch.float64)
        for out in outputs:
            for i, name in enumerate(names):
                value = float(out["metrics"][name])
                if name in MAX_METRICS:
                    extremes[i] = max(extremes[i], value)
                elif name in MIN_METRICS:
                    extremes[i] = max(extremes[i], -value)
                elif name in CONSTANT_METRICS:
                    sums[i] = value
                elif name in SUMMED_METRICS:
                    sums[i] += value
                else:
                    sums[i] += value * out["tokens"]
        group = self._ps.get_data_parallel_group()
        sums, extremes = sums.to(self.device), extremes.to(self.device)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
        result = {}
        for i, name in enumerate(names):
            if name in MAX_METRICS:
                result[name] = float(extremes[i])
            elif name in MIN_METRICS:
                result[name] = -float(extremes[i])
            elif name in CONSTANT_METRICS:
                result[name] = float(sums[i]) / self.dp_size
            elif name in SUMMED_METRICS:
                result[name] = float(sums[i])
            else:
                result[name] = float(sums[i]) / max(global_tokens, 1.0)
        return result

    def _broadcast_from_last_stage(self, metrics: dict) -> dict:
        if self.layout.pp == 1:
            return metrics
        box = [metrics]
        last, group = self._ps.get_pipeline_model_parallel_last_rank(), self._ps.get_pipeline_model_parallel_group()
        dist.broadcast_object_list(box, src=last, group=group)
        return box[0]

    # ------------------------------------------------------------------ offload
    def _storages(self) -> tuple[list, list, list]:
        """(parameter, gradient, optimizer-state) storages on the compute device."""
        params = [p for chunk in self.model_chunks for p in chunk.parameters()]
        grads = []
        for chunk in self._ddp_chunks or []:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                params.append(buffer.param_data)
                grads.append(buffer.grad_data)
        state = []
        if self.optimizer is not None:
            inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
            for opt in inner:
                torch_opt = opt.optimizer
                for group in torch_opt.param_groups:
                    for p in group["params"]:
                        state.append(p)
                        state.extend(v for v in torch_opt.state.get(p, {}).values() if torch.is_tensor(v))
        param_storages = offloading.unique_storages(params, self.device)
        taken = {s.data_ptr() for s in param_storages}
        grad_storages = [s for s in offloading.unique_storages(grads, self.device) if s.data_ptr() not in taken]
        taken |= {s.data_ptr() for s in grad_storages}
        state_storages = [s for s in offloading.unique_storages(state, self.device) if s.data_ptr() not in taken]
        return param_storages, grad_storages, state_storages

    def offload(self) -> dict:
        """Move parameters and optimizer state to host memory and free the gradient buffers.
        Returns {"bytes": copied to host, "freed_bytes": device bytes released, "seconds"}."""
        if self._offloaded is not None:
            return {"bytes": 0, "freed_bytes": 0, "seconds": 0.0}
        params, grads, state = self._storages()
        self._offloaded, stats = offloading.offload(params + state, grads, self.device)
        return stats

    def onload(self) -> dict:
        """Bring back what `offload` moved. Returns {"bytes": copied to the device, "seconds"}."""
        if self._offloaded is None:
            return {"bytes": 0, "seconds": 0.0}
        stats = offloading.onload(self._offloaded, self.device)
        self._offloaded = None
        return stats

    def _check_onloaded(self) -> None:
        if self._offloaded is not None:
            raise RuntimeError(f"{self.section}: the engine is offloaded; call onload() first")

    # ------------------------------------------------------------------ checkpoints
    def _optimizer_metadata(self) -> Optional[dict]:
        return {"distrib_optim_sharding_type": "dp_reshardable"} if self.use_distributed_optimizer else None

    def save_checkpoint(self, path: str | Path) -> None:
        """Save model (+ optimizer + LR schedule) as a `torch_dist` distributed checkpoint in the
        directory `path`. Every rank of the role calls it. Model and (non-distributed) optimizer
        state load at any TP/PP layout; the distributed optimizer's state needs the same TP/PP."""
        from megatron.core import dist_checkpointing

        self._check_onloaded()
        path = Path(path)
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state = self._sharded_state(is_loading=False)
        dist_checkpointing.save(state, str(path))
        dist.barrier()

    def load_checkpoint(self, path: str | Path) -> None:
        """Load what `save_checkpoint` saved (possibly at another TP/PP layout). Every rank calls it."""
        from megatron.core import dist_checkpointing

        self._check_onloaded()
        if not Path(path).is_dir():
            raise FileNotFoundError(f"{self.section}: checkpoint directory {path} does not exist")
        if self.use_distributed_optimizer:  # megatron's dp_reshardable load fills existing state tensors
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if not opt.optimizer.state:
                    opt._init_optimizer_states_with_dummy_values()
        check_metadata_is_data(path)  # torch.distributed.checkpoint itself unpickles it unrestricted
        state = self._sharded_state(is_loading=True)
        loaded = dist_checkpointing.load(state, str(path))
        for key, chunk in zip([k for k in state if k.startswith("model")], self.model_chunks):
            chunk.load_state_dict(loaded[key], strict=True)
        if self.optimizer is not None:
            with torch.no_grad():
                self.optimizer.load_state_dict(loaded["optimizer"])
            if self.use_distributed_optimizer:
                _restore_adam_steps(self.optimizer)
            self.scheduler.load_state_dict(loaded["scheduler"])
        self.updates = loaded["engine"]["updates"]

    def _sharded_state(self, is_loading: bool) -> dict:
        state = model_sharded_state_dict(self.model_chunks)
        if self.optimizer is not None:
            model_state = dict(state)
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_state, is_loading=is_loading, metadata=self._optimizer_metadata()
            )
            state["scheduler"] = self.scheduler.state_dict()
        state["engine"] = {"updates": self.updates}
        return state


def _restore_adam_steps(optimizer) -> None:
    """Work around megatron-core 0.16.1: loading a `dp_reshardable` distributed-optimizer
    checkpoint with torch's Adam (no apex / TE optimizer) leaves every parameter's Adam `step` at
    the dummy step taken before loading, and as ONE tensor shared by all parameters (so each
    later step would add the parameter count to it). Give every parameter its own step, set to
    the saved one, which is in the loaded param groups."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = torch_optimizer.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype,
                                                 device=state["step"].device)


def _apply_head(head: Head, mb: MicroBatch, hidden: torch.Tensor):
    """Select the hidden states that predict response tokens, then run the role's head."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return head(mb, flat.index_select(0, mb.token_index))
