//! The trainer's hand-written backward against PyTorch autograd: for the tiny transformers
//! checkpoints in tests/data/reference, `grad_fixture.json` (scripts/make_grad_fixtures.py)
//! holds a loss over sampled-looking sequences and its gradient, from autograd, at random
//! positions of every weight. lockstep's forward and backward must reproduce both.

use std::path::PathBuf;

use lockstep::backend::cpu::attention::KvDtype;
use lockstep::model::loader::load_model;
use lockstep::quant::Recipe;
use lockstep::train::linear_grad::BackwardMode;
use lockstep::train::params::{Params, ServingPrecision};
use lockstep::train::policy::{forward, Sequence};
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check(name: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/reference")
        .join(name);
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("grad_fixture.json")).unwrap())
            .unwrap();
    let (mut model, _) = load_model(&dir, None, None).unwrap();
    let params = Params::from_model(&mut model);
    let model = params
        .serving_model(&Recipe::bf16(), ServingPrecision::F32)
        .unwrap();
    let seqs: Vec<Sequence> = fixture["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| Sequence {
            prompt: ids(&s["prompt"]),
            completion: ids(&s["completion"]),
            routing: None,
        })
        .collect();
    let coeffs: Vec<Vec<f32>> = fixture["coeffs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            c.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    let fwd = forward(&model, &seqs, KvDtype::F32, false);
    let loss: f64 = fwd
        .logprobs
        .iter()
        .flatten()
        .zip(coeffs.iter().flatten())
        .map(|(a, b)| *a as f64 * *b as f64)
        .sum();
    let want = fixture["loss"].as_f64().unwrap();
    assert!(
        (loss - want).abs() <= 1e-4 * (1.0 + want.abs()),
        "{name}: loss {loss} vs torch {want}"
    );
    let grads = fwd.backward(
        &model,
        &params.values(),
        BackwardMode::HighPrecision,
        &coeffs,
    );
    let mut tensors = 0;
    for (tensor, g) in fixture["grads"].as_object().unwrap() {
        // Tied embeddings: torch reports the one shared matrix under the embedding's name.
        let ours = &grads[tensor];
        let values: Vec<f64> = g["value"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let scale = values.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (i, want) in g["index"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .zip(values)
        {
            let got = ours[i] as f64;
            assert!(
                (got - want).abs() <= 1e-3 * (scale + want.abs()) + 1e-6,
                "{name}: {tensor}[{i}] = {got}, torch {want} (tensor scale {scale})"
            );
        }
        tensors += 1;
    }
    assert_eq!(tensors, grads.len(), "{name}: every weight has a fixture");
}

#[test]
fn qwen3_moe_gradients_match_torch_autograd() {
    check("qwen3_moe");
}

#[test]
fn qwen3_tied_embedding_gradients_match_torch_autograd() {
    check("qwen3");
}

#[test]
fn llama_gradients_match_torch_autograd() {
    check("llama");
}
