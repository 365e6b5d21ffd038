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
decoder's own. megatron-core does this in `GPTModel._postprocess` (0.16.1) or its `process_mtp_loss` (0.19);
megarl's model class overrides `_postprocess` for a training pass of the MTP layers on both lines
(megarl.engines.megatron.model), where `mtp_postprocess` does what megatron's does with the token mean over
the whole micro-batch under context parallelism (`cp_token_normaliser`, `mtp_packed_seq_params`). The
cross-entropy comes from `compute_language_model_loss`, which megarl's model class makes skip megatron's
vocabulary padding.

Context parallelism: each CP rank holds chunks r and 2 CP - 1 - r of every sequence (megarl.engines.megatron.
context_parallel, megatron's own layout), and `mtp_labels` gives each rank the labels of its own positions;
megatron's `roll_tensor` (with the CP group) rolls labels, loss mask and input ids across the chunk boundaries
of that very layout (multi_token_prediction.py: each rank sends its chunks' first elements to its neighbours).
"""
from __future__ import annotations

import dataclasses
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


def mtp_packed_seq_params(packed_seq_params):
    """The packed sequences (`PackedSeqParams`, or None) as the MTP block and its rolls take them. With context
    parallelism megarl pads each sequence to a multiple of 2 CP (`cu_seqlens_q_padded`) and CP rank r holds chunks
    r and 2 CP - 1 - r of each padded sequence (megarl.engines.megatron.context_parallel), but megatron's
    `roll_tensor` cuts each rank's rows at `cu_seqlens_q` // CP (multi_token_prediction.py
    `_roll_tensor_packed_seq`, 0.16.1 and 0.19 alike): right only for the padded offsets. So these take them
    as `cu_seqlens_q` / `cu_seqlens_kv` too: a real token sees the same keys (causal attention: a sequence's
    padding follows its real tokens; RoPE already reads the padded offsets, attention.py), and the padding's
    outputs are never scored (loss_mask 0)."""
    if packed_seq_params is None or packed_seq_params.cu_seqlens_q_padded is None:
        return packed_seq_params
    return dataclasses.replace(packed_seq_params, cu_seqlens_q=packed_seq_params.cu_seqlens_q_padded,
                               cu_seqlens_kv=packed_seq_params.cu_seqlens_kv_padded)


def cp_token_normaliser(local_tokens: torch.Tensor, cp_group) -> torch.Tensor:
    """What a CP rank divides its MTP loss sum by: the micro-batch's tokens over all CP ranks (at least 1, as
    megatron-core 0.19 clamps them) / CP, `local_tokens` (0-dim) being this rank's. Each rank's loss is then
    CP x its sum / the micro-batch's tokens: megatron's DDP averages the gradients over the data x context
    parallel ranks (1 / CP of their sum) and MTPLossLoggingHelper averages the logged losses over them too
    (avg_group), so both come out as the token mean over the whole micro-batch, as at CP 1 (megarl's main loss
    is one too: context_parallel). megatron-core divides by the rank's own tokens instead (gpt_model.py
    `_postprocess` in 0.16.1, multi_token_prediction.py `process_mtp_loss` in 0.19: `roll_tensor` returns the
    local sum), which weighs the tokens of a rank that holds fewer more."""
    if cp_group is None or cp_group.size() == 1:
        return local_tokens.clamp(min=1)
    total = local_tokens.detach().clone()
    torch.distributed.all_reduce(total, group=cp_group)
    return total.clamp(min=1) / cp_group.size()


def mtp_postprocess(model, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """megatron-core's MTP part of `GPTModel._postprocess` (0.16.1: models/gpt/gpt_model.py; 0.19:
    transformer/multi_token_prediction.py `process_mtp_loss`), with megarl's CP normaliser
    (`cp_token_normaliser`) and packed sequences (`mtp_packed_seq_params`): the MTP block on the decoder output
    `hidden_states` [s, b, H], each MTP layer's loss attached to the main hidden states, which come back
    [s, b, H]. `kwargs`: the arguments GPTModel.forward passed to `_postprocess`, with the main loss's `labels`
    and `loss_mask` [b, s] (`mtp_labels`)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, roll_tensor

    config = model.config
    packed_seq_params = mtp_packed_seq_params(kwargs.get("packed_seq_params"))
    block_kwargs = {"padding_mask": kwargs.get("padding_mask")} if "padding_mask" in kwargs else {}  # 0.19
    hidden_states = model.mtp(
        input_ids=kwargs["input_ids"], position_ids=kwargs["position_ids"], hidden_states=hidden_states,
        attention_mask=kwargs.get("attention_mask"), inference_params=kwargs.get("inference_params"),
        rotary_pos_emb=kwargs.get("rotary_pos_emb"), rotary_pos_cos=kwargs.get("rotary_pos_cos"),
        rotary_pos_sin=kwargs.get("rotary_pos_sin"), packed_seq_params=packed_seq_params,
        sequence_len_offset=kwargs.get("sequence_len_offset"), embedding=model.embedding, **block_kwargs,
        **(kwargs.get("extra_block_kwargs") or {}))
    output_weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    if getattr(config, "mtp_detach_heads", False):  # 0.19's TransformerConfig
        output_weight = (model.output_layer.weight if output_weight is None else output_weight).detach()
    chunks = torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)
    hidden_states, labels, loss_mask = chunks[0], kwargs["labels"].clone(), kwargs["loss_mask"]
    avg_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for k in range(config.mtp_num_layers):
        logits, _ = model.output_layer(chunks[k + 1], weight=output_weight,
                                       runtime_gather_output=kwargs.get("runtime_gather_output"))
        if getattr(config, "use_mup", False):  # 0.19's TransformerConfig
            logits = model._scale_logits(logits)
        labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=model.cp_group,
                                packed_seq_params=packed_seq_params)
        loss_mask, local_tokens = roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=model.cp_group,
                                              packed_seq_params=packed_seq_params)
        num_tokens = cp_token_normaliser(local_tokens, model.cp_group)
        loss = loss_mask * model.compute_language_model_loss(labels, logits)
        if model.training:
            _track_mtp_loss(model, torch.sum(loss) / num_tokens, k, logits, labels, loss_mask, kwargs, avg_group)
        scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
        added = scale * loss if config.calculate_per_token_loss else scale * loss / num_tokens
        hidden_states = MTPLossAutoScaler.apply(hidden_states, added)
    return hidden_states


