"""The OpenAI API through the official `openai` client: completions, chat, streaming with
usage, logprobs shapes and /v1/models. The embedded model speaks nonsense, so these assert
structure, counts and determinism, never text."""

from __future__ import annotations

import math

import pytest
import requests

from e2e_util import byte_len, read_stream

MODEL = "lockstep-embedded"
# The embedded ChatML template: <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n
# where each special token is one id and every other byte one id.


def chat_prompt_tokens(messages: list[dict]) -> int:
    n = 0
    for m in messages:
        n += 1 + byte_len(m["role"] + "\n" + m["content"]) + 1 + 1  # im_start, text, im_end, \n
    return n + 1 + byte_len("assistant\n")


def test_models_lists_the_served_model(client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL]
    assert models.data[0].object == "model"


def test_completion_non_streaming_usage(client):
    prompt = "The quick brown fox"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion"
    assert r.model == MODEL
    assert r.id
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert c.finish_reason == "length"
    assert isinstance(c.text, str)
    assert r.usage.prompt_tokens == byte_len(prompt)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == byte_len(prompt) + 7


def test_completion_greedy_is_deterministic_and_matches_generate(client, server):
    kw = dict(model=MODEL, prompt="determinism", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    g = server.post("/generate", json={
        "text": "determinism",
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }).json()
    assert g["text"] == a.choices[0].text


def test_completion_n_and_batch_prompts(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, n=3, seed=5,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.prompt_tokens == 3
    assert r.usage.completion_tokens == 9
    # A list of prompts gets one choice per prompt.
    r = client.completions.create(model=MODEL, prompt=["a", "bb"], max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 2
    assert r.usage.completion_tokens == 4


def test_completion_token_id_prompt(client):
    r = client.completions.create(model=MODEL, prompt=[72, 105, 33], max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 3
    assert r.usage.completion_tokens == 4


def test_completion_echo(client):
    r = client.completions.create(model=MODEL, prompt="echo me", max_tokens=3, temperature=0,
                                  echo=True, extra_body={"ignore_eos": True})
    assert r.choices[0].text.startswith("echo me")


def test_completion_streaming_with_usage(client):
    prompt = "stream this"
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1, "exactly one chunk carries usage"
    assert chunks[-1] is usage_chunks[0], "the usage chunk comes last"
    assert usage_chunks[0].choices == []
    u = usage_chunks[0].usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
        byte_len(prompt), 9, byte_len(prompt) + 9)
    text_chunks = [c for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in text_chunks if c.choices[0].finish_reason]
    assert finishes == ["length"]
    streamed = "".join(c.choices[0].text for c in text_chunks)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert streamed.rstrip("\ufffd") == full.choices[0].text.rstrip("\ufffd")  # adapted, see below


def test_completion_streaming_without_usage_has_none(client):
    chunks = list(client.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in chunks)
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1


def test_chat_non_streaming_usage(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert len(r.choices) == 1
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert isinstance(msg.content, str)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == chat_prompt_tokens(messages)
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_chat_max_completion_tokens_and_n(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4, n=2,
        seed=3, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2
    assert r.usage.completion_tokens == 8
    assert {c.finish_reason for c in r.choices} == {"length"}


def test_chat_streaming_with_usage(client):
    messages = [{"role": "user", "content": "count"}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    u = chunks[-1].usage
    assert chunks[-1].choices == []
    assert u is not None
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
        chat_prompt_tokens(messages), 8, chat_prompt_tokens(messages) + 8)
    assert sum(1 for c in chunks if c.usage is not None) == 1
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    # Adapted (see test_streamed_text_equals_non_streamed_text): the text the detokenizer
    # flushes at the end (held-back partial UTF-8 -> U+FFFD) is missing from the stream.
    assert content.rstrip("\ufffd") == full.choices[0].message.content.rstrip("\ufffd")


def test_streamed_text_equals_non_streamed_text(client):
    messages = [{"role": "user", "content": "count"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    assert full.endswith("\ufffd"), "the repro needs output ending in a partial UTF-8 sequence"
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(stream=True, **kw) if c.choices)
    assert streamed == full


def test_chat_seed_reproducible(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "roll"}], max_tokens=10,
              temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def check_logprob(v):
    assert isinstance(v, float) and math.isfinite(v) and v <= 0.0


def test_completion_logprobs_shape(client):
    k = 3
    r = client.completions.create(model=MODEL, prompt="logprobs", max_tokens=5, temperature=0,
                                  logprobs=k, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for v in lp.token_logprobs:
        check_logprob(v)
    assert lp.text_offset == sorted(lp.text_offset)
    distinct = 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # Keys are token strings; distinct byte tokens may decode to the same string (U+FFFD),
        # so the dict can hold fewer than k entries (adapted: see the xfail below).
        assert 1 <= len(top) <= k
        for v in top.values():
            check_logprob(v)
        if len(top) == k:
            distinct += 1
            # Greedy: the chosen token is the most likely one.
            assert max(top.values()) == pytest.approx(chosen, abs=1e-5)
    assert distinct >= 1


def test_completion_top_logprobs_keep_the_greedy_token(client):
    r = client.completions.create(model=MODEL, prompt="logprobs", max_tokens=5, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)


def test_chat_logprobs_shape(client):
    k = 4
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=k, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert isinstance(e.token, str)
        assert isinstance(e.bytes, list) and all(0 <= b < 256 for b in e.bytes)
        check_logprob(e.logprob)
        assert len(e.top_logprobs) == k
        vals = [t.logprob for t in e.top_logprobs]
        for v in vals:
            check_logprob(v)
        assert vals == sorted(vals, reverse=True)
        assert vals[0] == pytest.approx(e.logprob, abs=1e-5)


def test_chat_logprobs_bytes_are_the_token_bytes(client, server):
    # Every non-special token of the byte tokenizer is exactly one byte; OpenAI's `bytes` exists
    # precisely so that tokens which are not valid UTF-8 on their own can be reassembled.
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=24, temperature=0,
        logprobs=True, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes) for e in content)
    assert all(len(e.bytes) == 1 for e in content), [e.bytes for e in content]
    assert joined.decode(errors="replace") == r.choices[0].message.content


def test_chat_without_logprobs_has_none(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2)
    assert r.choices[0].logprobs is None


def test_chat_streaming_logprobs(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == 4
    for e in entries:
        check_logprob(e.logprob)
        assert len(e.top_logprobs) == 2


def test_openai_stop_and_extensions(client, server):
    # Greedy output first; then stop at a printable ASCII character that appears in it.
    base = dict(model=MODEL, prompt="stop test prompt", temperature=0)
    full = client.completions.create(max_tokens=48, extra_body={"ignore_eos": True}, **base)
    text = full.choices[0].text
    cands = [ch for ch in text if ch.isascii() and ch.isprintable()]
    if not cands:
        pytest.skip("greedy output has no printable ASCII character to stop at")
    ch = cands[0]
    r = client.completions.create(max_tokens=48, stop=[ch], extra_body={"ignore_eos": True}, **base)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(ch)]
    # SGLang extensions pass through: top_k=1 at temperature 1 is greedy.
    r = client.completions.create(max_tokens=48, extra_body={"top_k": 1, "ignore_eos": True},
                                  **{**base, "temperature": 1.0})
    assert r.choices[0].text == text
    # stop_token_ids (not combined with ignore_eos, which disables them as in SGLang).
    g = server.post("/generate", json={"text": "stop test prompt", "sampling_params": {
        "max_new_tokens": 48, "temperature": 0}}).json()
    ids = g["output_ids"]
    assert len(ids) > 4, g
    stop_id = ids[3]
    r = client.completions.create(max_tokens=48, extra_body={"stop_token_ids": [stop_id]}, **base)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == ids.index(stop_id) + 1


def test_unknown_fields_are_ignored_openai(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "user": "u", "logit_bias": {},
            "frobnicate": {"deep": [1, 2]}, "suffix": None}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    body = {"model": "some-other-name", "messages": [{"role": "user", "content": "x", "name": "n"}],
            "max_tokens": 2, "parallel_tool_calls": False, "whatever": 1}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


def test_raw_sse_framing_openai(server):
    with requests.post(server.url + "/v1/completions", json={
        "prompt": "x", "max_tokens": 3, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}}, stream=True, timeout=60) as r:
        frames = read_stream(r)
    assert frames[-1]["usage"]["completion_tokens"] == 3
