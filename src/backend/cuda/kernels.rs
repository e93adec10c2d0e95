//! The kernel registry: every CUDA kernel lockstep launches, the source file it lives in
//! (kernels/*.cu, embedded in the binary) and its parameter kinds, declared once here (each
//! launch is checked against them, and tests/cuda_kernels.rs checks them against the PTX); and
//! their NVRTC compilation for the device's architecture with an on-disk cache, so start-up
//! compiles only when something changed.

use std::path::{Path, PathBuf};

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
    Hash,
}

impl Source {
    pub const ALL: [Source; 8] = [
        Source::Elementwise,
        Source::Moe,
        Source::Quant,
        Source::Gemm,
        Source::Attention,
        Source::PrefillAttention,
        Source::Sampling,
        Source::Hash,
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
            Source::Hash => "hash.cu",
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
            Source::Hash => include_str!("../../../kernels/hash.cu"),
        }
    }

    /// The full program text NVRTC sees: the embedded sources, or a file of
    /// `$LOCKSTEP_KERNEL_SOURCES` ([`sources_dir`]) in place of each one it holds.
    pub fn program(self) -> String {
        self.program_in(sources_dir().as_deref())
    }

    /// The program text with `dir`'s common.cuh and file of this source, where it holds them,
    /// in place of the embedded ones.
    pub fn program_in(self, dir: Option<&Path>) -> String {
        let read = |name: &str| dir.and_then(|d| std::fs::read_to_string(d.join(name)).ok());
        let common = read("common.cuh");
        let body = read(self.file_name());
        format!(
            "{}\n#line 1 \"{}\"\n{}",
            common.as_deref().unwrap_or(COMMON),
            self.file_name(),
            body.as_deref().unwrap_or(self.body())
        )
    }

    /// Whether `$LOCKSTEP_KERNEL_SOURCES` replaces this source or common.cuh.
    pub fn replaced(self) -> bool {
        sources_dir().is_some_and(|dir| {
            dir.join(self.file_name()).is_file() || dir.join("common.cuh").is_file()
        })
    }
}

/// `$LOCKSTEP_KERNEL_SOURCES`: a directory of kernel sources (common.cuh, gemm.cu, ...) compiled
/// in place of the embedded ones with the same names, for kernel experiments on a GPU host
/// without a rebuild (several variants run by one binary). Their kernels must keep the
/// registry's names and parameters: [`check_entries`] refuses PTX that does not.
pub fn sources_dir() -> Option<PathBuf> {
    std::env::var_os("LOCKSTEP_KERNEL_SOURCES").map(PathBuf::from)
}

/// Checks that `ptx` (compiled from `source`) declares every kernel of the registry that lives
/// in it with the registry's parameter kinds: what tests/cuda_kernels.rs checks for the
/// embedded sources, checked at load for replaced ones.
pub fn check_entries(source: Source, ptx: &str) -> Result<(), CudaError> {
    for &k in Kernel::ALL.iter().filter(|k| k.source() == source) {
        let params = ptx_entry_params(ptx, k.symbol()).unwrap_or_default();
        if let Some(m) = signature_mismatch(k, k.params(), &params) {
            return Err(CudaError::Nvrtc(format!("replaced kernel source: {m}")));
        }
    }
    Ok(())
}

/// How a kernel's declared parameters differ from the PTX `.entry` signature, if they do.
pub fn signature_mismatch(k: Kernel, declared: &[Param], ptx: &[&str]) -> Option<String> {
    let same =
        declared.len() == ptx.len() && declared.iter().zip(ptx).all(|(p, t)| p.matches_ptx(t));
    (!same).then(|| {
        let first = declared
            .iter()
            .zip(ptx)
            .position(|(p, t)| !p.matches_ptx(t))
            .map_or(String::new(), |i| {
                format!(" (first difference: parameter {i})")
            });
        format!(
            "{k:?} (`{}` in {}): declared {} parameters {declared:?}, the PTX takes {} {ptx:?}{first}",
            k.symbol(),
            k.source().file_name(),
            declared.len(),
            ptx.len(),
        )
    })
}

/// The kind of one kernel parameter. PTX types a pointer as `.u64`, so [`Param::Ptr`] and
/// [`Param::U64`] look the same in the PTX; Rust keeps them apart ([`super::args`]: a `Ptr`
/// takes a device view or address, a `U64` a `u64`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Param {
    /// A device address (`T*`), 0 for an absent optional buffer.
    Ptr,
    /// `int`.
    I32,
    /// `u64` (unsigned long long).
    U64,
    /// `float`.
    F32,
    /// A tensor map (`CUtensorMap`, 128 bytes) by value: the TMA GEMM's `const __grid_constant__
    /// TensorMap` (kernels/common.cuh).
    TensorMap,
}

