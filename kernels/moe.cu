// MoE routing and token permutation: softmax + top-k (+ renormalisation) per token, then the
// plan that groups the (token, slot) pairs by expert for the grouped expert GEMMs.

// One warp per token. Ties pick the lower expert id, like the CPU's stable sort. `kept`
// (optional): where the ids go too (the step's record of every MoE layer's experts).
// `given` (optional, [tokens, top_k]): routing replay. A row whose given ids are all valid takes
// them, weighted by this router's probabilities (renormalized over them, summed in slot order as
// the CPU does); any other row is routed normally.
// With `segments` > 0 the router's logits are its GEMM's segment sums (`sums`, tokens x experts
// each): the warp folds its token's row and writes it into `logits`.
// A lane's first ROUTE_HELD experts (lane, lane + 32, ...: 256 experts in all) keep their logits
// and probabilities in registers, read (or folded) once; the top-k walk recomputes the others'
// (the same expression, so the same values). Lane s keeps the s-th pick until the walk ends,
// so the renormalization reads no store back. `ids_s` (optional): the picks also go there
// (the plan's shared-memory copy).
#define ROUTE_HELD 8
__device__ void route_token(float* logits, const float* sums, int segments, int tokens, int t, int lane,
                            int experts, int top_k, int renormalize, const int* given, int* topk_ids,
                            float* topk_w, int* kept, int* ids_s) {
    float* row = logits + (u64)t * experts;
    float x[ROUTE_HELD];
    if (segments) {
        u64 at[ROUTE_HELD];
        bool live[ROUTE_HELD];
#pragma unroll
        for (int j = 0; j < ROUTE_HELD; j++) {
            int e = lane + 32 * j;
            live[j] = e < experts;
            at[j] = (u64)t * experts + (live[j] ? e : 0);
        }
        u64 stride = (u64)tokens * experts;
        folded_many<ROUTE_HELD>(sums, segments, stride, at, live, x);
#pragma unroll
        for (int j = 0; j < ROUTE_HELD; j++)
            if (live[j]) row[lane + 32 * j] = x[j];
        for (int e = lane + 32 * ROUTE_HELD; e < experts; e += 32)
            row[e] = folded(sums, segments, stride, (u64)t * experts + e);
        __syncwarp();
    } else {
#pragma unroll
        for (int j = 0; j < ROUTE_HELD; j++) x[j] = lane + 32 * j < experts ? row[lane + 32 * j] : 0.0f;
    }
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < ROUTE_HELD; j++)
        if (lane + 32 * j < experts) m = fmaxf(m, x[j]);
    for (int e = lane + 32 * ROUTE_HELD; e < experts; e += 32) m = fmaxf(m, row[e]);
    m = warp_max(m);
    float sum = 0.0f, held[ROUTE_HELD];
