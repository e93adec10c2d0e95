//! The bench's HTTP side: builds each backend's streaming request body, sends it to the one
//! base URL given, and times the response chunk by chunk into a [`RequestRecord`].
//!
//! hyper directly (not reqwest) keeps the compile small; plain http only, since the servers
//! this measures sit on a local network and TLS would time the proxy, not the engine.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{header, Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio::time::{timeout_at, Instant};

use super::dataset::BenchRequest;
use super::metrics::RequestRecord;
use super::sse::{truncate, SseDecoder, StreamEvent, StreamState};
use super::{Backend, BenchError};

pub type Http = Client<HttpConnector, Full<Bytes>>;

pub fn http_client() -> Http {
    let mut connector = HttpConnector::new();
    // Token-by-token frames are tiny; Nagle would batch them and inflate ITL.
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

/// The server under test. Every URL the bench requests is built from this, so it can never
/// reach another host.
#[derive(Clone, Debug)]
pub struct Target {
    base: String,
    api_key: Option<String>,
}

impl Target {
    pub fn new(base_url: &str, api_key: Option<String>) -> Result<Self, BenchError> {
        let bad = |reason: &str| BenchError::Arg {
            flag: "base-url",
            reason: format!("{base_url}: {reason}"),
        };
        let uri: Uri = base_url.parse().map_err(|e| bad(&format!("{e}")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => return Err(bad(&format!("scheme {other} unsupported, use http://"))),
            None => return Err(bad("needs a scheme, e.g. http://127.0.0.1:30000")),
        }
        if uri.host().is_none() {
            return Err(bad("no host"));
        }
        Ok(Self {
            base: base_url.trim_end_matches('/').to_string(),
            api_key,
        })
    }

    fn uri(&self, path: &str) -> Uri {
        // Checked in new(): base parses and path is one of ours, so this cannot fail.
        format!("{}{path}", self.base)
            .parse()
            .expect("base URL validated in Target::new")
    }

    fn request(&self, method: Method, path: &str, body: Bytes) -> Request<Full<Bytes>> {
        let mut b = Request::builder().method(method).uri(self.uri(path));
        if let Some(key) = &self.api_key {
            b = b.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        if !body.is_empty() {
            b = b.header(header::CONTENT_TYPE, "application/json");
        }
        b.body(Full::new(body))
            .expect("static method and validated URI")
    }
}

/// Options that shape every request body of a run.
#[derive(Clone, Debug)]
pub struct BodyOptions {
    pub model: String,
    /// RL rollouts: sample (temperature 1) with the request's seed and return logprobs, as
    /// a GRPO trainer does. Otherwise greedy, as sglang's bench sends.
    pub rollout: bool,
    pub return_routed_experts: bool,
}

/// The streaming request for `backend`: (path, JSON body).
pub fn request_body(
    backend: Backend,
    req: &BenchRequest,
    opts: &BodyOptions,
) -> (&'static str, Value) {
    let temperature = if opts.rollout { 1.0 } else { 0.0 };
    match backend {
        Backend::Lockstep | Backend::Sglang => {
            let mut sp = json!({
                "max_new_tokens": req.output_len,
                "temperature": temperature,
                // The asked output length must be generated, or throughput would depend on
                // where the model happens to stop.
                "ignore_eos": true,
            });
            if let Some(seed) = req.sampling_seed {
                sp["sampling_seed"] = json!(seed);
            }
            let mut body = json!({"text": req.prompt, "sampling_params": sp, "stream": true});
            if opts.rollout {
                body["return_logprob"] = json!(true);
            }
            if opts.return_routed_experts {
                body["return_routed_experts"] = json!(true);
            }
            ("/generate", body)
        }
        Backend::Vllm | Backend::OpenaiCompletions | Backend::OpenaiChat => {
            let chat = backend == Backend::OpenaiChat;
            let mut body = json!({
                "model": opts.model,
                "temperature": temperature,
                "stream": true,
                "stream_options": {"include_usage": true},
                "ignore_eos": true,
            });
            if chat {
                body["messages"] = json!([{"role": "user", "content": req.prompt}]);
                body["max_completion_tokens"] = json!(req.output_len);
            } else {
                body["prompt"] = json!(req.prompt);
                body["max_tokens"] = json!(req.output_len);
            }
            if let Some(seed) = req.sampling_seed {
                body["seed"] = json!(seed);
            }
            if opts.rollout {
                body["logprobs"] = if chat { json!(true) } else { json!(1) };
            }
            if opts.return_routed_experts {
                body["return_routed_experts"] = json!(true);
            }
            let path = if chat {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            (path, body)
        }
    }
}

/// Sends one streaming request and times it. Never fails: every problem becomes the
/// record's error, since a failed request is a result of the benchmark.
pub async fn send_one(
    http: &Http,
    target: &Target,
    backend: Backend,
    req: &BenchRequest,
    opts: &BodyOptions,
    run_start: Instant,
    deadline: Instant,
) -> RequestRecord {
    let (path, body) = request_body(backend, req, opts);
    let body = Bytes::from(serde_json::to_vec(&body).expect("JSON value serializes"));
    let mut state = StreamState::new(backend.wire());
    let mut rec = RequestRecord {
        group: req.group,
        sampling_seed: req.sampling_seed,
        prompt_tokens: req.prompt_len,
        ..Default::default()
    };
    let sent = Instant::now();
    rec.start_s = (sent - run_start).as_secs_f64();
    let outcome = stream(
        http, target, path, body, &mut state, &mut rec, sent, deadline,
    )
    .await;
    rec.e2e_s = (Instant::now().min(deadline.max(sent)) - sent).as_secs_f64();
    match outcome {
        Ok(()) => rec.success = true,
        Err(Failure::CutOff) => {
            rec.cut_off = true;
            rec.error = Some("unfinished when --timeout ended the run".into());
        }
        Err(Failure::Error(e)) => rec.error = Some(e),
    }
    if let Some(p) = state.prompt_tokens {
        rec.prompt_tokens = p;
        rec.prompt_tokens_from_server = true;
    }
    rec.output_tokens = state.output_tokens();
    rec.finish_reason = state.finish_reason.clone();
    rec
}

enum Failure {
    CutOff,
    Error(String),
}

#[allow(clippy::too_many_arguments)]
async fn stream(
    http: &Http,
    target: &Target,
    path: &str,
    body: Bytes,
    state: &mut StreamState,
    rec: &mut RequestRecord,
    sent: Instant,
    deadline: Instant,
) -> Result<(), Failure> {
    let request = target.request(Method::POST, path, body);
    let resp = timeout_at(deadline, http.request(request))
        .await
        .map_err(|_| Failure::CutOff)?
        .map_err(|e| Failure::Error(format!("connect/send: {}", error_chain(&e))))?;
    let status = resp.status();
    let mut body = resp.into_body();
    if status != StatusCode::OK {
        let text = timeout_at(deadline, body.collect())
            .await
            .map(|r| r.map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned()))
            .unwrap_or(Ok(String::new()))
            .unwrap_or_default();
        return Err(Failure::Error(format!(
            "HTTP {}: {}",
            status.as_u16(),
            truncate(text.trim(), 500)
        )));
    }
    let mut decoder = SseDecoder::default();
    let mut last_chunk: Option<Instant> = None;
    let mut done = false;
    loop {
        let frame = match timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(Failure::CutOff),
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return Err(Failure::Error(format!(
                    "reading stream: {}",
                    error_chain(&e)
                )))
            }
            Ok(Some(Ok(f))) => f,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = Instant::now();
        for payload in decoder.push(&data) {
            done |= on_payload(&payload, state, rec, sent, now, &mut last_chunk)?;
        }
        if done {
            break;
        }
    }
    let now = Instant::now();
    for payload in decoder.finish() {
        on_payload(&payload, state, rec, sent, now, &mut last_chunk)?;
    }
    Ok(())
}

/// Applies one payload to the timings; true on `[DONE]`.
fn on_payload(
    payload: &str,
    state: &mut StreamState,
    rec: &mut RequestRecord,
    sent: Instant,
    now: Instant,
    last_chunk: &mut Option<Instant>,
) -> Result<bool, Failure> {
    match state.on_data(payload).map_err(Failure::Error)? {
        StreamEvent::Done => return Ok(true),
        StreamEvent::Nothing => {}
        StreamEvent::Output { tokens, .. } => match *last_chunk {
            None => {
                rec.ttft_s = (now - sent).as_secs_f64();
                *last_chunk = Some(now);
            }
            // Text without a new token (a held-back character released): sglang's bench
            // skips it, leaving the gap to be measured at the next token.
            Some(_) if tokens == 0 => {}
            Some(prev) => {
                let gap = (now - prev).as_secs_f64() / tokens as f64;
                rec.itl_s.extend(std::iter::repeat_n(gap, tokens));
                *last_chunk = Some(now);
            }
        },
    }
    Ok(false)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// GET a small text resource (/metrics, /v1/models) with a bounded wait.
pub async fn get_text(http: &Http, target: &Target, path: &str) -> Result<String, String> {
    let req = target.request(Method::GET, path, Bytes::new());
    let fut = async {
        let resp = http.request(req).await.map_err(|e| error_chain(&e))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| error_chain(&e))?;
        let text = String::from_utf8_lossy(&body.to_bytes()).into_owned();
        if status.is_success() {
            Ok(text)
        } else {
            Err(format!(
                "HTTP {}: {}",
                status.as_u16(),
                truncate(&text, 200)
            ))
        }
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .unwrap_or_else(|_| Err(format!("GET {path}: no answer in 10 s")))
}

/// The served model's name for the OpenAI forms (vLLM rejects any other): the first entry of
/// GET /v1/models, or "default" when the server does not list models.
pub async fn served_model(http: &Http, target: &Target) -> String {
    get_text(http, target, "/v1/models")
        .await
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["data"][0]["id"].as_str().map(str::to_string))
        .unwrap_or_else(|| "default".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(seed: Option<u64>) -> BenchRequest {
        BenchRequest {
            prompt: "hello world".into(),
            prompt_len: 2,
            output_len: 5,
            group: seed.map(|_| 0),
            sampling_seed: seed,
        }
    }

    #[test]
    fn bodies_per_backend() {
        let plain = BodyOptions {
            model: "m".into(),
            rollout: false,
            return_routed_experts: false,
        };
        let (path, b) = request_body(Backend::Sglang, &req(None), &plain);
        assert_eq!(path, "/generate");
        assert_eq!(b["text"], "hello world");
        assert_eq!(b["stream"], true);
        assert_eq!(b["sampling_params"]["max_new_tokens"], 5);
        assert_eq!(b["sampling_params"]["temperature"], 0.0);
        assert!(b.get("return_logprob").is_none());

        let rollout = BodyOptions {
            rollout: true,
            return_routed_experts: true,
            ..plain.clone()
        };
        let (_, b) = request_body(Backend::Lockstep, &req(Some(3)), &rollout);
        assert_eq!(b["sampling_params"]["sampling_seed"], 3);
        assert_eq!(b["sampling_params"]["temperature"], 1.0);
        assert_eq!(b["return_logprob"], true);
        assert_eq!(b["return_routed_experts"], true);

        let (path, b) = request_body(Backend::Vllm, &req(Some(2)), &rollout);
        assert_eq!(path, "/v1/completions");
        assert_eq!(
            (b["prompt"].as_str(), b["max_tokens"].as_u64()),
            (Some("hello world"), Some(5))
        );
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(
            (b["seed"].as_u64(), b["logprobs"].as_u64()),
            (Some(2), Some(1))
        );
        assert_eq!(b["model"], "m");

        let (path, b) = request_body(Backend::OpenaiChat, &req(None), &plain);
        assert_eq!(path, "/v1/chat/completions");
        assert_eq!(b["messages"][0]["content"], "hello world");
        assert_eq!(b["max_completion_tokens"], 5);
    }

    #[test]
    fn only_plain_http_urls() {
        assert!(Target::new("http://127.0.0.1:30000/", None).is_ok());
        assert_eq!(
            Target::new("http://h:1/", None).unwrap().uri("/generate"),
            "http://h:1/generate"
        );
        assert!(Target::new("https://api.example/", None).is_err());
        assert!(Target::new("127.0.0.1:30000", None).is_err());
    }
}
