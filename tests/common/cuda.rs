//! Helpers of the GPU test binaries (tests/cuda_*.rs): fresh random data, the device, and the
//! error measure every CPU-reference comparison uses.

use lockstep::backend::cuda::Gpu;

/// xorshift64*: fresh but reproducible data; the seed changes per run and is printed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// In [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// In [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        self.unit() * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
}

/// A fresh odd seed per run (`LOCKSTEP_TEST_SEED` replays one), printed.
pub fn seed() -> u64 {
    let s = std::env::var("LOCKSTEP_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
        | 1;
    println!("seed {s}");
    s
}

pub fn gpu() -> Gpu {
    Gpu::open(0).expect("a CUDA device")
}

/// ||got - want|| / ||want||, and every output finite.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// A device buffer filled with `v`, so a kernel that skips an element is caught.
pub fn poisoned<T>(g: &Gpu, n: usize, v: T) -> cudarc::driver::CudaSlice<T>
where
    T: cudarc::driver::DeviceRepr + Clone,
{
    g.upload(&vec![v; n]).unwrap()
}
