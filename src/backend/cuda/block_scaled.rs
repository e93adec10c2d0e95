//! The Blackwell path for quantized layers: MXFP8 and NVFP4 GEMMs on sm_100's block-scaled
//! tensor cores through cuBLASLt (`CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0` /
//! `VEC16_UE4M3`), weights and activations both in their quantized bytes, FP32 output.
//!
//! **Compiled, never run**: no Blackwell GPU is available to the project. It is selected at run
//! time only on sm_100 (`BlockScaledGemm::available`); Hopper and older run the BF16
//! tensor-core kernels of gemm.cu. The operand preparation kernels it uses (scale swizzle, row
//! gather, NVFP4 epilogue) are arch-independent and tested on the H200 against the layout's
//! definition (tests/cuda_ops.rs).
//!
//! The products are the contract's: E4M3/E2M1 elements times their E8M0/E4M3 block scales,
//! FP32 accumulation, then (NVFP4) the per-token and per-tensor scales in the contract's order.

use std::ffi::c_void;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, DevicePtr};

use super::args::DevPtr;
use super::device::Gpu;
use super::kernels::Kernel;
use super::ops::{GemmRows, WeightData};
use super::CudaError;

/// cuBLASLt's workspace for the block-scaled kernels.
const WORKSPACE_BYTES: usize = 32 << 20;

/// Which block-scaled format a GEMM runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockFormat {
    Mxfp8,
    Nvfp4,
}

impl BlockFormat {
    /// Elements per block scale.
    pub fn block(self) -> usize {
        match self {
            BlockFormat::Mxfp8 => 32,
            BlockFormat::Nvfp4 => 16,
        }
    }

    /// Bytes of one row of `k` elements.
    pub fn row_bytes(self, k: usize) -> usize {
        match self {
            BlockFormat::Mxfp8 => k,
            BlockFormat::Nvfp4 => k / 2,
        }
    }
}

/// Bytes of a `[rows, cols]` scale tensor in cuBLASLt's tiled layout (128 x 4 tiles).
pub fn swizzled_len(rows: usize, cols: usize) -> usize {
    rows.div_ceil(128) * 128 * cols.div_ceil(4) * 4
}

/// The offset of scale `(r, c)` of a `[rows, cols]` tensor in cuBLASLt's 1D block-scaling
/// layout (kernels/quant.cu `swizzle_block_scales` implements it on the device).
pub fn swizzled_offset(r: usize, c: usize, cols: usize) -> usize {
    let tile = (r / 128) * cols.div_ceil(4) + c / 4;
    tile * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4
}

/// Swizzles `[rows, cols]` row-major scales at `src` into `dst` (both raw device pointers).
pub fn swizzle_scales(
    gpu: &Gpu,
    src: u64,
    rows: usize,
    cols: usize,
    dst: u64,
) -> Result<(), CudaError> {
    let total = swizzled_len(rows, cols);
    if total == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::SwizzleBlockScales,
        (gpu.grid_for(total, 256), 1, 1),
        256,
        (DevPtr(src), rows as i32, cols as i32, DevPtr(dst)),
    )
}

/// `dst[r] = src[row_index[r]]`, rows of `width` bytes.
pub fn gather_rows(
    gpu: &Gpu,
    src: u64,
    row_index: u64,
    rows: usize,
    width: usize,
    dst: u64,
) -> Result<(), CudaError> {
    if rows * width == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::GatherRowsU8,
        (gpu.grid_for(rows * width, 256), 1, 1),
        256,
        (
            DevPtr(src),
            DevPtr(row_index),
            rows as i32,
            width as i32,
            DevPtr(dst),
        ),
    )
}

fn raw<T>(gpu: &Gpu, s: &CudaSlice<T>) -> u64 {
    let (p, _) = s.device_ptr(&gpu.stream);
    p
}

/// The cuBLASLt handle and the buffers the block-scaled path prepares operands in, sized
/// once for the largest layer (no allocation in a step).
pub struct BlockScaledGemm {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    act_data: CudaSlice<u8>,
    act_scales: CudaSlice<u8>,
    act_swizzled: CudaSlice<u8>,
    w_swizzled: CudaSlice<u8>,
}

impl BlockScaledGemm {
    /// Block-scaled MMA exists on sm_100 (Blackwell datacenter parts).
    pub fn available(gpu: &Gpu) -> bool {
        gpu.arch == "sm_100a"
    }

