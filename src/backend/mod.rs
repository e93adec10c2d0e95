//! The ops a forward pass needs, behind small traits, and two implementations: the CPU
//! reference and CUDA. The forward itself is written once, in `model::forward`, against the
//! [`Backend`] trait; this module depends on nothing above `quant`, `checkpoint` and
//! `sampling`.
//!
//! Linear layers are the one place where formats differ (BF16/F32, MXFP8, NVFP4), so they are
//! a trait with one implementation per format and a factory ([`cpu::linear::make_linear`]);
//! everything else (norms, RoPE, attention, routing) is format-free and lives in plain
//! functions of `cpu`. A CUDA backend provides the same ops and is tested against these.

pub mod cpu;
pub mod cuda;
pub mod step;
pub mod trace;

pub use step::{Backend, Buffers, Dims, Logits, MoeShape, Sampled, SeqPlan, StepPlan};

use crate::checkpoint::CheckpointPart;
use crate::quant::{slot, Format};

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
    /// The stored weight in checkpoint layout (`quant::slot`): the tensors `lockstep convert`
    /// writes for this layer, borrowed where the layout is the held one.
    fn checkpoint_parts(&self) -> Vec<CheckpointPart<'_>> {
        let shape = vec![self.out_features(), self.in_features()];
        match self.storage() {
            Storage::F32(w) => vec![CheckpointPart::from_f32("weight", shape, w)],
            Storage::Bf16(w) => vec![CheckpointPart::bf16("weight", shape, w)],
            Storage::Mxfp8(q) => slot::mxfp8_parts(q),
            Storage::Nvfp4 { weight, .. } => slot::nvfp4_parts(weight),
        }
    }
    /// Copies `new`'s weights into this layer's existing buffers when both are the same kind
    /// and size, so a live update allocates nothing here and the buffers never move (what a
    /// GPU backend's captured graphs need). Returns false, changing nothing, otherwise.
    fn overwrite_from(&mut self, new: &dyn Linear) -> bool;
    /// For [`Linear::overwrite_from`]: the concrete layer behind the trait object.
    fn as_any(&self) -> &dyn std::any::Any;
    /// The stored weights as they are, for uploading to another backend.
    fn storage(&self) -> Storage<'_>;
    /// A copy of the layer (a streamed update's shadow of the served weights).
    fn boxed_clone(&self) -> Box<dyn Linear>;
}

impl Clone for Box<dyn Linear> {
    fn clone(&self) -> Self {
        self.boxed_clone()
    }
}

/// A linear layer's weights in their storage format.
pub enum Storage<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    Mxfp8(&'a crate::quant::Mxfp8Tensor),
    Nvfp4 {
        weight: &'a crate::quant::Nvfp4Tensor,
        activation_scale: crate::quant::nvfp4::ScaleGranularity,
        four_over_six: Option<crate::quant::FourOverSix>,
    },
}
