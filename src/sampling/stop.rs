//! Deciding, after each generated token, whether the sequence is finished and why, and how
//! much of its text to return.
//!
//! SGLang's order and semantics (`Req.check_finished`):
//! 1. `max_new_tokens` reached -> length (even if that last token is EOS or completes a stop
//!    string);
//! 2. unless `ignore_eos`: an EOS id or one of `stop_token_ids` -> stop, matched = the id
//!    (SGLang's `ignore_eos` silences both);
//! 3. a stop string in the decoded output -> stop, matched = the string.
//!
//! No stop condition counts for a token at an output position below `min_new_tokens`, the
//! same positions whose EOS/stop-token logits [`super::mask_min_new_tokens`] masks.

use serde::Serialize;

use super::params::ValidSamplingParams;

/// Why a sequence finished, serialized exactly as SGLang's `meta_info.finish_reason`:
/// `{"type":"stop","matched":2}`, `{"type":"stop","matched":"###"}`,
/// `{"type":"length","length":128}`, `{"type":"abort","message":"..."}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Finish {
    Stop { matched: StopMatch },
    Length { length: usize },
    Abort { message: String },
}

/// What ended a sequence: a token id (EOS or a stop_token_id) or a stop string.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum StopMatch {
    Token(u32),
    Text(String),
}

/// The verdict on one generated token.
#[derive(Debug, Clone, PartialEq)]
pub enum StopStatus {
    Continue,
    /// `text_len`: how many bytes of the decoded text to return. With `no_stop_trim` false a
    /// stop string and everything after it is cut, and a stop token's own text is dropped
    /// (the text as it was before that token); otherwise the whole text.
    Finished {
        finish: Finish,
        text_len: usize,
    },
}

/// Per-sequence stop state. Call [`StopChecker::check`] once per generated token.
///
/// A request with `max_new_tokens == 0` generates nothing; the engine finishes it as
/// `Finish::Length { length: 0 }` without calling this.
#[derive(Debug, Clone)]
pub struct StopChecker {
    max_new_tokens: usize,
    min_new_tokens: usize,
    /// EOS ids and stop_token_ids, empty under ignore_eos.
    stop_ids: Vec<u32>,
    stop_strings: Vec<String>,
    no_stop_trim: bool,
    /// Longest stop string minus one byte: how far back into already searched text a match
    /// completed by new text can start.
    overlap: usize,
    generated: usize,
    searched_to: usize,
    prev_text_len: usize,
}

impl StopChecker {
    pub fn new(params: &ValidSamplingParams, eos_token_ids: &[u32]) -> Self {
        let stop_ids = if params.ignore_eos {
            Vec::new()
        } else {
            eos_token_ids
                .iter()
                .chain(&params.stop_token_ids)
                .copied()
                .collect()
        };
        let longest = params
            .stop_strings
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(0);
        Self {
            max_new_tokens: params.max_new_tokens,
            min_new_tokens: params.min_new_tokens,
            stop_ids,
            stop_strings: params.stop_strings.clone(),
            no_stop_trim: params.no_stop_trim,
            overlap: longest.saturating_sub(1),
            generated: 0,
            searched_to: 0,
            prev_text_len: 0,
        }
    }

    /// Number of tokens checked so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// `token` was just generated; `text` is the output decoded so far, including it (as the
    /// incremental detokenizer has it: append-only, possibly holding back a partial character).
    pub fn check(&mut self, token: u32, text: &str) -> StopStatus {
        self.generated += 1;
        let prev_text_len = std::mem::replace(&mut self.prev_text_len, text.len());
        if text.len() < self.searched_to {
            // The detokenizer rewrote earlier text; search it all again rather than miss a stop.
            self.searched_to = 0;
        }
        let mut start = self.searched_to.saturating_sub(self.overlap);
        while !text.is_char_boundary(start) {
            start -= 1;
        }
        self.searched_to = text.len();

        if self.generated >= self.max_new_tokens {
            let finish = Finish::Length {
                length: self.max_new_tokens,
            };
            return StopStatus::Finished {
                finish,
                text_len: text.len(),
            };
        }
        // This token sits at output position generated - 1.
        if self.generated <= self.min_new_tokens {
            return StopStatus::Continue;
        }
        if self.stop_ids.contains(&token) {
            let text_len = if self.no_stop_trim {
                text.len()
            } else {
                prev_text_len.min(text.len())
            };
            let finish = Finish::Stop {
                matched: StopMatch::Token(token),
            };
            return StopStatus::Finished { finish, text_len };
        }
        // The earliest match wins; at equal positions, the string listed first.
        let window = &text[start..];
        let found = self
            .stop_strings
            .iter()
            .filter_map(|s| window.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, s)) = found {
            let text_len = if self.no_stop_trim {
                text.len()
            } else {
                start + at
            };
            let finish = Finish::Stop {
                matched: StopMatch::Text(s.clone()),
            };
            return StopStatus::Finished { finish, text_len };
        }
        StopStatus::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::params::SamplingParams;

