//! Launches of kernels/gemm.cu, the grouped GEMM over experts and dense layers with weights
//! decoded in-kernel (F32, BF16, MXFP8, NVFP4; FFMA or BF16 tensor cores in tiles or for few
//! rows, picked by [`GemmPath`]; dense layers of few rows split over K, [`SplitK`]). Every path
//! reduces each output element in an order fixed by K alone, and the tensor-core paths, split
//! or not, in the same order, so the choice never changes bits.

use cudarc::driver::CudaSlice;

use super::{need, MoePlan, Table, Unfolded};
use crate::backend::cuda::args::{addr, DevPtr, KernelArg, TensorMap, View};
use crate::backend::cuda::kernels::{Kernel, TMA_THREADS};
use crate::backend::cuda::{CudaError, Gpu};

/// Rows per tile of the grouped GEMM (kernels/gemm.cu `TM`).
pub const GEMM_TILE_ROWS: usize = 32;
/// Rows per wide tile of the tiled tensor-core kernel (kernels/gemm.cu `TM_WIDE`).
pub const GEMM_WIDE_TILE_ROWS: usize = 64;
/// Rows per tile of the wgmma and TMA kernels (kernels/gemm.cu `WG_ROWS`): two wide tiles.
pub const PAIR_TILE_ROWS: usize = 2 * GEMM_WIDE_TILE_ROWS;
/// Columns per tile of the FFMA kernel (kernels/gemm.cu `TN`).
pub const GEMM_TILE_COLS: usize = 64;
/// Columns per tile of the tiled tensor-core kernel (kernels/gemm.cu `TILE_TN`).
const MMA_TILE_COLS: usize = 128;
/// Output columns per block of the few-rows tensor-core kernels: 4 warps of 8 (or, in the
/// `skinny4` kernels, 32) columns.
const SKINNY_COLS_PER_BLOCK: usize = 32;
/// [`GemmPath::SkinnyKSplit`]'s block: 8 warps over one 32-column group (kernels/gemm.cu
/// `KSPLIT_WARPS`); the 8-column blocks take a warp a K segment, up to as many.
const BLOCK_SPLIT_THREADS: u32 = 256;
/// The most K segments [`GemmPath::SkinnyKSplit`] adds in a block (kernels/gemm.cu
/// `KSPLIT_MAX_SEGMENTS`), and the most rows of its tiles.
pub const BLOCK_SPLIT_MAX_SEGMENTS: usize = 16;
pub const BLOCK_SPLIT_MAX_TILE_ROWS: usize = 16;
/// The most rows of a dense launch [`GemmPath::Auto`] gives [`GemmPath::SkinnyKSplit`]; above
/// them (up to the kernel's [`BLOCK_SPLIT_MAX_TILE_ROWS`]) only launches of at most
/// [`BLOCK_SPLIT_AUTO_MAX_GROUPS`] 32-column groups, whose blocks are too few without the
/// split. H200, 2026-12-04 (cuda_kernel_bench, 16 rows, us, split in the block against Auto's
/// other kernels): q, k and v in one launch 18.7 against 26.3, o_proj 21.6 against 23.7, the
/// router 16.4 against 20.0; the LM head (4,748 groups) 213 against 191.
const BLOCK_SPLIT_AUTO_MAX_ROWS: usize = 8;
const BLOCK_SPLIT_AUTO_MAX_GROUPS: usize = 1024;
/// The most rows of the tiles that take the block-split kernel of 8 columns a block
/// ([`block_split_narrow`]): the sizes it was measured at (1 to 8 rows).
const BLOCK_SPLIT_NARROW_MAX_ROWS: usize = 8;
/// Warps at which a few-rows launch takes the 32-columns-per-warp kernels: enough to fill the
/// GPU, and each warp's activation packing then serves four times the weights.
const SKINNY4_MIN_WARPS: usize = 2048;
/// The same for a dense launch of one row, counting a warp per 32 columns and K segment (the
/// launch splits over K). H200 (cuda_kernel_bench, 2026-12-03), us at one row, 8-column warps
/// against 32-column ones, both split: router [128 x 2048] (32 warps) 13.7 / 14.9, k_proj
/// [512 x 2048] (128) 14.9 / 15.9, q_proj [4096 x 2048] (1,024) 21.7 / 18.7, o_proj
/// [2048 x 4096] (1,024) 21.7 / 18.0, q, k and v in one launch (1,280) 23.4 / 18.2. At 8 rows
/// the 8-column warps win up to 1,280 warps too (q_proj 23.6 / 26.1, o_proj 23.3 / 26.7, q,
/// k and v 25.4 / 24.8), and lose on the LM head (478 / 283): [`SKINNY4_MIN_WARPS`] there.
const SKINNY4_MIN_ONE_ROW_WARPS: usize = 512;
/// k per segment of the tensor-core K chain (kernels/gemm.cu `SEG`): each segment sums from
/// zero, and the segments' sums are added in order, so a split-K launch (a block per segment)
/// gives the bits of one that walks all of K.
pub const K_SEGMENT: usize = 256;
/// Spans (32 of K) a stage of the TMA GEMM holds (kernels/gemm.cu `TMA_SPANS`): its copies are
/// 64 bytes a row of x and a weight row's span bytes, times this. One: with 256 columns a
/// block (`TMA_COLS`) the running totals take the shared memory that two-span stages would.
const TMA_SPANS: u32 = 1;
/// Weight rows a block of the TMA GEMM takes (kernels/gemm.cu `TMA_COLS`): two 128-column
/// blocks side by side sharing each activation copy; its grid counts blocks of these.
const TMA_COLS: usize = 256;
/// Blocks below which [`SplitK::Auto`] splits a dense launch over its K segments: about one
/// block per SM of an H200 (132). From there the per-segment sums cost more than the blocks
/// they add (H200, cuda_kernel_bench, 2026-12-02: q_proj [4096 x 2048] at 128 rows (128
/// blocks) 37.4 us whole against 42.8 split, o_proj at 256 rows 60.3 against 67.2, k_proj
/// [512 x 2048] at 1,024 rows 39.5 against 43.6; at 64 blocks and fewer the split wins).
const SPLIT_K_BELOW_BLOCKS: usize = 128;
/// The same for a routing plan's tiles (decode-sized expert launches) and the few-rows kernels
/// of dense launches. Each of their warps walks all of K alone, one dependent round trip to
/// memory per few spans, so a launch needs several warps per scheduler before the loads
/// overlap: about eight blocks per SM (H200, cuda_kernel_bench, 2026-12-03: q_proj [4096 x
/// 2048] at 8 rows on 8-column warps, 128 blocks, 32.9 us whole against 23.6 split).
const SPLIT_K_PLAN_BELOW_BLOCKS: usize = 1024;
/// The largest split-K scratch (f32 per-segment sums) [`SplitK::Auto`] takes: 64 MiB.
const SPLIT_K_MAX_PARTIALS: usize = 1 << 24;
/// Dense rows (or a plan's tokens) up to which a split launch folds its segments itself: the
/// last block (or few-rows warp) of an output region adds them. Its region then holds a few
/// rows; with more, that one block's walk over them is slower than `gemm_fold_segments`' thread
/// per element (H200, 2026-12-03: folding every split launch in place took decode at 64 rows
/// from 26.1 to 33.9 ms a step, at 256 from 38.9 to 42.9; at one row 6.14 to 5.94 ms with the
/// one-launch routing).
const FOLD_IN_LAUNCH_MAX_ROWS: usize = 8;
/// Split-K counters reserved up front: one per output region (a block's tile, or a few-rows
/// warp's columns), enough for every launch [`SplitK::Auto`] splits (fewer than 1,024 blocks
/// of 4 warps); a larger forced split grows them.
const SPLIT_K_COUNTERS: usize = 1 << 14;

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

/// The GEMMs' device scratch, held by [`Gpu`]: split-K's per-segment sums and the counters
/// that find each output region's last segment (zero between launches), and the tiled
/// kernel's packed activations.
#[derive(Default)]
pub struct GemmScratch {
    partials: Option<CudaSlice<f32>>,
    counters: Option<CudaSlice<u32>>,
    operand: Option<CudaSlice<u32>>,
    /// Counts the times a buffer moved (a recorded step holds their addresses).
    pub generation: u64,
}

/// Sizes the GEMM scratch for the largest step up front, so that no later launch grows it (a
/// grown buffer moves, and the recorded decode steps that hold its address are dropped):
/// `operand_words` packed activation words (every row a launch packs: `rows * k / 2`) and the
/// split-K sums of launches up to `rows` output rows
/// of up to `n` columns over up to `k` inputs, at most [`SPLIT_K_MAX_PARTIALS`].
pub fn reserve_gemm_scratch(
    gpu: &Gpu,
    operand_words: usize,
    rows: usize,
    n: usize,
    k: usize,
) -> Result<(), CudaError> {
    let partials = SPLIT_K_MAX_PARTIALS.min(k.div_ceil(K_SEGMENT) * rows * n);
    let mut guard = gpu
        .gemm_scratch
        .lock()
        .map_err(|_| CudaError::Capacity("the GEMM scratch lock is poisoned".into()))?;
    let scratch = &mut *guard;
    grown(
        gpu,
        &mut scratch.operand,
        &mut scratch.generation,
        operand_words,
    )?;
    grown(
        gpu,
        &mut scratch.partials,
        &mut scratch.generation,
        partials,
    )?;
    grown(
        gpu,
        &mut scratch.counters,
        &mut scratch.generation,
        SPLIT_K_COUNTERS,
    )?;
    Ok(())
}

/// `buf`, grown to hold at least `len` elements (a move counted in `generation`).
fn grown<'a, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    gpu: &Gpu,
    buf: &'a mut Option<CudaSlice<T>>,
    generation: &mut u64,
    len: usize,
) -> Result<&'a mut CudaSlice<T>, CudaError> {
    if buf.as_ref().is_none_or(|b| b.len() < len) {
        *buf = Some(gpu.alloc::<T>(len)?);
        *generation += 1;
    }
    Ok(buf.as_mut().expect("allocated above"))
}

/// Which rows a grouped GEMM runs over.
#[derive(Clone, Copy)]
pub enum GemmRows<'a> {
    /// One group of `rows` rows (a dense layer).
    Dense(usize),
    /// The tiles of a routing plan.
    Plan(&'a MoePlan),
}

