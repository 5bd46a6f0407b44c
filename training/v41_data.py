"""The shipped V4.1 model's corpus: code and English, as BPE tokens.

- code: the standard library's .py files (data.py);
- English: the prose installed packages ship (each distribution's METADATA, which holds its
  README, and the .md / .rst files under site-packages), which needs no network;
- chat: one conversation per documented public function, class or method of those .py files, in
  DeepSeek V4's chat encoding: the user asks what `module.name` does, the assistant answers
  with the docstring's first paragraph. It teaches the turn structure, so a chat request gets
  an answer shaped like one (the facts are only as good as a 9M-parameter model's).

Each kind is split by data.is_held_out on the file's relative path, as the code always was:
a held-out file (and the conversations drawn from it) is never trained on, by the tokenizer
(bpe.py) or the model. A text's tokens are followed by the end-of-sentence id, in sorted
file order. Bits per byte count each
token's UTF-8 bytes (a byte-level BPE token's string has one character per byte) and one
byte for the end-of-sentence id, as the byte-level models counted their EOS.
"""

from __future__ import annotations

import ast
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.chat_deepseek_v4 import EOS, encode_chat
from kvmesh.training import data

KINDS = ("code", "english", "chat")
ENGLISH_SUFFIXES = (".md", ".rst")
MIN_ENGLISH_BYTES = 500          # smaller files are mostly a line or two of boilerplate


def english_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def english_files(root: Path | None = None) -> list[Path]:
    """Relative paths of the packages' prose files, sorted."""
    root = root or english_root()
    return sorted(p.relative_to(root) for p in root.rglob("*")
                  if (p.name == "METADATA" or p.suffix in ENGLISH_SUFFIXES) and p.is_file()
                  and p.stat().st_size >= MIN_ENGLISH_BYTES)


def sources() -> dict[str, tuple[Path, list[Path]]]:
    """kind -> (root, files); chat is drawn from the code files."""
    code_root, english = data.stdlib_root(), english_root()
    code = data.stdlib_files(code_root)
    return {"code": (code_root, code), "english": (english, english_files(english)),
            "chat": (code_root, code)}


def texts(root: Path, files: list[Path], kind: str = "code"):
    """The kind's texts from these files: each file whole, or (chat) its conversations."""
    for rel in files:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        if kind == "chat":
            yield from conversations(rel, text)
        else:
            yield text


def conversations(rel: Path, source: str) -> list[str]:
    """One chat per documented top-level def or class of a module (its docstring's first
    paragraph, at most 400 characters, as the answer; the end-of-sentence id follows in
    `encode`)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    parts = rel.with_suffix("").parts
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    top = [node for node in tree.body if isinstance(node, defs)]
    documented = [(node, f"{module}.{node.name}", None) for node in top]
    documented += [(item, f"{module}.{node.name}.{item.name}", "method") for node in top
                   if isinstance(node, ast.ClassDef) for item in node.body
                   if isinstance(item, defs[:2])]
    out = []
    for node, name, kind in documented:
        doc = ast.get_docstring(node)
        if node.name.startswith("_") or not doc:
            continue
        answer = " ".join(doc.split("\n\n")[0].split())
        if 20 <= len(answer) <= 400:
            kind = kind or ("class" if isinstance(node, ast.ClassDef) else "function")
            question = f"What does the {kind} `{name}` do?"
            out.append(encode_chat([{"role": "user", "content": question}]) + answer)
    return out


def training_texts():
    """The code and English training splits, as text (what the tokenizer is trained on)."""
    for kind, (root, files) in sources().items():
        if kind != "chat":
            train, _ = data.split(files)
            yield from texts(root, train, kind)


@dataclass
class TokenCorpus:
    train: dict[str, torch.Tensor]      # kind -> int16 token stream
    val: dict[str, torch.Tensor]
    files: dict[str, tuple[int, int]]   # kind -> (train files, held-out files)

    def describe(self) -> str:
        return "; ".join(f"{kind}: {self.files[kind][0]} train files ({len(self.train[kind]):,} "
                         f"tokens), {self.files[kind][1]} held-out ({len(self.val[kind]):,})"
                         for kind in KINDS)


def encode(tok, root: Path, files: list[Path], kind: str = "code") -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts(root, files, kind)), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int16 if tok.get_vocab_size() < 32768 else torch.int32)


def load(tok, cache: Path | None = None) -> TokenCorpus:
    """Tokenize both kinds' splits (or read them from `cache`, a .pt this wrote)."""
    if cache is not None and cache.exists():
        return TokenCorpus(**torch.load(cache))
    train, val, counts = {}, {}, {}
    for kind, (root, files) in sources().items():
        train_files, val_files = data.split(files)
        train[kind] = encode(tok, root, train_files, kind)
        val[kind] = encode(tok, root, val_files, kind)
        counts[kind] = (len(train_files), len(val_files))
    corpus = TokenCorpus(train, val, counts)
    if cache is not None:
        torch.save({"train": train, "val": val, "files": counts}, cache)
    return corpus


def token_bytes(tok) -> torch.Tensor:
    """[vocab] UTF-8 bytes each id stands for (special ids: 1)."""
    out = torch.ones(tok.get_vocab_size(), dtype=torch.float64)
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    for token, i in tok.get_vocab().items():
        if token not in special:
            out[i] = len(token)
    return out


def sample(corpus: TokenCorpus, batch: int, seq_len: int, english_fraction: float,
           chat_fraction: float, gen: torch.Generator, copy_fraction: float = 0.0,
           copy: tuple[list[int], int] | None = None) -> list[torch.Tensor]:
    """`batch` windows of seq_len + 1 tokens, each from English with `english_fraction`,
    from the conversations with `chat_fraction`, a repeated code snippet with
    `copy_fraction` (`copy_row`; copy = (separator ids, shortest snippet)), else code."""
    draws = torch.rand(batch, generator=gen).tolist()
    edges = (english_fraction, english_fraction + chat_fraction,
             english_fraction + chat_fraction + copy_fraction)
    kinds = ["english" if u < edges[0] else "chat" if u < edges[1] else
             "copy" if u < edges[2] else "code" for u in draws]
    rows = []
    for kind in kinds:
        if kind == "copy":
            window = data.sample_batch(corpus.train["code"], 1, seq_len, gen)[0]
            rows.append(copy_row(window, *copy, gen))
        else:
            rows.append(data.sample_batch(corpus.train[kind], 1, seq_len, gen)[0])
    return rows


# what separates a copy row's two snippets (copy_row; v41_evaluate's copy test)
COPY_SEPARATOR = "\n# the same code again:\n"


def copy_row(window: torch.Tensor, separator: list[int], shortest: int,
             gen: torch.Generator) -> torch.Tensor:
    """A code window's first s tokens, the separator, the same s tokens again and then the
    window's text after them, cut to the window's length. With s > the model's sliding
    window, the repeat is predictable only from what the compressed caches kept of the first
    copy: the rows teach retrieval past the window, which plain code rarely rewards."""
    n = len(window)
    longest = (n - len(separator)) // 2
    if longest < shortest:
        raise ValueError(f"copy rows: a window of {n} tokens has no room for two snippets of "
                         f"{shortest} tokens")
    s = int(torch.randint(shortest, longest + 1, (1,), generator=gen))
    sep = torch.tensor(separator, dtype=window.dtype)
    return torch.cat([window[:s], sep, window[:s], window[s:]])[:n]
