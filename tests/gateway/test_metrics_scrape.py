"""Every service's /metrics on a real mesh (two engines, gateway, kvstore, directory): types,
vLLM's names on the engines, and each family only on the services that produce it."""

from __future__ import annotations

import urllib.request

from tests.gateway.conftest import wait_for


def test_engine_metrics_are_typed_and_carry_vllms_names(gw, mesh):
    """Stats that only grow are counters, levels gauges; the names a vLLM dashboard queries
    are on every engine, labelled by the served model, and the latency histograms count."""
    from prometheus_client.parser import text_string_to_metric_families

    for i in range(4):
        gw.generate(f"typed metrics {i}", max_tokens=4, temperature=0.0)

    def families(name):
        body = urllib.request.urlopen(mesh.endpoints[f"{name}-metrics"], timeout=5).read()
        return {f.name: f for f in text_string_to_metric_families(body.decode())}

    def ttft_count():
        return sum(s.value for n in mesh.engine_names
                   for s in families(n)["vllm:time_to_first_token_seconds"].samples
                   if s.name.endswith("_count"))

    assert wait_for(lambda: ttft_count() >= 4), ttft_count()

    def finished(name):        # generations a phase histogram counted, over both engines
        return sum(s.value for n in mesh.engine_names for s in families(n)[name].samples
                   if s.name.endswith("_count"))

    for phase in ("queue", "prefill", "decode", "inference"):
        assert wait_for(lambda p=phase: finished(f"vllm:request_{p}_time_seconds") >= 4), phase
    from kvmesh.shipped import DEFAULT_MODEL

    model = DEFAULT_MODEL.resolve().name       # the served name: the checkpoint directory's
    for n in mesh.engine_names:
        fams = families(n)
        assert fams["kvmesh_engine_requests"].type == "counter"
        assert fams["kvmesh_engine_generated_tokens"].type == "counter"
        assert fams["kvmesh_engine_running"].type == "gauge"
        for name, kind in (("vllm:num_requests_running", "gauge"),
                           ("vllm:num_requests_waiting", "gauge"),
                           ("vllm:kv_cache_usage_perc", "gauge"),
                           ("vllm:prompt_tokens", "counter"),
                           ("vllm:generation_tokens", "counter"),
                           ("vllm:prefix_cache_queries", "counter"),
                           ("vllm:prefix_cache_hits", "counter"),
                           ("vllm:time_to_first_token_seconds", "histogram"),
                           ("vllm:inter_token_latency_seconds", "histogram"),
                           ("vllm:e2e_request_latency_seconds", "histogram"),
                           ("vllm:request_queue_time_seconds", "histogram"),
                           ("vllm:request_prefill_time_seconds", "histogram"),
                           ("vllm:request_decode_time_seconds", "histogram"),
                           ("vllm:request_inference_time_seconds", "histogram"),
                           ("vllm:request_success", "counter")):
            assert fams[name].type == kind, (n, name)
            labels = {s.labels.get("model_name") for s in fams[name].samples}
            # (a histogram has samples once its engine served a generation)
            assert (labels or kind == "histogram") and None not in labels, (n, name, labels)
            assert labels <= {model}, labels
    pages = [families(n) for n in ("gateway", "kvstore", "directory")]
    assert not any(name.startswith("vllm:") for page in pages for name in page)
    for page in (*pages[1:], families(mesh.engine_names[0])):     # the gateway's own
        assert not {"kvmesh_retries", "kvmesh_migrations"} & set(page), set(page)
    assert {"kvmesh_retries", "kvmesh_migrations", "kvmesh_tokens"} <= set(pages[0])
    for page in pages[1:]:              # tokens and TTFT: the gateway's and engines' only
        assert not {"kvmesh_tokens", "kvmesh_time_to_first_token_seconds"} & set(page)
    assert "kvmesh_time_to_first_token_seconds" in pages[0]
    # and nothing registered there but never produced: every family has samples
    for name, page in zip(("gateway", "kvstore", "directory"), pages, strict=True):
        empty = sorted(f.name for f in page.values() if not f.samples)
        assert not empty, (name, empty)
    kvstore = pages[1]
    assert kvstore["kvmesh_kvstore_gc_deleted"].type == "counter"
    assert kvstore["kvmesh_kvstore_shard_reads_hedged"].type == "counter"
    assert kvstore["kvmesh_kvstore_durable_bytes"].type == "gauge"