/// Which grouped-GEMM kernel runs (kernels/gemm.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// Picked from the shape: [`GemmPath::Skinny`] or [`GemmPath::Skinny4`] for tiles of few
    /// rows, [`GemmPath::TensorCore`] or (many rows) [`GemmPath::TensorCoreWide`] otherwise,
    /// CUDA cores where K is not a multiple of 32 or the weights are F32.
    Auto,
    /// CUDA cores (FFMA), any shape: the exact-f32 path.
    Ffma,
    /// BF16 tensor cores (mma.sync) in 32x128 tiles: activations packed to BF16 first, then
    /// streamed through shared memory with the raw weights.
    TensorCore,
    /// The same kernel in 64x128 tiles (8 warps; a routing plan's wide tiles): each weight
    /// column is read once per 64 rows, half the L2 traffic of [`GemmPath::TensorCore`].
    TensorCoreWide,
    /// The same tensor-core products, a warp per 8 columns, for decode-sized tiles.
    Skinny,
    /// As [`GemmPath::Skinny`], a warp per 32 columns: for launches with warps enough.
    Skinny4,
    /// The few-rows warps with K split over one block: the block's warps take a column group's
    /// K segments in turn and add them in order through shared memory (no split-K sums in
    /// global memory, no fold); 8 columns a block for tiles of up to 8 rows, else 32
    /// ([`block_split_narrow`]). For tiles of at most 16 rows (dense launches of up to 16 rows,
    /// plans of up to 16 tokens) and K of 2 to 16 segments; elsewhere it runs as
    /// [`GemmPath::Skinny4`] (the same bits). [`GemmPath::Auto`] takes it for dense launches of 1
    /// to 8 rows (and of 9 to 16 over few columns) and routing plans of one token
    /// (`LOCKSTEP_BLOCK_SPLIT=0` turns that off; the bits are the same either way).
    SkinnyKSplit,
    /// Hopper's warpgroup MMAs (`wgmma`, sm_90a) on pairs of the wide tiles (128 rows x 128
    /// columns, one block an SM): the weights decoded into registers as the A operand, the
    /// packed activations read by the tensor cores from shared memory. The same products and
    /// sums as the other tensor-core paths, bit for bit (see examples/cuda_wgmma_probe.rs).
    /// Elsewhere, or with `LOCKSTEP_WGMMA=0`, it runs as [`GemmPath::TensorCoreWide`] (the
    /// same bits).
    Wgmma,
    /// [`GemmPath::Wgmma`]'s tiles, products and epilogue (so its bits) with the copies made by
    /// the TMA unit (Hopper's tensor memory accelerator): one lane of a ninth warp issues each
    /// span's tile copies, and shared-memory barriers stand in for the block barrier
    /// (kernels/gemm.cu `grouped_gemm_tma`). The activations are packed with a routing plan's
    /// rows in its order first. Where the launch splits over K, or reads a dense group's rows
    /// through a row index, it runs as [`GemmPath::Wgmma`] (the same bits). [`GemmPath::Auto`]
    /// takes it where it takes the wgmma kernel unless `LOCKSTEP_TMA_GEMM=0` (H200,
    /// 2026-12-05: expert gate/up at 4,096 tokens 11% faster in BF16, prefill 8 x 2,048 10%).
    WgmmaTma,
    /// [`GemmPath::Wgmma`]'s kernel on a dense launch's 64-row tiles (m64n64 MMAs: half the
    /// accumulators and activation stages, about 100 registers, two blocks an SM), the same
    /// products in the same order, so the same bits. A routing plan's launch runs as
    /// [`GemmPath::Wgmma`]. [`GemmPath::Auto`] takes it where it takes the wgmma kernel for the
    /// attention projections at decode batches of at most [`WGMMA64_MAX_DENSE_ROWS`] rows.
    Wgmma64,
}

/// Whether a tensor-core launch runs a block per K segment (then the region's sums are added in
/// order and the NVFP4 epilogue applied: in the launch by the last of a region's blocks for few
/// rows, else by `gemm_fold_segments`). The bits are the same either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitK {
    /// Split when the launch has too few blocks to fill the GPU (decode-sized dense layers).
    Auto,
    Off,
    /// Split wherever K has more than one segment.
    On,
    /// As [`SplitK::On`], but on the wgmma kernels a block walks a run of consecutive
    /// segments, as few as keep the launch within one wave of its blocks (one an SM, two on
    /// 64-row tiles), storing each segment's sums as a block of that segment would
    /// (`grouped_gemm_wgmma_runs_*`): fewer blocks, each paying its copies' start once for
    /// several segments, and the same sums for the same fold. Other kernels split as `On`.
    /// [`SplitK::Auto`] takes it for the wgmma kernels unless `LOCKSTEP_SPLIT_ONE_WAVE=0`.
    OneWave,
}

/// Whether [`SplitK::Auto`] takes [`SplitK::OneWave`]'s runs on the wgmma kernels: unless
/// `LOCKSTEP_SPLIT_ONE_WAVE=0` (the bits are the same either way). H100, 2026-12-05
/// (docs/performance.md, fiftieth session): o_proj alone at 128 / 256 rows 28.5 -> 27.2 and
/// 49.2 -> 45.9 us; decode steps at 256 rows 0.5-0.7% faster, at 64 and 128 rows the same.
fn one_wave_switched_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switched_on(&ON, "LOCKSTEP_SPLIT_ONE_WAVE")
}

/// Blocks along K for a split wgmma launch of `tiles` tiles over `segments` K segments, at
/// most `wave` blocks at once: the fewest segments a block (`per`) that keep
/// `tiles * ceil(segments / per)` within the wave (a block a segment where even that does
/// not fit, or where it already does).
fn one_wave_blocks(tiles: usize, segments: usize, wave: usize) -> usize {
    let fit = wave / tiles.max(1);
    if fit == 0 || fit >= segments {
        return segments;
    }
    let per = segments.div_ceil(fit);
    segments.div_ceil(per)
}

impl SplitK {
    /// The segments to split over, or `None` to walk all of K in one block. `out_rows` rows of
    /// per-segment sums are kept (a plan's rows are its pairs).
    fn segments(
        self,
        path: GemmPath,
        rows: &GemmRows<'_>,
        blocks: usize,
        out_rows: usize,
        n: usize,
        k: usize,
    ) -> Option<usize> {
        let segments = k.div_ceil(K_SEGMENT);
        // The block-split kernel adds its segments itself.
        if matches!(path, GemmPath::Ffma | GemmPath::SkinnyKSplit)
            || self == SplitK::Off
            || segments < 2
        {
            return None;
        }
        // The few-rows kernels' warps each walk their K alone, as a plan's tiles do.
        let few_rows = matches!(path, GemmPath::Skinny | GemmPath::Skinny4);
        let below = match rows {
            // The wgmma kernel's 128 x 128 tiles split up to WGMMA_SPLIT_MAX_DENSE_TILES.
            GemmRows::Dense(_) if path == GemmPath::Wgmma => WGMMA_SPLIT_MAX_DENSE_TILES + 1,
            // (64-row tiles: twice as many.)
            GemmRows::Dense(_) if path == GemmPath::Wgmma64 => 2 * WGMMA_SPLIT_MAX_DENSE_TILES + 1,
            GemmRows::Dense(_) if !few_rows => SPLIT_K_BELOW_BLOCKS,
            _ => SPLIT_K_PLAN_BELOW_BLOCKS,
        };
        let fits = segments * out_rows * n <= SPLIT_K_MAX_PARTIALS;
        match self {
            SplitK::On | SplitK::OneWave => Some(segments),
            _ if blocks < below && fits => Some(segments),
            _ => None,
        }
    }
}

/// Rows up to which [`GemmPath::Auto`] takes the few-rows kernels for one dense group. Every
/// path gives the same bits; these only pick the faster.
/// Measured on the H200 (examples/cuda_kernel_bench.rs, docs/performance.md, 2026-12-01):
/// dense projections at 1-8 rows 0.85-0.9x the tiled kernel's time, at 16+ rows 1.5-3x.
pub const SKINNY_MAX_DENSE_ROWS: usize = 8;
/// The same for a routing plan, in routed rows. MXFP8 and NVFP4 weights are decoded in
/// registers, which the tiled kernel does once for all of a tile's rows; BF16 weights reach the
/// tiled kernel as whole 128-byte lines (kernels/common.cuh `cp_async16_line_at`). H200
/// (cuda_kernel_bench, gate/up of 128 experts, top-8): MXFP8 and NVFP4 (2026-12-02) at 8
/// routed rows on the split 32-column warps 0.9x the tiled kernel's time, at 64 rows the tiled
/// kernel 0.94x (MXFP8) and 0.91x (NVFP4) of theirs, at 512 rows 0.78x and 0.90x; BF16
/// (2026-12-04, with the line copies) at 64 / 128 / 256 / 384 / 512 routed rows the tiled kernel
/// 0.90 / 0.94 / 0.92 / 0.90 / 0.82x of `Skinny4`'s time (110 against 123 us at 64 rows), the
/// down projection 0.81-0.90x. Since the NVFP4 tiled kernel's pair slots (2026-12-06) the
/// crossing is lower: H100, 2026-12-06, `cuda_bench --steps 32 --batches 2,4,8`, two rounds, ms
/// a step, 32 -> 8 routed rows: NVFP4 batch 2 6.19 / 6.20 -> 5.85 / 5.91, batch 4 8.05 / 8.06 ->
/// 7.24 / 7.21; MXFP8 6.33 / 6.36 -> 6.15 / 6.29, 8.43 / 8.42 -> 7.68 / 7.69; BF16 6.93 / 6.97
/// -> 6.56 / 6.55, 9.57 / 9.57 -> 8.98 / 8.94 (batch 8, 64 rows, on the tiled kernel either way:
/// kept off it, NVFP4 9.47 -> 11.3). `LOCKSTEP_SKINNY_MAX_PLAN_ROWS` replaces it
/// ([`skinny_max_plan_rows`]).
pub const SKINNY_MAX_PLAN_ROWS: usize = 8;
/// Rows from which [`GemmPath::Auto`] takes the wide tiles for one dense group of at least
/// [`WIDE_MIN_DENSE_COLS`] columns and, on average per expert, for a routing plan over BF16 or
/// MXFP8 experts. H200 (cuda_kernel_bench, 2026-12-02): o_proj [2048 x 4096] at 1,024 rows
/// 134 us wide against 150, q_proj [4096 x 2048] 2% faster from 512 rows, k_proj [512 x 2048]
/// slower below 4,096 rows (too few blocks); expert gate/up of 128 experts, top-8, at 1,024
/// tokens (64 rows an expert): BF16 399 us against 434, MXFP8 419 against 455, NVFP4 equal
/// and 1-2% slower from 2,048 tokens (so NVFP4 plans stay on 32-row tiles); BF16 at 4,096
/// tokens 8% slower, but the 8x2048 prefill step 1% faster with them.
pub const WIDE_MIN_DENSE_ROWS: usize = 1024;
pub const WIDE_MIN_DENSE_COLS: usize = 2048;
pub const WIDE_MIN_ROWS_PER_EXPERT: usize = 64;
/// Rows per expert (on average) from which [`GemmPath::Auto`] takes the wgmma kernel for a
/// routing plan over MXFP8 or NVFP4 experts (where allowed, [`wgmma_allowed`]); it also takes
/// it wherever it would take the wide tiles. H200 (cuda_kernel_bench, 2026-12-03, gate/up of
/// 128 experts, top-8, the 128-row wgmma tiles), us at 512 / 1,024 / 2,048 / 4,096 tokens:
/// MXFP8 wgmma 390 / 403 / 493 / 975 against the best other 235 / 415 / 804 / 1,554; NVFP4
/// 570 / 621 / 796 / 1,581 against 306 / 577 / 1,100 / 2,166; BF16 367 / 383 / 634 / 1,222
/// against 350 / 405 / 706 / 1,450. Dense q_proj [4096 x 2048] at 1,024 / 4,096 rows: 102 /
/// 376 against the wide tiles' 126 / 448.
pub const WGMMA_MIN_QUANTIZED_ROWS_PER_EXPERT: usize = 128;
/// Rows, and 128 x 128 tiles, from which [`GemmPath::Auto`] takes the wgmma kernel for a dense
/// launch the wide-tile rule leaves out: a matrix wide enough that its 128-row tiles still fill
/// the GPU several times over at decode batches (the LM head, [151,936 x 2048]: 1,187 tiles at
/// 64 rows). The q/k/v/o projections at these rows have too few tiles and stay on 32-row ones.
pub const WGMMA_MIN_DENSE_ROWS: usize = 64;
pub const WGMMA_MIN_DENSE_TILES: usize = 1024;
/// Rows up to which, and 128 x 128 tiles up to which, [`GemmPath::Auto`] takes the wgmma kernel
/// for a dense launch of at least [`WGMMA_MIN_DENSE_ROWS`] rows: the attention projections at
/// decode batches, where 32-row tiles (the tiled kernel) take each weight column's span from L2
/// eight times at 256 rows and spend a block's K chain on few products. Launches of at most
/// [`WGMMA_SPLIT_MAX_DENSE_TILES`] tiles split over K ([`SplitK::Auto`]): o_proj [2048 x 4096]
/// (16 tiles at 64-128 rows, 32 at 256) and the router; more (q, k and v in one launch, 40 tiles
/// at 64-128 rows, 80 at 256) walk all of K. H200, 2026-12-05 (ncu of `cuda_kernel_bench
/// --sections dense --rows 64,128,256`, us; a split launch's fold not counted): o_proj at 64 /
/// 128 / 256 rows 12.5 / 15.3 / 25.9 split against the 32-row tiles' 15.1 (split) / 24.6
/// (split) / 49.9 (whole). H100, the same day (`cuda_bench --steps 32 --prefill 1x16`, ms, two
/// rounds each): with o_proj and the router alone on it NVFP4 (BF16 projections) batch 64 / 128
/// / 256 18.77 / 22.25 / 28.29 -> 18.61 / 21.78 / 27.78, MXFP8 (MXFP8 projections) 20.63 / 25.02
/// / 32.26 -> 20.08 / 24.12 / 30.20; with q/k/v too (up to 80 tiles) NVFP4 18.28 / 21.34 /
/// 27.23, MXFP8 19.91 / 22.81 / 28.96.
pub const WGMMA_MAX_DENSE_DECODE_ROWS: usize = 256;
pub const WGMMA_MAX_DENSE_DECODE_TILES: usize = 80;
pub const WGMMA_SPLIT_MAX_DENSE_TILES: usize = 32;
/// Rows up to which [`GemmPath::Auto`] runs those dense decode launches on the wgmma kernel's
/// 64-row tiles ([`GemmPath::Wgmma64`], two blocks an SM) instead of its 128-row ones. H100,
/// 2026-12-05 (`cuda_bench --steps 32 --prefill 1x16`, ms, two rounds each, 128-row tiles ->
/// 64-row tiles everywhere): batch 64 NVFP4 18.35 / 18.36 -> 18.21 / 18.23, MXFP8 19.90 /
/// 20.02 -> 19.54 / 19.45; batch 128 NVFP4 21.33 / 21.39 -> 21.29 / 21.16, MXFP8 22.82 / 22.88
/// -> 23.27 / 23.16; batch 256 NVFP4 27.28 / 27.34 -> 27.42 / 27.38, MXFP8 29.05 / 28.79 ->
/// 29.29 / 29.30. Wider launches keep the 128-row tiles. On 64-row tiles a launch splits over K
/// up to twice [`WGMMA_SPLIT_MAX_DENSE_TILES`] tiles ([`SplitK::Auto`]), so at 64 rows q, k and
/// v in one launch (40 tiles) split too (host-timed, us: 30.8 against 35.5 whole on 128-row
/// tiles).
pub const WGMMA64_MAX_DENSE_ROWS: usize = 64;

