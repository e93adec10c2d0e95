//! Launches of kernels/moe.cu: the router (softmax, top-k, optional replay of given experts)
//! and the routing plan that groups (token, slot) pairs by expert into grouped-GEMM tiles.

use cudarc::driver::CudaSlice;

use super::{
    need, sums_ptr, sums_segments, Unfolded, BLOCK, GEMM_TILE_ROWS, GEMM_WIDE_TILE_ROWS,
    PAIR_TILE_ROWS,
};
use crate::backend::cuda::args::{addr, DevPtr, View};
use crate::backend::cuda::kernels::Kernel;
use crate::backend::cuda::{CudaError, Gpu};

/// Threads of the one `moe_plan` block (kernels/moe.cu `PLAN_THREADS`).
const MOE_PLAN_THREADS: u32 = 256;

/// The router's buffers, checked to hold `tokens` rows: logits, given ids, ids, weights.
#[allow(clippy::type_complexity)]
fn route_buffers<'a>(
    logits: &'a CudaSlice<f32>,
    tokens: usize,
    experts: usize,
    top_k: usize,
    given: Option<&'a CudaSlice<i32>>,
    ids: &'a CudaSlice<i32>,
    weights: &'a CudaSlice<f32>,
) -> Result<
    (
        View<'a, f32>,
        Option<View<'a, i32>>,
        View<'a, i32>,
        View<'a, f32>,
    ),
    CudaError,
> {
    if top_k > 32 || top_k > experts {
        return Err(CudaError::Unsupported(format!(
            "top_k {top_k} of {experts} experts (max 32)"
        )));
    }
    Ok((
        need(logits, tokens * experts, "route logits")?,
        given
            .map(|g| need(g, tokens * top_k, "route given ids"))
            .transpose()?,
        need(ids, tokens * top_k, "route ids")?,
        need(weights, tokens * top_k, "route weights")?,
    ))
}

/// Where routing writes its ids a second time: `buf[at..at + tokens * top_k]` (a step's record
/// of every MoE layer's experts, MoE layer i at `i * tokens * top_k`).
pub struct KeptIds<'a> {
    pub buf: &'a mut CudaSlice<i32>,
    pub at: usize,
}

/// The kernels' `kept` argument: null without one, else its first element's address once the
/// buffer is checked to hold the `pairs` ids from there.
fn kept_ptr(gpu: &Gpu, kept: Option<KeptIds<'_>>, pairs: usize) -> Result<DevPtr, CudaError> {
    let Some(KeptIds { buf, at }) = kept else {
        return Ok(DevPtr(0));
    };
    need(buf, at + pairs, "route kept ids")?;
    Ok(DevPtr(
        addr(gpu, buf) + (at * std::mem::size_of::<i32>()) as u64,
    ))
}

/// Router softmax, top-k (ties to the lower id) and optional renormalisation; with `given`
/// (`[tokens, top_k]`), each row whose given ids are all valid takes them instead (replay).
/// With `sums`, the logits are the router GEMM's segment sums ([`Unfolded`]): folded first,
/// and written into `logits` (which then holds what the GEMM's own fold would have written).
/// With `kept`, the ids are also written there.
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    gpu: &Gpu,
    logits: &CudaSlice<f32>,
    sums: Option<Unfolded>,
    tokens: usize,
    experts: usize,
    top_k: usize,
    renormalize: bool,
    given: Option<&CudaSlice<i32>>,
    ids: &mut CudaSlice<i32>,
    weights: &mut CudaSlice<f32>,
    kept: Option<KeptIds<'_>>,
) -> Result<(), CudaError> {
    let kept = kept_ptr(gpu, kept, tokens * top_k)?;
    let (logits, given, ids, weights) =
        route_buffers(logits, tokens, experts, top_k, given, ids, weights)?;
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
            sums_ptr(sums, tokens * experts)?,
            sums_segments(sums),
            kept,
        ),
    )
}

/// Tokens up to which [`route_and_plan`] runs routing and plan as one block (`moe_route_plan`,
/// a warp a token): small decode steps, where the four launches and the memset cost more than
/// the work. Its 8 warps route one token each; more would queue (H200, 2026-12-03: at 64
/// tokens, 8 a warp, with the in-launch folds, decode took 33.9 ms a step against 26.1; H200,
/// 2026-12-05, BF16 at 4,096-token contexts: the one launch up to 16 tokens made the 16-row
/// step 15.66 ms against 15.48, up to 32 the 32-row step 22.16 against 21.46).
pub const ROUTE_PLAN_MAX_TOKENS: usize = 8;

