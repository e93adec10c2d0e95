//! The logits processors that rewrite one row in place before sampling: penalties, the
//! min_new_tokens mask and temperature. f32 arithmetic, each token independent of the others.
//!
//! Order (as vLLM and SGLang apply them): repetition penalty, frequency penalty, presence
//! penalty, min_new_tokens mask, then temperature.

use std::collections::{HashMap, HashSet};

use super::params::{Decoding, Penalties, ValidSamplingParams};

/// What the penalties need to know about one sequence: the distinct tokens of prompt and
/// output (repetition penalty) and how often each token occurs in the output (frequency and
/// presence penalties). Kept incrementally so a step costs O(distinct tokens), not O(length).
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    seen: HashSet<u32>,
    output_counts: HashMap<u32, u32>,
    output_len: usize,
}

impl TokenHistory {
    pub fn new(prompt: &[u32]) -> Self {
        Self {
            seen: prompt.iter().copied().collect(),
            ..Default::default()
        }
    }

    /// Records one generated token.
    pub fn push(&mut self, token: u32) {
        self.seen.insert(token);
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.output_len += 1;
    }

    /// Number of generated tokens: the output position of the next one.
    pub fn output_len(&self) -> usize {
        self.output_len
    }

    /// How often `token` occurs in the output.
    pub fn output_count(&self, token: u32) -> u32 {
        self.output_counts.get(&token).copied().unwrap_or(0)
    }

    /// The distinct tokens of prompt and output (what the repetition penalty touches), in no
    /// particular order.
    pub fn seen_tokens(&self) -> impl Iterator<Item = u32> + '_ {
        self.seen.iter().copied()
    }

    /// `(token, count)` for every token of the output, in no particular order.
    pub fn output_counts(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.output_counts.iter().map(|(&t, &c)| (t, c))
    }
}

/// Applies the penalties to `logits` in place.
///
/// - repetition (HF): every distinct token of prompt + output, positive logits divided by the
///   penalty, others multiplied;
/// - frequency then presence (OpenAI): over output tokens, `l -= frequency * count`, then
///   `l -= presence`, as two separate f32 subtractions.
///
/// Tokens outside the row are ignored: the engine may have prompt ids beyond a padded vocab.
/// Iteration order over the sets does not matter: each token is rewritten once, alone.
pub fn apply_penalties(logits: &mut [f32], penalties: &Penalties, history: &TokenHistory) {
    let r = penalties.repetition;
    if r != 1.0 {
        for &t in &history.seen {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
        }
    }
    let (f, p) = (penalties.frequency, penalties.presence);
    if f != 0.0 || p != 0.0 {
        for (&t, &count) in &history.output_counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= f * count as f32;
                *l -= p;
            }
        }
    }
}

