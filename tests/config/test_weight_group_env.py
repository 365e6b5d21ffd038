"""SGLang's NCCL variables for the weight-update group (megarl.config.devices.weight_group_nccl_env),
per case, and `decide_devices` giving every training worker exactly them. They are process-wide:
NCCL caches NCCL_NVLS_ENABLE at its first read and has no per-communicator NVLS switch (the
function's docstring cites the NCCL sources), so NVLink SHARP is off for the training groups too
whenever the weight sync is an NCCL group."""
import itertools

import pytest

from megarl.config import ConfigError
from megarl.config.devices import decide_devices, weight_group_nccl_env

# what SGLang sets in its own processes: sglang entrypoints/engine.py::_set_envs_and_config
SGLANG_NCCL = (("NCCL_CUMEM_ENABLE", "0"), ("NCCL_NVLS_ENABLE", "0"))


@pytest.mark.parametrize("backend, expected", [
    ("nccl", SGLANG_NCCL),  # split placement, real SGLang, distributed transport on GPUs
    ("gloo", ()),  # the CPU engine's group
    (None, ()),  # tensor handles or disk: no weight-update group
])
def test_weight_group_nccl_env_per_case(backend, expected):
    assert weight_group_nccl_env(backend) == expected


def test_decide_devices_gives_the_training_world_exactly_the_weight_group_env():
    cases = itertools.product(["cpu", "cuda"], ["colocate", "split"], ["sglang", "cpu"],
                              ["auto", "distributed", "tensor", "disk"])
    seen = set()
    for device, placement, engine, transport in cases:
        try:
            d = decide_devices(device, True, placement, engine, transport, collective_timeout_s=600.0)
        except ConfigError:
            continue  # an impossible combination, refused at load time
        env = weight_group_nccl_env(d.weight_sync_backend)
        if d.device == "cpu":
            assert d.nccl_env == ()
        else:
            assert d.nccl_env[:len(env)] == env
            assert not any(name.startswith("NCCL_") for name, _ in d.nccl_env[len(env):])  # only the watchdog's
        seen.add((d.device, d.weight_sync_backend))
    assert {("cuda", "nccl"), ("cuda", None), ("cuda", "gloo"), ("cpu", "gloo")} <= seen
