//! Typed launch wrappers, one per kernel (and the cuBLAS GEMMs): each checks that its buffers
//! hold what the kernel will touch, then queues the launch on the engine stream. Shapes are
//! row-major, activations f32, like the CPU backend's.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::CudaSlice;

use super::device::{opt_ptr, ptr, Arg, Gpu};
use super::kernels::Kernel;
use super::CudaError;

fn need<T>(buf: &CudaSlice<T>, n: usize, what: &str) -> Result<(), CudaError> {
    if buf.len() < n {
        return Err(CudaError::Capacity(format!(
            "{what}: needs {n} elements, has {}",
            buf.len()
        )));
    }
    Ok(())
}

const BLOCK: u32 = 256;

/// Dummy weights: the counter-based generator of `model::loader` (see `dummy_key`).
pub fn dummy_fill_bf16(
    gpu: &Gpu,
    out: &mut CudaSlice<u16>,
    n: usize,
    key: u64,
    bound: f32,
) -> Result<(), CudaError> {
    need(out, n, "dummy_fill out")?;
    gpu.launch(
        Kernel::DummyFillBf16,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        &[
            ptr(gpu, out),
            Arg::U64(n as u64),
            Arg::U64(key),
            Arg::F32(bound),
        ],
    )
}

pub fn bf16_to_f32(
    gpu: &Gpu,
    x: &CudaSlice<u16>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    need(x, n, "bf16_to_f32 x")?;
    need(out, n, "bf16_to_f32 out")?;
    gpu.launch(
        Kernel::Bf16ToF32,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        &[ptr(gpu, x), ptr(gpu, out), Arg::U64(n as u64)],
    )
}

pub fn f32_to_bf16(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<u16>,
    n: usize,
) -> Result<(), CudaError> {
    need(x, n, "f32_to_bf16 x")?;
    need(out, n, "f32_to_bf16 out")?;
    gpu.launch(
        Kernel::F32ToBf16,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        &[ptr(gpu, x), ptr(gpu, out), Arg::U64(n as u64)],
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
    need(tokens, n, "embedding tokens")?;
    need(out, n * hidden, "embedding out")?;
    let (t, is_bf16) = match table {
        Table::Bf16(t) => (ptr(gpu, t), 1),
        Table::F32(t) => (ptr(gpu, t), 0),
    };
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::Embedding,
        (n as u32, 1, 1),
        128,
        &[
            ptr(gpu, tokens),
            t,
            Arg::I32(is_bf16),
            ptr(gpu, out),
            Arg::I32(hidden as i32),
        ],
    )
}

/// `out[i] = rms_norm(x[rows[i]]) * w` for `out_rows` rows (rows: None = 0..out_rows); with a
/// residual, `x += residual` first (written back to x).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    residual: Option<&CudaSlice<f32>>,
    w: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    rows: Option<&CudaSlice<i32>>,
    out_rows: usize,
    d: usize,
    eps: f32,
) -> Result<(), CudaError> {
    need(w, d, "rms_norm weight")?;
    need(out, out_rows * d, "rms_norm out")?;
    if rows.is_none() {
        need(x, out_rows * d, "rms_norm x")?;
    }
    if out_rows == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::RmsNorm,
        (out_rows as u32, 1, 1),
        256,
        &[
            ptr(gpu, x),
            opt_ptr(gpu, residual),
            ptr(gpu, w),
            ptr(gpu, out),
            opt_ptr(gpu, rows),
            Arg::I32(d as i32),
            Arg::F32(eps),
        ],
    )
}

pub fn add_inplace(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    need(x, n, "add x")?;
    need(y, n, "add y")?;
    gpu.launch(
        Kernel::AddInplace,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        &[ptr(gpu, x), ptr(gpu, y), Arg::U64(n as u64)],
    )
}

