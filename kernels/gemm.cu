// Grouped GEMM for expert (and quantized dense) layers: out[r, n] = sum_k x[r, k] * W_e[n, k]
// for the rows r of each expert e, with W in F32, BF16, MXFP8 or NVFP4 kept in its storage
// format in GPU memory and decoded to f32 inside the kernel (exact for every format), FP32
// accumulation, and the NVFP4 second-level scales (s_tok of the row, S_dec of the weight)
// applied in the epilogue, in the contract's order.
//
// Batch invariance (docs/determinism.md): every output element is reduced over K in an order
// fixed by K alone, so a row's result has the same bits whatever the batch holds. Four kernels
// share the arguments and the tile plan, and the host picks one per launch (ops::grouped_gemm);
// a launch may cover up to three matrices over the same input side by side (gemm_part, the
// attention's q, k and v), each block working on one of them as that matrix's own launch would:
// - grouped_gemm_*: CUDA cores (FFMA), any K: each element is one fmaf chain over k = 0..K-1;
//   the only one for F32 weights (kept exact in f32).
// - grouped_gemm_mma_*: tensor cores (mma.sync m16n8k16, FP32 accumulation), 32x128 tiles
//   (grouped_gemm_mma_wide_*: 64x128, over the routing plan's wide tiles). Activations are
//   packed once (pack_gemm_operand) and streamed with the raw weight bytes through shared
//   memory; weights are decoded in registers. The operands are BF16, and FP16 for NVFP4
//   weights (F16_OPERANDS: its E2M1 x E4M3 values and activations are exact in FP16 too, and
//   decode to it in fewer instructions): exact for MXFP8 (E4M3 x E8M0) and NVFP4 weights and for
//   quantized activations (the quantizers' dequantized values).
//   Plain BF16 layers take f32 activations rounded to BF16 (nearest even), as SGLang, vLLM and
//   Megatron compute them: ~2e-3 from the CPU's f32 products (MoE routing may then differ from
//   the CPU's).
// - grouped_gemm_skinny_*, grouped_gemm_skinny4_*: the same tensor-core products for tiles of
//   few rows (decode): a warp per 8 (or 32) output columns, weights loaded straight into
//   registers, no shared memory.
// - grouped_gemm_skinny_ksplit_*, grouped_gemm_skinny_ksplit8_*: the few-rows warps (32 or 8
//   columns) for tiles of at most 16 rows, a column group's K segments spread over one block's
//   warps and added in the block.
// - grouped_gemm_wgmma_* (Hopper, sm_90a): the same products on warpgroup MMAs, 128x128 tiles
//   (a plan's pair tiles: two wide tiles' rows), the weights as the A operand (section below);
//   grouped_gemm_wgmma_swiglu_*: over a gate/up matrix, with SwiGLU in the epilogue (h written
//   instead of gate and up: swiglu_weight_row); grouped_gemm_tma_*: the same with the copies
//   made by the TMA unit (section below).
// The tensor-core kernels feed each mma exactly the same operands in the same order (the
// "K chain" below), so they give the same bits and the choice between them is speed alone.
//
// The K chain: K is walked in spans of 32 in order; within a span, lane (g, t) of an m16n8k16
// holds k = 8t..8t+7, chunk c (0, 1) taking k = 8t+4c+{0,1} in fragment slots {2t, 2t+1} and
// k = 8t+4c+{2,3} in slots {2t+8, 2t+9}; chunk 0 then chunk 1. Each lane's 8 values of a span
// are then one 16-byte load. The spans are grouped
// in segments of SEG k (the last may be shorter): each segment accumulates from zero, and the
// segments' sums are added in order (total = s0, then total + s1, ...). A block either walks
// every segment and keeps that running total, or (split-K, `partials` not null, launches of few
// blocks) takes the one segment blockIdx.z and stores its sum; then either (with `counters`,
// regions of few rows) the last of an output region's blocks (few-rows kernels: warps) to
// finish adds the region's segments in the same order (fold_if_last), or gemm_fold_segments
// does, a thread per element. Both give the same bits; split-K only buys blocks.

#define TM 32
#define TN 64
#define TK 32
#define SEG 256  // k per segment of the K chain (host: ops::gemm::K_SEGMENT)
// The 32-column few-rows kernels hold four 128-thread blocks an SM (at most 128 registers a
// thread: BF16's and MXFP8's two-fragment chains spill 120-200 bytes, their one-fragment chains
// 4-28 when compiled alone). They wait on memory, and 16 warps an SM instead of 12 (160
// registers) take BF16 expert gate/up at 64 tokens from 288 to 255 us, and 2 us more at one
// token (H200, cuda_kernel_bench, 2026-12-03).
#define SKINNY4_BLOCKS_PER_SM 4

// The rows of this block's tile (blockIdx.y): from the routing plan's `tiles` (expert, first
// row), or the tile-th run of `tm` rows of one dense group. False: no such tile this step.
__device__ __forceinline__ bool tile_rows(const int* tiles, const int* num_tiles, const int* offsets, int rows, int& e,
                                          int& r0, int& r1, int tm = TM) {
    int tile = blockIdx.y;
    if (tiles) {
        if (tile >= *num_tiles) return false;
        e = tiles[2 * tile];
        r0 = tiles[2 * tile + 1];
        r1 = min(r0 + tm, offsets[e + 1]);
    } else {
        e = 0;
        r0 = tile * tm;
        if (r0 >= rows) return false;
        r1 = min(r0 + tm, rows);
    }
    return true;
}

// Weight element (n, k) of expert e, decoded.
template <int FMT>
__device__ __forceinline__ float load_weight(const void* w, const u8* scales, u64 e, u64 n, u64 k, u64 N, u64 K) {
    u64 row = e * N + n;
    if (FMT == 0) return ((const float*)w)[row * K + k];
    if (FMT == 1) return bf16_to_f32(((const bf16_t*)w)[row * K + k]);
    if (FMT == 2) return __fmul_rn(e4m3_decode(((const u8*)w)[row * K + k]), e8m0_decode(scales[row * (K / 32) + k / 32]));
    u8 byte = ((const u8*)w)[row * (K / 2) + k / 2];
    u8 nib = (k & 1) ? (byte >> 4) : (byte & 15);
    return __fmul_rn(e2m1_decode(nib), e4m3_decode(scales[row * (K / 16) + k / 16]));
}

// Grid (ceil(N / TN), tiles), 256 threads, each a 2x4 patch of the 32x64 output tile.
// `tiles` (from moe_plan) lists (expert, first row); null means one group of `rows` rows.
// x rows are read through `row_index` (null: identity) so experts read tokens in place.
// row_scale (NVFP4 s_tok) is indexed like x; w_sdec[e * groups + n / (N / groups)].
template <int FMT>
__device__ void grouped_gemm(const float* x, const int* row_index, const float* row_scale, const void* w,
                             const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                             const int* num_tiles, const int* offsets, int rows, int N, int K, float* out,
                             float* /* partials: the FFMA chain is never split */, const u32* /* xb */,
                             u32* /* counters */, int bx) {
    int e, r0, r1;
    if (!tile_rows(tiles, num_tiles, offsets, rows, e, r0, r1)) return;
    int n0 = bx * TN;
    __shared__ float xs[TK][TM + 1];
    __shared__ float ws[TK][TN + 1];
    int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    float acc[2][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TK) {
        for (int i = tid; i < TM * TK; i += 256) {
            int r = i / TK, kk = i % TK, row = r0 + r, k = k0 + kk;
            float v = 0.0f;
            if (row < r1 && k < K) {
                u64 src = row_index ? (u64)row_index[row] : (u64)row;
                v = x[src * K + k];
            }
            xs[kk][r] = v;
        }
        for (int i = tid; i < TN * TK; i += 256) {
            int n = i / TK, kk = i % TK, col = n0 + n, k = k0 + kk;
            ws[kk][n] = (col < N && k < K) ? load_weight<FMT>(w, w_scales, e, col, k, N, K) : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < TK; kk++) {
            float a0 = xs[kk][ty * 2], a1 = xs[kk][ty * 2 + 1];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float b = ws[kk][tx * 4 + j];
                acc[0][j] = fmaf(a0, b, acc[0][j]);
                acc[1][j] = fmaf(a1, b, acc[1][j]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int row = r0 + ty * 2 + i;
        if (row >= r1) continue;
        u64 src = row_index ? (u64)row_index[row] : (u64)row;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int col = n0 + tx * 4 + j;
            if (col >= N) continue;
            float v = acc[i][j];
            if (FMT == 3) v = __fmul_rn(__fmul_rn(v, row_scale[src]), w_sdec[e * sdec_groups + col / (N / sdec_groups)]);
            out[(u64)row * N + col] = v;
        }
    }
}

// ---- Tensor cores: the K chain's operands and products ----

#define MMA_TK 32  // one span of the K chain

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) { return pack_bf16x2_rn(lo, hi); }

// Two f32 values that are exactly BF16 (decoded codes times block scales) packed as BF16x2.
__device__ __forceinline__ u32 pack_exact_bf16(float lo, float hi) {
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
}

// Operands in FP16 for NVFP4 weights, BF16 otherwise. NVFP4's weights (E2M1 x E4M3: at most 6
// significant bits, 2^-10 .. 2688) and activations (the same, its quantizer's values) are exact
// in both; FP16's E2M1 decoding takes one byte table where BF16's took two, and its E4M3 scale
// one conversion (e2m1x8_to_f16).
template <int FMT>
constexpr bool F16_OPERANDS = FMT == 3;

// One k16 step of the K chain (mma.sync m16n8k16, FP32 accumulation) in FMT's operand type.
template <int FMT>
__device__ __forceinline__ void mma_k16(float* c, const u32* a, const u32* b) {
#define MMA_K16_ASM(TYPE)                                                                                     \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
                 "{%8,%9}, {%0,%1,%2,%3};\n"                                                                  \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
    if constexpr (F16_OPERANDS<FMT>) MMA_K16_ASM("f16");
    else MMA_K16_ASM("bf16");
#undef MMA_K16_ASM
}

// Two activations as one word of the K chain's operand type, rounded to nearest even: BF16
// (plain BF16 layers' f32 activations; MXFP8's dequantized values, which are exact in it), or
// FP16 for NVFP4 weights (`f16`: its exact values). The few-rows kernels' packing (pack_act8)
// and the tiled and wgmma kernels' (pack_gemm_operand) both round through it.
__device__ __forceinline__ u32 pack_operand(bool f16, float lo, float hi) {
    return f16 ? pack_exact_f16(lo, hi) : pack_bf16(lo, hi);
}

// Eight consecutive activations (one lane's share of a span) as the K chain's words for FMT's
// weights (pack_operand).
template <int FMT>
__device__ __forceinline__ void pack_act8(float4 a, float4 b, u32* words) {
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; i++) words[i] = pack_operand(F16_OPERANDS<FMT>, v[2 * i], v[2 * i + 1]);
}

// One span of the K chain for an m16n8 accumulator: `row_g` / `row_g8` are the 4 words of the
// lane's rows g and g + 8 (pack_act8), `w` the 4 words of its weight column g.
template <int FMT>
__device__ __forceinline__ void mma_span(float* c, const u32* row_g, const u32* row_g8, const u32* w) {
#pragma unroll
    for (int ch = 0; ch < 2; ch++) {
        u32 b[2] = {w[2 * ch], w[2 * ch + 1]};
        u32 a[4] = {row_g[2 * ch], row_g8[2 * ch], row_g[2 * ch + 1], row_g8[2 * ch + 1]};
        mma_k16<FMT>(c, a, b);
    }
}

// Fast exact decoders for the inner loops. Two E4M3 codes (low byte first) as FP16x2: one
// hardware conversion on sm_89+ (every E4M3 value, NaN included, is an FP16), else the
// table-free decoder's values converted. E2M1 codes become FP16 through byte permutes (no
// memory lookups).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 pair) {
    u32 h2;
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)pair));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h2) : "f"(e4m3_decode((u8)(pair >> 8))), "f"(e4m3_decode((u8)pair)));
#endif
    return h2;
}

// Two E4M3 codes (low byte first) to f32.
__device__ __forceinline__ void e4m3x2_to_f32(u32 pair, float& lo, float& hi) {
#if __CUDA_ARCH__ >= 890
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi)
        : "r"(e4m3x2_to_f16x2(pair)));
#else
    lo = e4m3_decode((u8)pair);
    hi = e4m3_decode((u8)(pair >> 8));
#endif
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// Eight E2M1 codes (code i in bits 4i..4i+3) as four FP16x2 words (codes 2p, 2p + 1 in word p),
// exact. FP16's values of the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} have a zero low byte, so
// one byte permute looks up four codes' high bytes from an 8-byte table (0x00, 0x38, 0x3C,
// 0x3E, 0x40, 0x42, 0x44, 0x46) by their magnitude codes (3 bits). The signs join them four
// codes at a time: code 2j's is bit 7 of byte j of q << 4, code 2j + 1's bit 7 of byte j of q,
// so one byte permute lines them up. Two permutes with zero bytes then make the words.
__device__ __forceinline__ void e2m1x8_to_f16(u32 q, u32* out) {
    u32 mag = q & 0x77777777u, even_sign = q << 4;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        u32 sel = mag >> (16 * h);  // codes 4h..4h + 3
        u32 sign = prmt(even_sign, q, h == 0 ? 0x5140u : 0x7362u);  // theirs at bit 7 of bytes 0..3
        u32 hi = prmt(0x3E3C3800u, 0x46444240u, sel) | (sign & 0x80808080u);
        out[2 * h] = prmt(hi, 0u, 0x1404u);      // codes 4h, 4h + 1
        out[2 * h + 1] = prmt(hi, 0u, 0x3424u);  // codes 4h + 2, 4h + 3
    }
}

// Both halves of an FP16x2 word times the low half of s.
__device__ __forceinline__ u32 f16x2_mul_low(u32 a, u32 s) {
    u32 d;
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n .reg .b32 b;\n mov.b32 b, {l, l};\n mul.rn.f16x2 %0, %1, b;}"
        : "=r"(d)
        : "r"(a), "r"(s));
    return d;
}

// The raw bytes of 8 consecutive weights (n, k..k+8) and their block scale, loaded ahead of use.
struct Weight8 {
    uint4 q;   // BF16: 16 bytes; MXFP8: q.x, q.y (8 bytes); NVFP4: q.x (4 bytes)
    u8 scale;  // MXFP8: the 32-block's E8M0; NVFP4: the 16-block's E4M3
};

// Where a lane's weights of one weight row are read from k on (K % 32 == 0 and k % 8 == 0:
// aligned loads): the raw bytes and the block scale of its 8 weights at k, worked out once, so
// that the spans after it are fixed offsets (WeightCursor::at) rather than 64-bit products a
// load (H100, 2026-12-06: the one-token NVFP4 expert gate/up 30.0 -> 25.8 us).
template <int FMT>
struct WeightCursor {
    static constexpr int BYTES_PER_32K = FMT == 1 ? 64 : FMT == 2 ? 32 : 16;  // a span's bytes
    static constexpr int SCALES_PER_32K = FMT == 2 ? 1 : FMT == 3 ? 2 : 0;    // and block scales
    const u8* q;
    const u8* sc;
    __device__ __forceinline__ WeightCursor(const void* w, const u8* scales, u64 row, u64 k, u64 K) {
        q = (const u8*)w + row * (K * BYTES_PER_32K / 32) + k * BYTES_PER_32K / 32;
        sc = FMT == 1 ? nullptr : scales + (FMT == 2 ? row * (K / 32) + k / 32 : row * (K / 16) + k / 16);
    }
    __device__ __forceinline__ WeightCursor(const u8* bytes, const u8* block_scales) : q(bytes), sc(block_scales) {}
    // The 8 weights (and their block scale) s spans (32 k each) after the cursor's k.
    __device__ __forceinline__ Weight8 at(int s) const {
        Weight8 c;
        c.q = make_uint4(0, 0, 0, 0);
        c.scale = 0;
        const u8* p = q + s * BYTES_PER_32K;
        if (FMT == 1) {
            c.q = *(const uint4*)p;
        } else if (FMT == 2) {
            uint2 v = *(const uint2*)p;
            c.q.x = v.x;
            c.q.y = v.y;
        } else {
            c.q.x = *(const u32*)p;
        }
        if (FMT != 1) c.scale = sc[s * SCALES_PER_32K];
        return c;
    }
};

