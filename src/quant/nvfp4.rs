//! NVFP4: E2M1 elements in blocks of 16, one E4M3 scale per block, and an FP32 second-level
//! scale per tensor or per row (token).
//!
//! Per-token scales make a token's bytes independent of the batch it sits in, which is what
//! keeps rollouts and training on the same numbers. Gate and up projections of one expert
//! share a single second-level scale so that a fused gate/up GEMM sees one scale.

use rayon::prelude::*;

use super::codec::{amax, amax_of, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, min_num};
use super::{check_aligned, check_len, Element, QuantError};

pub const NVFP4_BLOCK: usize = 16;
/// fl(1/6), used instead of a division in step 3.
const R6: f32 = f32::from_bits(0x3E2A_AAAB);
/// 6 * 448: maps the tensor amax onto (largest E2M1) x (largest E4M3).
const DEFAULT_RANGE: f32 = 2688.0;

/// Which amax the second-level scale comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ScaleGranularity {
    /// One scale for the whole tensor (weights).
    #[default]
    PerTensor,
    /// One scale per row (activations: one per token).
    PerToken,
}

/// How four-over-six compares its two candidates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ErrorMetric {
    #[default]
    Absolute,
    Squared,
}

/// Four-over-six: per block, try mapping the block max to 6 and to 4, keep the smaller error.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FourOverSix {
    /// The E4M3 range the global scale targets (448 or 256).
    pub e4m3_range: f32,
    pub metric: ErrorMetric,
}

impl Default for FourOverSix {
    fn default() -> Self {
        FourOverSix {
            e4m3_range: 256.0,
            metric: ErrorMetric::Absolute,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Nvfp4Options {
    pub granularity: ScaleGranularity,
    pub four_over_six: Option<FourOverSix>,
}

/// The second-level decode scale(s) S_dec.
#[derive(Clone, Debug, PartialEq)]
pub enum GlobalScale {
    PerTensor(f32),
    PerToken(Vec<f32>),
}

impl GlobalScale {
    #[inline]
    pub fn of_row(&self, r: usize) -> f32 {
        match self {
            GlobalScale::PerTensor(s) => *s,
            GlobalScale::PerToken(v) => v[r],
        }
    }
}

/// An NVFP4 tensor in the plain (unswizzled, row-major) layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Tensor {
    pub rows: usize,
    pub cols: usize,
    /// Packed E2M1 codes `[rows, cols/2]`, even element in the low nibble.
    pub data: Vec<u8>,
    /// E4M3 block scales `[rows, cols/16]`.
    pub scales: Vec<u8>,
    pub global: GlobalScale,
}

/// The encode/decode pair of second-level scales for one amax.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SecondLevel {
    /// The amax the scale was derived from (four-over-six reuses it in its error term).
    pub amax: f32,
    pub s_enc: f32,
    pub s_dec: f32,
}

impl SecondLevel {
    /// Steps 1-2: `S_enc = RN(range / A)` (a true division), clamped, and `S_dec = RN(1/S_enc)`.
    pub fn from_amax(a: f32, range: f32) -> SecondLevel {
        let mut s_enc = min_num(range / a, f32::MAX);
        if a == 0.0 || s_enc == 0.0 {
            s_enc = 1.0;
        }
        SecondLevel {
            amax: a,
            s_enc,
            s_dec: 1.0 / s_enc,
        }
    }

    /// The global scale of the default (non-four-over-six) path for amax `a`.
    pub fn standard(a: f32) -> SecondLevel {
        Self::from_amax(a, DEFAULT_RANGE)
    }
}

/// Step 5: the element multiplier for a block scale byte.
#[inline]
fn element_multiplier(s8: u8, s_dec: f32) -> f32 {
    min_num(1.0 / (e4m3_decode(s8) * s_dec), f32::MAX)
}

/// Quantizes one row (a multiple of 16 elements) into its packed bytes and block scales, as
/// 8-lane vectors where the CPU has AVX2 (the same IEEE operations: identical bytes).
fn quantize_row<T: Element>(
    row: &[T],
    level: SecondLevel,
    fos: Option<FourOverSix>,
    data: &mut [u8],
    scales: &mut [u8],
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { quantize_row_avx2(row, level, fos, data, scales) };
    }
    quantize_row_portable(row, level, fos, data, scales)
}