/// Whether [`GemmPath::Auto`] may take the wide tiles: `LOCKSTEP_WIDE_TILES=0` keeps it on
/// 32-row tiles, to measure the difference in one run (scripts/gpu-check.sh
/// `BENCH_WIDE_OFF=1`). The bits are the same either way.
fn wide_tiles_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switched_on(&ALLOWED, "LOCKSTEP_WIDE_TILES")
}

/// Whether [`GemmPath::Auto`] may take the wgmma kernel for dense launches of 64-256 rows over
/// few tiles ([`WGMMA_MAX_DENSE_DECODE_TILES`]): unless `LOCKSTEP_DENSE_WGMMA=0` (to measure the
/// difference in one run; the bits are the same).
fn dense_wgmma_decode_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switched_on(&ALLOWED, "LOCKSTEP_DENSE_WGMMA")
}

/// Whether [`GemmPath::Auto`] may take [`GemmPath::Wgmma64`] for dense decode launches of at
/// most [`WGMMA64_MAX_DENSE_ROWS`] rows: unless `LOCKSTEP_WGMMA64=0` (the bits are the same).
fn wgmma64_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switched_on(&ALLOWED, "LOCKSTEP_WGMMA64")
}

/// Whether [`GemmPath::Auto`] may take [`GemmPath::SkinnyKSplit`]: unless
/// `LOCKSTEP_BLOCK_SPLIT=0` (scripts/gpu-check.sh `BENCH_BLOCK_SPLIT_OFF=1` measures the
/// difference in one run; the bits are the same).
fn block_split_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switched_on(&ALLOWED, "LOCKSTEP_BLOCK_SPLIT")
}

/// The most tokens of a routing plan whose launches [`GemmPath::Auto`] splits inside a block:
/// 1, or `LOCKSTEP_BLOCK_SPLIT_PLAN_TOKENS` (a trial; the bits are the same either way). Plans
/// of 8 and 16 tokens lost on 32-column blocks (H200, 2026-12-03, see [`GemmPath::resolve`]);
/// not yet measured on the 8-column ones.
fn block_split_plan_tokens() -> usize {
    static TOKENS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    env_count(&TOKENS, "LOCKSTEP_BLOCK_SPLIT_PLAN_TOKENS").unwrap_or(1)
}

/// The routed rows up to which [`GemmPath::Auto`] keeps a routing plan off the tiled kernel:
/// [`SKINNY_MAX_PLAN_ROWS`], or `LOCKSTEP_SKINNY_MAX_PLAN_ROWS` (to measure another crossing;
/// the bits are the same either way). A one-token plan of top-8 routing (8 rows) stays off it;
/// with the block split on ([`block_split_plan_tokens`]) it takes that kernel first.
fn skinny_max_plan_rows() -> usize {
    static ROWS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    env_count(&ROWS, "LOCKSTEP_SKINNY_MAX_PLAN_ROWS").unwrap_or(SKINNY_MAX_PLAN_ROWS)
}

/// The count the environment variable `var` holds, if it holds one, read once into `cell`.
fn env_count(cell: &std::sync::OnceLock<Option<usize>>, var: &str) -> Option<usize> {
    *cell.get_or_init(|| std::env::var(var).ok().and_then(|v| v.parse().ok()))
}

/// The most rows a tile of the launch can hold: a dense launch's, or a routing plan's tokens.
fn tile_rows_of(rows: &GemmRows<'_>) -> usize {
    match rows {
        GemmRows::Dense(r) => *r,
        GemmRows::Plan(p) => p.tokens,
    }
}

/// Which block-split kernel a launch of tiles of `tile_rows` rows takes: 8 columns a block
/// (`grouped_gemm_skinny_ksplit8_*`: one fragment a warp, one warp a K segment, up to 8 warps)
/// for tiles of at most [`BLOCK_SPLIT_NARROW_MAX_ROWS`] rows, else 32 (a 32-column group over 8
/// warps). The same products in the same order, so the same bits; four times the blocks, each
/// warp's segment one round of loads, spread evenly over the SMs where 32-column groups are few
/// (q/k/v at one row: 160). `LOCKSTEP_BLOCK_SPLIT_COLS=8` or `=32` sets one for every launch.
/// H100, 2026-12-05, `cuda_bench --steps 64 --batches 1,2,4` (ms, two rounds, 32 against 8
/// columns a block, both with every one-row launch split in the block): batch 1 BF16 5.21 /
/// 5.27 -> 5.22 / 5.21, NVFP4 5.33 / 5.31 -> 5.24 / 5.21, MXFP8 5.84 / 5.85 -> 5.22 / 5.19;
/// MXFP8 (whose attention projections are MXFP8 too) at batch 2 and 4 6.98 -> 6.68, 9.17 -> 8.87;
/// BF16 and NVFP4 there the same.
fn block_split_narrow(tile_rows: usize) -> bool {
    static COLS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    match env_count(&COLS, "LOCKSTEP_BLOCK_SPLIT_COLS") {
        Some(cols) => cols == 8,
        None => tile_rows <= BLOCK_SPLIT_NARROW_MAX_ROWS,
    }
}

/// Whether the environment variable `var` leaves a kernel choice on (anything but `0`), read
/// once into `cell`.
pub(crate) fn switched_on(cell: &std::sync::OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).map_or(true, |v| v != "0"))
}

/// Whether the environment variable `var` turns an opt-in choice on (`1`), read once into
/// `cell`.
pub(crate) fn opted_in(cell: &std::sync::OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).is_ok_and(|v| v == "1"))
}

/// Whether [`GemmPath::Auto`] takes [`GemmPath::WgmmaTma`] where it takes the wgmma kernel on
/// `gpu`: wherever the wgmma kernels run, unless `LOCKSTEP_TMA_GEMM=0` (the bits are the same
/// either way).
/// Its launches pack a routing plan's rows (top-k per token), not the tokens: the GEMM scratch
/// is reserved for that where it is chosen.
pub fn tma_chosen(gpu: &Gpu) -> bool {
    wgmma_allowed(gpu) && tma_switched_on()
}

/// `LOCKSTEP_TMA_GEMM` is not `0` (read once).
fn tma_switched_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switched_on(&ON, "LOCKSTEP_TMA_GEMM")
}

/// Whether the wgmma kernels may run: on sm_90a (Hopper; Blackwell has no wgmma), unless
/// `LOCKSTEP_WGMMA=0` (to measure the difference in one run; the bits are the same).
fn wgmma_allowed(gpu: &Gpu) -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    gpu.arch == "sm_90a" && switched_on(&ALLOWED, "LOCKSTEP_WGMMA")
}

impl GemmPath {
    /// Every kernel a launch can be told to take (all but [`GemmPath::Auto`]): what the tests
    /// and benchmarks that run each kernel walk.
    pub const EXPLICIT: [GemmPath; 9] = [
        GemmPath::Ffma,
        GemmPath::TensorCore,
        GemmPath::TensorCoreWide,
        GemmPath::Wgmma,
        GemmPath::WgmmaTma,
        GemmPath::Wgmma64,
        GemmPath::Skinny,
        GemmPath::Skinny4,
        GemmPath::SkinnyKSplit,
    ];

