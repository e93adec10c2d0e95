//! [`Backend`] on a CUDA device: weights, KV cache and activations in GPU memory, each op one
//! or a few launches of the kernels in kernels/*.cu on the one engine stream. The kernel-choice
//! policy (which GEMM and attention kernel per launch) lives here and nowhere else. Every
//! choice it makes is between kernels that give a row the same bits (docs/determinism.md): a
//! row's result never depends on the batch it is in.
//!
//! Every buffer is allocated once, for the largest step the engine will run ([`CudaSizes`]);
//! a step only copies its small metadata in and its routed-expert ids and either its logits
//! or its sampled tokens out.

use cudarc::driver::CudaSlice;

use super::args::DevPtr;
use super::block_scaled::{BlockFormat, BlockScaledGemm};
use super::graphs::StepGraphs;
use super::ops::{
    self, AttnRows, AttnShape, GemmRows, MoePlan, Nvfp4Out, SwigluOut, Table, Unfolded,
};
use super::sampling::{DeviceSampler, MAX_DEVICE_TOP_LOGPROBS};
use super::weights::{Activation, GpuMatrix};
use super::{CudaError, Gpu};
use crate::backend::step::{Backend, Buffers, Dims, Logits, MoeShape, Sampled, StepPlan};
use crate::backend::trace::{ExpertTrace, MoeTrace, SwiGluTrace};
use crate::sampling::{self, SampleInput, SamplerScratch};

/// A dense SwiGLU on the device: gate and up stacked in one matrix (`[2 * inter, hidden]`).
pub struct CudaSwiGlu {
    pub gate_up: GpuMatrix,
    pub down: GpuMatrix,
    pub inter: usize,
}

/// An MoE layer's experts on the device: every expert's gate+up, and every down, stacked.
pub struct CudaExperts {
    pub gate_up: GpuMatrix,
    pub down: GpuMatrix,
    pub inter: usize,
    pub count: usize,
}

/// What the engine asks of the device.
#[derive(Clone, Copy, Debug)]
pub struct CudaSizes {
    /// Tokens per step (the chunked-prefill budget).
    pub max_batch_tokens: usize,
    /// Sequences per step.
    pub max_running_requests: usize,
    pub block_size: usize,
    pub max_context_len: usize,
    /// Share of device memory for weights + KV cache (SGLang's `--mem-fraction-static`).
    pub mem_fraction_static: f32,
    /// Upper bound on KV tokens, if the user set one.
    pub max_total_tokens: Option<usize>,
    /// On Blackwell (sm_100), run the MXFP8/NVFP4 GEMMs on cuBLASLt's block-scaled kernels
    /// (block_scaled.rs): faster there, but cuBLASLt picks its algorithm by shape, so a row's
    /// bits may depend on the batch. Off by default; no effect elsewhere.
    pub block_scaled_gemm: bool,
    /// Decode steps of up to this many sequences run on CUDA graphs, padded to the row counts
    /// of [`super::graphs::GRAPH_ROWS`] (SGLang's `--cuda-graph-max-bs`); 0: never.
    pub graph_max_rows: usize,
}

/// The model shapes the device buffers are planned for.
#[derive(Clone, Copy, Debug)]
pub struct ModelShape {
    pub dims: Dims,
    pub num_layers: usize,
    /// The dense MLPs' intermediate size.
    pub intermediate: usize,
    pub moe: Option<MoeShape>,
    pub moe_layers: usize,
}

impl ModelShape {
    fn pairs(&self, rows: usize) -> usize {
        rows * self.moe.map_or(1, |m| m.top_k.max(1))
    }
    fn widest_inter(&self) -> usize {
        self.intermediate.max(self.moe.map_or(0, |m| m.inter))
    }
}

/// The paged BF16 KV cache: per layer, `[blocks, block_size, kv_heads, head_dim]`, with one
/// block more than the `num_blocks` the pool hands out: the padding rows of a recorded decode
/// step (see [`super::graphs`]) write and read there.
pub struct CudaKv {
    pub k: Vec<CudaSlice<u16>>,
    pub v: Vec<CudaSlice<u16>>,
    pub num_blocks: usize,
}

impl CudaKv {
    /// The block no sequence owns, for padding rows.
    pub fn padding_block(&self) -> u32 {
        self.num_blocks as u32
    }
}

/// One MoE layer's routing on the device, and every layer's kept ids.
pub struct CudaRoute {
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    plan: MoePlan,
    /// The replayed experts of this layer, uploaded.
    replay: CudaSlice<i32>,
    /// `[moe_layer][row][k]`.
    kept: CudaSlice<i32>,
    rows: usize,
    top_k: usize,
}

/// The lm_head runs on at most this many rows at a time (a step asking for input logprobs of
/// a long chunk needs logits for every row; the vocabulary makes each row large).
const LOGIT_CHUNK_ROWS: usize = 256;

/// A step's metadata on the device.
struct Meta {
    tokens: CudaSlice<u32>,
    pos: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    row_seq: CudaSlice<i32>,
    table_offsets: CudaSlice<i32>,
    block_tables: CudaSlice<i32>,
    logit_rows: CudaSlice<i32>,
    /// Tiles of the tensor-core prefill attention (`ops::prefill_tiles`).
    attn_tiles: CudaSlice<i32>,
    /// The rows of single-row sequences (decode), for the tensor-core decode attention.
    decode_rows: CudaSlice<i32>,
}

/// Buffers of the activation quantizers.
struct QuantScratch {
    data: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    deq: CudaSlice<f32>,
    row_scale: CudaSlice<f32>,
    amax: CudaSlice<u32>,
    /// The Blackwell block-scaled GEMMs (sm_100 only; compiled, never run: see block_scaled.rs).
    block_scaled: Option<BlockScaledGemm>,
}

/// This step's attention launches (set by `begin`, from the plan).
#[derive(Clone, Copy, Debug, Default)]
struct AttentionPlan {
    /// Tiles of up to 64 rows of the sequences with more than one row.
    prefill_tiles: usize,
    /// Rows of single-row sequences.
    decode_rows: usize,
    /// The shape has no tensor-core kernel: one CUDA-core block per (row, head) for every row.
    per_row: bool,
}

/// The attention kernels' shape of a model with these dims over blocks of `block_size` tokens.
fn attn_shape(d: &Dims, block_size: usize) -> AttnShape {
    AttnShape {
        heads: d.heads,
        kv_heads: d.kv_heads,
        head_dim: d.head_dim,
        block_size,
    }
}

/// The CUDA backend: the device, the step's metadata and scratch, the sampler.
pub struct Cuda {
    pub gpu: Gpu,
    pub sizes: CudaSizes,
    max_table_entries: usize,
    meta: Meta,
    quant: QuantScratch,
    sampler: DeviceSampler,
    /// lm_head output of one chunk of logit rows.
    logits: CudaSlice<f32>,
    /// For the rare rows the device sampler does not take.
    host_scratch: SamplerScratch,
    attention: AttentionPlan,
    /// The step's shapes (set by `begin`).
    dims: Dims,
    /// The step's rows when every sequence decodes one row (set by `begin`): the steps whose
    /// layers can be recorded.
    decode_rows: Option<usize>,
    /// The recorded decode steps.
    graphs: StepGraphs,
    /// Split-KV scratch of the tensor-core decode attention (None: the shape has no such
    /// kernel, or not one row's chunks fit).
    decode_split: Option<ops::DecodeSplit>,
    /// The step keeps every op's output in its buffer (`Backend::begin`'s `keep`).
    keep: bool,
    /// GEMM outputs left as split-K segment sums for their readers ([`Unfolded`]), by the
    /// output buffer's address.
    unfolded: Vec<LeftSums>,
    /// A MoE combine not yet run, left for the norm that reads its output.
    combine: Option<ops::Combine>,
}