    /// Buffers for up to `max_rows` activation rows and weight matrices of up to `max_n` rows,
    /// both at most `max_k` wide.
    pub fn new(gpu: &Gpu, max_rows: usize, max_n: usize, max_k: usize) -> Result<Self, CudaError> {
        let handle =
            lt::create_handle().map_err(|e| CudaError::Unsupported(format!("cuBLASLt: {e:?}")))?;
        let scale_cols = max_k / 16;
        Ok(BlockScaledGemm {
            handle,
            workspace: gpu.alloc(WORKSPACE_BYTES)?,
            act_data: gpu.alloc(max_rows * max_k)?,
            act_scales: gpu.alloc(max_rows * scale_cols + 1)?,
            act_swizzled: gpu.alloc(swizzled_len(max_rows, scale_cols))?,
            w_swizzled: gpu.alloc(swizzled_len(max_n, scale_cols))?,
        })
    }

    /// `out[r] = x[row_index(r)] W_e^T` over the rows of `rows`, from activations already
    /// quantized rowwise (`x_data`, `x_scales`, and for NVFP4 the per-row `row_scale`).
    /// Routed rows are gathered into their experts' groups, then one cuBLASLt call per expert.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        gpu: &Gpu,
        fmt: BlockFormat,
        w: &WeightData,
        x_data: &CudaSlice<u8>,
        x_scales: &CudaSlice<u8>,
        row_scale: Option<&CudaSlice<f32>>,
        rows: GemmRows<'_>,
        row_index: Option<&CudaSlice<i32>>,
        n: usize,
        k: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (w_data, w_scales, sdec, groups) = match (fmt, w) {
            (BlockFormat::Mxfp8, WeightData::Mxfp8 { data, scales }) => (data, scales, None, 1),
            (
                BlockFormat::Nvfp4,
                WeightData::Nvfp4 {
                    data,
                    scales,
                    s_dec,
                    groups,
                },
            ) => (data, scales, Some(s_dec), *groups),
            _ => {
                return Err(CudaError::Unsupported(
                    "block-scaled GEMM: weights and activations must share the format".into(),
                ))
            }
        };
        let (row_bytes, scale_cols) = (fmt.row_bytes(k), k / fmt.block());
        // Per group: (expert, first row, rows); x rows contiguous from `x_at` on.
        let (groups_list, x, xs) = match rows {
            GemmRows::Dense(r) => (
                vec![(0usize, 0usize, r)],
                raw(gpu, x_data),
                raw(gpu, x_scales),
            ),
            GemmRows::Plan(p) => {
                let offsets = gpu.download(&p.offsets, p.offsets.len())?;
                let pairs = *offsets.last().unwrap_or(&0) as usize;
                let list = offsets
                    .windows(2)
                    .enumerate()
                    .filter(|(_, w)| w[1] > w[0])
                    .map(|(e, w)| (e, w[0] as usize, (w[1] - w[0]) as usize))
                    .collect();
                match row_index {
                    Some(idx) => {
                        let idx = raw(gpu, idx);
                        gather_rows(
                            gpu,
                            raw(gpu, x_data),
                            idx,
                            pairs,
                            row_bytes,
                            raw(gpu, &self.act_data),
                        )?;
                        gather_rows(
                            gpu,
                            raw(gpu, x_scales),
                            idx,
                            pairs,
                            scale_cols,
                            raw(gpu, &self.act_scales),
                        )?;
                        (list, raw(gpu, &self.act_data), raw(gpu, &self.act_scales))
                    }
                    None => (list, raw(gpu, x_data), raw(gpu, x_scales)),
                }
            }
        };
        let out_base = raw(gpu, out);
        for (e, first, count) in groups_list {
            let w_at = raw(gpu, w_data) + (e * n * row_bytes) as u64;
            let ws_at = raw(gpu, w_scales) + (e * n * scale_cols) as u64;
            swizzle_scales(gpu, ws_at, n, scale_cols, raw(gpu, &self.w_swizzled))?;
            swizzle_scales(
                gpu,
                xs + (first * scale_cols) as u64,
                count,
                scale_cols,
                raw(gpu, &self.act_swizzled),
            )?;
            let d = out_base + (first * n * 4) as u64;
            self.matmul(
                gpu,
                fmt,
                w_at,
                x + (first * row_bytes) as u64,
                count,
                n,
                k,
                d,
            )?;
            if let (Some(sdec), Some(rs)) = (sdec, row_scale) {
                let idx = match row_index {
                    Some(i) => raw(gpu, i) + (first * 4) as u64,
                    None => 0,
                };
                // Without a row index the rows are x's own rows, from `first` on.
                let rs_at = raw(gpu, rs)
                    + if row_index.is_some() {
                        0
                    } else {
                        (first * 4) as u64
                    };
                gpu.launch(
                    Kernel::Nvfp4Epilogue,
                    (gpu.grid_for(count * n, 256), 1, 1),
                    256,
                    (
                        DevPtr(d),
                        DevPtr(rs_at),
                        DevPtr(idx),
                        DevPtr(raw(gpu, sdec)),
                        e as i32,
                        groups as i32,
                        count as i32,
                        n as i32,
                    ),
                )?;
            }
        }
        Ok(())
    }

    /// One block-scaled GEMM: row-major `d[m, n] = x[m, k] w[n, k]^T` with the swizzled scales
    /// in `w_swizzled` / `act_swizzled`. In cuBLAS's column-major terms D (n x m) =
    /// op(A) (n x k, A = w stored k x n, transposed) times B (k x m, B = x).
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &mut self,
        gpu: &Gpu,
        fmt: BlockFormat,
        w: u64,
        x: u64,
        m: usize,
        n: usize,
        k: usize,
        d: u64,
    ) -> Result<(), CudaError> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let err = |e: cudarc::cublaslt::result::CublasError| {
            CudaError::Unsupported(format!("cuBLASLt block-scaled GEMM: {e:?}"))
        };
        let (elem, mode) = match fmt {
            BlockFormat::Mxfp8 => (
                sys::cudaDataType::CUDA_R_8F_E4M3,
                sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0,
            ),
            BlockFormat::Nvfp4 => (
                sys::cudaDataType::CUDA_R_4F_E2M1,
                sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3,
            ),
        };
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(err)?;
        let a = lt::create_matrix_layout(elem, k as u64, n as u64, k as i64).map_err(err)?;
        let b = lt::create_matrix_layout(elem, k as u64, m as u64, k as i64).map_err(err)?;
        let c =
            lt::create_matrix_layout(sys::cudaDataType::CUDA_R_32F, n as u64, m as u64, n as i64)
                .map_err(err)?;
        let pref = lt::create_matmul_pref().map_err(err)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (w_scales, x_scales) = (raw(gpu, &self.w_swizzled), raw(gpu, &self.act_swizzled));
        let workspace = raw(gpu, &self.workspace);
        // SAFETY: every descriptor is created above and destroyed below; the pointers are device
        // buffers of this context sized by `new` for the largest layer; attribute buffers are
        // plain values of the types cuBLASLt documents for each attribute.
        let result = unsafe {
            (|| {
                let set = |attr: A, v: *const c_void, size: usize| {
                    lt::set_matmul_desc_attribute(desc, attr, v, size)
                };
                let trans_a = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
                let trans_b = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
                set(
                    A::CUBLASLT_MATMUL_DESC_TRANSA,
                    &trans_a as *const _ as *const c_void,
                    std::mem::size_of_val(&trans_a),
                )?;
                set(
                    A::CUBLASLT_MATMUL_DESC_TRANSB,
                    &trans_b as *const _ as *const c_void,
                    std::mem::size_of_val(&trans_b),
                )?;
                set(
                    A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                    &mode as *const _ as *const c_void,
                    std::mem::size_of_val(&mode),
                )?;
                set(
                    A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                    &mode as *const _ as *const c_void,
                    std::mem::size_of_val(&mode),
                )?;
                set(
                    A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                    &w_scales as *const u64 as *const c_void,
                    8,
                )?;
                set(
                    A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                    &x_scales as *const u64 as *const c_void,
                    8,
                )?;
                let ws = WORKSPACE_BYTES as u64;
                lt::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const u64 as *const c_void,
                    8,
                )?;
                let heuristic = lt::get_matmul_algo_heuristic(self.handle, desc, a, b, c, c, pref)?;
                lt::matmul(
                    self.handle,
                    desc,
                    &alpha as *const f32 as *const c_void,
                    &beta as *const f32 as *const c_void,
                    w as *const c_void,
                    a,
                    x as *const c_void,
                    b,
                    d as *const c_void,
                    c,
                    d as *mut c_void,
                    c,
                    &heuristic.algo,
                    workspace as *mut c_void,
                    WORKSPACE_BYTES,
                    gpu.stream.cu_stream() as sys::cudaStream_t,
                )
            })()
        };
        // SAFETY: created above, not used after this.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
            let _ = lt::destroy_matrix_layout(a);
            let _ = lt::destroy_matrix_layout(b);
            let _ = lt::destroy_matrix_layout(c);
            let _ = lt::destroy_matmul_desc(desc);
        }
        result.map_err(err)
    }
}

impl Drop for BlockScaledGemm {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