/// Masks (sets to -inf) every EOS id and stop_token_id while fewer than `min_new_tokens`
/// tokens have been generated, so the sequence cannot end early. As in SGLang this applies
/// even with `ignore_eos` (there EOS would not end the sequence, but is still held back).
pub fn mask_min_new_tokens(
    logits: &mut [f32],
    params: &ValidSamplingParams,
    history: &TokenHistory,
    eos_token_ids: &[u32],
) {
    if history.output_len() >= params.min_new_tokens {
        return;
    }
    for &t in eos_token_ids.iter().chain(&params.stop_token_ids) {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Divides the row by the temperature when sampling; greedy decoding leaves it unscaled,
/// so its logprobs are those of the penalized logits (SGLang sets temperature 1 for greedy).
pub fn apply_temperature(logits: &mut [f32], decoding: &Decoding) {
    if let Decoding::Sample { temperature, .. } = *decoding {
        if temperature != 1.0 {
            for l in logits.iter_mut() {
                *l /= temperature;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::params::SamplingParams;

    fn valid(p: SamplingParams) -> ValidSamplingParams {
        p.validate(&Default::default()).unwrap()
    }

    #[test]
    fn repetition_penalty_follows_hf() {
        // Prompt {0, 1}, output {1, 3}: tokens 0, 1, 3 penalized once each, 2 and 4 untouched.
        let mut h = TokenHistory::new(&[0, 1, 1, 0]);
        h.push(1);
        h.push(3);
        let mut l = vec![2.0f32, -1.5, 0.7, 0.0, 3.0];
        let pen = Penalties {
            repetition: 1.3,
            frequency: 0.0,
            presence: 0.0,
        };
        apply_penalties(&mut l, &pen, &h);
        assert_eq!(l, vec![2.0f32 / 1.3, -1.5f32 * 1.3, 0.7, 0.0f32 * 1.3, 3.0]);
    }

    #[test]
    fn frequency_and_presence_count_output_only() {
        let mut h = TokenHistory::new(&[0, 4, 4]);
        for t in [2, 2, 2, 3] {
            h.push(t);
        }
        assert_eq!(h.output_len(), 4);
        assert_eq!(h.output_count(2), 3);
        let mut l = vec![1.0f32, 1.0, 0.25, -0.5, 1.0];
        let pen = Penalties {
            repetition: 1.0,
            frequency: 0.4,
            presence: 0.3,
        };
        apply_penalties(&mut l, &pen, &h);
        let expect2 = (0.25f32 - 0.4f32 * 3.0) - 0.3f32;
        let expect3 = (-0.5f32 - 0.4f32 * 1.0) - 0.3f32;
        assert_eq!(l, vec![1.0, 1.0, expect2, expect3, 1.0]);
    }

    #[test]
    fn all_penalties_compose_in_order() {
        let mut h = TokenHistory::new(&[1]);
        h.push(0);
        h.push(0);
        let mut l = vec![3.0f32, -2.0, 5.0];
        let pen = Penalties {
            repetition: 2.0,
            frequency: 0.5,
            presence: -1.0,
        };
        apply_penalties(&mut l, &pen, &h);
        // token 0: 3 / 2 = 1.5, - 0.5 * 2 = 0.5, - (-1) = 1.5; token 1: -2 * 2 = -4.
        assert_eq!(l, vec![1.5, -4.0, 5.0]);
    }

    #[test]
    fn neutral_penalties_leave_the_row_alone_and_out_of_vocab_ids_are_ignored() {
        let mut h = TokenHistory::new(&[0, 1, 99]);
        h.push(1000);
        let mut l = vec![1.0f32, -1.0];
        apply_penalties(
            &mut l,
            &Penalties {
                repetition: 1.0,
                frequency: 0.0,
                presence: 0.0,
            },
            &h,
        );
        assert_eq!(l, vec![1.0, -1.0]);
        apply_penalties(
            &mut l,
            &Penalties {
                repetition: 2.0,
                frequency: 1.0,
                presence: 1.0,
            },
            &h,
        );
        assert_eq!(l, vec![0.5, -2.0]);
    }

    #[test]
    fn min_new_tokens_masks_eos_and_stop_ids_until_reached() {
        let params = valid(SamplingParams {
            min_new_tokens: 2,
            stop_token_ids: vec![3],
            ignore_eos: true,
            ..Default::default()
        });
        let mut h = TokenHistory::new(&[5]);
        let row = vec![0.5f32; 6];
        for step in 0..3 {
            let mut l = row.clone();
            mask_min_new_tokens(&mut l, &params, &h, &[1, 2]);
            let masked: Vec<usize> = (0..6).filter(|&i| l[i] == f32::NEG_INFINITY).collect();
            if step < 2 {
                assert_eq!(masked, vec![1, 2, 3], "step {step}");
            } else {
                assert!(masked.is_empty());
            }
            h.push(0);
        }
    }

    #[test]
    fn temperature_divides_only_when_sampling() {
        let mut l = vec![1.0f32, -3.0, 0.3];
        apply_temperature(&mut l, &Decoding::Greedy);
        assert_eq!(l, vec![1.0, -3.0, 0.3]);
        let d = Decoding::Sample {
            temperature: 0.7,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
        };
        apply_temperature(&mut l, &d);
        assert_eq!(l, vec![1.0f32 / 0.7, -3.0f32 / 0.7, 0.3f32 / 0.7]);
    }
}