/// The standard path (no four-over-six) in AVX2 intrinsics: a block's amax, its elements'
/// E2M1 codes (seven threshold compares, the sign, NaN to 0x7) two 8-lane vectors at a time,
/// with the block scale and multiplier computed as the portable path does. The same IEEE
/// operations in the same order, so the same bytes (`avx2_rows_equal_the_portable_rows`).
/// Four-over-six takes the portable path, compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_avx2<T: Element>(
    row: &[T],
    level: SecondLevel,
    fos: Option<FourOverSix>,
    data: &mut [u8],
    scales: &mut [u8],
) {
    use std::arch::x86_64::*;
    if fos.is_some() {
        return quantize_row_portable(row, level, fos, data, scales);
    }
    let t = level.s_enc * R6;
    let abs_mask = _mm256_set1_epi32(0x7FFF_FFFF);
    let inf_bits = _mm256_set1_epi32(0x7F80_0000);
    // |x| of each 8-lane half of the block as bits, NaN lanes as an all-ones mask.
    let split = |v: __m256| {
        let b = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
        (b, _mm256_cmpgt_epi32(b, inf_bits))
    };
    let encode = |v: __m256| {
        let bits = _mm256_castps_si256(v);
        let sign = _mm256_and_si256(_mm256_srli_epi32::<28>(bits), _mm256_set1_epi32(8));
        let a = _mm256_castsi256_ps(_mm256_and_si256(bits, abs_mask));
        // The midpoints below |v|, as `e2m1_encode` counts them: `>` where a tie goes to the
        // lower code, `>=` where it goes to the upper one (a true compare is -1).
        let gt = |m: f32| _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(a, _mm256_set1_ps(m)));
        let ge = |m: f32| _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(a, _mm256_set1_ps(m)));
        let below = [
            gt(0.25),
            ge(0.75),
            gt(1.25),
            ge(1.75),
            gt(2.5),
            ge(3.5),
            gt(5.0),
        ];
        let n = below
            .into_iter()
            .fold(_mm256_setzero_si256(), |n, m| _mm256_sub_epi32(n, m));
        let code = _mm256_or_si256(sign, n);
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        _mm256_blendv_epi8(code, _mm256_set1_epi32(7), nan)
    };
    for ((block, out), scale) in row
        .chunks_exact(NVFP4_BLOCK)
        .zip(data.chunks_exact_mut(NVFP4_BLOCK / 2))
        .zip(scales.iter_mut())
    {
        let x: [f32; NVFP4_BLOCK] = super::block_f32(block);
        // SAFETY: `x` holds 16 f32; unaligned loads.
        let (lo, hi) = unsafe {
            (
                _mm256_loadu_ps(x.as_ptr()),
                _mm256_loadu_ps(x.as_ptr().add(8)),
            )
        };
        // `amax`: the largest |x| bits among the numbers; NaN only when all 16 are NaN.
        let ((blo, nan_lo), (bhi, nan_hi)) = (split(lo), split(hi));
        let m = _mm256_max_epu32(
            _mm256_andnot_si256(nan_lo, blo),
            _mm256_andnot_si256(nan_hi, bhi),
        );
        let m = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
        let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
        let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
        let all_nan = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_and_si256(nan_lo, nan_hi)));
        let block_amax = if all_nan == 0xFF {
            f32::NAN
        } else {
            f32::from_bits(_mm_cvtsi128_si32(m) as u32)
        };
        let s8 = e4m3_encode(block_amax * t);
        let enc = _mm256_set1_ps(element_multiplier(s8, level.s_dec));
        let mut codes = [0i32; NVFP4_BLOCK];
        // SAFETY: `codes` holds 16 i32; unaligned stores.
        unsafe {
            _mm256_storeu_si256(codes.as_mut_ptr().cast(), encode(_mm256_mul_ps(lo, enc)));
            _mm256_storeu_si256(
                codes.as_mut_ptr().add(8).cast(),
                encode(_mm256_mul_ps(hi, enc)),
            );
        }
        for (byte, pair) in out.iter_mut().zip(codes.chunks_exact(2)) {
            *byte = ((pair[1] << 4) | pair[0]) as u8;
        }
        *scale = s8;
    }
}