// The 8 weights as 4 words of FMT's operand type: BF16x2, FP16x2 for NVFP4. Exact: an E4M3
// value times its power-of-two block scale has at most 4 significant bits (and stays in BF16's
// range), an E2M1 value times its E4M3 block scale at most 6 (within FP16's normal range).
template <int FMT>
__device__ __forceinline__ void decode_weight8(const Weight8& c, u32* out) {
    if (FMT == 1) {
        out[0] = c.q.x; out[1] = c.q.y; out[2] = c.q.z; out[3] = c.q.w;
    } else if (FMT == 2) {
        float s = e8m0_decode(c.scale);
        u32 words[2] = {c.q.x, c.q.y};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float lo, hi;
            e4m3x2_to_f32(words[i / 2] >> (16 * (i % 2)), lo, hi);
            out[i] = pack_exact_bf16(__fmul_rn(lo, s), __fmul_rn(hi, s));
        }
    } else {
        // The E4M3 block scale as FP16 (the low half): its product with an E2M1 value (at most
        // 6 significant bits, 2^-10 .. 2688) is exact in FP16.
        u32 s = e4m3x2_to_f16x2(c.scale);
        u32 v[4];
        e2m1x8_to_f16(c.q.x, v);
#pragma unroll
        for (int i = 0; i < 4; i++) out[i] = f16x2_mul_low(v[i], s);
    }
}

// The block scales a span holds per weight row: one MXFP8 32-block, two NVFP4 16-blocks.
template <int FMT>
constexpr int SPAN_SCALES = FMT == 2 ? 1 : FMT == 3 ? 2 : 0;

// Lane t's block scales along weight row `row` from span k_begin on (MXFP8's 32-block, NVFP4's
// 16-block of k0 + 8t): span s's is at [s * SPAN_SCALES<FMT>], so walking the spans takes no
// 64-bit products.
template <int FMT>
__device__ __forceinline__ const u8* column_scales(const u8* w_scales, u64 row, int K, int k_begin, int t) {
    return w_scales + (row * (K / MMA_TK) + k_begin / MMA_TK) * SPAN_SCALES<FMT> + (FMT == 3 ? t / 2 : 0);
}

// The raw bytes of a lane's 8 weights of a span from a shared-memory stage (W_BYTES / 4 of a
// column's span), with their block scale.
template <int FMT>
__device__ __forceinline__ Weight8 smem_weight8(const u8* wp, u8 scale) {
    Weight8 wc;
    wc.q = make_uint4(0, 0, 0, 0);
    if (FMT == 1) wc.q = *(const uint4*)wp;
    if (FMT == 2) {
        uint2 v = *(const uint2*)wp;
        wc.q.x = v.x;
        wc.q.y = v.y;
    }
    if (FMT == 3) wc.q.x = *(const u32*)wp;
    wc.scale = scale;
    return wc;
}

// The same from a shared-memory address (the state space's own, no generic pointer).
template <int FMT>
__device__ __forceinline__ Weight8 smem_weight8_at(u32 addr, u8 scale) {
    Weight8 wc;
    wc.q = make_uint4(0, 0, 0, 0);
    if (FMT == 1)
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(wc.q.x), "=r"(wc.q.y), "=r"(wc.q.z), "=r"(wc.q.w)
                     : "r"(addr));
    if (FMT == 2) asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(wc.q.x), "=r"(wc.q.y) : "r"(addr));
    if (FMT == 3) asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(wc.q.x) : "r"(addr));
    wc.scale = scale;
    return wc;
}

__device__ __forceinline__ u8 lds_u8(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(addr));
    return (u8)v;
}

// NVFP4's S_dec of weight column col of expert e (its group's: w_sdec[e * groups + group]).
__device__ __forceinline__ float nvfp4_column_sdec(const float* w_sdec, int e, int sdec_groups, int col, int N) {
    return w_sdec[e * sdec_groups + col / (N / sdec_groups)];
}

__device__ __forceinline__ float nvfp4_epilogue_scale(float v, const float* row_scale, u64 src, const float* w_sdec,
                                                      int e, int sdec_groups, int col, int N) {
    return __fmul_rn(__fmul_rn(v, row_scale[src]), nvfp4_column_sdec(w_sdec, e, sdec_groups, col, N));
}

// The NVFP4 epilogue's factors of a kernel's output tile, read once per row and per column
// before its stores (in store_sum they were read, and the column's group divided out, per
// element: the stores may alias them. H200, 2026-12-04: 15% of the wgmma NVFP4 kernel's
// instructions at 4,096 tokens). Other formats, and split-K's segment sums (`partials`: the
// fold applies the epilogue), get ones and read nothing.
template <int FMT>
__device__ __forceinline__ float epilogue_row_scale(const float* partials, const float* row_scale,
                                                    const int* row_index, int row) {
    return FMT == 3 && !partials ? row_scale[row_index ? row_index[row] : row] : 1.0f;
}
template <int FMT>
__device__ __forceinline__ float epilogue_column_sdec(const float* partials, const float* w_sdec, int e,
                                                      int sdec_groups, int col, int N) {
    return FMT == 3 && !partials && col < N ? nvfp4_column_sdec(w_sdec, e, sdec_groups, col, N) : 1.0f;
}

// The k range of this block: all of K, or (split-K) the segment blockIdx.z.
__device__ __forceinline__ void block_k_range(const float* partials, int K, int& k_begin, int& k_end) {
    k_begin = partials ? (int)blockIdx.z * SEG : 0;
    k_end = partials ? min(K, k_begin + SEG) : K;
}

// The K range of a wgmma `_runs` kernel's block: as block_k_range, or where the split grid has
// fewer blocks than K has segments (ops::gemm::SplitK::OneWave), a run of
// ceil(segments / gridDim.z) consecutive segments, each of whose sums the block stores as that
// segment's (wgmma_segment_sums): what a block a segment stores, so the fold adds the same sums.
__device__ __forceinline__ void block_k_run(const float* partials, int K, int& k_begin, int& k_end) {
    int per = partials ? ((K + SEG - 1) / SEG + (int)gridDim.z - 1) / (int)gridDim.z : 0;
    k_begin = partials ? (int)blockIdx.z * per * SEG : 0;
    k_end = partials ? min(K, k_begin + per * SEG) : K;
}

// The end of a segment: its sum joins the running total (or starts it) and the accumulators
// start again from zero.
// `tot` holds element i at tot[i * STRIDE] (registers, or a lane's column of shared memory).
template <int COUNT, int STRIDE = 1>
__device__ __forceinline__ void end_segment(float* acc, float* tot, bool first) {
#pragma unroll
    for (int i = 0; i < COUNT; i++) {
        tot[i * STRIDE] = first ? acc[i] : __fadd_rn(tot[i * STRIDE], acc[i]);
        acc[i] = 0.0f;
    }
}

// One output element's sum: the segment's sum into `partials` (split-K, dense rows), or the
// whole chain's through the NVFP4 epilogue (times the row's scale, then the column's S_dec:
// epilogue_row_scale, epilogue_column_sdec) into out.
template <int FMT>
__device__ __forceinline__ float epilogue_value(float v, float row_s, float col_sdec) {
    return FMT == 3 ? __fmul_rn(__fmul_rn(v, row_s), col_sdec) : v;
}
template <int FMT>
__device__ __forceinline__ void store_sum(float v, float* partials, int rows, int row, int col, int N, float row_s,
                                          float col_sdec, float* out) {
    if (partials) {
        partials[((u64)blockIdx.z * rows + row) * N + col] = v;
        return;
    }
    out[(u64)row * N + col] = epilogue_value<FMT>(v, row_s, col_sdec);
}

// Split-K's last step, inside the launch: the group (a block, or with WARP one warp) whose
// segment's sums are the last of the gridDim.z to land for its output region adds the
// region's segments in order (s0, then + s1, ...: the additions a whole-K block makes) and
// applies the NVFP4 epilogue of expert e. counters[counter] counts the region's finished
// groups and is left at zero for the next launch. The region is rows r0..r1 x columns c0..c1.
template <int FMT, bool WARP>
__device__ __forceinline__ void fold_if_last(const float* partials, u32* counters, int counter, int rows, int N,
                                             int r0, int r1, int c0, int c1, const int* row_index,
                                             const float* row_scale, const float* w_sdec, int e, int sdec_groups,
                                             float* out) {
    __shared__ int block_last;
    __threadfence();  // this thread's sums, seen device-wide before the count
    int last;
    if (WARP) {
        __syncwarp();
        int mine = 0;
        if ((threadIdx.x & 31) == 0) mine = atomicAdd(&counters[counter], 1u) == gridDim.z - 1;
        last = __shfl_sync(0xffffffffu, mine, 0);
    } else {
        __syncthreads();
        if (threadIdx.x == 0) block_last = atomicAdd(&counters[counter], 1u) == gridDim.z - 1;
        __syncthreads();
        last = block_last;
    }
    if (!last) return;
    __threadfence();
    int cols = min(c1, N) - c0, width = WARP ? 32 : blockDim.x, id = WARP ? threadIdx.x & 31 : threadIdx.x;
    u64 count = (u64)rows * N;
    for (int i = id; i < (r1 - r0) * cols; i += width) {
        int row = r0 + i / cols, col = c0 + i % cols;
        u64 at = (u64)row * N + col;
        // Eight segments' sums loaded at a time (one wait for the eight, not one each), then
        // added in segment order.
        float v = __ldcg(partials + at);
        for (int z0 = 1; z0 < (int)gridDim.z; z0 += 8) {
            float seg[8];
#pragma unroll
            for (int j = 0; j < 8; j++) seg[j] = z0 + j < (int)gridDim.z ? __ldcg(partials + (z0 + j) * count + at) : 0.0f;
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (z0 + j < (int)gridDim.z) v = __fadd_rn(v, seg[j]);
        }
        if (FMT == 3) {
            u64 src = row_index ? (u64)row_index[row] : (u64)row;
            v = nvfp4_epilogue_scale(v, row_scale, src, w_sdec, e, sdec_groups, col, N);
        }
        out[at] = v;
    }
    if (id == 0) counters[counter] = 0;
}

// ---- Tiles: activations packed once, operands streamed into shared memory ----

// The tiled and wgmma kernels' activation operand, each span's words in packed_word's order:
// every x row as pack_act8's words, `packing` 0 BF16, 1 FP16 (NVFP4), rounded to nearest even
// (host: ops::gemm::Packing). Row r is x row row_index[r] (null: r): the TMA kernels read a
// routing plan's rows in its order. A block a row at a time (grid-stride over rows), a thread a
// 16-byte piece of it at a time: piece q of a span holds its words q, q + 4, q + 8 and q + 12.
// (A thread a word, with 64-bit index arithmetic each: the TMA kernel's BF16 gate/up at 4,096
// tokens, packing included, took 783 us against 706 this way; H200, 2026-12-05.)
// `packing` 2: x holds such words already (K / 2 a row, e.g. the NVFP4 quantizer's), and the
// rows row_index names are copied in their order.
extern "C" __global__ void pack_gemm_operand(const float* x, const int* row_index, int rows, int K, int packing,
                                             u32* out) {
    pdl_entry();
    bool f16 = packing == 1;
    int pieces = K / 8;
    if (packing == 2) {
        for (int row = blockIdx.x; row < rows; row += gridDim.x) {
            const uint4* src = (const uint4*)((const u32*)x + (u64)(row_index ? row_index[row] : row) * (K / 2));
            uint4* dst = (uint4*)(out + (u64)row * (K / 2));
            for (int p = threadIdx.x; p < pieces; p += blockDim.x) dst[p] = src[p];
        }
        return;
    }
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* src = x + (u64)(row_index ? row_index[row] : row) * K;
        uint4* dst = (uint4*)(out + (u64)row * (K / 2));
        for (int p = threadIdx.x; p < pieces; p += blockDim.x) {
            // Words q, q + 4, q + 8, q + 12 of span p / 4 hold x at k = 2q + 8i (+1).
            const float* at = src + 32 * (p >> 2) + 2 * (p & 3);
            u32 w[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 v = *(const float2*)(at + 8 * i);
                w[i] = pack_operand(f16, v.x, v.y);
            }
            dst[p] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

#define TILE_TN 128   // columns per block: 4 warps of 32
#define TM_WIDE 64    // rows per wide tile (host: ops::gemm::GEMM_WIDE_TILE_ROWS)
// Spans in flight in the tiled kernels: three, and four for quantized 32-row tiles, whose
// stages are small (4-6 KB), so that the ring divides a segment and a whole segment's walk is
// unrolled with its stages known (tiled_walk).
template <int FMT, int WM>
constexpr int TiledStages = FMT != 1 && WM == 1 ? 4 : 3;
static_assert(TiledStages<3, 1> - 1 < SEG / 32 && TiledStages<1, 1> - 1 < SEG / 32,
              "a segment's scales are overwritten two segments later");

// A SwiGLU tile (the gate/up GEMM with silu(gate) * up in its epilogue: grouped_gemm_wgmma
// with OUT != 0) covers the 64 h columns h0.. of an expert's N = 2 * inter weight rows (gate
// rows 0..inter, up rows inter..N): a warp's 16 columns are the gate rows of 8 h columns, then
// the up rows of the same 8, so a lane's A rows g and g + 8 (col_local) are one h column's gate
// and up. The weight row of tile column `col` (0..TILE_TN), or -1 past inter.
__device__ __forceinline__ int swiglu_weight_row(int col, int h0, int N) {
    int inter = N / 2, hc = h0 + 8 * (col / 16) + col % 8;
    return hc >= inter ? -1 : col % 16 >= 8 ? inter + hc : hc;
}

// One thread's share of copying spans (32 k from k0) of the TILE_TN weight columns n0.. of
// expert e into a stage ([column][W_BYTES], W_BYTES a column's span in FMT), as 16-byte
// cp.async copies spread over THREADS threads, each asking L2 for its whole line (the column's
// next spans: cp_async16_line_at); columns past N read nothing (zeros). The tiled and wgmma
// kernels' copy: the sources (at k0) and places are worked out once; a span adds its k, or
// (issue_next) moves the sources on a span.
template <int FMT, int THREADS>
struct WeightSpanCopy {
    static constexpr int W_BYTES = FMT == 1 ? 64 : FMT == 2 ? 32 : 16;
    static constexpr int W_ALL = TILE_TN * W_BYTES / 16, CHUNKS = (W_ALL + THREADS - 1) / THREADS;
    const u8* src[CHUNKS];  // at k = k0
    int dst[CHUNKS];        // byte offset in a stage; -1: no chunk for this thread
    bool live[CHUNKS];

    // With `swiglu`, the stage's columns are a SwiGLU tile's (swiglu_weight_row, n0 the tile's
    // first h column).
    __device__ __forceinline__ WeightSpanCopy(const void* w, int e, int N, int n0, int K, int tid, int k0 = 0,
                                              bool swiglu = false) {
        u64 row_bytes = FMT == 1 ? (u64)K * 2 : FMT == 2 ? (u64)K : (u64)K / 2;
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            int chunk = tid + THREADS * c, col = chunk / (W_BYTES / 16), part = chunk % (W_BYTES / 16);
            int n = swiglu ? swiglu_weight_row(col, n0, N) : n0 + col;
            live[c] = swiglu ? n >= 0 : n < N;
            u64 row = (u64)e * N + (live[c] ? n : 0);
            src[c] = (const u8*)w + row * row_bytes + k0 * W_BYTES / 32 + 16 * part;
            dst[c] = W_ALL % THREADS != 0 && chunk >= W_ALL ? -1 : col * W_BYTES + 16 * part;
        }
    }

    // The wgmma kernel's copies (k0 = 0 made), into a stage given by pointer, each address
    // converted on its own: converting the stage once compiled the MXFP8 wgmma kernel to 40
    // more instructions (ptxas 13.5).
    __device__ __forceinline__ void issue(u8* stage, int k0) const {
#pragma unroll
        for (int c = 0; c < CHUNKS; c++)
            if (W_ALL % THREADS == 0 || dst[c] >= 0)
                cp_async16_line_at((u32)__cvta_generic_to_shared(stage + dst[c]), src[c] + k0 * W_BYTES / 32, live[c]);
    }
    // The tiled kernels' copies of the spans in order from k0, into a stage given by address.
    __device__ __forceinline__ void issue_next(u32 stage) {
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            if (W_ALL % THREADS == 0 || dst[c] >= 0) cp_async16_line_at(stage + dst[c], src[c], live[c]);
            src[c] += W_BYTES;
        }
    }
};