    fn resolve(
        self,
        wgmma: bool,
        w: &Operand<'_>,
        rows: &GemmRows<'_>,
        max_rows: usize,
        n: usize,
        k: usize,
    ) -> GemmPath {
        let tensor_ok = k % 32 == 0 && !w.f32_weights;
        // Tiles that will hold rows (a routing plan's active experts, at most one per routed
        // row), times the 32-column groups of N: the warps of a `Skinny4` launch.
        let (skinny_rows, live_tiles) = match rows {
            GemmRows::Dense(r) => (SKINNY_MAX_DENSE_ROWS, r.div_ceil(GEMM_TILE_ROWS)),
            GemmRows::Plan(p) => (skinny_max_plan_rows(), p.counts.len().min(max_rows)),
        };
        let wide = wide_tiles_allowed()
            && match rows {
                GemmRows::Dense(_) => max_rows >= WIDE_MIN_DENSE_ROWS && n >= WIDE_MIN_DENSE_COLS,
                GemmRows::Plan(p) => {
                    w.s_dec.is_none() && max_rows >= WIDE_MIN_ROWS_PER_EXPERT * p.counts.len()
                }
            };
        // A dense launch's 128 x 128 tiles on the wgmma kernel (none for a routing plan).
        let dense_pair_tiles = match rows {
            GemmRows::Dense(r) => r.div_ceil(PAIR_TILE_ROWS) * n.div_ceil(MMA_TILE_COLS),
            GemmRows::Plan(_) => 0,
        };
        // The wgmma kernel wherever the wide tiles would run, over MXFP8 or NVFP4 experts from
        // WGMMA_MIN_QUANTIZED_ROWS_PER_EXPERT rows an expert, and for dense launches of many
        // tiles (the LM head) from WGMMA_MIN_DENSE_ROWS rows.
        let wgmma_wins = wgmma
            && (wide
                || match rows {
                    GemmRows::Plan(p) => {
                        w.scales.is_some()
                            && max_rows >= WGMMA_MIN_QUANTIZED_ROWS_PER_EXPERT * p.counts.len()
                    }
                    GemmRows::Dense(r) => {
                        *r >= WGMMA_MIN_DENSE_ROWS && dense_pair_tiles >= WGMMA_MIN_DENSE_TILES
                    }
                });
        // Dense launches of 64-256 rows over few 128 x 128 tiles (decode's attention projections).
        let wgmma_decode_wins = wgmma
            && dense_wgmma_decode_allowed()
            && matches!(rows, GemmRows::Dense(r) if (WGMMA_MIN_DENSE_ROWS..=WGMMA_MAX_DENSE_DECODE_ROWS).contains(r))
            && dense_pair_tiles <= WGMMA_MAX_DENSE_DECODE_TILES
            && k > K_SEGMENT;
        // Those of at most WGMMA64_MAX_DENSE_ROWS rows on its 64-row tiles.
        let wgmma64_wins = wgmma_decode_wins
            && wgmma64_allowed()
            && matches!(rows, GemmRows::Dense(r) if *r <= WGMMA64_MAX_DENSE_ROWS);
        // K split over one block's warps: tiles of at most 16 rows, 2 to 16 segments.
        let tile_rows = tile_rows_of(rows);
        let block_split_fits = tile_rows <= BLOCK_SPLIT_MAX_TILE_ROWS
            && (2..=BLOCK_SPLIT_MAX_SEGMENTS).contains(&k.div_ceil(K_SEGMENT));
        // Auto takes it for dense launches of 1 to 8 rows, of 9 to 16 rows of few columns
        // (BLOCK_SPLIT_AUTO_MAX_GROUPS), and for routing plans of one token. H200, 2026-12-03,
        // step benchmark (ms, without -> with): NVFP4 batch 2 7.02 -> 6.63, batch 8 11.96 ->
        // 11.57 (its experts on their own kernels; BF16 and MXFP8 alike). A routing plan's
        // tiles of more tokens lost on it: at 8 and 16 tokens the BF16 step 12.34 -> 13.04 and
        // 15.17 -> 18.49, MXFP8 12.04 -> 14.04 (the expert gate/up alone at 16 tokens, us: BF16
        // 138 on Skinny4 against 150, MXFP8 135 on TensorCore against 143). At one row, on 32
        // columns a block, every format's batch-1 step lost then (BF16 5.23 -> 5.27 ms, MXFP8
        // 5.56 -> 5.81); on 8 columns a block (block_split_narrow) every one-row dense launch
        // and one-token plan gains (H100, 2026-12-05, `cuda_bench --steps 64`, two rounds, ms:
        // BF16 5.52 / 5.53 -> 5.22 / 5.21, NVFP4 5.41 / 5.39 -> 5.24 / 5.21, MXFP8 5.68 / 5.63
        // -> 5.22 / 5.19; the dense launches alone BF16 5.39, the plans alone 5.38).
        let groups = n.div_ceil(SKINNY_COLS_PER_BLOCK);
        let block_split = block_split_fits
            && block_split_allowed()
            && match rows {
                GemmRows::Dense(r) => {
                    *r <= BLOCK_SPLIT_AUTO_MAX_ROWS || groups <= BLOCK_SPLIT_AUTO_MAX_GROUPS
                }
                GemmRows::Plan(p) => p.tokens <= block_split_plan_tokens(),
            };
        match self {
            _ if !tensor_ok => GemmPath::Ffma,
            GemmPath::SkinnyKSplit if !block_split_fits => GemmPath::Skinny4,
            GemmPath::Auto if wgmma_wins && tma_switched_on() => GemmPath::WgmmaTma,
            GemmPath::Auto if wgmma64_wins => GemmPath::Wgmma64,
            GemmPath::Auto if wgmma_wins || wgmma_decode_wins => GemmPath::Wgmma,
            GemmPath::Auto if wide => GemmPath::TensorCoreWide,
            GemmPath::Wgmma | GemmPath::WgmmaTma | GemmPath::Wgmma64 if !wgmma => {
                GemmPath::TensorCoreWide
            }
            GemmPath::Wgmma64 if matches!(rows, GemmRows::Plan(_)) => GemmPath::Wgmma,
            GemmPath::Auto if block_split => GemmPath::SkinnyKSplit,
            GemmPath::Auto if max_rows > skinny_rows => GemmPath::TensorCore,
            // A dense launch of few rows splits over K (SplitK::Auto); its 32-column warps win
            // where they are many (SKINNY4_MIN_ONE_ROW_WARPS, SKINNY4_MIN_WARPS).
            GemmPath::Auto if matches!(rows, GemmRows::Dense(_)) && k > K_SEGMENT => {
                let warps = n.div_ceil(32) * k.div_ceil(K_SEGMENT);
                let enough = if max_rows == 1 {
                    SKINNY4_MIN_ONE_ROW_WARPS
                } else {
                    SKINNY4_MIN_WARPS
                };
                if warps >= enough {
                    GemmPath::Skinny4
                } else {
                    GemmPath::Skinny
                }
            }
            // So does a plan's launch small enough to split (SplitK::Auto): at one token (8 rows)
            // the split 32-column warps take 0.7-0.9x the 8-column kernel's time (H200,
            // cuda_kernel_bench, 2026-12-02).
            GemmPath::Auto
                if matches!(rows, GemmRows::Plan(p) if k > K_SEGMENT
                    && p.tiles_launched() * n.div_ceil(4 * SKINNY_COLS_PER_BLOCK)
                        < SPLIT_K_PLAN_BELOW_BLOCKS) =>
            {
                GemmPath::Skinny4
            }
            GemmPath::Auto if live_tiles * n.div_ceil(32) >= SKINNY4_MIN_WARPS => GemmPath::Skinny4,
            GemmPath::Auto => GemmPath::Skinny,
            p => p,
        }
    }
}

/// A GEMM's weights as the kernels take them: untyped data (decoded by the kernel's format),
/// block scales, NVFP4 S_dec and its groups.
struct Operand<'a> {
    /// The FFMA, tiled tensor-core and few-rows tensor-core kernels (8 and 32 columns per
    /// warp), then the wide-tiled, the wgmma and the block-split few-rows ones, of the format
    /// (F32 has FFMA only).
    kernels: [Kernel; 7],
    f32_weights: bool,
    /// How the tiled and wgmma kernels' packed activations are made.
    packing: Packing,
    data: DevPtr,
    scales: Option<View<'a, u8>>,
    s_dec: Option<View<'a, f32>>,
    groups: usize,
}

