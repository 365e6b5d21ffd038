"""Training the checkpoint's multi-token-prediction (MTP) layers with megatron-core's MTP block (verl's
`model.mtp.enable_train`: verl/models/mcore/mtp_patch.py, verl/utils/megatron_utils.py).

The last stage's `GPTModel` holds `mtp.layers.{k}` (`GPTModel(mtp_block_spec=...)`, TransformerConfig
`mtp_num_layers`, `mtp_loss_scaling_factor`); with pipeline stages also a copy of the embedding, whose gradient
megatron all-reduces with the first stage's (language_module.py `setup_embeddings_and_output_layer`,
distributed/finalize_model_grads.py), and which the weight push leaves out (the first stage sends it).

In a training pass the schedule hands the model the labels of the main loss (`mtp_labels`); megatron runs
the MTP block on the decoder's output, computes each MTP layer's cross-entropy on the labels rolled once
more, and attaches `mtp_loss_scaling_factor / mtp_num_layers` x its token mean to the main hidden states with
`MTPLossAutoScaler`, whose backward adds that loss's gradient (scaled by 1 / micro-batches,
pipeline_parallel/schedules.py `forward_step`). The main hidden states, and so the policy's log-probs, are the
decoder's own. megatron-core 0.19 does this in `GPTModel._postprocess` (`process_mtp_loss`); for 0.16, whose
`_postprocess` megarl overrides (megarl.engines.megatron.model), `mtp_postprocess` does what 0.16.1's does
(models/gpt/gpt_model.py). Both take the cross-entropy from `compute_language_model_loss`, which megarl's
model class makes skip megatron's vocabulary padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MtpTraining:
    """verl's `model.mtp` training settings (verl/workers/config/model.py MtpConfig)."""

    loss_scaling_factor: float = 0.1  # megatron's mtp_loss_scaling_factor
    detach_encoder: bool = False  # the MTP loss reaches neither the embedding nor the decoder


def mtp_block_spec(config, layer_spec, transformer_engine: bool):
    """megatron-core's MTP block spec (gpt_layer_specs.py `get_gpt_mtp_block_spec`): each MTP layer's
    transformer layer is built from `layer_spec`, the decoder's last layer's (MoE in DeepSeek-V3)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=transformer_engine)


def detach_mtp_inputs(chunk) -> None:
    """verl's `detach_encoder` (mtp_patch.py `_patched_get_embeddings_for_detach`): each MTP layer's inputs,
    the next token's embedding and the decoder's hidden states, are detached, so that the MTP loss trains
    the MTP layers (and the shared output layer) only. `MultiTokenPredictionLayer._get_embeddings` returns
    them last in megatron-core 0.16 and 0.19 alike."""
    for layer in chunk.mtp.layers:
        get_embeddings = layer._get_embeddings

        def detached(*args, _get=get_embeddings, **kwargs):
            *rest, decoder_input, hidden_states = _get(*args, **kwargs)
            return (*rest, decoder_input.detach(), hidden_states.detach())

        layer._get_embeddings = detached


def mtp_postprocess(model, hidden_states: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                    kwargs: dict) -> torch.Tensor:
    """megatron-core 0.16.1 `GPTModel._postprocess`'s MTP part (models/gpt/gpt_model.py): the MTP block on
    the decoder output `hidden_states` [s, b, H], each MTP layer's loss attached to the main hidden states,
    which come back [s, b, H]. `labels`, `loss_mask` [b, s]: the main loss's (`mtp_labels`); `kwargs`: the
    other arguments GPTModel.forward passed to `_postprocess`."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import (MTPLossAutoScaler, MTPLossLoggingHelper,
                                                                  roll_tensor)

    config = model.config
    hidden_states = model.mtp(
        input_ids=kwargs["input_ids"], position_ids=kwargs["position_ids"], hidden_states=hidden_states,
        attention_mask=kwargs.get("attention_mask"), inference_params=kwargs.get("inference_params"),
        rotary_pos_emb=kwargs.get("rotary_pos_emb"), rotary_pos_cos=kwargs.get("rotary_pos_cos"),
        rotary_pos_sin=kwargs.get("rotary_pos_sin"), packed_seq_params=kwargs.get("packed_seq_params"),
        sequence_len_offset=kwargs.get("sequence_len_offset"), embedding=model.embedding,
        **(kwargs.get("extra_block_kwargs") or {}))
    output_weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    packed_seq_params = kwargs.get("packed_seq_params")
    chunks = torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)
    hidden_states, mtp_labels = chunks[0], labels.clone()
    for k in range(config.mtp_num_layers):
        logits, _ = model.output_layer(chunks[k + 1], weight=output_weight,
                                       runtime_gather_output=kwargs.get("runtime_gather_output"))
        mtp_labels, _ = roll_tensor(mtp_labels, shifts=-1, dims=-1, cp_group=model.cp_group,
                                    packed_seq_params=packed_seq_params)
        loss_mask, num_tokens = roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=model.cp_group,
                                            packed_seq_params=packed_seq_params)
        loss = loss_mask * model.compute_language_model_loss(mtp_labels, logits)
        if model.training:
            MTPLossLoggingHelper.save_loss_to_tracker(
                torch.sum(loss) / num_tokens, k, config.mtp_num_layers,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
        added = scale * loss if config.calculate_per_token_loss else scale * loss / num_tokens
        hidden_states = MTPLossAutoScaler.apply(hidden_states, added)
    return hidden_states


def mtp_labels(mb) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, loss_mask) of the micro-batch `mb` in megatron's layout, shaped as `mb.input_ids` ([b, S]
    padded, [1, T] packed): at each position that predicts a response token, that token and 1; elsewhere 0
    and 0. The MTP layer k at position i predicts label[i + k + 1] where loss_mask[i + k + 1] is 1 (megatron
    rolls both), so it learns the response tokens k + 1 ahead of the main head."""
    rows = mb.input_ids.numel()
    labels = torch.zeros(rows, dtype=torch.long, device=mb.input_ids.device)
    mask = torch.zeros(rows, dtype=torch.float32, device=mb.input_ids.device)
    labels[mb.token_index] = mb.targets.to(labels.device)
    mask[mb.token_index] = 1.0
    b, s = mb.input_ids.shape
    # the flattened hidden states' rows are [s, b] row-major (schedule._apply_head); the labels are [b, s]
    return labels.view(s, b).t().contiguous(), mask.view(s, b).t().contiguous()


def mtp_loss_metrics(num_micro_batches: int) -> dict[str, float]:
    """`mtp_<k>_loss`: each MTP layer's token-mean cross-entropy, averaged over the micro-batches of the
    last training pass and the data-parallel ranks (megatron's MTPLossLoggingHelper, as verl's
    `get_megatron_mtp_loss` reads it); the tracker is emptied. Last pipeline stage only: a collective over
    its data-parallel group."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    losses: dict = {}
    MTPLossLoggingHelper.track_mtp_metrics(loss_scale=1.0 / num_micro_batches, iteration=0, writer=None,
                                           total_loss_dict=losses)
    return {name.replace(" ", "_"): float(value) for name, value in losses.items() if name.endswith(" loss")}
