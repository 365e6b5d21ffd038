"""megarl's pipeline split (`sharding.stage_layers`, `layer_offset`, `chunk_layers`) against
megatron-core's own: `TransformerConfig`'s uneven-stage checks, `get_transformer_layer_offset` and
`get_num_layers_to_build`, for even and uneven splits with and without virtual stages. No process
group: megatron's functions take the pipeline rank as an argument."""
import pytest
import torch

from megarl.bridge.errors import ConversionError
from megarl.bridge.sharding import ParallelLayout, chunk_layers, layer_offset, stage_layers

CASES = [  # (layers, pp, vpp, first, last)
    (8, 2, 1, None, None), (8, 4, 2, None, None), (8, 2, 1, 3, None), (8, 2, 1, None, 3), (8, 4, 1, 1, 1),
    (8, 3, 1, 2, None), (7, 3, 1, None, 1), (8, 2, 2, 2, None), (12, 3, 2, 2, 2), (9, 4, 1, 3, None),
    (8, 3, 1, None, None), (8, 2, 1, 8, None), (8, 3, 1, 3, None), (8, 4, 2, 2, 3), (8, 2, 2, 3, None),
]
# account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split: (layers, pp, vpp, embedding, loss)
SPLIT_CASES = [
    (7, 2, 1, True, False), (7, 2, 1, False, True), (6, 2, 1, True, True), (4, 3, 1, True, True),
    (7, 4, 1, True, False), (6, 4, 2, True, True), (7, 2, 2, True, False), (7, 2, 2, False, True),
    (10, 3, 2, True, True), (8, 2, 1, True, False), (6, 2, 2, True, True), (4, 1, 1, True, True),
    (3, 1, 1, True, False), (8, 2, 1, True, True), (2, 2, 1, True, True),
]


def _megatron(layers, pp, vpp, first, last, embedding=False, loss=False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                             num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                             account_for_embedding_in_pipeline_split=embedding,
                             account_for_loss_in_pipeline_split=loss, pipeline_dtype=torch.float32)


@pytest.mark.parametrize("layers, pp, vpp, embedding, loss", SPLIT_CASES)
def test_the_split_counting_embedding_and_loss_is_megatron_cores(layers, pp, vpp, embedding, loss):
    _compare(layers, pp, vpp, None, None, embedding, loss)


@pytest.mark.parametrize("layers, pp, vpp, first, last", CASES)
def test_the_split_is_megatron_cores(layers, pp, vpp, first, last):
    _compare(layers, pp, vpp, first, last)


def _compare(layers, pp, vpp, first, last, embedding=False, loss=False):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = ParallelLayout(1, pp, vpp, first_stage_layers=first, last_stage_layers=last,
                            embedding_in_split=embedding, loss_in_split=loss)
    try:
        config = _megatron(layers, pp, vpp, first, last, embedding, loss)
    except ValueError:
        with pytest.raises(ConversionError):
            stage_layers(layers, layout)
        return
    # megatron builds an even split of layers not a multiple of pp * vpp; megarl refuses uneven chunks
    if first is None and last is None and not (embedding or loss) and layers % (pp * vpp):
        with pytest.raises(ConversionError, match="is not a multiple of pp"):
            stage_layers(layers, layout)
        return
    for p in range(pp):
        for v in range(vpp):
            stage = v if vpp > 1 else None
            assert layer_offset(layers, layout, p, v) == get_transformer_layer_offset(config, stage, p), (p, v)
            assert chunk_layers(layers, layout, p, v) == get_num_layers_to_build(config, stage, p), (p, v)
    assert sum(stage_layers(layers, layout)) == layers


def test_uneven_layouts_name_megatrons_fields():
    assert str(ParallelLayout(1, 2, first_stage_layers=3)) == "TP=1 PP=2 VPP=1 num_layers_in_first_pipeline_stage=3"
    assert stage_layers(8, ParallelLayout(1, 4, first_stage_layers=1, last_stage_layers=1)) == [1, 3, 3, 1]
    with pytest.raises(ConversionError, match="num_layers_in_last_pipeline_stage=2 needs pp > 1"):
        ParallelLayout(1, 1, last_stage_layers=2)
    with pytest.raises(ConversionError, match="num_layers_in_first_pipeline_stage=0 must be a positive integer"):
        ParallelLayout(1, 2, first_stage_layers=0)
    with pytest.raises(ConversionError, match=r"the 1 layers of num_hidden_layers=8 left for the 2 middle"):
        stage_layers(8, ParallelLayout(1, 4, first_stage_layers=4, last_stage_layers=3))
    assert stage_layers(6, ParallelLayout(1, 2, embedding_in_split=True, loss_in_split=True)) == [3, 3]
    assert stage_layers(4, ParallelLayout(1, 3, embedding_in_split=True, loss_in_split=True)) == [1, 2, 1]
    with pytest.raises(ConversionError, match="cannot be set together with account_for_embedding_in_pipeline_split"):
        ParallelLayout(1, 2, first_stage_layers=3, embedding_in_split=True)
