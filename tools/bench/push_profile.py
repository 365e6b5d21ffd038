"""Benchmark: where one weight push of the CPU quickstart spends its time, per call and per process.

Runs `configs/quickstart.yaml` (GRPO, TP=1 DP=2 on gloo, two colocated CPU-engine servers; the
push's transport is what `weight_sync_transport: auto` gives on CPU, distributed over gloo; config
overrides as arguments, e.g. `actor_rollout_ref.rollout.weight_sync_transport=tensor`) for a few
steps through megarl's CLI with a timing hook in every process it starts (driver, Ray workers,
rollout servers: a `sitecustomize` on PYTHONPATH that wraps the push's functions as their modules
are imported; megarl's own code runs unchanged). Each wrapped call
appends (process, name, start, end) to a file per process, on the system-wide monotonic clock
(`time.perf_counter`, CLOCK_MONOTONIC on Linux), and this script splits every push
(from `Cluster.push_phase` to `Cluster.rollout_phase` in the driver, as `RLTrainer.train_step` calls
them) into its parts: median seconds per push over the pushes after
the first two.

    .venv/bin/python tools/bench/push_profile.py --steps 20 [--model DIR --train P --val P] [KEY=VALUE ...]
    .venv/bin/python tools/bench/push_profile.py --src /tmp/old/src --name old   # another tree, to compare

Without `--model` a random tiny Qwen2 and the addition data are made under the work directory (the
push does not depend on what the model learned; generation does, and is not measured here).
"""
from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from pathlib import Path

HOOK_ENV = "MEGARL_PUSH_PROFILE"  # the directory the hook writes into; unset: no hook
CPROFILE_ENV = "MEGARL_PUSH_PROFILE_CPROFILE"  # set: cProfile each actor rank's push_weights (slower pushes)

# ---------------------------------------------------------------------------------------------- the hook
# Runs inside every process of the run (imported by the generated sitecustomize): keep it light.

_out = None
_out_lock = threading.Lock()


def _record(name: str, started: float, ended: float, **extra) -> None:
    global _out
    line = json.dumps({"name": name, "t0": started, "t1": ended, **extra}) + "\n"
    with _out_lock:
        if _out is None:
            label = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
            _out = open(Path(os.environ[HOOK_ENV]) / f"{os.getpid()}.jsonl", "a", buffering=1)
            _out.write(json.dumps({"process": label, "argv": sys.argv[1:6]}) + "\n")
        _out.write(line)


def _timed(cls, method: str, name: str, extra=None) -> None:
    """Replace `cls.method` by a wrapper recording each call as `name` (`extra(args)`: more fields)."""
    original = getattr(cls, method)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _record(name, started, time.perf_counter(), **(extra(args, kwargs) if extra else {}))

    setattr(cls, method, wrapper)


class _TimedDist:
    """torch.distributed as `megarl.sync.weight_sync` sees it, with its object collectives timed."""

    def __init__(self, dist):
        self._dist = dist

    def __getattr__(self, name):
        value = getattr(self._dist, name)
        if name not in ("broadcast_object_list", "gather_object", "broadcast"):
            return value

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return value(*args, **kwargs)
            finally:
                _record(f"dist.{name}", started, time.perf_counter(), rank=self._dist.get_rank())
        return timed


def _rank(args, kwargs):
    import torch.distributed as dist
    return {"rank": dist.get_rank() if dist.is_initialized() else -1}


def _patch_control(m):
    _timed(m.ServerControl, "_call", "http",
           lambda a, k: {"url": a[0].url, "path": f"{a[1]} {a[2].split('?')[0]}"})  # the server's path
    _timed(m.ServerControl, "health", "http", lambda a, k: {"url": a[0].url, "path": "GET /health"})


def _patch_weight_sync(m):
    for method in ("push", "_prepare_servers", "_stream", "_commit", "_end_sessions", "_from_coordinator",
                   "_relay_round"):
        _timed(m.WeightSync, method, f"WeightSync.{method}", _rank)
    m.dist = _TimedDist(m.dist)


