#!/usr/bin/env bash
# The GPU test run (shared/GPU.md): on a CUDA host, with binaries built on the dev machine and
# carried in .bin/ (lockstep, the cuda_* test binaries, cuda_bench, cuda_kernel_bench;
# see docs/gpu.md), from the repo root:
#   scripts/gpu-check.sh [quick|full] [LOG_DIR]
# Runs every CUDA-vs-CPU op and model test, a smoke `lockstep serve --device cuda`, and the
# baseline benchmark (quick: 4 layers, few steps; full: the whole Qwen3-30B-A3B config plus the
# transformers peer), then prints a summary table.
set -uo pipefail
mode=${1:-quick}
out=${2:-${OUT:-/tmp/gpu-check}}
logs=$out
# PACK=1: the logs are written beside $out and packed into $out/results.tgz after each step (the
# device tool brings back at most 8 files, and a command cut by its time limit keeps what it
# had packed).
[ "${PACK:-0}" = 1 ] && logs=$(mktemp -d /tmp/gpu-check-logs.XXXX)
mkdir -p "$out" "$logs"
# tar's status 1 (a file changed while read) still leaves a whole archive; its messages go to
# $out/pack.err. (2026-12-05: the server runs' archives kept only gpu.txt, because the server
# loop read each row's output length into `out`.)
pack() {
  [ "${PACK:-0}" = 1 ] || return 0
  (cd "$logs" && { tar czf "$out/results.tgz.part" ./* 2>"$out/pack.err"; [ $? -le 1 ]; } \
    && mv "$out/results.tgz.part" "$out/results.tgz")
}
bin=.bin
export LOCKSTEP_KERNEL_CACHE=${LOCKSTEP_KERNEL_CACHE:-/tmp/lockstep-kernels}
# NVRTC and cuBLAS from the CUDA toolkit, or from pip's nvidia-* wheels (e.g. PyTorch's).
libdirs=$( (ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib 2>/dev/null;
  find /usr/local/nvidia /usr/local/cuda* /usr/lib /usr/lib64 /opt /lib \( -name 'libcuda.so*' -o -name 'libnvrtc.so*' -o -name 'libcublas.so*' \) -printf '%h\n' 2>/dev/null) | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
export RAYON_NUM_THREADS=$(nproc)
declare -a summary
record() { summary+=("| $1 | $2 |"); pack; }  # each step's logs packed as it ends (PACK=1)
# Benchmarks stop after BENCH_TIMEOUT seconds (default 420), as test suites do after TEST_TIMEOUT.
# The first one on a fresh machine also compiles the kernels (LOCKSTEP_KERNEL_CACHE is empty):
# 40 s was too short for it on an H100 (2026-12-05).
bound=(timeout -k 10 "${BENCH_TIMEOUT:-420}")
# Waits up to $2 seconds for a server on port $1 to answer /health.
wait_healthy() {
  for _ in $(seq 1 "$2"); do
    curl -sf "localhost:$1/health" >/dev/null 2>&1 && return 0
    sleep 1
  done
  return 1
}

echo "library path: $LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$logs/gpu.txt"

# Every GPU test binary carried in .bin/ (cargo test --release --test NAME --no-run):
# each runs its #[ignore]d GPU tests against the CPU reference.
declare -A what=(
  [cuda_ops]="ops, quantizers, GEMM kernels, attention, models vs CPU"
  [cuda_sampling]="device sampler vs CPU sampler"
  [cuda_load]="checkpoints loaded straight to the GPU, byte for byte; streamed update; from-disk and shadow swaps beside running requests"
  [cuda_attention]="attention vs CPU; rows bitwise equal in every batching"
  [cuda_invariance]="GEMM, MoE, quantizer, norm rows bitwise equal for every row count"
  [cuda_generate]="greedy generation vs CPU engine; rollout == recompute bitwise"
  [cuda_memory]="release/resume memory: freed bytes reach another allocator; same bits after; no room for a second copy: updates in place"
)
# TESTS="cuda_invariance cuda_attention" runs a subset; TEST_FILTER="name1 name2" only the tests
# whose names contain one of these. A suite still running after TEST_TIMEOUT seconds (default
# 420) is stopped and recorded as such: a kernel that never returns costs one suite, not the run.
for t in ${TESTS:-cuda_ops cuda_sampling cuda_load cuda_attention cuda_invariance cuda_generate cuda_memory}; do
  echo "== $t: ${what[$t]:-} ($(date +%T))"
  if [ "${SKIP_TESTS:-0}" = 1 ]; then
    record "$t" "skipped (SKIP_TESTS=1)"
  elif [ ! -x "$bin/$t" ]; then
    record "$t" "MISSING (.bin/$t not carried)"
  else
    timeout -k 10 "${TEST_TIMEOUT:-420}" "$bin/$t" --ignored --test-threads=1 --nocapture ${TEST_FILTER:-} \
      >"$logs/$t.log" 2>&1
    rc=$?
    tail -n 40 "$logs/$t.log"
    case $rc in
      0) record "$t (${what[$t]:-})" "pass" ;;
      124 | 137) record "$t (${what[$t]:-})" "TIMEOUT after ${TEST_TIMEOUT:-420} s (see $t.log)" ;;
      *) record "$t (${what[$t]:-})" "FAIL (see $t.log)" ;;
    esac
  fi
done

if [ "${SKIP_SMOKE:-0}" != 1 ]; then
echo "== smoke: lockstep serve --device cuda ($(date +%T))"
"$bin"/lockstep serve --device cuda --port 30555 >"$logs/serve.log" 2>&1 &
pid=$!
ok=fail
wait_healthy 30555 120
gen=$(curl -s localhost:30555/generate -H 'Content-Type: application/json' \
  -d '{"text":"The capital","sampling_params":{"max_new_tokens":8,"temperature":0}}')
chat=$(curl -s localhost:30555/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model":"lockstep-embedded","messages":[{"role":"user","content":"hi"}],"max_tokens":8}')
echo "generate: $gen"; echo "chat: $chat"
if echo "$gen" | grep -q '"text"' && echo "$chat" | grep -q '"choices"'; then ok=pass; fi
kill $pid 2>/dev/null; wait $pid 2>/dev/null
record "serve --device cuda: /generate + /v1/chat/completions" "$ok"
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
# SKIP_KERNEL_BENCH=1: only the step benchmark (cuda_bench), not cuda_kernel_bench (nor its _before).
# KERNEL_BENCH_ARGS="--sections moe,moe_down --tokens 64,256,4096": its flags.
read -r -a kernel_bench_args <<<"${KERNEL_BENCH_ARGS:-}"
if [ "${SKIP_KERNEL_BENCH:-0}" != 1 ]; then
echo "== kernel benchmark (expert GEMMs, attention) ($(date +%T))"
if "${bound[@]}" "$bin"/cuda_kernel_bench configs/qwen3-30b-a3b.json "${kernel_bench_args[@]}" 2>&1 | tee "$logs/kernel_bench.md"; then
  record "cuda_kernel_bench" "done (kernel_bench.md)"
else
  record "cuda_kernel_bench" "FAIL"
fi
fi

echo "== baseline benchmark ($(date +%T))"
if [ -n "${BENCH_ARGS:-}" ]; then
  read -r -a bench_args <<<"$BENCH_ARGS"
elif [ "$mode" = full ]; then
  bench_args=(configs/qwen3-30b-a3b.json --steps 16)
else
  bench_args=(configs/qwen3-30b-a3b.json --layers 4 --steps 16 --batches 1,64 --prefill 2x2048)
fi
if "${bound[@]}" "$bin"/cuda_bench "${bench_args[@]}" 2>&1 | tee "$logs/bench.md"; then
  record "cuda_bench ${bench_args[*]}" "done (bench.md)"
else
  record "cuda_bench" "FAIL"
fi
# Builds of the previous code (carried as .bin/cuda_kernel_bench_before, .bin/cuda_bench_before),
# for before/after in one run, with the same arguments.
if [ "${SKIP_KERNEL_BENCH:-0}" != 1 ] && [ -x "$bin/cuda_kernel_bench_before" ]; then
  "${bound[@]}" "$bin"/cuda_kernel_bench_before configs/qwen3-30b-a3b.json "${kernel_bench_args[@]}" 2>&1 | tee "$logs/kernel_bench_before.md" \
    && record "cuda_kernel_bench_before (previous code)" "done (kernel_bench_before.md)" || record "cuda_kernel_bench_before" "FAIL"
fi
if [ -x "$bin/cuda_bench_before" ]; then
  "${bound[@]}" "$bin"/cuda_bench_before "${bench_args[@]}" 2>&1 | tee "$logs/bench_before.md" \
    && record "cuda_bench_before (previous code)" "done (bench_before.md)" || record "cuda_bench_before" "FAIL"
fi
# KERNEL_VARIANTS="a b": the step benchmark (and KERNEL_VARIANT_KERNEL_BENCH=1: the kernel
# benchmark) again for each directory .bin/kv/NAME of kernel sources compiled in place of the
# built-in ones (LOCKSTEP_KERNEL_SOURCES, docs/gpu.md), as bench_NAME.md (kernel_bench_NAME.md):
# kernel variants measured by one binary in one run.
for v in ${KERNEL_VARIANTS:-}; do
  if [ "${KERNEL_VARIANT_KERNEL_BENCH:-0}" = 1 ]; then
    LOCKSTEP_KERNEL_SOURCES="$PWD/$bin/kv/$v" "${bound[@]}" "$bin"/cuda_kernel_bench configs/qwen3-30b-a3b.json "${kernel_bench_args[@]}" 2>&1 \
      | tee "$logs/kernel_bench_$v.md" && record "cuda_kernel_bench, kernels .bin/kv/$v" "done (kernel_bench_$v.md)" \
      || record "cuda_kernel_bench, kernels .bin/kv/$v" "FAIL"
  fi
  LOCKSTEP_KERNEL_SOURCES="$PWD/$bin/kv/$v" "${bound[@]}" "$bin"/cuda_bench "${bench_args[@]}" 2>&1 | tee "$logs/bench_$v.md" \
    && record "cuda_bench, kernels .bin/kv/$v" "done (bench_$v.md)" || record "cuda_bench, kernels .bin/kv/$v" "FAIL"
done
# BENCH_ALT_ARGS="...": the step benchmark once more with these arguments (bench_alt.md).
if [ -n "${BENCH_ALT_ARGS:-}" ]; then
  read -r -a alt_args <<<"$BENCH_ALT_ARGS"
  "${bound[@]}" "$bin"/cuda_bench "${alt_args[@]}" 2>&1 | tee "$logs/bench_alt.md" \
    && record "cuda_bench ${alt_args[*]}" "done (bench_alt.md)" || record "cuda_bench ${alt_args[*]}" "FAIL"
fi
# BENCH_WIDE_OFF=1: the step benchmark again on 32-row GEMM tiles only (LOCKSTEP_WIDE_TILES=0).
if [ "${BENCH_WIDE_OFF:-0}" = 1 ]; then
  LOCKSTEP_WIDE_TILES=0 "${bound[@]}" "$bin"/cuda_bench "${bench_args[@]}" 2>&1 | tee "$logs/bench_wide_off.md" \
    && record "cuda_bench, LOCKSTEP_WIDE_TILES=0" "done (bench_wide_off.md)" || record "cuda_bench, LOCKSTEP_WIDE_TILES=0" "FAIL"
fi
# BENCH_BLOCK_SPLIT_OFF=1: the step benchmark again without the few-rows launches split over K
# inside a block (LOCKSTEP_BLOCK_SPLIT=0: no GemmPath::SkinnyKSplit).
if [ "${BENCH_BLOCK_SPLIT_OFF:-0}" = 1 ]; then
  LOCKSTEP_BLOCK_SPLIT=0 "${bound[@]}" "$bin"/cuda_bench "${bench_args[@]}" 2>&1 | tee "$logs/bench_block_split_off.md" \
    && record "cuda_bench, LOCKSTEP_BLOCK_SPLIT=0" "done (bench_block_split_off.md)" || record "cuda_bench, LOCKSTEP_BLOCK_SPLIT=0" "FAIL"
fi
# BENCH_WGMMA_OFF=1: the step benchmark again without the wgmma GEMM kernels (LOCKSTEP_WGMMA=0).
if [ "${BENCH_WGMMA_OFF:-0}" = 1 ]; then
  LOCKSTEP_WGMMA=0 "${bound[@]}" "$bin"/cuda_bench "${bench_args[@]}" 2>&1 | tee "$logs/bench_wgmma_off.md" \
    && record "cuda_bench, LOCKSTEP_WGMMA=0" "done (bench_wgmma_off.md)" || record "cuda_bench, LOCKSTEP_WGMMA=0" "FAIL"
fi
# BENCH_SWITCHES_OFF="VAR VAR2": the step benchmark again with each kernel-choice switch VAR
# set to 0 (e.g. LOCKSTEP_SWIGLU_EPILOGUE, LOCKSTEP_TMA_GEMM), as bench_off_VAR.md:
# each choice against the default in one run (the bits are the same either way).
for var in ${BENCH_SWITCHES_OFF:-}; do
  env "$var=0" "${bound[@]}" "$bin"/cuda_bench "${bench_args[@]}" 2>&1 | tee "$logs/bench_off_$var.md" \
    && record "cuda_bench, $var=0" "done (bench_off_$var.md)" || record "cuda_bench, $var=0" "FAIL"
done
# BENCH_SWITCHES_ON="VAR ...": the same with each opt-in switch VAR set to 1 (e.g.
# LOCKSTEP_FOLD_IN_READERS), as bench_on_VAR.md.
for var in ${BENCH_SWITCHES_ON:-}; do
  env "$var=1" "${bound[@]}" "$bin"/cuda_bench "${bench_args[@]}" 2>&1 | tee "$logs/bench_on_$var.md" \
    && record "cuda_bench, $var=1" "done (bench_on_$var.md)" || record "cuda_bench, $var=1" "FAIL"
done
# BENCH_ENVS="VAR=VALUE ...": the same once for each setting (e.g. LOCKSTEP_ROUTE_PLAN_TOKENS=16),
# with BENCH_ENV_ARGS as its arguments if set (default: BENCH_ARGS), as bench_env_VAR_VALUE.md.
read -r -a env_args <<<"${BENCH_ENV_ARGS:-}"
[ ${#env_args[@]} -gt 0 ] || env_args=("${bench_args[@]}")
for setting in ${BENCH_ENVS:-}; do
  log="bench_env_${setting//=/_}.md"
  env "$setting" "${bound[@]}" "$bin"/cuda_bench "${env_args[@]}" 2>&1 | tee "$logs/$log" \
    && record "cuda_bench, $setting" "done ($log)" || record "cuda_bench, $setting" "FAIL"
done
# BENCH_PDL_OFF=1: the step benchmark again with programmatic dependent launch off
# (LOCKSTEP_PDL=0), for its share of the step time in the same run.
if [ "${BENCH_PDL_OFF:-0}" = 1 ]; then
  LOCKSTEP_PDL=0 "${bound[@]}" "$bin"/cuda_bench "${bench_args[@]}" 2>&1 | tee "$logs/bench_pdl_off.md" \
    && record "cuda_bench, LOCKSTEP_PDL=0" "done (bench_pdl_off.md)" || record "cuda_bench, LOCKSTEP_PDL=0" "FAIL"
fi
if [ "$mode" = full ] && [ "${SKIP_PEER:-0}" != 1 ]; then
  PYTHONUNBUFFERED=1 python3 scripts/hf_peer_bench.py configs/qwen3-30b-a3b.json 2>&1 | tee "$logs/hf_peer.md" \
    && record "transformers peer (bf16)" "done (hf_peer.md)" || record "transformers peer" "FAIL"
fi

fi

# Through the HTTP server (SERVER_BENCH=1): `lockstep serve --device cuda --load-format dummy`
# of SERVER_CONFIG with the Qwen3 tokenizer carried as .bin/qwen3-tokenizer.json.gz, loaded by
# `lockstep bench` at 1, 64 and 256 streams (4, 64, 256 prompts of 512 in; 128 / 256 / 256 out); the same for
# .bin/lockstep_before (a build of the previous code) when carried. SERVER_QUANT picks the
# expert format (default: none = BF16). SERVER_BENCH_TARGETS=1 adds issue 15's other rows: RL
# (32 prompts x 8 seeded samples, 512 / 512, 256 concurrent), 16 concurrent 4096 / 1024, and
# the TTFT of one 32k prompt. SERVER_BENCH_ROWS="CONC PROMPTS IN OUT DATASET; ..." runs those rows
# instead (e.g. "16 16 4096 1024 random; 1 1 32768 1 random").
if [ "${SERVER_BENCH:-0}" = 1 ]; then
  model=/tmp/lockstep-server-model
  mkdir -p "$model"
  cp "${SERVER_CONFIG:-configs/qwen3-30b-a3b.json}" "$model/config.json"
  gunzip -c "$bin/qwen3-tokenizer.json.gz" >"$model/tokenizer.json"
  quant=()
  [ -n "${SERVER_QUANT:-}" ] && quant=(--quantization "$SERVER_QUANT")
  # SERVER_ALT_ARGS="--chunked-prefill-size 8192": lockstep once more with these serve flags
  # (reported as lockstep_alt).
  servers=(lockstep lockstep_before)
  [ -n "${SERVER_ALT_ARGS:-}" ] && servers+=(lockstep_alt)
  for server in "${servers[@]}"; do
    exe=$server extra=()
    [ "$server" = lockstep_alt ] && exe=lockstep && read -r -a extra <<<"$SERVER_ALT_ARGS"
    [ -x "$bin/$exe" ] || continue
    echo "== server bench: $server ${extra[*]} ($(date +%T))"
    "$bin/$exe" serve --device cuda --model-path "$model" --load-format dummy "${quant[@]}" \
      --max-running-requests 256 --port 30556 "${extra[@]}" >"$logs/serve_$server.log" 2>&1 &
    pid=$!
    wait_healthy 30556 300
    ok=done
    : >"$logs/server_bench_$server.md"
    runs=("1 4 512 128 random" "64 64 512 256 random" "256 256 512 256 random")
    [ "${SERVER_BENCH_TARGETS:-0}" = 1 ] && runs+=("256 32 512 512 rl" "16 16 4096 1024 random" "1 1 32768 1 random")
    [ -n "${SERVER_BENCH_ROWS:-}" ] && IFS=';' read -r -a runs <<<"$SERVER_BENCH_ROWS"
    for run in "${runs[@]}"; do
      # (Not `out`: that is the log directory, which pack() writes to.)
      read -r conc prompts in_len out_len dataset <<<"$run"
      echo "-- $server: $conc concurrent, $prompts prompts ($dataset), $in_len in / $out_len out" | tee -a "$logs/server_bench_$server.md"
      "$bin/lockstep" bench --base-url http://127.0.0.1:30556 --tokenizer "$model/tokenizer.json" \
        --dataset "$dataset" --num-prompts "$prompts" --max-concurrency "$conc" --input-len "$in_len" \
        --output-len "$out_len" --range-ratio 1 --warmup 2 2>&1 | tee -a "$logs/server_bench_$server.md" || ok=FAIL
      # The engine's step phases so far (cumulative): the host's share is 1 - forward / all.
      curl -s localhost:30556/metrics | grep -E "^lockstep_engine_((step_seconds|step_tokens|decode_step_seconds)_(sum|count)|cuda_graph_steps_total)" \
        >>"$logs/server_bench_$server.md"
    done
    kill $pid 2>/dev/null; wait $pid 2>/dev/null
    record "server bench ($server)" "$ok (server_bench_$server.md)"
  done
fi

# An update from disk while a client streams tokens (DISK_UPDATE_BENCH=1): a made-up BF16
# checkpoint of DISK_UPDATE_GB (default 8) GB served with --device cuda, then
# /update_weights_from_disk of the same directory while scripts/stream_gaps.py reads one long
# greedy stream for DISK_UPDATE_WINDOW (default 90) seconds; prints the update's answer
# (load_seconds, swap_seconds) and the stream's largest gap, and for the push the server's
# read-back, commit and in-place write lines. DISK_UPDATE_QUANT=nvfp4_online (or mxfp8) serves
# it quantized; DISK_UPDATE_SERVE_ARGS adds serve flags (e.g. "--weight-update-shadow off").
if [ "${DISK_UPDATE_BENCH:-0}" = 1 ]; then
  py=python3  # one with numpy (make_push_checkpoint.py)
  for c in /opt/torch/.venv/bin/python python3; do
    "$c" -c "import numpy" 2>/dev/null && py=$c && break
  done
  ck=/tmp/lockstep-disk-update
  echo "== update from disk while streaming ($(date +%T))"
  {
    "$py" scripts/make_push_checkpoint.py --out "$ck" --gb "${DISK_UPDATE_GB:-8}"
    RUST_LOG="lockstep=info,lockstep::model::cuda=debug" \
      "$bin"/lockstep serve --device cuda --model-path "$ck" --weights-root /tmp --port 30557 \
      ${DISK_UPDATE_QUANT:+--quantization "$DISK_UPDATE_QUANT"} ${DISK_UPDATE_SERVE_ARGS:-} \
      >"$logs/serve_disk_update.log" 2>&1 &
    pid=$!
    wait_healthy 30557 300
    "$py" scripts/stream_gaps.py http://127.0.0.1:30557 "${DISK_UPDATE_WINDOW:-90}" &
    gaps=$!
    sleep 5
    curl -s localhost:30557/update_weights_from_disk -H 'Content-Type: application/json' \
      -d "{\"model_path\": \"$ck\"}"
    echo
    wait $gaps
    echo "-- lockstep push of the same checkpoint (default flags) while streaming"
    "$py" scripts/stream_gaps.py http://127.0.0.1:30557 "${DISK_UPDATE_WINDOW:-90}" &
    gaps=$!
    sleep 3
    "$bin"/lockstep push --server http://127.0.0.1:30557 --checkpoint "$ck" 2>&1 \
      | grep -E "GB/s|commit|checksum|version|rror" || true
    wait $gaps
    # The server's side of each bucket: waiting for the session, building the slots, writing.
    grep -o "bucket of .*" "$logs/serve_disk_update.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -n 32
    grep -oE "(in-place commit|read-back of|weights committed).*" "$logs/serve_disk_update.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -n 6
    # The in-place writes of every commit, summed: tensors checked, host writes, device copies
    # queued and waited for (the store's debug lines).
    sed 's/\x1b\[[0-9;]*m//g' "$logs/serve_disk_update.log" | awk '
      /in-place write: [0-9]+ tensors/ { n++; for (i = 1; i <= NF; i++) { if ($i == "tensors,") t += $(i-1);
        if ($i == "checked") c += $(i+2); if ($i == "writes") h += $(i+2); if ($i == "device") k += $(i-1);
        if ($i == "queued") q += $(i+2); if ($i == "waited") w += $(i+1) } }
      END { if (n) printf "in-place writes: %d groups, %d tensors; checked %.1f ms, host writes %.1f ms, %d device copies queued in %.1f ms, waited %.1f ms for them\n", n, t, c, h, k, q, w }'

    grep -E "VmHWM|peak" /proc/$pid/status 2>/dev/null || true
    kill $pid 2>/dev/null; wait $pid 2>/dev/null
  } 2>&1 | tee "$logs/disk_update.md"
  grep -q '"success":true' "$logs/disk_update.md" && grep -q "max gap" "$logs/disk_update.md" \
    && record "update from disk while streaming" "done (disk_update.md)" \
    || record "update from disk while streaming" "FAIL (disk_update.md)"
fi

# IPC_TEST=1: POST /update_weights_from_tensor with real torch CUDA IPC handles serialized as
# SGLang does (both load formats), checked against the same tensors loaded from disk, with the
# copy rate (scripts/ipc_update_test.py; IPC_GB sets the model size, IPC_PYTHON the interpreter;
# IPC_SCALE_GB=31 adds the timed round at that size against a dummy-loaded server).
if [ "${IPC_TEST:-0}" = 1 ]; then
  echo "== update_weights_from_tensor (CUDA IPC) ($(date +%T))"
  if "${IPC_PYTHON:-/opt/torch/.venv/bin/python}" scripts/ipc_update_test.py --bin "$bin/lockstep" \
      --gb "${IPC_GB:-2}" --scale-gb "${IPC_SCALE_GB:-0}" 2>&1 | tee "$logs/ipc_update.log"; then
    record "update_weights_from_tensor (CUDA IPC)" "PASS ($(grep -o '[0-9.]* s end to end = [0-9.]* GB/s' "$logs/ipc_update.log" | tr '\n' ';'))"
  else
    record "update_weights_from_tensor (CUDA IPC)" "FAIL (ipc_update.log)"
  fi
fi

# WGMMA_PROBE=1: whether wgmma adds BF16 products with the mma.sync K chain's bits
# (examples/cuda_wgmma_probe.rs; wgmma_probe.md).
if [ "${WGMMA_PROBE:-0}" = 1 ]; then
  echo "== wgmma probe ($(date +%T))"
  if timeout 120 "$bin"/cuda_wgmma_probe >"$logs/wgmma_probe.md" 2>&1; then
    record "wgmma probe" "done (wgmma_probe.md)"
  else
    record "wgmma probe" "FAIL (wgmma_probe.md)"
  fi
fi

# NCU_PREFILL=1: per-kernel times of one 4x2048 BF16 prefill step on two layers (ncu_prefill.csv;
# the first forward is a warm-up, the second the timed one).
if [ "${NCU_PREFILL:-0}" = 1 ]; then
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  echo "== ncu profile, prefill 4x2048 ($(date +%T))"
  timeout 150 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv "$bin"/cuda_bench \
    configs/qwen3-30b-a3b.json --layers 2 --formats bf16 --batches 1 --steps 1 --prompt 16 --prefill 4x2048 \
    >"$logs/ncu_prefill.csv" 2>&1 && record "ncu profile, prefill" "done (ncu_prefill.csv)" || record "ncu profile, prefill" "FAIL"
  # NCU_PREFILL_KERNELS=REGEX: what bounds the first NCU_PREFILL_COUNT (or NCU_COUNT, default 6)
  # matching launches of the timed prefill (NCU_PREFILL_SKIP, default 12, skips the warm-up's).
  if [ -n "${NCU_PREFILL_KERNELS:-}" ]; then
    timeout 240 "$ncu" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section InstructionStats --section Occupancy \
      --section LaunchStats --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,dram__bytes_read.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,lts__t_bytes.sum" \
      -k "regex:$NCU_PREFILL_KERNELS" --launch-skip "${NCU_PREFILL_SKIP:-12}" --launch-count "${NCU_PREFILL_COUNT:-${NCU_COUNT:-6}}" "$bin"/cuda_bench \
      configs/qwen3-30b-a3b.json --layers 2 --formats bf16 --batches 1 --steps 1 --prompt 16 --prefill 4x2048 \
      --mem-fraction 0.2 >"$logs/ncu_detail_prefill.txt" 2>&1 \
      && record "ncu sections, prefill ($NCU_PREFILL_KERNELS)" "done (ncu_detail_prefill.txt)" || record "ncu sections, prefill" "FAIL"
  fi
fi

# NCU_KERNEL_BENCH=REGEX[;REGEX...]: what bounds the launches of cuda_kernel_bench whose names
# match, NCU_COUNT (default 1) of them after NCU_SKIP (default 0), for each regex in turn (logs
# ncu_kernel_bench.txt, then _2, _3...), e.g. NCU_KERNEL_BENCH=decode_attention NCU_SKIP=84: the
# 256-row decode at context 512 (each measurement is 21 launches). NCU_TOKENS (default 1) is the
# bench's --tokens: the expert GEMMs' token counts; NCU_SECTIONS its --sections (e.g. moe: only
# the expert GEMMs).
if [ -n "${NCU_KERNEL_BENCH:-}" ]; then
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  IFS=';' read -r -a ncu_regexes <<<"$NCU_KERNEL_BENCH"
  i=1
  for regex in "${ncu_regexes[@]}"; do
    log="$logs/ncu_kernel_bench.txt"
    [ "$i" -gt 1 ] && log="$logs/ncu_kernel_bench_$i.txt"
    echo "== ncu sections, kernel bench ($regex) ($(date +%T))"
    timeout 200 "$ncu" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section InstructionStats --section Occupancy --section LaunchStats --section SourceCounters \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,dram__bytes_read.sum,lts__t_bytes.sum" \
      -k "regex:$regex" --launch-skip "${NCU_SKIP:-0}" --launch-count "${NCU_COUNT:-1}" \
      "$bin"/cuda_kernel_bench configs/qwen3-30b-a3b.json --tokens "${NCU_TOKENS:-1}" --sections "${NCU_SECTIONS:-attention,dense,moe}" >"$log" 2>&1 \
      && record "ncu sections, kernel bench ($regex)" "done ($(basename "$log"))" || record "ncu sections, kernel bench ($regex)" "FAIL"
    i=$((i + 1))
  done
fi

# NCU=1: an ncu profile (per-kernel times) of the batch-1 and batch-64 BF16 decode steps on two
# layers (ncu_b1.csv, ncu_b64.csv; `--clock-control none`, as the device host allows);
# NCU_BATCHES="1 64 256" picks the batches, NCU_FORMAT (bf16, mxfp8 or nvfp4) the experts'
# format (logs ncu_<format>_b<batch>.csv for the quantized ones).
# NCU_KERNELS=REGEX adds, for the first NCU_COUNT (default 6) launches after the warm-up whose
# names match, the sections that say what bounds a kernel (throughput, warp stalls, issue
# rate, instruction mix, occupancy) for both batches (ncu_detail_b1.txt, ncu_detail_b64.txt).
# cuda_bench then takes 20% of the device, so ncu can save and restore memory between replays.
if [ "${NCU:-0}" = 1 ]; then
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  for b in ${NCU_BATCHES:-1 64}; do
    echo "== ncu profile, batch $b ($(date +%T))"
    fmt=${NCU_FORMAT:-bf16} csv=ncu_b$b.csv
    [ "$fmt" != bf16 ] && csv=ncu_${fmt}_b$b.csv
    step=(configs/qwen3-30b-a3b.json --layers 2 --formats "$fmt" --batches "$b" --steps 4 --prefill 1x16)
    timeout 120 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv "$bin"/cuda_bench \
      "${step[@]}" >"$logs/$csv" 2>&1 && record "ncu profile, $fmt batch $b" "done ($csv)" || record "ncu profile, $fmt batch $b" "FAIL"
    if [ -n "${NCU_KERNELS:-}" ]; then
      timeout 200 "$ncu" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section InstructionStats --section Occupancy \
        --section LaunchStats --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,dram__bytes_read.sum" \
        -k "regex:$NCU_KERNELS" --launch-skip 40 --launch-count "${NCU_COUNT:-6}" "$bin"/cuda_bench "${step[@]}" \
        --mem-fraction 0.2 >"$logs/ncu_detail_b$b.txt" 2>&1 \
        && record "ncu sections, batch $b ($NCU_KERNELS)" "done (ncu_detail_b$b.txt)" || record "ncu sections, batch $b" "FAIL"
    fi
  done
fi


{
  echo
  echo "| check | result |"
  echo "|---|---|"
  printf '%s\n' "${summary[@]}"
} | tee "$logs/summary.md"

pack
