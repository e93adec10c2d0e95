//! Prometheus metrics through the `metrics` crate: one process-wide recorder, the HTTP
//! middleware counting requests by endpoint and status, and the `/metrics` handler.

use std::sync::OnceLock;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use super::AppState;
use crate::engine::{DECODE_STEP_SECONDS, STEP_SECONDS, STEP_TOKENS};

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// An engine step's phases: from microseconds (scheduling) to a long prefill chunk.
const STEP_BUCKETS: &[f64] = &[
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5,
];
/// Token rows per step: one decode row up to a whole chunked-prefill budget.
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    16384.0, 32768.0,
];

/// Installs the recorder on first use; later calls (e.g. several test servers in one process)
/// share it.
pub fn handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        // A full-name matcher is applied before a suffix one.
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(STEP_SECONDS.into()), STEP_BUCKETS)
            .expect("valid buckets")
            .set_buckets_for_metric(Matcher::Full(DECODE_STEP_SECONDS.into()), STEP_BUCKETS)
            .expect("valid buckets")
            .set_buckets_for_metric(Matcher::Full(STEP_TOKENS.into()), TOKEN_BUCKETS)
            .expect("valid buckets")
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
            .expect("valid buckets")
            .build_recorder();
        let handle = recorder.handle();
        // Another recorder may already be installed by an embedding program; we still render ours.
        let _ = metrics::set_global_recorder(recorder);
        handle
    })
}

/// Endpoints counted by name; anything else is "other" so scanners cannot blow up the label set.
const ENDPOINTS: &[&str] = &[
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/health_generate",
    "/get_model_info",
    "/get_server_info",
    "/get_weight_version",
    "/flush_cache",
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/metrics",
    "/update_weights_from_disk",
    "/begin_weight_update",
    "/update_weights",
    "/end_weight_update",
    "/abort_weight_update",
    "/weights_checksum",
];

pub async fn track_http(req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let endpoint = ENDPOINTS
        .iter()
        .find(|e| **e == path)
        .copied()
        .unwrap_or("other");
    let resp = next.run(req).await;
    metrics::counter!("lockstep_http_requests_total", "endpoint" => endpoint, "status" => resp.status().as_u16().to_string()).increment(1);
    resp
}

pub async fn render(State(state): State<AppState>) -> Response {
    let shared = &state.engine.shared;
    use std::sync::atomic::Ordering::Acquire;
    metrics::gauge!("lockstep_num_running_reqs").set(shared.running.load(Acquire) as f64);
    metrics::gauge!("lockstep_num_queue_reqs").set(shared.waiting.load(Acquire) as f64);
    metrics::gauge!("lockstep_kv_blocks_used").set(shared.kv_used_blocks.load(Acquire) as f64);
    metrics::gauge!("lockstep_kv_blocks_total").set(shared.kv_total_blocks.load(Acquire) as f64);
    metrics::counter!("lockstep_preemptions_total").absolute(shared.preemptions.load(Acquire));
    let version = state.engine.weight_version();
    metrics::gauge!("lockstep_weight_version_info", "version" => version).set(1.0);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        handle().render(),
    )
        .into_response()
}