def _patch_transports(m):
    for method in ("open_stream", "send", "commit", "_post"):
        _timed(m.TensorTransport, method, f"TensorTransport.{method}", _rank)
    for method in ("open_stream", "send", "commit"):
        _timed(m.DistributedTransport, method, f"DistributedTransport.{method}", _rank)
    m.dist = _TimedDist(m.dist)


def _patch_train_worker(m):
    _timed(m.TrainWorker, "push_weights", "TrainWorker.push_weights", lambda a, k: {"rank": a[0].rank})
    if os.environ.get(CPROFILE_ENV):
        timed = m.TrainWorker.push_weights

        @functools.wraps(timed)
        def profiled(self, *args, **kwargs):
            return _profiled(f"push_weights-rank{self.rank}", timed, self, *args, **kwargs)
        m.TrainWorker.push_weights = profiled


_profilers: dict = {}  # module state, not a closure's: Ray pickles the actor class with its methods' closures


def _profiled(name: str, call, *args, **kwargs):
    """`call(*args, **kwargs)` under this process's cProfile profiler `name`, its stats written after each call."""
    import cProfile
    profiler = _profilers.setdefault(name, cProfile.Profile())
    try:
        return profiler.runcall(call, *args, **kwargs)
    finally:
        profiler.dump_stats(Path(os.environ[HOOK_ENV]) / f"{name}.prof")


def _patch_rollout_worker(m):
    _timed(m.RolloutWorker, "status", "RolloutWorker.status")


def _patch_cluster(m):
    for method in ("push_phase", "push_weights", "rollout_phase", "recover", "_do"):
        _timed(m.Cluster, method, f"Cluster.{method}")


def _patch_fleet(m):
    for method in ("take_down_failed", "_failed_servers", "_statuses", "fault_metrics"):
        _timed(m.RolloutFleet, method, f"RolloutFleet.{method}")


def _patch_roles(m):
    _timed(m.ActorRole, "push_weights", "ActorRole.push_weights")


def _patch_weight_group(m):
    _timed(m, "receive_bucket", "server.receive_bucket")


def _patch_cpu_engine(m):
    _timed(m.CPUEngine, "load_weights", "server.load_weights")


def _patch_uvicorn(m):
    """The CPU engine's server (`python -m megarl.rollout.cpu.server`, which runs as __main__ and
    hands its app to `uvicorn.run`): each request's time in the server, from the ASGI call to its
    last body chunk."""
    run = m.run
    port = next((a.split("=")[-1] for a in sys.argv if a.startswith("--port=")), None)
    if port is None and "--port" in sys.argv:
        port = sys.argv[sys.argv.index("--port") + 1]

    class Timing:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            started = time.perf_counter()

            async def timed_send(message):
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    _record("server", started, time.perf_counter(), port=port,
                            path=f"{scope['method']} {scope['path']}")
            return await self.app(scope, receive, timed_send)

    def timed_run(app, *args, **kwargs):
        app.add_middleware(Timing)
        return run(app, *args, **kwargs)
    m.run = timed_run


PATCHES = {
    "megarl.rollout.control": _patch_control,
    "megarl.sync.weight_sync": _patch_weight_sync,
    "megarl.sync.transports": _patch_transports,
    "megarl.workers.train_worker": _patch_train_worker,
    "megarl.workers.rollout_worker": _patch_rollout_worker,
    "megarl.runtime.cluster": _patch_cluster,
    "megarl.runtime.rollout_fleet": _patch_fleet,
    "megarl.runtime.roles": _patch_roles,
    "megarl.rollout.weight_group": _patch_weight_group,
    "megarl.rollout.cpu.engine": _patch_cpu_engine,
    "uvicorn": _patch_uvicorn,
}


class PatchingFinder:
    """Finds the modules named in `patches` (module name -> patch function) with the other
    finders and patches each once it has run (tools/bench/generate_profile.py uses it too)."""

    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, name, path=None, target=None):
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patches[name](module)
        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Called by the generated sitecustomize in every process where HOOK_ENV is set."""
    sys.meta_path.insert(0, PatchingFinder(PATCHES))


SITECUSTOMIZE = f"""import os
if os.environ.get({HOOK_ENV!r}):
    import push_profile
    push_profile.install()
