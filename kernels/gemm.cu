// Grouped GEMM for expert (and quantized dense) layers: out[r, n] = sum_k x[r, k] * W_e[n, k]
// for the rows r of each expert e, with W in F32, BF16, MXFP8 or NVFP4 kept in its storage
// format in GPU memory and decoded to f32 inside the kernel (exact for every format), FP32
// accumulation, and the NVFP4 second-level scales (s_tok of the row, S_dec of the weight)
// applied in the epilogue, in the contract's order.
//
// Three kernels share the arguments and the tile plan, and the host picks one per launch
// (ops::grouped_gemm):
// - grouped_gemm_*: CUDA cores (FFMA), any K; the only one for F32 weights (kept exact in f32).
// - grouped_gemm_mma_*: BF16 tensor cores (mma.sync m16n8k16, FP32 accumulation). Operands are
//   decoded to BF16 in shared memory: exact for MXFP8 (E4M3 x E8M0) and NVFP4 (E2M1 x E4M3)
//   weights and for quantized activations (the quantizers' dequantized values). Plain BF16
//   layers take f32 activations: each is split into two BF16 terms (hi + lo, 16 significant
//   bits) multiplied separately, so the result stays within ~1e-5 of the CPU's f32 products
//   instead of the ~2e-3 of rounding activations to BF16 (which flips MoE routing decisions).
// - grouped_gemv_*: a warp per output column for groups of a few rows (decode), 16-byte weight
//   loads; weight-bandwidth bound, where tensor cores would idle.

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

// ---- BF16 tensor cores: 32x64 tiles, 4 warps each 32 rows x 16 columns, K steps of 32 ----

#define MMA_TM TM  // the routing plan's tile rows
#define MMA_TN 64
#define MMA_TK 32
#define MMA_LD (MMA_TK + 8)  // padded row: the fragment loads hit 32 distinct banks

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

__device__ __forceinline__ void mma_bf16(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The raw bytes of 16 consecutive weights (n, k..k+16) of one tile, loaded ahead of use.
struct WeightChunk {
    uint4 lo, hi;  // BF16: 32 bytes; MXFP8: lo only (16 bytes); NVFP4: lo.x, lo.y (8 bytes)
    u8 scale;      // MXFP8: the block's E8M0; NVFP4: the 16-block's E4M3
};

template <int FMT>
__device__ __forceinline__ WeightChunk load_weight_chunk(const void* w, const u8* scales, u64 row, u64 k, u64 K) {
    WeightChunk c;
    c.lo = make_uint4(0, 0, 0, 0);
    c.hi = c.lo;
    c.scale = 0;
    if (FMT == 1) {
        const uint4* p = (const uint4*)((const bf16_t*)w + row * K + k);
        c.lo = p[0];
        c.hi = p[1];
    } else if (FMT == 2) {
        c.lo = *(const uint4*)((const u8*)w + row * K + k);
        c.scale = scales[row * (K / 32) + k / 32];
    } else {
        uint2 v = *(const uint2*)((const u8*)w + row * (K / 2) + k / 2);
        c.lo.x = v.x;
        c.lo.y = v.y;
        c.scale = scales[row * (K / 16) + k / 16];
    }
    return c;
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

// Two f32 values that are exactly BF16 (decoded codes times block scales) packed as BF16x2.
__device__ __forceinline__ u32 pack_exact_bf16(float lo, float hi) {
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
}

// The E2M1 table, filled by the block before first use (callers sync after it).
__device__ __forceinline__ void fill_e2m1_table(float* table) {
    if (threadIdx.x < 16) table[threadIdx.x] = e2m1_decode((u8)threadIdx.x);
}

// Decodes a chunk to 16 BF16 values (8 packed words). Exact: an E4M3 or E2M1 value times its
// power-of-two or E4M3 block scale has at most 8 significant bits.
template <int FMT>
__device__ __forceinline__ void decode_weight_chunk(const WeightChunk& c, const float* e2m1, u32* out) {
    if (FMT == 1) {
        out[0] = c.lo.x; out[1] = c.lo.y; out[2] = c.lo.z; out[3] = c.lo.w;
        out[4] = c.hi.x; out[5] = c.hi.y; out[6] = c.hi.z; out[7] = c.hi.w;
        return;
    }
    u32 words[4] = {c.lo.x, c.lo.y, c.lo.z, c.lo.w};
    if (FMT == 2) {
        float s = e8m0_decode(c.scale);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float lo, hi;
            e4m3x2_to_f32(words[i / 2] >> (16 * (i % 2)), lo, hi);
            out[i] = pack_exact_bf16(__fmul_rn(lo, s), __fmul_rn(hi, s));
        }
    } else {
        float s = e4m3_decode(c.scale);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 byte = (words[i / 4] >> (8 * (i % 4))) & 0xffu;
            out[i] = pack_exact_bf16(__fmul_rn(e2m1[byte & 15u], s), __fmul_rn(e2m1[byte >> 4], s));
        }
    }
}

