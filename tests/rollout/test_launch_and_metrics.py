"""Command lines for SGLang, the CPU engine and the router; rollout metrics."""
import os

import pytest

from megarl.rollout.cpu.server import parse_args
from megarl.rollout.launch import (
    SGLANG_CPU_SITE,
    MultiNode,
    apply_env_overrides,
    cpu_server_command,
    router_command,
    sglang_env_overrides,
    sglang_server_command,
    sglang_server_env,
    uses_memory_saver,
)
from megarl.rollout.metrics import RequestRecord, percentile, summarize


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_sglang_command_carries_placement_and_memory_flags():
    cmd = sglang_server_command("/m", 30001, tp_size=2, base_gpu_id=4, mem_fraction_static=0.6,
                                enable_memory_saver=True, extra_args=["--attention-backend", "fa3"])
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert flag(cmd, "--tp-size") == "2" and flag(cmd, "--base-gpu-id") == "4"
    assert flag(cmd, "--mem-fraction-static") == "0.6" and flag(cmd, "--port") == "30001"
    assert "--enable-memory-saver" in cmd and cmd[-2:] == ["--attention-backend", "fa3"]
    assert "--enable-memory-saver" not in sglang_server_command("/m", 1)


def test_sglang_env_drops_expandable_segments_under_the_memory_saver():
    base = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_VISIBLE_DEVICES": "2,3"}
    env = apply_env_overrides(base, sglang_env_overrides(enable_memory_saver=True))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    assert "PYTORCH_CUDA_ALLOC_CONF" in apply_env_overrides(base, sglang_env_overrides(enable_memory_saver=False))