impl Param {
    /// Whether a PTX `.param` type (`.u64`, `.u32`, `.s32`, `.f32`, ...) holds this kind.
    pub fn matches_ptx(self, ty: &str) -> bool {
        match self {
            Param::Ptr | Param::U64 => matches!(ty, ".u64" | ".b64" | ".s64"),
            Param::I32 => matches!(ty, ".s32" | ".u32" | ".b32"),
            Param::F32 => ty == ".f32",
            // `.param .align 64 .b8 name[128]`: `ptx_entry_params` keeps the second word.
            Param::TensorMap => ty == ".align",
        }
    }
}

/// The parameter types of `.entry NAME(...)` in `ptx`, in order (`.u64`, `.u32`, `.f32`, ...;
/// a by-value struct shows as `.align`); `None` when the PTX has no such entry.
pub fn ptx_entry_params<'a>(ptx: &'a str, name: &str) -> Option<Vec<&'a str>> {
    let start = ptx.find(&format!(".entry {name}("))? + ".entry (".len() + name.len();
    let list = &ptx[start..start + ptx[start..].find(')')?];
    Some(
        list.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| p.split_whitespace().nth(1).unwrap_or(p))
            .collect(),
    )
}

macro_rules! kernels {
    ($($variant:ident => ($source:ident, $name:literal, $params:expr)),* $(,)?) => {
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

            /// Its parameters in order, as its `extern "C"` signature declares them: what every
            /// launch is checked against (`Gpu::launch`), and what tests/cuda_kernels.rs checks
            /// against the compiled PTX.
            pub fn params(self) -> &'static [Param] {
                match self { $(Kernel::$variant => $params),* }
            }
        }
    };
}

use Param::{Ptr, TensorMap, F32, I32, U64};

