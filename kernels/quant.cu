// The contract's quantizers on the GPU, byte for byte the `quant` module's: MXFP8 1x32 rowwise
// and NVFP4 (per-tensor level given, or per-token levels computed here; optional
// four-over-six). Used for activations before every quantized GEMM and for weights quantized at
// load (`--quantization nvfp4_online|mxfp8`, dummy weights).

#define R448 __uint_as_float(0x3B124925u)  // fl(1/448)
#define R6 __uint_as_float(0x3E2AAAABu)    // fl(1/6)
#define F32_MAX __uint_as_float(0x7f7fffffu)

__device__ __forceinline__ u8 e4m3_encode(float x) {
    u32 bits = __float_as_uint(x);
    u32 sign = (bits >> 24) & 0x80u;
    u32 mag = bits & 0x7fffffffu;
    u32 rounded = (mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20;
    u32 normal = rounded - ((127u - 7u) << 3);
    float v = __fmul_rn(__uint_as_float(min(mag, 0x3c800000u)), 512.0f);
    u32 subnormal = (u32)__fsub_rn(__fadd_rn(v, 12582912.0f), 12582912.0f);
    u32 code = mag < 0x3c800000u ? subnormal : normal;
    code = mag >= 0x43e00000u ? 0x7eu : code;
    u8 byte = (u8)(sign | code);
    return mag > 0x7f800000u ? (u8)0x7f : byte;
}

__device__ __forceinline__ u8 e2m1_encode(float x) {
    if (isnan(x)) return 0x7;
    u8 sign = (u8)((__float_as_uint(x) >> 28) & 0x8u);
    float a = fabsf(x);
    u8 code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return sign | code;
}

__device__ __forceinline__ u8 e8m0_round_up(float v) {
    if (isnan(v)) return 0xff;
    if (isinf(v) && v > 0.0f) return 0xfe;
    if (v == 0.0f) return 0;
    u32 bits = __float_as_uint(v);
    u32 e = bits >> 23, m = bits & 0x7fffffu;
    if (m > 0u && e != 0xfeu && !(e == 0u && m <= 0x400000u)) e += 1u;
    return (u8)e;
}

__device__ __forceinline__ float e8m0_inverse(u8 c) {
    if (c == 0xff) return __uint_as_float(0x7fc00000u);
    if (c == 0xfe) return __uint_as_float(0x00400000u);
    return __uint_as_float((254u - c) << 23);
}

// |x| bits with NaN mapped to 0, so an unsigned max over them is the NaN-skipping amax.
__device__ __forceinline__ u32 amax_bits(float x) {
    u32 b = __float_as_uint(x) & 0x7fffffffu;
    return b <= 0x7f800000u ? b : 0u;
}

// Four values folded into a running max of their amax_bits and whether any is a number (not
// NaN): what every quantizer reduces for an amax.
__device__ __forceinline__ void amax_fold4(const float* v, u32& mb, int& any_number) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        mb = max(mb, amax_bits(v[i]));
        any_number |= !isnan(v[i]);
    }
}

// Four consecutive elements (16-byte aligned for f32, 8-byte for BF16) as f32.
__device__ __forceinline__ void load4(const float* x, u64 i, float* v) {
    float4 a = *(const float4*)(x + i);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}
__device__ __forceinline__ void load4(const bf16_t* x, u64 i, float* v) {
    uint2 a = *(const uint2*)(x + i);
    v[0] = __uint_as_float(a.x << 16); v[1] = __uint_as_float(a.x & 0xffff0000u);
    v[2] = __uint_as_float(a.y << 16); v[3] = __uint_as_float(a.y & 0xffff0000u);
}

