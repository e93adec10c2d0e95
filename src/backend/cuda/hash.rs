//! xxh3_64 of byte ranges in device memory, the checksum's hash ([`crate::model::checksum`]),
//! computed where the bytes lie (kernels/hash.cu, one block per range) and bit for bit what the
//! `xxhash` crates give on the host: tens of gigabytes of a colocated trainer's tensors are
//! hashed at device memory speed instead of through the host link.

use super::args::View;
use super::device::Gpu;
use super::kernels::Kernel;
use super::CudaError;

/// Threads per range (`HASH_THREADS` in hash.cu): each sums one 1 KiB block at a time.
const THREADS: u32 = 256;

/// The xxh3_64 of each range `(device address, bytes)`, in order, computed on `gpu`'s stream
/// (which this synchronizes). The ranges must be readable device memory of this context and
/// stay unchanged until this returns.
pub fn xxh3_of_device(gpu: &Gpu, ranges: &[(u64, usize)]) -> Result<Vec<u64>, CudaError> {
    let n = ranges.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let count = i32::try_from(n)
        .map_err(|_| CudaError::Capacity(format!("{n} ranges to hash in one launch")))?;
    let ptrs: Vec<u64> = ranges.iter().map(|r| r.0).collect();
    let lens: Vec<u64> = ranges.iter().map(|r| r.1 as u64).collect();
    let (ptrs, lens) = (gpu.upload(&ptrs)?, gpu.upload(&lens)?);
    let out = gpu.alloc::<u64>(n)?;
    gpu.launch(
        Kernel::Xxh3Ranges,
        (n as u32, 1, 1),
        THREADS,
        // The tables hold `n` entries each; the kernel reads range r's bytes only.
        (
            View::whole(&ptrs),
            View::whole(&lens),
            count,
            View::whole(&out),
        ),
    )?;
    let hashes = gpu.download(&out, n)?;
    gpu.synchronize()?;
    Ok(hashes)
}
