//! Launches of kernels/quant.cu's quantizers: the contract's MXFP8 and NVFP4 quantization of
//! activations and weights, the NaN-skipping amax, and block-FP8 dequantization at load. (The
//! Blackwell operand preparation in the same file is launched by `super::super::block_scaled`.)

use cudarc::driver::CudaSlice;

use super::{need, BLOCK};
use crate::backend::cuda::args::View;
use crate::backend::cuda::kernels::Kernel;
use crate::backend::cuda::{CudaError, Gpu};

/// MXFP8 1x32 quantization of `n` elements (whole rows); `deq` gets the exact dequantized
/// values.
pub fn mxfp8_quantize<T: QuantInput>(
    gpu: &Gpu,
    x: &CudaSlice<T>,
    n: usize,
    data: &mut CudaSlice<u8>,
    scales: &mut CudaSlice<u8>,
    deq: Option<&mut CudaSlice<f32>>,
) -> Result<(), CudaError> {
    let (data, scales, blocks) = mxfp8_outputs(n, data, scales)?;
    let x = need(x, n, "mxfp8 x")?;
    if blocks == 0 {
        return Ok(());
    }
    gpu.launch(
        T::MXFP8,
        (gpu.grid_for(blocks * 8, MXFP8_THREADS), 1, 1),
        MXFP8_THREADS,
        (x, blocks as u64, data, scales, deq.map(|d| View::whole(d))),
    )
}

/// Threads a block of the MXFP8 quantizers: eight per 32-element block (kernels/quant.cu
/// `mxfp8_rowwise`), so a launch has `blocks * 8` threads.
const MXFP8_THREADS: u32 = 128;

/// The MXFP8 quantizers' outputs for `n` elements (whole 32-blocks): codes, scales and the
/// number of 32-blocks.
fn mxfp8_outputs<'a>(
    n: usize,
    data: &'a CudaSlice<u8>,
    scales: &'a CudaSlice<u8>,
) -> Result<(View<'a, u8>, View<'a, u8>, usize), CudaError> {
    check_block(n, 32)?;
    let data = need(data, n, "mxfp8 data")?;
    Ok((data, need(scales, n / 32, "mxfp8 scales")?, n / 32))
}

fn check_block(n: usize, block: usize) -> Result<(), CudaError> {
    if n % block != 0 {
        return Err(CudaError::Capacity(format!(
            "{n} elements are not whole blocks of {block}"
        )));
    }
    Ok(())
}

/// NVFP4 options of one quantization: the second-level range (2688, or 6 * e4m3_range with
/// four-over-six) and four-over-six's E4M3 range and metric.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Nvfp4Params {
    pub range: f32,
    /// 0: four-over-six off.
    pub fos_range: f32,
    pub fos_squared: bool,
}

impl Nvfp4Params {
    pub fn from_four_over_six(fos: Option<crate::quant::FourOverSix>) -> Nvfp4Params {
        match fos {
            None => Nvfp4Params {
                range: 2688.0,
                fos_range: 0.0,
                fos_squared: false,
            },
            Some(f) => Nvfp4Params {
                range: 6.0 * f.e4m3_range,
                fos_range: f.e4m3_range,
                fos_squared: f.metric == crate::quant::nvfp4::ErrorMetric::Squared,
            },
        }
    }
}

/// The outputs of an activation quantization.
pub struct Nvfp4Out<'a> {
    pub data: &'a mut CudaSlice<u8>,
    pub scales: &'a mut CudaSlice<u8>,
    /// Per row: s_tok (per token) or the tensor's S_dec.
    pub row_s_dec: &'a mut CudaSlice<f32>,
    /// Block-scaled values e2m1 * e4m3, the GEMM operand.
    pub deq: Option<&'a mut CudaSlice<f32>>,
    /// The same values as the tiled and wgmma GEMMs' FP16 operand words (two values a word,
    /// `cols / 2` a row, in [`super::gemm::packed_word`]'s order, in an f32 buffer's memory):
    /// the words [`super::pack_gemm_operand`] makes of `deq` with [`super::Packing::F16`],
    /// for [`super::grouped_gemm_packed`].
    pub words: Option<&'a mut CudaSlice<f32>>,
}

