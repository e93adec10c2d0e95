// Grouped GEMM for expert (and quantized dense) layers: out[r, n] = sum_k x[r, k] * W_e[n, k]
// for the rows r of each expert e, with W in F32, BF16, MXFP8 or NVFP4 kept in its storage
// format in GPU memory and decoded to f32 inside the kernel (exact for every format), FP32
// accumulation, and the NVFP4 second-level scales (s_tok of the row, S_dec of the weight)
// applied in the epilogue, in the contract's order.
//
// Batch invariance (docs/determinism.md): every output element is reduced over K in an order
// fixed by K alone, so a row's result has the same bits whatever the batch holds. Three kernels
// share the arguments and the tile plan, and the host picks one per launch (ops::grouped_gemm):
// - grouped_gemm_*: CUDA cores (FFMA), any K: each element is one fmaf chain over k = 0..K-1;
//   the only one for F32 weights (kept exact in f32).
// - grouped_gemm_mma_*: BF16 tensor cores (mma.sync m16n8k16, FP32 accumulation), 32x64 tiles.
//   Operands are decoded to BF16 in shared memory: exact for MXFP8 (E4M3 x E8M0) and NVFP4
//   (E2M1 x E4M3) weights and for quantized activations (the quantizers' dequantized values).
//   Plain BF16 layers take f32 activations: each is split into two BF16 terms (hi + lo, 16
//   significant bits) multiplied separately, so the result stays within ~1e-5 of the CPU's f32
//   products instead of the ~2e-3 of rounding activations to BF16 (which flips MoE routing).
// - grouped_gemm_skinny_*, grouped_gemm_skinny4_*: the same tensor-core products for tiles of
//   few rows (decode): a warp per 8 (or 32) output columns, weights loaded straight into
//   registers, no shared memory.
// The two tensor-core kernels feed each mma exactly the same operands in the same order (the
// "K chain" below), so they give the same bits and the choice between them is speed alone.
//
// The K chain: K is walked in spans of 32 in order; within a span, lane (g, t) of an m16n8k16
// holds k = 8t..8t+7, chunk c (0, 1) taking k = 8t+4c+{0,1} in fragment slots {2t, 2t+1} and
// k = 8t+4c+{2,3} in slots {2t+8, 2t+9}; chunk 0 then chunk 1, each as hi then (plain BF16
// layers) lo. Each lane's 8 values of a span are then one 16-byte load.

#define TM 32
#define TN 64
#define TK 32

