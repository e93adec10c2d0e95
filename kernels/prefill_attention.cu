// Attention on BF16 tensor cores (flash-attention style) for prefill and decode rows alike:
// each warp takes 16 query rows, walks their sequence's keys in tiles of 64 through its block
// table with an online softmax, and never materializes the score matrix. The prefill kernel's
// rows are up to 64 consecutive positions of one sequence and one head (a chunk, possibly on
// top of cached prefix blocks); the decode kernel's are the query heads of one row that share
// a KV head. Both run the same per-row arithmetic (fa_attend), so a row's output has the same
// bits whichever kernel, tile or batch it is computed in (docs/determinism.md).
//
// Precision: the CPU reference computes q.k and p.v in f32 over the BF16 cache. Here q and the
// probabilities p are rounded to BF16 (to nearest even) and multiplied with FP32 accumulation,
// as FlashAttention does: ~1e-3 from the CPU's (splitting each into hi + lo BF16 terms, two
// MMAs, stayed within ~1e-5 and made 2 x 2,048 prefill rows 4% slower end to end; H200,
// 2026-12-04). K and V are BF16 already (exact): both kernels read them from the cache, where
// the step's new keys were stored first (qk_norm_rope_store).
//
// Keys are summed in chunks of FA_CHUNK (fixed boundaries, a multiple of the 64-key tiles): each
// chunk's online softmax starts afresh, and the chunks' states are merged in chunk order
// (fa_merge). A decode row may so have its chunks computed by different blocks (split-KV, for
// the batches too small to fill the GPU) and merged by attention_merge, with the bits of a
// block that walks them all, as prefill does.
//
// On Hopper, prefill of head_dim 128 runs the same arithmetic on warpgroup MMAs
// (fa_attend_wgmma), with the same bits.
//
// Needs head_dim 32, 64 or 128 and a power-of-two block size (the host checks; other shapes use
// paged_attention for every row).

#define FA_ROWS 64
#define FA_KEYS 64
#define FA_MAX_HD 128
#define FA_LD (FA_MAX_HD + 8)  // padded rows: fragment loads spread over the banks
#define DECODE_WARPS 4         // host: ops::prefill_attention::DECODE_THREADS / 32
// Keys per chunk of the merge order (host: ATTENTION_CHUNK_KEYS, which sizes the split-KV
// scratch: a kernel variant may define a larger multiple of FA_KEYS, leaving that room unused).
#ifndef FA_CHUNK
#define FA_CHUNK 128
#endif
// 1: prefill attention of head_dim 128 on wgmma where the GPU has it (Hopper: fa_attend_wgmma);
// 0: on mma.sync, as decode (a kernel variant to compare them).
#ifndef FA_WGMMA
#define FA_WGMMA 1
#endif
// A warp's running total of DW output column tiles (fa_attend): 16 rows x 8 DW columns.
#define FA_TOT_FLOATS(DW) ((DW) * 4 * 32)

__device__ __forceinline__ u32 fa_pack(float lo, float hi) { return pack_bf16x2_rn(lo, hi); }

__device__ __forceinline__ void fa_mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The query rows one lane serves (rows g and g + 8 of its warp's m16 tile): pointers to their
// q and out rows (one head each), their positions, and whether each is a row at all. With a
// split, part_lo/part_hi are where the rows' chunk states go ([chunk][HD + 2]: the unnormalized
// output, then m and l); null otherwise.
struct FaRows {
    const float* q_lo;
    const float* q_hi;
    float* out_lo;
    float* out_hi;
    float* part_lo;
    float* part_hi;
    int p_lo, p_hi;
    bool live_lo, live_hi;
};

// 2^x for the softmax and the chunk merges (x <= 0, or -inf), on the special function unit
// (`ex2.approx.ftz`, relative error about 2^-22; results under 2^-126 are 0). Scores are in
// log2 units (q is scaled by log2(e) / sqrt(head_dim) before it is rounded to BF16), so
// 2^(s - m) is the softmax's e^(s' - m') with no multiply a probability. Its error is far below
// that of rounding p to BF16 (2^-9); the accurate `expf` took eight instructions, ex2 of a
// product two (the wgmma walk issued 34 a thread a tile), ex2 alone one. Every attention kernel
// calls it, so prefill and decode rows keep equal bits.
__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The weights a (of the running total, max M) and b (of the next chunk, max m) of a merge: the
// merged max is max(M, m), and L' = L a + l b, O' = O a + o b, products and sums rounded one by
// one (never fused), the same in fa_attend and attention_merge. A chunk with no key at or before
// the row (m = -inf, l = 0, o = 0) leaves the total exactly as it was (a = 1, b = 0).
__device__ __forceinline__ void fa_merge_weights(float M, float m, float& a, float& b) {
    float mx = fmaxf(M, m), ref = mx == -INFINITY ? 0.0f : mx;
    a = fa_exp2(__fsub_rn(M, ref));
    b = fa_exp2(__fsub_rn(m, ref));
}
__device__ __forceinline__ float fa_merge(float total, float a, float part, float b) {
    return __fadd_rn(__fmul_rn(total, a), __fmul_rn(part, b));
}

// The warp's query rows as A fragments of the k16 steps of q.k (row-major 16 x HD: rows g and
// g + 8, columns 2t (+ 1) and 2t + 8 (+ 9) of each step), pre-scaled and rounded to BF16;
// rows that are not rows are zeros.
template <int HD, bool HI>
__device__ __forceinline__ void fa_q_fragments(const FaRows& r, float scale_log2, int t, u32 (&qa)[HD / 16][4]) {
#pragma unroll
    for (int s = 0; s < HD / 16; s++) {
        int c0 = s * 16 + 2 * t, c1 = c0 + 8;
        auto ql = [&](int c) { return r.live_lo ? __fmul_rn(r.q_lo[c], scale_log2) : 0.0f; };
        auto qh = [&](int c) { return HI && r.live_hi ? __fmul_rn(r.q_hi[c], scale_log2) : 0.0f; };
        qa[s][0] = fa_pack(ql(c0), ql(c0 + 1));
        qa[s][1] = fa_pack(qh(c0), qh(c0 + 1));
        qa[s][2] = fa_pack(ql(c1), ql(c1 + 1));
        qa[s][3] = fa_pack(qh(c1), qh(c1 + 1));
    }
}

// A warp's output column tiles (C fragments) set to zero: a chunk's sum before its first tile.
// Written as 64-bit moves in pairs: from plain `= 0.0f` ptxas 13.5 zeroed the wgmma walk's 64
// accumulators through uniform registers, 130 instructions a chunk (100 this way).
template <int DW>
__device__ __forceinline__ void fa_clear(float (&o)[DW][4]) {
#pragma unroll
    for (int d = 0; d < DW; d++)
#pragma unroll
        for (int i = 0; i < 4; i += 2)
            asm("{\n.reg .b64 z;\nmov.b64 z, 0;\nmov.b64 {%0, %1}, z;\n}\n" : "=f"(o[d][i]), "=f"(o[d][i + 1]));
}

// The output so far scaled by its rows' factors c, before a tile's P V (without HI the rows
// g + 8 are not rows).
template <bool HI, int DW>
__device__ __forceinline__ void fa_scale(float (&o)[DW][4], float c_lo, float c_hi) {
#pragma unroll
    for (int d = 0; d < DW; d++) {
        o[d][0] = __fmul_rn(o[d][0], c_lo);
        o[d][1] = __fmul_rn(o[d][1], c_lo);
        if constexpr (HI) {
            o[d][2] = __fmul_rn(o[d][2], c_hi);
            o[d][3] = __fmul_rn(o[d][3], c_hi);
        }
    }
}

// The causal mask and the online softmax of one 64-key tile's scores s (C fragments: key
// k0 + 8j + 2t + (i & 1), row g for i < 2, g + 8 for i >= 2), in place: s becomes the tile's
// probabilities against the rows' new maxima m, l their running sums, and c the factor the
// rows' output so far is scaled by. The quad (t = 0..3) shares each row.
template <bool HI>
__device__ __forceinline__ void fa_softmax(float (&s)[8][4], const FaRows& r, int k0, int t, float& m_lo, float& m_hi,
                                           float& l_lo, float& l_hi, float& c_lo, float& c_hi) {
    // Only a tile with a key past one of the lane's rows (the diagonal, or a row that is not a
    // row) has anything to mask: the tiles below the diagonal skip the compares.
    bool mask_lo = !r.live_lo || k0 + FA_KEYS - 1 > r.p_lo;
    bool mask_hi = HI && (!r.live_hi || k0 + FA_KEYS - 1 > r.p_hi);
    if (mask_lo || mask_hi) {
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                int key = k0 + j * 8 + 2 * t + i;
                if (!r.live_lo || key > r.p_lo) s[j][i] = -INFINITY;
                if constexpr (HI)
                    if (!r.live_hi || key > r.p_hi) s[j][2 + i] = -INFINITY;
            }
    }
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx_lo = fmaxf(mx_lo, s[j][i]);
            if constexpr (HI) mx_hi = fmaxf(mx_hi, s[j][2 + i]);
        }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, off));
        if constexpr (HI) mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, off));
    }
    float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
    // A fully masked row so far keeps m = -inf: use 0 as the reference to avoid inf - inf.
    float ref_lo = mn_lo == -INFINITY ? 0.0f : mn_lo, ref_hi = mn_hi == -INFINITY ? 0.0f : mn_hi;
    c_lo = fa_exp2(__fsub_rn(m_lo, ref_lo));
    c_hi = fa_exp2(__fsub_rn(m_hi, ref_hi));
    float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            s[j][i] = fa_exp2(__fsub_rn(s[j][i], ref_lo));
            sum_lo = __fadd_rn(sum_lo, s[j][i]);
            if constexpr (HI) {
                s[j][2 + i] = fa_exp2(__fsub_rn(s[j][2 + i], ref_hi));
                sum_hi = __fadd_rn(sum_hi, s[j][2 + i]);
            }
        }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        sum_lo = __fadd_rn(sum_lo, __shfl_xor_sync(0xffffffffu, sum_lo, off));
        if constexpr (HI) sum_hi = __fadd_rn(sum_hi, __shfl_xor_sync(0xffffffffu, sum_hi, off));
    }
    l_lo = __fmaf_rn(l_lo, c_lo, sum_lo);
    l_hi = __fmaf_rn(l_hi, c_hi, sum_hi);
    m_lo = mn_lo;
    m_hi = mn_hi;
}

