"""SFT chats (megarl.data.conversations), tokenised as verl's MultiTurnSFTDataset: checked against
the chat template's own rendering of the whole chat and hand-written token lists (the character
tokenizer: one token per character)."""
import logging

import pytest

from megarl.data.conversations import ChatDataset
from megarl.data.errors import DataError
from megarl.data.tiny_model import build_char_tokenizer

# per-turn markers ("u:" / "a:" / "s:", "," closing a turn, eos after an assistant turn); "a:" is the generation prompt
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %},{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
# as Qwen3's thinking: an assistant turn before the last renders differently ("x") in the whole chat
CHANGES_EARLIER_TURNS = ("{% for m in messages %}{{ m['role'][0] }}:"
                         "{% if m['role'] == 'assistant' and not loop.last %}x{% else %}{{ m['content'] }}{% endif %},"
                         "{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
CHAT = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"}, {"role": "user", "content": "x2"}, {"role": "assistant", "content": "6"}]


def tokenizer(template):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


def write(write_rows, chats):
    return write_rows([{"messages": chat} for chat in chats])


def test_a_chat_is_the_templates_rendering_trained_on_the_assistant_turns(write_rows):
    tok = tokenizer(TEMPLATE)
    chat = ChatDataset(write(write_rows, [CHAT]), tok)[0]
    whole = tok(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
    assert chat.input_ids == whole
    tokens = tok.convert_ids_to_tokens(chat.input_ids)
    assert "".join(tokens) == "<bos>s:add,u:1+2=,a:3<eos>,u:x2,a:6<eos>,"
    trained = [t for t, m in zip(tokens, chat.loss_mask) if m]
    assert trained == ["3", "<eos>", ",", "6", "<eos>", ","]  # after each "a:", through the turn's end
    assert tokens[chat.first_trained - 2:chat.first_trained] == ["a", ":"]


def test_a_template_that_changes_earlier_turns_is_refused_unless_ignored(write_rows, caplog):
    path = write(write_rows, [CHAT[1:3], CHAT])
    with pytest.raises(DataError, match=r"1 of 2 chats render differently.*row 1.*data.ignore_input_ids_mismatch=true"):
        ChatDataset(path, tokenizer(CHANGES_EARLIER_TURNS))
    with caplog.at_level(logging.WARNING):
        chats = ChatDataset(path, tokenizer(CHANGES_EARLIER_TURNS), ignore_input_ids_mismatch=True)
    assert "trained on the turns one by one" in caplog.text
    tok = tokenizer(CHANGES_EARLIER_TURNS)
    assert "".join(tok.convert_ids_to_tokens(chats[1].input_ids)) == "s:add,u:1+2=,a:3,u:x2,a:6,"  # turn by turn


def test_overlong_chats_follow_data_truncation(write_rows):
    path = write(write_rows, [CHAT])  # 29 tokens
    with pytest.raises(DataError, match=r"longer than data.max_length=20 tokens"):
        ChatDataset(path, tokenizer(TEMPLATE), max_length=20)
    tok = tokenizer(TEMPLATE)
    right = ChatDataset(path, tok, max_length=20, truncation="right")[0]
    assert "".join(tok.convert_ids_to_tokens(right.input_ids)) == "<bos>s:add,u:1+2=,a:3<eos>,u"
    assert sum(right.loss_mask) == 3 and len(right.loss_mask) == 20
    with pytest.raises(DataError, match=r"1 chats have no assistant token to train on within data.max_length=10"):
        ChatDataset(path, tok, max_length=10, truncation="right")


def test_a_chat_without_an_assistant_turn_is_refused(write_rows):
    with pytest.raises(DataError, match="no assistant token"):
        ChatDataset(write(write_rows, [CHAT[:2]]), tokenizer(TEMPLATE))


def test_tool_schemas_are_refused_not_dropped(write_rows):
    path = write_rows([{"messages": CHAT, "tools": "[]"}])
    with pytest.raises(DataError, match="column.s. tools: tool schemas and enable_thinking in SFT chats are not built"):
        ChatDataset(path, tokenizer(TEMPLATE))


def test_chat_template_kwargs_reach_every_turn(write_rows):
    """data.apply_chat_template_kwargs (verl passes them to the template in its SFT dataset too): the
    oracle is the template's own rendering of the whole chat with the same variable."""
    tok = tokenizer(TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] }}{{ mark | default('') }}"))
    chat = ChatDataset(write(write_rows, [CHAT]), tok, chat_template_kwargs={"mark": "!"})[0]
    whole = tok.apply_chat_template(CHAT, tokenize=False, mark="!")
    assert "1+2=!" in whole  # the variable changes the rendering: the check below can fail
    assert chat.input_ids == tok(whole, add_special_tokens=False)["input_ids"]
