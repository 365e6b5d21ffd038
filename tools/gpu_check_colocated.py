"""Checks 6-8 of tools/gpu_check.py: the colocated GPU path as production runs it (issue 40).

Kept apart from gpu_check.py for length only; run them through it. The IPC check's processes are
started with multiprocessing's spawn method (CUDA cannot be used in a forked child: torch's
"CUDA in multiprocessing" note), so their functions live at module level here. This module
imports megarl, never the other way round, and nothing that needs Ray (the lent GPU machine has
no Ray and no SGLang; check 7 uses SGLang where it is installed, and its report says which path ran).
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import queue
import re
import subprocess
import time
import traceback

import torch
import torch.distributed as dist

MIB, GIB = 2**20, 2**30
# check 8's tolerances (the module docstring of gpu_check.py explains them)
LEDGER_ABS_TOL = 256 * MIB  # resident memory outside the ledger
LEDGER_REL_TOL = 0.01  # the estimate's first-order omissions
CACHE_SLACK = 128 * MIB  # allocator segments a live small tensor keeps after empty_cache


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3f} GiB"


# ------------------------------------------------------------------------------ check 6: the world
def check_production_world(world: dict, cpu: bool) -> dict:
    """Check 6. `world`: what `gpu_check.init_single_process` did before any check (backend,
    environment, collective timeout). The world must carry CUDA tensors over NCCL and CPU objects
    over gloo, with the configured timeout, and megatron's groups must report the backends
    `group_backends()` gives (TP/PP/DP/MP inherit the world's: parallel_state.create_group(backend=None);
    the DP gloo group is gloo)."""
    from megatron.core import parallel_state

    from megarl.config.devices import nccl_watchdog_env
    from megarl.engines.megatron.parallel import RoleLayout, group_backends, init_role_parallel_state

    backend, timeout_s = world["backend"], world["collective_timeout_s"]
    result = {"backend_made": backend, "backend_reported": str(dist.get_backend())}
    if cpu:
        result["cpu_note"] = "--cpu: gloo only (no CUDA, so no NCCL all-reduce and no NCCL environment)"
    expected_env = {} if cpu else dict(nccl_watchdog_env(timeout_s))
    result["env_set_before_world"] = world["env"]
    result["env_now"] = {k: os.environ.get(k) for k in expected_env}
    env_ok = world["env"] == expected_env and result["env_now"] == expected_env

    devices = ["cpu"] if cpu else ["cpu", "cuda"]  # the device types of the world's backends
    timeouts, kinds = {}, {}
    for device in devices:
        try:
            part = dist.group.WORLD._get_backend(torch.device(device))
            kinds[device] = type(part).__name__
            timeouts[device] = part.options._timeout.total_seconds()
        except Exception as e:  # a private torch API: report it, and the check fails
            kinds.setdefault(device, f"unreadable: {type(e).__name__}: {e}")
    result["backend_per_device"] = kinds
    result["collective_timeout_s"] = {"config": timeout_s, **timeouts}
    want_kinds = {"cpu": "ProcessGroupGloo", "cuda": "ProcessGroupNCCL"}
    kinds_ok = all(kinds.get(d) == want_kinds[d] for d in devices)
    timeout_ok = len(timeouts) == len(devices) and all(t == timeout_s for t in timeouts.values())

    # a device tensor's all-reduce (NCCL on GPU), a CPU one (gloo), object collectives and a barrier
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    values = torch.arange(4, dtype=torch.float32)
    on_device = values.to(device)
    dist.all_reduce(on_device)
    on_cpu = values.clone()
    dist.all_reduce(on_cpu)
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, {"rank": dist.get_rank(), "pid": os.getpid()})
    dist.barrier()
    result["all_reduce_" + device.type] = torch.equal(on_device.cpu(), values)
    result["all_reduce_cpu"] = torch.equal(on_cpu, values)
    result["all_gather_object"] = objects
    try:
        result["object_collective_device"] = dist.distributed_c10d._get_object_coll_device()
    except Exception as e:  # private; informational
        result["object_collective_device"] = f"unreadable: {e}"
    collectives_ok = (result["all_reduce_" + device.type] and result["all_reduce_cpu"]
                      and objects == [{"rank": 0, "pid": os.getpid()}])

    # megatron's groups: the ones the engines of checks 1-5 built (or built here, as an engine does)
    if not parallel_state.model_parallel_is_initialized():
        init_role_parallel_state(RoleLayout(1, 1, 1), 1234, "gpu_check", collective_timeout_s=timeout_s)
    groups = group_backends()
    expected_groups = {name: ("gloo" if name.endswith("_gloo") else backend) for name in groups}
    result["megatron_group_backends"] = groups
    groups_ok = groups == expected_groups and result["backend_reported"] == backend
    result["pass"] = bool(env_ok and kinds_ok and timeout_ok and collectives_ok and groups_ok)
    return result


# ------------------------------------------------------------------------------ check 7: IPC push
def _bucket_tensors() -> list[tuple[str, torch.Tensor]]:
    """The bucket both processes know: seeded tensors of two dtypes (CPU)."""
    g = torch.Generator().manual_seed(7)
    return [("model.embed_tokens.weight", torch.randn(512, 64, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.randn(64, generator=g)),
            ("lm_head.weight", torch.randn(512, 64, generator=g).to(torch.bfloat16))]


def _gpu_uuid() -> str:
    """This process's GPU 0 as torch names it (hex, 8-4-4-4-12)."""
    return str(torch.cuda.get_device_properties(0).uuid)