// NVFP4 on 32-row tiles copies a column's weights two spans at a time: 32 bytes, one whole L2
// sector, where a span's 16 bytes asked for half a sector each (the tiled NVFP4 kernel is bound
// by L2's sector rate: docs/performance.md, forty-eighth and fifty-ninth sessions). H100,
// 2026-12-06: expert gate/up at 64 / 256 tokens 143.5 / 160.7 -> 115.6 / 126.6 us, down 82.0 /
// 94.7 -> 73.9 / 84.2; NVFP4 steps at 8 / 64 / 256 rows 3-6% faster.
template <int FMT, int WM>
constexpr bool TiledPairs = FMT == 3 && WM == 1;
#define PAIR_SLOTS 4                   // pair slots in the ring: a segment's 8 spans
#define PAIR_SLOT (TILE_TN * 32)       // a slot's bytes: [column][32]

// One thread's share of copying span pairs of the TILE_TN NVFP4 weight columns n0.. of expert e
// into slots of [column][32 bytes]: thread pairs take the two 16-byte halves of a column's
// sector in one instruction (so L2 sees one request for the sector), two columns 64 apart a
// thread on 128 threads. A column's halves are swapped on columns 4-7 of every 8, so the 8
// columns a warp reads at once (lanes g, 4 bytes at t) fall in distinct banks.
struct Nvfp4PairCopy {
    const u8* src[2];  // the next pair's half
    u32 dst;           // byte offset in a slot of the first column's half (the second's: + 64 columns)
    bool live[2], upper;

    __device__ __forceinline__ Nvfp4PairCopy(const void* w, int e, int N, int n0, int K, int tid, int k0) {
        u64 row_bytes = (u64)K / 2;
        upper = tid & 1;
#pragma unroll
        for (int c = 0; c < 2; c++) {
            int col = (tid >> 1) + 64 * c, n = n0 + col;
            live[c] = n < N;
            src[c] = (const u8*)w + ((u64)e * N + (live[c] ? n : 0)) * row_bytes + k0 / 2 + 16 * upper;
        }
        int col = tid >> 1;
        dst = col * 32 + ((upper ^ ((col >> 2) & 1)) << 4);
    }
    // The next pair (in order from k0) into the slot at `slot`; SECOND: whether its second span
    // is in the block's K range (else that half is zeros, read from nowhere).
    template <bool SECOND>
    __device__ __forceinline__ void issue_next(u32 slot) {
#pragma unroll
        for (int c = 0; c < 2; c++) {
            cp_async16_line_at(slot + dst + c * 64 * 32, src[c], live[c] && (SECOND || !upper));
            src[c] += 32;
        }
    }
};

// A tiled block's walk over its spans for one warp whose rows hold FRAGS live m16 fragments
// (0 to 2; plain BF16 keeps both) and with the block scales staged in shared memory a segment
// at a time (SEG_STAGED: ss_ld, lane's scale of fragment 0 in segment buffer 0) or read a span
// ahead (load_scales): the K chain's products, each segment's sums joining the running total
// (element i at tot[i * TOT_STRIDE]). `issue(span, stage, ring)` copies a span into a stage
// (ring: a number congruent to span modulo SEG / MMA_TK), the spans in order; spans 0 ..
// TiledStages - 2 are issued and committed. With TiledPairs the weights are read from pair
// slots (w_ld: a span's of even place in a segment, w_ld1: of odd). One instantiation per
// live-fragment count: a warp-uniform skip inside the loop cost every MMA a WARPSYNC.
template <int FMT, int WM, int FRAGS, bool SEG_STAGED, int TOT_STRIDE, class Issue, class LoadScales>
__device__ __forceinline__ void tiled_walk(int spans, Issue& issue, const LoadScales& load_scales, u32 ss_ld,
                                           const u32 (&a_ld)[2], u32 w_ld, u32 w_ld1, float* tot) {
    constexpr int STAGES = TiledStages<FMT, WM>;
    constexpr int TMR = 32 * WM;
    constexpr int W_BYTES = WeightSpanCopy<FMT, 128 * WM>::W_BYTES;
    constexpr int SEG_SPANS = SEG / MMA_TK, SEG_SCALES = SEG_SPANS * SPAN_SCALES<FMT>;
    constexpr u32 AS_STAGE = TMR * 64, WS_STAGE = TILE_TN * W_BYTES;
    constexpr bool PAIRS = TiledPairs<FMT, WM>;
    float acc[FRAGS > 0 ? FRAGS : 1][4][4];
#pragma unroll
    for (int i = 0; i < (FRAGS > 0 ? FRAGS : 1); i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) acc[i][j][v] = 0.0f;
    u8 sc[4], sc_next[4];
    if (!SEG_STAGED) load_scales(0, sc);
    // One span in stage `cur`, issuing the span STAGES - 1 ahead into stage `ahead`; its scales
    // (SEG_STAGED) at ss_at. `ring`: the span's place in its segment (span % SEG_SPANS, a
    // constant in the unrolled walk), which picks its pair slot and half (PAIRS).
    auto step = [&](int span, int cur, int ahead, u32 ss_at, int ring) {
        if (!SEG_STAGED && FRAGS > 0) load_scales(span + 1, sc_next);
        cp_async_wait<STAGES - 2>();
        // This span's stage (and, at a segment's first span, its scales) is in; every warp is
        // done with the stage refilled next, and with the scales of two segments back
        // (overwritten by the issue at a segment's first span, STAGES - 1 < SEG_SPANS spans
        // after the last of them was read).
        __syncthreads();
        if (SEG_STAGED && FRAGS > 0) {
#pragma unroll
            for (int ni = 0; ni < 4; ni++) sc[ni] = lds_u8(ss_at + ni * 8 * SEG_SCALES);
        }
        if (span + STAGES - 1 < spans) issue(span + STAGES - 1, ahead, ring + STAGES - 1);
        cp_async_commit();
        if constexpr (FRAGS > 0) {
            // a[mi][c]: chunk c's A fragment of rows mi * 16.., one ldmatrix each.
            u32 a[FRAGS][2][4];
#pragma unroll
            for (int mi = 0; mi < FRAGS; mi++)
#pragma unroll
                for (int c = 0; c < 2; c++) ldmatrix_x4_at(a_ld[c] + cur * AS_STAGE + mi * 16 * 64, a[mi][c]);
            u32 w_stage = PAIRS ? ((ring & 1) ? w_ld1 : w_ld) + ((ring >> 1) % PAIR_SLOTS) * PAIR_SLOT
                                : w_ld + cur * WS_STAGE;
            constexpr int COL_BYTES = PAIRS ? 32 : W_BYTES;  // a column's bytes in a stage or slot
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                u32 b[4];
                decode_weight8<FMT>(smem_weight8_at<FMT>(w_stage + ni * 8 * COL_BYTES, sc[ni]), b);
#pragma unroll
                for (int mi = 0; mi < FRAGS; mi++)
#pragma unroll
                    for (int c = 0; c < 2; c++) mma_k16<FMT>(acc[mi][ni], a[mi][c], &b[2 * c]);  // chunk 0, then 1
            }
            if (!SEG_STAGED) {
#pragma unroll
                for (int ni = 0; ni < 4; ni++) sc[ni] = sc_next[ni];
            }
        }
    };
    // Whole segments with staged scales unrolled when the ring's stages divide a segment: each
    // span's stages are then constants (a segment starts in stage 0).
    constexpr bool UNROLL = SEG_STAGED && FRAGS > 0 && SEG_SPANS % STAGES == 0;
    // The stage of the next span, and of the span issued at it (STAGES - 1 ahead).
    int cur = 0, ahead = STAGES - 1;
    // Segment by segment (SEG / MMA_TK spans each; the last may be shorter), so the running
    // total is touched once per segment.
    for (int seg0 = 0; seg0 < spans; seg0 += SEG_SPANS) {
        int seg_end = min(spans, seg0 + SEG_SPANS);
        u32 ss_span = ss_ld + ((seg0 / SEG_SPANS) & 1) * (TILE_TN * SEG_SCALES);
        if (UNROLL && seg_end - seg0 == SEG_SPANS) {
#pragma unroll
            for (int j = 0; j < SEG_SPANS; j++)
                step(seg0 + j, j % STAGES, (j + STAGES - 1) % STAGES, ss_span + j * SPAN_SCALES<FMT>, j);
        } else {
            for (int span = seg0; span < seg_end; span++) {
                step(span, cur, ahead, ss_span, span - seg0);
                ss_span += SPAN_SCALES<FMT>;
                cur = cur == STAGES - 1 ? 0 : cur + 1;
                ahead = ahead == STAGES - 1 ? 0 : ahead + 1;
            }
        }
        if constexpr (FRAGS > 0) end_segment<FRAGS * 16, TOT_STRIDE>(&acc[0][0][0], tot, seg0 == 0);
    }
    cp_async_wait<0>();
}