/// Threads of an NVFP4 quantizer's block (a block a row): four a 16-element block
/// (kernels/quant.cu `nvfp4_row_quarters`), 32 to 512.
fn nvfp4_threads(cols: usize) -> u32 {
    (cols / 4).next_multiple_of(32).clamp(32, 512) as u32
}

/// An NVFP4 activation quantization's outputs for `rows` rows of `cols` values, checked: data,
/// scales, row scales and the operand words if asked for (`deq` is passed whole).
fn nvfp4_outputs<'a>(
    rows: usize,
    cols: usize,
    out: Nvfp4Out<'a>,
) -> Result<Nvfp4Views<'a>, CudaError> {
    let Nvfp4Out {
        data,
        scales,
        row_s_dec,
        deq,
        words,
    } = out;
    let data = need(data, rows * cols / 2, "nvfp4 data")?;
    let scales = need(scales, rows * cols / 16, "nvfp4 scales")?;
    let row_s_dec = need(row_s_dec, rows, "nvfp4 row scales")?;
    let words = match words {
        // The operand's spans are 32 values.
        Some(w) if cols.is_multiple_of(32) => {
            Some(need(w, rows * cols / 2, "nvfp4 operand words")?)
        }
        Some(_) => {
            return Err(CudaError::Unsupported(format!(
                "NVFP4 operand words of rows of {cols} values (a multiple of 32 needed)"
            )))
        }
        None => None,
    };
    let deq = deq.map(|d| View::whole(d));
    Ok((data, scales, row_s_dec, deq, words))
}

/// data, scales, row scales, dequantized values and operand words ([`nvfp4_outputs`]).
type Nvfp4Views<'a> = (
    View<'a, u8>,
    View<'a, u8>,
    View<'a, f32>,
    Option<View<'a, f32>>,
    Option<View<'a, f32>>,
);

/// How an NVFP4 activation quantizer walks its rows. Both give the same bytes; they differ in
/// speed alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nvfp4Walk {
    /// [`Nvfp4Walk::WarpARow`] for launches of at least [`nvfp4_warp_min_rows`] rows that it
    /// takes, else [`Nvfp4Walk::BlockARow`].
    Auto,
    /// A block a row (kernels/quant.cu `nvfp4_rows`): any width, four-over-six; the row read
    /// twice (its amax, then its blocks) by up to 512 threads. Few rows.
    BlockARow,
    /// A warp a row, the row in registers, read once (`nvfp4_rows_warp`): rows of at most
    /// [`NVFP4_WARP_MAX_COLS`] values, without four-over-six. Many rows.
    WarpARow,
}

/// The widest row [`Nvfp4Walk::WarpARow`] holds in registers (16 quarters a lane).
pub const NVFP4_WARP_MAX_COLS: usize = 2048;

/// Rows from which [`Nvfp4Walk::Auto`] takes [`Nvfp4Walk::WarpARow`]:
/// `LOCKSTEP_NVFP4_WARP_ROWS`, else 4,096 (prefill's launches). A warp a row gives a lane
/// several quarters in turn where a block a row gives each thread one, and fills the GPU only
/// with thousands of rows: from 256 rows (the experts' input at 256 decode rows, their SwiGLU
/// output from 32) the NVFP4 steps were slower, 17.59 / 17.70 -> 17.83 / 17.86 ms at 64 rows
/// and 26.39 / 26.35 -> 27.02 / 27.11 at 256, while prefill 8 x 2,048 went from 27,809 /
/// 27,819 to 28,987 / 28,495 tok/s (H100, `cuda_bench`, two rounds, 2026-12-06).
pub fn nvfp4_warp_min_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("LOCKSTEP_NVFP4_WARP_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4096)
    })
}

