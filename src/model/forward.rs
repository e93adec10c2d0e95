//! The layer program, written once for every backend: embed, then per layer the input norm
//! (joining the previous MLP output to the residual), q/k/v, q/k norm + RoPE + KV store,
//! attention, o_proj, the post-attention norm (joining o_proj's output), and a dense SwiGLU or
//! an MoE (route with optional replay, experts' gate/up, SwiGLU, down, weighted combine); then
//! the final norm, lm_head and sampling.
//!
//! The trainer's activation trace is a tap: with a trace given, the forward copies activations
//! out of the backend's buffers (`Backend::host`) as it goes; the arithmetic is the same either
//! way, which is why trainer logprobs equal the server's bit for bit.

use super::plan::plan;
use super::{ForwardBatch, ForwardOutput, Mlp, Model};
use crate::backend::trace::{ForwardTrace, LayerTrace, MlpTrace};
use crate::backend::{Backend, Buffers, MoeShape, Sampled};
use crate::sampling::SampleInput;

/// The buffers one step works in: the activations and the MoE routing.
pub struct StepState<B: Backend> {
    pub bufs: Buffers<B::Act>,
    pub route: B::Route,
}

impl<B: Backend> Default for StepState<B>
where
    B::Act: Default,
    B::Route: Default,
{
    fn default() -> Self {
        StepState {
            bufs: Buffers::default(),
            route: B::Route::default(),
        }
    }
}

/// What a forward is asked for besides the logits.
#[derive(Default)]
pub struct ForwardOptions<'a, 's> {
    /// `[total_tokens, num_moe_layers, top_k]` in batch order (as
    /// [`ForwardOutput::routed_experts`]): replaces the routers' choice of experts (routing
    /// replay; a row with an invalid id is routed normally).
    pub routing: Option<&'a [i32]>,
    /// Receives the activations the trainer's backward pass needs.
    pub trace: Option<&'a mut ForwardTrace>,
    /// Per sequence: sample its last logits row with these inputs.
    pub samples: &'a [Option<SampleInput<'s>>],
    /// The step's shape recurs (see [`Backend::layers`]); ignored with a trace or a replay,
    /// whose host work between the layers cannot be recorded.
    pub record: bool,
}

