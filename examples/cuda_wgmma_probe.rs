//! Does Hopper's `wgmma` add BF16 products with the same bits as the `mma.sync` K chain every
//! tensor-core GEMM here uses? The answer decides how a wgmma GEMM can join the batch-invariant
//! kernels (docs/determinism.md): if its k16 step rounds like mma.sync's, a wgmma tile and the
//! few-rows mma.sync kernels can serve different row counts and keep every bit.
//!
//! cargo run --release --example cuda_wgmma_probe [-- TRIALS]
//!
//! Each trial (one warpgroup) sums C0[r][n] + sum_k X[r][k] W[n][k] for 64 x 64 outputs over
//! K = 256 in k16 steps, in the same order, eight ways (examples/wgmma_probe.cu): mma.sync with
//! X as A (the reference), wgmma with X from registers or shared memory, and the transposed
//! products (W as A) on wgmma and mma.sync; then mma.sync with each step's 16 k values moved to
//! other slots of the step (the same products): whether a step's bits depend on which slot
//! holds which product, or only on which products a step holds, decides whether the K chain's
//! order within a step (kernels/gemm.cu) could follow a plain row-major layout in shared memory
//! (weights copied by the TMA unit as they lie, for an all-shared-memory wgmma). It prints, per
//! data kind, how many outputs differ
//! from the reference in any bit and the largest difference in units of the reference's last
//! place. Data: fresh random BF16 (seeded from the clock, printed), drawn to stress the
//! tensor cores' alignment and rounding: wide exponent ranges, cancellation, and activations
//! split into hi + lo BF16 terms as plain BF16 layers feed them.

use std::time::{SystemTime, UNIX_EPOCH};

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

const SOURCE: &str = include_str!("wgmma_probe.cu");
const K: usize = 256;
const VARIANTS: [&str; 8] = [
    "mma.sync, A = X (reference)",
    "wgmma, A = X in registers",
    "wgmma, A = X in shared memory",
    "wgmma, A = W in registers (transposed)",
    "mma.sync, A = W (transposed)",
    "mma.sync, each half's 8 slots reversed",
    "mma.sync, the two halves of 8 slots swapped",
    "mma.sync, slot s takes k (5s + 3) mod 16",
];

/// xorshift64*: enough for test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.unit().max(1e-7), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
    /// A random BF16 value with a binary exponent in [lo, hi] and a random sign.
    fn spread(&mut self, lo: i32, hi: i32) -> u16 {
        let e = lo + (self.next() % (hi - lo + 1) as u64) as i32;
        let sign = (self.next() & 1) as u16;
        let mant = (self.next() & 0x7f) as u16;
        sign << 15 | (((e + 127) as u16) << 7) | mant
    }
}

fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

