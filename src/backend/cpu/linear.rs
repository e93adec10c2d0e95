//! Linear layers on the CPU in every weight format of the contract.
//!
//! Each output element is one dot product in a fixed order (8 interleaved f32 partial sums,
//! reduced in a fixed tree), so it does not depend on the batch or the thread count. The
//! quantized formats follow the contract: activations are quantized per row with the `quant`
//! module, operands are dequantized per block (exact), products accumulated in f32, and the
//! second-level scales (per-token, then weight) applied after accumulation.

use half::bf16;
use rayon::prelude::*;

use crate::backend::{Linear, Storage};
pub use crate::quant::slot::DenseWeight;
use crate::quant::slot::{self, Stored};
use crate::quant::{self, Format, GlobalScale, Nvfp4Options, ScaleGranularity, TensorFormat};

/// Dot product with 8 independent accumulators, reduced in a fixed order. The same
/// arithmetic runs as one 8-lane AVX2 vector where the CPU has it (chosen at run time), so
/// results are bit-identical on every x86-64 machine.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { dot_avx2(a, b) };
    }
    dot8(a, b, |v| v)
}

/// [`dot`] with BF16 weights widened in the loop (a shift: exact).
#[inline]
pub fn dot_bf16(a: &[f32], b: &[bf16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { dot_bf16_avx2(a, b) };
    }
    dot8(a, b, widen)
}

