// Sampling on the device: one thread block per sampled row implements the definition at the top of
// src/sampling/sample.rs (penalties, min_new_tokens mask, temperature, probabilities, the canonical
// order, the kept set, the inverse-CDF draw, logprobs and top-N), so that only the chosen token, its
// logprob and the top-N cross to the host.
//
// Exactness. Processing uses the CPU's f32 operations one by one (__f*_rn: never contracted), and
// p = exp(l - max) uses a port of glibc's expf (the function Rust's f32::exp calls on Linux): the
// probabilities, hence the order and every tie, are the CPU's bit for bit. The normalizer is
// added in the CPU's order (src/sampling/sample.rs `fixed_order_sum`: 512 interleaved lanes,
// a halving tree per warp, the warps in order) and its log is the CPU's `contract_ln`, so the
// logprobs are the CPU's bit for bit too. The cumulative and kept masses are added in another
// order than the CPU's, so a cut or a draw whose target lies within rounding (~1e-16 relative)
// of a cumulative boundary may differ. Counts (top-k, top-N) are exact. Every sum has a fixed
// order: results are deterministic.
//
// Selection. Keys are 64 bits, (descending value bits << 32 | token id): the canonical order is the
// integer order. A radix select over 8-bit digits builds per-digit histograms of count and weight
// (weight = p for mass targets, 1 for counts), keeps the bin where the running weight reaches the
// target, and once the range holds at most GATHER_CAP keys, gathers, sorts and walks them.

#define SAMPLE_THREADS 512
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define GATHER_CAP 2048
#define NO_KEY 0xffffffffffffffffull

#define PENALTY_REPEAT 1u
#define PENALTY_MASK 2u

#define STATUS_OK 0
#define STATUS_NON_FINITE 1
#define STATUS_NO_CANDIDATES 2

#define KIND_PROB 0     // kept-set members: p > 0, p >= min_p, keyed by p
#define KIND_LOGPROB 1  // every token, keyed by its logprob

// Layouts asserted on the Rust side (src/backend/cuda/sampling.rs).
struct RowParams {
    double u;  // uniform(seed, sample_index, position), drawn on the host
    int logits_row;
    int penalties_begin;
    int penalties_end;
    int top_k;  // 0: no top-k
    int top_n;  // logprobs to report
    int greedy;
    float temperature;
    float top_p;
    float min_p;
    float repetition;
    float frequency;
    float presence;
    int logprob;  // 0: a greedy row without top-N need not compute the normalizer
    int pad1;
};

struct PenaltyEntry {
    u32 token;
    u32 output_count;  // 0 when frequency and presence are both 0
    u32 flags;
};

struct RowResult {
    u32 token;
    float logprob;
    int status;
    u32 bad_token;
    float bad_value;
    u32 num_top;
};

struct TopEntry {
    u32 token;
    float logprob;
};

// glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, from Arm optimized-routines) as its x86-64 FMA
// build computes it: 2^(k/32) from a table times a cubic in r, in f64, rounded once to f32.
// On 2.2e9 arguments in [-110, 90] this equals Rust's f32::exp on glibc 2.36 bit for bit.
__device__ const u64 EXP2F_TABLE[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

__device__ __forceinline__ float host_expf(float x, const u64* table) {
    u32 ix = __float_as_uint(x);
    u32 abstop = (ix >> 20) & 0x7ffu;
    if (abstop >= 0x42bu) {  // |x| >= 88 or NaN
        if (ix == 0xff800000u) return 0.0f;
        if (abstop >= 0x7f8u) return x + x;
        if (x > __uint_as_float(0x42b17217u)) return INFINITY;  // > ln(2^128)
        if (x < __uint_as_float(0xc2cff1b4u)) return 0.0f;      // < ln(2^-150)
    }
    // Exact power-of-two scalings of the published constants.
    const double inv_ln2_n = __longlong_as_double(0x3ff71547652b82fell) * 32.0;
    const double shift = __longlong_as_double(0x4338000000000000ll);
    const double c0 = __longlong_as_double(0x3fac6af84b912394ll) * (1.0 / 32768.0);
    const double c1 = __longlong_as_double(0x3fcebfce50fac4f3ll) * (1.0 / 1024.0);
    const double c2 = __longlong_as_double(0x3fe62e42ff0c52d6ll) * (1.0 / 32.0);
    double xd = (double)x;
    double kd = __fma_rn(inv_ln2_n, xd, shift);
    u64 ki = (u64)__double_as_longlong(kd);
    kd = __dsub_rn(kd, shift);
    double r = __fma_rn(inv_ln2_n, xd, -kd);
    u64 t = table[ki & 31u] + (ki << 47);
    double s = __longlong_as_double((long long)t);
    double z = __fma_rn(c0, r, c1);
    double r2 = __dmul_rn(r, r);
    double y = __fma_rn(c2, r, 1.0);
    y = __fma_rn(z, r2, y);
    y = __dmul_rn(y, s);
    return __double2float_rn(y);
}

// For the test that checks the port against the host's expf.
extern "C" __global__ void host_expf_kernel(const float* x, float* y, u64 n) {
    pdl_entry();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        y[i] = host_expf(x[i], EXP2F_TABLE);
}

// A u32 whose ascending order is the descending order of x (IEEE total order).
__device__ __forceinline__ u32 descending_f32(float x) {
    u32 b = __float_as_uint(x);
    u32 ascending = (b >> 31) ? ~b : (b | 0x80000000u);
    return ~ascending;
}

// The probability a KIND_PROB key holds in its top 32 bits (descending_f32 of p > 0): p itself,
// without a load of p from the row.
__device__ __forceinline__ float key_probability(u64 key) {
    return __uint_as_float(~(u32)(key >> 32) & 0x7fffffffu);
}

// src/sampling/sample.rs `contract_ln`, operation for operation: ln x for x >= 1.
__device__ double contract_ln(double x) {
    long long bits = __double_as_longlong(x);
    int e = (int)((bits >> 52) & 0x7ff) - 1023;
    double m = __longlong_as_double((bits & 0xfffffffffffffll) | (1023ll << 52));
    if (m > __longlong_as_double(0x3ff6a09e667f3bcdll)) {
        m = __dmul_rn(m, 0.5);
        e += 1;
    }
    double s = __ddiv_rn(__dsub_rn(m, 1.0), __dadd_rn(m, 1.0));
    double s2 = __dmul_rn(s, s);
    double poly = __ddiv_rn(1.0, 21.0);
    for (int k = 9; k >= 0; k--) poly = __fma_rn(poly, s2, __ddiv_rn(1.0, (double)(2 * k + 1)));
    return __fma_rn((double)e, __longlong_as_double(0x3fe62e42fefa39efll), __dmul_rn(__dmul_rn(2.0, s), poly));
}

// `(l as f64 - lse) as f32 + 0.0`: the + 0 folds -0 into +0 so equal logprobs tie.
__device__ __forceinline__ float logprob_of(float l, double lse) {
    return __fadd_rn(__double2float_rn(__dsub_rn((double)l, lse)), 0.0f);
}

struct RowView {
    const float* l;  // the processed row
    const float* p;  // exp(l - max) (sampling rows only)
    int vocab;
    float min_p;
    double lse;
    u64 limit;  // members have keys <= limit
};

struct SampleShared {
    union {
        double warp_hist[SAMPLE_WARPS][256];  // per-warp weights per digit: a fixed summation order
        u64 keys[GATHER_CAP];
    } u;
    double stage[SAMPLE_WARPS][32];
    double bin_w[256];
    int bin_n[256];
    double red_d[SAMPLE_WARPS];
    float red_f[SAMPLE_WARPS];
    int red_i[SAMPLE_WARPS];
    u64 exp_table[32];
    int gather_n;
    int sel_bin, sel_count, sel_none;
    double sel_before;
    u64 sel_key;
    u64 max_key;
    int bad;
    u32 argmax;
};

// Sum over the block in a fixed order (the CPU's fixed_order_sum); every thread gets it.
__device__ double block_sum_f64(double v, SampleShared& sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sh.red_d[warp] = v;
    __syncthreads();
    double total = 0.0;
    for (int w = 0; w < SAMPLE_WARPS; w++) total += sh.red_d[w];
    return total;
}

__device__ float block_max_f32(float v, SampleShared& sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh.red_f[warp] = v;
    __syncthreads();
    float m = -INFINITY;
    for (int w = 0; w < SAMPLE_WARPS; w++) m = fmaxf(m, sh.red_f[w]);
    return m;
}

__device__ int block_min_i32(int v, SampleShared& sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) sh.red_i[warp] = v;
    __syncthreads();
    int m = 0x7fffffff;
    for (int w = 0; w < SAMPLE_WARPS; w++) m = min(m, sh.red_i[w]);
    return m;
}