// Grid (ceil(N / 128), tiles), 128 * WM threads: tiles of 32 * WM rows, a warp per 32 rows
// and 32 columns (WM = 2: the routing plan's wide tiles, each expert's weights read from L2
// once per 64 rows instead of 32). xb is x packed by pack_gemm_operand. Requires K % 32 == 0
// (the host checks). Each span's packed activations and raw weight bytes are copied into a
// ring of TiledStages shared-memory stages (cp.async) while the tensor cores work on an
// earlier one (NVFP4 32-row tiles: the weights two spans a copy into a ring of pair slots,
// Nvfp4PairCopy). The activations come out of shared memory as whole mma fragments
// (ldmatrix over the packed order); each warp decodes its own 32 columns' weights from
// shared memory straight into fragments (block scales staged a segment at a time in shared
// memory where K is whole segments, else read one span ahead into registers).
// The products are the K chain's, in its order, as the few-rows kernels make them.
template <int FMT, int WM>
__device__ __forceinline__ void grouped_gemm_tiled(const float*, const int* row_index, const float* row_scale,
                                                   const void* w, const u8* w_scales, const float* w_sdec,
                                                   int sdec_groups, const int* tiles, const int* num_tiles,
                                                   const int* offsets, int rows, int N, int K, float* out,
                                                   float* partials, const u32* xb, u32* counters, int bx) {
    int e, r0, r1;
    constexpr int TMR = 32 * WM, THREADS = 128 * WM, STAGES = TiledStages<FMT, WM>;
    if (!tile_rows(tiles, num_tiles, offsets, rows, e, r0, r1, TMR)) return;
    int n0 = bx * TILE_TN;
    constexpr int W_BYTES = WeightSpanCopy<FMT, THREADS>::W_BYTES;  // one column's span
    constexpr bool PAIRS = TiledPairs<FMT, WM>;
    __shared__ __align__(16) u32 as[STAGES][TMR][16];  // 32 values per row, a_piece order
    // The weights' stages, or (PAIRS) their pair slots.
    __shared__ __align__(16) u8 ws[PAIRS ? PAIR_SLOTS : STAGES][TILE_TN][PAIRS ? 32 : W_BYTES];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    int wm = warp >> 2, wn = warp & 3;  // this warp's rows wm * 32.., columns wn * 32..

    // Copy roles: A row tid / 4, 16-byte piece tid % 4; W chunks tid + THREADS c.
    int a_row = tid >> 2, a_chunk = tid & 3;
    bool a_live = r0 + a_row < r1;
    u64 a_src = a_live ? (row_index ? (u64)row_index[r0 + a_row] : (u64)(r0 + a_row)) : 0;
    int a_dst = 4 * a_piece(a_row, a_chunk);

    int k_begin, k_end;
    block_k_range(partials, K, k_begin, k_end);
    int spans = (k_end - k_begin) / MMA_TK;
    WeightSpanCopy<FMT, THREADS> w_copy(w, e, N, n0, K, tid, k_begin);
    Nvfp4PairCopy pair_copy(w, e, N, n0, K, tid, k_begin);  // PAIRS only (else unused)
    // This thread's source of the next span to issue (spans are issued in order): its A piece;
    // the weights' are w_copy's (pair_copy's with PAIRS).
    const u8* a_next = (const u8*)(xb + a_src * (K / 2)) + a_chunk * 16 + k_begin * 2;
    // Where K is whole segments (and the scales 16-byte aligned), a segment's block scales of
    // the block's columns are copied into shared memory with the segment's first span (one
    // 8- or 16-byte copy a column; two segments' worth, alternating), instead of each lane
    // reading its bytes one span at a time from scattered global rows: the same bytes.
    constexpr int SEG_SPANS = SEG / MMA_TK, SEG_SCALES = SEG_SPANS * SPAN_SCALES<FMT>;
    __shared__ __align__(16) u8 ss[SEG_SCALES ? 2 : 1][SEG_SCALES ? TILE_TN : 1][SEG_SCALES ? SEG_SCALES : 1];
    bool seg_scales = SEG_SCALES && K % SEG == 0 && ((u64)w_scales & 15) == 0;
    const u8* ss_src = nullptr;
    bool ss_live = false;
    if (SEG_SCALES && tid < TILE_TN) {
        ss_live = n0 + tid < N;
        u64 row = (u64)e * N + (ss_live ? n0 + tid : 0);
        ss_src = w_scales + (row * (K / MMA_TK) + k_begin / MMA_TK) * SPAN_SCALES<FMT>;
    }
    // Shared memory by its own 32-bit addresses, worked out once: a span adds only its stage's
    // offset (generic pointers made the loop rebuild the shared window's base every span).
    constexpr u32 AS_STAGE = TMR * 64, WS_STAGE = TILE_TN * W_BYTES;
    const u32 as_addr = (u32)__cvta_generic_to_shared(&as[0][0][0]);
    const u32 ws_addr = (u32)__cvta_generic_to_shared(&ws[0][0][0]);
    const u32 a_copy = as_addr + a_row * 64 + 4 * a_dst;
    const u32 ss_copy = (u32)__cvta_generic_to_shared(&ss[0][0][0]) + (tid % TILE_TN) * SEG_SCALES;
    // `ring`: a number congruent to span modulo SEG_SPANS (a constant in the unrolled walk).
    auto issue = [&](int span, int stage, int ring) {
        cp_async16_at(a_copy + stage * AS_STAGE, a_next, a_live);
        a_next += MMA_TK * 2;
        if constexpr (PAIRS) {
            // Pair q (spans 2q, 2q + 1) is copied with span 2q - 1 (pair 0 before the walk), into
            // slot q % PAIR_SLOTS, last read for spans 2q - 8 and 2q - 7: every warp is past them
            // at the barrier before this issue (span 2q - 4's step).
            static_assert(PAIR_SLOTS * 2 == SEG_SPANS, "a segment's pairs fill the slots once");
            if ((ring & 1) && span + 1 < spans) {
                u32 slot = ws_addr + ((ring + 1) / 2 % PAIR_SLOTS) * PAIR_SLOT;
                if (span + 2 < spans) pair_copy.issue_next<true>(slot);
                else pair_copy.issue_next<false>(slot);  // the last span is even
            }
        } else {
            w_copy.issue_next(ws_addr + stage * WS_STAGE);
        }
        if (SEG_SCALES && seg_scales && span % SEG_SPANS == 0 && tid < TILE_TN) {
            u32 dst = ss_copy + ((span / SEG_SPANS) & 1) * (TILE_TN * SEG_SCALES);
            const u8* src = ss_src + span * SPAN_SCALES<FMT>;
            if constexpr (SEG_SCALES == 16) cp_async16_at(dst, src, ss_live);
            else if constexpr (SEG_SCALES == 8) cp_async8_at(dst, src, ss_live);
        }
    };
    // This lane's ldmatrix rows: row l % 8 (+ 8 for matrices 1 and 3) of each m16 fragment;
    // matrices 2 and 3 take a chunk's second piece. a_ld[c]: chunk c's fragment of the warp's
    // first 16 rows in stage 0 (the piece order does not depend on the fragment: a_piece reads
    // row bits 1-2).
    int lm_row = (lane & 7) + 8 * ((lane >> 3) & 1), lm_piece = lane >> 4;
    u32 a_ld[2];
#pragma unroll
    for (int c = 0; c < 2; c++) {
        int r = wm * 32 + lm_row;
        a_ld[c] = as_addr + r * 64 + 16 * a_piece(r, 2 * c + lm_piece);
    }
    // This lane's weights of fragment ni in stage 0: w_ld + ni * 8 * W_BYTES; with PAIRS, of an
    // even span in slot 0 w_ld + ni * 8 * 32, of an odd one w_ld1 + ni * 8 * 32 (the halves
    // swapped on columns 4-7 of every 8: Nvfp4PairCopy).
    const u32 w_ld = PAIRS ? ws_addr + (wn * 32 + g) * 32 + t * 4 + (((g >> 2) & 1) << 4)
                           : ws_addr + (wn * 32 + g) * W_BYTES + t * W_BYTES / 4;
    const u32 w_ld1 = PAIRS ? ws_addr + (wn * 32 + g) * 32 + t * 4 + ((((g >> 2) & 1) ^ 1) << 4) : w_ld;

    // This lane's weight columns (g of each n8 fragment) and their block scales, read a span
    // ahead through a pointer per column (column_scales).
    const u8* col_scales[4];
#pragma unroll
    for (int ni = 0; ni < 4; ni++) {
        int n = n0 + wn * 32 + ni * 8 + g;
        col_scales[ni] = column_scales<FMT>(w_scales, (u64)e * N + (n < N ? n : 0), K, k_begin, t);
    }
    auto load_scales = [&](int span, u8* out_scales) {
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
            out_scales[ni] = SPAN_SCALES<FMT> && span < spans ? col_scales[ni][span * SPAN_SCALES<FMT>] : 0;
    };
    // A span's scales from shared memory (after the wait for its copy group): fragment ni's at
    // ss_ld + segment buffer + ni * 8 * SEG_SCALES + the span's place in its segment.
    const u32 ss_ld = (u32)__cvta_generic_to_shared(&ss[0][0][0]) + (wn * 32 + g) * SEG_SCALES + (FMT == 3 ? t / 2 : 0);

    // The running total (element i at tot[i * TOT_STRIDE]): in registers, or for quantized
    // weights on 32-row tiles in shared memory (lane l's element i at [warp][i][l]), which is
    // touched once per segment and leaves the registers to the weights' decoding.
    constexpr bool TOT_SHARED = FMT != 1 && WM == 1;
    constexpr int TOT_STRIDE = TOT_SHARED ? 32 : 1;
    __shared__ float tot_s[TOT_SHARED ? THREADS / 32 : 1][TOT_SHARED ? 32 : 1][32];
    float tot_r[TOT_SHARED ? 1 : 32];
    float* tot = TOT_SHARED ? &tot_s[warp][0][lane] : tot_r;

    if constexpr (PAIRS) {
        if (spans > 1) pair_copy.issue_next<true>(ws_addr);  // pair 0, in span 0's group
        else if (spans > 0) pair_copy.issue_next<false>(ws_addr);
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < spans) issue(s, s, s);
        cp_async_commit();
    }
    // This warp's live m16 fragments: with quantized weights one with no live row is skipped
    // (the walk's instantiation for the count). Plain BF16 tiles keep every MMA: the branches
    // cost them more than the MMAs (H200, 2026-12-03: expert gate/up at 256 tokens 340 -> 359
    // us with the skip).
    int live = r1 - r0 - wm * 32;
#define TILED_WALK(FRAGS, STAGED) \
    tiled_walk<FMT, WM, FRAGS, STAGED, TOT_STRIDE>(spans, issue, load_scales, ss_ld, a_ld, w_ld, w_ld1, tot)
    if constexpr (FMT == 1) {
        TILED_WALK(2, false);  // no block scales
    } else if (live > 16) {
        if (seg_scales) TILED_WALK(2, true);
        else TILED_WALK(2, false);
    } else if (WM == 1 || live > 0) {
        if (seg_scales) TILED_WALK(1, true);
        else TILED_WALK(1, false);
    } else {
        if constexpr (WM > 1) {
            if (seg_scales) TILED_WALK(0, true);
            else TILED_WALK(0, false);
        }
    }
#undef TILED_WALK

    // A skipped fragment's rows are past r1: its sums are never stored.
    // C fragment: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of each 16x8 tile.
    float col_sdec[4][2];
#pragma unroll
    for (int ni = 0; ni < 4; ni++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            col_sdec[ni][j] =
                epilogue_column_sdec<FMT>(partials, w_sdec, e, sdec_groups, n0 + wn * 32 + ni * 8 + 2 * t + j, N);
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int row = r0 + wm * 32 + mi * 16 + g + 8 * half;
            if (row >= r1) continue;
            float row_s = epilogue_row_scale<FMT>(partials, row_scale, row_index, row);
#pragma unroll
            for (int ni = 0; ni < 4; ni++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    int col = n0 + wn * 32 + ni * 8 + 2 * t + j;
                    if (col >= N) continue;
                    store_sum<FMT>(tot[TOT_STRIDE * ((mi * 4 + ni) * 4 + 2 * half + j)], partials, rows, row, col, N,
                                   row_s, col_sdec[ni][j], out);
                }
        }
    if (partials && counters)
        fold_if_last<FMT, false>(partials, counters, blockIdx.y * gridDim.x + blockIdx.x, rows, N, r0, r1, n0,
                                 n0 + TILE_TN, row_index, row_scale, w_sdec, e, sdec_groups, out);
}

template <int FMT>
__device__ void grouped_gemm_mma(const float* x, const int* row_index, const float* row_scale, const void* w,
                                 const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                                 const int* num_tiles, const int* offsets, int rows, int N, int K, float* out,
                                 float* partials, const u32* xb, u32* counters, int bx) {
    grouped_gemm_tiled<FMT, 1>(x, row_index, row_scale, w, w_scales, w_sdec, sdec_groups, tiles, num_tiles, offsets,
                               rows, N, K, out, partials, xb, counters, bx);
}

// `tiles` is the routing plan's list of wide tiles (TM_WIDE rows).
template <int FMT>
__device__ void grouped_gemm_mma_wide(const float* x, const int* row_index, const float* row_scale, const void* w,
                                      const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                                      const int* num_tiles, const int* offsets, int rows, int N, int K, float* out,
                                      float* partials, const u32* xb, u32* counters, int bx) {
    grouped_gemm_tiled<FMT, TM_WIDE / 32>(x, row_index, row_scale, w, w_scales, w_sdec, sdec_groups, tiles,
                                          num_tiles, offsets, rows, N, K, out, partials, xb, counters, bx);
}

// ---- Tensor cores for tiles of few rows: a warp per 8 * NF output columns ----

#define SKINNY_WARPS 4  // warps per 128-thread block

// The K chain of one warp's NF fragments over k_begin..k_end for the tile's first FRAGS m16
// fragments (rows xr), SPANS spans of weights loaded ahead at a time; each segment's sums join
// the running total `tot` (a lane's column of shared memory, element i at tot[32 i]).
template <int FMT, int NF, int FRAGS, int SPANS>
__device__ __forceinline__ void skinny_chain(const void* w, const u8* w_scales, const u64* w_row,
                                             const float* const (*xr)[2], int live, int K, int k_begin, int k_end,
                                             int t, float* tot) {
    float acc[FRAGS][NF][4];
#pragma unroll
    for (int mi = 0; mi < FRAGS; mi++)
#pragma unroll
        for (int f = 0; f < NF; f++)
#pragma unroll
            for (int v = 0; v < 4; v++) acc[mi][f][v] = 0.0f;
    // Each column's weights from k_begin + 8t on (one span after another: fixed offsets).
    const u8* wq[NF];
    const u8* wsc[NF];
#pragma unroll
    for (int f = 0; f < NF; f++) {
        WeightCursor<FMT> c(w, w_scales, w_row[f], k_begin + 8 * t, K);
        wq[f] = c.q;
        wsc[f] = c.sc;
    }
    for (int k0 = k_begin; k0 < k_end; k0 += 32 * SPANS) {
        int spans = min(SPANS, (k_end - k0) / 32);
        Weight8 wc[SPANS][NF];
#pragma unroll
        for (int f = 0; f < NF; f++) {
            WeightCursor<FMT> c(wq[f], wsc[f]);
#pragma unroll
            for (int s = 0; s < SPANS; s++)
                if (s < spans) wc[s][f] = c.at(s);
            wq[f] += SPANS * WeightCursor<FMT>::BYTES_PER_32K;
            if (FMT != 1) wsc[f] += SPANS * WeightCursor<FMT>::SCALES_PER_32K;
        }
#pragma unroll
        for (int s = 0; s < SPANS; s++) {
            if (s >= spans) break;
            u32 b[NF][4];
#pragma unroll
            for (int f = 0; f < NF; f++) decode_weight8<FMT>(wc[s][f], b[f]);
#pragma unroll
            for (int mi = 0; mi < FRAGS; mi++) {
                if (mi * 16 >= live) break;
                u32 words[2][4] = {};
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    if (h == 1 && mi * 16 + 8 >= live) break;  // no live row in the upper half
                    float4 va = make_float4(0, 0, 0, 0), vb = va;
                    if (xr[mi][h]) {
                        const float4* p = (const float4*)(xr[mi][h] + k0 + 32 * s);
                        va = p[0];
                        vb = p[1];
                    }
                    pack_act8<FMT>(va, vb, words[h]);
                }
#pragma unroll
                for (int f = 0; f < NF; f++) mma_span<FMT>(acc[mi][f], words[0], words[1], b[f]);
            }
        }
        // 32 * SPANS divides SEG: a segment ends only at the end of an iteration.
        if ((k0 + 32 * SPANS) % SEG == 0 || k0 + 32 * SPANS >= k_end)
            end_segment<FRAGS * NF * 4, 32>(&acc[0][0][0], tot, k0 < k_begin + SEG);
    }
}