impl Nvfp4Walk {
    /// The walk a launch of `rows` rows of `cols` values with `p` takes (never `Auto`), or why
    /// it cannot take the one asked for.
    fn resolve(self, rows: usize, cols: usize, p: Nvfp4Params) -> Result<Nvfp4Walk, CudaError> {
        let warp_fits = cols <= NVFP4_WARP_MAX_COLS && p.fos_range <= 0.0;
        match self {
            Nvfp4Walk::Auto if warp_fits && rows >= nvfp4_warp_min_rows() => {
                Ok(Nvfp4Walk::WarpARow)
            }
            Nvfp4Walk::Auto => Ok(Nvfp4Walk::BlockARow),
            Nvfp4Walk::WarpARow if !warp_fits => Err(CudaError::Unsupported(format!(
                "the NVFP4 quantizer's warp-a-row walk takes rows of at most \
                 {NVFP4_WARP_MAX_COLS} values without four-over-six ({cols} asked)"
            ))),
            walk => Ok(walk),
        }
    }
}

/// Rows (warps) a block of [`Nvfp4Walk::WarpARow`].
const NVFP4_WARP_ROWS_A_BLOCK: usize = 8;

/// NVFP4 quantization of f32 rows, per token or per tensor (`tensor_amax` from [`amax`]).
#[allow(clippy::too_many_arguments)]
pub fn nvfp4_quantize_f32(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    rows: usize,
    cols: usize,
    per_token: bool,
    tensor_amax: Option<&CudaSlice<u32>>,
    p: Nvfp4Params,
    out: Nvfp4Out<'_>,
) -> Result<(), CudaError> {
    let walk = Nvfp4Walk::Auto;
    nvfp4_quantize_f32_on(walk, gpu, x, rows, cols, per_token, tensor_amax, p, out)
}

/// [`nvfp4_quantize_f32`] on a chosen walk (the tests run each against the CPU).
#[allow(clippy::too_many_arguments)]
pub fn nvfp4_quantize_f32_on(
    walk: Nvfp4Walk,
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    rows: usize,
    cols: usize,
    per_token: bool,
    tensor_amax: Option<&CudaSlice<u32>>,
    p: Nvfp4Params,
    out: Nvfp4Out<'_>,
) -> Result<(), CudaError> {
    check_block(cols, 16)?;
    let x = need(x, rows * cols, "nvfp4 x")?;
    let (data, scales, row_s_dec, deq, words) = nvfp4_outputs(rows, cols, out)?;
    if !per_token && tensor_amax.is_none() {
        return Err(CudaError::Capacity(
            "per-tensor NVFP4 needs the tensor amax".into(),
        ));
    }
    let walk = walk.resolve(rows, cols, p)?;
    if rows == 0 {
        return Ok(());
    }
    let amax = tensor_amax.map(View::whole);
    if walk == Nvfp4Walk::WarpARow {
        let kernel = match cols <= NVFP4_WARP_MAX_COLS / 2 {
            true => Kernel::Nvfp4QuantizeF32Warp8,
            false => Kernel::Nvfp4QuantizeF32Warp16,
        };
        return gpu.launch(
            kernel,
            (rows.div_ceil(NVFP4_WARP_ROWS_A_BLOCK) as u32, 1, 1),
            32 * NVFP4_WARP_ROWS_A_BLOCK as u32,
            (
                x,
                rows as u64,
                cols as i32,
                per_token as i32,
                amax,
                p.range,
                data,
                scales,
                row_s_dec,
                deq,
                words,
            ),
        );
    }
    gpu.launch(
        Kernel::Nvfp4QuantizeF32,
        (rows as u32, 1, 1),
        nvfp4_threads(cols),
        (
            x,
            cols as i32,
            per_token as i32,
            amax,
            p.range,
            p.fos_range,
            p.fos_squared as i32,
            data,
            scales,
            row_s_dec,
            deq,
            words,
        ),
    )
}

/// The widest SwiGLU output [`nvfp4_quantize_silu_mul`] takes (8 quarters a lane).
pub const NVFP4_SILU_MUL_MAX_COLS: usize = NVFP4_WARP_MAX_COLS / 2;

