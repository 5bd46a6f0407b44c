"""Mid-stream migration on a real mesh: an engine SIGKILLed (or stopped) mid-stream, and
the client's stream goes on from another engine as if nothing happened.

The engines run in float64 with truncation off, where a cold prefill of prompt +
generated tokens reproduces the first engine's logits to ~1e-14, so greedy tokens
must be identical to an uninterrupted run.
"""

from __future__ import annotations

import urllib.request

from tests.gateway.conftest import TEST_MESH, wait_for

MESH_OVERRIDES = dict(engine_extra=(*TEST_MESH["engine_extra"], "--dtype", "float64",
                                    "--truncation", "off"))
PROMPT = "Migration keeps the stream going: " * 4
N = 160


def _serving_engine(gw, mesh):
    for name in mesh.engine_names:
        if gw.engine_stats(name).get("running", 0) >= 1:
            return name
    return None


def _kill_mid_stream(gw, mesh, prompt, **kw):
    """Stream `prompt`, SIGKILL the serving engine after the first messages, return the
    messages received before and after, then bring the engine back."""
    call = gw.stream(prompt, timeout=120, **kw)
    before = [next(call), next(call)]
    victim = wait_for(lambda: _serving_engine(gw, mesh))
    assert victim
    try:
        mesh.kill(victim)
        after = list(call)
    finally:
        mesh.restart(victim)
    return before, after


def test_killed_engine_stream_continues_identically(gw, mesh):
    reference = gw.generate(PROMPT, max_tokens=N, temperature=0.0, ignore_eos=True)
    assert len(reference.token_ids) == N and reference.migrations == 0
    before, after = _kill_mid_stream(gw, mesh, PROMPT, max_tokens=N, temperature=0.0,
                                     ignore_eos=True)
    msgs = before + after
    tokens = [t for m in msgs for t in m.token_ids]
    assert len([t for m in before for t in m.token_ids]) < N   # killed before the end
    assert tokens == list(reference.token_ids)
    assert "".join(m.text for m in msgs) == reference.text
    last = msgs[-1]
    assert last.migrations == 1 and last.finish_reason == reference.finish_reason
    assert last.usage.generated_tokens == N
    assert last.usage.prompt_tokens == reference.usage.prompt_tokens


def test_seeded_sampling_continues_identically(gw, mesh):
    kw = dict(max_tokens=N, temperature=0.8, top_k=40, seed=1234, ignore_eos=True)
    reference = gw.generate(PROMPT + " seeded", **kw)
    before, after = _kill_mid_stream(gw, mesh, PROMPT + " seeded", **kw)
    tokens = [t for m in before + after for t in m.token_ids]
    assert tokens == list(reference.token_ids)
    assert after[-1].migrations == 1


def test_migrations_are_counted_in_metrics(gw, mesh):
    text = urllib.request.urlopen(mesh.endpoints["gateway-metrics"], timeout=5).read().decode()
    line = [ln for ln in text.splitlines() if ln.startswith("kvmesh_migrations_total{")]
    assert line and float(line[0].rsplit(" ", 1)[1]) >= 2, line
