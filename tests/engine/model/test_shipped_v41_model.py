"""The shipped default model (models/deepseek-v41-tiny): an HF checkpoint directory the V4.1
loader reads, in the shape train trains, within the size the repository allows, as good
on a held-out slice as its card records (its MTP module too), drafting in the engine, and
what every entry point serves by default."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from kvmesh.chat_deepseek_v4 import encode_chat
from kvmesh.services.engine.build import choose_model
from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint
from kvmesh.shipped import DEFAULT_MODEL
from kvmesh.training.v41_model import SHIPPED_TEXT_CONFIG

METRICS = json.loads((DEFAULT_MODEL / "metrics.json").read_text())


def test_the_directory_is_a_loadable_checkpoint_of_the_trained_shape():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "README.md", "metrics.json", "training.json"):
        assert (DEFAULT_MODEL / name).is_file(), name
    assert (DEFAULT_MODEL / "model.safetensors").stat().st_size < 40 << 20
    text = json.loads((DEFAULT_MODEL / "config.json").read_text())["text_config"]
    assert {k: text[k] for k in SHIPPED_TEXT_CONFIG} == SHIPPED_TEXT_CONFIG
    cfg, w = load_v41_checkpoint(DEFAULT_MODEL, torch.float32)
    assert sum(t.numel() for t in w.values()) == METRICS["parameters"] + METRICS["mtp"]["parameters"]
    assert cfg.window == 128 and cfg.decoder_start is not None and cfg.mtp_layers == 1


def test_a_held_out_slice_scores_as_recorded():
    sys.path.insert(0, str(DEFAULT_MODEL.parents[1] / "scripts"))
    from ship_v41_model import slice_loss

    got, want = slice_loss(DEFAULT_MODEL), METRICS["slice"]["loss_nats"]
    print(f"held-out code slice: {got:.4f} nats/token, recorded {want:.4f}")
    assert abs(got - want) <= 0.02 * want


def test_the_mtp_module_agrees_with_the_trunk_as_recorded():
    sys.path.insert(0, str(DEFAULT_MODEL.parents[1] / "scripts"))
    from ship_v41_model import mtp_slice

    got, want = mtp_slice(DEFAULT_MODEL), METRICS["mtp"]["slice"]
    print(f"held-out code slice: MTP agrees with the trunk {got['agree']:.4f}, recorded "
          f"{want['agree']:.4f}")
    assert abs(got["agree"] - want["agree"]) <= 0.02
    for kind in ("code", "english", "chat"):       # it learned: most drafts a trunk would keep
        assert METRICS["mtp"][kind]["agree"] > 0.4, kind


def test_the_engine_drafts_with_it_and_verification_keeps_most_drafts():
    from kvmesh.services.engine.core.sampling import SamplingParams
    from tests.engine.engines import serve_core

    core = serve_core("--speculative", "mtp:2", "--spec-policy", "always")
    text = "def read(path):\n    with open(path) as f:\n        return f.read()\n\n\ndef write("
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    req = core.add_request(core.tokenizer.encode(text), params)
    while core.has_work:
        core.step()
    stats = core.stats()
    print({k: v for k, v in stats.items() if k.startswith("spec_")})
    assert len(req.output) == 48 and stats["spec_drafted_tokens"] > 0
    assert stats["spec_accepted_tokens"] > 0.3 * stats["spec_drafted_tokens"]


def test_the_recorded_numbers_say_it_learned_and_reads_past_the_window():
    for kind in ("code", "english", "chat"):
        k = METRICS[kind]
        assert k["bits_per_byte"] < 0.75 * k["byte_unigram_bits_per_byte"], kind
        assert k["bits_per_byte"] < k["token_unigram_bits_per_byte"], kind
    # the compressed caches carry code past the window (two standard errors; the English
    # held-out set is too small to tell, and a conversation is shorter than the window)
    gap = METRICS["code"]["beyond_window"]
    assert gap["gap_bits_per_byte"] > 2 * gap["gap_stderr_bits_per_byte"] > 0


def test_it_is_the_default_without_model_flags():
    args = argparse.Namespace(model=None)
    choose_model(args)
    assert args.model == str(DEFAULT_MODEL)
    args = argparse.Namespace(model="elsewhere")
    choose_model(args)
    assert args.model == "elsewhere"


def test_generate_local_serves_it_and_the_chat_turns_tokenize_to_single_ids():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    ids = tok.encode(encode_chat([{"role": "user", "content": "hi"}]), add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-2:] == [3, 5] and 2 in ids
    out = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "generate", "--local",
                          "def read(path):\n    with open(path) as f:\n", "--max-tokens", "24",
                          "--temperature", "0.8", "--seed", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout.rstrip("\n")
    print(repr(text))
    assert sum(c.isalpha() for c in text) >= 8, text
