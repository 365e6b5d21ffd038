"""Benchmark: where one GRPO step's generation of the CPU quickstart spends its time.

Starts what `configs/quickstart.yaml` starts for generation, outside Ray: two CPU-engine servers
(`cpu_server_command` as the rollout workers build it: one torch thread each, the run's seed per
server, `max_running_requests` = rollout.max_concurrent_requests) behind the real sglang-router,
and drives them as a step does (`RLTrainer.generate_and_score` through `Cluster.generate` and
`RolloutFleet.generate`): the fleet's `/health` probe of every server, `RolloutClient.generate` of the
step's 32 prompts x 8 samples with their seeds and the quickstart's sampling parameters (at most
4 new tokens, as tools/bench/overhead.py runs it), `experience.experience_batch`, then the reward
(`experience.score`). The servers get their prompts as the config says: one batched request each
(`rollout.batch_requests_per_server`, the quickstart's; they then start batches at once), or one
request per prompt through the router (`--direct`: straight to the servers, to see the router's share).

Every server runs with a timing hook (a `sitecustomize` on its PYTHONPATH that wraps the engine's
and the HTTP handler's functions as their modules are imported, keeping its records in memory
until the driver asks for them between steps); the driver's parts are timed in this process, and
every process's CPU time per step is read from the kernel (each thread's schedstat). Timestamps
are `time.perf_counter` (CLOCK_MONOTONIC, one clock for all processes). Each step is split along the
server whose last answer went out last (the rows marked '=' add up to the step), medians over the
steps after the first two. The floor is plain transformers on one torch thread doing one server's
compute: its distinct prompts' prefill, [rows, 1] decode forwards over a KV cache, and
torch.multinomial's sampling.

    .venv/bin/python tools/bench/generate_profile.py --steps 30 [--model DIR --train P --val P] [--cprofile]
    .venv/bin/python tools/bench/generate_profile.py actor_rollout_ref.rollout.batch_requests_per_server=false
    .venv/bin/python tools/bench/generate_profile.py --src /tmp/old/src --name old   # another tree, to compare

`--cprofile` adds cProfile of each server's engine and event-loop threads and of the driver, in CPU
time of each thread (files in the hooks directory; slows what it profiles).
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
import time
from pathlib import Path

HOOK_ENV = "MEGARL_GENERATE_PROFILE"  # the directory the server hook writes into; unset: no hook
FLUSH_PATH = "/_generate_profile_flush"  # a server's hook writes its records out when the driver asks
CPROFILE_ENV = "MEGARL_GENERATE_PROFILE_CPROFILE"  # set: cProfile the servers' engine and loop threads

# ---------------------------------------------------------------------------------------------- the hook
# Runs inside every server process: records stay in memory until the driver asks for them (between steps).

_events: list[tuple] = []
_in_flight = 0  # /generate requests being served
_profilers: dict = {}


def _note(name: str, t0: float, t1: float, extra=None) -> None:
    _events.append((name, t0, t1, extra))


def _flush() -> None:
    """Append the records so far to <hooks>/<pid>.jsonl (and dump the cProfile stats)."""
    global _events
    events, _events = _events, []
    with open(Path(os.environ[HOOK_ENV]) / f"{os.getpid()}.jsonl", "a") as out:
        out.writelines(json.dumps({"name": name, "t0": t0, "t1": t1, **(extra or {})}) + "\n"
                       for name, t0, t1, extra in events)
    for name, profiler in _profilers.items():
        profiler.dump_stats(Path(os.environ[HOOK_ENV]) / f"{name}-{os.getpid()}.prof")


def _timed(owner, attr: str, name: str, extra=None) -> None:
    """Replace `owner.attr` by a wrapper recording each call as `name` (`extra(args, result)`: fields)."""
    original = getattr(owner, attr)
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            result = await original(*args, **kwargs)
            _note(name, t0, time.perf_counter(), extra(args, result) if extra else None)
            return result
    else:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            result = original(*args, **kwargs)
            _note(name, t0, time.perf_counter(), extra(args, result) if extra else None)
            return result
    setattr(owner, attr, wrapper)


def _profiled_thread(owner, attr: str, name: str) -> None:
    """cProfile every call of `owner.attr` (one profiler per name, stats dumped at each flush)."""
    import cProfile

    original = getattr(owner, attr)
    profiler = _profilers.setdefault(name, cProfile.Profile(time.thread_time))

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return profiler.runcall(original, *args, **kwargs)
    setattr(owner, attr, wrapper)


def _patch_engine(m):
    if os.environ.get(CPROFILE_ENV):
        _profiled_thread(m.CPUEngine, "_run_batch", "engine")
    _timed(m.CPUEngine, "submit", "submit")
    _timed(m.CPUEngine, "_run_batch", "run_batch", lambda a, r: {"rows": len(a[0]._running)})  # joiners too
    _timed(m.CPUEngine, "_prefill", "prefill")
    _timed(m.CPUEngine, "_forward", "forward", lambda a, r: {"shape": list(a[2].shape)})
    _timed(m.CPUEngine, "_join", "join")
    _timed(m.CPUEngine, "_finish", "finish")
    _timed(m, "sample_tokens", "sample")


def _patch_protocol(m):
    _timed(m, "parse_generate_body", "parse")


def _patch_starlette(m):
    _timed(m.JSONResponse, "render", "render")


def _patch_uvicorn(m):
    """The server runs as __main__ and hands its app to `uvicorn.run`: here its module-level
    helpers are wrapped, and a middleware records each /generate from its ASGI call to its last
    body chunk and writes the records out when the driver asks (FLUSH_PATH)."""
    from starlette.responses import PlainTextResponse

    run = m.run
    main = sys.modules["__main__"]

    class Timing:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            global _in_flight
            if scope["type"] == "http" and scope["path"] == FLUSH_PATH:  # the driver's, between steps
                _flush()
                return await PlainTextResponse("flushed")(scope, receive, send)
            if scope["type"] != "http" or scope["path"] != "/generate":
                return await self.app(scope, receive, send)
            t0 = time.perf_counter()
            _in_flight += 1
            if _in_flight == 1 and "loop" in _profilers:
                _profilers["loop"].enable()

            async def timed_send(message):
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    _note("request", t0, time.perf_counter())
            try:
                return await self.app(scope, receive, timed_send)
            finally:
                _in_flight -= 1
                if _in_flight == 0 and "loop" in _profilers:
                    _profilers["loop"].disable()

    def timed_run(app, *args, **kwargs):
        if os.environ.get(CPROFILE_ENV):
            import cProfile
            _profilers["loop"] = cProfile.Profile(time.thread_time)
        _timed(main, "_output", "output")
        _timed(main, "_json_body", "read_body")
        app.add_middleware(Timing)
        return run(app, *args, **kwargs)
    m.run = timed_run


PATCHES = {
    "megarl.rollout.cpu.engine": _patch_engine,
    "megarl.rollout.protocol": _patch_protocol,
    "starlette.responses": _patch_starlette,
    "uvicorn": _patch_uvicorn,
}


def install() -> None:
    """Called by the generated sitecustomize in every process where HOOK_ENV is set."""
    from push_profile import PatchingFinder

    sys.meta_path.insert(0, PatchingFinder(PATCHES))


SITECUSTOMIZE = f"""import os
if os.environ.get({HOOK_ENV!r}):
    import generate_profile
    generate_profile.install()
