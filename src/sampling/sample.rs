//! Choosing the next token from one processed row, and the logprobs reported with it.
//!
//! Definitions (the fast paths below give exactly these results):
//! - probabilities: `p_t = exp(l_t - max)` in f32 on the processed row (penalties, mask,
//!   temperature), normalized by `total = sum p_t` accumulated in f64 in the fixed order of
//!   [`fixed_order_sum`] (the device sampler's), so CPU and GPU logprobs have the same bits;
//! - order: probability descending, ties by token id ascending (a strict total order);
//! - kept set: tokens with `p > 0` and `p >= min_p * p_max` (min-p), at most the first
//!   `top_k` in that order, then the shortest prefix whose cumulative probability (over the
//!   full distribution) reaches `top_p`; the top token is always kept;
//! - draw: inverse CDF over the kept set walked in that order, target `u * mass` where `mass`
//!   is the kept probability summed in token-id order and `u` comes from [`super::uniform`];
//! - logprobs: `l_t - (max + ln(total))` of the processed row before truncation (SGLang's
//!   definition), `ln` being [`contract_ln`]; top-N sorted by logprob descending, ties by id.
//!
//! A 150k vocabulary is never fully sorted when a partial selection suffices: the order is
//! materialized lazily, `select_nth_unstable` of a growing head then a sort of that head.

use super::params::{Decoding, ValidSamplingParams};
use super::process::{apply_penalties, apply_temperature, mask_min_new_tokens, TokenHistory};
use super::rng::uniform;
use super::SamplingError;

/// Everything [`sample`] needs about the sequence besides its logits row.
#[derive(Debug, Clone, Copy)]
pub struct SampleInput<'a> {
    pub params: &'a ValidSamplingParams,
    pub history: &'a TokenHistory,
    /// The model's EOS ids (masked while `min_new_tokens` is not reached).
    pub eos_token_ids: &'a [u32],
    /// The request's `sampling_seed`, or one drawn once per request by [`super::random_seed`].
    pub seed: u64,
    /// Which of the request's `n` samples this sequence is (0-based).
    pub sample_index: u32,
    /// How many alternatives to report (`top_logprobs_num`); 0 for none.
    pub top_logprobs_num: usize,
    /// Whether the chosen token's logprob is wanted (`return_logprob`). A greedy row without
    /// it and without alternatives skips the normalizer and reports a logprob of 0: the same
    /// token and the same errors, a walk over the row fewer.
    pub logprob: bool,
}

/// A chosen (or, for prompts, actual) token with its logprob and the top-N alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// `(token_id, logprob)`, logprob descending, ties by token id.
    pub top: Vec<(u32, f32)>,
}

/// Buffers reused across calls so a step over a batch does not allocate two vocab-sized
/// vectors per row. Holds no state that affects results.
#[derive(Debug, Default)]
pub struct SamplerScratch {
    probs: Vec<f32>,
    keys: Vec<u64>,
}

/// Processes `logits` in place (penalties, min_new_tokens mask, temperature) and chooses the
/// token at output position `history.output_len()`. The result depends only on this row, the
/// params, the history and (seed, sample_index, position).
pub fn sample(
    logits: &mut [f32],
    input: &SampleInput<'_>,
    scratch: &mut SamplerScratch,
) -> Result<TokenLogprobs, SamplingError> {
    let params = input.params;
    apply_penalties(logits, &params.penalties, input.history);
    mask_min_new_tokens(logits, params, input.history, input.eos_token_ids);
    apply_temperature(logits, &params.decoding);
    let (token, norm) = match params.decoding {
        Decoding::Greedy if !input.logprob && input.top_logprobs_num == 0 => {
            let max = checked_max(logits)?;
            return Ok(TokenLogprobs {
                token: first_max(logits, max),
                logprob: 0.0,
                top: Vec::new(),
            });
        }
        Decoding::Greedy => {
            let norm = Normalizer::of(logits, None)?;
            (first_max(logits, norm.max), norm)
        }
        Decoding::Sample {
            top_k,
            top_p,
            min_p,
            ..
        } => {
            let norm = Normalizer::of(logits, Some(&mut scratch.probs))?;
            let position = input.history.output_len() as u64;
            let u = uniform(input.seed, input.sample_index as u64, position);
            let truncation = Truncation {
                top_k,
                top_p,
                min_p,
            };
            let mut kept = Kept::select(&scratch.probs, norm.total, &truncation, &mut scratch.keys);
            (kept.draw(u), norm)
        }
    };
    Ok(TokenLogprobs {
        token,
        logprob: norm.logprob(logits[token as usize]),
        top: top_logprobs(logits, &norm, input.top_logprobs_num, &mut scratch.keys),
    })
}

