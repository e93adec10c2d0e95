//! The seam between the one forward pass (`model::forward`) and the backends: the [`Backend`]
//! trait (the fused ops a layer program needs, at the granularity the CUDA kernels fuse them),
//! the step plan every backend reads, and the per-step activation buffers.
//!
//! A backend names its own weight types (a linear layer, a norm vector, an MoE layer's expert
//! stack...) so the model's weight tree (`model::Model<B>`) is written once and holds whatever
//! each backend stores: boxed CPU `Linear`s, or stacked device matrices.

use crate::sampling::{SampleInput, SamplingError, TokenLogprobs};

use super::trace::{MoeTrace, SwiGluTrace};

/// Per sequence of a batch: its sampled token, when it asked for one.
pub type Sampled = Vec<Option<Result<TokenLogprobs, SamplingError>>>;

/// One sequence's slice of a step.
#[derive(Clone, Copy, Debug)]
pub struct SeqPlan<'a> {
    /// Block table covering positions `0..start_pos + len`.
    pub block_table: &'a [u32],
    /// Position of the sequence's first row in this step.
    pub start_pos: usize,
    pub len: usize,
    /// Its first row among the step's token rows.
    pub first_row: usize,
    /// Chunk rows `logits_from..len` get logits (`len`: none).
    pub logits_from: usize,
}

impl SeqPlan<'_> {
    pub fn logit_count(&self) -> usize {
        self.len - self.logits_from
    }
}

/// What one step computes, built once from the batch (`model::plan`) and read by every op.
#[derive(Clone, Debug, Default)]
pub struct StepPlan<'a> {
    pub seqs: Vec<SeqPlan<'a>>,
    /// Per token row: its token, its sequence and its position.
    pub tokens: Vec<u32>,
    pub row_seq: Vec<usize>,
    pub row_pos: Vec<usize>,
    /// Token rows that get logits, in output order (each sequence's rows in turn).
    pub logit_rows: Vec<usize>,
}

impl StepPlan<'_> {
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }
}

/// The shapes every op needs (from the model config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f32,
}