/// Shapes of one attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// q/k per-head norm (when given), RoPE at `pos`, and K/V stored into `slots` of the cache.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_store(
    gpu: &Gpu,
    q: &mut CudaSlice<f32>,
    k: &mut CudaSlice<f32>,
    v: &CudaSlice<f32>,
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
    need(q, rows * s.heads * s.head_dim, "rope q")?;
    need(k, rows * s.kv_heads * s.head_dim, "rope k")?;
    need(v, rows * s.kv_heads * s.head_dim, "rope v")?;
    need(inv_freq, s.head_dim / 2, "rope inv_freq")?;
    need(pos, rows, "rope positions")?;
    need(slots, rows, "rope slots")?;
    if rows == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::QkNormRopeStore,
        (rows as u32, (s.heads + s.kv_heads) as u32, 1),
        32,
        &[
            ptr(gpu, q),
            ptr(gpu, k),
            ptr(gpu, v),
            opt_ptr(gpu, norms.map(|n| n.0)),
            opt_ptr(gpu, norms.map(|n| n.1)),
            ptr(gpu, inv_freq),
            ptr(gpu, pos),
            ptr(gpu, slots),
            ptr(gpu, k_cache),
            ptr(gpu, v_cache),
            Arg::I32(s.heads as i32),
            Arg::I32(s.kv_heads as i32),
            Arg::I32(s.head_dim as i32),
            Arg::F32(eps),
        ],
    )
}

/// Where each query row's keys are: its position, its sequence, and the sequences' block tables
/// (flattened, `table_offsets[seq]` = start of that sequence's table).
pub struct AttnRows<'a> {
    pub pos: &'a CudaSlice<i32>,
    pub seq: &'a CudaSlice<i32>,
    pub table_offsets: &'a CudaSlice<i32>,
    pub block_tables: &'a CudaSlice<i32>,
}

#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    k_cache: &CudaSlice<u16>,
    v_cache: &CudaSlice<u16>,
    meta: &AttnRows<'_>,
    rows: usize,
    s: AttnShape,
) -> Result<(), CudaError> {
    if s.head_dim > 256 || s.heads % s.kv_heads != 0 {
        return Err(CudaError::Unsupported(format!(
            "attention with head_dim {} (max 256), {} heads over {} KV heads",
            s.head_dim, s.heads, s.kv_heads
        )));
    }
    need(q, rows * s.heads * s.head_dim, "attention q")?;
    need(out, rows * s.heads * s.head_dim, "attention out")?;
    need(meta.pos, rows, "attention positions")?;
    if rows == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::PagedAttention,
        (rows as u32, s.heads as u32, 1),
        128,
        &[
            ptr(gpu, q),
            ptr(gpu, out),
            ptr(gpu, k_cache),
            ptr(gpu, v_cache),
            ptr(gpu, meta.pos),
            ptr(gpu, meta.seq),
            ptr(gpu, meta.table_offsets),
            ptr(gpu, meta.block_tables),
            Arg::I32(s.heads as i32),
            Arg::I32(s.kv_heads as i32),
            Arg::I32(s.head_dim as i32),
            Arg::I32(s.block_size as i32),
            Arg::F32(1.0 / (s.head_dim as f32).sqrt()),
        ],
    )
}

/// Query rows per block of [`prefill_attention`] (kernels/prefill_attention.cu `FA_ROWS`).
pub const PREFILL_TILE_ROWS: usize = 64;

/// Whether [`prefill_attention`] has a kernel for this shape.
pub fn prefill_attention_supports(s: AttnShape) -> bool {
    matches!(s.head_dim, 32 | 64 | 128) && s.heads % s.kv_heads == 0
}

/// The tiles of [`prefill_attention`] for sequences of `rows_per_seq` consecutive rows each
/// (batch order): `(first row, row count)` pairs, flattened.
pub fn prefill_tiles(rows_per_seq: impl IntoIterator<Item = usize>) -> Vec<i32> {
    let mut tiles = Vec::new();
    let mut first = 0;
    for rows in rows_per_seq {
        for start in (0..rows).step_by(PREFILL_TILE_ROWS) {
            tiles.push((first + start) as i32);
            tiles.push(PREFILL_TILE_ROWS.min(rows - start) as i32);
        }
        first += rows;
    }
    tiles
}