// The rows of this block's tile (blockIdx.y): from the routing plan's `tiles` (expert, first
// row), or the tile-th run of TM rows of one dense group. False: no such tile this step.
__device__ __forceinline__ bool tile_rows(const int* tiles, const int* num_tiles, const int* offsets, int rows, int& e,
                                          int& r0, int& r1) {
    int tile = blockIdx.y;
    if (tiles) {
        if (tile >= *num_tiles) return false;
        e = tiles[2 * tile];
        r0 = tiles[2 * tile + 1];
        r1 = min(r0 + TM, offsets[e + 1]);
    } else {
        e = 0;
        r0 = tile * TM;
        if (r0 >= rows) return false;
        r1 = min(r0 + TM, rows);
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
                             const int* num_tiles, const int* offsets, int rows, int N, int K, float* out) {
    int e, r0, r1;
    if (!tile_rows(tiles, num_tiles, offsets, rows, e, r0, r1)) return;
    int n0 = blockIdx.x * TN;
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

// ---- BF16 tensor cores: 32x64 tiles, 4 warps each 32 rows x 16 columns, K steps of one span ----

#define MMA_TM TM  // the routing plan's tile rows
#define MMA_TN 64
#define MMA_TK 32  // one span of the K chain
#define MMA_LD MMA_TK  // unpadded: each quarter-warp's 16-byte fragment loads hit 32 distinct banks

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

// Two f32 values that are exactly BF16 (decoded codes times block scales) packed as BF16x2.
__device__ __forceinline__ u32 pack_exact_bf16(float lo, float hi) {
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
}

__device__ __forceinline__ void mma_bf16(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Eight consecutive activations (one lane's share of a span) as BF16x2 words. SPLIT (plain
// BF16 layers): hi = bf16(v), lo = bf16(v - hi); otherwise the values are exact in BF16.
template <bool SPLIT>
__device__ __forceinline__ void pack_act8(float4 a, float4 b, u32* hi, u32* lo) {
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if constexpr (SPLIT) {
            hi[i] = pack_bf16(v[2 * i], v[2 * i + 1]);
            lo[i] = pack_bf16(__fsub_rn(v[2 * i], __uint_as_float(hi[i] << 16)),
                              __fsub_rn(v[2 * i + 1], __uint_as_float(hi[i] & 0xffff0000u)));
        } else {
            hi[i] = pack_exact_bf16(v[2 * i], v[2 * i + 1]);
        }
    }
}

// One span of the K chain for an m16n8 accumulator: `lo_row` / `hi_row` are the 4 words of the
// lane's rows g and g + 8 (pack_act8), `w` the 4 words of its weight column g.
template <bool SPLIT>
__device__ __forceinline__ void mma_span(float* c, const u32* a_lo_row, const u32* a_hi_row, const u32* a_lo_row_lo,
                                         const u32* a_hi_row_lo, const u32* w) {
#pragma unroll
    for (int ch = 0; ch < 2; ch++) {
        u32 b[2] = {w[2 * ch], w[2 * ch + 1]};
        u32 a[4] = {a_lo_row[2 * ch], a_hi_row[2 * ch], a_lo_row[2 * ch + 1], a_hi_row[2 * ch + 1]};
        mma_bf16(c, a, b);
        if constexpr (SPLIT) {
            u32 l[4] = {a_lo_row_lo[2 * ch], a_hi_row_lo[2 * ch], a_lo_row_lo[2 * ch + 1], a_hi_row_lo[2 * ch + 1]};
            mma_bf16(c, l, b);
        }
    }
}

// Fast exact decoders for the inner loops. Two E4M3 codes (low byte first) to f32: one
// hardware conversion to f16x2 on sm_89+ (every E4M3 value, NaN included, is an f16), else
// the table-free decoder. E2M1 through a 16-entry table in shared memory (no bank conflicts).
__device__ __forceinline__ void e4m3x2_to_f32(u32 pair, float& lo, float& hi) {
#if __CUDA_ARCH__ >= 890
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)pair));
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi)
        : "r"(h2));
#else
    lo = e4m3_decode((u8)pair);
    hi = e4m3_decode((u8)(pair >> 8));
#endif
}

// The E2M1 table, filled by the block before first use (callers sync after it).
__device__ __forceinline__ void fill_e2m1_table(float* table) {
    if (threadIdx.x < 16) table[threadIdx.x] = e2m1_decode((u8)threadIdx.x);
}

// The raw bytes of 8 consecutive weights (n, k..k+8) and their block scale, loaded ahead of use.
struct Weight8 {
    uint4 q;   // BF16: 16 bytes; MXFP8: q.x, q.y (8 bytes); NVFP4: q.x (4 bytes)
    u8 scale;  // MXFP8: the 32-block's E8M0; NVFP4: the 16-block's E4M3
};

// Requires K % 32 == 0 and k % 8 == 0 (aligned loads).
template <int FMT>
__device__ __forceinline__ Weight8 load_weight8(const void* w, const u8* scales, u64 row, u64 k, u64 K) {
    Weight8 c;
    c.q = make_uint4(0, 0, 0, 0);
    c.scale = 0;
    if (FMT == 1) {
        c.q = *(const uint4*)((const bf16_t*)w + row * K + k);
    } else if (FMT == 2) {
        uint2 v = *(const uint2*)((const u8*)w + row * K + k);
        c.q.x = v.x;
        c.q.y = v.y;
        c.scale = scales[row * (K / 32) + k / 32];
    } else {
        c.q.x = *(const u32*)((const u8*)w + row * (K / 2) + k / 2);
        c.scale = scales[row * (K / 16) + k / 16];
    }
    return c;
}