// fa_softmax of the tile at k0 in the wgmma walks, whose chunk may end with the tile before: its
// maxima and sums then move to cm and cl (merged once that tile's P V is done) and the running
// ones start over, so this tile's softmax begins the next chunk.
__device__ __forceinline__ void fa_softmax_after(float (&s)[8][4], const FaRows& r, int k0, int t, bool chunk_end,
                                                 float& m_lo, float& m_hi, float& l_lo, float& l_hi, float& c_lo,
                                                 float& c_hi, float& cm_lo, float& cm_hi, float& cl_lo, float& cl_hi) {
    cm_lo = m_lo, cm_hi = m_hi, cl_lo = l_lo, cl_hi = l_hi;
    if (chunk_end) {
        m_lo = m_hi = -INFINITY;
        l_lo = l_hi = 0.0f;
    }
    fa_softmax<true>(s, r, k0, t, m_lo, m_hi, l_lo, l_hi, c_lo, c_hi);
}

// The probabilities of key tiles (2kk, 2kk + 1) as the A fragment of P V's k16 step kk, rounded
// to BF16 (the C fragments of two n8 tiles are one k16 A fragment); without HI the rows g + 8
// are zeros.
template <bool HI>
__device__ __forceinline__ void fa_p_fragments(const float (&s)[8][4], int kk, u32 (&p)[4]) {
    p[0] = fa_pack(s[2 * kk][0], s[2 * kk][1]);
    p[2] = fa_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    if constexpr (HI) {
        p[1] = fa_pack(s[2 * kk][2], s[2 * kk][3]);
        p[3] = fa_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    } else {
        p[1] = p[3] = 0u;
    }
}

// A chunk's state (max m, sum l) merged into the running total's (M, L): the weights of the
// total (a) and of the chunk (b) in the merge of their outputs, and the merged total's
// normalizer 1 / L. The first chunk is the total.
struct FaChunkWeights {
    float a_lo, b_lo, a_hi, b_hi, inv_lo, inv_hi;
};
__device__ __forceinline__ FaChunkWeights fa_chunk_weights(float m_lo, float m_hi, float l_lo, float l_hi, float& M_lo,
                                                           float& M_hi, float& L_lo, float& L_hi, bool first_chunk) {
    FaChunkWeights w{0.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f};
    if (first_chunk) {
        M_lo = m_lo;
        M_hi = m_hi;
        L_lo = l_lo;
        L_hi = l_hi;
    } else {
        fa_merge_weights(M_lo, m_lo, w.a_lo, w.b_lo);
        fa_merge_weights(M_hi, m_hi, w.a_hi, w.b_hi);
        L_lo = fa_merge(L_lo, w.a_lo, l_lo, w.b_lo);
        L_hi = fa_merge(L_hi, w.a_hi, l_hi, w.b_hi);
        M_lo = fmaxf(M_lo, m_lo);
        M_hi = fmaxf(M_hi, m_hi);
    }
    w.inv_lo = L_lo > 0.0f ? __fdiv_rn(1.0f, L_lo) : 0.0f;
    w.inv_hi = L_hi > 0.0f ? __fdiv_rn(1.0f, L_hi) : 0.0f;
    return w;
}

// One output element of a live row at a chunk's end: the running total merged with the chunk's
// part, kept in `total` while more chunks follow, else normalized into `out`. MODE, where the
// caller knows it: 0 the first chunk (the part is the total), 1 a later chunk whose a is 1
// (total * a is total), 2 any later chunk; -1: first_chunk says.
template <int MODE = -1>
__device__ __forceinline__ void fa_merge_element(float& total, float& out, float part, float a, float b, float inv,
                                                 bool first_chunk, bool more) {
    float v = MODE == 0   ? part
              : MODE == 1 ? __fadd_rn(total, __fmul_rn(part, b))
              : MODE == 2 ? fa_merge(total, a, part, b)
                          : (first_chunk ? part : fa_merge(total, a, part, b));
    if (more) total = v;
    else out = __fmul_rn(v, inv);
}

// A new chunk's state after a chunk's end: no max, no sum, no output.
template <int DW>
__device__ __forceinline__ void fa_next_chunk(float (&o)[DW][4], float& m_lo, float& m_hi, float& l_lo, float& l_hi,
                                              bool& first_chunk) {
    first_chunk = false;
    m_lo = m_hi = -INFINITY;
    l_lo = l_hi = 0.0f;
    fa_clear(o);
}

// The end of a chunk of FA_CHUNK keys (or of the last keys): with a split its state (o, m, l)
// is stored for attention_merge, else it is merged into the running total (M, L and the output
// rows or `tot`), or after the last chunk the normalized rows are written. The chunk's state
// is then reset.
template <int HD, int DW, bool HI, bool TOT_SHARED>
__device__ __forceinline__ void fa_end_chunk(float (&o)[DW][4], const FaRows& r, int k0, bool more, int d0, int t,
                                             int lane, int max_chunks, float* tot, float& m_lo, float& m_hi,
                                             float& l_lo, float& l_hi, float& M_lo, float& M_hi, float& L_lo,
                                             float& L_hi, bool& first_chunk) {
    // C fragment: (g, 2t), (g, 2t + 1) of row lo, (g + 8, ...) of row hi.
    int c = k0 / FA_CHUNK;
    if (r.part_lo) {
        if (c < max_chunks) {
            float* pl = r.part_lo + (u64)c * (HD + 2);
            float* ph = r.part_hi + (u64)c * (HD + 2);
#pragma unroll
            for (int d = 0; d < DW; d++) {
                int col = (d0 + d) * 8 + 2 * t;
                if (r.live_lo) {
                    pl[col] = o[d][0];
                    pl[col + 1] = o[d][1];
                }
                if (HI && r.live_hi) {
                    ph[col] = o[d][2];
                    ph[col + 1] = o[d][3];
                }
            }
            if (d0 == 0 && t == 0) {
                if (r.live_lo) {
                    pl[HD] = m_lo;
                    pl[HD + 1] = l_lo;
                }
                if (HI && r.live_hi) {
                    ph[HD] = m_hi;
                    ph[HD + 1] = l_hi;
                }
            }
        }
    } else if constexpr (TOT_SHARED) {
        FaChunkWeights w = fa_chunk_weights(m_lo, m_hi, l_lo, l_hi, M_lo, M_hi, L_lo, L_hi, first_chunk);
#pragma unroll
        for (int d = 0; d < DW; d++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                int col = (d0 + d) * 8 + 2 * t + j;
                if (r.live_lo)
                    fa_merge_element(tot[(4 * d + j) * 32 + lane], r.out_lo[col], o[d][j], w.a_lo, w.b_lo, w.inv_lo,
                                     first_chunk, more);
                if constexpr (HI)
                    if (r.live_hi)
                        fa_merge_element(tot[(4 * d + 2 + j) * 32 + lane], r.out_hi[col], o[d][2 + j], w.a_hi,
                                         w.b_hi, w.inv_hi, first_chunk, more);
            }
    } else {
        // The running total is the output rows themselves: every element of it is read before
        // the first store (which could alias it), so a chunk's end waits on memory once, not
        // once an element.
        FaChunkWeights w = fa_chunk_weights(m_lo, m_hi, l_lo, l_hi, M_lo, M_hi, L_lo, L_hi, first_chunk);
        float cur[DW][4];
#pragma unroll
        for (int d = 0; d < DW; d++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                int col = (d0 + d) * 8 + 2 * t + j;
                cur[d][j] = r.live_lo && !first_chunk ? r.out_lo[col] : 0.0f;
                cur[d][2 + j] = HI && r.live_hi && !first_chunk ? r.out_hi[col] : 0.0f;
            }
#pragma unroll
        for (int d = 0; d < DW; d++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                int col = (d0 + d) * 8 + 2 * t + j;
                float v;
                if (r.live_lo) {
                    fa_merge_element(cur[d][j], v, o[d][j], w.a_lo, w.b_lo, w.inv_lo, first_chunk, more);
                    r.out_lo[col] = more ? cur[d][j] : v;
                }
                if constexpr (HI)
                    if (r.live_hi) {
                        fa_merge_element(cur[d][2 + j], v, o[d][2 + j], w.a_hi, w.b_hi, w.inv_hi, first_chunk, more);
                        r.out_hi[col] = more ? cur[d][2 + j] : v;
                    }
            }
    }
    fa_next_chunk(o, m_lo, m_hi, l_lo, l_hi, first_chunk);
}

// fa_end_chunk_regs' merge of a chunk into the running total, in one of fa_merge_element's
// modes. (A template, not a generic lambda: the NVRTC of CUDA 13.0 takes a generic lambda in
// device code for a host function and refuses it.)
template <int MODE, int DW>
__device__ __forceinline__ void fa_merge_regs(float (&o)[DW][4], float (&tot)[DW][4], const FaRows& r,
                                              const FaChunkWeights& w, int t, bool first_chunk, bool more) {
#pragma unroll
    for (int d = 0; d < DW; d++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int col = d * 8 + 2 * t + j;
            if (r.live_lo)
                fa_merge_element<MODE>(tot[d][j], r.out_lo[col], o[d][j], w.a_lo, w.b_lo, w.inv_lo, first_chunk, more);
            if (r.live_hi)
                fa_merge_element<MODE>(tot[d][2 + j], r.out_hi[col], o[d][2 + j], w.a_hi, w.b_hi, w.inv_hi,
                                       first_chunk, more);
        }
}