/// `GEMM_ENTRY` in gemm.cu: x, row_index, row_scale, w, w_scales, w_sdec, sdec_groups, tiles,
/// num_tiles, offsets, rows, N, K, out, partials, xb, counters, then parts 2 and 3 (w, scales,
/// sdec, out, n each).
const GROUPED_GEMM: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, Ptr, Ptr, Ptr, I32, I32, I32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr,
    Ptr, Ptr, I32, Ptr, Ptr, Ptr, Ptr, I32,
];
/// kernels/prefill_attention.cu `prefill_attention_tma_hd128`: the K and V caches' tensor maps,
/// then q, out, the rows' positions and sequences, the block tables, the tiles, heads, KV heads,
/// block size and the scale in log2 units (log2(e) / sqrt(head_dim)).
const TMA_ATTENTION: &[Param] = &[
    TensorMap, TensorMap, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, F32,
];
/// `GEMM_TMA_KERNEL` in gemm.cu: the tensor maps of x and of parts 1-3's weights, row_index,
/// row_scale, w_scales, w_sdec, sdec_groups, tiles, num_tiles, offsets, rows, N, K, out, then
/// parts 2 and 3 (scales, sdec, out, n each).
const TMA_GEMM: &[Param] = &[
    TensorMap, TensorMap, TensorMap, TensorMap, Ptr, Ptr, Ptr, Ptr, I32, Ptr, Ptr, Ptr, I32, I32,
    I32, Ptr, Ptr, Ptr, Ptr, I32, Ptr, Ptr, Ptr, I32,
];
/// The prefill and decode kernels of prefill_attention.cu: q, out, k_cache, v_cache, row_pos,
/// row_seq, table_offsets, block_tables, tiles (prefill) or rows (decode), heads, kv_heads,
/// block_size, scale in log2 units (log2(e) / sqrt(head_dim)), part and max_chunks (decode's
/// split-KV; prefill ignores them).
const TENSOR_CORE_ATTENTION: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, F32, Ptr, I32,
];
/// part, out, row_pos, rows, heads, max_chunks.
const ATTENTION_MERGE: &[Param] = &[Ptr, Ptr, Ptr, Ptr, I32, I32];
/// x, blocks, data, scales, deq.
const MXFP8_QUANTIZE: &[Param] = &[Ptr, U64, Ptr, Ptr, Ptr];
/// x, n, out.
const AMAX: &[Param] = &[Ptr, U64, Ptr];
/// x, rows, cols, per_token, tensor_amax, range, data, scales, row_s_dec, deq, words.
const NVFP4_QUANTIZE_WARP: &[Param] = &[Ptr, U64, I32, I32, Ptr, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
/// x, out, n: the casts and `host_expf_kernel`.
const MAP_N: &[Param] = &[Ptr, Ptr, U64];

kernels! {
    DummyFillBf16 => (Elementwise, "dummy_fill_bf16", &[Ptr, U64, U64, F32]),
    Bf16ToF32 => (Elementwise, "bf16_to_f32_kernel", MAP_N),
    F32ToBf16 => (Elementwise, "f32_to_bf16_kernel", MAP_N),
    Embedding => (Elementwise, "embedding", &[Ptr, Ptr, I32, Ptr, I32]),
    RmsNorm => (Elementwise, "rms_norm", &[Ptr, Ptr, Ptr, Ptr, Ptr, I32, F32]),
    RmsNormSums => (Elementwise, "rms_norm_sums", &[Ptr, Ptr, Ptr, Ptr, Ptr, I32, F32, I32, U64]),
    AddInplace => (Elementwise, "add_inplace", &[Ptr, Ptr, U64]),
    QkNormRopeStore => (Elementwise, "qk_norm_rope_store", &[
        Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, F32,
    ]),
    QkNormRopeStoreSums => (Elementwise, "qk_norm_rope_store_sums", &[
        Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, F32, Ptr, Ptr, Ptr, I32,
    ]),
    SiluMul => (Elementwise, "silu_mul", &[Ptr, Ptr, U64, I32]),
    SiluMulSums => (Elementwise, "silu_mul_sums", &[Ptr, Ptr, U64, I32, I32]),
    MoeCombine => (Elementwise, "moe_combine", &[Ptr, Ptr, Ptr, Ptr, I32, I32]),
    MoeCombineSums => (Elementwise, "moe_combine_sums", &[Ptr, Ptr, Ptr, Ptr, I32, I32, I32]),
    RmsNormCombine => (Elementwise, "rms_norm_combine", &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, F32]),
    RmsNormCombineSums => (Elementwise, "rms_norm_combine_sums", &[
        Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, F32, I32,
    ]),
    CopyRanges => (Elementwise, "copy_ranges", &[Ptr, I32]),
    MoeRoute => (Moe, "moe_route", &[Ptr, I32, I32, I32, I32, Ptr, Ptr, Ptr, Ptr, I32, Ptr]),
    MoeCount => (Moe, "moe_count", &[Ptr, I32, Ptr]),
    MoePlan => (Moe, "moe_plan", &[Ptr, I32, I32, I32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr]),
    MoeScatter => (Moe, "moe_scatter", &[Ptr, I32, I32, Ptr, Ptr, Ptr]),
    MoePlanIds => (Moe, "moe_plan_ids", &[
        Ptr, I32, I32, I32, Ptr, I32, I32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr,
    ]),
    MoeRoutePlan => (Moe, "moe_route_plan", &[
        Ptr, I32, I32, I32, I32, Ptr, Ptr, Ptr, Ptr, I32, I32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr,
        Ptr, Ptr, I32, Ptr,
    ]),
    Mxfp8QuantizeF32 => (Quant, "mxfp8_quantize_f32", MXFP8_QUANTIZE),
    Mxfp8QuantizeBf16 => (Quant, "mxfp8_quantize_bf16", MXFP8_QUANTIZE),
    Mxfp8QuantizeSiluMul => (Quant, "mxfp8_quantize_silu_mul", &[Ptr, Ptr, I32, U64, Ptr, Ptr, Ptr]),
    Nvfp4QuantizeF32 => (Quant, "nvfp4_quantize_f32", &[
        Ptr, I32, I32, Ptr, F32, F32, I32, Ptr, Ptr, Ptr, Ptr, Ptr,
    ]),
    Nvfp4QuantizeF32Warp8 => (Quant, "nvfp4_quantize_f32_warp8", NVFP4_QUANTIZE_WARP),
    Nvfp4QuantizeF32Warp16 => (Quant, "nvfp4_quantize_f32_warp16", NVFP4_QUANTIZE_WARP),
    Nvfp4QuantizeSiluMulRows => (Quant, "nvfp4_quantize_silu_mul_rows", &[
        Ptr, Ptr, I32, F32, Ptr, Ptr, Ptr, Ptr, Ptr,
    ]),
    Nvfp4QuantizeSiluMulWarp8 => (Quant, "nvfp4_quantize_silu_mul_warp8", &[
        Ptr, Ptr, U64, I32, F32, Ptr, Ptr, Ptr, Ptr, Ptr,
    ]),
    Nvfp4QuantizeBf16 => (Quant, "nvfp4_quantize_bf16", &[Ptr, I32, F32, F32, F32, I32, Ptr, Ptr]),
    AmaxBf16 => (Quant, "amax_bf16", AMAX),
    AmaxF32 => (Quant, "amax_f32", AMAX),
    SwizzleBlockScales => (Quant, "swizzle_block_scales", &[Ptr, I32, I32, Ptr]),
    GatherRowsU8 => (Quant, "gather_rows_u8", &[Ptr, Ptr, I32, I32, Ptr]),
    Nvfp4Epilogue => (Quant, "nvfp4_epilogue", &[Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32]),
    Fp8BlockDequantize => (Quant, "fp8_block_dequantize", &[Ptr, Ptr, U64, U64, U64, U64, Ptr]),
    GroupedGemmF32 => (Gemm, "grouped_gemm_f32", GROUPED_GEMM),
    GroupedGemmBf16 => (Gemm, "grouped_gemm_bf16", GROUPED_GEMM),
    GroupedGemmMxfp8 => (Gemm, "grouped_gemm_mxfp8", GROUPED_GEMM),
    GroupedGemmNvfp4 => (Gemm, "grouped_gemm_nvfp4", GROUPED_GEMM),
    GroupedGemmMmaBf16 => (Gemm, "grouped_gemm_mma_bf16", GROUPED_GEMM),
    GroupedGemmMmaMxfp8 => (Gemm, "grouped_gemm_mma_mxfp8", GROUPED_GEMM),
    GroupedGemmMmaNvfp4 => (Gemm, "grouped_gemm_mma_nvfp4", GROUPED_GEMM),
    GroupedGemmMmaWideBf16 => (Gemm, "grouped_gemm_mma_wide_bf16", GROUPED_GEMM),
    GroupedGemmMmaWideMxfp8 => (Gemm, "grouped_gemm_mma_wide_mxfp8", GROUPED_GEMM),
    GroupedGemmMmaWideNvfp4 => (Gemm, "grouped_gemm_mma_wide_nvfp4", GROUPED_GEMM),
    GroupedGemmWgmmaBf16 => (Gemm, "grouped_gemm_wgmma_bf16", GROUPED_GEMM),
    GroupedGemmWgmmaMxfp8 => (Gemm, "grouped_gemm_wgmma_mxfp8", GROUPED_GEMM),
    GroupedGemmWgmmaNvfp4 => (Gemm, "grouped_gemm_wgmma_nvfp4", GROUPED_GEMM),
    GroupedGemmWgmma64Bf16 => (Gemm, "grouped_gemm_wgmma64_bf16", GROUPED_GEMM),
    GroupedGemmWgmma64Mxfp8 => (Gemm, "grouped_gemm_wgmma64_mxfp8", GROUPED_GEMM),
    GroupedGemmWgmma64Nvfp4 => (Gemm, "grouped_gemm_wgmma64_nvfp4", GROUPED_GEMM),
    GroupedGemmWgmmaRunsBf16 => (Gemm, "grouped_gemm_wgmma_runs_bf16", GROUPED_GEMM),
    GroupedGemmWgmmaRunsMxfp8 => (Gemm, "grouped_gemm_wgmma_runs_mxfp8", GROUPED_GEMM),
    GroupedGemmWgmmaRunsNvfp4 => (Gemm, "grouped_gemm_wgmma_runs_nvfp4", GROUPED_GEMM),
    GroupedGemmWgmma64RunsBf16 => (Gemm, "grouped_gemm_wgmma64_runs_bf16", GROUPED_GEMM),
    GroupedGemmWgmma64RunsMxfp8 => (Gemm, "grouped_gemm_wgmma64_runs_mxfp8", GROUPED_GEMM),
    GroupedGemmWgmma64RunsNvfp4 => (Gemm, "grouped_gemm_wgmma64_runs_nvfp4", GROUPED_GEMM),
    GroupedGemmWgmmaSwigluBf16 => (Gemm, "grouped_gemm_wgmma_swiglu_bf16", GROUPED_GEMM),
    GroupedGemmWgmmaSwigluMxfp8 => (Gemm, "grouped_gemm_wgmma_swiglu_mxfp8", GROUPED_GEMM),
    GroupedGemmWgmmaSwigluNvfp4 => (Gemm, "grouped_gemm_wgmma_swiglu_nvfp4", GROUPED_GEMM),
    GroupedGemmWgmmaSwigluWordsBf16 => (Gemm, "grouped_gemm_wgmma_swiglu_words_bf16", GROUPED_GEMM),
    GroupedGemmTmaBf16 => (Gemm, "grouped_gemm_tma_bf16", TMA_GEMM),
    GroupedGemmTmaMxfp8 => (Gemm, "grouped_gemm_tma_mxfp8", TMA_GEMM),
    GroupedGemmTmaNvfp4 => (Gemm, "grouped_gemm_tma_nvfp4", TMA_GEMM),
    GroupedGemmTmaSwigluBf16 => (Gemm, "grouped_gemm_tma_swiglu_bf16", TMA_GEMM),
    GroupedGemmTmaSwigluMxfp8 => (Gemm, "grouped_gemm_tma_swiglu_mxfp8", TMA_GEMM),
    GroupedGemmTmaSwigluNvfp4 => (Gemm, "grouped_gemm_tma_swiglu_nvfp4", TMA_GEMM),
    GroupedGemmTmaSwigluWordsBf16 => (Gemm, "grouped_gemm_tma_swiglu_words_bf16", TMA_GEMM),
    GroupedGemmSkinnyBf16 => (Gemm, "grouped_gemm_skinny_bf16", GROUPED_GEMM),
    GroupedGemmSkinnyMxfp8 => (Gemm, "grouped_gemm_skinny_mxfp8", GROUPED_GEMM),
    GroupedGemmSkinnyNvfp4 => (Gemm, "grouped_gemm_skinny_nvfp4", GROUPED_GEMM),
    GroupedGemmSkinny4Bf16 => (Gemm, "grouped_gemm_skinny4_bf16", GROUPED_GEMM),
    GroupedGemmSkinny4Mxfp8 => (Gemm, "grouped_gemm_skinny4_mxfp8", GROUPED_GEMM),
    GroupedGemmSkinny4Nvfp4 => (Gemm, "grouped_gemm_skinny4_nvfp4", GROUPED_GEMM),
    GroupedGemmSkinnyKsplitBf16 => (Gemm, "grouped_gemm_skinny_ksplit_bf16", GROUPED_GEMM),
    GroupedGemmSkinnyKsplitMxfp8 => (Gemm, "grouped_gemm_skinny_ksplit_mxfp8", GROUPED_GEMM),
    GroupedGemmSkinnyKsplitNvfp4 => (Gemm, "grouped_gemm_skinny_ksplit_nvfp4", GROUPED_GEMM),
    GroupedGemmSkinnyKsplit8Bf16 => (Gemm, "grouped_gemm_skinny_ksplit8_bf16", GROUPED_GEMM),
    GroupedGemmSkinnyKsplit8Mxfp8 => (Gemm, "grouped_gemm_skinny_ksplit8_mxfp8", GROUPED_GEMM),
    GroupedGemmSkinnyKsplit8Nvfp4 => (Gemm, "grouped_gemm_skinny_ksplit8_nvfp4", GROUPED_GEMM),
    GemmFoldSegments => (Gemm, "gemm_fold_segments", &[Ptr, I32, I32, I32, Ptr, Ptr, Ptr, I32, Ptr, I32, Ptr]),
    GemmFoldParts => (Gemm, "gemm_fold_parts", &[Ptr, I32, I32, I32, Ptr, I32, Ptr, I32, Ptr]),
    PackGemmOperand => (Gemm, "pack_gemm_operand", &[Ptr, Ptr, I32, I32, I32, Ptr]),
    PagedAttention => (Attention, "paged_attention", &[
        Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32, F32,
    ]),
    PrefillAttentionHd32 => (PrefillAttention, "prefill_attention_hd32", TENSOR_CORE_ATTENTION),
    PrefillAttentionHd64 => (PrefillAttention, "prefill_attention_hd64", TENSOR_CORE_ATTENTION),
    PrefillAttentionHd128 => (PrefillAttention, "prefill_attention_hd128", TENSOR_CORE_ATTENTION),
    PrefillAttentionPairsHd128 => (PrefillAttention, "prefill_attention_pairs_hd128", TENSOR_CORE_ATTENTION),
    PrefillAttentionTmaHd128 => (PrefillAttention, "prefill_attention_tma_hd128", TMA_ATTENTION),
    DecodeAttentionHd32 => (PrefillAttention, "decode_attention_hd32", TENSOR_CORE_ATTENTION),
    DecodeAttentionG8Hd32 => (PrefillAttention, "decode_attention_g8_hd32", TENSOR_CORE_ATTENTION),
    AttentionMergeHd32 => (PrefillAttention, "attention_merge_hd32", ATTENTION_MERGE),
    DecodeAttentionHd64 => (PrefillAttention, "decode_attention_hd64", TENSOR_CORE_ATTENTION),
    DecodeAttentionG8Hd64 => (PrefillAttention, "decode_attention_g8_hd64", TENSOR_CORE_ATTENTION),
    AttentionMergeHd64 => (PrefillAttention, "attention_merge_hd64", ATTENTION_MERGE),
    DecodeAttentionHd128 => (PrefillAttention, "decode_attention_hd128", TENSOR_CORE_ATTENTION),
    DecodeAttentionG8Hd128 => (PrefillAttention, "decode_attention_g8_hd128", TENSOR_CORE_ATTENTION),
    DecodeAttentionG8Hd128Three => (PrefillAttention, "decode_attention_g8_hd128_3", TENSOR_CORE_ATTENTION),
    AttentionMergeHd128 => (PrefillAttention, "attention_merge_hd128", ATTENTION_MERGE),
    SampleRows => (Sampling, "sample_rows", &[Ptr, Ptr, I32, Ptr, Ptr, I32, I32, Ptr, Ptr]),
    ArgmaxRows => (Sampling, "argmax_rows", &[Ptr, I32, Ptr, Ptr, I32, Ptr, Ptr, I32, Ptr]),
    HostExpf => (Sampling, "host_expf_kernel", MAP_N),
    Xxh3Ranges => (Hash, "xxh3_64_ranges", &[Ptr, Ptr, I32, Ptr]),
}

