//! Reading tensors another process on this GPU shares through CUDA IPC, as torch's
//! `reduce_tensor` describes them (`/update_weights_from_tensor`): open the allocation's
//! `cudaIpcMemHandle_t`, wait on the producer's IPC event when it asks for that, copy the
//! tensor's bytes (device to device into the weights, or to the host), close the handle, and
//! give back the producer's reference (its counter in a shared-memory file) so the trainer can
//! free the tensor.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

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

/// The shared allocations of one payload, opened in this process, with the producer's events
/// waited for: device ranges a copy may read. Dropping it closes every handle and gives the
/// producer's references back, so whatever holds it (a replacement written device to device)
/// keeps the trainer's tensors mapped and reserved until it is done with them.
pub struct IpcMapping {
    ctx: Arc<CudaContext>,
    sources: Vec<IpcSource>,
    /// Per source: its first byte in this process.
    starts: Vec<sys::CUdeviceptr>,
    /// Every opened allocation, closed once each (by `close` or on drop).
    opened: std::sync::Mutex<Vec<sys::CUdeviceptr>>,
    released: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMapping")
            .field("sources", &self.sources.len())
            .finish()
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        self.close();
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

/// Gives back the producer's reference of every source (best effort: a producer that exited
/// took its counters with it), so the trainer can free the tensors; for a payload refused
/// before anything was opened (an opened one gives them back when dropped).
pub fn release_references(sources: &[IpcSource]) {
    release(
        sources
            .iter()
            .filter_map(|s| Some((s.name.as_str(), s.ref_counter.as_ref()?))),
    );
}

/// Gives back the producer's references of tensors a payload named but that were never opened
/// (a payload refused while it was decoded); best effort, as `release_references`.
pub fn release_counters(counters: &[RefCounter]) {
    release(counters.iter().map(|rc| ("", rc)));
}

fn release<'a>(counters: impl Iterator<Item = (&'a str, &'a RefCounter)>) {
    for (name, rc) in counters {
        if let Err(e) = decrement(rc) {
            tracing::warn!(
                "tensor `{name}`: could not release the producer's reference ({}#{}): {e}",
                rc.file,
                rc.index
            );
        }
    }
}

