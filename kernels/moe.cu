// MoE routing and token permutation: softmax + top-k (+ renormalisation) per token, then the
// plan that groups the (token, slot) pairs by expert for the grouped expert GEMMs.

// One warp per token. Ties pick the lower expert id, like the CPU's stable sort.
// `given` (optional, [tokens, top_k]): routing replay. A row whose given ids are all valid takes
// them, weighted by this router's probabilities (renormalized over them, summed in slot order as
// the CPU does); any other row is routed normally.
extern "C" __global__ void moe_route(const float* logits, int tokens, int experts, int top_k, int renormalize,
                                     const int* given, int* topk_ids, float* topk_w) {
    int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= tokens) return;
    const float* row = logits + (u64)t * experts;
    float m = -INFINITY;
    for (int e = lane; e < experts; e += 32) m = fmaxf(m, row[e]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int e = lane; e < experts; e += 32) sum += expf(row[e] - m);
    sum = warp_sum(sum);
    if (given) {
        const int* g = given + (u64)t * top_k;
        bool valid = true;
        for (int s = 0; s < top_k; s++) valid = valid && g[s] >= 0 && g[s] < experts;
        if (valid) {
            float picked = 0.0f;
            for (int s = 0; s < top_k; s++) {
                float p = expf(row[g[s]] - m) / sum;
                if (lane == 0) {
                    topk_ids[t * top_k + s] = g[s];
                    topk_w[t * top_k + s] = p;
                }
                picked += p;
            }
            __syncwarp();
            if (renormalize && lane < top_k) topk_w[t * top_k + lane] = topk_w[t * top_k + lane] / picked;
            return;
        }
    }
    float picked_sum = 0.0f;
    int prev_id = -1;
    float prev_p = INFINITY;
    for (int s = 0; s < top_k; s++) {
        // The next best after (prev_p, prev_id) in the order (probability desc, id asc).
        float best = -1.0f;
        int best_id = 0x7fffffff;
        for (int e = lane; e < experts; e += 32) {
            float p = expf(row[e] - m) / sum;
            bool after_prev = p < prev_p || (p == prev_p && e > prev_id);
            bool better = p > best || (p == best && e < best_id);
            if (after_prev && better) {
                best = p;
                best_id = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
            if (ob > best || (ob == best && oi < best_id)) {
                best = ob;
                best_id = oi;
            }
        }
        if (lane == 0) {
            topk_ids[t * top_k + s] = best_id;
            topk_w[t * top_k + s] = best;
        }
        picked_sum += best;
        prev_p = best;
        prev_id = best_id;
    }
    __syncwarp();
    if (renormalize && lane < top_k) topk_w[t * top_k + lane] = topk_w[t * top_k + lane] / picked_sum;
}

// counts[e] = number of (token, slot) pairs routed to e. `counts` must be zeroed first.
extern "C" __global__ void moe_count(const int* topk_ids, int pairs, int* counts) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x)
        atomicAdd(&counts[topk_ids[i]], 1);
}

// One thread: offsets[e] = first permuted row of expert e; tiles = (expert, first row) of every
// `tile_rows`-row tile of the grouped GEMMs; cursor[e] = offsets[e] for the scatter.
extern "C" __global__ void moe_plan(const int* counts, int experts, int tile_rows, int* offsets, int* cursor,
                                    int* tiles, int* num_tiles) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    int row = 0, n = 0;
    for (int e = 0; e < experts; e++) {
        offsets[e] = row;
        cursor[e] = row;
        for (int r = 0; r < counts[e]; r += tile_rows) {
            tiles[2 * n] = e;
            tiles[2 * n + 1] = row + r;
            n++;
        }
        row += counts[e];
    }
    offsets[experts] = row;
    *num_tiles = n;
}

// Assigns each (token, slot) pair a row in its expert's group. The order inside a group does
// not matter: every row is computed independently and the combine reads by (token, slot).
extern "C" __global__ void moe_scatter(const int* topk_ids, int pairs, int top_k, int* cursor, int* slot_row,
                                       int* row_token) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x) {
        int r = atomicAdd(&cursor[topk_ids[i]], 1);
        slot_row[i] = r;
        row_token[r] = i / top_k;
    }
}
