"""One training rank's torch.profiler trace of one step (verl's `global_profiler.tool=torch`:
verl/utils/profiler/torch_profile.py get_torch_profiler): started before the step's first call on
the rank, stopped after its last, written as a gzipped Chrome trace (torch.profiler's
`export_chrome_trace`, which chrome://tracing, Perfetto and TensorBoard's profiler plugin read) to
`<global_profiler.save_path>/<role>_step<step>_rank<rank>-of-<world size>.json.gz`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from megarl.config.profiler import profiled_rank, role_profilers, torch_activities


def trace_path(save_path: str, role: str, step: int, rank: int, world_size: int) -> Path:
    """Where a rank's trace of a step goes (verl's build_trace_basename's role, step and rank parts)."""
    return Path(save_path) / f"{role}_step{step}_rank{rank}-of-{world_size}.json.gz"


class StepTrace:
    """A role rank's torch.profiler over the profiled steps; does nothing on a rank not selected."""

    def __init__(self, config, role: str, rank: int, world_size: int, on_cuda: bool):
        profiler = role_profilers(config).get(role)
        self.on = (config.global_profiler.tool == "torch" and profiler is not None
                   and profiled_rank(profiler, rank))
        self.save_path, self.role, self.rank, self.world_size = config.global_profiler.save_path, role, rank, world_size
        self.contents = profiler.tool_config.torch.contents if profiler is not None else []
        self.on_cuda = on_cuda
        self.profile: Optional[torch.profiler.profile] = None
        self.step = 0

    def start(self, step: int) -> None:
        """Begin recording step `step` (verl's DistProfiler.start)."""
        if not self.on:
            return
        if self.profile is not None:
            raise RuntimeError(f"{self.role} rank {self.rank}: step {step}'s trace started while step {self.step}'s runs")
        activity = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
        contents = set(self.contents)  # verl's get_torch_profiler: the other contents map to these flags
        self.profile = torch.profiler.profile(
            activities=[activity[a] for a in torch_activities(self.contents, self.on_cuda)],
            record_shapes="shapes" in contents, profile_memory="memory" in contents, with_stack="stack" in contents)
        self.profile.start()
        self.step = step

    def stop(self) -> Optional[str]:
        """End the step's recording and write its trace; the file's path, or None on a rank not profiled."""
        if self.profile is None:
            return None
        profile, self.profile = self.profile, None
        profile.stop()
        path = trace_path(self.save_path, self.role, self.step, self.rank, self.world_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(path))
        return str(path)
