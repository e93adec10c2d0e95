// xxh3_64 (seed 0, the default secret) of byte ranges in device memory, bit for bit what the
// `xxhash` crates compute: the checksum's tensor hash (src/model/checksum.rs), taken where a
// colocated trainer's tensors lie instead of through the host link.
//
// One block per range. Past 240 bytes, xxh3 runs 8 accumulators over 1024-byte blocks of 16
// stripes and scrambles them after each block. Within a block every stripe only adds to the
// accumulators (wrapping u64 sums), so each thread computes one block's sums on its own; eight
// threads then fold them in, block after block, with the scramble between (the only serial
// part: a few integer operations per 1 KiB). The tail and the sizes up to 240 bytes run on one
// thread, as the reference does.

#define HASH_THREADS 256

__constant__ u8 XXH3_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define XXH_PRIME32_1 0x9E3779B1ull
#define XXH_PRIME32_2 0x85EBCA77ull
#define XXH_PRIME32_3 0xC2B2AE3Dull
#define XXH_PRIME64_1 0x9E3779B185EBCA87ull
#define XXH_PRIME64_2 0xC2B2AE3D27D4EB4Full
#define XXH_PRIME64_3 0x165667B19E3779F9ull
#define XXH_PRIME64_4 0x85EBCA77C2B2AE63ull
#define XXH_PRIME64_5 0x27D4EB2F165667C5ull

// Little-endian loads at any alignment.
__device__ __forceinline__ u64 rd64(const u8* p) {
    u64 v = 0;
#pragma unroll
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

__device__ __forceinline__ u32 rd32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__device__ __forceinline__ u64 secret64(int at) { return rd64(XXH3_SECRET + at); }

__device__ __forceinline__ u64 mul128_fold64(u64 a, u64 b) { return (a * b) ^ __umul64hi(a, b); }

__device__ __forceinline__ u64 xxh3_avalanche(u64 h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    return h ^ (h >> 32);
}

__device__ __forceinline__ u64 xxh64_avalanche(u64 h) {
    h ^= h >> 33;
    h *= XXH_PRIME64_2;
    h ^= h >> 29;
    h *= XXH_PRIME64_3;
    return h ^ (h >> 32);
}

__device__ __forceinline__ u64 bswap64(u64 v) {
    return ((u64)__byte_perm((u32)v, 0, 0x0123) << 32) | __byte_perm((u32)(v >> 32), 0, 0x0123);
}

__device__ __forceinline__ u64 rotl64(u64 v, int r) { return (v << r) | (v >> (64 - r)); }

__device__ __forceinline__ u64 mix16(const u8* in, int secret_at) {
    return mul128_fold64(rd64(in) ^ secret64(secret_at), rd64(in + 8) ^ secret64(secret_at + 8));
}

// Lengths 0..=240, on one thread.
__device__ u64 xxh3_short(const u8* p, u64 len) {
    if (len == 0) return xxh64_avalanche(secret64(56) ^ secret64(64));
    if (len <= 3) {
        u32 combo = ((u32)p[0] << 16) | ((u32)p[len >> 1] << 24) | (u32)p[len - 1] | ((u32)len << 8);
        u64 flip = (u64)(rd32(XXH3_SECRET) ^ rd32(XXH3_SECRET + 4));
        return xxh64_avalanche((u64)combo ^ flip);
    }
    if (len <= 8) {
        u64 flip = secret64(8) ^ secret64(16);
        u64 x = ((u64)rd32(p + len - 4) + ((u64)rd32(p) << 32)) ^ flip;
        x ^= rotl64(x, 49) ^ rotl64(x, 24);
        x *= 0x9FB21C651E98DF25ull;
        x ^= (x >> 35) + len;
        x *= 0x9FB21C651E98DF25ull;
        return x ^ (x >> 28);
    }
    if (len <= 16) {
        u64 lo = rd64(p) ^ (secret64(24) ^ secret64(32));
        u64 hi = rd64(p + len - 8) ^ (secret64(40) ^ secret64(48));
        return xxh3_avalanche(len + bswap64(lo) + hi + mul128_fold64(lo, hi));
    }
    u64 acc = len * XXH_PRIME64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += mix16(p + 48, 96);
                    acc += mix16(p + len - 64, 112);
                }
                acc += mix16(p + 32, 64);
                acc += mix16(p + len - 48, 80);
            }
            acc += mix16(p + 16, 32);
            acc += mix16(p + len - 32, 48);
        }
        acc += mix16(p, 0);
        acc += mix16(p + len - 16, 16);
        return xxh3_avalanche(acc);
    }
    int rounds = (int)(len / 16);
    for (int i = 0; i < 8; ++i) acc += mix16(p + 16 * i, 16 * i);
    acc = xxh3_avalanche(acc);
    for (int i = 8; i < rounds; ++i) acc += mix16(p + 16 * i, 16 * (i - 8) + 3);
    acc += mix16(p + len - 16, 136 - 17);
    return xxh3_avalanche(acc);
}

