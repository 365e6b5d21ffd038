"""Command lines (and environments) that start rollout servers and the router, and what a server
would refuse at start that a model's config shows beforehand. Pure functions.

* megarl's CPU engine: `python -m megarl.rollout.cpu.server ...`
* real SGLang (GPU, the `[gpu]` extra, 0.5.23): `python -m sglang.launch_server ...`; the same on a CPU,
  from its own venv (`make install-sglang`), with `sglang_cpu_flags` and `sglang_server_env`
* the router (PyPI `sglang-router`, a Rust binary in a Python wheel; runs on CPU):
  `python -m sglang_router.launch_router --worker-urls ...`
"""
from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

from megarl.config.engine_kwargs import sglang_engine_flags
from megarl.config.rules.mtp import SGLANG_CPU_NO_DRAFT

# How long a rollout server may take to become healthy (seconds), by engine, when
# `actor_rollout_ref.rollout.server_startup_timeout_s` is unset. SGLang on GPUs loads the checkpoint
# (a 235B model in bf16 is ~470 GB: at 1 GB/s from a network filesystem, about 8 minutes per copy
# read), joins its TP/EP ranks across nodes, profiles memory and captures CUDA graphs (minutes
# with many batch sizes): 30 minutes, as megatron's own distributed_timeout_minutes default. The
# CPU engine loads a small model in seconds: 10 minutes covers a loaded CI machine.
SERVER_STARTUP_TIMEOUT_S = {"sglang": 1800.0, "cpu": 600.0}


def rollout_api_key(api_key_env: Optional[str]) -> str:
    """The API key of a run's rollout servers and router (`actor_rollout_ref.rollout.api_key_env`):
    the named environment variable's value, or a fresh random one (256 bits) when unset, so that
    nobody else on the cluster network can generate with, release or push weights into the run's
    servers (they listen on the node's address). Hex, so that it never starts with "-": the servers
    and the router read it with argparse (`--api-key KEY`), which takes such a value for an option.
    Raises KeyError naming the key if the variable is unset or empty (a config rule says so first)."""
    if api_key_env is None:
        return secrets.token_hex(32)
    key = os.environ.get(api_key_env)
    if not key:
        raise KeyError(f"actor_rollout_ref.rollout.api_key_env={api_key_env}: that environment variable is not set")
    return key


def server_startup_timeout_s(engine: str, configured: Optional[float]) -> float:
    """Seconds a server of `engine` (actor_rollout_ref.rollout.name) may take to start, or to
    restart: `configured` (server_startup_timeout_s) if set, else `SERVER_STARTUP_TIMEOUT_S[engine]`."""
    return float(configured) if configured is not None else SERVER_STARTUP_TIMEOUT_S[engine]


# SGLang 0.5.23 `srt/arg_groups/fields/exec_.py`: enable_return_routed_experts (routing replay)
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
# SGLang 0.5.23 `srt/arg_groups/fields/parallel.py`: ep_size (aliases --expert-parallel-size, --ep)
EP_FLAG = "--ep-size"
# SGLang 0.5.23 `srt/arg_groups/fields/parallel.py`: attn_dp_size (alias --attention-data-parallel-size)
ATTN_DP_FLAG = "--attn-dp-size"


def expert_split_problem(num_experts: Optional[int], ep_size: int) -> Optional[str]:
    """Why a server of expert parallel size `ep_size` (`actor_rollout_ref.rollout.expert_parallel_size`)
    cannot serve a model of `num_experts` routed experts per layer (None: a dense model), or None.
    SGLang 0.5.23 `layers/moe/fused_moe_triton/layer.py` gives each EP rank num_experts / ep_size
    experts and asserts the division is exact as the server builds the model; a dense model has
    nothing to split."""
    if ep_size == 1:
        return None
    key = f"actor_rollout_ref.rollout.expert_parallel_size={ep_size}"
    if num_experts is None:
        return f"{key}: the model is not a mixture of experts, so there are no experts to split; set 1"
    if num_experts % ep_size:
        return (f"{key} must divide the model's {num_experts} routed experts per layer (SGLang gives each EP rank "
                "the same number of them)")
    return None


# SGLang 0.5.23's switch turning prefix caching off (srt/arg_groups/fields/*.py: MemoryArgs.disable_radix_cache),
# which megarl's CPU server shares
NO_PREFIX_CACHE_FLAG = "--disable-radix-cache"