// fa_end_chunk for the wgmma walk, which never splits: the running total in registers (`tot`,
// in o's layout). Two blocks an SM leave a thread 255 registers, and the total in shared memory
// cost a load and a store an element at each chunk's end. o is cleared for the next chunk here,
// so its first tile skips the scale by c (0 or a finite factor: it would leave zeros zero).
// (Clearing it at that tile instead held o's old values across the loop and spilled.)
template <int DW>
__device__ __forceinline__ void fa_end_chunk_regs(float (&o)[DW][4], float (&tot)[DW][4], const FaRows& r, bool more,
                                                  int t, float& m_lo, float& m_hi, float& l_lo, float& l_hi,
                                                  float& M_lo, float& M_hi, float& L_lo, float& L_hi,
                                                  bool& first_chunk) {
    FaChunkWeights w = fa_chunk_weights(m_lo, m_hi, l_lo, l_hi, M_lo, M_hi, L_lo, L_hi, first_chunk);
    // Where the total's weight a is exactly 1 in every live row of the warp (no row's running
    // max grew in this chunk: most chunks of a long row once its max is found), the products
    // total * a, which would be the totals themselves, are left out: the same bits, 64
    // multiplies fewer a chunk. The three cases are separate paths (as selects, ptxas kept
    // both operands of every element live).
    bool unit_a = __all_sync(0xffffffffu, (!r.live_lo || w.a_lo == 1.0f) && (!r.live_hi || w.a_hi == 1.0f));
    if (first_chunk) fa_merge_regs<0>(o, tot, r, w, t, first_chunk, more);
    else if (unit_a) fa_merge_regs<1>(o, tot, r, w, t, first_chunk, more);
    else fa_merge_regs<2>(o, tot, r, w, t, first_chunk, more);
    fa_next_chunk(o, m_lo, m_hi, l_lo, l_hi, first_chunk);
}

// Block-table lookups a 64-key tile at a time, shared by the tile's K and V copies: the first
// 64 threads of a block look up a key each and store its cache row (-1 past last_pos: copied
// as zeros) into the tile's list in shared memory. A thread that copies the keys key0, key0 +
// KEY_STEP, ... finds their rows side by side (key k at (k % KEY_STEP) * (FA_KEYS / KEY_STEP) +
// k / KEY_STEP) and reads them in one or two loads. The table entry is loaded well before it is
// stored, so its latency hides. Per key a copy had cost a thread a dependent table load and
// about 30 instructions of 64-bit address arithmetic (prefill on wgmma, H200, 2026-12-04: 2 x
// 2,048 rows 432 -> 367 us).
#define FA_ROWS_BYTES (FA_KEYS * 4)  // one tile's list of cache rows
template <int KEY_STEP>
struct FaRowList {
    static constexpr int PER_THREAD = FA_KEYS / KEY_STEP;
    const int* table;
    int last_pos, block_shift, block_mask;
    __device__ FaRowList(const int* table_, int last_pos_, int block_size)
        : table(table_), last_pos(last_pos_), block_shift(__ffs(block_size) - 1), block_mask(block_size - 1) {}
    // This thread's table entry of the tile at k0 (threads 0..63; -1 past last_pos).
    __device__ __forceinline__ int entry(int k0) const {
        int kpos = k0 + (int)threadIdx.x;
        return threadIdx.x < FA_KEYS && kpos <= last_pos ? table[kpos >> block_shift] : -1;
    }
    // Its key's cache row, stored into the tile's list (at shared address `list`).
    __device__ __forceinline__ void store(u32 list, int k0, int block) const {
        int key = threadIdx.x;
        if (key >= FA_KEYS) return;
        int row = block < 0 ? -1 : (block << block_shift) + ((k0 + key) & block_mask);
        asm volatile("st.shared.s32 [%0], %1;\n" ::"r"(list + 4 * ((key % KEY_STEP) * PER_THREAD + key / KEY_STEP)),
                     "r"(row)
                     : "memory");
    }
    // Copies the 16-byte pieces at `src` of the rows of keys key0 + KEY_STEP i of the tile
    // whose list is at `list` (rows row_bytes apart) to shared addresses dst + i dst_step, as
    // one cp.async group. ALL_LIVE: the caller knows every key of the tile is at or before
    // last_pos (no row of the list is -1), so no copy tests its row (a key's copy is then an
    // address and the copy: 2 instructions where the test took 6 more).
    template <bool ALL_LIVE = false>
    __device__ __forceinline__ void copy(u32 list, int key0, u32 dst, u32 dst_step, const u8* src,
                                         u32 row_bytes) const {
        static_assert(PER_THREAD == 2 || PER_THREAD % 4 == 0, "whole loads");
        int rows[PER_THREAD];
        u32 at = list + key0 * PER_THREAD * 4;
        if constexpr (PER_THREAD == 2) {
            asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(rows[0]), "=r"(rows[1]) : "r"(at));
        } else {
#pragma unroll
            for (int i = 0; i < PER_THREAD; i += 4)
                asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                             : "=r"(rows[i]), "=r"(rows[i + 1]), "=r"(rows[i + 2]), "=r"(rows[i + 3])
                             : "r"(at + 4 * i));
        }
#pragma unroll
        for (int i = 0; i < PER_THREAD; i++) {
            bool live = ALL_LIVE || rows[i] >= 0;
            cp_async16_at(dst + dst_step * i, src + (u64)(u32)(live ? rows[i] : 0) * row_bytes, live);
        }
        cp_async_commit();
    }
};

