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

use super::args::{DevPtr, View};
use super::CudaError;

/// A GEMM output its launch left as split-K's segment sums ([`grouped_gemm_unfolded`]):
/// `segments` sums of `stride` elements each from device address `sums`, in the scratch of
/// the GEMMs (valid until the next GEMM launch). Element i is their sum in segment order
/// (kernels/common.cuh `folded`), the additions the GEMM's own fold makes: the readers that
/// take one (the norm's residual, q/k norm + RoPE, routing, SwiGLU, the MoE combine) read the
/// bits the output would have held, without the fold's fences, counters and launch;
/// [`fold_unfolded`] writes them into the output for any other reader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unfolded {
    pub sums: u64,
    pub segments: usize,
    pub stride: usize,
}

/// A reader's sums argument: null without sums, else their address once their stride is the
/// `len` elements the reader takes them as.
fn sums_ptr(sums: Option<Unfolded>, len: usize) -> Result<DevPtr, CudaError> {
    match sums {
        None => Ok(DevPtr(0)),
        Some(u) if u.stride == len && u.segments > 0 => Ok(DevPtr(u.sums)),
        Some(u) => Err(CudaError::Capacity(format!(
            "segment sums of {} x {} elements read as {len}",
            u.segments, u.stride
        ))),
    }
}

/// A reader's segment count: 0 without sums.
fn sums_segments(sums: Option<Unfolded>) -> i32 {
    sums.map_or(0, |u| u.segments as i32)
}

/// `buf` as a kernel argument, once it is checked to hold the `n` elements the kernel touches.
fn need<'a, T>(buf: &'a CudaSlice<T>, n: usize, what: &str) -> Result<View<'a, T>, CudaError> {
    View::prefix(buf, n).ok_or_else(|| {
        CudaError::Capacity(format!("{what}: needs {n} elements, has {}", buf.len()))
    })
}

/// Threads per block of the grid-stride kernels.
const BLOCK: u32 = 256;