"""

# ---------------------------------------------------------------------------------------------- the driver


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(CPU seconds of process `pid`'s main thread, of its other threads) so far, from the kernel's
    per-thread schedstat (nanoseconds on the CPU); a server's main thread runs its HTTP event loop."""
    main = other = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        if int(task.name) == pid:
            main += ns / 1e9
        else:
            other += ns / 1e9
    return main, other


def cpu_snapshot(pids: dict[str, int], before: bool) -> dict[str, float]:
    """CPU seconds so far: per server its loop (main) thread and its other threads (the engine's),
    the router's, and this process's (every thread: the client's loop thread too), read last
    `before` a step and first after it, so that reading the others' counts is not the driver's."""
    out = {} if before else {"driver": time.process_time()}
    for name, pid in pids.items():
        main, other = cpu_seconds(pid)
        if name == "router":
            out[name] = main + other
        else:
            out[f"{name} loop thread"], out[f"{name} other threads"] = main, other
    if before:
        out["driver"] = time.process_time()
    return out


def record_attempts(client_class, events: list) -> None:
    """Record each `RolloutClient._attempt` (one HTTP request and its parsing) in `events`, as the
    servers' hooks record theirs."""
    original = client_class._attempt

    @functools.wraps(original)
    async def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return await original(*args, **kwargs)
        finally:
            events.append({"name": "attempt", "t0": t0, "t1": time.perf_counter()})
    client_class._attempt = wrapper