def cpu_server_command(
    model_path: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    api_key: Optional[str] = None,
    dtype: str = "auto",
    context_length: Optional[int] = None,
    max_running_requests: int = 64,
    random_seed: int = 0,
    num_threads: Optional[int] = None,
    lora: Optional[LoraServing] = None,
    return_routed_experts: bool = False,
    ep_size: int = 1,
    prefix_caching: bool = True,
    batch_wait_ms: Optional[float] = None,
    python: str = sys.executable,
) -> list[str]:
    """`return_routed_experts`: routing replay (SGLang's flag, `megarl.rollout.routed_experts`).
    `prefix_caching` false: SGLang's `--disable-radix-cache` (one prefill per sample, none shared).
    `batch_wait_ms`: how long the engine waits for more requests before starting a batch (None:
    the server's default, `engine.BATCH_WAIT_S`; 0 when each step's prompts come in one request).
    `ep_size` other than 1 is passed as SGLang's `--ep-size`, which the CPU server refuses: it serves a
    whole model in one process (a config rule says so first)."""
    cmd = [python, "-m", "megarl.rollout.cpu.server", "--model-path", model_path, "--host", host, "--port", str(port)]
    cmd += ["--dtype", dtype, "--max-running-requests", str(max_running_requests), "--random-seed", str(random_seed)]
    if api_key:
        cmd += ["--api-key", api_key]
    if context_length:
        cmd += ["--context-length", str(context_length)]
    if num_threads:
        cmd += ["--num-threads", str(num_threads)]
    if lora:
        cmd += lora.flags()
    if return_routed_experts:
        cmd += [ROUTED_EXPERTS_FLAG]
    if ep_size != 1:
        cmd += [EP_FLAG, str(ep_size)]
    if not prefix_caching:
        cmd += [NO_PREFIX_CACHE_FLAG]
    if batch_wait_ms is not None:
        cmd += ["--batch-wait-ms", str(batch_wait_ms)]
    return cmd


@dataclass(frozen=True)
class LoraServing:
    """A server that serves LoRA adapters loaded at run time (adapter-only weight sync): their
    largest `rank` and their PEFT `targets`."""

    rank: int
    targets: tuple[str, ...]

    def flags(self) -> list[str]:
        """SGLang 0.5.23's flags (`srt/arg_groups/fields/lora.py`), which megarl's CPU server shares."""
        return ["--enable-lora", "--max-lora-rank", str(self.rank), "--lora-target-modules", *self.targets]


@dataclass(frozen=True)
class SpeculativeDecoding:
    """A server that drafts with the checkpoint's own multi-token-prediction layers (verl's
    `model.mtp.enable_rollout`): SGLang's `algorithm` (EAGLE or its alias NEXTN: SGLang then takes the
    draft from the target checkpoint, `arg_groups/speculative_hook.py::_handle_eagle_family`), draft
    steps, branches per step and tokens verified per step. SGLang's weight updates reach the draft
    runner too (`managers/scheduler_components/weight_updater.py::_select_runners`, selector "all"), whose
    NextN loader takes only `model.layers.<num_hidden_layers>.*` and shares the target's embedding and
    head (`models/deepseek_common/deepseek_weight_loader.py`). With `model.mtp.enable_train` megarl pushes
    the trained MTP layers under those names (`megarl.sync.weight_sync.servers_weight_map`); without it the
    MTP layer keeps the checkpoint's weights: drafts get worse as the policy moves, and the samples stay the
    target's (speculative decoding verifies every draft token against the target)."""

    algorithm: str
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int

    def flags(self, enable_memory_saver: bool) -> list[str]:
        """SGLang 0.5.23's flags (`srt/arg_groups/fields/spec.py`); with the memory saver the draft's
        weights are kept in CPU memory while released (`--enable-draft-weights-cpu-backup`,
        fields/exec_.py), as verl does (async_sglang_server.py): no push restores them."""
        cmd = ["--speculative-algorithm", self.algorithm, "--speculative-num-steps", str(self.num_steps),
               "--speculative-eagle-topk", str(self.eagle_topk),
               "--speculative-num-draft-tokens", str(self.num_draft_tokens)]
        return cmd + (["--enable-draft-weights-cpu-backup"] if enable_memory_saver else [])


@dataclass(frozen=True)
class MultiNode:
    """One SGLang server spread over `nnodes` nodes (its TP group larger than a node): the same
    command runs on every node with its `node_rank`; all of them meet at `dist_init_addr`
    ("host:port" on node 0). Only node 0 serves HTTP (SGLang 0.5.23 `entrypoints/http_server.py`:
    a node with node_rank >= 1 returns after launching its schedulers), so only its URL goes to
    the router."""

    nnodes: int
    node_rank: int
    dist_init_addr: str

    def __post_init__(self):
        if self.nnodes < 2 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"multi-node SGLang server: node_rank {self.node_rank} of {self.nnodes} nodes")
        if ":" not in self.dist_init_addr:
            raise ValueError(f"multi-node SGLang server: dist_init_addr {self.dist_init_addr!r} is not host:port")


