//! Parse, don't validate: a prompt and its options become engine [`GenerateRequest`]s here,
//! with every limit checked once and every error naming its field.

use super::errors::ApiError;
use super::AppState;
use crate::engine::GenerateRequest;
use crate::sampling::{self, SamplingError, SamplingLimits, SamplingParams};

/// A prompt as a client sent it.
pub enum PromptInput {
    Text(String),
    Ids(Vec<i64>),
}

/// Per-request options outside `sampling_params`.
pub struct RequestOptions {
    pub return_logprob: bool,
    /// -1: output logprobs only.
    pub logprob_start_len: i64,
    pub top_logprobs_num: i64,
    pub return_routed_experts: bool,
    pub add_special_tokens: bool,
}

/// Server-wide limits that requests are checked against (defaults in `ServeArgs`).
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_n: usize,
    pub max_top_logprobs: usize,
    pub context_len: usize,
    pub vocab_size: usize,
    /// `--enable-return-routed-experts`.
    pub allow_routed_experts: bool,
    /// The engine runs on a CUDA GPU (else on the CPU backend); `/get_server_info` reports it.
    pub on_gpu: bool,
}

pub fn new_rid() -> String {
    format!(
        "{:032x}",
        (sampling::random_seed() as u128) << 64 | sampling::random_seed() as u128
    )
}

/// Tokenizes (on the blocking pool) and checks one prompt, then expands its `n` samples.
pub async fn build_requests(
    state: &AppState,
    rid: String,
    prompt: PromptInput,
    params: &SamplingParams,
    opts: &RequestOptions,
) -> Result<Vec<GenerateRequest>, ApiError> {
    let limits = &state.limits;
    if opts.return_routed_experts && !limits.allow_routed_experts {
        return Err(ApiError::invalid(
            "return_routed_experts",
            "routed expert capture is off; start the server with --enable-return-routed-experts",
        ));
    }
    let input_ids: Vec<u32> = match prompt {
        PromptInput::Ids(ids) => {
            if ids.is_empty() {
                return Err(ApiError::invalid(
                    "input_ids",
                    "input_ids must not be empty",
                ));
            }
            if let Some(bad) = ids
                .iter()
                .find(|&&t| t < 0 || t as usize >= limits.vocab_size)
            {
                return Err(ApiError::invalid(
                    "input_ids",
                    format!(
                        "token id {bad} is outside the vocabulary [0, {})",
                        limits.vocab_size
                    ),
                ));
            }
            ids.into_iter().map(|t| t as u32).collect()
        }
        PromptInput::Text(text) => {
            let tok = state.engine.info.tokenizer.clone();
            let add = opts.add_special_tokens;
            let ids = tokio::task::spawn_blocking(move || tok.encode(&text, add))
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))?
                .map_err(|e| ApiError::invalid("text", format!("cannot tokenize: {e}")))?;
            if ids.is_empty() {
                return Err(ApiError::invalid("text", "the prompt is empty"));
            }
            ids
        }
    };
    // `max_new_tokens: null` means "whatever the context leaves".
    let mut params = params.clone();
    if params.max_new_tokens.is_none() {
        params.max_new_tokens = Some(limits.context_len.saturating_sub(input_ids.len()) as i64);
    }
    let sampling_limits = SamplingLimits {
        max_n: limits.max_n,
        max_new_tokens: limits.context_len,
        vocab_size: Some(limits.vocab_size),
        ..SamplingLimits::default()
    };
    let valid = params.validate(&sampling_limits).map_err(|e| {
        let param = match &e {
            SamplingError::InvalidParam { field, .. } => format!("sampling_params.{field}"),
            _ => "sampling_params".to_string(),
        };
        ApiError::Invalid {
            message: format!("sampling_params.{e}"),
            param: Some(param),
        }
    })?;
    if input_ids.len() >= limits.context_len {
        return Err(ApiError::invalid(
            "input_ids",
            format!(
                "the prompt has {} tokens; the context length is {}",
                input_ids.len(),
                limits.context_len
            ),
        ));
    }
    if input_ids.len() + valid.max_new_tokens > limits.context_len {
        return Err(ApiError::invalid(
            "max_new_tokens",
            format!(
                "max_new_tokens {} plus the prompt's {} tokens exceeds the context length {}",
                valid.max_new_tokens,
                input_ids.len(),
                limits.context_len
            ),
        ));
    }
    if opts.top_logprobs_num < 0 || opts.top_logprobs_num as usize > limits.max_top_logprobs {
        return Err(ApiError::invalid(
            "top_logprobs_num",
            format!(
                "top_logprobs_num must be in [0, {}], got {}",
                limits.max_top_logprobs, opts.top_logprobs_num
            ),
        ));
    }
    let logprob_start_len = match opts.logprob_start_len {
        -1 => None,
        l if l >= 0 && (l as usize) < input_ids.len() => Some(l as usize),
        l => {
            return Err(ApiError::invalid(
                "logprob_start_len",
                format!(
                    "logprob_start_len must be -1 or in [0, {}), got {l}",
                    input_ids.len()
                ),
            ))
        }
    };
    let seed = valid.seed.unwrap_or_else(sampling::random_seed);
    let n = valid.n;
    Ok((0..n)
        .map(|i| GenerateRequest {
            rid: if n > 1 {
                format!("{rid}-{i}")
            } else {
                rid.clone()
            },
            input_ids: input_ids.clone(),
            params: valid.clone(),
            seed,
            sample_index: i as u32,
            return_logprob: opts.return_logprob,
            logprob_start_len: if opts.return_logprob {
                logprob_start_len
            } else {
                None
            },
            top_logprobs_num: if opts.return_logprob {
                opts.top_logprobs_num as usize
            } else {
                0
            },
            return_routed_experts: opts.return_routed_experts,
        })
        .collect())
}
