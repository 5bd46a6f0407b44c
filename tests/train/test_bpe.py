"""The byte-level BPE tokenizer for the shipped model (training/bpe.py):
DeepSeek's special tokens are single ids 0..5, any text round-trips exactly, the chat
encoding tokenizes through it, the held-out files are never trained on, and the saved
directory loads in `tokenizers` and in the gateway's chat path."""

from __future__ import annotations

import itertools
import json

import pytest

from kvmesh.chat_deepseek_v4 import SPECIAL_TOKENS, encode_chat
from kvmesh.training import bpe, data, v41_data


@pytest.fixture(scope="module")
def tok():
    texts = list(itertools.islice(v41_data.training_texts(), 60))
    return bpe.train(texts, vocab_size=700)


def test_special_tokens_are_the_first_ids(tok):
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4, 5]
    assert 400 < tok.get_vocab_size() <= 700      # merges were learned


@pytest.mark.parametrize("text", ["def f(x):\n    return x + 1\n", "héllo wörld ✓ 漢字 🙂",
                                  "\t\x00\x7f\r\n", ""])
def test_any_text_round_trips(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_the_chat_encoding_gives_single_special_ids(tok):
    ids = tok.encode(encode_chat([{"role": "user", "content": "hi"}]), add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-2:] == [3, 5] and 2 in ids


def test_held_out_files_are_not_training_text():
    root = data.stdlib_root()
    files = data.stdlib_files(root)
    train, _ = data.split(files)          # what v41_data.training_texts reads
    held_out = [f for f in files if data.is_held_out(f)]
    assert held_out and not set(train) & set(held_out)
    assert sorted(train + held_out) == files


def test_saved_directory_loads(tok, tmp_path):
    from tokenizers import Tokenizer

    from kvmesh.services.gateway.openai_api.chat import load_template, plain_template
    bpe.save(tok, tmp_path)
    again = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert again.encode("import os").ids == tok.encode("import os").ids
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == SPECIAL_TOKENS[0] and cfg["eos_token"] == SPECIAL_TOKENS[1]
    assert load_template(str(tmp_path / "tokenizer.json")) is plain_template  # no model config


def test_the_cli_refuses_a_vocabulary_too_small(tmp_path, capsys):
    from kvmesh.launch.cli import main
    assert main(["train-tokenizer", "--out", str(tmp_path), "--vocab-size", "100"]) == 2
    assert "vocab_size 100" in capsys.readouterr().err
