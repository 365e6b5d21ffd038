"""The engine methods as the controller reaches them: every method of a role handle
(megarl.runtime.roles) runs one public method of its role's engine class, which takes the handle's
arguments under the same names (or one of the worker's own methods, likewise); the workers'
dispatcher `TrainWorker.run_engine` runs an engine's public method and refuses any other name,
naming the role, the method and the engine's class; no engine method is written again on the
worker; and a handle's call reaches its engine through `EngineGroup` and the dispatcher, the batch
split over the DP ranks and joined back."""
import inspect
import subprocess
import sys

import pytest
import torch

from megarl.data.batch import Batch
from megarl.engines.megatron.engine import MegatronEngine
from megarl.engines.megatron.reward_model import RewardModelEngine
from megarl.engines.megatron.roles import ActorEngine, CriticEngine, RefEngine, TeacherEngine
from megarl.runtime import roles
from megarl.runtime.engine_group import EngineGroup, EngineMethod
from megarl.workers.train_worker import TrainWorker, engine_class

# the role whose workers each handle drives (runtime.cluster; trainer.sft and trainer.dpo for theirs)
HANDLE_ROLE = {roles.ActorRole: "actor", roles.SFTActorRole: "actor", roles.DPOActorRole: "actor",
               roles.RefRole: "ref", roles.CriticRole: "critic", roles.RewardModelRole: "reward_model",
               roles.TeacherRole: "teacher"}
ENGINES = {"actor": ActorEngine, "ref": RefEngine, "critic": CriticEngine, "reward_model": RewardModelEngine,
           "teacher": TeacherEngine}


class Arg:
    """A handle's argument, by its parameter's name."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Arg({self.name})"


class RecordingWorkers:
    """Stands for a handle's `WorkerGroup`: records the worker methods called on it directly."""

    def __init__(self, calls: list):
        self.calls = calls

    def call(self, method, *args, timeout_s: float, **kwargs):
        self.calls.append(("workers.call", method, args, kwargs))
        return [{}]


def handle_methods(handle_cls: type) -> dict:
    """{name: function} of the handle's public methods, beyond `EngineGroup`'s."""
    found = {}
    for cls in reversed(handle_cls.__mro__):
        if issubclass(cls, EngineGroup) and cls is not EngineGroup:
            found.update({n: f for n, f in vars(cls).items() if inspect.isfunction(f) and not n.startswith("_")})
    return found


def dispatches(handle_cls: type, method) -> tuple[list, list[str]]:
    """What the handle's `method`, called with an `Arg` per parameter, asks of its `EngineGroup`
    helpers and workers: [(helper, method, args, kwargs)]; and its parameters' names."""
    calls = []
    handle = object.__new__(handle_cls)
    handle.name, handle.workers = HANDLE_ROLE[handle_cls], RecordingWorkers(calls)

    def helper(helper_name, reply):
        def record(method, *args, **kwargs):
            calls.append((helper_name, method, args, kwargs))
            return reply
        return record

    for name, reply in (("call", [{}]), ("compute", {}), ("update", {}), ("update_and_compute", ({}, {}))):
        setattr(handle, name, helper(name, reply))
    params = list(inspect.signature(method).parameters)[1:]
    method(handle, *map(Arg, params))
    return calls, params


def assert_takes_the_handles_arguments(target, args: tuple, kwargs: dict, params: list[str], where: str) -> None:
    """`target`'s signature binds `args`, `kwargs` (after self), each `Arg` to the parameter of its
    name, and the handle passes on every argument it takes."""
    bound = inspect.signature(target).bind(None, *args, **kwargs).arguments
    passed = {name: value for name, value in list(bound.items())[1:]}
    assert all(isinstance(v, Arg) for v in passed.values()), (where, passed)
    assert {name: v.name for name, v in passed.items()} == {p: p for p in params}, where


@pytest.mark.parametrize("handle_cls", list(HANDLE_ROLE), ids=lambda c: c.__name__)
def test_every_engine_method_a_handle_names_is_public_on_its_roles_engine_and_takes_its_arguments(handle_cls):
    role = HANDLE_ROLE[handle_cls]
    engine_cls = engine_class(role)
    assert engine_cls is ENGINES[role]
    methods = handle_methods(handle_cls)
    assert {"offload", "onload", "empty_cache", "save_checkpoint", "load_checkpoint"} <= methods.keys()
    for name, method in methods.items():
        where = f"{handle_cls.__name__}.{name}"
        calls, params = dispatches(handle_cls, method)
        assert len(calls) == 1, (where, calls)
        helper, target, args, kwargs = calls[0]
        if helper == "workers.call":  # the worker's own (the actor's weight sync), not the engine's
            assert vars(TrainWorker).get(target.__name__) is target, where
            assert_takes_the_handles_arguments(target, args, kwargs, params, where)
            continue
        assert isinstance(target, EngineMethod), (where, target)  # named on the engine, not on the worker
        assert target.engine in [cls.__name__ for cls in engine_cls.__mro__], (where, target, engine_cls)
        engine_method = inspect.getattr_static(engine_cls, target.__name__, None)
        assert not target.__name__.startswith("_") and inspect.isfunction(engine_method), (where, target)
        assert_takes_the_handles_arguments(engine_method, args, kwargs, params, where)