"""

# ---------------------------------------------------------------------------------------------- analysis


def load(directory: Path) -> list[dict]:
    """Every record of every process, each with its process's label and pid."""
    records = []
    for path in sorted(directory.glob("*.jsonl")):
        lines = path.read_text().splitlines()
        head = json.loads(lines[0])
        for line in lines[1:]:  # a header per process, then its records
            records.append({**json.loads(line), "pid": int(path.stem), "process": head["process"],
                            "argv": head["argv"]})
    return records


def median(values: list[float]) -> float:
    values = sorted(values)
    n = len(values)
    return 0.0 if n == 0 else (values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2)


def split_push(records: list[dict], t0: float, t1: float) -> dict[str, float]:
    """The parts of one push (seconds; the HTTP calls a count), from the records inside [t0, t1]:
    each part is the total of its calls in the push, `longest` the longest one of several."""
    inside = [r for r in records if r["t0"] >= t0 - 1e-6 and r["t1"] <= t1 + 1e-6]

    def spans(name, **match):
        return sorted((r for r in inside if r["name"] == name and all(r.get(k) == v for k, v in match.items())),
                      key=lambda r: r["t0"])

    def total(name, **match):
        return sum(r["t1"] - r["t0"] for r in spans(name, **match))

    def longest(name, **match):
        return max((r["t1"] - r["t0"] for r in spans(name, **match)), default=0.0)

    def nth(n, name, **match):
        found = spans(name, **match)
        return found[n]["t1"] - found[n]["t0"] if len(found) > n else 0.0

    ranks = [total("TrainWorker.push_weights", rank=r) for r in (0, 1)]
    out = {
        "push (Cluster.push_phase to Cluster.rollout_phase)": t1 - t0,
        "  recover: the fleet's liveness check (Cluster.recover)": total("Cluster.recover"),
        "    RolloutFleet._failed_servers (driver-side /health)": total("RolloutFleet._failed_servers"),
        "    RolloutWorker.status, /health probe (longest)": longest("RolloutWorker.status"),
        "  memory moves (push_phase + rollout_phase)": total("Cluster.push_phase") + total("Cluster.rollout_phase"),
        "  ActorRole.push_weights (the Ray call)": total("ActorRole.push_weights"),
        "    Ray's share (call - slowest rank)": total("ActorRole.push_weights") - max(ranks),
        "    TrainWorker.push_weights rank 0": ranks[0],
        "    TrainWorker.push_weights rank 1": ranks[1],
        "      WeightSync.push rank 0": total("WeightSync.push", rank=0),
        "        prepare (coordinator)": total("WeightSync._prepare_servers", rank=0),
        "        broadcast of the decision (rank 0)": nth(0, "dist.broadcast_object_list", rank=0),
        "        broadcast of the decision (rank 1, waits out the prepare)": nth(0, "dist.broadcast_object_list",
                                                                                  rank=1),
        "        stream (rank 0)": total("WeightSync._stream", rank=0),
        "          relay rounds (tensor transport)": total("WeightSync._relay_round", rank=0),
        "        gather of the reports (rank 0)": total("dist.gather_object", rank=0),
        "        commit (coordinator)": total("WeightSync._commit", rank=0),
        "          gloo broadcast of the bucket (distributed transport)": total("dist.broadcast", rank=0),
        "          end of the sessions (round)": total("WeightSync._end_sessions", rank=0),
        "        broadcast of the outcome (rank 0)": nth(1, "dist.broadcast_object_list", rank=0),
        "HTTP calls in the push": float(len(spans("http"))),
    }
    for path in dict.fromkeys(r["path"] for r in spans("http")):
        out[f"  {path}: call (longest)"] = longest("http", path=path)
        out[f"  {path}: in the server (longest)"] = longest("server", path=path)
    out["  server: receive_bucket (longest)"] = longest("server.receive_bucket")
    out["  server: load_weights (longest)"] = longest("server.load_weights")
    return out