def _track_mtp_loss(model, loss, k, logits, labels, loss_mask, kwargs, avg_group) -> None:
    """MTP layer `k`'s loss into megatron's MTPLossLoggingHelper: 0.16.1's `save_loss_to_tracker`, or 0.19's
    `save_metrics_to_tracker` with its acceptance counts (`_compute_mtp_acceptance_counts`, as
    `process_mtp_loss` records them)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    helper, layers = mtp.MTPLossLoggingHelper, model.config.mtp_num_layers
    if hasattr(helper, "save_loss_to_tracker"):
        helper.save_loss_to_tracker(loss, k, layers, avg_group=avg_group)
        return
    correct, total = mtp._compute_mtp_acceptance_counts(logits, labels, loss_mask, model.output_layer,
                                                        kwargs.get("runtime_gather_output"), model.tp_group)
    helper.save_metrics_to_tracker(loss, correct, total, k, layers, avg_group=avg_group)


def mtp_labels(mb) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, loss_mask) of the micro-batch `mb` in megatron's layout, shaped as `mb.input_ids` ([b, S]
    padded, [1, T] packed; with context parallelism this CP rank's positions, [b, S/CP] or [1, T/CP], whose
    rows `mb.token_index` indexes): at each position that predicts a response token, that token and 1;
    elsewhere 0 and 0. The MTP layer k at position i predicts label[i + k + 1] where loss_mask[i + k + 1] is 1
    (megatron rolls both), so it learns the response tokens k + 1 ahead of the main head."""
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
