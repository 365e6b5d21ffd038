"""Tokenising prompts: chat template, fallback without one, overlong prompts, SFT responses."""
import logging

import pytest

from megarl.config.schema import DataConfig
from megarl.data.errors import DataError
from megarl.data.prompts import PromptDataset, render_chats
from megarl.data.tiny_model import build_char_tokenizer

BOS, EOS, UNK = 1, 2, 3


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_template_is_applied_with_generation_prompt(write_rows, make_rows, char_tokenizer):
    dataset = PromptDataset(write_rows(make_rows(["23+45=", "1+2="])), char_tokenizer, max_prompt_length=16)
    assert len(dataset) == 2 and dataset.num_filtered == 0
    first = dataset[0]
    assert first.input_ids == [BOS] + ids_of(char_tokenizer, "23+45=")
    assert first.index == 0 and first.row.ground_truth == "15" and first.response_ids is None
    assert [p.index for p in dataset.take([1, 0])] == [1, 0]


def test_a_real_style_template_sees_every_message():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }},{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
    )
    chat = [{"role": "system", "content": "x"}, {"role": "user", "content": "12"}]
    assert render_chats(tokenizer, [chat]) == [ids_of(tokenizer, "s:x,u:12,a:")]


def test_tokenizer_without_template_concatenates_and_warns_once(write_rows, make_rows, caplog):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    rows = make_rows(["1+1=", "2+2=", "3+3="])
    rows[0]["prompt"] = [{"role": "system", "content": "ab"}, {"role": "user", "content": "1+1="}]
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
        dataset = PromptDataset(write_rows(rows), tokenizer, max_prompt_length=16)
    warnings = [r for r in caplog.records if "no chat template" in r.getMessage()]
    assert len(warnings) == 1
    assert dataset[0].input_ids == ids_of(tokenizer, "ab") + [UNK] + ids_of(tokenizer, "1+1=")  # "\n" is <unk> here
    assert dataset[1].input_ids == ids_of(tokenizer, "2+2=")


PROMPTS = ["1+1=", "12345678+1=", "2+2=", "123456789+12="]  # 5, 12, 5 and 14 tokens with <bos>


def test_overlong_prompts_are_filtered_and_counted(write_rows, make_rows, char_tokenizer, caplog):
    path = write_rows(make_rows(PROMPTS))
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
        dataset = PromptDataset(path, char_tokenizer, max_prompt_length=8)
    assert [p.row.messages[0]["content"] for p in dataset.take(range(len(dataset)))] == ["1+1=", "2+2="]
    assert [p.row.row for p in dataset.take([0, 1])] == [0, 2]
    assert dataset.num_filtered == 2
    assert f"filtered out 2 of 4 longer than data.max_prompt_length=8 tokens (first: {path} row 1, 12 tokens)" in caplog.text


@pytest.mark.parametrize("side", ["left", "right"])
def test_overlong_prompts_are_truncated(write_rows, make_rows, char_tokenizer, side, caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
        dataset = PromptDataset(
            write_rows(make_rows(PROMPTS)), char_tokenizer, max_prompt_length=8, filter_overlong_prompts=False, truncation=side
        )
    full = [BOS] + ids_of(char_tokenizer, PROMPTS[1])
    assert len(dataset) == 4 and dataset.num_filtered == 0
    assert dataset[1].input_ids == (full[-8:] if side == "left" else full[:8])
    assert dataset[0].input_ids == [BOS] + ids_of(char_tokenizer, "1+1=")
    assert f"truncated ({side}) 2 of 4" in caplog.text


def test_overlong_prompts_are_an_error_when_neither_filtered_nor_truncated(write_rows, make_rows, char_tokenizer):
    path = write_rows(make_rows(PROMPTS))
    with pytest.raises(DataError) as err:
        PromptDataset(path, char_tokenizer, max_prompt_length=8, filter_overlong_prompts=False, truncation="error")
    assert f"2 of 4 longer than data.max_prompt_length=8 tokens (first: {path} row 1, 12 tokens)" in str(err.value)
    assert "data.filter_overlong_prompts=true or data.truncation=left|right" in str(err.value)


@pytest.mark.parametrize("response_key", [None, "response"])
def test_every_prompt_filtered_is_an_error(write_rows, make_rows, char_tokenizer, response_key):
    rows = make_rows(PROMPTS)
    for row in rows:
        row["response"] = "1"
    with pytest.raises(DataError, match="no rows of .* are within the length limits"):
        PromptDataset(write_rows(rows), char_tokenizer, max_prompt_length=3, response_key=response_key)


# Qwen3's way: an empty think block when enable_thinking is false (its tokenizer_config.json template)
THINKING_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}a:"
                     "{% if enable_thinking is defined and enable_thinking is false %}<>{% endif %}{% endif %}")


def test_data_apply_chat_template_kwargs_are_the_templates_variables(write_rows, make_rows):
    """Oracle: the tokenizer's own apply_chat_template given the same variable."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    chat = [{"role": "user", "content": "12"}]
    off = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == "12a:<>"  # the variable changes the rendering: the check below can fail
    config = DataConfig(train_files=[str(write_rows(make_rows(["12"])))], max_prompt_length=16,
                        apply_chat_template_kwargs={"enable_thinking": False})
    assert PromptDataset.from_config(config, tokenizer)[0].input_ids == ids_of(tokenizer, off)
    config.apply_chat_template_kwargs = {}
    assert PromptDataset.from_config(config, tokenizer)[0].input_ids == ids_of(tokenizer, "12a:")


def test_from_config_uses_the_data_keys(write_rows, make_rows, char_tokenizer):
    train = write_rows(make_rows(PROMPTS), "train.parquet")
    val = write_rows(make_rows(["9+9="]), "val.parquet")
    config = DataConfig(train_files=[str(train)], val_files=[str(val)], max_prompt_length=8)
    assert len(PromptDataset.from_config(config, char_tokenizer, "train")) == 2
    assert len(PromptDataset.from_config(config, char_tokenizer, "val")) == 1
    config.filter_overlong_prompts, config.truncation = False, "left"
    assert len(PromptDataset.from_config(config, char_tokenizer, "train")) == 4


def test_sft_responses_end_with_eos_and_obey_their_limit(write_rows, char_tokenizer):
    rows = [
        {"prompt": [{"role": "user", "content": "1+1="}], "response": "2"},
        {"prompt": [{"role": "user", "content": "abcdef>"}], "response": "fedcba"},
    ]
    path = write_rows(rows)
    dataset = PromptDataset(path, char_tokenizer, response_key="response", max_prompt_length=16, max_response_length=8)
    assert dataset[0].response_ids == ids_of(char_tokenizer, "2") + [EOS]
    assert dataset[1].response_ids == ids_of(char_tokenizer, "fedcba") + [EOS]
    short = PromptDataset(path, char_tokenizer, response_key="response", max_prompt_length=16, max_response_length=4)
    assert len(short) == 1 and short.num_filtered == 1
    with pytest.raises(DataError, match="longer than data.max_response_length=4"):
        PromptDataset(
            path, char_tokenizer, response_key="response", max_prompt_length=16, max_response_length=4,
            filter_overlong_prompts=False,
        )
