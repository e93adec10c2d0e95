//! A CUDA engine started in-process (the handle the HTTP endpoints call), and greedy runs
//! whose every token, logprob and top-5 is kept as bits.

use std::sync::Arc;

use lockstep::backend::cpu::attention::KvDtype;
use lockstep::engine::{
    CudaSource, Engine, EngineConfig, EngineHandle, EngineInfo, ExecutorSpec, GenerateRequest,
};
use lockstep::model::ModelConfig;
use lockstep::quant::Recipe;
use lockstep::sampling::SamplingParams;
use lockstep::tokenizer::Tokenizer;

use super::cuda::Rng;
use super::run_requests;

/// A word-level tokenizer with one made-up word per model token (text is not compared).
pub fn word_tokenizer(vocab: usize) -> Tokenizer {
    let words: serde_json::Map<String, serde_json::Value> =
        (0..vocab).map(|i| (format!("w{i}"), i.into())).collect();
    let json = serde_json::json!({
        "version": "1.0", "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"}
    });
    let path = std::env::temp_dir().join(format!(
        "lockstep-cuda-memory-{}-{vocab}.json",
        std::process::id()
    ));
    std::fs::write(&path, json.to_string()).unwrap();
    let t = Tokenizer::from_file(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    t
}

pub fn start(
    weights: CudaSource,
    config: ModelConfig,
    recipe: &Recipe,
    backup: bool,
) -> EngineHandle {
    let tokenizer = Arc::new(word_tokenizer(config.vocab_size));
    let info = EngineInfo {
        model_path: "test".into(),
        served_model_name: "test".into(),
        config,
        tokenizer,
        quantization: recipe.name.clone(),
        recipe_name: recipe.name.clone(),
        recipe_hash: recipe.hash(),
        recipe: recipe.clone(),
        // Published by the engine from the device weights.
        slots: Default::default(),
        weights_on_device: true,
        max_context_len: 1024,
        block_size: 16,
        weight_version: std::sync::RwLock::new("v0".into()),
        weights_checksum: std::sync::RwLock::new(("v0".into(), Default::default())),
    };
    let cfg = EngineConfig {
        max_running_requests: 8,
        max_batch_tokens: 512,
        max_total_tokens: 65536,
        block_size: 16,
        max_context_len: 1024,
        max_queued_requests: 64,
        kv_dtype: KvDtype::Bf16,
    };
    let spec = ExecutorSpec::Cuda {
        device: 0,
        weights,
        mem_fraction_static: 0.9,
        max_total_tokens: Some(65536),
        block_scaled_gemm: false,
        weights_cpu_backup: backup,
    };
    Engine::start_with(spec, info, cfg).unwrap_or_else(|e| panic!("{e}"))
}

pub fn greedy(rid: String, ids: Vec<u32>) -> GenerateRequest {
    let params = SamplingParams {
        max_new_tokens: Some(16),
        temperature: 0.0,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    GenerateRequest {
        rid,
        input_ids: ids,
        params: params.validate(&Default::default()).unwrap(),
        seed: 1,
        sample_index: 0,
        return_logprob: true,
        logprob_start_len: None,
        top_logprobs_num: 5,
        return_routed_experts: false,
    }
}

/// Every token of every prompt: id, logprob bits, top-5 (id, logprob bits).
pub type Bits = Vec<Vec<(u32, u32, Vec<(u32, u32)>)>>;

pub fn generate(h: &EngineHandle, prompts: &[Vec<u32>], tag: &str) -> Bits {
    let reqs = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| greedy(format!("{tag}{i}"), p.clone()))
        .collect();
    run_requests(h, reqs)
        .into_iter()
        .map(|(tokens, _)| {
            tokens
                .iter()
                .map(|t| {
                    let top = t.top_logprobs.iter().map(|(i, l)| (*i, l.to_bits()));
                    (t.id, t.logprob.unwrap().to_bits(), top.collect())
                })
                .collect()
        })
        .collect()
}

pub fn prompts(rng: &mut Rng, vocab: usize) -> Vec<Vec<u32>> {
    [7, 33, 150]
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(vocab) as u32).collect())
        .collect()
}

pub fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}
