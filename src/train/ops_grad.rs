//! Reverse mode of the format-free forward ops (`backend::cpu::ops` and attention), in f32.
//!
//! Each function takes the forward's inputs (as the trace recorded them) and the gradient of
//! the forward's output, and returns or accumulates the gradients of the inputs. Forward
//! quantities that are cheap (norm factors, softmax rows) are recomputed rather than stored.

use rayon::prelude::*;

use crate::backend::cpu::ops;

/// RMSNorm `y = x * inv * w`, `inv = 1/sqrt(mean(x^2) + eps)`, per row of width `w.len()`.
/// Returns dx; adds dw into `dw`.
pub fn rms_norm_backward(x: &[f32], w: &[f32], eps: f32, dy: &[f32], dw: &mut [f32]) -> Vec<f32> {
    let d = w.len();
    let mut dx = vec![0f32; x.len()];
    for ((row, g), dxr) in x.chunks(d).zip(dy.chunks(d)).zip(dx.chunks_mut(d)) {
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        // a = w * dy; dx = inv * a - x * inv^3 * mean(a * x).
        let mut ax = 0f32;
        for i in 0..d {
            ax += w[i] * g[i] * row[i];
            dw[i] += g[i] * row[i] * inv;
        }
        let c = inv * inv * inv * ax / d as f32;
        for i in 0..d {
            dxr[i] = inv * w[i] * g[i] - row[i] * c;
        }
    }
    dx
}

/// Reverse of [`ops::apply_rope`] at `pos`: the transpose of the rotation.
pub fn rope_backward(dy: &mut [f32], head_dim: usize, pos: usize, inv_freq: &[f32]) {
    let half = head_dim / 2;
    for head in dy.chunks_mut(head_dim) {
        for i in 0..half {
            let angle = pos as f32 * inv_freq[i];
            let (sin, cos) = angle.sin_cos();
            let (da, db) = (head[i], head[i + half]);
            head[i] = da * cos + db * sin;
            head[i + half] = db * cos - da * sin;
        }
    }
}

/// `h = silu(g) * u`: returns (dg, du).
pub fn silu_mul_backward(g: &[f32], u: &[f32], dh: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dg = vec![0f32; g.len()];
    let mut du = vec![0f32; g.len()];
    for i in 0..g.len() {
        let s = 1.0 / (1.0 + (-g[i]).exp());
        du[i] = dh[i] * ops::silu(g[i]);
        dg[i] = dh[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
    }
    (dg, du)
}

/// Softmax `p = softmax(z)` of one row: dz from dp.
pub fn softmax_backward(p: &[f32], dp: &[f32]) -> Vec<f32> {
    let dot: f32 = p.iter().zip(dp).map(|(a, b)| a * b).sum();
    p.iter().zip(dp).map(|(pi, di)| pi * (di - dot)).collect()
}

/// MoE combine weights of one row from router probabilities: `w_s = p[e_s] / sum_S p` when
/// `normalize` (norm_topk_prob), else `p[e_s]`. Returns dp over all experts given dw per slot.
pub fn routing_weights_backward(
    probs: &[f32],
    experts: &[usize],
    dw: &[f32],
    normalize: bool,
) -> Vec<f32> {
    let mut dp = vec![0f32; probs.len()];
    if !normalize {
        for (&e, &d) in experts.iter().zip(dw) {
            dp[e] += d;
        }
        return dp;
    }
    let sum: f32 = experts.iter().map(|&e| probs[e]).sum();
    // d(p_i / S)/d p_j = delta_ij / S - p_i / S^2 for j in S.
    let weighted: f32 = experts.iter().zip(dw).map(|(&e, &d)| d * probs[e]).sum();
    for (&e, &d) in experts.iter().zip(dw) {
        dp[e] += d / sum;
    }
    for &e in experts {
        dp[e] -= weighted / (sum * sum);
    }
    dp
}

/// One KV head's dk and dv rows (`[len, head_dim]` each) and the dq rows of each of its
/// query heads, by head index.
type KvHeadGrads = (Vec<f32>, Vec<f32>, Vec<(usize, Vec<f32>)>);

/// Causal GQA attention of one sequence starting at position 0: `q` `[len, heads*hd]`,
/// `k`/`v` `[len, kv_heads*hd]`, `d_out` like `q`. Returns (dq, dk, dv).
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d_out: &[f32],
    num_heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (qw, kw) = (num_heads * head_dim, kv_heads * head_dim);
    let len = q.len() / qw;
    let group = num_heads / kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    // Heads of one KV group write the same dk/dv rows, so work is split by KV head.
    let per_kv: Vec<KvHeadGrads> = (0..kv_heads)
        .into_par_iter()
        .map(|kvh| {
            let mut dk = vec![0f32; len * head_dim];
            let mut dv = vec![0f32; len * head_dim];
            let mut dqs = Vec::new();
            let kr = |t: usize| &k[t * kw + kvh * head_dim..][..head_dim];
            let vr = |t: usize| &v[t * kw + kvh * head_dim..][..head_dim];
            for h in kvh * group..(kvh + 1) * group {
                let mut dq = vec![0f32; len * head_dim];
                for i in 0..len {
                    let qi = &q[i * qw + h * head_dim..][..head_dim];
                    let doi = &d_out[i * qw + h * head_dim..][..head_dim];
                    let mut p: Vec<f32> = (0..=i)
                        .map(|t| qi.iter().zip(kr(t)).map(|(a, b)| a * b).sum::<f32>() * scale)
                        .collect();
                    ops::softmax_inplace(&mut p);
                    let dp: Vec<f32> = (0..=i)
                        .map(|t| doi.iter().zip(vr(t)).map(|(a, b)| a * b).sum())
                        .collect();
                    let ds = softmax_backward(&p, &dp);
                    for t in 0..=i {
                        let dvt = &mut dv[t * head_dim..][..head_dim];
                        for (d, o) in dvt.iter_mut().zip(doi) {
                            *d += p[t] * o;
                        }
                        let dqi = &mut dq[i * head_dim..][..head_dim];
                        for (d, kk) in dqi.iter_mut().zip(kr(t)) {
                            *d += ds[t] * scale * kk;
                        }
                        let dkt = &mut dk[t * head_dim..][..head_dim];
                        for (d, qq) in dkt.iter_mut().zip(qi) {
                            *d += ds[t] * scale * qq;
                        }
                    }
                }
                dqs.push((h, dq));
            }
            (dk, dv, dqs)
        })
        .collect();
    let mut dq = vec![0f32; q.len()];
    let mut dk = vec![0f32; k.len()];
    let mut dv = vec![0f32; v.len()];
    for (kvh, (dkh, dvh, dqs)) in per_kv.into_iter().enumerate() {
        for t in 0..len {
            dk[t * kw + kvh * head_dim..][..head_dim]
                .copy_from_slice(&dkh[t * head_dim..][..head_dim]);
            dv[t * kw + kvh * head_dim..][..head_dim]
                .copy_from_slice(&dvh[t * head_dim..][..head_dim]);
        }
        for (h, dqh) in dqs {
            for t in 0..len {
                dq[t * qw + h * head_dim..][..head_dim]
                    .copy_from_slice(&dqh[t * head_dim..][..head_dim]);
            }
        }
    }
    (dq, dk, dv)
}

