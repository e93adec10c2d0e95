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

/// The block in AVX2 intrinsics, four 8-lane vectors: the amax (NaN lanes masked, an
/// unsigned max), then `e4m3_encode` lane for lane (the same integer rounding, the same
/// subnormal trick, saturation and NaN), packed to bytes. The scale code and its inverse are
/// the portable path's scalar code, so the bytes are the same
/// (`avx2_blocks_equal_the_portable_blocks`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2<T: Element>(block: &[T], out: &mut [u8]) -> u8 {
    use std::arch::x86_64::*;
    let vals: [f32; MXFP8_BLOCK] = super::block_f32(block);
    // SAFETY: `vals` holds 32 f32; unaligned loads.
    let x: [__m256; 4] =
        std::array::from_fn(|i| unsafe { _mm256_loadu_ps(vals.as_ptr().add(8 * i)) });
    let abs_mask = _mm256_set1_epi32(0x7FFF_FFFF);
    let inf_bits = _mm256_set1_epi32(0x7F80_0000);
    let mag = x.map(|v| _mm256_and_si256(_mm256_castps_si256(v), abs_mask));
    let nan = mag.map(|m| _mm256_cmpgt_epi32(m, inf_bits));
    // `amax`: the largest |x| bits among the numbers; NaN only when all 32 are NaN.
    let numbers = |i: usize| _mm256_andnot_si256(nan[i], mag[i]);
    let m = _mm256_max_epu32(
        _mm256_max_epu32(numbers(0), numbers(1)),
        _mm256_max_epu32(numbers(2), numbers(3)),
    );
    let m = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
    let all_nan = _mm256_and_si256(
        _mm256_and_si256(nan[0], nan[1]),
        _mm256_and_si256(nan[2], nan[3]),
    );
    let block_amax = if _mm256_movemask_ps(_mm256_castsi256_ps(all_nan)) == 0xFF {
        f32::NAN
    } else {
        f32::from_bits(_mm_cvtsi128_si32(m) as u32)
    };
    let code = block_scale_code(block_amax);
    let inv = _mm256_set1_ps(e8m0_inverse(code));
    let encode = |v: __m256| {
        let bits = _mm256_castps_si256(_mm256_mul_ps(v, inv));
        let sign = _mm256_and_si256(_mm256_srli_epi32::<24>(bits), _mm256_set1_epi32(0x80));
        let mag = _mm256_and_si256(bits, abs_mask);
        // Normal: round to nearest even on the dropped 20 bits, rebias.
        let odd = _mm256_and_si256(_mm256_srli_epi32::<20>(mag), _mm256_set1_epi32(1));
        let rounded = _mm256_srli_epi32::<20>(_mm256_add_epi32(
            _mm256_add_epi32(mag, _mm256_set1_epi32(0x7FFFF)),
            odd,
        ));
        let normal = _mm256_sub_epi32(rounded, _mm256_set1_epi32((127 - 7) << 3));
        // Subnormal: |x| * 2^9 rounded to an integer by the 1.5 * 2^23 trick.
        let small = _mm256_set1_epi32(0x3C80_0000);
        let magic = _mm256_set1_ps(12_582_912.0);
        let v = _mm256_mul_ps(
            _mm256_castsi256_ps(_mm256_min_epi32(mag, small)),
            _mm256_set1_ps(512.0),
        );
        let subnormal = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(v, magic), magic));
        let code = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(small, mag));
        let saturated = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x43E0_0000 - 1));
        let code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7E), saturated);
        let byte = _mm256_or_si256(sign, code);
        let nan = _mm256_cmpgt_epi32(mag, inf_bits);
        _mm256_blendv_epi8(
            byte,
            _mm256_set1_epi32(i32::from(super::codec::E4M3_NAN)),
            nan,
        )
    };
    let [a, b, c, d] = x.map(encode);
    // 32 lanes of 0..=255 to bytes in order: the packs interleave 128-bit halves, the
    // permute puts them back.
    let packed = _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    let ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let mut bytes = [0u8; MXFP8_BLOCK];
    // SAFETY: `bytes` holds 32 bytes; an unaligned store.
    unsafe { _mm256_storeu_si256(bytes.as_mut_ptr().cast(), ordered) };
    out.copy_from_slice(&bytes[..out.len()]);
    code
}

#[inline(always)]
fn quantize_block_portable<T: Element>(block: &[T], out: &mut [u8]) -> u8 {
    let vals: [f32; MXFP8_BLOCK] = super::block_f32(block);
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Blocks of every kind of value (magnitudes over the whole range and beyond E4M3's, zeros,
    /// subnormal results, infinities, NaNs, blocks of only NaN, rounding ties) quantize to the
    /// same bytes and scale through the AVX2 path as through the portable one, from BF16 and
    /// from f32.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_blocks_equal_the_portable_blocks() {
        assert!(
            std::is_x86_feature_detected!("avx2"),
            "the path this checks runs on AVX2 CPUs; run it on one"
        );
        let mut next = crate::quant::xorshift64(0x2545_F491_4F6C_DD1Du64);
        let mut x: Vec<f32> = (0..MXFP8_BLOCK * 512)
            .map(|i| {
                let r = next();
                let u = (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                match r % 29 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => -0.0,
                    3 => 1e-42,
                    // Halfway between E4M3 neighbours once scaled, the lower one even
                    // (1.0625) or odd (1.1875): both directions of round-to-nearest-even.
                    4 => [1.0625f32, 1.1875][i % 2] * 2f32.powi(i as i32 % 9),
                    _ => u * 2f32.powi((r >> 8) as i32 % 80 - 40),
                }
            })
            .collect();
        x[32..64].fill(f32::NAN);
        x[64..96].fill(0.0);
        // One huge value beside tiny ones: most of the block lands in the subnormal range.
        x[96] = 3e4;
        let b: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let run = |avx2: bool, f32_input: bool| {
            let mut out = vec![0u8; x.len()];
            let scales: Vec<u8> = out
                .chunks_exact_mut(MXFP8_BLOCK)
                .enumerate()
                .map(|(i, o)| {
                    let r = i * MXFP8_BLOCK..(i + 1) * MXFP8_BLOCK;
                    match (avx2, f32_input) {
                        // SAFETY: AVX2 was detected above.
                        (true, true) => unsafe { quantize_block_avx2(&x[r], o) },
                        (true, false) => unsafe { quantize_block_avx2(&b[r], o) },
                        (false, true) => quantize_block_portable(&x[r], o),
                        (false, false) => quantize_block_portable(&b[r], o),
                    }
                })
                .collect();
            (out, scales)
        };
        for f32_input in [true, false] {
            assert_eq!(
                run(true, f32_input),
                run(false, f32_input),
                "f32 input {f32_input}"
            );
        }
    }
}
