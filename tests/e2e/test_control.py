"""Control endpoints: model/server info, weight version, flush_cache, pause/continue and
abort_request, in SGLang's {"success", "message"} shape."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from e2e_util import (CONTEXT_LEN, MAX_N, MAX_TOP_LOGPROBS, NUM_MOE_LAYERS, VOCAB_SIZE,
                      assert_error, post, read_stream, sse_events, wait_idle,
                      wait_until)


def test_get_model_info(server):
    r = server.get("/get_model_info")
    assert r.status_code == 200
    info = r.json()
    assert info["served_model_name"] == "lockstep-embedded"
    assert info["is_generation"] is True
    assert info["weight_version"] == "default"
    assert info["vocab_size"] == VOCAB_SIZE
    assert info["num_moe_layers"] == NUM_MOE_LAYERS
    assert "model_path" in info


def test_get_server_info(server):
    info = server.get("/get_server_info").json()
    assert info["context_length"] == CONTEXT_LEN
    assert info["max_n"] == MAX_N
    assert info["max_top_logprobs"] == MAX_TOP_LOGPROBS
    assert info["weight_version"] == "default"
    assert info["paused"] is False
    assert info["kv_blocks_total"] > 0
    assert info["page_size"] == 16


def test_get_weight_version(server):
    r = server.get("/get_weight_version")
    assert r.status_code == 200
    assert r.json() == {"weight_version": "default"}


def test_health_generate(server):
    assert server.get("/health_generate").status_code == 200


def test_flush_cache_when_idle(server):
    wait_idle(server.url, timeout=30)
    for method in ("post", "get"):
        r = getattr(requests, method)(server.url + "/flush_cache", timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["success"] is True and isinstance(body["message"], str)


def start_long_stream(url: str, rid: str, tokens: int = 3000) -> requests.Response:
    r = requests.post(url + "/generate", stream=True, timeout=60, json={
        "text": "a long one", "rid": rid, "stream": True,
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r


def finish_of(events) -> dict:
    """Reads the rest of a /generate stream; returns the last frame."""
    last = None
    for ev in events:
        if ev == "[DONE]":
            break
        assert "error" not in ev, ev
        last = ev
    assert last is not None
    return last


def test_flush_cache_refused_while_running(server):
    r = start_long_stream(server.url, "flush-blocker")
    try:
        events = sse_events(r)
        next(events)
        resp = server.post("/flush_cache")
        assert_error(resp, 409)
        server.post("/abort_request", json={"rid": "flush-blocker"})
        last = finish_of(events)
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        r.close()
    wait_idle(server.url, timeout=30)
    assert server.post("/flush_cache").status_code == 200


def test_abort_request_by_rid(server):
    r = start_long_stream(server.url, "abort-me")
    try:
        events = sse_events(r)
        first = next(events)
        assert first["meta_info"]["id"] == "abort-me"
        resp = server.post("/abort_request", json={"rid": "abort-me"})
        assert resp.status_code == 200
        assert resp.json()["success"] is True
        last = finish_of(events)
    finally:
        r.close()
    fr = last["meta_info"]["finish_reason"]
    assert fr["type"] == "abort"
    assert isinstance(fr.get("message"), str)
    assert last["meta_info"]["completion_tokens"] < 3000
    wait_idle(server.url, timeout=30)


def test_abort_request_non_streaming_and_abort_all(server):
    results = {}

    def run(rid):
        results[rid] = post(server.url + "/generate", json={
            "text": "abort all", "rid": rid,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})

    threads = [threading.Thread(target=run, args=(f"all-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: server.get("/get_server_info").json()["num_running_reqs"] >= 2, 30,
               what="two running requests")
    resp = server.post("/abort_request", json={"abort_all": True})
    assert resp.status_code == 200 and resp.json()["success"] is True
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    for rid, r in results.items():
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert r.json()["meta_info"]["id"] == rid


@pytest.fixture
def unpause(server):
    yield
    server.post("/continue_generation")


def test_request_sent_while_paused_completes_after_continue(server, unpause):
    wait_idle(server.url, timeout=30)
    r = server.post("/pause_generation", json={"mode": "in_place"})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    assert server.get("/get_server_info").json()["paused"] is True
    result = {}

    def run():
        result["r"] = server.post("/generate", json={
            "text": "while paused", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True,
                                                        "temperature": 0}})

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.7)
    assert t.is_alive(), "a request must not run while generation is paused"
    assert "r" not in result
    r = server.post("/continue_generation")
    assert r.status_code == 200 and r.json()["success"] is True
    t.join(60)
    assert not t.is_alive()
    out = result["r"]
    assert out.status_code == 200, out.text
    assert len(out.json()["output_ids"]) == 5
    assert out.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert server.get("/get_server_info").json()["paused"] is False


def test_pause_abort_mode_aborts_running(server, unpause):
    r = start_long_stream(server.url, "pause-abort")
    try:
        events = sse_events(r)
        next(events)
        resp = server.post("/pause_generation", json={"mode": "abort"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["num_paused_requests"] >= 1
        last = finish_of(events)
    finally:
        r.close()
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    server.post("/continue_generation")
    wait_idle(server.url, timeout=30)


def test_pause_retract_then_continue_finishes_the_same_tokens(server, unpause):
    body = {"text": "retract me", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True,
                                                      "temperature": 0}}
    reference = server.post("/generate", json=body).json()["output_ids"]
    r = requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True,
                      timeout=120)
    try:
        events = sse_events(r)
        for _ in range(3):
            next(events)
        resp = server.post("/pause_generation", json={"mode": "retract"})
        assert resp.status_code == 200, resp.text
        time.sleep(0.3)
        assert server.post("/continue_generation").status_code == 200
        last = finish_of(events)
    finally:
        r.close()
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    assert last["output_ids"] == reference


def test_stream_frames_survive_everything_above(server):
    """A final sanity check that the shared server still answers after the control tests."""
    with requests.post(server.url + "/generate", stream=True, timeout=60, json={
            "text": "ok", "stream": True, "sampling_params": {"max_new_tokens": 2,
                                                              "ignore_eos": True}}) as r:
        frames = read_stream(r)
    assert frames[-1]["meta_info"]["completion_tokens"] == 2