// What the MXFP8 quantizer reads, four elements of one row at flat element index i (i % 4 == 0):
// a tensor of T (f32 or BF16), or SwiGLU's silu(gate) * up computed from gate/up rows
// [rows][2 * cols] (silu_mul's arithmetic), each value also stored to h [rows][cols], so the
// down projection's input is quantized in the launch that makes it.
// `at(r, cols, c, v)`: the four elements c..c + 3 of row r of rows of `cols` values.
template <typename T>
struct TensorSrc {
    const T* x;
    __device__ __forceinline__ void four(u64 i, float* v) const { load4(x, i, v); }
    __device__ __forceinline__ void at(u64 r, u64 cols, u64 c, float* v) const { load4(x, r * cols + c, v); }
};
struct SiluMulSrc {
    const float* gu;
    float* h;
    u64 cols;
    __device__ __forceinline__ void four(u64 i, float* v) const {
        u64 r = i / cols, c = i - r * cols;
        float g[4], u[4];
        load4(gu, 2 * r * cols + c, g);
        load4(gu, 2 * r * cols + cols + c, u);
#pragma unroll
        for (int k = 0; k < 4; k++) v[k] = silu_mul_value(g[k], u[k]);
        *(float4*)(h + i) = make_float4(v[0], v[1], v[2], v[3]);
    }
    __device__ __forceinline__ void at(u64 r, u64, u64 c, float* v) const {
        float g[4], u[4];
        load4(gu, 2 * r * cols + c, g);
        load4(gu, 2 * r * cols + cols + c, u);
#pragma unroll
        for (int k = 0; k < 4; k++) v[k] = silu_mul_value(g[k], u[k]);
        *(float4*)(h + r * cols + c) = make_float4(v[0], v[1], v[2], v[3]);
    }
};

// Eight lanes per 1x32 block, four consecutive elements each (one 16-byte load, one 4-byte
// store of codes, one 16-byte store of dequantized values), so a warp reads and writes whole
// lines; the block's amax is a max over its 8 lanes, which gives the bits of any order.
// `deq` (optional) receives the exact dequantized values.
template <typename Src>
__device__ void mxfp8_rowwise(Src x, u64 blocks, u8* data, u8* scales, float* deq) {
    u64 quads = blocks * 8, lane = threadIdx.x & 31;
    // Warp-uniform trips: a group of 8 lanes is wholly past the end or not (quads % 8 == 0).
    for (u64 w = blockIdx.x * (u64)blockDim.x + threadIdx.x - lane; w < quads; w += (u64)gridDim.x * blockDim.x) {
        u64 i = w + lane;  // elements 4i..4i + 3 of block i / 8
        bool live = i < quads;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (live) x.four(4 * i, v);
        u32 mb = 0u;
        int any_number = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            mb = max(mb, amax_bits(v[k]));
            any_number |= live && !isnan(v[k]);
        }
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) {
            mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, o));
            any_number |= __shfl_xor_sync(0xffffffffu, any_number, o);
        }
        if (!live) continue;
        float amax = any_number ? __uint_as_float(mb) : __uint_as_float(0x7fc00000u);
        u8 code = e8m0_round_up(__fmul_rn(amax, R448));
        float inv = e8m0_inverse(code), dec = e8m0_decode(code);
        if ((i & 7) == 0) scales[i / 8] = code;
        u32 codes = 0u;
        float d[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u8 q = e4m3_encode(__fmul_rn(v[k], inv));
            codes |= (u32)q << (8 * k);
            d[k] = __fmul_rn(e4m3_decode(q), dec);
        }
        *(u32*)(data + 4 * i) = codes;
        if (deq) *(float4*)(deq + 4 * i) = make_float4(d[0], d[1], d[2], d[3]);
    }
}

extern "C" __global__ void mxfp8_quantize_f32(const float* x, u64 blocks, u8* data, u8* scales, float* deq) {
    pdl_entry();
    mxfp8_rowwise(TensorSrc<float>{x}, blocks, data, scales, deq);
}

extern "C" __global__ void mxfp8_quantize_bf16(const bf16_t* x, u64 blocks, u8* data, u8* scales, float* deq) {
    pdl_entry();
    mxfp8_rowwise(TensorSrc<bf16_t>{x}, blocks, data, scales, deq);
}

// silu_mul and then mxfp8_quantize_f32 of its output, in one launch: h [rows][cols] gets
// silu_mul's values and data, scales and deq their quantization, the same bytes as the two
// launches. cols % 32 == 0.
extern "C" __global__ void mxfp8_quantize_silu_mul(const float* gu, float* h, int cols, u64 blocks, u8* data,
                                                   u8* scales, float* deq) {
    pdl_entry();
    mxfp8_rowwise(SiluMulSrc{gu, h, (u64)cols}, blocks, data, scales, deq);
}

