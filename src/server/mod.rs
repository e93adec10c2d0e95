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
        .route("/generate", post(native::generate))
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
        .route(
            "/update_weights_from_disk",
            post(weights::update_weights_from_disk),
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
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_admin_key,
        ));
    let open = Router::new()
        .route("/health", get(admin::health))
        .route("/health_generate", get(admin::health_generate))
        .route("/get_model_info", get(admin::model_info))
        .route("/get_server_info", get(admin::server_info))
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

/// Serves until SIGINT/SIGTERM, then stops accepting, lets in-flight requests finish for up
/// to `grace`, aborts the rest and returns.
pub async fn serve(
    state: AppState,
    listener: tokio::net::TcpListener,
    grace: std::time::Duration,
) -> std::io::Result<()> {
    let engine = state.engine.clone();
    let flag = state.shutting_down.clone();
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
