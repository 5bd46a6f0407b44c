"""Tokenizers: built-in byte-level, or a HuggingFace tokenizer.json via `tokenizers`.

Byte-level ids: 0..255 are the UTF-8 bytes, then the special tokens.
Decoding is incremental (`TextStream`) so a multi-byte character split across
tokens is emitted once it is complete, never as a replacement character.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from pathlib import Path


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's stand-ins (GPT-2's table): printable bytes stand for themselves,
    the other 68 for the code points from 256 on, in byte order; char -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


BYTE_OF_CHAR = _byte_level_chars()


def token_text(raw: bytes) -> str:
    """A token's name in OpenAI's logprobs: its text, or `bytes:\\xNN...` when its bytes
    are not whole UTF-8 characters (a piece of one), as OpenAI writes them."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class ByteTokenizer:
    BOS, EOS, PAD = 256, 257, 258
    specials = {"<bos>": 256, "<eos>": 257, "<pad>": 258}

    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return bytes(i for i in ids if i < 256)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a special token's name)."""
        if token < 256:
            return bytes([token])
        return next((name.encode() for name, i in self.specials.items() if i == token), b"")

    @property
    def eos_id(self) -> int:
        return self.EOS

    def stream(self) -> TextStream:
        return TextStream(self)


class HFTokenizer:
    """A tokenizer.json loaded through the `tokenizers` library."""

    def __init__(self, path: str | Path, eos_token: str | None = None, eos_id: int | None = None):
        """`eos_id` (a checkpoint config's eos_token_id) wins over `eos_token`, which wins
        over the usual end-of-text names."""
        from tokenizers import Tokenizer

        self.path = str(path)
        self.tok = Tokenizer.from_file(self.path)
        self.vocab_size = self.tok.get_vocab_size()
        eos = eos_token or next((t for t in ("</s>", "<|endoftext|>", "<eos>")
                                 if self.tok.token_to_id(t) is not None), None)
        self._eos = eos_id if eos_id is not None else (self.tok.token_to_id(eos) if eos else None)
        self._byte_level = type(self.tok.decoder).__name__ == "ByteLevel"

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for: a byte-level BPE piece read back through the
        byte table (one token may hold part of a character), else its decoded text (a
        special token's name)."""
        piece = self.tok.id_to_token(token)
        if self._byte_level and piece and all(c in BYTE_OF_CHAR for c in piece):
            return bytes(BYTE_OF_CHAR[c] for c in piece)
        return self.tok.decode([token], skip_special_tokens=False).encode()

    @property
    def eos_id(self) -> int | None:
        return self._eos

    def stream(self) -> TextStream:
        return TextStream(self)


class TextStream:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self._pieces: list[str] = []   # the text's deltas, joined only when `text` is read
        self._context = 0      # HF: ids[_context:_shown] are decoded again as left context
        self._shown = 0        # HF: ids[:_shown] are in text
        if isinstance(tokenizer, ByteTokenizer):
            self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        if isinstance(self.tok, ByteTokenizer):
            delta = self._dec.decode(self.tok.decode_bytes(ids))
        else:
            # Only the tokens since the last text, after the ones that gave it: a token's
            # text can depend on its left neighbour (a word's leading space, a character
            # split over byte tokens), and decoding that neighbour too and keeping what
            # follows its text gives what a decode of every id gives. Decoding every id on
            # every push made a long generation's text quadratic in its length.
            before = self.tok.decode(self.ids[self._context : self._shown])
            after = self.tok.decode(self.ids[self._context :])
            if after.endswith("\ufffd"):  # wait for the rest of a character
                return ""
            delta = after[len(before):]
            self._context, self._shown = self._shown, len(self.ids)
        if delta:
            self._pieces.append(delta)
        return delta

    @property
    def text(self) -> str:
        """Everything decoded so far. Joined on reading (and kept joined), not on each push:
        `text += delta` copied the whole text for every token."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(path: str | None) -> Tokenizer:
    return ByteTokenizer() if not path else HFTokenizer(path)
