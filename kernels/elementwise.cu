// Element-wise and row-wise ops of the forward pass: dummy weights, embedding, RMSNorm (with the
// residual add fused), Qwen3 q/k norm + RoPE + KV-cache store, SwiGLU, casts, MoE combine.

// Counter-based dummy weights: element i of a tensor depends only on (key, i), the same
// splitmix64 finalizer as `model::loader`, so the CPU and the GPU draw identical values.
extern "C" __global__ void dummy_fill_bf16(bf16_t* out, u64 n, u64 key, float bound) {
    pdl_entry();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 z = key + i * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) / 16777216.0f;  // exact: z >> 40 < 2^24
        out[i] = f32_to_bf16(__fmul_rn(__fsub_rn(__fmul_rn(u, 2.0f), 1.0f), bound));
    }
}

extern "C" __global__ void bf16_to_f32_kernel(const bf16_t* x, float* out, u64 n) {
    pdl_entry();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = bf16_to_f32(x[i]);
}

extern "C" __global__ void f32_to_bf16_kernel(const float* x, bf16_t* out, u64 n) {
    pdl_entry();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(x[i]);
}

// One block per token; the table is BF16 (`is_bf16`) or F32.
extern "C" __global__ void embedding(const u32* tokens, const void* table, int is_bf16, float* out, int hidden) {
    pdl_entry();
    u64 src = (u64)tokens[blockIdx.x] * hidden;
    float* o = out + (u64)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        o[i] = is_bf16 ? bf16_to_f32(((const bf16_t*)table)[src + i]) : ((const float*)table)[src + i];
}

