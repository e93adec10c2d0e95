"""SGLang's own client code, unchanged, against lockstep: `sglang.bench_serving` (the load
generator SGLang benchmarks itself with), the `sglang` frontend language's RuntimeEndpoint, and
`sglang-router` (the Rust gateway, from its PyPI wheel) in front of two lockstep servers.

The packages are pinned in requirements-sglang.txt and installed by scripts/test.sh into
.cache/sglang-client (off the system Python); each client runs as a subprocess with that
directory on PYTHONPATH and the Hugging Face Hub switched off, so nothing leaves the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from conftest import REPO, Server, _PROCS, free_port
from e2e_util import wait_until
from rl_util import byte_level_model_dir

CLIENT_DIR = Path(os.environ.get("LOCKSTEP_SGLANG_CLIENT_DIR", REPO / ".cache" / "sglang-client"))
REQUIREMENTS = Path(__file__).with_name("requirements-sglang.txt")
INSTALL = ("python3 -m pip install --no-deps --target .cache/sglang-client "
           "-r tests/e2e/requirements-sglang.txt && cp tests/e2e/requirements-sglang.txt "
           ".cache/sglang-client/.requirements")


def _installed() -> bool:
    """scripts/test.sh leaves a copy of the pins it installed: a partial install has none."""
    stamp = CLIENT_DIR / ".requirements"
    return stamp.is_file() and stamp.read_bytes() == REQUIREMENTS.read_bytes()


pytestmark = pytest.mark.skipif(
    not _installed(),
    reason=f"SGLang's client packages (requirements-sglang.txt) are not installed in {CLIENT_DIR}: "
           f"scripts/test.sh installs them from PyPI; by hand: {INSTALL}",
)


def client_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
    env["PYTHONPATH"] = str(CLIENT_DIR)
    # Offline: tokenizers come from local directories only.
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["HF_HOME"] = str(REPO / ".cache" / "hf-home-unused")
    return env


def run_client(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], env=client_env(), cwd=REPO, capture_output=True,
                       text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"{args[:2]} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A served model with a tokenizer.json on disk, for clients that load the worker's."""
    return byte_level_model_dir(tmp_path_factory.mktemp("sglang-clients") / "bytelevel")


@pytest.fixture
def private(request):
    """Private servers (counters start at zero), killed afterwards."""
    started: list[Server] = []

    def start(*args: str, name: str) -> Server:
        srv = Server(list(args), name)
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        srv.kill()
        srv.close()


def generated(srv: Server) -> int:
    return srv.get("/server_info").json()["generated_tokens"]


def test_bench_serving_drives_lockstep(private, model_dir, tmp_path):
    srv = private(name="bench-serving")
    out = tmp_path / "bench.jsonl"
    num, input_len, output_len = 12, 24, 16
    p = run_client([
        "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", srv.url,
        "--dataset-name", "random-ids", "--tokenizer", str(model_dir),
        "--num-prompts", str(num), "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--random-range-ratio", "1.0",
        "--request-rate", "inf", "--seed", "1", "--output-file", str(out),
    ])
    assert "Serving Benchmark Result" in p.stdout, p.stdout[-2000:]
    (result,) = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert result["completed"] == num, result
    assert result["total_input_tokens"] == num * input_len
    # It streams (TTFT is measured from the first SSE frame) and, with ignore_eos, every
    # request generates exactly output_len tokens: the benchmark's, plus its one warm-up.
    assert result["mean_ttft_ms"] > 0
    assert generated(srv) == (num + 1) * output_len