/// A GEMM output left as its segment sums: where it would have gone, and its shape.
#[derive(Clone, Copy, Debug)]
struct LeftSums {
    out: u64,
    sums: Unfolded,
    rows: usize,
    n: usize,
}

/// Whether the NVFP4 activation quantizer writes the GEMM's FP16 operand words itself where the
/// GEMM reads words ([`linear`]): unless `LOCKSTEP_NVFP4_WORDS=0` (the bits are the same either
/// way). H100, 2026-12-06 (`cuda_bench`, two rounds, on against off): NVFP4 prefill 8 x 2,048
/// 27,512 / 27,469 against 26,849 / 27,071 tok/s, the 256-row step 26.54 / 26.46 against 26.58
/// / 26.83 ms, 64 rows the same.
fn quantizer_packs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    ops::switched_on(&ON, "LOCKSTEP_NVFP4_WORDS")
}

/// Whether SwiGLU runs inside the per-token NVFP4 quantizer of the experts' down projection
/// (`ops::nvfp4_quantize_silu_mul`) for `pairs` routed rows of `inter` values, for rows of at
/// most `ops::NVFP4_SILU_MUL_MAX_COLS` values without four-over-six, on the quantizer's own
/// walk. The bits are the same either way (cuda_ops). By default where the quantizer walks a
/// block a row (below `ops::nvfp4_warp_min_rows()` rows: decode), one launch less a layer (H100,
/// 2026-12-06, NVFP4 `cuda_bench`, two rounds: 1 row 4.88 / 4.88 -> 4.86 / 4.81 ms a step, 256
/// rows 26.54 / 26.58 -> 26.40 / 26.43); on the warp walk only with
/// `LOCKSTEP_NVFP4_SILU_QUANT=1`, where it gained nothing (`cuda_bench --prefill 1x1024`, 8,192
/// routed rows off the SwiGLU epilogue's path: 22,199 / 22,239 tok/s on against 22,232 /
/// 22,302 off); `=0` nowhere.
fn nvfp4_silu_quantizer_takes(pairs: usize, inter: usize, p: ops::Nvfp4Params) -> bool {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let mode = MODE.get_or_init(
        || match std::env::var("LOCKSTEP_NVFP4_SILU_QUANT").as_deref() {
            Ok("1") => Some(true),
            Ok("0") => Some(false),
            _ => None,
        },
    );
    mode.unwrap_or(pairs < ops::nvfp4_warp_min_rows())
        && inter <= ops::NVFP4_SILU_MUL_MAX_COLS
        && inter.is_multiple_of(16)
        && p.fos_range <= 0.0
}

/// Whether the quantizer's words are also read through a row index (the experts' gate/up, whose
/// plan rows are tokens' rows) in a launch over `tokens` tokens: from
/// `ops::nvfp4_warp_min_rows()` tokens (4,096: prefill, where the quantizer walks a warp a row),
/// everywhere with `LOCKSTEP_NVFP4_GATE_UP_WORDS=1`, nowhere with `=0`. The bits are the same
/// either way (cuda_ops `nvfp4_operand_words_give_the_bits_of_the_values`, H200, 2026-12-06).
/// On the H200 (`cuda_bench`, NVFP4, on against off, 2026-12-06, the quantizer then a block a
/// row) the 64-row step was slower with it (15.34 / 15.41 against 15.09 / 15.08 ms) and so was
/// prefill 8 x 2,048 (28,413 / 28,414 against 28,702 / 28,487 tok/s). With the warp walk, on an
/// H100 the same day: prefill 8 x 2,048 29,393 / 28,881 against 28,795 / 28,224 tok/s, the
/// TMA kernel's copy of the plan's rows 154 us against 231 a layer (ncu of a 4 x 2,048 forward,
/// docs/performance.md): so it is on where the warp walk is.
fn gathers_words(tokens: usize) -> bool {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let mode =
        MODE.get_or_init(
            || match std::env::var("LOCKSTEP_NVFP4_GATE_UP_WORDS").as_deref() {
                Ok("1") => Some(true),
                Ok("0") => Some(false),
                _ => None,
            },
        );
    mode.unwrap_or(tokens >= ops::nvfp4_warp_min_rows())
}

/// Whether the GEMMs of a step that does not keep its buffers leave their split-K sums to their
/// readers: only with `LOCKSTEP_FOLD_IN_READERS=1` (the bits are the same either way). Measured
/// on an H200 (2026-12-05, docs/performance.md) it took the BF16 batch-8 step from 10.62 to
/// 10.32 ms but batch 1 from 4.96 to 5.13 and batch 64 from 20.72 to 20.99, so the launches
/// fold their own sums unless it is asked for.
fn folds_in_readers() -> bool {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    ops::opted_in(&CHOSEN, "LOCKSTEP_FOLD_IN_READERS")
}

/// Whether a step that does not keep its buffers runs each MoE combine inside the norm that
/// reads its output (`ops::rms_norm_combined`: one launch less a layer, the same bits), unless
/// `LOCKSTEP_COMBINE_IN_NORM=0`. Measured even to slightly faster (H100, 2026-12-06, NVFP4
/// `cuda_bench`, two rounds: 256 rows 26.76 / 26.74 -> 26.70 / 26.70 ms a step, 1 to 64 rows
/// within 0.05 ms).
fn combines_in_norm() -> bool {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    ops::switched_on(&CHOSEN, "LOCKSTEP_COMBINE_IN_NORM")
}

impl Cuda {
    /// The backend's own scratch for steps up to `sizes`.
    pub fn new(gpu: Gpu, shape: &ModelShape, sizes: CudaSizes) -> Result<Cuda, CudaError> {
        let d = &shape.dims;
        let t = sizes.max_batch_tokens.max(1);
        let pairs = shape.pairs(t);
        let seqs = sizes.max_running_requests.max(1);
        let max_table_entries = seqs * sizes.max_context_len.div_ceil(sizes.block_size).max(1);
        // Widest GEMM input: x (hidden), attention output (q_size) or, per routed pair, the
        // expert's intermediate activations.
        let in_width = d.hidden.max(d.q_size()).max(shape.intermediate);
        let moe_inter = shape.moe.map_or(0, |m| m.inter);
        let quant_elems = (t * in_width).max(pairs * moe_inter);
        let meta = Meta {
            tokens: gpu.alloc(t)?,
            pos: gpu.alloc(t)?,
            slots: gpu.alloc(t)?,
            row_seq: gpu.alloc(t)?,
            table_offsets: gpu.alloc(seqs)?,
            block_tables: gpu.alloc(max_table_entries)?,
            logit_rows: gpu.alloc(t)?,
            // At most one partial tile per sequence plus the full ones.
            attn_tiles: gpu.alloc(2 * (t / ops::PREFILL_TILE_ROWS + seqs))?,
            decode_rows: gpu.alloc(seqs)?,
        };
        let quant = QuantScratch {
            data: gpu.alloc(quant_elems)?,
            scales: gpu.alloc(quant_elems / 16 + 1)?,
            deq: gpu.alloc(quant_elems)?,
            row_scale: gpu.alloc(pairs.max(t))?,
            amax: gpu.alloc(2)?,
            block_scaled: if sizes.block_scaled_gemm && BlockScaledGemm::available(&gpu) {
                let widest = d
                    .vocab
                    .max(2 * shape.widest_inter())
                    .max(d.q_size())
                    .max(d.hidden);
                Some(BlockScaledGemm::new(&gpu, pairs.max(t), widest, in_width)?)
            } else {
                None
            },
        };
        // One sampled row per sequence; a launch samples at most one lm_head chunk's rows.
        let sampler = DeviceSampler::new(
            &gpu,
            d.vocab,
            seqs.min(LOGIT_CHUNK_ROWS),
            seqs,
            (sizes.max_context_len + 1024).max(1 << 16),
        )?;
        let logits = gpu.alloc(t.min(LOGIT_CHUNK_ROWS) * d.vocab)?;
        // The GEMMs' packed activations take a word per two of the quantizer's input values;
        // split-K's sums are for launches of up to a step's routed rows, as wide as the widest
        // output (lm_head or gate/up).
        let widest_out = d
            .vocab
            .max(2 * shape.widest_inter())
            .max(d.q_size() + 2 * d.kv_size())
            .max(d.hidden);
        // The TMA GEMM packs the experts' input once per routed row, in the plan's order.
        let operand_elems = if ops::tma_chosen(&gpu) {
            quant_elems.max(pairs * in_width)
        } else {
            quant_elems
        };
        ops::reserve_gemm_scratch(&gpu, operand_elems / 2, pairs.max(t), widest_out, in_width)?;
        let attn = attn_shape(d, sizes.block_size);
        let decode_split = if ops::prefill_attention_supports(attn) {
            ops::DecodeSplit::new(&gpu, attn, sizes.max_context_len, seqs)?
        } else {
            None
        };
        Ok(Cuda {
            gpu,
            sizes,
            max_table_entries,
            meta,
            quant,
            sampler,
            logits,
            host_scratch: SamplerScratch::default(),
            attention: AttentionPlan::default(),
            dims: shape.dims,
            decode_rows: None,
            graphs: StepGraphs::default(),
            decode_split,
            keep: true,
            unfolded: Vec::new(),
            combine: None,
        })
    }

