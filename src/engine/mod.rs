//! The engine thread: it alone owns the model, the KV memory and the scheduler. Everyone else
//! talks to it through an [`EngineHandle`]: generation requests come in as validated
//! [`GenerateRequest`]s, results go out as per-request [`EngineEvent`]s (token ids, logprobs,
//! routed experts, weight version, finish reason). Wire formats live in `server/`.

mod config;
mod core;
mod executor;
mod memory;
mod request;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

pub use self::config::{defaults, EngineConfig};
pub use self::core::Engine;
pub use executor::{
    CudaSource, DeviceLoader, DiskWeights, ExecutorSpec, ShadowCopy, ShadowWeights,
};
pub use memory::{MemoryState, MemoryTag, WeightsState};
pub use request::{EngineEvent, FinishInfo, GenerateRequest, InputLogprob, TokenOut, VersionSpan};

use crate::model::checksum::WeightsChecksum;
use crate::model::slots::Replacement;
use crate::model::{Model, ModelConfig};
use crate::tokenizer::Tokenizer;

/// Histogram of each engine step's phases, labelled `phase`: `schedule`, `forward` (the forward
/// pass with sampling), `outputs` (logprobs, routed experts, detokenizing, stop checks) and
/// `finish` (freeing what ended). Recorded through the `metrics` crate; `/metrics` shows it.
pub const STEP_SECONDS: &str = "lockstep_engine_step_seconds";
/// Histogram of the token rows each engine step runs (prefill chunks and decode rows).
pub const STEP_TOKENS: &str = "lockstep_engine_step_tokens";
/// Histogram of the forward pass (with sampling) of the steps whose every row is one decode
/// token: a server's decode step, to set beside a kernel benchmark's.
pub const DECODE_STEP_SECONDS: &str = "lockstep_engine_decode_step_seconds";

#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum EngineError {
    #[error("the engine queue is full ({0} requests waiting); retry later")]
    Overloaded(usize),
    #[error("the engine has stopped: {0}")]
    Stopped(String),
    #[error("{0}")]
    Conflict(String),
    /// The memory a request or command needs is released, or the weights are absent (see
    /// [`MemoryState`]); for generation the caller should come back after a resume (503).
    #[error("{0}")]
    Unavailable(String),
    /// A release or resume the memory's state does not allow (twice, nothing released,
    /// requests in flight), or a weight update into released weights (409).
    #[error("{0}")]
    MemoryState(String),
    /// One request could not be served (the rest of the engine is fine).
    #[error("{0}")]
    Failed(String),
    /// The backend could not be started (no device, a kernel that does not compile, too
    /// little memory for the KV cache).
    #[error("backend start-up failed: {0}")]
    Start(String),
    /// What the caller handed over cannot be used (e.g. a CUDA IPC handle that does not open):
    /// a 400 naming `param`.
    #[error("{message}")]
    BadInput { param: String, message: String },
}

/// How `/pause_generation` treats running requests (SGLang's modes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Abort every running and waiting request.
    #[default]
    Abort,
    /// Move running requests back to the queue (their KV is freed; they are recomputed).
    Retract,
    /// Keep everything in place; just stop stepping.
    InPlace,
}

/// Replacements read back group by group during the commit's pause (an update that waited on
/// disk): each call gives the next group, None once all were given.
pub struct MoreUpdates {
    /// Slots the groups write, all told.
    pub writes: usize,
    pub next: Box<dyn FnMut() -> Option<Result<Vec<(String, Replacement)>, String>> + Send>,
    /// Where the commit keeps what it overwrites, so a group that cannot be read or written
    /// after others were is rolled back (None: the weights are then marked absent).
    pub undo: Option<Box<dyn UndoLog>>,
}

/// Where an in-place commit in groups keeps the served contents of the slots it is about to
/// overwrite (in checkpoint layout), to write them back if a later group fails.
pub trait UndoLog: Send {
    /// Keeps these slots' served contents.
    fn keep(&mut self, slots: crate::model::store::SlotParts) -> Result<(), String>;
    /// Everything kept, as replacements, group by group.
    fn replay(self: Box<Self>) -> MoreUpdates;
}

/// One commit of replacements into the served weights (see [`EngineHandle::apply_weights`]).
pub struct WeightCommit {
    pub updates: Vec<(String, Replacement)>,
    /// Written after `updates`, in the same pause.
    pub more: Option<MoreUpdates>,
    /// The whole model's checksum after the commit.
    pub checksum: Arc<WeightsChecksum>,
    pub version: String,
}