def _use_visible(visible):
    """Select the GPU by `visible` (a CUDA_VISIBLE_DEVICES value) before CUDA starts; None: CPU."""
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        torch.cuda.set_device(0)


def _ipc_sender(visible, payload_q, result_q, done, timeout_s: float) -> None:
    """Serialise one bucket as the tensor transport does (`sync/ipc_copies.py`: the bucket's own
    copy, `serialise_copy`), hand the payload over, and keep the memory until `done`."""
    try:
        _use_visible(visible)
        from megarl.rollout import tensor_payload
        from megarl.rollout.weight_group import bucket_layout, flatten_tensors, unflatten_tensors
        from megarl.sync import ipc_copies

        on_gpu = visible is not None
        device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
        flat, fields = flatten_tensors([(n, t.to(device)) for n, t in _bucket_tensors()])
        slots = bucket_layout(fields["names"], fields["dtypes"], fields["shapes"])
        copy = ipc_copies.fresh_copy(flat)
        sglang = True
        if on_gpu:
            try:
                ipc_copies.sglang_serialisation()
            except RuntimeError:
                sglang = False
        if sglang:
            entry, load_format = ipc_copies.serialise_copy(copy, slots)
            how = ("SGLang's flattened_bucket, CUDA reductions naming the GPU by UUID (production's payload)" if on_gpu
                   else "load_format null: (name, tensor) views into a shared-memory file (production's CPU payload)")
        else:  # megarl's own serialisation of the same views, torch's stock CUDA reduction
            entry, load_format = tensor_payload.serialize(unflatten_tensors(copy, list(slots))), None
            how = ("load_format null, torch's stock CUDA reduction (names the GPU by index in the sender): SGLang "
                   "is not installed, so production's UUID-naming payload is not exercised")
        if on_gpu:
            torch.cuda.synchronize()  # the bytes are in place before the handle leaves
        payload_q.put((entry, load_format))
        result_q.put({"role": "sender", "uuid": _gpu_uuid() if on_gpu else None, "payload": how,
                      "bucket_bytes": copy.numel(), "visible": visible})
        done.wait(timeout_s)  # the receiver has copied what it read
    except BaseException:
        result_q.put({"role": "sender", "error": traceback.format_exc()})


def _ipc_receiver(visible, payload_q, result_q, timeout_s: float) -> None:
    """Open the payload with megarl's receiving side (`rollout/tensor_payload.py`, the CPU engine
    server's decoder, which mirrors SGLang's) and compare every tensor with the known bucket."""
    try:
        _use_visible(visible)
        from megarl.rollout import tensor_payload

        entry, load_format = payload_q.get(timeout=timeout_s)
        got = tensor_payload.named_tensors(tensor_payload.deserialize(entry), load_format)
        expected = _bucket_tensors()
        equal = [n for n, _ in got] == [n for n, _ in expected] and all(
            torch.equal(t.cpu(), e) for (_, t), (_, e) in zip(got, expected))
        info = {"role": "receiver", "uuid": _gpu_uuid() if visible is not None else None, "equal": equal,
                "devices": sorted({str(t.device) for _, t in got}), "load_format": load_format, "visible": visible}
        del got
        if visible is not None:
            torch.cuda.synchronize()
        result_q.put(info)
    except BaseException:
        result_q.put({"role": "receiver", "error": traceback.format_exc()})


