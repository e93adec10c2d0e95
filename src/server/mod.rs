//! The HTTP server (axum): SGLang's native API, the OpenAI API, control endpoints and
//! Prometheus metrics, over an [`EngineHandle`]. Handlers parse requests into validated
//! engine requests (validate.rs), follow engine events (generation.rs) and render wire
//! formats (native.rs, openai.rs); errors map to HTTP in errors.rs only.

mod admin;
mod auth;
pub mod errors;
mod extract;
mod generation;
pub mod metrics;
mod native;
mod openai;
pub mod pickle;
mod read_back;
mod spill;
pub mod tensor_ipc;
mod tensor_update;
pub mod validate;
pub mod weights;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;

use crate::engine::EngineHandle;
pub use validate::Limits;

/// Keys that guard the API. When only one is set it guards everything (API.md).
#[derive(Clone, Debug, Default)]
pub struct Auth {
    pub api_key: Option<String>,
    pub admin_api_key: Option<String>,
}

impl Auth {
    fn generation_key(&self) -> Option<&str> {
        self.api_key.as_deref().or(self.admin_api_key.as_deref())
    }
    fn admin_key(&self) -> Option<&str> {
        self.admin_api_key.as_deref().or(self.api_key.as_deref())
    }
}

/// Everything a handler may touch. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub limits: Arc<Limits>,
    pub auth: Arc<Auth>,
    pub served_model_name: Arc<str>,
    pub shutting_down: Arc<AtomicBool>,
    pub started: Instant,
    pub max_request_bytes: usize,
    /// `--max-running-requests` (reported by `/get_server_info` and `/v1/loads`).
    pub max_running_requests: usize,
    pub weights: Arc<weights::WeightSettings>,
    pub updates: Arc<weights::WeightUpdates>,
}

impl AppState {
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }
}

/// The whole API as a router, so tests can drive it with `oneshot` and no socket.
pub fn app(state: AppState) -> Router {
    let generation = Router::new()
        // SGLang takes PUT as well.
        .route("/generate", post(native::generate).put(native::generate))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ));
    let control = Router::new()
        .route(
            "/flush_cache",
            post(admin::flush_cache).get(admin::flush_cache),
        )
        .route("/abort_request", post(admin::abort_request))
        .route("/pause_generation", post(admin::pause_generation))
        .route("/continue_generation", post(admin::continue_generation))
        // SGLang takes GET as well (with the same body, or none).
        .route(
            "/release_memory_occupation",
            post(admin::release_memory_occupation).get(admin::release_memory_occupation),
        )
        .route(
            "/resume_memory_occupation",
            post(admin::resume_memory_occupation).get(admin::resume_memory_occupation),
        )
        .route(
            "/update_weights_from_disk",
            post(weights::update_weights_from_disk),
        )
        .route(
            "/update_weights_from_tensor",
            post(tensor_update::update_weights_from_tensor),
        )
        .route("/begin_weight_update", post(weights::begin_weight_update))
        // Buckets are bounded by the staging limit, not by the generation body limit.
        .route(
            "/update_weights",
            axum::routing::put(weights::put_update_weights)
                .layer(DefaultBodyLimit::max(state.updates.max_staged_bytes)),
        )
        .route("/end_weight_update", post(weights::end_weight_update))
        .route("/abort_weight_update", post(weights::abort_weight_update))
        .route(
            "/update_weight_version",
            post(weights::update_weight_version),
        )
        .route(
            "/weights_checker",
            post(weights::weights_checker).get(weights::weights_checker),
        );
    let control = unsupported_routes(control).route_layer(axum::middleware::from_fn_with_state(
        state.clone(),
        auth::require_admin_key,
    ));
    let open = Router::new()
        .route("/health", get(admin::health))
        .route("/health_generate", get(admin::health_generate))
        .route("/get_model_info", get(admin::model_info))
        .route("/model_info", get(admin::model_info))
        .route("/get_server_info", get(admin::server_info))
        .route("/server_info", get(admin::server_info))
        .route("/version", get(admin::version))
        .route("/get_load", get(admin::get_load))
        .route("/v1/loads", get(admin::v1_loads))
        .route("/get_weight_version", get(admin::weight_version))
        .route("/weights_checksum", get(weights::weights_checksum))
        .route("/metrics", get(metrics::render));
    Router::new()
        .merge(generation)
        .merge(control)
        .merge(open)
        .fallback(admin::not_found)
        .method_not_allowed_fallback(admin::method_not_allowed)
        .layer(axum::middleware::from_fn(metrics::track_http))
        .layer(DefaultBodyLimit::max(state.max_request_bytes))
        .with_state(state)
}

/// SGLang endpoints that RL frameworks call and lockstep does not implement yet, with why: each
/// answers 501 in our error shape (admin-guarded like the rest of the control surface), so a
/// client learns what is missing instead of seeing a 404. docs/api.md lists them all.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("/init_weights_update_group", "NCCL weight-update groups are not supported; stream safetensors buckets with PUT /update_weights"),
    ("/update_weights_from_distributed", "NCCL weight broadcast is not supported; stream safetensors buckets with PUT /update_weights"),
    ("/destroy_weights_update_group", "NCCL weight-update groups are not supported (see /init_weights_update_group)"),
    ("/update_weights_from_ipc", "checkpoint-engine IPC updates are not supported; use PUT /update_weights"),
    ("/get_weights_by_name", "reading parameters back is not supported; compare checksums with GET /weights_checksum or /weights_checker"),
    ("/init_weights_send_group_for_remote_instance", "serving weights to another instance is not supported"),
    ("/send_weights_to_remote_instance", "serving weights to another instance is not supported"),
    ("/load_lora_adapter", "LoRA adapters are not supported"),
    ("/unload_lora_adapter", "LoRA adapters are not supported"),
];

fn unsupported_routes(mut router: Router<AppState>) -> Router<AppState> {
    for &(path, reason) in UNSUPPORTED {
        let h = admin::not_supported(reason);
        router = router.route(path, post(h.clone()).get(h));
    }
    router
}

/// Serves until SIGINT/SIGTERM, then stops accepting, lets in-flight requests finish for up
/// to `grace`, aborts the rest and returns.
pub async fn serve(
    state: AppState,
    listener: tokio::net::TcpListener,
    grace: std::time::Duration,
) -> std::io::Result<()> {
    let engine = state.engine.clone();
    let flag = state.shutting_down.clone();
    tokio::spawn(weights::reap_idle_sessions(state.updates.clone()));
    let router = app(state);
    let signal = async move {
        shutdown_signal().await;
        tracing::info!("shutdown requested: no new requests; finishing in-flight ones");
        flag.store(true, Ordering::Release);
        let engine = engine.clone();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            tracing::warn!("grace period over: aborting what is still running");
            engine.shutdown();
        });
    };
    axum::serve(listener, router)
        .with_graceful_shutdown(signal)
        .await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
