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
#[derive(Clone, Copy)]
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

// A host model copies like its parts (the CUDA one copies fallibly: `CudaWeights::copy_on`).
impl Clone for Moe {
    fn clone(&self) -> Self {
        Moe {
            router: self.router.clone(),
            experts: self.experts.clone(),
            top_k: self.top_k,
            norm_topk_prob: self.norm_topk_prob,
        }
    }
}

impl Clone for Mlp {
    fn clone(&self) -> Self {
        match self {
            Mlp::Dense(m) => Mlp::Dense(m.clone()),
            Mlp::Moe(m) => Mlp::Moe(m.clone()),
        }
    }
}

impl Clone for Layer {
    fn clone(&self) -> Self {
        Layer {
            input_norm: self.input_norm.clone(),
            post_attention_norm: self.post_attention_norm.clone(),
            q_proj: self.q_proj.clone(),
            k_proj: self.k_proj.clone(),
            v_proj: self.v_proj.clone(),
            o_proj: self.o_proj.clone(),
            q_norm: self.q_norm.clone(),
            k_norm: self.k_norm.clone(),
            mlp: self.mlp.clone(),
        }
    }
}

impl Clone for Model {
    fn clone(&self) -> Self {
        Model {
            config: self.config.clone(),
            embed_tokens: self.embed_tokens.clone(),
            layers: self.layers.clone(),
            norm: self.norm.clone(),
            lm_head: self.lm_head.clone(),
            inv_freq: self.inv_freq.clone(),
        }
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

    /// Bytes of the weights in host memory (tables, norms, every layer's storage).
    pub fn weight_bytes(&self) -> usize {
        let linears = |l: &Layer| {
            let mut n = [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj]
                .iter()
                .map(|p| p.storage_bytes())
                .sum::<usize>();
            let swiglu =
                |m: &SwiGlu| m.gate.storage_bytes() + m.up.storage_bytes() + m.down.storage_bytes();
            n += match &l.mlp {
                Mlp::Dense(m) => swiglu(m),
                Mlp::Moe(m) => {
                    m.router.storage_bytes() + m.experts.iter().map(swiglu).sum::<usize>()
                }
            };
            n + 4 * (l.input_norm.len() + l.post_attention_norm.len())
        };
        let table = match &self.embed_tokens {
            crate::backend::cpu::linear::DenseWeight::F32(w) => 4 * w.len(),
            crate::backend::cpu::linear::DenseWeight::Bf16(w) => 2 * w.len(),
        };
        table
            + 4 * self.norm.len()
            + self.lm_head.storage_bytes()
            + self.layers.iter().map(linears).sum::<usize>()
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
            record: false,
        };
        let mut st = StepState::default();
        let Ok((out, _)) = forward(&mut Cpu::default(), self, kv, &mut st, batch, opts);
        out
    }
}