/// Dynamic shared memory of the wgmma GEMM kernels (kernels/gemm.cu) on tiles of `tile_rows`:
/// 1,024 bytes to align the stages for the 64-byte swizzle, then `WG_STAGES` (eight) stages of
/// an activation span (64 bytes a row) and 128 BF16 weight columns' span (`WG_W_STAGE`).
const fn wgmma_smem_bytes(tile_rows: u32) -> u32 {
    1024 + 8 * (tile_rows * 64 + 128 * 64)
}
/// The pair tiles' (128 rows, `WG_X_STAGE`).
pub const WGMMA_SMEM_BYTES: u32 = wgmma_smem_bytes(128);
/// A dense launch's 64-row tiles' (`grouped_gemm_wgmma64_*`): 99,328 bytes, so that two blocks
/// share an SM.
pub const WGMMA64_SMEM_BYTES: u32 = wgmma_smem_bytes(64);

/// Dynamic shared memory of the TMA GEMM kernels (kernels/gemm.cu `grouped_gemm_tma`): 1,024
/// bytes to align the stages, four stages (`TMA_STAGES`) of one span (`TMA_SPANS`) each: a
/// 128-row activation span (64 bytes a row) and the span of 256 BF16 weight rows (the largest
/// format's, `TMA_COLS`), then the MMA threads' running totals (256 threads x 128 f32), then a
/// `full` and an `empty` barrier (8 bytes) a stage: 230,464 bytes, under the 232,448 a block
/// may have on Hopper (one block an SM).
pub const TMA_SMEM_BYTES: u32 = 1024 + 4 * (128 * 64 + 256 * 64) + 256 * 128 * 4 + 2 * 8 * 4;
/// Threads of a TMA GEMM block: two MMA warpgroups and the copy warpgroup.
pub const TMA_THREADS: u32 = 384;

