"""Resolve the CPU test set of one tested line, or the benchmark environment's additions, and write
it as a lock: what `make install`, `make install-py312` and tools/bench/setup_bench_env.sh install.

    python tools/lock_cpu.py --python .venv/bin/python            # requirements/cpu-py311.lock
    python tools/lock_cpu.py --python .venv312/bin/python         # requirements/cpu-py312.lock
    python tools/lock_cpu.py --python .venv/bin/python --bench    # requirements/bench-py311.lock
    python tools/lock_cpu.py --python .venv/bin/python --sglang   # requirements/sglang-cpu-py311.lock
    make lock        # all four, and the GPU locks (tools/lock_gpu.py)

Runs `<python> -m pip install --dry-run --ignore-installed --report` on this checkout, so pip
resolves for that interpreter and installs nothing. Unlike tools/lock_gpu.py it keeps this
machine's pip configuration: `torch==2.13.0` is then the build the configured indexes offer (the
CPU build where a CPU index or wheel folder is configured; PyPI's CUDA build otherwise, which runs
on the CPU too, and is what Python 3.12 gets). A lock lists every distribution but megarl and pip,
`name==version`, sorted, without local version labels: `torch==2.13.0` admits `2.13.0+cpu`
(PEP 440), so one lock installs with either index.

CPU set: setup.py's `test` extra and TORCH; on Python 3.11, the line developers and the benchmarks
work on, also its `dev` extra (py-spy, ruff). Bench set: what `trl` adds on top of the Python 3.11
CPU lock (.venv-bench shares .venv's packages; accelerate is in the CPU lock already, peft needs it).
SGLang set: real SGLang 0.5.23 serving on the CPU (.venv-sglang, `make install-sglang`; docs/sglang-on-cpu.md):
SGLANG_NO_DEPS without their own requirements (SGLang's pull CUDA torch 2.14.1, flashinfer, deep-gemm and
the nvidia-* wheels), and with theirs resolved, TORCH (the CPU build) and SGLANG_CPU_RUNTIME: what SGLang
imports when it serves a dense model on the CPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name as canonical

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the tested torch of both lines (README "Tested versions")
EXTRAS = {"3.11": "test,dev", "3.12": "test"}
BENCH_PYTHON = "3.11"  # the benchmarks' line (docs/benchmarks.md)
BENCH_REQUIREMENTS = ["trl"]  # the newest TRL that fits the CPU lock; its datasets come with it
SGLANG_PYTHON = "3.11"  # the line whose suite starts real SGLang servers (line 1)
SGLANG_NO_DEPS = ["sglang==0.5.23", "compressed-tensors==0.18.0"]
# SGLang 0.5.23's own requirements (its METADATA) that it imports on the CPU path, pinned as it pins them,
# plus what it imports without declaring (triton, torchvision, dill, loguru, jsonschema); python-dateutil<3 as
# it asks. torchvision comes as PyPI's CUDA build (rollout/cpu/sglang_site/sitecustomize.py explains).
SGLANG_CPU_RUNTIME = [
    "aiohttp", "anthropic", "apache-tvm-ffi==0.1.11", "blobfile==3.0.0", "distro", "einops", "fastapi", "gguf",
    "interegular", "IPython", "llguidance>=1.7.6,<2", "msgspec", "numpy", "openai==2.8.0", "openai-harmony==0.0.4",
    "orjson", "packaging", "partial_json_parser", "pillow", "prometheus-client>=0.20.0", "psutil", "pybase64",
    "pydantic", "python-dateutil<3", "python-multipart", "pyzmq>=25.1.2", "regex", "requests", "safetensors", "scipy",
    "sentencepiece==0.2.1", "setproctitle", "soundfile==0.13.1", "tiktoken", "tokenizers==0.23.2", "tqdm",
    "transformers==5.19.0", "uvicorn>=0.51", "uvloop", "watchfiles", "xgrammar==0.2.7", "xxhash", "zstandard",
    "triton", "torchvision", "dill", "loguru", "jsonschema", "huggingface_hub",
]
LEFT_OUT = {"megarl", "pip"}  # megarl installs editable (--no-deps); `make install` upgrades pip first


def python_version(python: str) -> str:
    """'3.11' for a Python 3.11 interpreter."""
    return subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def resolve(python: str, requirements: list[str], timeout_s: float) -> dict[str, str]:
    """{canonical name: version} that `pip install <requirements>` would install into an empty
    environment of `python`, local version labels dropped, LEFT_OUT left out."""
    with tempfile.TemporaryDirectory(prefix="megarl-lock-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [python, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
               "--report", str(report), *requirements]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        if result.returncode != 0:
            raise SystemExit(f"pip could not resolve {' '.join(requirements)} for {python}:\n{result.stderr[-4000:]}")
        installs = json.loads(report.read_text())["install"]
    pins = {canonical(i["metadata"]["name"]): i["metadata"]["version"].split("+")[0] for i in installs}
    return {name: version for name, version in sorted(pins.items()) if name not in LEFT_OUT}


def read_lock(path: Path) -> dict[str, str]:
    """{canonical name: version} of a lock's `name==version` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonical(name)] = version
    return pins


