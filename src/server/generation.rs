//! Running validated requests on the engine and following their events, shared by the
//! native and OpenAI front ends: collection into finished samples, streaming, and the
//! latency histograms (time to first token, inter-token latency, end-to-end, queue time).

use std::time::Instant;

use futures_util::stream::{self, Stream, StreamExt};
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::errors::ApiError;
use super::AppState;
use crate::engine::{EngineEvent, FinishInfo, GenerateRequest, TokenOut};

/// One sample's events, tracked for metrics.
pub struct Tracker {
    start: Instant,
    last_token: Option<Instant>,
    endpoint: &'static str,
}

impl Tracker {
    pub fn new(endpoint: &'static str) -> Tracker {
        Tracker {
            start: Instant::now(),
            last_token: None,
            endpoint,
        }
    }

    pub fn observe(&mut self, event: &EngineEvent) {
        let now = Instant::now();
        match event {
            EngineEvent::Token(_) => {
                match self.last_token {
                    None => metrics::histogram!("lockstep_time_to_first_token_seconds")
                        .record(now.duration_since(self.start).as_secs_f64()),
                    Some(prev) => metrics::histogram!("lockstep_inter_token_latency_seconds")
                        .record(now.duration_since(prev).as_secs_f64()),
                }
                self.last_token = Some(now);
                metrics::counter!("lockstep_generation_tokens_total").increment(1);
            }
            EngineEvent::Finished(f) => {
                metrics::histogram!("lockstep_e2e_request_latency_seconds").record(self.elapsed());
                metrics::histogram!("lockstep_queue_time_seconds").record(f.queue_time);
                metrics::counter!("lockstep_prompt_tokens_total").increment(f.prompt_tokens as u64);
                metrics::counter!("lockstep_prefix_cache_hit_tokens_total")
                    .increment(f.cached_tokens as u64);
                metrics::counter!("lockstep_requests_finished_total", "endpoint" => self.endpoint, "reason" => finish_kind(f)).increment(1);
            }
            EngineEvent::Error(_) => {}
        }
    }

    pub fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}

fn finish_kind(f: &FinishInfo) -> &'static str {
    match f.reason {
        crate::sampling::Finish::Stop { .. } => "stop",
        crate::sampling::Finish::Length { .. } => "length",
        crate::sampling::Finish::Abort { .. } => "abort",
    }
}

/// A finished sample with the per-token data the wire formats need.
pub struct Sample {
    pub tokens: Vec<TokenOut>,
    pub finish: FinishInfo,
    pub e2e_latency: f64,
}

/// Submits every request; fails as a whole (and aborts what was queued) if one is refused.
pub fn submit_all(
    state: &AppState,
    reqs: Vec<GenerateRequest>,
) -> Result<Vec<tokio::sync::mpsc::UnboundedReceiver<EngineEvent>>, ApiError> {
    let mut receivers = Vec::with_capacity(reqs.len());
    for r in reqs {
        // Receivers already created are dropped on error, which aborts their sequences.
        receivers.push(state.engine.submit(r)?);
    }
    Ok(receivers)
}

/// Runs every request to completion, in order.
pub async fn collect(
    state: &AppState,
    reqs: Vec<GenerateRequest>,
    endpoint: &'static str,
) -> Result<Vec<Sample>, ApiError> {
    let receivers = submit_all(state, reqs)?;
    let runs = receivers.into_iter().map(|mut rx| async move {
        let mut tracker = Tracker::new(endpoint);
        let mut tokens = Vec::new();
        while let Some(ev) = rx.recv().await {
            tracker.observe(&ev);
            match ev {
                EngineEvent::Token(t) => tokens.push(t),
                EngineEvent::Finished(f) => {
                    return Ok(Sample {
                        tokens,
                        finish: *f,
                        e2e_latency: tracker.elapsed(),
                    })
                }
                EngineEvent::Error(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Internal(
            "the engine stopped before the request finished".into(),
        ))
    });
    futures_util::future::try_join_all(runs).await
}

/// Every sample's events, interleaved as they come, tagged with the sample's index.
pub fn stream_events(
    state: &AppState,
    reqs: Vec<GenerateRequest>,
    endpoint: &'static str,
) -> Result<impl Stream<Item = (usize, EngineEvent, f64)> + Send + 'static, ApiError> {
    let receivers = submit_all(state, reqs)?;
    let streams = receivers.into_iter().enumerate().map(move |(i, rx)| {
        let mut tracker = Tracker::new(endpoint);
        UnboundedReceiverStream::new(rx).map(move |ev| {
            tracker.observe(&ev);
            (i, ev, tracker.elapsed())
        })
    });
    Ok(stream::select_all(streams))
}

/// Routed expert ids on the wire: base64 of little-endian int32 (API.md).
pub fn routed_experts_base64(ids: &[i32]) -> String {
    use base64::Engine as _;
    let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}
