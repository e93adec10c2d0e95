"""Helpers shared by the e2e tests: SSE parsing, error-shape checks, /metrics parsing."""

from __future__ import annotations

import json
import time
from typing import Iterator

import requests
from prometheus_client.parser import text_string_to_metric_families

# The embedded model (configs/embedded-qwen3-moe.json and the byte tokenizer).
VOCAB_SIZE = 259
ENDOFTEXT, IM_START, IM_END = 256, 257, 258
EOS_IDS = {IM_END, ENDOFTEXT}
NUM_MOE_LAYERS = 4
TOP_K = 2
NUM_EXPERTS = 8
CONTEXT_LEN = 4096
MAX_N = 64
MAX_TOP_LOGPROBS = 20
# --max-request-bytes of the small_body_server fixture.
SMALL_BODY_LIMIT = 2048


def byte_len(text: str) -> int:
    """Prompt tokens of `text` under the byte tokenizer (no special-token text inside)."""
    return len(text.encode())


def sse_events(resp: requests.Response) -> Iterator[object]:
    """The `data:` payloads of an SSE response: parsed JSON objects, or the string "[DONE]"."""
    assert resp.status_code == 200, resp.text
    assert resp.headers.get("content-type", "").startswith("text/event-stream"), resp.headers
    for raw in resp.iter_lines(decode_unicode=False):
        if not raw:
            continue
        line = raw.decode()
        if line.startswith(":"):
            continue
        assert line.startswith("data:"), f"unexpected SSE line {line!r}"
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            yield "[DONE]"
        else:
            yield json.loads(data)


def read_stream(resp: requests.Response) -> list[dict]:
    """Every JSON frame of a complete stream; asserts it ends with exactly one [DONE]."""
    frames: list[dict] = []
    done = 0
    for ev in sse_events(resp):
        if ev == "[DONE]":
            done += 1
            continue
        assert done == 0, "a frame after [DONE]"
        assert "error" not in ev, ev
        frames.append(ev)
    assert done == 1, "the stream did not end with data: [DONE]"
    return frames


def assert_error(resp: requests.Response, status: int | tuple[int, ...], field: str | None = None):
    """The OpenAI error shape with the expected status; the message names `field` if given."""
    statuses = status if isinstance(status, tuple) else (status,)
    assert resp.status_code in statuses, (resp.status_code, resp.text)
    assert 400 <= resp.status_code < 500
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    for key in ("message", "type", "code"):
        assert key in err, f"error object lacks {key}: {body}"
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    assert err["code"] is not None, body
    if field is not None:
        assert field.lower() in err["message"].lower(), (
            f"error message does not name {field!r}: {err['message']!r}"
        )
    return err


def metric_families(base_url: str) -> dict:
    """/metrics parsed by prometheus_client's text parser: {family name: family}."""
    r = requests.get(base_url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def gauge(base_url: str, name: str) -> float:
    fams = metric_families(base_url)
    assert name in fams, f"{name} missing from /metrics: {sorted(fams)}"
    samples = [s for s in fams[name].samples if s.name == name]
    assert len(samples) == 1, samples
    return samples[0].value


def post(url: str, **kw) -> requests.Response:
    kw.setdefault("timeout", 120)
    return requests.post(url, **kw)


def wait_until(pred, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def wait_idle(base_url: str, timeout: float = 60.0) -> dict:
    """Until no request runs or waits and no KV block is held (the idle values are 0)."""
    names = ("lockstep_kv_blocks_used", "lockstep_num_running_reqs", "lockstep_num_queue_reqs")
    deadline = time.monotonic() + timeout
    vals: dict = {}
    while True:
        fams = metric_families(base_url)
        vals = {n: fams[n].samples[0].value for n in names}
        if all(v == 0 for v in vals.values()):
            return vals
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout}s: {vals}")
        time.sleep(0.2)
