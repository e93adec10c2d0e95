//! [`WeightStore`]: the served weights by the layout's names, wherever they live (host memory
//! for the CPU backend, device memory for CUDA). Every live update, streamed or from disk,
//! ends in [`WeightStore::write`]: checked whole first (a name the layout does not know, a
//! wrong kind, shape or storage is an error naming the tensor, never a panic), then written
//! into the buffers the weights already live in, so a refused update changes nothing and an
//! accepted one moves no memory.

use std::collections::BTreeMap;

use super::checksum::WeightsChecksum;
use super::slots::{Replacement, SlotShape};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StoreError {
    #[error("unknown weight names: {0:?}")]
    UnknownNames(Vec<String>),
    #[error("replacement for `{name}`: {why}")]
    Mismatch { name: String, why: String },
    #[error("the device: {0}")]
    Device(String),
}

impl StoreError {
    /// A replacement that does not fit its slot.
    pub fn mismatch(name: &str, why: &str) -> StoreError {
        StoreError::Mismatch {
            name: name.into(),
            why: why.into(),
        }
    }
}

/// The served weights by checkpoint name.
pub trait WeightStore {
    /// Every tensor a live update may write, by checkpoint name.
    fn slot_shapes(&mut self) -> BTreeMap<String, SlotShape>;

    /// Every tensor in checkpoint layout, hashed (the same bytes and hashes on every backend
    /// for equal weights).
    fn checksum(&mut self) -> Result<WeightsChecksum, StoreError>;

    /// Writes prepared replacements into the served weights, all or none. Returns them (or
    /// what they displaced) for the caller to free off the engine thread.
    fn write(
        &mut self,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, StoreError>;

    /// The served contents of the slots `names`, copied out in checkpoint layout (by slot
    /// name): what an in-place commit keeps, to write back if it cannot finish.
    fn parts_of(&mut self, names: &[String]) -> Result<SlotParts, StoreError>;
}

/// Slots in checkpoint layout: each slot's name and its checkpoint parts.
pub type SlotParts = Vec<(String, Vec<crate::checkpoint::CheckpointPart<'static>>)>;
