"""Preference pairs for DPO: verl parquet rows with a chosen and a rejected response, tokenised.

    dataset = PreferenceDataset.from_config(config.data, tokenizer, split="train")
    batch = pairs_to_batch(dataset.take([0, 1]))   # rows: chosen 0, rejected 0, chosen 1, rejected 1

Columns: `data.prompt_key` (chat messages or a string, as for RL and SFT data), `data.chosen_key`
and `data.rejected_key` (non-empty strings); `data_source`, `ability`, `reward_model` and
`extra_info` are read when present. Prompts are rendered with the chat template and limited to
`data.max_prompt_length` tokens; each response gets the eos token and is limited to
`data.max_response_length` tokens. Overlong pairs are dropped with data.filter_overlong_prompts,
else truncated (prompts per data.truncation, responses on the right) or refused
(data.truncation=error). Every error names the file, the row and the column.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.data.batch import Batch
from megarl.data.errors import DataError
from megarl.data.parquet import PromptRow, read_rows
from megarl.data.prompts import Truncation, encode_responses, fit_lengths, render_chats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreferencePair:
    index: int  # position in the dataset, after overlong pairs were filtered out
    prompt_ids: list[int]  # the prompt as the model sees it (chat template applied)
    chosen_ids: list[int]  # the preferred response followed by eos
    rejected_ids: list[int]  # the dispreferred response followed by eos
    row: PromptRow  # the parquet row (its `response` is the chosen text), file and row number


def _files(files) -> list[Path]:
    files = [files] if isinstance(files, (str, Path)) else list(files)
    if not files:
        raise DataError("no preference data files given")
    return [Path(f) for f in files]


def _check_columns(files: list[Path], columns: Sequence[str]) -> None:
    """Every readable file has every column (unreadable files are left to read_rows to report)."""
    problems = []
    for path in files:
        try:
            present = pq.read_schema(path).names
        except (pa.ArrowException, OSError):
            continue
        missing = [c for c in columns if c not in present]
        if missing:
            problems.append(f"{path}: missing column(s) {', '.join(repr(c) for c in missing)} (every row); "
                            f"columns present: {', '.join(present)}")
    if problems:
        raise DataError("unusable preference data:\n" + "\n".join(f"  - {p}" for p in problems))


def _read_responses(files: list[Path], column: str) -> list[str]:
    """The non-empty strings of `column` in every file, in order; DataError lists the bad rows."""
    values, problems = [], []
    for path in files:
        for i, value in enumerate(pq.read_table(path, columns=[column]).column(column).to_pylist()):
            if not isinstance(value, str) or not value:
                problems.append(f"{path}: row {i}, column '{column}': expected a non-empty response string, "
                                f"got {type(value).__name__} {value!r:.60}")
            values.append(value)
    if problems:
        shown = problems[:10] + ([f"... ({len(problems)} bad rows in all)"] if len(problems) > 10 else [])
        raise DataError("unusable preference data:\n" + "\n".join(f"  - {p}" for p in shown))
    return values


def _fit_responses(ids, rows, column: str, max_length: int, filter_overlong: bool, truncation: Truncation):
    try:
        return fit_lengths(ids, rows, max_length, filter_overlong=filter_overlong,
                           truncation="error" if truncation == "error" else "right", what="data.max_response_length")
    except DataError as exc:
        raise DataError(f"column '{column}': {exc}") from None


class PreferenceDataset:
    """Validated, tokenised preference pairs of one or more parquet files, in file order."""

    def __init__(
        self,
        files: Sequence[str | Path] | str | Path,
        tokenizer,
        *,
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        reward_fn_key: str = "data_source",
        max_prompt_length: int = 512,
        max_response_length: int = 512,
        filter_overlong_prompts: bool = True,
        truncation: Truncation = "error",
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    ):
        paths = _files(files)
        _check_columns(paths, [prompt_key, chosen_key, rejected_key])
        rows = read_rows(paths, prompt_key=prompt_key, reward_fn_key=reward_fn_key, response_key=chosen_key)
        rejected = _read_responses(paths, rejected_key)
        num_read = len(rows)
        same = [r for r, text in zip(rows, rejected) if r.response == text]
        if same:
            logger.warning("%d of %d pairs have identical chosen and rejected responses (first: %s row %d); "
                           "they add nothing to the DPO loss", len(same), num_read, same[0].file, same[0].row)

        prompts = render_chats(tokenizer, [r.messages for r in rows], chat_template_kwargs)
        kept, prompts = fit_lengths(prompts, rows, max_prompt_length, filter_overlong=filter_overlong_prompts,
                                    truncation=truncation, what="data.max_prompt_length")
        rows, rejected = [rows[i] for i in kept], [rejected[i] for i in kept]
        chosen_ids = encode_responses(tokenizer, [r.response for r in rows])
        rejected_ids = encode_responses(tokenizer, rejected)
        kept_chosen, chosen_ids = _fit_responses(chosen_ids, rows, chosen_key, max_response_length,
                                                 filter_overlong_prompts, truncation)
        kept_rejected, rejected_ids = _fit_responses(rejected_ids, rows, rejected_key, max_response_length,
                                                     filter_overlong_prompts, truncation)
        chosen_of, rejected_of = dict(zip(kept_chosen, chosen_ids)), dict(zip(kept_rejected, rejected_ids))
        both = [i for i in range(len(rows)) if i in chosen_of and i in rejected_of]
        if not both:
            raise DataError(f"no pairs of {', '.join(map(str, paths))} are within the length limits "
                            f"(data.max_prompt_length={max_prompt_length}, "
                            f"data.max_response_length={max_response_length})")
        self.num_filtered = num_read - len(both)  # pairs dropped as overlong
        self._pairs = [
            PreferencePair(index=k, prompt_ids=prompts[i], chosen_ids=chosen_of[i], rejected_ids=rejected_of[i],
                           row=rows[i])
            for k, i in enumerate(both)
        ]

    @classmethod
    def from_config(cls, data_config, tokenizer, split: Literal["train", "val"] = "train") -> "PreferenceDataset":
        """The train or val pairs named by a `DataConfig` (megarl.config.schema)."""
        d = data_config
        return cls(
            d.train_files if split == "train" else d.val_files, tokenizer, prompt_key=d.prompt_key,
            chosen_key=d.chosen_key, rejected_key=d.rejected_key, reward_fn_key=d.reward_fn_key,
            max_prompt_length=d.max_prompt_length, max_response_length=d.max_response_length,
            filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation,
            chat_template_kwargs=d.apply_chat_template_kwargs,
        )

    def __len__(self) -> int:
        return len(self._pairs)

    def __getitem__(self, index: int) -> PreferencePair:
        return self._pairs[index]

    def take(self, indices: Sequence[int]) -> list[PreferencePair]:
        return [self._pairs[i] for i in indices]


def pairs_to_batch(pairs: Sequence[PreferencePair]) -> Batch:
    """A batch of 2 x len(pairs) samples: row 2i is pair i's prompt + chosen response, row 2i + 1
    its prompt + rejected response (the layout `ActorEngine.dpo_step` expects)."""
    prompts = [p.prompt_ids for p in pairs for _ in range(2)]
    responses = [ids for p in pairs for ids in (p.chosen_ids, p.rejected_ids)]
    return Batch.from_token_lists(prompts, responses)
