"""`megarl doctor`: what is installed, and whether that combination is one megarl can run.

It prints the versions of Python, torch (with its CUDA and NCCL), megatron-core,
transformer-engine, SGLang, sglang-router, Ray and transformers, and the GPUs torch sees; then
one line per known-bad combination. The checks are pure functions of versions and package
metadata (tested case by case in tests/launch/test_doctor.py); `run_doctor` only gathers the facts.
Exit status 1 when a check fails, else 0.
"""
from __future__ import annotations

import importlib.metadata as metadata
import platform
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

# The tested lines (README "Tested versions", Makefile `test` and `test-py312`): Python 3.11 with
# megatron-core 0.16.1, Python 3.12 with megatron-core 0.19.x. setup.py bounds megatron-core to
# this range (tests/test_packaging.py holds them equal).
MEGATRON_CORE_TESTED = SpecifierSet(">=0.16.1,<0.20")
TESTED_PYTHONS = ("3.11", "3.12")

# distribution name -> what doctor prints it as
PACKAGES = {
    "torch": "torch",
    "megatron-core": "megatron-core",
    "transformer-engine": "transformer-engine",
    "transformer-engine-torch": "transformer-engine (torch)",
    "sglang": "sglang",
    "sglang-router": "sglang-router",
    "ray": "ray",
    "transformers": "transformers",
}
# whose declared requirements on the others are checked (`unmet_requirements`)
REQUIRERS = ("megatron-core", "sglang", "transformer-engine")


@dataclass(frozen=True)
class Facts:
    """What `run_doctor` found. `installed`: distribution name -> version (absent: not installed);
    `requires`: distribution name -> its Requires-Dist lines."""

    python: str  # e.g. "3.12.1"
    installed: Mapping[str, str]
    requires: Mapping[str, Sequence[str]] = field(default_factory=dict)
    cuda_available: bool = False
    torch_cuda: Optional[str] = None  # torch.version.cuda: the CUDA torch was built for
    nccl: Optional[str] = None
    gpus: Sequence[str] = ()
    verified_cpu_shims: Sequence[str] = ()  # megarl.engines.megatron.cpu.shims.VERIFIED_MEGATRON_CORE_VERSIONS
    gpu_config: Optional[str] = None  # why the given experiment config needs CUDA, if it does


def _requirements(lines: Sequence[str], extras: Sequence[str] = ("",)) -> list[Requirement]:
    """The requirements among `lines` that apply with the given extras ("" = a plain install),
    markers evaluated for this interpreter."""
    found = []
    for line in lines:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**default_environment(), "extra": e}) for e in extras):
            found.append(req)
    return found


def check_python(python: str) -> list[str]:
    minor = ".".join(python.split(".")[:2])
    if minor not in TESTED_PYTHONS:
        return [f"Python {python} is not a tested line ({', '.join(TESTED_PYTHONS)}); megatron-core's GPU wheels, "
                "SGLang and megarl's tests assume one of them"]
    return []


def check_megatron_core(version: Optional[str]) -> list[str]:
    if version is None:
        return ["megatron-core is not installed (pip install -e . installs it)"]
    if Version(version) not in MEGATRON_CORE_TESTED:
        return [f"megatron-core {version} is outside the tested range {MEGATRON_CORE_TESTED}: megarl overrides parts "
                "of it (engines/megatron/model.py, cpu.py); install a tested version"]
    return []


def transformer_engine_range(megatron_requires: Sequence[str]) -> SpecifierSet:
    """The transformer-engine versions megatron-core declares (in any of its extras): its own
    metadata is the authority. Empty (anything) when it declares no bound."""
    spec = SpecifierSet()
    for req in _requirements(megatron_requires, extras=("", "dev", "te", "lts", "mlm", "training")):
        if canonicalize_name(req.name) == "transformer-engine":
            spec &= req.specifier
    return spec


def check_transformer_engine(te_version: Optional[str], megatron_requires: Sequence[str]) -> list[str]:
    if te_version is None:
        return []
    allowed = transformer_engine_range(megatron_requires)
    if not allowed.contains(te_version, prereleases=True):
        return [f"transformer-engine {te_version} is outside what the installed megatron-core declares "
                f"({allowed}); install a version in that range"]
    return []