def test_sglang_frontend_runtime_endpoint(server):
    script = (
        "import sys, json, sglang as sgl\n"
        "sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))\n"
        "@sgl.function\n"
        "def f(s, q):\n"
        "    s += 'Q: ' + q + '\\nA:' + sgl.gen('answer', max_tokens=6, temperature=0)\n"
        "st = f.run(q='hi')\n"
        "print(json.dumps({'answer': st['answer'], 'meta': st.get_meta_info('answer')}))\n"
    )
    p = run_client(["-c", script, server.url])
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["meta"]["completion_tokens"] == 6
    assert got["meta"]["finish_reason"] == {"type": "length", "length": 6}
    # The same greedy request sent directly gives the same text.
    direct = server.post("/generate", json={
        "text": "Q: hi\nA:", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert got["answer"] == direct["text"]


@pytest.fixture
def routed_pair(private, model_dir):
    """Two lockstep servers behind sglang-router (round robin)."""
    a = private("--model-path", str(model_dir), "--enable-return-routed-experts", name="worker-a")
    b = private("--model-path", str(model_dir), "--enable-return-routed-experts", name="worker-b")
    port = free_port()
    log = open(Path(a.log_path).with_suffix(".router.log"), "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", a.url, b.url,
         "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"],
        env=client_env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    _PROCS.append(proc)
    router = f"http://127.0.0.1:{port}"

    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"router exited with {proc.returncode}: "
                                 f"{Path(log.name).read_text(errors='replace')[-4000:]}")
        try:
            workers = requests.get(router + "/workers", timeout=2).json()["workers"]
        except (requests.RequestException, ValueError, KeyError):
            return False
        return len(workers) == 2 and all(w["is_healthy"] for w in workers) and workers

    try:
        workers = wait_until(ready, 60, what="sglang-router with two healthy workers")
        yield router, a, b, workers
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()
        Path(log.name).unlink(missing_ok=True)


def test_sglang_router_in_front_of_two_lockstep_servers(routed_pair):
    router, a, b, workers = routed_pair
    # The router classified both as SGLang workers from /model_info and /server_info.
    for w in workers:
        meta = w["metadata"]
        assert meta["model_type"] == "qwen3_moe" and "Qwen3MoeForCausalLM" in meta["architectures"]
        assert meta["tp_size"] == "1" and meta["disaggregation_mode"] == "null"
    before = generated(a), generated(b)
    n, tokens = 8, 5
    for i in range(n):
        r = requests.post(router + "/generate", timeout=60, json={
            "text": f"request {i}", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == tokens
    da, db = generated(a) - before[0], generated(b) - before[1]
    assert da + db == n * tokens and da > 0 and db > 0, (da, db)
    chat = requests.post(router + "/v1/chat/completions", timeout=60, json={
        "model": "bytelevel", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 3


def test_sglang_router_reads_lockstep_load(routed_pair):
    """The router's /get_loads asks each worker's /get_load (-1 when that fails): a request
    held waiting on one worker shows there as its prompt tokens."""
    router, a, b, _ = routed_pair
    loads = {w["worker"]: w["load"] for w in requests.get(router + "/get_loads", timeout=30).json()["workers"]}
    assert loads == {a.url: 0, b.url: 0}, loads
    assert a.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    prompt = list(range(1, 30))
    t = threading.Thread(target=lambda: a.post("/generate", json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}))
    t.start()
    try:
        want = {a.url: len(prompt), b.url: 0}
        wait_until(lambda: {w["worker"]: w["load"] for w in
                            requests.get(router + "/get_loads", timeout=30).json()["workers"]} == want,
                   30, what="the router to see the waiting prompt")
    finally:
        a.post("/continue_generation")
        t.join(60)


def test_sglang_router_drops_return_routed_experts(routed_pair):
    """Known limitation (docs/rl-frameworks.md): sglang-router 0.3.2 re-serializes /generate
    without `return_routed_experts`, so routing replay must call the servers directly. If this
    starts failing, the router forwards it now and the doc can say so."""
    router, a, _, _ = routed_pair
    body = {"text": "route me", "return_routed_experts": True, "sampling_params": {"max_new_tokens": 2}}
    direct = a.post("/generate", json=body).json()
    assert direct["meta_info"]["routed_experts"]
    via = requests.post(router + "/generate", json=body, timeout=60).json()
    assert "routed_experts" not in via["meta_info"], via["meta_info"]