// Grid (ceil(N / (32 * NF)), tiles), 128 threads. Requires K % 32 == 0. Each lane streams the
// 8 values per span of its NF weight columns (g of each n8 fragment) from global memory,
// SPANS spans ahead, and packs its rows' activations itself (L1-resident, shared by the
// block's warps) once per span for all NF fragments; more fragments per warp spread that
// packing over more weights, fewer give more warps. The tile's rows are at most TM = two m16
// fragments; a fragment, or its upper 8 rows, with no live row is skipped (warp-uniform), and
// a tile of at most 16 rows (every tile of a step of at most 16 tokens) may take a chain over
// one fragment: the same products in the same order.
template <int FMT, int NF>
__device__ void grouped_gemm_skinny(const float* x, const int* row_index, const float* row_scale, const void* w,
                                    const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                                    const int* num_tiles, const int* offsets, int rows, int N, int K, float* out,
                                    float* partials, u32* counters, int bx) {
    int e, r0, r1;
    if (!tile_rows(tiles, num_tiles, offsets, rows, e, r0, r1)) return;
    constexpr int FRAGS = TM / 16;
    constexpr int SPANS = NF == 1 ? 8 : 4;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int n0 = (bx * SKINNY_WARPS + warp) * 8 * NF;
    if (n0 >= N) return;  // warp-uniform; split-K folds per warp
    // A lane past N reads column n0 (never stored: lanes store columns 2t, 2t + 1).
    u64 w_row[NF];
#pragma unroll
    for (int f = 0; f < NF; f++) {
        int n = n0 + 8 * f + g;
        w_row[f] = (u64)e * N + (n < N ? n : n0);
    }
    int live = r1 - r0;
    const float* xr[FRAGS][2];
#pragma unroll
    for (int mi = 0; mi < FRAGS; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int row = r0 + mi * 16 + g + 8 * h;
            xr[mi][h] = row < r1 ? x + (row_index ? (u64)row_index[row] : (u64)row) * K + 8 * t : nullptr;
        }
    // The running total lives in shared memory (element i of lane l at [warp][i][l]): it is
    // touched once per segment, and registers go to the weights in flight.
    __shared__ float tot_s[SKINNY_WARPS][FRAGS * NF * 4][32];
    float* tot = &tot_s[warp][0][lane];

    int k_begin, k_end;
    block_k_range(partials, K, k_begin, k_end);
    // BF16 tiles of at most 16 rows, and MXFP8 ones split over K (the one-token launches), take
    // the one-fragment chain: without the second fragment's sums their weights in flight fit in
    // registers (the two-fragment chain spills). Unsplit MXFP8 tiles (8 tokens) and NVFP4 ones
    // (whose chain fits either way) measured slower on it (H200, 2026-12-03).
    if (FMT != 3 && live <= 16 && (FMT == 1 || partials))
        skinny_chain<FMT, NF, 1, SPANS>(w, w_scales, w_row, xr, live, K, k_begin, k_end, t, tot);
    else
        skinny_chain<FMT, NF, FRAGS, SPANS>(w, w_scales, w_row, xr, live, K, k_begin, k_end, t, tot);

    float col_sdec[NF][2];
#pragma unroll
    for (int f = 0; f < NF; f++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            col_sdec[f][j] = epilogue_column_sdec<FMT>(partials, w_sdec, e, sdec_groups, n0 + 8 * f + 2 * t + j, N);
#pragma unroll
    for (int mi = 0; mi < FRAGS; mi++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int row = r0 + mi * 16 + g + 8 * half;
            if (row >= r1) continue;
            float row_s = epilogue_row_scale<FMT>(partials, row_scale, row_index, row);
#pragma unroll
            for (int f = 0; f < NF; f++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    int col = n0 + 8 * f + 2 * t + j;
                    if (col >= N) continue;
                    store_sum<FMT>(tot[32 * ((mi * NF + f) * 4 + 2 * half + j)], partials, rows, row, col, N, row_s,
                                   col_sdec[f][j], out);
                }
        }
    if (partials && counters)
        fold_if_last<FMT, true>(partials, counters, (blockIdx.y * gridDim.x + blockIdx.x) * SKINNY_WARPS + warp, rows,
                                N, r0, r1, n0, n0 + 8 * NF, row_index, row_scale, w_sdec, e, sdec_groups, out);
}

// ---- Few rows, K split over one block's warps ----
//
// The few-rows warps of NF n8 fragments (grouped_gemm_skinny4's 32 columns, or 8), for tiles of
// at most 16 rows (one m16 fragment): a block takes one 8 * NF-column group, and its warps (up
// to KSPLIT_WARPS: blockDim.x / 32) take the K segments w, w + warps, ... Each segment's sums go
// to shared memory; then the block adds every element's segments in order (s0, then + s1, ...:
// the additions a whole-K chain makes), applies the NVFP4 epilogue and stores. Split-K's blocks
// without its partial sums in global memory, counters and last-block fold. Requires K % 32 == 0,
// at most KSPLIT_MAX_SEGMENTS segments and tiles of at most 16 rows (the host's choice; a tile
// of more rows would lose them).

#define KSPLIT_WARPS 8          // host: ops::gemm::BLOCK_SPLIT_THREADS / 32
#define KSPLIT_MAX_SEGMENTS 16  // host: ops::gemm::BLOCK_SPLIT_MAX_SEGMENTS

template <int FMT, int NF = 4>
__device__ void grouped_gemm_skinny_ksplit(const float* x, const int* row_index, const float* row_scale,
                                           const void* w, const u8* w_scales, const float* w_sdec, int sdec_groups,
                                           const int* tiles, const int* num_tiles, const int* offsets, int rows,
                                           int N, int K, float* out, float* /* partials: none */,
                                           const u32* /* xb: reads x itself */, u32* /* counters: none */, int bx) {
    constexpr int ELEMS = NF * 4;
    // One segment's chain holds SPANS spans of NF columns in flight: 16 loads a lane.
    constexpr int SPANS = 16 / NF > 8 ? 8 : 16 / NF;
    int e, r0, r1;
    if (!tile_rows(tiles, num_tiles, offsets, rows, e, r0, r1)) return;
    int n0 = bx * 8 * NF;
    if (n0 >= N) return;  // block-uniform
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u64 w_row[NF];
#pragma unroll
    for (int f = 0; f < NF; f++) {
        int n = n0 + 8 * f + g;
        w_row[f] = (u64)e * N + (n < N ? n : n0);
    }
    int live = min(r1 - r0, 16);
    const float* xr[1][2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int row = r0 + g + 8 * h;
        xr[0][h] = row < r0 + live ? x + (row_index ? (u64)row_index[row] : (u64)row) * K + 8 * t : nullptr;
    }
    // Segment z's sum of element i of lane l at [z][i][l].
    __shared__ float seg_s[KSPLIT_MAX_SEGMENTS][ELEMS][32];
    int segments = (K + SEG - 1) / SEG, warps = blockDim.x >> 5;
    for (int z = warp; z < segments; z += warps)
        skinny_chain<FMT, NF, 1, SPANS>(w, w_scales, w_row, xr, live, K, z * SEG, min(K, (z + 1) * SEG), t,
                                        &seg_s[z][0][lane]);
    __syncthreads();
    // Element i of lane l is row g + 8 * (i % 4 / 2), column 8 * (i / 4) + 2 * t + i % 2 of the
    // fragment's (grouped_gemm_skinny's store).
    for (int at = threadIdx.x; at < ELEMS * 32; at += blockDim.x) {
        int i = at / 32, l = at % 32;
        int row = r0 + (l >> 2) + 8 * (i % 4 / 2), col = n0 + 8 * (i / 4) + 2 * (l & 3) + i % 2;
        if (row >= r0 + live || col >= N) continue;
        float v = seg_s[0][i][l];
        for (int z = 1; z < segments; z++) v = __fadd_rn(v, seg_s[z][i][l]);
        u64 src = row_index ? (u64)row_index[row] : (u64)row;
        if (FMT == 3) v = nvfp4_epilogue_scale(v, row_scale, src, w_sdec, e, sdec_groups, col, N);
        out[(u64)row * N + col] = v;
    }
}

template <int FMT>
__device__ void grouped_gemm_skinny1(const float* x, const int* row_index, const float* row_scale, const void* w,
                                     const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                                     const int* num_tiles, const int* offsets, int rows, int N, int K, float* out,
                                     float* partials, const u32* /* xb: reads x itself */, u32* counters, int bx) {
    grouped_gemm_skinny<FMT, 1>(x, row_index, row_scale, w, w_scales, w_sdec, sdec_groups, tiles, num_tiles, offsets,
                                rows, N, K, out, partials, counters, bx);
}

template <int FMT>
__device__ void grouped_gemm_skinny4(const float* x, const int* row_index, const float* row_scale, const void* w,
                                     const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                                     const int* num_tiles, const int* offsets, int rows, int N, int K, float* out,
                                     float* partials, const u32* /* xb: reads x itself */, u32* counters, int bx) {
    grouped_gemm_skinny<FMT, 4>(x, row_index, row_scale, w, w_scales, w_sdec, sdec_groups, tiles, num_tiles, offsets,
                                rows, N, K, out, partials, counters, bx);
}

// ---- Hopper (sm_90a): warpgroup MMAs with the weights as the A operand ----
//
// The K chain's products on wgmma: examples/cuda_wgmma_probe.rs found wgmma's k16 steps
// bitwise equal to mma.sync's, with either operand as A and with the B operand unswizzled or
// in the 64-byte swizzle (H200, 2026-12-03), so this kernel gives the bits of the ones above.
// It computes out^T = W x^T: a warpgroup's 64 weight columns are wgmma's rows (A, in
// registers: each lane's fragment is the decoded weight words the few-rows kernels make), and
// the tile's rows of x its N (B, from shared memory in the 64-byte swizzle: a row's span is 64
// bytes whose 16-byte pieces are the packed operand's, piece s at s ^ (row / 2) % 4, the tiled
// kernel's `a_piece` order; chunk c's k16 step starts 32c bytes into the rows).
// A tile is 128 rows (a routing plan's pair tile: two wide tiles' rows of one expert; or of a
// dense group) x 128 columns over two warpgroups, one block an SM: each decoded weight fragment feeds 128
// rows, and each byte brought from L2 feeds twice the products of a 64-row tile (ncu, H200,
// 2026-12-03: the 64-row kernel kept L2 87% busy and its shared-memory reads conflicted 62% of
// the time, unswizzled). The grid is the pair tiles' (the plan's `pair_tiles`). A tile of at
// most 64 live rows uses m64n64 MMAs.

#define WG_ROWS 128  // rows per wgmma tile: two wide tiles (host: ops::gemm::PAIR_TILE_ROWS)
#define WG_STAGES 8
#define WG_X_STAGE (WG_ROWS * 64)  // a span of the activations: 64 bytes a row
#define WG_W_STAGE (TILE_TN * 64)  // a span of 128 BF16 columns
// The wgmma kernels' dynamic shared memory, 1024 (the swizzle's alignment) + WG_STAGES *
// (WG_X_STAGE + WG_W_STAGE) bytes, is given by the host (kernels::WGMMA_SMEM_BYTES).

// OUT: what the epilogue writes. 0 (WG_OUT_SUMS): the sums, out [rows][N] (or split-K's
// segment sums). A SwiGLU tile (swiglu_weight_row; whole K, no split) writes h = silu(gate) *
// up, silu_mul's value of the two sums as they would be stored, for its 64 h columns of
// inter = N / 2: WG_OUT_SWIGLU_F32 as f32, out [rows][inter]; WG_OUT_SWIGLU_BF16 as the tiled
// and wgmma kernels' BF16 operand (pack_gemm_operand's words, packing 0), out [rows][inter / 2]
// words (inter a multiple of 32).
#define WG_OUT_SUMS 0
#define WG_OUT_SWIGLU_F32 1
#define WG_OUT_SWIGLU_BF16 2

// A wgmma block's lane: its warpgroup, warp in it, (g, t), and its two weight columns (A rows g
// and g + 8 of its warp's 16) as tile columns and as weight rows (a SwiGLU tile's: -1 past inter).
struct WgLanes {
    int wg, wq, g, t;
    int col_local[2], col_row[2];
};

// The wgmma kernels' epilogue: a block's totals (tot[4j + i]: tile row 8j + 2t + (i & 1), A row
// col_local[i >> 1]) through the NVFP4 epilogue into `out` as OUT says, or split-K's segment
// sums into `partials` (then folded here by the region's last block where `counters` is given).
template <int FMT, int OUT, int ACC = 64>
__device__ __forceinline__ void wgmma_store(const float (&tot)[ACC], const WgLanes& l, int e, int r0, int r1, int n0,
                                            int N, int rows, const int* row_index, const float* row_scale,
                                            const float* w_sdec, int sdec_groups, float* out, float* partials,
                                            u32* counters) {
    constexpr bool swiglu = OUT != WG_OUT_SUMS;
    const int wg = l.wg, wq = l.wq, g = l.g, t = l.t;
    const int* col_local = l.col_local;
    const int* col_row = l.col_row;
    float col_sdec[2];
#pragma unroll
    for (int h = 0; h < 2; h++)
        col_sdec[h] = epilogue_column_sdec<FMT>(partials, w_sdec, e, sdec_groups,
                                                swiglu && col_row[h] < 0 ? N : col_row[h], N);
    // The lane's rows' scales, all read before its first store (read between stores, each waited
    // for in turn: the stores may alias them). Rows past r1 get ones and read nothing. H100,
    // 2026-12-07: the TMA kernel's NVFP4 gate/up at 8,192 tokens 1,940 -> 1,532 us, down 1,020 ->
    // 848, NVFP4 prefill 8 x 2,048 +7.4%. The tiled and few-rows kernels keep theirs between the
    // stores: loaded first there, the 8-token gate/up measured 72 -> 82 us (docs/performance.md,
    // sixty-third session).
    float row_s[ACC / 4][2];
#pragma unroll
    for (int j = 0; j < ACC / 4; j++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int row = r0 + 8 * j + 2 * t + i;
            row_s[j][i] = row < r1 ? epilogue_row_scale<FMT>(partials, row_scale, row_index, row) : 1.0f;
        }
    if constexpr (swiglu) {
        // Lane (g, t) holds h column hc of rows 8j + 2t + i: gate in tot[4j + i], up in
        // tot[4j + 2 + i].
        int inter = N / 2, hc = n0 + 8 * (4 * wg + wq) + g;
        u32* words = (u32*)out;
#pragma unroll
        for (int j = 0; j < ACC / 4; j++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                int row = r0 + 8 * j + 2 * t + i;
                bool live = row < r1 && col_row[0] >= 0;
                float h = silu_mul_value(epilogue_value<FMT>(tot[4 * j + i], row_s[j][i], col_sdec[0]),
                                         epilogue_value<FMT>(tot[4 * j + 2 + i], row_s[j][i], col_sdec[1]));
                if (OUT == WG_OUT_SWIGLU_F32) {
                    if (live) out[(u64)row * inter + hc] = h;
                } else {
                    // Word hc / 2 holds columns hc (low half) and hc + 1: lane g + 1's.
                    float next = __shfl_down_sync(0xffffffffu, h, 4);
                    if (live && g % 2 == 0) words[(u64)row * (inter / 2) + packed_word(hc / 2)] = pack_bf16(h, next);
                }
            }
    } else {
#pragma unroll
        for (int j = 0; j < ACC / 4; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int row = r0 + 8 * j + 2 * t + (i & 1), col = n0 + col_local[i >> 1];
                if (row >= r1 || col >= N) continue;
                store_sum<FMT>(tot[4 * j + i], partials, rows, row, col, N, row_s[j][i & 1], col_sdec[i >> 1], out);
            }
        if (partials && counters)
            fold_if_last<FMT, false>(partials, counters, blockIdx.y * gridDim.x + blockIdx.x, rows, N, r0, r1, n0,
                                     n0 + TILE_TN, row_index, row_scale, w_sdec, e, sdec_groups, out);
    }
}

// One span's products on the wgmma kernels: the lane's decoded weight words of its columns g
// and g + 8 (`wd`) as the A fragments of the span's two k16 steps (`cur`), issued against the
// activations' stage at x_stage in the K chain's order; then a wait for the span before's
// products, whose fragments (`prev`) are free after it.
// X_ROW: the bytes of a row of the activations' stage (64: the 64-byte swizzle; 128: a TMA
// stage of two spans in the 128-byte swizzle, the span's 64 bytes at x_stage's offset).
template <int FMT, int X_ROW = 64, int ACC = 64>
__device__ __forceinline__ void wgmma_span(float (&acc)[ACC], const u32 (&wd)[2][4], u32 (&cur)[2][4],
                                           u32 (&prev)[2][4], u32 x_stage, bool wide_n) {
    // Chunk c's A fragment: (row g, slots 2t..), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..).
#pragma unroll
    for (int c = 0; c < 2; c++) {
        cur[c][0] = wd[0][2 * c];
        cur[c][1] = wd[1][2 * c];
        cur[c][2] = wd[0][2 * c + 1];
        cur[c][3] = wd[1][2 * c + 1];
    }
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int c = 0; c < 2; c++) {  // the K chain's order: chunk 0, then 1
        u64 desc = X_ROW == 128 ? wgmma_desc_sw128(x_stage + 32 * c) : wgmma_desc_sw64(x_stage + 32 * c);
        if (ACC == 64) {
            if (wide_n) wgmma_m64n128k16_rs<0, F16_OPERANDS<FMT>>(acc, cur[c], desc);
            else wgmma_m64n64k16_rs<0, F16_OPERANDS<FMT>>(acc, cur[c], desc);
        } else {
            if (wide_n) wgmma_m64n64k16_rs<0, F16_OPERANDS<FMT>>(acc, cur[c], desc);
            else wgmma_m64n32k16_rs<0, F16_OPERANDS<FMT>>(acc, cur[c], desc);
        }
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
#pragma unroll
    for (int c = 0; c < 2; c++)
#pragma unroll
        for (int i = 0; i < 4; i++) wgmma_hold(prev[c][i]);
}

// Every wgmma product issued is done: its accumulators hold their sums and its fragments, a0
// and a1, are free.
template <int ACC>
__device__ __forceinline__ void wgmma_drain(float (&acc)[ACC], u32 (&a0)[2][4], u32 (&a1)[2][4]) {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < ACC; i++) wgmma_hold(acc[i]);
#pragma unroll
    for (int c = 0; c < 2; c++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            wgmma_hold(a0[c][i]);
            wgmma_hold(a1[c][i]);
        }
}

// A segment's end on the wgmma kernels: every product issued is done (wgmma_drain), then the
// segment's sums join the running total (or, wgmma_segment_sums, are stored).
template <int ACC = 64>
__device__ __forceinline__ void wgmma_segment_end(float (&acc)[ACC], float (&tot)[ACC], u32 (&a0)[2][4],
                                                  u32 (&a1)[2][4], bool first) {
    wgmma_drain<ACC>(acc, a0, a1);
    end_segment<ACC>(acc, tot, first);
}

