//! Helpers of the GPU test binaries (tests/cuda_*.rs): fresh random data, the device, and the
//! error measure every CPU-reference comparison uses.

use cudarc::driver::CudaSlice;
use lockstep::backend::cuda::ops::{self, GemmPath, GemmRows, Nvfp4Out, SplitK};
use lockstep::backend::cuda::weights::{Activation, GpuMatrix};
use lockstep::backend::cuda::Gpu;
use lockstep::quant::nvfp4::ScaleGranularity;
use lockstep::quant::{Format, TensorFormat};

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
    let s = lockstep::testing::test_seed() | 1;
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

/// The GEMM input of a layer whose activations are `act`, for `rows` rows of x (`k` wide): x
/// itself (plain layers), or, as the model does, its per-token quantization's exact dequantized
/// values (and, for NVFP4, the row scales).
pub struct LayerInput {
    pub x: CudaSlice<f32>,
    pub row_scale: Option<CudaSlice<f32>>,
}

pub fn layer_input(g: &Gpu, act: Activation, x: &[f32], rows: usize, k: usize) -> LayerInput {
    let dx = g.upload(x).unwrap();
    let (mut data, mut scales) = (
        g.alloc::<u8>(rows * k).unwrap(),
        g.alloc::<u8>(rows * k / 16).unwrap(),
    );
    let mut deq = g.alloc::<f32>(rows * k).unwrap();
    match act {
        Activation::Plain => LayerInput {
            x: dx,
            row_scale: None,
        },
        Activation::Mxfp8 => {
            ops::mxfp8_quantize(g, &dx, rows * k, &mut data, &mut scales, Some(&mut deq)).unwrap();
            LayerInput {
                x: deq,
                row_scale: None,
            }
        }
        Activation::Nvfp4 { per_token, params } => {
            assert!(per_token, "the recipes' default");
            let mut row_scale = g.alloc::<f32>(rows).unwrap();
            ops::nvfp4_quantize_f32(
                g,
                &dx,
                rows,
                k,
                true,
                None,
                params,
                Nvfp4Out {
                    data: &mut data,
                    scales: &mut scales,
                    row_s_dec: &mut row_scale,
                    deq: Some(&mut deq),
                    words: None,
                },
            )
            .unwrap();
            LayerInput {
                x: deq,
                row_scale: Some(row_scale),
            }
        }
    }
}

/// `grouped_gemm_on(path, split, ..)` of `input` (its row scales with it) over `m`: the
/// `out_rows` x `m.n` output, into a buffer first filled with NaN.
#[allow(clippy::too_many_arguments)]
pub fn gemm_on(
    g: &Gpu,
    (path, split): (GemmPath, SplitK),
    input: &LayerInput,
    row_index: Option<&CudaSlice<i32>>,
    m: &GpuMatrix,
    rows: GemmRows<'_>,
    out_rows: usize,
) -> Vec<f32> {
    let mut out = poisoned(g, out_rows * m.n, f32::NAN);
    ops::grouped_gemm_on(
        path,
        split,
        g,
        &input.x,
        row_index,
        input.row_scale.as_ref(),
        &m.data,
        rows,
        out_rows,
        m.n,
        m.k,
        &mut out,
    )
    .unwrap();
    g.download(&out, out_rows * m.n).unwrap()
}

/// BF16, MXFP8 and NVFP4 (per-token activations): the recipes' expert formats.
pub fn expert_formats() -> [TensorFormat; 3] {
    [
        TensorFormat::BF16,
        TensorFormat {
            format: Format::Mxfp8,
            ..TensorFormat::BF16
        },
        TensorFormat {
            format: Format::Nvfp4,
            activation_scale: ScaleGranularity::PerToken,
            four_over_six: None,
        },
    ]
}
