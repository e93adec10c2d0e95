//! The model architectures (Qwen3-MoE, Qwen3, Llama), written once against the backend ops.
//!
//! A forward pass takes an explicit [`ForwardBatch`] (which tokens of which sequences, at which
//! positions, in which KV blocks) and returns logits for the rows asked for plus the routed
//! expert ids of every token and MoE layer.

pub mod checksum;
pub mod config;
pub mod loader;
pub mod slots;
pub mod trace;

use crate::backend::cpu::attention::{paged_attention, AttentionSeq, KvMemory};
use crate::backend::cpu::ops;
use crate::backend::Linear;
pub use config::{Architecture, ModelConfig};
pub use trace::{ExpertTrace, ForwardTrace, LayerTrace, MlpTrace, MoeTrace, SwiGluTrace};

/// Dense SwiGLU MLP or expert: `down(silu(gate(x)) * up(x))`.
pub struct SwiGlu {
    pub gate: Box<dyn Linear>,
    pub up: Box<dyn Linear>,
    pub down: Box<dyn Linear>,
}

impl SwiGlu {
    fn forward(&self, x: &[f32], rows: usize, trace: Option<&mut SwiGluTrace>) -> Vec<f32> {
        let inter = self.gate.out_features();
        let (mut g, mut u) = (vec![0f32; rows * inter], vec![0f32; rows * inter]);
        self.gate.forward(x, rows, &mut g);
        self.up.forward(x, rows, &mut u);
        let mut h = vec![0f32; rows * inter];
        ops::silu_mul(&g, &u, &mut h);
        let mut out = vec![0f32; rows * self.down.out_features()];
        self.down.forward(&h, rows, &mut out);
        if let Some(t) = trace {
            *t = SwiGluTrace {
                gate: g,
                up: u,
                act: h,
            };
        }
        out
    }
}

pub struct Moe {
    pub router: Box<dyn Linear>,
    pub experts: Vec<SwiGlu>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

impl Moe {
    /// Routes every row, runs each expert on the rows sent to it and combines the outputs in
    /// a fixed order (by top-k slot), so a token's result does not depend on its batch.
    /// `replay` (`[rows, top_k]`) replaces the router's top-k choice (routing replay); the
    /// weights still come from this router's probabilities of the replayed experts.
    fn forward(
        &self,
        x: &[f32],
        rows: usize,
        hidden: usize,
        routed: &mut [i32],
        replay: Option<&[i32]>,
        mut trace: Option<&mut MoeTrace>,
    ) -> Vec<f32> {
        let e = self.experts.len();
        let mut logits = vec![0f32; rows * e];
        self.router.forward(x, rows, &mut logits);
        let mut choice = vec![(0usize, 0f32); rows * self.top_k];
        for r in 0..rows {
            let probs = &mut logits[r * e..][..e];
            ops::softmax_inplace(probs);
            let given = replay
                .map(|ids| &ids[r * self.top_k..][..self.top_k])
                .filter(|ids| ids.iter().all(|&i| i >= 0 && (i as usize) < e));
            let top = match given {
                Some(ids) => ids.iter().map(|&i| i as usize).collect(),
                None => ops::top_k(probs, self.top_k),
            };
            let sum: f32 = top.iter().map(|&i| probs[i]).sum();
            for (slot, &i) in top.iter().enumerate() {
                let w = if self.norm_topk_prob {
                    probs[i] / sum
                } else {
                    probs[i]
                };
                choice[r * self.top_k + slot] = (i, w);
                routed[r * self.top_k + slot] = i as i32;
            }
        }
        // Gather the rows of each expert, run it once on all of them.
        let mut expert_out: Vec<Option<Vec<f32>>> = vec![None; e];
        let mut row_in_expert = vec![0usize; rows * self.top_k];
        for (ex, out) in expert_out.iter_mut().enumerate() {
            let members: Vec<usize> = (0..rows * self.top_k)
                .filter(|&s| choice[s].0 == ex)
                .collect();
            if members.is_empty() {
                continue;
            }
            let mut xin = Vec::with_capacity(members.len() * hidden);
            for (j, &s) in members.iter().enumerate() {
                xin.extend_from_slice(&x[(s / self.top_k) * hidden..][..hidden]);
                row_in_expert[s] = j;
            }
            let expert_trace = trace.as_deref_mut().map(|t| {
                t.experts[ex] = Some(ExpertTrace {
                    members: members.clone(),
                    swiglu: SwiGluTrace::default(),
                    out: Vec::new(),
                });
                &mut t.experts[ex].as_mut().expect("just set").swiglu
            });
            *out = Some(self.experts[ex].forward(&xin, members.len(), expert_trace));
        }
        let mut y = vec![0f32; rows * hidden];
        for r in 0..rows {
            let yr = &mut y[r * hidden..][..hidden];
            for slot in 0..self.top_k {
                let s = r * self.top_k + slot;
                let (ex, w) = choice[s];
                let eo = &expert_out[ex].as_ref().expect("expert ran")[row_in_expert[s] * hidden..]
                    [..hidden];
                for (a, b) in yr.iter_mut().zip(eo) {
                    *a += w * b;
                }
            }
        }
        if let Some(t) = trace {
            t.probs = logits;
            t.choice = choice;
            t.row_in_expert = row_in_expert;
            for (ex, out) in expert_out.into_iter().enumerate() {
                if let (Some(et), Some(o)) = (t.experts[ex].as_mut(), out) {
                    et.out = o;
                }
            }
        }
        y
    }
}

pub enum Mlp {
    Dense(SwiGlu),
    Moe(Moe),
}

pub struct Layer {
    pub input_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub q_proj: Box<dyn Linear>,
    pub k_proj: Box<dyn Linear>,
    pub v_proj: Box<dyn Linear>,
    pub o_proj: Box<dyn Linear>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub mlp: Mlp,
}

pub struct Model {
    pub config: ModelConfig,
    /// `[vocab, hidden]`, kept in f32 rows only when looked up.
    pub embed_tokens: crate::backend::cpu::linear::DenseWeight,
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,
    pub lm_head: Box<dyn Linear>,
    inv_freq: Vec<f32>,
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

impl Model {
    pub fn new(
        config: ModelConfig,
        embed_tokens: crate::backend::cpu::linear::DenseWeight,
        layers: Vec<Layer>,
        norm: Vec<f32>,
        lm_head: Box<dyn Linear>,
    ) -> Model {
        let inv_freq = ops::rope_inv_freq(config.head_dim, config.rope_theta, &config.rope_scaling);
        Model {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
        }
    }