/// Dynamic shared memory of the prefill attention kernel for `head_dim` on `arch`
/// (kernels/prefill_attention.cu): its 4 warps' running totals of 16 rows x `head_dim` f32
/// (`FA_TOT_FLOATS`), which with the K and V tiles pass a block's 48 KB of static shared memory.
/// Head_dim 128 on Hopper (wgmma, `fa_attend_wgmma`, whose totals are in registers) takes its
/// tiles instead: 512 bytes to align them for the 64-byte swizzle, then q and two buffers each
/// of K and V, 64 rows x 128 BF16 each, then four tiles' lists of cache rows, 64 i32 each
/// (81.5 KB in all: two blocks an SM, as its registers allow). That is more than
/// the totals, so the `mma.sync` walk (kernel variant `FA_WGMMA 0`) runs in it too.
pub fn prefill_attention_smem_bytes(head_dim: u32, arch: &str) -> u32 {
    if head_dim == 128 && arch == "sm_90a" {
        512 + 5 * FA_TILE_BYTES + 4 * 64 * 4
    } else {
        4 * 16 * head_dim * 4
    }
}

/// One 64-row tile of head_dim 128 in BF16 (q, K or V) in the wgmma attention's shared memory.
const FA_TILE_BYTES: u32 = 64 * 128 * 2;

