//! Reverse mode through the whole model, from the gradient of the logits back to every
//! weight, using the activations a [`ForwardTrace`] recorded from the serving forward pass.
//!
//! Rounding that the forward applies outside linear layers (the BF16 KV cache) is passed
//! through as identity (straight-through); linear layers follow the [`BackwardMode`].

use super::linear_grad::{linear_backward, BackwardMode};
use super::ops_grad;
use super::params::Grads;
use crate::backend::cpu::ops;
use crate::backend::Linear;
use crate::model::layout::{Half, Place, Proj};
use crate::model::{ForwardTrace, Mlp, MlpTrace, Model, MoeTrace, SwiGlu, SwiGluTrace};

/// One traced batch: every sequence starts at position 0 (a whole sequence per forward).
pub struct TracedBatch<'a> {
    pub trace: &'a ForwardTrace,
    /// All tokens of the batch, in batch order.
    pub tokens: &'a [u32],
    /// Length of each sequence, in batch order.
    pub seq_lens: &'a [usize],
}

struct Ctx<'a> {
    model: &'a Model,
    /// The high-precision (BF16-valued) weights by name.
    hp: &'a Grads,
    mode: BackwardMode,
    grads: Grads,
}

impl Ctx<'_> {
    fn linear(
        &mut self,
        name: &str,
        layer: &dyn Linear,
        x: &[f32],
        rows: usize,
        dy: &[f32],
    ) -> Vec<f32> {
        let dw = self
            .grads
            .get_mut(name)
            .unwrap_or_else(|| panic!("no gradient slot `{name}`"));
        linear_backward(self.mode, layer, &self.hp[name], x, rows, dy, dw)
    }

    fn rms_norm(&mut self, name: &str, w: &[f32], x: &[f32], dy: &[f32]) -> Vec<f32> {
        let eps = self.model.config.rms_norm_eps;
        let dw = self.grads.get_mut(name).expect("norm gradient slot");
        ops_grad::rms_norm_backward(x, w, eps, dy, dw)
    }

    /// A SwiGLU's backward; `at` is its place as (layer, expert: None for a dense MLP).
    fn swiglu(
        &mut self,
        at: (usize, Option<usize>),
        m: &SwiGlu,
        x: &[f32],
        rows: usize,
        t: &SwiGluTrace,
        dy: &[f32],
    ) -> Vec<f32> {
        let d_act = self.linear(
            &Place::Down(at.0, at.1).name(),
            m.down.as_ref(),
            &t.act,
            rows,
            dy,
        );
        let (dg, du) = ops_grad::silu_mul_backward(&t.gate, &t.up, &d_act);
        let mut dx = self.linear(
            &Place::GateUp(at.0, at.1, Half::Gate).name(),
            m.gate.as_ref(),
            x,
            rows,
            &dg,
        );
        let dx_up = self.linear(
            &Place::GateUp(at.0, at.1, Half::Up).name(),
            m.up.as_ref(),
            x,
            rows,
            &du,
        );
        ops::add_inplace(&mut dx, &dx_up);
        dx
    }

    #[allow(clippy::too_many_arguments)]
    fn moe(
        &mut self,
        layer: usize,
        moe: &crate::model::Moe,
        x: &[f32],
        rows: usize,
        t: &MoeTrace,
        dy: &[f32],
    ) -> Vec<f32> {
        let h = self.model.config.hidden_size;
        let (k, e) = (moe.top_k, moe.experts.len());
        // d(combine weight) per (row, slot) and the gradient reaching each expert's output.
        let mut d_weight = vec![0f32; rows * k];
        let mut d_expert_out: Vec<Vec<f32>> = t
            .experts
            .iter()
            .map(|et| {
                et.as_ref()
                    .map_or(Vec::new(), |et| vec![0f32; et.members.len() * h])
            })
            .collect();
        for r in 0..rows {
            let dyr = &dy[r * h..][..h];
            for slot in 0..k {
                let s = r * k + slot;
                let (ex, w) = t.choice[s];
                let et = t.experts[ex].as_ref().expect("expert ran");
                let j = t.row_in_expert[s];
                let eo = &et.out[j * h..][..h];
                d_weight[s] = dyr.iter().zip(eo).map(|(a, b)| a * b).sum();
                for (d, g) in d_expert_out[ex][j * h..][..h].iter_mut().zip(dyr) {
                    *d += w * g;
                }
            }
        }
        let mut dx = vec![0f32; rows * h];
        for (ex, (et, d_out)) in t.experts.iter().zip(&d_expert_out).enumerate() {
            let Some(et) = et.as_ref() else {
                continue;
            };
            let mut xin = Vec::with_capacity(et.members.len() * h);
            for &s in &et.members {
                xin.extend_from_slice(&x[(s / k) * h..][..h]);
            }
            let dxin = self.swiglu(
                (layer, Some(ex)),
                &moe.experts[ex],
                &xin,
                et.members.len(),
                &et.swiglu,
                d_out,
            );
            for (j, &s) in et.members.iter().enumerate() {
                let r = s / k;
                ops::add_inplace(&mut dx[r * h..][..h], &dxin[j * h..][..h]);
            }
        }
        // Through the combine weights to the router's softmax and logits.
        let mut d_logits = vec![0f32; rows * e];
        for r in 0..rows {
            let probs = &t.probs[r * e..][..e];
            let chosen: Vec<usize> = (0..k).map(|slot| t.choice[r * k + slot].0).collect();
            let dp = ops_grad::routing_weights_backward(
                probs,
                &chosen,
                &d_weight[r * k..][..k],
                moe.norm_topk_prob,
            );
            d_logits[r * e..][..e].copy_from_slice(&ops_grad::softmax_backward(probs, &dp));
        }
        let dx_router = self.linear(
            &Place::Router(layer).name(),
            moe.router.as_ref(),
            x,
            rows,
            &d_logits,
        );
        ops::add_inplace(&mut dx, &dx_router);
        dx
    }
}

