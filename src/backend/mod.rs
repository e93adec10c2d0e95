//! The ops a forward pass needs, behind small traits, and the CPU implementation that is the
//! reference for every other backend.
//!
//! Linear layers are the one place where formats differ (BF16/F32, MXFP8, NVFP4), so they are
//! a trait with one implementation per format and a factory ([`cpu::linear::make_linear`]);
//! everything else (norms, RoPE, attention, routing) is format-free and lives in plain
//! functions of `cpu`. A CUDA backend provides the same ops and is tested against these.

pub mod cpu;

use crate::quant::Format;

/// A linear layer `y = x W^T` with `W` of shape `[out_features, in_features]`, in whatever
/// format its weights are stored.
pub trait Linear: Send + Sync {
    fn in_features(&self) -> usize;
    fn out_features(&self) -> usize;
    fn format(&self) -> Format;
    /// `x`: `[rows, in_features]` row-major; `out`: `[rows, out_features]`. Each output row
    /// depends only on its input row (batch invariance).
    fn forward(&self, x: &[f32], rows: usize, out: &mut [f32]);
    /// The dense weight the layer computes with, dequantized (`[out, in]`), for the trainer
    /// and for tests.
    fn dequantized_weight(&self) -> Vec<f32>;
    /// The activation values this layer really multiplies for the input `x` (`[rows,
    /// in_features]`): the quantized activation dequantized, its per-token scale folded in;
    /// `x` itself for high-precision layers. The trainer's `dequantized` backward uses it.
    fn effective_input(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let _ = rows;
        x.to_vec()
    }
    /// Bytes of weight storage (weights and scales).
    fn storage_bytes(&self) -> usize;
}