BATCH_KEY = "batch_requests_per_server"  # actor_rollout_ref.rollout's; older trees have none


def quickstart_file(workdir: Path) -> str:
    """configs/quickstart.yaml; for a source tree from before `rollout.batch_requests_per_server`
    (`--src`), which would refuse the key, a copy without it (such a tree sends a request per prompt)."""
    import yaml

    from megarl.config.schema import RolloutConfig

    path = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    if BATCH_KEY in RolloutConfig.__dataclass_fields__:
        return str(path)
    tree = yaml.safe_load(path.read_text())
    tree["actor_rollout_ref"]["rollout"].pop(BATCH_KEY, None)
    tree["defaults"] = [str(path.parent / base) for base in tree.get("defaults", [])]  # relative to the original
    copy = workdir / "quickstart-per-prompt.yaml"
    copy.write_text(yaml.safe_dump(tree))
    return str(copy)


def run_steps(args, c, data, tokenizer, hooks: Path, src: Path) -> tuple[list[dict], list[dict]]:
    """Start the servers and the router for config `c`, run `args.steps` generations of `data`'s
    prompts as the trainer's step does; returns (the driver's records, one dict per step with its bounds)."""
    from megarl.data.sampler import EpochSampler
    from megarl.net import free_port
    from megarl.rewards.custom import select_score_fn
    from megarl.rollout.client import RolloutClient
    from megarl.rollout.control import ServerControl, on_each
    from megarl.rollout.launch import cpu_server_command
    from megarl.rollout.process import ServerProcess
    from megarl.rollout.router import Router
    from megarl.runtime.rollout_fleet import QUICK_HEALTH_S
    from megarl.trainer import experience
    from megarl.trainer.rl import sampling_params, sampling_seeds

    r = c.actor_rollout_ref.rollout
    model = c.actor_rollout_ref.model.path
    batched = getattr(r, BATCH_KEY, False)
    sampler = EpochSampler.from_config(c.data, len(data))
    score_fn = select_score_fn(c.custom_reward_function.path, c.custom_reward_function.name,
                               c.custom_reward_function.reward_kwargs)
    context = r.prompt_length + r.response_length
    env = {**os.environ, HOOK_ENV: str(hooks)}
    env["PYTHONPATH"] = os.pathsep.join([str(hooks.parent / "site"), str(Path(__file__).resolve().parent), str(src),
                                         os.environ.get("PYTHONPATH", "")])
    if args.cprofile:
        env[CPROFILE_ENV] = "1"
    servers, router, client = [], None, None
    attempts: list[dict] = []  # the driver's records
    try:
        for i in range(c.trainer.n_gpus_per_node):  # one colocated server per logical GPU
            port = free_port("127.0.0.1")
            command = cpu_server_command(model, port, dtype=r.dtype, context_length=context,
                                         max_running_requests=r.max_concurrent_requests,
                                         random_seed=c.trainer.seed + i, num_threads=1,
                                         prefix_caching=r.enable_prefix_caching,
                                         # as the rollout worker starts them for batch_requests_per_server
                                         **({"batch_wait_ms": 0} if batched else {}))
            server = ServerProcess(f"rollout-{i}", command, f"http://127.0.0.1:{port}", env=env,
                                   log_path=str(hooks.parent / f"rollout-{args.name}-{i}.log"), startup_timeout_s=120)
            server.start()
            servers.append(server)
        urls = [s.url for s in servers]
        router = Router(urls, free_port("127.0.0.1"), prometheus_port=free_port("127.0.0.1"),
                        log_path=str(hooks.parent / f"router-{args.name}.log"))
        router.start(timeout_s=120)
        client = RolloutClient(router.url, abort_urls=urls, max_concurrency=r.max_concurrent_requests,
                               request_timeout_s=r.request_timeout_s,
                               server_urls=urls if args.direct or batched else None,  # as RolloutFleet makes it
                               **({"batch_per_server": True} if batched else {}))  # an older tree has no such key
        record_attempts(RolloutClient, attempts)
        profiler = None
        if args.cprofile:
            import cProfile
            profiler = cProfile.Profile(time.thread_time)
            loop = client._loop_thread().loop  # the client's requests run on its loop thread: profile it too
            loop_profiler = cProfile.Profile(time.thread_time)
            loop.call_soon_threadsafe(loop_profiler.enable)
        steps = []
        sampling = sampling_params(c)
        pids = {**{f"server {i}": s.pid for i, s in enumerate(servers)}, "router": router.process.pid}
        for step in range(1, args.steps + 1):
            prompts = data.take(sampler.next_batch())
            uid_prefix = f"s{step}"
            if profiler is not None:
                profiler.enable()
            cpu_before = cpu_snapshot(pids, before=True)
            c0 = time.thread_time()
            t0 = time.perf_counter()
            # Cluster.generate -> recover -> RolloutFleet.take_down_failed -> _failed_servers: one /health each
            probed = on_each([ServerControl(u) for u in urls], lambda s: s.health(QUICK_HEALTH_S))
            t1, c1 = time.perf_counter(), time.thread_time()
            result = client.generate([p.input_ids for p in prompts], sampling,
                                     seeds=sampling_seeds(c.trainer.seed, uid_prefix, prompts), keep_going=True)
            t2, c2 = time.perf_counter(), time.thread_time()
            batch = experience.experience_batch(prompts, result.samples, uid_prefix=uid_prefix)
            t3, c3 = time.perf_counter(), time.thread_time()
            metrics = experience.score(batch, score_fn, tokenizer, c)
            t4, c4 = time.perf_counter(), time.thread_time()
            cpu_after = cpu_snapshot(pids, before=False)
            for url in urls:
                ServerControl(url)._call("GET", FLUSH_PATH)
            if profiler is not None:
                profiler.disable()
            if result.failed or not all(p is True for p in probed):
                raise RuntimeError(f"step {step}: probe {probed}, failed prompts {result.failed}")
            steps.append({"step": step, "t0": t0, "probed": t1, "generated": t2, "batch_made": t3, "t1": t4,
                          "response_tokens": int(batch["response_mask"].sum()), "score": metrics["reward/score_mean"],
                          "cpu_s": {k: cpu_after[k] - v for k, v in cpu_before.items()},
                          "driver_main_cpu_s": {"probe": c1 - c0, "generate() (waits)": c2 - c1,
                                                "experience_batch": c3 - c2, "reward": c4 - c3}})
            time.sleep(args.pause_s)  # the step's training and push, during which the servers idle
        for url in urls:  # what the last batch recorded after its last answer went out
            ServerControl(url)._call("GET", FLUSH_PATH)
        if profiler is not None:
            profiler.dump_stats(hooks / "driver-main.prof")
            done = threading.Event()
            loop.call_soon_threadsafe(lambda: (loop_profiler.disable(), done.set()))
            done.wait(10)
            loop_profiler.dump_stats(hooks / "driver-client-loop.prof")
    finally:
        if client is not None:
            client.close()
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()
    return attempts, steps