/// Gradients of `sum(d_logits * logits)` for the logit rows the traced forward returned,
/// with respect to every parameter (by checkpoint name; `hp` gives each one's BF16 values).
pub fn backward(
    model: &Model,
    hp: &Grads,
    mode: BackwardMode,
    batch: &TracedBatch<'_>,
    d_logits: &[f32],
) -> Grads {
    let cfg = &model.config;
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let trace = batch.trace;
    let n = batch.tokens.len();
    let grads: Grads = hp
        .iter()
        .map(|(k, v)| (k.clone(), vec![0f32; v.len()]))
        .collect();
    let mut cx = Ctx {
        model,
        hp,
        mode,
        grads,
    };
    let inv_freq = cfg.rope_inv_freq();

    // lm_head and the final norm, on the rows that had logits.
    let rows = trace.logit_source_rows.len();
    let lm_name = if cfg.tie_word_embeddings {
        Place::Embedding
    } else {
        Place::LmHead
    }
    .name();
    let d_head_in = cx.linear(
        &lm_name,
        model.lm_head.as_ref(),
        &trace.lm_head_in,
        rows,
        d_logits,
    );
    let mut dx = vec![0f32; n * h];
    {
        let mut xs = Vec::with_capacity(rows * h);
        for &r in &trace.logit_source_rows {
            xs.extend_from_slice(&trace.x_final[r * h..][..h]);
        }
        let d = cx.rms_norm(&Place::FinalNorm.name(), &model.norm, &xs, &d_head_in);
        for (j, &r) in trace.logit_source_rows.iter().enumerate() {
            ops::add_inplace(&mut dx[r * h..][..h], &d[j * h..][..h]);
        }
    }

    for (l, (layer, lt)) in model.layers.iter().zip(&trace.layers).enumerate().rev() {
        // MLP branch: x_out = x_mid + mlp(post_norm(x_mid)).
        let d_mlp_in = match (&layer.mlp, &lt.mlp) {
            (Mlp::Dense(m), MlpTrace::Dense(t)) => cx.swiglu((l, None), m, &lt.mlp_in, n, t, &dx),
            (Mlp::Moe(m), MlpTrace::Moe(t)) => cx.moe(l, m, &lt.mlp_in, n, t, &dx),
            _ => unreachable!("a trace records the layer's own MLP kind"),
        };
        let d = cx.rms_norm(
            &Place::PostAttentionNorm(l).name(),
            &layer.post_attention_norm,
            &lt.x_mid,
            &d_mlp_in,
        );
        ops::add_inplace(&mut dx, &d);

        // Attention branch: x_mid = x_in + o_proj(attention(rope(norm(q)), rope(norm(k)), v)).
        let d_attn = cx.linear(
            &Place::Attention(l, Proj::O).name(),
            layer.o_proj.as_ref(),
            &lt.attn_out,
            n,
            &dx,
        );
        let (qw, kw) = (cfg.q_size(), cfg.kv_size());
        let mut dq = vec![0f32; n * qw];
        let mut dk = vec![0f32; n * kw];
        let mut dv = vec![0f32; n * kw];
        let mut start = 0;
        for &len in batch.seq_lens {
            let (a, b) = (start * qw, (start + len) * qw);
            let (c, d) = (start * kw, (start + len) * kw);
            let (sq, sk, sv) = ops_grad::attention_backward(
                &lt.q[a..b],
                &lt.k[c..d],
                &lt.v[c..d],
                &d_attn[a..b],
                cfg.num_heads,
                cfg.num_kv_heads,
                hd,
            );
            dq[a..b].copy_from_slice(&sq);
            dk[c..d].copy_from_slice(&sk);
            dv[c..d].copy_from_slice(&sv);
            for pos in 0..len {
                let r = start + pos;
                ops_grad::rope_backward(&mut dq[r * qw..][..qw], hd, pos, &inv_freq);
                ops_grad::rope_backward(&mut dk[r * kw..][..kw], hd, pos, &inv_freq);
            }
            start += len;
        }
        if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
            dq = cx.rms_norm(&Place::QNorm(l).name(), qn, &lt.q_proj, &dq);
            dk = cx.rms_norm(&Place::KNorm(l).name(), kn, &lt.k_proj, &dk);
        }
        let mut d_attn_in = cx.linear(
            &Place::Attention(l, Proj::Q).name(),
            layer.q_proj.as_ref(),
            &lt.attn_in,
            n,
            &dq,
        );
        let d_k = cx.linear(
            &Place::Attention(l, Proj::K).name(),
            layer.k_proj.as_ref(),
            &lt.attn_in,
            n,
            &dk,
        );
        let d_v = cx.linear(
            &Place::Attention(l, Proj::V).name(),
            layer.v_proj.as_ref(),
            &lt.attn_in,
            n,
            &dv,
        );
        ops::add_inplace(&mut d_attn_in, &d_k);
        ops::add_inplace(&mut d_attn_in, &d_v);
        let d = cx.rms_norm(
            &Place::InputNorm(l).name(),
            &layer.input_norm,
            &lt.x_in,
            &d_attn_in,
        );
        ops::add_inplace(&mut dx, &d);
    }

    // Embedding rows receive the gradient of the tokens that looked them up.
    let de = cx
        .grads
        .get_mut(&Place::Embedding.name())
        .expect("embedding gradient slot");
    for (r, &t) in batch.tokens.iter().enumerate() {
        ops::add_inplace(&mut de[t as usize * h..][..h], &dx[r * h..][..h]);
    }
    cx.grads
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::attention::KvDtype;
    use crate::model::ModelConfig;
    use crate::quant::Recipe;
    use crate::train::linear_grad::BackwardMode;
    use crate::train::ops_grad::tests::Rng;
    use crate::train::params::{Params, ServingPrecision};
    use crate::train::policy::{forward, Sequence};

    /// The whole model's gradient (embedding, norms, q/k norms, attention, RoPE, router,
    /// experts, lm_head, log-softmax) against central differences of the same f32 forward,
    /// at random coordinates of fresh random weights. Routing is replayed so that the
    /// function is smooth around the point (top-k is piecewise constant).
    #[test]
    fn model_gradient_matches_finite_differences() {
        let mut r = Rng::fresh();
        let mut cfg =
            ModelConfig::from_json(serde_json::from_str(crate::serve::EMBEDDED_CONFIG).unwrap())
                .unwrap();
        cfg.num_layers = 2;
        let mut params = Params::dummy(cfg.clone(), r.next()).unwrap();
        // Norm weights start at 1; make them generic.
        for (name, p) in params.tensors.iter_mut() {
            if name.contains("norm") {
                p.value.iter_mut().for_each(|v| *v += 0.3 * r.normal());
            }
        }
        let vocab = cfg.vocab_size;
        let mut seqs: Vec<Sequence> = (0..2)
            .map(|_| Sequence {
                prompt: (0..3).map(|_| r.below(vocab) as u32).collect(),
                completion: (0..4).map(|_| r.below(vocab) as u32).collect(),
                routing: None,
            })
            .collect();
        let recipe = Recipe::bf16();
        let model = params
            .serving_model(&recipe, ServingPrecision::F32)
            .unwrap();
        let first = forward(&model, &seqs, KvDtype::F32, false);
        for (s, routed) in seqs.iter_mut().zip(&first.routed) {
            s.routing = Some(routed.clone());
        }
        let coeff: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| s.completion.iter().map(|_| r.normal()).collect())
            .collect();
        let loss = |p: &Params| -> f64 {
            let m = p.serving_model(&recipe, ServingPrecision::F32).unwrap();
            let f = forward(&m, &seqs, KvDtype::F32, true);
            f.logprobs
                .iter()
                .flatten()
                .zip(coeff.iter().flatten())
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum()
        };
        let fwd = forward(&model, &seqs, KvDtype::F32, true);
        let grads = fwd.backward(
            &model,
            &params.values(),
            BackwardMode::HighPrecision,
            &coeff,
        );
        // An expert that layer 1 really used for the first token.
        let moe_layers = model.num_moe_layers();
        let ex = seqs[0].routing.as_ref().unwrap()[moe_layers * model.top_k()] as usize;
        let token_row = seqs[0].prompt[1] as usize;
        let checks: Vec<(String, Option<usize>)> = vec![
            (
                "model.embed_tokens.weight".into(),
                Some(token_row * cfg.hidden_size + r.below(cfg.hidden_size)),
            ),
            ("lm_head.weight".into(), None),
            ("model.norm.weight".into(), None),
            ("model.layers.0.input_layernorm.weight".into(), None),
            (
                "model.layers.0.post_attention_layernorm.weight".into(),
                None,
            ),
            ("model.layers.1.self_attn.q_proj.weight".into(), None),
            ("model.layers.1.self_attn.k_proj.weight".into(), None),
            ("model.layers.0.self_attn.v_proj.weight".into(), None),
            ("model.layers.0.self_attn.o_proj.weight".into(), None),
            ("model.layers.0.self_attn.q_norm.weight".into(), None),
            ("model.layers.1.self_attn.k_norm.weight".into(), None),
            ("model.layers.1.mlp.gate.weight".into(), None),
            (
                format!("model.layers.1.mlp.experts.{ex}.gate_proj.weight"),
                None,
            ),
            (
                format!("model.layers.1.mlp.experts.{ex}.up_proj.weight"),
                None,
            ),
            (
                format!("model.layers.1.mlp.experts.{ex}.down_proj.weight"),
                None,
            ),
        ];
        // Central differences at steps h and h / 2, extrapolated (Richardson: (4 D(h / 2) -
        // D(h)) / 3), so the h^2 term of the truncation error cancels: at a random point the
        // curvature along one coordinate may be large enough that D(1e-2) alone misses by
        // more than the tolerance (seen: embed_tokens 2.1e-3 off), while a smaller step alone
        // is swamped by the f32 forward's rounding.
        let eps = 1e-2f32;
        let mut results = Vec::new();
        for (name, at) in checks {
            for _ in 0..3 {
                let n = params.tensors[&name].value.len();
                let i = at.unwrap_or_else(|| r.below(n));
                let x = params.tensors[&name].value[i];
                let central = |h: f32| {
                    let mut p = params.clone();
                    p.tensors.get_mut(&name).unwrap().value[i] = x + h;
                    let up = loss(&p);
                    p.tensors.get_mut(&name).unwrap().value[i] = x - h;
                    let down = loss(&p);
                    (up - down) / ((x + h) as f64 - (x - h) as f64)
                };
                let numeric = (4.0 * central(eps / 2.0) - central(eps)) / 3.0;
                results.push((name.clone(), i, grads[&name][i] as f64, numeric));
            }
        }
        let scale = results.iter().fold(0f64, |m, r| m.max(r.3.abs()));
        assert!(scale > 1e-3, "the checked gradients are not all ~0");
        for (name, i, a, n) in &results {
            assert!(
                (a - n).abs() <= 2e-2 * n.abs() + 2e-3 * scale,
                "{name}[{i}]: analytic {a} vs numeric {n} (scale {scale})"
            );
        }
    }
}
