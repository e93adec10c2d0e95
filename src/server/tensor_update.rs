//! `POST /update_weights_from_tensor` (SGLang's colocated update): the trainer, on the same
//! GPU, sends CUDA IPC handles of its tensors (tensor_ipc.rs reads SGLang's pickles). The
//! handles are opened off the engine thread; BF16 tensors bound for BF16 slots are hashed where
//! they lie and copied device to device into the weights, and BF16 weights of MXFP8/NVFP4
//! layers are quantized on the device ([`crate::model::cuda::quantize`]); the rest are copied
//! to the host and take the streamed session's path (checked against the layout, quantized by
//! `quant::slot`). Every handle is closed before this answers. With a session open
//! (`/begin_weight_update`) they are staged into it (into its shadow, when it has one) and
//! commit at `/end_weight_update`; otherwise the call is one update of its own, written in place
//! during one pause of generation, all or nothing.

use std::collections::BTreeMap;
use std::sync::Arc;
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
use crate::backend::cuda::{hash, ipc, CudaError, Gpu};
use crate::model::cuda::quantize::{quantize_slots, Dense};
use crate::model::slots::{DeviceTensor, Replacement};
use crate::quant::slot::Slot;
use cudarc::driver::DevicePtrMut;

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
    let bytes: usize = payload.tensors.iter().map(|t| t.len).sum();
    let started = Instant::now();
    // Opened on a stream of its own, the producer's events waited for (the CPU backend
    // refuses, naming serialized_named_tensors).
    let (gpu, mapping) = state.engine.open_ipc(payload.sources).await?;
    let open_s = started.elapsed().as_secs_f64();
    let mapping = Arc::new(mapping);
    let result = write(
        state,
        body.weight_version,
        payload.tensors,
        gpu,
        mapping.clone(),
    )
    .await;
    let write_s = started.elapsed().as_secs_f64() - open_s;
    // Every copy out of the trainer's memory has finished: it may free its tensors now.
    tokio::task::spawn_blocking(move || mapping.close())
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let (mut out, device_bytes, hash_s) = result?;
    let count = out["updated_tensors"].as_u64().unwrap_or(0);
    let host_bytes = bytes - device_bytes;
    let path = match (device_bytes, host_bytes) {
        (_, 0) => "device-to-device",
        (0, _) => "device-to-host-to-device",
        _ => "device-to-device (BF16 slots, quantized slots from BF16), device-to-host-to-device (the rest)",
    };
    let total_s = started.elapsed().as_secs_f64();
    tracing::info!(
        "weights from CUDA IPC tensors: {count} tensors, {bytes} bytes ({device_bytes} device to device) in {total_s:.3} s"
    );
    merge(
        &mut out,
        json!({"copied_bytes": bytes, "device_to_device_bytes": device_bytes, "copy_path": path,
               "open_s": open_s, "hash_s": hash_s, "write_s": write_s,
               "close_s": total_s - open_s - write_s, "copy_s": total_s}),
    );
    Ok(out)
}