struct Level {
    float amax, s_enc, s_dec;
};

// `S_enc = RN(range / A)` clamped (1 for a zero amax), `S_dec = RN(1 / S_enc)`.
__device__ __forceinline__ Level level_from_amax(float a, float range) {
    float s = fminf(__fdiv_rn(range, a), F32_MAX);
    if (a == 0.0f || s == 0.0f) s = 1.0f;
    Level l = {a, s, __fdiv_rn(1.0f, s)};
    return l;
}

// A row's per-token level from its amax bits (`any_number` 0: every element NaN, the amax NaN),
// and its s_tok (0 for an all-zero row) stored by the `writer` thread.
__device__ __forceinline__ Level token_level(u32 amax_bits, int any_number, int cols, float range, float* s_tok,
                                             bool writer) {
    float a = (any_number || cols == 0) ? __uint_as_float(amax_bits) : __uint_as_float(0x7fc00000u);
    Level lv = level_from_amax(a, range);
    if (writer) *s_tok = lv.amax == 0.0f ? 0.0f : lv.s_dec;
    return lv;
}

// A row's level from a given amax (per tensor, or shared), its S_dec stored by the `writer`
// thread where asked for (`s_dec` not null).
__device__ __forceinline__ Level given_level(float amax, float range, float* s_dec, bool writer) {
    Level lv = level_from_amax(amax, range);
    if (s_dec && writer) *s_dec = lv.s_dec;
    return lv;
}

__device__ __forceinline__ float element_multiplier(u8 s8, float s_dec) {
    return fminf(__fdiv_rn(1.0f, __fmul_rn(e4m3_decode(s8), s_dec)), F32_MAX);
}

// A 16-element block's scale byte for its amax, and the multiplier that encodes its elements.
__device__ __forceinline__ u8 nvfp4_block_scale(float block_amax, Level lv, float& enc) {
    u8 s8 = e4m3_encode(__fmul_rn(block_amax, __fmul_rn(lv.s_enc, R6)));
    enc = element_multiplier(s8, lv.s_dec);
    return s8;
}

// One 16-element block: codes out, its scale byte returned. fos_range > 0 turns on
// four-over-six with that E4M3 range; fos_squared picks the squared error.
__device__ u8 nvfp4_block(const float* v, Level lv, float fos_range, int fos_squared, u8* codes) {
    u32 mb = 0u;
    bool any_number = false;
    for (int i = 0; i < 16; i++) {
        mb = max(mb, amax_bits(v[i]));
        any_number |= !isnan(v[i]);
    }
    float block_amax = any_number ? __uint_as_float(mb) : __uint_as_float(0x7fc00000u);
    if (fos_range <= 0.0f) {
        float enc;
        u8 s8 = nvfp4_block_scale(block_amax, lv, enc);
        for (int i = 0; i < 16; i++) codes[i] = e2m1_encode(__fmul_rn(v[i], enc));
        return s8;
    }
    float range = __fmul_rn(6.0f, fos_range);
    float base = __fmul_rn(__fdiv_rn(block_amax, 6.0f), lv.s_enc);
    u8 s6 = e4m3_encode(fminf(base, 448.0f));
    u8 s4 = e4m3_encode(fminf(__fmul_rn(base, 1.5f), 448.0f));
    float enc6 = element_multiplier(s6, lv.s_dec), enc4 = element_multiplier(s4, lv.s_dec);
    float d6 = e4m3_decode(s6), d4 = e4m3_decode(s4);
    float err6 = 0.0f, err4 = 0.0f;
    u8 c4[16];
    for (int i = 0; i < 16; i++) {
        codes[i] = e2m1_encode(__fmul_rn(v[i], enc6));
        c4[i] = e2m1_encode(__fmul_rn(v[i], enc4));
    }
    for (int i = 0; i < 16; i++) {
        float a = __fsub_rn(__fdiv_rn(__fmul_rn(__fmul_rn(e2m1_decode(codes[i]), d6), lv.amax), range), v[i]);
        float b = __fsub_rn(__fdiv_rn(__fmul_rn(__fmul_rn(e2m1_decode(c4[i]), d4), lv.amax), range), v[i]);
        err6 = __fadd_rn(err6, fos_squared ? __fmul_rn(a, a) : fabsf(a));
        err4 = __fadd_rn(err4, fos_squared ? __fmul_rn(b, b) : fabsf(b));
    }
    if (err4 < err6) {
        for (int i = 0; i < 16; i++) codes[i] = c4[i];
        return s4;
    }
    return s6;
}

