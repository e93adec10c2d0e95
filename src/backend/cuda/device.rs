//! One CUDA device as the engine uses it: its context, the one engine stream every kernel and
//! copy is queued on, the loaded kernels, and the GEMM split-K scratch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};

use super::args::{KernelArgs, Raw, MAX_PARAMS};
use super::kernels::{self, Kernel, Source};
use super::ops::GemmScratch;
use super::CudaError;

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub arch: &'static str,
    pub name: String,
    pub sm_count: u32,
    functions: HashMap<Kernel, CudaFunction>,
    /// Kernels are launched as programmatic dependents of the one before them (Hopper and
    /// later; `LOCKSTEP_PDL=0` turns it off): see [`Gpu::launch`].
    pub pdl: bool,
    /// The GEMMs' scratch (split-K sums, packed activations), grown on first need; every
    /// launch is on `stream`, so one set of buffers serves them in turn.
    pub(crate) gemm_scratch: Mutex<GemmScratch>,
}

/// The number of CUDA devices, or why there are none usable (never panics: cudarc panics when
/// a library is missing, so its presence is checked first).
pub fn probe() -> Result<usize, String> {
    // SAFETY: only tries to dlopen libcuda.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("libcuda (the NVIDIA driver library) cannot be loaded".into());
    }
    std::panic::catch_unwind(|| {
        cudarc::driver::result::init().map_err(|e| format!("cuInit failed: {e}"))?;
        CudaContext::device_count()
            .map(|n| n.max(0) as usize)
            .map_err(|e| format!("cuDeviceGetCount failed: {e}"))
    })
    .unwrap_or_else(|_| Err("the CUDA driver library panicked on load".into()))
}

/// Whether a CUDA driver and at least one device are present.
pub fn device_count() -> usize {
    probe().unwrap_or(0)
}