/// The logprob of `next_token` under a raw logits row (no penalties, no temperature: SGLang's
/// `input_token_logprobs`) and the row's top-N.
pub fn prompt_logprobs(
    logits: &[f32],
    next_token: u32,
    top_n: usize,
) -> Result<TokenLogprobs, SamplingError> {
    if next_token as usize >= logits.len() {
        return Err(SamplingError::TokenOutOfVocab {
            token: next_token,
            vocab: logits.len(),
        });
    }
    let norm = Normalizer::of(logits, None)?;
    let mut keys = Vec::new();
    Ok(TokenLogprobs {
        token: next_token,
        logprob: norm.logprob(logits[next_token as usize]),
        top: top_logprobs(logits, &norm, top_n, &mut keys),
    })
}

/// The row's largest logit. Rejects NaN and +inf (a broken model, reported rather than sampled
/// around; the first such token) and rows with nothing finite.
fn checked_max(logits: &[f32]) -> Result<f32, SamplingError> {
    let mut max = f32::NEG_INFINITY;
    for (t, &l) in logits.iter().enumerate() {
        if l.is_nan() || l == f32::INFINITY {
            return Err(SamplingError::NonFiniteLogit {
                token: t as u32,
                value: l,
            });
        }
        max = max.max(l);
    }
    if max == f32::NEG_INFINITY {
        return Err(SamplingError::NoCandidates);
    }
    Ok(max)
}

/// The greedy token: the first position holding `max` (ties go to the lowest id).
fn first_max(logits: &[f32], max: f32) -> u32 {
    logits
        .iter()
        .position(|&l| l == max)
        .expect("max is an element") as u32
}

/// The softmax normalizer of a row.
struct Normalizer {
    max: f32,
    /// `sum exp(l - max)` over the row, in f64, in [`fixed_order_sum`]'s order.
    total: f64,
    /// `max + contract_ln(total)`.
    lse: f64,
}

impl Normalizer {
    /// Rejects what [`checked_max`] rejects. When `probs` is given it receives `exp(l - max)`
    /// per token.
    fn of(logits: &[f32], probs: Option<&mut Vec<f32>>) -> Result<Self, SamplingError> {
        let max = checked_max(logits)?;
        let total: f64 = match probs {
            Some(probs) => {
                probs.clear();
                probs.extend(logits.iter().map(|&l| (l - max).exp()));
                fixed_order_sum(probs.iter().map(|&p| p as f64))
            }
            None => fixed_order_sum(logits.iter().map(|&l| (l - max).exp() as f64)),
        };
        Ok(Self {
            max,
            total,
            lse: max as f64 + contract_ln(total),
        })
    }

    fn logprob(&self, logit: f32) -> f32 {
        // + 0.0 folds a -0.0 into 0.0, so equal logprobs tie (and break by id) in top-N.
        (logit as f64 - self.lse) as f32 + 0.0
    }
}

/// Lanes of [`fixed_order_sum`]: kernels/sampling.cu `SAMPLE_THREADS`.
const SUM_LANES: usize = 512;

/// `sum p` in the one order both the CPU and the device sampler (kernels/sampling.cu, a block of
/// 512 threads per row) add it: lane i sums p[i], p[i + 512], ... in turn; within each warp of
/// 32 lanes, lane l adds lane l + o for o = 16, 8, 4, 2, 1 (lane 0 keeps the warp's sum); the
/// 16 warps' sums are then added in warp order. The same f64 additions in the same order give
/// the same bits on both.
pub fn fixed_order_sum(p: impl Iterator<Item = f64>) -> f64 {
    let mut lane = [0f64; SUM_LANES];
    for (t, v) in p.enumerate() {
        lane[t % SUM_LANES] += v;
    }
    let mut total = 0.0;
    for warp in lane.chunks_mut(32) {
        let mut o = 16;
        while o > 0 {
            for l in 0..o {
                warp[l] += warp[l + o];
            }
            o /= 2;
        }
        total += warp[0];
    }
    total
}

/// `ln x` for the softmax normalizer (x >= 1, finite), built from correctly rounded operations
/// only (IEEE +, -, *, / and fused multiply-add), so the device sampler's copy
/// (kernels/sampling.cu `contract_ln`) gives the same bits where a libm `log` would not.
/// Within a few ulp of the true value: x = 2^e m with m in [sqrt(1/2), sqrt(2)), and
/// ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.172, by its series to s^21.
pub fn contract_ln(x: f64) -> f64 {
    const SQRT_2: u64 = 0x3ff6_a09e_667f_3bcd;
    const LN_2: u64 = 0x3fe6_2e42_fefa_39ef;
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & ((1u64 << 52) - 1)) | (1023u64 << 52));
    if m > f64::from_bits(SQRT_2) {
        m *= 0.5;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    // Horner over 1 / (2k + 1), k = 10 down to 0.
    let mut poly: f64 = 1.0 / 21.0;
    for k in (0..10).rev() {
        poly = poly.mul_add(s2, 1.0 / (2 * k + 1) as f64);
    }
    (e as f64).mul_add(f64::from_bits(LN_2), (2.0 * s) * poly)
}

