"""bench/quality/truncation.py on the shipped model: `mask` equals `compact` to float64
noise, `off` differs from them (truncation is an approximation), and the engine's greedy
tokens under mask and compact agree."""

import json

from bench.quality import truncation


def test_mask_equals_compact_and_off_is_measured(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert truncation.main(["--length", "300", "--decode", "4", "--dtype", "float64",
                            "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["pair"]: r for r in res["rows"]}
    assert rows["logits mask-compact"]["max"] < 1e-9
    assert rows["logits off-compact"]["max"] > 1e-6      # truncation is an approximation
    assert res["agree"]["mask-compact"] == 4
    assert "per-position L2 distance" in capsys.readouterr().out


def test_a_v4_checkpoint_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    assert truncation.main(["--model", str(tmp_path)]) == 2
    assert "not a DeepSeek V4.1 checkpoint" in capsys.readouterr().err