/// Attention for query rows grouped in tiles of consecutive positions of one sequence, on
/// tensor cores (kernels/prefill_attention.cu). `tiles` from [`prefill_tiles`].
#[allow(clippy::too_many_arguments)]
pub fn prefill_attention(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    k_cache: &CudaSlice<u16>,
    v_cache: &CudaSlice<u16>,
    meta: &AttnRows<'_>,
    tiles: &CudaSlice<i32>,
    num_tiles: usize,
    rows: usize,
    s: AttnShape,
) -> Result<(), CudaError> {
    let kernel = match s.head_dim {
        32 => Kernel::PrefillAttentionHd32,
        64 => Kernel::PrefillAttentionHd64,
        128 => Kernel::PrefillAttentionHd128,
        hd => {
            return Err(CudaError::Unsupported(format!(
                "prefill attention with head_dim {hd} (32, 64 or 128)"
            )))
        }
    };
    if s.heads % s.kv_heads != 0 {
        return Err(CudaError::Unsupported(format!(
            "{} heads over {} KV heads",
            s.heads, s.kv_heads
        )));
    }
    need(q, rows * s.heads * s.head_dim, "attention q")?;
    need(out, rows * s.heads * s.head_dim, "attention out")?;
    need(meta.pos, rows, "attention positions")?;
    need(tiles, 2 * num_tiles, "attention tiles")?;
    if num_tiles == 0 {
        return Ok(());
    }
    gpu.launch(
        kernel,
        (num_tiles as u32, s.heads as u32, 1),
        128,
        &[
            ptr(gpu, q),
            ptr(gpu, out),
            ptr(gpu, k_cache),
            ptr(gpu, v_cache),
            ptr(gpu, meta.pos),
            ptr(gpu, meta.seq),
            ptr(gpu, meta.table_offsets),
            ptr(gpu, meta.block_tables),
            ptr(gpu, tiles),
            Arg::I32(s.heads as i32),
            Arg::I32(s.kv_heads as i32),
            Arg::I32(s.block_size as i32),
            Arg::F32(1.0 / (s.head_dim as f32).sqrt()),
        ],
    )
}

/// Query heads one block of the split decode kernel serves (`HEADS_PER_BLOCK` in
/// kernels/attention.cu): GQA groups wider than this take several blocks per KV head.
pub const SPLIT_HEADS_PER_BLOCK: usize = 8;

/// How a split decode-attention launch divides each row's keys: `splits` ranges of `chunk`
/// keys, the last one running to the row's own end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeySplit {
    pub splits: usize,
    pub chunk: usize,
}

impl KeySplit {
    /// No range shorter than this is split off: below it the combine costs more than the
    /// extra parallelism saves. Small: a batch-1 decode step has only a few blocks per KV
    /// head, and each walks its keys one after another (latency-bound).
    pub const MIN_CHUNK: usize = 64;
    pub const MAX_SPLITS: usize = 64;
    /// Blocks per SM the plan aims for, so memory latency is hidden.
    const BLOCKS_PER_SM: usize = 4;

    /// Splits enough to give `sm_count` SMs work when `rows` rows alone cannot, never into
    /// ranges under `MIN_CHUNK` keys, and never beyond `max_partials` scratch slots (one per
    /// row, head and split). `longest`: the most keys any row attends to (its pos + 1).
    pub fn plan(
        rows: usize,
        s: AttnShape,
        longest: usize,
        sm_count: u32,
        max_partials: usize,
    ) -> KeySplit {
        let base = (rows * split_y_blocks(s)).max(1);
        let want = (Self::BLOCKS_PER_SM * sm_count as usize).div_ceil(base);
        let by_len = longest / Self::MIN_CHUNK;
        let by_room = max_partials / (rows * s.heads).max(1);
        let splits = want.min(by_len).min(by_room).clamp(1, Self::MAX_SPLITS);
        KeySplit {
            splits,
            chunk: longest.div_ceil(splits).max(1),
        }
    }
}

/// Blocks per row along grid.y of the split kernel.
fn split_y_blocks(s: AttnShape) -> usize {
    s.kv_heads * (s.heads / s.kv_heads.max(1)).div_ceil(SPLIT_HEADS_PER_BLOCK)
}

/// Partial results of split decode attention: per (row, head, split) the unnormalized
/// output `[head_dim]` and its (max, sum). Sized once at start-up.
pub struct SplitScratch {
    pub acc: CudaSlice<f32>,
    pub ml: CudaSlice<f32>,
    pub partials: usize,
}

impl SplitScratch {
    pub fn new(gpu: &Gpu, partials: usize, head_dim: usize) -> Result<SplitScratch, CudaError> {
        Ok(SplitScratch {
            acc: gpu.alloc(partials * head_dim)?,
            ml: gpu.alloc(partials * 2)?,
            partials,
        })
    }
}

