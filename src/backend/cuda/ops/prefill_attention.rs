//! Launches of kernels/prefill_attention.cu: flash-style attention on BF16 tensor cores, for
//! query rows in tiles of consecutive positions of one sequence (prefill chunks, with the tile
//! list the kernel walks, [`prefill_tiles`]) and for single decode rows (the query heads of one
//! KV head in one block), those split over their keys when the batch is small
//! ([`DecodeSplit`]). All give a row the same bits: keys are summed in chunks of
//! [`ATTENTION_CHUNK_KEYS`] merged in order, whoever computes them.

use cudarc::driver::CudaSlice;

use super::{need, AttnRows, AttnShape};
use crate::backend::cuda::args::{addr, KernelArg, View};
use crate::backend::cuda::kernels::{Kernel, PREFILL_ATTENTION_TMA_THREADS};
use crate::backend::cuda::{CudaError, Gpu};

/// Query rows per block of [`prefill_attention`] (kernels/prefill_attention.cu `FA_ROWS`).
pub const PREFILL_TILE_ROWS: usize = 64;

/// Threads per block of [`decode_attention`] (kernels/prefill_attention.cu `DECODE_WARPS`).
const DECODE_THREADS: u32 = 128;
/// Blocks an SM of `decode_attention_g8_hd128_3` (its launch bounds).
const THREE_BLOCKS_PER_SM: usize = 3;
/// Keys per chunk of the attention's merge order (kernels/prefill_attention.cu `FA_CHUNK`).
pub const ATTENTION_CHUNK_KEYS: usize = 128;
/// Decode launches split over their keys where two splits of every (row, KV head) stay within
/// this many blocks (at most 132 unsplit: one wave of an H200's SMs); see [`split_count`].
const SPLIT_BELOW_BLOCKS: usize = 264;
/// The most blocks one (row, KV head) splits into: one row of 32,768 keys then walks 4 chunks a
/// block over 256 blocks.
const MAX_SPLITS: usize = 64;
/// The most blocks a split launch has: eight an SM of an H200. A block takes the chunks z, z +
/// splits, ... of its row, so at short contexts the blocks past a row's chunks return at once,
/// and at long ones every block has a few chunks to walk.
const SPLIT_GRID_BLOCKS: usize = 1056;
/// The largest split-KV scratch a backend takes: 1 GiB of f32 chunk states (Qwen3-30B-A3B at
/// 40,960 keys needs 176 MB for the 33 rows that split; FlashInfer's workspace under SGLang is
/// of the same order).
const SPLIT_MAX_FLOATS: usize = 1 << 28;

/// Split-KV's device scratch: room for the chunk states (unnormalized output, max, sum) of
/// every (row, head) of up to `max_rows` decode rows of up to `max_chunks` chunks each. Sized
/// once, so a recorded step's launches keep their addresses.
pub struct DecodeSplit {
    part: CudaSlice<f32>,
    max_rows: usize,
    max_chunks: usize,
}

impl DecodeSplit {
    /// Scratch for contexts of up to `max_context` keys and at most `max_rows` rows, within
    /// [`SPLIT_MAX_FLOATS`]; `None` when not one row fits.
    pub fn new(
        gpu: &Gpu,
        s: AttnShape,
        max_context: usize,
        max_rows: usize,
    ) -> Result<Option<DecodeSplit>, CudaError> {
        let (max_chunks, per_row) = chunk_states(s, max_context);
        let max_rows = split_rows(s, max_context, max_rows);
        if max_rows == 0 {
            return Ok(None);
        }
        Ok(Some(DecodeSplit {
            part: gpu.alloc(max_rows * per_row)?,
            max_rows,
            max_chunks,
        }))
    }

    /// Blocks per (row, KV head) [`decode_attention`] takes for `count` rows (1: no split).
    pub fn splits(&self, count: usize, s: AttnShape) -> usize {
        if count > self.max_rows {
            return 1;
        }
        split_count(count, s)
    }
}

