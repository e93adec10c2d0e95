//! `sampling_params` as the client sends them ([`SamplingParams`], SGLang's names and
//! defaults) and as the engine may trust them ([`ValidSamplingParams`]).
//!
//! Wire fields keep wide types (signed integers, f64) so that a bad value reaches
//! [`SamplingParams::validate`], which names the field and the limit, instead of failing in
//! serde with a message that names neither.

use serde::{Deserialize, Deserializer, Serialize};

use super::SamplingError;

/// Temperatures below this mean greedy decoding (SGLang's `_SAMPLING_EPS`).
pub const GREEDY_TEMPERATURE: f64 = 1e-6;

/// The `sampling_params` object of `/generate`, with SGLang's field names. Missing fields take
/// the defaults of [`SamplingParams::default`], the one place they are defined; unknown fields
/// are ignored (shared/API.md).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct SamplingParams {
    /// `null` means "as many as the server allows" (SGLang: up to the context length).
    pub max_new_tokens: Option<i64>,
    pub temperature: f64,
    pub top_p: f64,
    /// -1 means all tokens.
    pub top_k: i64,
    pub min_p: f64,
    pub frequency_penalty: f64,
    pub presence_penalty: f64,
    pub repetition_penalty: f64,
    pub min_new_tokens: i64,
    pub n: i64,
    /// A string or a list of strings on the wire.
    #[serde(deserialize_with = "string_or_list")]
    pub stop: Vec<String>,
    #[serde(deserialize_with = "null_as_empty")]
    pub stop_token_ids: Vec<i64>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    pub spaces_between_special_tokens: bool,
    pub no_stop_trim: bool,
    /// Any JSON integer; a negative one is taken as its 64-bit two's complement, so clients
    /// that draw seeds from a signed range are reproducible too.
    #[serde(deserialize_with = "seed", skip_serializing_if = "Option::is_none")]
    pub sampling_seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: Some(128),
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            min_new_tokens: 0,
            n: 1,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
            no_stop_trim: false,
            sampling_seed: None,
        }
    }
}

/// Server-side limits that [`SamplingParams::validate`] enforces.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingLimits {
    /// Largest `n` (samples per prompt).
    pub max_n: usize,
    /// Largest `max_new_tokens`, and the value used when the client sends `null`. The engine
    /// still clamps to what fits in the context after the prompt.
    pub max_new_tokens: usize,
    pub max_stop_strings: usize,
    /// Longest stop string in bytes: it bounds the text rescanned per token.
    pub max_stop_string_bytes: usize,
    pub max_stop_token_ids: usize,
    /// When known, stop_token_ids must be below it.
    pub vocab_size: Option<usize>,
}

impl Default for SamplingLimits {
    fn default() -> Self {
        Self {
            max_n: 128,
            max_new_tokens: 32768,
            max_stop_strings: 32,
            max_stop_string_bytes: 512,
            max_stop_token_ids: 256,
            vocab_size: None,
        }
    }
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decoding {
    /// Argmax of the penalized logits, ties to the lowest token id; logprobs use temperature 1.
    Greedy,
    Sample {
        /// > 0 (at least [`GREEDY_TEMPERATURE`]).
        temperature: f32,
        /// `None` = all tokens; otherwise >= 1 (larger than the vocabulary means all).
        top_k: Option<usize>,
        /// In (0, 1]; 1 disables nucleus truncation.
        top_p: f32,
        /// In [0, 1]; 0 disables it.
        min_p: f32,
    },
}

/// Repetition (HF, over prompt and output) and frequency/presence (OpenAI, over output)
/// penalties; the neutral values are 1, 0, 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    pub repetition: f32,
    pub frequency: f32,
    pub presence: f32,
}

impl Penalties {
    pub fn is_neutral(&self) -> bool {
        self.repetition == 1.0 && self.frequency == 0.0 && self.presence == 0.0
    }
}

/// Sampling parameters that passed [`SamplingParams::validate`]: the only form the engine
/// accepts. Fields are public for reading; the private marker keeps construction here.
// `#[non_exhaustive]` would still let the rest of the crate build one by hand; the private
// field keeps construction in this file, behind `validate`.
#[allow(clippy::manual_non_exhaustive)]
#[derive(Debug, Clone, PartialEq)]
pub struct ValidSamplingParams {
    pub max_new_tokens: usize,
    /// <= `max_new_tokens`.
    pub min_new_tokens: usize,
    pub decoding: Decoding,
    pub penalties: Penalties,
    /// In 1..=`SamplingLimits::max_n`.
    pub n: usize,
    /// Non-empty strings.
    pub stop_strings: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub no_stop_trim: bool,
    pub skip_special_tokens: bool,
    pub spaces_between_special_tokens: bool,
    /// The client's seed; without one the engine draws one per request ([`super::random_seed`]).
    pub seed: Option<u64>,
    _validated: (),
}

