//! The model on a CUDA device: its weights as a [`Model<Cuda>`] (uploaded from a CPU-built
//! model, loaded straight from a checkpoint, or drawn on the device), their slot table and
//! checksum, and [`CudaModel`], which runs the one forward pass ([`super::forward`]) on them.

mod dummy;
pub use dummy::DummyWeights;
pub mod load;
pub mod memory;
pub mod quantize;
pub mod slots;

use cudarc::driver::CudaSlice;

use super::forward::{forward, ForwardOptions, StepState};
use super::{
    ForwardBatch, ForwardOutput, ForwardTrace, Layer, Mlp, Model, ModelConfig, Moe, SeqInput,
};
use crate::backend::cpu::linear::DenseWeight;
pub use crate::backend::cuda::backend::{Cuda, CudaSizes};
use crate::backend::cuda::backend::{CudaExperts, CudaKv, CudaSwiGlu, ModelShape};
use crate::backend::cuda::graphs::{padded_rows, GRAPH_ROWS};
use crate::backend::cuda::ops::Table;
use crate::backend::cuda::weights::GpuMatrix;
use crate::backend::cuda::{CudaError, Gpu};
use crate::backend::{Linear, MoeShape, Sampled};
use crate::model::checksum::WeightsChecksum;
use crate::model::layout::{Place, Proj};
use crate::model::slots::{Replacement, SlotShape};
use crate::model::store::{SlotParts, StoreError, WeightStore};
use crate::sampling::SampleInput;
use std::collections::BTreeMap;

/// The model's weights on the device.
pub type CudaWeights = Model<Cuda>;

impl Model<Cuda> {
    /// Puts the device parts together (RoPE's frequencies are uploaded here).
    pub fn on_device(
        gpu: &Gpu,
        config: ModelConfig,
        embed_tokens: Table,
        layers: Vec<Layer<Cuda>>,
        norm: CudaSlice<f32>,
        lm_head: Option<GpuMatrix>,
    ) -> Result<CudaWeights, CudaError> {
        let inv_freq = gpu.upload(&config.rope_inv_freq())?;
        Ok(Model {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
        })
    }

    /// Uploads a model the CPU loader built (any checkpoint format, quantized by `quant`).
    pub fn upload(gpu: &Gpu, model: &Model) -> Result<CudaWeights, CudaError> {
        let embed = match &model.embed_tokens {
            DenseWeight::Bf16(w) => {
                Table::Bf16(gpu.upload(&w.iter().map(|v| v.to_bits()).collect::<Vec<_>>())?)
            }
            DenseWeight::F32(w) => Table::F32(gpu.upload(w)?),
        };
        let one = |l: &dyn Linear| GpuMatrix::upload(gpu, &[vec![l]]);
        let mut layers = Vec::with_capacity(model.layers.len());
        for layer in &model.layers {
            let cfg = &model.config;
            let mlp = match &layer.mlp {
                Mlp::Dense(m) => device_mlp(
                    cfg,
                    None,
                    GpuMatrix::upload(gpu, &[vec![&*m.gate, &*m.up]])?,
                    one(&*m.down)?,
                ),
                Mlp::Moe(moe) => {
                    let gate_up: Vec<Vec<&dyn Linear>> =
                        moe.experts.iter().map(|e| vec![&*e.gate, &*e.up]).collect();
                    let down: Vec<Vec<&dyn Linear>> =
                        moe.experts.iter().map(|e| vec![&*e.down]).collect();
                    device_mlp(
                        cfg,
                        Some(one(&*moe.router)?),
                        GpuMatrix::upload(gpu, &gate_up)?,
                        GpuMatrix::upload(gpu, &down)?,
                    )
                }
            };
            let vector = |v: &Option<Vec<f32>>| v.as_ref().map(|v| gpu.upload(v)).transpose();
            layers.push(Layer {
                input_norm: gpu.upload(&layer.input_norm)?,
                post_attention_norm: gpu.upload(&layer.post_attention_norm)?,
                q_proj: one(&*layer.q_proj)?,
                k_proj: one(&*layer.k_proj)?,
                v_proj: one(&*layer.v_proj)?,
                o_proj: one(&*layer.o_proj)?,
                q_norm: vector(&layer.q_norm)?,
                k_norm: vector(&layer.k_norm)?,
                mlp,
            });
        }
        let lm_head = Some(GpuMatrix::upload(gpu, &[vec![&*model.lm_head]])?);
        let norm = gpu.upload(&model.norm)?;
        Model::on_device(gpu, model.config.clone(), embed, layers, norm, lm_head)
    }