/// Blocks per (row, KV head) for a decode launch of `count` rows. A launch splits where two
/// splits fit in [`SPLIT_BELOW_BLOCKS`] (a launch of 256 blocks split in two measured 9% slower
/// than unsplit, 64 rows x 512 keys, H200, 2026-12-02), and then as far as
/// [`SPLIT_GRID_BLOCKS`] allows: the count is fixed per row count (a recorded step keeps its
/// grid), and the contexts it meets run from a few chunks to hundreds.
fn split_count(count: usize, s: AttnShape) -> usize {
    if count > splitting_rows(s) {
        return 1;
    }
    (SPLIT_GRID_BLOCKS / (count * blocks_per_row(s)).max(1)).min(MAX_SPLITS)
}

/// The most rows a decode launch splits at: two splits of each of their blocks within
/// [`SPLIT_BELOW_BLOCKS`].
fn splitting_rows(s: AttnShape) -> usize {
    SPLIT_BELOW_BLOCKS / 2 / blocks_per_row(s)
}

/// Unsplit blocks of [`decode_attention`] per row: one per KV head and 16 of its query heads.
fn blocks_per_row(s: AttnShape) -> usize {
    s.kv_heads.max(1) * (s.heads / s.kv_heads.max(1)).div_ceil(16)
}

/// The chunks of a row of up to `max_context` keys, and the floats of their states (unnormalized
/// output, max, sum) over every head.
fn chunk_states(s: AttnShape, max_context: usize) -> (usize, usize) {
    let max_chunks = max_context.div_ceil(ATTENTION_CHUNK_KEYS).max(1);
    (max_chunks, s.heads * max_chunks * (s.head_dim + 2))
}

/// The rows [`DecodeSplit`] keeps chunk states for: every row count whose launch splits
/// ([`split_count`]), at most `max_rows`, within [`SPLIT_MAX_FLOATS`] at `max_context` keys.
/// Sized by the row counts that split, not by the context alone: a 40,960-key server once kept
/// room for 12 rows, so 16 long sequences ran 64 blocks on 132 SMs.
fn split_rows(s: AttnShape, max_context: usize, max_rows: usize) -> usize {
    let (_, per_row) = chunk_states(s, max_context);
    max_rows
        .min(splitting_rows(s))
        .min(SPLIT_MAX_FLOATS / per_row.max(1))
}

/// Whether [`prefill_attention`] and [`decode_attention`] have a kernel for this shape: head_dim
/// 32, 64 or 128, whole GQA groups and a power-of-two block size (the kernels find a key's
/// block by shifts).
pub fn prefill_attention_supports(s: AttnShape) -> bool {
    matches!(s.head_dim, 32 | 64 | 128)
        && s.kv_heads > 0
        && s.heads.is_multiple_of(s.kv_heads)
        && s.block_size.is_power_of_two()
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

/// How a step's rows split between the two tensor-core kernels, for sequences of
/// `rows_per_seq` consecutive rows each (batch order): the [`prefill_tiles`] of every sequence
/// of several rows, and the rows of single-row sequences (for [`decode_attention`]). A row
/// gets the same bits from either kernel; this split is for speed.
pub fn attention_split(rows_per_seq: impl IntoIterator<Item = usize>) -> (Vec<i32>, Vec<i32>) {
    let (mut tiles, mut decode_rows) = (Vec::new(), Vec::new());
    let mut first = 0;
    for rows in rows_per_seq {
        if rows == 1 {
            decode_rows.push(first as i32);
        } else {
            for t in prefill_tiles([rows]).chunks(2) {
                tiles.extend([first as i32 + t[0], t[1]]);
            }
        }
        first += rows;
    }
    (tiles, decode_rows)
}

/// What a block of [`prefill_attention`] takes. A row has the same bits in each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillBlocks {
    /// One query head (every shape).
    OneHead,
    /// Two query heads of one KV head sharing their K and V tiles and copies
    /// (`prefill_attention_pairs_hd128`).
    TwoHeads,
    /// Two query heads with their K and V tiles copied by a producer warp through the TMA unit
    /// (`prefill_attention_tma_hd128`).
    TwoHeadsTma,
}