impl IpcMapping {
    /// Opens every source's allocation (once per handle), checks that each source lies
    /// inside it, and waits for the producer's events on `gpu`'s stream, then for that stream:
    /// when this returns, the tensors hold what the producer wrote, for a copy on any stream.
    /// On failure everything opened is closed and the references are given back.
    pub fn open(gpu: &Gpu, sources: Vec<IpcSource>) -> Result<IpcMapping, IpcError> {
        let mut mapping = IpcMapping {
            ctx: gpu.ctx.clone(),
            sources,
            starts: Vec::new(),
            opened: std::sync::Mutex::new(Vec::new()),
            released: std::sync::atomic::AtomicBool::new(false),
        };
        let first = mapping
            .sources
            .first()
            .map(|s| s.name.clone())
            .unwrap_or_default();
        gpu.ctx.bind_to_thread().map_err(|e| IpcError {
            name: first.clone(),
            message: format!("binding the CUDA context: {e}"),
        })?;
        let stream = gpu.stream.cu_stream();
        let mut events = Events(Vec::new());
        let mut bases: HashMap<[u8; IPC_HANDLE_BYTES], (sys::CUdeviceptr, usize)> = HashMap::new();
        let mut waited: Vec<[u8; IPC_HANDLE_BYTES]> = Vec::new();
        for i in 0..mapping.sources.len() {
            let s = &mapping.sources[i];
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
                // SAFETY: the event was just opened; the stream is this context's.
                check(
                    unsafe { sys::cuStreamWaitEvent(stream, event, 0) },
                    &s.name,
                    "cuStreamWaitEvent",
                )?;
                waited.push(ev);
            }
            if let Entry::Vacant(slot) = bases.entry(s.handle) {
                let handle = sys::CUipcMemHandle_st {
                    reserved: s.handle.map(|b| b as std::ffi::c_char),
                };
                let mut ptr: sys::CUdeviceptr = 0;
                // SAFETY: out-parameter; a handle from another machine or a process that
                // exited is refused by the driver with an error, not undefined behaviour.
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
                mapping.opened.get_mut().expect("ipc lock").push(ptr);
                let (mut base, mut size) = (0, 0);
                // SAFETY: out-parameters over a pointer just mapped.
                check(
                    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) },
                    &s.name,
                    "cuMemGetAddressRange",
                )?;
                // The mapping is the whole allocation: what lies past `ptr` bounds every range.
                let usable = (base as usize + size) - ptr as usize;
                slot.insert((ptr, usable));
            }
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
            mapping.starts.push(ptr + s.offset as u64);
        }
        // SAFETY: this context's stream; after it the producer's writes are visible to any
        // stream of the context.
        check(
            unsafe { sys::cuStreamSynchronize(stream) },
            &first,
            "waiting for the producer's event (cuStreamSynchronize)",
        )?;
        Ok(mapping)
    }

    /// Closes every handle and gives the producer's references back (once; dropping does it
    /// too). Call it when every copy out of the mapping has finished: the trainer may then
    /// free or overwrite its tensors, and no address from `range` may be read again.
    pub fn close(&self) {
        let opened = std::mem::take(&mut *self.opened.lock().expect("ipc lock"));
        if !opened.is_empty() && self.ctx.bind_to_thread().is_ok() {
            for p in opened {
                // SAFETY: each pointer came from cuIpcOpenMemHandle in this context and is
                // closed once (taken out of the list above).
                unsafe { sys::cuIpcCloseMemHandle(p) };
            }
        }
        if !self
            .released
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            release_references(&self.sources);
        }
    }

    /// The device address of bytes `start..start + len` of source `source`.
    pub fn range(&self, source: usize, start: usize, len: usize) -> Result<u64, IpcError> {
        let s = self.sources.get(source).ok_or_else(|| IpcError {
            name: String::new(),
            message: format!("source {source} of {} does not exist", self.sources.len()),
        })?;
        if self.released.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(IpcError {
                name: s.name.clone(),
                message: format!("`{}`: the shared allocation is closed", s.name),
            });
        }
        if start.checked_add(len).is_none_or(|end| end > s.len) {
            return Err(IpcError {
                name: s.name.clone(),
                message: format!(
                    "bytes {start}..{} lie outside `{}` ({} bytes)",
                    start.saturating_add(len),
                    s.name,
                    s.len
                ),
            });
        }
        Ok(self.starts[source] + start as u64)
    }

    /// Copies byte ranges `(source, start, len)` to host memory, one buffer each, in order,
    /// on `gpu`'s stream.
    pub fn to_host(
        &self,
        gpu: &Gpu,
        ranges: &[(usize, usize, usize)],
    ) -> Result<Vec<Vec<u8>>, IpcError> {
        let mut out = Vec::with_capacity(ranges.len());
        let mut last = String::new();
        for &(source, start, len) in ranges {
            let ptr = self.range(source, start, len)?;
            let name = &self.sources[source].name;
            let mut host = vec![0u8; len];
            if len > 0 {
                // SAFETY: the range lies inside the mapped allocation (checked by `range`) and
                // `host` has `len` bytes; the copy is complete after the synchronize below,
                // before `host` is read or the mapping closed.
                check(
                    unsafe {
                        sys::cuMemcpyDtoHAsync_v2(
                            host.as_mut_ptr().cast(),
                            ptr,
                            len,
                            gpu.stream.cu_stream(),
                        )
                    },
                    name,
                    "copying the tensor to the host",
                )?;
            }
            last.clone_from(name);
            out.push(host);
        }
        // SAFETY: this context's stream.
        check(
            unsafe { sys::cuStreamSynchronize(gpu.stream.cu_stream()) },
            &last,
            "cuStreamSynchronize",
        )?;
        Ok(out)
    }
}

/// Decrements the producer's counter (what torch's receiving side does when it frees its
/// copy), so the trainer's caching allocator may reuse the memory.
fn decrement(rc: &RefCounter) -> std::io::Result<()> {
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
