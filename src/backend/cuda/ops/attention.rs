//! Launches of kernels/attention.cu: paged attention over the KV cache's block tables (any
//! rows, GQA), and the split-K GQA-aware decode attention with its combine, whose key split is
//! planned here ([`KeySplit::plan`]).

use cudarc::driver::CudaSlice;

use super::need;
use crate::backend::cuda::args::View;
use crate::backend::cuda::kernels::Kernel;
use crate::backend::cuda::{CudaError, Gpu};

/// Shapes of one attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// Where each query row's keys are: its position, its sequence, and the sequences' block tables
/// (flattened, `table_offsets[seq]` = start of that sequence's table).
pub struct AttnRows<'a> {
    pub pos: &'a CudaSlice<i32>,
    pub seq: &'a CudaSlice<i32>,
    pub table_offsets: &'a CudaSlice<i32>,
    pub block_tables: &'a CudaSlice<i32>,
}

// The sequences, block tables and caches are read where the rows' data points: the scheduler's
// batch keeps those in bounds, so the wrappers pass them whole.

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
    let q = need(q, rows * s.heads * s.head_dim, "attention q")?;
    let out = need(out, rows * s.heads * s.head_dim, "attention out")?;
    let pos = need(meta.pos, rows, "attention positions")?;
    if rows == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::PagedAttention,
        (rows as u32, s.heads as u32, 1),
        128,
        (
            q,
            out,
            View::whole(k_cache),
            View::whole(v_cache),
            pos,
            View::whole(meta.seq),
            View::whole(meta.table_offsets),
            View::whole(meta.block_tables),
            s.heads as i32,
            s.kv_heads as i32,
            s.head_dim as i32,
            s.block_size as i32,
            1.0 / (s.head_dim as f32).sqrt(),
        ),
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
    let q = need(q, rows * s.heads * s.head_dim, "decode attention q")?;
    let out = need(out, rows * s.heads * s.head_dim, "decode attention out")?;
    let pos = need(meta.pos, rows, "decode attention positions")?;
    let seq = need(meta.seq, rows, "decode attention sequences")?;
    let (acc, ml) = if split.splits > 1 {
        let partials = rows * s.heads * split.splits;
        (
            need(
                &scratch.acc,
                partials * s.head_dim,
                "decode attention partials",
            )?,
            need(&scratch.ml, partials * 2, "decode attention partial sums")?,
        )
    } else {
        // One split writes `out` directly and leaves the scratch alone.
        (View::whole(&scratch.acc), View::whole(&scratch.ml))
    };
    if rows == 0 {
        return Ok(());
    }
    gpu.launch(
        Kernel::PagedAttentionSplit,
        (rows as u32, split_y_blocks(s) as u32, split.splits as u32),
        128,
        (
            q,
            out,
            acc,
            ml,
            View::whole(k_cache),
            View::whole(v_cache),
            pos,
            seq,
            View::whole(meta.table_offsets),
            View::whole(meta.block_tables),
            s.heads as i32,
            s.kv_heads as i32,
            s.head_dim as i32,
            s.block_size as i32,
            split.chunk as i32,
            1.0 / (s.head_dim as f32).sqrt(),
        ),
    )?;
    if split.splits == 1 {
        return Ok(());
    }
    gpu.launch(
        Kernel::PagedAttentionCombine,
        (rows as u32, s.heads as u32, 1),
        128,
        (
            acc,
            ml,
            out,
            pos,
            s.heads as i32,
            s.head_dim as i32,
            split.chunk as i32,
            split.splits as i32,
        ),
    )
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