impl WeightCommit {
    /// `updates`, all in hand and hashed, making `checksum` as `version`.
    pub fn of(
        updates: Vec<(String, Replacement)>,
        checksum: Arc<WeightsChecksum>,
        version: String,
    ) -> WeightCommit {
        WeightCommit {
            updates,
            more: None,
            checksum,
            version,
        }
    }
}

pub(crate) enum Command {
    Generate(Box<GenerateRequest>, mpsc::UnboundedSender<EngineEvent>),
    Abort {
        rid: Option<String>,
        all: bool,
    },
    Pause(PauseMode, oneshot::Sender<usize>),
    Continue(oneshot::Sender<()>),
    FlushCache(oneshot::Sender<Result<(), EngineError>>),
    /// Replace the weights between two steps (see [`EngineHandle::swap_model`]).
    SwapModel {
        model: Box<Model>,
        checksum: Arc<WeightsChecksum>,
        version: String,
        abort_all: bool,
        reply: oneshot::Sender<Result<usize, EngineError>>,
    },
    /// A loader for new device weights (see [`EngineHandle::device_loader`]).
    DeviceLoader(oneshot::Sender<Result<Option<DeviceLoader>, EngineError>>),
    /// A shadow copy of the weights (see [`EngineHandle::shadow_weights`]).
    Shadow {
        required: bool,
        reply: oneshot::Sender<Result<Option<ShadowWeights>, EngineError>>,
    },
    /// Swap a written shadow in (see [`EngineHandle::install_shadow`]).
    InstallShadow {
        shadow: Box<ShadowWeights>,
        checksum: Arc<WeightsChecksum>,
        version: String,
        abort_all: bool,
        reply: oneshot::Sender<Result<Installed, EngineError>>,
    },
    /// Replace some tensors between two steps (see [`EngineHandle::apply_weights`]).
    ApplyWeights {
        commit: WeightCommit,
        /// Answers how long the engine stood still, and what is left to free (dropped by the
        /// caller, off the engine thread).
        reply: oneshot::Sender<Result<(std::time::Duration, Vec<Replacement>), EngineError>>,
    },
    /// A stream beside the engine's (see [`EngineHandle::side_stream`]).
    SideStream(oneshot::Sender<Result<crate::backend::cuda::Gpu, EngineError>>),
    /// `/release_memory_occupation` (see [`EngineHandle::release_memory`]).
    ReleaseMemory {
        tags: Option<Vec<MemoryTag>>,
        reply: oneshot::Sender<Result<MemoryReport, EngineError>>,
    },
    /// `/resume_memory_occupation` (see [`EngineHandle::resume_memory`]).
    ResumeMemory {
        tags: Option<Vec<MemoryTag>>,
        reply: oneshot::Sender<Result<MemoryReport, EngineError>>,
    },
    Shutdown,
}

/// What [`EngineHandle::install_shadow`] did.
pub struct Installed {
    /// How long the engine stood still.
    pub pause: std::time::Duration,
    /// Requests aborted (`abort_all`).
    pub aborted: usize,
    /// The weights swapped out, to free off the engine thread.
    pub displaced: ShadowCopy,
}

/// Counters the engine publishes for /health, /get_server_info and admission control.
#[derive(Default)]
pub struct EngineShared {
    pub healthy: AtomicBool,
    pub warm: AtomicBool,
    pub paused: AtomicBool,
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    /// Context tokens of the running requests, and prompt tokens of the waiting ones
    /// (`/get_load`, `/v1/loads`).
    pub running_tokens: AtomicUsize,
    pub waiting_tokens: AtomicUsize,
    /// Submitted requests the engine thread has not picked up yet (still in the channel).
    pub in_channel: AtomicUsize,
    pub kv_used_blocks: AtomicUsize,
    pub kv_total_blocks: AtomicUsize,
    pub prefix_hit_tokens: AtomicU64,
    pub preemptions: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub last_error: std::sync::Mutex<Option<String>>,
    /// What is released (set by the engine thread after every release and resume).
    pub memory: std::sync::Mutex<MemoryState>,
}