/// One forward pass of `model` on backend `b` over `batch`, with the KV cache `kv` and the
/// step buffers `st`.
pub fn forward<B: Backend>(
    b: &mut B,
    model: &Model<B>,
    kv: &mut B::Kv,
    st: &mut StepState<B>,
    batch: &ForwardBatch<'_>,
    opts: ForwardOptions<'_, '_>,
) -> Result<(ForwardOutput, Sampled), B::Error> {
    let cfg = &model.config;
    let dims = cfg.dims();
    let plan = plan(batch);
    let (n, h, eps) = (plan.rows(), dims.hidden, dims.eps);
    let (qs, ks) = (dims.q_size(), dims.kv_size());
    let moe_layers = model.num_moe_layers();
    let top_k = model.top_k();
    let mut trace = opts.trace;
    let tracing = trace.is_some();
    if let Some(t) = trace.as_deref_mut() {
        t.layers.clear();
    }
    b.begin(&plan, &dims, tracing)?;
    let record = opts.record && !tracing && opts.routing.is_none();
    let (s, route) = (&mut st.bufs, &mut st.route);
    b.layers(record, &mut |b| {
        b.embed(&model.embed_tokens, &plan, &dims, &mut s.x)?;
        let mut moe_index = 0;
        for (l, layer) in model.layers.iter().enumerate() {
            // The previous layer's MLP output joins the residual stream inside the norm.
            let residual = (l > 0).then_some(&s.y);
            b.rms_norm(
                &mut s.x,
                residual,
                &layer.input_norm,
                &mut s.normed,
                n,
                h,
                eps,
            )?;
            let x_in = tracing.then(|| b.host(&s.x, n * h)).transpose()?;
            b.linear_same_input(
                [&layer.q_proj, &layer.k_proj, &layer.v_proj],
                &s.normed,
                n,
                [&mut s.q, &mut s.k, &mut s.v],
            )?;
            let projections = if tracing {
                Some((
                    b.host(&s.normed, n * h)?,
                    b.host(&s.q, n * qs)?,
                    b.host(&s.k, n * ks)?,
                ))
            } else {
                None
            };
            let norms = layer.q_norm.as_ref().zip(layer.k_norm.as_ref());
            b.qk_norm_rope_store(
                l,
                norms,
                &model.inv_freq,
                &mut s.q,
                &mut s.k,
                &s.v,
                kv,
                &plan,
                &dims,
            )?;
            b.attention(l, &s.q, kv, &plan, &dims, &mut s.attn)?;
            b.linear(&layer.o_proj, &s.attn, n, &mut s.o)?;
            b.rms_norm(
                &mut s.x,
                Some(&s.o),
                &layer.post_attention_norm,
                &mut s.normed,
                n,
                h,
                eps,
            )?;
            let x_mid = tracing.then(|| b.host(&s.x, n * h)).transpose()?;
            let mlp_in = tracing.then(|| b.host(&s.normed, n * h)).transpose()?;
            let mlp_trace = match &layer.mlp {
                Mlp::Dense(mlp) => {
                    let inter = cfg.intermediate_size;
                    b.mlp_gate_up(mlp, &s.normed, n, &mut s.gate_up)?;
                    b.silu_mul(&s.gate_up, n, inter, &mut s.act)?;
                    b.mlp_down(mlp, &s.act, n, &mut s.y)?;
                    tracing
                        .then(|| b.mlp_trace(s, n, inter))
                        .transpose()?
                        .map(MlpTrace::Dense)
                }
                Mlp::Moe(moe) => {
                    let shape = MoeShape {
                        experts: cfg.moe.as_ref().map_or(0, |m| m.num_experts),
                        top_k: moe.top_k,
                        renormalize: moe.norm_topk_prob,
                        inter: cfg.moe.as_ref().map_or(0, |m| m.intermediate_size),
                    };
                    b.linear(&moe.router, &s.normed, n, &mut s.router_logits)?;
                    // This layer's replayed experts, `[rows, top_k]`.
                    let replay: Option<Vec<i32>> = opts.routing.map(|ids| {
                        (0..n)
                            .flat_map(|t| {
                                ids[(t * moe_layers + moe_index) * top_k..][..top_k].iter()
                            })
                            .copied()
                            .collect()
                    });
                    b.moe_route(
                        &s.router_logits,
                        n,
                        shape,
                        replay.as_deref(),
                        moe_index,
                        route,
                    )?;
                    b.experts_mlp(
                        &moe.experts,
                        &s.normed,
                        n,
                        shape,
                        route,
                        &mut s.gate_up,
                        &mut s.act,
                        &mut s.expert_out,
                    )?;
                    b.moe_combine(&s.expert_out, route, n, h, &mut s.y)?;
                    moe_index += 1;
                    tracing
                        .then(|| b.moe_trace(route, s, n, shape))
                        .transpose()?
                        .map(MlpTrace::Moe)
                }
            };
            if let Some(t) = trace.as_deref_mut() {
                let (attn_in, q_proj, k_proj) = projections.expect("recorded when tracing");
                t.layers.push(LayerTrace {
                    x_in: x_in.expect("recorded when tracing"),
                    attn_in,
                    q_proj,
                    k_proj,
                    q: b.host(&s.q, n * qs)?,
                    k: b.kv_stored(kv, &s.k, n * ks)?,
                    v: b.kv_stored(kv, &s.v, n * ks)?,
                    attn_out: b.host(&s.attn, n * qs)?,
                    x_mid: x_mid.expect("recorded when tracing"),
                    mlp_in: mlp_in.expect("recorded when tracing"),
                    mlp: mlp_trace.expect("recorded when tracing"),
                });
            }
        }
        Ok(())
    })?;
    // The last MLP output joins the residual in the final norm.
    let out = b.logits(
        s,
        !model.layers.is_empty(),
        &model.norm,
        &model.lm_head,
        &model.embed_tokens,
        &plan,
        &dims,
        opts.samples,
        tracing,
    )?;
    let routed_experts = b.routed_experts(route, n, moe_layers, top_k)?;
    if let Some(t) = trace {
        t.x_final = b.host(&s.x, n * h)?;
        t.logit_source_rows = plan.logit_rows.clone();
        t.lm_head_in = out.lm_head_in.unwrap_or_default();
    }
    Ok((
        ForwardOutput {
            logits: out.logits,
            logit_rows: out.logit_rows,
            routed_experts,
        },
        out.sampled,
    ))
}
