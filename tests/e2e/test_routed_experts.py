"""return_routed_experts: base64 of int32 [tokens - 1, moe_layers, top_k] expert ids, only with
--enable-return-routed-experts."""

from __future__ import annotations

import base64
import struct

import pytest
import requests

from e2e_util import NUM_EXPERTS, NUM_MOE_LAYERS, TOP_K, assert_error, read_stream

PER_TOKEN = NUM_MOE_LAYERS * TOP_K


def decode(b64: str) -> list[int]:
    raw = base64.b64decode(b64, validate=True)
    assert len(raw) % 4 == 0
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def check_routing(experts: list[int], prompt_len: int, completion_len: int):
    positions = prompt_len + completion_len - 1
    assert len(experts) == positions * PER_TOKEN
    assert all(0 <= e < NUM_EXPERTS for e in experts), sorted(set(experts))
    # Each token goes to top_k distinct experts in every layer.
    for i in range(0, len(experts), TOP_K):
        assert len(set(experts[i:i + TOP_K])) == TOP_K, experts[i:i + TOP_K]


def generate(srv, **body):
    r = requests.post(srv.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_routed_experts_generate(routed_server):
    prompt = "route these tokens please"
    out = generate(routed_server, text=prompt, return_routed_experts=True,
                   sampling_params={"max_new_tokens": 7, "ignore_eos": True, "temperature": 0})
    m = out["meta_info"]
    experts = decode(m["routed_experts"])
    check_routing(experts, len(prompt), 7)
    if "routed_experts_shape" in m:
        assert m["routed_experts_shape"] == [len(prompt) + 7 - 1, NUM_MOE_LAYERS, TOP_K]
    # Deterministic: the same greedy request routes the same way.
    again = generate(routed_server, text=prompt, return_routed_experts=True,
                     sampling_params={"max_new_tokens": 7, "ignore_eos": True, "temperature": 0})
    assert decode(again["meta_info"]["routed_experts"]) == experts
    assert again["output_ids"] == out["output_ids"]


def test_routed_experts_not_returned_unless_asked(routed_server):
    out = generate(routed_server, text="abc", sampling_params={"max_new_tokens": 2})
    assert "routed_experts" not in out["meta_info"]


def test_routed_experts_with_cached_prefix(routed_server):
    """A prompt already in the prefix cache is still routed in full (no placeholder ids)."""
    prompt = "a prompt long enough to fill a couple of KV blocks of sixteen tokens each"
    generate(routed_server, text=prompt, sampling_params={"max_new_tokens": 1})
    out = generate(routed_server, text=prompt, return_routed_experts=True,
                   sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    check_routing(decode(out["meta_info"]["routed_experts"]), len(prompt), 3)


def test_routed_experts_batch_n_and_stream(routed_server):
    outs = generate(routed_server, text=["ab", "cdef"], return_routed_experts=True,
                    sampling_params={"max_new_tokens": 4, "ignore_eos": True, "n": 2,
                                     "sampling_seed": 1})
    assert len(outs) == 4
    for o in outs:
        check_routing(decode(o["meta_info"]["routed_experts"]), o["meta_info"]["prompt_tokens"], 4)
    body = {"text": "stream", "stream": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    with requests.post(routed_server.url + "/generate", json=body, stream=True, timeout=60) as r:
        frames = read_stream(r)
    check_routing(decode(frames[-1]["meta_info"]["routed_experts"]), 6, 5)


def test_routed_experts_openai(routed_server):
    r = requests.post(routed_server.url + "/v1/completions", json={
        "prompt": "hello", "max_tokens": 4, "ignore_eos": True, "return_routed_experts": True},
        timeout=60)
    assert r.status_code == 200, r.text
    check_routing(decode(r.json()["choices"][0]["routed_experts"]), 5, 4)
    r = requests.post(routed_server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True,
        "return_routed_experts": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    check_routing(decode(body["choices"][0]["routed_experts"]), body["usage"]["prompt_tokens"], 3)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "a", "return_routed_experts": True}),
    ("/v1/completions", {"prompt": "a", "return_routed_experts": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "return_routed_experts": True}),
])
def test_routed_experts_refused_without_flag(server, path, body):
    r = server.post(path, json=body)
    assert_error(r, 400, "return_routed_experts")
    assert server.get("/health").status_code == 200
