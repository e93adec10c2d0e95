//! Where the forward pass and sampling run, behind one trait: the CPU reference (model and KV
//! cache in host memory, rows sampled by `sampling::sample`) or a CUDA device (rows sampled on
//! the device, only the tokens, logprobs and top-N copied back). Both run the one forward,
//! `model::forward`. [`build`] makes the executor a spec names, on the engine thread; its
//! errors travel back to whoever started the engine.

use crate::backend::cpu::attention::{KvDtype, KvMemory};
use crate::backend::cpu::Cpu;
use crate::backend::cuda::{CudaError, CudaSizes, Gpu};
use crate::backend::Sampled;
use crate::model::checksum::WeightsChecksum;
use crate::model::cuda::{CudaModel, CudaWeights};
use crate::model::loader::{open_serving_checkpoint, Quantization};
use crate::model::slots::{Replacement, SlotShape};
use crate::model::store::{SlotParts, StoreError, WeightStore};
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
        /// `CudaSizes::graph_max_rows` (0: no CUDA graphs).
        cuda_graph_max_bs: usize,
        /// `--enable-weights-cpu-backup`: releasing the weights keeps a host copy that resume
        /// restores (SGLang's flag); without it they come back absent.
        weights_cpu_backup: bool,
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

/// What releasing the weights did.
pub(crate) struct ReleasedWeights {
    /// Bytes freed.
    pub bytes: usize,
    /// Resume restores the values (a host copy was kept, or the weights live on the host).
    pub backup: bool,
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

    /// The served contents of the slots `names` in checkpoint layout (see
    /// [`WeightStore::parts_of`]).
    fn parts_of(&mut self, names: &[String]) -> Result<SlotParts, EngineError>;

    /// The slot table and checksum of device-only weights (None when the host holds them).
    fn device_catalog(&mut self) -> Result<Option<DeviceCatalog>, EngineError> {
        Ok(None)
    }

    /// A stream of its own on the device for `/update_weights_from_disk` of device-only
    /// weights: a [`DeviceLoader`] loads a checkpoint there, beside the served weights, off the
    /// engine thread, into a shadow for [`Executor::install_shadow`]. None when free device
    /// memory does not hold a second copy of the weights.
    fn loader_stream(&mut self) -> Result<Option<Gpu>, EngineError> {
        Err(EngineError::Conflict(
            "updates loaded onto the device are for device-loaded CUDA weights".into(),
        ))
    }

    /// A copy of the served weights for a streamed update to write into while generation goes
    /// on ([`ShadowWeights`]). None when this executor makes none unasked (`required` false)
    /// or there is no room for one; with `required`, no room is an error saying why.
    fn shadow(&mut self, required: bool) -> Result<Option<ShadowCopy>, EngineError>;

    /// Swaps a written shadow in for the served weights; returns the displaced weights for
    /// the caller to free off the engine thread.
    fn install_shadow(&mut self, copy: ShadowCopy) -> Result<ShadowCopy, EngineError>;

    /// The device with a stream of its own, for copies off the engine thread (tensors shared
    /// through CUDA IPC, an in-place commit's staging). Only a CUDA executor has one; the
    /// refusal names what asks for it from outside, a colocated trainer's tensors.
    fn side_stream(&mut self) -> Result<Gpu, EngineError> {
        Err(EngineError::BadInput {
            param: "serialized_named_tensors".into(),
            message: "serialized_named_tensors holds CUDA IPC tensor handles, which this server cannot open: it computes on the CPU (start it with --device cuda on the trainer's GPU, or stream safetensors buckets with PUT /update_weights)".into(),
        })
    }

    /// Whether [`Executor::release_weights`] keeps what resume restores.
    fn keeps_weights_backup(&self) -> bool;

    /// Frees the KV cache's memory (its contents are gone; the engine flushed the prefix
    /// cache). Returns the bytes freed. Only called on an idle engine.
    fn release_kv(&mut self) -> Result<usize, EngineError>;

    /// Reallocates the KV cache with the same blocks, empty. Returns its bytes. On failure
    /// nothing is allocated and the cache stays released.
    fn resume_kv(&mut self) -> Result<usize, EngineError>;

    /// Frees the weights' memory, keeping a backup when the executor keeps one and `keep` says
    /// the values are worth it (absent weights are not). On failure nothing is freed.
    fn release_weights(&mut self, keep: bool) -> Result<ReleasedWeights, EngineError>;