impl PrefillBlocks {
    /// Every kind, for the tests and benchmarks that run each.
    pub const ALL: [PrefillBlocks; 3] = [
        PrefillBlocks::OneHead,
        PrefillBlocks::TwoHeads,
        PrefillBlocks::TwoHeadsTma,
    ];

    /// Whether a launch of this shape on `gpu` can take these blocks: two heads need Hopper's
    /// wgmma walk at head_dim 128 and an even number of query heads a KV head; the TMA copies
    /// also pages of at least 16 tokens (a box a page and column group).
    pub fn possible(self, gpu: &Gpu, s: AttnShape) -> bool {
        self.possible_on(gpu.arch, s)
    }

    /// [`PrefillBlocks::possible`] on a GPU of `arch` (`kernels::arch_for`).
    fn possible_on(self, arch: &str, s: AttnShape) -> bool {
        let two_heads = arch == "sm_90a"
            && s.head_dim == 128
            && s.kv_heads > 0
            && s.heads.is_multiple_of(s.kv_heads)
            && (s.heads / s.kv_heads).is_multiple_of(2);
        match self {
            PrefillBlocks::OneHead => true,
            PrefillBlocks::TwoHeads => two_heads,
            // A 64-key tile in at most four pages (the kernel's page rows), found by shifts.
            PrefillBlocks::TwoHeadsTma => {
                two_heads && s.block_size >= 16 && s.block_size.is_power_of_two()
            }
        }
    }

    /// The blocks [`prefill_attention`] takes: one head a block unless `LOCKSTEP_FA_PAIRS=1`
    /// (two heads where possible) or `LOCKSTEP_FA_TMA=1` (two heads, copied by the TMA unit).
    /// Both are opt-in: on an H100 (2026-12-05) two heads a block took 8% longer than one, and
    /// the TMA copies no less time than the threads' copies (docs/performance.md).
    pub fn chosen(gpu: &Gpu, s: AttnShape) -> PrefillBlocks {
        static PAIRS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        static TMA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if PrefillBlocks::TwoHeadsTma.possible(gpu, s)
            && super::gemm::opted_in(&TMA, "LOCKSTEP_FA_TMA")
        {
            PrefillBlocks::TwoHeadsTma
        } else if PrefillBlocks::TwoHeads.possible(gpu, s)
            && super::gemm::opted_in(&PAIRS, "LOCKSTEP_FA_PAIRS")
        {
            PrefillBlocks::TwoHeads
        } else {
            PrefillBlocks::OneHead
        }
    }
}

/// Attention for query rows grouped in tiles of consecutive positions of one sequence, on
/// tensor cores (kernels/prefill_attention.cu), in `blocks` (where [`PrefillBlocks::possible`];
/// the engine takes [`PrefillBlocks::chosen`]). `tiles` from [`prefill_tiles`]. A row has the
/// same bits in every kind of block; the tests and the kernel benchmark run them all.
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
    blocks: PrefillBlocks,
) -> Result<(), CudaError> {
    if !blocks.possible(gpu, s) {
        return Err(CudaError::Unsupported(format!(
            "prefill attention in blocks of {blocks:?} with head_dim {}, {} heads over {}, \
             {}-token pages on {}",
            s.head_dim, s.heads, s.kv_heads, s.block_size, gpu.arch
        )));
    }
    let kernel = kernel_for(
        s,
        [
            Kernel::PrefillAttentionHd32,
            Kernel::PrefillAttentionHd64,
            Kernel::PrefillAttentionHd128,
        ],
    )?;
    let tiles = need(tiles, 2 * num_tiles, "attention tiles")?;
    if num_tiles == 0 {
        return Ok(());
    }
    let (kernel, heads_a_block, threads) = match blocks {
        PrefillBlocks::OneHead => (kernel, 1, 128),
        PrefillBlocks::TwoHeads => (Kernel::PrefillAttentionPairsHd128, 2, 256),
        PrefillBlocks::TwoHeadsTma => {
            return prefill_attention_tma(
                gpu, q, out, k_cache, v_cache, meta, tiles, num_tiles, rows, s,
            )
        }
    };
    let grid = (num_tiles as u32, (s.heads / heads_a_block) as u32, 1);
    launch(
        gpu,
        kernel,
        grid,
        threads,
        q,
        out,
        k_cache,
        v_cache,
        meta,
        rows,
        s,
        tiles,
        (None, 0),
    )
}