def test_every_handle_class_is_checked():
    handles = {c for c in vars(roles).values() if isinstance(c, type) and issubclass(c, roles.TrainingRole)}
    assert handles - {roles.TrainingRole} == HANDLE_ROLE.keys()


def test_the_handles_name_engine_methods_without_loading_megatron():
    code = ("import sys; from megarl.runtime import roles; "
            "print(roles.ActorEngine.update_policy.__qualname__, sorted(m for m in sys.modules if 'megatron' in m))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split(" ", 1) == ["ActorEngine.update_policy", "[]\n"]


def public_methods(cls: type) -> set[str]:
    return {name for c in cls.__mro__ if c is not object for name, f in vars(c).items()
            if inspect.isfunction(f) and not name.startswith("_")}


def test_no_engine_method_is_written_again_on_the_worker():
    on_engines = set().union(*map(public_methods, ENGINES.values()))
    assert public_methods(TrainWorker) & on_engines == set()


@pytest.fixture
def critic_worker(monkeypatch):
    """A critic rank's worker (not started) whose engine is a `CriticEngine` never initialised,
    its compute device the CPU."""
    monkeypatch.setenv("RANK", "0")  # TrainWorker sets both; restored after the test
    monkeypatch.setenv("WORLD_SIZE", "1")
    worker = TrainWorker(0, 1, "critic", config=None)
    worker.engine = object.__new__(CriticEngine)
    worker.engine.device = torch.device("cpu")
    return worker


def test_the_dispatcher_runs_a_public_engine_method(critic_worker):
    # MegatronEngine.empty_cache on the CPU: nothing is cached, both counts are 0
    assert critic_worker.run_engine("empty_cache") == {"reserved_before": 0, "reserved_after": 0}


@pytest.mark.parametrize("name", [
    "no_such_method",
    "_value_weight",  # CriticEngine's own, private
    "__init__",
    "update_policy",  # ActorEngine's: another role's
    "dp_rank",  # a property
    "hook",  # a callable on the instance, not on the class
])
def test_the_dispatcher_refuses_what_is_no_public_method_of_its_engine(critic_worker, name):
    critic_worker.engine.hook = lambda: "ran"
    with pytest.raises(TypeError) as error:
        critic_worker.run_engine(name)
    assert str(error.value) == f"critic: {name!r} is not a public method of its engine, CriticEngine"


class DoublingEngine:
    """A stand-in engine: `compute_values` doubles each sample's `x`; `offload` echoes its arguments."""

    is_output_rank = True

    def compute_values(self, batch: Batch) -> dict:
        return {"values": batch["x"] * 2}

    def offload(self, params: bool, grads: bool, optimizer: bool) -> dict:
        return {"params": params, "grads": grads, "optimizer": optimizer}


class LocalWorkers:
    """Stands for `WorkerGroup` in process: each rank a `TrainWorker` hosting a `DoublingEngine`."""

    def __init__(self, ranks: int, calls: list):
        self.ranks = [TrainWorker(r, ranks, "critic", config=None) for r in range(ranks)]
        for worker in self.ranks:
            worker.engine = DoublingEngine()
        self.calls = calls

    def call(self, method, *args, timeout_s: float, call_name: str, **kwargs):
        self.calls.append((method.__name__, call_name))
        return [getattr(w, method.__name__)(*args, **kwargs) for w in self.ranks]

    def call_each(self, method, per_rank_args: list[tuple], timeout_s: float, call_name: str):
        self.calls.append((method.__name__, call_name))
        return [getattr(w, method.__name__)(*args) for w, args in zip(self.ranks, per_rank_args)]


def test_a_handles_call_reaches_each_ranks_engine_through_the_dispatcher(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    calls = []
    critic = object.__new__(roles.CriticRole)
    critic.name, critic.timeout_s, critic.workers = "critic", 60.0, LocalWorkers(2, calls)
    critic.dp_size, critic.dp_ranks, critic.output_ranks = 2, [0, 1], {0: 0, 1: 1}
    x = torch.arange(5.0)[:, None]  # 5 samples over 2 DP ranks: the last one padded onto rank 1
    values = critic.compute_values(Batch({"x": x}))["values"]
    assert torch.equal(values, 2 * x)
    assert critic.offload(True, False, True) == [{"params": True, "grads": False, "optimizer": True}] * 2
    assert calls == [("run_engine", "compute_values"), ("run_engine", "offload")]