# SGLang 0.5.23's flags that make it serve on a CPU without AMX (docs/sglang-on-cpu.md; each is a field of
# `srt/arg_groups/fields/*.py`, which tests/rollout/test_sglang_flags.py checks against the wheel):
# device.py `device`; the backends with a torch-native path (attention `torch_native`, sampling `pytorch`,
# no grammar backend, which would load xgrammar's compiled matcher); no overlap scheduler (it runs the
# next batch's scheduling on a CUDA stream); no CUDA graphs, prefill or decode.
SGLANG_CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                    "--grammar-backend", "none", "--disable-overlap-schedule",
                    "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled")


def sglang_cpu_flags(context_length: int, max_running_requests: int) -> list[str]:
    """SGLANG_CPU_FLAGS and the KV-cache bounds of a server on a CPU: SGLang sizes its cache as a
    fraction of the machine's free memory (`--mem-fraction-static`, gigabytes on a CPU); a pool of
    `--max-total-tokens` = `context_length` x `max_running_requests` tokens holds every request at
    full length and no more."""
    return [*SGLANG_CPU_FLAGS, "--max-total-tokens", str(context_length * max_running_requests),
            "--max-running-requests", str(max_running_requests)]


def sglang_server_command(
    model_path: str,
    port: int,
    *,
    device: str = "cuda",
    max_running_requests: int = 64,
    host: str = "127.0.0.1",
    tp_size: int = 1,
    ep_size: int = 1,
    attn_dp_size: int = 1,
    base_gpu_id: int = 0,
    mem_fraction_static: Optional[float] = None,
    enable_memory_saver: bool = False,
    api_key: Optional[str] = None,
    dtype: str = "auto",
    context_length: Optional[int] = None,
    random_seed: Optional[int] = None,
    deterministic: bool = False,
    return_routed_experts: bool = False,
    multi_node: Optional[MultiNode] = None,
    lora: Optional[LoraServing] = None,
    speculative: Optional[SpeculativeDecoding] = None,
    prefix_caching: bool = True,
    engine_kwargs: Mapping[str, Any] = MappingProxyType({}),
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """`device` cuda or cpu (the training roles' device, `megarl.config.devices`): on a CPU, SGLang's own
    flags for it (`sglang_cpu_flags`; `context_length` and `max_running_requests` bound its KV cache), and
    no memory saver (torch_memory_saver needs libcuda; a config rule says so first).
    `enable_memory_saver` when colocated with training (release/resume memory between phases);
    `base_gpu_id` is the first of this node's GPUs the server takes, an index into the server
    process's CUDA_VISIBLE_DEVICES (`megarl.config.devices.visible_gpu_index`); `tp_size` is the server's whole TP size, over
    all its nodes with `multi_node`; `ep_size` its expert parallel size, laid over those TP ranks (it
    divides `tp_size`: the config rule `rollout_expert_parallel_fits_server` cites SGLang's check);
    `attn_dp_size` its attention data parallel size (`--attn-dp-size`): attention in that many groups of
    tp_size / attn_dp_size ranks inside the same `tp_size` GPUs (it divides `tp_size`: the config rule
    `rollout_attention_data_parallel_fits_server` cites SGLang's check).
    `deterministic`: SGLang's `--enable-deterministic-inference`, the only mode in which it reads `sampling_params.sampling_seed` (0.5.23,
    `sampling/sampling_batch_info.py`). `return_routed_experts`: routing replay
    (`--enable-return-routed-experts`, fields/exec_.py). `prefix_caching` false: `--disable-radix-cache`
    (SGLang's radix cache is on by default). `speculative`: drafting with the checkpoint's MTP layers
    (`SpeculativeDecoding`). `engine_kwargs`: verl's engine_kwargs.sglang, {ServerArgs name:
    value}, added after megarl's own flags (megarl.config.engine_kwargs.sglang_engine_flags: ValueError
    where one contradicts them). Every flag here is one of SGLang 0.5.23's own
    (`sglang/srt/arg_groups/fields/*.py`); tests/rollout/test_sglang_flags.py checks that against
    the wheel."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"SGLang server device {device!r}: cuda or cpu")
    if device == "cpu" and (enable_memory_saver or deterministic or not context_length):
        raise ValueError("SGLang on a CPU: no memory saver (it needs libcuda), no deterministic inference (it needs "
                         "a GPU attention backend: actor_rollout_ref.rollout.deterministic_inference=false), and a "
                         "context_length to size the KV cache by")
    if device == "cpu" and speculative:
        raise ValueError(f"SGLang on a CPU: no speculative decoding ({SGLANG_CPU_NO_DRAFT})")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port)]
    cmd += ["--tp-size", str(tp_size), "--base-gpu-id", str(base_gpu_id), "--dtype", dtype, "--skip-server-warmup"]
    if device == "cpu":
        cmd += sglang_cpu_flags(context_length, max_running_requests)
    if ep_size != 1:
        cmd += [EP_FLAG, str(ep_size)]
    if attn_dp_size != 1:
        cmd += [ATTN_DP_FLAG, str(attn_dp_size)]
    if multi_node is not None:  # fields/parallel.py: nnodes, node_rank, dist_init_addr
        cmd += ["--nnodes", str(multi_node.nnodes), "--node-rank", str(multi_node.node_rank),
                "--dist-init-addr", multi_node.dist_init_addr]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    if enable_memory_saver:
        cmd += ["--enable-memory-saver"]
    if deterministic:  # fields/exec_.py: enable_deterministic_inference
        cmd += ["--enable-deterministic-inference"]
    if return_routed_experts:  # fields/exec_.py: enable_return_routed_experts
        cmd += [ROUTED_EXPERTS_FLAG]
    if not prefix_caching:
        cmd += [NO_PREFIX_CACHE_FLAG]
    if api_key:
        cmd += ["--api-key", api_key]
    if context_length:
        cmd += ["--context-length", str(context_length)]
    if random_seed is not None:
        cmd += ["--random-seed", str(random_seed)]
    if lora:  # fields/lora.py: enable_lora, max_lora_rank, lora_target_modules
        cmd += lora.flags()
        if enable_memory_saver:  # fields/exec_.py: releasing the weights keeps them in CPU memory, as only
            cmd += ["--enable-weights-cpu-backup"]  # adapters are pushed and the base must come back as it was
    if speculative:
        cmd += speculative.flags(enable_memory_saver)
    return cmd + sglang_engine_flags(engine_kwargs, cmd) + list(extra_args)


def lora_serving(config) -> Optional[LoraServing]:
    """The LoRA adapters the servers must be able to load: those of an actor with adapter-only sync."""
    from megarl.config.rules.lora import lora_targets

    lora = config.actor_rollout_ref.model.lora
    if lora.rank <= 0 or lora.sync != "adapter":
        return None
    return LoraServing(lora.rank, lora_targets(lora.target_modules))


def sglang_command(config, model_path: str, port: int, *, device: str, colocated: bool, context_length: int,
                   host: str = "127.0.0.1", base_gpu_id: int = 0, api_key: Optional[str] = None,
                   multi_node: Optional[MultiNode] = None, server: int = 0) -> list[str]:
    """`sglang_server_command` for server number `server` of the experiment `config` (an ExperimentConfig)
    on `device`, `colocated` with training or not; `context_length`: tokens of its longest request.
    ValueError where the config's engine_kwargs.sglang contradicts megarl's own flags."""
    from megarl.config.rules.choices import deterministic_inference_default
    from megarl.config.rules.router_replay import replays_routes

    r = config.actor_rollout_ref.rollout
    deterministic = (deterministic_inference_default(config.trainer.resume_mode, r.name, device)
                     if r.deterministic_inference is None else r.deterministic_inference)
    return sglang_server_command(
        model_path, port, device=device, max_running_requests=r.max_concurrent_requests, host=host,
        tp_size=r.tensor_model_parallel_size, ep_size=r.expert_parallel_size,
        attn_dp_size=r.attention_data_parallel_size, base_gpu_id=base_gpu_id,
        mem_fraction_static=r.gpu_memory_utilization if device == "cuda" else None,
        enable_memory_saver=uses_memory_saver(device, colocated), api_key=api_key, dtype=r.dtype,
        context_length=context_length, random_seed=config.trainer.seed + server,
        deterministic=deterministic, return_routed_experts=replays_routes(config),
        multi_node=multi_node, lora=lora_serving(config), speculative=speculative_decoding(config),
        prefix_caching=r.enable_prefix_caching,
        engine_kwargs=r.engine_kwargs.get("sglang", {}), python=r.server_python or sys.executable,
    )


def speculative_decoding(config) -> Optional[SpeculativeDecoding]:
    """How the servers draft with the model's MTP layers: verl's `model.mtp` with enable and enable_rollout
    (verl/workers/rollout/sglang_rollout/async_sglang_server.py passes speculative_* to SGLang then only)."""
    mtp = config.actor_rollout_ref.model.mtp
    if not (mtp.enable and mtp.enable_rollout):
        return None
    return SpeculativeDecoding(mtp.speculative_algorithm, mtp.speculative_num_steps, mtp.speculative_eagle_topk,
                               mtp.speculative_num_draft_tokens)


def uses_memory_saver(device: str, colocated: bool) -> bool:
    """Whether a SGLang server starts with `--enable-memory-saver`: colocated with training on GPUs, so
    that `/release_memory_occupation` frees its GPU memory for the trainer. Never on a CPU:
    torch_memory_saver's allocator hooks need libcuda (SGLang 0.5.23 then fails at start); there the
    release and resume calls still answer as SGLang's state machine says, and free nothing."""
    return colocated and device == "cuda"


# What SGLang needs on a CPU that PyPI does not have (docs/sglang-on-cpu.md): a stand-in for its compiled
# `sgl_kernel` CPU kernels and a `sitecustomize` that lets PyPI's CUDA-built torchvision import. This folder
# goes first on the server's PYTHONPATH, and on no other process's.
SGLANG_CPU_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu", "sglang_site")


def sglang_server_env(base_env: Mapping[str, str], *, device: str, enable_memory_saver: bool,
                      colocated: bool) -> dict[str, str]:
    """The environment of a real SGLang server: `base_env` with `sglang_env_overrides`, and on a CPU
    `SGLANG_USE_CPU_ENGINE=1` (SGLang 0.5.23 `srt/utils/common.py::is_cpu`, which picks its CPU code
    paths), SGLANG_CPU_SITE first on PYTHONPATH, and no crash dumps: before a crashed server exits,
    SGLang waits up to 60 s for a CUDA core dump and runs py-spy (`srt/environ.py`
    SGLANG_CUDA_COREDUMP_BEFORE_CRASH, SGLANG_PYSPY_DUMP_BEFORE_CRASH), neither of which a CPU venv has."""
    env = apply_env_overrides(base_env, sglang_env_overrides(enable_memory_saver, colocated=colocated))
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] = env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] = "false"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SGLANG_CPU_SITE, base_env.get("PYTHONPATH")) if p)
    return env


