//! Live weight updates. `/update_weights_from_disk` (SGLang's name and shape) loads a
//! checkpoint from under `--weights-root` off the engine thread, checks it has the served
//! model's shapes, and swaps it in between two engine steps: all or nothing, the version moves
//! only on success. The streamed session (begin, PUT buckets, end/abort) validates tensors on
//! arrival and commits them the same way. A tensor that is a whole slot by itself (a dense
//! weight with no gate/up partner to share a scale with) is prepared as soon as it arrives, its
//! bucket bytes freed: the prepared slots are the update's copy of the weights, so a model of
//! any size streams through. Parts that wait for others (scales, an NVFP4 gate/up pair) stay
//! raw until commit, bounded by `--max-staged-weight-bytes`.
//!
//! Where the prepared slots go (`--weight-update-shadow`): into a **shadow** copy of the served
//! weights that the engine made at the session's first bucket (on the device for a CUDA
//! server with room for it), written as each bucket arrives while generation goes on; the
//! commit swaps the shadow in between two steps. Or, with no shadow, they are kept on the host
//! and written **in place** at commit, generation standing still for the writes. Either way
//! the version moves only when every tensor is written and the checksum verifies; a refused
//! commit leaves the served weights and version as they were (a shadow is dropped; in place,
//! nothing was written yet).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::Json;
use cudarc::driver::DevicePtrMut;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde::Deserialize;
use serde_json::json;

use super::errors::ApiError;
use super::extract::{ApiBytes, ApiJson};
use super::read_back;
use super::spill::Spill;
use super::AppState;
use crate::backend::cpu::linear::DenseWeight;
use crate::backend::cuda::{hash, CudaError, Gpu};
use crate::backend::Storage;
use crate::engine::{EngineInfo, ShadowWeights};
use crate::model::checksum::{self, WeightsChecksum};
use crate::model::cuda::quantize::{self, quantize_slots, Dense};
use crate::model::loader::{self, Quantization};
use crate::model::slots::{replacements_checksum, DeviceTensor, Replacement, SlotShape};
use crate::model::store::WeightStore;
use crate::quant::slot::{self, Slot, SlotError};
use crate::quant::{Format, Recipe};

/// How the served model was loaded, so an update is loaded the same way.
#[derive(Clone, Debug, Default)]
pub struct WeightSettings {
    pub quantization: Option<Quantization>,
    pub recipe: Option<Recipe>,
    /// Updates may only read checkpoints below this directory; none: updates from disk are off.
    pub weights_root: Option<PathBuf>,
    /// Where a streamed session writes (`--weight-update-shadow`).
    pub shadow: ShadowMode,
}

/// `--weight-update-shadow`: whether a streamed update writes into a shadow copy of the
/// served weights (commit is a swap) or is written in place at commit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ShadowMode {
    /// A shadow on the device when free device memory holds one (CUDA); otherwise in place.
    #[default]
    Auto,
    /// Always a shadow (also on the CPU, where the first bucket's write copies the served
    /// model); a session whose shadow does not fit is refused (409) at its first bucket.
    On,
    /// Always in place.
    Off,
}

#[derive(Deserialize)]
pub struct UpdateFromDisk {
    model_path: String,
    #[serde(default)]
    weight_version: Option<String>,
    #[serde(default = "yes")]
    flush_cache: bool,
    #[serde(default)]
    abort_all_requests: bool,
}

fn yes() -> bool {
    true
}

/// `path` resolved, if it lies under `root` (symlinks and `..` resolved first).
fn under_root(root: &Path, path: &str) -> Result<PathBuf, ApiError> {
    let forbidden = || {
        ApiError::Forbidden(format!(
            "model_path `{path}` is not under --weights-root {}",
            root.display()
        ))
    };
    let root = root.canonicalize().map_err(|_| forbidden())?;
    let p = Path::new(path)
        .canonicalize()
        .map_err(|e| ApiError::invalid("model_path", format!("`{path}`: {e}")))?;
    if p.starts_with(&root) {
        Ok(p)
    } else {
        Err(forbidden())
    }
}

