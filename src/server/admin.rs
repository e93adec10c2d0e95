//! Health, model and server info, weight version, and the control endpoints (flush cache,
//! abort, pause/continue, memory release and resume) in SGLang's `{"success", "message"}`
//! shape.

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
use crate::engine::{EngineEvent, GenerateRequest, MemoryReport, MemoryTag, PauseMode};
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
            EngineEvent::Error(e) => return Err(ApiError::Unavailable(e.to_string())),
            EngineEvent::Token(_) => {}
        }
    }
    Err(ApiError::Unavailable("engine stopped".into()))
}

/// `GET /model_info` (and the older `/get_model_info`): SGLang's fields, which gateways
/// (sglang-router, smg) read to classify a worker, plus lockstep's own (`architecture` is kept
/// for clients of earlier lockstep versions).
pub async fn model_info(State(state): State<AppState>) -> Json<serde_json::Value> {
    let info = &state.engine.info;
    let raw = &info.config.raw;
    let architectures = raw.get("architectures").cloned().unwrap_or(json!([]));
    Json(json!({
        "model_path": info.model_path,
        "tokenizer_path": tokenizer_path(&state),
        "is_generation": true,
        "served_model_name": info.served_model_name,
        "preferred_sampling_params": null,
        "weight_version": state.engine.weight_version(),
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": raw.get("model_type").cloned().unwrap_or(json!(null)),
        "architectures": architectures,
        "architecture": architectures,
        "quantization": info.quantization,
        "recipe": info.recipe_name,
        "recipe_hash": info.recipe_hash,
        "num_moe_layers": info.config.num_layers,
        "vocab_size": info.config.vocab_size,
    }))
}

/// Where the tokenizer files are: the model directory, or null for the embedded model, whose
/// byte vocabulary is built in code (gateways that load a worker's tokenizer would otherwise
/// look for a model called `embedded` on the Hugging Face Hub).
fn tokenizer_path(state: &AppState) -> serde_json::Value {
    let path = &state.engine.info.model_path;
    if std::path::Path::new(path).join("tokenizer.json").is_file() {
        json!(path)
    } else {
        json!(null)
    }
}

/// Requests queued for the engine: in its waiting queue, or submitted and not yet picked up.
fn num_waiting(s: &crate::engine::EngineShared) -> usize {
    s.waiting.load(Ordering::Acquire) + s.in_channel.load(Ordering::Acquire)
}

fn max_total_tokens(state: &AppState) -> usize {
    state.engine.shared.kv_total_blocks.load(Ordering::Acquire) * state.engine.info.block_size
}

/// `GET /server_info` (and `/get_server_info`): SGLang's server arguments that RL frameworks
/// read or assert against their own settings, with lockstep's real values: one engine on one
/// device, no parallelism, no disaggregation, memory release supported (`enable_memory_saver`;
/// what is released now in `memory_released` and `weights_state`), routed-expert capture as
/// `--enable-return-routed-experts` says.
pub async fn server_info(State(state): State<AppState>) -> Json<serde_json::Value> {
    let info = &state.engine.info;
    let s = &state.engine.shared;
    let running = s.running.load(Ordering::Acquire);
    let waiting = num_waiting(s);
    let paused = s.paused.load(Ordering::Acquire);
    let on_gpu = state.limits.on_gpu;
    let memory = state.engine.memory();
    let mut body = json!({
        "version": env!("CARGO_PKG_VERSION"),
        "engine": "lockstep",
        "model_path": info.model_path,
        "tokenizer_path": tokenizer_path(&state),
        "served_model_name": info.served_model_name,
        "context_length": info.max_context_len,
        "page_size": info.block_size,
        "quantization": info.quantization,
        "device": if on_gpu { "cuda" } else { "cpu" },
        // The GPUs this server computes on: one on CUDA, none on the CPU backend.
        "num_gpus": usize::from(on_gpu),
        "tp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
        "dp_size": 1,
        "moe_dp_size": 1,
        "nnodes": 1,
        "node_rank": 0,
        "enable_dp_attention": false,
        "disaggregation_mode": "null",
        "enable_memory_saver": true,
        "enable_return_routed_experts": state.limits.allow_routed_experts,
        "skip_tokenizer_init": false,
        "max_running_requests": state.max_running_requests,
        "max_total_num_tokens": max_total_tokens(&state),
        "max_n": state.limits.max_n,
        "max_top_logprobs": state.limits.max_top_logprobs,
        "weight_version": state.engine.weight_version(),
        "num_running_reqs": running,
        "num_queue_reqs": waiting,
        "kv_blocks_used": s.kv_used_blocks.load(Ordering::Acquire),
        "kv_blocks_total": s.kv_total_blocks.load(Ordering::Acquire),
        "paused": paused,
        "generated_tokens": s.generated_tokens.load(Ordering::Relaxed),
        "uptime_s": state.started.elapsed().as_secs_f64(),
        // SGLang answers one entry per data-parallel rank; lockstep has one.
        // (`world_size`: the ranks behind this engine, which Miles sums into its GPU count).
        "internal_states": [{"dp_rank": 0, "world_size": 1, "num_running_reqs": running, "num_waiting_reqs": waiting, "paused": paused}],
    });
    // What `/release_memory_occupation` released (tags in SGLang's names).
    body["enable_weights_cpu_backup"] = json!(memory.weights_backup);
    body["memory_released"] = json!(memory.released());
    body["weights_state"] = json!(memory.weights.name());
    // Since start: sequences preempted by recompute (the KV cache ran out).
    body["num_preemptions"] = json!(s.preemptions.load(Ordering::Acquire));
    Json(body)
}