// out[b] = rms_norm(x[row]) * w, row = rows ? rows[b] : b. With `residual`, x[row] += residual[row]
// first (the CPU's add-then-norm, same f32 additions). One block per output row; thread i takes
// elements i, i + blockDim, ... in that order (the sum of squares' order, fixed by d alone).
// A row of up to NORM_REGS elements a thread is loaded into registers first, all its loads in
// flight at once (a decode row is otherwise a chain of dependent round trips); longer rows
// stream. Both make the same operations in the same order.
#define NORM_REGS 16
// The end of a norm whose row is held in registers (a thread's elements i = threadIdx.x + j *
// blockDim.x in v, the weights' in wv) and whose squares the thread has summed (ss): the block's
// sum, then out[i] = v * inv * w.
template <int N>
__device__ __forceinline__ void rms_norm_held(const float (&v)[N], const float (&wv)[N], float ss, float* o, int d,
                                              float eps) {
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll
    for (int j = 0; j < N; j++) {
        int i = threadIdx.x + j * blockDim.x;
        if (i >= d) break;
        o[i] = __fmul_rn(__fmul_rn(v[j], inv), wv[j]);
    }
}
template <bool SUMS>
__device__ __forceinline__ void rms_norm_row(float* x, const float* residual, const float* w, float* out,
                                             const int* rows, int d, float eps, int segments, u64 stride) {
    u64 r = rows ? (u64)rows[blockIdx.x] : (u64)blockIdx.x;
    float* xr = x + r * d;
    float* o = out + (u64)blockIdx.x * d;
    float ss = 0.0f;
    if (d <= NORM_REGS * (int)blockDim.x) {
        // The norm's weights too, before any store: read after the stores to x and out (which
        // may alias them) each waited for the one before it.
        float v[NORM_REGS], a[NORM_REGS], wv[NORM_REGS];
#pragma unroll
        for (int j = 0; j < NORM_REGS; j++) {
            int i = threadIdx.x + j * blockDim.x;
            v[j] = i < d ? xr[i] : 0.0f;
            wv[j] = i < d ? w[i] : 0.0f;
            if (!SUMS) a[j] = residual && i < d ? residual[r * d + i] : 0.0f;
        }
        if constexpr (SUMS) {
            // The residual's elements folded together (each round's loads all in flight).
            u64 at[NORM_REGS];
            bool live[NORM_REGS];
#pragma unroll
            for (int j = 0; j < NORM_REGS; j++) {
                int i = threadIdx.x + j * blockDim.x;
                at[j] = r * d + i;
                live[j] = i < d;
            }
            folded_many<NORM_REGS>(residual, segments, stride, at, live, a);
        }
#pragma unroll
        for (int j = 0; j < NORM_REGS; j++) {
            int i = threadIdx.x + j * blockDim.x;
            if (i >= d) break;
            if (residual) {
                v[j] = __fadd_rn(v[j], a[j]);
                xr[i] = v[j];
            }
            ss += v[j] * v[j];
        }
        rms_norm_held<NORM_REGS>(v, wv, ss, o, d, eps);
        return;
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = xr[i];
        if (residual) {
            v = __fadd_rn(v, SUMS ? folded(residual, segments, stride, r * d + i) : residual[r * d + i]);
            xr[i] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
}

extern "C" __global__ void rms_norm(float* x, const float* residual, const float* w, float* out,
                                    const int* rows, int d, float eps) {
    pdl_entry();
    rms_norm_row<false>(x, residual, w, out, rows, d, eps, 0, 0);
}

// The same with the residual a GEMM output left as its segment sums (`sums`, `segments` of
// `stride` elements each: folded), read as the values it would have held.
extern "C" __global__ void rms_norm_sums(float* x, const float* sums, const float* w, float* out, const int* rows,
                                         int d, float eps, int segments, u64 stride) {
    pdl_entry();
    rms_norm_row<true>(x, sums, w, out, rows, d, eps, segments, stride);
}

// x += y (the residual add when no norm follows).
extern "C" __global__ void add_inplace(float* x, const float* y, u64 n) {
    pdl_entry();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = __fadd_rn(x[i], y[i]);
}

// Grid (tokens, ceil((heads + kv_heads) / 8)), 8 warps a block, a warp a head: optional
// per-head RMSNorm (Qwen3 q_norm / k_norm), rotary embedding (rotate-half), and for key heads
// the store of K and V into their paged-cache slot. Lane i owns the pair (i, i + head_dim/2),
// so no element has two writers. The block works out its token's sines and cosines once into
// shared memory (the same sincosf of the same product for every head; 36 blocks of one warp
// each computing them took 357 us for 8,192 tokens of Qwen3-30B-A3B, H200, 2026-12-04).
// Requires head_dim <= 2 * QK_ROPE_MAX_HALF (the host checks).
#define QK_ROPE_MAX_HALF 256
#define QK_ROPE_WARPS 8
#define QK_FOLD_MAX (2 * QK_ROPE_MAX_HALF / 32)  // a lane's elements of a head

// A lane's elements (lane, lane + 32, ...: up to N of them) of the head at `at` of a q, k or v
// left as segment sums, folded together.
template <int N>
__device__ __forceinline__ void qk_fold_head(const float* sums, int segments, u64 stride, u64 at, int lane, int hd,
                                             float (&f)[N]) {
    u64 el[N];
    bool live[N];
#pragma unroll
    for (int j = 0; j < N; j++) {
        live[j] = lane + 32 * j < hd;
        el[j] = at + lane + 32 * j;
    }
    folded_many<N>(sums, segments, stride, el, live, f);
}
// A head of hd = 32 * J elements in registers (J even: the partner i + hd/2 of a lane's element
// i = lane + 32 j is its own element j + J/2): the head's values (folded when `sums`), its norm
// weights and, for a key head, its values of v are all read before the first store, which they
// could alias, so the lane waits on memory once rather than after each store. The same
// expressions in the same order as the walk below: the same bits.
template <bool SUMS, int J>
__device__ __forceinline__ void qk_head_in_registers(float* x, const float* sums, int segments, u64 stride, u64 at,
                                                     const float* nw, float eps, int lane, const float* sin_s,
                                                     const float* cos_s, bool is_q, bf16_t* k_cache,
                                                     bf16_t* v_cache, u64 kv_base, const float* vr,
                                                     const float* v_sums, u64 v_stride, u64 v_at) {
    constexpr int hd = 32 * J, half = hd / 2;
    float a[J], w[J], vv[J];
    if (SUMS && sums) {
        qk_fold_head(sums, segments, stride, at, lane, hd, a);
    } else {
#pragma unroll
        for (int j = 0; j < J; j++) a[j] = x[lane + 32 * j];
    }
    if (nw) {
#pragma unroll
        for (int j = 0; j < J; j++) w[j] = nw[lane + 32 * j];
    }
    if (!is_q) {
        if (SUMS && v_sums) {
            qk_fold_head(v_sums, segments, v_stride, v_at, lane, hd, vv);
        } else {
#pragma unroll
            for (int j = 0; j < J; j++) vv[j] = vr[lane + 32 * j];
        }
    }
    float inv = 1.0f;
    if (nw) {
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < J; j++) ss += a[j] * a[j];
        ss = warp_sum(ss);
        inv = 1.0f / sqrtf(ss / (float)hd + eps);
    }
#pragma unroll
    for (int j = 0; j < J / 2; j++) {
        int i = lane + 32 * j;
        float av = a[j], bv = a[j + J / 2];
        if (nw) {
            av = __fmul_rn(__fmul_rn(av, inv), w[j]);
            bv = __fmul_rn(__fmul_rn(bv, inv), w[j + J / 2]);
        }
        float s = sin_s[i], c = cos_s[i];
        float na = __fsub_rn(__fmul_rn(av, c), __fmul_rn(bv, s));
        float nb = __fadd_rn(__fmul_rn(bv, c), __fmul_rn(av, s));
        x[i] = na;
        x[i + half] = nb;
        if (!is_q) {
            k_cache[kv_base + i] = f32_to_bf16(na);
            k_cache[kv_base + i + half] = f32_to_bf16(nb);
        }
    }
    if (!is_q) {
#pragma unroll
        for (int j = 0; j < J; j++) v_cache[kv_base + lane + 32 * j] = f32_to_bf16(vv[j]);
    }
}

template <bool SUMS>
__device__ __forceinline__ void qk_norm_rope_store_head(float* q, float* k, const float* v, const float* q_norm,
                                                        const float* k_norm, const float* inv_freq, const int* pos,
                                                        const int* slots, bf16_t* k_cache, bf16_t* v_cache,
                                                        int heads, int kv_heads, int hd, float eps,
                                                        const float* q_sums, const float* k_sums,
                                                        const float* v_sums, int segments) {
    __shared__ float sin_s[QK_ROPE_MAX_HALF], cos_s[QK_ROPE_MAX_HALF];
    int t = blockIdx.x, lane = threadIdx.x & 31;
    int h = blockIdx.y * QK_ROPE_WARPS + (threadIdx.x >> 5);
    int half = hd / 2;
    float p = (float)pos[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) sincosf(__fmul_rn(p, inv_freq[i]), &sin_s[i], &cos_s[i]);
    __syncthreads();
    if (h >= heads + kv_heads) return;
    bool is_q = h < heads;
    int kh = h - heads;
    float* x = is_q ? q + ((u64)t * heads + h) * hd : k + ((u64)t * kv_heads + kh) * hd;
    const float* sums = is_q ? q_sums : k_sums;
    const float* nw = is_q ? q_norm : k_norm;
    u64 kv_base = (u64)slots[t] * kv_heads * hd + (u64)kh * hd;
    if (hd == 128 || hd == 64) {
        u64 at = is_q ? ((u64)t * heads + h) * hd : ((u64)t * kv_heads + kh) * hd;
        u64 stride = (u64)gridDim.x * (is_q ? heads : kv_heads) * hd;
        u64 v_at = ((u64)t * kv_heads + kh) * hd, v_stride = (u64)gridDim.x * kv_heads * hd;
        const float* vs = SUMS ? v_sums : nullptr;
        if (hd == 128)
            qk_head_in_registers<SUMS, 4>(x, SUMS ? sums : nullptr, segments, stride, at, nw, eps, lane, sin_s,
                                          cos_s, is_q, k_cache, v_cache, kv_base, v + v_at, vs, v_stride, v_at);
        else
            qk_head_in_registers<SUMS, 2>(x, SUMS ? sums : nullptr, segments, stride, at, nw, eps, lane, sin_s,
                                          cos_s, is_q, k_cache, v_cache, kv_base, v + v_at, vs, v_stride, v_at);
        return;
    }
    if constexpr (SUMS) if (sums) {
        u64 at = is_q ? ((u64)t * heads + h) * hd : ((u64)t * kv_heads + kh) * hd;
        float f[QK_FOLD_MAX];
        qk_fold_head(sums, segments, (u64)gridDim.x * (is_q ? heads : kv_heads) * hd, at, lane, hd, f);
#pragma unroll
        for (int j = 0; j < QK_FOLD_MAX; j++)
            if (lane + 32 * j < hd) x[lane + 32 * j] = f[j];
        __syncwarp();
    }
    float inv = 1.0f;
    if (nw) {
        float ss = 0.0f;
        for (int i = lane; i < hd; i += 32) ss += x[i] * x[i];
        ss = warp_sum(ss);
        inv = 1.0f / sqrtf(ss / (float)hd + eps);
    }
    for (int i = lane; i < half; i += 32) {
        float a = x[i], b = x[i + half];
        if (nw) {
            a = __fmul_rn(__fmul_rn(a, inv), nw[i]);
            b = __fmul_rn(__fmul_rn(b, inv), nw[i + half]);
        }
        float s = sin_s[i], c = cos_s[i];
        float na = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        float nb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
        x[i] = na;
        x[i + half] = nb;
        if (!is_q) {
            k_cache[kv_base + i] = f32_to_bf16(na);
            k_cache[kv_base + i + half] = f32_to_bf16(nb);
        }
    }
    if (!is_q) {
        u64 at = ((u64)t * kv_heads + kh) * hd;
        if (SUMS && v_sums) {
            float f[QK_FOLD_MAX];
            qk_fold_head(v_sums, segments, (u64)gridDim.x * kv_heads * hd, at, lane, hd, f);
#pragma unroll
            for (int j = 0; j < QK_FOLD_MAX; j++)
                if (lane + 32 * j < hd) v_cache[kv_base + lane + 32 * j] = f32_to_bf16(f[j]);
        } else {
            const float* vr = v + at;
            for (int i = lane; i < hd; i += 32) v_cache[kv_base + i] = f32_to_bf16(vr[i]);
        }
    }
}

extern "C" __global__ void qk_norm_rope_store(float* q, float* k, const float* v, const float* q_norm,
                                              const float* k_norm, const float* inv_freq, const int* pos,
                                              const int* slots, bf16_t* k_cache, bf16_t* v_cache, int heads,
                                              int kv_heads, int hd, float eps) {
    pdl_entry();
    qk_norm_rope_store_head<false>(q, k, v, q_norm, k_norm, inv_freq, pos, slots, k_cache, v_cache, heads, kv_heads,
                                   hd, eps, nullptr, nullptr, nullptr, 0);
}

// The same where q, k and v whose `*_sums` are given are GEMM outputs left as their segment
// sums (folded: q's rows x heads x hd each, k's and v's rows x kv_heads x hd): a warp first
// writes its head's folded values into q or k; v's are folded as they are stored.
extern "C" __global__ void qk_norm_rope_store_sums(float* q, float* k, const float* v, const float* q_norm,
                                                   const float* k_norm, const float* inv_freq, const int* pos,
                                                   const int* slots, bf16_t* k_cache, bf16_t* v_cache, int heads,
                                                   int kv_heads, int hd, float eps, const float* q_sums,
                                                   const float* k_sums, const float* v_sums, int segments) {
    pdl_entry();
    qk_norm_rope_store_head<true>(q, k, v, q_norm, k_norm, inv_freq, pos, slots, k_cache, v_cache, heads, kv_heads,
                                  hd, eps, q_sums, k_sums, v_sums, segments);
}

// h[r, i] = silu(gu[r, i]) * gu[r, inter + i]: gate and up come from one GEMM of width 2*inter.
// Four columns a thread where the widths and addresses allow float4 (32-bit indices below 2^31
// quads): a 64-bit division per element cost more than the element's arithmetic.
template <bool SUMS>
__device__ __forceinline__ void silu_mul_rows(const float* gu, float* h, u64 rows, int inter, int segments) {
    u64 n = rows * inter, stride = rows * 2 * inter;
    if (inter % 4 == 0 && n / 4 < (1u << 31) && (((u64)gu | (u64)h) & 15) == 0) {
        u32 quads = (u32)(n / 4), per_row = inter / 4;
        for (u32 j = blockIdx.x * blockDim.x + threadIdx.x; j < quads; j += gridDim.x * blockDim.x) {
            u32 r = j / per_row, c = 4 * (j - r * per_row);
            float4 g, u;
            if constexpr (SUMS) {
                // Gate and up folded together.
                u64 at[2] = {(u64)r * 2 * inter + c, (u64)r * 2 * inter + c + inter};
                bool live[2] = {true, true};
                float4 gu4[2];
                folded4_many<2, 4>(gu, segments, stride, at, live, gu4);
                g = gu4[0];
                u = gu4[1];
            } else {
                const float* row = gu + (u64)r * 2 * inter + c;
                g = *(const float4*)row;
                u = *(const float4*)(row + inter);
            }
            *(float4*)(h + (u64)r * inter + c) =
                make_float4(silu_mul_value(g.x, u.x), silu_mul_value(g.y, u.y), silu_mul_value(g.z, u.z),
                            silu_mul_value(g.w, u.w));
        }
        return;
    }
    for (u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x; j < n; j += (u64)gridDim.x * blockDim.x) {
        u64 r = j / inter, i = j % inter;
        float g, u;
        if constexpr (SUMS) {
            u64 at[2] = {r * 2 * inter + i, r * 2 * inter + inter + i};
            bool live[2] = {true, true};
            float v[2];
            folded_many<2>(gu, segments, stride, at, live, v);
            g = v[0];
            u = v[1];
        } else {
            g = gu[r * 2 * inter + i];
            u = gu[r * 2 * inter + inter + i];
        }
        h[j] = silu_mul_value(g, u);
    }
}

extern "C" __global__ void silu_mul(const float* gu, float* h, u64 rows, int inter) {
    pdl_entry();
    silu_mul_rows<false>(gu, h, rows, inter, 0);
}

// The same with gu the gate/up GEMM's segment sums (folded, rows x 2 inter each).
extern "C" __global__ void silu_mul_sums(const float* sums, float* h, u64 rows, int inter, int segments) {
    pdl_entry();
    silu_mul_rows<true>(sums, h, rows, inter, segments);
}

// y[t] = sum over top-k slots, in slot order, of weight * expert_out[row of (t, slot)].
// Grid (tokens, column blocks): block (t, c) sums token t's columns c * blockDim.x.. (strided by
// the grid; four columns a thread where hidden and the addresses allow float4), so one token's
// columns are spread over blocks instead of walked by one.
#define COMBINE_SLOTS 16

// Where column i of each slot's expert row is (its row of expert_out: rows[s]), for the folds.
__device__ __forceinline__ void combine_slots(const int* rows, int top_k, int hidden, int i, u64* at, bool* live) {
#pragma unroll
    for (int s = 0; s < COMBINE_SLOTS; s++) {
        at[s] = (u64)rows[s] * hidden + i;
        live[s] = s < top_k;
    }
}
// Four columns' sums over a token's slots: slot 0, then + slot 1, ... (weight times value,
// each rounded), and a + b element by element: the combine's arithmetic wherever it runs.
template <int S>
__device__ __forceinline__ float4 combine_sum4(const float (&wts)[S], const float4 (&e)[S], int top_k) {
    float4 acc = make_float4(0, 0, 0, 0);
#pragma unroll
    for (int s = 0; s < S; s++)
        if (s < top_k) {
            acc.x = __fadd_rn(acc.x, __fmul_rn(wts[s], e[s].x));
            acc.y = __fadd_rn(acc.y, __fmul_rn(wts[s], e[s].y));
            acc.z = __fadd_rn(acc.z, __fmul_rn(wts[s], e[s].z));
            acc.w = __fadd_rn(acc.w, __fmul_rn(wts[s], e[s].w));
        }
    return acc;
}
__device__ __forceinline__ float4 add4(float4 a, float4 b) {
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}
// With ADD, each sum is added into y (`y = __fadd_rn(y, sum)`: the norm's residual add, y the
// residual stream) instead of written.
template <bool SUMS, bool ADD = false>
__device__ __forceinline__ void moe_combine_token(const float* expert_out, const int* slot_row,
                                                  const float* weights, float* y, int top_k, int hidden,
                                                  int segments) {
    int t = blockIdx.x;
    u64 stride = (u64)gridDim.x * top_k * hidden;
    // The token's rows and weights once, into registers (top_k <= COMBINE_SLOTS; more stream):
    // each element's top_k loads are then independent, all in flight at once. The sum is the
    // same either way: slot 0, then + slot 1, ...
    int rows[COMBINE_SLOTS];
    float wts[COMBINE_SLOTS];
    bool held = top_k <= COMBINE_SLOTS;
#pragma unroll
    for (int s = 0; s < COMBINE_SLOTS; s++) {
        rows[s] = held && s < top_k ? slot_row[t * top_k + s] : 0;
        wts[s] = held && s < top_k ? weights[t * top_k + s] : 0.0f;
    }
    if (held && hidden % 4 == 0 && (((u64)expert_out | (u64)y) & 15) == 0) {
        for (int i = 4 * (blockIdx.y * blockDim.x + threadIdx.x); i < hidden; i += 4 * gridDim.y * blockDim.x) {
            float4 e[COMBINE_SLOTS];
            if constexpr (SUMS) {
                u64 at[COMBINE_SLOTS];
                bool live[COMBINE_SLOTS];
                combine_slots(rows, top_k, hidden, i, at, live);
                folded4_many<COMBINE_SLOTS, 1>(expert_out, segments, stride, at, live, e);
            } else {
#pragma unroll
                for (int s = 0; s < COMBINE_SLOTS; s++)
                    e[s] = s < top_k ? *(const float4*)(expert_out + (u64)rows[s] * hidden + i) : make_float4(0, 0, 0, 0);
            }
            float4 acc = combine_sum4(wts, e, top_k);
            float4* out = (float4*)(y + (u64)t * hidden + i);
            if constexpr (ADD) acc = add4(*out, acc);
            *out = acc;
        }
        return;
    }
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < hidden; i += gridDim.y * blockDim.x) {
        float acc = 0.0f;
        if (held) {
            float e[COMBINE_SLOTS];
            if constexpr (SUMS) {
                u64 at[COMBINE_SLOTS];
                bool live[COMBINE_SLOTS];
                combine_slots(rows, top_k, hidden, i, at, live);
                folded_many<COMBINE_SLOTS>(expert_out, segments, stride, at, live, e);
            } else {
#pragma unroll
                for (int s = 0; s < COMBINE_SLOTS; s++) e[s] = s < top_k ? expert_out[(u64)rows[s] * hidden + i] : 0.0f;
            }
#pragma unroll
            for (int s = 0; s < COMBINE_SLOTS; s++)
                if (s < top_k) acc = __fadd_rn(acc, __fmul_rn(wts[s], e[s]));
        } else {
            for (int s = 0; s < top_k; s++) {
                int r = slot_row[t * top_k + s];
                float e = SUMS ? folded(expert_out, segments, stride, (u64)r * hidden + i) : expert_out[(u64)r * hidden + i];
                acc = __fadd_rn(acc, __fmul_rn(weights[t * top_k + s], e));
            }
        }
        float* out = y + (u64)t * hidden + i;
        *out = ADD ? __fadd_rn(*out, acc) : acc;
    }
}

