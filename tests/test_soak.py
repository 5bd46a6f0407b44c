"""bench/gateway/soak.py end to end: a short soak in the default run keeps the harness honest;
the 300-request fault run of the reliability work is `slow` (about 4 minutes; the
migration and failover tests in tests/gateway cover its behaviours in the default run)."""

from __future__ import annotations

import json

import pytest

from bench.common import OUT
from bench.gateway import soak


def test_short_soak_passes_and_reports(capsys):
    # 18 s is all warm-up for RSS (torch grows its pools): RSS growth is judged by the
    # 30-minute soak, not here.
    rc = soak.main(["--streams", "4", "--minutes", "0.3", "--sample-every", "5",
                    "--cancel-rate", "0.3", "--rss-limit", "1.0"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    data = json.loads((OUT / "soak_4x0.3m.json").read_text())
    assert sum(data["by_status"].values()) > 4
    assert data["failed"] == [] and data["tracebacks"] == []
    assert all(s == 0 and b == 0 for s, b in data["leftovers"])
    assert (OUT / "soak_4x0.3m.png").stat().st_size > 10_000
    # each sample has both engines' snapshot stores, never past their bound (--cache-mib 16)
    stores = [mb for _, per in data["snapshot_mb"] for mb in per.values()]
    assert stores and len(data["snapshot_mb"]) == len(data["samples"])
    assert max(stores) <= 16 and set(data["rss_start"]) == set(data["rss_growth"])
    assert "PASS" in out


@pytest.mark.slow
def test_fault_run_has_no_failed_requests(capsys):
    """300 requests at 40 streams; an engine SIGKILLed and restarted, Valkey killed and
    restarted empty, an engine SIGSTOPped for 15 s."""
    rc = soak.main(["--streams", "40", "--minutes", "3", "--requests", "300", "--faults",
                    "--cancel-rate", "0", "--rss-limit", "1.0"])
    out = capsys.readouterr().out
    data = json.loads((OUT / "soak_40x3m_faults.json").read_text())
    assert data["failed"] == [], data["failed"][:5]
    assert data["by_status"] == {"OK": 300}
    assert len(data["faults"]) == 6
    assert rc == 0, out[-3000:]