    /// Drops the recorded decode steps: call it whenever a buffer they read moves (weights or
    /// KV cache replaced, released or resumed).
    pub fn clear_graphs(&mut self) {
        self.graphs.clear(&self.gpu);
    }

    /// How many decode row counts have a recording.
    pub fn recorded_steps(&self) -> usize {
        self.graphs.recorded()
    }

    /// Device bytes of the sampler and the logits chunk.
    pub fn sampler_bytes(&self) -> usize {
        self.sampler.bytes() + self.logits.len() * 4
    }

    /// Activation buffers for the largest step.
    pub fn buffers(&self, shape: &ModelShape) -> Result<Buffers<CudaSlice<f32>>, CudaError> {
        let (gpu, d) = (&self.gpu, &shape.dims);
        let t = self.sizes.max_batch_tokens.max(1);
        let pairs = shape.pairs(t);
        let inter = shape.widest_inter();
        Ok(Buffers {
            x: gpu.alloc(t * d.hidden)?,
            normed: gpu.alloc(t * d.hidden)?,
            q: gpu.alloc(t * d.q_size())?,
            k: gpu.alloc(t * d.kv_size())?,
            v: gpu.alloc(t * d.kv_size())?,
            attn: gpu.alloc(t * d.q_size())?,
            o: gpu.alloc(t * d.hidden)?,
            y: gpu.alloc(t * d.hidden)?,
            router_logits: gpu.alloc(t * shape.moe.map_or(1, |m| m.experts.max(1)))?,
            gate_up: gpu.alloc(pairs * 2 * inter)?,
            act: gpu.alloc(pairs * inter)?,
            expert_out: gpu.alloc(pairs * d.hidden)?,
        })
    }

    /// Routing buffers for the largest step.
    pub fn route(&self, shape: &ModelShape) -> Result<CudaRoute, CudaError> {
        let gpu = &self.gpu;
        let pairs = shape.pairs(self.sizes.max_batch_tokens.max(1));
        let experts = shape.moe.map_or(1, |m| m.experts.max(1));
        Ok(CudaRoute {
            ids: gpu.alloc(pairs)?,
            weights: gpu.alloc(pairs)?,
            plan: MoePlan::new(gpu, pairs, experts)?,
            replay: gpu.alloc(pairs)?,
            kept: gpu.alloc(shape.moe_layers.max(1) * pairs)?,
            rows: 0,
            top_k: 0,
        })
    }

    /// The KV cache: whatever `mem_fraction_static` of the device leaves once everything else
    /// is allocated (so call this last).
    pub fn kv_cache(&self, shape: &ModelShape) -> Result<CudaKv, CudaError> {
        let (gpu, d, sizes) = (&self.gpu, &shape.dims, &self.sizes);
        gpu.synchronize()?;
        let (free, total) = gpu.memory()?;
        let per_block = 2 * shape.num_layers * d.kv_size() * 2 * sizes.block_size;
        let budget =
            (total as f64 * sizes.mem_fraction_static as f64) as i64 - (total - free) as i64;
        // One block of the budget is the padding block.
        let mut num_blocks = ((budget.max(0) as usize) / per_block.max(1)).saturating_sub(1);
        if let Some(cap) = sizes.max_total_tokens {
            num_blocks = num_blocks.min(cap.div_ceil(sizes.block_size));
        }
        if num_blocks == 0 {
            return Err(CudaError::Capacity(format!(
                "no device memory left for the KV cache: weights and scratch use {:.1} GiB of {:.1} GiB (raise --mem-fraction-static or lower --chunked-prefill-size)",
                (total - free) as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64
            )));
        }
        self.alloc_kv(shape, num_blocks)
    }

