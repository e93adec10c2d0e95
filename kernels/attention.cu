// Paged attention over the BF16 KV cache, for prefill and decode rows alike: each query row
// attends causally to positions 0..=pos of its sequence through the sequence's block table, so
// a chunk on top of cached prefix blocks needs nothing special. GQA maps head h to KV head
// h / (heads / kv_heads). The K/V of the new tokens are stored first (qk_norm_rope_store).
//
// Grid (rows, heads), 4 warps: warp w takes keys w, w+4, ... with an online softmax; the warps
// merge at the end. head_dim <= 256 (8 values per lane).

#define MAX_HD_PER_LANE 8
#define WARPS 4

extern "C" __global__ void paged_attention(const float* q, float* out, const bf16_t* k_cache, const bf16_t* v_cache,
                                           const int* row_pos, const int* row_seq, const int* table_offsets,
                                           const int* block_tables, int heads, int kv_heads, int hd, int block_size,
                                           float scale) {
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

// Decode attention, GQA-aware and split over the keys ("flash decoding"). With few query rows
// the kernel above leaves most SMs idle on long contexts and reads each K/V row once per query
// head. Here a block serves one (row, KV head, key range): the query heads sharing that KV head
// (up to HEADS_PER_BLOCK of them; larger groups take several blocks) read each K/V row once,
// and grid.z splits the keys 0..=pos into ranges of `chunk` keys, the last one running to pos.
//
// Grid (rows, kv_heads * ceil(group / HEADS_PER_BLOCK), splits), 4 warps: warp w takes keys
// start + w, start + w + 4, ... with an online softmax per head; the warps merge through shared
// memory. With one split the block writes the normalized output; otherwise it writes the
// unnormalized partial (acc[hd], max, sum) of its range to `part_acc` / `part_ml` at slot
// ((row * heads + head) * splits + split), and paged_attention_combine merges them.
// A split whose range starts past pos has no keys and writes nothing; the combine skips it.

#define HEADS_PER_BLOCK 8
#define MAX_HD (32 * MAX_HD_PER_LANE)

extern "C" __global__ void paged_attention_split(const float* q, float* out, float* part_acc, float* part_ml,
                                                 const bf16_t* k_cache, const bf16_t* v_cache, const int* row_pos,
                                                 const int* row_seq, const int* table_offsets, const int* block_tables,
                                                 int heads, int kv_heads, int hd, int block_size, int chunk,
                                                 float scale) {
    int t = blockIdx.x, split = blockIdx.z, splits = gridDim.z;
    int group = heads / kv_heads;
    int passes = (group + HEADS_PER_BLOCK - 1) / HEADS_PER_BLOCK;
    int kvh = blockIdx.y / passes, first = (blockIdx.y % passes) * HEADS_PER_BLOCK;
    int nh = min(HEADS_PER_BLOCK, group - first);
    int h0 = kvh * group + first;
    int pos = row_pos[t];
    int start = split * chunk;
    // Uniform over the block and before any barrier: the whole block leaves.
    if (start > pos) return;
    int end = split == splits - 1 ? pos + 1 : min(pos + 1, start + chunk);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int* table = block_tables + table_offsets[row_seq[t]];
    u64 kv_width = (u64)kv_heads * hd;

    __shared__ float qs[HEADS_PER_BLOCK][MAX_HD];
    for (int i = threadIdx.x; i < nh * hd; i += blockDim.x) {
        int g = i / hd, d = i % hd;
        qs[g][d] = q[((u64)t * heads + h0 + g) * hd + d];
    }
    __syncthreads();

    float m[HEADS_PER_BLOCK], l[HEADS_PER_BLOCK], acc[HEADS_PER_BLOCK][MAX_HD_PER_LANE];
#pragma unroll
    for (int g = 0; g < HEADS_PER_BLOCK; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_HD_PER_LANE; j++) acc[g][j] = 0.0f;
    }
    for (int key = start + warp; key < end; key += WARPS) {
        u64 base = ((u64)table[key / block_size] * block_size + key % block_size) * kv_width + (u64)kvh * hd;
        float kv[MAX_HD_PER_LANE];
#pragma unroll
        for (int j = 0; j < MAX_HD_PER_LANE; j++) {
            int d = lane + 32 * j;
            kv[j] = d < hd ? bf16_to_f32(k_cache[base + d]) : 0.0f;
        }
        float s[HEADS_PER_BLOCK];
#pragma unroll
        for (int g = 0; g < HEADS_PER_BLOCK; g++) {
            s[g] = 0.0f;
            if (g < nh) {
                float dot = 0.0f;
#pragma unroll
                for (int j = 0; j < MAX_HD_PER_LANE; j++) {
                    int d = lane + 32 * j;
                    if (d < hd) dot += qs[g][d] * kv[j];
                }
                s[g] = warp_sum(dot) * scale;
            }
        }
#pragma unroll
        for (int j = 0; j < MAX_HD_PER_LANE; j++) {
            int d = lane + 32 * j;
            kv[j] = d < hd ? bf16_to_f32(v_cache[base + d]) : 0.0f;
        }
#pragma unroll
        for (int g = 0; g < HEADS_PER_BLOCK; g++) {
            if (g >= nh) continue;
            float m_new = fmaxf(m[g], s[g]);
            float c = expf(m[g] - m_new), p = expf(s[g] - m_new);
            l[g] = l[g] * c + p;
#pragma unroll
            for (int j = 0; j < MAX_HD_PER_LANE; j++) acc[g][j] = acc[g][j] * c + p * kv[j];
            m[g] = m_new;
        }
    }

    __shared__ float wm[WARPS][HEADS_PER_BLOCK], wl[WARPS][HEADS_PER_BLOCK];
    __shared__ float wacc[WARPS][HEADS_PER_BLOCK][MAX_HD];
#pragma unroll
    for (int g = 0; g < HEADS_PER_BLOCK; g++) {
        if (g >= nh) continue;
        if (lane == 0) {
            wm[warp][g] = m[g];
            wl[warp][g] = l[g];
        }
#pragma unroll
        for (int j = 0; j < MAX_HD_PER_LANE; j++) {
            int d = lane + 32 * j;
            if (d < hd) wacc[warp][g][d] = acc[g][j];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nh * hd; i += blockDim.x) {
        int g = i / hd, d = i % hd;
        float mm = -INFINITY;
        for (int w = 0; w < WARPS; w++) mm = fmaxf(mm, wm[w][g]);
        // A warp with no keys in this range (range shorter than WARPS) has max -inf.
        float total = 0.0f, a = 0.0f;
        for (int w = 0; w < WARPS; w++) {
            float f = wm[w][g] == -INFINITY ? 0.0f : expf(wm[w][g] - mm);
            total += wl[w][g] * f;
            a += wacc[w][g][d] * f;
        }
        u64 slot = (u64)t * heads + h0 + g;
        if (splits == 1) {
            out[slot * hd + d] = a / total;
        } else {
            slot = slot * splits + split;
            part_acc[slot * hd + d] = a;
            if (d == 0) {
                part_ml[2 * slot] = mm;
                part_ml[2 * slot + 1] = total;
            }
        }
    }
}

// Merges the splits of paged_attention_split: grid (rows, heads). Row t has keys 0..=pos, so
// splits 0..=min(splits - 1, pos / chunk) hold partials (each with at least one key).
extern "C" __global__ void paged_attention_combine(const float* part_acc, const float* part_ml, float* out,
                                                   const int* row_pos, int heads, int hd, int chunk, int splits) {
    int t = blockIdx.x, h = blockIdx.y;
    int n = min(splits, row_pos[t] / chunk + 1);
    u64 first = ((u64)t * heads + h) * splits;
    float mm = -INFINITY;
    for (int s = 0; s < n; s++) mm = fmaxf(mm, part_ml[2 * (first + s)]);
    float total = 0.0f;
    for (int s = 0; s < n; s++) total += part_ml[2 * (first + s) + 1] * expf(part_ml[2 * (first + s)] - mm);
    float* o = out + ((u64)t * heads + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n; s++) a += part_acc[(first + s) * hd + d] * expf(part_ml[2 * (first + s)] - mm);
        o[d] = a / total;
    }
}