    const EOS: u32 = 2;

    fn checker(p: SamplingParams) -> StopChecker {
        StopChecker::new(&p.validate(&Default::default()).unwrap(), &[EOS])
    }

    /// Feeds (token, text piece) pairs; returns the status after each, stopping at the first
    /// finish, with the full text.
    fn run(c: &mut StopChecker, steps: &[(u32, &str)]) -> (Vec<StopStatus>, String) {
        let mut text = String::new();
        let mut out = Vec::new();
        for &(t, piece) in steps {
            text.push_str(piece);
            let s = c.check(t, &text);
            let done = s != StopStatus::Continue;
            out.push(s);
            if done {
                break;
            }
        }
        (out, text)
    }

    fn finished(s: &StopStatus) -> (&Finish, usize) {
        match s {
            StopStatus::Finished { finish, text_len } => (finish, *text_len),
            StopStatus::Continue => panic!("not finished"),
        }
    }

    #[test]
    fn finish_reasons_serialize_as_sglang() {
        let j = |f: Finish| serde_json::to_string(&f).unwrap();
        assert_eq!(
            j(Finish::Stop {
                matched: StopMatch::Token(2)
            }),
            r#"{"type":"stop","matched":2}"#
        );
        assert_eq!(
            j(Finish::Stop {
                matched: StopMatch::Text("###".into())
            }),
            "{\"type\":\"stop\",\"matched\":\"###\"}"
        );
        assert_eq!(
            j(Finish::Length { length: 128 }),
            r#"{"type":"length","length":128}"#
        );
        assert_eq!(
            j(Finish::Abort {
                message: "client gone".into()
            }),
            r#"{"type":"abort","message":"client gone"}"#
        );
    }

    #[test]
    fn length_after_max_new_tokens() {
        let mut c = checker(SamplingParams {
            max_new_tokens: Some(3),
            ..Default::default()
        });
        let (s, text) = run(&mut c, &[(5, "a"), (6, "b"), (7, "c"), (8, "d")]);
        assert_eq!(s.len(), 3);
        assert_eq!(finished(&s[2]), (&Finish::Length { length: 3 }, text.len()));
        assert_eq!(c.generated(), 3);
    }

    #[test]
    fn length_wins_over_eos_on_the_last_token() {
        let mut c = checker(SamplingParams {
            max_new_tokens: Some(2),
            ..Default::default()
        });
        let (s, _) = run(&mut c, &[(5, "a"), (EOS, "")]);
        assert_eq!(finished(&s[1]).0, &Finish::Length { length: 2 });
    }

    #[test]
    fn eos_and_stop_token_ids_stop_and_trim_their_text() {
        let mut c = checker(SamplingParams {
            stop_token_ids: vec![9],
            ..Default::default()
        });
        let (s, _) = run(&mut c, &[(5, "Hello"), (9, "<|im_end|>")]);
        assert_eq!(
            finished(&s[1]),
            (
                &Finish::Stop {
                    matched: StopMatch::Token(9)
                },
                5
            )
        );

        let mut c = checker(SamplingParams {
            no_stop_trim: true,
            ..Default::default()
        });
        let (s, text) = run(&mut c, &[(5, "Hi"), (EOS, "</s>")]);
        assert_eq!(
            finished(&s[1]),
            (
                &Finish::Stop {
                    matched: StopMatch::Token(EOS)
                },
                text.len()
            )
        );
    }

