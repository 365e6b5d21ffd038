"""actor_rollout_ref.nccl_timeout (verl's key, seconds) and NCCL's watchdog decided from it
(megarl.config.devices.nccl_watchdog_env), against hand-computed values, PyTorch's documented
variable semantics and torch's own ProcessGroupNCCL header. That the key reaches the groups for real
is tests/engines/test_collective_timeout.py."""
import logging
import re
from pathlib import Path

import pytest
import torch

from megarl.config import ConfigError, load_and_validate, load_config
from megarl.config.devices import decide_devices, nccl_watchdog_env

KEY = "actor_rollout_ref.nccl_timeout"
# a verl-style command line (tests/config/test_verl_compat.py's)
BASE = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.rollout.mode=async"]
TORCH_HEARTBEAT_DEFAULT_S = 480  # torch's own (ProcessGroupNCCL.cpp, HeartbeatMonitor: 60 * 8)


# ------------------------------------------------------------------------------------- the key
def test_the_default_is_thirty_minutes():
    assert load_config(None, []).actor_rollout_ref.nccl_timeout == 1800.0


def test_verls_override_is_accepted_as_a_megarl_key(caplog):
    """verl's Qwen3-235B example sets it to 7200; it is megarl's own key, so no verl warning."""
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_and_validate(None, BASE + [f"{KEY}=7200"])
    assert config.actor_rollout_ref.nccl_timeout == 7200.0
    assert not [r for r in caplog.records if "nccl_timeout" in r.getMessage()]


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_timeout_that_is_not_positive_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, BASE + [f"{KEY}={value}"])
    assert f"{KEY}={float(value)}: must be > 0 seconds" in str(info.value)


# ------------------------------------------------------------------------------------- the watchdog
def test_on_cuda_the_watchdog_aborts_on_error_monitors_and_beats_no_shorter_than_the_timeout():
    # PyTorch's "ProcessGroupNCCL Environment Variables": ASYNC_ERROR_HANDLING=1 is "aborting NCCL
    # communicator and tearing down process upon error"; ENABLE_MONITORING=1 kills a process whose
    # watchdog has no heartbeat for HEARTBEAT_TIMEOUT_SEC
    assert nccl_watchdog_env(1800.0) == (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                                         ("TORCH_NCCL_ENABLE_MONITORING", "1"),
                                         ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "1800"))
    d = decide_devices("cuda", True, "split", "sglang", "auto", collective_timeout_s=7200.0)
    assert d.training_env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0",
                              "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
                              "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "7200"}
    # what `megarl plan` and the run's log print
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 TORCH_NCCL_ENABLE_MONITORING=1 TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=7200" \
        in d.summary()


@pytest.mark.parametrize("timeout_s", [3.0, 7200.0])
def test_on_cpu_no_watchdog_variable_is_set(timeout_s):
    for device, cuda_available in (("cpu", False), ("auto", False), ("cpu", True)):
        d = decide_devices(device, cuda_available, "colocate", "cpu", "auto", collective_timeout_s=timeout_s)
        assert d.training_env == {} and "TORCH_NCCL" not in d.summary()


@pytest.mark.parametrize("timeout_s,heartbeat_s", [(3.0, 480), (479.5, 480), (480.0, 480), (1800.0, 1800),
                                                   (7200.0, 7200), (7200.4, 7201)])
def test_the_heartbeat_is_never_shorter_than_the_collective_timeout_nor_torchs_default(timeout_s, heartbeat_s):
    value = dict(nccl_watchdog_env(timeout_s))["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]
    assert value == str(heartbeat_s)  # an integer: torch reads it with getCvarInt
    assert int(value) >= timeout_s and int(value) >= TORCH_HEARTBEAT_DEFAULT_S


def test_every_variable_is_one_torchs_process_group_nccl_reads():
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    if not header.exists():
        pytest.skip(f"this torch ships no {header.name}")
    declared = set(re.findall(r'static std::vector<std::string> (TORCH_NCCL_\w+) = \{\s*"(\1)"', header.read_text()))
    assert {(name, name) for name, _ in nccl_watchdog_env(1800.0)} <= declared
