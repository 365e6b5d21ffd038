"""SFT chats: verl's multi-turn SFT data (a column of {role, content} messages), trained on the
assistant turns.

    chats = ChatDataset(files, tokenizer, messages_key="messages", max_length=1024)
    chat = chats[0]      # Chat(index, input_ids, loss_mask, row)

Tokenised as verl's MultiTurnSFTDataset does (verl/utils/dataset/multiturn_sft_dataset.py,
`__getitem__` and `_process_single_message`): each message rendered on its own with the chat
template, the template's system prompt cut from every message but the first, the turns
concatenated; an assistant turn's tokens after the template's generation prompt are trained on
(its end-of-turn tokens included), nothing else. The concatenation must equal the whole chat
rendered at once (verl's `sanity_check`) unless `ignore_input_ids_mismatch`. No torch here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pyarrow.parquet as pq

from megarl.data.errors import DataError
from megarl.data.parquet import PromptRow, read_rows
from megarl.data.prompts import Truncation, fit_lengths

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chat:
    index: int  # position in the dataset
    input_ids: list[int]  # the whole chat, unpadded
    loss_mask: list[int]  # 1: a trained token (assistant turns), per token of input_ids
    row: PromptRow  # the parquet row (its messages, file and row number)

    @property
    def first_trained(self) -> int:
        """Position of the first trained token."""
        return self.loss_mask.index(1)


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False,
            template_kwargs: Optional[Mapping[str, Any]] = None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         **(template_kwargs or {}))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def template_parts(tokenizer, template_kwargs: Optional[Mapping[str, Any]] = None) -> tuple[list[int], list[int]]:
    """(system prompt, generation prompt) token ids of the chat template, found as verl's
    `extract_system_prompt_and_generation` (verl/utils/tokenizer/chat_template.py) finds them: what one
    empty user turn renders beyond the second one's length, and what add_generation_prompt appends."""
    empty = [{"role": "user", "content": ""}]
    one, two = _render(tokenizer, empty, False, template_kwargs), _render(tokenizer, empty * 2, False, template_kwargs)
    system = one[: len(one) - (len(two) - len(one))]
    return system, _render(tokenizer, empty, True, template_kwargs)[len(one):]


def tokenize_chat(tokenizer, messages: list[dict], system: list[int], generation: list[int],
                  template_kwargs: Optional[Mapping[str, Any]] = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one chat, turn by turn (see the module's docstring)."""
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        turn = _render(tokenizer, [message], False, template_kwargs)
        if i != 0 and message["role"] != "system":
            turn = turn[len(system):]
        prompt = len(generation) if message["role"] == "assistant" else len(turn)  # untrained tokens
        ids += turn
        mask += [0] * min(prompt, len(turn)) + [1] * max(0, len(turn) - prompt)
    return ids, mask


class ChatDataset:
    """Tokenised chats of one or more parquet files, in file order, each at most `max_length` tokens
    (longer ones: `truncation` keeps the first (right) or last (left) tokens, or DataError). A chat
    without a trained token (no assistant turn, or none left after truncation) is refused."""

    def __init__(self, files: Sequence[str | Path] | str | Path, tokenizer, *, messages_key: str = "messages",
                 max_length: int = 1024, truncation: Truncation = "error", ignore_input_ids_mismatch: bool = False,
                 chat_template_kwargs: Optional[Mapping[str, Any]] = None):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: chats "
                            "(data.messages_key) need one")
        rows = read_rows(files, prompt_key=messages_key, chats=True)
        for path in dict.fromkeys(row.file for row in rows):
            unread = [c for c in ("tools", "enable_thinking") if c in pq.ParquetFile(path).schema_arrow.names]
            if unread:  # verl passes them to the chat template (MultiTurnSFTDataset's tools_key, enable_thinking_key)
                raise DataError(f"{path}: column(s) {', '.join(unread)}: tool schemas and enable_thinking in SFT chats "
                                "are not built yet")
        system, generation = template_parts(tokenizer, chat_template_kwargs)
        ids, masks, mismatched = [], [], []
        for row in rows:
            chat_ids, mask = tokenize_chat(tokenizer, row.messages, system, generation, chat_template_kwargs)
            if chat_ids != _render(tokenizer, row.messages, False, chat_template_kwargs):
                mismatched.append(row)
            ids.append(chat_ids)
            masks.append(mask)
        if mismatched:
            first = mismatched[0]
            what = (f"{len(mismatched)} of {len(rows)} chats render differently turn by turn than at once (first: "
                    f"{first.file} row {first.row}); the chat template changes earlier turns (e.g. Qwen3's <think> "
                    "on the last turn only)")
            if not ignore_input_ids_mismatch:
                raise DataError(f"{what}; data.ignore_input_ids_mismatch=true trains on the turns as rendered one "
                                "by one (verl's behaviour)")
            logger.warning("%s; trained on the turns one by one (data.ignore_input_ids_mismatch=true)", what)
        _, cut = fit_lengths(ids, rows, max_length, filter_overlong=False, truncation=truncation,
                             what="data.max_length")
        masks = [m[-len(c):] if truncation == "left" else m[:len(c)] for m, c in zip(masks, cut)]
        untrained = [r for r, m in zip(rows, masks) if 1 not in m]
        if untrained:
            raise DataError(f"{len(untrained)} chats have no assistant token to train on within data.max_length="
                            f"{max_length} (first: {untrained[0].file} row {untrained[0].row})")
        self._rows, self._ids, self._masks = rows, cut, masks

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Chat:
        return Chat(index=index, input_ids=self._ids[index], loss_mask=self._masks[index], row=self._rows[index])

    def take(self, indices: Sequence[int]) -> list[Chat]:
        return [self[i] for i in indices]
