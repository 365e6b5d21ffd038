"""The tensor transport's GPU half fails loudly where it cannot work (the CPU half runs end to end
in test_weight_sync.py and tools/gpu_check.py --cpu)."""
import importlib.util

import pytest

from megarl.sync.ipc_copies import sglang_serialisation as _sglang_serialisation


def test_gpu_serialisation_needs_sglang_and_says_how_to_install_it():
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(RuntimeError, match=r"pip install -e '\.\[gpu\]'.*ModuleNotFoundError"):
            _sglang_serialisation()
    else:  # with SGLang: its serializer and the metadata class its server's allow-list names
        serializer, metadata = _sglang_serialisation()
        assert metadata.__module__ == "sglang.srt.weight_sync.tensor_bucket" and hasattr(serializer, "serialize")
