//! The model architectures (Qwen3-MoE, Qwen3, Llama), written once against the backend ops.
//!
//! A forward pass takes an explicit [`ForwardBatch`] (which tokens of which sequences, at which
//! positions, in which KV blocks) and returns logits for the rows asked for plus the routed
//! expert ids of every token and MoE layer.

pub mod checksum;
pub mod config;
pub mod cuda;
pub mod forward;
pub mod layout;
pub mod loader;
pub mod plan;
pub mod slots;
pub mod store;
pub mod trace;

use crate::backend::cpu::attention::KvMemory;
use crate::backend::cpu::Cpu;
pub use crate::backend::cpu::SwiGlu;
use crate::backend::Backend;
pub use config::{Architecture, ModelConfig};
pub use forward::{forward, ForwardOptions, StepState};
pub use trace::{ExpertTrace, ForwardTrace, LayerTrace, MlpTrace, MoeTrace, SwiGluTrace};

/// An MoE layer: the router and the experts, in the backend's storage.
pub struct Moe<B: Backend = Cpu> {
    pub router: B::Linear,
    pub experts: B::Experts,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

pub enum Mlp<B: Backend = Cpu> {
    Dense(B::SwiGlu),
    Moe(Moe<B>),
}

pub struct Layer<B: Backend = Cpu> {
    pub input_norm: B::Vector,
    pub post_attention_norm: B::Vector,
    pub q_proj: B::Linear,
    pub k_proj: B::Linear,
    pub v_proj: B::Linear,
    pub o_proj: B::Linear,
    pub q_norm: Option<B::Vector>,
    pub k_norm: Option<B::Vector>,
    pub mlp: Mlp<B>,
}

/// A model's weights on one backend (the CPU reference by default), and its config. The
/// forward pass over them is [`forward::forward`], the same for every backend.
pub struct Model<B: Backend = Cpu> {
    pub config: ModelConfig,
    pub embed_tokens: B::Table,
    pub layers: Vec<Layer<B>>,
    pub norm: B::Vector,
    pub lm_head: B::LmHead,
    /// RoPE's inverse frequencies, where the backend reads them.
    pub inv_freq: B::Vector,
}

/// One sequence's slice of a batch.
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`.
    pub start_pos: usize,
    /// Block table covering positions `0..start_pos + tokens.len()`.
    pub block_table: &'a [u32],
    /// Logits are returned for chunk rows `logits_from..tokens.len()` (None: no logits).
    pub logits_from: Option<usize>,
}

/// Batch metadata, passed explicitly to every forward.
pub struct ForwardBatch<'a> {
    pub seqs: Vec<SeqInput<'a>>,
}

pub struct ForwardOutput {
    /// Logit rows of every sequence that asked for them, concatenated in batch order.
    pub logits: Vec<f32>,
    /// Per sequence: index of its first logit row in `logits` (rows, not floats) and the count.
    pub logit_rows: Vec<(usize, usize)>,
    /// `[total_tokens, num_moe_layers, top_k]` expert ids, in batch order (empty for dense models).
    pub routed_experts: Vec<i32>,
}

impl<B: Backend> Model<B> {
    pub fn num_moe_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| matches!(l.mlp, Mlp::Moe(_)))
            .count()
    }

    pub fn top_k(&self) -> usize {
        self.config.moe.as_ref().map_or(0, |m| m.top_k)
    }
}

impl Model {
    pub fn new(
        config: ModelConfig,
        embed_tokens: crate::backend::cpu::linear::DenseWeight,
        layers: Vec<Layer>,
        norm: Vec<f32>,
        lm_head: Box<dyn crate::backend::Linear>,
    ) -> Model {
        let inv_freq = config.rope_inv_freq();
        Model {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
        }
    }

    pub fn forward(&self, batch: &ForwardBatch<'_>, kv: &mut KvMemory) -> ForwardOutput {
        self.forward_traced(batch, kv, None, None)
    }

    /// The forward pass on the CPU with the trainer's two options: `routing` (`[total_tokens,
    /// num_moe_layers, top_k]`, batch order, as [`ForwardOutput::routed_experts`]) replaces
    /// the routers' choice of experts (a row with an invalid id is routed normally), and
    /// `trace` receives the activations the backward pass needs. Neither changes arithmetic:
    /// with no routing given, the logits are the serving path's, bit for bit.
    pub fn forward_traced(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &mut KvMemory,
        routing: Option<&[i32]>,
        trace: Option<&mut ForwardTrace>,
    ) -> ForwardOutput {
        let opts = ForwardOptions {
            routing,
            trace,
            samples: &[],
        };
        let mut st = StepState::default();
        let Ok((out, _)) = forward(&mut Cpu::default(), self, kv, &mut st, batch, opts);
        out
    }
}