// One quarter of a 16-element block without four-over-six (elements 4q..4q + 3 of a row, in
// v), computed by the block's four threads together (`group`: their lanes, all live): the block
// amax by two shuffles within the group, then the scale (nvfp4_block_scale), codes and
// dequantized values of nvfp4_block for the thread's four (so the same bytes): two code bytes
// and a float4 a thread. `data`, `scales`, `deq` and `words` are the row's.
__device__ __forceinline__ void nvfp4_quarter(const float* v, int q, u32 group, Level lv, u8* data, u8* scales,
                                              float* deq, u32* words) {
    u32 mb = 0u;
    int any_number = 0;
    amax_fold4(v, mb, any_number);
#pragma unroll
    for (int d = 1; d < 4; d <<= 1) {
        mb = max(mb, __shfl_xor_sync(group, mb, d));
        any_number |= __shfl_xor_sync(group, any_number, d);
    }
    float block_amax = any_number ? __uint_as_float(mb) : __uint_as_float(0x7fc00000u);
    float enc;
    u8 s8 = nvfp4_block_scale(block_amax, lv, enc);
    u32 c[4];
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] = e2m1_encode(__fmul_rn(v[i], enc));
    *(unsigned short*)(data + (u64)q * 2) = (unsigned short)(c[0] | c[1] << 4 | c[2] << 8 | c[3] << 12);
    if ((q & 3) == 0) scales[q / 4] = s8;
    if (deq || words) {
        float d = e4m3_decode(s8);
        float4 v4 = make_float4(__fmul_rn(e2m1_decode(c[0]), d), __fmul_rn(e2m1_decode(c[1]), d),
                                __fmul_rn(e2m1_decode(c[2]), d), __fmul_rn(e2m1_decode(c[3]), d));
        if (deq) *(float4*)(deq + (u64)q * 4) = v4;
        if (words) {
            // Pairs 2q and 2q + 1 as pack_gemm_operand packs them (a warp's stores fill whole
            // sectors: its 128 values are four spans).
            words[packed_word(2 * q)] = pack_exact_f16(v4.x, v4.y);
            words[packed_word(2 * q + 1)] = pack_exact_f16(v4.z, v4.w);
        }
    }
}

// A row's 16-element blocks without four-over-six, four threads a block and four elements a
// thread (blockDim a multiple of 4, cols of 16): nvfp4_quarter for each thread's quarters. A
// decode row is one block: a quarter of nvfp4_block's chain a thread, where a thread a block
// left 16 dependent encodes each.
template <typename T>
__device__ __forceinline__ void nvfp4_row_quarters(const T* row, int cols, Level lv, u8* data, u8* scales,
                                                   float* deq, u32* words) {
    for (int q = threadIdx.x; q < cols / 4; q += blockDim.x) {
        // A group's four threads are all in this trip or all past the row (cols / 4 and the
        // stride are multiples of 4).
        u32 group = __activemask();
        float v[4];
        load4(row, (u64)q * 4, v);
        nvfp4_quarter(v, q, group, lv, data, scales, deq, words);
    }
}

// A row's per-token level from each thread's amax bits and any-number flag (one block a row):
// the block's max and or (the same in any order), then token_level, thread 0 writing s_tok.
__device__ __forceinline__ Level block_token_level(u32 mb, int any_number, int cols, float range, float* s_tok) {
    __shared__ u32 red_bits[32];
    __shared__ int red_any[32];
    mb = __reduce_max_sync(0xffffffffu, mb);
    any_number = __reduce_or_sync(0xffffffffu, any_number);
    if ((threadIdx.x & 31) == 0) {
        red_bits[threadIdx.x >> 5] = mb;
        red_any[threadIdx.x >> 5] = any_number;
    }
    __syncthreads();
    mb = 0u;
    any_number = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
        mb = max(mb, red_bits[w]);
        any_number |= red_any[w];
    }
    return token_level(mb, any_number, cols, range, s_tok, threadIdx.x == 0);
}

