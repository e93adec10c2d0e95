//! The forward pass on a CUDA device: the same architecture, batch metadata and outputs as
//! [`crate::model::Model::forward`], with weights, KV cache and activations in GPU memory.
//!
//! Memory is planned once at start-up (weights, then activation and sampling scratch sized for
//! the largest step, then the paged BF16 KV cache from what `--mem-fraction-static` leaves); a
//! step only copies its small metadata in and its routed-expert ids and either its logits or,
//! with [`CudaModel::forward_and_sample`], its sampled tokens out.

use cudarc::driver::CudaSlice;

use super::block_scaled::{BlockFormat, BlockScaledGemm};
use super::ops::{
    self, AttnRows, AttnShape, CublasOperand, GemmRows, KeySplit, MoePlan, Nvfp4Out, SplitScratch,
    Table, WeightData,
};
use super::sampling::DeviceSampler;
use super::weights::{Activation, DummyWeights, GpuMatrix};
use super::{CudaError, Gpu};
use crate::backend::cpu::linear::DenseWeight;
use crate::backend::cpu::ops::rope_inv_freq;
use crate::model::{ForwardBatch, ForwardOutput, Mlp, Model, ModelConfig};
use crate::quant::{Format, Recipe};
use crate::sampling::{SampleInput, SamplingError, TokenLogprobs};

/// Per sequence of a batch: its sampled token, when it asked for one.
pub type Sampled = Vec<Option<Result<TokenLogprobs, SamplingError>>>;

pub enum CudaMlp {
    Dense {
        gate_up: GpuMatrix,
        down: GpuMatrix,
        inter: usize,
    },
    Moe {
        router: GpuMatrix,
        gate_up: GpuMatrix,
        down: GpuMatrix,
        inter: usize,
        experts: usize,
        top_k: usize,
        renormalize: bool,
    },
}

pub struct CudaLayer {
    pub input_norm: CudaSlice<f32>,
    pub post_attention_norm: CudaSlice<f32>,
    pub q: GpuMatrix,
    pub k: GpuMatrix,
    pub v: GpuMatrix,
    pub o: GpuMatrix,
    pub qk_norm: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    pub mlp: CudaMlp,
}

/// The model's weights on the device.
pub struct CudaWeights {
    pub embed: Table,
    /// None: tied to the embedding table.
    pub lm_head: Option<GpuMatrix>,
    pub layers: Vec<CudaLayer>,
    pub norm: CudaSlice<f32>,
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
}

/// Dense BF16 layers use cuBLAS (activations rounded to BF16) above this many rows; below it
/// the in-house GEMM keeps f32 activations like the CPU (decode steps are memory-bound either
/// way, and routing decisions then match the CPU reference far more often).
const CUBLAS_MIN_ROWS: usize = 16;

/// Decode steps with fewer (row, head) pairs than this many per SM use the split kernel.
const SPLIT_DECODE_BLOCKS_PER_SM: usize = 4;

/// A step with a sequence of at least this many rows runs the tensor-core prefill attention.
const PREFILL_ATTENTION_MIN_ROWS: usize = 2;

/// The lm_head runs on at most this many rows at a time (a step asking for input logprobs of
/// a long chunk needs logits for every row; the vocabulary makes each row large).
const LOGIT_CHUNK_ROWS: usize = 256;

/// Split decode attention keeps this many partial results per (sequence, query head): a
/// step of `max_running_requests` rows may split each row's keys this many ways, a step of
/// fewer rows proportionally more (up to `KeySplit::MAX_SPLITS`).
const SPLIT_PARTIALS_PER_HEAD: usize = 16;

/// Per-step activation buffers, allocated once for the largest step.
struct Scratch {
    tokens: CudaSlice<u32>,
    pos: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    row_seq: CudaSlice<i32>,
    table_offsets: CudaSlice<i32>,
    block_tables: CudaSlice<i32>,
    logit_rows: CudaSlice<i32>,
    /// Tiles of the tensor-core prefill attention (`ops::prefill_tiles`).
    attn_tiles: CudaSlice<i32>,
    x: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    attn_split: SplitScratch,
    o: CudaSlice<f32>,
    y: CudaSlice<f32>,
    router_logits: CudaSlice<f32>,
    topk_ids: CudaSlice<i32>,
    topk_w: CudaSlice<f32>,
    plan: Option<MoePlan>,
    gu: CudaSlice<f32>,
    h: CudaSlice<f32>,
    expert_out: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    routed: CudaSlice<i32>,
    quant: QuantScratch,
}

