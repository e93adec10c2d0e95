//! The kernel registry: every CUDA kernel lockstep launches, the source file it lives in
//! (kernels/*.cu, embedded in the binary), and their NVRTC compilation for the device's
//! architecture with an on-disk cache, so start-up compiles only when something changed.

use std::path::PathBuf;

use cudarc::nvrtc::{self, CompileOptions};

use super::CudaError;

/// Prepended to every source: typedefs and helpers, no CUDA headers needed at run time.
const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// One kernels/*.cu file, compiled as one NVRTC program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    Elementwise,
    Moe,
    Quant,
    Gemm,
    Attention,
    PrefillAttention,
    Sampling,
}

impl Source {
    pub const ALL: [Source; 7] = [
        Source::Elementwise,
        Source::Moe,
        Source::Quant,
        Source::Gemm,
        Source::Attention,
        Source::PrefillAttention,
        Source::Sampling,
    ];

    pub fn file_name(self) -> &'static str {
        match self {
            Source::Elementwise => "elementwise.cu",
            Source::Moe => "moe.cu",
            Source::Quant => "quant.cu",
            Source::Gemm => "gemm.cu",
            Source::Attention => "attention.cu",
            Source::PrefillAttention => "prefill_attention.cu",
            Source::Sampling => "sampling.cu",
        }
    }

    fn body(self) -> &'static str {
        match self {
            Source::Elementwise => include_str!("../../../kernels/elementwise.cu"),
            Source::Moe => include_str!("../../../kernels/moe.cu"),
            Source::Quant => include_str!("../../../kernels/quant.cu"),
            Source::Gemm => include_str!("../../../kernels/gemm.cu"),
            Source::Attention => include_str!("../../../kernels/attention.cu"),
            Source::PrefillAttention => include_str!("../../../kernels/prefill_attention.cu"),
            Source::Sampling => include_str!("../../../kernels/sampling.cu"),
        }
    }

    /// The full program text NVRTC sees.
    pub fn program(self) -> String {
        format!(
            "{COMMON}\n#line 1 \"{}\"\n{}",
            self.file_name(),
            self.body()
        )
    }
}

macro_rules! kernels {
    ($($variant:ident => ($source:ident, $name:literal)),* $(,)?) => {
        /// Every kernel lockstep launches.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel { $($variant),* }

        impl Kernel {
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant),*];

            pub fn source(self) -> Source {
                match self { $(Kernel::$variant => Source::$source),* }
            }

            /// The `extern "C"` symbol in its source.
            pub fn symbol(self) -> &'static str {
                match self { $(Kernel::$variant => $name),* }
            }
        }
    };
}

kernels! {
    DummyFillBf16 => (Elementwise, "dummy_fill_bf16"),
    Bf16ToF32 => (Elementwise, "bf16_to_f32_kernel"),
    F32ToBf16 => (Elementwise, "f32_to_bf16_kernel"),
    Embedding => (Elementwise, "embedding"),
    RmsNorm => (Elementwise, "rms_norm"),
    AddInplace => (Elementwise, "add_inplace"),
    QkNormRopeStore => (Elementwise, "qk_norm_rope_store"),
    SiluMul => (Elementwise, "silu_mul"),
    MoeCombine => (Elementwise, "moe_combine"),
    MoeRoute => (Moe, "moe_route"),
    MoeCount => (Moe, "moe_count"),
    MoePlan => (Moe, "moe_plan"),
    MoeScatter => (Moe, "moe_scatter"),
    Mxfp8QuantizeF32 => (Quant, "mxfp8_quantize_f32"),
    Mxfp8QuantizeBf16 => (Quant, "mxfp8_quantize_bf16"),
    Nvfp4QuantizeF32 => (Quant, "nvfp4_quantize_f32"),
    Nvfp4QuantizeBf16 => (Quant, "nvfp4_quantize_bf16"),
    AmaxBf16 => (Quant, "amax_bf16"),
    AmaxF32 => (Quant, "amax_f32"),
    SwizzleBlockScales => (Quant, "swizzle_block_scales"),
    GatherRowsU8 => (Quant, "gather_rows_u8"),
    Nvfp4Epilogue => (Quant, "nvfp4_epilogue"),
    Fp8BlockDequantize => (Quant, "fp8_block_dequantize"),
    GroupedGemmF32 => (Gemm, "grouped_gemm_f32"),
    GroupedGemmBf16 => (Gemm, "grouped_gemm_bf16"),
    GroupedGemmMxfp8 => (Gemm, "grouped_gemm_mxfp8"),
    GroupedGemmNvfp4 => (Gemm, "grouped_gemm_nvfp4"),
    GroupedGemmMmaBf16 => (Gemm, "grouped_gemm_mma_bf16"),
    GroupedGemmMmaMxfp8 => (Gemm, "grouped_gemm_mma_mxfp8"),
    GroupedGemmMmaNvfp4 => (Gemm, "grouped_gemm_mma_nvfp4"),
    GroupedGemvF32 => (Gemm, "grouped_gemv_f32"),
    GroupedGemvBf16 => (Gemm, "grouped_gemv_bf16"),
    GroupedGemvMxfp8 => (Gemm, "grouped_gemv_mxfp8"),
    GroupedGemvNvfp4 => (Gemm, "grouped_gemv_nvfp4"),
    PagedAttention => (Attention, "paged_attention"),
    PrefillAttentionHd32 => (PrefillAttention, "prefill_attention_hd32"),
    PrefillAttentionHd64 => (PrefillAttention, "prefill_attention_hd64"),
    PrefillAttentionHd128 => (PrefillAttention, "prefill_attention_hd128"),
    SampleRows => (Sampling, "sample_rows"),
    HostExpf => (Sampling, "host_expf_kernel"),
    PagedAttentionSplit => (Attention, "paged_attention_split"),
    PagedAttentionCombine => (Attention, "paged_attention_combine"),
}

