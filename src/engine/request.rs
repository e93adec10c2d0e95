//! What crosses the engine boundary: a validated request for one sample, and the events the
//! engine sends back for it.

use crate::sampling::{Finish, ValidSamplingParams};

/// One sequence to generate (a request with `n > 1` is submitted as n of these, sharing the
/// prompt and seed, with sample indices 0..n).
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub rid: String,
    pub input_ids: Vec<u32>,
    pub params: ValidSamplingParams,
    /// The request's sampling seed (drawn once per request when the client gave none).
    pub seed: u64,
    pub sample_index: u32,
    pub return_logprob: bool,
    /// First prompt position whose logprob is returned; None: output tokens only.
    pub logprob_start_len: Option<usize>,
    pub top_logprobs_num: usize,
    pub return_routed_experts: bool,
}

impl GenerateRequest {
    /// Prompt logprobs and routed experts need every prompt position computed by this
    /// request, so such requests do not reuse cached prefix blocks.
    pub fn needs_full_prefill(&self) -> bool {
        (self.return_logprob && self.logprob_start_len.is_some()) || self.return_routed_experts
    }
}

/// One prompt position's logprob (None for the first token) and top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct InputLogprob {
    pub token: u32,
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenOut {
    pub id: u32,
    /// Newly decoded text (complete characters only).
    pub text: String,
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
    /// The weight version that computed this token.
    pub weight_version: String,
}

/// A run of output tokens computed with one weight version, `[start, end)`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct VersionSpan {
    pub version: String,
    pub start: usize,
    pub end: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FinishInfo {
    pub reason: Finish,
    /// The whole output text, trimmed per the stop rules.
    pub text: String,
    pub output_ids: Vec<u32>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub input_logprobs: Option<Vec<InputLogprob>>,
    /// `[prompt + output - 1, moe_layers, top_k]`, when asked for.
    pub routed_experts: Option<Vec<i32>>,
    pub moe_layers: usize,
    pub top_k: usize,
    pub weight_versions: Vec<VersionSpan>,
    /// Seconds from arrival to the first scheduling of the request.
    pub queue_time: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Token(TokenOut),
    Finished(Box<FinishInfo>),
    /// The request failed or was refused; the kind says whose fault (errors.rs maps it).
    Error(super::EngineError),
}