#pragma unroll
    for (int j = 0; j < ROUTE_HELD; j++) {
        int e = lane + 32 * j;
        held[j] = e < experts ? expf(x[j] - m) : 0.0f;
        if (e < experts) sum += held[j];
    }
    for (int e = lane + 32 * ROUTE_HELD; e < experts; e += 32) sum += expf(row[e] - m);
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < ROUTE_HELD; j++) held[j] = held[j] / sum;
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
                    if (kept) kept[t * top_k + s] = g[s];
                    if (ids_s) ids_s[t * top_k + s] = g[s];
                }
                picked += p;
            }
            __syncwarp();
            if (renormalize && lane < top_k) topk_w[t * top_k + lane] = topk_w[t * top_k + lane] / picked;
            return;
        }
    }
    float picked_sum = 0.0f, my_w = 0.0f;
    int prev_id = -1, my_id = 0;
    float prev_p = INFINITY;
    for (int s = 0; s < top_k; s++) {
        // The next best after (prev_p, prev_id) in the order (probability desc, id asc).
        float best = -1.0f;
        int best_id = 0x7fffffff;
        auto consider = [&](int e, float p) {
            bool after_prev = p < prev_p || (p == prev_p && e > prev_id);
            bool better = p > best || (p == best && e < best_id);
            if (after_prev && better) {
                best = p;
                best_id = e;
            }
        };
#pragma unroll
        for (int j = 0; j < ROUTE_HELD; j++)
            if (lane + 32 * j < experts) consider(lane + 32 * j, held[j]);
        for (int e = lane + 32 * ROUTE_HELD; e < experts; e += 32) consider(e, expf(row[e] - m) / sum);
        // The warp's best in two reductions: the largest probability (a lane's best as bits
        // plus one, 0 for none: the bits of non-negative floats order as the floats), then the
        // lowest id among the lanes that hold it. (Five shuffle rounds of both before: the same
        // picks, three times the instructions.)
        u32 key = best >= 0.0f ? __float_as_uint(best) + 1u : 0u;
        u32 top = __reduce_max_sync(0xffffffffu, key);
        best_id = (int)__reduce_min_sync(0xffffffffu, key == top ? (u32)best_id : 0x7fffffffu);
        best = top ? __uint_as_float(top - 1u) : -1.0f;
        if (lane == s) {
            my_id = best_id;
            my_w = best;
        }
        picked_sum += best;
        prev_p = best;
        prev_id = best_id;
    }
    if (lane < top_k) {
        topk_ids[t * top_k + lane] = my_id;
        topk_w[t * top_k + lane] = renormalize ? my_w / picked_sum : my_w;
        if (kept) kept[t * top_k + lane] = my_id;
        if (ids_s) ids_s[t * top_k + lane] = my_id;
    }
}

extern "C" __global__ void moe_route(float* logits, int tokens, int experts, int top_k, int renormalize,
                                     const int* given, int* topk_ids, float* topk_w, const float* sums,
                                     int segments, int* kept) {
    pdl_entry();
    int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= tokens) return;
    route_token(logits, sums, segments, tokens, t, lane, experts, top_k, renormalize, given, topk_ids, topk_w, kept,
                nullptr);
}

// counts[e] = number of (token, slot) pairs routed to e. `counts` must be zeroed first.
extern "C" __global__ void moe_count(const int* topk_ids, int pairs, int* counts) {
    pdl_entry();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x)
        atomicAdd(&counts[topk_ids[i]], 1);
}

// One block of PLAN_THREADS threads: offsets[e] = first permuted row of expert e; tiles =
// (expert, first row) of every `tile_rows`-row tile of the grouped GEMMs, in expert order,
// wide_tiles the same for `wide_rows`-row tiles (the tiled GEMM's wide blocks) and pair_tiles
// for tiles of two wide tiles' rows (the wgmma and TMA kernels' blocks); cursor[e] =
// offsets[e] for the scatter. Thread i takes a contiguous run of experts; a block scan of the
// runs' rows and tiles gives each run its first row and tiles, so the plan is the one a single
// walk over e = 0, 1, ... writes (integers: the same for any thread count).
#define PLAN_THREADS 256
// Writes expert e's tiles of `tile_rows` rows over its `count` rows from `row` into `list` from
// entry `at`; returns the entry after them.
__device__ __forceinline__ int put_tiles(int* list, int at, int e, int row, int count, int tile_rows) {
    for (int r = 0; r < count; r += tile_rows, at++) {
        list[2 * at] = e;
        list[2 * at + 1] = row + r;
    }
    return at;
}
__device__ void plan_block(const int* counts, int experts, int tile_rows, int wide_rows, int* offsets, int* cursor,
                           int* tiles, int* num_tiles, int* wide_tiles, int* num_wide_tiles, int* pair_tiles,
                           int* num_pair_tiles) {
    __shared__ int4 warp_s[PLAN_THREADS / 32];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, pair_rows = 2 * wide_rows;
    int per = (experts + PLAN_THREADS - 1) / PLAN_THREADS;
    int e0 = min(tid * per, experts), e1 = min(e0 + per, experts);
    int my_rows = 0, my_tiles = 0, my_wide = 0, my_pairs = 0;
    for (int e = e0; e < e1; e++) {
        my_rows += counts[e];
        my_tiles += (counts[e] + tile_rows - 1) / tile_rows;
        my_wide += (counts[e] + wide_rows - 1) / wide_rows;
        my_pairs += (counts[e] + pair_rows - 1) / pair_rows;
    }
    // Exclusive block scan of the four sums: a shuffle scan in each warp, then each thread adds
    // the totals of the warps before its own (one barrier; a Hillis-Steele scan over shared
    // memory took seventeen).
    int4 v = make_int4(my_rows, my_tiles, my_wide, my_pairs);
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        int4 u = make_int4(__shfl_up_sync(0xffffffffu, v.x, off), __shfl_up_sync(0xffffffffu, v.y, off),
                           __shfl_up_sync(0xffffffffu, v.z, off), __shfl_up_sync(0xffffffffu, v.w, off));
        if (lane >= off) v = make_int4(v.x + u.x, v.y + u.y, v.z + u.z, v.w + u.w);
    }
    if (lane == 31) warp_s[warp] = v;
    __syncthreads();
    int4 before = make_int4(0, 0, 0, 0), total = make_int4(0, 0, 0, 0);
