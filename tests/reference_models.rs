//! lockstep against a peer: tiny random Qwen3-MoE, Qwen3 and Llama checkpoints made by
//! transformers (scripts/make_reference.py) with their float32 logits and greedy
//! continuations. The f32 path must match logits within 1e-4 relative and greedy tokens exactly.

use std::path::PathBuf;

use lockstep::backend::cpu::attention::{KvDtype, KvMemory};
use lockstep::checkpoint::{to_f32, Checkpoint};
use lockstep::model::loader::load_model;
use lockstep::model::{ForwardBatch, Model, SeqInput};

mod common;
use common::{ids, row_errors};

const BLOCK: usize = 4;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/reference")
        .join(name)
}

fn kv_for(model: &Model, blocks: usize) -> KvMemory {
    let c = &model.config;
    KvMemory::new(
        KvDtype::F32,
        c.num_layers,
        blocks,
        BLOCK,
        c.num_kv_heads,
        c.head_dim,
    )
}

/// Runs the prompt in one chunk and returns its logits `[len, vocab]`.
fn prompt_logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let table: Vec<u32> = (0..prompt.len().div_ceil(BLOCK) as u32).collect();
    let mut kv = kv_for(model, table.len());
    let batch = ForwardBatch {
        seqs: vec![SeqInput {
            tokens: prompt,
            start_pos: 0,
            block_table: &table,
            logits_from: Some(0),
        }],
    };
    model.forward(&batch, &mut kv).logits
}

fn check_model(name: &str) {
    let (model, _) = load_model(&dir(name), None, None).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir(name).join("reference.json")).unwrap())
            .unwrap();
    let reference = Checkpoint::open(&dir(name).join("reference_logits.safetensors")).unwrap();
    let prompts = meta["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 3);
    for (i, p) in prompts.iter().enumerate() {
        let prompt = ids(p);
        let want = to_f32(
            "logits",
            &reference.tensor(&format!("prompt{i}.logits")).unwrap(),
        )
        .unwrap();
        let got = prompt_logits(&model, &prompt);
        let vocab = model.config.vocab_size;
        for (pos, (diff, scale)) in row_errors(&got, &want, vocab).into_iter().enumerate() {
            assert!(
                diff <= 1e-4 * scale,
                "{name} prompt {i} pos {pos}: max |diff| {diff} vs max |logit| {scale}"
            );
        }
        let want_greedy = ids(&meta["greedy"][i]);
        assert_eq!(
            common::greedy(&model, &prompt, want_greedy.len(), KvDtype::F32, BLOCK),
            want_greedy,
            "{name} prompt {i} greedy"
        );
    }
}

#[test]
fn qwen3_moe_matches_transformers() {
    check_model("qwen3_moe");
}

#[test]
fn qwen3_matches_transformers() {
    check_model("qwen3");
}

#[test]
fn llama_with_llama3_rope_scaling_and_tied_embeddings_matches_transformers() {
    check_model("llama");
}

/// Quantized paths: experts (and, for MXFP8, attention) quantized at load with the shipped
/// recipes must match an f64 reference (scripts/quantized_reference.py, built on the
/// independent numpy quantizer) that applies the same quantized operands, to 1e-5 relative.
#[test]
fn quantized_experts_match_the_f64_reference() {
    use lockstep::model::loader::Quantization;
    let reference =
        Checkpoint::open(&dir("qwen3_moe").join("quantized_logits.safetensors")).unwrap();
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir("qwen3_moe").join("reference.json")).unwrap(),
    )
    .unwrap();
    let (plain, _) = load_model(&dir("qwen3_moe"), None, None).unwrap();
    for (recipe, q) in [
        ("nvfp4", Quantization::Nvfp4Online),
        ("mxfp8", Quantization::Mxfp8),
    ] {
        let (model, used) = load_model(&dir("qwen3_moe"), Some(q), None).unwrap();
        assert_eq!(used.name, recipe);
        let vocab = model.config.vocab_size;
        for (i, p) in meta["prompts"].as_array().unwrap().iter().enumerate() {
            let prompt = ids(p);
            let want = to_f32(
                "logits",
                &reference
                    .tensor(&format!("{recipe}.prompt{i}.logits"))
                    .unwrap(),
            )
            .unwrap();
            let got = prompt_logits(&model, &prompt);
            let unquantized = prompt_logits(&plain, &prompt);
            let moved = row_errors(&unquantized, &want, vocab);
            for (pos, (diff, scale)) in row_errors(&got, &want, vocab).into_iter().enumerate() {
                assert!(
                    diff <= 1e-5 * scale,
                    "{recipe} prompt {i} pos {pos}: max |diff| {diff} vs max |logit| {scale}"
                );
                // Quantization is really applied: far from the high-precision logits.
                assert!(
                    moved[pos].0 > 1e-3 * scale,
                    "{recipe} prompt {i} pos {pos}: quantized logits equal the BF16 ones"
                );
            }
        }
    }
}