#define AMAX_LOADS 4  // nvfp4_rows' per-token amax: loads of four elements in flight a thread

// One block per row. Per token (`per_token`): the row's own level, and s_tok (0 for an all-zero
// row) written to row_s_dec. Otherwise the given level (a per-tensor scale, e.g. the one gate and
// up share). `deq` (optional): the block-scaled values e2m1 * e4m3, the GEMM's operand.
template <typename T>
__device__ void nvfp4_rows(const T* x, int cols, int per_token, float amax, float range, float fos_range,
                           int fos_squared, u8* data, u8* scales, float* row_s_dec, float* deq, u32* words) {
    u64 r = blockIdx.x;
    const T* row = x + r * cols;
    Level lv;
    if (per_token) {
        // Four elements a load and AMAX_LOADS loads in flight before any max: a decode row is
        // one block, and a load a trip made its walk a chain of dependent round trips (16 for
        // a 2,048-wide row). A max over the bits and an or give the same result in any order.
        u32 mb = 0u;
        int any_number = 0;
        for (int i0 = 4 * threadIdx.x; i0 < cols; i0 += 4 * AMAX_LOADS * blockDim.x) {
            float v[AMAX_LOADS][4];
#pragma unroll
            for (int u = 0; u < AMAX_LOADS; u++) {
                int i = i0 + 4 * u * blockDim.x;
                if (i < cols) load4(row, i, v[u]);
            }
#pragma unroll
            for (int u = 0; u < AMAX_LOADS; u++) {
                if (i0 + 4 * u * (int)blockDim.x >= cols) break;
                amax_fold4(v[u], mb, any_number);
            }
        }
        lv = block_token_level(mb, any_number, cols, range, row_s_dec + r);
    } else {
        lv = given_level(amax, range, row_s_dec ? row_s_dec + r : nullptr, threadIdx.x == 0);
    }
    if (fos_range <= 0.0f) {
        nvfp4_row_quarters(row, cols, lv, data + r * (cols / 2), scales + r * (cols / 16), deq ? deq + r * cols : nullptr,
                           words ? words + r * (cols / 2) : nullptr);
        return;
    }
    // Four-over-six: a thread per 16-element block, 16-byte loads, its 8 code bytes in one
    // store, its dequantized values in four.
    for (int b = threadIdx.x; b < cols / 16; b += blockDim.x) {
        float v[16];
        u8 codes[16];
#pragma unroll
        for (int i = 0; i < 16; i += 4) load4(row, b * 16 + i, v + i);
        u8 s8 = nvfp4_block(v, lv, fos_range, fos_squared, codes);
        scales[r * (cols / 16) + b] = s8;
        u32 packed[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 8; i++) packed[i / 4] |= (u32)((codes[2 * i + 1] << 4) | codes[2 * i]) << (8 * (i % 4));
        *(uint2*)(data + r * (cols / 2) + b * 8) = make_uint2(packed[0], packed[1]);
        if (deq || words) {
            float d = e4m3_decode(s8);
#pragma unroll
            for (int i = 0; i < 16; i += 4) {
                float4 v4 = make_float4(__fmul_rn(e2m1_decode(codes[i]), d), __fmul_rn(e2m1_decode(codes[i + 1]), d),
                                        __fmul_rn(e2m1_decode(codes[i + 2]), d), __fmul_rn(e2m1_decode(codes[i + 3]), d));
                if (deq) *(float4*)(deq + r * cols + b * 16 + i) = v4;
                if (words) {
                    int j = (b * 16 + i) / 2;  // the pair of elements b * 16 + i, + 1
                    words[r * (cols / 2) + packed_word(j)] = pack_exact_f16(v4.x, v4.y);
                    words[r * (cols / 2) + packed_word(j + 1)] = pack_exact_f16(v4.z, v4.w);
                }
            }
        }
    }
}