// The 8 weights as 4 BF16x2 words. Exact: an E4M3 or E2M1 value times its power-of-two or
// E4M3 block scale has at most 8 significant bits.
template <int FMT>
__device__ __forceinline__ void decode_weight8(const Weight8& c, const float* e2m1, u32* out) {
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
        float s = e4m3_decode(c.scale);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 byte = (c.q.x >> (8 * i)) & 0xffu;
            out[i] = pack_exact_bf16(__fmul_rn(e2m1[byte & 15u], s), __fmul_rn(e2m1[byte >> 4], s));
        }
    }
}

__device__ __forceinline__ float nvfp4_epilogue_scale(float v, const float* row_scale, u64 src, const float* w_sdec,
                                                      int e, int sdec_groups, int col, int N) {
    return __fmul_rn(__fmul_rn(v, row_scale[src]), w_sdec[e * sdec_groups + col / (N / sdec_groups)]);
}

// Grid (ceil(N / 64), tiles), 128 threads. Requires K % 32 == 0 (the host checks). The next
// span's operands are loaded into registers while the tensor cores work on the current one.
template <int FMT>
__device__ void grouped_gemm_mma(const float* x, const int* row_index, const float* row_scale, const void* w,
                                 const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                                 const int* num_tiles, const int* offsets, int rows, int N, int K, float* out) {
    int e, r0, r1;
    if (!tile_rows(tiles, num_tiles, offsets, rows, e, r0, r1)) return;
    int n0 = blockIdx.x * MMA_TN;
    constexpr bool SPLIT = FMT == 1;
    __shared__ __align__(16) u32 as[MMA_TM][MMA_LD / 2];
    __shared__ __align__(16) u32 as_lo[SPLIT ? MMA_TM : 1][MMA_LD / 2];
    __shared__ __align__(16) u32 ws[MMA_TN][MMA_LD / 2];
    __shared__ float e2m1[16];
    fill_e2m1_table(e2m1);
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

    // Loader roles: A row tid / 4 (8 values from k (tid % 4) * 8); W row tid / 2 (16 values
    // from k (tid % 2) * 16, two Weight8s).
    int a_row = tid >> 2, a_k = (tid & 3) * 8;
    bool a_live = r0 + a_row < r1;
    u64 a_src = a_live ? (row_index ? (u64)row_index[r0 + a_row] : (u64)(r0 + a_row)) : 0;
    int w_n = tid >> 1, w_k = (tid & 1) * 16;
    bool w_live = n0 + w_n < N;
    u64 w_row = (u64)e * N + (n0 + w_n);

    float4 xa = make_float4(0, 0, 0, 0), xb = xa;
    Weight8 wc[2];
    wc[0].q = make_uint4(0, 0, 0, 0);
    wc[0].scale = 0;
    wc[1] = wc[0];
    auto fetch = [&](int k0) {
        if (a_live) {
            const float4* p = (const float4*)(x + a_src * K + k0 + a_k);
            xa = p[0];
            xb = p[1];
        }
        if (w_live) {
            wc[0] = load_weight8<FMT>(w, w_scales, w_row, k0 + w_k, K);
            wc[1] = load_weight8<FMT>(w, w_scales, w_row, k0 + w_k + 8, K);
        }
    };
    auto stash = [&]() {
        u32 hi[4], lo[4];
        pack_act8<SPLIT>(xa, xb, hi, lo);
        *(uint4*)&as[a_row][a_k / 2] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        if constexpr (SPLIT) *(uint4*)&as_lo[a_row][a_k / 2] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 d[4];
            decode_weight8<FMT>(wc[h], e2m1, d);
            *(uint4*)&ws[w_n][w_k / 2 + 4 * h] = make_uint4(d[0], d[1], d[2], d[3]);
        }
    };

    float acc[2][2][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) acc[i][j][v] = 0.0f;

    fetch(0);
    __syncthreads();  // the E2M1 table
    for (int k0 = 0; k0 < K; k0 += MMA_TK) {
        stash();
        __syncthreads();
        if (k0 + MMA_TK < K) fetch(k0 + MMA_TK);
        // Lane (g, t) reads words 4t..4t+3 (k = 8t..8t+7) of its rows and columns.
        uint4 a[2][2], al[2][2], b[2];
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                a[mi][h] = *(const uint4*)&as[mi * 16 + g + 8 * h][4 * t];
                if constexpr (SPLIT) al[mi][h] = *(const uint4*)&as_lo[mi * 16 + g + 8 * h][4 * t];
            }
