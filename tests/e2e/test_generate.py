"""SGLang-native /generate: single, batch, token ids, n > 1 with seeds, determinism under
concurrency, streaming, logprobs, stop conditions and lengths."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from e2e_util import (EOS_IDS, MAX_TOP_LOGPROBS, VOCAB_SIZE, byte_len, post,
                      read_stream)


def gen(server, **body) -> dict | list:
    r = post(server.url + "/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(max_new: int, **extra) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0, **extra}


def check_sample(out: dict, prompt_tokens: int, n_tokens: int | None = None):
    assert set(out) >= {"text", "output_ids", "meta_info"}
    assert isinstance(out["text"], str)
    ids = out["output_ids"]
    assert all(isinstance(t, int) and 0 <= t < VOCAB_SIZE for t in ids)
    m = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                "weight_version", "e2e_latency"):
        assert key in m, f"meta_info lacks {key}: {m}"
    assert m["prompt_tokens"] == prompt_tokens
    assert m["completion_tokens"] == len(ids)
    assert m["weight_version"] == "default"
    assert isinstance(m["e2e_latency"], float) and m["e2e_latency"] > 0
    assert 0 <= m["cached_tokens"] <= prompt_tokens
    if n_tokens is not None:
        assert len(ids) == n_tokens
        assert m["finish_reason"] == {"type": "length", "length": n_tokens}


def test_single_text(server):
    out = gen(server, text="Hello, lockstep!", rid="single-1",
              sampling_params=greedy(10, ignore_eos=True))
    check_sample(out, byte_len("Hello, lockstep!"), 10)
    assert out["meta_info"]["id"] == "single-1"


def test_default_rid_is_generated_and_unique(server):
    a = gen(server, text="x", sampling_params=greedy(1))
    b = gen(server, text="x", sampling_params=greedy(1))
    assert a["meta_info"]["id"] and a["meta_info"]["id"] != b["meta_info"]["id"]


def test_batch_of_texts_gives_a_list(server):
    texts = ["a", "bb", "ccc"]
    out = gen(server, text=texts, rid=["r0", "r1", "r2"],
              sampling_params=[greedy(2, ignore_eos=True), greedy(3, ignore_eos=True),
                               greedy(4, ignore_eos=True)])
    assert isinstance(out, list) and len(out) == 3
    for i, (t, o) in enumerate(zip(texts, out)):
        check_sample(o, len(t), i + 2)
        assert o["meta_info"]["id"] == f"r{i}"
    # Each item equals the same prompt sent alone.
    alone = gen(server, text="bb", sampling_params=greedy(3, ignore_eos=True))
    assert alone["output_ids"] == out[1]["output_ids"]


def test_single_item_list_gives_a_list(server):
    out = gen(server, text=["only"], sampling_params=greedy(2, ignore_eos=True))
    assert isinstance(out, list) and len(out) == 1
    check_sample(out[0], 4, 2)


def test_input_ids_match_text(server):
    text = "token ids"
    by_text = gen(server, text=text, sampling_params=greedy(8, ignore_eos=True))
    by_ids = gen(server, input_ids=list(text.encode()), sampling_params=greedy(8, ignore_eos=True))
    check_sample(by_ids, len(text), 8)
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["text"] == by_text["text"]
    batch = gen(server, input_ids=[list(b"ab"), [257, 10, 258]],
                sampling_params=greedy(3, ignore_eos=True))
    assert isinstance(batch, list) and len(batch) == 2
    check_sample(batch[0], 2, 3)
    check_sample(batch[1], 3, 3)


def test_temperature_zero_is_deterministic(server):
    body = dict(text="greedy", sampling_params=greedy(24, ignore_eos=True))
    a, b = gen(server, **body), gen(server, **body)
    assert a["output_ids"] == b["output_ids"]
    assert a["text"] == b["text"]
    # n > 1 greedy: every sample is the greedy one.
    many = gen(server, text="greedy", sampling_params=greedy(24, ignore_eos=True, n=3))
    assert [m["output_ids"] for m in many] == [a["output_ids"]] * 3


def seeded(seed: int, n: int = 1, max_new: int = 16, **extra) -> dict:
    return {"max_new_tokens": max_new, "temperature": 1.0, "n": n, "sampling_seed": seed,
            "ignore_eos": True, **extra}


def test_n_samples_distinct_and_reproducible(server):
    body = dict(text="sample me", rid="nseed", sampling_params=seeded(42, n=4))
    first = gen(server, **body)
    assert isinstance(first, list) and len(first) == 4
    for o in first:
        check_sample(o, byte_len("sample me"), 16)
    ids = [tuple(o["output_ids"]) for o in first]
    assert len(set(ids)) == 4, "the n samples of one seed must differ from each other"
    assert sorted(o["meta_info"]["id"] for o in first) == [f"nseed-{i}" for i in range(4)]
    again = gen(server, **body)
    assert [tuple(o["output_ids"]) for o in again] == ids, "same seed must give the same samples"
    other = gen(server, **{**body, "sampling_params": seeded(43, n=4)})
    assert [tuple(o["output_ids"]) for o in other] != ids


def test_seeded_request_same_alone_and_concurrent(server):
    target = dict(text="concurrency", sampling_params=seeded(7, max_new=24))
    alone = gen(server, **target)["output_ids"]
    others = [dict(text=f"noise {i} " * (i + 1), sampling_params=seeded(100 + i, max_new=40))
              for i in range(7)]
    with ThreadPoolExecutor(max_workers=8) as ex:
        futs = [ex.submit(gen, server, **b) for b in others[:4]]
        fut = ex.submit(gen, server, **target)
        futs += [ex.submit(gen, server, **b) for b in others[4:]]
        together = fut.result()["output_ids"]
        for f in futs:
            f.result()
    assert together == alone
    # And inside one batch request, next to other prompts.
    batch = gen(server, text=["other prompt", "concurrency", "x"],
                sampling_params=[seeded(1, max_new=30), seeded(7, max_new=24), seeded(2)])
    assert batch[1]["output_ids"] == alone


def test_stream_generate_frames(server):
    body = {"text": "stream", "stream": True, "sampling_params": greedy(6, ignore_eos=True)}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        frames = read_stream(r)
    assert len(frames) >= 2
    # Cumulative output_ids: one more token per token frame; the last frame is final.
    for i, f in enumerate(frames[:-1]):
        assert len(f["output_ids"]) == i + 1
        assert f["meta_info"]["finish_reason"] is None
    last = frames[-1]
    check_sample(last, 6, 6)
    full = gen(server, **{**body, "stream": False})
    assert last["output_ids"] == full["output_ids"]
    assert last["text"] == full["text"]
    for f in frames:
        assert full["output_ids"][: len(f["output_ids"])] == f["output_ids"]


def test_stream_batch_frames_are_indexed(server):
    body = {"text": ["a", "b"], "stream": True, "sampling_params": greedy(3, ignore_eos=True)}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        frames = read_stream(r)
    finals = {}
    for f in frames:
        assert f["index"] in (0, 1)
        if f["meta_info"]["finish_reason"] is not None:
            assert f["index"] not in finals
            finals[f["index"]] = f
    assert set(finals) == {0, 1}
    for f in finals.values():
        check_sample(f, 1, 3)


def test_max_new_tokens_gives_length(server):
    for n in (1, 5, 33):
        out = gen(server, text="len", sampling_params={"max_new_tokens": n, "ignore_eos": True})
        check_sample(out, 3, n)


def test_max_new_tokens_zero(server):
    out = gen(server, text="nothing", sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == []
    assert out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


# ---------------------------------------------------------------------------------- logprobs

def is_lp(v) -> bool:
    return isinstance(v, float) and math.isfinite(v) and v <= 0.0


def check_top(top: list, k: int, with_text: bool = False):
    assert len(top) == k
    vals = [e[0] for e in top]
    assert all(is_lp(v) for v in vals)
    assert vals == sorted(vals, reverse=True), "top logprobs must be sorted, best first"
    assert len({e[1] for e in top}) == k, "top logprobs list distinct tokens"
    for e in top:
        assert 0 <= e[1] < VOCAB_SIZE
        assert isinstance(e[2], str) if with_text else e[2] is None


@pytest.mark.parametrize("start", [0, 3])
def test_logprobs_with_prompt_and_top(server, start):
    prompt = "logprob prompt"
    k = 5
    out = gen(server, text=prompt, return_logprob=True, top_logprobs_num=k,
              logprob_start_len=start, sampling_params=greedy(6, ignore_eos=True))
    m = out["meta_info"]
    plen = byte_len(prompt)
    inp = m["input_token_logprobs"]
    assert len(inp) == plen - start
    assert [e[1] for e in inp] == list(prompt.encode())[start:]
    if start == 0:
        assert inp[0][0] is None, "the first prompt token has no logprob"
        rest = inp[1:]
    else:
        rest = inp
    assert all(is_lp(e[0]) for e in rest)
    in_top = m["input_top_logprobs"]
    assert len(in_top) == len(inp)
    if start == 0:
        assert in_top[0] in (None, [])
    for t in in_top[1 if start == 0 else 0:]:
        check_top(t, k)
    outp = m["output_token_logprobs"]
    assert [e[1] for e in outp] == out["output_ids"]
    assert all(is_lp(e[0]) for e in outp)
    out_top = m["output_top_logprobs"]
    assert len(out_top) == len(outp) == 6
    for chosen, top in zip(outp, out_top):
        check_top(top, k)
        # Greedy picks the best token.
        assert top[0][1] == chosen[1]
        assert top[0][0] == pytest.approx(chosen[0], abs=1e-6)


def test_logprobs_outputs_only_by_default(server):
    out = gen(server, text="abc", return_logprob=True, sampling_params=greedy(3, ignore_eos=True))
    m = out["meta_info"]
    assert len(m["output_token_logprobs"]) == 3
    assert not m.get("input_token_logprobs")
    assert "output_top_logprobs" not in m or all(t == [] for t in m["output_top_logprobs"])


def test_logprobs_text_and_max_top(server):
    out = gen(server, text="abc", return_logprob=True, top_logprobs_num=MAX_TOP_LOGPROBS,
              return_text_in_logprobs=True, logprob_start_len=0,
              sampling_params=greedy(2, ignore_eos=True))
    m = out["meta_info"]
    for e in m["output_token_logprobs"] + m["input_token_logprobs"]:
        assert isinstance(e[2], str)
    assert m["input_token_logprobs"][0][2] == "a"
    for t in m["output_top_logprobs"]:
        check_top(t, MAX_TOP_LOGPROBS, with_text=True)


def test_prompt_logprobs_match_generated_logprobs(server):
    """Teacher forcing: the logprobs of generated tokens equal their logprobs as prompt tokens."""
    prompt = list(b"consistency check")
    out = gen(server, input_ids=prompt, return_logprob=True,
              sampling_params=greedy(8, ignore_eos=True))
    gen_lps = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    full = prompt + out["output_ids"]
    scored = gen(server, input_ids=full, return_logprob=True, logprob_start_len=len(prompt),
                 sampling_params={"max_new_tokens": 0})
    inp = scored["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inp] == out["output_ids"]
    for a, b in zip(gen_lps, [e[0] for e in inp]):
        assert a == pytest.approx(b, abs=0.05)


def test_sampled_logprobs_are_consistent_with_top(server):
    out = gen(server, text="sampled", return_logprob=True, top_logprobs_num=3,
              sampling_params=seeded(9, max_new=12))
    m = out["meta_info"]
    for chosen, top in zip(m["output_token_logprobs"], m["output_top_logprobs"]):
        check_top(top, 3)
        assert chosen[0] <= top[0][0] + 1e-6
        for lp, tid, _ in top:
            if tid == chosen[1]:
                assert lp == pytest.approx(chosen[0], abs=1e-6)


# ------------------------------------------------------------------------------------- stops

def printable_ascii(text: str) -> list[str]:
    return [c for c in text if c.isascii() and c.isprintable()]


@pytest.fixture(scope="module")
def greedy_run(server):
    """A greedy run whose output has a printable ASCII character to stop at."""
    for prompt in ("stop strings here", "another prompt", "The cat sat on the mat", "zzz"):
        out = gen(server, text=prompt, sampling_params=greedy(64, ignore_eos=True))
        chars = printable_ascii(out["text"])
        if chars:
            return prompt, out, chars[0]
    pytest.fail("no greedy output contained a printable ASCII character")


def test_stop_string(server, greedy_run):
    prompt, full, ch = greedy_run
    out = gen(server, text=prompt, sampling_params=greedy(64, ignore_eos=True, stop=[ch]))
    text = full["text"]
    assert out["text"] == text[: text.index(ch)]
    assert ch not in out["text"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ch}
    assert len(out["output_ids"]) < 64
    assert out["output_ids"] == full["output_ids"][: len(out["output_ids"])]
    assert out["output_ids"][-1] == ord(ch)


def test_stop_string_no_stop_trim(server, greedy_run):
    prompt, full, ch = greedy_run
    out = gen(server, text=prompt,
              sampling_params=greedy(64, ignore_eos=True, stop=ch, no_stop_trim=True))
    text = full["text"]
    assert out["text"] == text[: text.index(ch) + 1]
    assert out["text"].endswith(ch)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ch}


def test_stop_string_streaming(server, greedy_run):
    prompt, full, ch = greedy_run
    body = {"text": prompt, "stream": True, "sampling_params": greedy(64, ignore_eos=True, stop=[ch])}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        frames = read_stream(r)
    last = frames[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": ch}
    assert last["text"] == full["text"][: full["text"].index(ch)]


def test_stop_token_ids(server):
    # Without ignore_eos (which, as in SGLang, also disables stop_token_ids).
    full = gen(server, text="stop ids", sampling_params=greedy(64))
    ids = full["output_ids"]
    if len(ids) < 3:
        pytest.skip("greedy output ended at EOS too early")
    stop_id = ids[2]
    cut = ids.index(stop_id)
    out = gen(server, text="stop ids", sampling_params=greedy(64, stop_token_ids=[stop_id]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == ids[: cut + 1]
    # The stop token's own text is trimmed, unless no_stop_trim.
    kept = gen(server, text="stop ids",
               sampling_params=greedy(64, stop_token_ids=[stop_id], no_stop_trim=True))
    assert kept["output_ids"] == out["output_ids"]
    assert kept["text"].startswith(out["text"])
    if stop_id < 128:
        assert kept["text"] == out["text"] + chr(stop_id)


def test_ignore_eos(server):
    """Find seeded samples that end at EOS; with ignore_eos the same samples run on past it."""
    for seed in range(1, 30):
        params = seeded(seed, n=16, max_new=48)
        params.pop("ignore_eos")
        outs = gen(server, text="eos hunt", sampling_params=params)
        hits = [(i, o) for i, o in enumerate(outs)
                if o["meta_info"]["finish_reason"]["type"] == "stop"]
        if hits:
            break
    else:
        pytest.fail("no sample reached EOS in 48 tokens")
    for _, o in hits:
        fr = o["meta_info"]["finish_reason"]
        assert fr["matched"] in EOS_IDS
        assert o["output_ids"][-1] == fr["matched"]
        assert len(o["output_ids"]) < 48
    ignored = gen(server, text="eos hunt", sampling_params=seeded(seed, n=16, max_new=48))
    for i, o in hits:
        longer = ignored[i]
        assert longer["meta_info"]["finish_reason"] == {"type": "length", "length": 48}
        assert len(longer["output_ids"]) == 48
        assert longer["output_ids"][: len(o["output_ids"])] == o["output_ids"]


def test_min_new_tokens_holds_back_eos(server):
    out = gen(server, text="min", sampling_params={"max_new_tokens": 20, "min_new_tokens": 20,
                                                   "temperature": 1.0, "sampling_seed": 3})
    assert len(out["output_ids"]) == 20
    assert not (set(out["output_ids"]) & EOS_IDS)


def test_unknown_fields_are_ignored_generate(server):
    out = gen(server, text="x", frobnicate=True, custom_logit_processor=None,
              sampling_params={"max_new_tokens": 2, "ignore_eos": True, "not_a_param": [1]})
    check_sample(out, 1, 2)


def test_prefix_cache_reports_cached_tokens(server):
    prompt = "A shared prefix that spans several sixteen-token KV blocks, to be reused: " * 2
    first = gen(server, text=prompt, sampling_params=greedy(2, ignore_eos=True))
    second = gen(server, text=prompt, sampling_params=greedy(2, ignore_eos=True))
    assert second["output_ids"] == first["output_ids"]
    plen = byte_len(prompt)
    cached = second["meta_info"]["cached_tokens"]
    # Whole 16-token blocks of the prompt are reused (at least one token is always recomputed).
    assert plen - 16 <= cached < plen, (cached, plen)
    r = server.openai().completions.create(model="m", prompt=prompt, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens == cached
