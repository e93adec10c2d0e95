//! THE low-precision contract (shared/QUANT_CONTRACT.md): element codecs, MXFP8, NVFP4,
//! the 128x4 scale swizzle, block-FP8 dequantization, precision recipes and one slot's
//! checkpoint layout and stored bytes (`slot`).
//!
//! Pure Rust, no GPU, no I/O. The converter, the server's online quantizer, the CUDA
//! activation quantizers' tests and the trainer's fake-quant all go through this module, so
//! one tensor quantizes to the same bytes everywhere. Work is split over rows/blocks with
//! rayon; every block is computed independently, so results never depend on thread count.

pub mod codec;
pub mod fp8_block;
pub mod mxfp8;
pub mod nvfp4;
pub mod recipe;
pub mod slot;
pub mod swizzle;

pub use mxfp8::{BlockAxis, Mxfp8Tensor, MXFP8_BLOCK};
pub use nvfp4::{
    ErrorMetric, FourOverSix, GlobalScale, Nvfp4Options, Nvfp4Tensor, ScaleGranularity, NVFP4_BLOCK,
};
pub use recipe::{Format, Recipe, TensorFormat};

use half::{bf16, f16};

/// Errors of the contract's entry points: all are caller mistakes about shapes.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QuantError {
    #[error("dimension {dim} has size {size}, which is not a multiple of the block size {block}")]
    NotBlockAligned {
        dim: usize,
        size: usize,
        block: usize,
    },
    #[error("expected {expected} elements for shape [{rows}, {cols}], got {got}")]
    LengthMismatch {
        rows: usize,
        cols: usize,
        expected: usize,
        got: usize,
    },
    #[error("{0}")]
    Invalid(String),
}

/// A high-precision input element, widened exactly to f32 before any arithmetic.
pub trait Element: Copy + Send + Sync {
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for bf16 {
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl Element for f16 {
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// A block of `N` elements widened to f32 (the quantizers' first step on every block).
#[inline(always)]
pub(crate) fn block_f32<const N: usize, T: Element>(block: &[T]) -> [f32; N] {
    let mut x = [0f32; N];
    for (v, e) in x.iter_mut().zip(block) {
        *v = e.to_f32();
    }
    x
}

/// The quantizer tests' pseudo-random source: xorshift64 from `seed` (not zero).
#[cfg(test)]
pub(crate) fn xorshift64(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

pub(crate) fn check_len(len: usize, rows: usize, cols: usize) -> Result<(), QuantError> {
    let expected = rows * cols;
    if len != expected {
        return Err(QuantError::LengthMismatch {
            rows,
            cols,
            expected,
            got: len,
        });
    }
    Ok(())
}

pub(crate) fn check_aligned(dim: usize, size: usize, block: usize) -> Result<(), QuantError> {
    if size % block != 0 {
        return Err(QuantError::NotBlockAligned { dim, size, block });
    }
    Ok(())
}
