// Shared by every kernel file: prepended to each source before NVRTC compiles it, so the
// kernels need no CUDA headers at run time (BF16 is carried as raw 16-bit patterns).
//
// Arithmetic that must match the CPU reference bit for bit (the quantizers, the dummy-weight
// generator, the residual and combine sums) uses the explicit __f*_rn intrinsics: they are
// never contracted into FMAs, whatever the compiler options.

typedef unsigned short bf16_t;
typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

#define INFINITY __uint_as_float(0x7f800000u)

__device__ __forceinline__ float bf16_to_f32(bf16_t v) { return __uint_as_float(((u32)v) << 16); }

// Round to nearest even, NaN kept quiet (as the `half` crate does).
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((b >> 16) | 0x40u);
    return (bf16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// Two f32 values as BF16x2 (lo in the low half), rounded to nearest even like f32_to_bf16 by
// one hardware conversion (sm_80+) instead of nine integer operations each. Only a NaN's
// payload may differ, so it packs tensor-core operands: mma.sync makes the same result of a
// NaN operand whatever its payload.
__device__ __forceinline__ u32 pack_bf16x2_rn(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Two f32 values that are exactly FP16 (NVFP4's decoded codes times block scales) as FP16x2.
__device__ __forceinline__ u32 pack_exact_f16(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Where word j (k = 2j, 2j + 1) of a 16-word span of a packed GEMM operand row is stored (the
// tiled and wgmma kernels' activations, gemm.cu `pack_gemm_operand`; the NVFP4 quantizer's
// `words`): the span's 4x4 words transposed, so its 16-byte piece s holds words s, s + 4,
// s + 8, s + 12. An ldmatrix row of piece 2c (2c + 1) then hands lane t the word 4t + 2c
// (4t + 2c + 1): the K chain's fragment slots {2t, 2t + 1} ({2t + 8, 2t + 9}) of chunk c
// (host: ops::gemm::packed_word).
__device__ __forceinline__ int packed_word(int j) { return (j & ~15) | (j & 3) << 2 | (j & 15) >> 2; }

// The first statement of every kernel. Launched as a programmatic dependent (Gpu::launch on
// Hopper and later), a kernel's blocks may be resident before the kernel ahead of it on the
// stream has finished: this waits until that kernel has completed and its writes are visible
// (so no read or write moves), then lets the next kernel's launch begin. Launched plainly,
// both instructions return at once.
__device__ __forceinline__ void pdl_entry() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Element i of a GEMM output its launch left as split-K's segment sums (`segments` sums of
// `stride` elements each, ops::gemm `Unfolded`): the sums added in segment order (s0, then + s1,
// ...), the additions the GEMM's own fold makes, so a reader gets the bits the output would
// have held. Eight segments' loads are issued at a time, then added in order.
__device__ __forceinline__ float folded(const float* sums, int segments, u64 stride, u64 i) {
    float v = sums[i];
    for (int z0 = 1; z0 < segments; z0 += 8) {
        float seg[8];
#pragma unroll
        for (int j = 0; j < 8; j++) seg[j] = z0 + j < segments ? sums[(u64)(z0 + j) * stride + i] : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (z0 + j < segments) v = __fadd_rn(v, seg[j]);
    }
    return v;
}

// The same for E elements at once (element j at at[j], where live[j]), every element's loads of
// a round of FOLD_ROUND segments issued before any of their additions: a reader holding several
// elements waits about once a round, not once an element.
#define FOLD_ROUND 4
template <int E>
__device__ __forceinline__ void folded_many(const float* sums, int segments, u64 stride, const u64* at,
                                            const bool* live, float* v) {
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = live[j] ? sums[at[j]] : 0.0f;
    for (int z0 = 1; z0 < segments; z0 += FOLD_ROUND) {
        float seg[FOLD_ROUND][E];
#pragma unroll
        for (int q = 0; q < FOLD_ROUND; q++)
#pragma unroll
            for (int j = 0; j < E; j++)
                seg[q][j] = z0 + q < segments && live[j] ? sums[(u64)(z0 + q) * stride + at[j]] : 0.0f;
#pragma unroll
        for (int q = 0; q < FOLD_ROUND; q++)
#pragma unroll
            for (int j = 0; j < E; j++)
                if (z0 + q < segments) v[j] = __fadd_rn(v[j], seg[q][j]);
    }
}

// Four consecutive elements (i a multiple of 4, 16-byte aligned sums and stride) the same way,
// for E such quads at once (quad j at at[j]), ROUND segments a round.
template <int E, int ROUND>
__device__ __forceinline__ void folded4_many(const float* sums, int segments, u64 stride, const u64* at,
                                             const bool* live, float4* v) {
#pragma unroll
    for (int j = 0; j < E; j++) v[j] = live[j] ? *(const float4*)(sums + at[j]) : make_float4(0, 0, 0, 0);
    for (int z0 = 1; z0 < segments; z0 += ROUND) {
        float4 seg[ROUND][E];
#pragma unroll
        for (int q = 0; q < ROUND; q++)
#pragma unroll
            for (int j = 0; j < E; j++)
                seg[q][j] = z0 + q < segments && live[j] ? *(const float4*)(sums + (u64)(z0 + q) * stride + at[j])
                                                         : make_float4(0, 0, 0, 0);
#pragma unroll
        for (int q = 0; q < ROUND; q++)
#pragma unroll
            for (int j = 0; j < E; j++)
                if (z0 + q < segments) {
                    v[j].x = __fadd_rn(v[j].x, seg[q][j].x);
                    v[j].y = __fadd_rn(v[j].y, seg[q][j].y);
                    v[j].z = __fadd_rn(v[j].z, seg[q][j].z);
                    v[j].w = __fadd_rn(v[j].w, seg[q][j].w);
                }
    }
}

// SwiGLU's product for one element: silu(g) * u, as the CPU computes it (g / (1 + e^-g), then
// times u, each rounded). silu_mul and the quantizers that take gate/up rows share it.
__device__ __forceinline__ float silu_mul_value(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads (blockDim.x a multiple of 32); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// Decoders of the contract's element and scale codes (quant.cu has the encoders).
__device__ __forceinline__ float e4m3_decode(u8 c) {
    u32 e = (c >> 3) & 15u, m = c & 7u;
    if (e == 15u && m == 7u) return __uint_as_float(0x7fc00000u);
    float mag = e == 0u ? __fmul_rn((float)m, 1.0f / 512.0f) : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (c & 0x80u) ? -mag : mag;
}

// E2M1's magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} built as f32 bits: code m >= 2 is
// 2^((m >> 1) - 1) * (1 + (m & 1) / 2). (A table of them was local memory, stored again before
// every lookup.)
__device__ __forceinline__ float e2m1_decode(u8 c) {
    u32 m = c & 7u;
    u32 bits = m >= 2u ? ((m >> 1) + 126u) << 23 | (m & 1u) << 22 : m == 1u ? 0x3f000000u : 0u;
    float mag = __uint_as_float(bits);
    return (c & 8) ? -mag : mag;
}

__device__ __forceinline__ float e8m0_decode(u8 c) {
    if (c == 0xff) return __uint_as_float(0x7fc00000u);
    if (c == 0) return __uint_as_float(0x00400000u);
    return __uint_as_float(((u32)c) << 23);
}


// Asynchronous 16-byte copies global -> shared (sm_80+): `live` false writes 16 zero bytes and
// reads nothing. A group is waited for with cp_async_wait<groups still allowed in flight>.
// cp_async16_at takes the shared-memory address itself (worked out once, outside a loop).
__device__ __forceinline__ void cp_async16_at(u32 dst, const void* gmem, bool live) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(live ? 16 : 0));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool live) {
    cp_async16_at((u32)__cvta_generic_to_shared(smem), gmem, live);
}
// The same asking L2 for the whole 128-byte line: for streams that take a row 64 bytes at a
// time (a weight column's 32-k span), the row's next span then comes from L2, and the memory
// sees 128-byte reads instead of scattered 64-byte ones. H200, 2026-12-04: the tiled BF16
// expert gate/up at 256 tokens 340 -> 219 us (57% -> 89% of the weights' bandwidth).
__device__ __forceinline__ void cp_async16_line_at(u32 dst, const void* gmem, bool live) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(live ? 16 : 0));
}
// The same for 8 bytes (through L1: .cg copies only 16).
__device__ __forceinline__ void cp_async8_at(u32 dst, const void* gmem, bool live) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(gmem), "r"(live ? 8 : 0));
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, bool live) {
    cp_async8_at((u32)__cvta_generic_to_shared(smem), gmem, live);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Four 8x8 BF16 matrices from shared memory (16-byte rows), lane l addressing row l % 8 of
// matrix l / 8; register i of lane (g, t) is word t of row g of matrix i (columns 2t, 2t + 1).
// ldmatrix_x4_at takes the shared-memory address itself.
__device__ __forceinline__ void ldmatrix_x4_at(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(const void* smem, u32* r) {
    ldmatrix_x4_at((u32)__cvta_generic_to_shared(smem), r);
}

// The same, transposed: register i of lane (g, t) holds rows 2t (low half) and 2t + 1 of
// column g of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(const void* smem, u32* r) {
    u32 a = (u32)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// Two matrices, transposed (lanes 0-15 address them).
__device__ __forceinline__ void ldmatrix_x2_trans(const void* smem, u32* r) {
    u32 a = (u32)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a));
}