impl<'a> Operand<'a> {
    fn new(
        kernels: [Kernel; 7],
        data: DevPtr,
        scales: Option<View<'a, u8>>,
        s_dec: Option<View<'a, f32>>,
        groups: usize,
    ) -> Operand<'a> {
        Operand {
            kernels,
            f32_weights: kernels[0] == Kernel::GroupedGemmF32,
            packing: match kernels[0] {
                Kernel::GroupedGemmNvfp4 => Packing::F16,
                _ => Packing::Bf16,
            },
            data,
            scales,
            s_dec,
            groups,
        }
    }

    /// The wgmma kernel with SwiGLU in its epilogue writing `out`, where the format has one.
    fn swiglu_kernel(&self, out: SwigluOut) -> Option<Kernel> {
        match (self.kernels[5], out) {
            (Kernel::GroupedGemmWgmmaBf16, SwigluOut::F32) => {
                Some(Kernel::GroupedGemmWgmmaSwigluBf16)
            }
            (Kernel::GroupedGemmWgmmaBf16, SwigluOut::Bf16Words) => {
                Some(Kernel::GroupedGemmWgmmaSwigluWordsBf16)
            }
            (Kernel::GroupedGemmWgmmaMxfp8, SwigluOut::F32) => {
                Some(Kernel::GroupedGemmWgmmaSwigluMxfp8)
            }
            (Kernel::GroupedGemmWgmmaNvfp4, SwigluOut::F32) => {
                Some(Kernel::GroupedGemmWgmmaSwigluNvfp4)
            }
            _ => None,
        }
    }

    /// [`GemmPath::Wgmma64`]'s kernel: the wgmma kernel on a dense launch's 64-row tiles.
    fn wgmma64_kernel(&self) -> Kernel {
        use Kernel::*;
        match self.kernels[5] {
            GroupedGemmWgmmaMxfp8 => GroupedGemmWgmma64Mxfp8,
            GroupedGemmWgmmaNvfp4 => GroupedGemmWgmma64Nvfp4,
            _ => GroupedGemmWgmma64Bf16,
        }
    }

    /// The wgmma kernel (on 64-row tiles with `narrow`) whose blocks walk a run of K segments
    /// ([`SplitK::OneWave`]).
    fn wgmma_runs_kernel(&self, narrow: bool) -> Kernel {
        use Kernel::*;
        match (self.kernels[5], narrow) {
            (GroupedGemmWgmmaMxfp8, false) => GroupedGemmWgmmaRunsMxfp8,
            (GroupedGemmWgmmaNvfp4, false) => GroupedGemmWgmmaRunsNvfp4,
            (_, false) => GroupedGemmWgmmaRunsBf16,
            (GroupedGemmWgmmaMxfp8, true) => GroupedGemmWgmma64RunsMxfp8,
            (GroupedGemmWgmmaNvfp4, true) => GroupedGemmWgmma64RunsNvfp4,
            (_, true) => GroupedGemmWgmma64RunsBf16,
        }
    }

    /// [`GemmPath::SkinnyKSplit`]'s kernel of 8 columns a block ([`block_split_narrow`]).
    fn narrow_block_split_kernel(&self) -> Kernel {
        use Kernel::*;
        match self.kernels[6] {
            GroupedGemmSkinnyKsplitMxfp8 => GroupedGemmSkinnyKsplit8Mxfp8,
            GroupedGemmSkinnyKsplitNvfp4 => GroupedGemmSkinnyKsplit8Nvfp4,
            _ => GroupedGemmSkinnyKsplit8Bf16,
        }
    }

    /// The TMA kernel ([`GemmPath::WgmmaTma`]) writing what `swiglu` says (the sums: none).
    fn tma_kernel(&self, swiglu: Option<SwigluOut>) -> Option<Kernel> {
        use Kernel::*;
        Some(match (self.kernels[5], swiglu) {
            (GroupedGemmWgmmaBf16, None) => GroupedGemmTmaBf16,
            (GroupedGemmWgmmaMxfp8, None) => GroupedGemmTmaMxfp8,
            (GroupedGemmWgmmaNvfp4, None) => GroupedGemmTmaNvfp4,
            (GroupedGemmWgmmaBf16, Some(SwigluOut::F32)) => GroupedGemmTmaSwigluBf16,
            (GroupedGemmWgmmaMxfp8, Some(SwigluOut::F32)) => GroupedGemmTmaSwigluMxfp8,
            (GroupedGemmWgmmaNvfp4, Some(SwigluOut::F32)) => GroupedGemmTmaSwigluNvfp4,
            (GroupedGemmWgmmaBf16, Some(SwigluOut::Bf16Words)) => GroupedGemmTmaSwigluWordsBf16,
            _ => return None,
        })
    }

    /// Bytes of a weight row of `k` values in the format, and of its 32-value span (what the
    /// TMA kernel copies of each row a span).
    fn row_bytes(&self, k: usize) -> (usize, usize) {
        let span = match self.kernels[0] {
            Kernel::GroupedGemmMxfp8 => 32,
            Kernel::GroupedGemmNvfp4 => 16,
            _ => 64,
        };
        (k / 32 * span, span)
    }

    fn f32(gpu: &Gpu, d: &'a CudaSlice<f32>) -> Operand<'a> {
        let k = Kernel::GroupedGemmF32;
        Operand::new([k, k, k, k, k, k, k], DevPtr(addr(gpu, d)), None, None, 1)
    }

    fn bf16(gpu: &Gpu, d: &'a CudaSlice<u16>) -> Operand<'a> {
        let kernels = [
            Kernel::GroupedGemmBf16,
            Kernel::GroupedGemmMmaBf16,
            Kernel::GroupedGemmSkinnyBf16,
            Kernel::GroupedGemmSkinny4Bf16,
            Kernel::GroupedGemmMmaWideBf16,
            Kernel::GroupedGemmWgmmaBf16,
            Kernel::GroupedGemmSkinnyKsplitBf16,
        ];
        Operand::new(kernels, DevPtr(addr(gpu, d)), None, None, 1)
    }

    fn of(gpu: &Gpu, w: &'a WeightData) -> Operand<'a> {
        match w {
            WeightData::F32(d) => Operand::f32(gpu, d),
            WeightData::Bf16(d) => Operand::bf16(gpu, d),
            WeightData::Mxfp8 { data, scales } => Operand::new(
                [
                    Kernel::GroupedGemmMxfp8,
                    Kernel::GroupedGemmMmaMxfp8,
                    Kernel::GroupedGemmSkinnyMxfp8,
                    Kernel::GroupedGemmSkinny4Mxfp8,
                    Kernel::GroupedGemmMmaWideMxfp8,
                    Kernel::GroupedGemmWgmmaMxfp8,
                    Kernel::GroupedGemmSkinnyKsplitMxfp8,
                ],
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
            } => Operand::new(
                [
                    Kernel::GroupedGemmNvfp4,
                    Kernel::GroupedGemmMmaNvfp4,
                    Kernel::GroupedGemmSkinnyNvfp4,
                    Kernel::GroupedGemmSkinny4Nvfp4,
                    Kernel::GroupedGemmMmaWideNvfp4,
                    Kernel::GroupedGemmWgmmaNvfp4,
                    Kernel::GroupedGemmSkinnyKsplitNvfp4,
                ],
                DevPtr(addr(gpu, data)),
                Some(View::whole(scales)),
                Some(View::whole(s_dec)),
                *groups,
            ),
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
        SplitK::Auto,
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

/// What a gate/up GEMM with SwiGLU in its epilogue ([`grouped_gemm_swiglu`]) writes: h =
/// silu(gate) * up, `[rows, n / 2]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwigluOut {
    /// f32 values (what the activation quantizers, or the packing of a launch, read next).
    F32,
    /// The tiled and wgmma kernels' BF16 operand ([`Packing::Bf16`], [`packed_word`]'s order,
    /// `n / 4` words a row): what a down projection on BF16 weights reads
    /// ([`grouped_gemm_packed`]) without packing it again.
    Bf16Words,
}

/// Whether [`grouped_gemm_swiglu`] runs for `w` over these rows: [`GemmPath::Auto`] takes the
/// wgmma kernel there and it has a SwiGLU epilogue for the format and `out` (BF16 words from
/// BF16 weights only). `LOCKSTEP_SWIGLU_EPILOGUE=0` says no (the bits are the same either way).
pub fn swiglu_epilogue_runs(
    gpu: &Gpu,
    w: &WeightData,
    rows: &GemmRows<'_>,
    max_rows: usize,
    n: usize,
    k: usize,
    out: SwigluOut,
) -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let w = Operand::of(gpu, w);
    switched_on(&ALLOWED, "LOCKSTEP_SWIGLU_EPILOGUE")
        && n.is_multiple_of(2)
        && (out == SwigluOut::F32 || (n / 2).is_multiple_of(32))
        && w.swiglu_kernel(out).is_some()
        && matches!(
            GemmPath::Auto.resolve(wgmma_allowed(gpu), &w, rows, max_rows, n, k),
            GemmPath::Wgmma | GemmPath::WgmmaTma
        )
}

/// Whether a [`grouped_gemm`] of `w` over these rows reads its activations as operand words
/// ([`grouped_gemm_packed`] can take them already packed), in the weights' operand type
/// ([`Packing`]).
pub fn takes_operand_words(
    gpu: &Gpu,
    w: &WeightData,
    rows: &GemmRows<'_>,
    max_rows: usize,
    n: usize,
    k: usize,
) -> Option<Packing> {
    let w = Operand::of(gpu, w);
    matches!(
        GemmPath::Auto.resolve(wgmma_allowed(gpu), &w, rows, max_rows, n, k),
        GemmPath::TensorCore
            | GemmPath::TensorCoreWide
            | GemmPath::Wgmma
            | GemmPath::WgmmaTma
            | GemmPath::Wgmma64
    )
    .then_some(w.packing)
}

/// Whether [`takes_operand_words`] takes BF16 words.
pub fn takes_bf16_words(
    gpu: &Gpu,
    w: &WeightData,
    rows: &GemmRows<'_>,
    max_rows: usize,
    n: usize,
    k: usize,
) -> bool {
    takes_operand_words(gpu, w, rows, max_rows, n, k) == Some(Packing::Bf16)
}

/// The gate/up GEMM `[gate; up] = x W_e^T` (`n` = 2 * inter weight rows: gate, then up) with
/// SwiGLU in the wgmma kernel's epilogue: `h[r, i] = silu(gate[r, i]) * up[r, i]` into `h`
/// as `out` says, the bits of [`grouped_gemm`] then `silu_mul` (then, for
/// [`SwigluOut::Bf16Words`], [`pack_gemm_operand`]). Neither gate nor up is stored. Refused
/// where [`swiglu_epilogue_runs`] says no.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_swiglu(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    row_index: Option<&CudaSlice<i32>>,
    row_scale: Option<&CudaSlice<f32>>,
    w: &WeightData,
    rows: GemmRows<'_>,
    max_rows: usize,
    n: usize,
    k: usize,
    out: SwigluOut,
    h: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let path = GemmPath::Auto;
    grouped_gemm_swiglu_on(
        path, gpu, x, row_index, row_scale, w, rows, max_rows, n, k, out, h,
    )
}

/// [`grouped_gemm_swiglu`] on a chosen wgmma kernel: [`GemmPath::Wgmma`] or
/// [`GemmPath::WgmmaTma`] ([`GemmPath::Auto`]: the engine's choice of the two).
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_swiglu_on(
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
    out: SwigluOut,
    h: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    swiglu_launch(
        path, gpu, x, None, row_index, row_scale, w, rows, max_rows, n, k, out, h,
    )
}

/// [`grouped_gemm_swiglu`] of activations given as operand words already (as
/// [`grouped_gemm_packed`] takes them: the NVFP4 quantizer's `words`, read through
/// `row_index`), not packed again.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_swiglu_packed(
    gpu: &Gpu,
    words: &CudaSlice<f32>,
    packing: Packing,
    row_index: Option<&CudaSlice<i32>>,
    row_scale: Option<&CudaSlice<f32>>,
    w: &WeightData,
    rows: GemmRows<'_>,
    max_rows: usize,
    n: usize,
    k: usize,
    out: SwigluOut,
    h: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    if takes_operand_words(gpu, w, &rows, max_rows, n, k) != Some(packing) {
        return Err(CudaError::Unsupported(format!(
            "SwiGLU's gate/up over activations packed as {packing:?} where its kernel reads them otherwise"
        )));
    }
    let path = GemmPath::Auto;
    swiglu_launch(
        path,
        gpu,
        words,
        Some(words),
        row_index,
        row_scale,
        w,
        rows,
        max_rows,
        n,
        k,
        out,
        h,
    )
}

/// The gate/up launch with SwiGLU in its epilogue, over x or (`packed`) operand words.
#[allow(clippy::too_many_arguments)]
fn swiglu_launch(
    path: GemmPath,
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    packed: Option<&CudaSlice<f32>>,
    row_index: Option<&CudaSlice<i32>>,
    row_scale: Option<&CudaSlice<f32>>,
    w: &WeightData,
    rows: GemmRows<'_>,
    max_rows: usize,
    n: usize,
    k: usize,
    out: SwigluOut,
    h: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    if !swiglu_epilogue_runs(gpu, w, &rows, max_rows, n, k, out) {
        return Err(CudaError::Unsupported(format!(
            "SwiGLU in the GEMM epilogue ({out:?}) for these weights and rows (the wgmma kernel only)"
        )));
    }
    if !matches!(path, GemmPath::Auto | GemmPath::Wgmma | GemmPath::WgmmaTma) {
        return Err(CudaError::Unsupported(format!(
            "SwiGLU in the epilogue of a {path:?} launch (the wgmma kernels only)"
        )));
    }
    let mode = LaunchMode {
        swiglu: Some(out),
        packed,
        ..LaunchMode::default()
    };
    let w = Operand::of(gpu, w);
    let split = SplitK::Off;
    launch_gemm(
        path, split, mode, gpu, x, row_index, row_scale, w, rows, max_rows, n, k, h,
    )
    .map(drop)
}

/// [`grouped_gemm`] of activations given as operand words already (`words`, rows of `k / 2`
/// words in the weights' operand type: a [`SwigluOut::Bf16Words`] output, or the NVFP4
/// quantizer's `words` with its row scales as `row_scale`), not packed again: read through
/// `row_index` as [`grouped_gemm`] reads x (the TMA kernel, which reads a plan's rows in its
/// order, has them copied so first). Refused where the launch would not read words of that
/// type ([`takes_operand_words`]).
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_packed(
    gpu: &Gpu,
    words: &CudaSlice<f32>,
    packing: Packing,
    row_index: Option<&CudaSlice<i32>>,
    row_scale: Option<&CudaSlice<f32>>,
    w: &WeightData,
    rows: GemmRows<'_>,
    max_rows: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    if takes_operand_words(gpu, w, &rows, max_rows, n, k) != Some(packing) {
        return Err(CudaError::Unsupported(format!(
            "a GEMM over activations packed as {packing:?} where its kernel reads them otherwise"
        )));
    }
    let (path, split) = (GemmPath::Auto, SplitK::Auto);
    grouped_gemm_packed_on(
        path, split, gpu, words, row_index, row_scale, w, rows, max_rows, n, k, out,
    )
}

/// [`grouped_gemm_packed`] on a chosen kernel that reads packed activations (the tiled, wide
/// and wgmma ones) and split.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_packed_on(
    path: GemmPath,
    split: SplitK,
    gpu: &Gpu,
    words: &CudaSlice<f32>,
    row_index: Option<&CudaSlice<i32>>,
    row_scale: Option<&CudaSlice<f32>>,
    w: &WeightData,
    rows: GemmRows<'_>,
    max_rows: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let mode = LaunchMode {
        packed: Some(words),
        ..LaunchMode::default()
    };
    let w = Operand::of(gpu, w);
    launch_gemm(
        path, split, mode, gpu, words, row_index, row_scale, w, rows, max_rows, n, k, out,
    )
    .map(drop)
}

/// [`grouped_gemm`] on a chosen kernel and split (the tests run each against the CPU).
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_on(
    path: GemmPath,
    split: SplitK,
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
    let (mode, w) = (LaunchMode::default(), Operand::of(gpu, w));
    launch_gemm(
        path, split, mode, gpu, x, row_index, row_scale, w, rows, max_rows, n, k, out,
    )
    .map(drop)
}

/// Whether dense layers `ws` can share one [`dense_gemm_parts`] launch: at most
/// [`GEMM_MAX_PARTS`] of them, of one storage format and (NVFP4) S_dec grouping.
pub fn joinable(ws: &[&WeightData]) -> bool {
    let groups = |w: &WeightData| match w {
        WeightData::Nvfp4 { groups, .. } => *groups,
        _ => 1,
    };
    (1..=GEMM_MAX_PARTS).contains(&ws.len())
        && ws.iter().all(|w| {
            std::mem::discriminant(*w) == std::mem::discriminant(ws[0])
                && groups(w) == groups(ws[0])
        })
}

