"""Reading verl-format parquet files into validated rows. No torch here.

verl's columns, one row per prompt:

    data_source   str                               which reward function scores the row
    prompt        list of {role: str, content: str}  the chat; or a plain string (a single user turn)
    ability       str                               optional, e.g. "math"
    reward_model  {style: str, ground_truth: ...}   ground_truth may be null only when style == "model"
    extra_info    dict                              optional, passed to the reward function

Files written by pandas, pyarrow or HF `datasets` load unchanged. Every problem in every file is
collected and raised at once as one DataError naming file, row and column.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.data.errors import DataError

@dataclass(frozen=True)
class PromptRow:
    """One validated row. `file` and `row` locate it for later error messages."""

    messages: list[dict[str, Any]]  # chat messages; a plain-text prompt becomes one user message
    data_source: str
    reward_model: dict[str, Any]
    ability: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    response: Optional[str] = None  # SFT data: the reference response
    file: str = ""
    row: int = 0

    @property
    def ground_truth(self) -> Any:
        return self.reward_model.get("ground_truth")


# --------------------------------------------------------------------------------------------
# Per-value checks: each returns (converted value, problem or None).
# --------------------------------------------------------------------------------------------
def _as_dict(value) -> Optional[dict]:
    """A struct reads back as a dict, a parquet map as a list of (key, value) pairs."""
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
        return dict(value)
    return None


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _check_prompt(value):
    if isinstance(value, str):
        if not value:
            return None, "empty prompt string"
        return [{"role": "user", "content": value}], None
    if not isinstance(value, list) or not value:
        return None, f"expected a non-empty list of {{role, content}} chat messages or a string, got {_describe(value)}"
    messages = []
    for k, raw in enumerate(value):
        message = _as_dict(raw)
        if message is None:
            return None, f"message {k}: expected a {{role, content}} dict, got {_describe(raw)}"
        message = {key: v for key, v in message.items() if v is not None}  # parquet structs fill absent keys with null
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return None, f"message {k}: '{key}' must be a string, got {_describe(message.get(key))}"
        messages.append(message)
    return messages, None


def _check_string(value):
    if not isinstance(value, str) or not value:
        return None, f"expected a non-empty string, got {_describe(value)}"
    return value, None


def _check_optional_string(value):
    if value is None:
        return "", None
    if not isinstance(value, str):
        return None, f"expected a string, got {_describe(value)}"
    return value, None


def _check_optional_dict(value):
    if value is None:
        return {}, None
    as_dict = _as_dict(value)
    if as_dict is None:
        return None, f"expected a dict, got {_describe(value)}"
    return as_dict, None


def _check_reward_model(value):
    as_dict = _as_dict(value)
    if as_dict is None:
        return None, f"expected a {{style, ground_truth}} dict, got {_describe(value)}"
    if as_dict.get("ground_truth") is None and as_dict.get("style") != "model":
        return None, "'ground_truth' is missing or null (allowed only when style is 'model')"
    return as_dict, None


_Check = Callable[[Any], tuple[Any, Optional[str]]]


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------
def _open(path: Path) -> pq.ParquetFile:
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file ({exc})") from None


def read_rows(
    files: Sequence[str | Path] | str | Path,
    *,
    prompt_key: str = "prompt",
    reward_fn_key: str = "data_source",
    response_key: Optional[str] = None,
    limit: Optional[int] = None,
    chats: bool = False,
) -> list[PromptRow]:
    """All rows of `files` in order (the first `limit` rows of each file when given: a quick check), validated.

    RL data (response_key None) needs columns `prompt_key`, `reward_fn_key` and `reward_model`;
    SFT data needs `prompt_key` and `response_key` (a string column), or with `chats` (SFT chats,
    verl's messages column) `prompt_key` alone. `ability` and `extra_info` are read when present.
    Raises DataError listing every bad file, column and row.
    """
    if isinstance(files, (str, Path)):
        files = [files]
    if not files:
        raise DataError("no data files given")
    checks: dict[str, _Check] = {prompt_key: _check_prompt}
    if response_key is None and not chats:
        checks.update({reward_fn_key: _check_string, "reward_model": _check_reward_model})
    elif response_key is not None:
        checks[response_key] = _check_string
    required = list(checks)
    optional: dict[str, _Check] = {
        reward_fn_key: _check_string,
        "reward_model": _check_optional_dict,
        "ability": _check_optional_string,
        "extra_info": _check_optional_dict,
    }

    rows: list[PromptRow] = []
    problems: list[str] = []
    for file in files:
        path = Path(file)
        try:
            parquet = _open(path)
        except DataError as exc:
            problems.append(str(exc))
            continue
        present = parquet.schema_arrow.names
        if parquet.metadata.num_rows == 0:
            problems.append(f"{path}: the file has no rows")
            continue
        missing = [c for c in required if c not in present]
        if missing:
            problems.append(
                f"{path}: missing column(s) {', '.join(repr(c) for c in missing)} (every row); "
                f"columns present: {', '.join(present)}"
            )
            continue
        columns = {name: check for name, check in optional.items() if name in present}
        columns.update(checks)
        try:
            if limit is None:
                table = parquet.read(columns=list(columns))
            else:
                table = pa.Table.from_batches([next(parquet.iter_batches(batch_size=limit, columns=list(columns)))])
        except (pa.ArrowException, OSError) as exc:
            problems.append(f"{path}: cannot read columns {list(columns)} ({exc})")
            continue
        values: dict[str, list] = {}
        file_ok = True
        for name, check in columns.items():
            converted, bad_rows, first_problem = [], [], None
            for i, raw in enumerate(table.column(name).to_pylist()):
                value, problem = check(raw)
                converted.append(value)
                if problem:
                    bad_rows.append(i)
                    first_problem = first_problem or f"{path}: row {i}, column '{name}': {problem}"
            if bad_rows:
                file_ok = False
                if len(bad_rows) > 1:
                    listed = ", ".join(map(str, bad_rows[:10])) + (", ..." if len(bad_rows) > 10 else "")
                    first_problem += f" ({len(bad_rows)} bad rows in this column: {listed})"
                problems.append(first_problem)
            values[name] = converted
        if not file_ok:
            continue
        for i in range(table.num_rows):
            rows.append(
                PromptRow(
                    messages=values[prompt_key][i],
                    data_source=values[reward_fn_key][i] if reward_fn_key in values else "",
                    reward_model=values["reward_model"][i] if "reward_model" in values else {},
                    ability=values["ability"][i] if "ability" in values else "",
                    extra_info=values["extra_info"][i] if "extra_info" in values else {},
                    response=values[response_key][i] if response_key else None,
                    file=str(path),
                    row=i,
                )
            )
    if problems:
        raise DataError("unusable data:\n" + "\n".join(f"  - {p}" for p in problems))
    return rows


def write_splits(out_dir: str | Path, splits: dict[str, list[dict]]) -> dict[str, Path]:
    """Write each split's rows (verl rows) to `<out_dir>/<split>.parquet`; {split: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in splits.items():
        paths[name] = out / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[name])
    return paths