/// NVRTC options. Default precision (IEEE division and square root); the bit-exact paths
/// use explicit `__f*_rn` intrinsics, so FMA contraction elsewhere is allowed.
fn options(arch: &'static str) -> CompileOptions {
    CompileOptions {
        arch: Some(arch),
        options: vec!["-std=c++17".into(), "-lineinfo".into()],
        name: None,
        ..Default::default()
    }
}

/// `sm_90a` for Hopper, `sm_100a` for Blackwell, `sm_XY` otherwise.
pub fn arch_for(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (9, 0) => "sm_90a",
        (10, 0) => "sm_100a",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (12, 0) => "sm_120",
        _ => "sm_80",
    }
}

/// NVRTC's version, part of the cache key.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters; the library is loaded by cudarc on first use.
    let rc = unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if rc != nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Nvrtc(format!("nvrtcVersion failed: {rc:?}")));
    }
    Ok((major, minor))
}

/// Whether libnvrtc can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { nvrtc::sys::is_culib_present() }
}

/// Compiles one source for `arch` to PTX; the error carries NVRTC's log.
pub fn compile(source: Source, arch: &'static str) -> Result<String, CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::Nvrtc(
            "libnvrtc not found (install the CUDA toolkit or `pip install nvidia-cuda-nvrtc` and add its lib directory to LD_LIBRARY_PATH)".into(),
        ));
    }
    let opts = CompileOptions {
        name: Some(source.file_name().into()),
        ..options(arch)
    };
    nvrtc::compile_ptx_with_opts(source.program(), opts)
        .map(|ptx| ptx.to_src())
        .map_err(|e| match e {
            nvrtc::CompileError::CompileError { log, options, .. } => CudaError::Nvrtc(format!(
                "{} for {arch} ({}):\n{}",
                source.file_name(),
                options.join(" "),
                log.to_string_lossy()
            )),
            other => CudaError::Nvrtc(format!("{}: {other}", source.file_name())),
        })
}

/// FNV-1a, 64 bits: a stable hash for cache keys (std's hasher may change between releases).
fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &b in *part {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Where compiled PTX is kept: `$LOCKSTEP_KERNEL_CACHE`, else `$XDG_CACHE_HOME/lockstep/kernels`
/// or `~/.cache/lockstep/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("LOCKSTEP_KERNEL_CACHE") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("lockstep").join("kernels"))
}

/// PTX of `source` for `arch`, from the cache when the key (source text, arch, options, NVRTC
/// and driver versions) matches, else compiled and stored. A cache that cannot be written is
/// only a warning.
pub fn cached_ptx(source: Source, arch: &'static str, driver: i32) -> Result<String, CudaError> {
    let (major, minor) = nvrtc_version()?;
    let opts = format!("{:?}", options(arch).options);
    let versions = format!("nvrtc {major}.{minor} driver {driver}");
    let program = source.program();
    let key = fnv1a64(&[
        program.as_bytes(),
        arch.as_bytes(),
        opts.as_bytes(),
        versions.as_bytes(),
    ]);
    let path = cache_dir().map(|d| d.join(format!("{}-{arch}-{key:016x}.ptx", source.file_name())));
    if let Some(p) = &path {
        if let Ok(ptx) = std::fs::read_to_string(p) {
            return Ok(ptx);
        }
    }
    let ptx = compile(source, arch)?;
    if let Some(p) = &path {
        let stored = p
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|_| {
                // Write then rename, so a concurrent start never reads half a file.
                let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                std::fs::write(&tmp, &ptx)?;
                std::fs::rename(&tmp, p)
            });
        if let Err(e) = stored {
            tracing::warn!("kernel cache {} not written: {e}", p.display());
        }
    }
    Ok(ptx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_names_a_symbol_of_its_source() {
        for k in Kernel::ALL {
            let body = k.source().body();
            assert!(
                body.contains(&format!("void {}(", k.symbol()))
                    || body.contains(&format!(", {}, ", k.symbol()))
                    || body.contains(&format!("({}, ", k.symbol())),
                "{k:?}: `{}` not defined in {}",
                k.symbol(),
                k.source().file_name()
            );
        }
    }

    #[test]
    fn cache_key_changes_with_any_part() {
        let a = fnv1a64(&[b"src", b"sm_90a"]);
        assert_ne!(a, fnv1a64(&[b"src", b"sm_100a"]));
        assert_ne!(a, fnv1a64(&[b"srcsm_90a"]));
        assert_eq!(a, fnv1a64(&[b"src", b"sm_90a"]));
    }
}
