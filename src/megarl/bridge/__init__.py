"""HF <-> megatron-core: architecture rules, config translation, pure TP/PP/VPP sharding, and
streaming safetensors / `torch_dist` I/O. Holds no process groups; imports megatron-core only in
`megatron_config` functions that build megatron objects."""
from megarl.bridge.arch import FAMILIES, ModelArch, arch_from_hf_config, load_hf_config
from megarl.bridge.errors import ConversionError
from megarl.bridge.mapping import WeightMap, canonical_name, is_extra_state, tp_split
from megarl.bridge.sharding import ParallelLayout, check_layout, layer_offset, merge_model, shard_model, shard_tp, unshard_tp
from megarl.bridge.transforms import padded_vocab_size

__all__ = [
    "FAMILIES",
    "ConversionError",
    "ModelArch",
    "ParallelLayout",
    "WeightMap",
    "arch_from_hf_config",
    "canonical_name",
    "check_layout",
    "is_extra_state",
    "layer_offset",
    "load_hf_config",
    "merge_model",
    "padded_vocab_size",
    "shard_model",
    "shard_tp",
    "tp_split",
    "unshard_tp",
]
