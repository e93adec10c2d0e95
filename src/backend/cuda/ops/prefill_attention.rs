//! Launches of kernels/prefill_attention.cu: flash-style attention on BF16 tensor cores for
//! query rows in tiles of consecutive positions of one sequence (prefill chunks), and the tile
//! list the kernel walks ([`prefill_tiles`]).

use cudarc::driver::CudaSlice;

use super::{need, AttnRows, AttnShape};
use crate::backend::cuda::args::View;
use crate::backend::cuda::kernels::Kernel;
use crate::backend::cuda::{CudaError, Gpu};

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
    let q = need(q, rows * s.heads * s.head_dim, "attention q")?;
    let out = need(out, rows * s.heads * s.head_dim, "attention out")?;
    let pos = need(meta.pos, rows, "attention positions")?;
    let tiles = need(tiles, 2 * num_tiles, "attention tiles")?;
    if num_tiles == 0 {
        return Ok(());
    }
    // The sequences, block tables and caches are read where the rows' data points (see
    // `super::attention`), so they go whole.
    gpu.launch(
        kernel,
        (num_tiles as u32, s.heads as u32, 1),
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
            tiles,
            s.heads as i32,
            s.kv_heads as i32,
            s.block_size as i32,
            1.0 / (s.head_dim as f32).sqrt(),
        ),
    )
}
