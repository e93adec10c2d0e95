//! The HTTP side of a push: one [`Server`] per URL, JSON calls and bucket PUTs over hyper
//! (the bench's client stack), with bounded retries and exponential backoff for failures that
//! may pass (connection errors, timeouts, 5xx, 429). A 4xx is the server refusing the data:
//! never retried.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{header, Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use super::body::Chunks;
use super::PushError;

/// The push's HTTP client: bodies are chunk lists (a bucket's tensors go out from the
/// checkpoint's map).
type Http = Client<HttpConnector, Chunks>;

/// Retries after the first attempt, and the first backoff (doubled each time).
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    pub retries: usize,
    pub backoff: Duration,
    /// Per attempt, for the whole request and response.
    pub timeout: Duration,
}

/// One failed call, before it becomes a [`PushError`] naming the server.
#[derive(Debug)]
pub enum CallError {
    /// The server answered with an error status; `message` is its error text.
    Status {
        status: StatusCode,
        message: String,
    },
    Transport(String),
}

impl CallError {
    fn retryable(&self) -> bool {
        match self {
            CallError::Transport(_) => true,
            CallError::Status { status, .. } => {
                status.is_server_error() || *status == StatusCode::TOO_MANY_REQUESTS
            }
        }
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Status { status, message } => write!(f, "{status}: {message}"),
            CallError::Transport(e) => write!(f, "{e}"),
        }
    }
}

#[derive(Clone)]
pub struct Server {
    pub url: String,
    api_key: Option<String>,
    http: Http,
    policy: RetryPolicy,
}

impl Server {
    pub fn new(
        url: &str,
        api_key: Option<String>,
        policy: RetryPolicy,
    ) -> Result<Server, PushError> {
        let bad = |reason: String| PushError::Server {
            url: url.to_string(),
            reason,
        };
        let uri: Uri = url.parse().map_err(|e| bad(format!("not a URL: {e}")))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(bad("expected http://HOST:PORT".into()));
        }
        Ok(Server {
            url: url.trim_end_matches('/').to_string(),
            api_key,
            http: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            policy,
        })
    }

    fn request(&self, method: Method, path: &str, body: Chunks, json: bool) -> Request<Chunks> {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url));
        if let Some(key) = &self.api_key {
            b = b.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        let kind = if json {
            "application/json"
        } else {
            "application/octet-stream"
        };
        b.header(header::CONTENT_TYPE, kind)
            .body(body)
            .expect("URL checked in Server::new")
    }

    async fn once(
        &self,
        method: Method,
        path: &str,
        body: Chunks,
        json: bool,
    ) -> Result<Value, CallError> {
        let req = self.request(method, path, body, json);
        let call = async {
            let resp = self
                .http
                .request(req)
                .await
                .map_err(|e| CallError::Transport(format!("{e}")))?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| CallError::Transport(format!("reading the answer: {e}")))?
                .to_bytes();
            let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            if status.is_success() {
                Ok(value)
            } else {
                let message = value["error"]["message"]
                    .as_str()
                    .or(value["message"].as_str())
                    .map(str::to_string)
                    .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
                Err(CallError::Status { status, message })
            }
        };
        tokio::time::timeout(self.policy.timeout, call)
            .await
            .unwrap_or_else(|_| {
                Err(CallError::Transport(format!(
                    "no answer within {:?}",
                    self.policy.timeout
                )))
            })
    }

    /// One call with the retry policy; `retry` false for calls that must not repeat (end).
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Chunks,
        json: bool,
        retry: bool,
    ) -> Result<Value, CallError> {
        let mut backoff = self.policy.backoff;
        let mut attempt = 0;
        loop {
            match self.once(method.clone(), path, body.clone(), json).await {
                Err(e) if retry && e.retryable() && attempt < self.policy.retries => {
                    tracing::warn!("{}{path}: {e}; retrying in {backoff:?}", self.url);
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    pub async fn get(&self, path: &str) -> Result<Value, CallError> {
        self.call(Method::GET, path, Chunks::default(), true, true)
            .await
    }

    pub async fn post(&self, path: &str, body: &Value, retry: bool) -> Result<Value, CallError> {
        let body = Chunks::one(Bytes::from(
            serde_json::to_vec(body).expect("JSON serializes"),
        ));
        self.call(Method::POST, path, body, true, retry).await
    }

    /// Staging the same tensors twice replaces them, so a bucket PUT is safe to retry.
    pub async fn put_bucket(
        &self,
        session: &str,
        body: impl Into<Chunks>,
    ) -> Result<Value, CallError> {
        let path = format!("/update_weights?session={session}");
        self.call(Method::PUT, &path, body.into(), false, true)
            .await
    }
}