// Attention of one warp's 16 query rows over the keys 0..=last_pos of one sequence and KV head,
// in tiles of 64 keys copied in by the block's THREADS threads (every warp of the block shares
// the sequence, the KV head and last_pos). The copies run ahead of the arithmetic: a tile's V
// arrives while its scores are computed, and the next tile's K while its V is summed. The warp
// writes DW of the head's HD / 8 output column tiles, starting at tile d0 (warps that share
// rows split the columns, and the scores' key tiles, passing the scores through shared memory).
//
// The warp walks the chunks chunk0, chunk0 + chunk_step, ... up to last_pos. Without a split
// (part null; then chunk0 = 0, chunk_step = 1) it merges them in order, keeping the running
// total's max and sum in registers and its unnormalized output (no registers to spare for it)
// in the output rows themselves, or with TOT_SHARED in shared memory (`tot`, this warp's
// FA_TOT_FLOATS(DW) floats: a lane's (d, i) element at tot[(4 d + i) * 32 + lane]), and writes
// the normalized rows after the last. Prefill merges a chunk per 128 keys and takes shared
// memory: from the output rows each merge waited a global load latency per element (H200,
// 2026-12-04: a quarter of prefill attention's stall samples). Decode rows merge a few chunks
// each (split-KV takes the long ones), and their kernels needed more registers with the shared
// total. With a split, it stores each chunk's state (at most max_chunks) for attention_merge.
//
// Each row's result depends only on its own q, its position and the keys: which other rows
// share the warp, which columns it writes, which block computes which chunk, and last_pos beyond
// the row's own position, change nothing (a tile, or a chunk, of keys all past a row's position
// leaves its state exactly as it was), so prefill chunks and decode rows give the same bits
// (docs/determinism.md).
//
// HI false: the warp's rows g + 8 are never rows (a decode block of at most 8 query heads), so
// their arithmetic is left out; the rows g compute what they compute with it (an MMA's rows are
// independent, and the absent rows' q and p terms are the zeros they would be).
template <int HD, int THREADS, int DW, bool HI = true, bool TOT_SHARED = false>
__device__ void fa_attend(const FaRows r, int last_pos, const bf16_t* k_cache, const bf16_t* v_cache,
                          const int* table, int kvh, int kv_heads, int block_size, float scale_log2, int d0, int chunk0,
                          int chunk_step, int max_chunks, float* tot) {
    constexpr int KSTEPS = HD / 16;  // k16 steps of q.k
    constexpr int WARPS = THREADS / 32;
    // Decode: every warp of the block holds the same rows (and writes DW of their columns).
    constexpr bool SHARED_ROWS = DW < HD / 8;
    static_assert(!SHARED_ROWS || 8 % WARPS == 0, "the key tiles split evenly over the warps");
    __shared__ __align__(16) bf16_t ks[FA_KEYS][FA_LD];
    __shared__ __align__(16) bf16_t vs[FA_KEYS][FA_LD];
    // The scores of the 8 key tiles as C fragments, [tile][lane] (shared rows only).
    __shared__ __align__(16) float shared_s[SHARED_ROWS ? 8 * 32 * 4 : 1];
    int tid = threadIdx.x, lane = tid & 31, t = lane & 3, warp = tid >> 5;
    // One 64-key tile of K or V into shared memory (one cp.async group); keys past last_pos
    // are zero. A thread copies the 16-byte piece `part` of keys key0, key0 + KEY_STEP, ..., at
    // the cache rows of the tile's list (FaRowList; the block size is a power of two, the host
    // checks).
    constexpr int CHUNKS = HD / 8, KEY_STEP = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && FA_KEYS % KEY_STEP == 0 && THREADS >= FA_KEYS, "whole keys a pass");
    // The lists of the tile being summed and of the next (by the parity of the tile's number).
    __shared__ __align__(16) int lists[2][FA_KEYS];
    FaRowList<KEY_STEP> row_list(table, last_pos, block_size);
    const u32 lists_at = (u32)__cvta_generic_to_shared(&lists[0][0]);
    const int key0 = tid / CHUNKS, part = (tid % CHUNKS) * 8;
    const u32 row_bytes = kv_heads * HD * 2, head_at = (kvh * HD + part) * 2;
    // The tile at k0 (its list at `list`): a tile of keys all at or before last_pos (all but a
    // row's last) copies without testing its rows.
    auto copy_tile = [&](bf16_t (*dst)[FA_LD], const bf16_t* cache, u32 list, int k0) {
        u32 to = (u32)__cvta_generic_to_shared(&dst[key0][part]);
        const u8* src = reinterpret_cast<const u8*>(cache) + head_at;
        if (k0 + FA_KEYS - 1 <= last_pos) row_list.template copy<true>(list, key0, to, KEY_STEP * FA_LD * 2, src, row_bytes);
        else row_list.copy(list, key0, to, KEY_STEP * FA_LD * 2, src, row_bytes);
    };

    // Q fragments (A operand, row-major 16 x HD), rounded to BF16, pre-scaled.
    u32 qa[KSTEPS][4];
    fa_q_fragments<HD, HI>(r, scale_log2, t, qa);

    float o[DW][4];
    fa_clear(o);
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;

    // The running total over the chunks done (no split).
    float M_lo = -INFINITY, M_hi = -INFINITY, L_lo = 0.0f, L_hi = 0.0f;
    bool first_chunk = true;
    int k_first = chunk0 * FA_CHUNK;
    row_list.store(lists_at, k_first, row_list.entry(k_first));
    __syncthreads();  // the first tile's list
    copy_tile(ks, k_cache, lists_at, k_first);
    copy_tile(vs, v_cache, lists_at, k_first);
    u32 list_next = lists_at + FA_ROWS_BYTES;  // the next tile's list (then this one's, in turn)
    for (int k0 = k_first; k0 <= last_pos;) {
        // The next tile: the next 64 keys, or past the chunks of other blocks.
        int k_next = k0 + FA_KEYS;
        bool chunk_end = k_next % FA_CHUNK == 0;
        if (chunk_end) k_next += (chunk_step - 1) * FA_CHUNK;
        bool more = k_next <= last_pos;
        int entry = row_list.entry(k_next);  // stored after the scores
        cp_async_wait<1>();  // this tile's K is in (its V may still be coming)
        __syncthreads();

        // S = q k^T for this warp's 16 rows x 64 keys: 8 n8 tiles. One ldmatrix gives the B
        // fragments of two k16 steps: lane (g, t) gets key j * 8 + g, columns st * 16 + 2t
        // (+ 1) and the same + 8.
        auto score = [&](float* acc, int j) {
#pragma unroll
            for (int i = 0; i < 4; i++) acc[i] = 0.0f;
#pragma unroll
            for (int st = 0; st < KSTEPS; st += 2) {
                u32 b[4];
                ldmatrix_x4(&ks[j * 8 + (lane & 7)][(st + (lane >> 4)) * 16 + (lane & 8)], b);
                fa_mma(acc, qa[st], b[0], b[1]);
                fa_mma(acc, qa[st + 1], b[2], b[3]);
            }
        };
        float s[8][4];
        if constexpr (SHARED_ROWS) {
            // The warps hold the same rows: each computes 8 / WARPS of the key tiles (the same
            // MMAs, so the same bits as computing them all) and takes the rest from the others.
#pragma unroll
            for (int jj = 0; jj < 8 / WARPS; jj++) {
                int j = warp * (8 / WARPS) + jj;
                float acc[4];
                score(acc, j);
                if constexpr (HI)
                    reinterpret_cast<float4*>(shared_s)[j * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                else
                    reinterpret_cast<float2*>(shared_s)[j * 32 + lane] = make_float2(acc[0], acc[1]);
            }
            __syncthreads();
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if constexpr (HI) {
                    float4 v = reinterpret_cast<const float4*>(shared_s)[j * 32 + lane];
                    s[j][0] = v.x;
                    s[j][1] = v.y;
                    s[j][2] = v.z;
                    s[j][3] = v.w;
                } else {
                    float2 v = reinterpret_cast<const float2*>(shared_s)[j * 32 + lane];
                    s[j][0] = v.x;
                    s[j][1] = v.y;
                    s[j][2] = s[j][3] = -INFINITY;
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) score(s[j], j);
        }
        float c_lo, c_hi;
        fa_softmax<HI>(s, r, k0, t, m_lo, m_hi, l_lo, l_hi, c_lo, c_hi);
        // The next tile's list, where the tile before this one's was (its copies are issued).
        row_list.store(list_next, k_next, entry);
        __syncthreads();  // every warp is done with ks: the next tile's K comes in under P V
        if (more) copy_tile(ks, k_cache, list_next, k_next);
        else cp_async_commit();  // an empty group keeps the count
        cp_async_wait<1>();      // this tile's V is in
        __syncthreads();
        // A chunk's first tile adds to fa_next_chunk's zeros (unscaled: zeros stay zeros).
        if (k0 % FA_CHUNK != 0) fa_scale<HI>(o, c_lo, c_hi);
        // O += P V: the S accumulators of key tiles (2kk, 2kk + 1) are the A fragment of the
        // k16 step kk; V's B fragment pairs keys (2t, 2t + 1) and (2t + 8, 2t + 9) at column g.
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            u32 p[4];
            fa_p_fragments<HI>(s, kk, p);
            // acc += p v. Without rows g + 8 their accumulators start from zero each time and
            // are dropped (they stay zero), so they take no registers across tiles.
            auto pv = [&](float* acc, u32 b0, u32 b1) {
                if constexpr (HI) {
                    fa_mma(acc, p, b0, b1);
                } else {
                    float c[4] = {acc[0], acc[1], 0.0f, 0.0f};
                    fa_mma(c, p, b0, b1);
                    acc[0] = c[0];
                    acc[1] = c[1];
                }
            };
            // Transposed ldmatrix: lane (g, t) gets keys kk * 16 + 2t (+ 1) and + 8 (+ 9) of
            // column g of an 8-column tile; two tiles a load (one where DW is odd).
            int v_key = kk * 16 + (lane & 15);
            if constexpr (DW % 2 == 0) {
#pragma unroll
                for (int d = 0; d < DW; d += 2) {
                    u32 b[4];
                    ldmatrix_x4_trans(&vs[v_key][(d0 + d + (lane >> 4)) * 8], b);
                    pv(o[d], b[0], b[1]);
                    pv(o[d + 1], b[2], b[3]);
                }
            } else {
#pragma unroll
                for (int d = 0; d < DW; d++) {
                    u32 b[2];
                    ldmatrix_x2_trans(&vs[v_key][(d0 + d) * 8], b);
                    pv(o[d], b[0], b[1]);
                }
            }
        }
        __syncthreads();  // every warp is done with vs
        if (more) copy_tile(vs, v_cache, list_next, k_next);
        else cp_async_commit();
        list_next = list_next == lists_at ? lists_at + FA_ROWS_BYTES : lists_at;

        if (chunk_end || !more)
            fa_end_chunk<HD, DW, HI, TOT_SHARED>(o, r, k0, more, d0, t, lane, max_chunks, tot, m_lo, m_hi, l_lo, l_hi,
                                                 M_lo, M_hi, L_lo, L_hi, first_chunk);
        k0 = k_next;
    }
    cp_async_wait<0>();
}

// ---- Prefill attention on warpgroup MMAs (Hopper, sm_90a; head_dim 128) ----
//
// fa_attend's arithmetic for a block of one warpgroup (the 4 warps of a 64-row prefill tile),
// with each tile's q.k and P V issued as wgmma: S = q k^T as 8 m64n64k16 steps (the k16 steps
// of q, as fa_attend's score), O += P V as 4 m64n128k16 steps (16 keys each). wgmma's k16 steps give mma.sync's bits (examples/cuda_wgmma_probe.rs), and a
// warp's 16 rows of a wgmma accumulator are laid out as its mma.sync C fragments (S: 8 key
// tiles, O: 16 column tiles), so the softmax, the merges and every bit are fa_attend's: a
// prefill row keeps the bits of the decode rows (cuda_attention and cuda_generate test them).
//
// q, K and V tiles lie in shared memory as 4 groups of 32 columns (64
// bytes a row) in the 64-byte swizzle: q and K are the K-major A and B operands of S (k16 step
// s in group s / 2, 32 (s % 2) bytes into the rows), V the N-major B operand of P V (keys
// 16kk.. of every group, the groups 4,096 bytes apart).
//
// H200, 2026-12-04, 2 x 2,048 prefill rows of Qwen3-30B-A3B: 657 us on mma.sync, 586 us on
// wgmma one step after the other, 470 us with the next tile's scores under this tile's P V
// (ncu: tensor pipe 32% busy, issue slots 48%, 202 registers, two blocks an SM), 367 us with
// the exponentials on ex2, the totals in registers, K two tiles ahead and the block table
// looked up once a tile (ncu: 124 M instructions where there were 213 M; 255 registers, 52
// bytes spilled; bound by the latency of each warp's chains, eight warps an SM).
#define FA_WG_GROUP_BYTES (FA_KEYS * 64)
#define FA_WG_TILE_BYTES (4 * FA_WG_GROUP_BYTES)
// V's descriptor: groups of 32 columns FA_WG_GROUP_BYTES apart (the leading dimension).
#ifndef FA_WG_V_DESC
#define FA_WG_V_DESC(addr) wgmma_desc_sw64_mn(addr, FA_WG_GROUP_BYTES)
#endif