/// The tensors of one payload written toward the weights: BF16 tensors bound for BF16 slots
/// device to device (hashed where they lie, then copied into the open session's shadow or, with
/// no session, into the served weights during the commit's pause); dense BF16 weights of
/// MXFP8/NVFP4 layers quantized on the device, likewise; the rest through host memory and
/// `quant::slot`, as a streamed bucket. An open session that writes in place keeps
/// what it stages until `/end_weight_update`, after the trainer may have changed its tensors,
/// so it gets host copies only. Returns the answer, the bytes copied device to device and the
/// seconds spent hashing them.
async fn write(
    state: &AppState,
    weight_version: Option<String>,
    tensors: Vec<tensor_ipc::SharedTensor>,
    gpu: crate::backend::cuda::Gpu,
    mapping: Arc<ipc::IpcMapping>,
) -> Result<(serde_json::Value, usize, f64), ApiError> {
    let session = weights::open_session_id(state).await;
    let direct = match &session {
        None => true,
        Some(id) => weights::session_writes_shadow(state, id).await?,
    };
    let info = state.engine.info.clone();
    let count = tensors.len();
    let (device, host): (Vec<_>, Vec<_>) = tensors
        .into_iter()
        .partition(|t| direct && weights::lands_device_to_device(&info, &t.name, t.dtype));
    // Dense BF16 weights of MXFP8/NVFP4 layers are quantized where they lie.
    let (to_quantize, host) = if direct {
        let by_name = host.into_iter().map(|t| (t.name.clone(), t)).collect();
        let (q, rest) = weights::quantized_on_device(&info, by_name, |t| t.dtype);
        (q, rest.into_values().collect())
    } else {
        (BTreeMap::new(), host)
    };
    let owner = mapping.clone();
    let (host, device, device_bytes, hash_s) = tokio::task::spawn_blocking(move || {
        let bad = |e: ipc::IpcError| ApiError::invalid(&e.name, e.message);
        let (quantized, host) = quantize_shared(&gpu, &mapping, to_quantize, host)?;
        let device_bytes: usize = device.iter().map(|t| t.len).sum::<usize>()
            + quantized.iter().map(|(_, _, len)| len).sum::<usize>();
        let ranges: Vec<_> = host.iter().map(|t| (t.source, t.start, t.len)).collect();
        let bufs = mapping.to_host(&gpu, &ranges).map_err(bad)?;
        let host: Vec<(String, StagedTensor)> = host
            .into_iter()
            .zip(bufs)
            .map(|(t, data)| {
                let data = bytes::Bytes::from(data);
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
        let ranges = device
            .iter()
            .map(|t| Ok((mapping.range(t.source, t.start, t.len)?, t.len)))
            .collect::<Result<Vec<_>, ipc::IpcError>>()
            .map_err(bad)?;
        // Hashed where they lie, before anything is written (31 GB in about 30 ms on an H200).
        let started = Instant::now();
        let hashes = hash::xxh3_of_device(&gpu, &ranges)
            .map_err(|e| ApiError::Internal(format!("hashing the shared tensors: {e}")))?;
        let hash_s = started.elapsed().as_secs_f64();
        let mut device: Vec<(String, (String, Replacement))> = device
            .into_iter()
            .zip(ranges.into_iter().zip(hashes))
            .map(|(t, ((ptr, bytes), hash))| {
                let owner: Arc<dyn std::any::Any + Send + Sync> = owner.clone();
                let r = Replacement::Device(DeviceTensor {
                    ptr,
                    bytes,
                    hash,
                    owner,
                });
                (t.name.clone(), (t.name, r))
            })
            .collect();
        device.extend(
            quantized
                .into_iter()
                .map(|(name, r, _)| (name.clone(), (name, r))),
        );
        Ok::<_, ApiError>((host, device, device_bytes, hash_s))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))??;
    if let Some(id) = session {
        let Json(mut staged) = weights::stage_bucket(state, Some(&id), host, device).await?;
        if let Some(v) = weight_version {
            weights::name_session_version(state, &id, v).await;
        }
        staged["message"] = json!(format!(
            "{count} tensors staged into weight update session {id}; they commit at /end_weight_update"
        ));
        staged["updated_tensors"] = json!(count);
        return Ok((staged, device_bytes, hash_s));
    }
    let staged: BTreeMap<String, StagedTensor> = host.into_iter().collect();
    let committed = weights::commit(
        state,
        staged,
        device.into_iter().collect(),
        None,
        weight_version,
        None,
    )
    .await?;
    let version = committed.version;
    let out = json!({"success": true, "message": format!("{count} tensors updated, version {version}"),
        "updated_tensors": count, "weight_version": version, "commit_pause_s": committed.pause.as_secs_f64()});
    Ok((out, device_bytes, hash_s))
}

/// The shared dense weights of quantized layers, each copied out of the trainer's memory into
/// a buffer of its own and quantized there ([`quantize_slots`]): their replacements by slot
/// name, with the bytes each read. When the device has no room for that, they join `host`.
fn quantize_shared(
    gpu: &Gpu,
    mapping: &ipc::IpcMapping,
    to_quantize: BTreeMap<String, (Slot, tensor_ipc::SharedTensor)>,
    mut host: Vec<tensor_ipc::SharedTensor>,
) -> Result<QuantizedShared, ApiError> {
    if to_quantize.is_empty() {
        return Ok((Vec::new(), host));
    }
    for (slot, t) in to_quantize.values() {
        slot.check("weight", t.dtype, &t.shape)
            .map_err(|e| ApiError::invalid(&e.name, e.to_string()))?;
    }
    let copy = |(slot, t): &(Slot, tensor_ipc::SharedTensor)| {
        let src = mapping
            .range(t.source, t.start, t.len)
            .map_err(|e| ApiError::invalid(&e.name, e.message))?;
        let mut values = gpu.alloc::<u16>(t.len / 2).map_err(Copy::Device)?;
        {
            let (dst, _sync) = values.device_ptr_mut(&gpu.stream);
            // SAFETY: both ranges hold `t.len` bytes (the shared range was checked by
            // `range`, the buffer was sized from it); the mapping outlives the copy, which the
            // quantizers' stream orders before them.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, src, t.len, gpu.stream.cu_stream())
            }
            .map_err(|e| Copy::Device(e.into()))?;
        }
        Ok(Dense {
            slot: slot.clone(),
            values,
        })
    };
    let dense: Result<Vec<Dense>, Copy> = to_quantize.values().map(copy).collect();
    let quantized = match dense {
        Ok(d) => quantize_slots(gpu, d).map_err(Copy::Device),
        Err(e) => Err(e),
    };
    match quantized {
        Ok(q) => Ok((
            q.into_iter()
                .map(|(name, r)| {
                    let len = to_quantize[&name].1.len;
                    (name, r, len)
                })
                .collect(),
            host,
        )),
        Err(Copy::Refused(e)) => Err(e),
        Err(Copy::Device(e)) => {
            tracing::warn!(
                "dense weights of quantized layers go through host memory: quantizing them on the device failed ({e})"
            );
            host.extend(to_quantize.into_values().map(|(_, t)| t));
            Ok((Vec::new(), host))
        }
    }
}

/// Device replacements by slot name with the bytes each read, and what goes through the host.
type QuantizedShared = (
    Vec<(String, Replacement, usize)>,
    Vec<tensor_ipc::SharedTensor>,
);

/// Why a shared tensor was not quantized on the device.
enum Copy {
    Refused(ApiError),
    Device(CudaError),
}

impl From<ApiError> for Copy {
    fn from(e: ApiError) -> Copy {
        Copy::Refused(e)
    }
}

fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
    if let (Some(a), serde_json::Value::Object(b)) = (into.as_object_mut(), from) {
        a.extend(b);
    }
}
