//! Launches of kernels/gemm.cu, the grouped GEMM over experts and dense layers with weights
//! decoded in-kernel (F32, BF16, MXFP8, NVFP4; FFMA, BF16 tensor cores or a GEMV, picked by
//! [`GemmPath`]), and the dense cuBLAS GEMM.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::CudaSlice;

use super::{need, MoePlan};
use crate::backend::cuda::args::{addr, DevPtr, View};
use crate::backend::cuda::kernels::Kernel;
use crate::backend::cuda::{CudaError, Gpu};

/// Rows per tile of the grouped GEMM (kernels/gemm.cu `TM`).
pub const GEMM_TILE_ROWS: usize = 32;
/// Columns per tile (kernels/gemm.cu `TN`, `MMA_TN`).
pub const GEMM_TILE_COLS: usize = 64;
/// Output columns per GEMV block (a warp each).
const GEMV_COLS_PER_BLOCK: usize = 8;

/// A weight matrix (or a stack of expert matrices) in GPU memory, in its storage format.
pub enum WeightData {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
    Mxfp8 {
        data: CudaSlice<u8>,
        scales: CudaSlice<u8>,
    },
    Nvfp4 {
        data: CudaSlice<u8>,
        scales: CudaSlice<u8>,
        /// S_dec per (matrix, group): `[experts * groups]`.
        s_dec: CudaSlice<f32>,
        groups: usize,
    },
}

/// Which rows a grouped GEMM runs over.
pub enum GemmRows<'a> {
    /// One group of `rows` rows (a dense layer).
    Dense(usize),
    /// The tiles of a routing plan.
    Plan(&'a MoePlan),
}

/// Which grouped-GEMM kernel runs (kernels/gemm.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// Picked from the shape: [`GemmPath::Gemv`] for groups of a few rows, tensor cores
    /// otherwise, CUDA cores where K is not a multiple of 32 or the weights are F32.
    Auto,
    /// CUDA cores (FFMA), any shape: the exact-f32 path.
    Ffma,
    /// BF16 tensor cores (mma.sync), operands decoded to BF16 in shared memory.
    TensorCore,
    /// A warp per output column, for decode-sized groups.
    Gemv,
}

/// Rows up to which [`GemmPath::Auto`] takes the GEMV for one dense group (kernels/gemm.cu
/// `GEMV_ROWS` rows per pass, later passes read the weights from L2; the tensor-core kernel
/// would give a 4096-wide layer only 64 blocks) and, on average per expert, for a routing plan.
/// Measured on the H200 (examples/cuda_kernel_bench.rs, docs/performance.md): at 0.5 rows per
/// expert the GEMV takes 0.7x the tensor-core kernel's time, at 4 rows 1.4x.
pub const GEMV_MAX_DENSE_ROWS: usize = 16;
pub const GEMV_MAX_ROWS_PER_EXPERT: usize = 2;

impl GemmPath {
    fn resolve(self, w: &WeightData, rows: &GemmRows<'_>, max_rows: usize, k: usize) -> GemmPath {
        let shape_ok = k % 32 == 0;
        let f32_weights = matches!(w, WeightData::F32(_));
        match self {
            GemmPath::Auto => {
                let gemv_rows = match rows {
                    GemmRows::Dense(_) => GEMV_MAX_DENSE_ROWS,
                    GemmRows::Plan(p) => GEMV_MAX_ROWS_PER_EXPERT * p.counts.len(),
                };
                if !shape_ok {
                    GemmPath::Ffma
                } else if max_rows <= gemv_rows {
                    GemmPath::Gemv
                } else if f32_weights {
                    GemmPath::Ffma
                } else {
                    GemmPath::TensorCore
                }
            }
            GemmPath::TensorCore if f32_weights || !shape_ok => GemmPath::Ffma,
            GemmPath::Gemv if !shape_ok => GemmPath::Ffma,
            p => p,
        }
    }
}

/// `out[r] = x[row_index(r)] W_e^T` for every row of every group, W decoded in-kernel.
/// `row_scale` is the NVFP4 s_tok of each x row (required for NVFP4).
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    row_index: Option<&CudaSlice<i32>>,
    row_scale: Option<&CudaSlice<f32>>,
    w: &WeightData,
    rows: GemmRows<'_>,
    max_rows: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    grouped_gemm_on(
        GemmPath::Auto,
        gpu,
        x,
        row_index,
        row_scale,
        w,
        rows,
        max_rows,
        n,
        k,
        out,
    )
}

