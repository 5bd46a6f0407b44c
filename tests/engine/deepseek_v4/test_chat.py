"""DeepSeek V4's chat encoding, as text and through a tokenizer.json with its special tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kvmesh.chat_deepseek_v4 import SPECIAL_TOKENS, encode_chat


def test_multi_turn_non_thinking_drops_nothing_but_reasoning():
    text = encode_chat([{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
                        {"role": "user", "content": "1+1?"}])
    assert text == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>hi<｜Assistant｜></think>Hello."
                    "<｜end▁of▁sentence｜><｜User｜>1+1?<｜Assistant｜></think>")


def test_thinking_mode_opens_a_think_block():
    assert encode_chat([{"role": "user", "content": "q"}], thinking=True).endswith(
        "<｜User｜>q<｜Assistant｜><think>")


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "messages: the last"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
      {"role": "user", "content": "c"}], "messages[1].role"),
])
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        encode_chat(messages)


def test_special_tokens_are_single_ids_through_tokenizer_json(tmp_path):
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tok.encode(encode_chat([{"role": "user", "content": "hi"}]),
                     add_special_tokens=False).ids
    special = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    bos, _, user, assistant, _, end_think = special
    assert ids == [bos, user, vocab["h"], vocab["i"], assistant, end_think]
