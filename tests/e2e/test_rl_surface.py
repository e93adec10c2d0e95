"""The SGLang control surface RL frameworks call (slime, Miles, AReaL, verl, NeMo-RL) and
gateways read (sglang-router, smg): server/model info under both names, load reports, weight
versions, the weights checker, SGLang's begin/end bodies, memory release for colocation, and a
clear 501 for what lockstep does not support. Tests that change the weight version use a private server."""

from __future__ import annotations

import threading

import pytest
from pathlib import Path
import requests
from prometheus_client.parser import text_string_to_metric_families

from conftest import Server
from e2e_util import assert_error, read_stream, sse_events, wait_until
from rl_util import EMBEDDED_CONFIG, byte_level_model_dir, norm_bucket


@pytest.fixture(scope="module")
def rl():
    """A server whose weights and version these tests change."""
    srv = Server([], "rl-surface")
    try:
        srv.start()
        yield srv
    finally:
        srv.close()


@pytest.fixture
def unpaused(rl):
    yield rl
    rl.post("/continue_generation")


def version(srv) -> str:
    return srv.get("/get_weight_version").json()["weight_version"]


def put_bucket(srv, body: bytes, session: str | None = None) -> requests.Response:
    path = "/update_weights" + (f"?session={session}" if session else "")
    return requests.put(srv.url + path, data=body, timeout=60,
                        headers={"content-type": "application/octet-stream"})


# --- info ---------------------------------------------------------------------------------

LIVE_INFO_FIELDS = (
    "uptime_s",
    "num_running_reqs",
    "num_queue_reqs",
    "kv_blocks_used",
    "generated_tokens",
    "internal_states",
    "num_preemptions",
)


def test_server_info_and_model_info_answer_under_both_names(server):
    for new, old in (("/server_info", "/get_server_info"), ("/model_info", "/get_model_info")):
        a, b = server.get(new), server.get(old)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        a, b = a.json(), b.json()
        # The engine's live counters may move between the two reads (a request an earlier
        # test left running); every other field must be the same.
        for live in LIVE_INFO_FIELDS:
            a.pop(live, None), b.pop(live, None)
        assert a == b, (new, old)


def test_model_info_has_sglangs_fields_from_the_config(server):
    info = server.get("/model_info").json()
    assert info["architectures"] == EMBEDDED_CONFIG["architectures"]
    assert info["model_type"] == EMBEDDED_CONFIG["model_type"]
    assert info["architecture"] == info["architectures"], "kept for older lockstep clients"
    assert info["is_generation"] is True
    assert info["has_image_understanding"] is False and info["has_audio_understanding"] is False
    assert "preferred_sampling_params" in info
    # The embedded model has no tokenizer file for a gateway to load.
    assert info["tokenizer_path"] is None
    assert info["weight_version"] == version(server)


def test_server_info_reports_the_real_deployment(server, routed_server):
    info = server.get("/server_info").json()
    for key in ("tp_size", "pp_size", "ep_size", "dp_size", "moe_dp_size"):
        assert info[key] == 1, key
    assert info["disaggregation_mode"] == "null"
    assert info["device"] in ("cpu", "cuda")
    assert info["num_gpus"] == (1 if info["device"] == "cuda" else 0)
    assert info["max_total_num_tokens"] == info["kv_blocks_total"] * info["page_size"]
    assert len(info["internal_states"]) == 1
    # enable_memory_saver says whether memory release works (below), and it does.
    assert info["enable_memory_saver"] is True
    assert info["memory_released"] == [] and info["weights_state"] == "resident"
    # enable_return_routed_experts says whether a request may ask for routed experts.
    assert info["enable_return_routed_experts"] is False
    body = {"text": "ab", "return_routed_experts": True, "sampling_params": {"max_new_tokens": 1}}
    assert_error(server.post("/generate", json=body), 400, "return_routed_experts")
    routed = routed_server.get("/server_info").json()
    assert routed["enable_return_routed_experts"] is True
    out = routed_server.post("/generate", json=body)
    assert out.status_code == 200 and out.json()["meta_info"]["routed_experts"], out.text


def test_generate_takes_put_as_sglang_does(server):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0,
                                                         "ignore_eos": True}}
    put = requests.put(server.url + "/generate", json=body, timeout=60)
    assert put.status_code == 200, put.text
    assert put.json()["output_ids"] == server.post("/generate", json=body).json()["output_ids"]


