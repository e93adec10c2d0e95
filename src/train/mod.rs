//! `lockstep train`: a GRPO trainer on the CPU that shares the serving forward pass and the
//! low-precision contract, learns from rollouts served over HTTP and streams its weights back.
//!
//! - [`params`]: f32 master weights and the serving model built from them;
//! - [`policy`]: logprobs of sampled sequences through the engine's forward, and their gradient;
//! - [`backward`], [`ops_grad`], [`linear_grad`]: hand-written reverse mode, backward modes;
//! - [`optim`]: AdamW with gradient clipping.

pub mod backward;
pub mod linear_grad;
pub mod ops_grad;
pub mod optim;
pub mod params;
pub mod policy;
