"""`megarl doctor`: each known-bad combination is caught by its pure check, and the command on this
machine prints what importlib.metadata and torch report, exiting 0, or 1 when a config needs CUDA."""
import importlib.metadata as metadata
from pathlib import Path

import torch

from megarl.cli import main
from megarl.launch import doctor
from megarl.launch.doctor import Facts

# megatron-core 0.16.1's own METADATA line (its `dev` extra); 0.19.2 declares TE with no bound
MCORE_0161_TE = 'transformer-engine[core_cu13,pytorch]<2.12.0,>=2.9.0a0; extra == "dev"'
MCORE_0192_TE = 'transformer-engine[core_cu13,pytorch]; extra == "te"'


def test_megatron_core_outside_the_tested_range_is_bad():
    assert doctor.check_megatron_core("0.16.1") == [] and doctor.check_megatron_core("0.19.2") == []
    for version in ("0.15.3", "0.16.0", "0.20.0", "1.0.0"):
        (msg,) = doctor.check_megatron_core(version)
        assert f"megatron-core {version} is outside the tested range" in msg
    assert "not installed" in doctor.check_megatron_core(None)[0]


def test_transformer_engine_outside_megatron_cores_declared_range_is_bad():
    requires = ["torch>=2.6.0", "numpy", MCORE_0161_TE]
    assert str(doctor.transformer_engine_range(requires)) in ("<2.12.0,>=2.9.0a0", ">=2.9.0a0,<2.12.0")
    assert doctor.check_transformer_engine("2.11.0", requires) == []
    assert doctor.check_transformer_engine("2.9.0", requires) == []
    (msg,) = doctor.check_transformer_engine("2.20.2", requires)  # what the unbounded extra resolved to
    assert "transformer-engine 2.20.2 is outside" in msg and "<2.12.0" in msg
    assert doctor.check_transformer_engine("2.20.2", ["torch>=2.6.0", MCORE_0192_TE]) == []  # 0.19: no bound
    assert doctor.check_transformer_engine(None, requires) == []  # not installed: nothing to check


def test_a_requirement_of_sglang_or_megatron_core_that_the_installed_set_breaks_is_bad():
    installed = {"sglang": "0.5.23", "torch": "2.13.0", "transformers": "5.19.0", "megatron-core": "0.16.1"}
    requires = {"sglang": ["torch==2.14.1", "transformers==5.19.0", 'pytest; extra == "test"'],
                "megatron-core": ["torch>=2.6.0", "packaging>=24.2"]}
    (msg,) = doctor.unmet_requirements(requires, installed)
    assert msg == "sglang 0.5.23 requires torch==2.14.1, but torch 2.13.0 is installed"
    assert doctor.unmet_requirements(requires, {**installed, "torch": "2.14.1"}) == []
    del installed["sglang"]  # not installed: its requirements are not checked
    assert doctor.unmet_requirements(requires, installed) == []


def test_no_cuda_with_a_gpu_config_or_with_unverified_cpu_shims_is_bad():
    base = dict(python="3.11.7", installed={"megatron-core": "0.16.1", "torch": "2.13.0"}, verified_cpu_shims=("0.16.1",))
    assert doctor.check_cuda(Facts(**base)) == []
    (msg,) = doctor.check_cuda(Facts(**base, gpu_config="trainer.device=cuda"))
    assert msg == "the config needs CUDA (trainer.device=cuda), but torch has no CUDA (a CPU build)"
    assert doctor.check_cuda(Facts(**base, gpu_config="trainer.device=cuda", cuda_available=True)) == []
    (msg,) = doctor.check_cuda(Facts(**{**base, "verified_cpu_shims": ("0.19.2",)}))
    assert "CPU shims were verified on megatron-core 0.19.2 only, not 0.16.1" in msg


def test_python_outside_the_tested_lines_is_bad():
    assert doctor.check_python("3.11.7") == [] and doctor.check_python("3.12.1") == []
    assert "Python 3.10.13 is not a tested line" in doctor.check_python("3.10.13")[0]
    assert doctor.check_python("3.13.0")


def test_the_command_prints_this_machines_versions_and_exits_0(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for dist in ("megatron-core", "ray", "transformers", "sglang-router"):
        assert f"{dist:<28}{metadata.version(dist)}\n" in out
    assert f"torch                       {torch.__version__.split('+')[0]}  (CUDA {torch.version.cuda or 'none: CPU build'}" in out
    assert f"GPUs                        {torch.cuda.device_count()}" in out
    assert out.rstrip().endswith("OK: a tested combination")


def test_the_command_exits_1_when_the_config_needs_cuda_this_machine_lacks(capsys):
    expected = 0 if torch.cuda.is_available() else 1
    quickstart = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
    assert main(["doctor", "--config", quickstart, "trainer.device=cuda"]) == expected
    if expected:
        assert "WARNING: the config needs CUDA (trainer.device=cuda)" in capsys.readouterr().out