extern "C" __global__ void moe_combine(const float* expert_out, const int* slot_row, const float* weights,
                                       float* y, int top_k, int hidden) {
    pdl_entry();
    moe_combine_token<false>(expert_out, slot_row, weights, y, top_k, hidden, 0);
}

// The same with expert_out the down projection's segment sums (folded, tokens x top_k x hidden
// each).
extern "C" __global__ void moe_combine_sums(const float* sums, const int* slot_row, const float* weights, float* y,
                                            int top_k, int hidden, int segments) {
    pdl_entry();
    moe_combine_token<true>(sums, slot_row, weights, y, top_k, hidden, segments);
}

// rms_norm with its residual the MoE combine of expert_out (moe_combine's arguments; y is not
// written): x[t] += combine(t), then out[t] = rms_norm(x[t]) * w. A block a token (256 threads,
// as rms_norm): the combine's walk adds each column's sum into x, and after the barrier the norm
// reads x back. Each x value is the __fadd_rn(x, y) rms_norm makes and the squares are summed in
// its order, so x and out are the bits of moe_combine, then rms_norm with y as the residual.
// Rows of up to two of the combine's float4 rounds (d <= 8 * blockDim.x, at most
// NORM_COMBINE_HELD elements) and up to NORM_COMBINE_SLOTS slots take a shorter chain: the
// norm's weights are read first, both rounds' loads (the slots' values and x) are issued before
// the first store (which could alias them), and the sums also go to shared memory, where the
// norm reads them after the barrier instead of reading x back. The same operations in the same
// order as moe_combine_token's walk, then rms_norm_row's: the same bits.
#define NORM_COMBINE_SLOTS 8
#define NORM_COMBINE_HELD 2048
template <bool SUMS>
__device__ __forceinline__ void combine_add_two_rounds(const float* expert_out, const int* slot_row,
                                                       const float* weights, float* x, float* xs, int top_k,
                                                       int hidden, int segments) {
    int t = blockIdx.x;
    u64 stride = (u64)gridDim.x * top_k * hidden;
    int rows[NORM_COMBINE_SLOTS];
    float wts[NORM_COMBINE_SLOTS];
#pragma unroll
    for (int s = 0; s < NORM_COMBINE_SLOTS; s++) {
        rows[s] = s < top_k ? slot_row[t * top_k + s] : 0;
        wts[s] = s < top_k ? weights[t * top_k + s] : 0.0f;
    }
    float4 e[2][NORM_COMBINE_SLOTS], r[2];
#pragma unroll
    for (int q = 0; q < 2; q++) {
        int i = 4 * (threadIdx.x + q * blockDim.x);
        if (i >= hidden) continue;
        if constexpr (SUMS) {
            u64 at[NORM_COMBINE_SLOTS];
            bool live[NORM_COMBINE_SLOTS];
#pragma unroll
            for (int s = 0; s < NORM_COMBINE_SLOTS; s++) {
                at[s] = (u64)rows[s] * hidden + i;
                live[s] = s < top_k;
            }
            folded4_many<NORM_COMBINE_SLOTS, 1>(expert_out, segments, stride, at, live, e[q]);
        } else {
#pragma unroll
            for (int s = 0; s < NORM_COMBINE_SLOTS; s++)
                e[q][s] = s < top_k ? *(const float4*)(expert_out + (u64)rows[s] * hidden + i) : make_float4(0, 0, 0, 0);
        }
        r[q] = *(const float4*)(x + (u64)t * hidden + i);
    }
#pragma unroll
    for (int q = 0; q < 2; q++) {
        int i = 4 * (threadIdx.x + q * blockDim.x);
        if (i >= hidden) continue;
        float4 acc = add4(r[q], combine_sum4(wts, e[q], top_k));
        *(float4*)(x + (u64)t * hidden + i) = acc;
        *(float4*)(xs + i) = acc;
    }
}

