//! Health, model and server info, weight version, and the control endpoints (flush cache,
//! abort, pause/continue) in SGLang's `{"success", "message"}` shape.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::errors::ApiError;
use super::extract::ApiBytes;
use super::AppState;
use crate::engine::{EngineEvent, GenerateRequest, PauseMode};
use crate::sampling::SamplingParams;

/// 200 once the engine has run its warm-up step; 503 before that and once shutdown starts.
pub async fn health(State(state): State<AppState>) -> Response {
    let s = &state.engine.shared;
    if state.is_shutting_down() {
        return ApiError::Unavailable("shutting down".into()).into_response();
    }
    if !s.healthy.load(Ordering::Acquire) {
        return ApiError::Unavailable(format!("engine unhealthy: {}", state.engine.last_error()))
            .into_response();
    }
    if !s.warm.load(Ordering::Acquire) {
        return ApiError::Unavailable("warming up".into()).into_response();
    }
    StatusCode::OK.into_response()
}

/// Generates one token end to end.
pub async fn health_generate(State(state): State<AppState>) -> Result<Response, ApiError> {
    let params = SamplingParams {
        max_new_tokens: Some(1),
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let valid = params
        .validate(&Default::default())
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let req = GenerateRequest {
        rid: format!("health-{}", super::validate::new_rid()),
        input_ids: vec![0],
        params: valid,
        seed: 0,
        sample_index: 0,
        return_logprob: false,
        logprob_start_len: None,
        top_logprobs_num: 0,
        return_routed_experts: false,
    };
    let mut rx = state.engine.submit(req)?;
    while let Some(ev) = rx.recv().await {
        match ev {
            EngineEvent::Finished(_) => return Ok(StatusCode::OK.into_response()),
            EngineEvent::Error(e) => return Err(ApiError::Unavailable(e)),
            EngineEvent::Token(_) => {}
        }
    }
    Err(ApiError::Unavailable("engine stopped".into()))
}

pub async fn model_info(State(state): State<AppState>) -> Json<serde_json::Value> {
    let info = &state.engine.info;
    Json(json!({
        "model_path": info.model_path,
        "tokenizer_path": info.model_path,
        "is_generation": true,
        "served_model_name": info.served_model_name,
        "architecture": info.config.raw.get("architectures").cloned().unwrap_or(json!([])),
        "quantization": info.quantization,
        "recipe": info.recipe_name,
        "recipe_hash": info.recipe_hash,
        "weight_version": state.engine.weight_version(),
        "num_moe_layers": info.config.num_layers,
        "vocab_size": info.config.vocab_size,
    }))
}

pub async fn server_info(State(state): State<AppState>) -> Json<serde_json::Value> {
    let info = &state.engine.info;
    let s = &state.engine.shared;
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "model_path": info.model_path,
        "served_model_name": info.served_model_name,
        "context_length": info.max_context_len,
        "page_size": info.block_size,
        "quantization": info.quantization,
        "max_n": state.limits.max_n,
        "max_top_logprobs": state.limits.max_top_logprobs,
        "weight_version": state.engine.weight_version(),
        "num_running_reqs": s.running.load(Ordering::Acquire),
        "num_queue_reqs": s.waiting.load(Ordering::Acquire),
        "kv_blocks_used": s.kv_used_blocks.load(Ordering::Acquire),
        "kv_blocks_total": s.kv_total_blocks.load(Ordering::Acquire),
        "paused": s.paused.load(Ordering::Acquire),
        "generated_tokens": s.generated_tokens.load(Ordering::Relaxed),
        "uptime_s": state.started.elapsed().as_secs_f64(),
    }))
}

pub async fn weight_version(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(json!({"weight_version": state.engine.weight_version()}))
}

/// Control endpoints accept an empty body for their defaults (as SGLang's do).
fn optional_json<T: Default + serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let param = (path != ".").then_some(path.clone());
        ApiError::Invalid {
            message: format!("invalid request body: {path}: {}", e.inner()),
            param,
        }
    })
}

fn success(message: impl Into<String>) -> Json<serde_json::Value> {
    Json(json!({"success": true, "message": message.into()}))
}

/// 409 while requests run: flushing under them would not free their blocks anyway.
pub async fn flush_cache(
    State(state): State<AppState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    state.engine.flush_cache().await?;
    Ok(success("cache flushed"))
}

#[derive(Deserialize, Default)]
pub struct AbortBody {
    #[serde(default)]
    rid: Option<String>,
    #[serde(default)]
    abort_all: bool,
}

pub async fn abort_request(
    State(state): State<AppState>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let body: AbortBody = optional_json(&body)?;
    if body.rid.is_none() && !body.abort_all {
        return Err(ApiError::invalid("rid", "give `rid` or `abort_all: true`"));
    }
    state.engine.abort(body.rid, body.abort_all)?;
    Ok(success("abort requested"))
}

#[derive(Deserialize, Default)]
pub struct PauseBody {
    #[serde(default)]
    mode: PauseMode,
}

pub async fn pause_generation(
    State(state): State<AppState>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let mode = optional_json::<PauseBody>(&body)?.mode;
    let n = state.engine.pause(mode).await?;
    Ok(Json(
        json!({"success": true, "message": format!("paused ({mode:?})"), "num_paused_requests": n}),
    ))
}

pub async fn continue_generation(
    State(state): State<AppState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    state.engine.continue_generation().await?;
    Ok(success("generation continued"))
}

pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("{method} is not allowed on {}", uri.path()))
}

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound(format!("no endpoint at {}", uri.path()))
}