def unmet_requirements(requires: Mapping[str, Sequence[str]], installed: Mapping[str, str]) -> list[str]:
    """One message per requirement of a `REQUIRERS` package (plain install, no extras) on another
    installed package whose installed version it excludes, e.g. sglang 0.5.23 next to another torch."""
    names = {canonicalize_name(n): v for n, v in installed.items()}
    found = []
    for requirer in REQUIRERS:
        if requirer not in installed:
            continue
        for req in _requirements(requires.get(requirer, ())):
            have = names.get(canonicalize_name(req.name))
            if have is not None and not req.specifier.contains(have, prereleases=True):
                found.append(f"{requirer} {installed[requirer]} requires {req.name}{req.specifier}, "
                             f"but {req.name} {have} is installed")
    return found


def check_cuda(facts: Facts) -> list[str]:
    found = []
    if facts.gpu_config and not facts.cuda_available:
        why = "torch has no CUDA (a CPU build)" if facts.torch_cuda is None else \
            f"torch {facts.installed.get('torch')} (CUDA {facts.torch_cuda}) sees no GPU"
        found.append(f"the config needs CUDA ({facts.gpu_config}), but {why}")
    if not facts.cuda_available and facts.installed.get("megatron-core") and facts.verified_cpu_shims \
            and facts.installed["megatron-core"] not in facts.verified_cpu_shims:
        found.append(f"no CUDA, and megarl's CPU shims were verified on megatron-core "
                     f"{', '.join(facts.verified_cpu_shims)} only, not {facts.installed['megatron-core']}")
    return found


def problems(facts: Facts) -> list[str]:
    """Every known-bad combination in `facts`, one message each (empty: a tested combination)."""
    return [
        *check_python(facts.python),
        *check_megatron_core(facts.installed.get("megatron-core")),
        *check_transformer_engine(facts.installed.get("transformer-engine"), facts.requires.get("megatron-core", ())),
        *unmet_requirements(facts.requires, facts.installed),
        *check_cuda(facts),
    ]


def report(facts: Facts) -> str:
    """The printed versions, GPUs and problems."""
    lines = [f"{'python':<28}{facts.python}"]
    for dist, label in PACKAGES.items():
        version = facts.installed.get(dist, "not installed")
        if dist == "torch" and dist in facts.installed:
            version += f"  (CUDA {facts.torch_cuda or 'none: CPU build'}, NCCL {facts.nccl or 'none'})"
        lines.append(f"{label:<28}{version}")
    lines.append(f"{'GPUs':<28}{len(facts.gpus)}" + "".join(f"\n  {i}: {name}" for i, name in enumerate(facts.gpus)))
    found = problems(facts)
    lines += [f"WARNING: {p}" for p in found] or ["OK: a tested combination"]
    return "\n".join(lines)


def gather_facts(gpu_config: Optional[str] = None) -> Facts:
    """Facts of this interpreter (imports torch; megatron-core, SGLang and TE only through metadata)."""
    import torch

    from megarl.engines.megatron.cpu.shims import VERIFIED_MEGATRON_CORE_VERSIONS

    installed, requires = {}, {}
    for dist in PACKAGES:
        try:
            installed[dist] = metadata.version(dist)
            requires[dist] = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            pass
    if "torch" in installed:
        installed["torch"] = installed["torch"].split("+")[0]  # 2.13.0+cpu: the local tag is not a release
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    return Facts(platform.python_version(), installed, requires, cuda, torch.version.cuda, nccl, gpus,
                 VERIFIED_MEGATRON_CORE_VERSIONS, gpu_config)


def gpu_config_reason(config) -> Optional[str]:
    """The keys of an experiment config that need CUDA (None when it runs without): a CUDA device
    or SGLang rollout servers (GPU only; megarl.config.devices)."""
    needs = []
    if config.trainer.device == "cuda":
        needs.append("trainer.device=cuda")
    if config.actor_rollout_ref.rollout.name == "sglang":
        needs.append("actor_rollout_ref.rollout.name=sglang")
    return ", ".join(needs) or None


def run_doctor(config=None) -> int:
    """Print the report; 1 when it found a problem, else 0."""
    facts = gather_facts(gpu_config_reason(config) if config is not None else None)
    print(report(facts))
    return 1 if problems(facts) else 0
