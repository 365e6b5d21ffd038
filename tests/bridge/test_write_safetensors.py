"""`write_safetensors` (views into one buffer, written without copies) read back by safetensors' own reader."""
import torch
from safetensors import safe_open

from megarl.bridge.safetensors_io import write_safetensors


def test_views_of_one_buffer_read_back_by_safetensors(tmp_path):
    flat = torch.arange(64, dtype=torch.uint8)
    named = [("a.weight", flat[:32].view(torch.float32).view(2, 4)),  # 32 bytes: fp32 [2, 4]
             ("b.weight", flat[32:38].view(torch.bfloat16)),  # 6 bytes: bf16 [3]
             ("c.bias", flat[40:48].view(torch.float16).view(2, 2))]  # after a gap of 2 bytes
    write_safetensors(named, tmp_path / "x.safetensors")
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(n for n, _ in named)
        for name, tensor in named:
            got = f.get_tensor(name)
            assert got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name