/// `GET /version`.
pub async fn version() -> Json<serde_json::Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION"), "engine": "lockstep"}))
}

/// `GET /get_load`: SGLang's per-data-parallel-rank list (one rank here). `num_tokens` is the
/// context of the running requests plus the prompts of the waiting ones, what a router
/// balances on; `num_reqs` is 0 exactly when the server is idle.
pub async fn get_load(State(state): State<AppState>) -> Json<serde_json::Value> {
    let s = &state.engine.shared;
    let waiting = num_waiting(s);
    let tokens =
        s.running_tokens.load(Ordering::Acquire) + s.waiting_tokens.load(Ordering::Acquire);
    Json(json!([{
        "dp_rank": 0,
        "num_reqs": s.running.load(Ordering::Acquire) + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": tokens,
    }]))
}

/// Sections `/v1/loads?include=` accepts (SGLang's names). Lockstep reports `core`; the others
/// (memory breakdown, speculative decoding, LoRA, disaggregation, queue details) describe
/// features it does not have, and are left out as SGLang leaves out absent sections.
const LOAD_SECTIONS: &[&str] = &["core", "memory", "spec", "lora", "disagg", "queues", "all"];

/// `GET /v1/loads?include=core,...&dp_rank=N&format=json|prometheus`: SGLang's load report.
pub async fn v1_loads(
    State(state): State<AppState>,
    query: Result<
        axum::extract::Query<std::collections::HashMap<String, String>>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Response, ApiError> {
    let q = query
        .map_err(|e| ApiError::Invalid {
            param: None,
            message: format!("invalid query string: {}", e.body_text()),
        })?
        .0;
    if let Some(include) = q.get("include") {
        for section in include.split(',').map(str::trim) {
            if !LOAD_SECTIONS.contains(&section) {
                return Err(ApiError::invalid(
                    "include",
                    format!(
                        "include section `{section}` is not one of {}",
                        LOAD_SECTIONS.join(", ")
                    ),
                ));
            }
        }
    }
    let dp_rank = q
        .get("dp_rank")
        .map(|r| {
            r.parse::<i64>().map_err(|_| {
                ApiError::invalid("dp_rank", format!("dp_rank `{r}` is not an integer"))
            })
        })
        .transpose()?;
    let prometheus = match q.get("format").map(String::as_str) {
        None | Some("json") => false,
        Some("prometheus") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "format",
                format!("format `{other}` is not `json` or `prometheus`"),
            ))
        }
    };
    let s = &state.engine.shared;
    let running_tokens = s.running_tokens.load(Ordering::Acquire);
    let waiting_tokens = s.waiting_tokens.load(Ordering::Acquire);
    let used_blocks = s.kv_used_blocks.load(Ordering::Acquire);
    let total_blocks = s.kv_total_blocks.load(Ordering::Acquire);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let core = json!({
        "timestamp": now.as_secs_f64(),
        "dp_rank": 0,
        "num_running_reqs": s.running.load(Ordering::Acquire),
        "num_waiting_reqs": num_waiting(s),
        // Lockstep learns a prompt's cached prefix only when it admits it: an upper bound.
        "num_waiting_uncached_tokens": waiting_tokens,
        "num_used_tokens": running_tokens,
        "num_total_tokens": running_tokens + waiting_tokens,
        "num_active_tokens": running_tokens + waiting_tokens,
        "max_total_num_tokens": max_total_tokens(&state),
        "max_running_requests": state.max_running_requests,
        "token_usage": if total_blocks == 0 { 0.0 } else { used_blocks as f64 / total_blocks as f64 },
    });
    // One data-parallel rank: any other rank asked for has no report, as in SGLang.
    let loads = if dp_rank.is_none_or(|r| r == 0) {
        vec![core]
    } else {
        vec![]
    };
    if prometheus {
        let mut text = String::new();
        if let Some(load) = loads.first().and_then(|l| l.as_object()) {
            for (key, value) in load {
                if key == "dp_rank" {
                    continue;
                }
                if let Some(v) = value.as_f64() {
                    text.push_str(&format!(
                        "# TYPE sglang_{key} gauge\nsglang_{key}{{dp_rank=\"0\"}} {v}\n"
                    ));
                }
            }
        }
        return Ok((
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response());
    }
    Ok(Json(json!({
        "timestamp": rfc3339_utc(now),
        "version": env!("CARGO_PKG_VERSION"),
        "accelerator": if state.limits.on_gpu { json!("cuda") } else { json!(null) },
        "num_accelerators": usize::from(state.limits.on_gpu),
        "loads": loads,
    }))
    .into_response())
}