    pub fn num_moe_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| matches!(l.mlp, Mlp::Moe(_)))
            .count()
    }

    pub fn top_k(&self) -> usize {
        self.config.moe.as_ref().map_or(0, |m| m.top_k)
    }

    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        use crate::backend::cpu::linear::DenseWeight;
        let h = self.config.hidden_size;
        let mut x = vec![0f32; tokens.len() * h];
        for (row, &t) in x.chunks_mut(h).zip(tokens) {
            let t = t as usize;
            match &self.embed_tokens {
                DenseWeight::F32(w) => row.copy_from_slice(&w[t * h..][..h]),
                DenseWeight::Bf16(w) => row
                    .iter_mut()
                    .zip(&w[t * h..][..h])
                    .for_each(|(d, s)| *d = s.to_f32()),
            }
        }
        x
    }

    pub fn forward(&self, batch: &ForwardBatch<'_>, kv: &mut KvMemory) -> ForwardOutput {
        self.forward_traced(batch, kv, None, None)
    }

    /// The forward pass with the trainer's two options: `routing` (`[total_tokens,
    /// num_moe_layers, top_k]`, batch order, as [`ForwardOutput::routed_experts`]) replaces
    /// the routers' choice of experts (a row with an invalid id is routed normally), and
    /// `trace` receives the activations the backward pass needs. Neither changes arithmetic:
    /// with no routing given, the logits are the serving path's, bit for bit.
    pub fn forward_traced(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &mut KvMemory,
        routing: Option<&[i32]>,
        mut trace: Option<&mut ForwardTrace>,
    ) -> ForwardOutput {
        let cfg = &self.config;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let tokens: Vec<u32> = batch
            .seqs
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let n = tokens.len();
        // Row -> (sequence, position), for RoPE and the KV writes.
        let row_pos: Vec<(usize, usize)> = batch
            .seqs
            .iter()
            .enumerate()
            .flat_map(|(i, s)| (0..s.tokens.len()).map(move |j| (i, s.start_pos + j)))
            .collect();
        let moe_layers = self.num_moe_layers();
        let top_k = self.top_k();
        let mut routed = vec![0i32; n * moe_layers * top_k];
        let mut x = self.embed(&tokens);
        let mut normed = vec![0f32; n * h];
        let mut moe_index = 0;
        if let Some(t) = trace.as_deref_mut() {
            t.layers.clear();
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let x_in = trace.is_some().then(|| x.clone());
            ops::rms_norm(&x, &layer.input_norm, cfg.rms_norm_eps, &mut normed);
            let (mut q, mut k, mut v) = (
                vec![0f32; n * cfg.q_size()],
                vec![0f32; n * cfg.kv_size()],
                vec![0f32; n * cfg.kv_size()],
            );
            layer.q_proj.forward(&normed, n, &mut q);
            layer.k_proj.forward(&normed, n, &mut k);
            layer.v_proj.forward(&normed, n, &mut v);
            let pre_norm = trace
                .is_some()
                .then(|| (normed.clone(), q.clone(), k.clone()));
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                ops::head_rms_norm_inplace(&mut q, qn, cfg.rms_norm_eps);
                ops::head_rms_norm_inplace(&mut k, kn, cfg.rms_norm_eps);
            }
            for (r, &(s, pos)) in row_pos.iter().enumerate() {
                ops::apply_rope(
                    &mut q[r * cfg.q_size()..][..cfg.q_size()],
                    hd,
                    pos,
                    &self.inv_freq,
                );
                ops::apply_rope(
                    &mut k[r * cfg.kv_size()..][..cfg.kv_size()],
                    hd,
                    pos,
                    &self.inv_freq,
                );
                kv.write(
                    l,
                    batch.seqs[s].block_table,
                    pos,
                    &k[r * cfg.kv_size()..][..cfg.kv_size()],
                    &v[r * cfg.kv_size()..][..cfg.kv_size()],
                );
            }
            let seqs: Vec<AttentionSeq<'_>> = batch
                .seqs
                .iter()
                .map(|s| AttentionSeq {
                    block_table: s.block_table,
                    start_pos: s.start_pos,
                    len: s.tokens.len(),
                })
                .collect();
            let mut attn = vec![0f32; n * cfg.q_size()];
            paged_attention(kv, l, &seqs, &q, cfg.num_heads, &mut attn);
            let mut o = vec![0f32; n * h];
            layer.o_proj.forward(&attn, n, &mut o);
            ops::add_inplace(&mut x, &o);
            let x_mid = trace.is_some().then(|| x.clone());

            ops::rms_norm(
                &x,
                &layer.post_attention_norm,
                cfg.rms_norm_eps,
                &mut normed,
            );
            let mut mlp_trace = match &layer.mlp {
                Mlp::Dense(_) => MlpTrace::Dense(SwiGluTrace::default()),
                Mlp::Moe(moe) => MlpTrace::Moe(MoeTrace {
                    experts: vec![None; moe.experts.len()],
                    ..MoeTrace::default()
                }),
            };
            let y = match &layer.mlp {
                Mlp::Dense(mlp) => {
                    let t = match (&mut mlp_trace, trace.is_some()) {
                        (MlpTrace::Dense(t), true) => Some(t),
                        _ => None,
                    };
                    mlp.forward(&normed, n, t)
                }
                Mlp::Moe(moe) => {
                    let mut r = vec![0i32; n * top_k];
                    let replay: Option<Vec<i32>> = routing.map(|ids| {
                        (0..n)
                            .flat_map(|t| {
                                ids[(t * moe_layers + moe_index) * top_k..][..top_k]
                                    .iter()
                                    .copied()
                            })
                            .collect()
                    });
                    let t = match (&mut mlp_trace, trace.is_some()) {
                        (MlpTrace::Moe(t), true) => Some(t),
                        _ => None,
                    };
                    let y = moe.forward(&normed, n, h, &mut r, replay.as_deref(), t);
                    for t in 0..n {
                        routed[(t * moe_layers + moe_index) * top_k..][..top_k]
                            .copy_from_slice(&r[t * top_k..][..top_k]);
                    }
                    moe_index += 1;
                    y
                }
            };
            if let Some(t) = trace.as_deref_mut() {
                let (attn_in, q_proj, k_proj) = pre_norm.expect("recorded when tracing");
                t.layers.push(LayerTrace {
                    x_in: x_in.expect("recorded when tracing"),
                    attn_in,
                    q_proj,
                    k_proj,
                    k: kv.stored(&k),
                    v: kv.stored(&v),
                    q,
                    attn_out: attn,
                    x_mid: x_mid.expect("recorded when tracing"),
                    mlp_in: normed.clone(),
                    mlp: mlp_trace,
                });
            }
            ops::add_inplace(&mut x, &y);
        }
        // Final norm and lm_head only on the rows that need logits.
        let mut rows = Vec::new();
        let mut logit_rows = Vec::with_capacity(batch.seqs.len());
        let mut offset = 0;
        for s in &batch.seqs {
            let from = s.logits_from.unwrap_or(s.tokens.len()).min(s.tokens.len());
            logit_rows.push((rows.len(), s.tokens.len() - from));
            rows.extend((offset + from)..(offset + s.tokens.len()));
            offset += s.tokens.len();
        }
        let mut hsel = vec![0f32; rows.len() * h];
        for (dst, &r) in hsel.chunks_mut(h).zip(&rows) {
            ops::rms_norm_row(&x[r * h..][..h], &self.norm, cfg.rms_norm_eps, dst);
        }
        let mut logits = vec![0f32; rows.len() * cfg.vocab_size];
        self.lm_head.forward(&hsel, rows.len(), &mut logits);
        if let Some(t) = trace {
            t.x_final = x;
            t.logit_source_rows = rows;
            t.lm_head_in = hsel;
        }
        ForwardOutput {
            logits,
            logit_rows,
            routed_experts: routed,
        }
    }
}
