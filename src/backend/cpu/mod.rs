//! The CPU reference backend: plain Rust + rayon, f32 accumulation in a fixed order, so a
//! token's results never depend on what else is in the batch.

pub mod attention;
mod backend;
pub mod linear;
pub mod ops;

pub use backend::{Cpu, CpuRoute, SwiGlu};