/// The `n` highest logprobs of the row, descending, ties by id.
fn top_logprobs(
    logits: &[f32],
    norm: &Normalizer,
    n: usize,
    keys: &mut Vec<u64>,
) -> Vec<(u32, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    keys.clear();
    keys.extend(
        logits
            .iter()
            .enumerate()
            .map(|(t, &l)| pack(descending_f32(norm.logprob(l)), t as u32)),
    );
    if n < keys.len() {
        keys.select_nth_unstable(n - 1);
    }
    let head = &mut keys[..n];
    head.sort_unstable();
    head.iter()
        .map(|&k| {
            let t = token_of(k);
            (t, norm.logprob(logits[t as usize]))
        })
        .collect()
}

/// The truncation part of [`Decoding::Sample`].
#[derive(Debug, Clone, Copy)]
struct Truncation {
    top_k: Option<usize>,
    top_p: f32,
    min_p: f32,
}

// Candidates are sorted as packed u64 keys, (descending value, ascending id), so the canonical
// order is plain integer order: no indirection or float compare in the hot sort.

/// A u32 whose ascending order is the descending order of `x` (IEEE total order).
#[inline]
fn descending_f32(x: f32) -> u32 {
    let b = x.to_bits();
    let ascending = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    !ascending
}

#[inline]
fn pack(rank: u32, token: u32) -> u64 {
    (rank as u64) << 32 | token as u64
}

#[inline]
fn token_of(key: u64) -> u32 {
    key as u32
}

/// Smallest head sorted at once: most draws end within the first few dozen tokens.
const MIN_SORTED_HEAD: usize = 64;

/// The kept set of one row: `keys[..len]`, of which `keys[..sorted]` is already in the
/// canonical order and holds the `sorted` most probable kept tokens.
struct Kept<'a> {
    probs: &'a [f32],
    keys: &'a mut Vec<u64>,
    len: usize,
    sorted: usize,
    /// Kept probability mass (unnormalized), summed in token-id order.
    mass: f64,
}

impl<'a> Kept<'a> {
    fn select(probs: &'a [f32], total: f64, tr: &Truncation, keys: &'a mut Vec<u64>) -> Self {
        // probs are exp(l - max), so the most probable token has exactly 1 and min-p's
        // threshold `min_p * p_max` is min_p itself. Zero-probability tokens (masked or
        // underflowed) could never be drawn, so they are not candidates.
        keys.clear();
        keys.extend(
            probs
                .iter()
                .enumerate()
                .filter(|&(_, &p)| p > 0.0 && p >= tr.min_p)
                .map(|(t, &p)| pack(descending_f32(p), t as u32)),
        );
        // Still in token-id order here.
        let all_mass: f64 = keys
            .iter()
            .map(|&k| probs[token_of(k) as usize] as f64)
            .sum();
        let candidates = keys.len();
        let mut kept = Kept {
            probs,
            keys,
            len: candidates,
            sorted: 0,
            mass: all_mass,
        };
        if let Some(k) = tr.top_k {
            if k < kept.len {
                kept.keys.select_nth_unstable(k - 1);
                kept.len = k;
            }
        }
        if tr.top_p < 1.0 {
            let threshold = tr.top_p as f64 * total;
            let mut cum = 0.0f64;
            let mut r = 0;
            while r < kept.len {
                cum += kept.prob_at(r) as f64;
                r += 1;
                if cum >= threshold {
                    break;
                }
            }
            kept.len = r;
        }
        kept.sorted = kept.sorted.min(kept.len);
        if kept.len < candidates {
            let mut in_id_order: Vec<u32> =
                kept.keys[..kept.len].iter().map(|&k| token_of(k)).collect();
            in_id_order.sort_unstable();
            kept.mass = in_id_order.iter().map(|&t| probs[t as usize] as f64).sum();
        }
        kept
    }

    /// The probability of the kept token of rank `r` in canonical order.
    fn prob_at(&mut self, r: usize) -> f32 {
        self.ensure_sorted(r + 1);
        self.probs[token_of(self.keys[r]) as usize]
    }

    /// Makes `keys[..n]` the `n` most probable kept tokens in canonical order, sorting a head
    /// at least twice as long as the last so repeated calls cost O(V log V) at worst.
    fn ensure_sorted(&mut self, n: usize) {
        if n <= self.sorted {
            return;
        }
        let mut want = n.max(2 * self.sorted).max(MIN_SORTED_HEAD).min(self.len);
        if want > self.len / 4 {
            // Past a quarter, one sort of the rest is cheaper than more selections.
            want = self.len;
        }
        let rest = &mut self.keys[self.sorted..self.len];
        let m = want - self.sorted;
        if m < rest.len() {
            rest.select_nth_unstable(m - 1);
        }
        rest[..m].sort_unstable();
        self.sorted = want;
    }