/// `outs[i] = x W_i^T` over the same `rows` rows of `x` for dense layers that can share a
/// launch ([`joinable`]; the attention's q, k and v), in one launch: the grid covers each
/// layer's columns in turn, and every output has the bits of its own [`grouped_gemm`].
/// `row_scale` is the NVFP4 s_tok of each x row (required for NVFP4).
#[allow(clippy::too_many_arguments)]
pub fn dense_gemm_parts(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    row_scale: Option<&CudaSlice<f32>>,
    ws: &[&WeightData],
    ns: &[usize],
    rows: usize,
    k: usize,
    outs: &mut [&mut CudaSlice<f32>],
) -> Result<(), CudaError> {
    dense_gemm_parts_on(
        GemmPath::Auto,
        SplitK::Auto,
        gpu,
        x,
        row_scale,
        ws,
        ns,
        rows,
        k,
        outs,
    )
}

/// [`dense_gemm_parts`] on a chosen kernel and split (the tests run each against separate
/// launches).
#[allow(clippy::too_many_arguments)]
pub fn dense_gemm_parts_on(
    path: GemmPath,
    split: SplitK,
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    row_scale: Option<&CudaSlice<f32>>,
    ws: &[&WeightData],
    ns: &[usize],
    rows: usize,
    k: usize,
    outs: &mut [&mut CudaSlice<f32>],
) -> Result<(), CudaError> {
    let mode = LaunchMode::default();
    dense_parts(path, split, mode, gpu, x, row_scale, ws, ns, rows, k, outs).map(drop)
}

/// [`dense_gemm_parts`], except that a launch split over K with no NVFP4 epilogue leaves each
/// part's segment sums unfolded and returns them, in part order (as [`grouped_gemm_unfolded`]);
/// none: every output holds its values.
#[allow(clippy::too_many_arguments)]
pub fn dense_gemm_parts_unfolded(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    row_scale: Option<&CudaSlice<f32>>,
    ws: &[&WeightData],
    ns: &[usize],
    rows: usize,
    k: usize,
    outs: &mut [&mut CudaSlice<f32>],
) -> Result<Vec<Unfolded>, CudaError> {
    let mode = LaunchMode {
        unfolded: true,
        ..LaunchMode::default()
    };
    let (path, split) = (GemmPath::Auto, SplitK::Auto);
    dense_parts(path, split, mode, gpu, x, row_scale, ws, ns, rows, k, outs)
}

/// [`grouped_gemm`], except that a launch split over K with no NVFP4 epilogue leaves its
/// segment sums unfolded and returns them ([`Unfolded`]): `out` is then not written; its
/// readers take the sums, or [`fold_unfolded`] writes them. None: `out` holds the values.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_unfolded(
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
) -> Result<Option<Unfolded>, CudaError> {
    let mode = LaunchMode {
        unfolded: true,
        ..LaunchMode::default()
    };
    let w = Operand::of(gpu, w);
    let (path, split) = (GemmPath::Auto, SplitK::Auto);
    launch_gemm(
        path, split, mode, gpu, x, row_index, row_scale, w, rows, max_rows, n, k, out,
    )
}

#[allow(clippy::too_many_arguments)]
fn dense_parts(
    path: GemmPath,
    split: SplitK,
    mode: LaunchMode<'_>,
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    row_scale: Option<&CudaSlice<f32>>,
    ws: &[&WeightData],
    ns: &[usize],
    rows: usize,
    k: usize,
    outs: &mut [&mut CudaSlice<f32>],
) -> Result<Vec<Unfolded>, CudaError> {
    if ns.len() != ws.len() || outs.len() != ws.len() {
        return Err(CudaError::Unsupported(
            "a part of a joined GEMM launch without its columns or output".into(),
        ));
    }
    let parts: Vec<GemmPart<'_>> = ws
        .iter()
        .zip(ns)
        .zip(outs.iter())
        .map(|((w, &n), out)| GemmPart {
            w: Operand::of(gpu, w),
            n,
            out,
        })
        .collect();
    launch_parts(
        path,
        split,
        gpu,
        x,
        None,
        row_scale,
        &parts,
        GemmRows::Dense(rows),
        rows,
        k,
        mode,
    )
}

/// `out = x T^T` for the embedding table T read as the tied lm_head (`[n, k]`), on the
/// kernels of its format: the same products as a BF16 or F32 [`WeightData`] of the same values.
pub fn table_gemm(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    table: &Table,
    m: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let w = match table {
        Table::Bf16(t) => Operand::bf16(gpu, t),
        Table::F32(t) => Operand::f32(gpu, t),
    };
    let (path, split, mode) = (GemmPath::Auto, SplitK::Auto, LaunchMode::default());
    launch_gemm(
        path,
        split,
        mode,
        gpu,
        x,
        None,
        None,
        w,
        GemmRows::Dense(m),
        m,
        n,
        k,
        out,
    )
    .map(drop)
}

/// Where word `j` (k = 2j, 2j + 1) of a row of the tiled kernel's packed operand is stored
/// (kernels/gemm.cu `packed_word`): each 16-word span's words transposed as a 4x4 matrix, so
/// that the kernel's `ldmatrix` hands every lane its mma fragment whole.
pub fn packed_word(j: usize) -> usize {
    (j & !15) | (j & 3) << 2 | (j & 15) >> 2
}

/// How the tiled and wgmma kernels take a launch's activations (kernels/gemm.cu
/// `pack_gemm_operand`, `F16_OPERANDS`): the tensor cores' operand type follows the weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    /// BF16 and MXFP8 weights: each value rounded to BF16 (nearest even; MXFP8's quantized
    /// activations are exact in it).
    Bf16 = 0,
    /// NVFP4 weights: each value as FP16 (its quantizer's values are exact in it).
    F16 = 1,
}

/// The tiled kernel's A operand: `rows` rows of `x` (`k` wide, a multiple of 32) as 16-bit pairs
/// (`k / 2` words a row) in [`packed_word`]'s order, per [`Packing`], rounded to nearest even.
pub fn pack_gemm_operand(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    rows: usize,
    k: usize,
    packing: Packing,
    out: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    pack_gemm_operand_rows(gpu, x, None, rows, k, packing, out)
}

/// [`pack_gemm_operand`] of rows `row_index[r]` of `x` for r in 0..`rows` (every row in order
/// without an index): the TMA kernel's operand, a routing plan's rows in its order. The index
/// is the plan's (its bounds kept by the plan's owner).
pub fn pack_gemm_operand_rows(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    row_index: Option<&CudaSlice<i32>>,
    rows: usize,
    k: usize,
    packing: Packing,
    out: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let words = rows * k / 2;
    let x = match row_index {
        Some(_) => View::whole(x),
        None => need(x, rows * k, "gemm operand x")?,
    };
    let out = need(out, words, "gemm operand")?;
    launch_pack(gpu, x, row_index, rows, k, packing as i32, out)
}

/// `pack_gemm_operand`'s mode that copies rows of operand words already packed (x holds them,
/// `k / 2` a row), through the row index (kernels/gemm.cu).
const PACK_COPY_WORDS: i32 = 2;

/// The `pack_gemm_operand` launch: `rows` rows of `out` from x (row `row_index[r]` where an
/// index is given) in `mode` ([`Packing`] as i32, or [`PACK_COPY_WORDS`]).
fn launch_pack(
    gpu: &Gpu,
    x: View<'_, f32>,
    row_index: Option<&CudaSlice<i32>>,
    rows: usize,
    k: usize,
    mode: i32,
    out: View<'_, u32>,
) -> Result<(), CudaError> {
    // A block a row (rows past grid_for's cap taken in turn), a thread a 16-byte piece (8
    // values) of it at a time.
    let block = (k / 8).clamp(32, 256) as u32;
    gpu.launch(
        Kernel::PackGemmOperand,
        (gpu.grid_for(rows, 1), 1, 1),
        block,
        (
            x,
            row_index.map(View::whole),
            rows as i32,
            k as i32,
            mode,
            out,
        ),
    )
}

/// One weight matrix of a launch: its weights (in the launch's format), columns and output.
struct GemmPart<'a> {
    w: Operand<'a>,
    n: usize,
    out: &'a CudaSlice<f32>,
}

/// The most matrices one launch takes side by side (kernels/gemm.cu `gemm_part`).
pub const GEMM_MAX_PARTS: usize = 3;

/// What a launch writes and where its activations come from: the sums from x (the default),
/// SwiGLU's h from a gate/up matrix (the wgmma kernel's epilogue), or the sums from
/// activations packed already.
#[derive(Clone, Copy, Default)]
struct LaunchMode<'a> {
    swiglu: Option<SwigluOut>,
    /// Operand words (rows of k / 2, in the weights' operand type) to read instead of packing x.
    packed: Option<&'a CudaSlice<f32>>,
    /// A launch split over K leaves its segment sums unfolded ([`Unfolded`]) where no part
    /// has an NVFP4 epilogue.
    unfolded: bool,
}

/// [`launch_parts`] of one matrix: its segment sums where `mode` leaves them.
#[allow(clippy::too_many_arguments)]
fn launch_gemm(
    path: GemmPath,
    split: SplitK,
    mode: LaunchMode<'_>,
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    row_index: Option<&CudaSlice<i32>>,
    row_scale: Option<&CudaSlice<f32>>,
    w: Operand<'_>,
    rows: GemmRows<'_>,
    max_rows: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
) -> Result<Option<Unfolded>, CudaError> {
    let parts = [GemmPart { w, n, out }];
    let left = launch_parts(
        path, split, gpu, x, row_index, row_scale, &parts, rows, max_rows, k, mode,
    )?;
    Ok(left.into_iter().next())
}