def lock_text(header: list[str], pins: dict[str, str]) -> str:
    return "\n".join([f"# {line}" for line in header] + [f"{n}=={v}" for n, v in pins.items()]) + "\n"


def cpu_lock(python: str, timeout_s: float) -> tuple[Path, str]:
    minor = python_version(python)
    if minor not in EXTRAS:
        raise SystemExit(f"{python} is Python {minor}; the tested lines are {', '.join(EXTRAS)}")
    extras, name = EXTRAS[minor], f"cpu-py{minor.replace('.', '')}.lock"
    pins = resolve(python, ["-e", f".[{extras}]", TORCH], timeout_s)
    header = [
        f"megarl's CPU test install (pip install -e '.[{extras}]' {TORCH}), Python {minor}, Linux x86_64.",
        "Generated by `make lock` (tools/lock_cpu.py); do not edit by hand. `make install` installs it:",
        f"pip install -r requirements/{name} && pip install --no-deps -e .",
    ]
    return ROOT / "requirements" / name, lock_text(header, pins)


def bench_lock(python: str, timeout_s: float) -> tuple[Path, str]:
    minor = python_version(python)
    if minor != BENCH_PYTHON:
        raise SystemExit(f"{python} is Python {minor}; the benchmark environment is Python {BENCH_PYTHON}'s")
    cpu_path = ROOT / "requirements" / f"cpu-py{minor.replace('.', '')}.lock"
    cpu = read_lock(cpu_path)
    # the CPU lock as requirements pins every shared package; the bench lock is what comes on top
    resolved = resolve(python, ["-r", str(cpu_path), "-e", ".", *BENCH_REQUIREMENTS], timeout_s)
    pins = {n: v for n, v in resolved.items() if n not in cpu}
    name = f"bench-py{minor.replace('.', '')}.lock"
    header = [
        f"What the benchmark environment (.venv-bench) adds to requirements/{cpu_path.name}: "
        f"{', '.join(BENCH_REQUIREMENTS)} with what it needs (accelerate is in the CPU lock: peft needs it).",
        f"Python {minor}, Linux x86_64. Generated by `make lock` (tools/lock_cpu.py --bench); do not edit by hand.",
        f"tools/bench/setup_bench_env.sh installs it: pip install --no-deps -r requirements/{name}",
    ]
    return ROOT / "requirements" / name, lock_text(header, pins)


def sglang_lock(python: str, timeout_s: float) -> tuple[Path, str]:
    minor = python_version(python)
    if minor != SGLANG_PYTHON:
        raise SystemExit(f"{python} is Python {minor}; real SGLang on the CPU is tested on Python {SGLANG_PYTHON}")
    pins = resolve(python, [TORCH, *SGLANG_CPU_RUNTIME], timeout_s)
    pins.update({canonical(r.split("==")[0]): r.split("==")[1] for r in SGLANG_NO_DEPS})
    name = f"sglang-cpu-py{minor.replace('.', '')}.lock"
    header = [
        f"Real SGLang serving on the CPU (.venv-sglang): {', '.join(SGLANG_NO_DEPS)} without their requirements, "
        f"{TORCH} (the CPU build) and what SGLang imports on the CPU.",
        f"Python {minor}, Linux x86_64. Generated by `make lock` (tools/lock_cpu.py --sglang); do not edit by hand.",
        f"`make install-sglang` installs it: pip install --no-deps -r requirements/{name}",
    ]
    return ROOT / "requirements" / name, lock_text(header, dict(sorted(pins.items())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter to resolve for")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--bench", action="store_true", help="the benchmark environment's lock, not the CPU test lock")
    kind.add_argument("--sglang", action="store_true", help="real SGLang on the CPU's lock, not the CPU test lock")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for pip (default 1800)")
    args = parser.parse_args(argv)
    make = bench_lock if args.bench else sglang_lock if args.sglang else cpu_lock
    path, text = make(args.python, args.timeout)
    path.write_text(text)
    print(f"{path.relative_to(ROOT)}: {len(read_lock(path))} distributions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