/// What a release or resume did.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryReport {
    /// The tags acted on, in the order they were.
    pub tags: Vec<MemoryTag>,
    /// Bytes freed (release) or allocated again (resume).
    pub bytes: usize,
    /// The state afterwards.
    pub state: MemoryState,
}

/// Static facts about the served model.
pub struct EngineInfo {
    pub model_path: String,
    pub served_model_name: String,
    pub config: ModelConfig,
    pub tokenizer: Arc<Tokenizer>,
    pub quantization: String,
    pub recipe_name: String,
    pub recipe_hash: String,
    /// The recipe linear layers were quantized with (live updates quantize the same way).
    pub recipe: crate::quant::Recipe,
    /// Every tensor a live update may replace, by checkpoint name: set before the engine
    /// starts for host-built models, by the engine once device-loaded weights are in place.
    pub slots:
        std::sync::OnceLock<std::collections::BTreeMap<String, crate::model::slots::SlotShape>>,
    /// The weights live only on the device (a checkpoint loaded straight to the GPU): updates
    /// from disk are loaded by the engine thread, onto the device.
    pub weights_on_device: bool,
    pub max_context_len: usize,
    pub block_size: usize,
    pub weight_version: std::sync::RwLock<String>,
    /// The served weights' checksum and the version it belongs to (set with the version).
    pub weights_checksum: std::sync::RwLock<(String, Arc<WeightsChecksum>)>,
}

impl EngineInfo {
    /// The slot table (empty while unknown, e.g. device-drawn dummy weights).
    pub fn slots(&self) -> &std::collections::BTreeMap<String, crate::model::slots::SlotShape> {
        static NONE: std::collections::BTreeMap<String, crate::model::slots::SlotShape> =
            std::collections::BTreeMap::new();
        self.slots.get().unwrap_or(&NONE)
    }

    /// The description of `model` served with `recipe` (its weights on the device or not),
    /// for unit tests: the embedded tokenizer, version "v0".
    #[cfg(test)]
    pub(crate) fn for_test(
        model: &mut Model,
        recipe: crate::quant::Recipe,
        weights_on_device: bool,
    ) -> EngineInfo {
        let checksum = Arc::new(model.weights_checksum());
        EngineInfo {
            model_path: "embedded".into(),
            served_model_name: "test".into(),
            config: model.config.clone(),
            tokenizer: Arc::new(Tokenizer::embedded()),
            quantization: recipe.name.clone(),
            recipe_name: recipe.name.clone(),
            recipe_hash: recipe.hash(),
            recipe,
            slots: std::sync::OnceLock::from(model.slot_shapes()),
            weights_on_device,
            max_context_len: 256,
            block_size: 16,
            weight_version: std::sync::RwLock::new("v0".into()),
            weights_checksum: std::sync::RwLock::new(("v0".into(), checksum)),
        }
    }
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: std::sync::mpsc::SyncSender<Command>,
    pub shared: Arc<EngineShared>,
    pub info: Arc<EngineInfo>,
    max_queued: usize,
}

