//! xxh3_64 of byte ranges in device memory, the checksum's hash ([`crate::model::checksum`]),
//! computed on the host from pinned copies: a few worker threads, each with a stream of its own
//! and two pinned buffers (kept for the next call), copy the next chunk of a range while hashing
//! the last one. A device
//! copy of tens of gigabytes is hashed at about the host link's bandwidth instead of through
//! freshly allocated pageable buffers (a page fault per 4 KiB).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaContext, CudaStream};
use xxhash_rust::xxh3::Xxh3;

use super::CudaError;

/// Bytes one pinned buffer holds (two per worker).
const CHUNK: usize = 16 << 20;
/// Workers at most: the host link saturates before the host's cores do.
const WORKERS: usize = 8;

/// A pinned host buffer, freed on drop.
struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a plain host allocation; one worker uses it at a time (it is taken out of the pool).
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(len: usize) -> Result<Pinned, CudaError> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: out-parameter; the context is bound to this thread by the caller.
        let r = unsafe { sys::cuMemHostAlloc(&mut ptr, len, 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::Driver(result::DriverError(r)));
        }
        Ok(Pinned {
            ptr: ptr.cast(),
            len,
        })
    }

    fn bytes(&self, len: usize) -> &[u8] {
        assert!(len <= self.len);
        // SAFETY: `len` bytes of the allocation, written by a finished copy.
        unsafe { std::slice::from_raw_parts(self.ptr, len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc, freed once, no copy in flight (every copy is
        // waited for before its buffer is read or dropped).
        unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}

/// One worker's stream and buffers, kept between calls: pinning memory costs milliseconds
/// per buffer, more than hashing it.
struct Lane {
    ctx: sys::CUcontext,
    stream: Arc<CudaStream>,
    bufs: [Pinned; 2],
    /// Recorded after the copies into the buffer of the same index.
    copied: [sys::CUevent; 2],
}

impl Drop for Lane {
    fn drop(&mut self) {
        for e in self.copied {
            // SAFETY: created for this lane, destroyed once.
            unsafe { sys::cuEventDestroy_v2(e) };
        }
    }
}

// SAFETY: the context handle is only compared; the stream and buffers are used by one thread
// at a time (a lane is taken out of the pool while in use).
unsafe impl Send for Lane {}

/// Idle lanes (at most `WORKERS` pinned pairs stay allocated: 256 MiB of host memory).
static LANES: Mutex<Vec<Lane>> = Mutex::new(Vec::new());

fn take_lane(ctx: &Arc<CudaContext>) -> Result<Lane, CudaError> {
    let mine = ctx.cu_ctx();
    let found = {
        let mut idle = LANES.lock().expect("hash lanes");
        idle.retain(|l| l.ctx == mine);
        idle.pop()
    };
    match found {
        Some(lane) => Ok(lane),
        None => {
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
            Ok(Lane {
                ctx: mine,
                stream: ctx.new_stream()?,
                bufs: [Pinned::new(CHUNK)?, Pinned::new(CHUNK)?],
                copied: [result::event::create(flags)?, result::event::create(flags)?],
            })
        }
    }
}

/// The xxh3_64 of each range `(device address, bytes)`, in order. The ranges must stay valid
/// and unchanged until this returns.
pub fn xxh3_of_device(
    ctx: &Arc<CudaContext>,
    ranges: &[(u64, usize)],
) -> Result<Vec<u64>, CudaError> {
    let units = plan(ranges);
    let workers = WORKERS.min(units.len());
    let next = AtomicUsize::new(0);
    let out = Mutex::new(vec![0u64; ranges.len()]);
    let failed: Mutex<Option<CudaError>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                let run = || -> Result<(), CudaError> {
                    ctx.bind_to_thread()?;
                    let lane = take_lane(ctx)?;
                    let r = worker(&lane, ranges, &units, &next, &out);
                    if r.is_ok() {
                        LANES.lock().expect("hash lanes").push(lane);
                    }
                    r
                };
                if let Err(e) = run() {
                    failed.lock().expect("hash error lock").get_or_insert(e);
                    // The other workers stop at their next unit.
                    next.store(units.len(), Ordering::Relaxed);
                }
            });
        }
    });
    if let Some(e) = failed.into_inner().expect("hash error lock") {
        return Err(e);
    }
    Ok(out.into_inner().expect("hash lock"))
}

/// What a worker copies and hashes at once.
enum Unit {
    /// Consecutive ranges that fit one buffer together: copied into it back to back, hashed
    /// while the worker's next unit is copied into its other buffer.
    Small(std::ops::Range<usize>),
    /// One range larger than a buffer: copied chunk by chunk through both buffers.
    Large(usize),
}

/// The ranges as units, the large ones first (the longest work starts first); small units are
/// runs of consecutive ranges of at most `CHUNK` bytes together.
fn plan(ranges: &[(u64, usize)]) -> Vec<Unit> {
    let mut units = Vec::new();
    let mut small = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, &(_, len)) in ranges.iter().enumerate() {
        if len > CHUNK || bytes + len > CHUNK {
            if i > start {
                small.push(Unit::Small(start..i));
            }
            (start, bytes) = (i, 0);
        }
        if len > CHUNK {
            units.push(Unit::Large(i));
            start = i + 1;
        } else {
            bytes += len;
        }
    }
    if ranges.len() > start {
        small.push(Unit::Small(start..ranges.len()));
    }
    units.extend(small);
    units
}

