"""The shipped checkpoint (models/v4-mini-tiny): it is the engine's default, it loads, it
matches its recorded config, and it reaches its recorded loss on a held-out slice."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.build import DEFAULT_CHECKPOINTS, checkpoint_path
from services.engine.config import TINY
from services.engine.model import weights as weights_mod
from training import evaluate

MODEL = Path(__file__).resolve().parents[3] / "models" / "v4-mini-tiny"
METRICS = json.loads((MODEL / "metrics.json").read_text())


def test_shipped_checkpoint_matches_its_config_and_recorded_loss():
    path = MODEL / "model.safetensors"
    assert path.stat().st_size <= 40 << 20
    w = weights_mod.load(path, TINY)              # refuses a config or shape mismatch
    assert METRICS["config"] == json.loads(TINY.to_json())
    loss = evaluate.slice_loss(w, TINY, evaluate.held_out_stream())
    want = METRICS["slice"]["loss_nats"]
    print(f"held-out slice: {loss:.4f} nats/byte, recorded {want:.4f}")
    assert abs(loss - want) <= 0.02 * want
    # the recorded numbers the model card quotes: well under the byte-unigram baseline
    assert METRICS["val_bits_per_byte"] < 0.75 * METRICS["unigram_bits_per_byte"]


def _args(**kw):
    base = dict(preset="tiny", checkpoint=None, random_weights=False)
    return argparse.Namespace(**{**base, **kw})


def test_shipped_checkpoint_is_the_default_random_weights_only_on_request():
    assert checkpoint_path(_args()) == DEFAULT_CHECKPOINTS["tiny"] == MODEL / "model.safetensors"
    assert checkpoint_path(_args(random_weights=True)) is None
    assert checkpoint_path(_args(checkpoint="x.safetensors")) == Path("x.safetensors")
    with pytest.raises(ValueError, match="exclude each other"):
        checkpoint_path(_args(checkpoint="x.safetensors", random_weights=True))
    with pytest.raises(ValueError, match="no shipped checkpoint"):
        checkpoint_path(_args(preset="v41-flash"))


def test_generate_local_tiny_preset_writes_text():
    """--preset tiny, no --checkpoint: the shipped V4-mini model. Sampled (its greedy
    continuation of code is spaces), it writes printable ASCII with letters, unlike random
    weights' arbitrary bytes."""
    out = subprocess.run([sys.executable, "-m", "launch.cli", "generate", "--local", "--preset",
                          "tiny", "def read(path):\n    with open(path) as f:\n", "--max-tokens", "32",
                          "--temperature", "0.8", "--seed", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout.rstrip("\n")
    print(repr(text))
    assert text.isascii() and text.replace("\n", "").isprintable()
    assert sum(c.isalpha() for c in text) >= 8, text


def test_shipped_mtp_module_reaches_its_recorded_held_out_accuracy():
    """The checkpoint's MTP module (speculative drafts): trained, and as good as recorded on
    a small held-out slice (loss within 2 %, agreement with the trunk's greedy tokens at
    draft positions 1 and 2 within 0.02)."""
    from services.engine.model import mtp
    from training.mtp import slice_metrics

    w = weights_mod.load(MODEL / "model.safetensors", TINY)
    assert mtp.has_mtp(w) and set(mtp.shapes(TINY)) <= set(w)
    got, want = slice_metrics(w, TINY, evaluate.held_out_stream()), METRICS["mtp"]["slice"]
    print(f"MTP slice: {got}")
    assert abs(got["mtp_loss"] - want["mtp_loss_nats"]) <= 0.02 * want["mtp_loss_nats"]
    for key in ("draft_agreement", "chain_agreement"):     # draft positions 1 and 2
        assert abs(got[key] - want[key]) <= 0.02, key
    held_out = METRICS["mtp"]["held_out"]
    assert held_out["draft_agreement"] > 0.7 and held_out["chain_agreement"] > 0.7
