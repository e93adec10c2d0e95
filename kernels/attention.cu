// Paged attention over the BF16 KV cache on CUDA cores, for the shapes prefill_attention.cu has
// no kernel for (head_dim other than 32, 64, 128), prefill and decode rows alike: each query row
// attends causally to positions 0..=pos of its sequence through the sequence's block table, so
// a chunk on top of cached prefix blocks needs nothing special. GQA maps head h to KV head
// h / (heads / kv_heads). The K/V of the new tokens are stored first (qk_norm_rope_store).
//
// Grid (rows, heads), 4 warps: warp w takes keys w, w+4, ... with an online softmax; the warps
// merge at the end, in warp order. Every row's reduction order is fixed by its position alone,
// so a row has the same bits in any batch. head_dim <= 256 (8 values per lane).

#define MAX_HD_PER_LANE 8
#define WARPS 4

extern "C" __global__ void paged_attention(const float* q, float* out, const bf16_t* k_cache, const bf16_t* v_cache,
                                           const int* row_pos, const int* row_seq, const int* table_offsets,
                                           const int* block_tables, int heads, int kv_heads, int hd, int block_size,
                                           float scale) {
    pdl_entry();
    int t = blockIdx.x, h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int pos = row_pos[t];
    const int* table = block_tables + table_offsets[row_seq[t]];
    int kvh = h / (heads / kv_heads);
    u64 kv_width = (u64)kv_heads * hd;
    const float* qh = q + ((u64)t * heads + h) * hd;
    float qv[MAX_HD_PER_LANE], acc[MAX_HD_PER_LANE];
#pragma unroll
    for (int j = 0; j < MAX_HD_PER_LANE; j++) {
        int d = lane + 32 * j;
        qv[j] = d < hd ? qh[d] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int key = warp; key <= pos; key += WARPS) {
        u64 base = ((u64)table[key / block_size] * block_size + key % block_size) * kv_width + (u64)kvh * hd;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_HD_PER_LANE; j++) {
            int d = lane + 32 * j;
            if (d < hd) s += qv[j] * bf16_to_f32(k_cache[base + d]);
        }
        s = warp_sum(s) * scale;
        float m_new = fmaxf(m, s);
        float c = expf(m - m_new), p = expf(s - m_new);
        l = l * c + p;
#pragma unroll
        for (int j = 0; j < MAX_HD_PER_LANE; j++) {
            int d = lane + 32 * j;
            if (d < hd) acc[j] = acc[j] * c + p * bf16_to_f32(v_cache[base + d]);
        }
        m = m_new;
    }
    __shared__ float wm[WARPS], wl[WARPS];
    __shared__ float wacc[WARPS][32 * MAX_HD_PER_LANE];
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < MAX_HD_PER_LANE; j++) wacc[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    if (warp != 0) return;
    float mm = -INFINITY;
    for (int w = 0; w < WARPS; w++) mm = fmaxf(mm, wm[w]);
    float total = 0.0f, f[WARPS];
    for (int w = 0; w < WARPS; w++) {
        f[w] = wm[w] == -INFINITY ? 0.0f : expf(wm[w] - mm);
        total += wl[w] * f[w];
    }
    float* o = out + ((u64)t * heads + h) * hd;
#pragma unroll
    for (int j = 0; j < MAX_HD_PER_LANE; j++) {
        int d = lane + 32 * j;
        if (d >= hd) continue;
        float v = 0.0f;
        for (int w = 0; w < WARPS; w++) v += wacc[w][d] * f[w];
        o[d] = v / total;
    }
}