fn bf16_value(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// One trial's X, W and C0 of data kind `kind`.
fn draw(kind: &str, rng: &mut Rng) -> (Vec<u16>, Vec<u16>, Vec<f32>) {
    let n = 64 * K;
    let (mut x, mut w) = (vec![0u16; n], vec![0u16; n]);
    let mut c0 = vec![0f32; 64 * 64];
    match kind {
        "normal" => {
            for v in x.iter_mut().chain(w.iter_mut()) {
                *v = bf16_bits(rng.normal());
            }
        }
        "wide exponents" => {
            for v in x.iter_mut().chain(w.iter_mut()) {
                *v = rng.spread(-20, 20);
            }
            for c in &mut c0 {
                *c = bf16_value(rng.spread(-10, 30)) * (1.0 + rng.unit());
            }
        }
        "cancellation" => {
            // Pairs of equal products of opposite signs around small ones.
            for r in 0..64 {
                for k in (0..K).step_by(2) {
                    let big = rng.spread(5, 12);
                    x[r * K + k] = big;
                    x[r * K + k + 1] = big ^ 0x8000;
                }
            }
            for v in &mut w {
                *v = rng.spread(-3, 3);
            }
            for r in 0..64 {
                for k in (0..K).step_by(2) {
                    w[r * K + k + 1] = w[r * K + k] ^ (rng.next() as u16 & 1);
                }
            }
            for c in &mut c0 {
                *c = rng.normal() * 1e-3;
            }
        }
        _ => {
            // "hi + lo": activations f32 ~ N(0, 1) split as a plain BF16 layer feeds them,
            // hi in even k, lo in odd k; weights ~ N(0, 0.02).
            for r in 0..64 {
                for k in (0..K).step_by(2) {
                    let v = rng.normal();
                    let hi = bf16_bits(v);
                    x[r * K + k] = hi;
                    x[r * K + k + 1] = bf16_bits(v - bf16_value(hi));
                }
            }
            for v in &mut w {
                *v = bf16_bits(rng.normal() * 0.02);
            }
        }
    }
    (x, w, c0)
}

/// The distance between two finite f32 values in units in the last place of `r`.
fn ulps(a: f32, r: f32) -> f64 {
    if a == r {
        return 0.0;
    }
    let ulp = (f32::from_bits(r.abs().to_bits() + 1) - r.abs()) as f64;
    ((a as f64 - r as f64) / ulp).abs()
}

fn main() {
    let trials: usize = std::env::args()
        .nth(1)
        .map_or(128, |t| t.parse().expect("TRIALS"));
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as u64
        | 1;
    println!("seed {seed:#x}, {trials} trials of 64 x 64 outputs, K = {K}, per data kind");
    let ctx = CudaContext::new(0).expect("CUDA device 0");
    let stream = ctx.default_stream();
    let opts = CompileOptions {
        arch: Some("sm_90a"),
        options: vec!["-std=c++17".into()],
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(SOURCE, opts).expect("NVRTC");
    let module = ctx.load_module(ptx).expect("module");
    let f = module.load_function("probe").expect("probe");
    let mut rng = Rng(seed);
    // (LBO, SBO): the core-matrix strides along K and along rows of a no-swizzle K-major
    // descriptor (a layout read the wrong way shows as gross differences, not last-place
    // ones): packed core matrices, 8-k groups 1 KiB apart, and 1,056 bytes apart (the GEMM
    // kernel's padded pieces: core matrices 16-byte but not 128-byte aligned). LBO 0: the
    // 64-byte swizzle, rows of 64 bytes, 8-row groups 512 bytes apart (examples/wgmma_probe.cu
    // `to_smem`).
    for (lbo, sbo) in [(128i32, 256i32), (1024, 128), (1056, 128), (0, 512)] {
        if lbo == 0 {
            println!("\ndescriptor with the 64-byte swizzle, SBO {sbo}");
        } else {
            println!("\ndescriptor LBO {lbo}, SBO {sbo}");
        }
        println!("| data | variant | outputs differing | largest difference (ulp) |");
        println!("|---|---|---|---|");
        for kind in ["normal", "wide exponents", "cancellation", "hi + lo"] {
            let (mut xs, mut ws, mut cs) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..trials {
                let (x, w, c) = draw(kind, &mut rng);
                xs.extend(x);
                ws.extend(w);
                cs.extend(c);
            }
            let x = stream.clone_htod(&xs).expect("upload");
            let w = stream.clone_htod(&ws).expect("upload");
            let c0 = stream.clone_htod(&cs).expect("upload");
            let mut out = stream
                .alloc_zeros::<f32>(trials * VARIANTS.len() * 4096)
                .expect("alloc");
            let cfg = LaunchConfig {
                grid_dim: (trials as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let k = K as i32;
            let mut b = stream.launch_builder(&f);
            b.arg(&x)
                .arg(&w)
                .arg(&c0)
                .arg(&k)
                .arg(&lbo)
                .arg(&sbo)
                .arg(&mut out);
            // SAFETY: the arguments match probe's signature; every buffer holds `trials`
            // trials' worth of what the kernel reads and writes.
            unsafe { b.launch(cfg) }.expect("launch");
            let host = stream.clone_dtoh(&out).expect("download");
            for (v, name) in VARIANTS.iter().enumerate().skip(1) {
                let (mut differ, mut worst) = (0usize, 0f64);
                for trial in 0..trials {
                    let base = trial * VARIANTS.len() * 4096;
                    for i in 0..4096 {
                        let (r, a) = (host[base + i], host[base + v * 4096 + i]);
                        if r.to_bits() != a.to_bits() {
                            differ += 1;
                            worst = worst.max(ulps(a, r));
                        }
                    }
                }
                println!(
                    "| {kind} | {name} | {differ} of {} | {worst:.0} |",
                    trials * 4096
                );
            }
        }
    }
}