/// [`grouped_gemm`] on a chosen kernel (the tests run each against the CPU).
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_on(
    path: GemmPath,
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    row_index: Option<&CudaSlice<i32>>,
    row_scale: Option<&CudaSlice<f32>>,
    w: &WeightData,
    rows: GemmRows<'_>,
    max_rows: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let out = need(out, max_rows * n, "gemm out")?;
    let path = path.resolve(w, &rows, max_rows, k);
    let pick = |ffma, mma, gemv| match path {
        GemmPath::Gemv => gemv,
        GemmPath::TensorCore => mma,
        _ => ffma,
    };
    // The kernels take the weights untyped (`const void*`), decoded by format.
    let (kernel, w_data, w_scales, w_sdec, groups) = match w {
        WeightData::F32(d) => (
            pick(
                Kernel::GroupedGemmF32,
                Kernel::GroupedGemmF32,
                Kernel::GroupedGemvF32,
            ),
            DevPtr(addr(gpu, d)),
            None,
            None,
            1,
        ),
        WeightData::Bf16(d) => (
            pick(
                Kernel::GroupedGemmBf16,
                Kernel::GroupedGemmMmaBf16,
                Kernel::GroupedGemvBf16,
            ),
            DevPtr(addr(gpu, d)),
            None,
            None,
            1,
        ),
        WeightData::Mxfp8 { data, scales } => (
            pick(
                Kernel::GroupedGemmMxfp8,
                Kernel::GroupedGemmMmaMxfp8,
                Kernel::GroupedGemvMxfp8,
            ),
            DevPtr(addr(gpu, data)),
            Some(View::whole(scales)),
            None,
            1,
        ),
        WeightData::Nvfp4 {
            data,
            scales,
            s_dec,
            groups,
        } => {
            if row_scale.is_none() {
                return Err(CudaError::Capacity(
                    "NVFP4 GEMM needs the row scales".into(),
                ));
            }
            (
                pick(
                    Kernel::GroupedGemmNvfp4,
                    Kernel::GroupedGemmMmaNvfp4,
                    Kernel::GroupedGemvNvfp4,
                ),
                DevPtr(addr(gpu, data)),
                Some(View::whole(scales)),
                Some(View::whole(s_dec)),
                *groups,
            )
        }
    };
    let (tiles, num_tiles, offsets, rows_arg, grid_y) = match rows {
        GemmRows::Dense(r) => (None, None, None, r, r.div_ceil(GEMM_TILE_ROWS)),
        GemmRows::Plan(p) => (
            Some(View::whole(&p.tiles)),
            Some(View::whole(&p.num_tiles)),
            Some(View::whole(&p.offsets)),
            0,
            p.tiles.len() / 2,
        ),
    };
    if grid_y == 0 || n == 0 {
        return Ok(());
    }
    // Block shapes: kernels/gemm.cu (FFMA 32x64 tiles on 256 threads, MMA 32x64 tiles on 4
    // warps, GEMV 8 columns on 8 warps).
    let (cols_per_block, threads) = match path {
        GemmPath::Gemv => (GEMV_COLS_PER_BLOCK, 256),
        GemmPath::TensorCore => (GEMM_TILE_COLS, 128),
        _ => (GEMM_TILE_COLS, 256),
    };
    // x, its row index and scales, and the weights are read at the rows and experts the plan
    // (or the dense row count) names: sized by the layer's owner.
    gpu.launch(
        kernel,
        (n.div_ceil(cols_per_block) as u32, grid_y as u32, 1),
        threads,
        (
            View::whole(x),
            row_index.map(View::whole),
            row_scale.map(View::whole),
            w_data,
            w_scales,
            w_sdec,
            groups as i32,
            tiles,
            num_tiles,
            offsets,
            rows_arg as i32,
            n as i32,
            k as i32,
            out,
        ),
    )
}

/// Dense `out[m, n] = x[m, k] W[n, k]^T` through cuBLAS: BF16 operands (x already cast) or
/// F32 operands, f32 output, FP32 accumulation.
pub fn cublas_gemm(
    gpu: &Gpu,
    x: CublasOperand<'_>,
    w: CublasOperand<'_>,
    m: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let out = need(out, m * n, "cublas out")?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (xp, xt) = x.raw(gpu, m * k)?;
    let (wp, wt) = w.raw(gpu, n * k)?;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let op = out.addr(gpu);
    // Row-major out^T = W x^T is column-major out (n x m): A = W (k x n, transposed), B = x.
    // SAFETY: buffer sizes were checked above; all pointers are on the handle's stream.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *gpu.blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            m as i32,
            k as i32,
            &alpha as *const f32 as *const _,
            wp as *const _,
            wt,
            k as i32,
            xp as *const _,
            xt,
            k as i32,
            &beta as *const f32 as *const _,
            op as *mut _,
            cudaDataType::CUDA_R_32F,
            n as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )?;
    }
    Ok(())
}

/// A cuBLAS operand.
pub enum CublasOperand<'a> {
    Bf16(&'a CudaSlice<u16>),
    F32(&'a CudaSlice<f32>),
}

impl CublasOperand<'_> {
    fn raw(&self, gpu: &Gpu, n: usize) -> Result<(u64, cudaDataType), CudaError> {
        Ok(match self {
            CublasOperand::Bf16(s) => (
                need(s, n, "cublas operand")?.addr(gpu),
                cudaDataType::CUDA_R_16BF,
            ),
            CublasOperand::F32(s) => (
                need(s, n, "cublas operand")?.addr(gpu),
                cudaDataType::CUDA_R_32F,
            ),
        })
    }
}