def test_version(server):
    v = server.get("/version").json()
    assert v["version"] == server.get("/server_info").json()["version"]


# --- load ---------------------------------------------------------------------------------

def test_get_load_and_v1_loads_follow_real_requests(unpaused):
    rl = unpaused
    wait_until(lambda: rl.get("/get_load").json()[0]["num_reqs"] == 0, 30, what="idle")
    assert rl.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0,
                                           "num_tokens": 0}]
    # Paused in place, a request is admitted but never scheduled: it waits with its prompt.
    assert rl.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    prompt = list(range(1, 38))
    result = {}

    def run():
        result["r"] = rl.post("/generate", json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})

    t = threading.Thread(target=run)
    t.start()
    # Submitted requests count at once; their prompt tokens once the engine has admitted them.
    want = [{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 1, "num_tokens": len(prompt)}]
    wait_until(lambda: rl.get("/get_load").json() == want, 30,
               what="the paused request to be counted with its prompt")
    core = rl.get("/v1/loads", params={"include": "core"}).json()
    assert core["num_accelerators"] == rl.get("/server_info").json()["num_gpus"]
    (entry,) = core["loads"]
    assert entry["dp_rank"] == 0
    assert (entry["num_running_reqs"], entry["num_waiting_reqs"]) == (0, 1)
    assert entry["num_waiting_uncached_tokens"] == len(prompt)
    assert entry["num_total_tokens"] == len(prompt)
    assert entry["max_total_num_tokens"] == rl.get("/server_info").json()["max_total_num_tokens"]
    prom = rl.get("/v1/loads", params={"format": "prometheus"})
    assert prom.status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(prom.text)}
    assert fams["sglang_num_waiting_reqs"].samples[0].value == 1
    assert fams["sglang_num_waiting_reqs"].samples[0].labels == {"dp_rank": "0"}

    assert rl.post("/continue_generation").status_code == 200
    t.join(60)
    assert result["r"].status_code == 200, result["r"].text
    wait_until(lambda: rl.get("/get_load").json()[0]["num_reqs"] == 0, 30, what="idle again")
    assert rl.get("/get_load").json()[0]["num_tokens"] == 0