pub async fn update_weights_from_disk(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<UpdateFromDisk>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let settings = state.weights.clone();
    let root = settings.weights_root.as_deref().ok_or_else(|| {
        ApiError::Forbidden(
            "updates from disk are off; start the server with --weights-root DIR".into(),
        )
    })?;
    let path = under_root(root, &body.model_path)?;
    weights_in_memory(&state)?;
    // Flushing is not optional here: cached blocks hold KV computed with the old weights.
    if !body.flush_cache {
        return Err(ApiError::invalid("flush_cache", "flush_cache=false is not supported: the prefix cache always holds KV of the old weights"));
    }
    let in_place = state.engine.info.weights_on_device;
    if in_place {
        let commit = state.updates.commit.clone().lock_owned().await;
        if let Some(loader) = state.engine.device_loader().await? {
            return update_on_device(&state, body, path, loader, commit).await;
        }
        // No room on the device for a second copy: the checkpoint is loaded on the host and
        // written into the served buffers in place, generation standing still for the writes.
    }
    let started = Instant::now();
    let load_path = path.clone();
    let (model, sum) = tokio::task::spawn_blocking(move || {
        loader::load_model(&load_path, settings.quantization, settings.recipe.clone()).map(
            |(mut model, _)| {
                let sum = model.weights_checksum();
                (model, sum)
            },
        )
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
    .map_err(|e| ApiError::invalid("model_path", format!("{}: {e}", path.display())))?;
    let load_secs = started.elapsed().as_secs_f64();
    let _commit = state.updates.commit.lock().await;
    let version = body
        .weight_version
        .unwrap_or_else(|| next_version(&state.engine.weight_version()));
    let swap = Instant::now();
    let aborted = state
        .engine
        .swap_model(
            model,
            Arc::new(sum),
            version.clone(),
            body.abort_all_requests,
        )
        .await
        .map_err(refused_weights)?;
    // In place the engine stood still for the writes; on the host the new model was built
    // beside the served one and swapped in.
    let mode = if in_place { "in_place" } else { "shadow" };
    Ok(disk_answer(
        &body.model_path,
        &version,
        mode,
        aborted,
        load_secs,
        swap,
    ))
}

/// A checkpoint the engine refused at the swap (another config) is the request's fault.
fn refused_weights(e: crate::engine::EngineError) -> ApiError {
    match e {
        crate::engine::EngineError::Conflict(m) => ApiError::invalid("model_path", m),
        other => other.into(),
    }
}

/// The answer to an update from disk, logged: how it went in (`mode`), and how long loading
/// and the swap (since `swap`) took.
fn disk_answer(
    model_path: &str,
    version: &str,
    mode: &str,
    aborted: usize,
    load_secs: f64,
    swap: Instant,
) -> Json<serde_json::Value> {
    let swap_secs = swap.elapsed().as_secs_f64();
    tracing::info!(
        "weights updated from {model_path} to version {version} ({mode}): loaded in {load_secs:.2} s, swapped in {:.1} ms",
        swap_secs * 1e3
    );
    Json(json!({
        "success": true,
        "message": format!("weights updated to version {version}"),
        "num_paused_requests": aborted,
        "mode": mode,
        "load_seconds": load_secs,
        "swap_seconds": swap_secs,
    }))
}

/// `/update_weights_from_disk` when the weights live only on the GPU and the device has room
/// for a second copy: the checkpoint is loaded onto the device beside the served weights, on
/// the loader's stream, while generation goes on; the engine then swaps it in between two
/// steps (it stands still only for the swap). `_commit` is held throughout.
async fn update_on_device(
    state: &AppState,
    body: UpdateFromDisk,
    path: PathBuf,
    loader: crate::engine::DeviceLoader,
    _commit: tokio::sync::OwnedMutexGuard<()>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let settings = &state.weights;
    let weights = crate::engine::DiskWeights {
        dir: path.clone(),
        quantization: settings.quantization,
        recipe: settings.recipe.clone(),
    };
    let started = Instant::now();
    let (loaded, sum) = tokio::task::spawn_blocking(move || {
        let mut loaded = loader.load(&weights)?;
        let sum = loaded
            .checksum()
            .map_err(|e| format!("the device could not take the new weights: {e}"))?;
        Ok::<_, String>((loaded, sum))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
    .map_err(|e| ApiError::invalid("model_path", e))?;
    let load_secs = started.elapsed().as_secs_f64();
    let version = body
        .weight_version
        .unwrap_or_else(|| next_version(&state.engine.weight_version()));
    let swap = Instant::now();
    let installed = state
        .engine
        .install_shadow(
            loaded,
            Arc::new(sum),
            version.clone(),
            body.abort_all_requests,
        )
        .await
        .map_err(refused_weights)?;
    let answer = disk_answer(
        &body.model_path,
        &version,
        "shadow",
        installed.aborted,
        load_secs,
        swap,
    );
    tokio::task::spawn_blocking(move || drop(installed.displaced));
    Ok(answer)
}

/// Refuses an update before anything is loaded or staged while the weights are released (no
/// memory to write into); the engine checks again when it commits, and also refuses a
/// partial update of absent weights.
fn weights_in_memory(state: &AppState) -> Result<(), ApiError> {
    let slots = state.engine.info.slots().len();
    state
        .engine
        .memory()
        .check_update(slots, slots)
        .map_err(ApiError::Conflict)
}

/// "default" -> "1", "7" -> "8", anything else -> "<it>.1".
pub fn next_version(v: &str) -> String {
    match v.parse::<u64>() {
        Ok(n) => (n + 1).to_string(),
        Err(_) if v == "default" => "1".into(),
        Err(_) => format!("{v}.1"),
    }
}

// ---------------------------------------------------------------------------------------------
// The streamed session: begin, any number of PUT /update_weights buckets, end (or abort).

/// A staged tensor: a slice of the bucket body it arrived in (no copy).
pub struct StagedTensor {
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<usize>,
    pub(crate) data: bytes::Bytes,
}

/// One open streamed update. Tensors are validated on arrival and held here until commit.
pub struct Session {
    id: String,
    /// The version the commit names: from begin, or from `/update_weight_version` while the
    /// session is open; None: the next after the served one.
    version: Option<String>,
    /// Parts waiting for others, as they arrived; `bytes` is their total.
    staged: BTreeMap<String, StagedTensor>,
    bytes: usize,
    /// Whole slots already prepared, by checkpoint tensor name: (slot name, replacement).
    prepared: BTreeMap<String, (String, Replacement)>,
    /// Bucket bytes the prepared slots came from (in memory and spilled).
    prepared_bytes: usize,
    /// Bucket bytes of the prepared slots held in memory.
    resident_bytes: usize,
    /// Prepared slots past `--max-prepared-weight-bytes`, waiting on disk (in place only).
    spill: Option<Spill>,
    /// Where whole slots go, decided at the first bucket: None until then.
    target: Option<Target>,
    last_activity: Instant,
}

/// Where a session's whole slots go.
enum Target {
    /// Kept in `prepared`, written in place at commit.
    InPlace,
    Shadow(SessionShadow),
}

/// A session's shadow copy and what was written into it.
struct SessionShadow {
    /// None only while a bucket writes into it (off the runtime).
    weights: Option<ShadowWeights>,
    /// Checkpoint tensor names written, and the checksums of the slots they wrote.
    written: std::collections::BTreeSet<String>,
    changed: WeightsChecksum,
}

impl SessionShadow {
    fn on_device(&self) -> bool {
        self.weights.as_ref().is_some_and(ShadowWeights::on_device)
    }
}

impl Session {
    fn tensors(&self) -> usize {
        let written = match &self.target {
            Some(Target::Shadow(s)) => s.written.len(),
            _ => 0,
        };
        self.staged.len()
            + self.prepared.len()
            + written
            + self.spill.as_ref().map_or(0, Spill::slots)
    }

    fn mode(&self) -> &'static str {
        match &self.target {
            Some(Target::Shadow(_)) => "shadow",
            Some(Target::InPlace) => "in_place",
            None => "undecided",
        }
    }

    fn shadow_mut(&mut self) -> Option<&mut SessionShadow> {
        match &mut self.target {
            Some(Target::Shadow(s)) => Some(s),
            _ => None,
        }
    }
}

/// The server's single update slot and its limits.
pub struct WeightUpdates {
    session: tokio::sync::Mutex<Option<Session>>,
    /// Held from reading the served checksum to the swap, so two commits (a session and an
    /// update from disk) never overlay the same old checksum.
    commit: Arc<tokio::sync::Mutex<()>>,
    /// `/weights_checker {action: snapshot}`: the served checksum then, with its version.
    snapshot: std::sync::Mutex<Option<(String, Arc<WeightsChecksum>)>>,
    pub max_staged_bytes: usize,
    pub session_timeout: Duration,
    /// Bucket bytes of prepared slots an in-place session keeps in memory; later ones wait in
    /// a spill file under `spill_dir` until the commit.
    pub max_prepared_bytes: usize,
    pub spill_dir: PathBuf,
    /// Whether a commit with spilled slots keeps what it overwrites, to roll back
    /// (`--weight-update-rollback`).
    pub rollback: bool,
    /// Device bytes an in-place commit may fill with spilled layers read back before it
    /// pauses generation (`--max-read-ahead-weight-bytes`; None: what is free, less a spare).
    pub max_read_ahead_bytes: Option<usize>,
}

impl WeightUpdates {
    pub fn new(
        max_staged_bytes: usize,
        session_timeout: Duration,
        max_prepared_bytes: usize,
        spill_dir: PathBuf,
        rollback: bool,
        max_read_ahead_bytes: Option<usize>,
    ) -> WeightUpdates {
        WeightUpdates {
            session: tokio::sync::Mutex::new(None),
            commit: Arc::new(tokio::sync::Mutex::new(())),
            snapshot: std::sync::Mutex::new(None),
            max_staged_bytes,
            session_timeout,
            max_prepared_bytes,
            spill_dir,
            rollback,
            max_read_ahead_bytes,
        }
    }
}

/// Every field is optional so that SGLang's own body (`{"selector": "all"}`, what Miles sends)
/// opens a session too; the version can then come from `/update_weight_version` or default to
/// the next one at commit.
#[derive(Deserialize, Default)]
pub struct BeginBody {
    #[serde(default)]
    weight_version: Option<String>,
    #[serde(default)]
    recipe_hash: Option<String>,
    #[serde(default)]
    selector: Option<String>,
}

/// SGLang's `selector` (which model runners an operation applies to): lockstep serves one
/// model and no draft model, so `all` and `target` both mean it.
pub(crate) fn check_selector(selector: Option<&str>) -> Result<(), ApiError> {
    match selector {
        None | Some("all") | Some("target") => Ok(()),
        Some("draft") => Err(ApiError::invalid(
            "selector",
            "selector `draft`: this server has no draft model (speculative decoding is not supported)",
        )),
        Some(other) => Err(ApiError::invalid(
            "selector",
            format!("selector `{other}` is not one of all, target, draft"),
        )),
    }
}

pub async fn begin_weight_update(
    State(state): State<AppState>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let body: BeginBody = super::admin::optional_json(&body)?;
    check_selector(body.selector.as_deref())?;
    if body.weight_version.as_deref() == Some("") {
        return Err(ApiError::invalid(
            "weight_version",
            "weight_version must not be empty",
        ));
    }
    if let Some(h) = &body.recipe_hash {
        if *h != state.engine.info.recipe_hash {
            return Err(ApiError::invalid(
                "recipe_hash",
                format!(
                    "recipe_hash {h} differs from the server's recipe {} ({})",
                    state.engine.info.recipe_hash, state.engine.info.recipe_name
                ),
            ));
        }
    }
    weights_in_memory(&state)?;
    let mut slot = state.updates.session.lock().await;
    if let Some(open) = slot.as_ref() {
        if open.last_activity.elapsed() < state.updates.session_timeout {
            return Err(ApiError::Conflict(format!(
                "weight update session {} is open; end or abort it first",
                open.id
            )));
        }
        tracing::warn!(
            "weight update session {} timed out; dropping what it staged",
            open.id
        );
    }
    let id = super::validate::new_rid();
    *slot = Some(Session {
        id: id.clone(),
        version: body.weight_version,
        staged: BTreeMap::new(),
        bytes: 0,
        prepared: BTreeMap::new(),
        prepared_bytes: 0,
        resident_bytes: 0,
        spill: None,
        target: None,
        last_activity: Instant::now(),
    });
    Ok(Json(json!({"success": true, "session": id})))
}

#[derive(Deserialize)]
pub struct SessionQuery {
    #[serde(default)]
    session: Option<String>,
}

/// The open session named `id`; with no `id`, the one open session (the server holds at most
/// one, so a client that never saw the id, like SGLang's, still means it unambiguously).
fn open_session<'a>(
    slot: &'a mut Option<Session>,
    id: Option<&str>,
    timeout: Duration,
) -> Result<&'a mut Session, ApiError> {
    let id = match (id, slot.as_ref()) {
        (Some(id), _) => id.to_string(),
        (None, Some(open)) => open.id.clone(),
        (None, None) => {
            return Err(ApiError::invalid(
                "session",
                "no session given and no weight update session is open: POST /begin_weight_update first",
            ))
        }
    };
    let id = id.as_str();
    match slot {
        Some(s) if s.id == id => {
            if s.last_activity.elapsed() < timeout {
                Ok(s)
            } else {
                Err(ApiError::Conflict(format!(
                    "weight update session {id} timed out"
                )))
            }
        }
        _ => Err(ApiError::NotFound(format!(
            "no open weight update session `{id}`"
        ))),
    }
}

pub async fn put_update_weights(
    State(state): State<AppState>,
    Query(q): Query<SessionQuery>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let st = SafeTensors::deserialize(&body).map_err(|e| {
        ApiError::invalid(
            "body",
            format!("not a complete safetensors file (cut off?): {e}"),
        )
    })?;
    let mut tensors = Vec::new();
    for (name, t) in st.tensors() {
        // The view borrows from `body`: keep a slice of it rather than a copy.
        let start = t.data().as_ptr() as usize - body.as_ptr() as usize;
        let staged = StagedTensor {
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            data: body.slice(start..start + t.data().len()),
        };
        tensors.push((name, staged));
    }
    stage_bucket(&state, q.session.as_deref(), tensors, Vec::new()).await
}

/// Each tensor checked against the served slot it is for: (name, tensor, whether it is a dense
/// weight, the name of its gate/up partner when it is a dense half of a pair).
type Incoming = Vec<(String, StagedTensor, bool, Option<String>)>;

fn check_incoming(
    info: &EngineInfo,
    tensors: Vec<(String, StagedTensor)>,
) -> Result<Incoming, ApiError> {
    let mut incoming = Vec::new();
    for (name, staged) in tensors {
        let (slot, suffix) = served_part(info, &name)?;
        slot.check(suffix, staged.dtype, &staged.shape)
            .map_err(invalid)?;
        let dense = suffix == "weight" && slot::is_dense(staged.dtype);
        let partner = slot.pair.as_ref().filter(|_| dense).map(|p| {
            let other = if p.gate == slot.module {
                &p.up
            } else {
                &p.gate
            };
            format!("{other}.weight")
        });
        incoming.push((name, staged, dense, partner));
    }
    Ok(incoming)
}

/// One bucket of checkpoint-layout tensors into the open session (`PUT /update_weights`, and
/// `/update_weights_from_tensor` while a session is open).
/// `device`: whole slots already prepared in device memory (by checkpoint name: slot name and
/// replacement), for a session that writes into a shadow on the device only.
pub(crate) async fn stage_bucket(
    state: &AppState,
    session_id: Option<&str>,
    tensors: Vec<(String, StagedTensor)>,
    device: Vec<(String, (String, Replacement))>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let arrived = Instant::now();
    let incoming = check_incoming(&state.engine.info, tensors)?;
    // The session is held through the bucket, so buckets and the commit never interleave.
    let mut open = state.updates.session.lock().await;
    let locked = Instant::now();
    let session = open_session(&mut open, session_id, state.updates.session_timeout)?;
    if session.target.is_none() {
        session.target = Some(target(state).await?);
    }
    if !device.is_empty() && !session.shadow_mut().is_some_and(|s| s.on_device()) {
        return Err(ApiError::Internal(format!(
            "tensors in device memory offered to weight update session {} that writes {}",
            session.id,
            session.mode()
        )));
    }
    // Whole slots: a dense weight with no partner, or both dense halves of a gate/up pair
    // (one may have arrived in an earlier bucket). The rest waits for commit.
    let here: BTreeMap<String, bool> = incoming
        .iter()
        .map(|(n, t, _, _)| (n.clone(), slot::is_dense(t.dtype)))
        .collect();
    let mut whole = BTreeMap::new();
    let mut waiting = Vec::new();
    let mut taken = Vec::new();
    for (name, t, dense, partner) in incoming {
        match partner {
            None if dense => {
                whole.insert(name, t);
            }
            Some(other) if here.get(&other) == Some(&true) => {
                whole.insert(name, t);
            }
            Some(other)
                if session
                    .staged
                    .get(&other)
                    .is_some_and(|o| slot::is_dense(o.dtype)) =>
            {
                let o = &session.staged[&other];
                whole.insert(
                    other.clone(),
                    StagedTensor {
                        dtype: o.dtype,
                        shape: o.shape.clone(),
                        data: o.data.clone(),
                    },
                );
                taken.push(other);
                whole.insert(name, t);
            }
            _ => waiting.push((name, t)),
        }
    }
    let replaced: usize = waiting
        .iter()
        .filter_map(|(n, _)| session.staged.get(n).map(|t| t.data.len()))
        .sum();
    let freed: usize = taken.iter().map(|n| session.staged[n].data.len()).sum();
    let new_bytes: usize = waiting.iter().map(|(_, t)| t.data.len()).sum();
    if session.bytes - replaced - freed + new_bytes > state.updates.max_staged_bytes {
        return Err(ApiError::invalid(
            "body",
            format!(
                "staging {new_bytes} more bytes of parts that wait for others (a gate/up half without its partner, scales) would exceed --max-staged-weight-bytes {}",
                state.updates.max_staged_bytes
            ),
        ));
    }
    // Whole slots are prepared now, off the runtime, and their bucket bytes dropped; with a
    // shadow they are written into it there too, and only their checksums kept.
    let whole_bytes: usize = whole.values().map(|t| t.data.len()).sum();
    let mut names: Vec<String> = whole.keys().cloned().collect();
    names.extend(device.iter().map(|(n, _)| n.clone()));
    let info = state.engine.info.clone();
    let shadow = session
        .shadow_mut()
        .map(|s| s.weights.take().expect("returned by every bucket"));
    let (shadow, prepared, prepare_ms) = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let (mut updates, whole) = match shadow.as_ref().and_then(ShadowWeights::device_stream) {
            Some(gpu) => upload_for_device(gpu, &info, whole),
            None => (Vec::new(), whole),
        };
        match build_replacements(&info, whole) {
            Ok(u) => updates.extend(u),
            Err(e) => return (shadow, Err(e), 0.0),
        };
        updates.extend(device.into_iter().map(|(_, slot)| slot));
        let prepare_ms = started.elapsed().as_secs_f64() * 1e3;
        let (shadow, prepared) = match shadow {
            None => (None, Ok(Prepared::Kept(updates))),
            Some(mut shadow) => match write_shadow(&mut shadow, updates, info.config.hidden_size) {
                Ok(changed) => (Some(shadow), Ok(Prepared::Written(changed))),
                Err(e @ ShadowWriteError::Refused(_)) => (Some(shadow), Err(e.into())),
                Err(e) => (None, Err(e.into())),
            },
        };
        (shadow, prepared, prepare_ms)
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?;
    if let Some(s) = session.shadow_mut() {
        match shadow {
            Some(w) => s.weights = Some(w),
            None => {
                // A device error while writing: what the shadow holds is unknown.
                let id = session.id.clone();
                *open = None;
                let e = prepared
                    .err()
                    .expect("the shadow is only lost with an error");
                return Err(ApiError::Conflict(format!(
                    "weight update session {id} was dropped, nothing changed: {e}"
                )));
            }
        }
    }
    let prepared = prepared?;
    // A tensor sent again replaces the earlier one, whichever way each was held.
    for (name, t) in waiting {
        session.bytes += t.data.len();
        session.prepared.remove(&name);
        if let Some(spill) = &mut session.spill {
            spill.remove(&name);
        }
        if let Some(s) = session.shadow_mut() {
            s.written.remove(&name);
        }
        if let Some(old) = session.staged.insert(name, t) {
            session.bytes -= old.data.len();
        }
    }
    for name in &names {
        // A partner taken from an earlier bucket leaves the waiting parts.
        if let Some(old) = session.staged.remove(name) {
            session.bytes -= old.data.len();
        }
    }
    match prepared {
        Prepared::Kept(updates) => {
            session.prepared_bytes += whole_bytes;
            if session.resident_bytes + whole_bytes <= state.updates.max_prepared_bytes {
                session.resident_bytes += whole_bytes;
                for (name, update) in names.into_iter().zip(updates) {
                    if let Some(spill) = &mut session.spill {
                        spill.remove(&name);
                    }
                    session.prepared.insert(name, update);
                }
            } else {
                spill_slots(state, session, names.into_iter().zip(updates).collect()).await?;
            }
        }
        Prepared::Written(changed) => {
            let s = session.shadow_mut().expect("written into the shadow");
            s.changed = s.changed.overlaid(&changed);
            s.written.extend(names);
        }
    }
    session.last_activity = Instant::now();
    tracing::info!(
        "bucket of {} bytes ({}): waited {:.1} ms for the session, prepared{} in {:.1} ms (slots built in {:.1} ms)",
        whole_bytes,
        session.mode(),
        (locked - arrived).as_secs_f64() * 1e3,
        if session.shadow_mut().is_some() {
            " and written"
        } else {
            ""
        },
        locked.elapsed().as_secs_f64() * 1e3,
        prepare_ms
    );
    Ok(Json(json!({
        "success": true,
        "session": session.id,
        "mode": session.mode(),
        "staged_tensors": session.tensors(),
        "staged_bytes": session.bytes + session.prepared_bytes,
        "spilled_bytes": session.spill.as_ref().map_or(0, Spill::bytes),
        "waiting_bytes": session.bytes,
    })))
}

/// Whether checkpoint tensor `name` of `dtype` can be written into the weights device to device:
/// a BF16 tensor for a BF16 layer or the embedding, whose device layout is the checkpoint's.
pub(crate) fn lands_device_to_device(info: &EngineInfo, name: &str, dtype: Dtype) -> bool {
    dtype == Dtype::BF16
        && matches!(
            info.slots().get(name),
            Some(SlotShape::Linear {
                format: Format::Bf16,
                ..
            }) | Some(SlotShape::Embedding { .. })
        )
}

/// Tensors bound for weights on the device (a pushed bucket for a device shadow, on the
/// shadow's stream): those that land device to device are copied to the device in one buffer
/// and hashed there, and dense BF16 weights of MXFP8 or NVFP4 layers are copied there and
/// quantized there ([`quantize_slots`]); both are handed over as device replacements, so their
/// bytes are neither converted, quantized nor hashed on the host (what bounded a push's
/// bucket). Returns them and the rest, for the host path; tensors go there too when the device
/// has no room for them.
fn upload_for_device(
    gpu: &Gpu,
    info: &EngineInfo,
    whole: BTreeMap<String, StagedTensor>,
) -> (Vec<(String, Replacement)>, BTreeMap<String, StagedTensor>) {
    let (direct, rest): (BTreeMap<_, _>, BTreeMap<_, _>) = whole
        .into_iter()
        .partition(|(name, t)| lands_device_to_device(info, name, t.dtype));
    let (to_quantize, mut rest) = quantized_on_device(info, rest, |t| t.dtype);
    let mut updates = Vec::new();
    if !direct.is_empty() {
        match upload(gpu, &direct) {
            Ok(u) => updates = u,
            Err(e) => {
                tracing::warn!(
                    "BF16 tensors go through host memory: staging them on the device failed ({e})"
                );
                rest.extend(direct);
            }
        }
    }
    if !to_quantize.is_empty() {
        let dense = |(slot, t): &(Slot, StagedTensor)| {
            let mut values = gpu.alloc::<u16>(t.data.len() / 2)?;
            {
                let (dst, _sync) = values.device_ptr_mut(&gpu.stream);
                // SAFETY: `values` holds the tensor's bytes (its dense shape, checked on
                // arrival); pageable host memory is copied before the call returns.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        dst,
                        &t.data[..],
                        gpu.stream.cu_stream(),
                    )
                }?;
            }
            Ok(Dense {
                slot: slot.clone(),
                values,
            })
        };
        let quantized = room_for(gpu, to_quantize.values().map(|(_, t)| t.data.len() * 2))
            .and_then(|()| {
                to_quantize
                    .values()
                    .map(dense)
                    .collect::<Result<Vec<_>, CudaError>>()
            })
            .and_then(|d| quantize_slots(gpu, d));
        match quantized {
            Ok(u) => updates.extend(u),
            Err(e) => {
                tracing::warn!(
                    "dense weights of quantized layers are quantized on the host: quantizing them on the device failed ({e})"
                );
                rest.extend(to_quantize.into_iter().map(|(n, (_, t))| (n, t)));
            }
        }
    }
    (updates, rest)
}

