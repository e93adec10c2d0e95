//! The bench's seeded random source: one small generator that makes every random choice
//! (prompt words, lengths, arrival gaps) so that `--seed` reproduces a workload exactly.
//!
//! Hand-written (SplitMix64) rather than `rand` so the stream of numbers for a seed can never
//! change under a dependency upgrade: two runs of the bench months apart must send the same
//! workload for their numbers to be comparable.

pub struct BenchRng {
    state: u64,
}

impl BenchRng {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        // SplitMix64 (Steele, Lea, Flood 2014): passes BigCrush, one add and three
        // xor-multiplies per draw, which is all a load generator needs.
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), with the 53 bits an f64 mantissa holds.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in [lo, hi] (inclusive); `lo` when the range is empty.
    pub fn range_inclusive(&mut self, lo: usize, hi: usize) -> usize {
        if hi <= lo {
            return lo;
        }
        let span = (hi - lo) as u64 + 1;
        // Modulo bias is below span / 2^64, far under anything a benchmark could notice.
        lo + (self.next_u64() % span) as usize
    }

    /// Exponential with the given rate (mean 1 / rate): the gap between Poisson arrivals.
    pub fn exponential(&mut self, rate: f64) -> f64 {
        // 1 - u lies in (0, 1], so the log is finite.
        -(1.0 - self.next_f64()).ln() / rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_different_seed_different_stream() {
        let a: Vec<u64> = {
            let mut r = BenchRng::new(7);
            (0..8).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = BenchRng::new(7);
            (0..8).map(|_| r.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut r = BenchRng::new(8);
            (0..8).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn poisson_inter_arrival_mean_matches_rate() {
        // Exponential(rate 4): mean 0.25 s, standard deviation 0.25 s. Over 200,000 draws the
        // sample mean has standard error 0.25 / sqrt(2e5) = 5.6e-4, so a 1% band (2.5e-3, about
        // 4.5 standard errors) fails by chance less than once in 100,000 runs, while a generator
        // off by a few percent, or using the wrong rate, fails it every time.
        let rate = 4.0;
        let n = 200_000;
        let mut rng = BenchRng::new(1);
        let gaps: Vec<f64> = (0..n).map(|_| rng.exponential(rate)).collect();
        let mean = gaps.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.0025, "mean {mean}");
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n as f64;
        // Exponential: std equals mean. Variance estimate is noisier; 3% band.
        assert!((var.sqrt() - 0.25).abs() < 0.0075, "std {}", var.sqrt());
        assert!(gaps.iter().all(|g| g.is_finite() && *g >= 0.0));
    }

    #[test]
    fn range_is_inclusive_and_covers_both_ends() {
        let mut rng = BenchRng::new(3);
        let draws: Vec<usize> = (0..1000).map(|_| rng.range_inclusive(5, 7)).collect();
        assert!(draws.iter().all(|d| (5..=7).contains(d)));
        for v in 5..=7 {
            assert!(draws.contains(&v));
        }
        assert_eq!(rng.range_inclusive(9, 9), 9);
        assert_eq!(rng.range_inclusive(9, 3), 9);
    }
}