/// `prefill_attention_tma_hd128`: tensor maps over the K and V caches (rows of every KV head's
/// head_dim BF16, boxes of 32 columns by a page of at most 64 rows, the 64-byte swizzle the
/// kernel's descriptors read), then the launch as the two-head kernel's grid.
#[allow(clippy::too_many_arguments)]
fn prefill_attention_tma(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    k_cache: &CudaSlice<u16>,
    v_cache: &CudaSlice<u16>,
    meta: &AttnRows<'_>,
    tiles: View<'_, i32>,
    num_tiles: usize,
    rows: usize,
    s: AttnShape,
) -> Result<(), CudaError> {
    let row_elems = s.kv_heads * s.head_dim;
    let box_rows = s.block_size.min(PREFILL_TILE_ROWS) as u32;
    let map = |cache: &CudaSlice<u16>| {
        super::gemm::tensor_map_boxes(
            addr(gpu, cache),
            2 * row_elems,
            cache.len() / row_elems,
            64,
            box_rows,
        )
    };
    let (k_map, v_map) = (map(k_cache)?, map(v_cache)?);
    let (q, out, pos) = super::attention::row_views(q, out, meta, rows, s)?;
    gpu.launch(
        Kernel::PrefillAttentionTmaHd128,
        (num_tiles as u32, (s.heads / 2) as u32, 1),
        PREFILL_ATTENTION_TMA_THREADS,
        (
            k_map,
            v_map,
            q,
            out,
            pos,
            View::whole(meta.seq),
            View::whole(meta.table_offsets),
            View::whole(meta.block_tables),
            tiles,
            s.heads as i32,
            s.kv_heads as i32,
            s.block_size as i32,
            q_scale(s),
        ),
    )
}

/// q's scale in log2 units: the kernels' softmax is 2^(s - m) (`fa_exp2`).
fn q_scale(s: AttnShape) -> f32 {
    std::f32::consts::LOG2_E / (s.head_dim as f32).sqrt()
}