    /// A KV cache of `num_blocks` blocks and the padding block, zeroed (also what a resume after
    /// `/release_memory_occupation` allocates again). On failure nothing stays allocated.
    pub fn alloc_kv(&self, shape: &ModelShape, num_blocks: usize) -> Result<CudaKv, CudaError> {
        let cache_len = (num_blocks + 1) * self.sizes.block_size * shape.dims.kv_size();
        let layers = || {
            (0..shape.num_layers)
                .map(|_| self.gpu.alloc::<u16>(cache_len))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(CudaKv {
            k: layers()?,
            v: layers()?,
            num_blocks,
        })
    }

    fn attn_shape(&self, d: &Dims) -> AttnShape {
        attn_shape(d, self.sizes.block_size)
    }

    /// The experts' gate/up GEMM with SwiGLU in its epilogue ([`ops::grouped_gemm_swiglu`]),
    /// then the down projection into `out`: h lands in `h` (the gate/up buffer's memory) as the
    /// down projection's BF16 operand words where it reads those (plain BF16 activations on a
    /// tiled or wgmma launch: nothing is packed again), else as f32 rows, which the down
    /// projection quantizes or packs as from `silu_mul`. The bits of the separate launches;
    /// neither gate/up's sums nor `silu_mul`'s output buffer are written. False, with nothing
    /// done, where the gate/up launch has no such epilogue (not on the wgmma kernel, or
    /// Blackwell's block-scaled MMAs).
    #[allow(clippy::too_many_arguments)]
    fn experts_swiglu_down(
        &mut self,
        w: &CudaExperts,
        x: &CudaSlice<f32>,
        rows: usize,
        route: &CudaRoute,
        h: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<bool, CudaError> {
        self.settle()?;
        let (gu, down) = (&w.gate_up, &w.down);
        let (pairs, plan) = (rows * route.top_k, &route.plan);
        {
            let (gpu, q) = (&self.gpu, &mut self.quant);
            if q.block_scaled.is_some() {
                return Ok(false);
            }
            let routed = GemmRows::Plan(plan);
            let words = down.act == Activation::Plain
                && ops::takes_bf16_words(gpu, &down.data, &routed, pairs, down.n, down.k);
            let form = if words {
                SwigluOut::Bf16Words
            } else {
                SwigluOut::F32
            };
            let runs = ops::swiglu_epilogue_runs(gpu, &gu.data, &routed, pairs, gu.n, gu.k, form);
            if !runs {
                return Ok(false);
            }
            // The quantizer's FP16 words where NVFP4's gate/up reads them (as `linear`).
            let gu_words = matches!(gu.act, Activation::Nvfp4 { .. })
                && quantizer_packs()
                && gathers_words(rows);
            quantize_input(gpu, gu.act, gu.experts, x, rows, gu.k, q, gu_words)?;
            let (input, row_scale) = q.gemm_input(gu.act, x);
            let row_token = Some(&plan.row_token);
            if gu_words {
                let f16 = ops::Packing::F16;
                ops::grouped_gemm_swiglu_packed(
                    gpu, &q.deq, f16, row_token, row_scale, &gu.data, routed, pairs, gu.n, gu.k,
                    form, h,
                )?;
            } else {
                ops::grouped_gemm_swiglu(
                    gpu, input, row_token, row_scale, &gu.data, routed, pairs, gu.n, gu.k, form, h,
                )?;
            }
            if words {
                let bf16 = ops::Packing::Bf16;
                ops::grouped_gemm_packed(
                    gpu, h, bf16, None, None, &down.data, routed, pairs, down.n, down.k, out,
                )?;
                return Ok(true);
            }
        }
        self.experts_down(w, h, route, out)?;
        Ok(true)
    }

    /// `out = x W^T` ([`linear`]); unless the step keeps its buffers, a launch split over K
    /// leaves its sums for `out`'s reader ([`Cuda::take_sums`]) where `reader_takes_sums` (a
    /// reader that takes none would have them folded by a launch of their own).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &mut self,
        m: &GpuMatrix,
        x: &CudaSlice<f32>,
        x_rows: usize,
        rows: GemmRows<'_>,
        row_index: Option<&CudaSlice<i32>>,
        out_rows: usize,
        out: &mut CudaSlice<f32>,
        reader_takes_sums: bool,
    ) -> Result<(), CudaError> {
        self.settle()?;
        let leave = reader_takes_sums && self.leaves_sums();
        let left = linear(
            &self.gpu,
            m,
            x,
            x_rows,
            rows,
            row_index,
            out_rows,
            out,
            &mut self.quant,
            leave,
        )?;
        self.remember(out, left, out_rows, m.n);
        Ok(())
    }

    /// SwiGLU and the per-token NVFP4 quantizer of the down projection's input in one launch
    /// (`nvfp4_quantize_silu_mul`, a warp a row), then the down projection: the bytes of
    /// `silu_mul`, the quantizer and the GEMM. Sums left by the gate/up GEMM are folded first.
    #[allow(clippy::too_many_arguments)]
    fn experts_nvfp4_silu_down(
        &mut self,
        w: &CudaExperts,
        gate_up: &CudaSlice<f32>,
        pairs: usize,
        inter: usize,
        params: ops::Nvfp4Params,
        route: &CudaRoute,
        act: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.settle()?;
        let leave = self.leaves_sums();
        let (gpu, q) = (&self.gpu, &mut self.quant);
        let plan = GemmRows::Plan(&route.plan);
        let words = quantizer_writes_words(gpu, &w.down, pairs, &plan, None, pairs, q);
        let (deq, operand) = match words {
            true => (None, Some(&mut q.deq)),
            false => (Some(&mut q.deq), None),
        };
        let outputs = Nvfp4Out {
            data: &mut q.data,
            scales: &mut q.scales,
            row_s_dec: &mut q.row_scale,
            deq,
            words: operand,
        };
        ops::nvfp4_quantize_silu_mul(gpu, gate_up, act, pairs, inter, params, outputs)?;
        let left = gemm_prepared(gpu, &w.down, act, plan, None, pairs, out, q, leave, words)?;
        self.remember(out, left, pairs, w.down.n);
        Ok(())
    }

    /// Whether this step's GEMMs leave their split-K sums to their readers.
    fn leaves_sums(&self) -> bool {
        !self.keep && folds_in_readers()
    }

    /// Records that `out` was left as `sums` (`rows` x `n`), if it was.
    fn remember(&mut self, out: &CudaSlice<f32>, sums: Option<Unfolded>, rows: usize, n: usize) {
        if let Some(sums) = sums {
            let out = super::args::addr(&self.gpu, out);
            self.unfolded.push(LeftSums { out, sums, rows, n });
        }
    }

    /// The sums `buf` was left as, if it was: its reader takes them (and the record).
    fn take_sums(&mut self, buf: &CudaSlice<f32>) -> Option<Unfolded> {
        let at = super::args::addr(&self.gpu, buf);
        let i = self.unfolded.iter().position(|l| l.out == at)?;
        Some(self.unfolded.swap_remove(i).sums)
    }

    /// Runs the MoE combine left for its norm, and writes every output still left as sums into
    /// its buffer: before the next GEMM reuses the sums' scratch, and before a reader that takes
    /// neither.
    fn settle(&mut self) -> Result<(), CudaError> {
        if let Some(c) = self.combine.take() {
            ops::moe_combine(&self.gpu, &c)?;
        }
        for l in std::mem::take(&mut self.unfolded) {
            ops::fold_unfolded(&self.gpu, l.sums, l.rows, l.n, DevPtr(l.out))?;
        }
        Ok(())
    }
}

/// `out = x W^T` for one layer or expert stack, quantizing x first as the format requires.
/// `x_rows` rows of x are quantized (per token, before any routing); `rows` says which output
/// rows are computed and `row_index` maps them to x rows.
#[allow(clippy::too_many_arguments)]
fn linear(
    gpu: &Gpu,
    m: &GpuMatrix,
    x: &CudaSlice<f32>,
    x_rows: usize,
    rows: GemmRows<'_>,
    row_index: Option<&CudaSlice<i32>>,
    out_rows: usize,
    out: &mut CudaSlice<f32>,
    q: &mut QuantScratch,
    leave: bool,
) -> Result<Option<Unfolded>, CudaError> {
    let words = quantizer_writes_words(gpu, m, x_rows, &rows, row_index, out_rows, q);
    quantize_input(gpu, m.act, m.experts, x, x_rows, m.k, q, words)?;
    gemm_prepared(gpu, m, x, rows, row_index, out_rows, out, q, leave, words)
}

/// Whether `m`'s activation quantizer (over `x_rows` rows) writes the GEMM's operand words for
/// this launch: NVFP4 activations on a kernel that reads them (the tiled and wgmma kernels). The
/// quantizer then writes the words itself, into the dequantized values' buffer, which nothing
/// reads then, and no launch packs them (the TMA kernel's copy of a plan's rows in its order
/// copies words). The same words as pack_gemm_operand's of the values, so the same bits.
fn quantizer_writes_words(
    gpu: &Gpu,
    m: &GpuMatrix,
    x_rows: usize,
    rows: &GemmRows<'_>,
    row_index: Option<&CudaSlice<i32>>,
    out_rows: usize,
    q: &QuantScratch,
) -> bool {
    match m.act {
        Activation::Nvfp4 { .. }
            if q.block_scaled.is_none()
                && quantizer_packs()
                && (row_index.is_none() || gathers_words(x_rows)) =>
        {
            ops::takes_operand_words(gpu, &m.data, rows, out_rows, m.n, m.k)
                == Some(ops::Packing::F16)
        }
        _ => false,
    }
}

/// The activation quantizer of layers whose input is `act`, over `x_rows` rows of width `k`:
/// data, scales, exact dequantized values and (NVFP4) row scales into `q`; with `words`
/// (NVFP4 only), the values as the GEMM's FP16 operand words in `q.deq`'s memory instead of
/// as f32. Nothing for plain layers.
#[allow(clippy::too_many_arguments)]
fn quantize_input(
    gpu: &Gpu,
    act: Activation,
    experts: usize,
    x: &CudaSlice<f32>,
    x_rows: usize,
    k: usize,
    q: &mut QuantScratch,
    words: bool,
) -> Result<(), CudaError> {
    match act {
        Activation::Plain => Ok(()),
        Activation::Mxfp8 => ops::mxfp8_quantize(
            gpu,
            x,
            x_rows * k,
            &mut q.data,
            &mut q.scales,
            Some(&mut q.deq),
        ),
        Activation::Nvfp4 { per_token, params } => {
            if !per_token {
                if experts > 1 {
                    return Err(CudaError::Unsupported(
                        "per-tensor NVFP4 activations for experts (the CPU scales each expert's rows)".into(),
                    ));
                }
                ops::amax(gpu, x, x_rows * k, &mut q.amax)?;
            }
            let (deq, operand) = match words {
                true => (None, Some(&mut q.deq)),
                false => (Some(&mut q.deq), None),
            };
            ops::nvfp4_quantize_f32(
                gpu,
                x,
                x_rows,
                k,
                per_token,
                (!per_token).then_some(&q.amax),
                params,
                Nvfp4Out {
                    data: &mut q.data,
                    scales: &mut q.scales,
                    row_s_dec: &mut q.row_scale,
                    deq,
                    words: operand,
                },
            )
        }
    }
}

/// `out = x W^T` on the input as [`quantize_input`] (or a launch quantizing as it does) left it
/// in `q` for `m`'s activation format (x itself for plain layers); with `words`, as the operand
/// words ([`quantizer_writes_words`]). With `leave`, a launch split over K may leave its segment
/// sums instead ([`ops::grouped_gemm_unfolded`]), returned.
#[allow(clippy::too_many_arguments)]
fn gemm_prepared(
    gpu: &Gpu,
    m: &GpuMatrix,
    x: &CudaSlice<f32>,
    rows: GemmRows<'_>,
    row_index: Option<&CudaSlice<i32>>,
    out_rows: usize,
    out: &mut CudaSlice<f32>,
    q: &mut QuantScratch,
    leave: bool,
    words: bool,
) -> Result<Option<Unfolded>, CudaError> {
    if words {
        let f16 = ops::Packing::F16;
        let row_scale = Some(&q.row_scale);
        ops::grouped_gemm_packed(
            gpu, &q.deq, f16, row_index, row_scale, &m.data, rows, out_rows, m.n, m.k, out,
        )?;
        return Ok(None);
    }
    let (n, k) = (m.n, m.k);
    let format = match m.act {
        Activation::Plain => None,
        Activation::Mxfp8 => Some(BlockFormat::Mxfp8),
        Activation::Nvfp4 { .. } => Some(BlockFormat::Nvfp4),
    };
    if let (Some(format), Some(bs)) = (format, &mut q.block_scaled) {
        let row_scale = (format == BlockFormat::Nvfp4).then_some(&q.row_scale);
        return bs
            .run(
                gpu, format, &m.data, &q.data, &q.scales, row_scale, rows, row_index, n, k, out,
            )
            .map(|()| None);
    }
    let (input, row_scale) = q.gemm_input(m.act, x);
    if leave {
        return ops::grouped_gemm_unfolded(
            gpu, input, row_index, row_scale, &m.data, rows, out_rows, n, k, out,
        );
    }
    ops::grouped_gemm(
        gpu, input, row_index, row_scale, &m.data, rows, out_rows, n, k, out,
    )
    .map(|()| None)
}

impl QuantScratch {
    /// What the GEMM kernels read for a layer whose input is `act`, after [`quantize_input`]:
    /// x itself for plain layers, else the exact dequantized values (and, for NVFP4, the row
    /// scales).
    fn gemm_input<'a>(
        &'a self,
        act: Activation,
        x: &'a CudaSlice<f32>,
    ) -> (&'a CudaSlice<f32>, Option<&'a CudaSlice<f32>>) {
        match act {
            Activation::Plain => (x, None),
            Activation::Mxfp8 => (&self.deq, None),
            Activation::Nvfp4 { .. } => (&self.deq, Some(&self.row_scale)),
        }
    }
}