fn worker(
    lane: &Lane,
    ranges: &[(u64, usize)],
    units: &[Unit],
    next: &AtomicUsize,
    out: &Mutex<Vec<u64>>,
) -> Result<(), CudaError> {
    let cu = lane.stream.cu_stream();
    // A small unit whose copies are queued, and the buffer they go to.
    let mut pending: Option<(std::ops::Range<usize>, usize)> = None;
    let finish = |pending: &mut Option<(std::ops::Range<usize>, usize)>| -> Result<(), CudaError> {
        if let Some((r, b)) = pending.take() {
            // SAFETY: recorded on this lane's stream after the unit's copies.
            unsafe { result::event::synchronize(lane.copied[b]) }?;
            let mut at = 0;
            let mut hashes = Vec::with_capacity(r.len());
            for i in r.clone() {
                let len = ranges[i].1;
                hashes.push(xxhash_rust::xxh3::xxh3_64(
                    &lane.bufs[b].bytes(at + len)[at..],
                ));
                at += len;
            }
            let mut out = out.lock().expect("hash lock");
            for (i, h) in r.zip(hashes) {
                out[i] = h;
            }
        }
        Ok(())
    };
    let mut free = 0;
    loop {
        match units.get(next.fetch_add(1, Ordering::Relaxed)) {
            Some(Unit::Small(r)) => {
                let mut at = 0;
                for &(ptr, len) in &ranges[r.clone()] {
                    if len > 0 {
                        // SAFETY: the range is valid device memory (the caller's promise); the
                        // unit's ranges fit the buffer together, which is read only after the
                        // event recorded below has completed.
                        unsafe {
                            result::memcpy_dtoh_async(
                                std::slice::from_raw_parts_mut(lane.bufs[free].ptr.add(at), len),
                                ptr,
                                cu,
                            )
                        }?;
                    }
                    at += len;
                }
                // SAFETY: this lane's event and stream.
                unsafe { result::event::record(lane.copied[free], cu) }?;
                finish(&mut pending)?;
                pending = Some((r.clone(), free));
                free = 1 - free;
            }
            Some(&Unit::Large(i)) => {
                finish(&mut pending)?;
                let h = hash_large(lane, ranges[i])?;
                out.lock().expect("hash lock")[i] = h;
            }
            None => return finish(&mut pending),
        }
    }
}

/// One range through both buffers: chunk c + 1 is copied while chunk c is hashed.
fn hash_large(lane: &Lane, (ptr, len): (u64, usize)) -> Result<u64, CudaError> {
    let cu = lane.stream.cu_stream();
    let bufs = &lane.bufs;
    let mut hasher = Xxh3::new();
    let chunks = len.div_ceil(CHUNK);
    let chunk = |c: usize| (c * CHUNK, CHUNK.min(len - c * CHUNK));
    let copy = |c: usize| -> Result<(), CudaError> {
        let (at, n) = chunk(c);
        // SAFETY: the range is valid device memory (the caller's promise) and the buffer
        // holds `n` bytes; it is read only after the stream is synchronized.
        unsafe {
            result::memcpy_dtoh_async(
                std::slice::from_raw_parts_mut(bufs[c % 2].ptr, n),
                ptr + at as u64,
                cu,
            )
        }?;
        Ok(())
    };
    if chunks > 0 {
        copy(0)?;
    }
    for c in 0..chunks {
        // SAFETY: this lane's stream.
        unsafe { result::stream::synchronize(cu) }?;
        if c + 1 < chunks {
            copy(c + 1)?;
        }
        hasher.update(bufs[c % 2].bytes(chunk(c).1));
    }
    Ok(hasher.digest())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every range lands in exactly one unit, small units hold consecutive ranges of at most
    /// one buffer together, and the large ranges come first.
    #[test]
    fn the_plan_covers_every_range_once_in_buffer_sized_units() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for case in 0..200 {
            let n = case % 40;
            let ranges: Vec<(u64, usize)> = (0..n)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    let len = match s % 5 {
                        0 => 0,
                        1 => CHUNK,
                        2 => CHUNK + (s >> 40) as usize % 1000,
                        _ => (s >> 20) as usize % (CHUNK / 3),
                    };
                    (0, len)
                })
                .collect();
            let units = plan(&ranges);
            let mut seen = vec![0; n];
            let mut small_started = false;
            for u in &units {
                match u {
                    Unit::Large(i) => {
                        assert!(!small_started, "a large range after a small unit");
                        assert!(ranges[*i].1 > CHUNK);
                        seen[*i] += 1;
                    }
                    Unit::Small(r) => {
                        small_started = true;
                        assert!(!r.is_empty());
                        let bytes: usize = ranges[r.clone()].iter().map(|r| r.1).sum();
                        assert!(bytes <= CHUNK, "a small unit of {bytes} bytes");
                        for i in r.clone() {
                            seen[i] += 1;
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "case {case}: {seen:?}");
        }
    }
}