// Copies of 64-key tiles of K or V into their swizzled groups (one cp.async group a tile),
// through the tiles' lists of cache rows (FaRowList, looked up four tiles ahead): thread tid
// of the block's THREADS (128, or 256 for two warpgroups sharing the tiles) copies the 16-byte
// piece tid % 16 of keys tid / 16 + KEY_STEP i, whose group and swizzled place are the same for
// every i (the swizzle repeats every 8 keys, 512 bytes).
template <int THREADS>
struct FaTileCopy {
    static constexpr int KEY_STEP = THREADS / 16;
    FaRowList<KEY_STEP> lookups;
    u32 row_bytes, dst0;
    int key0;
    // This thread's 16-byte piece of cache row 0 in K and V (worked out once: a copy is then
    // one wide multiply-add from the row, not a 64-bit sum of three terms).
    const u8* k_src;
    const u8* v_src;
    __device__ FaTileCopy(const int* table, int last_pos, const bf16_t* k_cache, const bf16_t* v_cache, int kvh,
                          int kv_heads, int hd, int block_size)
        : lookups(table, last_pos, block_size) {
        int tid = threadIdx.x, part = tid % 16;
        key0 = tid / 16;
        row_bytes = kv_heads * hd * 2;
        u32 head_at = (kvh * hd + part * 8) * 2;
        k_src = reinterpret_cast<const u8*>(k_cache) + head_at;
        v_src = reinterpret_cast<const u8*>(v_cache) + head_at;
        dst0 = (part / 4) * FA_WG_GROUP_BYTES + key0 * 64 + 16 * a_piece(key0, part % 4);
    }
    // The 64-key tile at k0 (list `list`) of K or V (`src`: k_src or v_src) into dst.
    __device__ __forceinline__ void issue(u32 dst, const u8* src, u32 list, int k0) const {
        if (k0 + FA_KEYS - 1 <= lookups.last_pos)
            lookups.template copy<true>(list, key0, dst + dst0, KEY_STEP * 64, src, row_bytes);
        else
            lookups.copy(list, key0, dst + dst0, KEY_STEP * 64, src, row_bytes);
    }
};

// This thread's copies but the last `pending` groups are in and seen by the tensor cores'
// reads (async proxy), then the block's are.
template <int PENDING>
__device__ __forceinline__ void fa_tiles_in() {
    cp_async_wait<PENDING>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
}

// d (m64n64, f32) += a (m64k16) * b (k16n64), both BF16 in shared memory, K-major.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

// A descriptor of the shared-memory operand `bytes` further on: its address field (bits 0-13,
// the address over 16) plus bytes / 16, which cannot carry into the next field while the address
// stays within shared memory's 256 KB. One add where a descriptor built from the address took
// four uniform instructions (the walk built 20 a tile).
__device__ __forceinline__ u64 wgmma_desc_at(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

// O += P V for one tile, issued (not waited): the k16 steps of 16 keys in order.
__device__ __forceinline__ void fa_wg_pv(float (&o)[16][4], const u32 (&p)[4][4], u32 vs) {
    u64 v_desc = FA_WG_V_DESC(vs);
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wgmma_m64n128k16_rs<1>(&o[0][0], p[kk], wgmma_desc_at(v_desc, kk * 16 * 64));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// The pieces of a warpgroup's walk that fa_attend_wgmma and fa_attend_tma share.
//
// This lane's q fragment words (fa_q_fragments) stored at their places in the warpgroup's q tile
// `qs`, in the swizzled groups: word i of step st is row g + 8 (i & 1), columns 16 st + 2t +
// 8 (i >> 1) (+ 1).
template <int HD>
__device__ __forceinline__ void fa_wg_store_q(const FaRows& r, float scale_log2, int warp, int g, int t, u32 qs) {
    constexpr int KSTEPS = HD / 16;
    u32 qa[KSTEPS][4];
    fa_q_fragments<HD, true>(r, scale_log2, t, qa);
#pragma unroll
    for (int st = 0; st < KSTEPS; st++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int row = warp * 16 + g + 8 * (i & 1), col = st * 16 + 2 * t + 8 * (i >> 1);
            u32 at = qs + (col / 32) * FA_WG_GROUP_BYTES + row * 64 + 16 * a_piece(row, (col % 32) / 8) + (col % 8) * 2;
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(at), "r"(qa[st][i]) : "memory");
        }
}

// S = q k^T of one tile (q and K in shared memory, their descriptors) into s, issued (not
// waited).
template <int HD>
__device__ __forceinline__ void fa_wg_scores(float (&s)[8][4], u64 q_desc, u64 k_desc) {
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) s[j][i] = 0.0f;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int st = 0; st < HD / 16; st++) {
        u32 step = (st / 2) * FA_WG_GROUP_BYTES + 32 * (st % 2);
        wgmma_m64n64k16_ss(&s[0][0], wgmma_desc_at(q_desc, step), wgmma_desc_at(k_desc, step));
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void fa_wg_hold_scores(float (&s)[8][4]) {
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) wgmma_hold(s[j][i]);
}

// The tile at k0's probabilities as P V's A fragments, after its scale of the chunk's sum o by c
// (a chunk's first tile adds to the zeros fa_end_chunk_regs left: unscaled, zeros stay zeros).
template <int DW>
__device__ __forceinline__ void fa_wg_probabilities(float (&o)[DW][4], const float (&s)[8][4], u32 (&p)[4][4], int k0,
                                                    float c_lo, float c_hi) {
    static_assert(FA_CHUNK % FA_KEYS == 0, "chunks of whole tiles");
    if (k0 % FA_CHUNK != 0) fa_scale<true>(o, c_lo, c_hi);
#pragma unroll
    for (int kk = 0; kk < 4; kk++) fa_p_fragments<true>(s, kk, p[kk]);
}

// Every product issued is done: o and the P fragments are free.
template <int DW>
__device__ __forceinline__ void fa_wg_pv_done(float (&o)[DW][4], u32 (&p)[4][4]) {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int d = 0; d < DW; d++)
#pragma unroll
        for (int i = 0; i < 4; i++) wgmma_hold(o[d][i]);
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) wgmma_hold(p[kk][i]);
}

// The walk over the keys overlaps a tile's softmax with the tile before's P V (as
// FlashAttention-3 does): the next tile's scores are issued before this tile's P V and waited
// for alone, so the softmax runs on the CUDA cores while the tensor cores sum. q lies in shared
// memory (the A operand of S, leaving registers for the next tile's scores), and K and V have
// two buffers each: a tile's K is copied two tiles ahead, as soon as the scores of the tile
// before it in its buffer are done, and the next tile's V while this one's is summed (with one
// K buffer the copy of the next tile's K had only a softmax's time to arrive). Every value is computed
// by the same operations in the same order as fa_attend: the next tile's softmax starts from
// a fresh chunk's state where the tile before ended a chunk, and the chunk is merged (from
// its saved max and sum) once the tile's P V is done; the output's scale by the next tile's
// factor comes after the P V it follows, as in fa_attend. `tiles`: q, K0, K1, V0, V1
// (FA_WG_TILE_BYTES each; tile n's K and V in buffer n % 2), then four tiles' lists of cache
// rows (FaTileCopy; tile n's in list n % 4).
//
// WGS 2: the block is two warpgroups, each with its own rows (`r`: the same positions of two
// query heads of one KV head) and q tile, sharing the K and V tiles and their copies: `tiles`
// then holds q of warpgroup 0, q of warpgroup 1, K0, K1, V0, V1 and the lists. Both walk the
// same keys, so they meet at every barrier; each row's arithmetic is the one-warpgroup walk's.
template <int HD, int WGS = 1>
__device__ void fa_attend_wgmma(const FaRows r, int last_pos, const bf16_t* k_cache, const bf16_t* v_cache,
                                const int* table, int kvh, int kv_heads, int block_size, float scale_log2, u8* tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(HD == 128, "4 groups of 32 columns");
    constexpr int DW = HD / 8;
    static_assert(WGS == 1 || WGS == 2, "one or two warpgroups");
    int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    u32 base = (u32)__cvta_generic_to_shared(tiles);
    // The warpgroup's q tile: its number through a shuffle from lane 0, which the compiler
    // knows to be the same in every lane, so the q descriptors stay in uniform registers (from
    // threadIdx.x itself they were worked out per lane and moved over, 56 instructions a tile).
    int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    u32 qs = base + wg * FA_WG_TILE_BYTES, ks0 = base + WGS * FA_WG_TILE_BYTES;
    u32 vs0 = ks0 + 2 * FA_WG_TILE_BYTES, lists = vs0 + 2 * FA_WG_TILE_BYTES;
    auto list = [&](int k0) { return lists + (k0 / FA_KEYS) % 4 * FA_ROWS_BYTES; };
    FaTileCopy<128 * WGS> copy(table, last_pos, k_cache, v_cache, kvh, kv_heads, HD, block_size);
    fa_wg_store_q<HD>(r, scale_log2, warp, g, t, qs);
    // S = q k^T of the tile whose K is in ks into s, issued (not waited).
    const u64 q_desc = wgmma_desc_sw64(qs);
    auto scores = [&](float (&s)[8][4], u32 ks) { fa_wg_scores<HD>(s, q_desc, wgmma_desc_sw64(ks)); };

    // This chunk's output (zero at its first tile: fa_end_chunk_regs clears it), and the total
    // of the chunks before.
    float o[DW][4], tot[DW][4];
    fa_clear(o);
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
    float M_lo = -INFINITY, M_hi = -INFINITY, L_lo = 0.0f, L_hi = 0.0f;
    bool first_chunk = true;
    // The first tile's scores and softmax; K of the two tiles after it comes in.
#pragma unroll
    for (int k = 0; k < 4 * FA_KEYS; k += FA_KEYS) copy.lookups.store(list(k), k, copy.lookups.entry(k));
    __syncthreads();  // the first four tiles' lists
    copy.issue(ks0, copy.k_src, list(0), 0);
    copy.issue(vs0, copy.v_src, list(0), 0);
    if (FA_KEYS <= last_pos) copy.issue(ks0 + FA_WG_TILE_BYTES, copy.k_src, list(FA_KEYS), FA_KEYS);
    else cp_async_commit();
    fa_tiles_in<1>();  // K and V of the first tile (and every warp's q)
    float s[8][4], c_lo, c_hi;
    scores(s, ks0);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    fa_wg_hold_scores(s);
    fa_softmax<true>(s, r, 0, t, m_lo, m_hi, l_lo, l_hi, c_lo, c_hi);
    __syncthreads();  // every warp's scores are done with the first K buffer
    if (2 * FA_KEYS <= last_pos) copy.issue(ks0, copy.k_src, list(2 * FA_KEYS), 2 * FA_KEYS);
    else cp_async_commit();
    // The tiles with a tile after them: the next tile's scores are issued before this tile's
    // P V, and its softmax runs while the P V does.
    int k0 = 0, buf = 0;  // buf: this tile's K and V buffer
    u32 p[4][4];
    auto probabilities = [&]() { fa_wg_probabilities(o, s, p, k0, c_lo, c_hi); };
    auto pv_done = [&]() { fa_wg_pv_done(o, p); };
    for (; k0 + FA_KEYS <= last_pos; k0 += FA_KEYS, buf ^= 1) {
        // Here: s holds this tile's probabilities, c its factor; the next two tiles' K are
        // coming (the next one's issued two tiles back).
        int k_next = k0 + FA_KEYS;
        bool chunk_end = k_next % FA_CHUNK == 0;
        u32 ks_next = ks0 + (buf ^ 1) * FA_WG_TILE_BYTES;
        int entry = copy.lookups.entry(k0 + 4 * FA_KEYS);  // stored in the list this tile is done with
        // The next tile's V into the other buffer (its last P V is done in every warp).
        copy.issue(vs0 + (buf ^ 1) * FA_WG_TILE_BYTES, copy.v_src, list(k_next), k_next);
        fa_tiles_in<2>();  // the next tile's K and this tile's V (not the K after, nor that V)
        probabilities();
        scores(s, ks_next);  // the next tile's, then this tile's P V: the scores are done first
        fa_wg_pv(o, p, vs0 + buf * FA_WG_TILE_BYTES);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        fa_wg_hold_scores(s);
        copy.lookups.store(list(k0), k0 + 4 * FA_KEYS, entry);
        __syncthreads();  // every warp's scores are done with ks_next: the K two tiles on comes in
        if (k_next + 2 * FA_KEYS <= last_pos) copy.issue(ks_next, copy.k_src, list(k_next + 2 * FA_KEYS), k_next + 2 * FA_KEYS);
        else cp_async_commit();
        float cm_lo, cm_hi, cl_lo, cl_hi;  // this chunk's max and sum
        fa_softmax_after(s, r, k_next, t, chunk_end, m_lo, m_hi, l_lo, l_hi, c_lo, c_hi, cm_lo, cm_hi, cl_lo, cl_hi);
        pv_done();
        if (chunk_end)
            fa_end_chunk_regs(o, tot, r, true, t, cm_lo, cm_hi, cl_lo, cl_hi, M_lo, M_hi, L_lo, L_hi, first_chunk);
        __syncthreads();  // every warp's P V is done with this V buffer
    }
    // The last tile.
    fa_tiles_in<0>();
    probabilities();
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    fa_wg_pv(o, p, vs0 + buf * FA_WG_TILE_BYTES);
    pv_done();
    fa_end_chunk_regs(o, tot, r, false, t, m_lo, m_hi, l_lo, l_hi, M_lo, M_hi, L_lo, L_hi, first_chunk);
    cp_async_wait<0>();
#endif
}

