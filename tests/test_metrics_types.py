"""Counters are counters and vLLM's names are there (issue 43): an engine's stats that only
grow are exported as `_total` counters so `rate()` works, levels as gauges, and the same
numbers under the names a vLLM dashboard queries, labelled by the served model."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh import metrics
from kvmesh.metrics import GenerationTimes, StatsExporter, VllmEngineStats

STATS = {"requests": 7.0, "prompt_tokens": 900.0, "generated_tokens": 120.0,
         "cache_hit_tokens": 512.0, "replayed_tokens": 128.0, "running": 3.0, "waiting": 1.0,
         "blocks_in_use": 48.0, "blocks_total": 64.0, "slots_in_use": 3.0}


def families(registry) -> dict[str, tuple[str, dict]]:
    text = generate_latest(registry).decode()
    return {f.name: (f.type, {(s.name, tuple(sorted(s.labels.items()))): s.value
                              for s in f.samples})
            for f in text_string_to_metric_families(text)}


def test_stats_that_only_grow_are_counters_and_levels_gauges():
    reg = CollectorRegistry()
    StatsExporter("engine", lambda: STATS, reg, counters=lambda: {"requests", "prompt_tokens"})
    got = families(reg)
    assert got["kvmesh_engine_requests"] == ("counter", {("kvmesh_engine_requests_total", ()): 7.0})
    assert got["kvmesh_engine_prompt_tokens"][0] == "counter"
    assert got["kvmesh_engine_running"] == ("gauge", {("kvmesh_engine_running", ()): 3.0})


def test_the_engine_numbers_under_vllms_names():
    reg = CollectorRegistry()
    VllmEngineStats(lambda: STATS, lambda: "deepseek-v41-tiny", reg)
    got = families(reg)
    label = (("model_name", "deepseek-v41-tiny"),)
    want = {"vllm:num_requests_running": ("gauge", "vllm:num_requests_running", 3.0),
            "vllm:num_requests_waiting": ("gauge", "vllm:num_requests_waiting", 1.0),
            "vllm:kv_cache_usage_perc": ("gauge", "vllm:kv_cache_usage_perc", 0.75),
            "vllm:prompt_tokens": ("counter", "vllm:prompt_tokens_total", 900.0),
            "vllm:generation_tokens": ("counter", "vllm:generation_tokens_total", 120.0),
            "vllm:prefix_cache_queries": ("counter", "vllm:prefix_cache_queries_total", 900.0),
            "vllm:prefix_cache_hits": ("counter", "vllm:prefix_cache_hits_total", 384.0)}
    for family, (kind, sample, value) in want.items():
        assert got[family] == (kind, {(sample, label): value}), family


def test_generation_times_observe_ttft_gaps_and_end_to_end():
    now = [100.0]
    t = GenerationTimes("m-times", clock=lambda: now[0])
    ttft, itl, e2e = metrics.vllm_histograms()
    before = {h: h.labels("m-times")._sum.get() for h in (ttft, itl, e2e)}
    now[0] = 100.5
    t.token(1)                      # TTFT 0.5
    now[0] = 100.7
    t.token(2)                      # two tokens together: 0.1 each
    now[0] = 100.8
    t.token(1)                      # 0.1
    t.done()                        # 0.8
    sums = {h: h.labels("m-times")._sum.get() - before[h] for h in before}
    assert round(sums[ttft], 6) == 0.5
    assert round(sums[itl], 6) == 0.3
    assert round(sums[e2e], 6) == 0.8


def test_each_drafting_generation_adds_its_acceptance():
    t = GenerationTimes("m-acceptance", clock=lambda: 1.0)
    hist = metrics.spec_acceptance().labels("m-acceptance")
    before = (hist._sum.get(), sum(b.get() for b in hist._buckets))
    t.done(drafted=8, accepted=6)
    GenerationTimes("m-acceptance", clock=lambda: 1.0).done()           # drafted nothing
    after = (hist._sum.get(), sum(b.get() for b in hist._buckets))
    assert round(after[0] - before[0], 6) == 0.75 and after[1] - before[1] == 1


def test_finished_generations_count_by_vllms_finish_reason():
    counter = metrics.request_success()
    before = {r: counter.labels("m-finish", r)._value.get() for r in ("stop", "length", "abort")}
    for finish in ("stop", "stop", "length", "aborted", "handoff", ""):
        GenerationTimes("m-finish", clock=lambda: 1.0).done(finish=finish)
    got = {r: counter.labels("m-finish", r)._value.get() - before[r] for r in before}
    assert got == {"stop": 2, "length": 1, "abort": 1}     # a handoff is not an end


def test_a_finished_generation_records_its_queue_prefill_and_decode_phases():
    now = [100.0]
    t = GenerationTimes("m-phases", clock=lambda: now[0])
    hists = metrics.vllm_phase_histograms()
    before = [h.labels("m-phases")._sum.get() for h in hists]
    t.scheduled(100.2)              # waited 0.2 s for a slot
    now[0] = 100.5
    t.token(1)                      # prefill 0.3 s
    t.scheduled(100.4)              # a later admission (after a preemption) changes nothing
    now[0] = 100.8
    t.token(1)
    now[0] = 100.9
    t.done(finish="length")         # decode 0.4 s, inference 0.7 s
    got = [round(h.labels("m-phases")._sum.get() - b, 6) for h, b in zip(hists, before, strict=True)]
    assert got == [0.2, 0.3, 0.4, 0.7]
    unscheduled = GenerationTimes("m-phases", clock=lambda: now[0])
    unscheduled.token(1)
    unscheduled.done()              # never scheduled (e.g. an adopted stream without a time)
    assert [round(h.labels("m-phases")._sum.get() - b, 6) for h, b in
            zip(hists, before, strict=True)] == got