// A segment's end on a wgmma block of a split launch that walks several segments (block_k_run):
// every product issued is done, then the segment's sums go to segment `seg`'s partials, where a
// block of that one segment stores its running total (wgmma_store: the same lanes, rows and
// columns), and the accumulators start again from zero.
template <int ACC>
__device__ __forceinline__ void wgmma_segment_sums(float (&acc)[ACC], u32 (&a0)[2][4], u32 (&a1)[2][4],
                                                   const WgLanes& l, int seg, int r0, int r1, int n0, int N,
                                                   int rows, float* partials) {
    wgmma_drain<ACC>(acc, a0, a1);
#pragma unroll
    for (int j = 0; j < ACC / 4; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int row = r0 + 8 * j + 2 * l.t + (i & 1), col = n0 + l.col_local[i >> 1];
            if (row < r1 && col < N) partials[((u64)seg * rows + row) * N + col] = acc[4 * j + i];
            acc[4 * j + i] = 0.0f;
        }
}

// TR: the tile's rows. WG_ROWS (a pair tile's 128: m64n128 MMAs, or m64n64 where it holds at
// most 64 live rows), or 64 for a dense launch's 64-row tiles (grouped_gemm_wgmma64_*: m64n64
// MMAs, half the accumulators and activation stages, two blocks an SM).
template <int FMT, int OUT = WG_OUT_SUMS, int TR = WG_ROWS, bool RUNS = false>
__device__ __forceinline__ void grouped_gemm_wgmma(const float*, const int* row_index, const float* row_scale,
                                                   const void* w, const u8* w_scales, const float* w_sdec,
                                                   int sdec_groups, const int* tiles, const int* num_tiles,
                                                   const int* offsets, int rows, int N, int K, float* out,
                                                   float* partials, const u32* xb, u32* counters, int bx) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    int e, r0, r1;
    if (!tile_rows(tiles, num_tiles, offsets, rows, e, r0, r1, TR)) return;  // a pair tile's rows
    // Block-uniform: MMAs over all of the tile's rows (m64n128, or m64n64 on 64-row tiles), else
    // over its first half (m64n64, m64n32). (On 64-row tiles the branch also keeps ptxas 13.0 from
    // giving both k16 steps' fragments one register quad and serializing the MMAs: C7513.)
    bool wide_n = r1 - r0 > TR / 2;
    constexpr int ACC = TR / 2, X_STAGE = TR * 64, HALVES = TR / 64;
    constexpr bool swiglu = OUT != WG_OUT_SUMS;
    int n0 = bx * (swiglu ? TILE_TN / 2 : TILE_TN);  // a SwiGLU tile's first h column
    constexpr int W_BYTES = WeightSpanCopy<FMT, 256>::W_BYTES;  // one column's span
    extern __shared__ __align__(128) u8 wg_smem[];
    // The swizzle is of shared-memory address bits: stages start 1024-byte aligned.
    u32 smem_base = (u32)__cvta_generic_to_shared(wg_smem);
    u8* xs = wg_smem + ((1024 - (smem_base & 1023)) & 1023);  // [stage][part][row][64 bytes], swizzled
    u8* ws = xs + WG_STAGES * X_STAGE;                            // [stage][column][W_BYTES]
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    int wg = warp >> 2, wq = warp & 3;  // warpgroup (64 columns), warp in it (16 of them)

    // Copy roles: x piece tid & 3 of rows tid / 4 and tid / 4 + 64; W chunks
    // tid + 256 c.
    int piece = tid & 3;
    const u8* a_base[HALVES];
    bool a_live[HALVES];
    int a_dst[HALVES];
#pragma unroll
    for (int h = 0; h < HALVES; h++) {
        int r = (tid >> 2) + 64 * h;
        a_live[h] = r0 + r < r1;
        u64 src = a_live[h] ? (row_index ? (u64)row_index[r0 + r] : (u64)(r0 + r)) : 0;
        a_base[h] = (const u8*)(xb + src * (K / 2)) + piece * 16;
        a_dst[h] = r * 64 + 16 * a_piece(r, piece);
    }

    WeightSpanCopy<FMT, 256> w_copy(w, e, N, n0, K, tid, 0, swiglu);

    int k_begin, k_end;
    if (RUNS) block_k_run(partials, K, k_begin, k_end);
    else block_k_range(partials, K, k_begin, k_end);
    int spans = (k_end - k_begin) / MMA_TK;
    // RUNS (grouped_gemm_wgmma_runs_*, grouped_gemm_wgmma64_runs_*): a run of a split launch's
    // segments (a last run may hold one), each segment's sums stored as it ends, at its own
    // index (not blockIdx.z).
    bool seg_sums = RUNS && partials;
    auto issue = [&](int span) {
        int stage = span % WG_STAGES, k0 = k_begin + span * MMA_TK;
        u8* xst = xs + stage * X_STAGE;
#pragma unroll
        for (int h = 0; h < HALVES; h++)
            if (h == 0 || wide_n) cp_async16(xst + a_dst[h], a_base[h] + k0 * 2, a_live[h]);
        w_copy.issue(ws + stage * WG_W_STAGE, k0);
    };

    // This lane's weight columns: A rows g and g + 8 of its warp's 16, and their block scales a
    // span ahead.
    // (A SwiGLU tile's: h column n0 + 8 * (4 * wg + wq) + g's gate and up rows.)
    int col_local[2] = {wg * 64 + wq * 16 + g, wg * 64 + wq * 16 + g + 8};
    int col_row[2];  // their weight rows (a SwiGLU tile's: -1 past inter)
    const u8* col_scales[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int n = col_row[h] = swiglu ? swiglu_weight_row(col_local[h], n0, N) : n0 + col_local[h];
        col_scales[h] = column_scales<FMT>(w_scales, (u64)e * N + ((swiglu ? n >= 0 : n < N) ? n : 0), K, k_begin, t);
    }
    auto load_scales = [&](int span, u8* out_scales) {
#pragma unroll
        for (int h = 0; h < 2; h++)
            out_scales[h] = SPAN_SCALES<FMT> && span < spans ? col_scales[h][span * SPAN_SCALES<FMT>] : 0;
    };

    // acc[4j + i]: column (A row) wq * 16 + g + 8 (i >> 1) of this warpgroup's 64, tile row
    // 8j + 2t + (i & 1) (j < 8 with m64n64 MMAs).
    float acc[ACC], tot[ACC];
#pragma unroll
    for (int i = 0; i < ACC; i++) acc[i] = 0.0f;
    // Spans in flight, copied and waited for in pairs (one barrier per two spans): at span 2q
    // the pair 2q + 4, 2q + 5 is issued into the stages of spans 2q - 4 and 2q - 3, whose MMAs
    // are done (each span waits for all but its own group); the MMAs of a span overlap the next
    // span's copies and decoding.
#pragma unroll
    for (int s = 0; s < 4; s += 2) {
        if (s < spans) issue(s);
        if (s + 1 < spans) issue(s + 1);
        cp_async_commit();
    }
    u32 xs_addr = (u32)__cvta_generic_to_shared(xs);
    u8 sc[2], sc_next[2];
    load_scales(0, sc);
    // One span: its A fragments decoded into `cur` (the previous span's, `prev`, are free once
    // its MMAs are done).
    auto step = [&](int span, u32 (&cur)[2][4], u32 (&prev)[2][4]) {
        load_scales(span + 1, sc_next);
        if (span % 2 == 0) {
            cp_async_wait<1>();
            // This thread's copies of the pair, seen by the tensor cores' reads (async proxy).
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();  // the pair's stages are in; every warp's MMAs two spans back are done
            if (span + 4 < spans) issue(span + 4);
            if (span + 5 < spans) issue(span + 5);
            cp_async_commit();
        }
        int stage = span % WG_STAGES;
        u32 wd[2][4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            decode_weight8<FMT>(smem_weight8<FMT>(ws + stage * WG_W_STAGE + col_local[h] * W_BYTES + t * W_BYTES / 4, sc[h]),
                                wd[h]);
        }
        wgmma_span<FMT, 64, ACC>(acc, wd, cur, prev, xs_addr + stage * X_STAGE, wide_n);
        sc[0] = sc_next[0];
        sc[1] = sc_next[1];
    };
    u32 a0[2][4], a1[2][4];
    const WgLanes lanes{wg, wq, g, t, {col_local[0], col_local[1]}, {col_row[0], col_row[1]}};
    for (int seg0 = 0; seg0 < spans; seg0 += SEG / MMA_TK) {
        int seg_end = min(spans, seg0 + SEG / MMA_TK);
        for (int span = seg0; span < seg_end; span += 2) {
            step(span, a0, a1);
            if (span + 1 < seg_end) step(span + 1, a1, a0);
        }
        if (seg_sums)
            wgmma_segment_sums(acc, a0, a1, lanes, k_begin / SEG + seg0 / (SEG / MMA_TK), r0, r1, n0, N, rows,
                               partials);
        else
            wgmma_segment_end(acc, tot, a0, a1, seg0 == 0);
    }
    cp_async_wait<0>();

    if (!seg_sums)
        wgmma_store<FMT, OUT, ACC>(tot, lanes, e, r0, r1, n0, N, rows, row_index, row_scale, w_sdec, sdec_groups, out,
                                   partials, counters);
#else
    __trap();  // sm_90a only: the host never picks this kernel elsewhere
#endif
}

// ---- Hopper (sm_90a): the wgmma kernel fed by the tensor memory accelerator ----
//
// grouped_gemm_tma_*: grouped_gemm_wgmma's tiles, products and epilogue (so its bits), with
// its copies made by the TMA unit instead of every thread: a ninth warp's first lane issues a
// span's tile copies (x: 64 rows of the packed operand a copy into the 64-byte swizzle, the
// layout the wgmma descriptors read; W: 64 weight rows a copy into the stage's unswizzled
// [column][W_BYTES]), and shared-memory barriers stand in for the block barrier: a stage's
// `full` barrier completes when its bytes have landed, its `empty` barrier when the products
// of the 8 MMA warps that read it are done. The MMA warps issue no copies and never wait for
// each other. No split-K (the host takes the wgmma kernel there).
//
// x is the packed operand with the tile's rows in the plan's order (tile row r is operand row
// r0 + r: the host packs a routing plan's rows through row_index first), as a tensor map over
// [rows][2K bytes]; W a tensor map over [experts * N][row bytes], 64 rows a copy (a SwiGLU
// tile's gate rows, then its up rows).
//
// A block takes TMA_COLS weight columns: 128 (two MMA warpgroups of 64), or 256, two
// 128-column blocks side by side (the grid's column blocks are of TMA_COLS, the host's
// ops::gemm::TMA_COLS): each MMA warpgroup then holds the 64 columns it would hold in each of
// the two as two m64 accumulators sharing every activation copy, so a span's copies carry a third fewer
// bytes a product than with 128 (L2 bounds the 128-column tiles: docs/gpu.md). Each column's
// products, sums and epilogue are those of the 128-column block, so the bits are. With 256 the
// running totals live in shared memory ([element][thread], added once a segment) and the
// copy warpgroup hands its registers to the MMA warpgroups (`setmaxnreg`: 40 and 232 a
// thread).
//
// A stage holds TMA_SPANS spans (host: ops::gemm::TMA_SPANS): x's copies are 64 * TMA_SPANS
// bytes a row (the 64- or 128-byte swizzle, as wgmma_span's X_ROW), W's W_BYTES * TMA_SPANS
// in the swizzle of that width (tma_w_offset), so a lane's reads of 8 columns fall in distinct
// banks.
#define TMA_COLS 256  // weight rows a block; the host's grid follows it (ops::gemm::TMA_COLS)
#define TMA_SUBS (TMA_COLS / TILE_TN)  // 128-column blocks a block takes
#ifndef TMA_SPANS
#define TMA_SPANS 1  // the host's box widths follow it: a kernel variant may not change it alone
#endif
#ifndef TMA_STAGES
#define TMA_STAGES 4
#endif
#define TMA_X_STAGE (WG_X_STAGE * TMA_SPANS)
#define TMA_W_STAGE (TMA_COLS * 64 * TMA_SPANS)  // the largest stage of the weight rows (BF16)
#define TMA_MMA_WARPS 8
#define TMA_TOT_BYTES (TMA_SUBS == 2 ? 32 * TMA_MMA_WARPS * 128 * 4 : 0)
// The TMA kernels' dynamic shared memory: 1024 (the swizzle's alignment) + TMA_STAGES *
// (TMA_X_STAGE + TMA_W_STAGE) + TMA_TOT_BYTES + 2 * 8 * TMA_STAGES (the barriers), within what
// the host gives (kernels::TMA_SMEM_BYTES, the most a block may have); 384 threads
// (kernels::TMA_THREADS): the two MMA warpgroups, then the copy warpgroup.
static_assert(1024 + TMA_STAGES * (TMA_X_STAGE + TMA_W_STAGE) + TMA_TOT_BYTES + 16 * TMA_STAGES <= 232448,
              "the stages and totals fit a block's shared memory");
static_assert((SEG / MMA_TK) % TMA_SPANS == 0, "segments end on a stage's end");
static_assert(TMA_SPANS == 1 || TMA_SPANS == 2, "x's rows: the 64- or 128-byte swizzle");
static_assert(TMA_SUBS == 1 || TMA_SUBS == 2, "128 or 256 columns a block");

// The byte of a TMA stage's weight row `row` at offset o into its ROW bytes: the 16-byte pieces
// swizzled as the copy wrote them (the swizzle of the row's width: piece ^ address bits 7..;
// none for 16-byte rows).
template <int ROW>
__device__ __forceinline__ int tma_w_offset(int row, int o) {
    return row * ROW + ((((o >> 4) ^ ((row * ROW >> 7) & (ROW / 16 - 1)))) << 4) + (o & 15);
}

// One span's products on the TMA kernels: wgmma_span's for each of SUBS m64 accumulators (one
// per 128-column block), the k16 steps in the K chain's order for each.
template <int FMT, int X_ROW, int SUBS>
__device__ __forceinline__ void tma_span(float (&acc)[SUBS][64], const u32 (&wd)[SUBS][2][4],
                                         u32 (&cur)[SUBS][2][4], u32 (&prev)[SUBS][2][4], u32 x_stage,
                                         bool wide_n) {
#pragma unroll
    for (int s = 0; s < SUBS; s++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            cur[s][c][0] = wd[s][0][2 * c];
            cur[s][c][1] = wd[s][1][2 * c];
            cur[s][c][2] = wd[s][0][2 * c + 1];
            cur[s][c][3] = wd[s][1][2 * c + 1];
        }
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int c = 0; c < 2; c++) {
        u64 desc = X_ROW == 128 ? wgmma_desc_sw128(x_stage + 32 * c) : wgmma_desc_sw64(x_stage + 32 * c);
#pragma unroll
        for (int s = 0; s < SUBS; s++) {
            if (wide_n) wgmma_m64n128k16_rs<0, F16_OPERANDS<FMT>>(acc[s], cur[s][c], desc);
            else wgmma_m64n64k16_rs<0, F16_OPERANDS<FMT>>(acc[s], cur[s][c], desc);
        }
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
#pragma unroll
    for (int s = 0; s < SUBS; s++)
#pragma unroll
        for (int c = 0; c < 2; c++)
#pragma unroll
            for (int i = 0; i < 4; i++) wgmma_hold(prev[s][c][i]);
}