// Whether token t, whose probability (KIND_PROB) or logit (KIND_LOGPROB) is v, is a member of
// `kind`, and its key and weight.
__device__ __forceinline__ bool member_of(const RowView& r, int kind, int by_mass, int t, float v, u64& key,
                                          double& w) {
    if (kind == KIND_PROB) {
        if (!(v > 0.0f && v >= r.min_p)) return false;
        key = ((u64)descending_f32(v) << 32) | (u32)t;
        w = by_mass ? (double)v : 1.0;
    } else {
        key = ((u64)descending_f32(logprob_of(v, r.lse)) << 32) | (u32)t;
        w = 1.0;
    }
    return key <= r.limit;
}

// A thread's walk over a row: f(t, row[t]) for t = threadIdx.x, + SAMPLE_THREADS, ... < vocab,
// in that order, each SAMPLE_BATCH elements' loads issued before any is used: one block walks a
// whole row (151,936 logits of Qwen3), and at one load in flight a warp each walk waited out
// ~300 load latencies. (f may write row[t]: its batch was loaded first.) More than 8 gave the
// kernel more than 64 registers a thread (16: 128), so one block an SM where two fit.
#define SAMPLE_BATCH 8
#ifndef SELECT_BATCH
#define SELECT_BATCH 16  // select_key's histogram walk (its loop body holds no f64 polynomial)
#endif
template <class F>
__device__ __forceinline__ void walk_row(const float* row, int vocab, F f) {
    for (int t0 = threadIdx.x; t0 < vocab; t0 += SAMPLE_THREADS * SAMPLE_BATCH) {
        float lb[SAMPLE_BATCH];
#pragma unroll
        for (int u = 0; u < SAMPLE_BATCH; u++) {
            int t = t0 + u * SAMPLE_THREADS;
            lb[u] = t < vocab ? row[t] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < SAMPLE_BATCH; u++) {
            int t = t0 + u * SAMPLE_THREADS;
            if (t >= vocab) break;
            f(t, lb[u]);
        }
    }
}

__device__ __forceinline__ bool in_prefix(u64 key, u64 prefix, int fixed) {
    return fixed == 0 || (key >> (64 - fixed)) == prefix;
}

// The values a member test of `kind` reads: the probabilities or the logits.
__device__ __forceinline__ const float* member_values(const RowView& r, int kind) {
    return kind == KIND_PROB ? r.p : r.l;
}