    #[test]
    fn ignore_eos_silences_eos_and_stop_token_ids_but_not_strings() {
        let mut c = checker(SamplingParams {
            ignore_eos: true,
            stop_token_ids: vec![9],
            stop: vec!["END".into()],
            max_new_tokens: Some(10),
            ..Default::default()
        });
        let (s, _) = run(&mut c, &[(EOS, ""), (9, "x"), (5, "E"), (6, "ND")]);
        assert_eq!(
            &s[..3],
            &[
                StopStatus::Continue,
                StopStatus::Continue,
                StopStatus::Continue
            ]
        );
        assert_eq!(
            finished(&s[3]),
            (
                &Finish::Stop {
                    matched: StopMatch::Text("END".into())
                },
                1
            )
        );
    }

    #[test]
    fn stop_strings_trim_before_the_match_even_across_tokens() {
        let p = SamplingParams {
            stop: vec!["\n\n".into(), "###".into()],
            ..Default::default()
        };
        let mut c = checker(p.clone());
        let (s, text) = run(
            &mut c,
            &[(5, "The answer"), (6, " is 4.#"), (7, "#"), (8, "# tail")],
        );
        assert_eq!(s.len(), 4);
        let (f, len) = finished(&s[3]);
        assert_eq!(
            f,
            &Finish::Stop {
                matched: StopMatch::Text("###".into())
            }
        );
        assert_eq!(&text[..len], "The answer is 4.");

        // no_stop_trim: the whole text, stop string and what followed it in the token.
        let mut c = checker(SamplingParams {
            no_stop_trim: true,
            ..p.clone()
        });
        let (s, text) = run(&mut c, &[(5, "a\n"), (6, "\nb")]);
        assert_eq!(
            finished(&s[1]),
            (
                &Finish::Stop {
                    matched: StopMatch::Text("\n\n".into())
                },
                text.len()
            )
        );

        // Two matches in one window: the earliest wins, whatever the list order.
        let mut c = checker(p);
        let (s, text) = run(&mut c, &[(5, "x###y\n\nz")]);
        let (f, len) = finished(&s[0]);
        assert_eq!(
            f,
            &Finish::Stop {
                matched: StopMatch::Text("###".into())
            }
        );
        assert_eq!(&text[..len], "x");
    }

    #[test]
    fn stop_strings_respect_char_boundaries() {
        let mut c = checker(SamplingParams {
            stop: vec!["éé".into()],
            ..Default::default()
        });
        let (s, text) = run(&mut c, &[(5, "日本"), (6, "語é"), (7, "é!")]);
        let (_, len) = finished(&s[2]);
        assert_eq!(&text[..len], "日本語");
    }

    #[test]
    fn min_new_tokens_defers_every_stop() {
        let mut c = checker(SamplingParams {
            min_new_tokens: 3,
            stop: vec!["STOP".into()],
            ..Default::default()
        });
        // Positions 0..2 may not stop: a stop string complete there is passed over, an EOS
        // forced there too; position 3 may.
        let (s, text) = run(
            &mut c,
            &[(5, "STOP"), (EOS, ""), (6, "x"), (7, "yST"), (8, "OPz")],
        );
        assert_eq!(
            &s[..4],
            &[
                StopStatus::Continue,
                StopStatus::Continue,
                StopStatus::Continue,
                StopStatus::Continue
            ]
        );
        let (f, len) = finished(&s[4]);
        assert_eq!(
            f,
            &Finish::Stop {
                matched: StopMatch::Text("STOP".into())
            }
        );
        assert_eq!(&text[..len], "STOPxy");

        let mut c = checker(SamplingParams {
            min_new_tokens: 1,
            ..Default::default()
        });
        let (s, _) = run(&mut c, &[(EOS, ""), (EOS, "")]);
        assert_eq!(s[0], StopStatus::Continue);
        assert_eq!(
            finished(&s[1]).0,
            &Finish::Stop {
                matched: StopMatch::Token(EOS)
            }
        );
    }
}
