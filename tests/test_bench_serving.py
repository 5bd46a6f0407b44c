"""bench/engine/serve_burst.py (engine serve over gRPC) and bench/gateway/serving.py (a mesh under Poisson
arrivals over the HTTP API) run end to end at toy sizes and write their reports. Their
figures are timings; this checks the scripts, and that every request was served in full."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=400)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    return run


def test_serve_burst_compares_engine_settings_in_one_run():
    run = _run("-m", "bench.engine.serve_burst", "--requests", "3", "--prompt-tokens", "40", "--tokens",
               "4", "--beside-streams", "2", "--beside-tokens", "300", "--flags", "",
               "--flags", "--step-slo-ms 0")
    report = json.loads((ROOT / "bench/out/serve_burst.json").read_text())["results"]
    assert set(report) == {"defaults", "--step-slo-ms 0"}
    for res in report.values():
        for phase in ("sequential", "burst"):
            assert res[phase]["tokens"] == 3 * 4          # every request served in full
            assert res[phase]["tok_s"] > 0 and res[phase]["ttft_p50_ms"] > 0
        assert res["sequential"]["peak_decoding"] == 1
        assert 1 <= res["burst"]["peak_decoding"] <= 3
        assert res["beside"]["ttft_ms"] > 0 and res["beside"]["alone_p50_ms"] > 0
    assert "burst / sequential" in run.stdout
    assert (ROOT / "bench/out/serve_burst.png").stat().st_size > 1000


def test_serving_sends_poisson_arrivals_over_the_http_api():
    run = _run("-m", "bench.gateway.serving", "--rates", "5", "--requests", "3", "--prompt-tokens", "30",
               "--tokens", "4")
    (res,) = json.loads((ROOT / "bench/out/serving.json").read_text())["results"]
    assert res["rate"] == 5 and res["requests"] == 3
    assert res["tok_s"] > 0 and res["ttft_p50_ms"] > 0 and res["itl_p50_ms"] > 0
    assert "TTFT p99 ms" in run.stdout
    assert (ROOT / "bench/out/serving.png").stat().st_size > 1000
