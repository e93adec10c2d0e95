//! Linear layers on the CPU in every weight format of the contract.
//!
//! Each output element is one dot product in a fixed order (8 interleaved f32 partial sums,
//! reduced in a fixed tree), so it does not depend on the batch or the thread count. The
//! quantized formats follow the contract: activations are quantized per row with the `quant`
//! module, operands are dequantized per block (exact), products accumulated in f32, and the
//! second-level scales (per-token, then weight) applied after accumulation.

use half::bf16;
use rayon::prelude::*;

use crate::backend::Linear;
use crate::quant::{self, Format, GlobalScale, Nvfp4Options, ScaleGranularity, TensorFormat};

/// Dot product with 8 independent accumulators (vectorizes), reduced in a fixed order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8 * 8;
    for (ca, cb) in a[..chunks].chunks_exact(8).zip(b[..chunks].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += ca[i] * cb[i];
        }
    }
    for (i, (x, y)) in a[chunks..].iter().zip(&b[chunks..]).enumerate() {
        acc[i] += x * y;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `out[r, n] = dot(x[r], w_row(n))` with output features split over threads.
fn gemm_rows(
    x: &[f32],
    rows: usize,
    k: usize,
    n_out: usize,
    out: &mut [f32],
    w_row: impl Fn(usize, &mut [f32]) + Sync,
) {
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(out.len(), rows * n_out);
    // Work on column tiles so each weight row is widened once and reused for every token.
    const TILE: usize = 16;
    let tiles: Vec<(usize, Vec<f32>)> = (0..n_out.div_ceil(TILE))
        .into_par_iter()
        .map(|t| {
            let n0 = t * TILE;
            let n1 = (n0 + TILE).min(n_out);
            let mut w = vec![0f32; k];
            let mut res = vec![0f32; rows * (n1 - n0)];
            for n in n0..n1 {
                w_row(n, &mut w);
                for r in 0..rows {
                    res[r * (n1 - n0) + (n - n0)] = dot(&x[r * k..][..k], &w);
                }
            }
            (n0, res)
        })
        .collect();
    for (n0, res) in tiles {
        let width = res.len() / rows.max(1);
        for r in 0..rows {
            out[r * n_out + n0..][..width].copy_from_slice(&res[r * width..][..width]);
        }
    }
}

/// Dense weights kept as f32 (F32 checkpoints: the exact reference path).
pub struct DenseF32 {
    pub weight: Vec<f32>,
    pub out_features: usize,
    pub in_features: usize,
}

impl Linear for DenseF32 {
    fn in_features(&self) -> usize {
        self.in_features
    }
    fn out_features(&self) -> usize {
        self.out_features
    }
    fn format(&self) -> Format {
        Format::Bf16
    }
    fn forward(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        let k = self.in_features;
        gemm_rows(x, rows, k, self.out_features, out, |n, w| {
            w.copy_from_slice(&self.weight[n * k..][..k])
        });
    }
    fn dequantized_weight(&self) -> Vec<f32> {
        self.weight.clone()
    }
    fn storage_bytes(&self) -> usize {
        self.weight.len() * 4
    }
}

/// Dense BF16 weights, widened to f32 inside the kernel.
pub struct DenseBf16 {
    pub weight: Vec<bf16>,
    pub out_features: usize,
    pub in_features: usize,
}

impl Linear for DenseBf16 {
    fn in_features(&self) -> usize {
        self.in_features
    }
    fn out_features(&self) -> usize {
        self.out_features
    }
    fn format(&self) -> Format {
        Format::Bf16
    }
    fn forward(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        let k = self.in_features;
        gemm_rows(x, rows, k, self.out_features, out, |n, w| {
            for (d, s) in w.iter_mut().zip(&self.weight[n * k..][..k]) {
                *d = s.to_f32();
            }
        });
    }
    fn dequantized_weight(&self) -> Vec<f32> {
        self.weight.iter().map(|v| v.to_f32()).collect()
    }
    fn storage_bytes(&self) -> usize {
        self.weight.len() * 2
    }
}

/// MXFP8 weights (rowwise, blocks along K); activations quantized MXFP8 1x32 per row.
pub struct Mxfp8Linear {
    pub weight: quant::Mxfp8Tensor,
}

impl Linear for Mxfp8Linear {
    fn in_features(&self) -> usize {
        self.weight.cols
    }
    fn out_features(&self) -> usize {
        self.weight.rows
    }
    fn format(&self) -> Format {
        Format::Mxfp8
    }
    fn forward(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        let k = self.weight.cols;
        // The block scales are powers of two, so dequantized operands are exact and their
        // products accumulate exactly as the block-scaled MMA would.
        let xq = quant::mxfp8::quantize_rowwise(x, rows, k)
            .expect("activation width is a multiple of 32")
            .dequantize();
        let w = &self.weight;
        gemm_rows(&xq, rows, k, w.rows, out, |n, row| {
            for (c, d) in row.iter_mut().enumerate() {
                *d = quant::codec::e4m3_decode(w.data[n * k + c])
                    * quant::codec::e8m0_decode(w.scales[n * (k / 32) + c / 32]);
            }
        });
    }
    fn dequantized_weight(&self) -> Vec<f32> {
        self.weight.dequantize()
    }
    fn storage_bytes(&self) -> usize {
        self.weight.data.len() + self.weight.scales.len()
    }
}

/// NVFP4 weights (per-tensor second-level scale); activations quantized NVFP4 per token
/// (or per tensor when the recipe says so).
pub struct Nvfp4Linear {
    pub weight: quant::Nvfp4Tensor,
    /// Block-scaled weight values `e2m1 * e4m3` (exact), widened once at load: the operand the
    /// tensor cores see. S_dec of the weight is applied after accumulation.
    block_scaled: Vec<bf16>,
    pub activation_scale: ScaleGranularity,
    pub four_over_six: Option<quant::FourOverSix>,
}

impl Nvfp4Linear {
    pub fn new(weight: quant::Nvfp4Tensor, fmt: &TensorFormat) -> Nvfp4Linear {
        // e2m1 * e4m3 has at most 5 significant bits: exact in BF16, so this cache loses nothing.
        let block_scaled = weight
            .block_scaled_values()
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        Nvfp4Linear {
            weight,
            block_scaled,
            activation_scale: fmt.activation_scale,
            four_over_six: fmt.four_over_six,
        }
    }

    pub fn weight_scale(&self) -> f32 {
        self.weight.global.of_row(0)
    }
}

impl Linear for Nvfp4Linear {
    fn in_features(&self) -> usize {
        self.weight.cols
    }
    fn out_features(&self) -> usize {
        self.weight.rows
    }
    fn format(&self) -> Format {
        Format::Nvfp4
    }
    fn forward(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        let k = self.weight.cols;
        let xq = quant::nvfp4::quantize(
            x,
            rows,
            k,
            &Nvfp4Options {
                granularity: self.activation_scale,
                four_over_six: self.four_over_six,
            },
        )
        .expect("activation width is a multiple of 16");
        let xs = xq.block_scaled_values();
        gemm_rows(&xs, rows, k, self.weight.rows, out, |n, row| {
            for (d, s) in row.iter_mut().zip(&self.block_scaled[n * k..][..k]) {
                *d = s.to_f32();
            }
        });
        let s_w = self.weight_scale();
        for r in 0..rows {
            let s_tok = match &xq.global {
                GlobalScale::PerTensor(s) => *s,
                GlobalScale::PerToken(v) => v[r],
            };
            // Contract order: acc * s_tok * s_w, two f32 multiplies.
            for o in &mut out[r * self.weight.rows..][..self.weight.rows] {
                *o = *o * s_tok * s_w;
            }
        }
    }
    fn dequantized_weight(&self) -> Vec<f32> {
        self.weight.dequantize()
    }
    fn storage_bytes(&self) -> usize {
        self.weight.data.len() + self.weight.scales.len() + 4
    }
}

/// High-precision source weights of one linear layer, before the recipe decides its format.
pub enum DenseWeight {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl DenseWeight {
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            DenseWeight::F32(v) => v.clone(),
            DenseWeight::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

/// The factory: a high-precision weight -> the linear op of its recipe format. `shared_s_enc`
/// carries the gate/up joint second-level scale for NVFP4 experts.
pub fn make_linear(
    w: DenseWeight,
    out_features: usize,
    in_features: usize,
    fmt: &TensorFormat,
    shared_level: Option<quant::nvfp4::SecondLevel>,
) -> Box<dyn Linear> {
    match fmt.format {
        Format::Bf16 => match w {
            DenseWeight::F32(weight) => Box::new(DenseF32 {
                weight,
                out_features,
                in_features,
            }),
            DenseWeight::Bf16(weight) => Box::new(DenseBf16 {
                weight,
                out_features,
                in_features,
            }),
        },
        Format::Mxfp8 => {
            let x = w.to_f32();
            Box::new(Mxfp8Linear {
                weight: quant::mxfp8::quantize_rowwise(&x, out_features, in_features)
                    .expect("checked block alignment"),
            })
        }
        Format::Nvfp4 => {
            let x = w.to_f32();
            let q = match shared_level {
                Some(level) => quant::nvfp4::quantize_with_level(
                    &x,
                    out_features,
                    in_features,
                    level,
                    fmt.four_over_six,
                ),
                None => quant::nvfp4::quantize(
                    &x,
                    out_features,
                    in_features,
                    &Nvfp4Options {
                        granularity: ScaleGranularity::PerTensor,
                        four_over_six: fmt.four_over_six,
                    },
                )
                .expect("checked block alignment"),
            };
            Box::new(Nvfp4Linear::new(q, fmt))
        }
    }
}
