//! Launches of kernels/attention.cu: paged attention on CUDA cores over the KV cache's block
//! tables (any rows, GQA, head_dim up to 256), for the shapes the tensor-core kernels of
//! kernels/prefill_attention.cu do not cover.

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

/// q, out and the positions of a launch over `rows` query rows, each checked against its
/// buffer's length.
pub(super) fn row_views<'a>(
    q: &'a CudaSlice<f32>,
    out: &'a CudaSlice<f32>,
    meta: &AttnRows<'a>,
    rows: usize,
    s: AttnShape,
) -> Result<(View<'a, f32>, View<'a, f32>, View<'a, i32>), CudaError> {
    Ok((
        need(q, rows * s.heads * s.head_dim, "attention q")?,
        need(out, rows * s.heads * s.head_dim, "attention out")?,
        need(meta.pos, rows, "attention positions")?,
    ))
}

// The sequences, block tables and caches are read where the rows' data points: the scheduler's
// batch keeps those in bounds, so the wrappers pass them whole.

/// Attention of every query row (one block per row and head).
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
    let (q, out, pos) = row_views(q, out, meta, rows, s)?;
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