impl Gpu {
    /// Opens device `ordinal`, compiles (or loads from the cache) every kernel for its
    /// architecture and creates the engine stream.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        let count = probe().map_err(CudaError::NoDevice)?;
        if count <= ordinal {
            return Err(CudaError::NoDevice(format!(
                "CUDA device {ordinal} requested, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = kernels::arch_for(major, minor);
        let name = ctx.name()?;
        let sm_count = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        let mut driver = 0;
        // SAFETY: plain out-parameter of a loaded driver.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
        // Everything runs on one stream, so cudarc's per-buffer event tracking (for buffers
        // shared between streams) is pure overhead.
        // SAFETY: no buffer of this context is used from another stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let mut functions = HashMap::new();
        for source in Source::ALL {
            let ptx = kernels::cached_ptx(source, arch, driver)?;
            if source.replaced() {
                kernels::check_entries(source, &ptx)?;
                tracing::warn!(
                    "{}: compiled from $LOCKSTEP_KERNEL_SOURCES, not the built-in source",
                    source.file_name()
                );
            }
            let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))?;
            for &k in Kernel::ALL.iter().filter(|k| k.source() == source) {
                let f = module.load_function(k.symbol())?;
                if let Some(h) = k.register_handoff().filter(|_| arch == "sm_90a") {
                    let entry = f.num_regs()? as u32;
                    if entry < h.entry_needed() {
                        return Err(CudaError::Unsupported(format!(
                            "{}: {entry} registers a thread at entry, where its setmaxnreg hand-off ({} threads to {}, {} to {}) needs {}: its blocks would wait forever",
                            k.symbol(), h.givers, h.low, h.takers, h.high, h.entry_needed()
                        )));
                    }
                }
                if k.dynamic_smem(arch) > 0 {
                    f.set_attribute(
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        k.dynamic_smem(arch) as i32,
                    )?;
                }
                functions.insert(k, f);
            }
        }
        let pdl = major >= 9 && std::env::var("LOCKSTEP_PDL").map_or(true, |v| v != "0");
        tracing::info!(
            "CUDA device {ordinal}: {name} ({arch}, {sm_count} SMs){}",
            if pdl {
                ", programmatic dependent launch"
            } else {
                ""
            }
        );
        Ok(Gpu {
            ctx,
            stream,
            arch,
            name,
            sm_count,
            functions,
            pdl,
            gemm_scratch: Mutex::new(GemmScratch::default()),
        })
    }

    /// The same device and kernels on a stream of their own, for work beside the engine's
    /// (loading new weights while generation goes on). Nothing orders the two streams:
    /// synchronize this one before the engine stream reads what it wrote.
    pub fn with_own_stream(&self) -> Result<Gpu, CudaError> {
        Ok(Gpu {
            ctx: self.ctx.clone(),
            stream: self.ctx.new_stream()?,
            arch: self.arch,
            name: self.name.clone(),
            sm_count: self.sm_count,
            functions: self.functions.clone(),
            pdl: self.pdl,
            gemm_scratch: Mutex::new(GemmScratch::default()),
        })
    }

    /// Queues `kernel` on the engine stream, once `args` are checked to be of the kinds, in the
    /// order, that the kernel declares (`Kernel::params`).
    pub fn launch<A: KernelArgs>(
        &self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        args: A,
    ) -> Result<(), CudaError> {
        if A::KINDS != kernel.params() {
            return Err(CudaError::KernelArgs(format!(
                "{kernel:?} (`{}`) takes {:?}, given {:?}",
                kernel.symbol(),
                kernel.params(),
                A::KINDS
            )));
        }
        let mut raw = [Raw::U64(0); MAX_PARAMS];
        args.raw(self, &mut raw);
        let f = &self.functions[&kernel];
        let smem = kernel.dynamic_smem(self.arch);
        if self.pdl {
            return self.launch_dependent(f, grid, block, smem, &mut raw[..A::KINDS.len()]);
        }
        let mut b = self.stream.launch_builder(f);
        for a in &raw[..A::KINDS.len()] {
            match a {
                Raw::U64(v) => b.arg(v),
                Raw::I32(v) => b.arg(v),
                Raw::F32(v) => b.arg(v),
                Raw::Map(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: the arguments are of the kinds and in the order the kernel's signature has
        // (checked above; tests/cuda_kernels.rs checks the declaration against the PTX), and
        // every wrapper passes buffers it has checked to hold what the kernel touches.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// A launch with programmatic stream serialization: the kernel's blocks may be scheduled
    /// while the kernel before it on the stream finishes, instead of after. Every kernel opens
    /// with `pdl_entry` (kernels/common.cuh): it waits there, before touching memory, until the
    /// kernel before has completed and its writes are visible, then lets the next one start.
    /// So the order of every read and write is the stream's, and only the launch latency
    /// between dependent kernels overlaps (on a CUDA graph too: capture keeps the edge).
    fn launch_dependent(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        raw: &mut [Raw],
    ) -> Result<(), CudaError> {
        let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_PARAMS];
        for (p, a) in params.iter_mut().zip(raw.iter_mut()) {
            *p = match a {
                Raw::U64(v) => v as *mut u64 as *mut std::ffi::c_void,
                Raw::I32(v) => v as *mut i32 as *mut std::ffi::c_void,
                Raw::F32(v) => v as *mut f32 as *mut std::ffi::c_void,
                Raw::Map(v) => v.as_mut_ptr() as *mut std::ffi::c_void,
            };
        }
        // SAFETY: a zeroed attribute is a valid plain-data value; the two fields set are the
        // attribute's id and its value.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: as in `launch`: the arguments match the kernel's signature (checked by the
        // caller), each pointer in `params` points at one of them, alive for the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        Ok(())
    }

    /// How many times the GEMM scratch moved (see [`super::graphs`]).
    pub fn gemm_scratch_generation(&self) -> u64 {
        self.gemm_scratch.lock().map_or(u64::MAX, |s| s.generation)
    }

    /// Grid size for a grid-stride loop over `n` elements.
    pub fn grid_for(&self, n: usize, block: u32) -> u32 {
        (n.div_ceil(block as usize) as u32).clamp(1, self.sm_count.max(1) * 32)
    }

    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        if host.is_empty() {
            // SAFETY: a one-element buffer nobody reads; zero-length allocations are refused.
            return Ok(unsafe { self.stream.alloc::<T>(1) }?);
        }
        Ok(self.stream.clone_htod(host)?)
    }

    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
        n: usize,
    ) -> Result<Vec<T>, CudaError> {
        let mut host = vec![T::default(); n];
        if n > 0 {
            self.stream.memcpy_dtoh(&dev.slice(0..n), &mut host)?;
        }
        Ok(host)
    }

    /// Copies `host` into the start of `dev`.
    pub fn write<T: DeviceRepr>(
        &self,
        host: &[T],
        dev: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        if host.is_empty() {
            return Ok(());
        }
        if host.len() > dev.len() {
            return Err(CudaError::Capacity(format!(
                "{} elements into a buffer of {}",
                host.len(),
                dev.len()
            )));
        }
        self.stream
            .memcpy_htod(host, &mut dev.slice_mut(0..host.len()))?;
        Ok(())
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// Hands memory freed on the engine stream back to the driver, so another process (a
    /// colocated trainer) can allocate it: buffers are freed in stream order into the
    /// stream-ordered allocator's pool, which keeps them for reuse unless trimmed.
    pub fn return_freed_memory(&self) -> Result<(), CudaError> {
        self.synchronize()?;
        if self.ctx.has_async_alloc() {
            // SAFETY: the pool of this context's device, asked of a loaded driver; trimming
            // releases only memory that no allocation holds.
            unsafe {
                let pool = cudarc::driver::result::device::get_mem_pool(self.ctx.cu_device())?;
                cudarc::driver::result::mem_pool::trim_to(pool, 0)?;
            }
        }
        Ok(())
    }
}

/// Device-to-device copy bandwidth of `gpu` (bytes read + written per second), the median of
/// 10 copies of 1 GiB after a warm-up: the denominator of the benchmarks' rooflines.
pub fn copy_bandwidth(gpu: &Gpu) -> Result<f64, CudaError> {
    let n = 1usize << 30;
    let src = gpu.alloc::<u8>(n)?;
    let mut dst = gpu.alloc::<u8>(n)?;
    gpu.stream.memcpy_dtod(&src, &mut dst)?;
    gpu.synchronize()?;
    let mut times = Vec::with_capacity(10);
    for _ in 0..10 {
        let t = std::time::Instant::now();
        gpu.stream.memcpy_dtod(&src, &mut dst)?;
        gpu.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * n as f64 / times[times.len() / 2])
}
