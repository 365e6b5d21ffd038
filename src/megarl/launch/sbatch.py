"""`megarl submit`: render slurm/megarl.sbatch for one experiment, sized from its config, and
submit it. The allocation is trainer.nnodes nodes x trainer.n_gpus_per_node GPUs by construction;
a different --nodes / --gpus-per-node, or an sbatch argument that sizes the job, is an error
before anything is queued.

The rendered script is the template with the #SBATCH lines megarl submit sets replaced (the
template has one option per #SBATCH line), plus two shell lines: the Python that rendered it (so
the job finds megarl from any directory) and the experiment arguments (used when sbatch is given
none), with `trainer.device=cuda` where the config leaves the device to `auto` (`device_overrides`).
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megarl.config import ConfigError, ExperimentConfig
from megarl.placement import plan_from_config

# Options megarl submit sets, with their short forms.
ALIASES = {"-J": "--job-name", "-N": "--nodes", "-t": "--time", "-p": "--partition", "-A": "--account",
           "-o": "--output", "-D": "--chdir"}
# sbatch arguments that would size the job behind the config's back.
SIZING = ("--nodes", "-N", "--gpus-per-node", "--gres", "--gpus", "-G", "--gpus-per-task", "--ntasks", "-n",
          "--ntasks-per-node")
_SBATCH_LINE = re.compile(r"^#SBATCH\s+(--[A-Za-z-]+|-[A-Za-z])")


def default_template() -> Path:
    """The sbatch template, shipped as package data beside this module (setup.py package_data),
    so an installed megarl finds it as an editable one does; slurm/megarl.sbatch of a checkout is a
    link to it."""
    return Path(__file__).resolve().with_name("megarl.sbatch")


@dataclass(frozen=True)
class SbatchOptions:
    """The #SBATCH options megarl submit sets (long names, no leading dashes -> value; None for a
    flag), and sbatch arguments passed through."""

    options: dict[str, str | None]
    extra: tuple[str, ...] = ()


def sbatch_options(config: ExperimentConfig, *, output: str, chdir: str, time: str | None = None,
                   partition: str | None = None, account: str | None = None, job_name: str | None = None,
                   requeue: bool | None = None, nodes: int | None = None, gpus_per_node: int | None = None,
                   extra: tuple[str, ...] = ()) -> SbatchOptions:
    """Options for this experiment; ConfigError when a size given here contradicts the config."""
    t = config.trainer
    problems = []
    if nodes is not None and nodes != t.nnodes:
        problems.append(f"--nodes={nodes} but trainer.nnodes={t.nnodes}: set trainer.nnodes={nodes} instead")
    if gpus_per_node is not None and gpus_per_node != t.n_gpus_per_node:
        problems.append(f"--gpus-per-node={gpus_per_node} but trainer.n_gpus_per_node={t.n_gpus_per_node}: set "
                        f"trainer.n_gpus_per_node={gpus_per_node} instead")
    for arg in extra:
        name = re.split(r"[=\s]", arg, maxsplit=1)[0]
        if name in SIZING or name[:2] in SIZING:  # also -N2, -n4
            problems.append(f"sbatch argument {arg!r} sizes the job: megarl submit takes the size from "
                            "trainer.nnodes and trainer.n_gpus_per_node")
    if problems:
        raise ConfigError("the allocation would not match the config:\n" + "\n".join(f"  - {p}" for p in problems))
    options: dict[str, str | None] = {
        "job-name": job_name or t.experiment_name,
        "nodes": str(t.nnodes),
        "gpus-per-node": str(t.n_gpus_per_node),
        "output": output,
        "chdir": chdir,
    }
    for key, value in (("time", time), ("partition", partition), ("account", account)):
        if value:
            options[key] = value
    if requeue is not None:
        options["requeue" if requeue else "no-requeue"] = None
    return SbatchOptions(options, tuple(extra))


def slurm_seconds(text: str) -> int | None:
    """A Slurm time (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds; None for UNLIMITED/INFINITE."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    days, has_days, rest = text.partition("-") if "-" in text else ("0", "", text)
    try:
        parts = [int(p) for p in rest.split(":")]
        if has_days:
            hours, minutes, seconds = (parts + [0, 0])[:3]
        else:
            hours, minutes, seconds = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    except (ValueError, KeyError):
        raise ConfigError(f"--time={text}: not a Slurm time (minutes, H:M:S, D-H:M:S)") from None


def _check_warning_fits(lines: list[str]) -> None:
    """The time-limit warning (#SBATCH --signal=...@LEAD) must come after the job starts, or the
    experiment would be told to checkpoint and stop at once. `lines`: the rendered script."""
    values = {}
    for line in lines:
        m = re.match(r"^#SBATCH\s+(--time|-t|--signal)[=\s]+(\S+)", line)
        if m:
            values[ALIASES.get(m.group(1), m.group(1))] = m.group(2)
    if "--time" not in values or "@" not in values.get("--signal", ""):
        return
    limit, lead = slurm_seconds(values["--time"]), int(values["--signal"].rsplit("@", 1)[1])
    if limit is not None and limit <= lead + 60:
        raise ConfigError(f"--time={values['--time']} is not longer than the time-limit warning "
                          f"(#SBATCH --signal={values['--signal']}, {lead} s before the end, and Slurm may send it "
                          f"up to 60 s early): give a longer --time or edit that line of the script")


def _sbatch_line(name: str, value: str | None) -> str:
    return f"#SBATCH --{name}" + ("" if value is None else f"={value}")


def render_sbatch(template: str, options: SbatchOptions, python: str, experiment_args: list[str],
                  source: str = "slurm/megarl.sbatch") -> str:
    """The template with `options` as its #SBATCH lines and the experiment baked in."""
    lines = template.splitlines()
    sbatch = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    if not sbatch:
        raise ConfigError(f"{source}: no #SBATCH lines: not an sbatch script")
    replaced = {f"--{k}" for k in options.options}
    if replaced & {"--requeue", "--no-requeue"}:
        replaced |= {"--requeue", "--no-requeue"}

    def is_replaced(line: str) -> bool:
        m = _SBATCH_LINE.match(line)
        return bool(m) and ALIASES.get(m.group(1), m.group(1)) in replaced

    head = [_sbatch_line(k, v) for k, v in options.options.items()] + [f"#SBATCH {a}" for a in options.extra]
    baked = [
        f"# Added by megarl submit (from {source}):",
        "# the Python to use, and the experiment when sbatch is given no arguments.",
        f': "${{MEGARL_PYTHON:={python}}}"',
        f"[ $# -gt 0 ] || set -- {shlex.join(experiment_args)}",
    ]
    out = []
    for i, line in enumerate(lines):
        if i == sbatch[0]:
            out += head
        if not is_replaced(line):
            out.append(line)
        if i == sbatch[-1]:
            out += baked
    _check_warning_fits(out)
    return "\n".join(out) + "\n"


def device_overrides(device: str) -> list[str]:
    """What the job adds to the experiment's overrides for `trainer.device` (`device`):
    `trainer.device=cuda` where the config leaves it to `auto`, nothing where it names one.

    `auto` is decided by the controller (megarl.config.devices.auto_device_refusal), which here is
    the batch step on the job's first node, and a batch step may be given none of the job's GPUs
    (a site's gres/cgroup settings, or --gpus rather than --gpus-per-node): the job asks Slurm for
    GPUs (--gpus-per-node=trainer.n_gpus_per_node), so it trains on them. A config that says `cpu`
    (a CPU cluster whose GPUs are Ray's logical ones) keeps it."""
    return ["trainer.device=cuda"] if device == "auto" else []


def write_script(config: ExperimentConfig, config_file: str | None, overrides: list[str], *, log_dir: str,
                 template: str | None = None, **sizes_and_limits) -> tuple[Path, str]:
    """Render the template for this experiment into <log_dir>/<job name>.sbatch; returns the
    script's path and the job's output path (with %j for the job id). `sizes_and_limits` are
    sbatch_options' keyword arguments. Raises ConfigError before writing anything."""
    plan_from_config(config)  # an impossible layout fails here, not after waiting in the queue
    out_dir = Path(log_dir).resolve()
    options = sbatch_options(config, output=str(out_dir / "%x-%j.out"), chdir=str(Path.cwd()), **sizes_and_limits)
    source = Path(template) if template else default_template()
    if not source.is_file():
        raise ConfigError(f"sbatch template not found: {source} (pass --script path/to/megarl.sbatch)")
    experiment = ((["--config", str(Path(config_file).resolve())] if config_file else []) + list(overrides)
                  + device_overrides(config.trainer.device))
    text = render_sbatch(source.read_text(), options, python=sys.executable, experiment_args=experiment,
                         source=str(source))
    out_dir.mkdir(parents=True, exist_ok=True)
    job_name = options.options["job-name"]
    script = out_dir / f"{job_name}.sbatch"
    script.write_text(text)
    return script, str(out_dir / f"{job_name}-%j.out")


def submit(script: Path) -> str:
    """sbatch the script; returns the job id."""
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ConfigError(f"sbatch not found: run megarl submit on a Slurm login node (script: {script})") from None
    if done.returncode != 0:
        raise ConfigError(f"sbatch rejected {script}:\n{done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]