// Grid (ceil(N / 64), tiles), 128 threads. Requires K % 32 == 0 (the host checks). The next K
// step's operands are loaded into registers while the tensor cores work on the current one.
template <int FMT>
__device__ void grouped_gemm_mma(const float* x, const int* row_index, const float* row_scale, const void* w,
                                 const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                                 const int* num_tiles, const int* offsets, int rows, int N, int K, float* out) {
    int e, r0, r1;
    if (!tile_rows(tiles, num_tiles, offsets, rows, e, r0, r1)) return;
    int n0 = blockIdx.x * MMA_TN;
    // Plain BF16 layers (FMT 1) split the f32 activations: as = hi, as_lo = x - hi.
    constexpr bool SPLIT = FMT == 1;
    __shared__ __align__(16) bf16_t as[MMA_TM][MMA_LD];
    __shared__ __align__(16) bf16_t as_lo[SPLIT ? MMA_TM : 1][MMA_LD];
    __shared__ __align__(16) bf16_t ws[MMA_TN][MMA_LD];
    __shared__ float e2m1[16];
    fill_e2m1_table(e2m1);
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

    // Loader roles: A row tid / 4 (8 values from k (tid % 4) * 8); W row tid / 2 (16 values).
    int a_row = tid >> 2, a_k = (tid & 3) * 8;
    bool a_live = r0 + a_row < r1;
    u64 a_src = a_live ? (row_index ? (u64)row_index[r0 + a_row] : (u64)(r0 + a_row)) : 0;
    int w_n = tid >> 1, w_k = (tid & 1) * 16;
    bool w_live = n0 + w_n < N;
    u64 w_row = (u64)e * N + (n0 + w_n);

    float4 xa = make_float4(0, 0, 0, 0), xb = xa;
    WeightChunk wc;
    wc.lo = make_uint4(0, 0, 0, 0);
    wc.hi = wc.lo;
    wc.scale = 0;
    auto fetch = [&](int k0) {
        if (a_live) {
            const float4* p = (const float4*)(x + a_src * K + k0 + a_k);
            xa = p[0];
            xb = p[1];
        }
        if (w_live) wc = load_weight_chunk<FMT>(w, w_scales, w_row, k0 + w_k, K);
    };
    auto stash = [&]() {
        // Quantized activations are exact in BF16; plain ones are rounded (hi) and split.
        auto pack = [](float lo, float hi) { return SPLIT ? pack_bf16(lo, hi) : pack_exact_bf16(lo, hi); };
        uint4 a = make_uint4(pack(xa.x, xa.y), pack(xa.z, xa.w), pack(xb.x, xb.y), pack(xb.z, xb.w));
        *(uint4*)&as[a_row][a_k] = a;
        if constexpr (SPLIT) {
            u32 hi[4] = {a.x, a.y, a.z, a.w};
            float v[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
            u32 lo[4];
#pragma unroll
            for (int i = 0; i < 4; i++)
                lo[i] = pack_bf16(v[2 * i] - __uint_as_float(hi[i] << 16), v[2 * i + 1] - __uint_as_float(hi[i] & 0xffff0000u));
            *(uint4*)&as_lo[a_row][a_k] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        }
        u32 d[8];
        decode_weight_chunk<FMT>(wc, e2m1, d);
        *(uint4*)&ws[w_n][w_k] = make_uint4(d[0], d[1], d[2], d[3]);
        *(uint4*)&ws[w_n][w_k + 8] = make_uint4(d[4], d[5], d[6], d[7]);
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
#pragma unroll
        for (int ks = 0; ks < MMA_TK; ks += 16) {
            u32 a[2][4], b[2][2];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                int r = mi * 16 + g;
                a[mi][0] = *(const u32*)&as[r][ks + 2 * t];
                a[mi][1] = *(const u32*)&as[r + 8][ks + 2 * t];
                a[mi][2] = *(const u32*)&as[r][ks + 2 * t + 8];
                a[mi][3] = *(const u32*)&as[r + 8][ks + 2 * t + 8];
            }
#pragma unroll
            for (int ni = 0; ni < 2; ni++) {
                int n = warp * 16 + ni * 8 + g;
                b[ni][0] = *(const u32*)&ws[n][ks + 2 * t];
                b[ni][1] = *(const u32*)&ws[n][ks + 2 * t + 8];
            }
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int ni = 0; ni < 2; ni++) mma_bf16(acc[mi][ni], a[mi], b[ni]);
            if constexpr (SPLIT) {
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    int r = mi * 16 + g;
                    a[mi][0] = *(const u32*)&as_lo[r][ks + 2 * t];
                    a[mi][1] = *(const u32*)&as_lo[r + 8][ks + 2 * t];
                    a[mi][2] = *(const u32*)&as_lo[r][ks + 2 * t + 8];
                    a[mi][3] = *(const u32*)&as_lo[r + 8][ks + 2 * t + 8];
                }
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
#pragma unroll
                    for (int ni = 0; ni < 2; ni++) mma_bf16(acc[mi][ni], a[mi], b[ni]);
            }
        }
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
                    if (FMT == 3)
                        v = __fmul_rn(__fmul_rn(v, row_scale[src]), w_sdec[e * sdec_groups + col / (N / sdec_groups)]);
                    out[(u64)row * N + col] = v;
                }
        }
}