// Gathers the member keys whose top `fixed` bits are `prefix` (at most GATHER_CAP of them) into
// sh.u.keys and sorts them ascending (bitonic). Returns their number.
__device__ int gather_sorted(const RowView& r, int kind, u64 prefix, int fixed, SampleShared& sh) {
    const int tid = threadIdx.x;
    __syncthreads();
    if (tid == 0) sh.gather_n = 0;
    __syncthreads();
    walk_row(member_values(r, kind), r.vocab, [&](int t, float v) {
        u64 key;
        double w;
        if (member_of(r, kind, 0, t, v, key, w) && in_prefix(key, prefix, fixed)) {
            int slot = atomicAdd(&sh.gather_n, 1);
            if (slot < GATHER_CAP) sh.u.keys[slot] = key;
        }
    });
    __syncthreads();
    int n = min(sh.gather_n, GATHER_CAP);
    int padded = 1;
    while (padded < n) padded <<= 1;
    for (int i = n + tid; i < padded; i += SAMPLE_THREADS) sh.u.keys[i] = NO_KEY;
    __syncthreads();
    for (int k = 2; k <= padded; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = tid; i < padded; i += SAMPLE_THREADS) {
                int partner = i ^ j;
                if (partner > i) {
                    u64 a = sh.u.keys[i], b = sh.u.keys[partner];
                    bool ascending = (i & k) == 0;
                    if ((a > b) == ascending) {
                        sh.u.keys[i] = b;
                        sh.u.keys[partner] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    return n;
}

// One 32-token group of a histogram pass (every lane of the warp calls it, in the warp's group
// order): the members' weights w of each 8-bit digit `bin` (256: not a member) are added in lane
// order by the digit's first lane, and that sum joins the warp's row of the histogram; the digit's
// count joins the block's.
__device__ __forceinline__ void bin_group(SampleShared& sh, int warp, int lane, bool in, u32 bin, double w) {
    sh.stage[warp][lane] = in ? w : 0.0;
    u32 peers = __match_any_sync(0xffffffffu, bin);
    __syncwarp();
    if (in && lane == __ffs(peers) - 1) {
        double s = 0.0;
        for (u32 m = peers; m; m &= m - 1) s += sh.stage[warp][__ffs(m) - 1];
        sh.u.warp_hist[warp][bin] += s;
        atomicAdd(&sh.bin_n[bin], __popc(peers));
    }
    __syncwarp();
}

// Clears the histogram of a pass (the caller synchronizes before and after).
__device__ __forceinline__ void clear_histogram(SampleShared& sh) {
    for (int i = threadIdx.x; i < SAMPLE_WARPS * 256; i += SAMPLE_THREADS) sh.u.warp_hist[i / 256][i % 256] = 0.0;
    for (int i = threadIdx.x; i < 256; i += SAMPLE_THREADS) sh.bin_n[i] = 0;
}

// The first member key in canonical (ascending key) order at which the running weight reaches
// `target` (cum >= target, or cum > target when `strict`); NO_KEY when the members' total never
// does. When rounding makes a narrowed range fall short, its last key is taken (the CPU's draw
// does the same with its last kept token). Every thread must call it; all get the result.
// `first_binned`: the first pass's histogram (all members, the top digit) is already in shared
// memory, built in the same group order by the probabilities' walk (sample_rows).
__device__ u64 select_key(const RowView& r, int kind, int by_mass, double target, int strict, SampleShared& sh,
                          bool first_binned = false) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    u64 prefix = 0;
    int fixed = 0;
    double before = 0.0;  // weight of the members below the current range
    int in_range = -1;    // unknown until the first pass
    while (fixed < 64 && (in_range < 0 || in_range > GATHER_CAP)) {
        const int shift = 56 - fixed;
        __syncthreads();
        const bool walk = !(first_binned && fixed == 0);
        if (walk) clear_histogram(sh);
        __syncthreads();
        // Warp w takes the 32-token groups w, w + SAMPLE_WARPS, ...: a fixed order per warp,
        // SELECT_BATCH groups' values loaded before the first is binned (one at a time, each
        // group waited a load's latency: ~300 a pass over 151,936 values).
        const float* values = member_values(r, kind);
        for (int base0 = warp * 32; walk && base0 < r.vocab; base0 += SAMPLE_THREADS * SELECT_BATCH) {
            float vb[SELECT_BATCH];
#pragma unroll
            for (int u = 0; u < SELECT_BATCH; u++) {
                int t = base0 + u * SAMPLE_THREADS + lane;
                vb[u] = t < r.vocab ? values[t] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < SELECT_BATCH; u++) {
                int base = base0 + u * SAMPLE_THREADS;
                if (base >= r.vocab) break;  // warp-uniform
                int t = base + lane;
                u64 key = 0;
                double w = 0.0;
                bool in = t < r.vocab && member_of(r, kind, by_mass, t, vb[u], key, w) && in_prefix(key, prefix, fixed);
                bin_group(sh, warp, lane, in, in ? (u32)(key >> shift) & 255u : 256u, w);
            }
        }
        __syncthreads();
        for (int b = tid; b < 256; b += SAMPLE_THREADS) {
            double s = 0.0;
            for (int w = 0; w < SAMPLE_WARPS; w++) s += sh.u.warp_hist[w][b];
            sh.bin_w[b] = s;
        }
        __syncthreads();
        if (tid == 0) {
            double acc = before, acc_last = before;
            int chosen = -1, last = -1;
            for (int b = 0; b < 256; b++) {
                if (sh.bin_n[b] == 0) continue;
                double next = acc + sh.bin_w[b];
                if (strict ? next > target : next >= target) {
                    chosen = b;
                    break;
                }
                last = b;
                acc_last = acc;
                acc = next;
            }
            sh.sel_none = 0;
            if (chosen >= 0) {
                sh.sel_before = acc;
            } else if (fixed == 0 || last < 0) {
                sh.sel_none = 1;
            } else {
                chosen = last;
                sh.sel_before = acc_last;
            }
            sh.sel_bin = chosen;
            sh.sel_count = chosen >= 0 ? sh.bin_n[chosen] : 0;
        }
        __syncthreads();
        if (sh.sel_none) return NO_KEY;
        prefix = (prefix << 8) | (u64)sh.sel_bin;
        fixed += 8;
        before = sh.sel_before;
        in_range = sh.sel_count;
    }
    int n = gather_sorted(r, kind, prefix, fixed, sh);
    if (warp == 0) {
        double acc = before;
        u64 found = NO_KEY;
        for (int base = 0; base < n && found == NO_KEY; base += 32) {
            int i = base + lane;
            double w = 0.0;
            if (i < n) w = (kind == KIND_PROB && by_mass) ? (double)key_probability(sh.u.keys[i]) : 1.0;
            double c = w;  // inclusive scan over the warp
            for (int o = 1; o < 32; o <<= 1) {
                double v = __shfl_up_sync(0xffffffffu, c, o);
                if (lane >= o) c += v;
            }
            double cum = acc + c;
            bool hit = i < n && (strict ? cum > target : cum >= target);
            u32 hits = __ballot_sync(0xffffffffu, hit);
            if (hits) found = sh.u.keys[base + __ffs(hits) - 1];
            acc += __shfl_sync(0xffffffffu, c, 31);
        }
        if (found == NO_KEY && n > 0) found = sh.u.keys[n - 1];
        if (lane == 0) sh.sel_key = found;
    }
    __syncthreads();
    return sh.sel_key;
}

// The kept mass: members' p summed (f64), a thread's in its walk's order.
__device__ double member_mass(const RowView& r, SampleShared& sh) {
    double acc = 0.0;
    walk_row(r.p, r.vocab, [&](int t, float p) {
        u64 key;
        double w;
        if (member_of(r, KIND_PROB, 1, t, p, key, w)) acc += w;
    });
    return block_sum_f64(acc, sh);
}

// The largest member key (the last kept token).
__device__ u64 member_max_key(const RowView& r, SampleShared& sh) {
    __syncthreads();
    if (threadIdx.x == 0) sh.max_key = 0;
    __syncthreads();
    walk_row(r.p, r.vocab, [&](int t, float p) {
        u64 key;
        double w;
        if (member_of(r, KIND_PROB, 0, t, p, key, w)) atomicMax(&sh.max_key, key);
    });
    __syncthreads();
    return sh.max_key;
}

// A row's result: its token (with the logprob and the number of top-N entries when computed).
__device__ void write_token(RowResult* res, u32 token, float logprob = 0.0f, u32 num_top = 0) {
    res->token = token;
    res->logprob = logprob;
    res->status = STATUS_OK;
    res->bad_token = 0;
    res->bad_value = 0.0f;
    res->num_top = num_top;
}

// A row that cannot be sampled: its first non-finite logit (`bad`, with its value) or, when
// there is none (bad = INT_MAX), no finite logit at all.
__device__ void write_failure(RowResult* res, int bad, float value) {
    const bool non_finite = bad != 0x7fffffff;
    res->token = 0;
    res->logprob = 0.0f;
    res->num_top = 0;
    res->status = non_finite ? STATUS_NON_FINITE : STATUS_NO_CANDIDATES;
    res->bad_token = non_finite ? (u32)bad : 0u;
    res->bad_value = non_finite ? value : 0.0f;
}

// The penalties (each token at most once in the list) of the row's tokens in [lo, hi), then
// their min_new_tokens mask, by a block of `threads` threads, in place; the block's threads see
// the processed row afterwards.
__device__ void apply_penalties(float* row, const RowParams& pr, const PenaltyEntry* penalties, int lo, int hi,
                                int threads) {
    const int first = pr.penalties_begin + threadIdx.x;
    for (int i = first; i < pr.penalties_end; i += threads) {
        PenaltyEntry e = penalties[i];
        if ((e.flags & PENALTY_MASK) || (int)e.token < lo || (int)e.token >= hi) continue;
        float l = row[e.token];
        if (e.flags & PENALTY_REPEAT) l = l > 0.0f ? __fdiv_rn(l, pr.repetition) : __fmul_rn(l, pr.repetition);
        if (e.output_count > 0) {
            l = __fsub_rn(l, __fmul_rn(pr.frequency, (float)e.output_count));
            l = __fsub_rn(l, pr.presence);
        }
        row[e.token] = l;
    }
    __syncthreads();
    for (int i = first; i < pr.penalties_end; i += threads) {
        PenaltyEntry e = penalties[i];
        if ((e.flags & PENALTY_MASK) && (int)e.token >= lo && (int)e.token < hi) row[e.token] = -INFINITY;
    }
    __syncthreads();
}

// One block per sampled row. `logits` holds the lm_head chunk (row stride `vocab`); the row is
// processed in place. `probs` has one row per block. Results go to slot first_slot + blockIdx.x.
extern "C" __global__ __launch_bounds__(SAMPLE_THREADS) void sample_rows(float* logits, float* probs, int vocab, const RowParams* params, const PenaltyEntry* penalties,
                int first_slot, int top_stride, RowResult* results, TopEntry* tops) {
    pdl_entry();
    __shared__ SampleShared sh;
    const int tid = threadIdx.x;
    const RowParams pr = params[blockIdx.x];
    float* row = logits + (u64)pr.logits_row * vocab;
    float* prow = probs + (u64)blockIdx.x * vocab;
    RowResult* res = results + first_slot + blockIdx.x;
    if (tid < 32) sh.exp_table[tid] = EXP2F_TABLE[tid];

    apply_penalties(row, pr, penalties, 0, vocab, SAMPLE_THREADS);

    // Temperature, the max and the first non-finite logit. A thread walks its logits t = tid,
    // tid + SAMPLE_THREADS, ... in that order, SAMPLE_BATCH of them loaded before any is used.
    // A thread's first maximum is the first t holding its largest l (its t ascend).
    const bool scale = !pr.greedy && pr.temperature != 1.0f;
    float m = -INFINITY;
    int bad = 0x7fffffff, first_max = 0x7fffffff;
    walk_row(row, vocab, [&](int t, float l) {
        if (scale) {
            l = __fdiv_rn(l, pr.temperature);
            row[t] = l;
        }
        if (l != l || l == INFINITY) bad = min(bad, t);
        if (l > m) {
            m = l;
            first_max = t;
        }
    });
    bad = block_min_i32(bad, sh);
    float block_m = block_max_f32(m, sh);
    first_max = block_min_i32(m == block_m ? first_max : 0x7fffffff, sh);
    m = block_m;
    if (bad != 0x7fffffff || m == -INFINITY) {
        if (tid == 0) write_failure(res, bad, bad != 0x7fffffff ? row[bad] : 0.0f);
        return;
    }
    if (pr.greedy && !pr.logprob && pr.top_n == 0) {
        if (tid == 0) write_token(res, (u32)first_max);
        return;
    }

    // Probabilities and the normalizer (each thread's terms added in its walk's order).
    double acc = 0.0;
    auto probability = [&](int t, float l) {
        float p = host_expf(__fsub_rn(l, m), sh.exp_table);
        if (!pr.greedy) prow[t] = p;
        acc = __dadd_rn(acc, (double)p);
        return p;
    };
    // A draw with no top-k, top-p or min-p keeps every token with p > 0, whose mass is the
    // normalizer (below). Its first histogram pass (select_key's: every member, the top digit)
    // is then built on this walk, which visits the groups of 32 tokens in select_key's order
    // (warp w: groups w, w + SAMPLE_WARPS, ...; walk_row's tokens for each thread), so the sums
    // are the pass's own: a walk over the row fewer.
    const bool untruncated = !pr.greedy && pr.top_k <= 0 && !(pr.top_p < 1.0f) && !(pr.min_p > 0.0f);
    if (untruncated) {
        const int lane = tid & 31, warp = tid >> 5;
        clear_histogram(sh);
        __syncthreads();
        for (int base0 = warp * 32; base0 < vocab; base0 += SAMPLE_THREADS * SAMPLE_BATCH) {
            float lb[SAMPLE_BATCH];
#pragma unroll
            for (int u = 0; u < SAMPLE_BATCH; u++) {
                int t = base0 + u * SAMPLE_THREADS + lane;
                lb[u] = t < vocab ? row[t] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < SAMPLE_BATCH; u++) {
                int base = base0 + u * SAMPLE_THREADS;
                if (base >= vocab) break;  // warp-uniform
                int t = base + lane;
                float p = t < vocab ? probability(t, lb[u]) : 0.0f;
                bool in = t < vocab && p > 0.0f;  // member_of(KIND_PROB) with min_p 0, no limit
                bin_group(sh, warp, lane, in, in ? descending_f32(p) >> 24 : 256u, (double)p);
            }
        }
    } else {
        walk_row(row, vocab, [&](int t, float l) { probability(t, l); });
    }
    double total = block_sum_f64(acc, sh);
    RowView view;
    view.l = row;
    view.p = prow;
    view.vocab = vocab;
    view.min_p = pr.min_p;
    view.lse = __dadd_rn((double)m, contract_ln(total));
    view.limit = NO_KEY;
    __syncthreads();  // prow is read across threads from here on

    u32 token;
    if (pr.greedy) {
        token = (u32)first_max;
    } else {
        if (pr.top_k > 0) {
            u64 k = select_key(view, KIND_PROB, 0, (double)pr.top_k, 0, sh);
            if (k != NO_KEY) view.limit = k;
        }
        if (pr.top_p < 1.0f) {
            u64 k = select_key(view, KIND_PROB, 1, (double)pr.top_p * total, 0, sh);
            if (k != NO_KEY) view.limit = k;
        }
        // Untruncated, the members are the tokens with p > 0, and their mass in member_mass's
        // order is the normalizer: the same terms in the same walk and tree, less p == 0 ones,
        // whose +0.0 changes no sum. Its walk is left out, and the draw's first histogram is
        // the probabilities' walk's.
        double mass = untruncated ? total : member_mass(view, sh);
        u64 k = select_key(view, KIND_PROB, 1, pr.u * mass, 1, sh, untruncated);
        if (k == NO_KEY) k = member_max_key(view, sh);
        token = (u32)k;
    }
    float lp = logprob_of(row[token], view.lse);

    int n = min(pr.top_n, vocab);
    if (n > 0) {
        RowView all = view;
        all.limit = NO_KEY;
        u64 last = select_key(all, KIND_LOGPROB, 0, (double)n, 0, sh);
        all.limit = last;
        n = gather_sorted(all, KIND_LOGPROB, 0, 0, sh);
        TopEntry* out = tops + (u64)(first_slot + blockIdx.x) * top_stride;
        for (int i = tid; i < n; i += SAMPLE_THREADS) {
            u32 t = (u32)sh.u.keys[i];
            out[i].token = t;
            out[i].logprob = logprob_of(row[t], view.lse);
        }
    }
    if (tid == 0) {
        write_token(res, token, lp, (u32)max(n, 0));
    }
}

// Greedy rows without logprobs or top-N, each row split over `splits` blocks (grid (splits,
// rows)): block s processes and walks tokens [s * chunk, (s + 1) * chunk), chunk =
// ceil(vocab / splits), and leaves its largest logit, that logit's first token and its first
// non-finite token in `parts`; the row's last block to finish (a ticket in `tickets`, zero
// between launches) combines the parts in token order. A maximum and a first index do not
// depend on how the row is cut: the token and the errors are sample_rows' (and the CPU's).
// At few rows, one block a row walked 151,936 logits from one SM.
#define ARGMAX_THREADS 256
#define ARGMAX_WARPS (ARGMAX_THREADS / 32)
#define ARGMAX_BATCH 8

struct ArgmaxPart {
    float max;
    int first_max;
    int bad;
    int pad;
};

// The (max, first index) of two candidates: the larger logit, the lower index on ties.
__device__ __forceinline__ void argmax_pick(float& m, int& i, float m2, int i2) {
    if (m2 > m || (m2 == m && i2 < i)) {
        m = m2;
        i = i2;
    }
}

__device__ __forceinline__ void warp_argmax(float& m, int& i, int& bad) {
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        bad = min(bad, __shfl_xor_sync(0xffffffffu, bad, o));
        argmax_pick(m, i, m2, i2);
    }
}

extern "C" __global__ __launch_bounds__(ARGMAX_THREADS) void argmax_rows(float* logits, int vocab, const RowParams* params, const PenaltyEntry* penalties,
                int splits, ArgmaxPart* parts, u32* tickets, int first_slot, RowResult* results) {
    pdl_entry();
    __shared__ float red_m[ARGMAX_WARPS];
    __shared__ int red_i[ARGMAX_WARPS], red_bad[ARGMAX_WARPS];
    __shared__ bool last;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int r = blockIdx.y, s = blockIdx.x;
    const RowParams pr = params[r];
    float* row = logits + (u64)pr.logits_row * vocab;
    const int chunk = (vocab + splits - 1) / splits;
    const int lo = s * chunk, hi = min(vocab, lo + chunk);

    apply_penalties(row, pr, penalties, lo, hi, ARGMAX_THREADS);  // this block's tokens'

    float m = -INFINITY;
    int first = 0x7fffffff, bad = 0x7fffffff;
    for (int t0 = lo + tid; t0 < hi; t0 += ARGMAX_THREADS * ARGMAX_BATCH) {
        float lb[ARGMAX_BATCH];
#pragma unroll
        for (int u = 0; u < ARGMAX_BATCH; u++) {
            int t = t0 + u * ARGMAX_THREADS;
            lb[u] = t < hi ? row[t] : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < ARGMAX_BATCH; u++) {
            int t = t0 + u * ARGMAX_THREADS;
            float l = lb[u];
            if (t < hi && (l != l || l == INFINITY)) bad = min(bad, t);
            if (l > m) {
                m = l;
                first = t;
            }
        }
    }
    warp_argmax(m, first, bad);
    if (lane == 0) {
        red_m[warp] = m;
        red_i[warp] = first;
        red_bad[warp] = bad;
    }
    __syncthreads();
    ArgmaxPart* row_parts = parts + (u64)r * splits;
    if (tid == 0) {
        for (int w = 1; w < ARGMAX_WARPS; w++) {
            argmax_pick(m, first, red_m[w], red_i[w]);
            bad = min(bad, red_bad[w]);
        }
        row_parts[s] = ArgmaxPart{m, first, bad, 0};
        __threadfence();  // the part is visible before the ticket counts it
        last = atomicAdd(&tickets[r], 1u) == (u32)(splits - 1);
    }
    __syncthreads();
    if (!last || warp != 0) return;

    // The row's last block: every part (read from L2, where the other blocks' writes are), a
    // lane's in token order, then the lanes' by argmax_pick (which keeps the lower index).
    __threadfence();
    m = -INFINITY;
    first = 0x7fffffff;
    bad = 0x7fffffff;
    for (int p = lane; p < splits; p += 32) {
        int4 q = __ldcg(reinterpret_cast<const int4*>(row_parts + p));
        argmax_pick(m, first, __int_as_float(q.x), q.y);
        bad = min(bad, q.z);
    }
    warp_argmax(m, first, bad);
    if (lane == 0) {
        RowResult* res = results + first_slot + r;
        if (bad != 0x7fffffff || m == -INFINITY) {
            write_failure(res, bad, bad != 0x7fffffff ? __ldcg(row + bad) : 0.0f);
        } else {
            write_token(res, (u32)first);
        }
        tickets[r] = 0;  // for the next launch, which the stream orders after this one
    }
}