/// The tensors of `tensors` that are quantized on the device for their slots (dense BF16
/// weights of MXFP8 or NVFP4 layers that [`quantize::quantizes`], with both halves of a shared
/// scale's gate/up pair among them), with their slots, and the rest.
pub(crate) fn quantized_on_device<T>(
    info: &EngineInfo,
    tensors: BTreeMap<String, T>,
    dtype: impl Fn(&T) -> Dtype,
) -> (BTreeMap<String, (Slot, T)>, BTreeMap<String, T>) {
    let mut chosen = BTreeMap::new();
    let mut rest = BTreeMap::new();
    for (name, t) in tensors {
        let slot = served_part(info, &name).ok().filter(|(slot, suffix)| {
            *suffix == "weight" && dtype(&t) == Dtype::BF16 && quantize::quantizes(slot)
        });
        match slot {
            Some((slot, _)) => {
                chosen.insert(name, (slot, t));
            }
            None => {
                rest.insert(name, t);
            }
        }
    }
    let lonely: Vec<String> = chosen
        .iter()
        .filter(|(_, (slot, _))| {
            slot.pair.as_ref().is_some_and(|p| {
                !chosen.contains_key(&format!("{}.weight", p.gate))
                    || !chosen.contains_key(&format!("{}.weight", p.up))
            })
        })
        .map(|(n, _)| n.clone())
        .collect();
    for name in lonely {
        let (_, t) = chosen.remove(&name).expect("listed above");
        rest.insert(name, t);
    }
    (chosen, rest)
}