/// Where one lm_head output row goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RowDest {
    /// This row of the host logits.
    Host(usize),
    /// Sampled on the device for this sequence of the batch.
    Device(usize),
}

impl Backend for Cuda {
    type Error = CudaError;
    type Act = CudaSlice<f32>;
    type Vector = CudaSlice<f32>;
    type Table = Table;
    type Linear = GpuMatrix;
    /// None: tied to the embedding table.
    type LmHead = Option<GpuMatrix>;
    type SwiGlu = CudaSwiGlu;
    type Experts = CudaExperts;
    type Kv = CudaKv;
    type Route = CudaRoute;

    fn begin(&mut self, plan: &StepPlan<'_>, dims: &Dims, keep: bool) -> Result<(), CudaError> {
        // Every reader of a finished step took its sums; a step that failed half way leaves
        // none that anything will read.
        self.unfolded.clear();
        self.combine = None;
        self.keep = keep;
        let bs = self.sizes.block_size;
        let n = plan.rows();
        let mut tables = Vec::new();
        let mut table_offsets = Vec::with_capacity(plan.seqs.len());
        for s in &plan.seqs {
            table_offsets.push(tables.len() as i32);
            tables.extend(s.block_table.iter().map(|&b| b as i32));
        }
        if n > self.sizes.max_batch_tokens
            || plan.seqs.len() > self.sizes.max_running_requests.max(1)
            || tables.len() > self.max_table_entries
        {
            return Err(CudaError::Capacity(format!(
                "a step of {n} tokens in {} sequences exceeds the sizes the device was planned for",
                plan.seqs.len()
            )));
        }
        let pos: Vec<i32> = plan.row_pos.iter().map(|&p| p as i32).collect();
        let slots: Vec<i32> = plan
            .row_seq
            .iter()
            .zip(&plan.row_pos)
            .map(|(&s, &p)| (plan.seqs[s].block_table[p / bs] as usize * bs + p % bs) as i32)
            .collect();
        let row_seq: Vec<i32> = plan.row_seq.iter().map(|&s| s as i32).collect();
        let logit_idx: Vec<i32> = plan.logit_rows.iter().map(|&r| r as i32).collect();
        let shape = self.attn_shape(dims);
        // Sequences of several rows run the prefill kernel, single rows the decode kernel: the
        // same arithmetic per row, so the split is for speed only.
        let per_row = !ops::prefill_attention_supports(shape);
        let (tiles, decode_rows) = if per_row {
            Default::default()
        } else {
            ops::attention_split(plan.seqs.iter().map(|s| s.len))
        };
        self.attention = AttentionPlan {
            prefill_tiles: tiles.len() / 2,
            decode_rows: decode_rows.len(),
            per_row,
        };
        self.dims = *dims;
        self.decode_rows = plan.seqs.iter().all(|s| s.len == 1).then_some(n);
        let (gpu, m) = (&self.gpu, &mut self.meta);
        gpu.write(&plan.tokens, &mut m.tokens)?;
        gpu.write(&pos, &mut m.pos)?;
        gpu.write(&slots, &mut m.slots)?;
        gpu.write(&row_seq, &mut m.row_seq)?;
        gpu.write(&table_offsets, &mut m.table_offsets)?;
        gpu.write(&tables, &mut m.block_tables)?;
        gpu.write(&logit_idx, &mut m.logit_rows)?;
        gpu.write(&tiles, &mut m.attn_tiles)?;
        gpu.write(&decode_rows, &mut m.decode_rows)?;
        Ok(())
    }