def _ipc_pair(sender_visible, receiver_visible, timeout_s: float = 180.0) -> dict:
    """One sender and one receiver process (spawn), results by role; the processes are ended by
    their own handles if they overrun."""
    ctx = multiprocessing.get_context("spawn")
    payload_q, result_q, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    sender = ctx.Process(target=_ipc_sender, args=(sender_visible, payload_q, result_q, done, timeout_s),
                         name="gpu-check-ipc-sender")
    receiver = ctx.Process(target=_ipc_receiver, args=(receiver_visible, payload_q, result_q, timeout_s),
                           name="gpu-check-ipc-receiver")
    sender.start()
    receiver.start()
    results = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                item = result_q.get(timeout=1.0)
            except queue.Empty:
                if not sender.is_alive() and not receiver.is_alive():
                    break
                continue
            results[item["role"]] = item
            if item["role"] == "sender" and "error" in item:
                break  # no payload will come: the receiver has nothing to wait for
    finally:
        if "receiver" not in results:
            receiver.kill()
        receiver.join(timeout=30)  # its view of the sender's memory ends with it
        done.set()  # only then may the sender free the bucket
        sender.join(timeout=30)
        for p in (receiver, sender):
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    results["exit_codes"] = (sender.exitcode, receiver.exitcode)
    return results


def gpu_spellings() -> tuple[str, str, str]:
    """(index, UUID) spellings in CUDA_VISIBLE_DEVICES of this process's GPU 0, and torch's UUID.
    The index is this process's own CUDA_VISIBLE_DEVICES entry (0 when unset); the UUID is the
    `nvidia-smi -L` name ending in torch's UUID (GPU-... or MIG-...), else "GPU-" + it."""
    uuid = _gpu_uuid()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    names = []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        names = re.findall(r"UUID: ([^)\s]+)\)", listing)
    except (OSError, subprocess.SubprocessError):
        pass
    spelled = next((n for n in names if n.split("-", 1)[-1] == uuid), "GPU-" + uuid)
    index = visible[0] if visible else "0"
    if not index.isdigit():  # this process was given a UUID: its index from nvidia-smi's order
        query = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout
        index = next((line.split(",")[0].strip() for line in query.splitlines()
                      if line.split(",")[-1].strip() == index), index)
    return index, spelled, uuid


def check_ipc_spellings(cpu: bool) -> dict:
    """Check 7: a bucket's handle made by one process and opened by another, the GPU named by
    index in one and by UUID in the other, both ways; on CPU one pair over shared memory."""
    if cpu:
        r = _ipc_pair(None, None)
        result = {"cpu_note": "--cpu: shared-memory path only; the CUDA_VISIBLE_DEVICES spellings are GPU only",
                  "sender": r.get("sender"), "receiver": r.get("receiver"), "exit_codes": r["exit_codes"]}
        result["pass"] = bool((r.get("receiver") or {}).get("equal")) and r["exit_codes"] == (0, 0)
        return result
    index, spelled, uuid = gpu_spellings()
    result = {"gpu_uuid_torch": uuid, "spellings": {"index": index, "uuid": spelled}}
    ok = True
    for label, (send_as, receive_as) in {"index -> uuid": (index, spelled), "uuid -> index": (spelled, index)}.items():
        r = _ipc_pair(send_as, receive_as)
        sender, receiver = r.get("sender") or {}, r.get("receiver") or {}
        same_gpu = sender.get("uuid") == receiver.get("uuid") == uuid
        passed = (bool(receiver.get("equal")) and same_gpu and receiver.get("devices") == ["cuda:0"]
                  and r["exit_codes"] == (0, 0))
        result[label] = {"sender CUDA_VISIBLE_DEVICES": send_as, "receiver CUDA_VISIBLE_DEVICES": receive_as,
                         "tensors_equal": receiver.get("equal"), "same_gpu": same_gpu,
                         "receiver_devices": receiver.get("devices"), "exit_codes": r["exit_codes"],
                         "pass": passed}
        result["payload"] = sender.get("payload")
        for role, info in (("sender", sender), ("receiver", receiver)):
            if "error" in info or not info:
                result[label][f"{role}_error"] = info.get("error", "no result")
        ok &= passed
    result["pass"] = ok
    return result


# ------------------------------------------------------------------------------ check 8: the ledger
def ledger_config(model_dir, args, gpu_memory_gib: float):
    """A validated colocated GRPO config of the ~1B model on one GPU: the actor alone beside one
    TP-1 server, offloading its parameters, gradients and optimizer state."""
    from megarl.config import load_and_validate

    responses = 2 * args.micro_batch  # one mini-batch: micro_batch prompts x rollout.n 2
    return load_and_validate(None, [
        "data.train_files=unused.parquet",  # never read
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.dtype={args.dtype}",
        "trainer.n_gpus_per_node=1",
        "placement.mode=colocate",
        f"placement.gpu_memory_gib={gpu_memory_gib}",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
        f"data.train_batch_size={responses // 2}",
        f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.response_len}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={responses // 2}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.megatron.param_offload=true",
        "actor_rollout_ref.actor.megatron.grad_offload=true",
        "actor_rollout_ref.actor.megatron.optimizer_offload=true",
    ])