/// Buffers of the activation quantizers and the BF16 cast for cuBLAS.
struct QuantScratch {
    xb: CudaSlice<u16>,
    data: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    deq: CudaSlice<f32>,
    row_scale: CudaSlice<f32>,
    amax: CudaSlice<u32>,
    /// The Blackwell block-scaled GEMMs (sm_100 only; compiled, never run: see block_scaled.rs).
    block_scaled: Option<BlockScaledGemm>,
}

struct KvCache {
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    num_blocks: usize,
}

pub struct CudaModel {
    pub gpu: Gpu,
    pub config: ModelConfig,
    weights: CudaWeights,
    inv_freq: CudaSlice<f32>,
    kv: KvCache,
    s: Scratch,
    sizes: CudaSizes,
    max_table_entries: usize,
    sampler: DeviceSampler,
    pub weight_bytes: usize,
}

impl CudaWeights {
    /// Uploads a model the CPU loader built (any checkpoint format, quantized by `quant`).
    pub fn upload(gpu: &Gpu, model: &Model) -> Result<CudaWeights, CudaError> {
        let embed = match &model.embed_tokens {
            DenseWeight::Bf16(w) => {
                Table::Bf16(gpu.upload(&w.iter().map(|v| v.to_bits()).collect::<Vec<_>>())?)
            }
            DenseWeight::F32(w) => Table::F32(gpu.upload(w)?),
        };
        let mut layers = Vec::with_capacity(model.layers.len());
        for layer in &model.layers {
            let one = |l: &dyn crate::backend::Linear| GpuMatrix::upload(gpu, &[vec![l]]);
            let mlp = match &layer.mlp {
                Mlp::Dense(m) => CudaMlp::Dense {
                    gate_up: GpuMatrix::upload(gpu, &[vec![&*m.gate, &*m.up]])?,
                    down: one(&*m.down)?,
                    inter: m.gate.out_features(),
                },
                Mlp::Moe(moe) => {
                    let gate_up: Vec<Vec<&dyn crate::backend::Linear>> =
                        moe.experts.iter().map(|e| vec![&*e.gate, &*e.up]).collect();
                    let down: Vec<Vec<&dyn crate::backend::Linear>> =
                        moe.experts.iter().map(|e| vec![&*e.down]).collect();
                    CudaMlp::Moe {
                        router: one(&*moe.router)?,
                        gate_up: GpuMatrix::upload(gpu, &gate_up)?,
                        down: GpuMatrix::upload(gpu, &down)?,
                        inter: moe.experts[0].gate.out_features(),
                        experts: moe.experts.len(),
                        top_k: moe.top_k,
                        renormalize: moe.norm_topk_prob,
                    }
                }
            };
            let qk_norm = match (&layer.q_norm, &layer.k_norm) {
                (Some(q), Some(k)) => Some((gpu.upload(q)?, gpu.upload(k)?)),
                _ => None,
            };
            layers.push(CudaLayer {
                input_norm: gpu.upload(&layer.input_norm)?,
                post_attention_norm: gpu.upload(&layer.post_attention_norm)?,
                q: one(&*layer.q_proj)?,
                k: one(&*layer.k_proj)?,
                v: one(&*layer.v_proj)?,
                o: one(&*layer.o_proj)?,
                qk_norm,
                mlp,
            });
        }
        Ok(CudaWeights {
            embed,
            lm_head: Some(GpuMatrix::upload(gpu, &[vec![&*model.lm_head]])?),
            layers,
            norm: gpu.upload(&model.norm)?,
        })
    }

