"""A byte-level BPE tokenizer for the shipped model, trained with `tokenizers` on the
training split of the code and English corpus (v41_data.training_texts: the held-out files
are never seen), saved in Hugging Face's form: `tokenizer.json` + `tokenizer_config.json`.

DeepSeek V4's special tokens come first, as single ids, so the chat encoding
(kvmesh/chat_deepseek_v4.py) works through the tokenizer and the ids match a DeepSeek config:

    0 <｜begin▁of▁sentence｜>   1 <｜end▁of▁sentence｜>   2 <｜User｜>   3 <｜Assistant｜>
    4 <think>                   5 </think>

Byte-level: every UTF-8 byte is in the initial alphabet, so any text encodes and decodes
back exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from kvmesh.chat_deepseek_v4 import BOS, EOS, SPECIAL_TOKENS


def train(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """A byte-level BPE over `texts` with the special tokens at ids 0..5."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size {vocab_size}: needs at least the 256 bytes and "
                         f"{len(SPECIAL_TOKENS)} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save(tok, directory: Path, max_length: int = 1048576) -> None:
    """tokenizer.json and a tokenizer_config.json naming the begin / end tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "add_bos_token": False, "add_eos_token": False, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
