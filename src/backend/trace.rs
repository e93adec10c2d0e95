//! The activations a forward pass records for the trainer's backward pass
//! ([`crate::model::forward`]): copies only, so tracing never changes the arithmetic.

/// A SwiGLU's intermediate values: `gate(x)`, `up(x)` and `silu(gate) * up` (the down input).
#[derive(Default, Clone)]
pub struct SwiGluTrace {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub act: Vec<f32>,
}

/// One expert's share of an MoE layer: which (row, slot) entries it served, in its row order.
#[derive(Clone)]
pub struct ExpertTrace {
    /// Indices `row * top_k + slot` of the entries routed here.
    pub members: Vec<usize>,
    pub swiglu: SwiGluTrace,
    /// The expert's output rows, `[members.len(), hidden]`.
    pub out: Vec<f32>,
}

/// An MoE layer's routing and expert values.
#[derive(Default, Clone)]
pub struct MoeTrace {
    /// Router softmax, `[rows, experts]`.
    pub probs: Vec<f32>,
    /// Per `row * top_k + slot`: the expert and its combine weight.
    pub choice: Vec<(usize, f32)>,
    /// Per `row * top_k + slot`: its row within the expert's batch.
    pub row_in_expert: Vec<usize>,
    pub experts: Vec<Option<ExpertTrace>>,
}

#[derive(Clone)]
pub enum MlpTrace {
    Dense(SwiGluTrace),
    Moe(MoeTrace),
}

/// What the trainer's backward pass needs from one layer of a forward.
#[derive(Clone)]
pub struct LayerTrace {
    /// The residual stream entering the layer.
    pub x_in: Vec<f32>,
    /// `input_norm(x_in)`: the input of q/k/v.
    pub attn_in: Vec<f32>,
    /// q and k projections before their norms (and RoPE).
    pub q_proj: Vec<f32>,
    pub k_proj: Vec<f32>,
    /// Queries after norm and RoPE; keys and values as attention read them (after the KV
    /// cache's rounding).
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Attention output: the input of o_proj.
    pub attn_out: Vec<f32>,
    /// The residual stream after attention.
    pub x_mid: Vec<f32>,
    /// `post_attention_norm(x_mid)`: the MLP input.
    pub mlp_in: Vec<f32>,
    pub mlp: MlpTrace,
}

/// Activations recorded by the forward pass (`model::forward` with a trace) for the trainer's backward pass.
#[derive(Default, Clone)]
pub struct ForwardTrace {
    pub layers: Vec<LayerTrace>,
    /// The residual stream after the last layer, every row.
    pub x_final: Vec<f32>,
    /// Batch rows that got logits, in logit-row order.
    pub logit_source_rows: Vec<usize>,
    /// `norm(x_final)` of those rows: the lm_head input.
    pub lm_head_in: Vec<f32>,
}