# ---------------------------------------------------------------------------------------------- analysis


def load_servers(hooks: Path) -> dict[int, list[dict]]:
    """pid -> that server's records."""
    return {int(path.stem): [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted(hooks.glob("*.jsonl"))}


def split_step(step: dict, driver: list[dict], servers: dict[int, list[dict]]) -> dict[str, float]:
    """One step's parts (seconds), along the server whose last answer went out last: the rows
    marked '=' add up to the step; the indented ones split the row above them."""
    def inside(events):  # those that started in the step (a batch may return after its last answer went out)
        return [e for e in events if step["t0"] <= e["t0"] <= step["t1"]]

    per_server = {pid: inside(ev) for pid, ev in servers.items()}
    per_server = {pid: ev for pid, ev in per_server.items() if any(e["name"] == "request" for e in ev)}
    mine = inside(driver)

    def total(events, name):
        return sum(e["t1"] - e["t0"] for e in events if e["name"] == name)

    def last_sent(ev):
        return max(e["t1"] for e in ev if e["name"] == "request")

    pid = max(per_server, key=lambda p: last_sent(per_server[p]))
    ev = per_server[pid]
    requests = [e for e in ev if e["name"] == "request"]
    batches = sorted((e for e in ev if e["name"] == "run_batch"), key=lambda e: e["t0"])
    first_arrival, last_arrival = min(e["t0"] for e in requests), max(e["t0"] for e in requests)
    last_submit = max(e["t1"] for e in ev if e["name"] == "submit")
    batch_start = batches[0]["t0"]
    last_finish = max(e["t1"] for e in ev if e["name"] == "finish")
    sent = last_sent(ev)
    forwards = [e for e in ev if e["name"] == "forward"]
    prefill_forwards = [f for f in forwards if f["shape"][1] > 1]
    decode_forwards = [f for f in forwards if f["shape"][1] == 1]
    in_batches = sum(b["t1"] - b["t0"] for b in batches)
    prefill_forward = sum(f["t1"] - f["t0"] for f in prefill_forwards)
    compute = {
        "prefill (forward)": prefill_forward,
        "prefill (the rest: padding, unique, cache copy)": total(ev, "prefill") - prefill_forward,
        "decode forwards": sum(f["t1"] - f["t0"] for f in decode_forwards),
        "sampling (sample_tokens)": total(ev, "sample"),
        "finishing (detokenise, hand over)": total(ev, "finish"),
        "joins (late requests' prefill)": total(ev, "join"),
    }
    compute["bookkeeping (the rest of the batch loop)"] = in_batches - sum(compute.values())
    out = {
        "= probe: GET /health of each server (Cluster.recover)": step["probed"] - step["t0"],
        "= client: generate() -> first request at the server": first_arrival - step["probed"],
        "    generate() -> the first request's _attempt starts (driver)": min(
            e["t0"] for e in mine if e["name"] == "attempt") - step["probed"],
        "= requests arriving (first -> last at the server)": last_arrival - first_arrival,
        "    body read + parse + submit (all requests, loop thread)": sum(total(ev, name) for name in
                                                                         ("read_body", "parse", "submit")),
        "= last arrival -> batch starts (burst wait)": batch_start - last_arrival,
        "    of which after the last submit (idle)": batch_start - last_submit,
        "= batch start -> its last sample finished": last_finish - batch_start,
        "    engine batches (run_batch, all of them)": in_batches,
        **{f"      {k}": v for k, v in compute.items()},
        "= last sample finished -> last answer sent (loop wake, _output, JSON, send)": sent - last_finish,
        "    _output (all samples)": total(ev, "output"),
        "    JSONResponse.render (all answers)": total(ev, "render"),
        "= last answer sent -> generate() returns (router, read, parse)": step["generated"] - sent,
        "= experience_batch": step["batch_made"] - step["generated"],
        "= reward (experience.score)": step["t1"] - step["batch_made"],
        "step's generation (generate + reward)": step["t1"] - step["t0"],
        "  timing/generate (probe -> experience_batch)": step["batch_made"] - step["t0"],
        "  client generate() (rollout/wall_s)": step["generated"] - step["probed"],
        "requests per server (this server)": float(len(requests)),
        "batches at this server (run_batch calls)": float(len(batches)),
        "decode forwards at this server": float(len(decode_forwards)),
        "rows in this server's batches": float(sum(b["rows"] for b in batches)),
        "response tokens (all)": float(step["response_tokens"]),
        **{f"CPU s: {k}": v for k, v in step["cpu_s"].items()},
        "CPU s: all of the above": sum(step["cpu_s"].values()),
        **{f"CPU s: driver's main thread: {k}": v for k, v in step["driver_main_cpu_s"].items()},
    }
    engines = [total(e, "run_batch") for e in per_server.values()]
    out["engine batches, mean of the servers"] = sum(engines) / len(engines)
    return out


def median(values: list[float]) -> float:
    values = sorted(values)
    n = len(values)
    return 0.0 if n == 0 else (values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2)


def floor(model_path: str, prompts: list[list[int]], n: int, steps: int, repeats: int = 20) -> dict[str, float]:
    """Plain transformers on one torch thread doing one server's compute: the distinct prompts'
    prefill (left-padded, one forward), the KV cache repeated to n rows each, `steps` decode
    forwards of [rows, 1], and steps + 1 samplings with torch.multinomial and log_softmax; medians."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1

    def once():
        with torch.inference_mode():
            t0 = time.perf_counter()
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
            t1 = time.perf_counter()
            cache, logits = out.cache, out.logits[:, -1].repeat_interleave(n, 0)
            cache.batch_repeat_interleave(n)
            m, nxt = mask.repeat_interleave(n, 0), pos[:, -1:].repeat_interleave(n, 0) + 1
            fwd = smp = 0.0
            for t in range(steps + 1):
                a = time.perf_counter()
                token = torch.multinomial(torch.softmax(logits, -1), 1)
                torch.log_softmax(logits, -1).gather(-1, token)
                smp += time.perf_counter() - a
                if t == steps:
                    break
                m = torch.cat([m, torch.ones(len(m), 1, dtype=m.dtype)], 1)
                a = time.perf_counter()
                out = model(input_ids=token, attention_mask=m, position_ids=nxt, cache=cache, use_cache=True)
                fwd += time.perf_counter() - a
                cache, logits, nxt = out.cache, out.logits[:, -1], nxt + 1
            return {"prefill forward": t1 - t0, "decode forwards": fwd, "sampling": smp,
                    "total": time.perf_counter() - t0}

    for _ in range(3):
        once()
    runs = [once() for _ in range(repeats)]
    torch.set_num_threads(threads)
    return {k: median([r[k] for r in runs]) for k in runs[0]}


def report(names: list[str], medians: dict[str, float], steps: int, floor_s: dict[str, float]) -> None:
    print(f"{steps} steps; medians of steps 3+ (seconds; counts where named):")
    width = max(len(n) for n in names)
    for n in names:
        print(f"  {n:<{width}}  {medians[n]:8.4f}")
    print("floor, plain transformers at 1 thread, one server's work:")
    for k, v in floor_s.items():
        print(f"  {k:<{width}}  {v:8.4f}")


def main() -> None:
    import argparse
    import shutil

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import DEFAULT_OUT, REPO, load_average, write_result
    from megarl_run import warm_start

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workdir", type=Path, default=DEFAULT_OUT / "generate_profile")
    p.add_argument("--model", help="an HF checkpoint (default: megarl_run's SFT warm start under --workdir)")
    p.add_argument("--train", help="RL train parquet (with --model)")
    p.add_argument("--val", help="RL validation parquet (with --model)")
    p.add_argument("--src", type=Path, help="the megarl source tree to run (default: this checkout's src/)")
    p.add_argument("--name", default="run", help="names the run and its JSON result")
    p.add_argument("--direct", action="store_true", help="send requests to the servers straight, not via the router")
    p.add_argument("--cprofile", action="store_true", help="cProfile the servers' threads and the driver")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--pause-s", type=float, default=0.15, help="idle time between steps (the step's training)")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value) on top of configs/quickstart.yaml")
    args = p.parse_args()
    workdir = args.workdir.resolve()
    warm = ({"model": args.model, "train": args.train, "val": args.val} if args.model
            else warm_start(workdir, sft_steps=240))
    hooks = workdir / f"hooks-{args.name}"
    shutil.rmtree(hooks, ignore_errors=True)
    hooks.mkdir(parents=True)
    (workdir / "site").mkdir(exist_ok=True)
    (workdir / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    src = (args.src or REPO / "src").resolve()
    sys.path.insert(0, str(src))  # the driver's megarl: the same tree as the servers'
    for name in [m for m in sys.modules if m == "megarl" or m.startswith("megarl.")]:
        del sys.modules[name]
    from transformers import AutoTokenizer

    from megarl.config import load_and_validate
    from megarl.data.prompts import PromptDataset

    c = load_and_validate(quickstart_file(workdir), [
        f"actor_rollout_ref.model.path={warm['model']}", f"data.train_files=[{warm['train']}]",
        f"data.val_files=[{warm['val']}]", "data.max_response_length=4", *args.overrides])
    tokenizer = AutoTokenizer.from_pretrained(warm["model"])
    data = PromptDataset.from_config(c.data, tokenizer, "train")
    load_before = load_average()
    driver, steps = run_steps(args, c, data, tokenizer, hooks, src)
    load_after = load_average()
    servers = load_servers(hooks)
    splits = [split_step(s, driver, servers) for s in steps]
    steady = splits[2:] if len(splits) > 2 else splits
    names = list(dict.fromkeys(k for s in steady for k in s))
    medians = {k: median([s.get(k, 0.0) for s in steady]) for k in names}

    per_server = c.data.train_batch_size // c.trainer.n_gpus_per_node
    floor_s = floor(warm["model"], [data[i].input_ids for i in range(per_server)], c.actor_rollout_ref.rollout.n,
                    steps=int(medians["decode forwards at this server"]))
    report(names, medians, len(splits), floor_s)
    print(f"load average before {load_before['1m']:.2f}, after {load_after['1m']:.2f} (1 min)")
    write_result(f"generate_profile_{args.name}", {"steps": args.steps, "src": str(src), "direct": args.direct,
                                                   "overrides": args.overrides,
                                                   "hooks": str(hooks), "median_s": medians, "floor_s": floor_s,
                                                   "splits": splits, "load_before": load_before,
                                                   "load_after": load_after}, args.out)


if __name__ == "__main__":
    main()
