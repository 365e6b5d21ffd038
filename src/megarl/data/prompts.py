"""Prompt datasets: verl parquet rows tokenised with the model's chat template, length-checked.

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = PromptDataset.from_config(config.data, tokenizer, split="train")
    prompt = dataset[0]          # Prompt(index, input_ids, row, response_ids)

No torch here: token ids are plain lists; the batch container pads them into tensors.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

from megarl.data.errors import DataError
from megarl.data.parquet import PromptRow, read_rows

logger = logging.getLogger(__name__)

Truncation = Literal["error", "left", "right"]


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the dataset, after overlong prompts were filtered out
    input_ids: list[int]  # the prompt as the model sees it (chat template applied), unpadded
    row: PromptRow  # the parquet row: data_source, ground truth, extra_info, file and row number
    response_ids: Optional[list[int]] = None  # SFT data: the reference response followed by eos


def render_chats(tokenizer, chats: Sequence[list[dict]],
                 template_kwargs: Optional[Mapping[str, Any]] = None) -> list[list[int]]:
    """Token ids of each chat, ending where the assistant's reply starts.

    Uses the tokenizer's chat template with add_generation_prompt=True and `template_kwargs`, the
    template's own variables (data.apply_chat_template_kwargs, e.g. Qwen3's enable_thinking). A
    tokenizer without a template gets the messages' contents joined by newlines, with its own
    special tokens, and one warning per call.
    """
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                               **(template_kwargs or {})) for chat in chats]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    logger.warning(
        "tokenizer %s has no chat template: prompts are the messages' contents joined by newlines",
        getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
    )
    texts = ["\n".join(m["content"] for m in chat) for chat in chats]
    return tokenizer(texts, add_special_tokens=True)["input_ids"]


def encode_responses(tokenizer, responses: Sequence[str]) -> list[list[int]]:
    """Token ids of each reference response followed by the tokenizer's eos token."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no eos token: SFT responses cannot be terminated")
    if not responses:  # a tokenizer call with no texts fails
        return []
    return [ids + [tokenizer.eos_token_id] for ids in tokenizer(list(responses), add_special_tokens=False)["input_ids"]]


def fit_lengths(
    ids: list[list[int]],
    rows: Sequence[PromptRow],
    max_length: int,
    *,
    filter_overlong: bool,
    truncation: Truncation,
    what: str,
) -> tuple[list[int], list[list[int]]]:
    """(indices kept, their ids) after applying the length limit `max_length` (tokens).

    filter_overlong drops longer sequences; otherwise `truncation` keeps the last (left) or first
    (right) max_length tokens, or raises DataError naming the first overlong row ("error").
    The number filtered or truncated is logged; `what` names the limit's config key.
    """
    overlong = [i for i, seq in enumerate(ids) if len(seq) > max_length]
    if not overlong:
        return list(range(len(ids))), ids
    first = rows[overlong[0]]
    detail = (
        f"{len(overlong)} of {len(ids)} longer than {what}={max_length} tokens "
        f"(first: {first.file} row {first.row}, {len(ids[overlong[0]])} tokens)"
    )
    if filter_overlong:
        logger.warning("filtered out %s", detail)
        drop = set(overlong)
        kept = [i for i in range(len(ids)) if i not in drop]
        return kept, [ids[i] for i in kept]
    if truncation == "error":
        raise DataError(f"{detail}; set data.filter_overlong_prompts=true or data.truncation=left|right")
    logger.warning("truncated (%s) %s", truncation, detail)
    cut = (lambda s: s[-max_length:]) if truncation == "left" else (lambda s: s[:max_length])
    return list(range(len(ids))), [cut(s) if len(s) > max_length else s for s in ids]


class PromptDataset:
    """Validated, tokenised prompts of one or more parquet files, in file order.

    With `response_key` (SFT data) each item also carries the reference response's ids, limited to
    `max_response_length` tokens by the same filter/truncation rule (right-truncated).
    """

    def __init__(
        self,
        files: Sequence[str | Path] | str | Path,
        tokenizer,
        *,
        prompt_key: str = "prompt",
        reward_fn_key: str = "data_source",
        response_key: Optional[str] = None,
        max_prompt_length: int = 512,
        max_response_length: Optional[int] = None,
        filter_overlong_prompts: bool = True,
        truncation: Truncation = "error",
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    ):
        rows = read_rows(files, prompt_key=prompt_key, reward_fn_key=reward_fn_key, response_key=response_key)
        num_read = len(rows)
        ids = render_chats(tokenizer, [r.messages for r in rows], chat_template_kwargs)
        kept, ids = fit_lengths(
            ids, rows, max_prompt_length, filter_overlong=filter_overlong_prompts, truncation=truncation,
            what="data.max_prompt_length",
        )
        rows = [rows[i] for i in kept]
        responses: list[Optional[list[int]]] = [None] * len(rows)
        if response_key is not None:
            responses = encode_responses(tokenizer, [r.response for r in rows])
            if max_response_length is not None:
                kept, responses = fit_lengths(
                    responses, rows, max_response_length, filter_overlong=filter_overlong_prompts,
                    truncation="error" if truncation == "error" else "right", what="data.max_response_length",
                )
                rows, ids = [rows[i] for i in kept], [ids[i] for i in kept]
        if not rows:
            raise DataError(f"no rows of {', '.join(map(str, _as_list(files)))} are within the length limits")
        self.num_filtered = num_read - len(rows)  # rows dropped as overlong
        self._rows, self._ids, self._responses = rows, ids, responses

    @classmethod
    def from_config(cls, data_config, tokenizer, split: Literal["train", "val"] = "train", **kwargs) -> "PromptDataset":
        """The train or val set named by a `DataConfig` (megarl.config.schema)."""
        files = data_config.train_files if split == "train" else data_config.val_files
        return cls(
            files,
            tokenizer,
            prompt_key=data_config.prompt_key,
            reward_fn_key=data_config.reward_fn_key,
            max_prompt_length=data_config.max_prompt_length,
            filter_overlong_prompts=data_config.filter_overlong_prompts,
            truncation=data_config.truncation,
            chat_template_kwargs=data_config.apply_chat_template_kwargs,
            **kwargs,
        )

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Prompt:
        return Prompt(index=index, input_ids=self._ids[index], row=self._rows[index], response_ids=self._responses[index])

    def take(self, indices: Sequence[int]) -> list[Prompt]:
        return [self[i] for i in indices]


def _as_list(files) -> list:
    return [files] if isinstance(files, (str, Path)) else list(files)