/// Attention for single query rows (decode; `rows` lists them, None: rows 0..count), a block
/// of 4 warps per (row, KV head) serving the query heads that share it
/// (kernels/prefill_attention.cu). With `split` and a batch too small to fill the GPU, each
/// (row, KV head) takes several blocks over its key chunks, then `attention_merge` adds them
/// in order: the same bits. Rows must lie within the split's `max_context` keys.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    k_cache: &CudaSlice<u16>,
    v_cache: &CudaSlice<u16>,
    meta: &AttnRows<'_>,
    rows: Option<&CudaSlice<i32>>,
    count: usize,
    step_rows: usize,
    s: AttnShape,
    split: Option<&DecodeSplit>,
) -> Result<(), CudaError> {
    let kernels = [
        (Kernel::DecodeAttentionHd32, Kernel::AttentionMergeHd32),
        (Kernel::DecodeAttentionHd64, Kernel::AttentionMergeHd64),
        (Kernel::DecodeAttentionHd128, Kernel::AttentionMergeHd128),
    ];
    // At most 8 query heads a KV head (Qwen3-30B-A3B's 32 over 4): the kernel that leaves out
    // the tile's other 8 rows, the same bits in fewer registers.
    let kernel = if s.kv_heads > 0 && s.heads / s.kv_heads <= 8 {
        let narrow = [
            Kernel::DecodeAttentionG8Hd32,
            Kernel::DecodeAttentionG8Hd64,
            Kernel::DecodeAttentionG8Hd128,
        ];
        kernel_for(s, narrow)?
    } else {
        kernel_for(s, kernels.map(|k| k.0))?
    };
    let merge = kernel_for(s, kernels.map(|k| k.1))?;
    let rows = rows.map(|r| need(r, count, "decode rows")).transpose()?;
    if count == 0 {
        return Ok(());
    }
    let passes = (s.heads / s.kv_heads).div_ceil(16);
    let split = split
        .map(|p| (p, p.splits(count, s)))
        .filter(|&(_, n)| n > 1);
    let (part, max_chunks, splits) = match split {
        Some((p, n)) => (Some(View::whole(&p.part)), p.max_chunks, n),
        None => (None, 0, 1),
    };
    let grid = (count as u32, (s.kv_heads * passes) as u32, splits as u32);
    // Head dim 128 at three blocks an SM where the grid fits in one wave of them (no register
    // spill; a grid of more waves runs faster at four, kernels/prefill_attention.cu).
    let blocks = grid.0 as usize * grid.1 as usize * grid.2 as usize;
    let kernel = if kernel == Kernel::DecodeAttentionG8Hd128
        && blocks <= THREE_BLOCKS_PER_SM * gpu.sm_count as usize
    {
        Kernel::DecodeAttentionG8Hd128Three
    } else {
        kernel
    };
    launch(
        gpu,
        kernel,
        grid,
        DECODE_THREADS,
        q,
        out,
        k_cache,
        v_cache,
        meta,
        step_rows,
        s,
        rows,
        (part, max_chunks),
    )?;
    let Some(part) = part else {
        return Ok(());
    };
    // launch checked q, out and the positions for step_rows rows.
    gpu.launch(
        merge,
        (count as u32, s.heads as u32, 1),
        s.head_dim as u32,
        (
            part,
            View::whole(out),
            View::whole(meta.pos),
            rows,
            s.heads as i32,
            max_chunks as i32,
        ),
    )
}