/// `lockstep convert` then serving the converted checkpoint computes exactly what online
/// quantization at load computes: the same bytes, the same logits.
#[test]
fn converted_checkpoints_serve_the_same_logits_as_online_quantization() {
    use lockstep::convert::{convert, ConvertOptions};
    use lockstep::model::loader::Quantization;
    use lockstep::quant::Recipe;
    let tmp = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = vec![17, 300, 42, 42, 7, 99, 128];
    for (name, q) in [
        ("nvfp4", Quantization::Nvfp4Online),
        ("mxfp8", Quantization::Mxfp8),
    ] {
        let out = tmp.path().join(name);
        let recipe = Recipe::builtin(name).unwrap();
        convert(&ConvertOptions {
            input: &dir("qwen3_moe"),
            output: &out,
            recipe: &recipe,
            max_shard_bytes: 1 << 20,
            progress: false,
        })
        .unwrap();
        let (online, _) = load_model(&dir("qwen3_moe"), Some(q), None).unwrap();
        // No --quantization: the format is detected from quantization_config.
        let (stored, used) = load_model(&out, None, None).unwrap();
        assert_eq!(used.name, name);
        assert_eq!(
            bits(&prompt_logits(&stored, &prompt)),
            bits(&prompt_logits(&online, &prompt)),
            "{name}"
        );
    }
}

/// A request's logits are bitwise identical alone, batched with others, chunked, and with its
/// prefix read from cache blocks another request wrote.
#[test]
fn logits_are_batch_and_prefix_cache_invariant() {
    let (model, _) = load_model(&dir("qwen3_moe"), None, None).unwrap();
    let vocab = model.config.vocab_size;
    let prompt: Vec<u32> = (0..11).map(|i| (i * 37 % 500) as u32).collect();
    let alone = prompt_logits(&model, &prompt);

    // Batched with two unrelated sequences, in the middle of the batch.
    let (a, b): (Vec<u32>, Vec<u32>) = (
        (0..7).map(|i| i * 3 + 1).collect(),
        (0..5).map(|i| 400 - i).collect(),
    );
    let mut kv = kv_for(&model, 12);
    let (ta, tp, tb) = (vec![0u32, 1], vec![2u32, 3, 4], vec![5u32, 6]);
    let batch = ForwardBatch {
        seqs: vec![
            SeqInput {
                tokens: &a,
                start_pos: 0,
                block_table: &ta,
                logits_from: Some(0),
            },
            SeqInput {
                tokens: &prompt,
                start_pos: 0,
                block_table: &tp,
                logits_from: Some(0),
            },
            SeqInput {
                tokens: &b,
                start_pos: 0,
                block_table: &tb,
                logits_from: Some(3),
            },
        ],
    };
    let out = model.forward(&batch, &mut kv);
    let (start, rows) = out.logit_rows[1];
    assert_eq!(rows, prompt.len());
    assert_eq!(
        bits(&out.logits[start * vocab..][..rows * vocab]),
        bits(&alone)
    );

    // Prefix (two full blocks) computed by another request, then only the suffix computed.
    let mut kv = kv_for(&model, 8);
    let table = vec![4u32, 6, 1];
    let first = ForwardBatch {
        seqs: vec![SeqInput {
            tokens: &prompt[..8],
            start_pos: 0,
            block_table: &table[..2],
            logits_from: None,
        }],
    };
    model.forward(&first, &mut kv);
    let rest = ForwardBatch {
        seqs: vec![SeqInput {
            tokens: &prompt[8..],
            start_pos: 8,
            block_table: &table,
            logits_from: Some(0),
        }],
    };
    let tail = model.forward(&rest, &mut kv).logits;
    assert_eq!(bits(&tail), bits(&alone[8 * vocab..]));
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