    /// Inverse CDF: the first kept token, in canonical order, whose cumulative probability
    /// exceeds `u * mass`.
    fn draw(&mut self, u: f64) -> u32 {
        let target = u * self.mass;
        let mut cum = 0.0f64;
        for r in 0..self.len {
            cum += self.prob_at(r) as f64;
            if cum > target {
                return token_of(self.keys[r]);
            }
        }
        // Only rounding gets here (the walk sums in another order than `mass`): the last
        // kept token, which has p > 0.
        token_of(self.keys[self.len - 1])
    }

    /// The kept tokens in canonical order.
    #[cfg(test)]
    fn tokens(&mut self) -> Vec<u32> {
        self.ensure_sorted(self.len);
        self.keys[..self.len].iter().map(|&k| token_of(k)).collect()
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
    fn contract_ln_is_within_a_few_ulp_of_libm() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut xs = vec![1.0, 2.0, std::f64::consts::SQRT_2, 151_936.0];
        for _ in 0..20_000 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Normalizers lie in [1, vocab]: log-uniform over [1, 2^18).
            let u = (state >> 11) as f64 / (1u64 << 53) as f64;
            xs.push((u * 18.0 * std::f64::consts::LN_2).exp());
        }
        for x in xs {
            let (got, want) = (contract_ln(x), x.ln());
            let ulp = f64::EPSILON * want.abs().max(f64::MIN_POSITIVE);
            assert!(
                (got - want).abs() <= 4.0 * ulp.max(1e-300),
                "ln {x}: {got} vs {want}"
            );
        }
        assert_eq!(contract_ln(1.0), 0.0);
    }

    #[test]
    fn fixed_order_sum_adds_lanes_then_each_warp_by_halves_then_the_warps() {
        // Integers: every order gives the exact sum.
        let ints: Vec<f64> = (0..1500).map(|i| (i % 37) as f64).collect();
        assert_eq!(
            fixed_order_sum(ints.iter().copied()),
            ints.iter().sum::<f64>()
        );
        // 1 + 2^-53 + 2^-53: added left to right both halves are lost; the tree adds lanes 16
        // and 0 first (losing one), then lane 8's 2^-53 into lane 0 is lost too, unless lanes 8
        // and 24 meet first: lane 8 = 2^-53, lane 24 = 2^-53 give 2^-52, which survives.
        let tiny = f64::EPSILON / 2.0;
        let mut p = vec![0.0; 32];
        p[0] = 1.0;
        p[8] = tiny;
        p[24] = tiny;
        assert_eq!(p.iter().sum::<f64>(), 1.0);
        assert_eq!(fixed_order_sum(p.into_iter()), 1.0 + f64::EPSILON);
        // Lanes wrap at 512: tokens 0 and 512 share lane 0 and are added before lane 16's 1.
        let mut q = vec![0.0; 513];
        q[0] = tiny;
        q[16] = 1.0;
        q[512] = tiny;
        assert_eq!(q.iter().sum::<f64>(), 1.0);
        assert_eq!(fixed_order_sum(q.into_iter()), 1.0 + f64::EPSILON);
    }

    fn input<'a>(
        params: &'a ValidSamplingParams,
        history: &'a TokenHistory,
        seed: u64,
    ) -> SampleInput<'a> {
        SampleInput {
            params,
            history,
            eos_token_ids: &[],
            seed,
            sample_index: 0,
            top_logprobs_num: 0,
            logprob: true,
        }
    }

    fn softmax(l: &[f32]) -> Vec<f64> {
        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = l.iter().map(|&x| (x as f64 - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    /// Deterministic pseudo-random numbers for test data, from the module's own RNG.
    fn test_uniforms(seed: u64, n: usize) -> Vec<f64> {
        (0..n as u64).map(|i| uniform(seed, 999, i)).collect()
    }

    /// The kept set in canonical order, via the fast path.
    fn kept_set(probs: &[f32], tr: Truncation) -> Vec<u32> {
        let total: f64 = probs.iter().map(|&p| p as f64).sum();
        let mut keys = Vec::new();
        Kept::select(probs, total, &tr, &mut keys).tokens()
    }

    /// The definition in the module doc, by a full sort: what the fast path must equal.
    fn reference_draw(probs: &[f32], tr: Truncation, u: f64) -> u32 {
        let total: f64 = probs.iter().map(|&p| p as f64).sum();
        let mut order: Vec<u32> = (0..probs.len() as u32).collect();
        // Probability descending, ties by token id ascending.
        order.sort_by(|&a, &b| {
            probs[b as usize]
                .total_cmp(&probs[a as usize])
                .then(a.cmp(&b))
        });
        let mut kept: Vec<u32> = order
            .into_iter()
            .filter(|&t| probs[t as usize] > 0.0 && probs[t as usize] >= tr.min_p)
            .collect();
        if let Some(k) = tr.top_k {
            kept.truncate(k);
        }
        if tr.top_p < 1.0 {
            let mut cum = 0.0f64;
            let cut = kept
                .iter()
                .position(|&t| {
                    cum += probs[t as usize] as f64;
                    cum >= tr.top_p as f64 * total
                })
                .map_or(kept.len(), |r| r + 1);
            kept.truncate(cut);
        }
        let mut by_id = kept.clone();
        by_id.sort();
        let mass: f64 = by_id.iter().map(|&t| probs[t as usize] as f64).sum();
        let mut cum = 0.0f64;
        for &t in &kept {
            cum += probs[t as usize] as f64;
            if cum > u * mass {
                return t;
            }
        }
        *kept.last().unwrap()
    }

    fn probs_of(logits: &[f32]) -> Vec<f32> {
        let mut probs = Vec::new();
        Normalizer::of(logits, Some(&mut probs)).unwrap();
        probs
    }

    #[test]
    fn greedy_picks_the_argmax_lowest_id_on_ties() {
        let params = valid(SamplingParams {
            temperature: 0.0,
            ..Default::default()
        });
        let h = TokenHistory::new(&[]);
        let mut s = SamplerScratch::default();
        let mut l = vec![0.1f32, 2.0, -1.0, 2.0, 1.9];
        let out = sample(&mut l, &input(&params, &h, 1), &mut s).unwrap();
        assert_eq!(out.token, 1);
        // Greedy logprobs are of the unscaled row.
        let want = softmax(&[0.1, 2.0, -1.0, 2.0, 1.9])[1].ln();
        assert!((out.logprob as f64 - want).abs() < 1e-6);
        // Any seed, any position: greedy does not draw.
        for seed in 0..20 {
            let mut l = vec![0.1f32, 2.0, -1.0, 2.0, 1.9];
            assert_eq!(
                sample(&mut l, &input(&params, &h, seed), &mut s)
                    .unwrap()
                    .token,
                1
            );
        }
    }

    #[test]
    fn greedy_without_logprobs_takes_the_same_token_and_reports_the_same_errors() {
        let params = valid(SamplingParams {
            temperature: 0.0,
            repetition_penalty: 1.5,
            min_new_tokens: 2,
            ..Default::default()
        });
        let h = TokenHistory::new(&[3, 7]);
        let mut s = SamplerScratch::default();
        let u = test_uniforms(11, 4000);
        let mut rows: Vec<Vec<f32>> = (0..40)
            .map(|r| {
                u[r * 100..][..100]
                    .iter()
                    // A coarse grid: ties for the maximum in most rows.
                    .map(|x| (x * 6.0).floor() as f32 - 2.0)
                    .collect()
            })
            .collect();
        rows[0][5] = f32::NAN;
        rows[1][9] = f32::INFINITY;
        rows[2] = vec![f32::NEG_INFINITY; 100];
        rows[3][0] = -0.0;
        rows[3][1] = 0.0;
        for (r, row) in rows.iter().enumerate() {
            let with = SampleInput {
                eos_token_ids: &[4],
                ..input(&params, &h, r as u64)
            };
            let without = SampleInput {
                logprob: false,
                ..with
            };
            let a = sample(&mut row.clone(), &with, &mut s);
            let b = sample(&mut row.clone(), &without, &mut s);
            match (a, b) {
                (Ok(a), Ok(b)) => {
                    assert_eq!(a.token, b.token, "row {r}");
                    assert_eq!(b.logprob, 0.0, "row {r}: no logprob asked");
                    assert!(b.top.is_empty());
                }
                (Err(a), Err(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}"), "row {r}"),
                (a, b) => panic!("row {r}: with logprob {a:?}, without {b:?}"),
            }
        }
        // Alternatives still need the normalizer: a top-N row reports its logprob.
        let top = SampleInput {
            logprob: false,
            top_logprobs_num: 2,
            ..input(&params, &h, 0)
        };
        let out = sample(&mut rows[5].clone(), &top, &mut s).unwrap();
        assert!(out.logprob < 0.0 && out.top.len() == 2);
    }

    #[test]
    fn greedy_sees_penalties() {
        let params = valid(SamplingParams {
            temperature: 0.0,
            repetition_penalty: 2.0,
            ..Default::default()
        });
        let h = TokenHistory::new(&[0]);
        let mut l = vec![3.0f32, 2.0];
        let out = sample(
            &mut l,
            &input(&params, &h, 0),
            &mut SamplerScratch::default(),
        )
        .unwrap();
        assert_eq!(out.token, 1, "3 / 2 = 1.5 < 2");
    }

    #[test]
    fn seeded_draws_are_pure_functions_of_seed_index_position() {
        let params = valid(SamplingParams {
            temperature: 1.3,
            top_p: 0.95,
            ..Default::default()
        });
        let logits: Vec<f32> = test_uniforms(5, 500)
            .iter()
            .map(|u| (u * 8.0) as f32)
            .collect();
        let draw = |seed: u64, index: u32, history: &TokenHistory, scratch: &mut SamplerScratch| {
            let mut l = logits.clone();
            let inp = SampleInput {
                sample_index: index,
                ..input(&params, history, seed)
            };
            sample(&mut l, &inp, scratch).unwrap().token
        };
        let mut fresh = SamplerScratch::default();
        // A scratch that has served other rows of another size first, as in a batch.
        let mut used = SamplerScratch::default();
        for other in [vec![1.0f32; 3], vec![0.5f32; 2000]] {
            let mut o = other.clone();
            sample(
                &mut o,
                &input(&params, &TokenHistory::new(&[]), 77),
                &mut used,
            )
            .unwrap();
        }
        let mut h = TokenHistory::new(&[1, 2, 3]);
        let (mut same_seed_diff_index, mut diff_seed) = (0, 0);
        let positions = 400;
        for _ in 0..positions {
            let a = draw(11, 0, &h, &mut fresh);
            assert_eq!(a, draw(11, 0, &h, &mut used));
            same_seed_diff_index += (draw(11, 1, &h, &mut fresh) != a) as usize;
            diff_seed += (draw(12, 0, &h, &mut fresh) != a) as usize;
            h.push(a);
        }
        // Two independent draws from a 500-token, high-entropy distribution rarely agree;
        // if seeds or indices were ignored they would always agree.
        assert!(
            same_seed_diff_index > positions * 9 / 10,
            "{same_seed_diff_index}"
        );
        assert!(diff_seed > positions * 9 / 10, "{diff_seed}");
    }

    #[test]
    fn empirical_frequencies_match_softmax() {
        let logits = [1.0f32, 0.0, -1.0, 2.0, 0.5, -3.0, 1.5, 0.0];
        let temperature = 0.8f32;
        let scaled: Vec<f32> = logits.iter().map(|l| l / temperature).collect();
        let p = softmax(&scaled);
        let params = valid(SamplingParams {
            temperature: 0.8,
            ..Default::default()
        });
        let mut scratch = SamplerScratch::default();
        let n = 200_000usize;
        let mut counts = [0usize; 8];
        // Position-only history: the counter, not the content, moves the draw.
        let seed = 2024;
        let probs = probs_of(&scaled);
        let total: f64 = probs.iter().map(|&x| x as f64).sum();
        let tr = Truncation {
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
        };
        for pos in 0..n as u64 {
            let mut ids = Vec::new();
            let t = Kept::select(&probs, total, &tr, &mut ids).draw(uniform(seed, 0, pos));
            counts[t as usize] += 1;
        }
        // The same through `sample`, on a subset of positions (it needs a history per position).
        let mut h = TokenHistory::new(&[]);
        for pos in 0..2000u64 {
            let mut l = logits.to_vec();
            let t = sample(&mut l, &input(&params, &h, seed), &mut scratch)
                .unwrap()
                .token;
            let mut ids = Vec::new();
            assert_eq!(
                t,
                Kept::select(&probs, total, &tr, &mut ids).draw(uniform(seed, 0, pos))
            );
            h.push(t);
        }
        // Each count is Binomial(n, p_t), sd = sqrt(n p (1 - p)) (~200 for p ~ 0.3). A correct
        // sampler leaves a 5-sd band with probability ~6e-7 per token; a misordered CDF or
        // a wrong temperature moves counts by thousands. The chi-square statistic catches
        // smaller biases spread over several tokens.
        let mut chi2 = 0.0;
        for t in 0..8 {
            let expect = n as f64 * p[t];
            let sd = (n as f64 * p[t] * (1.0 - p[t])).sqrt();
            let dev = counts[t] as f64 - expect;
            assert!(
                dev.abs() < 5.0 * sd.max(1.0),
                "token {t}: {} vs {expect:.0}",
                counts[t]
            );
            chi2 += dev * dev / expect.max(1e-9);
        }
        // 7 degrees of freedom: P(chi2 > 30) ~ 1e-4.
        assert!(chi2 < 30.0, "chi2 = {chi2}");
    }

    #[test]
    fn truncation_keeps_the_expected_sets() {
        // Probabilities (unnormalized, max 1): token: 0:0.1 1:1.0 2:0.5 3:0.25 4:0.5 5:0.05
        let probs = [0.1f32, 1.0, 0.5, 0.25, 0.5, 0.05];
        let total = 2.4f64;
        let all = Truncation {
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
        };
        assert_eq!(kept_set(&probs, all), vec![1, 2, 4, 3, 0, 5]);
        // top-k, ties (2 and 4 at 0.5) broken by id.
        assert_eq!(
            kept_set(
                &probs,
                Truncation {
                    top_k: Some(2),
                    ..all
                }
            ),
            vec![1, 2]
        );
        assert_eq!(
            kept_set(
                &probs,
                Truncation {
                    top_k: Some(1),
                    ..all
                }
            ),
            vec![1]
        );
        assert_eq!(
            kept_set(
                &probs,
                Truncation {
                    top_k: Some(100),
                    ..all
                }
            )
            .len(),
            6
        );
        // top-p: cumulative 1.0, 1.5, 2.0, 2.25, 2.35, 2.4 of 2.4.
        let cut = |p: f64| {
            kept_set(
                &probs,
                Truncation {
                    top_p: p as f32,
                    ..all
                },
            )
        };
        assert_eq!(cut(0.1), vec![1], "the top token is always kept");
        assert_eq!(cut(1.0 / total), vec![1], "reaching top_p exactly stops");
        assert_eq!(cut(1.01 / total), vec![1, 2]);
        assert_eq!(cut(2.0 / total - 1e-6), vec![1, 2, 4]);
        assert_eq!(cut(2.3 / total), vec![1, 2, 4, 3, 0]);
        // min-p relative to the top probability.
        let mp = |m: f32| kept_set(&probs, Truncation { min_p: m, ..all });
        assert_eq!(mp(0.5), vec![1, 2, 4]);
        assert_eq!(mp(0.51), vec![1]);
        assert_eq!(mp(0.1), vec![1, 2, 4, 3, 0]);
        assert_eq!(mp(1.0), vec![1]);
        // Combined: the intersection of the prefixes.
        let both = Truncation {
            top_k: Some(4),
            top_p: 0.8,
            min_p: 0.2,
        };
        assert_eq!(kept_set(&probs, both), vec![1, 2, 4]);
        // Zero-probability (masked) tokens are never kept.
        assert_eq!(kept_set(&[0.0, 1.0, 0.0], all), vec![1]);
    }

    #[test]
    fn draws_stay_inside_the_kept_set() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let params = valid(SamplingParams {
            top_k: 5,
            temperature: 2.0,
            ..Default::default()
        });
        let allowed = {
            let probs = probs_of(&logits.iter().map(|l| l / 2.0).collect::<Vec<_>>());
            kept_set(
                &probs,
                Truncation {
                    top_k: Some(5),
                    top_p: 1.0,
                    min_p: 0.0,
                },
            )
        };
        assert_eq!(allowed, vec![6, 13, 20, 27, 34]);
        let mut seen = std::collections::BTreeSet::new();
        let mut s = SamplerScratch::default();
        for seed in 0..300 {
            let mut l = logits.clone();
            let h = TokenHistory::new(&[]);
            seen.insert(
                sample(&mut l, &input(&params, &h, seed), &mut s)
                    .unwrap()
                    .token,
            );
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), allowed);
    }

    #[test]
    fn partial_selection_equals_the_full_sort_definition() {
        // Logits on a coarse grid give many exact ties, the hard case for a partial order.
        let mut i = 0u64;
        let mut next = || {
            i += 1;
            uniform(3, 999, i)
        };
        for case in 0..60 {
            let v = [3usize, 17, 100, 700, 3000][case % 5];
            let logits: Vec<f32> = (0..v)
                .map(|_| {
                    if next() < 0.1 {
                        f32::NEG_INFINITY
                    } else {
                        (next() * 12.0).floor() as f32 * 0.5
                    }
                })
                .collect();
            if logits.iter().all(|l| *l == f32::NEG_INFINITY) {
                continue;
            }
            let probs = probs_of(&logits);
            let tr = Truncation {
                top_k: if next() < 0.5 {
                    None
                } else {
                    Some(1 + (next() * v as f64) as usize)
                },
                top_p: if next() < 0.4 {
                    1.0
                } else {
                    next().max(0.01) as f32
                },
                min_p: if next() < 0.6 {
                    0.0
                } else {
                    (next() * 0.3) as f32
                },
            };
            let total: f64 = probs.iter().map(|&p| p as f64).sum();
            for _ in 0..20 {
                let u = next();
                let mut ids = Vec::new();
                let fast = Kept::select(&probs, total, &tr, &mut ids).draw(u);
                assert_eq!(
                    fast,
                    reference_draw(&probs, tr, u),
                    "case {case} {tr:?} u={u}"
                );
            }
        }
    }

    #[test]
    fn large_vocab_matches_the_reference() {
        let v = 151_936;
        let logits: Vec<f32> = test_uniforms(8, v)
            .iter()
            .map(|u| (u * 20.0) as f32)
            .collect();
        let probs = probs_of(&logits);
        let total: f64 = probs.iter().map(|&p| p as f64).sum();
        for tr in [
            Truncation {
                top_k: None,
                top_p: 1.0,
                min_p: 0.0,
            },
            Truncation {
                top_k: Some(50),
                top_p: 0.9,
                min_p: 0.0,
            },
            Truncation {
                top_k: None,
                top_p: 0.95,
                min_p: 0.0,
            },
            Truncation {
                top_k: None,
                top_p: 1.0,
                min_p: 0.05,
            },
        ] {
            for u in [0.0, 0.3, 0.999_999] {
                let mut ids = Vec::new();
                let fast = Kept::select(&probs, total, &tr, &mut ids).draw(u);
                assert_eq!(fast, reference_draw(&probs, tr, u), "{tr:?} u={u}");
            }
        }
    }

    #[test]
    fn logprobs_are_log_softmax_before_truncation() {
        let raw: Vec<f32> = test_uniforms(9, 1000)
            .iter()
            .map(|u| (u * 10.0 - 5.0) as f32)
            .collect();
        let params = valid(SamplingParams {
            temperature: 0.7,
            top_k: 1,
            presence_penalty: 0.5,
            ..Default::default()
        });
        let mut h = TokenHistory::new(&[]);
        h.push(3);
        let mut l = raw.clone();
        let inp = SampleInput {
            top_logprobs_num: 1000,
            logprob: true,
            ..input(&params, &h, 4)
        };
        let out = sample(&mut l, &inp, &mut SamplerScratch::default()).unwrap();
        // The processed row: presence penalty on token 3, then temperature.
        let mut expect = raw.clone();
        expect[3] -= 0.5;
        let expect: Vec<f32> = expect.iter().map(|x| x / 0.7).collect();
        assert_eq!(l, expect);
        let p = softmax(&expect);
        // top_k = 1 keeps only the argmax, yet its logprob is from the untruncated softmax.
        let argmax = (0..1000)
            .max_by(|&a, &b| expect[a].total_cmp(&expect[b]))
            .unwrap();
        assert_eq!(out.token as usize, argmax);
        assert!((out.logprob as f64 - p[argmax].ln()).abs() < 1e-5);
        assert!(out.logprob < 0.0);
        // The whole vocabulary as top-N: exp sums to 1, sorted, each matches.
        assert_eq!(out.top.len(), 1000);
        let sum: f64 = out.top.iter().map(|&(_, lp)| (lp as f64).exp()).sum();
        assert!((sum - 1.0).abs() < 1e-5, "{sum}");
        for w in out.top.windows(2) {
            assert!(
                w[0].1 > w[1].1 || (w[0].1 == w[1].1 && w[0].0 < w[1].0),
                "{w:?}"
            );
        }
        for &(t, lp) in &out.top {
            assert!((lp as f64 - p[t as usize].ln()).abs() < 1e-4);
        }
        assert_eq!(out.top[0], (out.token, out.logprob));
    }

    #[test]
    fn top_logprobs_break_ties_by_id() {
        let l = [1.0f32, 3.0, 3.0, f32::NEG_INFINITY, 1.0, 2.0];
        let out = prompt_logprobs(&l, 3, 4).unwrap();
        assert_eq!(out.logprob, f32::NEG_INFINITY);
        let ids: Vec<u32> = out.top.iter().map(|&(t, _)| t).collect();
        assert_eq!(ids, vec![1, 2, 5, 0]);
        assert_eq!(out.top[0].1, out.top[1].1);
        assert_eq!(prompt_logprobs(&l, 0, 100).unwrap().top.len(), 6);
        assert!(prompt_logprobs(&l, 0, 0).unwrap().top.is_empty());
    }

    #[test]
    fn prompt_logprobs_use_the_raw_row() {
        let l = [0.5f32, -1.0, 2.0, 0.0];
        let out = prompt_logprobs(&l, 1, 2).unwrap();
        let p = softmax(&l);
        assert!((out.logprob as f64 - p[1].ln()).abs() < 1e-6);
        assert_eq!(out.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 0]);
        let sum: f64 = (0..4)
            .map(|t| (prompt_logprobs(&l, t, 0).unwrap().logprob as f64).exp())
            .sum();
        assert!((sum - 1.0).abs() < 1e-6);
        assert_eq!(
            prompt_logprobs(&l, 4, 0).unwrap_err(),
            SamplingError::TokenOutOfVocab { token: 4, vocab: 4 }
        );
    }

    #[test]
    fn min_new_tokens_mask_holds_back_eos_in_sampling() {
        let params = valid(SamplingParams {
            min_new_tokens: 3,
            ..Default::default()
        });
        let mut s = SamplerScratch::default();
        let mut h = TokenHistory::new(&[]);
        for pos in 0..6 {
            let mut l = vec![0.0f32, 30.0];
            let inp = SampleInput {
                eos_token_ids: &[1],
                ..input(&params, &h, 9)
            };
            let t = sample(&mut l, &inp, &mut s).unwrap().token;
            assert_eq!(t, if pos < 3 { 0 } else { 1 }, "position {pos}");
            h.push(t);
        }
    }

    #[test]
    fn broken_rows_are_errors() {
        let params = ValidSamplingParams::default();
        let h = TokenHistory::new(&[]);
        let mut s = SamplerScratch::default();
        let mut l = vec![0.0f32, f32::NAN];
        assert!(matches!(
            sample(&mut l, &input(&params, &h, 0), &mut s),
            Err(SamplingError::NonFiniteLogit { token: 1, .. })
        ));
        let mut l = vec![f32::NEG_INFINITY; 3];
        assert_eq!(
            sample(&mut l, &input(&params, &h, 0), &mut s),
            Err(SamplingError::NoCandidates)
        );
        let mut l = vec![];
        assert_eq!(
            sample(&mut l, &input(&params, &h, 0), &mut s),
            Err(SamplingError::NoCandidates)
        );
    }
}
