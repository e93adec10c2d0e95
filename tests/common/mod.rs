//! Helpers shared by the model-level integration tests.
#![allow(dead_code)]

pub mod cuda;
pub mod engine;
pub mod server;

use lockstep::engine::{EngineEvent, EngineHandle, FinishInfo, GenerateRequest, TokenOut};

use lockstep::backend::cpu::attention::{KvDtype, KvMemory};
use lockstep::model::{ForwardBatch, Model, SeqInput};

/// Greedy decoding one token at a time through the paged cache (ties to the lower id), with
/// the blocks laid out in reverse order so the block table is exercised.
pub fn greedy(
    model: &Model,
    prompt: &[u32],
    n: usize,
    kv_dtype: KvDtype,
    block: usize,
) -> Vec<u32> {
    let c = &model.config;
    let table: Vec<u32> = (0..(prompt.len() + n).div_ceil(block) as u32)
        .rev()
        .collect();
    let mut kv = KvMemory::new(
        kv_dtype,
        c.num_layers,
        table.len(),
        block,
        c.num_kv_heads,
        c.head_dim,
    );
    let vocab = c.vocab_size;
    let (mut chunk, mut pos, mut out) = (prompt.to_vec(), 0, Vec::new());
    for _ in 0..n {
        let batch = ForwardBatch {
            seqs: vec![SeqInput {
                tokens: &chunk,
                start_pos: pos,
                block_table: &table,
                logits_from: Some(chunk.len() - 1),
            }],
        };
        let logits = model.forward(&batch, &mut kv).logits;
        assert_eq!(logits.len(), vocab);
        let next = (0..vocab)
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .unwrap() as u32;
        pos += chunk.len();
        out.push(next);
        chunk = vec![next];
    }
    out
}

/// Per position: the max |got - want| and the max |want| of that logit row.
pub fn row_errors(got: &[f32], want: &[f32], vocab: usize) -> Vec<(f32, f32)> {
    assert_eq!(got.len(), want.len());
    got.chunks(vocab)
        .zip(want.chunks(vocab))
        .map(|(g, w)| {
            (
                g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs())),
                w.iter().fold(0f32, |m, v| m.max(v.abs())),
            )
        })
        .collect()
}

/// A JSON list of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Submits the requests together (so the engine batches them) and returns each one's tokens
/// and finish, in order.
pub fn run_requests(
    h: &EngineHandle,
    reqs: Vec<GenerateRequest>,
) -> Vec<(Vec<TokenOut>, FinishInfo)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let rxs: Vec<_> = reqs.into_iter().map(|r| h.submit(r).unwrap()).collect();
    rt.block_on(async {
        let mut out = Vec::new();
        for mut rx in rxs {
            let mut tokens = Vec::new();
            loop {
                match rx.recv().await.expect("event") {
                    EngineEvent::Token(t) => tokens.push(t),
                    EngineEvent::Finished(f) => {
                        out.push((tokens, *f));
                        break;
                    }
                    EngineEvent::Error(e) => panic!("engine error: {e}"),
                }
            }
        }
        out
    })
}
