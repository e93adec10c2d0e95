//! Reading tensors another process on this GPU shares through CUDA IPC, as torch's
//! `reduce_tensor` describes them (`/update_weights_from_tensor`): open the allocation's
//! `cudaIpcMemHandle_t`, wait on the producer's IPC event when it asks for that, copy the
//! tensor's bytes, close the handle, and give back the producer's reference (its counter in a
//! shared-memory file) so the trainer can free the tensor.

use std::collections::HashMap;

use cudarc::driver::sys;

use super::Gpu;

/// `cudaIpcMemHandle_t` / `cudaIpcEventHandle_t`.
pub const IPC_HANDLE_BYTES: usize = 64;
const _: () = assert!(std::mem::size_of::<sys::CUipcMemHandle_st>() == IPC_HANDLE_BYTES);
const _: () = assert!(std::mem::size_of::<sys::CUipcEventHandle_st>() == IPC_HANDLE_BYTES);

/// torch's counter of consumers of one shared CUDA storage: entry `index` (i64) of the
/// shared-memory file `file`, after torch's 64-byte map header (`RefcountedMapAllocator`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefCounter {
    pub file: String,
    pub index: usize,
}

/// One contiguous byte range of a shared allocation (a whole tensor, or a flattened bucket).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpcSource {
    /// For error messages: the tensor (or `flattened_tensor`).
    pub name: String,
    pub handle: [u8; IPC_HANDLE_BYTES],
    /// From the start of the allocation the handle names.
    pub offset: usize,
    pub len: usize,
    /// The producer's event to wait on before reading (torch's `event_sync_required`).
    pub event: Option<[u8; IPC_HANDLE_BYTES]>,
    pub ref_counter: Option<RefCounter>,
}

#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct IpcError {
    /// The tensor the error is about.
    pub name: String,
    pub message: String,
}

/// Opened allocations, closed on every path (errors included).
struct Opened(Vec<sys::CUdeviceptr>);

impl Drop for Opened {
    fn drop(&mut self) {
        for &p in &self.0 {
            // SAFETY: each pointer came from cuIpcOpenMemHandle in this context and is closed
            // once; nothing reads it after this guard goes.
            unsafe { sys::cuIpcCloseMemHandle(p) };
        }
    }
}

struct Events(Vec<sys::CUevent>);

impl Drop for Events {
    fn drop(&mut self) {
        for &e in &self.0 {
            // SAFETY: each event came from cuIpcOpenEventHandle and is destroyed once.
            unsafe { sys::cuEventDestroy_v2(e) };
        }
    }
}

fn check(r: sys::CUresult, name: &str, what: &str) -> Result<(), IpcError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(IpcError {
            name: name.to_string(),
            message: format!("tensor `{name}`: {what} failed ({r:?})"),
        })
    }
}

/// Copies every source to host memory (one buffer each, in order). Handles are opened once per
/// allocation and closed before returning, success or not; every source's producer reference is
/// given back either way.
pub fn read_to_host(gpu: &Gpu, sources: &[IpcSource]) -> Result<Vec<Vec<u8>>, IpcError> {
    let result = read(gpu, sources);
    release_references(sources);
    result
}

/// Gives back the producer's reference of every source (best effort: a producer that exited
/// took its counters with it), so the trainer can free the tensors; for a payload refused
/// before anything was read, as well as after reading.
pub fn release_references(sources: &[IpcSource]) {
    for s in sources {
        if let Some(rc) = &s.ref_counter {
            if let Err(e) = release(rc) {
                tracing::warn!(
                    "tensor `{}`: could not release the producer's reference ({}#{}): {e}",
                    s.name,
                    rc.file,
                    rc.index
                );
            }
        }
    }
}

