// Does Hopper's wgmma accumulate BF16 products with the same bits as the mma.sync K chain?
// One block (a warpgroup) per trial: X [64][K], W [64][K] as BF16 bits, C0 [64][64] f32;
// out [8][64][64]: each variant's sum C0[r][n] + sum_k X[r][k] W[n][k] in k16 steps, in order.
//   0 mma.sync m16n8k16, A = X, B = W (the engine's K chain)
//   1 wgmma, A = X from registers, B = W from shared memory
//   2 wgmma, A = X and B = W from shared memory
//   3 wgmma, A = W from registers, B = X from shared memory (the transposed product)
//   4 mma.sync m16n8k16, A = W, B = X (transposed)
//   5-7 mma.sync as 0 with each k16 step's 16 k values in other slots (the same permutation
//     for A and B, so the same products): reversed within each half of 8 slots (5), the halves
//     swapped (6), and slot s taking k (5s + 3) mod 16 (7). Equal bits to 0 mean a step adds
//     its products whatever slots they occupy (8 or 16 at a time).
#define PROBE_VARIANTS 8  // host: VARIANTS
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ void mma_bf16(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// m64n64k16, BF16 x BF16 -> F32, d += a * b (scale-d = 1). A from registers (the m16n8k16
// fragment layout, warp w of the warpgroup holding rows 16w..16w + 15) or shared memory.
__device__ __forceinline__ void wgmma_rs_n64(float* d, const u32* a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

__device__ __forceinline__ void wgmma_ss_n64(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

// The k (from the step's first) that slot s of a k16 step holds in variant v.
__device__ __forceinline__ int slot_k(int v, int s) {
    return v == 5 ? (s & 8) | (7 - (s & 7)) : v == 6 ? s ^ 8 : v == 7 ? (5 * s + 3) & 15 : s;
}

// Slots s and s + 1 of the step at k0 of row `row` as a BF16x2 word.
__device__ __forceinline__ u32 pair(const u16* m, int K, int row, int k0, int s, int v) {
    return (u32)m[row * K + k0 + slot_k(v, s)] | ((u32)m[row * K + k0 + slot_k(v, s + 1)] << 16);
}

// The m16n8k16 A fragment of rows r0.. at k0: (g, 2t), (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8).
__device__ __forceinline__ void a_frag(const u16* m, int K, int r0, int k0, int g, int t, u32* a, int v = 0) {
    a[0] = pair(m, K, r0 + g, k0, 2 * t, v);
    a[1] = pair(m, K, r0 + g + 8, k0, 2 * t, v);
    a[2] = pair(m, K, r0 + g, k0, 2 * t + 8, v);
    a[3] = pair(m, K, r0 + g + 8, k0, 2 * t + 8, v);
}

// The B fragment of column n: (k 2t, 2t + 1), (2t + 8, 2t + 9).
__device__ __forceinline__ void b_frag(const u16* m, int K, int n, int k0, int t, u32* b, int v = 0) {
    b[0] = pair(m, K, n, k0, 2 * t, v);
    b[1] = pair(m, K, n, k0, 2 * t + 8, v);
}

// 64 rows x 16 k of m into shared memory, K-major. lbo > 0: no swizzle, 8x8 core matrices of
// 16-byte rows, (row block rb, k block kb) at rb * sbo + kb * lbo. lbo == 0: the 64-byte
// swizzle (the mma.sync tiled kernel's `a_piece` order): rows of 64 bytes (32 k), 16-byte
// chunk c of row r at chunk c ^ (r / 2) % 4; the k16 step fills chunks 2h, 2h + 1 of its row,
// h = (k0 / 16) % 2, so odd steps also try a descriptor that starts 32 bytes into the rows.
__device__ __forceinline__ void to_smem(const u16* m, int K, int k0, u16* s, int lbo, int sbo) {
    int h = (k0 / 16) & 1;
    for (int i = threadIdx.x; i < 64 * 16; i += blockDim.x) {
        int r = i / 16, k = i % 16;
        int at = lbo > 0 ? ((r / 8) * sbo + (k / 8) * lbo) / 2 + (r % 8) * 8 + k % 8
                         : r * 32 + (((2 * h + k / 8) ^ ((r >> 1) & 3)) * 8) + k % 8;
        s[at] = m[r * K + k0 + k];
    }
}

__device__ __forceinline__ u64 desc(const void* s, int lbo, int sbo, int k0) {
    u64 addr = (u64)__cvta_generic_to_shared(s);
    if (lbo == 0)  // 64-byte swizzle (mode 2): 8-row groups sbo bytes apart, LBO unused
        return (((addr + 32 * ((k0 / 16) & 1)) & 0x3FFFF) >> 4) | (1ull << 16) | ((u64)(sbo >> 4) << 32) |
               (2ull << 62);
    return ((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

__device__ __forceinline__ void wg_sync_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(128) probe(const u16* X, const u16* W, const float* C0, int K, int lbo,
                                                        int sbo, float* out) {
    // Room for the largest layout the host tries (64 rows of 64 bytes).
    __shared__ __align__(1024) u16 xs[64 * 32];
    __shared__ __align__(1024) u16 ws[64 * 32];
    const u16* x = X + (u64)blockIdx.x * 64 * K;
    const u16* w = W + (u64)blockIdx.x * 64 * K;
    const float* c0 = C0 + (u64)blockIdx.x * 64 * 64;
    float* o = out + (u64)blockIdx.x * PROBE_VARIANTS * 64 * 64;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3, r0 = warp * 16;
    for (int v = 0; v < PROBE_VARIANTS; v++) {
        // d[4j + i]: rows r0 + g (+ 8 for i >= 2), columns 8j + 2t (+ 1 for odd i), of D
        // (D[r][n] for variants 0-2 and 5-7, D[n][r] for 3-4).
        float d[32];
        bool tr = v == 3 || v == 4;
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 4; i++) {
                int a = r0 + g + 8 * (i >> 1), b = 8 * j + 2 * t + (i & 1);
                d[4 * j + i] = tr ? c0[b * 64 + a] : c0[a * 64 + b];
            }
        for (int k0 = 0; k0 < K; k0 += 16) {
            if (v == 0 || v >= 4) {
                const u16* am = v == 4 ? w : x;
                const u16* bm = v == 4 ? x : w;
                u32 a[4];
                a_frag(am, K, r0, k0, g, t, a, v);
                for (int j = 0; j < 8; j++) {
                    u32 b[2];
                    b_frag(bm, K, 8 * j + g, k0, t, b, v);
                    mma_bf16(&d[4 * j], a, b);
                }
            } else {
                __syncthreads();
                to_smem(x, K, k0, xs, lbo, sbo);
                to_smem(w, K, k0, ws, lbo, sbo);
                u32 a[4];
                a_frag(v == 3 ? w : x, K, r0, k0, g, t, a);
                wg_sync_smem();
                if (v == 1) wgmma_rs_n64(d, a, desc(ws, lbo, sbo, k0));
                if (v == 2) wgmma_ss_n64(d, desc(xs, lbo, sbo, k0), desc(ws, lbo, sbo, k0));
                if (v == 3) wgmma_rs_n64(d, a, desc(xs, lbo, sbo, k0));
                wg_wait();
            }
        }
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 4; i++) {
                int a = r0 + g + 8 * (i >> 1), b = 8 * j + 2 * t + (i & 1);
                if (tr) o[v * 4096 + b * 64 + a] = d[4 * j + i];
                else o[v * 4096 + a * 64 + b] = d[4 * j + i];
            }
    }
}
