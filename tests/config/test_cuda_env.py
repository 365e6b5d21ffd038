"""CUDA_DEVICE_MAX_CONNECTIONS for the training workers (megarl.config.devices.cuda_connections_env),
per case on CPU, against megatron-core's own check: its tensor-parallel linear warns unless the
variable is "1" when it overlaps a sequence-parallel all-gather or an input-gradient all-reduce
with the gradient GEMMs (tensor_parallel/layers.py). That the environment reaches the workers'
Ray actors is tests/trainer/test_training_env.py."""
import itertools
import warnings

import pytest
import torch

from megarl.config import ConfigError, devices
from megarl.config.devices import decide_devices

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"


@pytest.mark.parametrize("device, expected", [
    ("cuda", ((VARIABLE, "1"),)),  # megatron-core's overlap relies on one work queue
    ("cpu", ()),  # no CUDA context: nothing to set
])
def test_cuda_connections_env_per_device(device, expected):
    assert devices.cuda_connections_env(device) == expected


def test_every_cuda_decision_gives_the_workers_one_connection_and_no_cpu_decision_any():
    cases = itertools.product(["auto", "cuda", "cpu"], [True, False], ["colocate", "split"], ["sglang", "cpu"],
                              ["auto", "distributed", "tensor", "disk"])
    seen = set()
    for device, cuda, placement, engine, transport in cases:
        try:
            d = decide_devices(device, cuda, placement, engine, transport, collective_timeout_s=600.0)
        except ConfigError:
            continue  # an impossible combination, refused at load time
        assert d.training_env.get(VARIABLE) == ("1" if d.device == "cuda" else None), (device, cuda, placement,
                                                                                       engine, transport)
        seen.add(d.device)
        if d.device == "cuda":
            assert f"{VARIABLE}=1" in d.summary()  # `megarl plan` and the run's log show it
    assert seen == {"cuda", "cpu"}


def megatron_connection_warnings(env: dict[str, str], monkeypatch, *, sequence_parallel: bool,
                                 allreduce_dgrad: bool) -> list[str]:
    """The CUDA_DEVICE_MAX_CONNECTIONS warnings megatron-core's linear gives in a process with `env`."""
    from megatron.core.tensor_parallel import layers

    monkeypatch.delenv(VARIABLE, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    fn = layers.linear_with_grad_accumulation_and_async_allreduce
    monkeypatch.setattr(fn, "warned", False)  # it warns once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn(torch.ones(2, 1, 4), torch.ones(3, 4), None, gradient_accumulation_fusion=False,
               allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel)
        except Exception:  # noqa: BLE001 the sequence-parallel all-gather needs a TP group; the check came first
            pass
    return [str(w.message) for w in caught if VARIABLE in str(w.message)]


@pytest.mark.parametrize("sequence_parallel, allreduce_dgrad", [(True, False), (False, True)])
def test_megatron_cores_own_check_is_satisfied_by_the_cuda_training_env(monkeypatch, sequence_parallel,
                                                                        allreduce_dgrad):
    flags = dict(sequence_parallel=sequence_parallel, allreduce_dgrad=allreduce_dgrad)
    cuda = decide_devices("cuda", True, "split", "sglang", "auto", collective_timeout_s=600.0)
    assert megatron_connection_warnings(cuda.training_env, monkeypatch, **flags) == []
    # negative control: without the variable (what the workers had before), megatron-core warns
    cpu = decide_devices("cpu", False, "split", "cpu", "auto", collective_timeout_s=600.0)
    said = megatron_connection_warnings(cpu.training_env, monkeypatch, **flags)
    assert len(said) == 1 and f"set the environment variable {VARIABLE} to 1" in said[0]