#pragma unroll
    for (int w = 0; w < PLAN_THREADS / 32; w++) {
        int4 t = warp_s[w];
        if (w < warp) before = make_int4(before.x + t.x, before.y + t.y, before.z + t.z, before.w + t.w);
        total = make_int4(total.x + t.x, total.y + t.y, total.z + t.z, total.w + t.w);
    }
    int row = before.x + v.x - my_rows, n = before.y + v.y - my_tiles, m = before.z + v.z - my_wide;
    int p = before.w + v.w - my_pairs;
    for (int e = e0; e < e1; e++) {
        offsets[e] = row;
        cursor[e] = row;
        n = put_tiles(tiles, n, e, row, counts[e], tile_rows);
        m = put_tiles(wide_tiles, m, e, row, counts[e], wide_rows);
        p = put_tiles(pair_tiles, p, e, row, counts[e], pair_rows);
        row += counts[e];
    }
    if (tid == 0) {
        offsets[experts] = total.x;
        *num_tiles = total.y;
        *num_wide_tiles = total.z;
        *num_pair_tiles = total.w;
    }
}

extern "C" __global__ void moe_plan(const int* counts, int experts, int tile_rows, int wide_rows, int* offsets,
                                    int* cursor, int* tiles, int* num_tiles, int* wide_tiles, int* num_wide_tiles,
                                    int* pair_tiles, int* num_pair_tiles) {
    pdl_entry();
    plan_block(counts, experts, tile_rows, wide_rows, offsets, cursor, tiles, num_tiles, wide_tiles, num_wide_tiles,
               pair_tiles, num_pair_tiles);
}

// Assigns each (token, slot) pair a row in its expert's group. The order inside a group does
// not matter: every row is computed independently and the combine reads by (token, slot).
extern "C" __global__ void moe_scatter(const int* topk_ids, int pairs, int top_k, int* cursor, int* slot_row,
                                       int* row_token) {
    pdl_entry();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x) {
        int r = atomicAdd(&cursor[topk_ids[i]], 1);
        slot_row[i] = r;
        row_token[r] = i / top_k;
    }
}

