//! Copies from the host to the device through a ring of page-locked buffers: the host fills
//! one buffer (reading a file, say) while the device copies out of the others, and the copies
//! run at the host link's speed, which copies out of pageable memory do not (the driver stages
//! those through its own buffers, one at a time, and the call waits for them).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent};

use super::device::Gpu;
use super::CudaError;

/// A failed [`HostRing::upload`]: the device, or the source filling a buffer.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("reading the bytes to upload: {0}")]
    Read(#[from] std::io::Error),
}

/// One page-locked buffer and the copy last queued out of it.
struct Buffer {
    ptr: *mut u8,
    len: usize,
    copied: Option<CudaEvent>,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer's memory is its own, reached only through `&mut self`.
unsafe impl Send for Buffer {}

impl Buffer {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Buffer, CudaError> {
        ctx.bind_to_thread()?;
        // SAFETY: a fresh allocation of `len` bytes (plain page-locked memory, readable by the
        // host: not write-combined), freed in `drop`.
        let ptr = unsafe { cudarc::driver::result::malloc_host(len, 0) }? as *mut u8;
        Ok(Buffer {
            ptr,
            len,
            copied: None,
            ctx: ctx.clone(),
        })
    }

    /// The memory, once the device has finished the copy last queued out of it.
    fn writable(&mut self) -> Result<&mut [u8], CudaError> {
        if let Some(e) = self.copied.take() {
            e.synchronize()?;
        }
        // SAFETY: `len` bytes of our allocation; no copy reads them any more.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // A queued copy may still read the memory: wait for it before freeing.
        if let Some(e) = self.copied.take() {
            let _ = e.synchronize();
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `malloc_host` in `new`, freed once.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
    }
}

/// A ring of page-locked buffers for host-to-device copies.
pub struct HostRing {
    buffers: Vec<Buffer>,
    next: usize,
}

impl HostRing {
    /// `count` buffers (at least two, so filling and copying overlap) of `bytes` each.
    pub fn new(gpu: &Gpu, count: usize, bytes: usize) -> Result<HostRing, CudaError> {
        let buffers = (0..count.max(2))
            .map(|_| Buffer::new(&gpu.ctx, bytes.max(1)))
            .collect::<Result<_, _>>()?;
        Ok(HostRing { buffers, next: 0 })
    }

    /// Copies `len` bytes to the device address `dst` (this context's, `len` bytes writable)
    /// on `gpu`'s stream, a buffer at a time: `fill(offset, buf)` writes the source's bytes
    /// `offset..offset + buf.len()` into `buf`. The copies are queued, not awaited: the caller
    /// synchronizes the stream before it reads `dst`.
    pub fn upload(
        &mut self,
        gpu: &Gpu,
        dst: u64,
        len: usize,
        mut fill: impl FnMut(usize, &mut [u8]) -> std::io::Result<()>,
    ) -> Result<(), UploadError> {
        let mut done = 0;
        while done < len {
            let count = self.buffers.len();
            let buffer = &mut self.buffers[self.next];
            self.next = (self.next + 1) % count;
            let n = buffer.len.min(len - done);
            let chunk = &mut buffer.writable()?[..n];
            fill(done, chunk)?;
            gpu.ctx.bind_to_thread().map_err(CudaError::from)?;
            // SAFETY: `dst + done` has `n` writable bytes (the caller's promise); `chunk` is
            // page-locked and not written again before `copied` says the copy is done.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dst + done as u64,
                    &chunk[..],
                    gpu.stream.cu_stream(),
                )
            }
            .map_err(CudaError::from)?;
            buffer.copied = Some(gpu.stream.record_event(None).map_err(CudaError::from)?);
            done += n;
        }
        Ok(())
    }
}

/// Host-to-device bandwidth through a ring of `count` page-locked buffers of `bytes`: the
/// median of 5 uploads of 1 GiB whose source writes nothing (so only the link is timed), after
/// a warm-up. What an in-place commit's read-back could reach if reading the spill cost nothing.
pub fn ring_bandwidth(gpu: &Gpu, count: usize, bytes: usize) -> Result<f64, UploadError> {
    let n = 1usize << 30;
    let mut ring = HostRing::new(gpu, count, bytes)?;
    let dst = gpu.alloc::<u8>(n)?;
    let base = cudarc::driver::DevicePtr::device_ptr(&dst, &gpu.stream).0;
    let mut times = Vec::with_capacity(5);
    for round in 0..6 {
        let t = std::time::Instant::now();
        ring.upload(gpu, base, n, |_, _| Ok(()))?;
        gpu.synchronize()?;
        if round > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(n as f64 / times[times.len() / 2])
}