impl Dims {
    pub fn q_size(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_size(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// One MoE layer's routing rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    pub experts: usize,
    pub top_k: usize,
    /// Renormalize the top-k weights to sum to one (`norm_topk_prob`).
    pub renormalize: bool,
    /// The experts' intermediate size.
    pub inter: usize,
}

/// The activation buffers of one step, all of a backend's activation type. A CPU step grows
/// them as it goes; a device step reuses buffers planned for the largest step.
pub struct Buffers<A> {
    /// The residual stream, `[rows, hidden]`.
    pub x: A,
    /// Norm output: the input of the next linear layers.
    pub normed: A,
    pub q: A,
    pub k: A,
    pub v: A,
    /// Attention output, `[rows, q_size]`.
    pub attn: A,
    /// o_proj output, joined to the residual by the next norm.
    pub o: A,
    /// MLP output, joined to the residual by the next norm.
    pub y: A,
    pub router_logits: A,
    /// Gate and up projections (layout is the backend's; its `silu_mul` reads it).
    pub gate_up: A,
    /// `silu(gate) * up`: the down projection's input.
    pub act: A,
    /// Per routed (row, slot) pair: its expert's output row.
    pub expert_out: A,
}

impl<A: Default> Default for Buffers<A> {
    fn default() -> Self {
        Buffers {
            x: A::default(),
            normed: A::default(),
            q: A::default(),
            k: A::default(),
            v: A::default(),
            attn: A::default(),
            o: A::default(),
            y: A::default(),
            router_logits: A::default(),
            gate_up: A::default(),
            act: A::default(),
            expert_out: A::default(),
        }
    }
}

/// The step's end: logits on the host and the rows sampled.
pub struct Logits {
    /// Asked-for logits rows on the host, in batch order (a backend that samples on the device
    /// leaves out each sampled sequence's last row).
    pub logits: Vec<f32>,
    /// Per sequence: its first row in `logits` and the count.
    pub logit_rows: Vec<(usize, usize)>,
    pub sampled: Sampled,
    /// With tracing: the final norm of the logit rows (the lm_head input).
    pub lm_head_in: Option<Vec<f32>>,
}

/// The fused ops of a forward pass. Every op computes each output row from its own input
/// row(s) only, in a reduction order fixed by the reduced axis (batch invariance), and
/// returns the backend's error rather than panicking.
pub trait Backend {
    type Error: std::error::Error + Send + Sync + 'static;
    /// f32 activations, `[rows, width]` row-major.
    type Act;
    /// A norm's weight vector.
    type Vector;
    /// The embedding table.
    type Table;
    /// One linear layer.
    type Linear;
    /// lm_head (a device backend may tie it to the table).
    type LmHead;
    /// A dense SwiGLU MLP.
    type SwiGlu;
    /// An MoE layer's experts.
    type Experts;
    /// The paged KV cache.
    type Kv;
    /// One MoE layer's routing: chosen experts, combine weights and the row grouping.
    type Route;

    /// Readies the backend for a step (capacity checks, metadata to the device). With `keep`
    /// (a traced forward, which copies activations out as it goes), every op's output buffer
    /// holds its values once the op is done; without it a backend may hand an op's result to
    /// its reader in another form (a GEMM's split-K sums left for the reader to add, SwiGLU
    /// inside the gate/up GEMM), the values the reader computes with being the same.
    fn begin(&mut self, plan: &StepPlan<'_>, dims: &Dims, keep: bool) -> Result<(), Self::Error>;

    /// Runs `layers`: the step's work from the embedding to the last layer's output. With
    /// `record`, the step's shape recurs (a decode step padded to a fixed row count): a backend
    /// may keep what `layers` queues and replay it for the next step of the same shape, which
    /// then does not call `layers` at all (CUDA graphs). The default runs them.
    fn layers(
        &mut self,
        record: bool,
        layers: &mut dyn FnMut(&mut Self) -> Result<(), Self::Error>,
    ) -> Result<(), Self::Error> {
        let _ = record;
        layers(self)
    }

    /// `out = table[tokens]`.
    fn embed(
        &mut self,
        table: &Self::Table,
        plan: &StepPlan<'_>,
        dims: &Dims,
        out: &mut Self::Act,
    ) -> Result<(), Self::Error>;

    /// With a residual, `x += residual` first (written back); then `out = rms_norm(x) * w`
    /// over `rows` rows of width `w`'s length.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm(
        &mut self,
        x: &mut Self::Act,
        residual: Option<&Self::Act>,
        w: &Self::Vector,
        out: &mut Self::Act,
        rows: usize,
        width: usize,
        eps: f32,
    ) -> Result<(), Self::Error>;

    /// `out = x W^T` over `rows` rows (the activation quantized as the layer's format says).
    fn linear(
        &mut self,
        w: &Self::Linear,
        x: &Self::Act,
        rows: usize,
        out: &mut Self::Act,
    ) -> Result<(), Self::Error>;

    /// `outs[i] = x W_i^T` for layers that read the same `x` (the attention's q, k and v): three
    /// [`Backend::linear`] calls, unless the backend prepares `x` once for all of them (the CUDA
    /// backend quantizes it once when the layers share an activation format).
    fn linear_same_input(
        &mut self,
        ws: [&Self::Linear; 3],
        x: &Self::Act,
        rows: usize,
        outs: [&mut Self::Act; 3],
    ) -> Result<(), Self::Error> {
        for (w, out) in ws.into_iter().zip(outs) {
            self.linear(w, x, rows, out)?;
        }
        Ok(())
    }

    /// Per-head q/k norm (when given), RoPE at each row's position, and K/V stored into the
    /// cache of `layer`.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_store(
        &mut self,
        layer: usize,
        norms: Option<(&Self::Vector, &Self::Vector)>,
        inv_freq: &Self::Vector,
        q: &mut Self::Act,
        k: &mut Self::Act,
        v: &Self::Act,
        kv: &mut Self::Kv,
        plan: &StepPlan<'_>,
        dims: &Dims,
    ) -> Result<(), Self::Error>;

    /// Causal GQA attention of every query row over the keys the cache holds for it.
    fn attention(
        &mut self,
        layer: usize,
        q: &Self::Act,
        kv: &Self::Kv,
        plan: &StepPlan<'_>,
        dims: &Dims,
        out: &mut Self::Act,
    ) -> Result<(), Self::Error>;

    /// A dense MLP's gate and up projections into `out`.
    fn mlp_gate_up(
        &mut self,
        w: &Self::SwiGlu,
        x: &Self::Act,
        rows: usize,
        out: &mut Self::Act,
    ) -> Result<(), Self::Error>;

    /// A dense MLP's down projection.
    fn mlp_down(
        &mut self,
        w: &Self::SwiGlu,
        act: &Self::Act,
        rows: usize,
        out: &mut Self::Act,
    ) -> Result<(), Self::Error>;

    /// `out = silu(gate) * up` for `rows` rows of `inter` columns of `gate_up`.
    fn silu_mul(
        &mut self,
        gate_up: &Self::Act,
        rows: usize,
        inter: usize,
        out: &mut Self::Act,
    ) -> Result<(), Self::Error>;

    /// Router softmax and top-k (ties to the lower id), or with `replay` (`[rows, top_k]`)
    /// the given experts of every row whose ids are all valid, weighted by this router's
    /// probabilities; then the rows grouped by expert. The chosen experts are kept as MoE layer
    /// `moe_index` of the step ([`Backend::routed_experts`]).
    #[allow(clippy::too_many_arguments)]
    fn moe_route(
        &mut self,
        logits: &Self::Act,
        rows: usize,
        shape: MoeShape,
        replay: Option<&[i32]>,
        moe_index: usize,
        route: &mut Self::Route,
    ) -> Result<(), Self::Error>;

    /// Each expert's gate and up projections over the rows routed to it.
    fn experts_gate_up(
        &mut self,
        w: &Self::Experts,
        x: &Self::Act,
        rows: usize,
        route: &Self::Route,
        out: &mut Self::Act,
    ) -> Result<(), Self::Error>;

    /// Each expert's down projection over its rows of `act`.
    fn experts_down(
        &mut self,
        w: &Self::Experts,
        act: &Self::Act,
        route: &Self::Route,
        out: &mut Self::Act,
    ) -> Result<(), Self::Error>;

    /// `act = silu(gate) * up` over the `pairs` routed rows of `gate_up` (`inter` columns), then
    /// each expert's down projection over its rows of `act`: [`Backend::silu_mul`] then
    /// [`Backend::experts_down`], which a backend may do in fewer launches.
    #[allow(clippy::too_many_arguments)]
    fn experts_silu_down(
        &mut self,
        w: &Self::Experts,
        gate_up: &Self::Act,
        pairs: usize,
        inter: usize,
        route: &Self::Route,
        act: &mut Self::Act,
        out: &mut Self::Act,
    ) -> Result<(), Self::Error> {
        self.silu_mul(gate_up, pairs, inter, act)?;
        self.experts_down(w, act, route, out)
    }

    /// An MoE layer's experts over the routed rows of `x` (`shape.top_k` a row, `shape.inter`
    /// wide): [`Backend::experts_gate_up`] into `gate_up`, then [`Backend::experts_silu_down`]
    /// through `act` into `out`. Unless the step keeps its buffers ([`Backend::begin`]), a
    /// backend may skip writing `gate_up` and `act` (SwiGLU inside the gate/up GEMM's
    /// epilogue); `out` is the same either way.
    #[allow(clippy::too_many_arguments)]
    fn experts_mlp(
        &mut self,
        w: &Self::Experts,
        x: &Self::Act,
        rows: usize,
        shape: MoeShape,
        route: &Self::Route,
        gate_up: &mut Self::Act,
        act: &mut Self::Act,
        out: &mut Self::Act,
    ) -> Result<(), Self::Error> {
        self.experts_gate_up(w, x, rows, route, gate_up)?;
        let pairs = rows * shape.top_k;
        self.experts_silu_down(w, gate_up, pairs, shape.inter, route, act, out)
    }

    /// `out[row] = sum over slots, in slot order, of weight * expert output`.
    fn moe_combine(
        &mut self,
        expert_out: &Self::Act,
        route: &Self::Route,
        rows: usize,
        hidden: usize,
        out: &mut Self::Act,
    ) -> Result<(), Self::Error>;

    /// Every kept layer's experts, `[rows, moe_layers, top_k]`.
    fn routed_experts(
        &mut self,
        route: &Self::Route,
        rows: usize,
        moe_layers: usize,
        top_k: usize,
    ) -> Result<Vec<i32>, Self::Error>;

    /// The final norm (of `bufs.x`, after `x += bufs.y` when `add_y`) and lm_head on the
    /// plan's logit rows, then the last row of every sequence `i` with `samples[i]` sampled.
    /// The other buffers are free to use as scratch.
    #[allow(clippy::too_many_arguments)]
    fn logits(
        &mut self,
        bufs: &mut Buffers<Self::Act>,
        add_y: bool,
        norm: &Self::Vector,
        head: &Self::LmHead,
        table: &Self::Table,
        plan: &StepPlan<'_>,
        dims: &Dims,
        samples: &[Option<SampleInput<'_>>],
        trace: bool,
    ) -> Result<Logits, Self::Error>;

    /// The first `len` values of `a` on the host (for the trainer's trace).
    fn host(&mut self, a: &Self::Act, len: usize) -> Result<Vec<f32>, Self::Error>;

    /// The first `len` values of `a` as the KV cache stores them (rounded to its dtype).
    fn kv_stored(
        &mut self,
        kv: &Self::Kv,
        a: &Self::Act,
        len: usize,
    ) -> Result<Vec<f32>, Self::Error>;

    /// A dense MLP's trace from its buffers.
    fn mlp_trace(
        &mut self,
        bufs: &Buffers<Self::Act>,
        rows: usize,
        inter: usize,
    ) -> Result<SwiGluTrace, Self::Error>;

    /// An MoE layer's trace from its routing and buffers (router logits, gate/up, act and
    /// expert outputs).
    fn moe_trace(
        &mut self,
        route: &Self::Route,
        bufs: &Buffers<Self::Act>,
        rows: usize,
        shape: MoeShape,
    ) -> Result<MoeTrace, Self::Error>;
}