template <bool SUMS>
__device__ __forceinline__ void rms_norm_combine_row(float* x, const float* expert_out, const int* slot_row,
                                                     const float* weights, const float* w, float* out, int top_k,
                                                     int d, float eps, int segments) {
    __shared__ __align__(16) float xs[NORM_COMBINE_HELD];
    if (top_k <= NORM_COMBINE_SLOTS && d % 4 == 0 && d <= NORM_COMBINE_HELD && d <= 8 * (int)blockDim.x &&
        (((u64)expert_out | (u64)x) & 15) == 0) {
        float v[8], wv[8], ss = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = threadIdx.x + j * blockDim.x;
            wv[j] = i < d ? w[i] : 0.0f;
        }
        combine_add_two_rounds<SUMS>(expert_out, slot_row, weights, x, xs, top_k, d, segments);
        __syncthreads();
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = threadIdx.x + j * blockDim.x;
            v[j] = i < d ? xs[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (threadIdx.x + j * blockDim.x >= d) break;
            ss += v[j] * v[j];
        }
        rms_norm_held<8>(v, wv, ss, out + (u64)blockIdx.x * d, d, eps);
        return;
    }
    moe_combine_token<SUMS, true>(expert_out, slot_row, weights, x, top_k, d, segments);
    __syncthreads();
    rms_norm_row<false>(x, nullptr, w, out, nullptr, d, eps, 0, 0);
}