/// One launch over `parts` (1 to [`GEMM_MAX_PARTS`] matrices of one format and S_dec grouping,
/// over the same rows of `x`): the grid's column blocks cover each part's columns in turn, and
/// each block computes what a launch of its part alone would, so every part's output has the
/// bits of its own launch. The path is picked for the parts' columns together. `mode`: see
/// [`LaunchMode`] (its callers check that the path takes it).
#[allow(clippy::too_many_arguments)]
fn launch_parts(
    path: GemmPath,
    split: SplitK,
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    row_index: Option<&CudaSlice<i32>>,
    row_scale: Option<&CudaSlice<f32>>,
    parts: &[GemmPart<'_>],
    rows: GemmRows<'_>,
    max_rows: usize,
    k: usize,
    mode: LaunchMode<'_>,
) -> Result<Vec<Unfolded>, CudaError> {
    let Some(w) = parts
        .first()
        .map(|p| &p.w)
        .filter(|_| parts.len() <= GEMM_MAX_PARTS)
    else {
        return Err(CudaError::Unsupported(format!(
            "a GEMM launch over {} matrices (1 to {GEMM_MAX_PARTS})",
            parts.len()
        )));
    };
    if parts
        .iter()
        .any(|p| p.w.kernels != w.kernels || p.w.groups != w.groups)
    {
        return Err(CudaError::Unsupported(
            "one GEMM launch over matrices of different formats or S_dec groups".into(),
        ));
    }
    if w.s_dec.is_some() && row_scale.is_none() {
        return Err(CudaError::Capacity(
            "NVFP4 GEMM needs the row scales".into(),
        ));
    }
    let n: usize = parts.iter().map(|p| p.n).sum();
    let path = path.resolve(wgmma_allowed(gpu), w, &rows, max_rows, n, k);
    // The TMA kernel has the wgmma kernel's grid and tiles; it is taken below once the split is
    // known.
    let tma = path == GemmPath::WgmmaTma;
    let path = if tma { GemmPath::Wgmma } else { path };
    let (kernel, cols_per_block, threads) = match path {
        GemmPath::TensorCore => (w.kernels[1], MMA_TILE_COLS, 128),
        GemmPath::TensorCoreWide => (w.kernels[4], MMA_TILE_COLS, 4 * GEMM_WIDE_TILE_ROWS as u32),
        // Two warpgroups of 64 columns over a pair tile's 128 rows (two wide tiles').
        GemmPath::Wgmma => match mode.swiglu {
            None => (w.kernels[5], MMA_TILE_COLS, 256),
            // (The same grid: 64 h columns a block of 2 x 64 weight rows.)
            Some(out) => match w.swiglu_kernel(out) {
                Some(kernel) => (kernel, MMA_TILE_COLS, 256),
                None => {
                    return Err(CudaError::Unsupported(format!(
                        "no SwiGLU epilogue writing {out:?} for these weights"
                    )))
                }
            },
        },
        GemmPath::Wgmma64 => (w.wgmma64_kernel(), MMA_TILE_COLS, 256),
        GemmPath::Skinny4 => (w.kernels[3], 4 * SKINNY_COLS_PER_BLOCK, 128),
        // A 32-column group a block, its K segments over the block's 8 warps; or 8 columns a
        // block, a warp a segment (up to 8).
        GemmPath::SkinnyKSplit if block_split_narrow(tile_rows_of(&rows)) => (
            w.narrow_block_split_kernel(),
            8,
            32 * k.div_ceil(K_SEGMENT).min(BLOCK_SPLIT_THREADS as usize / 32) as u32,
        ),
        GemmPath::SkinnyKSplit => (w.kernels[6], 32, BLOCK_SPLIT_THREADS),
        GemmPath::Skinny => (w.kernels[2], SKINNY_COLS_PER_BLOCK, 128),
        _ => (w.kernels[0], GEMM_TILE_COLS, 256),
    };
    // A plan's launch takes `max_rows` (its pairs) as the row count of split-K's sums.
    // The tiles a block: the wgmma (and TMA) kernels' of two wide tiles' rows.
    let tile_rows = match path {
        GemmPath::Wgmma => PAIR_TILE_ROWS,
        GemmPath::TensorCoreWide | GemmPath::Wgmma64 => GEMM_WIDE_TILE_ROWS,
        _ => GEMM_TILE_ROWS,
    };
    let (tiles, num_tiles, offsets, experts, rows_arg, grid_y) = match rows {
        GemmRows::Dense(r) => (None, None, None, 0, r, r.div_ceil(tile_rows)),
        GemmRows::Plan(p) => {
            let (list, count, launched) = match path {
                GemmPath::Wgmma => (&p.pair_tiles, &p.num_pair_tiles, p.pair_tiles_launched()),
                GemmPath::TensorCoreWide => {
                    (&p.wide_tiles, &p.num_wide_tiles, p.wide_tiles_launched())
                }
                _ => (&p.tiles, &p.num_tiles, p.tiles_launched()),
            };
            (
                Some(View::whole(list)),
                Some(View::whole(count)),
                Some(View::whole(&p.offsets)),
                p.counts.len(),
                max_rows,
                launched,
            )
        }
    };
    if grid_y == 0 || n == 0 {
        return Ok(Vec::new());
    }
    let outs = parts
        .iter()
        .map(|p| {
            // SwiGLU's h: a value (F32) or half a word (BF16 words) per h column, n / 2 of them.
            let len = match mode.swiglu {
                None => max_rows * p.n,
                Some(SwigluOut::F32) => max_rows * p.n / 2,
                Some(SwigluOut::Bf16Words) => max_rows * p.n / 4,
            };
            need(p.out, len, "gemm out")
        })
        .collect::<Result<Vec<_>, _>>()?;
    let grid_x: usize = parts.iter().map(|p| p.n.div_ceil(cols_per_block)).sum();
    if mode.swiglu.is_some() && (path != GemmPath::Wgmma || parts.len() != 1) {
        return Err(CudaError::Unsupported(format!(
            "SwiGLU in the epilogue of a {path:?} launch of {} matrices (wgmma, one matrix)",
            parts.len()
        )));
    }
    // A SwiGLU epilogue needs whole sums: no split.
    let split = if mode.swiglu.is_some() {
        SplitK::Off
    } else {
        split
    };
    let segments = split.segments(path, &rows, grid_x * grid_y, rows_arg, n, k);
    if tma && segments.is_none() && !matches!((&rows, row_index), (GemmRows::Dense(_), Some(_))) {
        let grid_x: usize = parts.iter().map(|p| p.n.div_ceil(TMA_COLS)).sum();
        let grid = (grid_x as u32, grid_y as u32, 1);
        return launch_tma(
            gpu, x, row_index, row_scale, parts, &outs, &rows, rows_arg, k, grid, mode,
        )
        .map(|()| Vec::new());
    }
    let mut guard = gpu
        .gemm_scratch
        .lock()
        .map_err(|_| CudaError::Capacity("the GEMM scratch lock is poisoned".into()))?;
    let scratch = &mut *guard;
    let partials = match segments {
        Some(s) => Some(&*grown(
            gpu,
            &mut scratch.partials,
            &mut scratch.generation,
            s * rows_arg * n,
        )?),
        None => None,
    };
    // Regions of few rows are folded in the launch (a counter per block, or per warp of the
    // few-rows kernels, 4 a block); others by gemm_fold_segments, a thread per element.
    let fold_in_launch = match &rows {
        GemmRows::Dense(r) => *r <= FOLD_IN_LAUNCH_MAX_ROWS,
        GemmRows::Plan(p) => p.tokens <= FOLD_IN_LAUNCH_MAX_ROWS,
    };
    // Sums left for the readers: no fold in the launch or after it.
    let unfolded = mode.unfolded && segments.is_some() && parts.iter().all(|p| p.w.s_dec.is_none());
    let counters = match segments {
        Some(_) if fold_in_launch && !unfolded => Some(&*grown(
            gpu,
            &mut scratch.counters,
            &mut scratch.generation,
            (grid_x * grid_y * 4).max(SPLIT_K_COUNTERS),
        )?),
        _ => None,
    };
    // SplitK::OneWave (and Auto, unless LOCKSTEP_SPLIT_ONE_WAVE=0) on a dense wgmma launch
    // folded after it: the blocks along K that keep it within one wave, each walking a run of
    // segments.
    let one_wave = split == SplitK::OneWave || (split == SplitK::Auto && one_wave_switched_on());
    let runs = match (segments, path, &rows) {
        (Some(s), GemmPath::Wgmma | GemmPath::Wgmma64, GemmRows::Dense(_))
            if one_wave && counters.is_none() && mode.swiglu.is_none() =>
        {
            let per_sm = if path == GemmPath::Wgmma64 { 2 } else { 1 };
            let z = one_wave_blocks(grid_x * grid_y, s, per_sm * gpu.sm_count as usize);
            (z < s).then_some(z)
        }
        _ => None,
    };
    let kernel = match runs {
        Some(_) => w.wgmma_runs_kernel(path == GemmPath::Wgmma64),
        None => kernel,
    };
    // The tiled kernel reads x packed to BF16: every row the rows (through row_index) name.
    let reads_words = matches!(
        path,
        GemmPath::TensorCore | GemmPath::TensorCoreWide | GemmPath::Wgmma | GemmPath::Wgmma64
    );
    let x_rows = match (&rows, row_index) {
        (GemmRows::Dense(r), None) => *r,
        (GemmRows::Plan(p), Some(_)) => p.tokens,
        (GemmRows::Plan(p), None) => p.pairs,
        (GemmRows::Dense(_), Some(_)) => x.len() / k,
    };
    if mode.packed.is_some() && !reads_words {
        return Err(CudaError::Unsupported(format!(
            "packed activations for a {path:?} launch"
        )));
    }
    let operand = if reads_words {
        let packing = w.packing;
        let operand = (&mut scratch.operand, &mut scratch.generation);
        operand_words(gpu, operand, mode.packed, x, None, x_rows, k, packing)?
    } else {
        DevPtr(0)
    };
    // Parts 2 and 3 of the launch (absent: null weights and no columns).
    let extra = |i: usize| match parts.get(i) {
        Some(p) => (p.w.data, p.w.scales, p.w.s_dec, Some(outs[i]), p.n as i32),
        None => (DevPtr(0), None, None, None, 0),
    };
    let (w2, scales2, sdec2, out2, n2) = extra(1);
    let (w3, scales3, sdec3, out3, n3) = extra(2);
    // Block shapes (kernels/gemm.cu): FFMA 32x64 tiles on 256 threads, MMA 32x128 tiles on 4
    // warps (64x128 on 8, or on two warpgroups for wgmma), few-rows MMA 32 or 128 columns on
    // 4 warps; split-K adds a block per segment.
    // x, its row index and scales, and the weights are read at the rows and experts the plan
    // (or the dense row count) names: sized by the layer's owner.
    gpu.launch(
        kernel,
        (
            grid_x as u32,
            grid_y as u32,
            runs.or(segments).unwrap_or(1) as u32,
        ),
        threads,
        (
            View::whole(x),
            row_index.map(View::whole),
            row_scale.map(View::whole),
            w.data,
            w.scales,
            w.s_dec,
            w.groups as i32,
            tiles,
            num_tiles,
            offsets,
            rows_arg as i32,
            parts[0].n as i32,
            k as i32,
            outs[0],
            partials.map(View::whole),
            operand,
            counters.map(View::whole),
            w2,
            scales2,
            sdec2,
            out2,
            n2,
            w3,
            scales3,
            sdec3,
            out3,
            n3,
        ),
    )?;
    let (Some(segments), Some(partials), None) = (segments, partials, counters) else {
        return Ok(Vec::new());
    };
    // Each part's sums follow the previous part's ([segments][rows][n] each).
    let mut sums = addr(gpu, partials);
    if unfolded {
        let mut left = Vec::with_capacity(parts.len());
        for p in parts {
            let stride = rows_arg * p.n;
            left.push(Unfolded {
                sums,
                segments,
                stride,
            });
            sums += (segments * stride * std::mem::size_of::<f32>()) as u64;
        }
        return Ok(left);
    }
    if parts.len() > 1 && parts.iter().all(|p| p.w.s_dec.is_none()) && joined_fold_chosen() {
        return fold_parts(gpu, sums, segments, rows_arg, parts, &outs).map(|()| Vec::new());
    }
    for (p, out) in parts.iter().zip(outs) {
        let epilogue = match (p.w.s_dec, row_scale) {
            (Some(s_dec), Some(row_scale)) => Some(FoldEpilogue {
                row_index: row_index.map(View::whole),
                row_scale: View::whole(row_scale),
                s_dec,
                groups: p.w.groups,
                offsets,
                experts,
            }),
            _ => None,
        };
        fold_segments(gpu, sums, segments, rows_arg, p.n, epilogue, out)?;
        sums += (segments * rows_arg * p.n * std::mem::size_of::<f32>()) as u64;
    }
    Ok(Vec::new())
}

/// The NVFP4 epilogue a fold applies to the added segments (kernels/gemm.cu
/// `gemm_fold_segments`): each row's activation scale (through the routed rows' index), the
/// weights' S_dec of the column's group, the expert found through the plan's offsets.
struct FoldEpilogue<'a> {
    row_index: Option<View<'a, i32>>,
    row_scale: View<'a, f32>,
    s_dec: View<'a, f32>,
    groups: usize,
    offsets: Option<View<'a, i32>>,
    experts: usize,
}

/// Adds `segments` segment sums of `rows` x `n` at device address `sums` in segment order into
/// `out` (a buffer or an address), then applies `epilogue` where given: what the launch's own
/// fold writes.
fn fold_segments<O: KernelArg>(
    gpu: &Gpu,
    sums: u64,
    segments: usize,
    rows: usize,
    n: usize,
    epilogue: Option<FoldEpilogue<'_>>,
    out: O,
) -> Result<(), CudaError> {
    let count = rows * n;
    let (row_index, row_scale, s_dec, groups, offsets, experts) = match epilogue {
        Some(e) => (
            e.row_index,
            Some(e.row_scale),
            Some(e.s_dec),
            e.groups,
            e.offsets,
            e.experts,
        ),
        None => (None, None, None, 1, None, 0),
    };
    gpu.launch(
        Kernel::GemmFoldSegments,
        (count.div_ceil(256) as u32, 1, 1),
        256,
        (
            DevPtr(sums),
            segments as i32,
            rows as i32,
            n as i32,
            row_index,
            row_scale,
            s_dec,
            groups as i32,
            offsets,
            experts as i32,
            out,
        ),
    )
}