impl EngineHandle {
    /// Queues a request; events arrive on the returned receiver until `Finished` or `Error`.
    /// Dropping the receiver aborts the request and frees its KV blocks.
    pub fn submit(
        &self,
        req: GenerateRequest,
    ) -> Result<mpsc::UnboundedReceiver<EngineEvent>, EngineError> {
        if !self.shared.healthy.load(Ordering::Acquire) {
            return Err(EngineError::Stopped(self.last_error()));
        }
        // The engine checks again when it admits the request (a release may be queued ahead).
        if let Some(why) = self.memory().unavailable() {
            return Err(EngineError::Unavailable(why));
        }
        let waiting = self.shared.waiting.load(Ordering::Acquire)
            + self.shared.in_channel.load(Ordering::Acquire);
        if waiting >= self.max_queued {
            return Err(EngineError::Overloaded(waiting));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        // Count it as waiting now, so a burst is bounded before the engine sees it.
        self.shared.in_channel.fetch_add(1, Ordering::AcqRel);
        self.tx
            .try_send(Command::Generate(Box::new(req), tx))
            .map_err(|e| {
                self.shared.in_channel.fetch_sub(1, Ordering::AcqRel);
                match e {
                    std::sync::mpsc::TrySendError::Full(_) => EngineError::Overloaded(waiting),
                    std::sync::mpsc::TrySendError::Disconnected(_) => {
                        EngineError::Stopped(self.last_error())
                    }
                }
            })?;
        Ok(rx)
    }

    fn send(&self, c: Command) -> Result<(), EngineError> {
        self.tx
            .send(c)
            .map_err(|_| EngineError::Stopped(self.last_error()))
    }

    pub fn abort(&self, rid: Option<String>, all: bool) -> Result<(), EngineError> {
        self.send(Command::Abort { rid, all })
    }

    /// Returns the number of requests paused (aborted or retracted or held).
    pub async fn pause(&self, mode: PauseMode) -> Result<usize, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Pause(mode, tx))?;
        rx.await
            .map_err(|_| EngineError::Stopped(self.last_error()))
    }

    pub async fn continue_generation(&self) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Continue(tx))?;
        rx.await
            .map_err(|_| EngineError::Stopped(self.last_error()))
    }

    pub async fn flush_cache(&self) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::FlushCache(tx))?;
        rx.await
            .map_err(|_| EngineError::Stopped(self.last_error()))?
    }

    /// Swaps in `model` (same architecture and shapes) between two engine steps: every token
    /// before is computed with the old weights, every token after with the new ones. The prefix
    /// cache is flushed and the weight version set to `version`. With `abort_all`, requests in
    /// flight are aborted first; otherwise they continue on the new weights (their KV from the
    /// old weights is kept) and report the version spans. Returns how many were aborted.
    /// `checksum` is the new model's ([`Model::weights_checksum`]), computed by the caller off
    /// the engine thread.
    pub async fn swap_model(
        &self,
        model: Model,
        checksum: Arc<WeightsChecksum>,
        version: String,
        abort_all: bool,
    ) -> Result<usize, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::SwapModel {
            model: Box::new(model),
            checksum,
            version,
            abort_all,
            reply,
        })?;
        rx.await
            .map_err(|_| EngineError::Stopped(self.last_error()))?
    }

    /// For weights that live only on the device: a loader that puts a checkpoint on the device
    /// beside the served weights, on a stream of its own, while the engine goes on generating
    /// (run it off the async runtime), for [`EngineHandle::install_shadow`]. None when free
    /// device memory does not hold a second copy of the weights.
    pub async fn device_loader(&self) -> Result<Option<DeviceLoader>, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::DeviceLoader(reply))?;
        rx.await
            .map_err(|_| EngineError::Stopped(self.last_error()))?
    }

    /// A copy of the served weights for a streamed update to write into (through its
    /// [`crate::model::store::WeightStore`], off the async runtime) while generation goes on,
    /// for [`EngineHandle::install_shadow`]. None when there is no room for one, or the
    /// executor makes none unasked (the CPU); with `required`, that is an error saying why.
    /// Refused while the weights are not resident.
    pub async fn shadow_weights(
        &self,
        required: bool,
    ) -> Result<Option<ShadowWeights>, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Shadow { required, reply })?;
        rx.await
            .map_err(|_| EngineError::Stopped(self.last_error()))?
    }

    /// Swaps a written (or loaded) shadow in between two engine steps (generation stands still
    /// only for the swap), flushes the prefix cache and sets the weight version; `checksum` is
    /// the whole model's after the update. Refused, changing nothing, when the shapes differ
    /// from the served model's or other weights were swapped in since the shadow (or loader)
    /// was made. With `abort_all`, requests in flight are aborted; otherwise they continue on
    /// the new weights ([`EngineHandle::swap_model`]). Returns the time generation stood still,
    /// how many requests were aborted, and the displaced weights, for the caller to free off
    /// the engine thread.
    pub async fn install_shadow(
        &self,
        shadow: ShadowWeights,
        checksum: Arc<WeightsChecksum>,
        version: String,
        abort_all: bool,
    ) -> Result<Installed, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::InstallShadow {
            shadow: Box::new(shadow),
            checksum,
            version,
            abort_all,
            reply,
        })?;
        rx.await
            .map_err(|_| EngineError::Stopped(self.last_error()))?
    }

    /// Swaps validated tensor replacements in between two engine steps (all at once), flushes
    /// the prefix cache and sets the weight version. The names must come from the served
    /// model's slot table; `checksum` is the whole model's after the update. `more` is written
    /// after `updates` in the same pause, each slot's served contents kept first in its undo
    /// log. If a group of `more` cannot be read or written after something was written, what
    /// was written is rolled back from the log: the weights and version stay as they were and
    /// the error says so. Without a log, or if the rollback fails too, the weights are marked
    /// absent and generation is refused until an update writes every tensor: weights that are
    /// neither the old nor the new ones are never served. Returns the time generation stood
    /// still, and the spent replacements for the caller to free.
    pub async fn apply_weights(
        &self,
        commit: WeightCommit,
    ) -> Result<(std::time::Duration, Vec<Replacement>), EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::ApplyWeights { commit, reply })?;
        rx.await
            .map_err(|_| EngineError::Stopped(self.last_error()))?
    }

    /// The engine's device with a stream of its own, for copies beside the engine's work (a
    /// colocated trainer's tensors, an in-place commit's next layer); the engine's work is not
    /// ordered with it, so synchronize it before handing the engine what it wrote. A CPU engine
    /// refuses.
    pub async fn side_stream(&self) -> Result<crate::backend::cuda::Gpu, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::SideStream(reply))?;
        rx.await
            .map_err(|_| EngineError::Stopped(self.last_error()))?
    }

    /// Opens the allocations another process on this GPU shares through CUDA IPC, off the
    /// engine thread (generation goes on), and waits for the producer's events. The mapping
    /// comes back with a stream of its own for copies out of it; the handles close, and the
    /// producer's references are given back, when the last holder drops it (also when this
    /// fails). A CPU engine refuses (no device to open them on).
    pub async fn open_ipc(
        &self,
        sources: Vec<crate::backend::cuda::ipc::IpcSource>,
    ) -> Result<
        (
            crate::backend::cuda::Gpu,
            crate::backend::cuda::ipc::IpcMapping,
        ),
        EngineError,
    > {
        use crate::backend::cuda::ipc;
        let gpu = match self.side_stream().await {
            Ok(gpu) => gpu,
            Err(e) => {
                ipc::release_references(&sources);
                return Err(e);
            }
        };
        tokio::task::spawn_blocking(move || {
            ipc::IpcMapping::open(&gpu, sources).map(|mapping| (gpu, mapping))
        })
        .await
        .map_err(|e| EngineError::Failed(format!("opening the shared tensors failed: {e}")))?
        .map_err(|e| EngineError::BadInput {
            param: e.name,
            message: e.message,
        })
    }

    /// Releases the memory of `tags` (SGLang's `/release_memory_occupation`; None: every tag
    /// not released yet): the KV cache's memory is freed and the prefix cache flushed (its
    /// contents are gone); the weights' memory is freed, a host copy kept first when
    /// [`MemoryState::weights_backup`] says so. Refused, changing nothing, while any request
    /// is in flight (running, waiting or held by a pause) or when a tag given is released
    /// already (or, for None, everything is). Generation is refused (503) until resumed.
    pub async fn release_memory(
        &self,
        tags: Option<Vec<MemoryTag>>,
    ) -> Result<MemoryReport, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::ReleaseMemory { tags, reply })?;
        rx.await
            .map_err(|_| EngineError::Stopped(self.last_error()))?
    }

    /// Reallocates the memory of `tags` (None: everything released): the KV cache empty, the
    /// weights from their backup (bit for bit) or, without one, absent until an update writes
    /// every tensor. Refused, changing nothing, when a tag given is not released (or, for
    /// None, nothing is); a failed allocation (the memory is still taken by someone else)
    /// leaves that tag released.
    pub async fn resume_memory(
        &self,
        tags: Option<Vec<MemoryTag>>,
    ) -> Result<MemoryReport, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::ResumeMemory { tags, reply })?;
        rx.await
            .map_err(|_| EngineError::Stopped(self.last_error()))?
    }

    /// What is released now.
    pub fn memory(&self) -> MemoryState {
        *self.shared.memory.lock().expect("memory lock")
    }

    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }

    pub fn weight_version(&self) -> String {
        self.info
            .weight_version
            .read()
            .expect("weight version lock")
            .clone()
    }

    /// The served weights' checksum with the version it belongs to.
    pub fn weights_checksum(&self) -> (String, Arc<WeightsChecksum>) {
        self.info
            .weights_checksum
            .read()
            .expect("checksum lock")
            .clone()
    }

    pub fn last_error(&self) -> String {
        self.shared
            .last_error
            .lock()
            .ok()
            .and_then(|e| e.clone())
            .unwrap_or_else(|| "engine thread exited".into())
    }
}
