//! The trainer's view of the model: logprobs of sampled completions through the engine's own
//! forward pass (whole sequences, as one batch), and the gradient of a per-token objective.

use super::backward::{backward, TracedBatch};
use super::linear_grad::BackwardMode;
use super::ops_grad::logprob_backward;
use super::params::Grads;
use crate::backend::cpu::attention::{KvDtype, KvMemory};
use crate::model::{ForwardBatch, ForwardTrace, Model, SeqInput};

const BLOCK: usize = 16;

/// A prompt and a completion sampled after it.
#[derive(Clone, Debug)]
pub struct Sequence {
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
    /// Routing replay: expert ids `[prompt + completion - 1, moe_layers, top_k]` as the server
    /// reported them (`return_routed_experts`).
    pub routing: Option<Vec<i32>>,
}

impl Sequence {
    /// The tokens the forward reads: all but the last (nothing is predicted after it).
    fn inputs(&self) -> Vec<u32> {
        let mut t = self.prompt.clone();
        t.extend_from_slice(&self.completion);
        t.pop();
        t
    }
}

/// The forward of a batch of sequences: per sequence the logprob of each completion token,
/// plus what the backward needs.
pub struct PolicyForward {
    pub logprobs: Vec<Vec<f32>>,
    /// Per sequence, the experts its input rows were routed to (`[rows, moe_layers, top_k]`).
    pub routed: Vec<Vec<i32>>,
    logits: Vec<f32>,
    trace: ForwardTrace,
    tokens: Vec<u32>,
    seq_lens: Vec<usize>,
    targets: Vec<u32>,
}

/// Runs the serving forward pass over `seqs` (empty completions are not allowed) with
/// routing replay when every sequence carries routing and `replay` is set.
pub fn forward(model: &Model, seqs: &[Sequence], kv_dtype: KvDtype, replay: bool) -> PolicyForward {
    let cfg = &model.config;
    let inputs: Vec<Vec<u32>> = seqs.iter().map(Sequence::inputs).collect();
    let blocks: Vec<usize> = inputs.iter().map(|t| t.len().div_ceil(BLOCK)).collect();
    let mut tables = Vec::new();
    let mut next = 0u32;
    for &b in &blocks {
        tables.push((next..next + b as u32).collect::<Vec<u32>>());
        next += b as u32;
    }
    let mut kv = KvMemory::new(
        kv_dtype,
        cfg.num_layers,
        next as usize,
        BLOCK,
        cfg.num_kv_heads,
        cfg.head_dim,
    );
    let batch = ForwardBatch {
        seqs: seqs
            .iter()
            .zip(&inputs)
            .zip(&tables)
            .map(|((s, t), table)| {
                assert!(
                    !s.completion.is_empty() && !s.prompt.is_empty(),
                    "a sequence needs a prompt and a completion"
                );
                SeqInput {
                    tokens: t,
                    start_pos: 0,
                    block_table: table,
                    logits_from: Some(s.prompt.len() - 1),
                }
            })
            .collect(),
    };
    let routing: Option<Vec<i32>> =
        (replay && seqs.iter().all(|s| s.routing.is_some())).then(|| {
            seqs.iter()
                .flat_map(|s| s.routing.clone().expect("checked"))
                .collect()
        });
    let mut trace = ForwardTrace::default();
    let out = model.forward_traced(&batch, &mut kv, routing.as_deref(), Some(&mut trace));
    let v = cfg.vocab_size;
    let mut logprobs = Vec::with_capacity(seqs.len());
    let mut targets = Vec::new();
    for (s, &(first, count)) in seqs.iter().zip(&out.logit_rows) {
        debug_assert_eq!(count, s.completion.len());
        let lp = (0..count)
            .map(|j| {
                let row = &out.logits[(first + j) * v..][..v];
                // The sampler's own definition, so the numbers are the server's.
                crate::sampling::prompt_logprobs(row, s.completion[j], 0)
                    .expect("finite logits")
                    .logprob
            })
            .collect();
        logprobs.push(lp);
        targets.extend_from_slice(&s.completion);
    }
    let per_row = model.num_moe_layers() * model.top_k();
    let mut routed = Vec::with_capacity(seqs.len());
    let mut row = 0;
    for t in &inputs {
        routed.push(out.routed_experts[row * per_row..(row + t.len()) * per_row].to_vec());
        row += t.len();
    }
    PolicyForward {
        logprobs,
        routed,
        logits: out.logits,
        tokens: inputs.concat(),
        seq_lens: inputs.iter().map(Vec::len).collect(),
        trace,
        targets,
    }
}

impl PolicyForward {
    /// Gradients of `sum_{s,j} d_logprob[s][j] * logprob[s][j]` for every parameter.
    pub fn backward(
        &self,
        model: &Model,
        hp: &Grads,
        mode: BackwardMode,
        d_logprob: &[Vec<f32>],
    ) -> Grads {
        let v = model.config.vocab_size;
        let mut d_logits = vec![0f32; self.logits.len()];
        let flat: Vec<f32> = d_logprob.iter().flatten().copied().collect();
        assert_eq!(
            flat.len(),
            self.targets.len(),
            "one gradient per completion token"
        );
        for (r, (&tok, &d)) in self.targets.iter().zip(&flat).enumerate() {
            if d != 0.0 {
                logprob_backward(
                    &self.logits[r * v..][..v],
                    tok as usize,
                    d,
                    &mut d_logits[r * v..][..v],
                );
            }
        }
        let batch = TracedBatch {
            trace: &self.trace,
            tokens: &self.tokens,
            seq_lens: &self.seq_lens,
        };
        backward(model, hp, mode, &batch, &d_logits)
    }
}
