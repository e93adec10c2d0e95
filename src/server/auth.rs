//! API keys: `--api-key` guards generation, `--admin-api-key` every endpoint that changes
//! weights or server state; a key is read from `Authorization: Bearer` (or `X-API-Key`).

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::ApiError;
use super::AppState;

fn presented(req: &Request) -> Option<&str> {
    let h = req.headers();
    h.get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()))
}

/// Compares in time independent of where the first difference is.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Passes when no key is configured or the request presents one of `accepted`.
fn check(accepted: &[Option<&str>], req: Request) -> Result<Request, Response> {
    let keys: Vec<&str> = accepted.iter().flatten().copied().collect();
    if keys.is_empty() || presented(&req).is_some_and(|p| keys.iter().any(|k| same(p, k))) {
        Ok(req)
    } else {
        Err(ApiError::Unauthorized.into_response())
    }
}

pub async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if state.is_shutting_down() {
        return ApiError::Unavailable("the server is shutting down".into()).into_response();
    }
    // The admin key may do everything the generation key may.
    match check(&[state.auth.generation_key(), state.auth.admin_key()], req) {
        Ok(req) => next.run(req).await,
        Err(resp) => resp,
    }
}

pub async fn require_admin_key(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    match check(&[state.auth.admin_key()], req) {
        Ok(req) => next.run(req).await,
        Err(resp) => resp,
    }
}