    fn layers(
        &mut self,
        record: bool,
        layers: &mut dyn FnMut(&mut Self) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        // Split-K sums the layers leave with no reader inside them (a dense last layer's
        // output) are folded inside them too: a replayed graph runs no host code after them.
        let mut layers = |cuda: &mut Self| {
            cuda.unfolded.clear();
            cuda.combine = None;
            layers(cuda).and_then(|()| cuda.settle())
        };
        match self.decode_rows.filter(|_| record) {
            Some(rows) => {
                let mut graphs = std::mem::take(&mut self.graphs);
                let ran = graphs.run(self, rows, &mut layers);
                self.graphs = graphs;
                ran
            }
            None => layers(self),
        }
    }

    fn embed(
        &mut self,
        table: &Table,
        plan: &StepPlan<'_>,
        dims: &Dims,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        ops::embedding(
            &self.gpu,
            &self.meta.tokens,
            plan.rows(),
            table,
            out,
            dims.hidden,
        )
    }

    fn rms_norm(
        &mut self,
        x: &mut CudaSlice<f32>,
        residual: Option<&CudaSlice<f32>>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        width: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        if let Some(c) = self.combine.take() {
            if residual.is_some_and(|r| c.writes(&self.gpu, r, rows, width)) {
                return ops::rms_norm_combined(&self.gpu, x, &c, w, out, eps);
            }
            ops::moe_combine(&self.gpu, &c)?;
        }
        let sums = residual.and_then(|r| self.take_sums(r));
        ops::rms_norm(&self.gpu, x, residual, sums, w, out, None, rows, width, eps)
    }

    fn linear(
        &mut self,
        w: &GpuMatrix,
        x: &CudaSlice<f32>,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        // The readers of the forward's dense layers (the norm's residual, routing, SwiGLU)
        // take sums.
        self.gemm(w, x, rows, GemmRows::Dense(rows), None, rows, out, true)
    }

    /// Layers of one activation format (q, k and v of a quantized model) quantize `x` once:
    /// each would write the same bytes, scales and dequantized values. Their one launch may
    /// leave its sums to the readers, as [`Cuda::gemm`]; separate launches fold (each would
    /// reuse the sums' scratch).
    fn linear_same_input(
        &mut self,
        ws: [&GpuMatrix; 3],
        x: &CudaSlice<f32>,
        rows: usize,
        outs: [&mut CudaSlice<f32>; 3],
    ) -> Result<(), CudaError> {
        self.settle()?;
        let shared = ws
            .iter()
            .all(|m| m.act == ws[0].act && m.k == ws[0].k && m.experts == 1);
        if shared {
            quantize_input(
                &self.gpu,
                ws[0].act,
                1,
                x,
                rows,
                ws[0].k,
                &mut self.quant,
                false,
            )?;
            // One launch for all three where the kernels take them together (the block-scaled
            // MMAs of quantized activations run one layer a launch).
            let data = ws.map(|m| &m.data);
            let (input, row_scale) = self.quant.gemm_input(ws[0].act, x);
            let plain = ws[0].act == Activation::Plain;
            if ops::joinable(&data) && (plain || self.quant.block_scaled.is_none()) {
                let ns = ws.map(|m| m.n);
                let mut outs = outs;
                let (gpu, k) = (&self.gpu, ws[0].k);
                if !self.leaves_sums() {
                    return ops::dense_gemm_parts(
                        gpu, input, row_scale, &data, &ns, rows, k, &mut outs,
                    );
                }
                let left = ops::dense_gemm_parts_unfolded(
                    gpu, input, row_scale, &data, &ns, rows, k, &mut outs,
                )?;
                for ((out, sums), n) in outs.iter().zip(left).zip(ns) {
                    self.remember(out, Some(sums), rows, n);
                }
                return Ok(());
            }
        }
        for (m, out) in ws.into_iter().zip(outs) {
            if !shared {
                quantize_input(
                    &self.gpu,
                    m.act,
                    m.experts,
                    x,
                    rows,
                    m.k,
                    &mut self.quant,
                    false,
                )?;
            }
            let dense = GemmRows::Dense(rows);
            gemm_prepared(
                &self.gpu,
                m,
                x,
                dense,
                None,
                rows,
                out,
                &mut self.quant,
                false,
                false,
            )?;
        }
        Ok(())
    }

    fn qk_norm_rope_store(
        &mut self,
        layer: usize,
        norms: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
        inv_freq: &CudaSlice<f32>,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        kv: &mut CudaKv,
        plan: &StepPlan<'_>,
        dims: &Dims,
    ) -> Result<(), CudaError> {
        let shape = self.attn_shape(dims);
        let sums = [self.take_sums(q), self.take_sums(k), self.take_sums(v)];
        ops::qk_norm_rope_store(
            &self.gpu,
            q,
            k,
            v,
            sums,
            norms,
            inv_freq,
            &self.meta.pos,
            &self.meta.slots,
            &mut kv.k[layer],
            &mut kv.v[layer],
            plan.rows(),
            shape,
            dims.eps,
        )
    }

    fn attention(
        &mut self,
        layer: usize,
        q: &CudaSlice<f32>,
        kv: &CudaKv,
        plan: &StepPlan<'_>,
        dims: &Dims,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.settle()?;
        let (n, shape) = (plan.rows(), self.attn_shape(dims));
        let m = &self.meta;
        let meta = AttnRows {
            pos: &m.pos,
            seq: &m.row_seq,
            table_offsets: &m.table_offsets,
            block_tables: &m.block_tables,
        };
        let (k, v) = (&kv.k[layer], &kv.v[layer]);
        let a = self.attention;
        if a.per_row {
            return ops::paged_attention(&self.gpu, q, out, k, v, &meta, n, shape);
        }
        ops::prefill_attention(
            &self.gpu,
            q,
            out,
            k,
            v,
            &meta,
            &m.attn_tiles,
            a.prefill_tiles,
            n,
            shape,
            ops::PrefillBlocks::chosen(&self.gpu, shape),
        )?;
        ops::decode_attention(
            &self.gpu,
            q,
            out,
            k,
            v,
            &meta,
            Some(&m.decode_rows),
            a.decode_rows,
            n,
            shape,
            self.decode_split.as_ref(),
        )
    }

    fn mlp_gate_up(
        &mut self,
        w: &CudaSwiGlu,
        x: &CudaSlice<f32>,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.linear(&w.gate_up, x, rows, out)
    }

    fn mlp_down(
        &mut self,
        w: &CudaSwiGlu,
        act: &CudaSlice<f32>,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.linear(&w.down, act, rows, out)
    }

    fn silu_mul(
        &mut self,
        gate_up: &CudaSlice<f32>,
        rows: usize,
        inter: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let sums = self.take_sums(gate_up);
        ops::silu_mul(&self.gpu, gate_up, sums, out, rows, inter)
    }