    /// Dummy weights drawn on the device: the values `loader::dummy_model(cfg, recipe, seed)`
    /// builds on the CPU, in the same formats.
    pub fn dummy(
        gpu: &Gpu,
        cfg: &ModelConfig,
        recipe: &Recipe,
        seed: u64,
    ) -> Result<CudaWeights, CudaError> {
        let d = DummyWeights { gpu, seed };
        let h = cfg.hidden_size;
        let fmt =
            |module: &str, cols: usize| recipe.format_for(module, cfg.num_layers).fitting(cols);
        let single = |module: String, rows: usize, cols: usize| {
            let f = fmt(&module, cols);
            d.matrix(&[vec![(format!("{module}.weight"), rows)]], cols, &f, false)
        };
        let ones = |n: usize| gpu.upload(&vec![1f32; n]);
        // A SwiGLU (dense MLP or each expert): gate+up stacked, and down; NVFP4 gate/up share
        // one second-level scale as in the CPU loader.
        let swiglu =
            |prefixes: &[String], inter: usize| -> Result<(GpuMatrix, GpuMatrix), CudaError> {
                let (g, u) = (
                    fmt(&format!("{}.gate_proj", prefixes[0]), h),
                    fmt(&format!("{}.up_proj", prefixes[0]), h),
                );
                if g != u {
                    return Err(CudaError::Unsupported(
                        "gate and up in different formats".into(),
                    ));
                }
                let share = g.format == Format::Nvfp4;
                let gate_up: Vec<Vec<(String, usize)>> = prefixes
                    .iter()
                    .map(|p| {
                        vec![
                            (format!("{p}.gate_proj.weight"), inter),
                            (format!("{p}.up_proj.weight"), inter),
                        ]
                    })
                    .collect();
                let down: Vec<Vec<(String, usize)>> = prefixes
                    .iter()
                    .map(|p| vec![(format!("{p}.down_proj.weight"), h)])
                    .collect();
                let df = fmt(&format!("{}.down_proj", prefixes[0]), inter);
                Ok((
                    d.matrix(&gate_up, h, &g, share)?,
                    d.matrix(&down, inter, &df, false)?,
                ))
            };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let mlp = if cfg.is_moe_layer(l) {
                let moe = cfg.moe.as_ref().expect("moe layer has a moe config");
                let prefixes: Vec<String> = (0..moe.num_experts)
                    .map(|e| format!("{p}.mlp.experts.{e}"))
                    .collect();
                let (gate_up, down) = swiglu(&prefixes, moe.intermediate_size)?;
                let router = d.matrix(
                    &[vec![(format!("{p}.mlp.gate.weight"), moe.num_experts)]],
                    h,
                    &crate::quant::TensorFormat::BF16,
                    false,
                )?;
                CudaMlp::Moe {
                    router,
                    gate_up,
                    down,
                    inter: moe.intermediate_size,
                    experts: moe.num_experts,
                    top_k: moe.top_k,
                    renormalize: moe.norm_topk_prob,
                }
            } else {
                let (gate_up, down) = swiglu(&[format!("{p}.mlp")], cfg.intermediate_size)?;
                CudaMlp::Dense {
                    gate_up,
                    down,
                    inter: cfg.intermediate_size,
                }
            };
            layers.push(CudaLayer {
                input_norm: ones(h)?,
                post_attention_norm: ones(h)?,
                q: single(format!("{p}.self_attn.q_proj"), cfg.q_size(), h)?,
                k: single(format!("{p}.self_attn.k_proj"), cfg.kv_size(), h)?,
                v: single(format!("{p}.self_attn.v_proj"), cfg.kv_size(), h)?,
                o: single(format!("{p}.self_attn.o_proj"), h, cfg.q_size())?,
                qk_norm: if cfg.qk_norm {
                    Some((ones(cfg.head_dim)?, ones(cfg.head_dim)?))
                } else {
                    None
                },
                mlp,
            });
        }
        let embed = Table::Bf16(d.bf16("model.embed_tokens.weight", cfg.vocab_size, h)?);
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(d.matrix(
                &[vec![("lm_head.weight".to_string(), cfg.vocab_size)]],
                h,
                &crate::quant::TensorFormat::BF16,
                false,
            )?)
        };
        Ok(CudaWeights {
            embed,
            lm_head,
            layers,
            norm: ones(h)?,
        })
    }

    pub fn bytes(&self) -> usize {
        let table = match &self.embed {
            Table::Bf16(t) => t.len() * 2,
            Table::F32(t) => t.len() * 4,
        };
        let mut total = table + self.lm_head.as_ref().map_or(0, GpuMatrix::bytes);
        for l in &self.layers {
            total += l.q.bytes() + l.k.bytes() + l.v.bytes() + l.o.bytes();
            total += match &l.mlp {
                CudaMlp::Dense { gate_up, down, .. } => gate_up.bytes() + down.bytes(),
                CudaMlp::Moe {
                    router,
                    gate_up,
                    down,
                    ..
                } => router.bytes() + gate_up.bytes() + down.bytes(),
            };
        }
        total
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
) -> Result<(), CudaError> {
    let (n, k) = (m.n, m.k);
    match (&m.data, &rows, row_index) {
        (WeightData::F32(w), GemmRows::Dense(r), None) => {
            return ops::cublas_gemm(
                gpu,
                CublasOperand::F32(x),
                CublasOperand::F32(w),
                *r,
                n,
                k,
                out,
            )
        }
        (WeightData::Bf16(w), GemmRows::Dense(r), None) if *r > CUBLAS_MIN_ROWS => {
            ops::f32_to_bf16(gpu, x, &mut q.xb, r * k)?;
            return ops::cublas_gemm(
                gpu,
                CublasOperand::Bf16(&q.xb),
                CublasOperand::Bf16(w),
                *r,
                n,
                k,
                out,
            );
        }
        _ => {}
    }
    match m.act {
        Activation::Plain => {
            ops::grouped_gemm(gpu, x, row_index, None, &m.data, rows, out_rows, n, k, out)
        }
        Activation::Mxfp8 => {
            ops::mxfp8_quantize(
                gpu,
                x,
                x_rows * k,
                &mut q.data,
                &mut q.scales,
                Some(&mut q.deq),
            )?;
            if let Some(bs) = &mut q.block_scaled {
                return bs.run(
                    gpu,
                    BlockFormat::Mxfp8,
                    &m.data,
                    &q.data,
                    &q.scales,
                    None,
                    rows,
                    row_index,
                    n,
                    k,
                    out,
                );
            }
            ops::grouped_gemm(
                gpu, &q.deq, row_index, None, &m.data, rows, out_rows, n, k, out,
            )
        }
        Activation::Nvfp4 { per_token, params } => {
            if !per_token {
                if m.experts > 1 {
                    return Err(CudaError::Unsupported(
                        "per-tensor NVFP4 activations for experts (the CPU scales each expert's rows)".into(),
                    ));
                }
                ops::amax(gpu, x, x_rows * k, &mut q.amax)?;
            }
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
                    deq: Some(&mut q.deq),
                },
            )?;
            if let Some(bs) = &mut q.block_scaled {
                return bs.run(
                    gpu,
                    BlockFormat::Nvfp4,
                    &m.data,
                    &q.data,
                    &q.scales,
                    Some(&q.row_scale),
                    rows,
                    row_index,
                    n,
                    k,
                    out,
                );
            }
            ops::grouped_gemm(
                gpu,
                &q.deq,
                row_index,
                Some(&q.row_scale),
                &m.data,
                rows,
                out_rows,
                n,
                k,
                out,
            )
        }
    }
}