#pragma unroll
        for (int ni = 0; ni < 2; ni++) b[ni] = *(const uint4*)&ws[warp * 16 + ni * 8 + g][4 * t];
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int ni = 0; ni < 2; ni++)
                mma_span<SPLIT>(acc[mi][ni], (const u32*)&a[mi][0], (const u32*)&a[mi][1], (const u32*)&al[mi][0],
                                (const u32*)&al[mi][1], (const u32*)&b[ni]);
        __syncthreads();
    }

    // C fragment: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of each 16x8 tile.
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int row = r0 + mi * 16 + g + 8 * half;
            if (row >= r1) continue;
            u64 src = row_index ? (u64)row_index[row] : (u64)row;
#pragma unroll
            for (int ni = 0; ni < 2; ni++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    int col = n0 + warp * 16 + ni * 8 + 2 * t + j;
                    if (col >= N) continue;
                    float v = acc[mi][ni][2 * half + j];
                    if (FMT == 3) v = nvfp4_epilogue_scale(v, row_scale, src, w_sdec, e, sdec_groups, col, N);
                    out[(u64)row * N + col] = v;
                }
        }
}

// ---- Tensor cores for tiles of few rows: a warp per 8 * NF output columns ----

#define SKINNY_WARPS 4  // warps per 128-thread block

// Grid (ceil(N / (32 * NF)), tiles), 128 threads. Requires K % 32 == 0. Each lane streams the
// 8 values per span of its NF weight columns (g of each n8 fragment) from global memory,
// SPANS spans ahead, and packs its rows' activations itself (L1-resident, shared by the
// block's warps) once per span for all NF fragments; more fragments per warp spread that
// packing over more weights, fewer give more warps. The tile's rows are at most TM = two m16
// fragments; a fragment, or its upper 8 rows, with no live row is skipped (warp-uniform).
template <int FMT, int NF>
__device__ void grouped_gemm_skinny(const float* x, const int* row_index, const float* row_scale, const void* w,
                                    const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                                    const int* num_tiles, const int* offsets, int rows, int N, int K, float* out) {
    int e, r0, r1;
    if (!tile_rows(tiles, num_tiles, offsets, rows, e, r0, r1)) return;
    constexpr bool SPLIT = FMT == 1;
    constexpr int FRAGS = TM / 16;
    constexpr int SPANS = NF == 1 ? 8 : 4;
    __shared__ float e2m1[16];
    fill_e2m1_table(e2m1);
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int n0 = (blockIdx.x * SKINNY_WARPS + warp) * 8 * NF;
    if (n0 >= N) return;
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
    float acc[FRAGS][NF][4];
#pragma unroll
    for (int mi = 0; mi < FRAGS; mi++)
#pragma unroll
        for (int f = 0; f < NF; f++)
#pragma unroll
            for (int v = 0; v < 4; v++) acc[mi][f][v] = 0.0f;

    for (int k0 = 0; k0 < K; k0 += 32 * SPANS) {
        int spans = min(SPANS, (K - k0) / 32);
        Weight8 wc[SPANS][NF];
#pragma unroll
        for (int s = 0; s < SPANS; s++)
#pragma unroll
            for (int f = 0; f < NF; f++)
                if (s < spans) wc[s][f] = load_weight8<FMT>(w, w_scales, w_row[f], k0 + 32 * s + 8 * t, K);
#pragma unroll
        for (int s = 0; s < SPANS; s++) {
            if (s >= spans) break;
            u32 b[NF][4];
#pragma unroll
            for (int f = 0; f < NF; f++) decode_weight8<FMT>(wc[s][f], e2m1, b[f]);
#pragma unroll
            for (int mi = 0; mi < FRAGS; mi++) {
                if (mi * 16 >= live) break;
                u32 hi[2][4] = {}, lo[2][4] = {};
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    if (h == 1 && mi * 16 + 8 >= live) break;  // no live row in the upper half
                    float4 va = make_float4(0, 0, 0, 0), vb = va;
                    if (xr[mi][h]) {
                        const float4* p = (const float4*)(xr[mi][h] + k0 + 32 * s);
                        va = p[0];
                        vb = p[1];
                    }
                    pack_act8<SPLIT>(va, vb, hi[h], lo[h]);
                }
#pragma unroll
                for (int f = 0; f < NF; f++) mma_span<SPLIT>(acc[mi][f], hi[0], hi[1], lo[0], lo[1], b[f]);
            }
        }
    }