// Activations. Per tensor, the amax comes from `amax_f32` on the device (no host round trip).
// `deq` (optional): the values as f32; `words` (optional): the same values as the tiled and
// wgmma GEMMs' FP16 operand (pack_gemm_operand's words of them: cols / 2 a row).
extern "C" __global__ void nvfp4_quantize_f32(const float* x, int cols, int per_token, const u32* tensor_amax,
                                              float range, float fos_range, int fos_squared, u8* data, u8* scales,
                                              float* row_s_dec, float* deq, u32* words) {
    pdl_entry();
    float amax = 0.0f;
    if (!per_token) amax = tensor_amax[1] ? __uint_as_float(tensor_amax[0]) : __uint_as_float(0x7fc00000u);
    nvfp4_rows(x, cols, per_token, amax, range, fos_range, fos_squared, data, scales, row_s_dec, deq, words);
}

extern "C" __global__ void nvfp4_quantize_bf16(const bf16_t* x, int cols, float amax, float range,
                                               float fos_range, int fos_squared, u8* data, u8* scales) {
    pdl_entry();
    nvfp4_rows(x, cols, 0, amax, range, fos_range, fos_squared, data, scales, (float*)0, (float*)0, (u32*)0);
}

// Many rows (prefill, and the experts' rows of large decode steps): a warp a row, the row held in
// registers (QPL quarters a lane: lane l takes quarters l, l + 32, ...; cols <= 128 * QPL), read
// once with every load in flight, its amax reduced within the warp (no block barrier), then
// nvfp4_quarter on each quarter from the registers. A block a row (nvfp4_rows) chains two reads
// of the row, a barrier and the level's divisions per row, and at prefill's tens of thousands
// of rows ran as waves of such chains (0.9-1.4 TB/s). Without four-over-six; the same bytes
// as nvfp4_rows (the same max over the same bits, the same nvfp4_quarter).
// `x` is what the row holds: a tensor (TensorSrc), or SwiGLU of gate/up rows (SiluMulSrc, whose
// values go to h as well).
template <int QPL, typename Src>
__device__ __forceinline__ void nvfp4_rows_warp(Src x, u64 rows, int cols, int per_token, float amax, float range,
                                                u8* data, u8* scales, float* row_s_dec, float* deq, u32* words) {
    u64 r = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;  // warp-uniform
    int lane = threadIdx.x & 31, quarters = cols / 4;
    float v[QPL][4];
#pragma unroll
    for (int j = 0; j < QPL; j++)
        if (lane + 32 * j < quarters) x.at(r, cols, (u64)(lane + 32 * j) * 4, v[j]);
    Level lv;
    if (per_token) {
        u32 mb = 0u;
        int any_number = 0;
#pragma unroll
        for (int j = 0; j < QPL; j++) {
            if (lane + 32 * j >= quarters) break;
            amax_fold4(v[j], mb, any_number);
        }
        mb = __reduce_max_sync(0xffffffffu, mb);
        any_number = __reduce_or_sync(0xffffffffu, any_number);
        lv = token_level(mb, any_number, cols, range, row_s_dec + r, lane == 0);
    } else {
        lv = given_level(amax, range, row_s_dec ? row_s_dec + r : nullptr, lane == 0);
    }
    u8* row_data = data + r * (cols / 2);
    u8* row_scales = scales + r * (cols / 16);
    float* row_deq = deq ? deq + r * cols : nullptr;
    u32* row_words = words ? words + r * (cols / 2) : nullptr;
#pragma unroll
    for (int j = 0; j < QPL; j++) {
        // Quarters and the lane stride are multiples of 4: a block's four lanes are all live or
        // all past the row, so the live lanes' shuffles stay among live lanes.
        int q = lane + 32 * j;
        if (32 * j >= quarters) break;  // warp-uniform
        u32 live = __ballot_sync(0xffffffffu, q < quarters);
        if (q < quarters) nvfp4_quarter(v[j], q, live, lv, row_data, row_scales, row_deq, row_words);
    }
}

