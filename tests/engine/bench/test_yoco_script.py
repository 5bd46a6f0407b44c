"""The YOCO equivalence script runs and reports mask == compact within noise."""

import json

from examples.yoco import yoco_equiv


def test_equivalence_script(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert yoco_equiv.main(["--length", "300", "--decode", "4", "--dtype", "float64",
                            "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["pair"]: r for r in res["rows"]}
    assert rows["logits mask-compact"]["max"] < 1e-9
    assert rows["logits off-compact"]["max"] > 1e-6      # truncation is an approximation
    assert res["agree"]["mask-compact"] == 4
    assert "per-position L2 distance" in capsys.readouterr().out
