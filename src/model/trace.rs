//! The activations a forward pass records for the trainer's backward pass. The types live in
//! [`crate::backend::trace`] because each backend fills them from its own buffers.

pub use crate::backend::trace::*;
