"""verl's profiler keys (`global_profiler.*`, `<role>.profiler.*`: verl/utils/profiler/config.py
ProfilerConfig and its tool configs; verl/trainer/config/ppo_megatron_trainer.yaml `global_profiler`):
which roles are profiled, what each tool needs of the device, and which of verl's tools megarl runs.

A step is profiled when it is one of `global_profiler.steps` (the first step is 1, verl's
`global_steps`), a role when its `profiler.enable` is set, a rank of it when `profiler.all_ranks`,
it is in `profiler.ranks`, or `ranks` is empty and it is rank 0 (verl/utils/profiler/profile.py
DistProfiler.__init__'s rank selection). With no tool, no steps or no enabled role nothing is
profiled, as in verl."""
from __future__ import annotations

from typing import Optional

from megarl.config.schema import TORCH_PROFILER_CONTENTS, ExperimentConfig, RoleProfilerConfig

# The training roles with verl's `profiler` group, by their section in the config and megarl's role name.
TRAINING_ROLE_SECTIONS = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref", "critic": "critic"}


def role_profilers(config: ExperimentConfig) -> dict[str, RoleProfilerConfig]:
    """{role name: its profiler group} of the training roles (actor, ref, critic)."""
    arr = config.actor_rollout_ref
    return {"actor": arr.actor.profiler, "ref": arr.ref.profiler, "critic": config.critic.profiler}


def profiling_on(config: ExperimentConfig) -> bool:
    """Whether anything is profiled: a tool, at least one step, and a role (rollout included) enabled."""
    g = config.global_profiler
    roles = [*role_profilers(config).values(), config.actor_rollout_ref.rollout.profiler]
    return g.tool is not None and bool(g.steps) and any(p.enable for p in roles)


def profiled_roles(config: ExperimentConfig, step: int) -> list[str]:
    """The training roles (of `role_profilers`) whose selected ranks record training step `step`
    with torch.profiler: tool=torch, `step` in global_profiler.steps and the role's profiler enabled
    (verl's RayPPOTrainer: do_profile = global_steps in global_profiler.steps)."""
    g = config.global_profiler
    if g.tool != "torch" or step not in (g.steps or ()):
        return []
    return [role for role, profiler in role_profilers(config).items() if profiler.enable]


def profiled_rank(profiler: RoleProfilerConfig, rank: int) -> bool:
    """Whether `rank` (0 .. the role's world size - 1) of an enabled role records (verl's DistProfiler:
    all_ranks, else the listed ranks, else rank 0)."""
    return profiler.enable and (profiler.all_ranks or (rank in profiler.ranks if profiler.ranks else rank == 0))


def torch_activities(contents: list[str], on_cuda: bool) -> tuple[str, ...]:
    """torch.profiler's activities for `tool_config.torch.contents` ("cpu", "cuda" of
    torch.profiler.ProfilerActivity): CPU always (verl's get_torch_profiler: its stage markers are CPU
    events), CUDA where contents is empty (verl: "Empty means collect everything") or names cuda, and
    only on a CUDA device (empty contents on a CPU: everything there is)."""
    wants_cuda = not contents or "cuda" in contents
    return ("cpu", "cuda") if wants_cuda and on_cuda else ("cpu",)


def profiler_settings_problems(config: ExperimentConfig) -> list[str]:
    """Device-independent refusals of the profiler keys: verl's own asserts (torch contents, the
    tool names) and what megarl does not run (NPU, the rollout servers' profiler, discrete traces)."""
    g = config.global_profiler
    problems = []
    if g.tool == "npu":
        problems.append("global_profiler.tool=npu: the Ascend NPU profiler (torch_npu.profiler) profiles NPUs, and "
                        "megarl runs on CUDA GPUs and CPUs only; use tool=torch or nsys (on GPUs)")
    if g.steps is not None and any(s < 1 for s in g.steps):
        problems.append(f"global_profiler.steps={g.steps}: steps count from 1 (verl's global_steps)")
    for role, profiler in role_profilers(config).items():
        section = TRAINING_ROLE_SECTIONS[role]
        if any(r < 0 for r in profiler.ranks):
            problems.append(f"{section}.profiler.ranks={profiler.ranks}: ranks are >= 0")
        bad = [c for c in profiler.tool_config.torch.contents if c not in TORCH_PROFILER_CONTENTS]
        if bad:  # verl's TorchProfilerToolConfig.__post_init__ asserts the same
            problems.append(f"{section}.profiler.tool_config.torch.contents: {bad} not among "
                            f"{list(TORCH_PROFILER_CONTENTS)}")
    if not profiling_on(config):
        return problems
    if config.actor_rollout_ref.rollout.profiler.enable:
        problems.append("actor_rollout_ref.rollout.profiler.enable=true: not built yet: megarl does not yet call the "
                        "SGLang servers' /start_profile and /stop_profile around a step's generation; profile the "
                        "training roles (actor, ref, critic) or leave global_profiler.steps empty")
    for role, profiler in role_profilers(config).items():
        tool = profiler.tool_config.torch if g.tool == "torch" else profiler.tool_config.nsys
        if profiler.enable and g.tool in ("torch", "nsys") and tool.discrete:
            problems.append(f"{TRAINING_ROLE_SECTIONS[role]}.profiler.tool_config.{g.tool}.discrete=true: not built "
                            "yet: megarl records one trace per profiled step and rank (discrete=false)")
    return problems


def profiler_device_problem(config: ExperimentConfig, device: str) -> Optional[str]:
    """Why the profiling the config asks for cannot run on `device` ("cuda" or "cpu"), or None.
    - nsys: Nsight Systems captures between cudaProfilerStart/Stop (torch.cuda.profiler.start/stop,
      PyTorch docs torch.cuda.profiler; verl's worker_nsight_options capture-range=cudaProfilerApi):
      CUDA only, and not built yet on CUDA either (megarl does not start its workers under nsys).
    - torch_memory: torch.cuda.memory._record_memory_history records the CUDA caching allocator
      (PyTorch docs, "Understanding CUDA Memory Usage"): CUDA only; not built yet on CUDA.
    - torch: runs on both; `contents` naming cuda needs CUDA (torch.profiler.ProfilerActivity.CUDA)."""
    if not profiling_on(config):
        return None
    tool = config.global_profiler.tool
    if tool in ("nsys", "torch_memory"):
        if device == "cpu":
            what = ("Nsight Systems captures CUDA work between cudaProfilerStart/Stop" if tool == "nsys" else
                    "torch.cuda.memory._record_memory_history records the CUDA caching allocator")
            return f"global_profiler.tool={tool} with trainer.device=cpu: {what}; a CPU has none (use tool=torch)"
        return (f"global_profiler.tool={tool}: not built yet in megarl (its training workers are not started under "
                f"{'nsys profile --capture-range=cudaProfilerApi' if tool == 'nsys' else 'a memory recorder'}); "
                "use tool=torch")
    if tool == "torch" and device == "cpu":
        for role, profiler in role_profilers(config).items():
            if profiler.enable and "cuda" in profiler.tool_config.torch.contents:
                return (f"{TRAINING_ROLE_SECTIONS[role]}.profiler.tool_config.torch.contents names cuda with "
                        "trainer.device=cpu: torch.profiler's CUDA activity needs a CUDA device")
    return None