/// The most experts `moe_route_plan` counts in shared memory (kernels/moe.cu).
pub const ROUTE_PLAN_MAX_EXPERTS: usize = 1024;

/// The tokens up to which [`route_and_plan`] runs as one launch: [`ROUTE_PLAN_MAX_TOKENS`], or
/// `LOCKSTEP_ROUTE_PLAN_TOKENS` (1 to 256, read once) to measure another bound; the ids,
/// weights and plan are the same either way.
fn route_plan_tokens() -> usize {
    static TOKENS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *TOKENS.get_or_init(|| {
        route_plan_tokens_from(std::env::var("LOCKSTEP_ROUTE_PLAN_TOKENS").ok().as_deref())
    })
}

/// [`route_plan_tokens`] for the variable's value: a count of 1 to 256, else the default.
fn route_plan_tokens_from(value: Option<&str>) -> usize {
    value
        .and_then(|v| v.parse().ok())
        .filter(|t| (1..=256).contains(t))
        .unwrap_or(ROUTE_PLAN_MAX_TOKENS)
}

/// [`moe_route`] and then [`MoePlan::build`] over its ids: as one launch for up to
/// `route_plan_tokens` tokens (the same ids, weights and plan), else as the two. `sums` and
/// `kept` as for [`moe_route`].
#[allow(clippy::too_many_arguments)]
pub fn route_and_plan(
    gpu: &Gpu,
    logits: &CudaSlice<f32>,
    sums: Option<Unfolded>,
    tokens: usize,
    experts: usize,
    top_k: usize,
    renormalize: bool,
    given: Option<&CudaSlice<i32>>,
    ids: &mut CudaSlice<i32>,
    weights: &mut CudaSlice<f32>,
    plan: &mut MoePlan,
    kept: Option<KeptIds<'_>>,
) -> Result<(), CudaError> {
    if tokens == 0 || tokens > route_plan_tokens() || experts > ROUTE_PLAN_MAX_EXPERTS {
        moe_route(
            gpu,
            logits,
            sums,
            tokens,
            experts,
            top_k,
            renormalize,
            given,
            ids,
            weights,
            kept,
        )?;
        return plan.build(gpu, ids, tokens, top_k, experts);
    }
    let pairs = tokens * top_k;
    let kept = kept_ptr(gpu, kept, pairs)?;
    let (logits, given, ids, weights) =
        route_buffers(logits, tokens, experts, top_k, given, ids, weights)?;
    let slot_row = need(&plan.slot_row, pairs, "plan slot_row")?;
    let counts = need(&plan.counts, experts, "plan counts")?;
    (plan.tokens, plan.pairs) = (tokens, pairs);
    // Offsets and the tiles are sized by `MoePlan::new` for `experts` and the most pairs,
    // row_token for the rows of the pairs (the kernel's cursor is in shared memory).
    gpu.launch(
        Kernel::MoeRoutePlan,
        (1, 1, 1),
        MOE_PLAN_THREADS,
        (
            logits,
            tokens as i32,
            experts as i32,
            top_k as i32,
            renormalize as i32,
            given,
            ids,
            weights,
            counts,
            GEMM_TILE_ROWS as i32,
            GEMM_WIDE_TILE_ROWS as i32,
            View::whole(&plan.offsets),
            View::whole(&plan.tiles),
            View::whole(&plan.num_tiles),
            View::whole(&plan.wide_tiles),
            View::whole(&plan.num_wide_tiles),
            View::whole(&plan.pair_tiles),
            View::whole(&plan.num_pair_tiles),
            slot_row,
            View::whole(&plan.row_token),
            sums_ptr(sums, tokens * experts)?,
            sums_segments(sums),
            kept,
        ),
    )
}

/// The most pairs [`MoePlan::build`] plans in one block (`moe_plan_ids`: counts, plan and
/// scatter in one launch instead of three and a memset): a decode step's (256 tokens of 8 slots
/// are 2,048); prefill's hundreds of thousands are counted and scattered by many blocks.
pub const PLAN_ONE_BLOCK_MAX_PAIRS: usize = 8192;

