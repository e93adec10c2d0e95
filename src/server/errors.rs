//! The one table from errors to HTTP: every failure answers in the OpenAI error shape
//! `{"error": {"message", "type", "code", "param"}}`, 4xx for the caller's mistakes, 5xx only
//! for ours.

use axum::extract::rejection::JsonRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::engine::EngineError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A field is missing, of the wrong type or out of its limits.
    #[error("{message}")]
    Invalid {
        param: Option<String>,
        message: String,
    },
    #[error("invalid or missing API key")]
    Unauthorized,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("request body is larger than the server's limit (--max-request-bytes; for a weight bucket, --max-staged-weight-bytes)")]
    PayloadTooLarge,
    #[error("expected `Content-Type: application/json`")]
    UnsupportedMediaType,
    /// Admission control: the queue is full. Carries Retry-After.
    #[error("{0}")]
    Overloaded(String),
    #[error("{0}")]
    Unavailable(String),
    /// An SGLang endpoint lockstep knows but does not implement (yet): the message says what
    /// is not supported and what to use instead, so a client never mistakes it for a typo (404).
    #[error("{0}")]
    NotImplemented(String),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 about `param`; the message always names it.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        let message = message.into();
        let message = if message.contains(param) {
            message
        } else {
            format!("{param}: {message}")
        };
        ApiError::Invalid {
            param: Some(param.to_string()),
            message,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Invalid { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Overloaded(_) | ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ApiError::Invalid { .. }
            | ApiError::PayloadTooLarge
            | ApiError::UnsupportedMediaType => "invalid_request_error",
            ApiError::Unauthorized => "authentication_error",
            ApiError::Forbidden(_) => "permission_error",
            ApiError::NotFound(_) => "not_found_error",
            ApiError::Conflict(_) => "conflict_error",
            ApiError::MethodNotAllowed(_) => "invalid_request_error",
            ApiError::Overloaded(_) | ApiError::Unavailable(_) => "service_unavailable",
            ApiError::NotImplemented(_) => "not_implemented_error",
            ApiError::Internal(_) => "internal_error",
        }
    }

    /// The error object as JSON (also used for errors inside SSE streams).
    pub fn body(&self) -> serde_json::Value {
        let param = match self {
            ApiError::Invalid { param, .. } => param.clone(),
            _ => None,
        };
        serde_json::json!({"error": {"message": self.to_string(), "type": self.kind(), "code": self.status().as_u16(), "param": param}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), Json(self.body())).into_response();
        if matches!(self, ApiError::Overloaded(_)) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        match e {
            EngineError::Overloaded(_) => ApiError::Overloaded(e.to_string()),
            EngineError::Stopped(_) | EngineError::Start(_) => ApiError::Internal(e.to_string()),
            EngineError::Failed(m) => ApiError::Internal(m),
            EngineError::Conflict(m) | EngineError::MemoryState(m) => ApiError::Conflict(m),
            EngineError::Unavailable(m) => ApiError::Unavailable(m),
            EngineError::BadInput { param, message } => ApiError::invalid(&param, message),
        }
    }
}

/// A JSON body that fails to parse gets our error shape, not axum's plain text.
impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> ApiError {
        match r {
            JsonRejection::MissingJsonContentType(_) => ApiError::UnsupportedMediaType,
            JsonRejection::BytesRejection(b) if b.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                ApiError::PayloadTooLarge
            }
            JsonRejection::JsonDataError(e) => ApiError::Invalid {
                param: None,
                message: format!("invalid request body: {}", e.body_text()),
            },
            JsonRejection::JsonSyntaxError(e) => ApiError::Invalid {
                param: None,
                message: format!("body is not valid JSON: {}", e.body_text()),
            },
            other => ApiError::Invalid {
                param: None,
                message: other.body_text(),
            },
        }
    }
}