impl Default for ValidSamplingParams {
    /// The defaults of [`SamplingParams`] under the default limits.
    fn default() -> Self {
        SamplingParams::default()
            .validate(&SamplingLimits::default())
            .expect("the default sampling params are valid under the default limits")
    }
}

fn invalid(field: &'static str, expected: impl Into<String>, got: impl ToString) -> SamplingError {
    SamplingError::InvalidParam {
        field,
        expected: expected.into(),
        got: got.to_string(),
    }
}

/// `lo <= x <= hi`, false for NaN.
fn within(x: f64, lo: f64, hi: f64) -> bool {
    x >= lo && x <= hi
}

impl SamplingParams {
    /// Checks every field against SGLang's rules and `limits`, once; the error names the field
    /// and the limit it broke.
    pub fn validate(&self, limits: &SamplingLimits) -> Result<ValidSamplingParams, SamplingError> {
        let max_new_tokens = match self.max_new_tokens {
            None => limits.max_new_tokens,
            Some(v) if v >= 0 && v as u64 <= limits.max_new_tokens as u64 => v as usize,
            Some(v) => {
                return Err(invalid(
                    "max_new_tokens",
                    format!("an integer in [0, {}]", limits.max_new_tokens),
                    v,
                ))
            }
        };
        if !(self.min_new_tokens >= 0 && self.min_new_tokens as u64 <= max_new_tokens as u64) {
            return Err(invalid(
                "min_new_tokens",
                format!("an integer in [0, max_new_tokens = {max_new_tokens}]"),
                self.min_new_tokens,
            ));
        }
        let t = self.temperature;
        if !(t >= 0.0 && t.is_finite()) {
            return Err(invalid("temperature", "a finite number >= 0", t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", "in (0, 1]", self.top_p));
        }
        let top_k = match self.top_k {
            -1 => None,
            k if k >= 1 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
            k => return Err(invalid("top_k", "-1 (all tokens) or an integer >= 1", k)),
        };
        if !within(self.min_p, 0.0, 1.0) {
            return Err(invalid("min_p", "in [0, 1]", self.min_p));
        }
        if !within(self.frequency_penalty, -2.0, 2.0) {
            return Err(invalid(
                "frequency_penalty",
                "in [-2, 2]",
                self.frequency_penalty,
            ));
        }
        if !within(self.presence_penalty, -2.0, 2.0) {
            return Err(invalid(
                "presence_penalty",
                "in [-2, 2]",
                self.presence_penalty,
            ));
        }
        // Zero would divide positive logits by zero; the HF penalty has no upper bound.
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(invalid(
                "repetition_penalty",
                "a finite number > 0",
                self.repetition_penalty,
            ));
        }
        if !(self.n >= 1 && self.n as u64 <= limits.max_n as u64) {
            return Err(invalid(
                "n",
                format!("an integer in [1, {}]", limits.max_n),
                self.n,
            ));
        }
        if self.stop.len() > limits.max_stop_strings {
            return Err(invalid(
                "stop",
                format!("at most {} strings", limits.max_stop_strings),
                format!("{} strings", self.stop.len()),
            ));
        }
        for s in &self.stop {
            // An empty stop string would match before the first token.
            if s.is_empty() || s.len() > limits.max_stop_string_bytes {
                return Err(invalid(
                    "stop",
                    format!("strings of 1 to {} bytes", limits.max_stop_string_bytes),
                    format!("a string of {} bytes", s.len()),
                ));
            }
        }
        if self.stop_token_ids.len() > limits.max_stop_token_ids {
            return Err(invalid(
                "stop_token_ids",
                format!("at most {} ids", limits.max_stop_token_ids),
                format!("{} ids", self.stop_token_ids.len()),
            ));
        }
        let id_bound = limits.vocab_size.map_or(u32::MAX as u64 + 1, |v| v as u64);
        let mut stop_token_ids = Vec::with_capacity(self.stop_token_ids.len());
        for &id in &self.stop_token_ids {
            if !(id >= 0 && (id as u64) < id_bound) {
                return Err(invalid(
                    "stop_token_ids",
                    format!("token ids in [0, {id_bound})"),
                    id,
                ));
            }
            stop_token_ids.push(id as u32);
        }
        let decoding = if t < GREEDY_TEMPERATURE {
            Decoding::Greedy
        } else {
            Decoding::Sample {
                temperature: t as f32,
                top_k,
                top_p: self.top_p as f32,
                min_p: self.min_p as f32,
            }
        };
        Ok(ValidSamplingParams {
            max_new_tokens,
            min_new_tokens: self.min_new_tokens as usize,
            decoding,
            penalties: Penalties {
                repetition: self.repetition_penalty as f32,
                frequency: self.frequency_penalty as f32,
                presence: self.presence_penalty as f32,
            },
            n: self.n as usize,
            stop_strings: self.stop.clone(),
            stop_token_ids,
            ignore_eos: self.ignore_eos,
            no_stop_trim: self.no_stop_trim,
            skip_special_tokens: self.skip_special_tokens,
            spaces_between_special_tokens: self.spaces_between_special_tokens,
            seed: self.sampling_seed,
            _validated: (),
        })
    }
}

fn string_or_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Option::<OneOrMany>::deserialize(d)? {
        None => Vec::new(),
        Some(OneOrMany::One(s)) => vec![s],
        Some(OneOrMany::Many(v)) => v,
    })
}