#[inline(always)]
fn quantize_row_portable<T: Element>(
    row: &[T],
    level: SecondLevel,
    fos: Option<FourOverSix>,
    data: &mut [u8],
    scales: &mut [u8],
) {
    let t = level.s_enc * R6;
    for ((block, out), scale) in row
        .chunks_exact(NVFP4_BLOCK)
        .zip(data.chunks_exact_mut(NVFP4_BLOCK / 2))
        .zip(scales.iter_mut())
    {
        let x: [f32; NVFP4_BLOCK] = super::block_f32(block);
        let block_amax = amax(&x);
        let mut codes = [0u8; NVFP4_BLOCK];
        *scale = match fos {
            None => {
                let s8 = e4m3_encode(block_amax * t);
                encode_block(&x, element_multiplier(s8, level.s_dec), &mut codes);
                s8
            }
            Some(f) => four_over_six_block(&x, block_amax, level, f, &mut codes),
        };
        for (byte, pair) in out.iter_mut().zip(codes.chunks_exact(2)) {
            *byte = (pair[1] << 4) | pair[0];
        }
    }
}

#[inline]
fn encode_block(x: &[f32; NVFP4_BLOCK], enc: f32, codes: &mut [u8; NVFP4_BLOCK]) {
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = e2m1_encode(v * enc);
    }
}

/// Quantizes a block twice (max -> 6 and max -> 4) and keeps the candidate with less error.
fn four_over_six_block(
    x: &[f32; NVFP4_BLOCK],
    block_amax: f32,
    level: SecondLevel,
    f: FourOverSix,
    codes: &mut [u8; NVFP4_BLOCK],
) -> u8 {
    let range = 6.0 * f.e4m3_range;
    let base = (block_amax / 6.0) * level.s_enc;
    let s6 = e4m3_encode(min_num(base, 448.0));
    let s4 = e4m3_encode(min_num(base * 1.5, 448.0));
    let mut codes4 = [0u8; NVFP4_BLOCK];
    encode_block(x, element_multiplier(s6, level.s_dec), codes);
    encode_block(x, element_multiplier(s4, level.s_dec), &mut codes4);
    let error = |codes: &[u8; NVFP4_BLOCK], s8: u8| {
        let s = e4m3_decode(s8);
        let mut err = 0f32;
        for (&c, &v) in codes.iter().zip(x) {
            let d = ((e2m1_decode(c) * s) * level.amax) / range - v;
            err += match f.metric {
                ErrorMetric::Absolute => d.abs(),
                ErrorMetric::Squared => d * d,
            };
        }
        err
    };
    if error(&codes4, s4) < error(codes, s6) {
        *codes = codes4;
        s4
    } else {
        s6
    }
}

fn second_level_range(fos: Option<FourOverSix>) -> f32 {
    fos.map_or(DEFAULT_RANGE, |f| 6.0 * f.e4m3_range)
}