/// Whether the device has room for buffers of `bytes` and the spare.
fn room_for(gpu: &Gpu, bytes: impl Iterator<Item = usize>) -> Result<(), CudaError> {
    let total: usize = bytes.sum();
    let (free, _) = gpu.memory()?;
    if free < total + UPLOAD_SPARE_BYTES {
        return Err(CudaError::Capacity(format!(
            "{total} bytes to stage with {free} free on the device"
        )));
    }
    Ok(())
}

/// Device memory an upload leaves free (else its tensors take the host path).
pub(crate) const UPLOAD_SPARE_BYTES: usize = 1 << 30;

/// `tensors` copied into one device buffer (each at a 256-byte boundary), hashed there, as
/// device tensors that keep the buffer alive.
fn upload(
    gpu: &Gpu,
    tensors: &BTreeMap<String, StagedTensor>,
) -> Result<Vec<(String, Replacement)>, CudaError> {
    let mut starts = Vec::with_capacity(tensors.len());
    let mut total = 0;
    for t in tensors.values() {
        starts.push(total);
        total += t.data.len().next_multiple_of(256);
    }
    // Never the engine's last memory: generation may be running and growing its scratch.
    room_for(gpu, std::iter::once(total))?;
    let mut buf = gpu.alloc::<u8>(total)?;
    for (t, &at) in tensors.values().zip(&starts) {
        if !t.data.is_empty() {
            gpu.stream
                .memcpy_htod(&t.data[..], &mut buf.slice_mut(at..at + t.data.len()))?;
        }
    }
    let base = cudarc::driver::DevicePtr::device_ptr(&buf, &gpu.stream).0;
    let ranges: Vec<(u64, usize)> = tensors
        .values()
        .zip(&starts)
        .map(|(t, &at)| (base + at as u64, t.data.len()))
        .collect();
    // Ordered after the copies on the same stream; synchronized before it returns.
    let hashes = hash::xxh3_of_device(gpu, &ranges)?;
    let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::new(buf);
    Ok(tensors
        .keys()
        .zip(ranges.into_iter().zip(hashes))
        .map(|(name, ((ptr, bytes), hash))| {
            let r = Replacement::Device(DeviceTensor {
                ptr,
                bytes,
                hash,
                owner: owner.clone(),
            });
            (name.clone(), r)
        })
        .collect())
}

