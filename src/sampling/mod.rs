//! Turning one row of logits into the next token: request sampling parameters (parsed once at
//! the HTTP boundary), logits processing, seeded sampling, logprobs and stop conditions.
//!
//! Every function here works on one sequence's row and nothing else, so a token never
//! depends on what else is in the batch: the engine may process rows in any order or in
//! parallel. Draws come from a counter-based RNG keyed by (seed, sample index, output
//! position), which is what makes `sampling_seed` reproducible (shared/API.md).
//!
//! Per generated token the engine calls, in order: [`sample`] on the row (penalties,
//! min_new_tokens mask, temperature, top-k/top-p/min-p, draw, logprobs), then
//! [`TokenHistory::push`] and [`StopChecker::check`] with the token and the decoded text.

mod params;
mod process;
mod rng;
mod sample;
mod stop;

pub use params::{
    Decoding, Penalties, SamplingLimits, SamplingParams, ValidSamplingParams, GREEDY_TEMPERATURE,
};
pub use process::{apply_penalties, apply_temperature, mask_min_new_tokens, TokenHistory};
pub use rng::{random_seed, uniform};
pub use sample::{prompt_logprobs, sample, SampleInput, SamplerScratch, TokenLogprobs};
pub use stop::{Finish, StopChecker, StopMatch, StopStatus};

/// Errors of this module: invalid request parameters (caller mistakes, rendered as 400 with
/// the field named) and rows the model produced that cannot be sampled (our fault).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A sampling parameter outside its allowed range; `field` is the SGLang field name.
    #[error("{field} must be {expected}, got {got}")]
    InvalidParam {
        field: &'static str,
        expected: String,
        got: String,
    },
    /// NaN or +inf in a row: a broken model (or a logit so large that temperature overflowed).
    #[error("logit of token {token} is {value} after penalties and temperature; cannot sample")]
    NonFiniteLogit { token: u32, value: f32 },
    /// Every token is masked (-inf): nothing can be sampled.
    #[error("every logit of the row is -inf; no token can be chosen")]
    NoCandidates,
    /// A token id that does not index the logits row.
    #[error("token id {token} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfVocab { token: u32, vocab: usize },
}