/// Quantizes `x` ([rows, cols], row-major) to NVFP4 under `opts`.
pub fn quantize<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    opts: &Nvfp4Options,
) -> Result<Nvfp4Tensor, QuantError> {
    check_len(x.len(), rows, cols)?;
    check_aligned(1, cols, NVFP4_BLOCK)?;
    let range = second_level_range(opts.four_over_six);
    match opts.granularity {
        ScaleGranularity::PerTensor => {
            let level = SecondLevel::from_amax(parallel_amax(x), range);
            Ok(quantize_with_level(
                x,
                rows,
                cols,
                level,
                opts.four_over_six,
            ))
        }
        ScaleGranularity::PerToken => {
            let mut data = vec![0u8; rows * cols / 2];
            let mut scales = vec![0u8; rows * cols / NVFP4_BLOCK];
            let mut s_dec = vec![0f32; rows];
            if cols > 0 {
                data.par_chunks_mut(cols / 2)
                    .zip(scales.par_chunks_mut(cols / NVFP4_BLOCK))
                    .zip(s_dec.par_iter_mut())
                    .zip(x.par_chunks(cols))
                    .for_each(|(((d, s), g), row)| {
                        let level = SecondLevel::from_amax(row_amax(row), range);
                        quantize_row(row, level, opts.four_over_six, d, s);
                        // An all-zero row has no scale to carry: s_tok = 0 zeroes its outputs.
                        *g = if level.amax == 0.0 { 0.0 } else { level.s_dec };
                    });
            }
            Ok(Nvfp4Tensor {
                rows,
                cols,
                data,
                scales,
                global: GlobalScale::PerToken(s_dec),
            })
        }
    }
}

/// Quantizes `x` with a given second-level scale (per-tensor), e.g. one shared by gate and up.
pub fn quantize_with_level<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    level: SecondLevel,
    fos: Option<FourOverSix>,
) -> Nvfp4Tensor {
    let mut data = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * cols / NVFP4_BLOCK];
    if cols > 0 {
        data.par_chunks_mut(cols / 2)
            .zip(scales.par_chunks_mut(cols / NVFP4_BLOCK))
            .zip(x.par_chunks(cols))
            .for_each(|((d, s), row)| quantize_row(row, level, fos, d, s));
    }
    Nvfp4Tensor {
        rows,
        cols,
        data,
        scales,
        global: GlobalScale::PerTensor(level.s_dec),
    }
}

/// The second-level scale gate and up share, from the larger of their amaxes (with
/// four-over-six, the range it targets; the same as [`quantize`] uses for one tensor).
pub fn gate_up_level(amax: f32, fos: Option<FourOverSix>) -> SecondLevel {
    SecondLevel::from_amax(amax, second_level_range(fos))
}

/// Gate (w1) and up (w3) of one expert as one tensor: one amax, one S_enc, one stored scale.
pub fn quantize_gate_up<T: Element>(
    gate: &[T],
    up: &[T],
    rows: usize,
    cols: usize,
    fos: Option<FourOverSix>,
) -> Result<(Nvfp4Tensor, Nvfp4Tensor), QuantError> {
    check_len(gate.len(), rows, cols)?;
    check_len(up.len(), rows, cols)?;
    check_aligned(1, cols, NVFP4_BLOCK)?;
    let level = gate_up_level(parallel_amax(gate).max(parallel_amax(up)), fos);
    Ok((
        quantize_with_level(gate, rows, cols, level, fos),
        quantize_with_level(up, rows, cols, level, fos),
    ))
}

fn row_amax<T: Element>(row: &[T]) -> f32 {
    amax_of(row.iter().map(|e| e.to_f32()))
}

/// Tensor amax; max is associative and NaN-skipping, so the split does not change the result.
pub fn parallel_amax<T: Element>(x: &[T]) -> f32 {
    x.par_chunks(4096)
        .map(row_amax)
        .reduce(|| f32::NAN, f32::max)
}

impl Nvfp4Tensor {
    /// Unpacked E2M1 code of element (r, c).
    #[inline]
    pub fn code(&self, r: usize, c: usize) -> u8 {
        let byte = self.data[(r * self.cols + c) / 2];
        if c % 2 == 0 {
            byte & 0xF
        } else {
            byte >> 4
        }
    }