fn null_as_empty<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<i64>, D::Error> {
    Ok(Option::<Vec<i64>>::deserialize(d)?.unwrap_or_default())
}

fn seed<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum AnyInt {
        Unsigned(u64),
        Signed(i64),
    }
    Ok(Option::<AnyInt>::deserialize(d)?.map(|v| match v {
        AnyInt::Unsigned(u) => u,
        AnyInt::Signed(i) => i as u64,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> SamplingParams {
        serde_json::from_str(json).unwrap()
    }

    fn err_of(p: SamplingParams) -> SamplingError {
        p.validate(&SamplingLimits::default()).unwrap_err()
    }

    fn field_of(e: &SamplingError) -> &'static str {
        match e {
            SamplingError::InvalidParam { field, .. } => field,
            other => panic!("not a parameter error: {other}"),
        }
    }

    #[test]
    fn empty_object_gives_sglang_defaults() {
        let p = parse("{}");
        assert_eq!(p, SamplingParams::default());
        assert_eq!(p.max_new_tokens, Some(128));
        let v = p.validate(&SamplingLimits::default()).unwrap();
        assert_eq!(v.max_new_tokens, 128);
        assert_eq!(v.n, 1);
        assert_eq!(
            v.decoding,
            Decoding::Sample {
                temperature: 1.0,
                top_k: None,
                top_p: 1.0,
                min_p: 0.0
            }
        );
        assert!(v.penalties.is_neutral());
        assert!(v.skip_special_tokens && v.spaces_between_special_tokens);
        assert!(!v.ignore_eos && !v.no_stop_trim);
        assert_eq!(v.seed, None);
        assert_eq!(v, ValidSamplingParams::default());
    }

    #[test]
    fn wire_shapes_parse() {
        let p = parse(
            r#"{"stop": "<END>", "stop_token_ids": null, "max_new_tokens": null,
                "sampling_seed": -1, "temperature": 0, "unknown_field": {"x": 1}, "regex": null}"#,
        );
        assert_eq!(p.stop, vec!["<END>".to_string()]);
        assert!(p.stop_token_ids.is_empty());
        assert_eq!(p.sampling_seed, Some(u64::MAX));
        let limits = SamplingLimits::default();
        let v = p.validate(&limits).unwrap();
        assert_eq!(v.max_new_tokens, limits.max_new_tokens);
        assert_eq!(v.decoding, Decoding::Greedy);

        let p = parse(
            r#"{"stop": null, "stop_token_ids": [7, 9], "sampling_seed": 18446744073709551615}"#,
        );
        assert!(p.stop.is_empty());
        assert_eq!(p.stop_token_ids, vec![7, 9]);
        assert_eq!(p.sampling_seed, Some(u64::MAX));
        let p = parse(r#"{"stop": ["a", "bc"], "top_k": 40, "temperature": 0.7}"#);
        assert_eq!(p.stop, vec!["a".to_string(), "bc".to_string()]);
        let v = p.validate(&SamplingLimits::default()).unwrap();
        assert_eq!(
            v.decoding,
            Decoding::Sample {
                temperature: 0.7,
                top_k: Some(40),
                top_p: 1.0,
                min_p: 0.0
            }
        );
    }

    #[test]
    fn greedy_threshold_is_exclusive() {
        let mut p = SamplingParams {
            temperature: 0.99e-6,
            ..Default::default()
        };
        assert_eq!(
            p.validate(&SamplingLimits::default()).unwrap().decoding,
            Decoding::Greedy
        );
        p.temperature = 1e-6;
        assert!(matches!(
            p.validate(&SamplingLimits::default()).unwrap().decoding,
            Decoding::Sample { .. }
        ));
    }

    #[test]
    fn every_error_names_the_field_and_the_limit() {
        let d = SamplingParams::default;
        let cases: Vec<(SamplingParams, &str, &str)> = vec![
            (
                SamplingParams {
                    temperature: -0.1,
                    ..d()
                },
                "temperature",
                ">= 0",
            ),
            (SamplingParams { top_p: 0.0, ..d() }, "top_p", "(0, 1]"),
            (SamplingParams { top_p: 1.5, ..d() }, "top_p", "(0, 1]"),
            (SamplingParams { top_k: 0, ..d() }, "top_k", "-1"),
            (SamplingParams { top_k: -2, ..d() }, "top_k", ">= 1"),
            (SamplingParams { min_p: -0.5, ..d() }, "min_p", "[0, 1]"),
            (SamplingParams { min_p: 1.5, ..d() }, "min_p", "[0, 1]"),
            (
                SamplingParams {
                    frequency_penalty: 2.5,
                    ..d()
                },
                "frequency_penalty",
                "[-2, 2]",
            ),
            (
                SamplingParams {
                    presence_penalty: -3.0,
                    ..d()
                },
                "presence_penalty",
                "[-2, 2]",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..d()
                },
                "repetition_penalty",
                "> 0",
            ),
            (SamplingParams { n: 0, ..d() }, "n", "[1, 128]"),
            (SamplingParams { n: 129, ..d() }, "n", "[1, 128]"),
            (
                SamplingParams {
                    max_new_tokens: Some(-1),
                    ..d()
                },
                "max_new_tokens",
                "[0, 32768]",
            ),
            (
                SamplingParams {
                    max_new_tokens: Some(40000),
                    ..d()
                },
                "max_new_tokens",
                "32768",
            ),
            (
                SamplingParams {
                    min_new_tokens: 200,
                    max_new_tokens: Some(100),
                    ..d()
                },
                "min_new_tokens",
                "max_new_tokens = 100",
            ),
            (
                SamplingParams {
                    min_new_tokens: -1,
                    ..d()
                },
                "min_new_tokens",
                "[0,",
            ),
            (
                SamplingParams {
                    stop: vec!["x".into(); 33],
                    ..d()
                },
                "stop",
                "at most 32",
            ),
            (
                SamplingParams {
                    stop: vec![String::new()],
                    ..d()
                },
                "stop",
                "1 to 512 bytes",
            ),
            (
                SamplingParams {
                    stop: vec!["y".repeat(513)],
                    ..d()
                },
                "stop",
                "512 bytes",
            ),
            (
                SamplingParams {
                    stop_token_ids: vec![-4],
                    ..d()
                },
                "stop_token_ids",
                "[0,",
            ),
            (
                SamplingParams {
                    stop_token_ids: vec![1; 257],
                    ..d()
                },
                "stop_token_ids",
                "at most 256",
            ),
        ];
        for (p, field, limit) in cases {
            let e = err_of(p.clone());
            assert_eq!(field_of(&e), field, "{p:?}");
            let msg = e.to_string();
            assert!(msg.starts_with(field), "{msg}");
            assert!(
                msg.contains(limit),
                "message `{msg}` lacks the limit `{limit}`"
            );
        }
    }

    #[test]
    fn stop_token_ids_are_checked_against_a_known_vocab() {
        let limits = SamplingLimits {
            vocab_size: Some(1000),
            ..Default::default()
        };
        let p = SamplingParams {
            stop_token_ids: vec![999],
            ..Default::default()
        };
        assert_eq!(p.validate(&limits).unwrap().stop_token_ids, vec![999]);
        let p = SamplingParams {
            stop_token_ids: vec![1000],
            ..Default::default()
        };
        let e = p.validate(&limits).unwrap_err();
        assert_eq!(
            e.to_string(),
            "stop_token_ids must be token ids in [0, 1000), got 1000"
        );
    }

    #[test]
    fn huge_top_k_means_all_and_serialization_round_trips() {
        let p = SamplingParams {
            top_k: i64::MAX,
            sampling_seed: Some(5),
            ..Default::default()
        };
        assert!(p.validate(&SamplingLimits::default()).is_ok());
        let back: SamplingParams =
            serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }
}
