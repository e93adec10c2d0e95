//! Live weight updates. `/update_weights_from_disk` (SGLang's name and shape) loads a
//! checkpoint from under `--weights-root` off the engine thread, checks it has the served
//! model's shapes, and swaps it in between two engine steps: all or nothing, the version moves
//! only on success. The streamed session of API.md is not implemented yet.

use std::path::{Path, PathBuf};

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::errors::ApiError;
use super::extract::ApiJson;
use super::AppState;
use crate::model::loader::{self, Quantization};
use crate::quant::Recipe;

/// How the served model was loaded, so an update is loaded the same way.
#[derive(Clone, Debug, Default)]
pub struct WeightSettings {
    pub quantization: Option<Quantization>,
    pub recipe: Option<Recipe>,
    /// Updates may only read checkpoints below this directory; none: updates from disk are off.
    pub weights_root: Option<PathBuf>,
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
    // Flushing is not optional here: cached blocks hold KV computed with the old weights.
    if !body.flush_cache {
        return Err(ApiError::invalid("flush_cache", "flush_cache=false is not supported: the prefix cache always holds KV of the old weights"));
    }
    let load_path = path.clone();
    let model = tokio::task::spawn_blocking(move || {
        loader::load_model(&load_path, settings.quantization, settings.recipe.clone())
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
    .map_err(|e| ApiError::invalid("model_path", format!("{}: {e}", path.display())))?
    .0;
    let version = body
        .weight_version
        .unwrap_or_else(|| next_version(&state.engine.weight_version()));
    let aborted = state
        .engine
        .swap_model(model, version.clone(), body.abort_all_requests)
        .await
        .map_err(|e| match e {
            crate::engine::EngineError::Conflict(m) => ApiError::invalid("model_path", m),
            other => other.into(),
        })?;
    tracing::info!(
        "weights updated from {} to version {version}",
        body.model_path
    );
    Ok(Json(
        json!({"success": true, "message": format!("weights updated to version {version}"), "num_paused_requests": aborted}),
    ))
}

/// "default" -> "1", "7" -> "8", anything else -> "<it>.1".
fn next_version(v: &str) -> String {
    match v.parse::<u64>() {
        Ok(n) => (n + 1).to_string(),
        Err(_) if v == "default" => "1".into(),
        Err(_) => format!("{v}.1"),
    }
}