// A prefill tile's rows of head h for the lane (g) of warp `warp`: rows 16 warp + g and + 8
// of the tile's `count` rows from step row `first` (position pos0).
template <int HD>
__device__ __forceinline__ FaRows fa_tile_rows(const float* q, float* out, int first, int count, int pos0, int h,
                                              int heads, int warp, int g) {
    int r_lo = warp * 16 + g, r_hi = r_lo + 8;
    FaRows r;
    r.live_lo = r_lo < count;
    r.live_hi = r_hi < count;
    r.p_lo = pos0 + r_lo;
    r.p_hi = pos0 + r_hi;
    u64 at_lo = ((u64)(first + (r.live_lo ? r_lo : 0)) * heads + h) * HD;
    u64 at_hi = ((u64)(first + (r.live_hi ? r_hi : 0)) * heads + h) * HD;
    r.q_lo = q + at_lo;
    r.q_hi = q + at_hi;
    r.out_lo = out + at_lo;
    r.out_hi = out + at_hi;
    r.part_lo = r.part_hi = nullptr;
    return r;
}

// Prefill: `tiles[2i]` = first row of tile i, `tiles[2i + 1]` = its row count (<= 64); the rows
// are consecutive positions of one sequence. Grid (tiles, heads), 128 threads: warp w owns
// query rows 16w..16w+15 of the tile. WGS 2 (Hopper's wgmma walk at head_dim 128, query heads
// a KV head even): grid (tiles, heads / 2), 256 threads, warpgroup i taking head 2y + i, the
// two sharing their K and V tiles (fa_attend_wgmma). Blocks start in launch order (x fastest), and block
// (x, y) takes the tiles from the last back, each over every head in turn: a sequence's later
// tiles, which walk more keys, start first, and the last wave holds short tiles (2 x 2,048
// rows: 736 -> 651 us, H200, 2026-12-04).
template <int HD, int WGS = 1>
__device__ void prefill_attention(const float* q, float* out, const bf16_t* k_cache, const bf16_t* v_cache,
                                  const int* row_pos, const int* row_seq, const int* table_offsets,
                                  const int* block_tables, const int* tiles, int heads, int kv_heads,
                                  int block_size, float scale_log2) {
    int at = blockIdx.y * gridDim.x + blockIdx.x;
    int tile = gridDim.x - 1 - at / gridDim.y;
    int first = tiles[2 * tile], count = tiles[2 * tile + 1];
    int h = at % gridDim.y * WGS + (int)(threadIdx.x >> 7), kvh = h / (heads / kv_heads);
    int warp = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2;
    int pos0 = row_pos[first];
    FaRows r = fa_tile_rows<HD>(q, out, first, count, pos0, h, heads, warp, g);
    // Dynamic shared memory (kernels::prefill_attention_smem_bytes): the warps' running totals
    // (4 x FA_TOT_FLOATS(HD / 8) floats: with the K and V tiles, more than 48 KB of static
    // memory), or on Hopper at head_dim 128 the wgmma walk's tiles, 512-byte aligned for the
    // swizzle (its totals are in registers).
    extern __shared__ __align__(16) float fa_dynamic[];
    const int* table = block_tables + table_offsets[row_seq[first]];
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (HD == 128 && FA_WGMMA) {
        u8* base = reinterpret_cast<u8*>(fa_dynamic);
        u8* tiles = base + ((512 - ((u32)__cvta_generic_to_shared(base) & 511)) & 511);
        fa_attend_wgmma<HD, WGS>(r, pos0 + count - 1, k_cache, v_cache, table, kvh, kv_heads, block_size, scale_log2,
                                 tiles);
        return;
    }
#endif
    if constexpr (WGS > 1) {
        __trap();  // the host launches two warpgroups only where the wgmma walk runs
        return;
    }
    float* tot = fa_dynamic + warp * FA_TOT_FLOATS(HD / 8);
    fa_attend<HD, 128, HD / 8, true, true>(r, pos0 + count - 1, k_cache, v_cache, table, kvh, kv_heads, block_size,
                                           scale_log2, 0, 0, 1, 0, tot);
}

// Decode: one query row per sequence. Grid (rows, kv_heads * passes, splits), 4 warps: the 16
// tile rows are the query heads sharing one KV head (GQA; a group of more than 16 heads takes
// `passes` blocks), so each K/V row is read once per KV head; the 4 warps copy the tiles
// together, each computes the scores of a quarter of a tile's keys (shared through shared
// memory) and writes a quarter of the output columns. `rows` maps block x to the step's
// row (null: identity). With `part` (split-KV), block z takes the chunks z, z + splits, ... and
// stores their states at part[((x * heads + head) * max_chunks + chunk) * (HD + 2)] for
// attention_merge; without, splits is 1 and the block writes the output.
template <int HD, bool HI>
__device__ void decode_attention(const float* q, float* out, const bf16_t* k_cache, const bf16_t* v_cache,
                                 const int* row_pos, const int* row_seq, const int* table_offsets,
                                 const int* block_tables, const int* rows, int heads, int kv_heads, int block_size,
                                 float scale_log2, float* part, int max_chunks) {
    int row = rows ? rows[blockIdx.x] : (int)blockIdx.x;
    int group = heads / kv_heads, passes = (group + 15) / 16;
    int kvh = blockIdx.y / passes, pass = blockIdx.y % passes;
    int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
    int j_lo = pass * 16 + g, j_hi = j_lo + 8;
    int pos = row_pos[row];
    if ((int)blockIdx.z * FA_CHUNK > pos) return;  // no chunk of this row for this block
    FaRows r;
    r.live_lo = j_lo < group;
    r.live_hi = j_hi < group;
    r.p_lo = pos;
    r.p_hi = pos;
    u64 at_lo = ((u64)row * heads + kvh * group + (r.live_lo ? j_lo : 0)) * HD;
    u64 at_hi = ((u64)row * heads + kvh * group + (r.live_hi ? j_hi : 0)) * HD;
    r.q_lo = q + at_lo;
    r.q_hi = q + at_hi;
    r.out_lo = out + at_lo;
    r.out_hi = out + at_hi;
    r.part_lo = r.part_hi = nullptr;
    if (part) {
        u64 head_lo = kvh * group + (r.live_lo ? j_lo : 0), head_hi = kvh * group + (r.live_hi ? j_hi : 0);
        r.part_lo = part + ((u64)blockIdx.x * heads + head_lo) * max_chunks * (HD + 2);
        r.part_hi = part + ((u64)blockIdx.x * heads + head_hi) * max_chunks * (HD + 2);
    }
    constexpr int DW = HD / 8 / DECODE_WARPS;
    fa_attend<HD, 32 * DECODE_WARPS, DW, HI>(r, pos, k_cache, v_cache, block_tables + table_offsets[row_seq[row]], kvh,
                                         kv_heads, block_size, scale_log2, warp * DW, blockIdx.z, gridDim.z, max_chunks,
                                         nullptr);
}