/// Host-held tensors from this size on are uploaded before an in-place commit's pause (the
/// write stages smaller ones into one upload itself).
const HELD_UPLOAD_MIN_BYTES: usize = 1 << 20;

/// An in-place commit's host-held BF16 weights (layers stored in BF16, the embedding), uploaded
/// on the side stream `gpu` while generation still runs, within `budget` device bytes and what
/// is free less [`UPLOAD_SPARE_BYTES`], so the pause copies them device to device instead of from pageable
/// host memory (H200, 2026-12-02: the last 1 GB of a 16 GB commit took 127-286 ms of the pause
/// that way). Each becomes a device tensor under the checksum entry `changed` has for it, once
/// every upload is done; on an error none does. Returns the device bytes taken; what does not
/// fit stays on the host.
fn upload_held(
    gpu: &Gpu,
    updates: &mut [(String, Replacement)],
    changed: &WeightsChecksum,
    budget: usize,
) -> Result<usize, CudaError> {
    // Never the engine's last memory: what is free now, less the spare, bounds them all.
    let (free, _) = gpu.memory()?;
    let budget = budget.min(free.saturating_sub(UPLOAD_SPARE_BYTES));
    let mut taken = 0;
    let mut uploaded = Vec::new();
    for (i, (name, r)) in updates.iter().enumerate() {
        let bytes: &[u8] = match r {
            Replacement::Linear(l) => match l.storage() {
                Storage::Bf16(v) => bytemuck::cast_slice(v),
                _ => continue,
            },
            Replacement::Embedding(DenseWeight::Bf16(v)) => bytemuck::cast_slice(v),
            _ => continue,
        };
        let Some(&hash) = changed.tensors.get(name) else {
            continue;
        };
        if bytes.len() < HELD_UPLOAD_MIN_BYTES || taken + bytes.len() > budget {
            continue;
        }
        let buf = gpu.upload(bytes)?;
        taken += bytes.len();
        let device = DeviceTensor {
            ptr: crate::backend::cuda::args::addr(gpu, &buf),
            bytes: bytes.len(),
            hash,
            owner: Arc::new(buf),
        };
        uploaded.push((i, Replacement::Device(device)));
    }
    // The engine's stream reads them: every copy is done first.
    gpu.synchronize()?;
    for (i, r) in uploaded {
        updates[i].1 = r;
    }
    Ok(taken)
}