// Adds one 64-byte stripe to the accumulators; `key(i)` is the secret word of lane i.
template <bool ALIGNED, typename Key>
__device__ __forceinline__ void accumulate_stripe(u64 acc[8], const u8* in, Key key) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        u64 v = ALIGNED ? __ldg((const u64*)in + i) : rd64(in + 8 * i);
        u64 k = v ^ key(i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xffffffffull) * (k >> 32);
    }
}

// What one 1024-byte block adds to each accumulator (16 stripes; stripe s, lane i takes the
// secret word at byte 8 * (s + i), `keys[s + i]`).
template <bool ALIGNED>
__device__ void block_sums(const u8* block, const u64* keys, u64 sums[8]) {
#pragma unroll 4
    for (int s = 0; s < 16; ++s)
        accumulate_stripe<ALIGNED>(sums, block + 64 * s, [&](int i) { return keys[s + i]; });
}

// ptrs[r], lens[r]: range r; out[r]: its xxh3_64. Grid: one block of HASH_THREADS per range.
extern "C" __global__ __launch_bounds__(HASH_THREADS) void xxh3_64_ranges(const u64* ptrs, const u64* lens, int n,
                                                                      u64* out) {
    pdl_entry();
    int r = blockIdx.x;
    if (r >= n) return;
    const u8* p = (const u8*)ptrs[r];
    u64 len = lens[r];
    if (len <= 240) {
        if (threadIdx.x == 0) out[r] = xxh3_short(p, len);
        return;
    }
    __shared__ u64 keys[24];
    // One block's sums per thread (9 words apart: fewer bank conflicts than 8).
    __shared__ u64 sums[HASH_THREADS][9];
    __shared__ u64 accs[8];
    int t = threadIdx.x;
    if (t < 24) keys[t] = secret64(8 * t);
    const u64 init[8] = {XXH_PRIME32_3, XXH_PRIME64_1, XXH_PRIME64_2, XXH_PRIME64_3,
                         XXH_PRIME64_4, XXH_PRIME32_2, XXH_PRIME64_5, XXH_PRIME32_1};
    u64 acc = t < 8 ? init[t] : 0;
    __syncthreads();
    bool aligned = ((u64)p & 7) == 0;
    u64 blocks = (len - 1) / 1024;
    for (u64 first = 0; first < blocks; first += HASH_THREADS) {
        if (first + t < blocks) {
            u64 s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            const u8* block = p + (first + t) * 1024;
            if (aligned)
                block_sums<true>(block, keys, s);
            else
                block_sums<false>(block, keys, s);
#pragma unroll
            for (int i = 0; i < 8; ++i) sums[t][i] = s[i];
        }
        __syncthreads();
        if (t < 8) {
            // The blocks in order: accumulator t plus the block's sum, then the scramble
            // with the secret's last 64 bytes.
            u64 m = min((u64)HASH_THREADS, blocks - first), key = keys[16 + t];
            for (u64 j = 0; j < m; ++j) {
                acc += sums[j][t];
                acc ^= acc >> 47;
                acc ^= key;
                acc *= XXH_PRIME32_1;
            }
        }
        __syncthreads();
    }
    if (t < 8) accs[t] = acc;
    __syncthreads();
    if (t != 0) return;
    u64 a[8];
    for (int i = 0; i < 8; ++i) a[i] = accs[i];
    // The last (partial) block's whole stripes, then the input's last 64 bytes.
    const u8* tail = p + blocks * 1024;
    int stripes = (int)(((len - 1) - blocks * 1024) / 64);
    for (int s = 0; s < stripes; ++s)
        accumulate_stripe<false>(a, tail + 64 * s, [&](int i) { return keys[s + i]; });
    accumulate_stripe<false>(a, p + len - 64, [&](int i) { return secret64(192 - 64 - 7 + 8 * i); });
    u64 h = len * XXH_PRIME64_1;
    for (int i = 0; i < 4; ++i)
        h += mul128_fold64(a[2 * i] ^ secret64(11 + 16 * i), a[2 * i + 1] ^ secret64(11 + 16 * i + 8));
    out[r] = xxh3_avalanche(h);
}