def sglang_env_overrides(enable_memory_saver: bool, colocated: bool = False) -> dict[str, Optional[str]]:
    """Environment changes for a real SGLang server (None = unset): `/health` answers without running
    a generation (the router polls it); expandable CUDA segments are off under the memory saver
    (they break it). Colocated, the training ranks sharing the server's GPUs hold different amounts
    of memory (pipeline stages differ, the first and last hold the embeddings), so the TP ranks'
    free memory differs by more than SGLang's 10 % and it would refuse to start:
    `SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=false` (SGLang 0.5.23 `environ.py`, read in
    `distributed/bootstrap.py`; each rank still sizes its KV cache from its own free memory)."""
    overrides: dict[str, Optional[str]] = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
    if enable_memory_saver:
        overrides["PYTORCH_CUDA_ALLOC_CONF"] = None
    if colocated:
        overrides["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] = "false"
    return overrides


def apply_env_overrides(base_env: Mapping[str, str], overrides: Mapping[str, Optional[str]]) -> dict[str, str]:
    env = dict(base_env)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def router_command(
    worker_urls: Sequence[str],
    port: int,
    *,
    prometheus_port: int,
    host: str = "127.0.0.1",
    policy: str = "round_robin",
    api_key: Optional[str] = None,
    disable_retries: bool = False,
    health_check_interval_s: int = 5,
    request_timeout_s: int = 3600,
    log_level: str = "warn",
    python: str = sys.executable,
) -> list[str]:
    """Every router needs its own `prometheus_port` (a second one on the default port panics at start).
    `api_key` is what the router sends to workers. `disable_retries` leaves retrying to the client."""
    cmd = [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port), "--policy", policy]
    cmd += ["--prometheus-host", host, "--prometheus-port", str(prometheus_port), "--log-level", log_level]
    cmd += ["--health-check-interval-secs", str(health_check_interval_s)]
    cmd += ["--request-timeout-secs", str(request_timeout_s)]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    if api_key:
        cmd += ["--api-key", api_key]
    if disable_retries:
        cmd += ["--disable-retries"]
    return cmd