fn read(gpu: &Gpu, sources: &[IpcSource]) -> Result<Vec<Vec<u8>>, IpcError> {
    let first = sources.first().map(|s| s.name.as_str()).unwrap_or("");
    gpu.ctx.bind_to_thread().map_err(|e| IpcError {
        name: first.to_string(),
        message: format!("binding the CUDA context: {e}"),
    })?;
    let stream = gpu.stream.cu_stream();
    let mut opened = Opened(Vec::new());
    let mut events = Events(Vec::new());
    let mut bases: HashMap<[u8; IPC_HANDLE_BYTES], (sys::CUdeviceptr, usize)> = HashMap::new();
    let mut waited: Vec<[u8; IPC_HANDLE_BYTES]> = Vec::new();
    for s in sources {
        if let Some(ev) = s.event.filter(|e| !waited.contains(e)) {
            let handle = sys::CUipcEventHandle_st {
                reserved: ev.map(|b| b as std::ffi::c_char),
            };
            let mut event = std::ptr::null_mut();
            // SAFETY: out-parameter; the handle is plain bytes the driver validates.
            check(
                unsafe { sys::cuIpcOpenEventHandle(&mut event, handle) },
                &s.name,
                "cuIpcOpenEventHandle (the producer's CUDA event)",
            )?;
            events.0.push(event);
            // SAFETY: the event was just opened; the stream is the engine's.
            check(
                unsafe { sys::cuStreamWaitEvent(stream, event, 0) },
                &s.name,
                "cuStreamWaitEvent",
            )?;
            waited.push(ev);
        }
        if bases.contains_key(&s.handle) {
            continue;
        }
        let handle = sys::CUipcMemHandle_st {
            reserved: s.handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-parameter; a handle from another machine or a process that exited is
        // refused by the driver with an error, not undefined behaviour.
        check(
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    handle,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            &s.name,
            "cuIpcOpenMemHandle (is the producer a process on this machine's GPU, still alive, and its tensor allocated without expandable segments?)",
        )?;
        opened.0.push(ptr);
        let (mut base, mut size) = (0, 0);
        // SAFETY: out-parameters over a pointer just mapped.
        check(
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) },
            &s.name,
            "cuMemGetAddressRange",
        )?;
        // The mapping is the whole allocation: what lies past `ptr` bounds every range in it.
        let usable = (base as usize + size) - ptr as usize;
        bases.insert(s.handle, (ptr, usable));
    }
    let mut out = Vec::with_capacity(sources.len());
    for s in sources {
        let (ptr, usable) = bases[&s.handle];
        if s.offset.checked_add(s.len).is_none_or(|end| end > usable) {
            return Err(IpcError {
                name: s.name.clone(),
                message: format!(
                    "tensor `{}`: bytes {}..{} lie outside the shared allocation ({usable} bytes)",
                    s.name,
                    s.offset,
                    s.offset + s.len
                ),
            });
        }
        let mut host = vec![0u8; s.len];
        // SAFETY: the source range lies inside the mapped allocation (checked above) and
        // `host` has `len` bytes; the copy is complete after the synchronize below, before
        // `host` is read or the mapping closed.
        check(
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    host.as_mut_ptr().cast(),
                    ptr + s.offset as u64,
                    s.len,
                    stream,
                )
            },
            &s.name,
            "copying the tensor to the host",
        )?;
        out.push(host);
    }
    // SAFETY: the engine's stream.
    check(
        unsafe { sys::cuStreamSynchronize(stream) },
        first,
        "cuStreamSynchronize",
    )?;
    Ok(out)
}

/// Decrements the producer's counter (what torch's receiving side does when it frees its
/// copy), so the trainer's caching allocator may reuse the memory.
fn release(rc: &RefCounter) -> std::io::Result<()> {
    let path = format!("/dev/shm/{}", rc.file.trim_start_matches('/'));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)?;
    let at = 64 + rc.index * 8;
    // SAFETY: a shared-memory file torch created and keeps while the counter is live; it is
    // only written through the atomic below.
    let mut map = unsafe { memmap2::MmapMut::map_mut(&file)? };
    if map.len() < at + 8 {
        return Err(std::io::Error::other(format!(
            "{path} has {} bytes, the counter is at {at}",
            map.len()
        )));
    }
    let p = map[at..at + 8].as_mut_ptr();
    if p.align_offset(8) != 0 {
        return Err(std::io::Error::other("misaligned counter"));
    }
    // SAFETY: 8 aligned bytes inside the mapping; torch reads the counter as an int64.
    let counter = unsafe { &*(p as *const std::sync::atomic::AtomicI64) };
    counter.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    Ok(())
}
