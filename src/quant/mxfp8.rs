//! MXFP8: E4M3 elements in blocks of 32 with one E8M0 (power-of-two) scale per block.
//!
//! Rowwise blocks run along the contraction (last) dim; columnwise blocks along dim 0 are a
//! separate quantization of the original tensor (used by backward GEMMs), never a
//! requantization of the rowwise bytes.

use rayon::prelude::*;

use super::codec::{amax, e4m3_decode, e4m3_encode, e8m0_decode, e8m0_inverse, e8m0_round_up};
use super::{check_aligned, check_len, Element, QuantError};

pub const MXFP8_BLOCK: usize = 32;
/// fl(1/448): the contract multiplies by this constant instead of dividing by 448.
const R448: f32 = f32::from_bits(0x3B12_4925);

/// Which dimension a block of 32 runs along.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockAxis {
    /// 1x32 blocks: scales `[rows, cols/32]`.
    Rowwise,
    /// 32x1 blocks: scales `[rows/32, cols]`.
    Columnwise,
}

/// An MXFP8 tensor in the plain (unswizzled, row-major) layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Mxfp8Tensor {
    pub rows: usize,
    pub cols: usize,
    pub axis: BlockAxis,
    /// E4M3 bytes, `[rows, cols]`, same element positions as the input.
    pub data: Vec<u8>,
    /// E8M0 codes.
    pub scales: Vec<u8>,
}

/// The scale code of one block from its amax (steps 1-3).
#[inline]
pub fn block_scale_code(block_amax: f32) -> u8 {
    e8m0_round_up(block_amax * R448)
}

/// One 1x32 block: writes its E4M3 bytes and returns its scale code.
fn quantize_block<T: Element>(block: &[T], out: &mut [u8]) -> u8 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { quantize_block_avx2(block, out) };
    }
    quantize_block_portable(block, out)
}

/// The same IEEE operations compiled for 8-lane vectors: identical bytes, more per cycle.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2<T: Element>(block: &[T], out: &mut [u8]) -> u8 {
    quantize_block_portable(block, out)
}

#[inline(always)]
fn quantize_block_portable<T: Element>(block: &[T], out: &mut [u8]) -> u8 {
    let mut vals = [0f32; MXFP8_BLOCK];
    for (v, e) in vals.iter_mut().zip(block) {
        *v = e.to_f32();
    }
    let code = block_scale_code(amax(&vals));
    let inv = e8m0_inverse(code);
    for (o, v) in out.iter_mut().zip(vals) {
        *o = e4m3_encode(v * inv);
    }
    code
}

/// Quantizes `x` ([rows, cols], row-major) with 1x32 blocks.
pub fn quantize_rowwise<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
) -> Result<Mxfp8Tensor, QuantError> {
    check_len(x.len(), rows, cols)?;
    check_aligned(1, cols, MXFP8_BLOCK)?;
    let mut data = vec![0u8; rows * cols];
    let mut scales = vec![0u8; rows * cols / MXFP8_BLOCK];
    data.par_chunks_mut(MXFP8_BLOCK)
        .zip(scales.par_iter_mut())
        .zip(x.par_chunks(MXFP8_BLOCK))
        .with_min_len(64)
        .for_each(|((out, scale), block)| *scale = quantize_block(block, out));
    Ok(Mxfp8Tensor {
        rows,
        cols,
        axis: BlockAxis::Rowwise,
        data,
        scales,
    })
}

/// Quantizes `x` ([rows, cols], row-major) with 32x1 blocks (32 consecutive rows of a column).
pub fn quantize_columnwise<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
) -> Result<Mxfp8Tensor, QuantError> {
    check_len(x.len(), rows, cols)?;
    check_aligned(0, rows, MXFP8_BLOCK)?;
    let stripe = MXFP8_BLOCK * cols;
    let mut data = vec![0u8; rows * cols];
    let mut scales = vec![0u8; rows / MXFP8_BLOCK * cols];
    if cols == 0 {
        return Ok(Mxfp8Tensor {
            rows,
            cols,
            axis: BlockAxis::Columnwise,
            data,
            scales,
        });
    }
    data.par_chunks_mut(stripe)
        .zip(scales.par_chunks_mut(cols))
        .zip(x.par_chunks(stripe))
        .for_each(|((out, scale_row), src)| {
            let mut col_amax = vec![f32::NAN; cols];
            for row in src.chunks(cols) {
                for (m, e) in col_amax.iter_mut().zip(row) {
                    *m = m.max(e.to_f32().abs());
                }
            }
            let inv: Vec<f32> = col_amax
                .iter()
                .zip(scale_row.iter_mut())
                .map(|(&a, s)| {
                    *s = block_scale_code(a);
                    e8m0_inverse(*s)
                })
                .collect();
            for (out_row, row) in out.chunks_mut(cols).zip(src.chunks(cols)) {
                for ((o, e), &m) in out_row.iter_mut().zip(row).zip(&inv) {
                    *o = e4m3_encode(e.to_f32() * m);
                }
            }
        });
    Ok(Mxfp8Tensor {
        rows,
        cols,
        axis: BlockAxis::Columnwise,
        data,
        scales,
    })
}

impl Mxfp8Tensor {
    /// Scale code of element (r, c).
    #[inline]
    pub fn scale_of(&self, r: usize, c: usize) -> u8 {
        match self.axis {
            BlockAxis::Rowwise => self.scales[r * (self.cols / MXFP8_BLOCK) + c / MXFP8_BLOCK],
            BlockAxis::Columnwise => self.scales[(r / MXFP8_BLOCK) * self.cols + c],
        }
    }

    /// Element-wise `e4m3(q) * 2^(code-127)`, exact in f32.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols == 0 {
            return out;
        }
        out.par_chunks_mut(self.cols)
            .enumerate()
            .for_each(|(r, row)| {
                for (c, o) in row.iter_mut().enumerate() {
                    *o = e4m3_decode(self.data[r * self.cols + c])
                        * e8m0_decode(self.scale_of(r, c));
                }
            });
        out
    }
}
