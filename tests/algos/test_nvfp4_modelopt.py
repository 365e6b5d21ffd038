"""megarl's NVFP4 fake quantization against NVIDIA ModelOpt 0.47.0's own code, bit for bit.

ModelOpt comes from its wheel (requirements/modelopt-oracle.lock, `make install-modelopt-oracle`,
which `make test` runs; $MEGARL_MODELOPT_WHEEL or .modelopt-oracle/), never installed: its
NVFP4QTensor (torch/quantization/qtensor/nvfp4_tensor.py) and the modules it imports are executed
from the zip, the helpers of its heavy `utils` package (reduce_amax, reduce_block_amax,
reduce_block_padding of utils/core_utils.py) extracted from their source. ModelOpt's training
kernels (triton, CUDA extensions: tensor_quant.py `_dynamic_block_quantize_impl` asserts a CUDA
amax) do not run on a CPU; its export path does, and is what NVFP4 serving computes with
(megarl.algos.nvfp4's docstring says where the two differ).
"""
from __future__ import annotations

import ast
import os
import sys
import types
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import torch

from megarl.algos.nvfp4 import nvfp4_dequantized, nvfp4_fake_quant

REPO = Path(__file__).resolve().parents[2]
WHEEL = Path(os.environ.get("MEGARL_MODELOPT_WHEEL")
             or REPO / ".modelopt-oracle" / "nvidia_modelopt-0.47.0-py3-none-any.whl")
Q = "modelopt/torch/quantization/"


def _module(name: str, source: str = "", package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__package__ = name if package else name.rpartition(".")[0]
    if package:
        module.__path__ = []
    sys.modules[name] = module
    if source:
        exec(compile(source, f"<modelopt {name}>", "exec"), module.__dict__)
    return module


def _functions(source: str, names: list[str]) -> str:
    """The source of the top-level functions `names` of a module and of its constants (without its
    imports)."""
    tree = ast.parse(source)
    return "\n".join(ast.get_source_segment(source, node) for node in tree.body
                     if isinstance(node, ast.FunctionDef) and node.name in names
                     or isinstance(node, ast.Assign) and node.targets[0].id.isupper() and node.targets[0].id.startswith("_"))


@pytest.fixture(scope="module")
def NVFP4QTensor():
    if not WHEEL.is_file():
        pytest.fail(f"ModelOpt 0.47.0's wheel is not at {WHEEL}: run `make install-modelopt-oracle` "
                    "(or set MEGARL_MODELOPT_WHEEL)")
    with zipfile.ZipFile(WHEEL) as wheel:
        read = lambda path: wheel.read(Q + path).decode()  # noqa: E731
        with mock.patch.dict(sys.modules):
            for package in ("modelopt", "modelopt.torch", "modelopt.torch.quantization",
                            "modelopt.torch.quantization.backends", "modelopt.torch.quantization.qtensor"):
                _module(package, package=True)
            utils = _module("modelopt.torch.quantization.utils", package=True)
            exec("import torch\nimport torch.nn.functional as F\n"
                 + _functions(read("utils/core_utils.py"), ["reduce_amax", "reduce_block_amax", "reduce_block_padding"])
                 + "\nfsdp2_aware_weight_update = patch_fsdp_mp_dtypes = None\n", utils.__dict__)
            _module("modelopt.torch.quantization.utils.numeric_utils", read("utils/numeric_utils.py"))
            _module("modelopt.torch.quantization.backends.utils", read("backends/utils.py"))
            _module("modelopt.torch.quantization.qtensor.base_qtensor", read("qtensor/base_qtensor.py"))
            nvfp4 = _module("modelopt.torch.quantization.qtensor.nvfp4_tensor", read("qtensor/nvfp4_tensor.py"))
            yield nvfp4.NVFP4QTensor


def modelopt_qdq(NVFP4QTensor, weight: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4 round trip of `weight`, as its export and NVFP4 serving see it."""
    packed, scale, global_scale = NVFP4QTensor.quantize(weight.clone(), 16)
    return packed.dequantize(dtype=weight.dtype, scale=scale, double_scale=global_scale, block_sizes={-1: 16})


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def weights(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(64, 128, generator=g) * 0.02
    zeros = plain.clone()
    zeros[3] = 0  # whole zero rows (zero groups)
    zeros[5, :16] = 0
    zeros[7, ::3] = 0
    outlier = plain.clone()
    outlier[0, 0] = 300.0  # a huge outlier: most groups' scales far below it (tiny and subnormal e4m3 scales)
    outlier[1, 17] = -1e-8
    # ties: every e2m1 midpoint (and its grid points) in a group whose amax is 6 x a power of two, so
    # that the group's scale is exact and the scaled values land on the midpoints exactly
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    tie_rows = torch.stack([ties * 2.0 ** -4, -ties * 2.0 ** -4, ties * 2.0 ** 3, ties.flip(0)])
    tie_weight = tie_rows.repeat(1, 4)  # [4, 64]
    mixed = torch.randn(32, 48, generator=g) * torch.logspace(-6, 2, 48)  # groups of very different ranges
    return [w.to(dtype) for w in (plain, zeros, outlier, tie_weight, mixed)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_for_bit_with_modelopt(NVFP4QTensor, dtype):
    for weight in weights(dtype):
        expected = modelopt_qdq(NVFP4QTensor, weight)
        got = nvfp4_dequantized(weight)
        assert got.dtype == dtype and got.shape == weight.shape
        assert torch.equal(bits(got), bits(expected)), (got - expected).abs().max()
        assert torch.equal(bits(nvfp4_fake_quant(weight)), bits(expected))


def test_ties_round_to_even_hand_computed():
    """The grid and its ties, hand-computed: the group's amax 6 makes the global scale 1/448 and the
    group's e4m3 scale 448, so each value is rounded as it stands."""
    values = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.2, 0.3, 0.8, 4.9, 5.1, -0.75, -2.5, -0.1])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, 0.5, 1.0, 4.0, 6.0, -1.0, -2.0, 0.0])
    assert torch.equal(nvfp4_dequantized(values[None]), expected[None])


def test_all_zero_weight_and_straight_through_gradient():
    assert torch.equal(nvfp4_dequantized(torch.zeros(2, 32)), torch.zeros(2, 32))
    weight = (torch.randn(4, 32) * 0.1).requires_grad_()
    upstream = torch.randn(4, 32)
    (nvfp4_fake_quant(weight) * upstream).sum().backward()
    assert torch.equal(weight.grad, upstream)
    with pytest.raises(ValueError, match="not a multiple of the group size 16"):
        nvfp4_dequantized(torch.ones(2, 24))