/// `h = silu(gate) * up` over `rows` gate/up rows (`[rows, 2 * inter]`, [`super::silu_mul`]'s
/// layout) and its per-token NVFP4 quantization, in one launch: the bytes of `silu_mul` then
/// [`nvfp4_quantize_f32`] of `h`. For `inter` of at most [`NVFP4_SILU_MUL_MAX_COLS`], without
/// four-over-six.
#[allow(clippy::too_many_arguments)]
pub fn nvfp4_quantize_silu_mul(
    gpu: &Gpu,
    gu: &CudaSlice<f32>,
    h: &mut CudaSlice<f32>,
    rows: usize,
    inter: usize,
    p: Nvfp4Params,
    out: Nvfp4Out<'_>,
) -> Result<(), CudaError> {
    nvfp4_quantize_silu_mul_on(Nvfp4Walk::Auto, gpu, gu, h, rows, inter, p, out)
}

/// [`nvfp4_quantize_silu_mul`] on a chosen walk (the tests run each against the two launches).
#[allow(clippy::too_many_arguments)]
pub fn nvfp4_quantize_silu_mul_on(
    walk: Nvfp4Walk,
    gpu: &Gpu,
    gu: &CudaSlice<f32>,
    h: &mut CudaSlice<f32>,
    rows: usize,
    inter: usize,
    p: Nvfp4Params,
    out: Nvfp4Out<'_>,
) -> Result<(), CudaError> {
    check_block(inter, 16)?;
    if inter > NVFP4_SILU_MUL_MAX_COLS || p.fos_range > 0.0 {
        return Err(CudaError::Unsupported(format!(
            "SwiGLU in the NVFP4 quantizer takes rows of at most {NVFP4_SILU_MUL_MAX_COLS} \
             values without four-over-six ({inter} asked)"
        )));
    }
    let n = rows * inter;
    let gu = need(gu, 2 * n, "silu_mul gate_up")?;
    let h = need(h, n, "silu_mul out")?;
    let (data, scales, row_s_dec, deq, words) = nvfp4_outputs(rows, inter, out)?;
    let walk = walk.resolve(rows, inter, p)?;
    if rows == 0 {
        return Ok(());
    }
    if walk == Nvfp4Walk::BlockARow {
        return gpu.launch(
            Kernel::Nvfp4QuantizeSiluMulRows,
            (rows as u32, 1, 1),
            nvfp4_threads(inter),
            (
                gu,
                h,
                inter as i32,
                p.range,
                data,
                scales,
                row_s_dec,
                deq,
                words,
            ),
        );
    }
    gpu.launch(
        Kernel::Nvfp4QuantizeSiluMulWarp8,
        (rows.div_ceil(NVFP4_WARP_ROWS_A_BLOCK) as u32, 1, 1),
        32 * NVFP4_WARP_ROWS_A_BLOCK as u32,
        (
            gu,
            h,
            rows as u64,
            inter as i32,
            p.range,
            data,
            scales,
            row_s_dec,
            deq,
            words,
        ),
    )
}

/// `h = silu(gate) * up` over `rows` gate/up rows (`[rows, 2 * inter]`, [`super::silu_mul`]'s
/// layout) and its MXFP8 quantization, in one launch: the bytes of `silu_mul` then
/// [`mxfp8_quantize`] of `h`.
#[allow(clippy::too_many_arguments)]
pub fn mxfp8_quantize_silu_mul(
    gpu: &Gpu,
    gu: &CudaSlice<f32>,
    h: &mut CudaSlice<f32>,
    rows: usize,
    inter: usize,
    data: &mut CudaSlice<u8>,
    scales: &mut CudaSlice<u8>,
    deq: Option<&mut CudaSlice<f32>>,
) -> Result<(), CudaError> {
    check_block(inter, 32)?;
    let n = rows * inter;
    let (data, scales, blocks) = mxfp8_outputs(n, data, scales)?;
    let gu = need(gu, 2 * n, "silu_mul gate_up")?;
    let h = need(h, n, "silu_mul out")?;
    if blocks == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::Mxfp8QuantizeSiluMul,
        (gpu.grid_for(blocks * 8, MXFP8_THREADS), 1, 1),
        MXFP8_THREADS,
        (
            gu,
            h,
            inter as i32,
            blocks as u64,
            data,
            scales,
            deq.map(|d| View::whole(d)),
        ),
    )
}