#[inline(always)]
fn widen(v: bf16) -> f32 {
    f32::from_bits((v.to_bits() as u32) << 16)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot8(a, b, |v| v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_bf16_avx2(a: &[f32], b: &[bf16]) -> f32 {
    dot8(a, b, widen)
}

#[inline(always)]
fn dot8<T: Copy>(a: &[f32], b: &[T], load: impl Fn(T) -> f32) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8 * 8;
    for (ca, cb) in a[..chunks].chunks_exact(8).zip(b[..chunks].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += ca[i] * load(cb[i]);
        }
    }
    for (i, (x, y)) in a[chunks..].iter().zip(&b[chunks..]).enumerate() {
        acc[i] += x * load(*y);
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Where [`gemm`] reads weight row `n` from.
enum Rows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    /// Decoded into a scratch row first (MXFP8).
    Decode(&'a (dyn Fn(usize, &mut [f32]) + Sync)),
}

/// `out[r, n] = dot(x[r], w[n])`, output features split over threads in tiles.
fn gemm(x: &[f32], rows: usize, k: usize, n_out: usize, out: &mut [f32], w: Rows<'_>) {
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(out.len(), rows * n_out);
    if rows == 0 || n_out == 0 {
        return;
    }
    const TILE: usize = 16;
    // Computed feature-major ([n_out, rows]) so tiles are contiguous, then transposed.
    let mut out_t = vec![0f32; n_out * rows];
    out_t
        .par_chunks_mut(TILE * rows)
        .enumerate()
        .for_each(|(t, chunk)| {
            let mut scratch = vec![0f32; if matches!(w, Rows::Decode(_)) { k } else { 0 }];
            for (j, col) in chunk.chunks_mut(rows).enumerate() {
                let n = t * TILE + j;
                if let Rows::Decode(f) = &w {
                    f(n, &mut scratch);
                }
                for (r, o) in col.iter_mut().enumerate() {
                    let xr = &x[r * k..][..k];
                    *o = match &w {
                        Rows::F32(ws) => dot(xr, &ws[n * k..][..k]),
                        Rows::Bf16(ws) => dot_bf16(xr, &ws[n * k..][..k]),
                        Rows::Decode(_) => dot(xr, &scratch),
                    };
                }
            }
        });
    if rows == 1 {
        out.copy_from_slice(&out_t);
    } else {
        for (n, col) in out_t.chunks(rows).enumerate() {
            for (r, v) in col.iter().enumerate() {
                out[r * n_out + n] = *v;
            }
        }
    }
}

/// Dense weights kept as f32 (F32 checkpoints: the exact reference path).
#[derive(Clone)]
pub struct DenseF32 {
    pub weight: Vec<f32>,
    pub out_features: usize,
    pub in_features: usize,
}

impl Linear for DenseF32 {
    fn boxed_clone(&self) -> Box<dyn Linear> {
        Box::new(self.clone())
    }
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
        gemm(
            x,
            rows,
            self.in_features,
            self.out_features,
            out,
            Rows::F32(&self.weight),
        );
    }
    fn dequantized_weight(&self) -> Vec<f32> {
        self.weight.clone()
    }
    fn storage_bytes(&self) -> usize {
        self.weight.len() * 4
    }
    fn overwrite_from(&mut self, new: &dyn Linear) -> bool {
        match new.as_any().downcast_ref::<DenseF32>() {
            Some(n) if n.weight.len() == self.weight.len() => {
                self.weight.copy_from_slice(&n.weight);
                true
            }
            _ => false,
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn storage(&self) -> Storage<'_> {
        Storage::F32(&self.weight)
    }
}

/// Dense BF16 weights, widened to f32 inside the kernel.
#[derive(Clone)]
pub struct DenseBf16 {
    pub weight: Vec<bf16>,
    pub out_features: usize,
    pub in_features: usize,
}

impl Linear for DenseBf16 {
    fn boxed_clone(&self) -> Box<dyn Linear> {
        Box::new(self.clone())
    }
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
        gemm(x, rows, k, self.out_features, out, Rows::Bf16(&self.weight));
    }
    fn dequantized_weight(&self) -> Vec<f32> {
        self.weight.iter().map(|v| v.to_f32()).collect()
    }
    fn storage_bytes(&self) -> usize {
        self.weight.len() * 2
    }
    fn overwrite_from(&mut self, new: &dyn Linear) -> bool {
        match new.as_any().downcast_ref::<DenseBf16>() {
            Some(n) if n.weight.len() == self.weight.len() => {
                self.weight.copy_from_slice(&n.weight);
                true
            }
            _ => false,
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn storage(&self) -> Storage<'_> {
        Storage::Bf16(&self.weight)
    }
}

/// MXFP8 weights (rowwise, blocks along K); activations quantized MXFP8 1x32 per row.
#[derive(Clone)]
pub struct Mxfp8Linear {
    pub weight: quant::Mxfp8Tensor,
}

impl Linear for Mxfp8Linear {
    fn boxed_clone(&self) -> Box<dyn Linear> {
        Box::new(self.clone())
    }
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
        let decode = |n: usize, row: &mut [f32]| {
            for (c, d) in row.iter_mut().enumerate() {
                *d = quant::codec::e4m3_decode(w.data[n * k + c])
                    * quant::codec::e8m0_decode(w.scales[n * (k / 32) + c / 32]);
            }
        };
        gemm(&xq, rows, k, w.rows, out, Rows::Decode(&decode));
    }
    fn dequantized_weight(&self) -> Vec<f32> {
        self.weight.dequantize()
    }
    fn effective_input(&self, x: &[f32], rows: usize) -> Vec<f32> {
        quant::mxfp8::quantize_rowwise(x, rows, self.weight.cols)
            .expect("activation width is a multiple of 32")
            .dequantize()
    }
    fn storage_bytes(&self) -> usize {
        self.weight.data.len() + self.weight.scales.len()
    }
    fn overwrite_from(&mut self, new: &dyn Linear) -> bool {
        match new.as_any().downcast_ref::<Mxfp8Linear>() {
            Some(n)
                if (n.weight.rows, n.weight.cols, n.weight.axis)
                    == (self.weight.rows, self.weight.cols, self.weight.axis) =>
            {
                self.weight.data.copy_from_slice(&n.weight.data);
                self.weight.scales.copy_from_slice(&n.weight.scales);
                true
            }
            _ => false,
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn storage(&self) -> Storage<'_> {
        Storage::Mxfp8(&self.weight)
    }
}

/// NVFP4 weights (per-tensor second-level scale); activations quantized NVFP4 per token
/// (or per tensor when the recipe says so).
#[derive(Clone)]
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
    fn boxed_clone(&self) -> Box<dyn Linear> {
        Box::new(self.clone())
    }
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
        gemm(
            &xs,
            rows,
            k,
            self.weight.rows,
            out,
            Rows::Bf16(&self.block_scaled),
        );
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
    fn effective_input(&self, x: &[f32], rows: usize) -> Vec<f32> {
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
        let mut xs = xq.block_scaled_values();
        for (r, row) in xs.chunks_mut(k).enumerate() {
            let s_tok = xq.global.of_row(r);
            row.iter_mut().for_each(|v| *v *= s_tok);
        }
        xs
    }
    fn storage_bytes(&self) -> usize {
        self.weight.data.len() + self.weight.scales.len() + 4
    }
    fn overwrite_from(&mut self, new: &dyn Linear) -> bool {
        let Some(n) = new.as_any().downcast_ref::<Nvfp4Linear>() else {
            return false;
        };
        let same = (n.weight.rows, n.weight.cols) == (self.weight.rows, self.weight.cols)
            && matches!(
                (&n.weight.global, &self.weight.global),
                (GlobalScale::PerTensor(_), GlobalScale::PerTensor(_))
            );
        if !same {
            return false;
        }
        self.weight.data.copy_from_slice(&n.weight.data);
        self.weight.scales.copy_from_slice(&n.weight.scales);
        self.weight.global = n.weight.global.clone();
        self.block_scaled.copy_from_slice(&n.block_scaled);
        self.activation_scale = n.activation_scale;
        self.four_over_six = n.four_over_six;
        true
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn storage(&self) -> Storage<'_> {
        Storage::Nvfp4 {
            weight: &self.weight,
            activation_scale: self.activation_scale,
            four_over_six: self.four_over_six,
        }
    }
}

/// The linear op holding a slot's stored form (`fmt`: the activations' numerics).
pub fn linear_from(stored: Stored, fmt: &TensorFormat) -> Box<dyn Linear> {
    match stored {
        Stored::Dense { shape, values } => {
            let (out_features, in_features) = (shape[0], shape[1]);
            match values {
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
            }
        }
        Stored::Mxfp8(weight) => Box::new(Mxfp8Linear { weight }),
        Stored::Nvfp4(q) => Box::new(Nvfp4Linear::new(q, &fmt.with(Format::Nvfp4))),
    }
}

/// The factory: a high-precision weight -> the linear op of its recipe format
/// ([`slot::store`]). `shared_level` carries the gate/up joint second-level scale for NVFP4.
pub fn make_linear(
    w: DenseWeight,
    out_features: usize,
    in_features: usize,
    fmt: &TensorFormat,
    shared_level: Option<quant::nvfp4::SecondLevel>,
) -> Box<dyn Linear> {
    let stored = slot::store(w, &[out_features, in_features], fmt, shared_level);
    linear_from(stored.expect("checked block alignment"), fmt)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The run-time-dispatched SIMD dot must give the portable code's bits.
    #[test]
    fn dispatched_dot_is_bitwise_the_portable_dot() {
        let mut s = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2f32.powi((s % 20) as i32 - 10)
        };
        for len in [1, 7, 8, 9, 31, 64, 576, 1000] {
            let a: Vec<f32> = (0..len).map(|_| next()).collect();
            let b: Vec<f32> = (0..len).map(|_| next()).collect();
            let bh: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
            assert_eq!(
                dot(&a, &b).to_bits(),
                dot8(&a, &b, |v| v).to_bits(),
                "len {len}"
            );
            assert_eq!(
                dot_bf16(&a, &bh).to_bits(),
                dot8(&a, &bh, |v| v.to_f32()).to_bits(),
                "len {len}"
            );
        }
    }
}