/// Gradient of `log_softmax(logits)[token]` with respect to the logits row, scaled by
/// `d_logprob`: `d * (onehot - softmax)`. The softmax uses the sampler's normalizer (f64 sum).
pub fn logprob_backward(logits: &[f32], token: usize, d_logprob: f32, out: &mut [f32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    for (o, &l) in out.iter_mut().zip(logits) {
        let p = (((l - max) as f64).exp() / total) as f32;
        *o += -d_logprob * p;
    }
    out[token] += d_logprob;
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend::cpu::attention::{paged_attention, AttentionSeq, KvDtype, KvMemory};

    /// A fresh random source per test run (the seed is printed; `LOCKSTEP_TEST_SEED` replays
    /// one).
    pub struct Rng(u64);
    impl Rng {
        pub fn fresh() -> Rng {
            let seed = crate::testing::test_seed();
            eprintln!("rng seed {seed}");
            Rng(seed | 1)
        }
        pub fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        /// Approximately standard normal (sum of uniforms).
        pub fn normal(&mut self) -> f32 {
            (0..4)
                .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32)
                .sum::<f32>()
                * 1.732
                - 3.464
        }
        pub fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.normal()).collect()
        }
        pub fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Central difference of the scalar `f` along coordinate `i` of `x`, in f64 from f32 evals.
    pub fn central(x: &[f32], i: usize, eps: f32, f: &dyn Fn(&[f32]) -> f64) -> f64 {
        let mut a = x.to_vec();
        let (hi, lo) = (x[i] + eps, x[i] - eps);
        a[i] = hi;
        let up = f(&a);
        a[i] = lo;
        let down = f(&a);
        // The step actually taken (f32 rounding of x +- eps).
        (up - down) / (hi as f64 - lo as f64)
    }

    /// Compares an analytic gradient with central differences on every coordinate:
    /// |a - n| <= tol * (1 + max|n|).
    pub fn check(
        name: &str,
        x: &[f32],
        analytic: &[f32],
        eps: f32,
        tol: f64,
        f: &dyn Fn(&[f32]) -> f64,
    ) {
        let numeric: Vec<f64> = (0..x.len()).map(|i| central(x, i, eps, f)).collect();
        let scale = 1.0 + numeric.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (i, (a, n)) in analytic.iter().zip(&numeric).enumerate() {
            assert!(
                ((*a as f64) - n).abs() <= tol * scale,
                "{name}[{i}]: analytic {a} vs numeric {n} (scale {scale})"
            );
        }
    }

    fn weighted_sum(y: &[f32], c: &[f32]) -> f64 {
        y.iter().zip(c).map(|(a, b)| *a as f64 * *b as f64).sum()
    }

    #[test]
    fn rms_norm_gradients_match_finite_differences() {
        let mut r = Rng::fresh();
        let (rows, d) = (3, 16);
        let (x, w, c) = (r.vec(rows * d), r.vec(d), r.vec(rows * d));
        let f = |x: &[f32], w: &[f32]| {
            let mut y = vec![0f32; rows * d];
            ops::rms_norm(x, w, 1e-6, &mut y);
            weighted_sum(&y, &c)
        };
        let mut dw = vec![0f32; d];
        let dx = rms_norm_backward(&x, &w, 1e-6, &c, &mut dw);
        check("dx", &x, &dx, 1e-2, 2e-3, &|x| f(x, &w));
        check("dw", &w, &dw, 1e-2, 2e-3, &|w| f(&x, w));
    }

    #[test]
    fn rope_gradient_is_the_transposed_rotation() {
        let mut r = Rng::fresh();
        let (hd, heads) = (8, 2);
        let inv = crate::model::config::rope_inv_freq(
            hd,
            10000.0,
            &crate::model::config::RopeScaling::None,
        );
        let pos = r.below(50);
        let (x, c) = (r.vec(hd * heads), r.vec(hd * heads));
        let f = |x: &[f32]| {
            let mut y = x.to_vec();
            ops::apply_rope(&mut y, hd, pos, &inv);
            weighted_sum(&y, &c)
        };
        let mut dx = c.clone();
        rope_backward(&mut dx, hd, pos, &inv);
        check("dx", &x, &dx, 1e-2, 1e-3, &f);
    }

    #[test]
    fn silu_mul_gradients_match_finite_differences() {
        let mut r = Rng::fresh();
        let n = 24;
        let (g, u, c) = (r.vec(n), r.vec(n), r.vec(n));
        let f = |g: &[f32], u: &[f32]| {
            let mut h = vec![0f32; n];
            ops::silu_mul(g, u, &mut h);
            weighted_sum(&h, &c)
        };
        let (dg, du) = silu_mul_backward(&g, &u, &c);
        check("dg", &g, &dg, 1e-2, 1e-3, &|g| f(g, &u));
        check("du", &u, &du, 1e-2, 1e-3, &|u| f(&g, u));
    }

    #[test]
    fn router_softmax_and_topk_weights_match_finite_differences() {
        let mut r = Rng::fresh();
        let e = 8;
        let z = r.vec(e);
        let mut p = z.clone();
        ops::softmax_inplace(&mut p);
        // The chosen set is held fixed (as routing is piecewise constant).
        let chosen = ops::top_k(&p, 3);
        let c = r.vec(3);
        for normalize in [true, false] {
            let f = |z: &[f32]| {
                let mut p = z.to_vec();
                ops::softmax_inplace(&mut p);
                let s: f32 = chosen.iter().map(|&i| p[i]).sum();
                chosen
                    .iter()
                    .zip(&c)
                    .map(|(&i, &ci)| (if normalize { p[i] / s } else { p[i] }) as f64 * ci as f64)
                    .sum()
            };
            let dp = routing_weights_backward(&p, &chosen, &c, normalize);
            let dz = softmax_backward(&p, &dp);
            check("dz", &z, &dz, 1e-2, 2e-3, &f);
        }
    }

    #[test]
    fn attention_gradients_match_finite_differences() {
        let mut r = Rng::fresh();
        let (heads, kv_heads, hd, len) = (4, 2, 8, 5);
        let (qw, kw) = (heads * hd, kv_heads * hd);
        let (q, k, v, c) = (
            r.vec(len * qw),
            r.vec(len * kw),
            r.vec(len * kw),
            r.vec(len * qw),
        );
        // The forward is the engine's paged attention over an F32 cache.
        let f = |q: &[f32], k: &[f32], v: &[f32]| {
            let mut kv = KvMemory::new(KvDtype::F32, 1, 1, len, kv_heads, hd);
            let table = [0u32];
            for t in 0..len {
                kv.write(0, &table, t, &k[t * kw..][..kw], &v[t * kw..][..kw]);
            }
            let seqs = [AttentionSeq {
                block_table: &table,
                start_pos: 0,
                len,
            }];
            let mut out = vec![0f32; len * qw];
            paged_attention(&kv, 0, &seqs, q, heads, &mut out);
            weighted_sum(&out, &c)
        };
        let (dq, dk, dv) = attention_backward(&q, &k, &v, &c, heads, kv_heads, hd);
        check("dq", &q, &dq, 1e-2, 2e-3, &|q| f(q, &k, &v));
        check("dk", &k, &dk, 1e-2, 2e-3, &|k| f(&q, k, &v));
        check("dv", &v, &dv, 1e-2, 2e-3, &|v| f(&q, &k, v));
    }

    #[test]
    fn logprob_gradient_matches_finite_differences() {
        let mut r = Rng::fresh();
        let vocab = 17;
        let z = r.vec(vocab);
        let token = r.below(vocab);
        let f = |z: &[f32]| {
            crate::sampling::prompt_logprobs(z, token as u32, 0)
                .unwrap()
                .logprob as f64
        };
        let mut dz = vec![0f32; vocab];
        logprob_backward(&z, token, 1.0, &mut dz);
        check("dz", &z, &dz, 1e-2, 2e-3, &f);
    }
}
