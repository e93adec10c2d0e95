//! The CUDA backend: the ops of [`crate::backend::Backend`] on an NVIDIA GPU ([`backend::Cuda`]).
//!
//! libcuda and NVRTC (and cuBLASLt, for the opt-in Blackwell GEMMs) are loaded at run time
//! (cudarc's dynamic loading), so the binary
//! builds and runs on machines without CUDA; `--device auto` uses a GPU when one is present.
//! Kernels live in kernels/*.cu, are embedded in the binary and compiled by NVRTC at start-up
//! for the device's architecture ([`kernels`]). Every op is tested against the CPU reference
//! on fresh random data (tests/cuda_ops.rs, run on a GPU host by scripts/gpu-check.sh).

pub mod args;
pub mod backend;
pub mod block_scaled;
pub mod device;
pub mod graphs;
pub mod hash;
pub mod ipc;
pub mod kernels;
pub mod ops;
pub mod pinned;
pub mod sampling;
pub mod weights;

pub use backend::{Cuda, CudaSizes};
pub use device::{device_count, Gpu};

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    #[error("not supported on the CUDA backend yet: {0}")]
    Unsupported(String),
    #[error("buffer too small: {0}")]
    Capacity(String),
    #[error("kernel arguments: {0}")]
    KernelArgs(String),
    #[error("loading weights: {0}")]
    Load(String),
}