#define NVFP4_WARP_ROWS_KERNEL(NAME, QPL)                                                                          \
    extern "C" __global__ void NAME(const float* x, u64 rows, int cols, int per_token, const u32* tensor_amax,      \
                                    float range, u8* data, u8* scales, float* row_s_dec, float* deq, u32* words) { \
        pdl_entry();                                                                                               \
        float amax = 0.0f;                                                                                         \
        if (!per_token) amax = tensor_amax[1] ? __uint_as_float(tensor_amax[0]) : __uint_as_float(0x7fc00000u);   \
        nvfp4_rows_warp<QPL>(TensorSrc<float>{x}, rows, cols, per_token, amax, range, data, scales, row_s_dec, deq, \
                             words);                                                                               \
    }
// Rows of up to 1,024 values (the experts' SwiGLU output: 768 in Qwen3-30B-A3B) and of up to
// 2,048 (their input).
NVFP4_WARP_ROWS_KERNEL(nvfp4_quantize_f32_warp8, 8)
NVFP4_WARP_ROWS_KERNEL(nvfp4_quantize_f32_warp16, 16)

// silu_mul and then the per-token nvfp4_quantize_f32 of its output on the warp-a-row walk, in
// one launch: h [rows][cols] gets silu_mul's values, data, scales, row_s_dec, deq and words
// their quantization; the same bytes as the two launches. Rows of up to 1,024 values.
extern "C" __global__ void nvfp4_quantize_silu_mul_warp8(const float* gu, float* h, u64 rows, int cols, float range,
                                                         u8* data, u8* scales, float* row_s_dec, float* deq,
                                                         u32* words) {
    pdl_entry();
    nvfp4_rows_warp<8>(SiluMulSrc{gu, h, (u64)cols}, rows, cols, 1, 0.0f, range, data, scales, row_s_dec, deq, words);
}

// The same on the block walk (nvfp4_rows: decode's few rows), without four-over-six: a block a
// row writes the row's SwiGLU values into h (four a thread, as the warp walk's loads), then
// quantizes the row as nvfp4_quantize_f32 does: from the registers where the row is a quarter a
// thread or less, else after the barrier from h. Rows of cols % 4 == 0 values.
extern "C" __global__ void nvfp4_quantize_silu_mul_rows(const float* gu, float* h, int cols, float range, u8* data,
                                                        u8* scales, float* row_s_dec, float* deq, u32* words) {
    pdl_entry();
    SiluMulSrc src{gu, h, (u64)cols};
    u64 r = blockIdx.x;
    if (cols % 16 == 0 && cols <= 4 * (int)blockDim.x) {
        // A quarter a thread at most (the engine's experts: 768 columns, 192 threads): the
        // thread keeps its four products for the amax and the codes instead of reading h back,
        // the values nvfp4_rows would read, so the same bytes.
        int q = threadIdx.x;
        bool live = 4 * q < cols;
        float v[4];
        u32 mb = 0u;
        int any_number = 0;
        if (live) {
            src.at(r, cols, 4 * q, v);
            amax_fold4(v, mb, any_number);
        }
        Level lv = block_token_level(mb, any_number, cols, range, row_s_dec + r);
        // A group's four threads are all live or all past the row (cols / 4 is a multiple of 4).
        if (live)
            nvfp4_quarter(v, q, __activemask(), lv, data + r * (cols / 2), scales + r * (cols / 16),
                          deq ? deq + r * cols : nullptr, words ? words + r * (cols / 2) : nullptr);
        return;
    }
    for (int c = 4 * threadIdx.x; c < cols; c += 4 * blockDim.x) {
        float v[4];
        src.at(r, cols, c, v);
    }
    __syncthreads();
    nvfp4_rows(h, cols, 1, 0.0f, range, 0.0f, 0, data, scales, row_s_dec, deq, words);
}

// out[0] = max |x| bits (NaN skipped), out[1] |= 1 if any element is a number. Zero `out` first.
extern "C" __global__ void amax_bf16(const bf16_t* x, u64 n, u32* out) {
    pdl_entry();
    u32 mb = 0u, any_number = 0u;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float v = bf16_to_f32(x[i]);
        mb = max(mb, amax_bits(v));
        any_number |= !isnan(v);
    }
    mb = __reduce_max_sync(0xffffffffu, mb);
    any_number = __reduce_or_sync(0xffffffffu, any_number);
    if ((threadIdx.x & 31) == 0) {
        atomicMax(&out[0], mb);
        atomicOr(&out[1], any_number);
    }
}