/// Writes prepared slots past `--max-prepared-weight-bytes` into the session's spill file (made
/// on first need), off the runtime. A failure drops the session: what it staged is gone.
async fn spill_slots(
    state: &AppState,
    session: &mut Session,
    updates: Vec<(String, (String, Replacement))>,
) -> Result<(), ApiError> {
    let spill = match session.spill.take() {
        Some(s) => Ok(s),
        None => Spill::create(&state.updates.spill_dir),
    };
    let hidden = state.engine.info.config.hidden_size;
    let id = session.id.clone();
    let written = tokio::task::spawn_blocking(move || {
        let mut spill = spill?;
        let parts: Vec<_> = updates
            .iter()
            .map(|(_, (_, r))| r.checkpoint_parts(hidden))
            .collect();
        let slots = updates
            .iter()
            .zip(&parts)
            .map(|((name, (slot, _)), parts)| {
                let module = slot.strip_suffix(".weight").unwrap_or(slot);
                (name.clone(), module, &parts[..])
            })
            .collect();
        spill.write_slots(slots)?;
        Ok::<_, std::io::Error>((
            spill,
            updates.into_iter().map(|(n, _)| n).collect::<Vec<_>>(),
        ))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?;
    match written {
        Ok((spill, names)) => {
            for name in names {
                session.prepared.remove(&name);
            }
            session.spill = Some(spill);
            Ok(())
        }
        Err(e) => Err(ApiError::Internal(format!(
            "weight update session {id}: writing prepared slots to a spill file in {} failed: {e} (set TMPDIR or --weight-spill-dir to a disk with room)",
            state.updates.spill_dir.display()
        ))),
    }
}

/// Whether the open session `id` writes into a shadow copy on the device (deciding where it
/// writes, if its first bucket has not yet).
pub(crate) async fn session_writes_shadow(state: &AppState, id: &str) -> Result<bool, ApiError> {
    let mut open = state.updates.session.lock().await;
    let session = open_session(&mut open, Some(id), state.updates.session_timeout)?;
    if session.target.is_none() {
        session.target = Some(target(state).await?);
    }
    Ok(session.shadow_mut().is_some_and(|s| s.on_device()))
}

/// A bucket's whole slots: kept for an in-place commit, or written into the shadow (their
/// checksums).
enum Prepared {
    Kept(Vec<(String, Replacement)>),
    Written(WeightsChecksum),
}

/// Where a session's whole slots go, per `--weight-update-shadow` and what the engine can
/// make.
async fn target(state: &AppState) -> Result<Target, ApiError> {
    let mode = state.weights.shadow;
    if mode == ShadowMode::Off {
        return Ok(Target::InPlace);
    }
    let shadow = state.engine.shadow_weights(mode == ShadowMode::On).await?;
    Ok(match shadow {
        None => Target::InPlace,
        Some(weights) => {
            tracing::info!(
                "weight update writes into a shadow copy ({:.2} GiB{})",
                weights.bytes() as f64 / (1u64 << 30) as f64,
                if weights.on_device() {
                    ", on the device"
                } else {
                    ", in host memory"
                }
            );
            Target::Shadow(SessionShadow {
                weights: Some(weights),
                written: Default::default(),
                changed: WeightsChecksum::default(),
            })
        }
    })
}

/// Why a write into a shadow failed.
#[derive(Debug, thiserror::Error)]
enum ShadowWriteError {
    /// The replacements do not fit (nothing was written; the shadow is intact).
    #[error("{0}")]
    Refused(crate::model::store::StoreError),
    /// The device failed mid-write: what the shadow holds is unknown.
    #[error("{0}")]
    Device(crate::model::store::StoreError),
}

impl From<ShadowWriteError> for ApiError {
    fn from(e: ShadowWriteError) -> ApiError {
        match e {
            ShadowWriteError::Refused(e) => ApiError::invalid("body", e.to_string()),
            ShadowWriteError::Device(e) => {
                ApiError::Internal(format!("writing into the shadow copy failed: {e}"))
            }
        }
    }
}

/// Writes prepared slots into `shadow`; returns their checksums (hashed before the host
/// copies are freed).
fn write_shadow(
    shadow: &mut ShadowWeights,
    updates: Vec<(String, Replacement)>,
    hidden: usize,
) -> Result<WeightsChecksum, ShadowWriteError> {
    let changed = replacements_checksum(&updates, hidden);
    match shadow.write(updates) {
        Ok(spent) => {
            drop(spent);
            Ok(changed)
        }
        Err(e @ crate::model::store::StoreError::Device(_)) => Err(ShadowWriteError::Device(e)),
        Err(e) => Err(ShadowWriteError::Refused(e)),
    }
}

/// The served slot of the checkpoint tensor `name` and its part (`weight`, `weight_scale`...).
pub(crate) fn served_part(info: &EngineInfo, name: &str) -> Result<(Slot, &'static str), ApiError> {
    let unknown = || {
        ApiError::invalid(
            name,
            format!("tensor `{name}`: not a tensor of the served model"),
        )
    };
    let (module, suffix) = slot::split(name).ok_or_else(unknown)?;
    Ok((served_slot(info, module).ok_or_else(unknown)?, suffix))
}

/// The slot of `module` as the server holds it: shape and format from the slot table, the
/// numerics of the recipe, and its NVFP4 gate/up pair.
fn served_slot(info: &EngineInfo, module: &str) -> Option<Slot> {
    crate::model::slots::served_slot(info.slots(), &info.recipe, info.config.num_layers, module)
}

fn invalid(e: SlotError) -> ApiError {
    ApiError::invalid(&e.name, e.to_string())
}

/// `session` may be left out (SGLang's `{}`): the open session is meant.
#[derive(Deserialize, Default)]
pub struct EndBody {
    #[serde(default)]
    session: Option<String>,
    #[serde(default)]
    expected_tensors: Option<usize>,
    #[serde(default)]
    checksum: Option<String>,
}

pub async fn end_weight_update(
    State(state): State<AppState>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let body: EndBody = super::admin::optional_json(&body)?;
    // The session ends here whatever happens: a failed commit drops what it staged.
    let session = {
        let mut slot = state.updates.session.lock().await;
        open_session(
            &mut slot,
            body.session.as_deref(),
            state.updates.session_timeout,
        )?;
        slot.take().expect("checked open")
    };
    let expected_checksum = body
        .checksum
        .as_deref()
        .map(|c| {
            checksum::parse_hex(c).ok_or_else(|| {
                ApiError::invalid(
                    "checksum",
                    format!("checksum `{c}` is not a 64-bit hex number (16 hex digits, as GET /weights_checksum gives)"),
                )
            })
        })
        .transpose()?;
    if let Some(n) = body.expected_tensors {
        if n != session.tensors() {
            return Err(ApiError::invalid(
                "expected_tensors",
                format!(
                    "expected_tensors is {n} but {} tensors were staged",
                    session.tensors()
                ),
            ));
        }
    }
    if session.tensors() == 0 {
        // SGLang's begin/end only bracket an update made by other means (NCCL, tensor
        // handles), so a session with nothing staged is a legitimate no-op: the served
        // weights keep their version rather than a new name for unchanged weights.
        let (version, sum) = state.engine.weights_checksum();
        if let Some(want) = expected_checksum {
            if sum.overall() != want {
                return Err(ApiError::invalid(
                    "checksum",
                    format!(
                        "checksum mismatch: expected {} but nothing was staged and the served weights give {}",
                        checksum::hex(want),
                        checksum::hex(sum.overall())
                    ),
                ));
            }
        }
        return Ok(Json(
            json!({"success": true, "message": format!("no tensors were staged in session {}: weights and weight_version {version} unchanged", session.id), "weight_version": version, "committed_tensors": 0}),
        ));
    }
    let count = session.tensors();
    let mode = session.mode();
    let version = session.version.clone();
    let committed = match session.target {
        Some(Target::Shadow(shadow)) => {
            commit_shadow(&state, session.staged, shadow, version, expected_checksum).await?
        }
        _ => {
            commit(
                &state,
                session.staged,
                session.prepared,
                session.spill,
                version,
                expected_checksum,
            )
            .await?
        }
    };
    let version = committed.version;
    tracing::info!(
        "weights updated from a streamed session ({mode}): {count} tensors, version {version}, generation stood still {:.1} ms",
        committed.pause.as_secs_f64() * 1e3
    );
    Ok(Json(
        json!({"success": true, "message": format!("{count} tensors committed, version {version}"), "weight_version": version, "committed_tensors": count, "mode": mode, "commit_pause_s": committed.pause.as_secs_f64()}),
    ))
}

/// What a commit did.
pub(crate) struct Committed {
    pub version: String,
    pub pause: Duration,
}

/// Staged parts for modules that also arrived whole are dropped: a dense weight is the whole
/// slot, and scale parts sent for the same module are ignored (as `Slot::prepare` ignores
/// them beside a dense weight).
fn drop_parts_of_whole<'a>(
    staged: &mut BTreeMap<String, StagedTensor>,
    whole: impl Iterator<Item = &'a String>,
) {
    let whole: Vec<&str> = whole
        .filter_map(|n| slot::split(n).map(|(module, _)| module))
        .collect();
    staged.retain(|n, _| slot::split(n).is_none_or(|(module, _)| !whole.contains(&module)));
}

/// The end of a session written into a shadow: the parts still raw are prepared and written
/// into it too, the served checksum overlaid with every written slot's, `expected_checksum`
/// checked, and the shadow swapped in (generation stands still only for the swap). On any
/// error the shadow is dropped and the served weights are untouched.
async fn commit_shadow(
    state: &AppState,
    mut staged: BTreeMap<String, StagedTensor>,
    mut shadow: SessionShadow,
    version: Option<String>,
    expected_checksum: Option<u64>,
) -> Result<Committed, ApiError> {
    drop_parts_of_whole(&mut staged, shadow.written.iter());
    let info = state.engine.info.clone();
    let mut weights = shadow.weights.take().expect("returned by every bucket");
    let (weights, changed) = tokio::task::spawn_blocking(move || {
        let updates = build_replacements(&info, staged)?;
        let rest = write_shadow(&mut weights, updates, info.config.hidden_size)?;
        Ok::<_, ApiError>((weights, shadow.changed.overlaid(&rest)))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))??;
    let _commit = state.updates.commit.lock().await;
    let (version, sum) = committed_checksum(state, version, &changed, expected_checksum)?;
    let installed = state
        .engine
        .install_shadow(weights, Arc::new(sum), version.clone(), false)
        .await?;
    let pause = installed.pause;
    tokio::task::spawn_blocking(move || drop(installed.displaced));
    Ok(Committed { version, pause })
}

/// What a commit names and will serve (call it under the commit lock): its version (the given
/// one, or the next after the served one) and the served checksum overlaid with `changed`,
/// checked against `expected`.
fn committed_checksum(
    state: &AppState,
    version: Option<String>,
    changed: &WeightsChecksum,
    expected: Option<u64>,
) -> Result<(String, WeightsChecksum), ApiError> {
    let (served_version, served) = state.engine.weights_checksum();
    let version = version.unwrap_or_else(|| next_version(&served_version));
    let sum = served.overlaid(changed);
    check_expected(expected, &sum)?;
    Ok((version, sum))
}

/// `expected_checksum` (when given) equals what the update gives.
fn check_expected(expected: Option<u64>, sum: &WeightsChecksum) -> Result<(), ApiError> {
    let Some(want) = expected else {
        return Ok(());
    };
    let got = sum.overall();
    if got != want {
        return Err(ApiError::invalid(
            "checksum",
            format!(
                "checksum mismatch: expected {} but the staged weights give {}; nothing changed (compare GET /weights_checksum's tensors to find the tensor)",
                checksum::hex(want),
                checksum::hex(got)
            ),
        ));
    }
    Ok(())
}

/// Prepares the parts still raw, overlays the served checksum, checks `expected_checksum`, and
/// swaps everything in at once (the end of a session, or a one-shot
/// `/update_weights_from_tensor`). On any error nothing changes.
pub(crate) async fn commit(
    state: &AppState,
    mut staged: BTreeMap<String, StagedTensor>,
    prepared: BTreeMap<String, (String, Replacement)>,
    spill: Option<Spill>,
    version: Option<String>,
    expected_checksum: Option<u64>,
) -> Result<Committed, ApiError> {
    let info = state.engine.info.clone();
    drop_parts_of_whole(
        &mut staged,
        prepared.keys().chain(spill.iter().flat_map(Spill::names)),
    );
    let (updates, changed) = tokio::task::spawn_blocking(move || {
        let mut updates = build_replacements(&info, staged)?;
        updates.extend(prepared.into_values());
        let changed = replacements_checksum(&updates, info.config.hidden_size);
        Ok::<_, ApiError>((updates, changed))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))??;
    let changed = match &spill {
        Some(s) => s.checksum().overlaid(&changed),
        None => changed,
    };
    // On a CUDA server the held BF16 weights, then the spilled ones, go to the device beside
    // generation, so that the pause copies device to device.
    let (updates, held_on_device, gpu) = match state.engine.side_stream().await.ok() {
        Some(g) => {
            let budget = state.updates.max_read_ahead_bytes.unwrap_or(usize::MAX);
            let sum = changed.clone();
            tokio::task::spawn_blocking(move || {
                let started = Instant::now();
                let mut updates = updates;
                let taken = match upload_held(&g, &mut updates, &sum, budget) {
                    Ok(taken) => taken,
                    Err(e) => {
                        tracing::warn!("an in-place commit writes its held weights from host memory: uploading them failed ({e})");
                        0
                    }
                };
                if taken > 0 {
                    tracing::info!(
                        "in-place commit: {taken} bytes of held weights uploaded before the pause in {:.1} ms",
                        started.elapsed().as_secs_f64() * 1e3
                    );
                }
                (updates, taken, Some(g))
            })
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))?
        }
        None => (updates, 0, None),
    };
    let more = match spill {
        Some(s) => {
            let budget = read_back::Budget {
                host_bytes: state.updates.max_prepared_bytes,
                device_bytes: state
                    .updates
                    .max_read_ahead_bytes
                    .map(|b| b.saturating_sub(held_on_device)),
            };
            let started = Instant::now();
            let read = read_back::start(state.engine.info.clone(), s, gpu, budget);
            // Generation goes on while the first layers are read back; it pauses once they are
            // ready (or all are).
            if let Ok(p) = read.ready.await {
                tracing::info!(
                    "in-place commit: {} of {} spilled layers read back before the pause in {:.1} ms ({} bytes on the device, {} in host memory)",
                    p.groups,
                    p.of,
                    started.elapsed().as_secs_f64() * 1e3,
                    p.device_bytes,
                    p.host_bytes
                );
            }
            let mut more = read.more;
            if state.updates.rollback {
                // What the groups overwrite is kept on disk too, to roll back a commit that
                // cannot finish.
                let dir = &state.updates.spill_dir;
                let undo = SpillUndo::create(dir, state.engine.info.clone()).map_err(|e| {
                    ApiError::Internal(format!(
                        "creating the undo file of an in-place commit in {} failed: {e} (set TMPDIR or --weight-spill-dir to a disk with room); nothing changed",
                        dir.display()
                    ))
                })?;
                more.undo = Some(Box::new(undo));
            }
            Some(more)
        }
        None => None,
    };
    let _commit = state.updates.commit.lock().await;
    let (version, sum) = committed_checksum(state, version, &changed, expected_checksum)?;
    let commit = crate::engine::WeightCommit {
        updates,
        more,
        checksum: Arc::new(sum),
        version: version.clone(),
    };
    let (pause, spent) = state.engine.apply_weights(commit).await?;
    // Freeing gigabytes takes a while: not on the engine thread, not on the runtime.
    tokio::task::spawn_blocking(move || drop(spent));
    Ok(Committed { version, pause })
}