extern "C" __global__ void rms_norm_combine(float* x, const float* expert_out, const int* slot_row,
                                            const float* weights, const float* w, float* out, int top_k, int d,
                                            float eps) {
    pdl_entry();
    rms_norm_combine_row<false>(x, expert_out, slot_row, weights, w, out, top_k, d, eps, 0);
}

// The same with expert_out the down projection's segment sums (as moe_combine_sums).
extern "C" __global__ void rms_norm_combine_sums(float* x, const float* sums, const int* slot_row,
                                                 const float* weights, const float* w, float* out, int top_k,
                                                 int d, float eps, int segments) {
    pdl_entry();
    rms_norm_combine_row<true>(x, sums, slot_row, weights, w, out, top_k, d, eps, segments);
}

// Device-to-device copies of `n` byte ranges in one launch: ranges[3i..3i+3] = (dst, src,
// bytes) of range i, in any order and never overlapping. Grid (x, n), 256 threads: the x blocks
// of range blockIdx.y copy it grid-stride, 16 bytes at a time where dst, src and bytes allow
// (an in-place weight commit writes thousands of tensors; a copy call each cost ~14 us).
extern "C" __global__ void copy_ranges(const u64* ranges, int n) {
    pdl_entry();
    int r = blockIdx.y;
    if (r >= n) return;
    u8* dst = (u8*)ranges[3 * r];
    const u8* src = (const u8*)ranges[3 * r + 1];
    u64 bytes = ranges[3 * r + 2];
    u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, step = (u64)gridDim.x * blockDim.x;
    if ((((u64)dst | (u64)src | bytes) & 15) == 0) {
        for (u64 i = first; i < bytes / 16; i += step) ((uint4*)dst)[i] = ((const uint4*)src)[i];
    } else {
        for (u64 i = first; i < bytes; i += step) dst[i] = src[i];
    }
}