/// `2026-01-02T03:04:05.678Z` for a time since the Unix epoch (civil-from-days, proleptic
/// Gregorian), so no date crate is needed for one field.
fn rfc3339_utc(since_epoch: std::time::Duration) -> String {
    let secs = since_epoch.as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since_epoch.subsec_millis()
    )
}

/// An SGLang endpoint lockstep does not implement: a 501 that says so and why, never a 404.
pub fn not_supported(
    reason: &'static str,
) -> impl Fn(axum::http::Uri) -> std::future::Ready<ApiError> + Clone + Send + Sync + 'static {
    move |uri: axum::http::Uri| {
        std::future::ready(ApiError::NotImplemented(format!(
            "{} is not supported by lockstep: {reason}",
            uri.path()
        )))
    }
}

pub async fn weight_version(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(json!({"weight_version": state.engine.weight_version()}))
}

/// Control endpoints accept an empty body for their defaults (as SGLang's do).
pub(super) fn optional_json<T: Default + serde::de::DeserializeOwned>(
    body: &[u8],
) -> Result<T, ApiError> {
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

/// `/release_memory_occupation` and `/resume_memory_occupation`'s body (SGLang's
/// `ReleaseMemoryOccupationReqInput`); no body, `tags` null or `[]`: every tag.
#[derive(Deserialize, Default)]
pub struct MemoryBody {
    #[serde(default)]
    tags: Option<Vec<String>>,
}

/// The tags asked for; None: every tag (no body, `tags` null or `[]`, as SGLang reads them).
fn memory_tags(body: &[u8]) -> Result<Option<Vec<MemoryTag>>, ApiError> {
    let tags = optional_json::<MemoryBody>(body)?.tags.unwrap_or_default();
    if tags.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(tags.len());
    for t in &tags {
        let tag = MemoryTag::parse(t).ok_or_else(|| {
            let known: Vec<&str> = MemoryTag::ALL.iter().map(|t| t.name()).collect();
            ApiError::invalid(
                "tags",
                format!("tags: `{t}` is not one of {}", known.join(", ")),
            )
        })?;
        if !out.contains(&tag) {
            out.push(tag);
        }
    }
    Ok(Some(out))
}

fn memory_answer(verb: &str, r: MemoryReport) -> Json<serde_json::Value> {
    let tags: Vec<&str> = r.tags.iter().map(|t| t.name()).collect();
    Json(json!({
        "success": true,
        "message": format!("{verb} {} ({:.3} GiB)", tags.join(", "), r.bytes as f64 / (1u64 << 30) as f64),
        "tags": tags,
        "bytes": r.bytes,
        "memory_released": r.state.released(),
        "weights_state": r.state.weights.name(),
    }))
}

/// `GET|POST /release_memory_occupation {tags?}` (SGLang's, for a trainer colocated on the
/// GPU): frees the KV cache (the prefix cache's contents go with it) and/or the weights (a
/// host backup kept with `--enable-weights-cpu-backup`; the CPU backend keeps its host
/// weights); no tags: everything not released yet. Needs an idle engine: 409 naming the
/// requests in flight, as SGLang refuses a busy one. Releasing a tag twice: 409. Until
/// resumed, generation answers 503.
pub async fn release_memory_occupation(
    State(state): State<AppState>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let tags = memory_tags(&body)?;
    // A session idle past its timeout would otherwise hold its shadow copy's memory.
    super::weights::drop_idle_session(&state.updates).await;
    let report = state.engine.release_memory(tags).await?;
    Ok(memory_answer("released", report))
}

/// `GET|POST /resume_memory_occupation {tags?}`: allocates what was released again, the KV
/// cache empty, the weights from their backup (the same bits) or absent (generation refused
/// until an update writes every tensor); no tags: everything released. Resuming what is not
/// released: 409; memory still taken by someone else: 503, and that tag stays released.
pub async fn resume_memory_occupation(
    State(state): State<AppState>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let tags = memory_tags(&body)?;
    let report = state.engine.resume_memory(tags).await?;
    Ok(memory_answer("resumed", report))
}

pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("{method} is not allowed on {}", uri.path()))
}

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound(format!("no endpoint at {}", uri.path()))
}

#[cfg(test)]
mod tests {
    use super::rfc3339_utc;
    use std::time::Duration;

    #[test]
    fn rfc3339_matches_known_instants() {
        assert_eq!(rfc3339_utc(Duration::ZERO), "1970-01-01T00:00:00.000Z");
        // 2000-02-29 (a leap day of a century leap year) 12:34:56.789.
        assert_eq!(
            rfc3339_utc(Duration::from_millis(951_827_696_789)),
            "2000-02-29T12:34:56.789Z"
        );
        assert_eq!(
            rfc3339_utc(Duration::from_secs(4_102_444_799)),
            "2099-12-31T23:59:59.000Z"
        );
    }
}