/// An in-place commit's undo log: the served contents of each slot it overwrites, in a spill
/// file of their own (host memory stays bounded), read back like the update's spilled layers
/// if the commit has to be rolled back.
pub struct SpillUndo {
    spill: Spill,
    info: Arc<EngineInfo>,
}

impl SpillUndo {
    pub fn create(dir: &Path, info: Arc<EngineInfo>) -> std::io::Result<SpillUndo> {
        Ok(SpillUndo {
            spill: Spill::create(dir)?,
            info,
        })
    }
}

impl crate::engine::UndoLog for SpillUndo {
    fn keep(&mut self, slots: crate::model::store::SlotParts) -> Result<(), String> {
        for (name, parts) in slots {
            let module = name.strip_suffix(".weight").unwrap_or(&name).to_string();
            self.spill
                .write_parts(name.clone(), &module, &parts)
                .map_err(|e| format!("`{name}` into the undo file: {e}"))?;
        }
        Ok(())
    }

    fn replay(self: Box<Self>) -> crate::engine::MoreUpdates {
        read_back::start(self.info, self.spill, None, read_back::Budget::ONE_AHEAD).more
    }
}

/// Names what the open session `id` will commit (as `/update_weight_version` does).
pub(crate) async fn name_session_version(state: &AppState, id: &str, version: String) {
    let mut slot = state.updates.session.lock().await;
    if let Some(s) = slot.as_mut().filter(|s| s.id == id) {
        s.version = Some(version);
    }
}

/// Drops the open session if it has been idle past `--weight-update-timeout-s` (a trainer that
/// went away mid-update): what it staged, and its shadow copy's memory, are freed. True if one
/// was dropped.
pub(crate) async fn drop_idle_session(updates: &WeightUpdates) -> bool {
    let mut slot = updates.session.lock().await;
    let idle = slot
        .as_ref()
        .is_some_and(|s| s.last_activity.elapsed() >= updates.session_timeout);
    if idle {
        let s = slot.take().expect("checked");
        tracing::warn!(
            "weight update session {} was idle for {:.0} s: dropped with what it staged ({} tensors, {})",
            s.id,
            s.last_activity.elapsed().as_secs_f64(),
            s.tensors(),
            s.mode()
        );
        drop(slot);
        tokio::task::spawn_blocking(move || drop(s));
    }
    idle
}

/// Drops idle sessions as they time out, so a trainer that disappears mid-update does not keep
/// a shadow copy (as much memory as the weights) until the next session begins.
pub(crate) async fn reap_idle_sessions(updates: Arc<WeightUpdates>) {
    let every =
        (updates.session_timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(15));
    loop {
        tokio::time::sleep(every).await;
        drop_idle_session(&updates).await;
    }
}

/// Whether a weight update session is open (not timed out); its id.
pub(crate) async fn open_session_id(state: &AppState) -> Option<String> {
    let slot = state.updates.session.lock().await;
    slot.as_ref()
        .filter(|s| s.last_activity.elapsed() < state.updates.session_timeout)
        .map(|s| s.id.clone())
}

/// Checks one tensor against the served slot it is for (name, dtype, shape), as a bucket does.
pub(crate) fn check_tensor(
    info: &EngineInfo,
    name: &str,
    dtype: Dtype,
    shape: &[usize],
) -> Result<(), ApiError> {
    let (slot, suffix) = served_part(info, name)?;
    slot.check(suffix, dtype, shape).map_err(invalid)
}

/// Refuses an update into released weights before anything is copied (see
/// [`weights_in_memory`]).
pub(crate) fn check_weights_in_memory(state: &AppState) -> Result<(), ApiError> {
    weights_in_memory(state)
}

#[derive(Deserialize)]
pub struct WeightVersionBody {
    new_version: String,
    /// SGLang's default: requests in flight are aborted (the abort is queued to the engine ahead
    /// of the rename; a step already running may still label its token with the new name).
    #[serde(default = "yes")]
    abort_all_requests: bool,
}