impl CudaModel {
    /// Puts `weights` to work: allocates the step scratch and sizes the KV cache.
    pub fn new(
        gpu: Gpu,
        config: ModelConfig,
        weights: CudaWeights,
        sizes: CudaSizes,
    ) -> Result<CudaModel, CudaError> {
        let c = &config;
        let t = sizes.max_batch_tokens.max(1);
        let (h, v) = (c.hidden_size, c.vocab_size);
        let (experts, top_k, moe_inter) = c
            .moe
            .as_ref()
            .map_or((0, 1, 0), |m| (m.num_experts, m.top_k, m.intermediate_size));
        let inter = c.intermediate_size.max(moe_inter);
        let pairs = t * top_k.max(1);
        // Widest GEMM input: x (hidden), attention output (q_size) or, per routed pair, the
        // expert's intermediate activations.
        let in_width = h.max(c.q_size()).max(c.intermediate_size);
        let quant_elems = (t * in_width).max(pairs * moe_inter);
        let moe_layers = c.num_moe_layers();
        let seqs = sizes.max_running_requests.max(1);
        let max_table_entries = seqs * sizes.max_context_len.div_ceil(sizes.block_size).max(1);
        let s = Scratch {
            tokens: gpu.alloc(t)?,
            pos: gpu.alloc(t)?,
            slots: gpu.alloc(t)?,
            row_seq: gpu.alloc(t)?,
            table_offsets: gpu.alloc(seqs)?,
            block_tables: gpu.alloc(max_table_entries)?,
            logit_rows: gpu.alloc(t)?,
            // At most one partial tile per sequence plus the full ones.
            attn_tiles: gpu.alloc(2 * (t / ops::PREFILL_TILE_ROWS + seqs))?,
            x: gpu.alloc(t * h)?,
            normed: gpu.alloc(t * h)?,
            q: gpu.alloc(t * c.q_size())?,
            k: gpu.alloc(t * c.kv_size())?,
            v: gpu.alloc(t * c.kv_size())?,
            attn: gpu.alloc(t * c.q_size())?,
            attn_split: SplitScratch::new(
                &gpu,
                seqs * c.num_heads * SPLIT_PARTIALS_PER_HEAD,
                c.head_dim,
            )?,
            o: gpu.alloc(t * h)?,
            y: gpu.alloc(t * h)?,
            router_logits: gpu.alloc(t * experts.max(1))?,
            topk_ids: gpu.alloc(pairs)?,
            topk_w: gpu.alloc(pairs)?,
            plan: if experts > 0 {
                Some(MoePlan::new(&gpu, pairs, experts)?)
            } else {
                None
            },
            gu: gpu.alloc(pairs * 2 * inter)?,
            h: gpu.alloc(pairs * inter)?,
            expert_out: gpu.alloc(pairs * h)?,
            logits: gpu.alloc(t.min(LOGIT_CHUNK_ROWS) * v)?,
            routed: gpu.alloc(moe_layers.max(1) * pairs)?,
            quant: QuantScratch {
                xb: gpu.alloc(t * in_width)?,
                data: gpu.alloc(quant_elems)?,
                scales: gpu.alloc(quant_elems / 16 + 1)?,
                deq: gpu.alloc(quant_elems)?,
                row_scale: gpu.alloc(pairs.max(t))?,
                amax: gpu.alloc(2)?,
                block_scaled: if BlockScaledGemm::available(&gpu) {
                    let widest = v.max(2 * inter).max(c.q_size()).max(h);
                    Some(BlockScaledGemm::new(&gpu, pairs.max(t), widest, in_width)?)
                } else {
                    None
                },
            },
        };
        // One sampled row per sequence; a launch samples at most one lm_head chunk's rows.
        let sampler = DeviceSampler::new(
            &gpu,
            v,
            seqs.min(LOGIT_CHUNK_ROWS),
            seqs,
            (sizes.max_context_len + 1024).max(1 << 16),
        )?;
        gpu.synchronize()?;
        let (free, total) = gpu.memory()?;
        let per_block = 2 * c.num_layers * c.kv_size() * 2 * sizes.block_size;
        let budget =
            (total as f64 * sizes.mem_fraction_static as f64) as i64 - (total - free) as i64;
        let mut num_blocks = (budget.max(0) as usize) / per_block;
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
        let cache_len = num_blocks * sizes.block_size * c.kv_size();
        let kv = KvCache {
            k: (0..c.num_layers)
                .map(|_| gpu.alloc::<u16>(cache_len))
                .collect::<Result<_, _>>()?,
            v: (0..c.num_layers)
                .map(|_| gpu.alloc::<u16>(cache_len))
                .collect::<Result<_, _>>()?,
            num_blocks,
        };
        let inv_freq = gpu.upload(&rope_inv_freq(c.head_dim, c.rope_theta, &c.rope_scaling))?;
        let weight_bytes = weights.bytes();
        tracing::info!(
            "CUDA memory: weights {:.2} GiB, sampler {:.2} GiB, KV cache {num_blocks} blocks of {} tokens ({:.2} GiB)",
            weight_bytes as f64 / (1u64 << 30) as f64,
            sampler.bytes() as f64 / (1u64 << 30) as f64,
            sizes.block_size,
            (num_blocks * per_block) as f64 / (1u64 << 30) as f64
        );
        Ok(CudaModel {
            gpu,
            config,
            weights,
            inv_freq,
            kv,
            s,
            sizes,
            max_table_entries,
            sampler,
            weight_bytes,
        })
    }

