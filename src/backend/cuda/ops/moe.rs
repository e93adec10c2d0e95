//! Launches of kernels/moe.cu: the router (softmax, top-k, optional replay of given experts)
//! and the routing plan that groups (token, slot) pairs by expert into grouped-GEMM tiles.

use cudarc::driver::CudaSlice;

use super::{need, BLOCK, GEMM_TILE_ROWS};
use crate::backend::cuda::args::View;
use crate::backend::cuda::kernels::Kernel;
use crate::backend::cuda::{CudaError, Gpu};

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
    let logits = need(logits, tokens * experts, "route logits")?;
    let ids = need(ids, tokens * top_k, "route ids")?;
    let weights = need(weights, tokens * top_k, "route weights")?;
    let given = given
        .map(|g| need(g, tokens * top_k, "route given ids"))
        .transpose()?;
    if tokens == 0 {
        return Ok(());
    }
    let warps_per_block = 4;
    gpu.launch(
        Kernel::MoeRoute,
        (tokens.div_ceil(warps_per_block) as u32, 1, 1),
        32 * warps_per_block as u32,
        (
            logits,
            tokens as i32,
            experts as i32,
            top_k as i32,
            renormalize as i32,
            given,
            ids,
            weights,
        ),
    )
}

/// Device buffers of a routing plan for `pairs = tokens * top_k` (token, slot) pairs.
pub struct MoePlan {
    pub counts: CudaSlice<i32>,
    pub offsets: CudaSlice<i32>,
    pub cursor: CudaSlice<i32>,
    pub tiles: CudaSlice<i32>,
    pub num_tiles: CudaSlice<i32>,
    pub slot_row: CudaSlice<i32>,
    pub row_token: CudaSlice<i32>,
    /// The tokens and (token, expert) pairs of the last [`MoePlan::build`].
    pub tokens: usize,
    pub pairs: usize,
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
            tokens: 0,
            pairs: 0,
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
        let ids = need(ids, pairs, "plan ids")?;
        (self.tokens, self.pairs) = (tokens, pairs);
        let slot_row = need(&self.slot_row, pairs, "plan slot_row")?;
        need(&self.counts, experts, "plan counts")?;
        gpu.stream.memset_zeros(&mut self.counts)?;
        // Sized by `new` for `experts` and the most pairs: offsets, cursor and the tiles are
        // indexed by expert ids and tile counts, row_token by the rows the cursor hands out.
        let counts = View::whole(&self.counts);
        let cursor = View::whole(&self.cursor);
        if pairs > 0 {
            gpu.launch(
                Kernel::MoeCount,
                (gpu.grid_for(pairs, BLOCK), 1, 1),
                BLOCK,
                (ids, pairs as i32, counts),
            )?;
        }
        gpu.launch(
            Kernel::MoePlan,
            (1, 1, 1),
            1,
            (
                counts,
                experts as i32,
                GEMM_TILE_ROWS as i32,
                View::whole(&self.offsets),
                cursor,
                View::whole(&self.tiles),
                View::whole(&self.num_tiles),
            ),
        )?;
        if pairs > 0 {
            gpu.launch(
                Kernel::MoeScatter,
                (gpu.grid_for(pairs, BLOCK), 1, 1),
                BLOCK,
                (
                    ids,
                    pairs as i32,
                    top_k as i32,
                    cursor,
                    slot_row,
                    View::whole(&self.row_token),
                ),
            )?;
        }
        Ok(())
    }
}