template <int FMT, int OUT>
__device__ __forceinline__ void grouped_gemm_tma(const TensorMap* x_map, const TensorMap* w_map, const int* row_index,
                                                 const float* row_scale, const u8* w_scales, const float* w_sdec,
                                                 int sdec_groups, const int* tiles, const int* num_tiles,
                                                 const int* offsets, int rows, int N, int K, float* out, int bx) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    int e, r0, r1;
    if (!tile_rows(tiles, num_tiles, offsets, rows, e, r0, r1, WG_ROWS)) return;
    bool wide_n = r1 - r0 > 64;
    constexpr bool swiglu = OUT != WG_OUT_SUMS;
    constexpr int SUB_COLS = swiglu ? TILE_TN / 2 : TILE_TN;  // output columns of a 128-column block
    int n0 = bx * TMA_SUBS * SUB_COLS;  // bx counts blocks of TMA_COLS weight rows
    constexpr int W_BYTES = WeightSpanCopy<FMT, 256>::W_BYTES;
    constexpr int W_ROW = W_BYTES * TMA_SPANS, X_ROW = 64 * TMA_SPANS;  // a stage's row bytes
    extern __shared__ __align__(128) u8 wg_smem[];
    u32 smem_base = (u32)__cvta_generic_to_shared(wg_smem);
    u32 align = (1024 - (smem_base & 1023)) & 1023;
    u32 xs = smem_base + align, ws = xs + TMA_STAGES * TMA_X_STAGE;
    const u8* ws_ptr = wg_smem + align + TMA_STAGES * TMA_X_STAGE;
    float* tot_s = (float*)(ws_ptr + TMA_STAGES * TMA_W_STAGE);  // TMA_SUBS 2: [element][thread]
    u32 full = ws + TMA_STAGES * TMA_W_STAGE + TMA_TOT_BYTES, empty = full + 8 * TMA_STAGES;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    int spans = K / MMA_TK;
    if (tid == 0) {
        for (int s = 0; s < TMA_STAGES; s++) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, TMA_MMA_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warp >= TMA_MMA_WARPS) {
        // The copy warpgroup, its first lane: stage use q (spans q * TMA_SPANS ..) into stage
        // q % TMA_STAGES once the products of the use before it there are done. A last stage
        // past K is zeros (the maps' bounds) and counts its whole boxes; so are a second
        // 128-column block's rows past the matrix (never stored).
        if constexpr (TMA_SUBS == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (warp != TMA_MMA_WARPS || lane != 0) return;
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)x_map) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)w_map) : "memory");
        u32 bytes = (wide_n ? 2 : 1) * 64 * X_ROW + TMA_SUBS * TILE_TN * W_ROW;
        for (int q = 0; q * TMA_SPANS < spans; q++) {
            int stage = q % TMA_STAGES, use = q / TMA_STAGES;
            if (use > 0) mbar_wait(empty + 8 * stage, (use - 1) & 1);
            u32 bar = full + 8 * stage, xd = xs + stage * TMA_X_STAGE, wd = ws + stage * TMA_W_STAGE;
            mbar_arrive_expect_tx(bar, bytes);
            tma_copy_2d(xd, x_map, q * X_ROW, r0, bar);
            if (wide_n) tma_copy_2d(xd + 64 * X_ROW, x_map, q * X_ROW, r0 + 64, bar);
#pragma unroll
            for (int s = 0; s < TMA_SUBS; s++) {
                int w_row0 = e * N + n0 + s * SUB_COLS, w_row1 = swiglu ? w_row0 + N / 2 : w_row0 + 64;
                u32 wsub = wd + s * TILE_TN * W_ROW;
                tma_copy_2d(wsub, w_map, q * W_ROW, w_row0, bar);
                tma_copy_2d(wsub + 64 * W_ROW, w_map, q * W_ROW, w_row1, bar);
            }
        }
        return;
    }
    if constexpr (TMA_SUBS == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

    int wg = warp >> 2, wq = warp & 3;
    // Each 128-column block's lanes, and where this lane's 8 weights of each column lie in a
    // stage's first span: the column's stage row (a SwiGLU tile's gate rows, then up rows),
    // swizzled. The second span's are at w_at ^ W_BYTES (the swizzle is an XOR of the pieces,
    // and W_BYTES a piece bit of the row).
    WgLanes l[TMA_SUBS];
    int w_at[TMA_SUBS][2];
    const u8* col_scales[TMA_SUBS][2];
#pragma unroll
    for (int s = 0; s < TMA_SUBS; s++) {
        l[s] = WgLanes{wg, wq, g, t, {wg * 64 + wq * 16 + g, wg * 64 + wq * 16 + g + 8}, {0, 0}};
        int n0s = n0 + s * SUB_COLS;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int c = l[s].col_local[h];
            int n = l[s].col_row[h] = swiglu ? swiglu_weight_row(c, n0s, N) : n0s + c;
            col_scales[s][h] =
                column_scales<FMT>(w_scales, (u64)e * N + ((swiglu ? n >= 0 : n < N) ? n : 0), K, 0, t);
            w_at[s][h] = s * TILE_TN * W_ROW +
                         tma_w_offset<W_ROW>(swiglu ? (c % 16 >= 8 ? 64 : 0) + 8 * (c / 16) + c % 8 : c, t * W_BYTES / 4);
        }
    }
    auto load_scales = [&](int span, u8 (&out_scales)[TMA_SUBS][2]) {
#pragma unroll
        for (int s = 0; s < TMA_SUBS; s++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                out_scales[s][h] = SPAN_SCALES<FMT> && span < spans ? col_scales[s][h][span * SPAN_SCALES<FMT>] : 0;
    };
    // NVFP4, where K is whole segments and the scales are 16-byte aligned: a column's block
    // scales come a segment at a time (16 bytes), each segment's loaded while the segment before
    // it is walked, instead of one byte a span loaded a span ahead (a span is a few hundred
    // cycles here, less than a load from L2 under the copies). The same bytes: span j of the
    // segment takes byte j of seg_now (the column's byte 2j + t / 2, the lane's 16-block).
    // H100, 2026-12-06: expert gate/up at 4,096 tokens 1,022 -> 964 us, down 550 -> 531, NVFP4
    // prefill 8 x 2,048 +0.4-1.0%; MXFP8's 8 bytes a segment measured 0-2.6% slower, so MXFP8
    // keeps the span-ahead bytes (docs/performance.md, fifty-ninth session).
    constexpr int SEG_SPANS = SEG / MMA_TK, SEG_SCALE_BYTES = SEG_SPANS * SPAN_SCALES<3>;
    static_assert(SEG_SCALE_BYTES == 16, "an NVFP4 column's segment of scales is one vector load");
    const bool seg_scales = FMT == 3 && K % SEG == 0 && ((u64)w_scales & 15) == 0;
    uint4 seg_next[TMA_SUBS][2];
    u32 seg_now[TMA_SUBS][2][2];
    auto load_segment_scales = [&](int seg) {
#pragma unroll
        for (int s = 0; s < TMA_SUBS; s++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                seg_next[s][h] = *(const uint4*)(col_scales[s][h] - t / 2 + seg * SEG_SCALE_BYTES);
    };
    auto take_segment_scales = [&]() {
        u32 pick = t / 2 ? 0x7531u : 0x6420u;  // this lane's 16-block of each span
#pragma unroll
        for (int s = 0; s < TMA_SUBS; s++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                uint4 v = seg_next[s][h];
                seg_now[s][h][0] = prmt(v.x, v.y, pick);
                seg_now[s][h][1] = prmt(v.z, v.w, pick);
            }
    };
    float acc[TMA_SUBS][64], tot[TMA_SUBS == 1 ? 64 : 1];
#pragma unroll
    for (int s = 0; s < TMA_SUBS; s++)
#pragma unroll
        for (int i = 0; i < 64; i++) acc[s][i] = 0.0f;
    u8 sc[TMA_SUBS][2], sc_next[TMA_SUBS][2];
    if (seg_scales) load_segment_scales(0);
    else load_scales(0, sc);
    // The stage of the span whose products were issued last and are not yet known done.
    int pending = -1;
    auto release = [&](int stage) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + 8 * stage);
    };
    // Span `span`, the j-th of its stage (j known where step is called: spans go in pairs from
    // a segment's start, a multiple of TMA_SPANS) and the js-th of its segment.
    auto step = [&](int span, int j, int js, u32 (&cur)[TMA_SUBS][2][4], u32 (&prev)[TMA_SUBS][2][4]) {
        if (seg_scales) {
#pragma unroll
            for (int s = 0; s < TMA_SUBS; s++)
#pragma unroll
                for (int h = 0; h < 2; h++)  // a select, not an indexed load (that would be local memory)
                    sc[s][h] = (u8)((js < 4 ? seg_now[s][h][0] : seg_now[s][h][1]) >> (8 * (js & 3)));
        } else {
            load_scales(span + 1, sc_next);
        }
        int q = span / TMA_SPANS, stage = q % TMA_STAGES;
        if (j == 0) {
            mbar_wait(full + 8 * stage, (q / TMA_STAGES) & 1);
            __syncwarp();  // the warp converged again after its polls, for the .aligned wgmma below
        }
        u32 wd[TMA_SUBS][2][4];
#pragma unroll
        for (int s = 0; s < TMA_SUBS; s++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                decode_weight8<FMT>(
                    smem_weight8<FMT>(ws_ptr + stage * TMA_W_STAGE + (w_at[s][h] ^ (j * W_BYTES)), sc[s][h]), wd[s][h]);
        tma_span<FMT, X_ROW, TMA_SUBS>(acc, wd, cur, prev, xs + stage * TMA_X_STAGE + 64 * j, wide_n);
        // The span before's products are done: its stage may be copied into again once this
        // span is of another.
        if (pending >= 0 && pending != stage) release(pending);
        pending = stage;
        if (!seg_scales) {
#pragma unroll
            for (int s = 0; s < TMA_SUBS; s++) {
                sc[s][0] = sc_next[s][0];
                sc[s][1] = sc_next[s][1];
            }
        }
    };
    u32 a0[TMA_SUBS][2][4], a1[TMA_SUBS][2][4];
    for (int seg0 = 0; seg0 < spans; seg0 += SEG_SPANS) {
        int seg_end = min(spans, seg0 + SEG_SPANS);
        if (seg_scales) {
            take_segment_scales();
            if (seg_end < spans) load_segment_scales(seg0 / SEG_SPANS + 1);
        }
        for (int span = seg0; span < seg_end; span += 2) {
            step(span, 0, span - seg0, a0, a1);
            if (span + 1 < seg_end) step(span + 1, TMA_SPANS - 1, span + 1 - seg0, a1, a0);
        }
        // The segment's products are done (and their fragments free); its sums join the
        // running total.
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < TMA_SUBS; s++) {
#pragma unroll
            for (int i = 0; i < 64; i++) wgmma_hold(acc[s][i]);
#pragma unroll
            for (int c = 0; c < 2; c++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    wgmma_hold(a0[s][c][i]);
                    wgmma_hold(a1[s][c][i]);
                }
        }
        if constexpr (TMA_SUBS == 1) end_segment<64>(acc[0], tot, seg0 == 0);
        else
#pragma unroll
            for (int s = 0; s < TMA_SUBS; s++)
                end_segment<64, 32 * TMA_MMA_WARPS>(acc[s], tot_s + s * 64 * 32 * TMA_MMA_WARPS + tid, seg0 == 0);
        release(pending);
        pending = -1;
    }
    if constexpr (TMA_SUBS == 1) {
        wgmma_store<FMT, OUT>(tot, l[0], e, r0, r1, n0, N, rows, row_index, row_scale, w_sdec, sdec_groups, out,
                              nullptr, nullptr);
    } else {
#pragma unroll
        for (int s = 0; s < TMA_SUBS; s++) {
            float sub_tot[64];
#pragma unroll
            for (int i = 0; i < 64; i++) sub_tot[i] = tot_s[(s * 64 + i) * 32 * TMA_MMA_WARPS + tid];
            wgmma_store<FMT, OUT>(sub_tot, l[s], e, r0, r1, n0 + s * SUB_COLS, N, rows, row_index, row_scale, w_sdec,
                                  sdec_groups, out, nullptr, nullptr);
        }
    }
#else
    __trap();  // sm_90a only: the host never picks this kernel elsewhere
#endif
}

// A launch's weight matrices: up to three over the same input x (the attention's q, k and v),
// their columns side by side in one grid. Part 1 is the launch's w, w_scales, w_sdec, N and
// out; parts 2 and 3 (n2, n3 > 0) follow with their own, the grid's column blocks taken in
// order, COLS columns a block. Each part keeps its own output [rows x n] and split-K sums
// (the parts' in turn in `partials`, gridDim.z segments each, or ceil(K / SEG) for the `_runs`
// kernels, which pass K as runs_k); sdec_groups and K are shared. A block works on one part, as a launch of
// that part alone would, with its column block bx.
struct GemmPart {
    const void* w;
    const u8* scales;
    const float* sdec;
    float* out;
    float* partials;
    int n, bx;
};

// The split-K sums a joined launch keeps of each part: a block's along z, or (the `_runs`
// kernels, runs_k = K) every segment's.
__device__ __forceinline__ u64 part_segments(int runs_k) {
    return runs_k ? (u64)((runs_k + SEG - 1) / SEG) : (u64)gridDim.z;
}

__device__ __forceinline__ GemmPart gemm_part(int cols, int rows, int runs_k, const void* w, const u8* w_scales,
                                              const float* w_sdec, int N, float* out, float* partials,
                                              const void* w2, const u8* scales2, const float* sdec2, float* out2,
                                              int n2, const void* w3, const u8* scales3, const float* sdec3,
                                              float* out3, int n3) {
    GemmPart p{w, w_scales, w_sdec, out, partials, N, (int)blockIdx.x};
    int blocks = (N + cols - 1) / cols;
    if (n2 <= 0 || p.bx < blocks) return p;
    float* partials2 = partials ? partials + part_segments(runs_k) * rows * N : nullptr;
    p = GemmPart{w2, scales2, sdec2, out2, partials2, n2, p.bx - blocks};
    blocks = (n2 + cols - 1) / cols;
    if (n3 <= 0 || p.bx < blocks) return p;
    float* partials3 = partials ? partials2 + part_segments(runs_k) * rows * n2 : nullptr;
    return GemmPart{w3, scales3, sdec3, out3, partials3, n3, p.bx - blocks};
}

// A GEMM kind's parameters (the launch's part already picked), for kinds that forward them.
#define GEMM_KIND_PARAMS                                                                                   \
    const float *x, const int *row_index, const float *row_scale, const void *w, const u8 *w_scales,       \
        const float *w_sdec, int sdec_groups, const int *tiles, const int *num_tiles, const int *offsets,  \
        int rows, int N, int K, float *out, float *partials, const u32 *xb, u32 *counters, int bx
#define GEMM_KIND_ARGS \
    x, row_index, row_scale, w, w_scales, w_sdec, sdec_groups, tiles, num_tiles, offsets, rows, N, K, out, partials, xb, counters, bx

// The kernels' entry: KIND<FMT> over the part of the launch this block works on, COLS columns
// a block, RUNS_K as gemm_part's runs_k. With THREADS and BLOCKS, launch bounds:
// THREADS a block, at least BLOCKS blocks an SM (the registers a thread may use follow).
#define GEMM_ENTRY(KIND, NAME, FMT, COLS, BOUNDS, RUNS_K)                                                          \
    extern "C" __global__ void BOUNDS NAME(                                                                       \
        const float* x, const int* row_index, const float* row_scale, const void* w, const u8* w_scales,          \
        const float* w_sdec, int sdec_groups, const int* tiles, const int* num_tiles, const int* offsets,          \
        int rows, int N, int K, float* out, float* partials, const u32* xb, u32* counters, const void* w2,         \
        const u8* scales2, const float* sdec2, float* out2, int n2, const void* w3, const u8* scales3,             \
        const float* sdec3, float* out3, int n3) {                                                                 \
        pdl_entry();                                                                                              \
        GemmPart p = gemm_part(COLS, rows, RUNS_K, w, w_scales, w_sdec, N, out, partials, w2, scales2, sdec2, out2, \
                               n2, w3, scales3, sdec3, out3, n3);                                                  \
        KIND<FMT>(x, row_index, row_scale, p.w, p.scales, p.sdec, sdec_groups, tiles, num_tiles, offsets, rows,    \
                  p.n, K, p.out, p.partials, xb, counters, p.bx);                                                  \
    }
