// Element-wise and row-wise ops of the forward pass: dummy weights, embedding, RMSNorm (with the
// residual add fused), Qwen3 q/k norm + RoPE + KV-cache store, SwiGLU, casts, MoE combine.

// Counter-based dummy weights: element i of a tensor depends only on (key, i), the same
// splitmix64 finalizer as `model::loader`, so the CPU and the GPU draw identical values.
extern "C" __global__ void dummy_fill_bf16(bf16_t* out, u64 n, u64 key, float bound) {
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
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = bf16_to_f32(x[i]);
}

extern "C" __global__ void f32_to_bf16_kernel(const float* x, bf16_t* out, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(x[i]);
}

// One block per token; the table is BF16 (`is_bf16`) or F32.
extern "C" __global__ void embedding(const u32* tokens, const void* table, int is_bf16, float* out, int hidden) {
    u64 src = (u64)tokens[blockIdx.x] * hidden;
    float* o = out + (u64)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        o[i] = is_bf16 ? bf16_to_f32(((const bf16_t*)table)[src + i]) : ((const float*)table)[src + i];
}

// out[b] = rms_norm(x[row]) * w, row = rows ? rows[b] : b. With `residual`, x[row] += residual[row]
// first (the CPU's add-then-norm, same f32 additions). One block per output row.
extern "C" __global__ void rms_norm(float* x, const float* residual, const float* w, float* out,
                                    const int* rows, int d, float eps) {
    u64 r = rows ? (u64)rows[blockIdx.x] : (u64)blockIdx.x;
    float* xr = x + r * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = xr[i];
        if (residual) {
            v = __fadd_rn(v, residual[r * d + i]);
            xr[i] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    float* o = out + (u64)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
}

// x += y (the residual add when no norm follows).
extern "C" __global__ void add_inplace(float* x, const float* y, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = __fadd_rn(x[i], y[i]);
}

// Grid (tokens, heads + kv_heads), one warp each: optional per-head RMSNorm (Qwen3 q_norm /
// k_norm), rotary embedding (rotate-half), and for key heads the store of K and V into their
// paged-cache slot. Lane i owns the pair (i, i + head_dim/2), so no element has two writers.
extern "C" __global__ void qk_norm_rope_store(float* q, float* k, const float* v, const float* q_norm,
                                              const float* k_norm, const float* inv_freq, const int* pos,
                                              const int* slots, bf16_t* k_cache, bf16_t* v_cache, int heads,
                                              int kv_heads, int hd, float eps) {
    int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    bool is_q = h < heads;
    int kh = h - heads;
    float* x = is_q ? q + ((u64)t * heads + h) * hd : k + ((u64)t * kv_heads + kh) * hd;
    const float* nw = is_q ? q_norm : k_norm;
    int half = hd / 2;
    float inv = 1.0f;
    if (nw) {
        float ss = 0.0f;
        for (int i = lane; i < hd; i += 32) ss += x[i] * x[i];
        ss = warp_sum(ss);
        inv = 1.0f / sqrtf(ss / (float)hd + eps);
    }
    float p = (float)pos[t];
    u64 kv_base = (u64)slots[t] * kv_heads * hd + (u64)kh * hd;
    for (int i = lane; i < half; i += 32) {
        float a = x[i], b = x[i + half];
        if (nw) {
            a = __fmul_rn(__fmul_rn(a, inv), nw[i]);
            b = __fmul_rn(__fmul_rn(b, inv), nw[i + half]);
        }
        float s, c;
        sincosf(__fmul_rn(p, inv_freq[i]), &s, &c);
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
        const float* vr = v + ((u64)t * kv_heads + kh) * hd;
        for (int i = lane; i < hd; i += 32) v_cache[kv_base + i] = f32_to_bf16(vr[i]);
    }
}

// h[r, i] = silu(gu[r, i]) * gu[r, inter + i]: gate and up come from one GEMM of width 2*inter.
extern "C" __global__ void silu_mul(const float* gu, float* h, u64 rows, int inter) {
    u64 n = rows * inter;
    for (u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x; j < n; j += (u64)gridDim.x * blockDim.x) {
        u64 r = j / inter, i = j % inter;
        float g = gu[r * 2 * inter + i], u = gu[r * 2 * inter + inter + i];
        h[j] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
    }
}

// y[t] = sum over top-k slots, in slot order, of weight * expert_out[row of (t, slot)].
extern "C" __global__ void moe_combine(const float* expert_out, const int* slot_row, const float* weights,
                                       float* y, int top_k, int hidden) {
    int t = blockIdx.x;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < top_k; s++) {
            int r = slot_row[t * top_k + s];
            acc = __fadd_rn(acc, __fmul_rn(weights[t * top_k + s], expert_out[(u64)r * hidden + i]));
        }
        y[(u64)t * hidden + i] = acc;
    }
}
