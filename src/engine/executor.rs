//! Where the forward pass and sampling run, behind one trait: the CPU reference (model and KV
//! cache in host memory, rows sampled by `sampling::sample`) or a CUDA device (rows sampled on
//! the device, only the tokens, logprobs and top-N copied back). Both run the one forward,
//! `model::forward`. [`build`] makes the executor a spec names, on the engine thread; its
//! errors travel back to whoever started the engine.

use crate::backend::cpu::attention::KvMemory;
use crate::backend::cpu::Cpu;
use crate::backend::cuda::{CudaError, CudaSizes, Gpu};
use crate::backend::Sampled;
use crate::model::checksum::WeightsChecksum;
use crate::model::cuda::{CudaModel, CudaWeights};
use crate::model::loader::{open_serving_checkpoint, Quantization};
use crate::model::slots::{Replacement, SlotShape};
use crate::model::store::{StoreError, WeightStore};
use crate::model::{
    forward, ForwardBatch, ForwardOptions, ForwardOutput, Model, ModelConfig, StepState,
};
use crate::quant::Recipe;
use crate::sampling::SampleInput;

use super::config::EngineConfig;
use super::EngineError;

/// What the engine is started with.
pub enum ExecutorSpec {
    Cpu(Model),
    Cuda {
        device: usize,
        weights: CudaSource,
        mem_fraction_static: f32,
        /// Cap on KV tokens; None sizes the cache from memory alone.
        max_total_tokens: Option<usize>,
        /// `CudaSizes::block_scaled_gemm` (Blackwell only, not batch-invariant).
        block_scaled_gemm: bool,
    },
}

/// How the CUDA executor gets its weights.
pub enum CudaSource {
    /// A model the CPU loader built, uploaded (nothing of it stays on the host).
    Model(Model),
    /// A checkpoint loaded straight to the device (`CudaWeights::from_checkpoint`): nothing
    /// stays on the host; streamed updates are written into the device buffers by slot name
    /// and the checksum is computed from the device.
    Checkpoint(DiskWeights),
    /// `--load-format dummy`: drawn on the device, nothing on the host.
    Dummy {
        config: ModelConfig,
        recipe: Recipe,
        seed: u64,
    },
}

/// A checkpoint directory and how to serve it (the server's `--quantization`/`--recipe`).
#[derive(Clone, Debug)]
pub struct DiskWeights {
    pub dir: std::path::PathBuf,
    pub quantization: Option<Quantization>,
    pub recipe: Option<Recipe>,
}

/// The slot table and checksum of weights that live only on the device, published by the
/// engine once they are loaded.
pub(crate) struct DeviceCatalog {
    pub slots: std::collections::BTreeMap<String, SlotShape>,
    pub checksum: WeightsChecksum,
}

/// One step's results.
pub(crate) struct StepOutput {
    /// The asked-for logits rows on the host, except rows sampled on the device (on CUDA, a
    /// sampled sequence's last row): what prompt logprobs read.
    pub forward: ForwardOutput,
    /// Per sequence of the batch: its sampled token, when it was given sampling inputs.
    pub sampled: Sampled,
}

/// The model, its weights, KV memory and step buffers on one backend: what the engine loop
/// drives.
pub(crate) trait Executor {
    fn config(&self) -> &ModelConfig;

    fn num_kv_blocks(&self) -> usize;