def test_sglang_env_turns_off_the_tp_memory_balance_check_only_when_colocated():
    """SGLang 0.5.23 distributed/bootstrap.py raises when a TP rank has < 0.9x the free memory of
    the others unless SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK is false (environ.py)."""
    colocated = apply_env_overrides({}, sglang_env_overrides(enable_memory_saver=True, colocated=True))
    assert colocated["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] == "false"
    split = apply_env_overrides({}, sglang_env_overrides(enable_memory_saver=False, colocated=False))
    assert "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK" not in split


def test_a_multi_node_server_runs_the_same_command_on_every_node_but_its_rank():
    commands = [sglang_server_command("/m", 30001, tp_size=16, multi_node=MultiNode(2, rank, "10.0.0.1:29500"))
                for rank in (0, 1)]
    assert [flag(c, "--node-rank") for c in commands] == ["0", "1"]
    assert all(flag(c, "--nnodes") == "2" and flag(c, "--dist-init-addr") == "10.0.0.1:29500" for c in commands)
    assert all(flag(c, "--tp-size") == "16" for c in commands)
    differ = [a for a, b in zip(commands[0], commands[1]) if a != b]
    assert differ == ["0"] and len(commands[0]) == len(commands[1])
    assert "--nnodes" not in sglang_server_command("/m", 1)
    for bad in [(1, 0, "h:1"), (2, 2, "h:1"), (2, -1, "h:1"), (2, 0, "h")]:
        with pytest.raises(ValueError):
            MultiNode(*bad)


def test_deterministic_inference_is_a_switch_that_is_off_by_default():
    assert "--enable-deterministic-inference" in sglang_server_command("/m", 1, deterministic=True)
    assert "--enable-deterministic-inference" not in sglang_server_command("/m", 1)


def test_sglang_on_a_cpu_gets_its_cpu_flags_and_a_kv_pool_of_every_request_at_full_length():
    cmd = sglang_server_command("/m", 1, device="cpu", context_length=256, max_running_requests=8)
    assert cmd[cmd.index("--device") + 1] == "cpu"
    assert cmd[cmd.index("--attention-backend") + 1] == "torch_native"
    assert cmd[cmd.index("--max-total-tokens") + 1] == str(256 * 8)
    assert cmd[cmd.index("--max-running-requests") + 1] == "8"
    assert "--disable-overlap-schedule" in cmd
    gpu = sglang_server_command("/m", 1, context_length=256)
    assert not {"--device", "--attention-backend", "--max-total-tokens"} & set(gpu)


@pytest.mark.parametrize("refused", [dict(enable_memory_saver=True, context_length=256),
                                     dict(deterministic=True, context_length=256), dict()])
def test_sglang_on_a_cpu_refuses_what_cannot_run_there(refused):
    # no memory saver (torch_memory_saver needs libcuda), no deterministic inference (GPU attention backends
    # only), and no KV pool without a context length
    with pytest.raises(ValueError, match="SGLang on a CPU"):
        sglang_server_command("/m", 1, device="cpu", **refused)
    with pytest.raises(ValueError, match="cuda or cpu"):
        sglang_server_command("/m", 1, device="tpu")


@pytest.mark.parametrize("device, colocated, saver", [("cuda", True, True), ("cuda", False, False),
                                                      ("cpu", True, False), ("cpu", False, False)])
def test_the_memory_saver_is_for_colocated_gpus_only(device, colocated, saver):
    assert uses_memory_saver(device, colocated) is saver


def test_sglang_on_a_cpu_gets_the_cpu_engine_switch_and_megarls_site_first_on_its_path():
    base = {"PYTHONPATH": "/user/lib", "HOME": "/h"}
    env = sglang_server_env(base, device="cpu", enable_memory_saver=False, colocated=False)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["HOME"] == "/h"
    assert env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "false"
    assert env["PYTHONPATH"].split(os.pathsep) == [SGLANG_CPU_SITE, "/user/lib"]
    assert os.path.isfile(os.path.join(SGLANG_CPU_SITE, "sgl_kernel", "__init__.py"))
    assert os.path.isfile(os.path.join(SGLANG_CPU_SITE, "sitecustomize.py"))
    gpu = sglang_server_env(base, device="cuda", enable_memory_saver=True, colocated=True)
    assert "SGLANG_USE_CPU_ENGINE" not in gpu and gpu["PYTHONPATH"] == "/user/lib"


def test_cpu_server_command_parses_back():
    cmd = cpu_server_command("/m", 31000, api_key="k", context_length=512, num_threads=1)
    args = parse_args(cmd[3:])
    parsed = (args.model_path, args.port, args.api_key, args.context_length, args.num_threads)
    assert parsed == ("/m", 31000, "k", 512, 1)
    assert args.host == "127.0.0.1"
    assert not args.disable_radix_cache  # prefix sharing on, as SGLang's radix cache by default
    assert parse_args(cpu_server_command("/m", 31000, prefix_caching=False)[3:]).disable_radix_cache
    assert parse_args(cpu_server_command("/m", 31000)[3:]).batch_wait_ms == 3.0  # engine.BATCH_WAIT_S
    assert parse_args(cpu_server_command("/m", 31000, batch_wait_ms=0)[3:]).batch_wait_ms == 0.0


def test_the_cpu_server_takes_sglangs_ep_flag_at_1_only(capsys):
    """The CPU engine serves a model in one process: it parses SGLang's `--ep-size` (and its alias)
    as 1, and refuses any other size naming the flag, exiting as argparse does (status 2)."""
    assert parse_args(cpu_server_command("/m", 31000)[3:]).ep_size == 1
    assert parse_args(["--model-path", "/m", "--expert-parallel-size", "1"]).ep_size == 1
    command = cpu_server_command("/m", 31000, ep_size=2)
    assert command[-2:] == ["--ep-size", "2"]
    with pytest.raises(SystemExit) as info:
        parse_args(command[3:])
    assert info.value.code == 2
    assert "--ep-size 2: megarl's CPU engine serves a whole model in one process" in capsys.readouterr().err


def test_router_command_has_its_own_prometheus_port():
    cmd = router_command(["http://a:1", "http://b:2"], 30000, prometheus_port=30001, disable_retries=True)
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    assert flag(cmd, "--prometheus-port") == "30001" and flag(cmd, "--prometheus-host") == "127.0.0.1"
    assert cmd[cmd.index("--worker-urls") + 1 : cmd.index("--worker-urls") + 3] == ["http://a:1", "http://b:2"]
    assert "--disable-retries" in cmd


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50 and percentile(values, 0.99) == 99 and percentile(values, 1.0) == 100
    assert percentile([], 0.5) == 0.0


def test_summarize_counts_tokens_tail_and_retries():
    records = [
        RequestRecord(prompt_tokens=10, response_tokens=(5, 7), latency_s=1.0, attempts=1, aborted_samples=0),
        RequestRecord(prompt_tokens=4, response_tokens=(30, 2), latency_s=3.0, attempts=3, aborted_samples=0),
        RequestRecord(prompt_tokens=6, response_tokens=(0, 0), latency_s=0.0, attempts=0, aborted_samples=2),
    ]
    m = summarize(records, wall_s=4.0)
    assert (m.requests, m.samples, m.prompt_tokens, m.response_tokens) == (3, 6, 40, 44)
    assert m.tokens_per_s == 11.0
    assert (m.longest_sample_tokens, m.longest_sample_s) == (30, 3.0)
    assert (m.retried_requests, m.retries, m.aborted_samples) == (1, 2, 2)
    assert (m.latency_p50_s, m.latency_max_s) == (1.0, 3.0)
    assert m.as_dict()["rollout/response_tokens"] == 44.0