/// One launch of either kernel: the arguments they share, `rows` (tiles or decode rows) and
/// the decode split's scratch and chunk count (none and 0 for prefill).
/// The sequences, block tables and caches are read where the rows' data points (see
/// `super::attention`), so they go whole.
#[allow(clippy::too_many_arguments)]
fn launch(
    gpu: &Gpu,
    kernel: Kernel,
    grid: (u32, u32, u32),
    threads: u32,
    q: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    k_cache: &CudaSlice<u16>,
    v_cache: &CudaSlice<u16>,
    meta: &AttnRows<'_>,
    step_rows: usize,
    s: AttnShape,
    rows: impl KernelArg,
    (part, max_chunks): (Option<View<'_, f32>>, usize),
) -> Result<(), CudaError> {
    let (q, out, pos) = super::attention::row_views(q, out, meta, step_rows, s)?;
    gpu.launch(
        kernel,
        grid,
        threads,
        (
            q,
            out,
            View::whole(k_cache),
            View::whole(v_cache),
            pos,
            View::whole(meta.seq),
            View::whole(meta.table_offsets),
            View::whole(meta.block_tables),
            rows,
            s.heads as i32,
            s.kv_heads as i32,
            s.block_size as i32,
            q_scale(s),
            part,
            max_chunks as i32,
        ),
    )
}

/// The kernel of `kernels` (head_dim 32, 64, 128) for this shape.
fn kernel_for(s: AttnShape, kernels: [Kernel; 3]) -> Result<Kernel, CudaError> {
    if s.heads % s.kv_heads != 0 {
        return Err(CudaError::Unsupported(format!(
            "{} heads over {} KV heads",
            s.heads, s.kv_heads
        )));
    }
    match s.head_dim {
        32 => Ok(kernels[0]),
        64 => Ok(kernels[1]),
        128 => Ok(kernels[2]),
        hd => Err(CudaError::Unsupported(format!(
            "tensor-core attention with head_dim {hd} (32, 64 or 128)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-30B-A3B's attention: 32 query heads over 4 KV heads of 128.
    const QWEN3_MOE: AttnShape = AttnShape {
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        block_size: 16,
    };

    #[test]
    fn two_head_blocks_only_where_hopper_runs_them() {
        use PrefillBlocks::*;
        let all = |arch: &str, s: AttnShape| PrefillBlocks::ALL.map(|b| b.possible_on(arch, s));
        // Qwen3-30B-A3B on an H200: every kind.
        assert_eq!(all("sm_90a", QWEN3_MOE), [true, true, true]);
        // Blackwell has no wgmma: one head a block.
        assert_eq!(all("sm_100a", QWEN3_MOE), [true, false, false]);
        // Head_dim 64, or an odd number of query heads a KV head: one head a block.
        let hd64 = AttnShape {
            head_dim: 64,
            ..QWEN3_MOE
        };
        assert_eq!(all("sm_90a", hd64), [true, false, false]);
        let odd = AttnShape {
            heads: 12,
            kv_heads: 4,
            ..QWEN3_MOE
        };
        assert_eq!(all("sm_90a", odd), [true, false, false]);
        // Pages under 16 tokens (SGLang's page size 1, say): no TMA copies (a box a page).
        for block_size in [1, 8] {
            let small = AttnShape {
                block_size,
                ..QWEN3_MOE
            };
            assert!(TwoHeads.possible_on("sm_90a", small));
            assert!(!TwoHeadsTma.possible_on("sm_90a", small));
        }
        assert!(OneHead.possible_on("sm_80", QWEN3_MOE));
    }

    #[test]
    fn every_row_count_that_splits_has_room_at_a_servers_full_context() {
        // A server of 256 sequences at the model's 40,960 keys: launches of up to 33 rows split,
        // so the scratch holds 33 rows (176 MB), not the 12 that a 64 MiB cap once left.
        let rows = split_rows(QWEN3_MOE, 40_960, 256);
        assert_eq!(rows, 33);
        for count in 1..=256 {
            assert_eq!(
                split_count(count, QWEN3_MOE) > 1,
                count <= rows,
                "{count} rows"
            );
        }
        // Fewer sequences than that: room for those only.
        assert_eq!(split_rows(QWEN3_MOE, 40_960, 16), 16);
        // Eight KV heads take 8 blocks a row, so launches of fewer rows split.
        let wide = AttnShape {
            heads: 64,
            kv_heads: 8,
            ..QWEN3_MOE
        };
        assert_eq!(split_rows(wide, 4096, 256), 16);
        assert!(split_count(16, wide) > 1 && split_count(17, wide) == 1);
        // A context whose chunk states for one row pass the cap gets no scratch.
        let huge = SPLIT_MAX_FLOATS / (QWEN3_MOE.heads * (QWEN3_MOE.head_dim + 2)) + 1;
        assert_eq!(split_rows(QWEN3_MOE, huge * ATTENTION_CHUNK_KEYS, 256), 0);
    }

    #[test]
    fn split_launches_stay_within_their_grid_and_split_at_least_as_far_as_before() {
        for count in 1..=33 {
            let (blocks, splits) = (
                count * blocks_per_row(QWEN3_MOE),
                split_count(count, QWEN3_MOE),
            );
            assert!(blocks * splits <= SPLIT_GRID_BLOCKS, "{count} rows");
            assert!((2..=MAX_SPLITS).contains(&splits), "{count} rows");
            // The rule before 2026-12-04: as many splits as kept the grid under two waves.
            assert!(
                splits >= (SPLIT_BELOW_BLOCKS / blocks).min(MAX_SPLITS),
                "{count} rows"
            );
        }
        // One row (four blocks) takes every split there is.
        assert_eq!(split_count(1, QWEN3_MOE), MAX_SPLITS);
    }
}