#define GEMM_KERNEL(KIND, NAME, FMT, COLS) GEMM_ENTRY(KIND, NAME, FMT, COLS, , 0)
#define GEMM_KERNEL_BOUNDED(KIND, NAME, FMT, COLS, THREADS, BLOCKS) \
    GEMM_ENTRY(KIND, NAME, FMT, COLS, __launch_bounds__(THREADS, BLOCKS), 0)
// A wgmma `_runs` kernel: a split grid of fewer blocks than segments (block_k_run).
#define GEMM_KERNEL_RUNS(KIND, NAME, FMT, THREADS, BLOCKS) \
    GEMM_ENTRY(KIND, NAME, FMT, TILE_TN, __launch_bounds__(THREADS, BLOCKS), K)

// The wide tiles' kernels: 256 threads, two blocks an SM (at most 128 registers a thread).
GEMM_KERNEL_BOUNDED(grouped_gemm_mma_wide, grouped_gemm_mma_wide_bf16, 1, TILE_TN, 4 * TM_WIDE, 2)
GEMM_KERNEL_BOUNDED(grouped_gemm_mma_wide, grouped_gemm_mma_wide_mxfp8, 2, TILE_TN, 4 * TM_WIDE, 2)
GEMM_KERNEL_BOUNDED(grouped_gemm_mma_wide, grouped_gemm_mma_wide_nvfp4, 3, TILE_TN, 4 * TM_WIDE, 2)
// The wgmma kernels: the wide tiles' grid and 256 threads, one block an SM.
GEMM_KERNEL_BOUNDED(grouped_gemm_wgmma, grouped_gemm_wgmma_bf16, 1, TILE_TN, 256, 1)
GEMM_KERNEL_BOUNDED(grouped_gemm_wgmma, grouped_gemm_wgmma_mxfp8, 2, TILE_TN, 256, 1)
GEMM_KERNEL_BOUNDED(grouped_gemm_wgmma, grouped_gemm_wgmma_nvfp4, 3, TILE_TN, 256, 1)
// The same on a dense launch's 64-row tiles: two blocks an SM.
template <int FMT>
__device__ __forceinline__ void grouped_gemm_wgmma64(GEMM_KIND_PARAMS) {
    grouped_gemm_wgmma<FMT, WG_OUT_SUMS, 64>(GEMM_KIND_ARGS);
}
GEMM_KERNEL_BOUNDED(grouped_gemm_wgmma64, grouped_gemm_wgmma64_bf16, 1, TILE_TN, 256, 2)
GEMM_KERNEL_BOUNDED(grouped_gemm_wgmma64, grouped_gemm_wgmma64_mxfp8, 2, TILE_TN, 256, 2)
GEMM_KERNEL_BOUNDED(grouped_gemm_wgmma64, grouped_gemm_wgmma64_nvfp4, 3, TILE_TN, 256, 2)
// Both on split grids of fewer blocks than K has segments, a block walking a run of them
// (ops::gemm::SplitK::OneWave): the same products, each segment's sums stored as its own.
template <int FMT>
__device__ __forceinline__ void grouped_gemm_wgmma_runs(GEMM_KIND_PARAMS) {
    grouped_gemm_wgmma<FMT, WG_OUT_SUMS, WG_ROWS, true>(GEMM_KIND_ARGS);
}
template <int FMT>
__device__ __forceinline__ void grouped_gemm_wgmma64_runs(GEMM_KIND_PARAMS) {
    grouped_gemm_wgmma<FMT, WG_OUT_SUMS, 64, true>(GEMM_KIND_ARGS);
}
GEMM_KERNEL_RUNS(grouped_gemm_wgmma_runs, grouped_gemm_wgmma_runs_bf16, 1, 256, 1)
GEMM_KERNEL_RUNS(grouped_gemm_wgmma_runs, grouped_gemm_wgmma_runs_mxfp8, 2, 256, 1)
GEMM_KERNEL_RUNS(grouped_gemm_wgmma_runs, grouped_gemm_wgmma_runs_nvfp4, 3, 256, 1)
GEMM_KERNEL_RUNS(grouped_gemm_wgmma64_runs, grouped_gemm_wgmma64_runs_bf16, 1, 256, 2)
GEMM_KERNEL_RUNS(grouped_gemm_wgmma64_runs, grouped_gemm_wgmma64_runs_mxfp8, 2, 256, 2)
GEMM_KERNEL_RUNS(grouped_gemm_wgmma64_runs, grouped_gemm_wgmma64_runs_nvfp4, 3, 256, 2)
// The same over a gate/up matrix with SwiGLU in the epilogue (the wgmma kernels' OUT): h as f32,
// or (BF16 weights) as the BF16 operand words of the down projection's tiled or wgmma launch.
template <int FMT>
__device__ __forceinline__ void grouped_gemm_wgmma_swiglu(GEMM_KIND_PARAMS) {
    grouped_gemm_wgmma<FMT, WG_OUT_SWIGLU_F32>(GEMM_KIND_ARGS);
}
template <int FMT>
__device__ __forceinline__ void grouped_gemm_wgmma_swiglu_words(GEMM_KIND_PARAMS) {
    grouped_gemm_wgmma<FMT, WG_OUT_SWIGLU_BF16>(GEMM_KIND_ARGS);
}
GEMM_KERNEL_BOUNDED(grouped_gemm_wgmma_swiglu, grouped_gemm_wgmma_swiglu_bf16, 1, TILE_TN, 256, 1)
GEMM_KERNEL_BOUNDED(grouped_gemm_wgmma_swiglu, grouped_gemm_wgmma_swiglu_mxfp8, 2, TILE_TN, 256, 1)
GEMM_KERNEL_BOUNDED(grouped_gemm_wgmma_swiglu, grouped_gemm_wgmma_swiglu_nvfp4, 3, TILE_TN, 256, 1)
GEMM_KERNEL_BOUNDED(grouped_gemm_wgmma_swiglu_words, grouped_gemm_wgmma_swiglu_words_bf16, 1, TILE_TN, 256, 1)
// The TMA kernels (grouped_gemm_tma): the tensor maps of x and of the launch's up to three
// weight matrices, then the other GEMM parameters they use (parts 2 and 3 as GEMM_ENTRY's).
#define GEMM_TMA_KERNEL(NAME, FMT, OUT)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * (TMA_MMA_WARPS + 4), 1) NAME(                             \
        const __grid_constant__ TensorMap x_map, const __grid_constant__ TensorMap w_map,                        \
        const __grid_constant__ TensorMap w2_map, const __grid_constant__ TensorMap w3_map, const int* row_index, \
        const float* row_scale, const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,      \
        const int* num_tiles, const int* offsets, int rows, int N, int K, float* out, const u8* scales2,         \
        const float* sdec2, float* out2, int n2, const u8* scales3, const float* sdec3, float* out3, int n3) {   \
        pdl_entry();                                                                                              \
        /* a part's weights are its tensor map */                                                                \
        GemmPart p = gemm_part(TMA_COLS, rows, 0, &w_map, w_scales, w_sdec, N, out, nullptr, &w2_map, scales2,   \
                               sdec2, out2, n2, &w3_map, scales3, sdec3, out3, n3);                               \
        grouped_gemm_tma<FMT, OUT>(&x_map, (const TensorMap*)p.w, row_index, row_scale, p.scales, p.sdec,        \
                                   sdec_groups, tiles, num_tiles, offsets, rows, p.n, K, p.out, p.bx);            \
    }
GEMM_TMA_KERNEL(grouped_gemm_tma_bf16, 1, WG_OUT_SUMS)
GEMM_TMA_KERNEL(grouped_gemm_tma_mxfp8, 2, WG_OUT_SUMS)
GEMM_TMA_KERNEL(grouped_gemm_tma_nvfp4, 3, WG_OUT_SUMS)
GEMM_TMA_KERNEL(grouped_gemm_tma_swiglu_bf16, 1, WG_OUT_SWIGLU_F32)
GEMM_TMA_KERNEL(grouped_gemm_tma_swiglu_mxfp8, 2, WG_OUT_SWIGLU_F32)
GEMM_TMA_KERNEL(grouped_gemm_tma_swiglu_nvfp4, 3, WG_OUT_SWIGLU_F32)
GEMM_TMA_KERNEL(grouped_gemm_tma_swiglu_words_bf16, 1, WG_OUT_SWIGLU_BF16)
GEMM_KERNEL(grouped_gemm_mma, grouped_gemm_mma_bf16, 1, TILE_TN)
GEMM_KERNEL(grouped_gemm_mma, grouped_gemm_mma_mxfp8, 2, TILE_TN)
GEMM_KERNEL(grouped_gemm_mma, grouped_gemm_mma_nvfp4, 3, TILE_TN)
GEMM_KERNEL(grouped_gemm_skinny1, grouped_gemm_skinny_bf16, 1, SKINNY_WARPS * 8)
GEMM_KERNEL(grouped_gemm_skinny1, grouped_gemm_skinny_mxfp8, 2, SKINNY_WARPS * 8)
GEMM_KERNEL(grouped_gemm_skinny1, grouped_gemm_skinny_nvfp4, 3, SKINNY_WARPS * 8)
GEMM_KERNEL_BOUNDED(grouped_gemm_skinny4, grouped_gemm_skinny4_bf16, 1, SKINNY_WARPS * 32, 128, SKINNY4_BLOCKS_PER_SM)
GEMM_KERNEL_BOUNDED(grouped_gemm_skinny4, grouped_gemm_skinny4_mxfp8, 2, SKINNY_WARPS * 32, 128, SKINNY4_BLOCKS_PER_SM)
GEMM_KERNEL_BOUNDED(grouped_gemm_skinny4, grouped_gemm_skinny4_nvfp4, 3, SKINNY_WARPS * 32, 128, SKINNY4_BLOCKS_PER_SM)
// K split over a block's warps: 32 columns a block, 8 warps, two blocks an SM (16 warps, as
// the 32-column kernel's four blocks; at 128 registers BF16 and MXFP8 spill 36-44 bytes, NVFP4
// takes 112; ptxas 13.5).
GEMM_KERNEL_BOUNDED(grouped_gemm_skinny_ksplit, grouped_gemm_skinny_ksplit_bf16, 1, 32, 32 * KSPLIT_WARPS, 2)
GEMM_KERNEL_BOUNDED(grouped_gemm_skinny_ksplit, grouped_gemm_skinny_ksplit_mxfp8, 2, 32, 32 * KSPLIT_WARPS, 2)
GEMM_KERNEL_BOUNDED(grouped_gemm_skinny_ksplit, grouped_gemm_skinny_ksplit_nvfp4, 3, 32, 32 * KSPLIT_WARPS, 2)
// The same for 8 columns a block (one fragment a warp, 8 spans in flight; the host's choice for
// tiles of up to 8 rows, ops::gemm `block_split_narrow`): four times the blocks over the same
// launch, each warp's segment one round of loads; at most 8 warps a block, three blocks an SM
// for BF16 and MXFP8 (at four, 64 registers, BF16 spilled 32 bytes; ptxas 13.0).
template <int FMT>
__device__ __forceinline__ void grouped_gemm_skinny_ksplit8(GEMM_KIND_PARAMS) {
    grouped_gemm_skinny_ksplit<FMT, 1>(GEMM_KIND_ARGS);
}
GEMM_KERNEL_BOUNDED(grouped_gemm_skinny_ksplit8, grouped_gemm_skinny_ksplit8_bf16, 1, 8, 32 * KSPLIT_WARPS, 3)
GEMM_KERNEL_BOUNDED(grouped_gemm_skinny_ksplit8, grouped_gemm_skinny_ksplit8_mxfp8, 2, 8, 32 * KSPLIT_WARPS, 3)
// NVFP4's at four blocks an SM (64 registers; 74 at three): its one-token gate/up waits on its
// loads, and 32 warps an SM hide more of that than 24 (H100, 2026-12-06: 26.7 -> 24.7 us, the
// batch-1 NVFP4 step 4.90 / 4.96 -> 4.84 / 4.88 ms).
GEMM_KERNEL_BOUNDED(grouped_gemm_skinny_ksplit8, grouped_gemm_skinny_ksplit8_nvfp4, 3, 8, 32 * KSPLIT_WARPS, 4)

GEMM_KERNEL(grouped_gemm, grouped_gemm_f32, 0, TN)
GEMM_KERNEL(grouped_gemm, grouped_gemm_bf16, 1, TN)
GEMM_KERNEL(grouped_gemm, grouped_gemm_mxfp8, 2, TN)
GEMM_KERNEL(grouped_gemm, grouped_gemm_nvfp4, 3, TN)

// Split-K's second step for launches whose regions hold many rows (the in-launch fold would
// walk them in one block): out[row, col] = the segments' sums added in order (the same additions
// the unsplit kernels make), then the NVFP4 epilogue when row_scale is given: of expert 0 for a
// dense layer, of the row's expert (offsets, `experts` + 1 entries) for a routing plan's rows.
// partials: [segments][rows][N]. Grid ceil(rows * N / 256), 256 threads.
extern "C" __global__ void gemm_fold_segments(const float* partials, int segments, int rows, int N,
                                              const int* row_index, const float* row_scale, const float* w_sdec,
                                              int sdec_groups, const int* offsets, int experts, float* out) {
    pdl_entry();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 count = (u64)rows * N;
    if (i >= count) return;
    float v = partials[i];
    for (int s = 1; s < segments; s++) v = __fadd_rn(v, partials[s * count + i]);
    if (row_scale) {
        int row = (int)(i / N), col = (int)(i % N);
        u64 src = row_index ? (u64)row_index[row] : (u64)row;
        int e = 0;
        if (offsets) {
            // The last expert whose rows start at or before `row`: offsets[e] <= row < offsets[e + 1].
            int lo = 0, hi = experts - 1;
            while (lo < hi) {
                int mid = (lo + hi + 1) / 2;
                if (offsets[mid] <= row) lo = mid;
                else hi = mid - 1;
            }
            e = lo;
        }
        v = nvfp4_epilogue_scale(v, row_scale, src, w_sdec, e, sdec_groups, col, N);
    }
    out[i] = v;
}

// gemm_fold_segments for the parts of one joined launch that take no epilogue (q, k and v), in
// one launch instead of one a part: part p's sums ([segments][rows][n_p]) follow part p - 1's,
// and element i of the launch is part p's element i - rows * (n_0 + ... + n_{p-1}), its segments
// added in order into out_p: the same additions, so the same bits. n1 and n2 may be 0 (fewer
// parts). Grid ceil(rows * (n0 + n1 + n2) / 256), 256 threads.
extern "C" __global__ void gemm_fold_parts(const float* partials, int segments, int rows, int n0, float* out0, int n1,
                                           float* out1, int n2, float* out2) {
    pdl_entry();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 c0 = (u64)rows * n0, c1 = (u64)rows * n1, count = c0;
    const float* sums = partials;
    float* out = out0;
    if (i >= c0) {
        i -= c0;
        sums += segments * c0;
        out = out1;
        count = c1;
        if (i >= c1) {
            i -= c1;
            sums += segments * c1;
            out = out2;
            count = (u64)rows * n2;
        }
    }
    if (i < count) out[i] = folded(sums, segments, count, i);
}