/// Dynamic shared memory of `prefill_attention_pairs_hd128` (Hopper): as the one-warpgroup
/// kernel's, with a q tile for each of its two warpgroups (97.5 KB: one block an SM, as its
/// 256 threads' registers allow).
pub const PREFILL_ATTENTION_PAIRS_SMEM_BYTES: u32 = 512 + 6 * FA_TILE_BYTES + 4 * 64 * 4;

/// Dynamic shared memory of `prefill_attention_tma_hd128` (Hopper): 512 bytes to align, the two
/// consumer warpgroups' q tiles, rings of `FA_TMA_STAGES` (4) K and V tiles, and their 16
/// barriers (161 KB: one block an SM).
pub const PREFILL_ATTENTION_TMA_SMEM_BYTES: u32 = 512 + (2 + 2 * 4) * FA_TILE_BYTES + 4 * 4 * 8;
/// Threads of `prefill_attention_tma_hd128`: two consumer warpgroups and the producer's.
pub const PREFILL_ATTENTION_TMA_THREADS: u32 = 384;

/// Registers a block's warpgroups hand between them (`setmaxnreg`): the copy warpgroup's
/// `givers` threads drop to `low` a thread, then the other `takers` rise to `high`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterHandoff {
    pub givers: u32,
    pub low: u32,
    pub takers: u32,
    pub high: u32,
}