/// The same attention as [`paged_attention`], by the GQA-aware split kernel: for steps with few
/// rows (decode), where one block per (row, head) leaves the GPU idle on long contexts.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    k_cache: &CudaSlice<u16>,
    v_cache: &CudaSlice<u16>,
    meta: &AttnRows<'_>,
    rows: usize,
    s: AttnShape,
    split: KeySplit,
    scratch: &mut SplitScratch,
) -> Result<(), CudaError> {
    if s.head_dim > 256 || s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
        return Err(CudaError::Unsupported(format!(
            "attention with head_dim {} (max 256), {} heads over {} KV heads",
            s.head_dim, s.heads, s.kv_heads
        )));
    }
    if split.splits == 0 || split.chunk == 0 {
        return Err(CudaError::Unsupported(format!("key split {split:?}")));
    }
    need(q, rows * s.heads * s.head_dim, "decode attention q")?;
    need(out, rows * s.heads * s.head_dim, "decode attention out")?;
    need(meta.pos, rows, "decode attention positions")?;
    need(meta.seq, rows, "decode attention sequences")?;
    if split.splits > 1 {
        let partials = rows * s.heads * split.splits;
        need(
            &scratch.acc,
            partials * s.head_dim,
            "decode attention partials",
        )?;
        need(&scratch.ml, partials * 2, "decode attention partial sums")?;
    }
    if rows == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::PagedAttentionSplit,
        (rows as u32, split_y_blocks(s) as u32, split.splits as u32),
        128,
        &[
            ptr(gpu, q),
            ptr(gpu, out),
            ptr(gpu, &scratch.acc),
            ptr(gpu, &scratch.ml),
            ptr(gpu, k_cache),
            ptr(gpu, v_cache),
            ptr(gpu, meta.pos),
            ptr(gpu, meta.seq),
            ptr(gpu, meta.table_offsets),
            ptr(gpu, meta.block_tables),
            Arg::I32(s.heads as i32),
            Arg::I32(s.kv_heads as i32),
            Arg::I32(s.head_dim as i32),
            Arg::I32(s.block_size as i32),
            Arg::I32(split.chunk as i32),
            Arg::F32(1.0 / (s.head_dim as f32).sqrt()),
        ],
    )?;
    if split.splits == 1 {
        return Ok(());
    }
    gpu.launch(
        Kernel::PagedAttentionCombine,
        (rows as u32, s.heads as u32, 1),
        128,
        &[
            ptr(gpu, &scratch.acc),
            ptr(gpu, &scratch.ml),
            ptr(gpu, out),
            ptr(gpu, meta.pos),
            Arg::I32(s.heads as i32),
            Arg::I32(s.head_dim as i32),
            Arg::I32(split.chunk as i32),
            Arg::I32(split.splits as i32),
        ],
    )
}

pub fn silu_mul(
    gpu: &Gpu,
    gu: &CudaSlice<f32>,
    h: &mut CudaSlice<f32>,
    rows: usize,
    inter: usize,
) -> Result<(), CudaError> {
    need(gu, rows * 2 * inter, "silu_mul gate_up")?;
    need(h, rows * inter, "silu_mul out")?;
    let n = rows * inter;
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::SiluMul,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        &[
            ptr(gpu, gu),
            ptr(gpu, h),
            Arg::U64(rows as u64),
            Arg::I32(inter as i32),
        ],
    )
}

/// Router softmax, top-k (ties to the lower id) and optional renormalisation; with `given`
/// (`[tokens, top_k]`), each row whose given ids are all valid takes them instead (replay).
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    gpu: &Gpu,
    logits: &CudaSlice<f32>,
    tokens: usize,
    experts: usize,
    top_k: usize,
    renormalize: bool,
    given: Option<&CudaSlice<i32>>,
    ids: &mut CudaSlice<i32>,
    weights: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    if top_k > 32 || top_k > experts {
        return Err(CudaError::Unsupported(format!(
            "top_k {top_k} of {experts} experts (max 32)"
        )));
    }
    need(logits, tokens * experts, "route logits")?;
    need(ids, tokens * top_k, "route ids")?;
    need(weights, tokens * top_k, "route weights")?;
    if let Some(g) = given {
        need(g, tokens * top_k, "route given ids")?;
    }
    if tokens == 0 {
        return Ok(());
    }
    let warps_per_block = 4;
    gpu.launch(
        Kernel::MoeRoute,
        (tokens.div_ceil(warps_per_block) as u32, 1, 1),
        32 * warps_per_block as u32,
        &[
            ptr(gpu, logits),
            Arg::I32(tokens as i32),
            Arg::I32(experts as i32),
            Arg::I32(top_k as i32),
            Arg::I32(renormalize as i32),
            opt_ptr(gpu, given),
            ptr(gpu, ids),
            ptr(gpu, weights),
        ],
    )
}

