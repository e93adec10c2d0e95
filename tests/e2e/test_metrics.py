"""/metrics: Prometheus text that prometheus_client parses, with the families issue 4 names,
whose values follow the traffic."""

from __future__ import annotations

import math

import requests
from prometheus_client.parser import text_string_to_metric_families

from e2e_util import wait_idle

REQUIRED_SAMPLES = [
    "lockstep_http_requests_total",
    "lockstep_time_to_first_token_seconds_bucket",
    "lockstep_time_to_first_token_seconds_count",
    "lockstep_time_to_first_token_seconds_sum",
    "lockstep_e2e_request_latency_seconds_bucket",
    "lockstep_e2e_request_latency_seconds_count",
    "lockstep_kv_blocks_total",
    "lockstep_kv_blocks_used",
    "lockstep_num_running_reqs",
    "lockstep_num_queue_reqs",
    "lockstep_prompt_tokens_total",
    "lockstep_generation_tokens_total",
    "lockstep_preemptions_total",
    "lockstep_engine_step_seconds_bucket",
    "lockstep_engine_step_tokens_sum",
]


def scrape(url: str) -> tuple[dict, list]:
    r = requests.get(url + "/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    families = list(text_string_to_metric_families(r.text))  # raises on malformed text
    samples = [s for f in families for s in f.samples]
    return {f.name: f for f in families}, samples


def value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_parse_and_contain_required_families(server):
    server.post("/generate", json={"text": "warm the metrics",
                                   "sampling_params": {"max_new_tokens": 3}})
    families, samples = scrape(server.url)
    names = {s.name for s in samples}
    missing = [n for n in REQUIRED_SAMPLES if n not in names]
    assert not missing, f"missing from /metrics: {missing}"
    assert families["lockstep_time_to_first_token_seconds"].type == "histogram"
    assert families["lockstep_e2e_request_latency_seconds"].type == "histogram"
    assert families["lockstep_engine_step_seconds"].type == "histogram"
    assert families["lockstep_kv_blocks_total"].type == "gauge"
    for s in samples:
        assert not math.isnan(s.value), s


def test_histogram_buckets_are_cumulative(server):
    server.post("/generate", json={"text": "h", "sampling_params": {"max_new_tokens": 2}})
    _, samples = scrape(server.url)
    for h in ("lockstep_time_to_first_token_seconds", "lockstep_e2e_request_latency_seconds"):
        buckets = sorted(((float(s.labels["le"]), s.value) for s in samples
                          if s.name == h + "_bucket"), key=lambda b: b[0])
        assert buckets and buckets[-1][0] == math.inf
        counts = [c for _, c in buckets]
        assert counts == sorted(counts), f"{h} buckets not cumulative"
        assert buckets[-1][1] == value(samples, h + "_count") > 0
        assert value(samples, h + "_sum") > 0


def test_metrics_follow_traffic(server):
    wait_idle(server.url, timeout=30)
    _, before = scrape(server.url)
    prompt = "count my tokens"
    r = server.post("/generate", json={"text": prompt,
                                       "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    assert r.status_code == 200
    bad = server.post("/generate", json={"text": "x", "sampling_params": {"top_p": 7}})
    assert bad.status_code == 400
    _, after = scrape(server.url)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("lockstep_prompt_tokens_total") == len(prompt)
    assert delta("lockstep_generation_tokens_total") == 5
    assert delta("lockstep_time_to_first_token_seconds_count") == 1
    assert delta("lockstep_e2e_request_latency_seconds_count") == 1
    assert delta("lockstep_http_requests_total", endpoint="/generate", status="200") == 1
    assert delta("lockstep_http_requests_total", endpoint="/generate", status="400") == 1
    # One step for the prompt (one chunk, first token), then one per further token; the
    # refused request never reached the engine.
    for phase in ("schedule", "forward", "outputs", "finish"):
        assert delta("lockstep_engine_step_seconds_count", phase=phase) == 5, phase
    assert delta("lockstep_engine_step_tokens_count") == 5
    assert delta("lockstep_engine_step_tokens_sum") == len(prompt) + 4
    # The four steps after the prompt's decode one token each.
    assert delta("lockstep_engine_decode_step_seconds_count") == 4


def test_kv_gauges_match_server_info(server):
    wait_idle(server.url, timeout=30)
    _, samples = scrape(server.url)
    info = server.get("/get_server_info").json()
    assert value(samples, "lockstep_kv_blocks_total") == info["kv_blocks_total"] == 65536 // 16
    assert value(samples, "lockstep_kv_blocks_used") == info["kv_blocks_used"] == 0
    assert value(samples, "lockstep_num_running_reqs") == 0


def test_unknown_paths_share_one_label(server):
    for p in ("/scan/a", "/scan/b", "/scan/c"):
        assert server.get(p).status_code == 404
    _, samples = scrape(server.url)
    endpoints = {s.labels.get("endpoint") for s in samples if s.name == "lockstep_http_requests_total"}
    assert not any(e and e.startswith("/scan") for e in endpoints), endpoints
    assert value(samples, "lockstep_http_requests_total", status="404") >= 3


def test_preemptions_and_prefix_hits_are_counted(fresh_server):
    """A KV pool too small for the requests at once, admitted without a reserve
    (--schedule-conservativeness 0): preemptions happen, and /metrics and /get_server_info count
    the same number."""
    from concurrent.futures import ThreadPoolExecutor

    from e2e_util import post

    srv = fresh_server("--max-total-tokens", "256", "--page-size", "16",
                       "--schedule-conservativeness", "0", name="preempting")

    def run(i):
        r = post(srv.url + "/generate", timeout=120, json={
            "input_ids": [5 + i] * 24,
            "sampling_params": {"max_new_tokens": 60, "ignore_eos": True, "temperature": 0}})
        assert r.status_code == 200, r.text
        return len(r.json()["output_ids"])

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(run, range(6))) == [60] * 6
    wait_idle(srv.url, timeout=30)
    info = srv.get("/get_server_info").json()
    _, samples = scrape(srv.url)
    assert info["num_preemptions"] > 0, info
    assert value(samples, "lockstep_preemptions_total") == info["num_preemptions"]
