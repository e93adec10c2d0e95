//! Where the forward pass and sampling run: the CPU reference backend (model and KV cache in
//! host memory, rows sampled by `sampling::sample`) or a CUDA device (rows sampled on the device,
//! only the tokens, logprobs and top-N copied back). The engine loop sees one interface either way.

use crate::backend::cpu::attention::KvMemory;
use crate::backend::cuda::{CudaError, CudaSizes, Gpu};
use crate::backend::Sampled;
use crate::model::cuda::{CudaModel, CudaWeights};
use crate::model::checksum::WeightsChecksum;
use crate::model::loader::{open_serving_checkpoint, Quantization};
use crate::model::slots::{Replacement, SlotShape};
use crate::model::{ForwardBatch, ForwardOutput, Model, ModelConfig};
use crate::quant::Recipe;
use crate::sampling::{self, SampleInput, SamplerScratch};

use super::core::EngineConfig;
use super::EngineError;

/// What the engine is started with.
pub enum RunnerSpec {
    Cpu(Model),
    Cuda {
        device: usize,
        weights: CudaSource,
        mem_fraction_static: f32,
        /// Cap on KV tokens; None sizes the cache from memory alone.
        max_total_tokens: Option<usize>,
    },
}

/// How the CUDA runner gets its weights.
pub enum CudaSource {
    /// A model the CPU loader built from a checkpoint; it is kept in host memory so streamed
    /// updates can be applied to it and re-uploaded.
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

/// Two configs describe the same shapes (their raw JSON aside).
pub(crate) fn same_shapes(a: &ModelConfig, b: &ModelConfig) -> bool {
    let (mut a, mut b) = (a.clone(), b.clone());
    a.raw = serde_json::Value::Null;
    b.raw = serde_json::Value::Null;
    a == b
}

/// Opens `w` and loads it into device memory.
fn load_to_device(gpu: &Gpu, w: &DiskWeights) -> Result<(ModelConfig, CudaWeights), String> {
    let src = open_serving_checkpoint(&w.dir, w.quantization, w.recipe.clone())
        .map_err(|e| format!("{}: {e}", w.dir.display()))?;
    let weights =
        CudaWeights::from_checkpoint(gpu, &src).map_err(|e| format!("{}: {e}", w.dir.display()))?;
    Ok((src.config, weights))
}

pub(crate) enum Runner {
    Cpu {
        model: Model,
        kv: KvMemory,
        scratch: SamplerScratch,
    },
    Cuda {
        model: Box<CudaModel>,
        host: Option<Model>,
        /// For the rare rows the device sampler does not take.
        scratch: SamplerScratch,
    },
}

/// One step's results.
pub(crate) struct StepOutput {
    /// The asked-for logits rows on the host, except rows sampled on the device (on CUDA, a
    /// sampled sequence's last row): what prompt logprobs read.
    pub forward: ForwardOutput,
    /// Per sequence of the batch: its sampled token, when it was given sampling inputs.
    pub sampled: Sampled,
}

impl Runner {
    /// Builds the runner on the engine thread (the CUDA context lives where it is used).
    pub(crate) fn build(spec: RunnerSpec, cfg: &EngineConfig) -> Result<Runner, CudaError> {
        match spec {
            RunnerSpec::Cpu(model) => {
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
                Ok(Runner::Cpu {
                    model,
                    kv,
                    scratch: SamplerScratch::default(),
                })
            }
            RunnerSpec::Cuda {
                device,
                weights,
                mem_fraction_static,
                max_total_tokens,
            } => {
                let gpu = Gpu::open(device)?;
                let sizes = CudaSizes {
                    max_batch_tokens: cfg.max_batch_tokens,
                    max_running_requests: cfg.max_running_requests,
                    block_size: cfg.block_size,
                    max_context_len: cfg.max_context_len,
                    mem_fraction_static,
                    max_total_tokens,
                };
                let (config, dev_weights, host) = match weights {
                    CudaSource::Model(model) => {
                        let w = CudaWeights::upload(&gpu, &model)?;
                        (model.config.clone(), w, Some(model))
                    }
                    CudaSource::Checkpoint(disk) => {
                        let (config, w) = load_to_device(&gpu, &disk).map_err(CudaError::Load)?;
                        (config, w, None)
                    }
                    CudaSource::Dummy {
                        config,
                        recipe,
                        seed,
                    } => {
                        let w = CudaWeights::dummy(&gpu, &config, &recipe, seed)?;
                        (config, w, None)
                    }
                };
                let model = CudaModel::new(gpu, config, dev_weights, sizes)?;
                Ok(Runner::Cuda {
                    model: Box::new(model),
                    host,
                    scratch: SamplerScratch::default(),
                })
            }
        }
    }

    pub(crate) fn config(&self) -> &ModelConfig {
        match self {
            Runner::Cpu { model, .. } => &model.config,
            Runner::Cuda { model, .. } => &model.config,
        }
    }

    pub(crate) fn num_kv_blocks(&self) -> usize {
        match self {
            Runner::Cpu { kv, .. } => kv.num_blocks,
            Runner::Cuda { model, .. } => model.num_kv_blocks(),
        }
    }

    pub(crate) fn num_moe_layers(&self) -> usize {
        match self {
            Runner::Cpu { model, .. } => model.num_moe_layers(),
            Runner::Cuda { model, .. } => model.num_moe_layers(),
        }
    }