    /// Runs the forward pass and samples the last logits row of every sequence `i` with
    /// `samples[i]` given (such a sequence asks for logits from its last row at the latest).
    /// An error here is a device failure the engine cannot recover from.
    fn step(
        &mut self,
        batch: &ForwardBatch<'_>,
        samples: &[Option<SampleInput<'_>>],
    ) -> Result<StepOutput, EngineError>;

    /// Replaces the whole model (same config), e.g. after `/update_weights_from_disk`.
    fn swap(&mut self, new: Model) -> Result<(), EngineError>;

    /// Replaces some tensors (a streamed update) through the weights' [`WeightStore`]: all
    /// checked, then written in place. Returns what is left to free.
    fn apply(
        &mut self,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, EngineError>;

    /// The slot table and checksum of device-only weights (None when the host holds them).
    fn device_catalog(&mut self) -> Result<Option<DeviceCatalog>, EngineError> {
        Ok(None)
    }

    /// `/update_weights_from_disk` loaded on the engine thread (device-only weights).
    fn swap_from_disk(&mut self, _w: &DiskWeights) -> Result<WeightsChecksum, EngineError> {
        Err(EngineError::Conflict(
            "updates loaded on the engine thread are for device-loaded CUDA weights".into(),
        ))
    }
}

/// Builds the executor `spec` names (on the engine thread: the CUDA context lives where it is
/// used).
pub(crate) fn build(
    spec: ExecutorSpec,
    cfg: &EngineConfig,
) -> Result<Box<dyn Executor>, EngineError> {
    match spec {
        ExecutorSpec::Cpu(model) => Ok(Box::new(CpuExecutor::new(model, cfg))),
        ExecutorSpec::Cuda {
            device,
            weights,
            mem_fraction_static,
            max_total_tokens,
            block_scaled_gemm,
        } => {
            let sizes = CudaSizes {
                max_batch_tokens: cfg.max_batch_tokens,
                max_running_requests: cfg.max_running_requests,
                block_size: cfg.block_size,
                max_context_len: cfg.max_context_len,
                mem_fraction_static,
                max_total_tokens,
                block_scaled_gemm,
            };
            let exec = CudaExecutor::new(device, weights, sizes).map_err(start_error)?;
            Ok(Box::new(exec))
        }
    }
}

fn start_error(e: CudaError) -> EngineError {
    EngineError::Start(e.to_string())
}

/// Two configs describe the same shapes (their raw JSON aside).
pub(crate) fn same_shapes(a: &ModelConfig, b: &ModelConfig) -> bool {
    let (mut a, mut b) = (a.clone(), b.clone());
    a.raw = serde_json::Value::Null;
    b.raw = serde_json::Value::Null;
    a == b
}

/// The CPU reference: model and KV cache in host memory.
struct CpuExecutor {
    model: Model,
    kv: KvMemory,
    backend: Cpu,
    state: StepState<Cpu>,
}

impl CpuExecutor {
    fn new(model: Model, cfg: &EngineConfig) -> CpuExecutor {
        let c = &model.config;
        let num_blocks = cfg.max_total_tokens.div_ceil(cfg.block_size).max(1);
        let kv = KvMemory::new(
            cfg.kv_dtype,
            c.num_layers,
            num_blocks,
            cfg.block_size,
            c.num_kv_heads,
            c.head_dim,
        );
        CpuExecutor {
            model,
            kv,
            backend: Cpu::default(),
            state: StepState::default(),
        }
    }
}

impl Executor for CpuExecutor {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn num_kv_blocks(&self) -> usize {
        self.kv.num_blocks
    }

    fn step(
        &mut self,
        batch: &ForwardBatch<'_>,
        samples: &[Option<SampleInput<'_>>],
    ) -> Result<StepOutput, EngineError> {
        let opts = ForwardOptions {
            routing: None,
            trace: None,
            samples,
        };
        let Ok((forward, sampled)) = forward(
            &mut self.backend,
            &self.model,
            &mut self.kv,
            &mut self.state,
            batch,
            opts,
        );
        Ok(StepOutput { forward, sampled })
    }

    fn swap(&mut self, new: Model) -> Result<(), EngineError> {
        self.model = new;
        Ok(())
    }

    fn apply(
        &mut self,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, EngineError> {
        self.model.write(updates).map_err(store_error)
    }
}

/// A CUDA device: weights, KV cache and step buffers in device memory; nothing of the model
/// stays on the host.
struct CudaExecutor {
    model: Box<CudaModel>,
}

/// Opens `w` and loads it into device memory.
fn load_to_device(gpu: &Gpu, w: &DiskWeights) -> Result<(ModelConfig, CudaWeights), String> {
    let src = open_serving_checkpoint(&w.dir, w.quantization, w.recipe.clone())
        .map_err(|e| format!("{}: {e}", w.dir.display()))?;
    let weights =
        CudaWeights::from_checkpoint(gpu, &src).map_err(|e| format!("{}: {e}", w.dir.display()))?;
    Ok((src.config, weights))
}

impl CudaExecutor {
    fn new(device: usize, weights: CudaSource, sizes: CudaSizes) -> Result<Self, CudaError> {
        let gpu = Gpu::open(device)?;
        let (config, dev_weights) = match weights {
            CudaSource::Model(model) => (model.config.clone(), CudaWeights::upload(&gpu, &model)?),
            CudaSource::Checkpoint(disk) => load_to_device(&gpu, &disk).map_err(CudaError::Load)?,
            CudaSource::Dummy {
                config,
                recipe,
                seed,
            } => {
                let w = CudaWeights::dummy(&gpu, &config, &recipe, seed)?;
                (config, w)
            }
        };
        let model = CudaModel::new(gpu, config, dev_weights, sizes)?;
        Ok(CudaExecutor {
            model: Box::new(model),
        })
    }
}

fn store_error(e: StoreError) -> EngineError {
    EngineError::Conflict(format!("the weights could not take the update: {e}"))
}

impl Executor for CudaExecutor {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn num_kv_blocks(&self) -> usize {
        self.model.num_kv_blocks()
    }

    fn step(
        &mut self,
        batch: &ForwardBatch<'_>,
        samples: &[Option<SampleInput<'_>>],
    ) -> Result<StepOutput, EngineError> {
        let (forward, sampled) = self
            .model
            .forward_and_sample(batch, samples)
            .map_err(|e| EngineError::Stopped(format!("CUDA forward failed: {e}")))?;
        Ok(StepOutput { forward, sampled })
    }

    /// A host-built model is written into the device buffers, slot by slot, like a streamed
    /// update of every tensor.
    fn swap(&mut self, new: Model) -> Result<(), EngineError> {
        self.model
            .write(new.into_replacements())
            .map(drop)
            .map_err(store_error)
    }

    fn apply(
        &mut self,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, EngineError> {
        self.model.write(updates).map_err(store_error)
    }

    fn device_catalog(&mut self) -> Result<Option<DeviceCatalog>, EngineError> {
        let slots = self.model.slot_shapes();
        let checksum = self.model.checksum().map_err(store_error)?;
        Ok(Some(DeviceCatalog { slots, checksum }))
    }

    /// The checkpoint is loaded to the device beside the served weights (so it needs room for
    /// a second copy), its shapes checked, then swapped in; on any failure the old weights
    /// keep serving. Returns the new weights' checksum.
    fn swap_from_disk(&mut self, w: &DiskWeights) -> Result<WeightsChecksum, EngineError> {
        let m = &mut *self.model;
        let (config, mut new) = load_to_device(m.gpu(), w).map_err(EngineError::Conflict)?;
        if !same_shapes(&config, &m.config) {
            return Err(EngineError::Conflict("the new weights' config.json differs from the served model's (architecture or shapes)".into()));
        }
        let checksum = new.weights_checksum(m.gpu(), &m.config).map_err(|e| {
            EngineError::Conflict(format!("the device could not take the new weights: {e}"))
        })?;
        m.replace_weights(new);
        Ok(checksum)
    }
}