// ---- GEMV for groups of a few rows: a warp per output column, 8 columns per 256-thread block ----

#define GEMV_ROWS 4  // rows per pass; a group with more rows makes more passes

// The 8 weights (n, k..k+8) as f32. Requires K % 32 == 0 and k % 8 == 0.
template <int FMT>
__device__ __forceinline__ void load_weight8(const void* w, const u8* scales, const float* e2m1, u64 row, u64 k,
                                             u64 K, float* v) {
    if (FMT == 0) {
        const float4* p = (const float4*)((const float*)w + row * K + k);
        float4 a = p[0], b = p[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else if (FMT == 1) {
        uint4 q = *(const uint4*)((const bf16_t*)w + row * K + k);
        u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(words[i] << 16);
            v[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
        }
    } else if (FMT == 2) {
        uint2 q = *(const uint2*)((const u8*)w + row * K + k);
        float s = e8m0_decode(scales[row * (K / 32) + k / 32]);
        u32 words[2] = {q.x, q.y};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            e4m3x2_to_f32(words[i / 2] >> (16 * (i % 2)), v[2 * i], v[2 * i + 1]);
            v[2 * i] = __fmul_rn(v[2 * i], s);
            v[2 * i + 1] = __fmul_rn(v[2 * i + 1], s);
        }
    } else {
        u32 q = *(const u32*)((const u8*)w + row * (K / 2) + k / 2);
        float s = e4m3_decode(scales[row * (K / 16) + k / 16]);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(e2m1[(q >> (4 * i)) & 15u], s);
    }
}

// Grid (ceil(N / 8), tiles), 256 threads.
template <int FMT>
__device__ void grouped_gemv(const float* x, const int* row_index, const float* row_scale, const void* w,
                             const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,
                             const int* num_tiles, const int* offsets, int rows, int N, int K, float* out) {
    int e, r0, r1;
    if (!tile_rows(tiles, num_tiles, offsets, rows, e, r0, r1)) return;
    __shared__ float e2m1[16];
    fill_e2m1_table(e2m1);
    __syncthreads();
    int col = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (col >= N) return;
    u64 w_row = (u64)e * N + col;
    for (int rg = r0; rg < r1; rg += GEMV_ROWS) {
        int live = min(GEMV_ROWS, r1 - rg);
        u64 src[GEMV_ROWS];
        float acc[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            src[r] = r < live ? (row_index ? (u64)row_index[rg + r] : (u64)(rg + r)) : 0;
            acc[r] = 0.0f;
        }
        for (int k = lane * 8; k < K; k += 256) {
            float wv[8];
            load_weight8<FMT>(w, w_scales, e2m1, w_row, k, K, wv);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++) {
                if (r >= live) break;
                const float4* p = (const float4*)(x + src[r] * K + k);
                float4 a = p[0], b = p[1];
                acc[r] = fmaf(a.x, wv[0], acc[r]);
                acc[r] = fmaf(a.y, wv[1], acc[r]);
                acc[r] = fmaf(a.z, wv[2], acc[r]);
                acc[r] = fmaf(a.w, wv[3], acc[r]);
                acc[r] = fmaf(b.x, wv[4], acc[r]);
                acc[r] = fmaf(b.y, wv[5], acc[r]);
                acc[r] = fmaf(b.z, wv[6], acc[r]);
                acc[r] = fmaf(b.w, wv[7], acc[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            float v = warp_sum(acc[r]);
            if (lane == 0 && r < live) {
                if (FMT == 3)
                    v = __fmul_rn(__fmul_rn(v, row_scale[src[r]]), w_sdec[e * sdec_groups + col / (N / sdec_groups)]);
                out[(u64)(rg + r) * N + col] = v;
            }
        }
    }
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
GEMM_KERNEL(grouped_gemv, grouped_gemv_f32, 0)
GEMM_KERNEL(grouped_gemv, grouped_gemv_bf16, 1)
GEMM_KERNEL(grouped_gemv, grouped_gemv_mxfp8, 2)
GEMM_KERNEL(grouped_gemv, grouped_gemv_nvfp4, 3)

GEMM_KERNEL(grouped_gemm, grouped_gemm_f32, 0)
GEMM_KERNEL(grouped_gemm, grouped_gemm_bf16, 1)
GEMM_KERNEL(grouped_gemm, grouped_gemm_mxfp8, 2)
GEMM_KERNEL(grouped_gemm, grouped_gemm_nvfp4, 3)
