//! `POST /update_weights_from_tensor` (SGLang's colocated update): the trainer, on the same
//! GPU, sends CUDA IPC handles of its tensors (tensor_ipc.rs reads SGLang's pickles); they are
//! copied out of the trainer's memory on a stream of their own, off the engine thread, every
//! handle closed before this answers, and the tensors then take the streamed session's path:
//! checked against the layout, quantized for MXFP8/NVFP4 slots by `quant::slot`, committed all
//! at once. With a session open (`/begin_weight_update`) they are staged into it (into its
//! shadow, when it has one) and commit at `/end_weight_update`; otherwise the call is one
//! update of its own, written in place.

use std::collections::BTreeMap;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::errors::ApiError;
use super::extract::ApiJson;
use super::tensor_ipc::{self, LoadFormat};
use super::weights::{self, StagedTensor};
use super::AppState;
use crate::backend::cuda::ipc;

/// SGLang's `UpdateWeightsFromTensorReqInput` over HTTP.
#[derive(Deserialize)]
pub struct UpdateFromTensor {
    serialized_named_tensors: Vec<String>,
    #[serde(default)]
    load_format: Option<String>,
    /// The prefix cache is flushed whenever weights change (its KV is the old weights'), so
    /// `false` changes nothing; accepted because verl and slime send it per bucket.
    #[serde(default = "yes")]
    #[allow(dead_code)]
    flush_cache: bool,
    #[serde(default)]
    abort_all_requests: bool,
    #[serde(default)]
    weight_version: Option<String>,
    #[serde(default)]
    selector: Option<String>,
}

fn yes() -> bool {
    true
}

/// SGLang answers `{success, message}` (400 with `success: false` on failure); the error
/// object is there too, as on every lockstep error.
pub async fn update_weights_from_tensor(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<UpdateFromTensor>,
) -> Response {
    match update(&state, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => {
            let status = e.status();
            let mut body = e.body();
            body["success"] = json!(false);
            body["message"] = json!(e.to_string());
            (status, Json(body)).into_response()
        }
    }
}

async fn update(state: &AppState, body: UpdateFromTensor) -> Result<serde_json::Value, ApiError> {
    weights::check_selector(body.selector.as_deref())?;
    if body.weight_version.as_deref() == Some("") {
        return Err(ApiError::invalid(
            "weight_version",
            "weight_version must not be empty",
        ));
    }
    let format = LoadFormat::parse(body.load_format.as_deref())?;
    let entry = tensor_ipc::own_entry(&body.serialized_named_tensors)?;
    let payload = tensor_ipc::decode(entry, format)?;
    if payload.tensors.is_empty() {
        return Ok(
            json!({"success": true, "message": "serialized_named_tensors holds no tensors: nothing changed", "updated_tensors": 0}),
        );
    }
    // Everything is checked before anything is copied; a refused payload still gives the
    // trainer its references back, so it can free the tensors.
    let checked = (|| {
        for t in &payload.tensors {
            weights::check_tensor(&state.engine.info, &t.name, t.dtype, &t.shape)?;
        }
        weights::check_weights_in_memory(state)
    })();
    if let Err(e) = checked {
        ipc::release_references(&payload.sources);
        return Err(e);
    }
    if body.abort_all_requests {
        if let Err(e) = state.engine.abort(None, true) {
            ipc::release_references(&payload.sources);
            return Err(e.into());
        }
    }
    let bytes: usize = payload.sources.iter().map(|s| s.len).sum();
    let started = Instant::now();
    // Opened, copied and closed on a stream of its own (the CPU backend refuses, naming
    // serialized_named_tensors).
    let host = state.engine.read_ipc(payload.sources).await?;
    let copy_s = started.elapsed().as_secs_f64();
    let host: Vec<bytes::Bytes> = host.into_iter().map(bytes::Bytes::from).collect();
    let count = payload.tensors.len();
    let tensors: Vec<(String, StagedTensor)> = payload
        .tensors
        .into_iter()
        .map(|t| {
            let data = host[t.source].slice(t.start..t.start + t.len);
            (
                t.name,
                StagedTensor {
                    dtype: t.dtype,
                    shape: t.shape,
                    data,
                },
            )
        })
        .collect();
    let stats = json!({"updated_tensors": count, "copied_bytes": bytes, "copy_s": copy_s, "copy_path": "device-to-host-to-device"});
    if let Some(id) = weights::open_session_id(state).await {
        let Json(mut staged) = weights::stage_bucket(state, Some(&id), tensors).await?;
        if let Some(v) = body.weight_version {
            weights::name_session_version(state, &id, v).await;
        }
        staged["message"] = json!(format!(
            "{count} tensors staged into weight update session {id}; they commit at /end_weight_update"
        ));
        merge(&mut staged, stats);
        return Ok(staged);
    }
    let staged: BTreeMap<String, StagedTensor> = tensors.into_iter().collect();
    let committed =
        weights::commit(state, staged, BTreeMap::new(), body.weight_version, None).await?;
    let version = committed.version;
    tracing::info!(
        "weights updated from CUDA IPC tensors: {count} tensors, {bytes} bytes copied in {copy_s:.3} s, version {version}"
    );
    let mut out = json!({"success": true, "message": format!("{count} tensors updated, version {version}"), "weight_version": version, "commit_pause_s": committed.pause.as_secs_f64()});
    merge(&mut out, stats);
    Ok(out)
}

fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
    if let (Some(a), serde_json::Value::Object(b)) = (into.as_object_mut(), from) {
        a.extend(b);
    }
}