extern "C" __global__ void amax_f32(const float* x, u64 n, u32* out) {
    pdl_entry();
    u32 mb = 0u, any_number = 0u;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        mb = max(mb, amax_bits(x[i]));
        any_number |= !isnan(x[i]);
    }
    mb = __reduce_max_sync(0xffffffffu, mb);
    any_number = __reduce_or_sync(0xffffffffu, any_number);
    if ((threadIdx.x & 31) == 0) {
        atomicMax(&out[0], mb);
        atomicOr(&out[1], any_number);
    }
}

// x * y with x86-64's NaN results (what the CPU reference computes): a NaN operand comes back
// quieted (the first one if both are), an invalid product (0 * inf) is the negative default NaN.
__device__ __forceinline__ float x86_mul(float x, float y) {
    if (isnan(x)) return __uint_as_float(__float_as_uint(x) | 0x400000u);
    if (isnan(y)) return __uint_as_float(__float_as_uint(y) | 0x400000u);
    float r = __fmul_rn(x, y);
    return isnan(r) ? __uint_as_float(0xffc00000u) : r;
}

// DeepSeek-style block FP8 at load, bit for bit `quant::fp8_block::dequantize`:
// out[i, j] = e4m3(q[i, j]) * scale_inv[i / bn, j / bk], scale_inv `[ceil(rows/bn), ceil(cols/bk)]`.
extern "C" __global__ void fp8_block_dequantize(const u8* q, const float* scale_inv, u64 rows, u64 cols, u64 bn,
                                                u64 bk, float* out) {
    pdl_entry();
    u64 n = rows * cols, scale_cols = (cols + bk - 1) / bk;
    for (u64 idx = blockIdx.x * (u64)blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x) {
        u64 i = idx / cols, j = idx - i * cols;
        out[idx] = x86_mul(e4m3_decode(q[idx]), scale_inv[(i / bn) * scale_cols + j / bk]);
    }
}

// ---- Operand preparation for the Blackwell block-scaled GEMMs (cuBLASLt, sm_100) ----

// Block scales [rows, cols] (row-major, one byte each) into cuBLASLt's 1D block-scaling layout:
// 128 x 4 tiles of 512 bytes, tiles row-block major; inside a tile, scale (r, c) sits at
// (r % 32) * 16 + (r / 32) * 4 + c. Padding (rows to 128, cols to 4) is zero.
extern "C" __global__ void swizzle_block_scales(const u8* src, int rows, int cols, u8* dst) {
    pdl_entry();
    int padded_rows = (rows + 127) / 128 * 128, padded_cols = (cols + 3) / 4 * 4;
    u64 total = (u64)padded_rows * padded_cols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        int r = (int)(i / padded_cols), c = (int)(i % padded_cols);
        u64 tile = (u64)(r / 128) * (padded_cols / 4) + c / 4;
        int in_tile = (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4;
        dst[tile * 512 + in_tile] = (r < rows && c < cols) ? src[(u64)r * cols + c] : (u8)0;
    }
}

// dst[r] = src[row_index[r]] for rows of `width` bytes (quantized activations permuted into
// their experts' row groups, data and scales alike).
extern "C" __global__ void gather_rows_u8(const u8* src, const int* row_index, int rows, int width, u8* dst) {
    pdl_entry();
    u64 total = (u64)rows * width;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / width, c = i % width;
        dst[i] = src[(u64)row_index[r] * width + c];
    }
}

// The NVFP4 second-level scales after a block-scaled GEMM, in the contract's order:
// out[r, n] = (out[r, n] * s_tok[row_index(r)]) * S_dec[e * groups + n / (N / groups)].
extern "C" __global__ void nvfp4_epilogue(float* out, const float* row_scale, const int* row_index,
                                          const float* w_sdec, int e, int groups, int rows, int N) {
    pdl_entry();
    u64 total = (u64)rows * N;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        int r = (int)(i / N), n = (int)(i % N);
        int src = row_index ? row_index[r] : r;
        out[i] = __fmul_rn(__fmul_rn(out[i], row_scale[src]), w_sdec[e * groups + n / (N / groups)]);
    }
}
