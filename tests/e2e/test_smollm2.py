"""The same server on a real model, SmolLM2-135M-Instruct, when scripts/fetch_test_assets.sh has
put it in .cache/assets/smollm2-135m (skipped otherwise). A real model lets these tests assert
what it says: greedy decoding of "The capital of France is" continues with " Paris"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from conftest import REPO, Server
from e2e_util import read_stream

MODEL_DIR = Path(os.environ.get("LOCKSTEP_SMOLLM2_DIR", REPO / ".cache" / "assets" / "smollm2-135m"))
NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def smol():
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.skip(f"{MODEL_DIR} is missing; run scripts/fetch_test_assets.sh")
    srv = Server(["--model-path", str(MODEL_DIR)], "smollm2")
    try:
        srv.start()
        yield srv
    finally:
        srv.close()


def test_models_and_info(smol):
    ids = [m.id for m in smol.openai().models.list().data]
    assert ids == [NAME]
    info = smol.get("/get_model_info").json()
    assert info["served_model_name"] == NAME


def test_completion_says_paris(smol):
    r = smol.openai().completions.create(model=NAME, prompt="The capital of France is",
                                         max_tokens=4, temperature=0)
    assert r.choices[0].text.startswith(" Paris"), r.choices[0].text
    assert r.usage.prompt_tokens == 5
    assert r.usage.completion_tokens == 4


def test_generate_stop_string_and_logprobs(smol):
    out = smol.post("/generate", json={
        "text": "The capital of France is", "return_logprob": True, "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop": ["."]}}).json()
    assert out["text"] == " Paris"
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "."}
    first = out["meta_info"]["output_top_logprobs"][0]
    assert first[0][1] == out["output_ids"][0]
    assert [e[0] for e in first] == sorted((e[0] for e in first), reverse=True)


def test_chat_answers_and_streams_the_same(smol):
    c = smol.openai()
    kw = dict(model=NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
              max_tokens=16, temperature=0)
    full = c.chat.completions.create(**kw)
    content = full.choices[0].message.content
    assert "Paris" in content
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_generate_stream_matches(smol):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4,
                                                                   "temperature": 0}}
    plain = smol.post("/generate", json=body).json()
    with requests.post(smol.url + "/generate", json={**body, "stream": True}, stream=True,
                       timeout=120) as r:
        frames = read_stream(r)
    assert frames[-1]["text"] == plain["text"]
    assert frames[-1]["output_ids"] == plain["output_ids"]
