"""Checkpoints, tokenizers, sampling and stop rules."""

import subprocess
import sys

import torch

from kvmesh.services.engine.core.finish import Finish
from kvmesh.services.engine.core.output import OutputState
from kvmesh.services.engine.core.sampling import SamplingParams, sample
from kvmesh.tokenizer import ByteTokenizer, HFTokenizer


def test_byte_tokenizer_streams_split_characters():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    s = tok.stream()
    deltas = [s.push([i]) for i in ids]
    assert "".join(deltas) == "héllo ✓"
    assert "\ufffd" not in "".join(deltas)


def test_hf_tokenizer_json_loads(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    t.save(str(path))
    hf = HFTokenizer(path)
    assert hf.encode("hello world") == [1, 2]
    assert hf.eos_id == 0


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([5.0, 4.0, 3.0, -10.0, -10.0])
    k1 = {sample(logits, SamplingParams(temperature=1.0, top_k=2), i, 0) for i in range(200)}
    assert k1 == {0, 1}
    # probabilities ~ [0.665, 0.245, 0.09, ...]: top_p 0.7 keeps the first two
    p = {sample(logits, SamplingParams(temperature=1.0, top_p=0.7), i, 0) for i in range(200)}
    assert p == {0, 1}
    assert sample(logits, SamplingParams(temperature=0.0), 0, 0) == 0


def test_sampling_depends_on_seed_and_step_only():
    logits = torch.zeros(50)
    a = [sample(logits, SamplingParams(seed=9), i, 123) for i in range(20)]
    b = [sample(logits, SamplingParams(seed=9), i, 456) for i in range(20)]
    assert a == b and len(set(a)) > 5


def test_stop_string_is_cut_and_held_back():
    tok = ByteTokenizer()
    out = OutputState(SamplingParams(stop=("END",), max_tokens=100), tok.eos_id, tok.stream())
    sent, finish = "", None
    for i, t in enumerate(tok.encode("abcENxENDzzz")):
        delta, finish = out.push(t, i + 1)
        sent += delta
        if finish:
            break
    assert sent == "abcENx" and finish is Finish.STOP


def test_eos_and_stop_tokens_finish():
    tok = ByteTokenizer()
    out = OutputState(SamplingParams(stop_token_ids=(65,)), tok.eos_id, tok.stream())
    assert out.push(ord("A"), 1) == ("", Finish.STOP)
    out = OutputState(SamplingParams(), tok.eos_id, tok.stream())
    assert out.push(tok.eos_id, 1)[1] is Finish.STOP
    out = OutputState(SamplingParams(ignore_eos=True, max_tokens=2), tok.eos_id, tok.stream())
    assert out.push(tok.eos_id, 1)[1] is None


def test_cli_generate_local_streams_and_rejects_bad_input():
    ok = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "generate", "--local", "def f(x):",
                         "--max-tokens", "5", "--temperature", "0"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "[length: 5 prompt tokens, 5 generated]" in ok.stderr   # the shipped model, greedy
    bad = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "generate", "--local", "x",
                          "--top-p", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "top_p must be in (0, 1]" in bad.stderr
    trunc = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "generate", "--local", "x",
                            "--truncation", "compact", "--keep-tokens", "100"],
                           capture_output=True, text=True, timeout=120)
    assert trunc.returncode == 2 and "smaller than W + B = 134" in trunc.stderr


def test_draw_batch_equals_one_draw_per_row():
    """A step's draws at once (greedy rows in one argmax over their stacked logits, sampled
    rows each with their own generator): the ids one draw() per row gives, ties included."""
    from kvmesh.services.engine.core.sampling import draw, draw_batch, read_ids

    GREEDY = SamplingParams(temperature=0)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 50, generator=g)
    logits[2, [4, 9]] = 10.0                                   # a tie: the first index wins
    plist = [GREEDY, SamplingParams(temperature=0.8, seed=5), GREEDY, GREEDY,
             SamplingParams(temperature=1.2, top_k=5), GREEDY, SamplingParams(temperature=0.5, top_p=0.9)]
    rows = [(logits[i], p, 3 + i, 100 + i) for i, p in enumerate(plist)]
    parts, where = draw_batch(rows)
    assert len(parts) == 1 + 3                                 # the four greedy rows: one part
    read = read_ids(parts)
    want = [int(draw(*row)) for row in rows]
    assert [read[p][j] for p, j in where] == want
    assert want[2] == 4
    # one greedy row alone is drawn as ever
    parts, where = draw_batch(rows[:2])
    assert len(parts) == 2 and [read_ids(parts)[p][j] for p, j in where] == want[:2]


def _byte_level_bpe(tmp_path):
    """A small byte-level BPE (the kind DeepSeek and GPT-2 ship), trained here offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld ✓ the quick brown fox 日本語のテキスト", "naïve café déjà vu ☃ 🎉"] * 20
    t.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path / "tokenizer.json"), corpus


def test_hf_stream_gives_the_deltas_of_decoding_every_id(tmp_path):
    """The stream decodes only its last tokens and their left neighbours; its deltas are,
    push by push, those of decoding the whole list each time (the earlier implementation,
    written out here), on text cut anywhere and on arbitrary ids (broken characters)."""
    import random

    hf, corpus = _byte_level_bpe(tmp_path)

    def decode_everything(ids):
        text, out = "", []
        for i in range(1, len(ids) + 1):
            full = hf.decode(ids[:i])
            delta = "" if full.endswith("\ufffd") else full[len(text):]
            text += delta
            out.append(delta)
        return out

    rng = random.Random(0)
    for trial in range(400):
        if trial % 2:
            ids = [rng.randrange(hf.vocab_size) for _ in range(rng.randrange(1, 30))]
        else:
            src = rng.choice(corpus)
            at = rng.randrange(len(src))
            ids = hf.encode(src[at : at + rng.randrange(1, 40)])
        stream = hf.stream()
        assert [stream.push([i]) for i in ids] == decode_everything(ids), ids


def test_hf_stream_work_per_token_does_not_grow_with_the_text(tmp_path):
    hf, corpus = _byte_level_bpe(tmp_path)
    ids = hf.encode(" ".join(corpus))
    assert len(ids) > 300
    decoded = []
    plain = hf.decode
    hf.decode = lambda xs: (decoded.append(len(xs)), plain(xs))[1]
    stream = hf.stream()
    text = "".join(stream.push([i]) for i in ids)
    assert text == plain(ids)
    assert max(decoded) <= 8, "a push decoded more than the last few tokens"