// The plan of `pairs` routed ids in one block of PLAN_THREADS threads: what moe_count, moe_plan
// and moe_scatter write (after the memset of counts), counted in shared memory. Counts, offsets
// and tiles are integers; rows within an expert's group are handed out in any order, as
// moe_scatter's are, from a cursor in shared memory (the plan's cursor in global memory is not
// written). Requires experts <= ROUTE_PLAN_MAX_EXPERTS (host: ops::moe::ROUTE_PLAN_MAX_EXPERTS).
#define ROUTE_PLAN_MAX_EXPERTS 1024
__device__ void plan_ids_block(const int* topk_ids, int pairs, int top_k, int experts, int* counts, int tile_rows,
                               int wide_rows, int* offsets, int* tiles, int* num_tiles, int* wide_tiles,
                               int* num_wide_tiles, int* pair_tiles, int* num_pair_tiles, int* slot_row,
                               int* row_token) {
    __shared__ int counts_s[ROUTE_PLAN_MAX_EXPERTS], cursor_s[ROUTE_PLAN_MAX_EXPERTS];
    int tid = threadIdx.x;
    for (int e = tid; e < experts; e += PLAN_THREADS) counts_s[e] = 0;
    __syncthreads();
    for (int i = tid; i < pairs; i += PLAN_THREADS) atomicAdd(&counts_s[topk_ids[i]], 1);
    __syncthreads();
    for (int e = tid; e < experts; e += PLAN_THREADS) counts[e] = counts_s[e];
    plan_block(counts_s, experts, tile_rows, wide_rows, offsets, cursor_s, tiles, num_tiles, wide_tiles, num_wide_tiles,
               pair_tiles, num_pair_tiles);
    __syncthreads();
    for (int i = tid; i < pairs; i += PLAN_THREADS) {
        int r = atomicAdd(&cursor_s[topk_ids[i]], 1);
        slot_row[i] = r;
        row_token[r] = i / top_k;
    }
}

// moe_count, moe_plan and moe_scatter in one launch (plan_ids_block), for steps of few pairs.
extern "C" __global__ void moe_plan_ids(const int* topk_ids, int pairs, int top_k, int experts, int* counts,
                                        int tile_rows, int wide_rows, int* offsets, int* tiles, int* num_tiles,
                                        int* wide_tiles, int* num_wide_tiles, int* pair_tiles, int* num_pair_tiles,
                                        int* slot_row, int* row_token) {
    pdl_entry();
    plan_ids_block(topk_ids, pairs, top_k, experts, counts, tile_rows, wide_rows, offsets, tiles, num_tiles,
                   wide_tiles, num_wide_tiles, pair_tiles, num_pair_tiles, slot_row, row_token);
}

// Routing and its plan in one block of PLAN_THREADS threads, for few tokens (decode): what
// moe_route, moe_count, moe_plan and moe_scatter write, in one launch instead of four and a
// memset. Each token is routed by the same code (a warp per token), its picks kept in shared
// memory for the plan (plan_ids_block) up to ROUTE_PLAN_MAX_PAIRS pairs (read back from topk_ids
// past that).
#define ROUTE_PLAN_MAX_PAIRS 2048
extern "C" __global__ void moe_route_plan(float* logits, int tokens, int experts, int top_k, int renormalize, const int* given,
                   int* topk_ids, float* topk_w, int* counts, int tile_rows, int wide_rows, int* offsets,
                   int* tiles, int* num_tiles, int* wide_tiles, int* num_wide_tiles,
                   int* pair_tiles, int* num_pair_tiles, int* slot_row, int* row_token, const float* sums,
                   int segments, int* kept) {
    __shared__ int ids_s[ROUTE_PLAN_MAX_PAIRS];
    pdl_entry();
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int* picks = tokens * top_k <= ROUTE_PLAN_MAX_PAIRS ? ids_s : nullptr;
    for (int t = warp; t < tokens; t += PLAN_THREADS / 32)
        route_token(logits, sums, segments, tokens, t, lane, experts, top_k, renormalize, given, topk_ids, topk_w,
                    kept, picks);
    __syncthreads();
    plan_ids_block(picks ? picks : topk_ids, tokens * top_k, top_k, experts, counts, tile_rows, wide_rows, offsets,
                   tiles, num_tiles, wide_tiles, num_wide_tiles, pair_tiles, num_pair_tiles, slot_row, row_token);
}