/// NVFP4 quantization of BF16 weight rows with a given (per-tensor or shared) amax.
#[allow(clippy::too_many_arguments)]
pub fn nvfp4_quantize_bf16(
    gpu: &Gpu,
    x: &CudaSlice<u16>,
    rows: usize,
    cols: usize,
    amax: f32,
    p: Nvfp4Params,
    data: &mut CudaSlice<u8>,
    scales: &mut CudaSlice<u8>,
) -> Result<(), CudaError> {
    check_block(cols, 16)?;
    let x = need(x, rows * cols, "nvfp4 x")?;
    let data = need(data, rows * cols / 2, "nvfp4 data")?;
    let scales = need(scales, rows * cols / 16, "nvfp4 scales")?;
    if rows == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::Nvfp4QuantizeBf16,
        (rows as u32, 1, 1),
        nvfp4_threads(cols),
        (
            x,
            cols as i32,
            amax,
            p.range,
            p.fos_range,
            p.fos_squared as i32,
            data,
            scales,
        ),
    )
}

/// Block-FP8 weights dequantized on the device, bit for bit `quant::fp8_block::dequantize`:
/// `q` E4M3 `[rows, cols]`, `scale_inv` `[ceil(rows/bn), ceil(cols/bk)]` (checked by the caller).
#[allow(clippy::too_many_arguments)]
pub fn fp8_block_dequantize(
    gpu: &Gpu,
    q: &CudaSlice<u8>,
    scale_inv: &CudaSlice<f32>,
    rows: usize,
    cols: usize,
    block: (usize, usize),
    out: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let (bn, bk) = block;
    if bn == 0 || bk == 0 {
        return Err(CudaError::Capacity(
            "weight_block_size must be positive".into(),
        ));
    }
    let n = rows * cols;
    let q = need(q, n, "fp8 dequantize q")?;
    let scale_inv = need(
        scale_inv,
        rows.div_ceil(bn) * cols.div_ceil(bk),
        "fp8 dequantize scale_inv",
    )?;
    let out = need(out, n, "fp8 dequantize out")?;
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::Fp8BlockDequantize,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        (
            q,
            scale_inv,
            rows as u64,
            cols as u64,
            bn as u64,
            bk as u64,
            out,
        ),
    )
}

/// Element types the quantizers read: f32 activations, BF16 weights (as raw bits).
pub trait QuantInput: cudarc::driver::DeviceRepr {
    const AMAX: Kernel;
    const MXFP8: Kernel;
}

impl QuantInput for f32 {
    const AMAX: Kernel = Kernel::AmaxF32;
    const MXFP8: Kernel = Kernel::Mxfp8QuantizeF32;
}

impl QuantInput for u16 {
    const AMAX: Kernel = Kernel::AmaxBf16;
    const MXFP8: Kernel = Kernel::Mxfp8QuantizeBf16;
}

/// `out = [max |x| bits, any number]`, the contract's NaN-skipping amax.
pub fn amax<T: QuantInput>(
    gpu: &Gpu,
    x: &CudaSlice<T>,
    n: usize,
    out: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let x = need(x, n, "amax x")?;
    need(out, 2, "amax out")?;
    gpu.stream.memset_zeros(out)?;
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        T::AMAX,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        // `out` was checked above, before it was zeroed.
        (x, n as u64, View::whole(out)),
    )
}

/// The amax from [`amax`]'s output (NaN when no element was a number).
pub fn amax_value(bits: &[u32], n: usize) -> f32 {
    if n > 0 && bits[1] == 0 {
        f32::NAN
    } else {
        f32::from_bits(bits[0])
    }
}