    /// `e2m1(q) * f32(s8) * S_dec` per element (f32 multiplies in that order).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols == 0 {
            return out;
        }
        let blocks_per_row = self.cols / NVFP4_BLOCK;
        out.par_chunks_mut(self.cols)
            .enumerate()
            .for_each(|(r, row)| {
                let g = self.global.of_row(r);
                for (c, o) in row.iter_mut().enumerate() {
                    let s = e4m3_decode(self.scales[r * blocks_per_row + c / NVFP4_BLOCK]);
                    *o = e2m1_decode(self.code(r, c)) * s * g;
                }
            });
        out
    }

    /// The block-scaled values without the second-level scale, `e2m1(q) * f32(s8)`: the
    /// operand a block-scaled MMA multiplies (exact in BF16); S_dec is applied after accumulation.
    pub fn block_scaled_values(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols == 0 {
            return out;
        }
        let blocks_per_row = self.cols / NVFP4_BLOCK;
        out.par_chunks_mut(self.cols)
            .enumerate()
            .for_each(|(r, row)| {
                for (c, o) in row.iter_mut().enumerate() {
                    *o = e2m1_decode(self.code(r, c))
                        * e4m3_decode(self.scales[r * blocks_per_row + c / NVFP4_BLOCK]);
                }
            });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Rows of every kind of value (magnitudes over the whole range, zeros, subnormals,
    /// infinities, NaNs, blocks of only NaN, ties of the E2M1 grid) quantize to the same bytes
    /// through the AVX2 path as through the portable one, from BF16 and from f32.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_rows_equal_the_portable_rows() {
        assert!(
            std::is_x86_feature_detected!("avx2"),
            "the path this checks runs on AVX2 CPUs; run it on one"
        );
        {
            let mut next = crate::quant::xorshift64(0x9E37_79B9_7F4A_7C15u64);
            let cols = 16 * 64;
            let mut x: Vec<f32> = (0..cols * 8)
                .map(|i| {
                    let r = next();
                    let u = (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    match r % 23 {
                        0 => f32::NAN,
                        1 => f32::INFINITY,
                        2 => -0.0,
                        3 => 1e-40,
                        // E2M1 midpoints once scaled by a block whose max maps to 6.
                        4 => [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0][i % 7],
                        _ => u * 2f32.powi((r >> 8) as i32 % 60 - 30),
                    }
                })
                .collect();
            x[16..32].fill(f32::NAN);
            x[32..48].fill(0.0);
            x[48..64].copy_from_slice(&[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0].repeat(2));
            let b: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            for level in [
                SecondLevel::standard(6.0),
                SecondLevel::standard(1e3),
                SecondLevel::standard(3e-3),
            ] {
                let run = |avx2: bool, f32_input: bool| {
                    let (mut data, mut scales) = (vec![0u8; x.len() / 2], vec![0u8; x.len() / 16]);
                    for ((row, d), sc) in (0..8)
                        .zip(data.chunks_exact_mut(cols / 2))
                        .zip(scales.chunks_exact_mut(cols / 16))
                    {
                        let r = row * cols..(row + 1) * cols;
                        match (avx2, f32_input) {
                            // SAFETY: AVX2 was detected above.
                            (true, true) => unsafe { quantize_row_avx2(&x[r], level, None, d, sc) },
                            (true, false) => unsafe {
                                quantize_row_avx2(&b[r], level, None, d, sc)
                            },
                            (false, true) => quantize_row_portable(&x[r], level, None, d, sc),
                            (false, false) => quantize_row_portable(&b[r], level, None, d, sc),
                        }
                    }
                    (data, scales)
                };
                for f32_input in [true, false] {
                    assert_eq!(
                        run(true, f32_input),
                        run(false, f32_input),
                        "{level:?} f32 {f32_input}"
                    );
                }
            }
        }
    }
}
