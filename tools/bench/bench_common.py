"""What every benchmark in tools/bench shares: the machine's description, load averages, a short
table on stdout and the JSON result under outputs/bench/.

Each script is run as `python tools/bench/<name>.py`, which puts this folder on sys.path.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "outputs" / "bench"


def load_average() -> dict:
    """1, 5 and 15-minute load averages (runnable processes; 2.0 saturates a 2-core machine)."""
    one, five, fifteen = os.getloadavg()
    return {"1m": one, "5m": five, "15m": fifteen, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def machine() -> dict:
    """CPU model, logical CPUs, RAM (GiB) and the versions that matter for the figures."""
    model = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info = {"cpu_model": model, "nproc": os.cpu_count(), "ram_gib": round(ram_gib, 1),
            "python": platform.python_version(), "platform": platform.platform()}
    for name in ("torch", "transformers", "megatron.core", "trl"):
        module = sys.modules.get(name)
        if module is not None:
            info[name] = getattr(module, "__version__", "?")
    return info


def spread(values: list[float]) -> dict:
    """mean, min and max of repeated measurements (None for each when there are none)."""
    if not values:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}


def by_group(runs: list[dict], group: str, keys: tuple[str, ...]) -> list[dict]:
    """One row per value of `group` (in first-seen order), over its runs: each of `keys` as the
    `spread` of the runs that have it: `key` (mean), `key_min`, `key_max`; and `runs`, their count."""
    rows = []
    for value in dict.fromkeys(r[group] for r in runs):
        mine = [r for r in runs if r[group] == value]
        row = {group: value, "runs": len(mine)}
        for key in keys:
            s = spread([r[key] for r in mine if r.get(key) is not None])
            row.update({key: s["mean"], f"{key}_min": s["min"], f"{key}_max": s["max"]})
        rows.append(row)
    return rows


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec such as '.3f'); missing values print as '-'."""
    widths = [max(len(header), 10) for _, header, _ in columns]
    print("  ".join(f"{header:>{w}}" for (_, header, _), w in zip(columns, widths)))
    for row in rows:
        cells = []
        for (key, _, spec), w in zip(columns, widths):
            value = row.get(key)
            cells.append(f"{'-' if value is None else format(value, spec):>{w}}")
        print("  ".join(cells))


def write_result(name: str, result: dict, out_dir: Path | None = None) -> Path:
    """Write {"benchmark": name, "machine": ..., **result} to <out_dir>/<name>.json; return the path."""
    out = Path(out_dir or DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    payload = {"benchmark": name, "command": " ".join([Path(sys.executable).name, *sys.argv]),
               "machine": machine(), **result}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"result: {path}")
    return path
