#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs and copies it, stripped, into the git-ignored .bin/ that
# the device tool carries (64 MiB in all with the tree; docs/gpu.md):
#   scripts/stage_gpu_bin.sh [TEST ...]          # the named cuda_* test binaries (default: all)
#   BEFORE=REV scripts/stage_gpu_bin.sh [TEST ...]  # also REV's lockstep, cuda_bench and
#                                                # cuda_kernel_bench as *_before (target/before)
#   NO_TESTS=1 scripts/stage_gpu_bin.sh          # only lockstep and the two benchmarks
#   VARIANTS="NAME:FILE:DEF=V,DEF2=V2 ..." scripts/stage_gpu_bin.sh
#       # also kernel variants for gpu-check.sh's KERNEL_VARIANTS: .bin/kv/NAME/FILE is
#       # kernels/FILE with `#define DEF V` lines on top (e.g. chunk256:prefill_attention.cu:FA_CHUNK=256)
# Needs scripts/fetch_test_assets.sh's Qwen3 tokenizer for the server benchmark's copy.
set -euo pipefail
cd "$(dirname "$0")/.."
all=(cuda_ops cuda_load cuda_sampling cuda_attention cuda_invariance cuda_generate cuda_memory)
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=("${all[@]}")
[ "${NO_TESTS:-0}" = 1 ] && tests=()

cargo build --release --bin lockstep --examples
if [ ${#tests[@]} -gt 0 ]; then
  cargo test --release $(printf -- '--test %s ' "${tests[@]}") --no-run
fi
rm -rf .bin && mkdir -p .bin
cp target/release/lockstep target/release/examples/cuda_bench target/release/examples/cuda_kernel_bench \
  target/release/examples/cuda_wgmma_probe .bin/
for t in "${tests[@]}"; do
  cp "$(ls -t target/release/deps/"$t"-* | grep -v '\.d$' | head -1)" ".bin/$t"
done

if [ -n "${BEFORE:-}" ]; then
  here=$PWD tree=$(mktemp -d)/before
  git worktree add -f "$tree" "$BEFORE"
  (cd "$tree" && CARGO_TARGET_DIR="$here/target/before" cargo build --release --bin lockstep \
    --example cuda_bench --example cuda_kernel_bench)
  for b in lockstep examples/cuda_bench examples/cuda_kernel_bench; do
    cp "target/before/release/$b" ".bin/$(basename "$b")_before"
  done
  git worktree remove --force "$tree"
fi

for v in ${VARIANTS:-}; do
  IFS=: read -r name file defs <<<"$v"
  mkdir -p ".bin/kv/$name"
  { tr ',' '\n' <<<"$defs" | sed 's/^\([^=]*\)=\(.*\)$/#define \1 \2/'; cat "kernels/$file"; } >".bin/kv/$name/$file"
done

find .bin -maxdepth 1 -type f -exec strip {} +
tok=.cache/assets/qwen3/tokenizer.json
[ -f "$tok" ] && gzip -9c "$tok" >.bin/qwen3-tokenizer.json.gz
# The device tool carries at most 64 MiB with the working tree: name fewer tests, or drop
# .bin/lockstep_before where no server run compares with it.
kib=$(du -sk .bin | cut -f1)
echo "$((kib / 1024)) MiB in .bin"
[ "$kib" -le $((60 * 1024)) ] || echo "warning: over 60 MiB; the working tree and .bin travel within 64 MiB" >&2