/// Rows per tile of the grouped GEMM (kernels/gemm.cu `TM`).
pub const GEMM_TILE_ROWS: usize = 32;
/// Columns per tile (kernels/gemm.cu `TN`, `MMA_TN`).
pub const GEMM_TILE_COLS: usize = 64;
/// Output columns per GEMV block (a warp each).
const GEMV_COLS_PER_BLOCK: usize = 8;

/// Device buffers of a routing plan for `pairs = tokens * top_k` (token, slot) pairs.
pub struct MoePlan {
    pub counts: CudaSlice<i32>,
    pub offsets: CudaSlice<i32>,
    pub cursor: CudaSlice<i32>,
    pub tiles: CudaSlice<i32>,
    pub num_tiles: CudaSlice<i32>,
    pub slot_row: CudaSlice<i32>,
    pub row_token: CudaSlice<i32>,
}

impl MoePlan {
    pub fn new(gpu: &Gpu, max_pairs: usize, experts: usize) -> Result<MoePlan, CudaError> {
        Ok(MoePlan {
            counts: gpu.alloc(experts)?,
            offsets: gpu.alloc(experts + 1)?,
            cursor: gpu.alloc(experts)?,
            tiles: gpu.alloc(2 * Self::max_tiles(max_pairs, experts))?,
            num_tiles: gpu.alloc(1)?,
            slot_row: gpu.alloc(max_pairs)?,
            row_token: gpu.alloc(max_pairs)?,
        })
    }

    /// Tiles can number at most one partial tile per expert plus the full ones.
    pub fn max_tiles(pairs: usize, experts: usize) -> usize {
        pairs / GEMM_TILE_ROWS + experts
    }

    /// Groups the pairs of `ids` by expert: counts, offsets, GEMM tiles, and for every pair
    /// its row (`slot_row`) and for every row its token (`row_token`).
    pub fn build(
        &mut self,
        gpu: &Gpu,
        ids: &CudaSlice<i32>,
        tokens: usize,
        top_k: usize,
        experts: usize,
    ) -> Result<(), CudaError> {
        let pairs = tokens * top_k;
        need(ids, pairs, "plan ids")?;
        need(&self.slot_row, pairs, "plan slot_row")?;
        need(&self.counts, experts, "plan counts")?;
        gpu.stream.memset_zeros(&mut self.counts)?;
        if pairs > 0 {
            gpu.launch(
                Kernel::MoeCount,
                (gpu.grid_for(pairs, BLOCK), 1, 1),
                BLOCK,
                &[
                    ptr(gpu, ids),
                    Arg::I32(pairs as i32),
                    ptr(gpu, &self.counts),
                ],
            )?;
        }
        gpu.launch(
            Kernel::MoePlan,
            (1, 1, 1),
            1,
            &[
                ptr(gpu, &self.counts),
                Arg::I32(experts as i32),
                Arg::I32(GEMM_TILE_ROWS as i32),
                ptr(gpu, &self.offsets),
                ptr(gpu, &self.cursor),
                ptr(gpu, &self.tiles),
                ptr(gpu, &self.num_tiles),
            ],
        )?;
        if pairs > 0 {
            gpu.launch(
                Kernel::MoeScatter,
                (gpu.grid_for(pairs, BLOCK), 1, 1),
                BLOCK,
                &[
                    ptr(gpu, ids),
                    Arg::I32(pairs as i32),
                    Arg::I32(top_k as i32),
                    ptr(gpu, &self.cursor),
                    ptr(gpu, &self.slot_row),
                    ptr(gpu, &self.row_token),
                ],
            )?;
        }
        Ok(())
    }
}

