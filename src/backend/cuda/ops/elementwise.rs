//! Launches of kernels/elementwise.cu: dummy weights, casts, embedding, RMSNorm (+ residual),
//! q/k norm + RoPE + KV store, SwiGLU and the MoE combine.

use cudarc::driver::CudaSlice;

use super::{need, sums_ptr, AttnShape, MoePlan, Unfolded, BLOCK};
use crate::backend::cuda::args::{addr, DevPtr, View};
use crate::backend::cuda::kernels::Kernel;
use crate::backend::cuda::{CudaError, Gpu};

/// Dummy weights: the counter-based generator of `model::loader` (see `dummy_key`).
pub fn dummy_fill_bf16(
    gpu: &Gpu,
    out: &mut CudaSlice<u16>,
    n: usize,
    key: u64,
    bound: f32,
) -> Result<(), CudaError> {
    let out = need(out, n, "dummy_fill out")?;
    gpu.launch(
        Kernel::DummyFillBf16,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        (out, n as u64, key, bound),
    )
}

pub fn bf16_to_f32(
    gpu: &Gpu,
    x: &CudaSlice<u16>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    let x = need(x, n, "bf16_to_f32 x")?;
    let out = need(out, n, "bf16_to_f32 out")?;
    gpu.launch(
        Kernel::Bf16ToF32,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        (x, out, n as u64),
    )
}

pub fn f32_to_bf16(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<u16>,
    n: usize,
) -> Result<(), CudaError> {
    let x = need(x, n, "f32_to_bf16 x")?;
    let out = need(out, n, "f32_to_bf16 out")?;
    gpu.launch(
        Kernel::F32ToBf16,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        (x, out, n as u64),
    )
}

/// An embedding table in its stored dtype.
pub enum Table {
    Bf16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

pub fn embedding(
    gpu: &Gpu,
    tokens: &CudaSlice<u32>,
    n: usize,
    table: &Table,
    out: &mut CudaSlice<f32>,
    hidden: usize,
) -> Result<(), CudaError> {
    let tokens = need(tokens, n, "embedding tokens")?;
    let out = need(out, n * hidden, "embedding out")?;
    // The kernel takes the table untyped (`const void*`) with its dtype beside it.
    let (table, is_bf16) = match table {
        Table::Bf16(t) => (DevPtr(addr(gpu, t)), 1),
        Table::F32(t) => (DevPtr(addr(gpu, t)), 0),
    };
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::Embedding,
        (n as u32, 1, 1),
        128,
        (tokens, table, is_bf16, out, hidden as i32),
    )
}

/// `out[i] = rms_norm(x[rows[i]]) * w` for `out_rows` rows (rows: None = 0..out_rows); with a
/// residual, `x += residual` first (written back to x).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    residual: Option<&CudaSlice<f32>>,
    residual_sums: Option<Unfolded>,
    w: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    rows: Option<&CudaSlice<i32>>,
    out_rows: usize,
    d: usize,
    eps: f32,
) -> Result<(), CudaError> {
    let w = need(w, d, "rms_norm weight")?;
    let out = need(out, out_rows * d, "rms_norm out")?;
    // With a row index, x is read at the rows it names: their bounds are the caller's.
    let x = match rows {
        None => need(x, out_rows * d, "rms_norm x")?,
        Some(_) => View::whole(x),
    };
    if out_rows == 0 {
        return Ok(());
    }
    let grid = (out_rows as u32, 1, 1);
    let rows = rows.map(View::whole);
    // (The residual's sums: `rms_norm_sums`, kernels/elementwise.cu.)
    match residual_sums {
        None => gpu.launch(
            Kernel::RmsNorm,
            grid,
            256,
            (x, residual.map(View::whole), w, out, rows, d as i32, eps),
        ),
        Some(u) if u.stride < out_rows * d => Err(CudaError::Capacity(format!(
            "rms_norm: residual segment sums of {} elements for {out_rows} rows of {d}",
            u.stride
        ))),
        Some(u) => gpu.launch(
            Kernel::RmsNormSums,
            grid,
            256,
            (
                x,
                DevPtr(u.sums),
                w,
                out,
                rows,
                d as i32,
                eps,
                u.segments as i32,
                u.stride as u64,
            ),
        ),
    }
}