// ---- Hopper (sm_90a) warpgroup MMAs: the GEMM's and prefill attention's ----
//
// Their shared-memory operands are rows of 64 bytes in the 64-byte swizzle: the 16-byte piece s
// of row r at r * 64 + 16 * a_piece(r, s), from a 512-byte aligned base.

// The 16-byte piece s of tile row r in shared memory: pieces swizzled by (r / 2) % 4, so the
// 8 rows one ldmatrix matrix reads fall in distinct banks.
__device__ __forceinline__ int a_piece(int r, int s) { return s ^ ((r >> 1) & 3); }

// A K-major B operand in the 64-byte swizzle: 8-row groups 512 bytes apart (LBO unused).
__device__ __forceinline__ u64 wgmma_desc_sw64(u32 smem_addr) {
    return (u64)((smem_addr & 0x3FFFF) >> 4) | (1ull << 16) | ((u64)(512 >> 4) << 32) | (2ull << 62);
}
// A K-major B operand in the 128-byte swizzle (rows of 128 bytes from a 1024-byte aligned base,
// the k16 step's 32 bytes at the address's offset into them): 8-row groups 1024 bytes apart.
__device__ __forceinline__ u64 wgmma_desc_sw128(u32 smem_addr) {
    return (u64)((smem_addr & 0x3FFFF) >> 4) | (1ull << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}
// An N-major B operand in the 64-byte swizzle: each 32 columns' 8-row (k) groups 512 bytes apart
// (the stride dimension), the next 32 columns `group_bytes` on (the leading dimension).
__device__ __forceinline__ u64 wgmma_desc_sw64_mn(u32 smem_addr, u32 group_bytes) {
    return (u64)((smem_addr & 0x3FFFF) >> 4) | ((u64)(group_bytes >> 4) << 16) | ((u64)(512 >> 4) << 32) |
           (2ull << 62);
}

// d (m64nN, f32) += a (m64k16 from registers) * b (k16nN in shared memory; K-major, or with
// TRANS_B N-major), both BF16, or FP16 with F16.
#define WGMMA_D16 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define WGMMA_D32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WGMMA_D64 WGMMA_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// One function per shape: D the accumulator's operand numbers, A, DESC, FLAG and TRANS those of
// the A registers, the B descriptor, the scale-d flag and TRANS_B; then the accumulator's
// constraints.
#define WGMMA_RS(NAME, SHAPE, D, A, DESC, FLAG, TRANS, ...)                                               \
    template <int TRANS_B = 0, bool F16 = false>                                                          \
    __device__ __forceinline__ void NAME(float* d, const u32* a, u64 desc_b) {                            \
        if constexpr (F16) WGMMA_RS_ASM(SHAPE, "f16", D, A, DESC, FLAG, TRANS, __VA_ARGS__);              \
        else WGMMA_RS_ASM(SHAPE, "bf16", D, A, DESC, FLAG, TRANS, __VA_ARGS__);                           \
    }
#define WGMMA_RS_ASM(SHAPE, TYPE, D, A, DESC, FLAG, TRANS, ...)                                           \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FLAG ", 0;\n"                                       \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" D "}, {" A "}, " DESC   \
                 ", p, 1, 1, " TRANS ";\n}\n"                                                              \
                 : __VA_ARGS__                                                                            \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(TRANS_B))