// Split-KV's second step: grid (rows, heads), HD threads. The chunk states decode_attention
// stored for each (row, head) merged in chunk order, as fa_attend merges them, then normalized.
template <int HD>
__device__ void attention_merge(const float* part, float* out, const int* row_pos, const int* rows, int heads,
                                int max_chunks) {
    int i = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    int row = rows ? rows[i] : i;
    int chunks = min(row_pos[row] / FA_CHUNK + 1, max_chunks);
    const float* p = part + ((u64)i * heads + h) * max_chunks * (HD + 2);
    float M = p[HD], L = p[HD + 1], O = p[d];
    for (int c = 1; c < chunks; c++) {
        const float* pc = p + (u64)c * (HD + 2);
        float m = pc[HD], a, b;
        fa_merge_weights(M, m, a, b);
        L = fa_merge(L, a, pc[HD + 1], b);
        O = fa_merge(O, a, pc[d], b);
        M = fmaxf(M, m);
    }
    float inv = L > 0.0f ? __fdiv_rn(1.0f, L) : 0.0f;
    out[((u64)row * heads + h) * HD + d] = __fmul_rn(O, inv);
}

#define ATTENTION_KERNELS(PREFILL, DECODE, DECODE_G8, MERGE, HD)                                                      \
    extern "C" __global__ void PREFILL(                                                                               \
        const float* q, float* out, const bf16_t* k_cache, const bf16_t* v_cache, const int* row_pos,                 \
        const int* row_seq, const int* table_offsets, const int* block_tables, const int* tiles, int heads,           \
        int kv_heads, int block_size, float scale_log2, float* /* part */, int /* max_chunks */) { pdl_entry();       \
        /* one signature for both kernels: prefill never splits its keys over blocks */                               \
        prefill_attention<HD>(q, out, k_cache, v_cache, row_pos, row_seq, table_offsets, block_tables, tiles,         \
                              heads, kv_heads, block_size, scale_log2);                                               \
    }                                                                                                                 \
    extern "C" __global__ void DECODE(                                                                                \
        const float* q, float* out, const bf16_t* k_cache, const bf16_t* v_cache, const int* row_pos,                 \
        const int* row_seq, const int* table_offsets, const int* block_tables, const int* rows, int heads,            \
        int kv_heads, int block_size, float scale_log2, float* part, int max_chunks) { pdl_entry();                   \
        decode_attention<HD, true>(q, out, k_cache, v_cache, row_pos, row_seq, table_offsets, block_tables, rows,     \
                                   heads, kv_heads, block_size, scale_log2, part, max_chunks);                        \
    }                                                                                                                 \
    /* at most 8 query heads a KV head: the tile rows g + 8 are never rows */                                         \
    extern "C" __global__ void __launch_bounds__(32 * DECODE_WARPS, 4) DECODE_G8(                                     \
        const float* q, float* out, const bf16_t* k_cache, const bf16_t* v_cache, const int* row_pos,                 \
        const int* row_seq, const int* table_offsets, const int* block_tables, const int* rows, int heads,            \
        int kv_heads, int block_size, float scale_log2, float* part, int max_chunks) { pdl_entry();                   \
        decode_attention<HD, false>(q, out, k_cache, v_cache, row_pos, row_seq, table_offsets, block_tables, rows,    \
                                    heads, kv_heads, block_size, scale_log2, part, max_chunks);                       \
    }                                                                                                                 \
    extern "C" __global__ void MERGE(const float* part, float* out, const int* row_pos, const int* rows, int heads,   \
                                     int max_chunks) { pdl_entry();                                                   \
        attention_merge<HD>(part, out, row_pos, rows, heads, max_chunks);                                             \
    }

ATTENTION_KERNELS(prefill_attention_hd32, decode_attention_hd32, decode_attention_g8_hd32, attention_merge_hd32, 32)
ATTENTION_KERNELS(prefill_attention_hd64, decode_attention_hd64, decode_attention_g8_hd64, attention_merge_hd64, 64)
ATTENTION_KERNELS(prefill_attention_hd128, decode_attention_hd128, decode_attention_g8_hd128, attention_merge_hd128, 128)

// Prefill attention of head_dim 128 on Hopper with two warpgroups a block, two query heads of
// one KV head sharing their K and V tiles and copies (fa_attend_wgmma's WGS 2): half the copy
// instructions and half the bytes from L2 a query row, in the same eight warps an SM (one block
// of 256 threads: 226 registers a thread). The rows' arithmetic is the one-warpgroup kernel's,
// so their bits are. ops::prefill_attention launches it where the query heads a KV head are
// even, unless LOCKSTEP_FA_PAIRS=0. Where the wgmma walk is not built (sm_100a, or the kernel
// variant FA_WGMMA 0) it traps.
extern "C" __global__ __launch_bounds__(256, 1) void prefill_attention_pairs_hd128(
    const float* q, float* out, const bf16_t* k_cache, const bf16_t* v_cache, const int* row_pos, const int* row_seq,
    const int* table_offsets, const int* block_tables, const int* tiles, int heads, int kv_heads, int block_size,
    float scale_log2, float* /* part */, int /* max_chunks */) {
    pdl_entry();
    prefill_attention<128, 2>(q, out, k_cache, v_cache, row_pos, row_seq, table_offsets, block_tables, tiles, heads,
                              kv_heads, block_size, scale_log2);
}

// ---- Prefill attention fed by the TMA unit (Hopper, head_dim 128, two query heads a block) ----
//
// prefill_attention_tma_hd128: the two-head walk of fa_attend_wgmma (WGS 2) with its copies
// taken off the MMA warps, as FlashAttention-3 does. 384 threads: two consumer warpgroups (the
// same rows of query heads 2y and 2y + 1 of one KV head), then a producer warpgroup whose first
// warp copies each 64-key tile of K and V with the TMA unit into a ring of FA_TMA_STAGES stages
// (K and V a ring each), `full` barriers completing when a stage's bytes land and `empty` ones
// when the 8 consumer warps are done with it, in place of the block's barriers and the
// consumers' cp.async copies and list lookups. The producer hands its registers to the
// consumers (`setmaxnreg` 40 / 232). Each row's arithmetic, in its order, is the walk's, so its
// bits are too.
//
// The cache's K (or V) is a tensor map over [cache rows][kv_heads * head_dim BF16] read in boxes
// of 32 columns (64 bytes: one of a tile's 4 column groups, in the 64-byte swizzle the
// descriptors read) by min(block_size, 64) rows: a tile takes 64 / that pages a group, each a
// box at its page's cache row (the block table, looked up two tiles ahead by the producer warp's
// lanes, one page a lane). Pages wholly past the rows' last position are not copied, and the
// last tile's V rows past it (stale or never written) are zeroed before its P V: their p is 0,
// and 0 times a stale NaN would not be. Its K rows past it are masked (-inf) as in the walk.
// Needs a block size of at least 16 (the host checks: smaller pages take the cp.async walk).
#define FA_TMA_STAGES 4
#define FA_TMA_THREADS 384
// 1: the consumer warpgroups take turns issuing their products (FlashAttention-3's "pingpong":
// named barriers 4 and 5), so one's softmax runs under the other's products instead of both
// waiting on interleaved ones. A kernel variant to measure (same products, same bits).
#ifndef FA_TMA_PINGPONG
#define FA_TMA_PINGPONG 0
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The producer warp: tile i's K then its V into stage i % FA_TMA_STAGES of their rings, once
// the consumers are done with the tile FA_TMA_STAGES before it there.
__device__ __forceinline__ void fa_tma_produce(const TensorMap* k_map, const TensorMap* v_map, const int* table,
                                               int last_pos, int kvh, int block_size, u32 ks0, u32 vs0, u32 bars) {
    constexpr int S = FA_TMA_STAGES;
    const u32 full_k = bars, full_v = bars + 8 * S, empty_k = bars + 16 * S, empty_v = bars + 24 * S;
    int lane = threadIdx.x & 31, shift = __ffs(block_size) - 1;
    int box_rows = min(block_size, FA_KEYS), pages = FA_KEYS / box_rows;
    // Lane p's page of tile i: its cache row (-1 past last_pos, or past the tile's pages).
    auto lookup = [&](int i) {
        int key = i * FA_KEYS + lane * box_rows;
        return lane < pages && key <= last_pos ? (table[key >> shift] << shift) + (key & (block_size - 1)) : -1;
    };
    if (lane == 0) {
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)k_map) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)v_map) : "memory");
    }
    int row = lookup(0), row_next = lookup(1);
    const int col = kvh * FA_MAX_HD * 2;  // the KV head's first byte of a cache row
    const int tiles = last_pos / FA_KEYS + 1;
    for (int i = 0; i < tiles; i++) {
        int row_after = lookup(i + 2);  // its table load is waited for two tiles on
        int stage = i % S, use = i / S;
        int live = min(pages, (last_pos - i * FA_KEYS) / box_rows + 1);
        u32 bytes = live * 4 * box_rows * 64;
        int rows[4];
#pragma unroll
        for (int p = 0; p < 4; p++) rows[p] = __shfl_sync(0xffffffffu, row, p);
        if (lane == 0) {
#pragma unroll
            for (int kv = 0; kv < 2; kv++) {
                u32 empty = (kv ? empty_v : empty_k) + 8 * stage, full = (kv ? full_v : full_k) + 8 * stage;
                if (use > 0) mbar_wait(empty, (use - 1) & 1);
                mbar_arrive_expect_tx(full, bytes);
                u32 dst = (kv ? vs0 : ks0) + stage * FA_WG_TILE_BYTES;
                const TensorMap* map = kv ? v_map : k_map;
#pragma unroll
                for (int p = 0; p < 4; p++) {
                    if (p >= live) break;
#pragma unroll
                    for (int grp = 0; grp < 4; grp++)
                        tma_copy_2d(dst + grp * FA_WG_GROUP_BYTES + p * box_rows * 64, map, col + 64 * grp, rows[p],
                                    full);
                }
            }
        }
        __syncwarp();
        row = row_next;
        row_next = row_after;
    }
}

