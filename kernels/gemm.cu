// Grouped GEMM for expert (and quantized dense) layers: out[r, n] = sum_k x[r, k] * W_e[n, k]
// for the rows r of each expert e, with W in F32, BF16, MXFP8 or NVFP4 kept in its storage
// format in GPU memory and decoded to f32 inside the kernel (exact for every format), FP32
// accumulation, and the NVFP4 second-level scales (s_tok of the row, S_dec of the weight)
// applied in the epilogue, in the contract's order.
//
// This is the correctness baseline on CUDA cores (FFMA); the tensor-core (wgmma / block-scaled
// MMA) versions are the next step and must match it within the BF16 tolerance.

#define TM 32
#define TN 64
#define TK 32

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
    int tile = blockIdx.y;
    int e, r0, r1;
    if (tiles) {
        if (tile >= *num_tiles) return;
        e = tiles[2 * tile];
        r0 = tiles[2 * tile + 1];
        r1 = min(r0 + TM, offsets[e + 1]);
    } else {
        e = 0;
        r0 = tile * TM;
        if (r0 >= rows) return;
        r1 = min(r0 + TM, rows);
    }
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

#define GEMM_ENTRY(NAME, FMT)                                                                                     \
    extern "C" __global__ void NAME(const float* x, const int* row_index, const float* row_scale, const void* w,   \
                                    const u8* w_scales, const float* w_sdec, int sdec_groups, const int* tiles,    \
                                    const int* num_tiles, const int* offsets, int rows, int N, int K, float* out) { \
        grouped_gemm<FMT>(x, row_index, row_scale, w, w_scales, w_sdec, sdec_groups, tiles, num_tiles, offsets,    \
                          rows, N, K, out);                                                                        \
    }

GEMM_ENTRY(grouped_gemm_f32, 0)
GEMM_ENTRY(grouped_gemm_bf16, 1)
GEMM_ENTRY(grouped_gemm_mxfp8, 2)
GEMM_ENTRY(grouped_gemm_nvfp4, 3)