    /// Reallocates the weights at their sizes: the backup's values, or none (absent). Returns
    /// the bytes. On failure nothing is allocated and the weights stay released.
    fn resume_weights(&mut self) -> Result<usize, EngineError>;
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
            cuda_graph_max_bs,
            weights_cpu_backup,
        } => {
            let sizes = CudaSizes {
                max_batch_tokens: cfg.max_batch_tokens,
                max_running_requests: cfg.max_running_requests,
                block_size: cfg.block_size,
                max_context_len: cfg.max_context_len,
                mem_fraction_static,
                max_total_tokens,
                block_scaled_gemm,
                graph_max_rows: cuda_graph_max_bs,
            };
            let exec = CudaExecutor::new(device, weights, sizes, weights_cpu_backup)
                .map_err(start_error)?;
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
pub(crate) struct CpuExecutor {
    /// Shared with a shadow copy until the shadow's first write copies it (off this thread).
    model: std::sync::Arc<Model>,
    kv: KvMemory,
    backend: Cpu,
    state: StepState<Cpu>,
    /// The KV cache's shape, to reallocate it after a release.
    kv_dtype: KvDtype,
    kv_blocks: usize,
    block_size: usize,
}

impl CpuExecutor {
    pub(crate) fn new(model: Model, cfg: &EngineConfig) -> CpuExecutor {
        let num_blocks = cfg.max_total_tokens.div_ceil(cfg.block_size).max(1);
        CpuExecutor {
            kv: kv_memory(&model.config, cfg.kv_dtype, num_blocks, cfg.block_size),
            model: std::sync::Arc::new(model),
            backend: Cpu::default(),
            state: StepState::default(),
            kv_dtype: cfg.kv_dtype,
            kv_blocks: num_blocks,
            block_size: cfg.block_size,
        }
    }

    fn kv_memory(&self, num_blocks: usize) -> KvMemory {
        kv_memory(
            &self.model.config,
            self.kv_dtype,
            num_blocks,
            self.block_size,
        )
    }

    fn kv_bytes(&self) -> usize {
        let c = &self.model.config;
        self.kv_blocks
            * self.block_size
            * KvMemory::bytes_per_token(self.kv_dtype, c.num_layers, c.num_kv_heads, c.head_dim)
    }
}

fn kv_memory(c: &ModelConfig, dtype: KvDtype, num_blocks: usize, block_size: usize) -> KvMemory {
    KvMemory::new(
        dtype,
        c.num_layers,
        num_blocks,
        block_size,
        c.num_kv_heads,
        c.head_dim,
    )
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
            record: false,
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
        self.model = std::sync::Arc::new(new);
        Ok(())
    }

    fn apply(
        &mut self,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, EngineError> {
        std::sync::Arc::get_mut(&mut self.model)
            .ok_or_else(|| {
                EngineError::Conflict(
                    "a shadow copy of the weights is being made; the update was not written".into(),
                )
            })?
            .write(updates)
            .map_err(store_error)
    }

    fn parts_of(&mut self, names: &[String]) -> Result<SlotParts, EngineError> {
        std::sync::Arc::get_mut(&mut self.model)
            .ok_or_else(|| {
                EngineError::Conflict(
                    "a shadow copy of the weights is being made; nothing was kept".into(),
                )
            })?
            .parts_of(names)
            .map_err(store_error)
    }

    /// Only when asked (`--weight-update-shadow on`): the shadow shares the served model until
    /// its first write copies it (on the writer's thread, not this one); it doubles the
    /// weights' memory, so `auto` writes in place on the CPU.
    fn shadow(&mut self, required: bool) -> Result<Option<ShadowCopy>, EngineError> {
        if !required {
            return Ok(None);
        }
        let bytes = self.model.weight_bytes();
        if let Some(free) = host_available_bytes() {
            if free < bytes + shadow_headroom(bytes) {
                return Err(EngineError::Conflict(format!(
                    "--weight-update-shadow on: no host memory for a copy of the weights ({:.2} GiB, {:.2} GiB available); use --weight-update-shadow off",
                    gib(bytes),
                    gib(free)
                )));
            }
        }
        Ok(Some(ShadowCopy::Host(self.model.clone())))
    }

    fn install_shadow(&mut self, copy: ShadowCopy) -> Result<ShadowCopy, EngineError> {
        match copy {
            ShadowCopy::Host(m) => Ok(ShadowCopy::Host(std::mem::replace(&mut self.model, m))),
            ShadowCopy::Device(_) => Err(EngineError::Conflict(
                "a device shadow cannot replace host weights".into(),
            )),
        }
    }

    /// The weights are host memory: they are their own backup.
    fn keeps_weights_backup(&self) -> bool {
        true
    }

    fn release_kv(&mut self) -> Result<usize, EngineError> {
        self.kv = self.kv_memory(0);
        Ok(self.kv_bytes())
    }

    fn resume_kv(&mut self) -> Result<usize, EngineError> {
        self.kv = self.kv_memory(self.kv_blocks);
        Ok(self.kv_bytes())
    }

    /// Nothing is freed: on the CPU the weights are the host copy a backup would be, so they
    /// stay where they are and resume serves them again, bit for bit.
    fn release_weights(&mut self, _keep: bool) -> Result<ReleasedWeights, EngineError> {
        Ok(ReleasedWeights {
            bytes: 0,
            backup: true,
        })
    }

    fn resume_weights(&mut self) -> Result<usize, EngineError> {
        Ok(0)
    }
}

/// A CUDA device: weights, KV cache and step buffers in device memory; nothing of the model
/// stays on the host (except a backup while released, with `--enable-weights-cpu-backup`).
struct CudaExecutor {
    model: Box<CudaModel>,
    weights_cpu_backup: bool,
}

/// Loads `/update_weights_from_disk` checkpoints onto the device on a stream of its own, so
/// the engine goes on generating while a new copy of the weights is read, uploaded and
/// quantized beside the served one (device memory must hold both), into a [`ShadowWeights`]
/// for [`super::EngineHandle::install_shadow`].
pub struct DeviceLoader {
    pub(crate) gpu: Gpu,
    /// The served weights' version counter when the loader was made (see [`ShadowWeights`]).
    pub(crate) generation: u64,
    pub(crate) held: std::sync::Arc<()>,
}

impl DeviceLoader {
    /// Blocks until `w` is on the device (call it off the engine thread).
    pub fn load(self, w: &DiskWeights) -> Result<ShadowWeights, String> {
        let (config, weights) = load_to_device(&self.gpu, w)?;
        Ok(ShadowWeights {
            copy: ShadowCopy::device(self.gpu, config, weights),
            generation: self.generation,
            _held: self.held,
        })
    }
}

/// A copy of the served weights that a streamed update writes into, tensor by tensor as the
/// buckets arrive, while the engine goes on generating with the originals
/// (`--weight-update-shadow`); [`super::EngineHandle::install_shadow`] swaps it in between two
/// steps. It is made from the weights of one version: the swap is refused if other weights
/// were swapped in meanwhile. While it exists, the engine refuses to release the weights'
/// memory (the copy holds as much again).
pub struct ShadowWeights {
    pub(crate) copy: ShadowCopy,
    /// The served weights' version counter when the copy was made.
    pub(crate) generation: u64,
    /// Counted by the engine: a shadow exists while a clone of it does.
    pub(crate) _held: std::sync::Arc<()>,
}

/// Where a shadow lives.
pub enum ShadowCopy {
    /// In host memory (the CPU backend; `--weight-update-shadow on` only): the served model
    /// itself until the first write copies it.
    Host(std::sync::Arc<Model>),
    /// On the device, written on a stream of its own.
    Device(Box<DeviceCopy>),
}

/// Weights on the device with the stream that writes them.
pub struct DeviceCopy {
    gpu: Gpu,
    config: ModelConfig,
    weights: CudaWeights,
}

impl ShadowCopy {
    fn device(gpu: Gpu, config: ModelConfig, weights: CudaWeights) -> ShadowCopy {
        ShadowCopy::Device(Box::new(DeviceCopy {
            gpu,
            config,
            weights,
        }))
    }
}

impl ShadowWeights {
    /// Whether the copy is in device memory.
    pub fn on_device(&self) -> bool {
        matches!(self.copy, ShadowCopy::Device(_))
    }

    /// The stream a device copy is written on (None for a host copy): device tensors for it
    /// made on this stream are ordered before its writes.
    pub fn device_stream(&self) -> Option<&Gpu> {
        match &self.copy {
            ShadowCopy::Device(d) => Some(&d.gpu),
            ShadowCopy::Host(_) => None,
        }
    }

    /// Bytes the copy holds.
    pub fn bytes(&self) -> usize {
        match &self.copy {
            ShadowCopy::Host(m) => m.weight_bytes(),
            ShadowCopy::Device(d) => d.weights.bytes(),
        }
    }
}

/// A host shadow of its own: the served model is copied here, on the caller's thread, the first
/// time the shadow is used.
fn own(m: &mut std::sync::Arc<Model>) -> &mut Model {
    std::sync::Arc::make_mut(m)
}

fn device_store(e: CudaError) -> StoreError {
    StoreError::Device(e.to_string())
}

impl WeightStore for ShadowWeights {
    fn slot_shapes(&mut self) -> std::collections::BTreeMap<String, SlotShape> {
        match &mut self.copy {
            ShadowCopy::Host(m) => own(m).slot_shapes(),
            ShadowCopy::Device(d) => d.weights.slot_shapes(&d.config),
        }
    }

    fn checksum(&mut self) -> Result<WeightsChecksum, StoreError> {
        match &mut self.copy {
            ShadowCopy::Host(m) => Ok(own(m).weights_checksum()),
            ShadowCopy::Device(d) => d
                .weights
                .weights_checksum(&d.gpu, &d.config)
                .and_then(|sum| d.gpu.synchronize().map(|()| sum))
                .map_err(device_store),
        }
    }

    /// Checked whole, then written into the copy (on the device: on the shadow's stream,
    /// finished before this returns).
    fn write(
        &mut self,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, StoreError> {
        match &mut self.copy {
            ShadowCopy::Host(m) => own(m).write(updates),
            ShadowCopy::Device(d) => d.weights.write_replacements(&d.gpu, &d.config, updates),
        }
    }

    fn parts_of(&mut self, names: &[String]) -> Result<SlotParts, StoreError> {
        match &mut self.copy {
            ShadowCopy::Host(m) => own(m).parts_of(names),
            ShadowCopy::Device(d) => d.weights.parts_of(&d.gpu, &d.config, names),
        }
    }
}

/// Host memory the kernel says is available (`MemAvailable`), when it says.
fn host_available_bytes() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Room a copy of `bytes` leaves free beside it: 5% of them, at least 1 GiB (the step's
/// scratch grows with the batch; a shadow must not take the memory the next step needs).
fn shadow_headroom(bytes: usize) -> usize {
    (bytes / 20).max(1 << 30)
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn load_to_device(gpu: &Gpu, w: &DiskWeights) -> Result<(ModelConfig, CudaWeights), String> {
    let src = open_serving_checkpoint(&w.dir, w.quantization, w.recipe.clone())
        .map_err(|e| format!("{}: {e}", w.dir.display()))?;
    let weights =
        CudaWeights::from_checkpoint(gpu, &src).map_err(|e| format!("{}: {e}", w.dir.display()))?;
    Ok((src.config, weights))
}

impl CudaExecutor {
    fn new(
        device: usize,
        weights: CudaSource,
        sizes: CudaSizes,
        weights_cpu_backup: bool,
    ) -> Result<Self, CudaError> {
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
        let mut model = CudaModel::new(gpu, config, dev_weights, sizes)?;
        if sizes.graph_max_rows > 0 {
            let started = std::time::Instant::now();
            let recorded = model.capture_decode_graphs()?;
            tracing::info!(
                "captured {recorded} decode step sizes on CUDA graphs in {:.1} s",
                started.elapsed().as_secs_f64()
            );
        }
        Ok(CudaExecutor {
            model: Box::new(model),
            weights_cpu_backup,
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

    fn parts_of(&mut self, names: &[String]) -> Result<SlotParts, EngineError> {
        self.model.parts_of(names).map_err(store_error)
    }

    fn device_catalog(&mut self) -> Result<Option<DeviceCatalog>, EngineError> {
        let slots = self.model.slot_shapes();
        let checksum = self.model.checksum().map_err(store_error)?;
        Ok(Some(DeviceCatalog { slots, checksum }))
    }

    fn loader_stream(&mut self) -> Result<Option<Gpu>, EngineError> {
        let m = &*self.model;
        let failed =
            |e: CudaError| EngineError::Conflict(format!("no stream for loading new weights: {e}"));
        let (free, _) = m.gpu().memory().map_err(failed)?;
        let bytes = m.weight_bytes;
        if free < bytes + shadow_headroom(bytes) {
            tracing::info!(
                "no room on the device for a second copy of the weights ({:.2} GiB and {:.2} GiB to spare; {:.2} GiB free)",
                gib(bytes),
                gib(shadow_headroom(bytes)),
                gib(free)
            );
            return Ok(None);
        }
        m.gpu().with_own_stream().map(Some).map_err(failed)
    }

    /// A copy on a stream of its own, when free device memory holds it beside the served
    /// weights with [`shadow_headroom`] to spare (the KV cache was sized first: lower
    /// `--mem-fraction-static` to leave room). The copies are queued here and run beside
    /// the engine's kernels; the writes that follow are queued behind them on the same stream.
    fn shadow(&mut self, required: bool) -> Result<Option<ShadowCopy>, EngineError> {
        let m = &*self.model;
        let bytes = m.weight_bytes;
        let refuse = |why: String| {
            if required {
                Err(EngineError::Conflict(format!(
                    "--weight-update-shadow on: {why}; lower --mem-fraction-static or use --weight-update-shadow off"
                )))
            } else {
                tracing::info!("no shadow copy for this weight update ({why}): it is written in place at commit");
                Ok(None)
            }
        };
        let free = match m.gpu().memory() {
            Ok((free, _)) => free,
            Err(e) => return refuse(format!("the device's free memory is unknown: {e}")),
        };
        if free < bytes + shadow_headroom(bytes) {
            return refuse(format!(
                "a copy of the weights needs {:.2} GiB and {:.2} GiB to spare; {:.2} GiB are free",
                gib(bytes),
                gib(shadow_headroom(bytes)),
                gib(free)
            ));
        }
        let gpu = match m.gpu().with_own_stream() {
            Ok(gpu) => gpu,
            Err(e) => return refuse(format!("no stream for the copy: {e}")),
        };
        match m.copy_weights(&gpu) {
            Ok(weights) => Ok(Some(ShadowCopy::device(gpu, m.config.clone(), weights))),
            Err(e) => refuse(format!("the copy failed: {e}")),
        }
    }

    /// Between two steps: the shadow's stream is drained (its writes are done), then the
    /// engine's (the displaced weights may still be read by queued kernels, and they may have
    /// been allocated on an earlier loader's stream, where their free would not wait for
    /// kernels queued here), then the swap.
    fn install_shadow(&mut self, copy: ShadowCopy) -> Result<ShadowCopy, EngineError> {
        let ShadowCopy::Device(d) = copy else {
            return Err(EngineError::Conflict(
                "a host shadow cannot replace device weights".into(),
            ));
        };
        let DeviceCopy {
            gpu,
            config,
            weights,
        } = *d;
        let m = &mut *self.model;
        if !same_shapes(&config, &m.config) {
            return Err(EngineError::Conflict("the new weights' config.json differs from the served model's (architecture or shapes)".into()));
        }
        let failed = |e: CudaError| EngineError::Stopped(format!("CUDA device failed: {e}"));
        gpu.synchronize().map_err(failed)?;
        m.gpu().synchronize().map_err(failed)?;
        let old = m.replace_weights(weights);
        Ok(ShadowCopy::device(gpu, config, old))
    }

    fn side_stream(&mut self) -> Result<Gpu, EngineError> {
        self.model
            .gpu()
            .with_own_stream()
            .map_err(|e| EngineError::Conflict(format!("no stream of its own on the device: {e}")))
    }

    fn keeps_weights_backup(&self) -> bool {
        self.weights_cpu_backup
    }

    fn release_kv(&mut self) -> Result<usize, EngineError> {
        self.model
            .release_kv()
            .map_err(|e| EngineError::Stopped(format!("freeing the KV cache failed: {e}")))
    }

    fn resume_kv(&mut self) -> Result<usize, EngineError> {
        let gib = self.model.kv_bytes() as f64 / (1u64 << 30) as f64;
        self.model.resume_kv().map_err(|e| {
            EngineError::Unavailable(format!(
                "the KV cache ({gib:.2} GiB) could not be allocated again: {e}; free device memory (the trainer's) and resume again"
            ))
        })
    }

    fn release_weights(&mut self, keep: bool) -> Result<ReleasedWeights, EngineError> {
        let backup = keep && self.weights_cpu_backup;
        let bytes = self.model.release_weights(backup).map_err(|e| {
            EngineError::Unavailable(format!(
                "releasing the weights failed, nothing was freed: {e}"
            ))
        })?;
        Ok(ReleasedWeights { bytes, backup })
    }

    fn resume_weights(&mut self) -> Result<usize, EngineError> {
        let gib = self.model.weight_bytes as f64 / (1u64 << 30) as f64;
        self.model.resume_weights().map_err(|e| {
            EngineError::Unavailable(format!(
                "the weights ({gib:.2} GiB) could not be allocated again: {e}; free device memory (the trainer's) and resume again"
            ))
        })
    }
}