#pragma unroll
    for (int mi = 0; mi < FRAGS; mi++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int row = r0 + mi * 16 + g + 8 * half;
            if (row >= r1) continue;
            u64 src = row_index ? (u64)row_index[row] : (u64)row;
#pragma unroll
            for (int f = 0; f < NF; f++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    int col = n0 + 8 * f + 2 * t + j;
                    if (col >= N) continue;
                    float v = acc[mi][f][2 * half + j];
                    if (FMT == 3) v = nvfp4_epilogue_scale(v, row_scale, src, w_sdec, e, sdec_groups, col, N);
                    out[(u64)row * N + col] = v;
                }
        }
}

template <int FMT>
__device__ void grouped_gemm_skinny1(const float* x, const int* row_index, const float* row_scale, const void* w,
                                     const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                                     const int* num_tiles, const int* offsets, int rows, int N, int K, float* out) {
    grouped_gemm_skinny<FMT, 1>(x, row_index, row_scale, w, w_scales, w_sdec, sdec_groups, tiles, num_tiles, offsets,
                                rows, N, K, out);
}

template <int FMT>
__device__ void grouped_gemm_skinny4(const float* x, const int* row_index, const float* row_scale, const void* w,
                                     const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                                     const int* num_tiles, const int* offsets, int rows, int N, int K, float* out) {
    grouped_gemm_skinny<FMT, 4>(x, row_index, row_scale, w, w_scales, w_sdec, sdec_groups, tiles, num_tiles, offsets,
                                rows, N, K, out);
}

#define GEMM_KERNEL(KIND, NAME, FMT)                                                                              \
    extern "C" __global__ void NAME(const float* x, const int* row_index, const float* row_scale, const void* w,   \
                                    const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,    \
                                    const int* num_tiles, const int* offsets, int rows, int N, int K, float* out) { \
        KIND<FMT>(x, row_index, row_scale, w, w_scales, w_sdec, sdec_groups, tiles, num_tiles, offsets, rows, N, K, \
                  out);                                                                                            \
    }

GEMM_KERNEL(grouped_gemm_mma, grouped_gemm_mma_bf16, 1)
GEMM_KERNEL(grouped_gemm_mma, grouped_gemm_mma_mxfp8, 2)
GEMM_KERNEL(grouped_gemm_mma, grouped_gemm_mma_nvfp4, 3)
GEMM_KERNEL(grouped_gemm_skinny1, grouped_gemm_skinny_bf16, 1)
GEMM_KERNEL(grouped_gemm_skinny1, grouped_gemm_skinny_mxfp8, 2)
GEMM_KERNEL(grouped_gemm_skinny1, grouped_gemm_skinny_nvfp4, 3)
GEMM_KERNEL(grouped_gemm_skinny4, grouped_gemm_skinny4_bf16, 1)
GEMM_KERNEL(grouped_gemm_skinny4, grouped_gemm_skinny4_mxfp8, 2)
GEMM_KERNEL(grouped_gemm_skinny4, grouped_gemm_skinny4_nvfp4, 3)

GEMM_KERNEL(grouped_gemm, grouped_gemm_f32, 0)
GEMM_KERNEL(grouped_gemm, grouped_gemm_bf16, 1)
GEMM_KERNEL(grouped_gemm, grouped_gemm_mxfp8, 2)
GEMM_KERNEL(grouped_gemm, grouped_gemm_nvfp4, 3)