pub fn moe_combine(
    gpu: &Gpu,
    expert_out: &CudaSlice<f32>,
    plan: &MoePlan,
    weights: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    tokens: usize,
    top_k: usize,
    hidden: usize,
) -> Result<(), CudaError> {
    need(expert_out, tokens * top_k * hidden, "combine expert_out")?;
    need(y, tokens * hidden, "combine out")?;
    if tokens == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::MoeCombine,
        (tokens as u32, 1, 1),
        256,
        &[
            ptr(gpu, expert_out),
            ptr(gpu, &plan.slot_row),
            ptr(gpu, weights),
            ptr(gpu, y),
            Arg::I32(top_k as i32),
            Arg::I32(hidden as i32),
        ],
    )
}

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
    check_block(n, 32)?;
    need(x, n, "mxfp8 x")?;
    need(data, n, "mxfp8 data")?;
    need(scales, n / 32, "mxfp8 scales")?;
    let blocks = n / 32;
    if blocks == 0 {
        return Ok(());
    }
    let deq = deq.map(|d| ptr(gpu, d)).unwrap_or(Arg::Ptr(0));
    gpu.launch(
        T::MXFP8,
        (gpu.grid_for(blocks, 128), 1, 1),
        128,
        &[
            ptr(gpu, x),
            Arg::U64(blocks as u64),
            ptr(gpu, data),
            ptr(gpu, scales),
            deq,
        ],
    )
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
}

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
    check_block(cols, 16)?;
    need(x, rows * cols, "nvfp4 x")?;
    need(out.data, rows * cols / 2, "nvfp4 data")?;
    need(out.scales, rows * cols / 16, "nvfp4 scales")?;
    need(out.row_s_dec, rows, "nvfp4 row scales")?;
    if !per_token && tensor_amax.is_none() {
        return Err(CudaError::Capacity(
            "per-tensor NVFP4 needs the tensor amax".into(),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    let deq = out.deq.map(|d| ptr(gpu, d)).unwrap_or(Arg::Ptr(0));
    gpu.launch(
        Kernel::Nvfp4QuantizeF32,
        (rows as u32, 1, 1),
        128,
        &[
            ptr(gpu, x),
            Arg::I32(cols as i32),
            Arg::I32(per_token as i32),
            opt_ptr(gpu, tensor_amax),
            Arg::F32(p.range),
            Arg::F32(p.fos_range),
            Arg::I32(p.fos_squared as i32),
            ptr(gpu, out.data),
            ptr(gpu, out.scales),
            ptr(gpu, out.row_s_dec),
            deq,
        ],
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
    need(x, rows * cols, "nvfp4 x")?;
    need(data, rows * cols / 2, "nvfp4 data")?;
    need(scales, rows * cols / 16, "nvfp4 scales")?;
    if rows == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::Nvfp4QuantizeBf16,
        (rows as u32, 1, 1),
        128,
        &[
            ptr(gpu, x),
            Arg::I32(cols as i32),
            Arg::F32(amax),
            Arg::F32(p.range),
            Arg::F32(p.fos_range),
            Arg::I32(p.fos_squared as i32),
            ptr(gpu, data),
            ptr(gpu, scales),
        ],
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
    need(q, n, "fp8 dequantize q")?;
    need(
        scale_inv,
        rows.div_ceil(bn) * cols.div_ceil(bk),
        "fp8 dequantize scale_inv",
    )?;
    need(out, n, "fp8 dequantize out")?;
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::Fp8BlockDequantize,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        &[
            ptr(gpu, q),
            ptr(gpu, scale_inv),
            Arg::U64(rows as u64),
            Arg::U64(cols as u64),
            Arg::U64(bn as u64),
            Arg::U64(bk as u64),
            ptr(gpu, out),
        ],
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
    need(x, n, "amax x")?;
    need(out, 2, "amax out")?;
    gpu.stream.memset_zeros(out)?;
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        T::AMAX,
        (gpu.grid_for(n, BLOCK), 1, 1),
        BLOCK,
        &[ptr(gpu, x), Arg::U64(n as u64), ptr(gpu, out)],
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
    need(out, max_rows * n, "gemm out")?;
    let path = path.resolve(w, &rows, max_rows, k);
    let pick = |ffma, mma, gemv| match path {
        GemmPath::Gemv => gemv,
        GemmPath::TensorCore => mma,
        _ => ffma,
    };
    let (kernel, wp, sp, dp, groups) = match w {
        WeightData::F32(d) => (
            pick(
                Kernel::GroupedGemmF32,
                Kernel::GroupedGemmF32,
                Kernel::GroupedGemvF32,
            ),
            ptr(gpu, d),
            Arg::Ptr(0),
            Arg::Ptr(0),
            1,
        ),
        WeightData::Bf16(d) => (
            pick(
                Kernel::GroupedGemmBf16,
                Kernel::GroupedGemmMmaBf16,
                Kernel::GroupedGemvBf16,
            ),
            ptr(gpu, d),
            Arg::Ptr(0),
            Arg::Ptr(0),
            1,
        ),
        WeightData::Mxfp8 { data, scales } => (
            pick(
                Kernel::GroupedGemmMxfp8,
                Kernel::GroupedGemmMmaMxfp8,
                Kernel::GroupedGemvMxfp8,
            ),
            ptr(gpu, data),
            ptr(gpu, scales),
            Arg::Ptr(0),
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
                ptr(gpu, data),
                ptr(gpu, scales),
                ptr(gpu, s_dec),
                *groups,
            )
        }
    };
    let (tiles, num_tiles, offsets, rows_arg, grid_y) = match rows {
        GemmRows::Dense(r) => (
            Arg::Ptr(0),
            Arg::Ptr(0),
            Arg::Ptr(0),
            r,
            r.div_ceil(GEMM_TILE_ROWS),
        ),
        GemmRows::Plan(p) => (
            ptr(gpu, &p.tiles),
            ptr(gpu, &p.num_tiles),
            ptr(gpu, &p.offsets),
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
    gpu.launch(
        kernel,
        (n.div_ceil(cols_per_block) as u32, grid_y as u32, 1),
        threads,
        &[
            ptr(gpu, x),
            opt_ptr(gpu, row_index),
            opt_ptr(gpu, row_scale),
            wp,
            sp,
            dp,
            Arg::I32(groups as i32),
            tiles,
            num_tiles,
            offsets,
            Arg::I32(rows_arg as i32),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            ptr(gpu, out),
        ],
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
    need(out, m * n, "cublas out")?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (xp, xt) = x.raw(gpu, m * k)?;
    let (wp, wt) = w.raw(gpu, n * k)?;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let Arg::Ptr(op) = ptr(gpu, out) else {
        unreachable!()
    };
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
        let (arg, t) = match self {
            CublasOperand::Bf16(s) => {
                need(s, n, "cublas operand")?;
                (ptr(gpu, s), cudaDataType::CUDA_R_16BF)
            }
            CublasOperand::F32(s) => {
                need(s, n, "cublas operand")?;
                (ptr(gpu, s), cudaDataType::CUDA_R_32F)
            }
        };
        let Arg::Ptr(p) = arg else { unreachable!() };
        Ok((p, t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3_30B: AttnShape = AttnShape {
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        block_size: 16,
    };

    #[test]
    fn key_split_covers_every_key_within_the_scratch() {
        for rows in [1, 2, 7, 64, 256] {
            for longest in [1, 5, 255, 256, 257, 1000, 4096, 32768, 131072] {
                for max_partials in [0, 32, 64 * 32 * 16, 1 << 20] {
                    let p = KeySplit::plan(rows, QWEN3_30B, longest, 132, max_partials);
                    assert!(p.splits >= 1 && p.splits <= KeySplit::MAX_SPLITS, "{p:?}");
                    assert!(
                        p.splits * p.chunk >= longest,
                        "{p:?} drops keys of {longest}"
                    );
                    // Every split starts before the longest row ends, so none is empty for it.
                    assert!((p.splits - 1) * p.chunk < longest, "{p:?} for {longest}");
                    if p.splits > 1 {
                        assert!(rows * QWEN3_30B.heads * p.splits <= max_partials, "{p:?}");
                        assert!(p.chunk >= KeySplit::MIN_CHUNK, "{p:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn key_split_splits_long_contexts_of_few_rows_only() {
        let room = 64 * 32 * 16;
        // One row of 4 KV-head blocks: ranges of MIN_CHUNK (64) keys.
        assert_eq!(KeySplit::plan(1, QWEN3_30B, 600, 132, room).splits, 9);
        assert_eq!(KeySplit::plan(1, QWEN3_30B, 100, 132, room).splits, 1);
        let one_row = KeySplit::plan(1, QWEN3_30B, 32768, 132, room);
        assert_eq!(one_row.splits, KeySplit::MAX_SPLITS);
        // 64 rows x 4 KV heads already give 256 blocks; 528 wanted: 3 splits.
        assert_eq!(KeySplit::plan(64, QWEN3_30B, 32768, 132, room).splits, 3);
        assert_eq!(KeySplit::plan(256, QWEN3_30B, 32768, 132, room).splits, 1);
    }
}