/// `POST /update_weight_version {new_version, abort_all_requests=true}`: names the weights.
/// Trainers that push weights by other means call it after every step (Miles: after
/// `/end_weight_update`). With no session open it renames the served weights (their checksum
/// keeps the new name too); while a streamed session is open, it names what that session will
/// commit instead, so the old weights never carry the new name.
pub async fn update_weight_version(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<WeightVersionBody>,
) -> Result<Json<serde_json::Value>, ApiError> {
    if body.new_version.is_empty() {
        return Err(ApiError::invalid(
            "new_version",
            "new_version must not be empty",
        ));
    }
    if body.abort_all_requests {
        state.engine.abort(None, true)?;
    }
    let version = body.new_version;
    {
        let mut slot = state.updates.session.lock().await;
        if let Some(open) = slot
            .as_mut()
            .filter(|s| s.last_activity.elapsed() < state.updates.session_timeout)
        {
            open.version = Some(version.clone());
            return Ok(Json(
                json!({"success": true, "message": format!("weight update session {} will commit as version {version}", open.id), "new_version": version}),
            ));
        }
    }
    // Under the commit lock no update swaps weights meanwhile, so name and checksum stay paired.
    let _commit = state.updates.commit.lock().await;
    let info = &state.engine.info;
    {
        let mut pair = info.weights_checksum.write().expect("checksum lock");
        pair.0 = version.clone();
    }
    *info.weight_version.write().expect("weight version lock") = version.clone();
    tracing::info!("weight version set to {version}");
    Ok(Json(
        json!({"success": true, "message": format!("Weight version updated to {version}"), "new_version": version}),
    ))
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct CheckBody {
    action: Option<String>,
    /// Accepted for SGLang's clients; checksums here are exact, so it changes nothing.
    #[allow(dead_code)]
    allow_quant_error: bool,
    skip_tensor_list: Option<Vec<String>>,
    selector: Option<String>,
}

/// `/weights_checker {action: checksum|snapshot|compare}` (SGLang's names) over the served
/// checksums (model/checksum.rs): `checksum` reports them in SGLang's `ranks` shape, `snapshot`
/// keeps the current one, `compare` names every tensor that differs from the snapshot.
/// `skip_tensor_list` drops tensors whose name contains any of its substrings.
pub async fn weights_checker(
    State(state): State<AppState>,
    ApiBytes(body): ApiBytes,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse;
    let body: CheckBody = super::admin::optional_json(&body)?;
    check_selector(body.selector.as_deref())?;
    let skip = body.skip_tensor_list.unwrap_or_default();
    let kept = |sum: &WeightsChecksum| WeightsChecksum {
        tensors: sum
            .tensors
            .iter()
            .filter(|(name, _)| !skip.iter().any(|p| name.contains(p.as_str())))
            .map(|(n, h)| (n.clone(), *h))
            .collect(),
    };
    if state.engine.memory().weights == crate::engine::WeightsState::Absent {
        return Err(ApiError::Conflict(
            "the weights are absent (resumed without a host backup): there is nothing to check until an update writes every tensor".into(),
        ));
    }
    let (version, served) = state.engine.weights_checksum();
    if served.tensors.is_empty() {
        return Err(ApiError::Conflict(
            "the served weights have no checksum (dummy weights drawn on the device)".into(),
        ));
    }
    let action = body.action.as_deref().unwrap_or("checksum");
    match action {
        "checksum" => {
            let sum = kept(&served);
            let hexes: serde_json::Map<String, serde_json::Value> = sum
                .tensors
                .iter()
                .map(|(n, h)| (n.clone(), json!(checksum::hex(*h))))
                .collect();
            let overall = checksum::hex(sum.overall());
            Ok(Json(json!({
                "success": true,
                "message": format!("{} tensors, {} over checkpoint-layout bytes", sum.tensors.len(), checksum::ALGORITHM),
                "weight_version": version,
                "algorithm": checksum::ALGORITHM,
                "per_engine_checksum": overall,
                "ranks": [{
                    "checksums": hexes,
                    "per_gpu_checksum": overall,
                    "parallelism_info": {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1},
                }],
            }))
            .into_response())
        }
        "snapshot" => {
            let n = served.tensors.len();
            *state.updates.snapshot.lock().expect("snapshot lock") = Some((version.clone(), served));
            Ok(Json(json!({"success": true, "message": format!("snapshot of {n} tensors at weight_version {version}"), "weight_version": version})).into_response())
        }
        "compare" => {
            let snap = state.updates.snapshot.lock().expect("snapshot lock").clone();
            let Some((snap_version, snap)) = snap else {
                return Err(ApiError::invalid(
                    "action",
                    "action `compare` needs an earlier `snapshot`",
                ));
            };
            let (then, now) = (kept(&snap), kept(&served));
            let names: std::collections::BTreeSet<&String> =
                then.tensors.keys().chain(now.tensors.keys()).collect();
            let differ: Vec<&String> = names
                .into_iter()
                .filter(|n| then.tensors.get(*n) != now.tensors.get(*n))
                .collect();
            if differ.is_empty() {
                return Ok(Json(json!({"success": true, "message": format!("all {} tensors equal the snapshot (weight_version {snap_version} then, {version} now)", now.tensors.len()), "weight_version": version, "snapshot_weight_version": snap_version, "mismatched_tensors": []})).into_response());
            }
            let shown: Vec<&str> = differ.iter().take(20).map(|s| s.as_str()).collect();
            let more = differ.len().saturating_sub(shown.len());
            let message = format!(
                "{} of {} tensors differ from the snapshot (weight_version {snap_version} then, {version} now): {}{}",
                differ.len(),
                now.tensors.len().max(then.tensors.len()),
                shown.join(", "),
                if more > 0 { format!(" and {more} more") } else { String::new() }
            );
            // SGLang answers a failed check with 400 and success: false; the error object
            // is there too for clients that read our error shape.
            let err = ApiError::Invalid { param: None, message: message.clone() };
            let mut body = err.body();
            body["success"] = json!(false);
            body["message"] = json!(message);
            body["weight_version"] = json!(version);
            body["snapshot_weight_version"] = json!(snap_version);
            body["mismatched_tensors"] = json!(differ);
            Ok((axum::http::StatusCode::BAD_REQUEST, Json(body)).into_response())
        }
        "reset_tensors" => Err(ApiError::NotImplemented(
            "action `reset_tensors` (overwriting the served weights with noise) is not supported: lockstep changes weights only through an update".into(),
        )),
        other => Err(ApiError::invalid(
            "action",
            format!("action `{other}` is not one of checksum, snapshot, compare, reset_tensors"),
        )),
    }
}

/// `GET /weights_checksum`: what the server holds, in checkpoint layout (model/checksum.rs).
pub async fn weights_checksum(State(state): State<AppState>) -> Json<serde_json::Value> {
    let (version, sum) = state.engine.weights_checksum();
    let mut body = sum.to_json();
    body["weight_version"] = json!(version);
    Json(body)
}

#[derive(Deserialize)]
pub struct AbortBody {
    session: String,
}

pub async fn abort_weight_update(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<AbortBody>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let mut slot = state.updates.session.lock().await;
    match slot.as_ref() {
        Some(s) if s.id == body.session => {
            *slot = None;
            Ok(Json(
                json!({"success": true, "message": "weight update aborted; nothing changed"}),
            ))
        }
        _ => Err(ApiError::NotFound(format!(
            "no open weight update session `{}`",
            body.session
        ))),
    }
}

/// Turns staged checkpoint-layout tensors into replacements with `quant::slot`: dense tensors
/// bound for a quantized slot are quantized with the contract (an NVFP4 expert's gate and up
/// share one scale, so both must be in the update); pre-quantized ones must be complete.
pub(crate) fn build_replacements(
    info: &EngineInfo,
    staged: BTreeMap<String, StagedTensor>,
) -> Result<Vec<(String, Replacement)>, ApiError> {
    let mut slots: BTreeMap<String, (Slot, slot::Parts<'_>)> = BTreeMap::new();
    for (name, t) in &staged {
        let (s, suffix) = served_part(info, name)?;
        let view = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data)
            .map_err(|e| ApiError::invalid(name, e.to_string()))?;
        let entry = slots
            .entry(s.module.clone())
            .or_insert((s, BTreeMap::new()));
        entry.1.insert(suffix, view);
    }
    let stored = slot::prepare_all(&slots).map_err(invalid)?;
    Ok(stored
        .into_iter()
        .map(|(module, stored)| {
            let (s, _) = &slots[&module];
            let name = s.name("weight");
            let r = Replacement::of(&info.slots()[&name], stored, &s.format);
            (name, r)
        })
        .collect())
}
