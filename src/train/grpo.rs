//! The GRPO objective on per-token logprobs: group-normalised advantages, the token-level
//! clipped policy-gradient loss with importance ratios against the rollout logprobs, an
//! optional k3 KL penalty to a reference policy, the supervised warm-up loss, and the
//! train/rollout mismatch metrics.

/// `(r - mean) / (std + 1e-6)` within each consecutive group of `group` rewards (population
/// std); a group whose rewards are all equal gets zero advantages.
pub fn group_advantages(rewards: &[f32], group: usize) -> Vec<f32> {
    rewards
        .chunks(group)
        .flat_map(|g| {
            let n = g.len() as f32;
            let mean = g.iter().sum::<f32>() / n;
            let std = (g.iter().map(|r| (r - mean) * (r - mean)).sum::<f32>() / n).sqrt();
            g.iter()
                .map(move |r| {
                    if std == 0.0 {
                        0.0
                    } else {
                        (r - mean) / (std + 1e-6)
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

#[derive(Clone, Copy, Debug)]
pub struct PgConfig {
    /// PPO clip range: ratios outside `[1 - eps, 1 + eps]` stop pulling further.
    pub clip_eps: f32,
    /// Weight of the k3 KL estimate to the reference policy (0: none).
    pub kl_coef: f32,
}

/// A loss over all completion tokens and its gradient with respect to each token's logprob.
#[derive(Clone, Debug)]
pub struct TokenLoss {
    pub loss: f64,
    pub d_logprob: Vec<Vec<f32>>,
    /// Fraction of tokens whose clipped term was active (no gradient).
    pub clip_fraction: f64,
}

/// Token-level clipped PG: `mean_t -min(rho_t A, clip(rho_t) A) + kl_coef * k3(ref || pi)`
/// with `rho_t = exp(lp_t - lp_old_t)`, the mean over every completion token of the batch.
pub fn policy_gradient(
    lp: &[Vec<f32>],
    lp_old: &[Vec<f32>],
    lp_ref: Option<&[Vec<f32>]>,
    advantages: &[f32],
    cfg: &PgConfig,
) -> TokenLoss {
    let tokens: usize = lp.iter().map(Vec::len).sum();
    let scale = 1.0 / tokens.max(1) as f64;
    let (mut loss, mut clipped) = (0f64, 0usize);
    let mut d_logprob = Vec::with_capacity(lp.len());
    for (s, (seq, old)) in lp.iter().zip(lp_old).enumerate() {
        let a = advantages[s] as f64;
        let mut d = Vec::with_capacity(seq.len());
        for (t, (&l, &o)) in seq.iter().zip(old).enumerate() {
            let ratio = (l as f64 - o as f64).exp();
            let lo = 1.0 - cfg.clip_eps as f64;
            let hi = 1.0 + cfg.clip_eps as f64;
            let unclipped = ratio * a;
            let clip = ratio.clamp(lo, hi) * a;
            let mut g = if unclipped <= clip {
                -a * ratio
            } else {
                clipped += 1;
                0.0
            };
            loss -= unclipped.min(clip);
            if let (Some(r), true) = (lp_ref, cfg.kl_coef != 0.0) {
                // k3 = exp(ref - lp) - (ref - lp) - 1; d/dlp = 1 - exp(ref - lp).
                let x = r[s][t] as f64 - l as f64;
                loss += cfg.kl_coef as f64 * (x.exp() - x - 1.0);
                g += cfg.kl_coef as f64 * (1.0 - x.exp());
            }
            d.push((g * scale) as f32);
        }
        d_logprob.push(d);
    }
    TokenLoss {
        loss: loss * scale,
        d_logprob,
        clip_fraction: clipped as f64 * scale,
    }
}

/// Supervised warm-up: mean negative logprob of the target tokens.
pub fn sft_loss(lp: &[Vec<f32>]) -> TokenLoss {
    let tokens: usize = lp.iter().map(Vec::len).sum();
    let scale = 1.0 / tokens.max(1) as f64;
    TokenLoss {
        loss: -lp.iter().flatten().map(|&x| x as f64).sum::<f64>() * scale,
        d_logprob: lp.iter().map(|s| vec![-scale as f32; s.len()]).collect(),
        clip_fraction: 0.0,
    }
}

/// How far the trainer's logprobs are from the ones the rollout server reported.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Mismatch {
    pub mean_abs: f64,
    pub max_abs: f64,
    /// k3 estimate of KL(rollout || train) from the rollout's samples:
    /// mean of `exp(d) - d - 1` with `d = lp_train - lp_rollout`.
    pub k3: f64,
    /// Tokens compared.
    pub tokens: usize,
}

pub fn mismatch(train: &[Vec<f32>], rollout: &[Vec<f32>]) -> Mismatch {
    let mut m = Mismatch::default();
    for (a, b) in train.iter().flatten().zip(rollout.iter().flatten()) {
        let d = *a as f64 - *b as f64;
        m.mean_abs += d.abs();
        m.max_abs = m.max_abs.max(d.abs());
        m.k3 += d.exp() - d - 1.0;
        m.tokens += 1;
    }
    if m.tokens > 0 {
        m.mean_abs /= m.tokens as f64;
        m.k3 /= m.tokens as f64;
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::ops_grad::tests::Rng;

    #[test]
    fn advantages_are_normalised_per_group() {
        let mut r = Rng::fresh();
        let rewards: Vec<f32> = (0..12).map(|_| r.normal()).collect();
        let adv = group_advantages(&rewards, 4);
        for g in adv.chunks(4) {
            let mean: f32 = g.iter().sum::<f32>() / 4.0;
            let var: f32 = g.iter().map(|a| (a - mean) * (a - mean)).sum::<f32>() / 4.0;
            assert!(mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-3, "{g:?}");
        }
        assert_eq!(group_advantages(&[0.5, 0.5, 0.5], 3), vec![0.0; 3]);
    }

    /// The reported gradient is the derivative of the reported loss (central differences in
    /// f64 on fresh random logprobs), with ratios on both sides of the clip range.
    #[test]
    fn pg_gradient_is_the_derivative_of_the_loss() {
        let mut r = Rng::fresh();
        let lens = [6usize, 9, 5, 8];
        let lp_old: Vec<Vec<f32>> = lens
            .iter()
            .map(|&n| (0..n).map(|_| -r.normal().abs()).collect())
            .collect();
        // Log-ratios either well inside the clip range (|d| <= 0.15 < ln 1.2) or well outside
        // (|d| >= 0.3 > -ln 0.8), so no finite difference straddles a kink.
        let lp: Vec<Vec<f32>> = lp_old
            .iter()
            .map(|s| {
                s.iter()
                    .map(|x| {
                        let u = (r.next() >> 40) as f32 / (1u64 << 24) as f32;
                        let sign = if r.next() & 1 == 0 { 1.0 } else { -1.0 };
                        let mag = if r.next() & 1 == 0 {
                            0.15 * u
                        } else {
                            0.3 + 0.3 * u
                        };
                        x + sign * mag
                    })
                    .collect()
            })
            .collect();
        let lp_ref: Vec<Vec<f32>> = lp_old
            .iter()
            .map(|s| s.iter().map(|x| x + 0.1 * r.normal()).collect())
            .collect();
        let adv: Vec<f32> = lens.iter().map(|_| r.normal()).collect();
        let cfg = PgConfig {
            clip_eps: 0.2,
            kl_coef: 0.05,
        };
        let out = policy_gradient(&lp, &lp_old, Some(&lp_ref), &adv, &cfg);
        assert!(
            out.clip_fraction > 0.0 && out.clip_fraction < 1.0,
            "both regimes are exercised"
        );
        for s in 0..lp.len() {
            for t in 0..lp[s].len() {
                let eps = 1e-3f32;
                let at = |v: f32| {
                    let mut x = lp.clone();
                    x[s][t] = v;
                    policy_gradient(&x, &lp_old, Some(&lp_ref), &adv, &cfg).loss
                };
                let (hi, lo) = (lp[s][t] + eps, lp[s][t] - eps);
                let numeric = (at(hi) - at(lo)) / (hi as f64 - lo as f64);
                let got = out.d_logprob[s][t] as f64;
                assert!(
                    (got - numeric).abs() < 1e-3 * (1.0 + numeric.abs()),
                    "[{s}][{t}] {got} vs {numeric}"
                );
            }
        }
    }

    /// A token whose ratio is past the clip in its advantage's direction (A > 0 and
    /// rho > 1 + eps, or A < 0 and rho < 1 - eps) gets exactly zero gradient and counts as
    /// clipped; past the clip the other way it keeps the unclipped gradient -A rho / tokens.
    #[test]
    fn clipped_tokens_have_zero_gradient() {
        let cfg = PgConfig {
            clip_eps: 0.2,
            kl_coef: 0.0,
        };
        let old = vec![vec![0.0f32; 4]; 2];
        let (up, down) = (1.5f32.ln(), 0.5f32.ln());
        // Sequence 0: A = +1; sequence 1: A = -1. Tokens: past above, past below, inside, at 1.
        let lp = vec![vec![up, down, 0.1f32.ln_1p(), 0.0]; 2];
        let out = policy_gradient(&lp, &old, None, &[1.0, -1.0], &cfg);
        let d = &out.d_logprob;
        assert_eq!(d[0][0], 0.0, "A > 0, ratio 1.5 > 1.2");
        assert_eq!(d[1][1], 0.0, "A < 0, ratio 0.5 < 0.8");
        let n = 8.0f64;
        let want = |a: f64, l: f32| (-a * (l as f64).exp() / n) as f32;
        assert_eq!(
            d[0][1],
            want(1.0, down),
            "A > 0 below the clip still pulls up"
        );
        assert_eq!(
            d[1][0],
            want(-1.0, up),
            "A < 0 above the clip still pulls down"
        );
        for s in 0..2 {
            let a = if s == 0 { 1.0 } else { -1.0 };
            assert_eq!(d[s][2], want(a, lp[s][2]));
            assert_eq!(d[s][3], want(a, 0.0));
        }
        assert_eq!(out.clip_fraction, 2.0 / 8.0);
    }

    #[test]
    fn mismatch_is_zero_for_identical_logprobs_and_k3_is_nonnegative() {
        let mut r = Rng::fresh();
        let a: Vec<Vec<f32>> = vec![(0..7).map(|_| -r.normal().abs()).collect()];
        let m = mismatch(&a, &a);
        assert_eq!((m.mean_abs, m.max_abs, m.k3, m.tokens), (0.0, 0.0, 0.0, 7));
        let b: Vec<Vec<f32>> = vec![a[0].iter().map(|x| x + 0.1 * r.normal()).collect()];
        let m = mismatch(&b, &a);
        let want_max = a[0]
            .iter()
            .zip(&b[0])
            .map(|(x, y)| (*x as f64 - *y as f64).abs())
            .fold(0.0, f64::max);
        assert_eq!(m.max_abs, want_max);
        assert!(m.k3 > 0.0);
    }
}