/// Whether the parts of a joined launch without an epilogue (q, k and v) are folded in one
/// launch (`gemm_fold_parts`) rather than one a part: unless `LOCKSTEP_JOINED_FOLD=0` (the bits
/// are the same either way). H100, 2026-12-06: decode steps at 32 rows 0.8% (BF16) and 1.4%
/// (NVFP4) faster, at 64 and 128 rows within the spread (docs/performance.md).
fn joined_fold_chosen() -> bool {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switched_on(&CHOSEN, "LOCKSTEP_JOINED_FOLD")
}

/// [`fold_segments`] of every part of a joined launch (2 or 3, no epilogue) in one launch: the
/// parts' sums one after another at device address `sums`, each added in segment order into
/// its output.
fn fold_parts(
    gpu: &Gpu,
    sums: u64,
    segments: usize,
    rows: usize,
    parts: &[GemmPart<'_>],
    outs: &[View<'_, f32>],
) -> Result<(), CudaError> {
    let part = |i: usize| match (parts.get(i), outs.get(i)) {
        (Some(p), Some(&out)) => (p.n as i32, Some(out)),
        _ => (0, None),
    };
    let ((n0, out0), (n1, out1), (n2, out2)) = (part(0), part(1), part(2));
    let count = rows * parts.iter().map(|p| p.n).sum::<usize>();
    gpu.launch(
        Kernel::GemmFoldParts,
        (count.div_ceil(256) as u32, 1, 1),
        256,
        (
            DevPtr(sums),
            segments as i32,
            rows as i32,
            n0,
            out0,
            n1,
            out1,
            n2,
            out2,
        ),
    )
}

/// The operand words a launch reads (`x_rows` rows of `k / 2`): `given` (packed already, for
/// `packing`: the caller's word, checked by [`grouped_gemm_packed`]; its rows `row_index`
/// names copied in order into the scratch's operand buffer where an index is given), or else
/// rows of `x` (row `row_index[r]` for r where an index is given) packed for `packing` into
/// the scratch's operand buffer (`scratch`: it and the scratch's generation).
#[allow(clippy::too_many_arguments)]
fn operand_words(
    gpu: &Gpu,
    scratch: (&mut Option<CudaSlice<u32>>, &mut u64),
    given: Option<&CudaSlice<f32>>,
    x: &CudaSlice<f32>,
    row_index: Option<&CudaSlice<i32>>,
    x_rows: usize,
    k: usize,
    packing: Packing,
) -> Result<DevPtr, CudaError> {
    let words = x_rows * k / 2;
    if let (Some(given), None) = (given, row_index) {
        // Two 16-bit values a word, in an f32 buffer's memory.
        return Ok(DevPtr(need(given, words, "packed gemm operand")?.addr(gpu)));
    }
    let packed = grown(gpu, scratch.0, scratch.1, words)?;
    match given {
        // The rows the index names, copied in its order.
        Some(given) => {
            let out = need(packed, words, "gathered gemm operand")?;
            launch_pack(
                gpu,
                View::whole(given),
                row_index,
                x_rows,
                k,
                PACK_COPY_WORDS,
                out,
            )?;
        }
        None => pack_gemm_operand_rows(gpu, x, row_index, x_rows, k, packing, packed)?,
    }
    Ok(DevPtr(addr(gpu, packed)))
}

/// The TMA kernel's launch ([`GemmPath::WgmmaTma`], no split) over `parts`, on the wgmma
/// kernel's grid: the activations packed with a plan's rows in its order (or given packed, in
/// that order), then tensor maps of them (64-row boxes of a span's 64 bytes, in the 64-byte
/// swizzle) and of each part's weights (64-row boxes of a span, unswizzled).
#[allow(clippy::too_many_arguments)]
fn launch_tma(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    row_index: Option<&CudaSlice<i32>>,
    row_scale: Option<&CudaSlice<f32>>,
    parts: &[GemmPart<'_>],
    outs: &[View<'_, f32>],
    rows: &GemmRows<'_>,
    rows_arg: usize,
    k: usize,
    grid: (u32, u32, u32),
    mode: LaunchMode<'_>,
) -> Result<(), CudaError> {
    let w = &parts[0].w;
    let kernel = w.tma_kernel(mode.swiglu).ok_or_else(|| {
        CudaError::Unsupported(format!(
            "no TMA kernel writing {:?} for these weights",
            mode.swiglu
        ))
    })?;
    let (tiles, num_tiles, offsets, x_rows, experts) = match rows {
        GemmRows::Dense(r) => (None, None, None, *r, 1),
        GemmRows::Plan(p) => (
            Some(View::whole(&p.pair_tiles)),
            Some(View::whole(&p.num_pair_tiles)),
            Some(View::whole(&p.offsets)),
            p.pairs,
            p.counts.len(),
        ),
    };
    let mut guard = gpu
        .gemm_scratch
        .lock()
        .map_err(|_| CudaError::Capacity("the GEMM scratch lock is poisoned".into()))?;
    let scratch = &mut *guard;
    let (given, packing) = (mode.packed, w.packing);
    let operand = (&mut scratch.operand, &mut scratch.generation);
    let operand = operand_words(gpu, operand, given, x, row_index, x_rows, k, packing)?;
    let x_map = tensor_map(operand.0, 2 * k, x_rows, 64 * TMA_SPANS)?;
    let (row_bytes, span_bytes) = w.row_bytes(k);
    let mut w_maps = [x_map; GEMM_MAX_PARTS];
    for (map, p) in w_maps.iter_mut().zip(parts) {
        *map = tensor_map(
            p.w.data.0,
            row_bytes,
            experts * p.n,
            span_bytes as u32 * TMA_SPANS,
        )?;
    }
    let extra = |i: usize| match parts.get(i) {
        Some(p) => (p.w.scales, p.w.s_dec, Some(outs[i]), p.n as i32),
        None => (None, None, None, 0),
    };
    let (scales2, sdec2, out2, n2) = extra(1);
    let (scales3, sdec3, out3, n3) = extra(2);
    gpu.launch(
        kernel,
        grid,
        TMA_THREADS,
        (
            x_map,
            w_maps[0],
            w_maps[1],
            w_maps[2],
            row_index.map(View::whole),
            row_scale.map(View::whole),
            w.scales,
            w.s_dec,
            w.groups as i32,
            tiles,
            num_tiles,
            offsets,
            rows_arg as i32,
            parts[0].n as i32,
            k as i32,
            outs[0],
            scales2,
            sdec2,
            out2,
            n2,
            scales3,
            sdec3,
            out3,
            n3,
        ),
    )
}

/// A tensor map of `rows` rows of `row_bytes` bytes from device address `base`, read in boxes
/// of 64 rows x `box_bytes` (zeros past its last row and byte), in the swizzle of the box's
/// width (32, 64 or 128 bytes; none for 16): the layout the wgmma descriptors read and
/// kernels/gemm.cu `tma_w_offset` addresses.
fn tensor_map(
    base: u64,
    row_bytes: usize,
    rows: usize,
    box_bytes: u32,
) -> Result<TensorMap, CudaError> {
    tensor_map_boxes(base, row_bytes, rows, box_bytes, 64)
}

/// [`tensor_map`] with boxes of `box_rows` rows (at most 256).
pub(crate) fn tensor_map_boxes(
    base: u64,
    row_bytes: usize,
    rows: usize,
    box_bytes: u32,
    box_rows: u32,
) -> Result<TensorMap, CudaError> {
    use cudarc::driver::sys;
    use sys::CUtensorMapSwizzle as Swizzle;
    let swizzle = match box_bytes {
        16 => Swizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        32 => Swizzle::CU_TENSOR_MAP_SWIZZLE_32B,
        64 => Swizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        128 => Swizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        _ => {
            return Err(CudaError::Capacity(format!(
                "no TMA swizzle for {box_bytes}-byte rows"
            )))
        }
    };
    let dims = [row_bytes as u64, rows as u64];
    let strides = [row_bytes as u64];
    let boxes = [box_bytes, box_rows];
    let steps = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: the arrays hold the rank's (2) entries the call reads; `map` is written by it.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            2,
            base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?;
    }
    // SAFETY: initialized by the successful call above.
    Ok(TensorMap(unsafe { map.assume_init() }.opaque))
}

/// Writes the values of a launch's segment sums ([`Unfolded`], `rows` x `n`) into its output:
/// what the launch's own fold would have written (no NVFP4 epilogue: such launches fold).
pub fn fold_unfolded(
    gpu: &Gpu,
    sums: Unfolded,
    rows: usize,
    n: usize,
    out: DevPtr,
) -> Result<(), CudaError> {
    if sums.stride != rows * n {
        return Err(CudaError::Capacity(format!(
            "segment sums of {} elements folded as {rows} x {n}",
            sums.stride
        )));
    }
    fold_segments(gpu, sums.sums, sums.segments, rows, n, None, out)
}

#[cfg(test)]
mod tests {
    use super::{one_wave_blocks, packed_word};

    /// A split launch's blocks along K under `SplitK::OneWave`: within the wave where runs can
    /// make it fit, every segment in exactly one run (runs of ceil(segments / blocks), the last
    /// possibly shorter but not empty), and a block a segment where that fits already or where
    /// even one run of all of K would not.
    #[test]
    fn one_wave_runs_cover_every_segment_once_within_the_wave() {
        // o_proj at 256 rows on an H200: 32 tiles of 128 x 128, 16 segments, 132 SMs.
        assert_eq!(one_wave_blocks(32, 16, 132), 4);
        // At 128 rows: 16 tiles, runs of two.
        assert_eq!(one_wave_blocks(16, 16, 132), 8);
        // Already within the wave, or more tiles than the wave: a block a segment.
        assert_eq!(one_wave_blocks(8, 16, 132), 16);
        assert_eq!(one_wave_blocks(200, 16, 132), 16);
        for tiles in 1..300 {
            for segments in 1..40 {
                let wave = 132;
                let z = one_wave_blocks(tiles, segments, wave);
                assert!(
                    (1..=segments).contains(&z),
                    "{tiles} tiles, {segments} segments"
                );
                if z == segments {
                    continue;
                }
                assert!(tiles * z <= wave, "{tiles} tiles x {z} past the wave");
                // The kernel's runs (block_k_run): ceil(segments / z) each.
                let per = segments.div_ceil(z);
                let runs: Vec<usize> = (0..z)
                    .map(|b| (segments - (b * per).min(segments)).min(per))
                    .collect();
                assert!(runs.iter().all(|&r| r > 0), "an empty run: {runs:?}");
                assert_eq!(runs.iter().sum::<usize>(), segments);
            }
        }
    }

    /// The packed order is a permutation of each 16-word span, and piece `s` (words 4s..4s+3
    /// as stored) holds words s, s + 4, s + 8, s + 12: lane t of an `ldmatrix` row of piece 2c
    /// (2c + 1) gets word 4t + 2c (4t + 2c + 1), the K chain's slots of chunk c.
    #[test]
    fn packed_words_put_each_fragment_in_one_piece() {
        for span in 0..3 {
            let base = 16 * span;
            let mut seen = [false; 16];
            for j in base..base + 16 {
                let at = packed_word(j);
                assert!((base..base + 16).contains(&at), "word {j} leaves its span");
                assert!(
                    !std::mem::replace(&mut seen[at - base], true),
                    "two words at {at}"
                );
            }
            for c in 0..2 {
                for t in 0..4 {
                    assert_eq!(packed_word(base + 4 * t + 2 * c), base + 4 * (2 * c) + t);
                    assert_eq!(
                        packed_word(base + 4 * t + 2 * c + 1),
                        base + 4 * (2 * c + 1) + t
                    );
                }
            }
        }
    }
}