def profile(directory: Path, skip: int = 2) -> tuple[list[str], dict[str, float], list[dict]]:
    """(row names, median seconds per push of each, every push's split)."""
    records = load(directory)
    starts = sorted((r for r in records if r["name"] == "Cluster.push_phase"), key=lambda r: r["t0"])
    ends = sorted((r for r in records if r["name"] == "Cluster.rollout_phase"), key=lambda r: r["t0"])
    splits = [split_push(records, start["t0"], end["t1"]) for start, end in zip(starts, ends)]
    steady = splits[skip:] if len(splits) > skip else splits
    names = list(dict.fromkeys(k for s in steady for k in s))
    return names, {k: median([s.get(k, 0.0) for s in steady]) for k in names}, splits


def main() -> None:
    import argparse
    import shutil

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import DEFAULT_OUT, REPO, load_average, write_result
    from megarl_run import run_grpo

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workdir", type=Path, default=DEFAULT_OUT / "push_profile")
    p.add_argument("--model", help="an HF checkpoint (default: a random tiny Qwen2 under --workdir)")
    p.add_argument("--train", help="RL train parquet (with --model)")
    p.add_argument("--val", help="RL validation parquet (with --model)")
    p.add_argument("--src", type=Path, help="the megarl source tree to run (default: this checkout's src/)")
    p.add_argument("--name", default="run", help="names the run and its JSON result")
    p.add_argument("--cprofile", action="store_true",
                   help="also cProfile each actor rank's pushes (hooks directory: push_weights-rank<r>.prof)")
    p.add_argument("--analyse", type=Path, help="only print the profile of a hook directory from an earlier run")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value) on top of configs/quickstart.yaml")
    args = p.parse_args()
    if args.analyse:
        report(*profile(args.analyse))
        return
    workdir = args.workdir.resolve()
    if args.model:
        warm = {"model": args.model, "train": args.train, "val": args.val}
    else:
        from megarl.data.synthetic import write_task_dataset
        from megarl.data.tiny_model import make_tiny_model
        if not (workdir / "model" / "config.json").exists():
            make_tiny_model("qwen2", workdir / "model", seed=0)
        data = write_task_dataset("add", workdir / "data", seed=0)
        warm = {"model": str(workdir / "model"), "train": str(data["train"]), "val": str(data["val"])}
    hooks = workdir / f"hooks-{args.name}"
    shutil.rmtree(hooks, ignore_errors=True)
    hooks.mkdir(parents=True)
    site = workdir / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    os.environ[HOOK_ENV] = str(hooks)
    if args.cprofile:
        os.environ[CPROFILE_ENV] = "1"
    src = (args.src or REPO / "src").resolve()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(Path(__file__).resolve().parent), str(src),
                                                os.environ.get("PYTHONPATH", "")])
    load_before = load_average()
    overrides = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[console]",
                 "actor_rollout_ref.actor.optim.lr_warmup_steps=1", *args.overrides]  # the warm-up must end in the run
    run = run_grpo(warm, workdir, args.name, args.steps, seed=0, overrides=overrides)
    names, medians, splits = profile(hooks)
    report(names, medians, splits)
    sync = run["phases_s"].get("sync_weights", [])
    print(f"timing/sync_weights_s median of steps 3+: {median(sync[2:]):.4f} s; "
          f"timing/step_s {median(run['step_s'][2:]):.3f} s")
    write_result(f"push_profile_{args.name}", {"steps": args.steps, "src": str(src), "overrides": overrides,
                                               "hooks": str(hooks), "median_s": medians, "pushes": splits,
                                               "load_before": load_before, "load_after": load_average(), "run": run})


def report(names: list[str], medians: dict[str, float], splits: list[dict]) -> None:
    print(f"{len(splits)} pushes; medians of pushes 3+ (seconds; the HTTP calls a count):")
    width = max(len(n) for n in names)
    for n in names:
        print(f"  {n:<{width}}  {medians[n]:8.4f}")


if __name__ == "__main__":
    main()
