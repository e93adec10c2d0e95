"""`lockstep bench` against the real server on the embedded model: every request format that
lockstep serves (native /generate and both OpenAI forms) and the RL rollout dataset, with the
JSON report checked for completeness and consistency."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import lockstep_bin

NUM = 6
OUT_LEN = 8


def run_bench(server, tmp_path, *extra: str) -> dict:
    out = tmp_path / "report.json"
    cmd = [str(lockstep_bin()), "bench", "--base-url", server.url, "--num-prompts", str(NUM),
           "--input-len", "12", "--output-len", str(OUT_LEN), "--range-ratio", "1",
           "--max-concurrency", "3", "--warmup", "1", "--timeout", "120",
           "--output-json", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Serving Benchmark Result" in done.stdout
    return json.loads(out.read_text())


@pytest.mark.parametrize("backend", ["lockstep", "sglang", "openai-completions", "openai-chat"])
def test_bench_report_is_complete_and_consistent(server, tmp_path, backend):
    rep = run_bench(server, tmp_path, "--backend", backend)
    s = rep["summary"]
    assert s["completed"] == NUM and s["failed"] == 0, s
    assert len(rep["requests"]) == NUM
    assert all(r["success"] for r in rep["requests"])
    # ignore_eos: every request produces exactly OUT_LEN tokens.
    assert s["total_output_tokens"] == NUM * OUT_LEN
    assert sum(r["output_tokens"] for r in rep["requests"]) == s["total_output_tokens"]
    assert s["duration_s"] > 0
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"], rel=1e-9)
    assert s["request_throughput"] == pytest.approx(NUM / s["duration_s"], rel=1e-9)
    assert s["total_throughput"] == pytest.approx(
        (s["total_input_tokens"] + s["total_output_tokens"]) / s["duration_s"], rel=1e-9)
    for r in rep["requests"]:
        assert 0 < r["ttft_s"] <= r["e2e_s"], r


def test_bench_rl_rollouts_report_prefix_cache_hits(server, tmp_path):
    rep = run_bench(server, tmp_path, "--dataset", "rl", "--rl-group-size", "4")
    s = rep["summary"]
    assert s["completed"] == NUM * 4 and s["failed"] == 0, s
    roll = rep["rollout"]
    assert roll["samples_per_s"] > 0
    assert roll["straggler_max_s"] >= roll["straggler_mean_s"] > 0
    # n samples of one prompt share its prefix blocks.
    assert roll["prefix_cache"] is not None and roll["prefix_cache"]["hit_rate"] > 0
