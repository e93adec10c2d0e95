//! Reverse mode of a linear layer `y = x W^T` under the contract's backward modes.
//!
//! The forward always runs the layer as served (quantized weights and activations). Which
//! operands the two backward GEMMs (`dx = dy W`, `dW = dy^T x`) use is the mode's choice:
//! - `high_precision`: the original BF16 weight and the unquantized input;
//! - `dequantized`: the dequantized operands the forward really multiplied;
//! - `quantized` (MXFP8 layers): every backward operand quantized to MXFP8 along that GEMM's
//!   contraction dim, as TransformerEngine does: `dy` rowwise and `W` columnwise for `dx`,
//!   `dy` and `x` columnwise (blocks of 32 tokens) for `dW`. Columnwise operands are fresh
//!   quantizations of the high-precision tensors, never requantized rowwise ones.
//!
//! High-precision (BF16) layers use their own weights in every mode.

use rayon::prelude::*;

use crate::backend::Linear;
use crate::quant::{self, Format, MXFP8_BLOCK};

/// `--backward-mode` (shared/QUANT_CONTRACT.md, "Backward modes").
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum BackwardMode {
    HighPrecision,
    Dequantized,
    /// MXFP8 layers only: the "end-to-end MXFP8" recipe.
    Quantized,
}

/// `dx[r, i] = sum_o dy[r, o] * w[o, i]` (`w`: `[n_out, n_in]`).
pub fn matmul_dx(dy: &[f32], w: &[f32], rows: usize, n_out: usize, n_in: usize) -> Vec<f32> {
    let mut dx = vec![0f32; rows * n_in];
    dx.par_chunks_mut(n_in.max(1))
        .zip(dy.par_chunks(n_out.max(1)))
        .for_each(|(dxr, dyr)| {
            for (o, &g) in dyr.iter().enumerate() {
                if g != 0.0 {
                    for (d, wv) in dxr.iter_mut().zip(&w[o * n_in..][..n_in]) {
                        *d += g * wv;
                    }
                }
            }
        });
    dx
}

/// `dw[o, i] += sum_r dy[r, o] * x[r, i]`.
pub fn matmul_dw(dy: &[f32], x: &[f32], rows: usize, n_out: usize, n_in: usize, dw: &mut [f32]) {
    dw.par_chunks_mut(n_in.max(1))
        .enumerate()
        .for_each(|(o, dwr)| {
            for r in 0..rows {
                let g = dy[r * n_out + o];
                if g != 0.0 {
                    for (d, xv) in dwr.iter_mut().zip(&x[r * n_in..][..n_in]) {
                        *d += g * xv;
                    }
                }
            }
        });
}

/// MXFP8 columnwise round trip of `[rows, cols]`, rows zero-padded to a multiple of 32 (zeros
/// never raise a block's amax, so padding does not change the real rows' scales).
fn mxfp8_columnwise(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let padded = rows.div_ceil(MXFP8_BLOCK) * MXFP8_BLOCK;
    let mut buf = x.to_vec();
    buf.resize(padded * cols, 0.0);
    let mut out = quant::mxfp8::quantize_columnwise(&buf, padded, cols)
        .expect("padded to whole blocks")
        .dequantize();
    out.truncate(rows * cols);
    out
}