    pub fn num_kv_blocks(&self) -> usize {
        self.kv.num_blocks
    }

    pub fn num_moe_layers(&self) -> usize {
        self.config.num_moe_layers()
    }

    pub fn top_k(&self) -> usize {
        self.config.moe.as_ref().map_or(0, |m| m.top_k)
    }

    /// The device and the weights, borrowed apart (to write into the weights on the device).
    pub fn parts_mut(&mut self) -> (&Gpu, &mut CudaWeights) {
        (&self.gpu, &mut self.weights)
    }

    /// Replaces the weights (a weight update): same config, new values.
    pub fn replace_weights(&mut self, weights: CudaWeights) {
        self.weights = weights;
    }

    /// The forward pass with every asked-for logits row copied to the host.
    pub fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<ForwardOutput, CudaError> {
        Ok(self.forward_and_sample(batch, &[])?.0)
    }

    /// The forward pass, sampling on the device the last logits row of every sequence `i` with
    /// `samples[i]` given (missing entries: none). Those rows stay on the device: the output's
    /// `logits` and `logit_rows` hold the other asked-for rows only (for a sampled sequence,
    /// its rows before the last), and the second value has each sampled sequence's token.
    /// A sequence sampled here must ask for logits from its last row at the latest, and for at
    /// most [`super::sampling::MAX_DEVICE_TOP_LOGPROBS`] alternatives.
    pub fn forward_and_sample(
        &mut self,
        batch: &ForwardBatch<'_>,
        samples: &[Option<SampleInput<'_>>],
    ) -> Result<(ForwardOutput, Sampled), CudaError> {
        let c = &self.config;
        let bs = self.sizes.block_size;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let mut tokens = Vec::new();
        let (mut pos, mut slots, mut row_seq) = (Vec::new(), Vec::new(), Vec::new());
        let (mut table_offsets, mut tables) = (Vec::new(), Vec::new());
        let (mut logit_idx, mut logit_rows) = (Vec::new(), Vec::new());
        // Per logits row: its place among the host rows, or the sequence sampling it here.
        let mut row_dest = Vec::new();
        let mut host_rows = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            table_offsets.push(tables.len() as i32);
            tables.extend(s.block_table.iter().map(|&b| b as i32));
            let from = s.logits_from.unwrap_or(s.tokens.len()).min(s.tokens.len());
            let rows = s.tokens.len() - from;
            let on_device = samples.get(i).is_some_and(Option::is_some);
            if on_device && rows == 0 {
                return Err(CudaError::Unsupported(format!(
                    "sequence {i} is sampled but asks for no logits"
                )));
            }
            let to_host = rows - on_device as usize;
            logit_rows.push((host_rows, to_host));
            row_dest.extend((0..to_host).map(|k| RowDest::Host(host_rows + k)));
            if on_device {
                row_dest.push(RowDest::Device(i));
            }
            host_rows += to_host;
            for (j, &t) in s.tokens.iter().enumerate() {
                let p = s.start_pos + j;
                if j >= from {
                    logit_idx.push(tokens.len() as i32);
                }
                tokens.push(t);
                pos.push(p as i32);
                slots.push((s.block_table[p / bs] as usize * bs + p % bs) as i32);
                row_seq.push(i as i32);
            }
        }
        let n = tokens.len();
        let longest = batch
            .seqs
            .iter()
            .map(|s| s.start_pos + s.tokens.len())
            .max()
            .unwrap_or(0);
        if n > self.sizes.max_batch_tokens
            || batch.seqs.len() > self.sizes.max_running_requests.max(1)
            || tables.len() > self.max_table_entries
        {
            return Err(CudaError::Capacity(format!(
                "a step of {n} tokens in {} sequences exceeds the sizes the device was planned for",
                batch.seqs.len()
            )));
        }
        let moe_layers = self.num_moe_layers();
        let top_k = self.top_k();
        let shape = AttnShape {
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: hd,
            block_size: bs,
        };
        // Steps with a multi-token chunk run attention on tensor cores, a tile of up to 64
        // consecutive rows of one sequence per block; decode-only steps keep a block per row.
        let prefill = ops::prefill_attention_supports(shape)
            && batch
                .seqs
                .iter()
                .any(|s| s.tokens.len() >= PREFILL_ATTENTION_MIN_ROWS);
        let attn_tiles = if prefill {
            ops::prefill_tiles(batch.seqs.iter().map(|s| s.tokens.len()))
        } else {
            Vec::new()
        };
        let top_n = samples.iter().flatten().map(|i| i.top_logprobs_num);
        self.sampler
            .begin(top_n.max().unwrap_or(0).min(c.vocab_size))?;
        let (gpu, w, s, kv) = (&self.gpu, &self.weights, &mut self.s, &mut self.kv);
        let sampler = &mut self.sampler;
        gpu.write(&tokens, &mut s.tokens)?;
        gpu.write(&pos, &mut s.pos)?;
        gpu.write(&slots, &mut s.slots)?;
        gpu.write(&row_seq, &mut s.row_seq)?;
        gpu.write(&table_offsets, &mut s.table_offsets)?;
        gpu.write(&tables, &mut s.block_tables)?;
        gpu.write(&logit_idx, &mut s.logit_rows)?;
        gpu.write(&attn_tiles, &mut s.attn_tiles)?;
        ops::embedding(gpu, &s.tokens, n, &w.embed, &mut s.x, h)?;
        let eps = c.rms_norm_eps;
        let mut moe_index = 0;
        for (l, layer) in w.layers.iter().enumerate() {
            // The previous layer's MLP output joins the residual stream inside the norm.
            let residual = (l > 0).then_some(&s.y);
            ops::rms_norm(
                gpu,
                &mut s.x,
                residual,
                &layer.input_norm,
                &mut s.normed,
                None,
                n,
                h,
                eps,
            )?;
            let q = &mut s.quant;
            linear(
                gpu,
                &layer.q,
                &s.normed,
                n,
                GemmRows::Dense(n),
                None,
                n,
                &mut s.q,
                q,
            )?;
            linear(
                gpu,
                &layer.k,
                &s.normed,
                n,
                GemmRows::Dense(n),
                None,
                n,
                &mut s.k,
                q,
            )?;
            linear(
                gpu,
                &layer.v,
                &s.normed,
                n,
                GemmRows::Dense(n),
                None,
                n,
                &mut s.v,
                q,
            )?;
            ops::qk_norm_rope_store(
                gpu,
                &mut s.q,
                &mut s.k,
                &s.v,
                layer.qk_norm.as_ref().map(|(a, b)| (a, b)),
                &self.inv_freq,
                &s.pos,
                &s.slots,
                &mut kv.k[l],
                &mut kv.v[l],
                n,
                shape,
                eps,
            )?;
            let meta = AttnRows {
                pos: &s.pos,
                seq: &s.row_seq,
                table_offsets: &s.table_offsets,
                block_tables: &s.block_tables,
            };
            if prefill {
                ops::prefill_attention(
                    gpu,
                    &s.q,
                    &mut s.attn,
                    &kv.k[l],
                    &kv.v[l],
                    &meta,
                    &s.attn_tiles,
                    attn_tiles.len() / 2,
                    n,
                    shape,
                )?;
            } else if n <= self.sizes.max_running_requests
                && n * c.num_heads < SPLIT_DECODE_BLOCKS_PER_SM * gpu.sm_count as usize
            {
                // Decode steps of few rows take the GQA-aware kernel, which also splits long
                // contexts over the keys; with rows enough to fill the GPU, one block per
                // (row, head) is faster (H200, docs/performance.md: 265 vs 299 us at 64 rows).
                let split = KeySplit::plan(n, shape, longest, gpu.sm_count, s.attn_split.partials);
                ops::decode_attention(
                    gpu,
                    &s.q,
                    &mut s.attn,
                    &kv.k[l],
                    &kv.v[l],
                    &meta,
                    n,
                    shape,
                    split,
                    &mut s.attn_split,
                )?;
            } else {
                ops::paged_attention(gpu, &s.q, &mut s.attn, &kv.k[l], &kv.v[l], &meta, n, shape)?;
            }
            linear(
                gpu,
                &layer.o,
                &s.attn,
                n,
                GemmRows::Dense(n),
                None,
                n,
                &mut s.o,
                q,
            )?;
            ops::rms_norm(
                gpu,
                &mut s.x,
                Some(&s.o),
                &layer.post_attention_norm,
                &mut s.normed,
                None,
                n,
                h,
                eps,
            )?;
            match &layer.mlp {
                CudaMlp::Dense {
                    gate_up,
                    down,
                    inter,
                } => {
                    linear(
                        gpu,
                        gate_up,
                        &s.normed,
                        n,
                        GemmRows::Dense(n),
                        None,
                        n,
                        &mut s.gu,
                        q,
                    )?;
                    ops::silu_mul(gpu, &s.gu, &mut s.h, n, *inter)?;
                    linear(gpu, down, &s.h, n, GemmRows::Dense(n), None, n, &mut s.y, q)?;
                }
                CudaMlp::Moe {
                    router,
                    gate_up,
                    down,
                    inter,
                    experts,
                    top_k,
                    renormalize,
                } => {
                    let pairs = n * top_k;
                    linear(
                        gpu,
                        router,
                        &s.normed,
                        n,
                        GemmRows::Dense(n),
                        None,
                        n,
                        &mut s.router_logits,
                        q,
                    )?;
                    ops::moe_route(
                        gpu,
                        &s.router_logits,
                        n,
                        *experts,
                        *top_k,
                        *renormalize,
                        &mut s.topk_ids,
                        &mut s.topk_w,
                    )?;
                    let plan = s.plan.as_mut().expect("MoE scratch exists for MoE models");
                    plan.build(gpu, &s.topk_ids, n, *top_k, *experts)?;
                    let plan = &*plan;
                    linear(
                        gpu,
                        gate_up,
                        &s.normed,
                        n,
                        GemmRows::Plan(plan),
                        Some(&plan.row_token),
                        pairs,
                        &mut s.gu,
                        q,
                    )?;
                    ops::silu_mul(gpu, &s.gu, &mut s.h, pairs, *inter)?;
                    linear(
                        gpu,
                        down,
                        &s.h,
                        pairs,
                        GemmRows::Plan(plan),
                        None,
                        pairs,
                        &mut s.expert_out,
                        q,
                    )?;
                    ops::moe_combine(gpu, &s.expert_out, plan, &s.topk_w, &mut s.y, n, *top_k, h)?;
                    if pairs > 0 {
                        let at = moe_index * n * top_k;
                        gpu.stream.memcpy_dtod(
                            &s.topk_ids.slice(0..pairs),
                            &mut s.routed.slice_mut(at..at + pairs),
                        )?;
                    }
                    moe_index += 1;
                }
            }
        }
        // Final norm (with the last MLP output added) and lm_head on the logit rows only.
        let rows = logit_idx.len();
        let last = (!w.layers.is_empty()).then_some(&s.y);
        ops::rms_norm(
            gpu,
            &mut s.x,
            last,
            &w.norm,
            &mut s.normed,
            Some(&s.logit_rows),
            rows,
            h,
            eps,
        )?;
        let v = c.vocab_size;
        let mut logits = vec![0f32; host_rows * v];
        let mut sampled_seqs = Vec::new();
        for first in (0..rows).step_by(LOGIT_CHUNK_ROWS) {
            let m = LOGIT_CHUNK_ROWS.min(rows - first);
            let x = s.normed.slice(first * h..(first + m) * h);
            // cuBLAS and the casts take whole buffers: copy the chunk's rows to the front.
            gpu.stream.memcpy_dtod(&x, &mut s.o.slice_mut(0..m * h))?;
            match (&w.lm_head, &w.embed) {
                (Some(head), _) => linear(
                    gpu,
                    head,
                    &s.o,
                    m,
                    GemmRows::Dense(m),
                    None,
                    m,
                    &mut s.logits,
                    &mut s.quant,
                )?,
                (None, Table::Bf16(t)) => {
                    ops::f32_to_bf16(gpu, &s.o, &mut s.quant.xb, m * h)?;
                    ops::cublas_gemm(
                        gpu,
                        CublasOperand::Bf16(&s.quant.xb),
                        CublasOperand::Bf16(t),
                        m,
                        v,
                        h,
                        &mut s.logits,
                    )?;
                }
                (None, Table::F32(t)) => {
                    ops::cublas_gemm(
                        gpu,
                        CublasOperand::F32(&s.o),
                        CublasOperand::F32(t),
                        m,
                        v,
                        h,
                        &mut s.logits,
                    )?;
                }
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
                            &s.logits.slice(r * v..(r + run) * v),
                            &mut logits[dest * v..(dest + run) * v],
                        )?;
                        r += run;
                    }
                    RowDest::Device(i) => {
                        let input = samples[i].expect("device rows have sampling inputs");
                        device_rows.push((r, input));
                        sampled_seqs.push(i);
                        r += 1;
                    }
                }
            }
            if !device_rows.is_empty() {
                sampler.sample(gpu, &mut s.logits, &device_rows)?;
            }
        }
        let mut sampled: Sampled = vec![None; batch.seqs.len()];
        for (i, result) in sampled_seqs.into_iter().zip(sampler.finish(gpu)?) {
            sampled[i] = Some(result);
        }
        let by_layer = gpu.download(&s.routed, moe_layers * n * top_k)?;
        gpu.synchronize()?;
        // [layer][token][k] -> [token][layer][k], the CPU backend's order.
        let mut routed = vec![0i32; n * moe_layers * top_k];
        for m in 0..moe_layers {
            for t in 0..n {
                routed[(t * moe_layers + m) * top_k..][..top_k]
                    .copy_from_slice(&by_layer[(m * n + t) * top_k..][..top_k]);
            }
        }
        Ok((
            ForwardOutput {
                logits,
                logit_rows,
                routed_experts: routed,
            },
            sampled,
        ))
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
