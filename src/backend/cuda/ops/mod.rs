//! Typed launch wrappers, one per kernel, one file per kernels/*.cu
//! source: each checks that its buffers hold what the kernel will touch, then queues the launch
//! on the engine stream. Shapes are row-major, activations f32, like the CPU backend's.
//!
//! Everything is re-exported here, so callers name `ops::rms_norm`, `ops::WeightData`, ...
//! whichever file it lives in. kernels/sampling.cu is launched by `super::sampling`, the
//! Blackwell operand preparation of kernels/quant.cu by `super::block_scaled`.

mod attention;
mod elementwise;
mod gemm;
mod moe;
mod prefill_attention;
mod quant;

pub use attention::*;
pub use elementwise::*;
pub use gemm::*;
pub use moe::*;
pub use prefill_attention::*;
pub use quant::*;

use cudarc::driver::CudaSlice;

use super::args::View;
use super::CudaError;

/// `buf` as a kernel argument, once it is checked to hold the `n` elements the kernel touches.
fn need<'a, T>(buf: &'a CudaSlice<T>, n: usize, what: &str) -> Result<View<'a, T>, CudaError> {
    View::prefix(buf, n).ok_or_else(|| {
        CudaError::Capacity(format!("{what}: needs {n} elements, has {}", buf.len()))
    })
}

/// Threads per block of the grid-stride kernels.
const BLOCK: u32 = 256;