impl RegisterHandoff {
    /// The fewest registers a thread the block must start with: `setmaxnreg.inc` waits until
    /// the block's pool holds what it asks for, and only the givers' `dec` fills it, so a
    /// block that starts with fewer waits forever (no barrier's timeout sees it).
    pub fn entry_needed(self) -> u32 {
        let (g, t) = (self.givers, self.takers);
        (self.high * t + self.low * g).div_ceil(g + t)
    }
}

/// The hand-off of the TMA-fed kernels (kernels/gemm.cu `grouped_gemm_tma`,
/// kernels/prefill_attention.cu `prefill_attention_tma_hd128`): 384 threads at one block an SM
/// start at 168 registers (65,536 / 384, in steps of 8), and 128 x (168 - 40) = 256 x (232 - 168).
const TMA_HANDOFF: RegisterHandoff = RegisterHandoff {
    givers: 128,
    low: 40,
    takers: 256,
    high: 232,
};

/// The most dynamic shared memory a block may opt into on `arch` (CUDA's per-block limits).
pub fn max_dynamic_smem(arch: &str) -> u32 {
    match arch {
        "sm_90a" | "sm_100a" => 232_448,
        "sm_80" => 166_912,
        _ => 101_376,
    }
}

impl Kernel {
    /// One of the TMA GEMM kernels (kernels/gemm.cu `GEMM_TMA_KERNEL`).
    fn is_tma_gemm(self) -> bool {
        matches!(
            self,
            Kernel::GroupedGemmTmaBf16
                | Kernel::GroupedGemmTmaMxfp8
                | Kernel::GroupedGemmTmaNvfp4
                | Kernel::GroupedGemmTmaSwigluBf16
                | Kernel::GroupedGemmTmaSwigluMxfp8
                | Kernel::GroupedGemmTmaSwigluNvfp4
                | Kernel::GroupedGemmTmaSwigluWordsBf16
        )
    }

    /// The registers it hands between warpgroups (`setmaxnreg`), on Hopper where it runs.
    pub fn register_handoff(self) -> Option<RegisterHandoff> {
        (self.is_tma_gemm() || self == Kernel::PrefillAttentionTmaHd128).then_some(TMA_HANDOFF)
    }