WGMMA_RS(wgmma_m64n32k16_rs, "m64n32k16", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15", "%16, %17, %18, %19", "%20", "%21", "%22", WGMMA_D16)
WGMMA_RS(wgmma_m64n64k16_rs, "m64n64k16", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31", "%32, %33, %34, %35", "%36", "%37", "%38", WGMMA_D32)
WGMMA_RS(wgmma_m64n128k16_rs, "m64n128k16", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63", "%64, %65, %66, %67", "%68", "%69", "%70", WGMMA_D64)
#undef WGMMA_RS_ASM
#undef WGMMA_RS
#undef WGMMA_D64
#undef WGMMA_D32
#undef WGMMA_D16

// Keeps the compiler from touching v (a wgmma operand or accumulator) across this point.
__device__ __forceinline__ void wgmma_hold(float& v) { asm volatile("" : "+f"(v)::"memory"); }
__device__ __forceinline__ void wgmma_hold(u32& v) { asm volatile("" : "+r"(v)::"memory"); }

// ---- Hopper (sm_90a) shared-memory barriers and tensor-map copies (the TMA GEMM's) ----
//
// A tensor map (CUtensorMap: the host encodes it with cuTensorMapEncodeTiled) passed by value
// as a `const __grid_constant__` kernel parameter; the copies take its address.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

// Polls of a barrier wait after which the kernel faults (a launch error) instead of hanging the
// GPU: far beyond any wait for copies in flight (each poll may suspend for a while).
#define MBAR_MAX_POLLS (1u << 26)

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// One arrival that also expects `bytes` more of copies to complete on the barrier.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase of this parity has completed (its copies' bytes are then
// visible to the waiting thread).
// The fault is a store to address 0 (an illegal-address launch error), not `trap`: a trap in
// the MMA warpgroups' code kept ptxas 13.5 from giving them the registers `setmaxnreg` hands
// them (the 256-column TMA GEMM then spilled at 168 registers).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    for (u32 polls = 0; !done && polls < MBAR_MAX_POLLS; polls++)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    if (!done) *(volatile u32*)0 = bar;
}
// The box of `map` at (c0, c1) (innermost coordinate first) into shared memory at dst, its
// bytes counted on `bar`.
__device__ __forceinline__ void tma_copy_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"((u64)map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
