"""`RewardModelEngine`: a reward model (HF `*ForSequenceClassification`, num_labels=1) on the
megatron engine, forward only (`reward_model.*`).

The model is the checkpoint's backbone with its `score.weight` [1, H] as a scalar head, in the
actor's dtype (`actor_rollout_ref.model.dtype`). The score of a sample is the head's output at its
last real token (the last valid response token; the last prompt token for an empty response):
what the HF model returns for prompt + response without padding (as verl's reward model does; a
response that ends in the pad token itself is scored there too, where HF's pooling would skip
trailing pad-token ids). It reads the policy's token ids as they are, so its tokenizer must be
the policy's (re-tokenising is not supported).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from megarl.config.schema import ExperimentConfig
from megarl.config.validate import resolve
from megarl.data.batch import Batch
from megarl.engines.megatron.context_parallel import gather_tokens, split_tokens
from megarl.engines.megatron.engine import MegatronEngine
from megarl.engines.megatron.heads import token_values
from megarl.engines.megatron.model import RM_SCORE, ModelSource, read_arch
from megarl.engines.megatron.sequences import Layout, MicroBatch

MODEL_KEY = "reward_model.model.path"


def policy_tokenizer_path(config: ExperimentConfig) -> str:
    """Where the policy's tokenizer comes from (as the trainer loads it)."""
    return config.data.tokenizer or config.actor_rollout_ref.model.path


def check_tokenizer(config: ExperimentConfig) -> None:
    """The reward model must read the policy's token ids: `reward_model.model.input_tokenizer`,
    when set, must be the policy's tokenizer, and the reward model's own tokenizer (when its
    directory has a tokenizer.json) must have the policy's vocabulary."""
    rm, policy = config.reward_model.model, policy_tokenizer_path(config)
    unsupported = ("re-tokenising responses for a reward model with another tokenizer is not supported: "
                   "use a reward model trained on the policy's tokenizer")
    if rm.input_tokenizer is not None and Path(rm.input_tokenizer).resolve() != Path(policy).resolve():
        raise NotImplementedError(
            f"reward_model.model.input_tokenizer={rm.input_tokenizer!r} differs from the policy's tokenizer "
            f"{policy!r} (data.tokenizer or actor_rollout_ref.model.path); {unsupported}"
        )
    files = [Path(policy) / "tokenizer.json", Path(rm.path) / "tokenizer.json"]
    if all(f.is_file() for f in files):
        from tokenizers import Tokenizer

        policy_vocab, rm_vocab = (Tokenizer.from_file(str(f)).get_vocab() for f in files)
        if policy_vocab != rm_vocab:
            raise NotImplementedError(
                f"{MODEL_KEY}={rm.path!r}: its tokenizer's vocabulary differs from the policy's ({policy!r}); "
                f"{unsupported}"
            )


def check_score_head(path: str) -> None:
    """`path` is an HF checkpoint with a [1, hidden_size] `score.weight`: a reward model is never
    randomly initialised."""
    from megarl.bridge.safetensors_io import HFCheckpointReader

    source = ModelSource.resolve(path, MODEL_KEY)
    if source.kind != "hf":
        raise NotImplementedError(
            f"{MODEL_KEY}={path!r}: a torch_dist checkpoint; the reward model loads an HF "
            "*ForSequenceClassification checkpoint (convert back with tools/convert_megatron_to_hf.py)"
        )
    hidden = read_arch(source, {}, MODEL_KEY).hidden_size  # rejects num_labels != 1, naming config.json
    with HFCheckpointReader(source.path) as reader:
        shape = reader.shape(RM_SCORE) if RM_SCORE in reader.names() else None
    if shape != (1, hidden):
        found = "has none" if shape is None else f"has one of shape {list(shape)}"
        raise ValueError(
            f"{MODEL_KEY}={path!r}: a reward model needs a `{RM_SCORE}` of shape [1, {hidden}] in {source.path}, "
            f"which {found}; point it to an HF *ForSequenceClassification checkpoint with num_labels=1 "
            "(a reward model is never randomly initialised)"
        )


class RewardModelEngine(MegatronEngine):
    """The reward model (`reward_model`); forward only."""

    def __init__(self, config: ExperimentConfig, sequence_layout: Optional[Layout] = None):
        config = resolve(config)
        rm = config.reward_model
        if not rm.model.path:
            raise ValueError(f"{MODEL_KEY} is not set: the reward model needs a checkpoint")
        check_tokenizer(config)
        check_score_head(rm.model.path)
        self.config = config
        # None: the actor's log-prob micro-batch (responses per micro-batch)
        self.micro_batch_size = rm.micro_batch_size_per_gpu or config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
        super().__init__(
            section="reward_model",
            model_path=rm.model.path,
            model_key=MODEL_KEY,
            override_config={},
            dtype=config.actor_rollout_ref.model.dtype,
            megatron_cfg=rm.megatron,
            value_head=True,  # the backbone with `score.weight` as its [1, H] head
            sequence_layout=sequence_layout,
            collective_timeout_s=config.actor_rollout_ref.nccl_timeout,
        )

    def micro_batches(self, batch: Batch, *, max_samples, max_tokens, data_keys=()) -> list[MicroBatch]:
        """As the engine's, but the head gets one hidden state per sample: its last real token's
        (with context parallelism, on the CP rank holding that position: `mb.cp` says which)."""
        groups = super().micro_batches(batch, max_samples=max_samples, max_tokens=max_tokens, data_keys=data_keys)
        lengths = batch.token_lengths()
        out = []
        for mb in groups:
            rows = mb.hidden_rows(lengths[mb.rows] - 1)  # each sample's last real token
            if mb.cp is None:
                out.append(dataclasses.replace(mb, token_index=rows.to(mb.token_index.device)))
                continue
            cp, mine = split_tokens(rows, mb.cp_rows, mb.cp.rank)
            out.append(dataclasses.replace(mb, token_index=mine.to(mb.token_index.device), cp=cp))
        return out

    def compute_rm_scores(self, batch: Batch) -> Optional[dict]:
        """{"rm_scores": [B] float32 on the CPU} on output ranks (None elsewhere): the score head
        at each sample's last real token. Micro-batches of reward_model.micro_batch_size_per_gpu
        samples (default: the rollout's log-prob micro-batch)."""
        head_weight = self.model_chunks[-1].output_layer.weight if self._is_last_stage() else None

        def head(mb: MicroBatch, hidden: torch.Tensor):
            scores = token_values(hidden, head_weight)  # [b] (this CP rank's samples with CP)
            if mb.cp is not None:
                scores = gather_tokens(scores, mb.cp)
            return scores.new_zeros(()), {"rows": mb.rows, "rm_scores": scores}

        outputs = self.run(self.micro_batches(batch, max_samples=self.micro_batch_size, max_tokens=None), head, True)
        if not self.is_output_rank:
            return None
        scores = torch.zeros(len(batch), dtype=torch.float32)
        for out in outputs:
            scores[out["rows"]] = out["rm_scores"].float().cpu()
        return {"rm_scores": scores}