def _update_batch(size: int, prompt_len: int, response_len: int, vocab: int):
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, vocab, (prompt_len,), generator=g).tolist() for _ in range(size)]
    responses = [torch.randint(4, vocab, (response_len,), generator=g).tolist() for _ in range(size)]
    batch = Batch.from_token_lists(prompts, responses)
    batch["advantages"] = torch.randn(size, 1, generator=g) * batch["response_mask"]
    return batch


def check_memory_ledger(model_dir, args) -> dict:
    """Check 8: one update of the ~1B actor, then the colocated moves of `ColocatedMemory`, each
    step's device memory beside the ledger's figure for it."""
    from megarl.engines.megatron.roles import ActorEngine
    from megarl.placement import plan_from_config
    from megarl.placement.colocated_memory import ColocatedMemory
    from megarl.placement.colocation import OffloadParts, offload_plan, releases_server_memory
    from megarl.placement.memory import DTYPE_BYTES, estimate, total_params

    on_gpu = torch.cuda.is_available()
    gc.collect()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1] if on_gpu else 0
    base_free = torch.cuda.mem_get_info()[0] if on_gpu else 0
    base_allocated = torch.cuda.memory_allocated() if on_gpu else 0
    base_reserved = torch.cuda.memory_reserved() if on_gpu else 0
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    base_use = total - base_free
    config = ledger_config(model_dir, args, round(total / GIB, 3) if on_gpu else 80.0)
    result = {}
    if not on_gpu:
        result["cpu_note"] = ("--cpu: no device memory, every measured figure is 0 and the tolerance check is "
                              "GPU only; the moves run as on GPU (simulated server memory on the meta device)")
    result["baseline"] = (f"total {_gib(total)}, in use before the engine {_gib(base_use)}, allocated "
                          f"{_gib(base_allocated)}")

    def measure() -> dict:
        if not on_gpu:
            return {"device_use": 0, "free": 0, "allocated": 0, "reserved": 0}
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        return {"device_use": total - free - base_use, "free": free, "allocated": torch.cuda.memory_allocated(),
                "reserved": torch.cuda.memory_reserved()}

    steps_ok = []

    def step(name: str, ledger: int, measured_key: str = "device_use") -> None:
        """Record one step: the ledger's bytes beside the measurement (`measured_key`: device use,
        or allocated bytes above the baseline's)."""
        m = measure()
        value = m["device_use"] if measured_key == "device_use" else m["allocated"] - base_allocated
        tol = LEDGER_ABS_TOL + LEDGER_REL_TOL * ledger
        within = abs(value - ledger) <= tol
        verdict = "not compared: --cpu"
        if on_gpu:
            steps_ok.append(within)
            verdict = f"diff {(value - ledger) / MIB:+.0f} MiB, tolerance {tol / MIB:.0f} MiB: " + (
                "within" if within else "OUTSIDE")
        result[name] = (f"ledger {_gib(ledger)} | measured {measured_key} {_gib(value)} ({verdict}) | free "
                        f"{_gib(m['free'])} of {_gib(total)}, allocated {_gib(m['allocated'])}, reserved "
                        f"{_gib(m['reserved'])}")

    cache_ok = []

    def empty_cache(engine, before: str) -> None:
        """The engine empties its allocator's cache; it counts as emptied if what it still reserves
        is what its tensors use plus CACHE_SLACK."""
        stats = engine.empty_cache()
        allocated = torch.cuda.memory_allocated() if on_gpu else 0
        emptied = stats["reserved_after"] <= allocated + CACHE_SLACK
        cache_ok.append(emptied)
        result[f"empty_cache before {before}"] = (
            f"reserved {_gib(stats['reserved_before'])} -> {_gib(stats['reserved_after'])}, allocated "
            f"{_gib(allocated)}: {'emptied' if emptied else 'NOT emptied'}")

    held = {}  # the simulated server memory and push bucket: device tensors on GPU, meta tensors on CPU
    hold_on = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("meta")

    def hold(name: str, nbytes: int) -> None:
        held[name] = torch.empty(int(nbytes), dtype=torch.uint8, device=hold_on)

    engine = ActorEngine(config, sequence_layout="padded")
    try:
        plan = plan_from_config(config)
        est = estimate(plan, config, engine.arch)
        (actor,) = [r for r in est.roles if r.role == "actor"]
        rollout = config.actor_rollout_ref.rollout
        server_weights = int(total_params(engine.arch) * DTYPE_BYTES[rollout.dtype] / plan.roles["rollout"].tp)
        bucket = rollout.update_weights_bucket_megabytes * MIB
        params = actor.offloadable_params
        grads_optimizer = actor.states - params
        result["estimate"] = (f"actor states {_gib(actor.states)} (params {_gib(params)}, grads + optimizer "
                              f"{_gib(grads_optimizer)}), activations {_gib(actor.activations)}; server weights "
                              f"{_gib(server_weights)}, bucket {_gib(bucket)}, rollout pool "
                              f"{_gib(est.rollout_reserved)}; "
                              "phases " + ", ".join(f"{k} {_gib(v)}" for k, v in est.phases.items()))

        memory = ColocatedMemory(1, offload_plan(config, plan.roles), releases_server_memory(config))
        memory.apply(memory.before_training())  # the server released all at start; the engine then built
        moves_seen = []

        batch = _update_batch(2 * args.micro_batch, args.prompt_len, args.response_len, engine.arch.vocab_size)
        batch["old_log_probs"] = engine.compute_log_prob(batch, 1.0)["log_probs"]
        engine.update_policy(batch)
        step("step 1 trained (tensors alive: allocated above the baseline's)", actor.states, "allocated")
        if on_gpu:
            peak = torch.cuda.max_memory_reserved() - base_reserved
            result["step 1 peak (not checked)"] = (f"estimate's training phase {_gib(est.phases['training'])} "
                                                   f"(activations are a first-order model) | peak reserved "
                                                   f"above the baseline's {_gib(peak)}")

        def run_moves(moves, name: str, resident_after_offload: int, before: str) -> None:
            """Offload and empty the cache as `moves` say (one server, the actor only); the caller resumes."""
            moves_seen.append({"offload": dict(moves.offload), "empty_cache": moves.empty_cache,
                               "resume": moves.resume})
            for role, parts in moves.offload.items():
                stats = engine.offload(params=parts.params, grads=parts.grads, optimizer=parts.optimizer)
                result[f"offload {role} before {before}"] = (
                    f"params {_gib(stats['params_bytes'])}, grads {_gib(stats['grads_bytes'])}, optimizer "
                    f"{_gib(stats['optimizer_bytes'])} in {stats['seconds']:.2f} s")
            if moves.empty_cache:
                empty_cache(engine, before)
            step(name, resident_after_offload)

        # before the push: grads + optimizer leave, cache emptied, then the server's weights come back
        moves = memory.before_push()
        run_moves(moves, "step 2 grads + optimizer offloaded, cache emptied", params, "resuming weights")
        if moves.resume.get(0) == ("weights",):
            hold("weights", server_weights)
        memory.apply(moves)
        step("step 3 server weights resumed", params + server_weights)
        hold("bucket", bucket)  # the push's bucket (ipc_copies.shareable_empty on the GPU)
        step(f"step 4 push bucket held (estimate's push phase {_gib(est.phases.get('push', 0))} also counts a "
             "second bucket and the vocabulary matrix gathered whole: an upper bound)",
             params + server_weights + bucket)
        del held["bucket"]  # dropped once the server answered

        # after the push: the parameters leave, cache emptied, then the KV cache (and CUDA graphs) come back
        moves = memory.after_push()
        run_moves(moves, "step 5 bucket dropped, params offloaded, cache emptied", server_weights,
                  "resuming the KV cache")
        if "kv_cache" in moves.resume.get(0, ()):
            hold("kv_cache", max(0, est.rollout_reserved - server_weights))  # the rest of the pool
        memory.apply(moves)
        step("step 6 KV cache resumed (CUDA graphs: not simulated, outside the estimate)", est.phases["rollout"])
        result["moves"] = moves_seen
        result["state_after"] = memory.describe()
        expected_moves = [
            {"offload": {"actor": OffloadParts(grads=True, optimizer=True)}, "empty_cache": True,
             "resume": {0: ("weights",)}},
            {"offload": {"actor": OffloadParts(params=True)}, "empty_cache": True,
             "resume": {0: ("kv_cache", "cuda_graph")}},
        ]
        result["tolerance"] = (f"|measured - ledger| <= {LEDGER_ABS_TOL // MIB} MiB + {LEDGER_REL_TOL:.0%} of the "
                               f"ledger; cache emptied: reserved <= allocated + {CACHE_SLACK // MIB} MiB")
        result["pass"] = moves_seen == expected_moves and all(steps_ok) and (all(cache_ok) or not on_gpu)
        return result
    finally:
        held.clear()  # the engine goes with this frame (report() collects it)