/// Whether [`MoePlan::build`] plans `pairs` pairs over `experts` experts in one block: where it
/// can, unless `LOCKSTEP_PLAN_ONE_BLOCK=0` (the same plan either way). Measured faster where it
/// applies (H100, 2026-12-06, NVFP4 `cuda_bench`, two rounds: 64 rows 17.78 / 17.76 -> 17.59 /
/// 17.59 ms a step, 256 rows 26.70 / 26.70 -> 26.54 / 26.58).
fn plans_in_one_block(pairs: usize, experts: usize) -> bool {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    pairs <= PLAN_ONE_BLOCK_MAX_PAIRS
        && experts <= ROUTE_PLAN_MAX_EXPERTS
        && super::switched_on(&CHOSEN, "LOCKSTEP_PLAN_ONE_BLOCK")
}

/// Device buffers of a routing plan for `pairs = tokens * top_k` (token, slot) pairs.
pub struct MoePlan {
    pub counts: CudaSlice<i32>,
    pub offsets: CudaSlice<i32>,
    pub cursor: CudaSlice<i32>,
    pub tiles: CudaSlice<i32>,
    pub num_tiles: CudaSlice<i32>,
    /// The same tiles of [`GEMM_WIDE_TILE_ROWS`] rows (the tiled GEMM's wide blocks).
    pub wide_tiles: CudaSlice<i32>,
    pub num_wide_tiles: CudaSlice<i32>,
    /// The same tiles of two wide tiles' rows (the wgmma and TMA GEMMs' blocks).
    pub pair_tiles: CudaSlice<i32>,
    pub num_pair_tiles: CudaSlice<i32>,
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
            tiles: gpu.alloc(2 * Self::max_tiles(max_pairs, experts, GEMM_TILE_ROWS))?,
            num_tiles: gpu.alloc(1)?,
            wide_tiles: gpu.alloc(2 * Self::max_tiles(max_pairs, experts, GEMM_WIDE_TILE_ROWS))?,
            num_wide_tiles: gpu.alloc(1)?,
            pair_tiles: gpu.alloc(2 * Self::max_tiles(max_pairs, experts, PAIR_TILE_ROWS))?,
            num_pair_tiles: gpu.alloc(1)?,
            slot_row: gpu.alloc(max_pairs)?,
            row_token: gpu.alloc(max_pairs)?,
            tokens: 0,
            pairs: 0,
        })
    }

    /// Tiles of `rows` rows can number at most one partial tile per expert plus the full ones.
    pub fn max_tiles(pairs: usize, experts: usize, rows: usize) -> usize {
        pairs / rows + experts
    }

    /// The most tiles of `rows` rows that `pairs` routed pairs can make: `m = min(experts,
    /// pairs)` experts at most hold rows, and `sum ceil(n_e / T) <= (pairs + (T - 1) m) / T`.
    /// A GEMM over the plan launches this many tile blocks (the plan's own count is on the
    /// device): at one decode row, 8 where [`MoePlan::max_tiles`] of the largest batch is
    /// thousands.
    pub fn tile_bound(pairs: usize, experts: usize, rows: usize) -> usize {
        (pairs + (rows - 1) * experts.min(pairs)) / rows
    }

    /// [`MoePlan::tile_bound`] of the last [`MoePlan::build`], for its tiles.
    pub fn tiles_launched(&self) -> usize {
        self.launched(&self.tiles, GEMM_TILE_ROWS)
    }

    /// The same for its wide tiles.
    pub fn wide_tiles_launched(&self) -> usize {
        self.launched(&self.wide_tiles, GEMM_WIDE_TILE_ROWS)
    }

    /// The same for its pair tiles.
    pub fn pair_tiles_launched(&self) -> usize {
        self.launched(&self.pair_tiles, PAIR_TILE_ROWS)
    }

    /// The tile blocks a launch over `list` (tiles of `rows` rows) takes: the bound, within the
    /// list.
    fn launched(&self, list: &CudaSlice<i32>, rows: usize) -> usize {
        Self::tile_bound(self.pairs, self.counts.len(), rows).min(list.len() / 2)
    }

    /// Groups the pairs of `ids` by expert: counts, offsets, GEMM tiles (wide and pair tiles too), and for every pair
    /// its row (`slot_row`) and for every row its token (`row_token`).
    pub fn build(
        &mut self,
        gpu: &Gpu,
        ids: &CudaSlice<i32>,
        tokens: usize,
        top_k: usize,
        experts: usize,
    ) -> Result<(), CudaError> {
        let one_block = plans_in_one_block(tokens * top_k, experts);
        self.build_in(gpu, ids, tokens, top_k, experts, one_block)
    }

    /// [`MoePlan::build`] in one block (`one_block`: `moe_plan_ids`, for at most
    /// [`PLAN_ONE_BLOCK_MAX_PAIRS`] pairs over at most [`ROUTE_PLAN_MAX_EXPERTS`] experts) or in
    /// three launches and a memset: the same plan but for the order of rows within a group.
    pub fn build_in(
        &mut self,
        gpu: &Gpu,
        ids: &CudaSlice<i32>,
        tokens: usize,
        top_k: usize,
        experts: usize,
        one_block: bool,
    ) -> Result<(), CudaError> {
        let pairs = tokens * top_k;
        let ids = need(ids, pairs, "plan ids")?;
        (self.tokens, self.pairs) = (tokens, pairs);
        let slot_row = need(&self.slot_row, pairs, "plan slot_row")?;
        need(&self.counts, experts, "plan counts")?;
        if one_block {
            if pairs > PLAN_ONE_BLOCK_MAX_PAIRS || experts > ROUTE_PLAN_MAX_EXPERTS {
                return Err(CudaError::Unsupported(format!(
                    "a one-block plan of {pairs} pairs over {experts} experts"
                )));
            }
            return gpu.launch(
                Kernel::MoePlanIds,
                (1, 1, 1),
                MOE_PLAN_THREADS,
                (
                    ids,
                    pairs as i32,
                    top_k as i32,
                    experts as i32,
                    View::whole(&self.counts),
                    GEMM_TILE_ROWS as i32,
                    GEMM_WIDE_TILE_ROWS as i32,
                    View::whole(&self.offsets),
                    View::whole(&self.tiles),
                    View::whole(&self.num_tiles),
                    View::whole(&self.wide_tiles),
                    View::whole(&self.num_wide_tiles),
                    View::whole(&self.pair_tiles),
                    View::whole(&self.num_pair_tiles),
                    slot_row,
                    View::whole(&self.row_token),
                ),
            );
        }
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
            MOE_PLAN_THREADS,
            (
                counts,
                experts as i32,
                GEMM_TILE_ROWS as i32,
                GEMM_WIDE_TILE_ROWS as i32,
                View::whole(&self.offsets),
                cursor,
                View::whole(&self.tiles),
                View::whole(&self.num_tiles),
                View::whole(&self.wide_tiles),
                View::whole(&self.num_wide_tiles),
                View::whole(&self.pair_tiles),
                View::whole(&self.num_pair_tiles),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_one_launch_routing_bound_takes_counts_of_1_to_256() {
        assert_eq!(route_plan_tokens_from(Some("16")), 16);
        assert_eq!(route_plan_tokens_from(Some("256")), 256);
        for bad in [
            None,
            Some("0"),
            Some("257"),
            Some("-3"),
            Some("sixteen"),
            Some(""),
        ] {
            assert_eq!(
                route_plan_tokens_from(bad),
                ROUTE_PLAN_MAX_TOKENS,
                "{bad:?}"
            );
        }
    }

    /// Every way of routing `pairs` pairs to `experts` experts (counts as compositions): the
    /// tiles they make never pass the bound, and some routing reaches it.
    #[test]
    fn the_tile_bound_holds_and_is_reached() {
        fn routings(
            left: usize,
            experts: usize,
            counts: &mut Vec<usize>,
            f: &mut dyn FnMut(&[usize]),
        ) {
            if experts == 1 {
                counts.push(left);
                f(counts);
                counts.pop();
                return;
            }
            for c in 0..=left {
                counts.push(c);
                routings(left - c, experts - 1, counts, f);
                counts.pop();
            }
        }
        for rows in [GEMM_TILE_ROWS, GEMM_WIDE_TILE_ROWS] {
            for experts in 1..=4 {
                for pairs in [0, 1, 3, 31, 32, 33, 63, 64, 65, 95, 97, 128, 130, 193] {
                    let bound = MoePlan::tile_bound(pairs, experts, rows);
                    let mut most = 0;
                    routings(pairs, experts, &mut Vec::new(), &mut |counts| {
                        let tiles: usize = counts.iter().map(|c| c.div_ceil(rows)).sum();
                        most = most.max(tiles);
                    });
                    assert_eq!(
                        most, bound,
                        "{pairs} pairs over {experts} experts, {rows} rows"
                    );
                    assert!(bound <= MoePlan::max_tiles(pairs, experts, rows));
                }
            }
        }
    }
}
