//! The trainer's forward is the server's: for the same weights, the logprobs the trainer
//! computes for sampled completions equal, bit for bit, the logprobs `/generate` returned
//! with them, in BF16, MXFP8 and NVFP4 (the embedded model on the CPU backend). Routing
//! replay with the server's reported experts gives the same bits too.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use base64::Engine as _;
use lockstep::backend::cpu::attention::KvDtype;
use lockstep::model::loader::{serving_recipe, Quantization};
use lockstep::model::ModelConfig;
use lockstep::serve::EMBEDDED_CONFIG;
use lockstep::train::params::{Params, ServingPrecision};
use lockstep::train::policy::{forward, Sequence};
use serde_json::{json, Value};
use tower::ServiceExt;

mod common;

fn router(extra: &[&str]) -> axum::Router {
    let mut flags = vec!["--enable-return-routed-experts"];
    flags.extend_from_slice(extra);
    common::server::router(&common::server::serve_args(&flags))
}

async fn generate(r: &axum::Router, body: Value) -> Value {
    let resp = r
        .clone()
        .oneshot(
            Request::builder()
                .method("POST")
                .uri("/generate")
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

fn fresh_seed() -> u64 {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("seed {s}");
    s
}

async fn trainer_matches_server(quantization: Quantization, flag: &str) {
    let r = router(&["--quantization", flag]);
    let seed = fresh_seed();
    // Random prompts and seeds: 4 prompts x 2 samples at temperature 1.
    let prompts: Vec<Vec<u32>> = (0..4u64)
        .map(|i| {
            (0..3 + (seed >> (i * 3)) as usize % 5)
                .map(|j| ((seed >> (j % 40)) as u32 ^ (i as u32 * 97 + j as u32 * 31)) % 256)
                .collect()
        })
        .collect();
    let mut input_ids = Vec::new();
    let mut params = Vec::new();
    for p in &prompts {
        for s in 0..2u64 {
            input_ids.push(json!(p));
            params.push(
                json!({"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": true,
                               "sampling_seed": seed.wrapping_add(s) % 1_000_000}),
            );
        }
    }
    let v = generate(
        &r,
        json!({"input_ids": input_ids, "sampling_params": params, "return_logprob": true,
               "return_routed_experts": true}),
    )
    .await;
    let cfg = ModelConfig::from_json(serde_json::from_str(EMBEDDED_CONFIG).unwrap()).unwrap();
    let recipe = serving_recipe(Some(quantization), None, None).unwrap();
    let model = Params::dummy(cfg, 0)
        .unwrap()
        .serving_model(&recipe, ServingPrecision::Bf16)
        .unwrap();
    let mut seqs = Vec::new();
    let mut server_lp = Vec::new();
    for (i, item) in v.as_array().unwrap().iter().enumerate() {
        let m = &item["meta_info"];
        let completion: Vec<u32> = item["output_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        server_lp.push(
            m["output_token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e[0].as_f64().unwrap() as f32)
                .collect::<Vec<f32>>(),
        );
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(m["routed_experts"].as_str().unwrap())
            .unwrap();
        let routing: Vec<i32> = bytes
            .chunks(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        seqs.push(Sequence {
            prompt: prompts[i / 2].clone(),
            completion,
            routing: Some(routing),
        });
    }
    for replay in [false, true] {
        let f = forward(&model, &seqs, KvDtype::Bf16, replay);
        for (i, (got, want)) in f.logprobs.iter().zip(&server_lp).enumerate() {
            let (g, w): (Vec<u32>, Vec<u32>) = (
                got.iter().map(|x| x.to_bits()).collect(),
                want.iter().map(|x| x.to_bits()).collect(),
            );
            assert_eq!(
                g, w,
                "{flag} sample {i} replay {replay}: {got:?} vs {want:?}"
            );
        }
        if !replay {
            // The trainer routes as the server did.
            for (s, routed) in seqs.iter().zip(&f.routed) {
                assert_eq!(s.routing.as_ref().unwrap(), routed, "{flag}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn trainer_logprobs_are_the_servers_bf16() {
    trainer_matches_server(Quantization::Bf16, "bf16").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn trainer_logprobs_are_the_servers_mxfp8() {
    trainer_matches_server(Quantization::Mxfp8, "mxfp8").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn trainer_logprobs_are_the_servers_nvfp4() {
    trainer_matches_server(Quantization::Nvfp4Online, "nvfp4_online").await;
}