    /// Device bytes of the weights.
    pub fn bytes(&self) -> usize {
        let table = match &self.embed_tokens {
            Table::Bf16(t) => t.len() * 2,
            Table::F32(t) => t.len() * 4,
        };
        let mut total = table + self.lm_head.as_ref().map_or(0, GpuMatrix::bytes);
        for l in &self.layers {
            total += l.q_proj.bytes() + l.k_proj.bytes() + l.v_proj.bytes() + l.o_proj.bytes();
            total += match &l.mlp {
                Mlp::Dense(m) => m.gate_up.bytes() + m.down.bytes(),
                Mlp::Moe(m) => {
                    m.router.bytes() + m.experts.gate_up.bytes() + m.experts.down.bytes()
                }
            };
        }
        total
    }
}

impl WeightStore for CudaModel {
    fn slot_shapes(&mut self) -> BTreeMap<String, SlotShape> {
        let config = self.config.clone();
        self.weights.slot_shapes(&config)
    }

    fn checksum(&mut self) -> Result<WeightsChecksum, StoreError> {
        let (gpu, weights) = (&self.backend.gpu, &mut self.weights);
        weights
            .weights_checksum(gpu, &self.config)
            .map_err(|e| StoreError::Device(e.to_string()))
    }

    /// Written into the device buffers the weights live in (see `CudaWeights::write_replacements`).
    fn write(
        &mut self,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, StoreError> {
        // Written into the buffers the weights live in, which do not move: the recorded decode
        // steps read the new values (kernels read every weight, scale and S_dec from device
        // memory; none is a launch argument).
        let (gpu, weights) = (&self.backend.gpu, &mut self.weights);
        weights.write_replacements(gpu, &self.config, updates)
    }

    fn parts_of(&mut self, names: &[String]) -> Result<SlotParts, StoreError> {
        let (gpu, weights) = (&self.backend.gpu, &mut self.weights);
        weights.parts_of(gpu, &self.config, names)
    }
}

/// Where a device model's tensors come from (a checkpoint, or the dummy generator): each
/// method makes one tensor (or one stack) of the layout on the device.
trait DeviceSource {
    type Error: From<CudaError>;
    fn embedding(&self, place: Place, rows: usize, cols: usize) -> Result<Table, Self::Error>;
    fn vector(&self, place: Place, len: usize) -> Result<CudaSlice<f32>, Self::Error>;
    /// A high-precision matrix (a router).
    fn plain(&self, place: Place, rows: usize, cols: usize) -> Result<GpuMatrix, Self::Error>;
    /// A linear layer in its recipe's format.
    fn linear(&self, place: Place, rows: usize, cols: usize) -> Result<GpuMatrix, Self::Error>;
    /// The SwiGLUs `prefixes` (a dense MLP, or every expert of a layer) as a gate+up stack and
    /// a down stack; an NVFP4 gate/up pair shares one second-level scale.
    fn swiglu(
        &self,
        prefixes: &[String],
        hidden: usize,
        inter: usize,
    ) -> Result<(GpuMatrix, GpuMatrix), Self::Error>;
    /// lm_head (None: tied to the table).
    fn lm_head(&self, table: &Table) -> Result<Option<GpuMatrix>, Self::Error>;
    /// A layer is on the device: what the source holds on the host for it may go.
    fn layer_done(&self) {}
}

/// The whole model from `src`, in the layout's order.
fn assemble<S: DeviceSource>(
    gpu: &Gpu,
    cfg: &ModelConfig,
    src: &S,
) -> Result<CudaWeights, S::Error> {
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let embed = src.embedding(Place::Embedding, v, h)?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for l in 0..cfg.num_layers {
        let mlp = match cfg.moe.as_ref().filter(|_| cfg.is_moe_layer(l)) {
            Some(moe) => {
                let prefixes: Vec<String> = (0..moe.num_experts)
                    .map(|e| Place::swiglu_prefix(l, Some(e)))
                    .collect();
                let router = src.plain(Place::Router(l), moe.num_experts, h)?;
                let (gate_up, down) = src.swiglu(&prefixes, h, moe.intermediate_size)?;
                device_mlp(cfg, Some(router), gate_up, down)
            }
            None => {
                let prefixes = [Place::swiglu_prefix(l, None)];
                let (gate_up, down) = src.swiglu(&prefixes, h, cfg.intermediate_size)?;
                device_mlp(cfg, None, gate_up, down)
            }
        };
        let qk = |place| {
            cfg.qk_norm
                .then(|| src.vector(place, cfg.head_dim))
                .transpose()
        };
        let attention = |proj, rows, cols| src.linear(Place::Attention(l, proj), rows, cols);
        layers.push(Layer {
            input_norm: src.vector(Place::InputNorm(l), h)?,
            post_attention_norm: src.vector(Place::PostAttentionNorm(l), h)?,
            q_proj: attention(Proj::Q, cfg.q_size(), h)?,
            k_proj: attention(Proj::K, cfg.kv_size(), h)?,
            v_proj: attention(Proj::V, cfg.kv_size(), h)?,
            o_proj: attention(Proj::O, h, cfg.q_size())?,
            q_norm: qk(Place::QNorm(l))?,
            k_norm: qk(Place::KNorm(l))?,
            mlp,
        });
        src.layer_done();
    }
    let norm = src.vector(Place::FinalNorm, h)?;
    let lm_head = src.lm_head(&embed)?;
    gpu.synchronize()?;
    Ok(Model::on_device(
        gpu,
        cfg.clone(),
        embed,
        layers,
        norm,
        lm_head,
    )?)
}

/// A layer's MLP from its device matrices: an MoE when it has a router, else a dense SwiGLU.
fn device_mlp(
    cfg: &ModelConfig,
    router: Option<GpuMatrix>,
    gate_up: GpuMatrix,
    down: GpuMatrix,
) -> Mlp<Cuda> {
    match (router, cfg.moe.as_ref()) {
        (Some(router), Some(moe)) => Mlp::Moe(Moe {
            router,
            experts: CudaExperts {
                gate_up,
                down,
                inter: moe.intermediate_size,
                count: moe.num_experts,
            },
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
        }),
        _ => Mlp::Dense(CudaSwiGlu {
            gate_up,
            down,
            inter: cfg.intermediate_size,
        }),
    }
}

/// The shapes the device buffers are planned for.
fn model_shape(c: &ModelConfig) -> ModelShape {
    ModelShape {
        dims: c.dims(),
        num_layers: c.num_layers,
        intermediate: c.intermediate_size,
        moe: c.moe.as_ref().map(|m| MoeShape {
            experts: m.num_experts,
            top_k: m.top_k,
            renormalize: m.norm_topk_prob,
            inter: m.intermediate_size,
        }),
        moe_layers: c.num_moe_layers(),
    }
}

/// Weights, KV cache and step buffers on one device, and the backend that runs the forward
/// on them. Memory is planned once at start-up: weights, then the step's scratch for the
/// largest step, then the paged BF16 KV cache from what `--mem-fraction-static` leaves.
pub struct CudaModel {
    pub backend: Cuda,
    pub config: ModelConfig,
    weights: CudaWeights,
    kv: CudaKv,
    state: StepState<Cuda>,
    pub weight_bytes: usize,
    /// The weights while released (`/release_memory_occupation`): their sizes and backup.
    parked: Option<memory::ParkedWeights>,
}

impl CudaModel {
    /// Puts `weights` to work: allocates the step scratch and sizes the KV cache.
    pub fn new(
        gpu: Gpu,
        config: ModelConfig,
        weights: CudaWeights,
        sizes: CudaSizes,
    ) -> Result<CudaModel, CudaError> {
        let shape = model_shape(&config);
        let backend = Cuda::new(gpu, &shape, sizes)?;
        let state = StepState {
            bufs: backend.buffers(&shape)?,
            route: backend.route(&shape)?,
        };
        let kv = backend.kv_cache(&shape)?;
        let weight_bytes = weights.bytes();
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let per_block = 2 * config.num_layers * config.kv_size() * 2 * sizes.block_size;
        tracing::info!(
            "CUDA memory: weights {:.2} GiB, sampler {:.2} GiB, KV cache {} blocks of {} tokens ({:.2} GiB)",
            gib(weight_bytes),
            gib(backend.sampler_bytes()),
            kv.num_blocks,
            sizes.block_size,
            gib(kv.num_blocks * per_block)
        );
        Ok(CudaModel {
            backend,
            config,
            weights,
            kv,
            state,
            weight_bytes,
            parked: None,
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.backend.gpu
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

    /// Replaces the weights (a weight update): same config, new values. Returns the old ones.
    pub fn replace_weights(&mut self, weights: CudaWeights) -> CudaWeights {
        self.weight_bytes = weights.bytes();
        self.parked = None;
        self.backend.clear_graphs();
        std::mem::replace(&mut self.weights, weights)
    }

    /// A copy of the served weights made on `gpu`'s stream (see [`CudaWeights::copy_on`]).
    pub fn copy_weights(&self, gpu: &Gpu) -> Result<CudaWeights, CudaError> {
        self.weights.copy_on(gpu)
    }

    /// Device bytes of the KV cache (when allocated).
    pub fn kv_bytes(&self) -> usize {
        let c = &self.config;
        self.kv.num_blocks * 2 * c.num_layers * c.kv_size() * 2 * self.backend.sizes.block_size
    }

    /// Frees the KV cache's device memory (its contents are gone). No step may run until
    /// [`CudaModel::resume_kv`]. Returns the bytes freed.
    pub fn release_kv(&mut self) -> Result<usize, CudaError> {
        let bytes = self.kv_bytes();
        self.backend.clear_graphs();
        self.kv.k = Vec::new();
        self.kv.v = Vec::new();
        self.trim();
        Ok(bytes)
    }

    /// Allocates the KV cache again, the same blocks, zeroed. On failure it stays released.
    pub fn resume_kv(&mut self) -> Result<usize, CudaError> {
        let kv = self
            .backend
            .alloc_kv(&model_shape(&self.config), self.kv.num_blocks)?;
        self.kv = kv;
        self.backend.clear_graphs();
        Ok(self.kv_bytes())
    }

    /// Frees the weights' device memory, with `backup` first copying them to the host (see
    /// [`memory`]). No step may run until [`CudaModel::resume_weights`]. Returns the bytes
    /// freed; on failure nothing is.
    pub fn release_weights(&mut self, backup: bool) -> Result<usize, CudaError> {
        self.backend.clear_graphs();
        let parked = self.weights.release(&self.backend.gpu, backup)?;
        let bytes = parked.bytes;
        self.parked = Some(parked);
        self.trim();
        Ok(bytes)
    }

    /// Allocates the weights again: the backup's bits, or zeros without one (absent until an
    /// update writes them). On failure they stay released. Returns the bytes.
    pub fn resume_weights(&mut self) -> Result<usize, CudaError> {
        let parked = self
            .parked
            .as_ref()
            .ok_or_else(|| CudaError::Unsupported("the weights are not released".into()))?;
        self.backend.clear_graphs();
        self.weights.restore(&self.backend.gpu, parked)?;
        let bytes = parked.bytes;
        self.parked = None;
        Ok(bytes)
    }

    /// Freed memory back to the driver. The buffers are gone from the model either way, so a
    /// failure here (memory kept in the allocator's pool) is only logged.
    fn trim(&self) {
        if let Err(e) = self.backend.gpu.return_freed_memory() {
            tracing::warn!("freed device memory may stay reserved by this process: {e}");
        }
    }

    /// The forward pass with every asked-for logits row copied to the host.
    pub fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<ForwardOutput, CudaError> {
        Ok(self.forward_with(batch, &[], None)?.0)
    }

    /// The forward pass, sampling on the device the last logits row of every sequence `i` with
    /// `samples[i]` given (missing entries: none). Those rows stay on the device: the output's
    /// `logits` and `logit_rows` hold the other asked-for rows only (for a sampled sequence,
    /// its rows before the last), and the second value has each sampled sequence's token.
    pub fn forward_and_sample(
        &mut self,
        batch: &ForwardBatch<'_>,
        samples: &[Option<SampleInput<'_>>],
    ) -> Result<(ForwardOutput, Sampled), CudaError> {
        self.forward_with(batch, samples, None)
    }

    /// The forward with the trainer's options on the device, as [`Model::forward_traced`] on
    /// the CPU: `routing` replaces the routers' choice, `trace` receives the activations
    /// (copied to the host as the layers run).
    pub fn forward_traced(
        &mut self,
        batch: &ForwardBatch<'_>,
        routing: Option<&[i32]>,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<ForwardOutput, CudaError> {
        let opts = ForwardOptions {
            routing,
            trace,
            samples: &[],
            record: false,
        };
        Ok(self.run(batch, opts)?.0)
    }

    /// [`CudaModel::forward_and_sample`] with routing replay: `routing` (`[total_tokens,
    /// num_moe_layers, top_k]`, batch order) replaces the routers' choice of experts.
    pub fn forward_with(
        &mut self,
        batch: &ForwardBatch<'_>,
        samples: &[Option<SampleInput<'_>>],
        routing: Option<&[i32]>,
    ) -> Result<(ForwardOutput, Sampled), CudaError> {
        let opts = ForwardOptions {
            routing,
            trace: None,
            samples,
            record: false,
        };
        self.run(batch, opts)
    }

    /// The largest decode step run on a CUDA graph (0: none).
    fn graph_max_rows(&self) -> usize {
        let sizes = &self.backend.sizes;
        sizes
            .graph_max_rows
            .min(sizes.max_running_requests)
            .min(sizes.max_batch_tokens)
    }

    /// Records the decode step of every row count of [`GRAPH_ROWS`] up to the largest a step
    /// runs on a graph, as SGLang captures its graphs at start-up: so serving runs no step launch
    /// by launch, nor stops to record one, until the weights or the KV cache move (then each
    /// size is recorded again on its second step). Each is a step of padding rows (the padding
    /// block, whose contents nobody reads), run once eagerly, then recorded. Returns the row
    /// counts recorded.
    pub fn capture_decode_graphs(&mut self) -> Result<usize, CudaError> {
        let padding_table = [self.kv.padding_block()];
        let padding = SeqInput {
            tokens: &[0],
            start_pos: 0,
            block_table: &padding_table,
            logits_from: None,
        };
        let max_rows = self.graph_max_rows();
        for &rows in GRAPH_ROWS.iter().filter(|&&r| r <= max_rows) {
            let batch = ForwardBatch {
                seqs: vec![padding; rows],
            };
            for _ in 0..2 {
                self.forward(&batch)?;
            }
        }
        Ok(self.backend.recorded_steps())
    }

    /// The one forward on this device's weights, KV cache and step buffers. A decode step
    /// (one row per sequence, no trace, no replayed routing) is padded with one-row sequences
    /// in the padding block to a row count of [`GRAPH_ROWS`] and runs on a CUDA graph
    /// (backend/cuda/graphs.rs); the padding's outputs are dropped. Rows do not depend on the
    /// batch they are in (docs/determinism.md), so padding changes no bit of the others.
    pub fn run(
        &mut self,
        batch: &ForwardBatch<'_>,
        mut opts: ForwardOptions<'_, '_>,
    ) -> Result<(ForwardOutput, Sampled), CudaError> {
        let max_rows = self.graph_max_rows();
        let decode = !batch.seqs.is_empty() && batch.seqs.iter().all(|s| s.tokens.len() == 1);
        let padded = (decode && opts.trace.is_none() && opts.routing.is_none())
            .then(|| padded_rows(batch.seqs.len(), max_rows))
            .flatten();
        let Some(padded) = padded else {
            return forward(
                &mut self.backend,
                &self.weights,
                &mut self.kv,
                &mut self.state,
                batch,
                opts,
            );
        };
        let real = batch.seqs.len();
        let padding_table = [self.kv.padding_block()];
        let mut seqs = batch.seqs.to_vec();
        seqs.resize_with(padded, || SeqInput {
            tokens: &[0],
            start_pos: 0,
            block_table: &padding_table,
            logits_from: None,
        });
        opts.record = true;
        let (mut out, mut sampled) = forward(
            &mut self.backend,
            &self.weights,
            &mut self.kv,
            &mut self.state,
            &ForwardBatch { seqs },
            opts,
        )?;
        out.logit_rows.truncate(real);
        out.routed_experts
            .truncate(real * self.config.num_moe_layers() * self.top_k());
        sampled.truncate(real);
        Ok((out, sampled))
    }
}