def test_get_load_counts_a_running_requests_context(unpaused):
    rl = unpaused
    prompt = list(range(1, 21))
    r = requests.post(rl.url + "/generate", stream=True, timeout=60, json={
        "input_ids": prompt, "rid": "load-running", "stream": True,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
    events = sse_events(r)
    first = next(events)
    assert first["output_ids"], first
    assert rl.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    load = rl.get("/get_load").json()[0]
    assert (load["num_reqs"], load["num_waiting_reqs"]) == (1, 0)
    # Prompt plus the tokens generated so far: at least the first one, fewer than all.
    assert len(prompt) + 1 <= load["num_tokens"] < len(prompt) + 3000
    assert rl.post("/abort_request", json={"rid": "load-running"}).status_code == 200
    assert rl.post("/continue_generation").status_code == 200
    for _ in events:
        pass
    wait_until(lambda: rl.get("/get_load").json()[0]["num_reqs"] == 0, 30, what="idle")


def test_v1_loads_bad_queries_name_the_field(server):
    assert_error(server.get("/v1/loads", params={"include": "core,bogus"}), 400, "include")
    assert_error(server.get("/v1/loads", params={"format": "xml"}), 400, "format")
    assert_error(server.get("/v1/loads", params={"dp_rank": "x"}), 400, "dp_rank")
    # Every SGLang section name is accepted; a rank this server does not have has no report.
    assert server.get("/v1/loads", params={"include": "all,memory,spec,lora,disagg,queues"}).ok
    assert server.get("/v1/loads", params={"dp_rank": 1}).json()["loads"] == []


# --- weight version -----------------------------------------------------------------------

def test_update_weight_version_names_the_served_weights(rl):
    r = rl.post("/update_weight_version", json={"new_version": "step-7"})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["new_version"] == "step-7"
    assert version(rl) == "step-7"
    assert rl.get("/model_info").json()["weight_version"] == "step-7"
    assert rl.get("/weights_checksum").json()["weight_version"] == "step-7"
    out = rl.post("/generate", json={"text": "v", "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["weight_version"] == "step-7"
    assert_error(rl.post("/update_weight_version", json={}), 400, "new_version")
    assert_error(rl.post("/update_weight_version", json={"new_version": ""}), 400, "new_version")
    assert_error(rl.post("/update_weight_version", json={"new_version": 7}), 400, "new_version")
    assert version(rl) == "step-7"


def test_update_weight_version_aborts_requests_unless_told_not_to(rl):
    def long_stream(rid):
        r = requests.post(rl.url + "/generate", stream=True, timeout=60, json={
            "text": "long", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
        events = sse_events(r)
        assert next(events)["output_ids"]
        return events

    # SGLang's default: abort everything in flight.
    events = long_stream("wv-abort")
    assert rl.post("/update_weight_version", json={"new_version": "wv-1"}).status_code == 200
    frames = [e for e in events if e != "[DONE]"]
    assert frames[-1]["meta_info"]["finish_reason"]["type"] == "abort", frames[-1]
    # abort_all_requests: false keeps it running; its later tokens carry the new name.
    events = long_stream("wv-keep")
    r = rl.post("/update_weight_version", json={"new_version": "wv-2", "abort_all_requests": False})
    assert r.status_code == 200
    for e in events:
        assert e != "[DONE]", "the stream ended before a token under the new name"
        if e["meta_info"]["weight_version"] == "wv-2":
            break
    assert rl.post("/abort_request", json={"rid": "wv-keep"}).status_code == 200
    last = [e for e in events if e != "[DONE]"][-1]
    spans = last["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["wv-1", "wv-2"], spans


# --- begin/end with SGLang's bodies (Miles' flow) ------------------------------------------

def test_miles_flow_begin_put_end_then_update_weight_version(rl):
    assert rl.post("/weights_checker", json={"action": "snapshot"}).status_code == 200
    before = version(rl)
    sum_before = rl.get("/weights_checksum").json()
    r = rl.post("/begin_weight_update", json={"selector": "all"})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    assert rl.post("/begin_weight_update", json={"selector": "all"}).status_code == 409
    # The bucket needs no session parameter: the server has one session open.
    r = put_bucket(rl, norm_bucket(1.5))
    assert r.status_code == 200, r.text
    assert version(rl) == before, "nothing changes before the commit"
    assert rl.get("/weights_checksum").json()["overall"] == sum_before["overall"]
    r = rl.post("/end_weight_update", json={})
    assert r.status_code == 200, r.text
    committed = r.json()["weight_version"]
    assert committed != before and version(rl) == committed
    # Exactly the pushed tensor changed.
    cmp = rl.post("/weights_checker", json={"action": "compare"})
    assert cmp.status_code == 400 and cmp.json()["success"] is False, cmp.text
    assert cmp.json()["mismatched_tensors"] == ["model.norm.weight"]
    # Miles names the step afterwards.
    assert rl.post("/update_weight_version", json={"new_version": "miles-3"}).status_code == 200
    assert version(rl) == "miles-3"
    assert rl.get("/weights_checksum").json()["weight_version"] == "miles-3"


def test_version_given_while_a_session_is_open_names_its_commit(rl):
    before = version(rl)
    assert rl.post("/begin_weight_update", json={}).status_code == 200
    assert rl.post("/update_weight_version", json={"new_version": "during"}).status_code == 200
    assert version(rl) == before, "the old weights never carry the new name"
    assert put_bucket(rl, norm_bucket(0.75)).status_code == 200
    r = rl.post("/end_weight_update", json={})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == "during" == version(rl)


def test_empty_session_changes_nothing(rl):
    before, overall = version(rl), rl.get("/weights_checksum").json()["overall"]
    assert rl.post("/begin_weight_update", json={"selector": "all"}).status_code == 200
    r = rl.post("/end_weight_update", json={})
    assert r.status_code == 200, r.text
    assert r.json()["committed_tensors"] == 0
    assert version(rl) == before
    assert rl.get("/weights_checksum").json()["overall"] == overall


def test_begin_end_bad_input_names_the_field(rl):
    assert_error(rl.post("/end_weight_update", json={}), 400, "session")
    assert_error(put_bucket(rl, norm_bucket(1.0)), 400, "session")
    assert_error(rl.post("/begin_weight_update", json={"selector": "draft"}), 400, "selector")
    assert_error(rl.post("/begin_weight_update", json={"selector": "bogus"}), 400, "selector")
    assert_error(rl.post("/begin_weight_update", json={"weight_version": 3}), 400, "weight_version")
    sid = rl.post("/begin_weight_update", json={}).json()["session"]
    try:
        assert_error(rl.post("/end_weight_update", json={"session": 5}), 400, "session")
        assert rl.post("/end_weight_update", json={"session": "nope"}).status_code == 404
    finally:
        assert rl.post("/abort_weight_update", json={"session": sid}).status_code == 200


# --- weights checker ------------------------------------------------------------------------

def test_weights_checker_checksum_is_the_served_checksum(rl):
    served = rl.get("/weights_checksum").json()
    for r in (rl.post("/weights_checker", json={"action": "checksum"}),
              rl.get("/weights_checker"), rl.post("/weights_checker")):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["success"] is True
        assert body["per_engine_checksum"] == served["overall"]
        (rank,) = body["ranks"]
        assert rank["checksums"] == served["tensors"]
        assert rank["parallelism_info"]["tp_size"] == 1
    skipped = rl.post("/weights_checker", json={"skip_tensor_list": ["experts"]}).json()
    names = skipped["ranks"][0]["checksums"]
    assert names and not any("experts" in n for n in names)
    assert set(names) == {n for n in served["tensors"] if "experts" not in n}
    assert skipped["per_engine_checksum"] != served["overall"]


def test_weights_checker_snapshot_then_compare_equal(rl):
    assert rl.post("/weights_checker", json={"action": "snapshot"}).status_code == 200
    r = rl.post("/weights_checker", json={"action": "compare"})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["mismatched_tensors"] == []


def test_weights_checker_bad_input(server):
    assert_error(server.post("/weights_checker", json={"action": "bogus"}), 400, "action")
    assert_error(server.post("/weights_checker", json={"selector": "draft"}), 400, "selector")
    assert_error(server.post("/weights_checker", json={"skip_tensor_list": "x"}), 400,
                 "skip_tensor_list")
    r = server.post("/weights_checker", json={"action": "reset_tensors"})
    assert r.status_code == 501 and "reset_tensors" in r.json()["error"]["message"]


def test_compare_without_snapshot_names_the_action(fresh_server):
    srv = fresh_server(name="no-snapshot")
    assert_error(srv.post("/weights_checker", json={"action": "compare"}), 400, "snapshot")


# --- memory release for colocated training -------------------------------------------------

GREEDY = {"input_ids": [5, 17, 3, 42, 9], "return_logprob": True, "top_logprobs_num": 2,
          "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}


def greedy_bits(srv):
    r = srv.post("/generate", json=GREEDY)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], out["meta_info"]["output_token_logprobs"], \
        out["meta_info"]["output_top_logprobs"]


def assert_released(srv, tags):
    r = srv.post("/generate", json=GREEDY)
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "/resume_memory_occupation" in message and all(t in message for t in tags), message
    assert srv.get("/health_generate").status_code == 503
    assert srv.get("/health").status_code == 200
    assert srv.get("/server_info").json()["memory_released"] == tags


def test_memory_release_and_resume_in_slimes_and_verls_order(fresh_server):
    srv = fresh_server(name="memory")
    before = greedy_bits(srv)
    # slime: flush the cache, release everything (no tags), resume weights, cuda_graph, kv_cache.
    assert srv.post("/flush_cache").status_code == 200
    r = srv.post("/release_memory_occupation", json={})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert r.json()["tags"] == ["kv_cache", "weights", "cuda_graph"]
    assert_released(srv, ["kv_cache", "weights"])
    for tags in (["weights"], ["cuda_graph"], ["kv_cache"]):
        r = srv.post("/resume_memory_occupation", json={"tags": tags})
        assert r.status_code == 200, (tags, r.text)
    assert greedy_bits(srv) == before
    # verl: release kv_cache and weights, resume weights, then the KV cache (GET, as SGLang takes).
    r = srv.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    assert r.status_code == 200, r.text
    assert_error(srv.post("/release_memory_occupation", json={"tags": ["weights"]}), 409, "weights")
    assert requests.get(srv.url + "/resume_memory_occupation", json={"tags": ["weights"]},
                        timeout=60).status_code == 200
    assert_released(srv, ["kv_cache"])
    assert_error(srv.post("/resume_memory_occupation", json={"tags": ["weights"]}), 409, "weights")
    assert_error(srv.post("/resume_memory_occupation", json={"tags": ["kv"]}), 400, "tags")
    assert srv.get("/resume_memory_occupation").status_code == 200, "no body: every tag"
    assert greedy_bits(srv) == before


def test_memory_release_refuses_a_busy_server_naming_the_request(fresh_server):
    srv = fresh_server(name="memory-busy")
    assert srv.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    body = {"rid": "held-7", "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=srv.post("/generate", json=body)))
    worker.start()
    wait_until(lambda: srv.get("/server_info").json()["num_queue_reqs"] == 1, timeout=60,
               what="the held request queued")
    assert_error(srv.post("/release_memory_occupation", json={}), 409, "held-7")
    assert srv.get("/server_info").json()["memory_released"] == []
    # SGLang's way: abort what is in flight, then release.
    assert srv.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    worker.join(timeout=60)
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert srv.post("/release_memory_occupation", json={}).status_code == 200
    assert srv.post("/continue_generation").status_code == 200
    assert srv.post("/resume_memory_occupation", json={}).status_code == 200
    assert greedy_bits(srv)


# --- not supported, clearly ----------------------------------------------------------------

def test_update_weights_from_tensor_on_the_cpu_server_is_a_400_naming_the_field(server):
    # SGLang's payload (tests/data/tensor_ipc, scripts/make_tensor_ipc_fixtures.py): CUDA IPC
    # handles, which a CPU server cannot open; SGLang's {success, message} shape.
    data = Path(__file__).resolve().parents[1] / "data" / "tensor_ipc"
    for name, fmt in (("direct", None), ("flattened_bucket", "flattened_bucket")):
        body = {"serialized_named_tensors": [(data / f"{name}.b64").read_text().strip()],
                "load_format": fmt, "flush_cache": True}
        r = server.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["success"] is False
        assert r.json()["error"]["param"] == "serialized_named_tensors", r.text


@pytest.mark.parametrize("path", [
    "/init_weights_update_group", "/update_weights_from_distributed",
    "/destroy_weights_update_group", "/update_weights_from_ipc", "/get_weights_by_name",
])
def test_unsupported_sglang_endpoints_answer_501_saying_what(server, path):
    r = server.post(path, json={})
    assert r.status_code == 501, (path, r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "not_implemented_error" and err["code"] == 501
    assert path in err["message"] and "not supported" in err["message"]


def test_admin_key_guards_the_new_control_endpoints(keyed_server):
    for path, body in (("/update_weight_version", {"new_version": "x"}),
                       ("/weights_checker", {"action": "snapshot"}),
                       ("/release_memory_occupation", {})):
        assert keyed_server.post(path, json=body).status_code == 401, path
        assert keyed_server.post(path, json=body, headers={"Authorization": "Bearer k1"}).status_code == 401
    ok = keyed_server.post("/update_weight_version", json={"new_version": "x"},
                           headers={"Authorization": "Bearer k2"})
    assert ok.status_code == 200, ok.text
    # Load and info stay open, as SGLang's are.
    assert keyed_server.get("/get_load").status_code == 200
    assert keyed_server.get("/v1/loads").status_code == 200
    assert keyed_server.get("/server_info").status_code == 200


# --- chat logprobs bytes with a Hugging Face byte-level tokenizer ----------------------------

def test_chat_logprobs_bytes_with_a_byte_level_bpe_tokenizer(fresh_server, tmp_path):
    model = byte_level_model_dir(tmp_path / "bytelevel")
    srv = fresh_server("--model-path", str(model), name="bytelevel")
    r = srv.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "temperature": 0,
        "logprobs": True, "top_logprobs": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # Special tokens are left out of the text (skip_special_tokens), not of the logprobs.
    specials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    content = [e for e in choice["logprobs"]["content"] if e["token"] not in specials]
    # Every other token of this vocabulary is one byte (or none, past the tokenizer's
    # vocabulary); the bytes rebuild the text even where a token splits a character.
    singles = [e for e in content if len(e["bytes"]) == 1]
    assert all(len(e["bytes"]) <= 1 for e in content), content
    joined = b"".join(bytes(e["bytes"]) for e in content)
    assert joined.decode(errors="replace") == choice["message"]["content"]
    assert singles, content
    for e in content:
        for t in e["top_logprobs"]:
            assert isinstance(t["bytes"], list) and all(0 <= b < 256 for b in t["bytes"])
