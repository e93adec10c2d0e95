//! The counter-based RNG behind every draw: a pure function of (seed, sample index, output
//! position), so a token never depends on the batch, the step or the thread that drew it.
//!
//! The function is spelled out exactly so a GPU sampler can reproduce it bit for bit:
//! ```text
//! mix(z)  = SplitMix64 finalizer (Stafford variant 13)
//! h       = mix(seed + G)
//! h       = mix(h ^ mix(sample_index + 2G))
//! h       = mix(h ^ mix(position + 3G))          all additions wrap mod 2^64
//! uniform = (h >> 11) * 2^-53                    in [0, 1), 53 random bits
//! ```
//! with G = 0x9E3779B97F4A7C15 (the golden-ratio increment of SplitMix64).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijection on u64 with full avalanche.
#[inline]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The 64 random bits for the token at output `position` of sample `sample_index`.
#[inline]
fn draw_bits(seed: u64, sample_index: u64, position: u64) -> u64 {
    // Each coordinate is mixed on its own before it is combined, so neighbouring indices and
    // positions (the common case: 0, 1, 2, ...) land on unrelated states.
    let mut h = mix64(seed.wrapping_add(GOLDEN_GAMMA));
    h = mix64(h ^ mix64(sample_index.wrapping_add(GOLDEN_GAMMA.wrapping_mul(2))));
    mix64(h ^ mix64(position.wrapping_add(GOLDEN_GAMMA.wrapping_mul(3))))
}

/// The uniform in [0, 1) used to sample the token at output `position` (0 = first generated
/// token) of sample `sample_index` (0..n) of a request seeded with `seed`.
#[inline]
pub fn uniform(seed: u64, sample_index: u64, position: u64) -> f64 {
    (draw_bits(seed, sample_index, position) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A fresh seed for a request that sent no `sampling_seed`. Drawn once per request at
/// admission: from then on its tokens are again a pure function of the seed.
pub fn random_seed() -> u64 {
    // No RNG dependency needed: std's RandomState is keyed from OS randomness, and the
    // counter and clock keep two calls within one process (or one nanosecond) apart.
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    mix64(h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_is_pure_and_in_range() {
        for p in 0..1000u64 {
            let u = uniform(42, 3, p);
            assert!((0.0..1.0).contains(&u));
            assert_eq!(u.to_bits(), uniform(42, 3, p).to_bits());
        }
        // Each coordinate matters.
        assert_ne!(uniform(1, 0, 0), uniform(2, 0, 0));
        assert_ne!(uniform(1, 0, 0), uniform(1, 1, 0));
        assert_ne!(uniform(1, 0, 0), uniform(1, 0, 1));
        assert_ne!(
            uniform(1, 1, 0),
            uniform(1, 0, 1),
            "index and position are not symmetric"
        );
    }

    #[test]
    fn uniform_is_uniform_over_positions() {
        // 16 buckets, 160k draws: each count is Binomial(160000, 1/16), sd ~ 97. A 6-sd band
        // (+-580) fails by chance with probability ~1e-8 per bucket.
        let n = 160_000u64;
        let mut buckets = [0u64; 16];
        let mut sum = 0.0;
        for p in 0..n {
            let u = uniform(7, 0, p);
            buckets[(u * 16.0) as usize] += 1;
            sum += u;
        }
        for (i, &c) in buckets.iter().enumerate() {
            assert!((c as i64 - 10_000).abs() < 580, "bucket {i} has {c}");
        }
        // Mean: sd = sqrt(1/12 / n) ~ 7.2e-4.
        assert!((sum / n as f64 - 0.5).abs() < 6.0 * 7.3e-4);
    }

    #[test]
    fn random_seeds_differ() {
        let a = random_seed();
        let b = random_seed();
        assert_ne!(a, b);
    }
}