    fn moe_route(
        &mut self,
        logits: &CudaSlice<f32>,
        rows: usize,
        shape: MoeShape,
        replay: Option<&[i32]>,
        moe_index: usize,
        route: &mut CudaRoute,
    ) -> Result<(), CudaError> {
        let sums = self.take_sums(logits);
        let gpu = &self.gpu;
        if let Some(ids) = replay {
            gpu.write(ids, &mut route.replay)?;
        }
        ops::route_and_plan(
            gpu,
            logits,
            sums,
            rows,
            shape.experts,
            shape.top_k,
            shape.renormalize,
            replay.map(|_| &route.replay),
            &mut route.ids,
            &mut route.weights,
            &mut route.plan,
            Some(ops::KeptIds {
                buf: &mut route.kept,
                at: moe_index * rows * shape.top_k,
            }),
        )?;
        route.rows = rows;
        route.top_k = shape.top_k;
        Ok(())
    }

    fn experts_gate_up(
        &mut self,
        w: &CudaExperts,
        x: &CudaSlice<f32>,
        rows: usize,
        route: &CudaRoute,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let pairs = rows * route.top_k;
        let plan = &route.plan;
        // SwiGLU takes sums; MXFP8's SwiGLU inside the quantizer does not.
        let takes = !matches!(w.down.act, Activation::Mxfp8);
        self.gemm(
            &w.gate_up,
            x,
            rows,
            GemmRows::Plan(plan),
            Some(&plan.row_token),
            pairs,
            out,
            takes,
        )
    }

    fn experts_down(
        &mut self,
        w: &CudaExperts,
        act: &CudaSlice<f32>,
        route: &CudaRoute,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let pairs = route.rows * route.top_k;
        self.gemm(
            &w.down,
            act,
            pairs,
            GemmRows::Plan(&route.plan),
            None,
            pairs,
            out,
            true,
        )
    }

    /// For MXFP8 down projections, SwiGLU and the activation quantizer are one launch
    /// (`mxfp8_quantize_silu_mul`, which takes gate/up as values: sums left by the gate/up GEMM
    /// are folded into it first); for per-token NVFP4 ones too where
    /// [`nvfp4_silu_quantizer_takes`] (by default at decode, on the quantizer's block walk: an
    /// earlier build of it made the batch-1 step slower on an H200, 2026-12-03, 5.65-5.73 against
    /// 5.58-5.59 ms; today's quantizer with it is even to faster on an H100, 2026-12-06,
    /// docs/performance.md).
    fn experts_silu_down(
        &mut self,
        w: &CudaExperts,
        gate_up: &CudaSlice<f32>,
        pairs: usize,
        inter: usize,
        route: &CudaRoute,
        act: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if let Activation::Nvfp4 {
            per_token: true,
            params,
        } = w.down.act
        {
            if nvfp4_silu_quantizer_takes(pairs, inter, params) {
                return self
                    .experts_nvfp4_silu_down(w, gate_up, pairs, inter, params, route, act, out);
            }
        }
        if !matches!(w.down.act, Activation::Mxfp8) {
            self.silu_mul(gate_up, pairs, inter, act)?;
            return self.experts_down(w, act, route, out);
        }
        self.settle()?;
        let leave = self.leaves_sums();
        let (gpu, q) = (&self.gpu, &mut self.quant);
        ops::mxfp8_quantize_silu_mul(
            gpu,
            gate_up,
            act,
            pairs,
            inter,
            &mut q.data,
            &mut q.scales,
            Some(&mut q.deq),
        )?;
        let plan = GemmRows::Plan(&route.plan);
        let left = gemm_prepared(gpu, &w.down, act, plan, None, pairs, out, q, leave, false)?;
        self.remember(out, left, pairs, w.down.n);
        Ok(())
    }

    /// Unless the step keeps its buffers, where the gate/up GEMM runs on the wgmma kernel,
    /// SwiGLU is its epilogue ([`Cuda::experts_swiglu_down`]); otherwise the separate launches.
    fn experts_mlp(
        &mut self,
        w: &CudaExperts,
        x: &CudaSlice<f32>,
        rows: usize,
        shape: MoeShape,
        route: &CudaRoute,
        gate_up: &mut CudaSlice<f32>,
        act: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if !self.keep && self.experts_swiglu_down(w, x, rows, route, gate_up, out)? {
            return Ok(());
        }
        self.experts_gate_up(w, x, rows, route, gate_up)?;
        let pairs = rows * shape.top_k;
        self.experts_silu_down(w, gate_up, pairs, shape.inter, route, act, out)
    }

    fn moe_combine(
        &mut self,
        expert_out: &CudaSlice<f32>,
        route: &CudaRoute,
        rows: usize,
        hidden: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let sums = self.take_sums(expert_out);
        let c = ops::Combine::new(
            &self.gpu,
            expert_out,
            sums,
            &route.plan,
            &route.weights,
            out,
            rows,
            route.top_k,
            hidden,
        )?;
        if self.keep || !combines_in_norm() {
            return ops::moe_combine(&self.gpu, &c);
        }
        // Left for the next layer's input norm (or `settle`): the expert rows stay as they are
        // until the next GEMM, which settles it first, the plan and weights until the next
        // routing, after that norm.
        if let Some(before) = self.combine.replace(c) {
            ops::moe_combine(&self.gpu, &before)?;
        }
        Ok(())
    }

    fn routed_experts(
        &mut self,
        route: &CudaRoute,
        rows: usize,
        moe_layers: usize,
        top_k: usize,
    ) -> Result<Vec<i32>, CudaError> {
        let by_layer = self.gpu.download(&route.kept, moe_layers * rows * top_k)?;
        // [layer][token][k] -> [token][layer][k], the CPU backend's order.
        let mut routed = vec![0i32; rows * moe_layers * top_k];
        for m in 0..moe_layers {
            for t in 0..rows {
                routed[(t * moe_layers + m) * top_k..][..top_k]
                    .copy_from_slice(&by_layer[(m * rows + t) * top_k..][..top_k]);
            }
        }
        Ok(routed)
    }