    pub(crate) fn top_k(&self) -> usize {
        match self {
            Runner::Cpu { model, .. } => model.top_k(),
            Runner::Cuda { model, .. } => model.top_k(),
        }
    }

    /// Runs the forward pass and samples the last logits row of every sequence `i` with
    /// `samples[i]` given (such a sequence asks for logits from its last row at the latest).
    /// A device failure mid-step cannot be recovered from: the engine thread's panic guard
    /// reports it on /health and to every waiting request.
    pub(crate) fn step(
        &mut self,
        batch: &ForwardBatch<'_>,
        samples: &[Option<SampleInput<'_>>],
    ) -> StepOutput {
        match self {
            Runner::Cpu { model, kv, scratch } => {
                let forward = model.forward(batch, kv);
                let vocab = model.config.vocab_size;
                let sampled = samples
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        s.as_ref()
                            .and_then(|s| sample_on_host(&forward, i, vocab, s, scratch))
                    })
                    .collect();
                StepOutput { forward, sampled }
            }
            Runner::Cuda { model, .. } => {
                let (forward, sampled) = model
                    .forward_and_sample(batch, samples)
                    .unwrap_or_else(|e| panic!("CUDA forward failed: {e}"));
                StepOutput { forward, sampled }
            }
        }
    }

    /// Replaces the whole model (same config), e.g. after `/update_weights_from_disk`.
    pub(crate) fn swap(&mut self, new: Model) -> Result<(), EngineError> {
        match self {
            Runner::Cpu { model, .. } => {
                *model = new;
                Ok(())
            }
            Runner::Cuda { model, host, .. } => {
                let w = CudaWeights::upload(model.gpu(), &new).map_err(device_error)?;
                model.replace_weights(w);
                *host = Some(new);
                Ok(())
            }
        }
    }

    /// Replaces some tensors (a streamed update). Returns what is left to free (see
    /// [`Model::apply_replacements`]).
    pub(crate) fn apply(
        &mut self,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, EngineError> {
        match self {
            Runner::Cpu { model, .. } => Ok(model.apply_replacements(updates)),
            Runner::Cuda { model, host, .. } => {
                let Some(h) = host else {
                    // Weights only on the device: written into its buffers by slot name.
                    let m = &mut **model;
                    let config = m.config.clone();
                    let (gpu, weights) = m.parts_mut();
                    return weights
                        .write_replacements(gpu, &config, updates)
                        .map_err(device_error);
                };
                let spent = h.apply_replacements(updates);
                match CudaWeights::upload(model.gpu(), h) {
                    Ok(w) => {
                        model.replace_weights(w);
                        Ok(spent)
                    }
                    Err(e) => {
                        // The device still serves the old weights, complete; the host copy no
                        // longer matches them, so later streamed updates are refused until a
                        // full update from disk.
                        *host = None;
                        Err(device_error(e))
                    }
                }
            }
        }
    }

    /// The slot table and checksum of device-only weights loaded from a checkpoint (None for
    /// the CPU backend, a host copy, or dummy weights).
    pub(crate) fn device_catalog(&mut self) -> Result<Option<DeviceCatalog>, EngineError> {
        match self {
            Runner::Cuda {
                model, host: None, ..
            } => {
                let m = &mut **model;
                let config = m.config.clone();
                let (gpu, weights) = m.parts_mut();
                let slots = weights.slot_shapes(&config);
                let checksum = weights
                    .weights_checksum(gpu, &config)
                    .map_err(device_error)?;
                Ok(Some(DeviceCatalog { slots, checksum }))
            }
            _ => Ok(None),
        }
    }

    /// `/update_weights_from_disk` for device-only weights: the checkpoint is loaded to the
    /// device beside the served weights (so it needs room for a second copy), its shapes
    /// checked, then swapped in; on any failure the old weights keep serving. Returns the new
    /// weights' checksum.
    pub(crate) fn swap_from_disk(
        &mut self,
        w: &DiskWeights,
    ) -> Result<WeightsChecksum, EngineError> {
        let Runner::Cuda { model, host, .. } = self else {
            return Err(EngineError::Conflict(
                "updates loaded on the engine thread are for device-loaded CUDA weights".into(),
            ));
        };
        let m = &mut **model;
        let (config, mut new) = load_to_device(m.gpu(), w).map_err(EngineError::Conflict)?;
        if !same_shapes(&config, &m.config) {
            return Err(EngineError::Conflict("the new weights' config.json differs from the served model's (architecture or shapes)".into()));
        }
        let checksum = new
            .weights_checksum(m.gpu(), &m.config)
            .map_err(device_error)?;
        m.replace_weights(new);
        *host = None;
        Ok(checksum)
    }
}

/// Samples sequence `i`'s last host logits row with the CPU sampler (None when it has none).
fn sample_on_host(
    forward: &ForwardOutput,
    i: usize,
    vocab: usize,
    input: &SampleInput<'_>,
    scratch: &mut SamplerScratch,
) -> Option<Result<sampling::TokenLogprobs, sampling::SamplingError>> {
    let (first, rows) = forward.logit_rows[i];
    if rows == 0 {
        return None;
    }
    let mut row = forward.logits[(first + rows - 1) * vocab..][..vocab].to_vec();
    Some(sampling::sample(&mut row, input, scratch))
}

fn device_error(e: CudaError) -> EngineError {
    EngineError::Conflict(format!("the device could not take the new weights: {e}"))
}
