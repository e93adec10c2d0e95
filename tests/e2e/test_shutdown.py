"""Graceful shutdown on SIGTERM: stop accepting, let in-flight requests finish within the
grace period (abort what is left after it), exit 0."""

from __future__ import annotations

import signal
import threading

import requests

from e2e_util import post, sse_events, wait_until


def health_after_shutdown(url: str) -> str:
    """'503' or 'refused': both mean the server no longer takes work."""
    try:
        r = requests.get(url + "/health", timeout=3)
    except (requests.ConnectionError, requests.Timeout):
        return "refused"
    return str(r.status_code)


def test_sigterm_finishes_in_flight_requests_and_exits_0(fresh_server):
    srv = fresh_server("--grace-period-s", "30", name="shutdown")
    n_stream, n_plain = 600, 300
    stream = requests.post(srv.url + "/generate", stream=True, timeout=120, json={
        "text": "in flight", "stream": True,
        "sampling_params": {"max_new_tokens": n_stream, "ignore_eos": True}})
    assert stream.status_code == 200
    events = sse_events(stream)
    first = next(events)
    assert first["meta_info"]["finish_reason"] is None

    plain = {}

    def run_plain():
        plain["r"] = post(srv.url + "/generate", timeout=120, json={
            "text": "also in flight", "sampling_params": {"max_new_tokens": n_plain,
                                                          "ignore_eos": True}})

    t = threading.Thread(target=run_plain)
    t.start()
    wait_until(lambda: srv.get("/get_server_info").json()["num_running_reqs"] >= 2, 30,
               interval=0.01, what="both requests running")

    srv.proc.send_signal(signal.SIGTERM)
    # While the in-flight requests finish, no new work is taken. The signal reaches the
    # server asynchronously, so wait for it to be seen (the stream below is still running).
    wait_until(lambda: health_after_shutdown(srv.url) in ("503", "refused"), 10,
               interval=0.01, what="the server to stop taking work")

    last = None
    done = False
    for ev in events:
        if ev == "[DONE]":
            done = True
            break
        last = ev
    stream.close()
    assert done, "the stream was cut instead of finishing"
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": n_stream}
    assert len(last["output_ids"]) == n_stream

    t.join(60)
    assert not t.is_alive()
    r = plain["r"]
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": n_plain}

    code = srv.proc.wait(timeout=30)
    assert code == 0, srv.log_text()[-4000:]
    assert health_after_shutdown(srv.url) in ("503", "refused")


def test_sigterm_aborts_what_outlives_the_grace_period(fresh_server):
    srv = fresh_server("--grace-period-s", "1", name="shutdown-grace")
    stream = requests.post(srv.url + "/generate", stream=True, timeout=120, json={
        "text": "too long", "stream": True,
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})
    events = sse_events(stream)
    next(events)
    srv.proc.send_signal(signal.SIGTERM)
    last = None
    for ev in events:
        if ev == "[DONE]":
            break
        last = ev
    stream.close()
    assert last is not None
    assert "error" in last or last["meta_info"]["finish_reason"]["type"] == "abort", last
    code = srv.proc.wait(timeout=30)
    assert code == 0, srv.log_text()[-4000:]
    assert health_after_shutdown(srv.url) == "refused"


def test_sigterm_when_idle_exits_0_quickly(fresh_server):
    srv = fresh_server(name="shutdown-idle")
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=10) == 0