// A consumer warpgroup's walk: fa_attend_wgmma's, its tiles waited for on the rings' `full`
// barriers and handed back on their `empty` ones. `base`: the q tiles of the two warpgroups.
template <int HD>
__device__ void fa_attend_tma(const FaRows r, int last_pos, float scale_log2, u32 base, u32 ks0, u32 vs0, u32 bars) {
    static_assert(HD == 128, "4 groups of 32 columns");
    constexpr int DW = HD / 8, S = FA_TMA_STAGES;
    const u32 full_k = bars, full_v = bars + 8 * S, empty_k = bars + 16 * S, empty_v = bars + 24 * S;
    int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // uniform to the compiler (fa_attend_wgmma)
    u32 qs = base + wg * FA_WG_TILE_BYTES;
    fa_wg_store_q<HD>(r, scale_log2, warp, g, t, qs);
    // The warpgroup's q is in and seen by its tensor cores' reads.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
    // FA_TMA_PINGPONG: warpgroup w issues its products on its turn (barrier 4 + w, completed by
    // the other's arrival after its own issue), warpgroup 0 first; warpgroup 1 leaves out its
    // last arrival, so every barrier's arrivals match its waits.
    auto turn_begin = [&]() {
        if (FA_TMA_PINGPONG) asm volatile("bar.sync %0, 256;\n" ::"r"(4 + wg) : "memory");
    };
    auto turn_end = [&](bool last) {
        if (FA_TMA_PINGPONG && !(last && wg == 1)) asm volatile("bar.arrive %0, 256;\n" ::"r"(5 - wg) : "memory");
    };
    if (FA_TMA_PINGPONG && wg == 1) asm volatile("bar.arrive 4, 256;\n" ::: "memory");
    auto stage_of = [&](int i) { return (u32)(i % S); };
    auto wait_full = [&](u32 full, int i) {
        mbar_wait(full + 8 * stage_of(i), (i / S) & 1);
        __syncwarp();  // converged again after the polls, for the .aligned wgmma
    };
    auto release = [&](u32 empty, int i) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + 8 * stage_of(i));
    };
    const u64 q_desc = wgmma_desc_sw64(qs);
    auto scores = [&](float (&s)[8][4], int i) {
        fa_wg_scores<HD>(s, q_desc, wgmma_desc_sw64(ks0 + stage_of(i) * FA_WG_TILE_BYTES));
    };
    float o[DW][4], tot[DW][4];  // as in fa_attend_wgmma
    fa_clear(o);
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
    float M_lo = -INFINITY, M_hi = -INFINITY, L_lo = 0.0f, L_hi = 0.0f;
    bool first_chunk = true;
    float s[8][4], c_lo, c_hi;
    wait_full(full_k, 0);
    turn_begin();
    scores(s, 0);
    turn_end(false);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    fa_wg_hold_scores(s);
    release(empty_k, 0);
    fa_softmax<true>(s, r, 0, t, m_lo, m_hi, l_lo, l_hi, c_lo, c_hi);
    int k0 = 0, i = 0;  // this tile's first key and number
    u32 p[4][4];
    auto probabilities = [&]() { fa_wg_probabilities(o, s, p, k0, c_lo, c_hi); };
    auto pv_done = [&]() { fa_wg_pv_done(o, p); };
    for (; k0 + FA_KEYS <= last_pos; k0 += FA_KEYS, i++) {
        int k_next = k0 + FA_KEYS;
        bool chunk_end = k_next % FA_CHUNK == 0;
        wait_full(full_k, i + 1);  // the next tile's K
        wait_full(full_v, i);      // this tile's V
        probabilities();
        turn_begin();
        scores(s, i + 1);  // the next tile's, then this tile's P V: the scores are done first
        fa_wg_pv(o, p, vs0 + stage_of(i) * FA_WG_TILE_BYTES);
        turn_end(false);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        fa_wg_hold_scores(s);
        release(empty_k, i + 1);
        float cm_lo, cm_hi, cl_lo, cl_hi;
        fa_softmax_after(s, r, k_next, t, chunk_end, m_lo, m_hi, l_lo, l_hi, c_lo, c_hi, cm_lo, cm_hi, cl_lo, cl_hi);
        pv_done();
        release(empty_v, i);
        if (chunk_end)
            fa_end_chunk_regs(o, tot, r, true, t, cm_lo, cm_hi, cl_lo, cl_hi, M_lo, M_hi, L_lo, L_hi, first_chunk);
    }
    // The last tile: its V rows past last_pos set to zero by both warpgroups' 256 threads.
    wait_full(full_v, i);
    {
        u32 vs = vs0 + stage_of(i) * FA_WG_TILE_BYTES;
        int first_dead = last_pos - k0 + 1, c = tid & 255;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int piece = c + 256 * j, key = piece / 16, part = piece % 16;
            if (key >= first_dead)
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(vs + (part / 4) * FA_WG_GROUP_BYTES +
                                                                              key * 64 + (part % 4) * 16),
                             "r"(0u)
                             : "memory");
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
    }
    probabilities();
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    turn_begin();
    fa_wg_pv(o, p, vs0 + stage_of(i) * FA_WG_TILE_BYTES);
    turn_end(true);
    pv_done();
    fa_end_chunk_regs(o, tot, r, false, t, m_lo, m_hi, l_lo, l_hi, M_lo, M_hi, L_lo, L_hi, first_chunk);
}
#endif

// Grid (tiles, heads / 2) as prefill_attention_pairs_hd128's, FA_TMA_THREADS threads; k_map and
// v_map over the K and V caches (ops::prefill_attention's `kv_tensor_map`).
extern "C" __global__ __launch_bounds__(FA_TMA_THREADS, 1) void prefill_attention_tma_hd128(
    const __grid_constant__ TensorMap k_map, const __grid_constant__ TensorMap v_map, const float* q, float* out,
    const int* row_pos, const int* row_seq, const int* table_offsets, const int* block_tables, const int* tiles,
    int heads, int kv_heads, int block_size, float scale_log2) {
    pdl_entry();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int HD = 128, S = FA_TMA_STAGES;
    int at = blockIdx.y * gridDim.x + blockIdx.x;
    int tile = gridDim.x - 1 - at / gridDim.y;
    int first = tiles[2 * tile], count = tiles[2 * tile + 1];
    int kvh = at % gridDim.y * 2 / (heads / kv_heads);
    int pos0 = row_pos[first], last_pos = pos0 + count - 1;
    const int* table = block_tables + table_offsets[row_seq[first]];
    // Dynamic shared memory (kernels::PREFILL_ATTENTION_TMA_SMEM_BYTES), 512-byte aligned for
    // the swizzle: q of each consumer warpgroup, the K ring, the V ring, then the barriers
    // (full K, full V, empty K, empty V; FA_TMA_STAGES each).
    extern __shared__ __align__(16) float fa_tma_dynamic[];
    u32 base = (u32)__cvta_generic_to_shared(fa_tma_dynamic);
    base += (512 - (base & 511)) & 511;
    u32 ks0 = base + 2 * FA_WG_TILE_BYTES, vs0 = ks0 + S * FA_WG_TILE_BYTES, bars = vs0 + S * FA_WG_TILE_BYTES;
    if (threadIdx.x == 0) {
        for (int s = 0; s < 2 * S; s++) {
            mbar_init(bars + 8 * s, 1);                                 // full K, full V: the producer's arrival
            mbar_init(bars + 8 * (2 * S + s), FA_TMA_THREADS / 32 - 4);  // empty: the 8 consumer warps
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x >= 256) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x < 288)
            fa_tma_produce(&k_map, &v_map, table, last_pos, kvh, block_size, ks0, vs0, bars);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    int wg = threadIdx.x >> 7, h = at % gridDim.y * 2 + wg;
    int warp = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2;
    FaRows r = fa_tile_rows<HD>(q, out, first, count, pos0, h, heads, warp, g);
    fa_attend_tma<HD>(r, last_pos, scale_log2, base, ks0, vs0, bars);
#else
    __trap();  // the host launches it on sm_90a alone (ops::prefill_attention::PrefillBlocks)
#endif
}

// decode_attention_g8_hd128 at three blocks an SM: 147 registers without a spill, where four
// blocks cap it at 128 and spill 36 bytes (ptxas 13.5, sm_90a). The same code, so the same bits;
// decode_attention takes it when its grid fits in one wave of three blocks an SM (H200,
// 2026-12-03: the batch-64 step 24.38 -> 23.97 ms, the batch-256 one, 1,024 blocks, 36.3 ->
// 37.5 at three).
extern "C" __global__ __launch_bounds__(32 * DECODE_WARPS, 3) void decode_attention_g8_hd128_3(
    const float* q, float* out, const bf16_t* k_cache, const bf16_t* v_cache, const int* row_pos, const int* row_seq,
    const int* table_offsets, const int* block_tables, const int* rows, int heads, int kv_heads, int block_size,
    float scale_log2, float* part, int max_chunks) {
    pdl_entry();
    decode_attention<128, false>(q, out, k_cache, v_cache, row_pos, row_seq, table_offsets, block_tables, rows, heads,
                                 kv_heads, block_size, scale_log2, part, max_chunks);
}