    /// The dynamic shared memory a launch on `arch` gives it (its limit is raised to this on
    /// load). The wgmma and TMA kernels run on Hopper alone (elsewhere they trap, and the
    /// host never launches them), so they ask for none elsewhere.
    pub fn dynamic_smem(self, arch: &str) -> u32 {
        let hopper = arch == "sm_90a";
        match self {
            Kernel::GroupedGemmWgmmaBf16
            | Kernel::GroupedGemmWgmmaMxfp8
            | Kernel::GroupedGemmWgmmaNvfp4
            | Kernel::GroupedGemmWgmmaSwigluBf16
            | Kernel::GroupedGemmWgmmaSwigluMxfp8
            | Kernel::GroupedGemmWgmmaSwigluNvfp4
            | Kernel::GroupedGemmWgmmaSwigluWordsBf16
            | Kernel::GroupedGemmWgmmaRunsBf16
            | Kernel::GroupedGemmWgmmaRunsMxfp8
            | Kernel::GroupedGemmWgmmaRunsNvfp4
                if hopper =>
            {
                WGMMA_SMEM_BYTES
            }
            Kernel::GroupedGemmWgmma64Bf16
            | Kernel::GroupedGemmWgmma64Mxfp8
            | Kernel::GroupedGemmWgmma64Nvfp4
            | Kernel::GroupedGemmWgmma64RunsBf16
            | Kernel::GroupedGemmWgmma64RunsMxfp8
            | Kernel::GroupedGemmWgmma64RunsNvfp4
                if hopper =>
            {
                WGMMA64_SMEM_BYTES
            }
            k if k.is_tma_gemm() && hopper => TMA_SMEM_BYTES,
            Kernel::PrefillAttentionHd32 => prefill_attention_smem_bytes(32, arch),
            Kernel::PrefillAttentionHd64 => prefill_attention_smem_bytes(64, arch),
            Kernel::PrefillAttentionHd128 => prefill_attention_smem_bytes(128, arch),
            Kernel::PrefillAttentionPairsHd128 if arch == "sm_90a" => {
                PREFILL_ATTENTION_PAIRS_SMEM_BYTES
            }
            Kernel::PrefillAttentionTmaHd128 if arch == "sm_90a" => {
                PREFILL_ATTENTION_TMA_SMEM_BYTES
            }
            _ => 0,
        }
    }
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
    fn every_kernel_fits_the_shared_memory_of_every_arch() {
        for (major, minor) in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)] {
            let arch = arch_for(major, minor);
            for k in Kernel::ALL {
                assert!(
                    k.dynamic_smem(arch) <= max_dynamic_smem(arch),
                    "{k:?} asks {} bytes on {arch}, which allows {}",
                    k.dynamic_smem(arch),
                    max_dynamic_smem(arch)
                );
            }
        }
    }

    #[test]
    fn register_handoffs_balance_at_the_entry_one_block_an_sm_gives() {
        let h = TMA_HANDOFF;
        // One block of 384 threads an SM: 65,536 registers in steps of 8 a thread.
        let entry = 65_536 / (h.givers + h.takers) / 8 * 8;
        assert_eq!(entry, 168);
        assert_eq!(h.entry_needed(), entry);
        // Exactly: what the givers free is what the takers ask, and the block fits the SM.
        assert_eq!((entry - h.low) * h.givers, (h.high - entry) * h.takers);
        assert!(h.low * h.givers + h.high * h.takers <= 65_536);
        // One register fewer at entry leaves the takers short.
        let short = entry - 8;
        assert!((short - h.low) * h.givers < (h.high - short) * h.takers);
        for k in Kernel::ALL {
            if let Some(hk) = k.register_handoff() {
                assert_eq!(hk, TMA_HANDOFF, "{k:?}");
            }
        }
        assert!(Kernel::PrefillAttentionTmaHd128
            .register_handoff()
            .is_some());
        assert!(Kernel::GroupedGemmTmaBf16.register_handoff().is_some());
    }

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
    fn a_sources_directory_replaces_the_files_it_holds() {
        let dir = std::env::temp_dir().join(format!("lockstep-kernel-src-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("gemm.cu"), "// replaced gemm\n").unwrap();
        let gemm = Source::Gemm.program_in(Some(&dir));
        assert!(gemm.starts_with(COMMON) && gemm.ends_with("// replaced gemm\n"));
        assert_eq!(
            Source::Moe.program_in(Some(&dir)),
            Source::Moe.program_in(None)
        );
        std::fs::write(dir.join("common.cuh"), "// replaced common\n").unwrap();
        let moe = Source::Moe.program_in(Some(&dir));
        assert!(moe.starts_with("// replaced common\n") && moe.ends_with(Source::Moe.body()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn replaced_kernels_must_keep_the_registry_signatures() {
        // Hash's kernels, written as PTX entries with the registry's parameters, pass; one
        // with a parameter dropped, or missing, is named.
        let entries = |drop_last_of: Option<Kernel>| {
            Kernel::ALL
                .iter()
                .filter(|k| k.source() == Source::Hash)
                .map(|&k| {
                    let n = k.params().len() - usize::from(drop_last_of == Some(k));
                    let params: Vec<String> = k.params()[..n]
                        .iter()
                        .enumerate()
                        .map(|(i, p)| {
                            let ty = match p {
                                Param::Ptr | Param::U64 => ".u64",
                                Param::I32 => ".u32",
                                Param::F32 => ".f32",
                                Param::TensorMap => ".align 64 .b8",
                            };
                            format!(".param {ty} p{i}")
                        })
                        .collect();
                    format!(".entry {}({})\n{{\n}}\n", k.symbol(), params.join(", "))
                })
                .collect::<String>()
        };
        assert!(check_entries(Source::Hash, &entries(None)).is_ok());
        let first = *Kernel::ALL
            .iter()
            .find(|k| k.source() == Source::Hash)
            .unwrap();
        let err = check_entries(Source::Hash, &entries(Some(first))).unwrap_err();
        assert!(err.to_string().contains(first.symbol()), "{err}");
        let err = check_entries(Source::Hash, "").unwrap_err();
        assert!(err.to_string().contains(first.symbol()), "{err}");
    }

    #[test]
    fn ptx_entry_params_reads_the_signature() {
        let ptx = "
.visible .entry other(\n\t.param .f32 other_param_0\n)
.visible .entry add_inplace(
\t.param .u64 .ptr .align 1 add_inplace_param_0,
\t.param .u64 add_inplace_param_1,
\t.param .u32 add_inplace_param_2
)
.maxntid 256, 1, 1
{";
        assert_eq!(
            ptx_entry_params(ptx, "add_inplace").unwrap(),
            [".u64", ".u64", ".u32"]
        );
        assert_eq!(ptx_entry_params(ptx, "other").unwrap(), [".f32"]);
        assert_eq!(ptx_entry_params(ptx, "add"), None);
        assert!(Param::Ptr.matches_ptx(".u64") && !Param::I32.matches_ptx(".u64"));
        assert!(Param::F32.matches_ptx(".f32") && !Param::F32.matches_ptx(".u32"));
    }

    #[test]
    fn cache_key_changes_with_any_part() {
        let a = fnv1a64(&[b"src", b"sm_90a"]);
        assert_ne!(a, fnv1a64(&[b"src", b"sm_100a"]));
        assert_ne!(a, fnv1a64(&[b"srcsm_90a"]));
        assert_eq!(a, fnv1a64(&[b"src", b"sm_90a"]));
    }
}