    fn logits(
        &mut self,
        bufs: &mut Buffers<CudaSlice<f32>>,
        add_y: bool,
        norm: &CudaSlice<f32>,
        head: &Option<GpuMatrix>,
        table: &Table,
        plan: &StepPlan<'_>,
        dims: &Dims,
        samples: &[Option<SampleInput<'_>>],
        trace: bool,
    ) -> Result<Logits, CudaError> {
        self.settle()?;
        let (h, v) = (dims.hidden, dims.vocab);
        // Rows asking for more alternatives than the device reports are sampled on the host.
        let on_device = |i: usize| {
            samples
                .get(i)
                .and_then(Option::as_ref)
                .filter(|s| s.top_logprobs_num <= MAX_DEVICE_TOP_LOGPROBS)
        };
        // Per logits row: its place among the host rows, or the sequence sampling it here.
        let mut row_dest = Vec::with_capacity(plan.logit_rows.len());
        let mut logit_rows = Vec::with_capacity(plan.seqs.len());
        let mut host_rows = 0;
        for (i, s) in plan.seqs.iter().enumerate() {
            let rows = s.logit_count();
            let device = on_device(i).is_some();
            if device && rows == 0 {
                return Err(CudaError::Unsupported(format!(
                    "sequence {i} is sampled but asks for no logits"
                )));
            }
            let to_host = rows - device as usize;
            logit_rows.push((host_rows, to_host));
            row_dest.extend((0..to_host).map(|k| RowDest::Host(host_rows + k)));
            if device {
                row_dest.push(RowDest::Device(i));
            }
            host_rows += to_host;
        }
        let top_n = (0..plan.seqs.len())
            .filter_map(on_device)
            .map(|s| s.top_logprobs_num);
        self.sampler.begin(top_n.max().unwrap_or(0).min(v))?;
        let rows = plan.logit_rows.len();
        let gpu = &self.gpu;
        // The final norm (with the last MLP output added) on the logit rows only; a trace
        // records the whole residual stream, so there every row gets the add first.
        let add_in_norm = add_y && !trace;
        if add_y && trace {
            ops::add_inplace(gpu, &mut bufs.x, &bufs.y, plan.rows() * h)?;
        }
        ops::rms_norm(
            gpu,
            &mut bufs.x,
            add_in_norm.then_some(&bufs.y),
            None,
            norm,
            &mut bufs.normed,
            Some(&self.meta.logit_rows),
            rows,
            h,
            dims.eps,
        )?;
        let lm_head_in = trace
            .then(|| gpu.download(&bufs.normed, rows * h))
            .transpose()?;
        let mut logits = vec![0f32; host_rows * v];
        let mut sampled_seqs = Vec::new();
        for first in (0..rows).step_by(LOGIT_CHUNK_ROWS) {
            let m = LOGIT_CHUNK_ROWS.min(rows - first);
            let x = bufs.normed.slice(first * h..(first + m) * h);
            // The GEMM reads rows from the front of its input: copy the chunk's rows there.
            gpu.stream
                .memcpy_dtod(&x, &mut bufs.o.slice_mut(0..m * h))?;
            let out = &mut self.logits;
            match (head, table) {
                (Some(head), _) => linear(
                    gpu,
                    head,
                    &bufs.o,
                    m,
                    GemmRows::Dense(m),
                    None,
                    m,
                    out,
                    &mut self.quant,
                    false,
                )
                .map(drop)?,
                (None, table) => ops::table_gemm(gpu, &bufs.o, table, m, v, h, out)?,
            }
            // Host rows in runs of consecutive rows, one copy each; the sampled rows are
            // sampled right here, before the next chunk's GEMM reuses the buffer.
            let mut device_rows = Vec::new();
            let mut r = 0;
            while r < m {
                match row_dest[first + r] {
                    RowDest::Host(dest) => {
                        let mut run = 1;
                        while r + run < m && row_dest[first + r + run] == RowDest::Host(dest + run)
                        {
                            run += 1;
                        }
                        gpu.stream.memcpy_dtoh(
                            &out.slice(r * v..(r + run) * v),
                            &mut logits[dest * v..(dest + run) * v],
                        )?;
                        r += run;
                    }
                    RowDest::Device(i) => {
                        let input = on_device(i).expect("device rows have sampling inputs");
                        device_rows.push((r, *input));
                        sampled_seqs.push(i);
                        r += 1;
                    }
                }
            }
            if !device_rows.is_empty() {
                self.sampler.sample(gpu, out, &device_rows)?;
            }
        }
        let mut sampled: Sampled = vec![None; plan.seqs.len()];
        for (i, result) in sampled_seqs.into_iter().zip(self.sampler.finish(gpu)?) {
            sampled[i] = Some(result);
        }
        gpu.synchronize()?;
        // The rows the device sampler does not take, from the host logits.
        for (i, s) in samples.iter().enumerate() {
            let Some(input) = s.as_ref().filter(|_| on_device(i).is_none()) else {
                continue;
            };
            let (first, count) = logit_rows[i];
            if count > 0 {
                let mut row = logits[(first + count - 1) * v..][..v].to_vec();
                sampled[i] = Some(sampling::sample(&mut row, input, &mut self.host_scratch));
            }
        }
        Ok(Logits {
            logits,
            logit_rows,
            sampled,
            lm_head_in,
        })
    }

    fn host(&mut self, a: &CudaSlice<f32>, len: usize) -> Result<Vec<f32>, CudaError> {
        self.settle()?;
        let out = self.gpu.download(a, len)?;
        self.gpu.synchronize()?;
        Ok(out)
    }

    fn kv_stored(
        &mut self,
        _kv: &CudaKv,
        a: &CudaSlice<f32>,
        len: usize,
    ) -> Result<Vec<f32>, CudaError> {
        // The device cache is BF16.
        let values = self.host(a, len)?;
        Ok(values
            .into_iter()
            .map(|x| half::bf16::from_f32(x).to_f32())
            .collect())
    }

    /// The stacked gate+up matrix writes each row as `[gate | up]`.
    fn mlp_trace(
        &mut self,
        bufs: &Buffers<CudaSlice<f32>>,
        rows: usize,
        inter: usize,
    ) -> Result<SwiGluTrace, CudaError> {
        let gu = self.host(&bufs.gate_up, rows * 2 * inter)?;
        let (gate, up) = split_gate_up(&gu, inter);
        Ok(SwiGluTrace {
            gate,
            up,
            act: self.host(&bufs.act, rows * inter)?,
        })
    }

    /// The device's grouping (the routing plan's rows) read back into the CPU's trace shape;
    /// the router softmax is recomputed on the host from the device's logits.
    fn moe_trace(
        &mut self,
        route: &CudaRoute,
        bufs: &Buffers<CudaSlice<f32>>,
        rows: usize,
        shape: MoeShape,
    ) -> Result<MoeTrace, CudaError> {
        self.settle()?;
        let (e, k, inter, h) = (shape.experts, shape.top_k, shape.inter, self.dims.hidden);
        let pairs = rows * k;
        let gpu = &self.gpu;
        let mut probs = gpu.download(&bufs.router_logits, rows * e)?;
        let ids = gpu.download(&route.ids, pairs)?;
        let weights = gpu.download(&route.weights, pairs)?;
        let slot_row = gpu.download(&route.plan.slot_row, pairs)?;
        let offsets = gpu.download(&route.plan.offsets, e + 1)?;
        let gu = gpu.download(&bufs.gate_up, pairs * 2 * inter)?;
        let act = gpu.download(&bufs.act, pairs * inter)?;
        let out = gpu.download(&bufs.expert_out, pairs * h)?;
        gpu.synchronize()?;
        for row in probs.chunks_mut(e) {
            crate::backend::cpu::ops::softmax_inplace(row);
        }
        let choice: Vec<(usize, f32)> = ids.iter().map(|&i| i as usize).zip(weights).collect();
        let row_in_expert: Vec<usize> = (0..pairs)
            .map(|s| (slot_row[s] - offsets[choice[s].0]) as usize)
            .collect();
        let (gate, up) = split_gate_up(&gu, inter);
        let experts = (0..e)
            .map(|ex| {
                let (a, b) = (offsets[ex] as usize, offsets[ex + 1] as usize);
                if a == b {
                    return None;
                }
                // Members in the order of their rows in the group.
                let mut members: Vec<usize> = (0..pairs).filter(|&s| choice[s].0 == ex).collect();
                members.sort_by_key(|&s| slot_row[s]);
                Some(ExpertTrace {
                    members,
                    swiglu: SwiGluTrace {
                        gate: gate[a * inter..b * inter].to_vec(),
                        up: up[a * inter..b * inter].to_vec(),
                        act: act[a * inter..b * inter].to_vec(),
                    },
                    out: out[a * h..b * h].to_vec(),
                })
            })
            .collect();
        Ok(MoeTrace {
            probs,
            choice,
            row_in_expert,
            experts,
        })
    }
}

/// Rows of `[gate | up]` (`inter` each) split into all gate rows and all up rows.
fn split_gate_up(gu: &[f32], inter: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut gate, mut up) = (
        Vec::with_capacity(gu.len() / 2),
        Vec::with_capacity(gu.len() / 2),
    );
    for row in gu.chunks(2 * inter) {
        gate.extend_from_slice(&row[..inter]);
        up.extend_from_slice(&row[inter..]);
    }
    (gate, up)
}