pub fn add_inplace(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    let x = need(x, n, "add x")?;
    let y = need(y, n, "add y")?;
    gpu.launch(
        Kernel::AddInplace,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        (x, y, n as u64),
    )
}

/// Heads a block of [`qk_norm_rope_store`] takes, a warp each (kernels/elementwise.cu
/// `QK_ROPE_WARPS`), and the largest head_dim its shared sines and cosines hold
/// (`2 * QK_ROPE_MAX_HALF`).
const QK_ROPE_WARPS: usize = 8;
const QK_ROPE_MAX_HEAD_DIM: usize = 512;

/// q/k per-head norm (when given), RoPE at `pos`, and K/V stored into `slots` of the cache.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_store(
    gpu: &Gpu,
    q: &mut CudaSlice<f32>,
    k: &mut CudaSlice<f32>,
    v: &CudaSlice<f32>,
    sums: [Option<Unfolded>; 3],
    norms: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
    inv_freq: &CudaSlice<f32>,
    pos: &CudaSlice<i32>,
    slots: &CudaSlice<i32>,
    k_cache: &mut CudaSlice<u16>,
    v_cache: &mut CudaSlice<u16>,
    rows: usize,
    s: AttnShape,
    eps: f32,
) -> Result<(), CudaError> {
    let q = need(q, rows * s.heads * s.head_dim, "rope q")?;
    let k = need(k, rows * s.kv_heads * s.head_dim, "rope k")?;
    let v = need(v, rows * s.kv_heads * s.head_dim, "rope v")?;
    let inv_freq = need(inv_freq, s.head_dim / 2, "rope inv_freq")?;
    let pos = need(pos, rows, "rope positions")?;
    let slots = need(slots, rows, "rope slots")?;
    // The kernel takes one segment count: q, k and v's sums come from one launch.
    let mut counts = sums.iter().flatten().map(|u| u.segments);
    let segments = match counts.next() {
        None => 0,
        Some(first) if counts.all(|c| c == first) => first as i32,
        Some(_) => {
            return Err(CudaError::Unsupported(
                "q, k and v as segment sums of different segment counts".into(),
            ))
        }
    };
    if s.head_dim > QK_ROPE_MAX_HEAD_DIM {
        return Err(CudaError::Unsupported(format!(
            "RoPE with head_dim {} (at most {QK_ROPE_MAX_HEAD_DIM})",
            s.head_dim
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    let grid = (
        rows as u32,
        (s.heads + s.kv_heads).div_ceil(QK_ROPE_WARPS) as u32,
        1,
    );
    let threads = (32 * QK_ROPE_WARPS) as u32;
    let (qn, kn) = (
        norms.map(|n| View::whole(n.0)),
        norms.map(|n| View::whole(n.1)),
    );
    // The slots index the caches: the KV allocator keeps them in bounds.
    let (kc, vc) = (View::whole(k_cache), View::whole(v_cache));
    let (heads, kv_heads, hd) = (s.heads as i32, s.kv_heads as i32, s.head_dim as i32);
    if segments == 0 {
        return gpu.launch(
            Kernel::QkNormRopeStore,
            grid,
            threads,
            (
                q, k, v, qn, kn, inv_freq, pos, slots, kc, vc, heads, kv_heads, hd, eps,
            ),
        );
    }
    let q_sums = sums_ptr(sums[0], rows * s.heads * s.head_dim)?;
    let k_sums = sums_ptr(sums[1], rows * s.kv_heads * s.head_dim)?;
    let v_sums = sums_ptr(sums[2], rows * s.kv_heads * s.head_dim)?;
    gpu.launch(
        Kernel::QkNormRopeStoreSums,
        grid,
        threads,
        (
            q, k, v, qn, kn, inv_freq, pos, slots, kc, vc, heads, kv_heads, hd, eps, q_sums,
            k_sums, v_sums, segments,
        ),
    )
}

/// `h = silu(gate) * up` over `rows` rows of `gu` (`[rows, 2 * inter]`: gate, then up), or with
/// `sums` of the gate/up GEMM's segment sums ([`Unfolded`]).
pub fn silu_mul(
    gpu: &Gpu,
    gu: &CudaSlice<f32>,
    sums: Option<Unfolded>,
    h: &mut CudaSlice<f32>,
    rows: usize,
    inter: usize,
) -> Result<(), CudaError> {
    let gu = match sums {
        Some(u) => sums_ptr(Some(u), rows * 2 * inter)?,
        None => DevPtr(need(gu, rows * 2 * inter, "silu_mul gate_up")?.addr(gpu)),
    };
    let h = need(h, rows * inter, "silu_mul out")?;
    let n = rows * inter;
    if n == 0 {
        return Ok(());
    }
    // Four columns a thread (kernels/elementwise.cu; where inter is not a multiple of 4 the
    // kernel walks the elements grid-stride).
    let grid = (gpu.grid_for(n.div_ceil(4), BLOCK), 1, 1);
    let (rows, inter) = (rows as u64, inter as i32);
    match sums {
        None => gpu.launch(Kernel::SiluMul, grid, BLOCK, (gu, h, rows, inter)),
        Some(u) => gpu.launch(
            Kernel::SiluMulSums,
            grid,
            BLOCK,
            (gu, h, rows, inter, u.segments as i32),
        ),
    }
}

/// One MoE combine, checked and held as device addresses: the expert rows it reads (or the down
/// projection's segment sums, [`Unfolded`]), the plan's slot rows and the routing weights of
/// `tokens` tokens, and where it writes. A backend may keep one to run it inside the norm that
/// reads its output ([`rms_norm_combined`]); those buffers must then hold what they hold now
/// until it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Combine {
    expert_out: DevPtr,
    sums: Option<Unfolded>,
    slot_row: DevPtr,
    weights: DevPtr,
    y: DevPtr,
    tokens: usize,
    top_k: usize,
    hidden: usize,
}

impl Combine {
    /// `y[t] = sum over slots, in slot order, of weight * expert_out[row of (t, slot)]` (or of
    /// the segment sums' folded rows).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        expert_out: &CudaSlice<f32>,
        sums: Option<Unfolded>,
        plan: &MoePlan,
        weights: &CudaSlice<f32>,
        y: &CudaSlice<f32>,
        tokens: usize,
        top_k: usize,
        hidden: usize,
    ) -> Result<Combine, CudaError> {
        let pairs = tokens * top_k;
        let expert_out = match sums {
            Some(u) => sums_ptr(Some(u), pairs * hidden)?,
            None => DevPtr(need(expert_out, pairs * hidden, "combine expert_out")?.addr(gpu)),
        };
        Ok(Combine {
            expert_out,
            sums,
            slot_row: DevPtr(need(&plan.slot_row, pairs, "combine slot_row")?.addr(gpu)),
            weights: DevPtr(need(weights, pairs, "combine weights")?.addr(gpu)),
            y: DevPtr(need(y, tokens * hidden, "combine out")?.addr(gpu)),
            tokens,
            top_k,
            hidden,
        })
    }

    /// Whether `buf`, read as `rows` rows of `width`, is the combine's output.
    pub fn writes(&self, gpu: &Gpu, buf: &CudaSlice<f32>, rows: usize, width: usize) -> bool {
        (rows, width) == (self.tokens, self.hidden) && addr(gpu, buf) == self.y.0
    }
}

/// Runs the combine `c`, writing its output.
pub fn moe_combine(gpu: &Gpu, c: &Combine) -> Result<(), CudaError> {
    if c.tokens == 0 {
        return Ok(());
    }
    // A block per token and 1,024 columns (256 threads of four): at one token (decode) the
    // columns' loads are all in flight at once instead of rounds of one block.
    let grid = (c.tokens as u32, c.hidden.div_ceil(1024) as u32, 1);
    let (top_k, hidden) = (c.top_k as i32, c.hidden as i32);
    let args = (c.expert_out, c.slot_row, c.weights, c.y, top_k, hidden);
    match c.sums {
        None => gpu.launch(Kernel::MoeCombine, grid, 256, args),
        Some(u) => gpu.launch(
            Kernel::MoeCombineSums,
            grid,
            256,
            (
                args.0,
                args.1,
                args.2,
                args.3,
                top_k,
                hidden,
                u.segments as i32,
            ),
        ),
    }
}

/// [`rms_norm`] of every row with the residual `y` the MoE combine `c` writes: `x[t] += y[t]`,
/// `out[t] = rms_norm(x[t]) * w`, in one launch that does not write y. x and out are the bits of
/// [`moe_combine`] then [`rms_norm`] (kernels/elementwise.cu `rms_norm_combine`).
pub fn rms_norm_combined(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    c: &Combine,
    w: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    eps: f32,
) -> Result<(), CudaError> {
    let (rows, d) = (c.tokens, c.hidden);
    let w = need(w, d, "rms_norm weight")?;
    let out = need(out, rows * d, "rms_norm out")?;
    let x = need(x, rows * d, "rms_norm x")?;
    if rows == 0 {
        return Ok(());
    }
    let grid = (rows as u32, 1, 1);
    let (top_k, d) = (c.top_k as i32, d as i32);
    let args = (
        x,
        c.expert_out,
        c.slot_row,
        c.weights,
        w,
        out,
        top_k,
        d,
        eps,
    );
    match c.sums {
        None => gpu.launch(Kernel::RmsNormCombine, grid, 256, args),
        Some(u) => gpu.launch(
            Kernel::RmsNormCombineSums,
            grid,
            256,
            (
                args.0,
                args.1,
                args.2,
                args.3,
                args.4,
                args.5,
                top_k,
                d,
                eps,
                u.segments as i32,
            ),
        ),
    }
}

/// A device-to-device copy of `bytes` bytes from `src` to `dst` (raw addresses of this
/// context), for [`copy_ranges`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRange {
    pub dst: u64,
    pub src: u64,
    pub bytes: u64,
}

/// Blocks per range of a [`copy_ranges`] launch at most: 256 threads of 16 bytes, 4 rounds
/// each, cover 4 MiB a round of the grid.
const COPY_RANGE_BLOCKS: u64 = 1024;

/// Queues every copy of `ranges` (disjoint, device memory that outlives the launch) as one
/// kernel launch per 65,535 ranges, the descriptors uploaded first.
///
/// # Safety
/// Every range must name `bytes` bytes of live device memory at `src` and at `dst`, and no
/// two destinations, nor a destination and a source, may overlap.
pub unsafe fn copy_ranges(gpu: &Gpu, ranges: &[CopyRange]) -> Result<(), CudaError> {
    for chunk in ranges.chunks(u16::MAX as usize) {
        let flat: Vec<u64> = chunk.iter().flat_map(|r| [r.dst, r.src, r.bytes]).collect();
        let most = chunk.iter().map(|r| r.bytes).max().unwrap_or(0);
        let blocks = most.div_ceil(16 * 256 * 4).clamp(1, COPY_RANGE_BLOCKS);
        let table = gpu.upload(&flat)?;
        gpu.launch(
            Kernel::CopyRanges,
            (blocks as u32, chunk.len() as u32, 1),
            256,
            (View::whole(&table), chunk.len() as i32),
        )?;
    }
    Ok(())
}