/// One linear layer's backward. `x` is the forward input as passed to the layer, `w_hp` the
/// layer's high-precision (BF16-valued) weight. Adds into `dw`, returns `dx`.
pub fn linear_backward(
    mode: BackwardMode,
    layer: &dyn Linear,
    w_hp: &[f32],
    x: &[f32],
    rows: usize,
    dy: &[f32],
    dw: &mut [f32],
) -> Vec<f32> {
    let (n_out, n_in) = (layer.out_features(), layer.in_features());
    match (mode, layer.format()) {
        (_, Format::Bf16) | (BackwardMode::HighPrecision, _) => {
            matmul_dw(dy, x, rows, n_out, n_in, dw);
            matmul_dx(dy, w_hp, rows, n_out, n_in)
        }
        (BackwardMode::Quantized, Format::Mxfp8) if n_out % MXFP8_BLOCK == 0 => {
            let dy_row = quant::mxfp8::quantize_rowwise(dy, rows, n_out)
                .expect("n_out is a multiple of 32")
                .dequantize();
            let w_col = mxfp8_columnwise(w_hp, n_out, n_in);
            let dy_col = mxfp8_columnwise(dy, rows, n_out);
            let x_col = mxfp8_columnwise(x, rows, n_in);
            matmul_dw(&dy_col, &x_col, rows, n_out, n_in, dw);
            matmul_dx(&dy_row, &w_col, rows, n_out, n_in)
        }
        // Dequantized, and quantized on a layer MXFP8 cannot tile along its output dim.
        _ => {
            let x_eff = layer.effective_input(x, rows);
            let w_eff = layer.dequantized_weight();
            matmul_dw(dy, &x_eff, rows, n_out, n_in, dw);
            matmul_dx(dy, &w_eff, rows, n_out, n_in)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::linear::{make_linear, DenseWeight};
    use crate::quant::{ScaleGranularity, TensorFormat};
    use crate::train::ops_grad::tests::{check, Rng};

    fn bf16_round(v: &[f32]) -> Vec<f32> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect()
    }

    #[test]
    fn bf16_linear_gradients_match_finite_differences() {
        let mut r = Rng::fresh();
        let (rows, n_in, n_out) = (3, 16, 8);
        let w = r.vec(n_out * n_in);
        let (x, c) = (r.vec(rows * n_in), r.vec(rows * n_out));
        let f = |x: &[f32], w: &[f32]| {
            let l = make_linear(
                DenseWeight::F32(w.to_vec()),
                n_out,
                n_in,
                &TensorFormat::BF16,
                None,
            );
            let mut y = vec![0f32; rows * n_out];
            l.forward(x, rows, &mut y);
            y.iter()
                .zip(&c)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
        };
        let layer = make_linear(
            DenseWeight::F32(w.clone()),
            n_out,
            n_in,
            &TensorFormat::BF16,
            None,
        );
        for mode in [
            BackwardMode::HighPrecision,
            BackwardMode::Dequantized,
            BackwardMode::Quantized,
        ] {
            let mut dw = vec![0f32; w.len()];
            let dx = linear_backward(mode, layer.as_ref(), &w, &x, rows, &c, &mut dw);
            check("dx", &x, &dx, 1e-2, 1e-3, &|x| f(x, &w));
            check("dw", &w, &dw, 1e-2, 1e-3, &|w| f(&x, w));
        }
    }

    /// The dequantized mode is the exact gradient of the function the quantized forward
    /// computes, with the quantizers treated as identity (straight-through): checked by
    /// comparing against the products of the operands the forward multiplied.
    #[test]
    fn dequantized_mode_uses_the_forward_operands() {
        let mut r = Rng::fresh();
        let (rows, n_in, n_out) = (5, 64, 32);
        let w = bf16_round(&r.vec(n_out * n_in));
        let (x, dy) = (r.vec(rows * n_in), r.vec(rows * n_out));
        for fmt in [
            TensorFormat::BF16.with(Format::Mxfp8),
            TensorFormat {
                format: Format::Nvfp4,
                activation_scale: ScaleGranularity::PerToken,
                four_over_six: None,
            },
        ] {
            let layer = make_linear(DenseWeight::F32(w.clone()), n_out, n_in, &fmt, None);
            // The forward equals effective_input x dequantized_weight up to f32 rounding of
            // the scale multiplies.
            let (xe, we) = (layer.effective_input(&x, rows), layer.dequantized_weight());
            let mut y = vec![0f32; rows * n_out];
            layer.forward(&x, rows, &mut y);
            for rr in 0..rows {
                for o in 0..n_out {
                    let want: f32 = (0..n_in)
                        .map(|i| xe[rr * n_in + i] * we[o * n_in + i])
                        .sum();
                    let got = y[rr * n_out + o];
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{fmt:?}: {got} vs {want}"
                    );
                }
            }
            assert_ne!(xe, x, "{fmt:?} quantizes the activation");
            let mut dw = vec![0f32; w.len()];
            let dx = linear_backward(
                BackwardMode::Dequantized,
                layer.as_ref(),
                &w,
                &x,
                rows,
                &dy,
                &mut dw,
            );
            let mut dw_ref = vec![0f32; w.len()];
            matmul_dw(&dy, &xe, rows, n_out, n_in, &mut dw_ref);
            assert_eq!(dw, dw_ref);
            assert_eq!(dx, matmul_dx(&dy, &we, rows, n_out, n_in));
            // And high precision ignores the quantization.
            let mut dw_hp = vec![0f32; w.len()];
            let dx_hp = linear_backward(
                BackwardMode::HighPrecision,
                layer.as_ref(),
                &w,
                &x,
                rows,
                &dy,
                &mut dw_hp,
            );
            assert_eq!(dx_hp, matmul_dx(&dy, &w, rows, n_out, n_in));
        }
    }

    /// Quantized mode: each GEMM operand is the MXFP8 quantization along that GEMM's
    /// contraction dim; checked element-wise against the contract's quantizers, and the result
    /// stays close to the high-precision gradient.
    #[test]
    fn quantized_mode_quantizes_each_operand_along_its_contraction() {
        let mut r = Rng::fresh();
        let (rows, n_in, n_out) = (40, 64, 32);
        let w = bf16_round(&r.vec(n_out * n_in));
        let (x, dy) = (r.vec(rows * n_in), r.vec(rows * n_out));
        let fmt = TensorFormat::BF16.with(Format::Mxfp8);
        let layer = make_linear(DenseWeight::F32(w.clone()), n_out, n_in, &fmt, None);
        let mut dw = vec![0f32; w.len()];
        let dx = linear_backward(
            BackwardMode::Quantized,
            layer.as_ref(),
            &w,
            &x,
            rows,
            &dy,
            &mut dw,
        );
        // dx row r uses dy's row r quantized in blocks of 32 outputs: one block here.
        let dyq = quant::mxfp8::quantize_rowwise(&dy, rows, n_out)
            .unwrap()
            .dequantize();
        let wq = quant::mxfp8::quantize_columnwise(&w, n_out, n_in)
            .unwrap()
            .dequantize();
        assert_eq!(dx, matmul_dx(&dyq, &wq, rows, n_out, n_in));
        // The first 32 token rows form one columnwise block; a 40-row batch pads the second.
        let mut x64 = x.clone();
        x64.resize(64 * n_in, 0.0);
        let xq = quant::mxfp8::quantize_columnwise(&x64, 64, n_in)
            .unwrap()
            .dequantize();
        let mut dy64 = dy.clone();
        dy64.resize(64 * n_out, 0.0);
        let dyc = quant::mxfp8::quantize_columnwise(&dy64, 64, n_out)
            .unwrap()
            .dequantize();
        let mut dw_ref = vec![0f32; w.len()];
        matmul_dw(&dyc, &xq, 64, n_out, n_in, &mut dw_ref);
        assert_eq!(dw, dw_ref);
        let mut dw_hp = vec![0f32; w.len()];
        let dx_hp = linear_backward(
            BackwardMode::HighPrecision,
            layer.as_ref(),
            &w,
            &x,
            rows,
            &dy,
            &mut dw_hp,
        );
        let rel = |a: &[f32], b: &[f32]| {
            let num: f32 = a.iter().zip(b).map(|(p, q)| (p - q) * (p - q)).sum();
            let den: f32 = b.iter().map(|q| q * q).sum();
            (num / den).sqrt()
        };
        // E4M3 has 3 mantissa bits: a few percent of relative error, not more.
        assert!(rel(&dx, &dx_hp) < 0.08, "dx rel err {}", rel(&dx, &dx_hp));
        assert!(rel(&dw, &dw_hp) < 0.08, "dw rel err {}", rel(&dw, &dw_hp));
    }
}
