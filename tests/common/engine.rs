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
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!(
        "lockstep-word-tokenizer-{}-{n}-{vocab}.json",
        std::process::id()
    ));
    std::fs::write(&path, json.to_string()).unwrap();
    let t = Tokenizer::from_file(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    t
}

/// What the engine publishes about a test model: a word tokenizer, `recipe`, and whether the
/// weights live only on the device (`weights_on_device`: updates are checked against the
/// device's slot table).
pub fn engine_info(
    config: ModelConfig,
    recipe: &Recipe,
    weights_on_device: bool,
    max_context_len: usize,
) -> EngineInfo {
    let tokenizer = Arc::new(word_tokenizer(config.vocab_size));
    EngineInfo {
        model_path: "test".into(),
        served_model_name: "test".into(),
        config,
        tokenizer,
        quantization: recipe.name.clone(),
        recipe_name: recipe.name.clone(),
        recipe_hash: recipe.hash(),
        recipe: recipe.clone(),
        // Published by the engine from the device weights (when they live there).
        slots: Default::default(),
        weights_on_device,
        max_context_len,
        block_size: 16,
        weight_version: std::sync::RwLock::new("v0".into()),
        weights_checksum: std::sync::RwLock::new(("v0".into(), Default::default())),
    }
}

/// Engine sizes for tests: a BF16 KV cache of 65536 tokens in blocks of 16 (the CUDA cache is
/// BF16; a CPU engine compared with it must be too).
pub fn engine_config(
    max_running_requests: usize,
    max_batch_tokens: usize,
    max_context_len: usize,
    max_queued_requests: usize,
) -> EngineConfig {
    EngineConfig {
        max_running_requests,
        max_batch_tokens,
        max_total_tokens: 65536,
        block_size: 16,
        max_context_len,
        max_queued_requests,
        kv_dtype: KvDtype::Bf16,
        schedule_conservativeness: lockstep::engine::defaults::SCHEDULE_CONSERVATIVENESS,
    }
}

/// A CUDA engine over `weights`, device-only, 8 running requests, 512-token batches.
pub fn start(
    weights: CudaSource,
    config: ModelConfig,
    recipe: &Recipe,
    backup: bool,
) -> EngineHandle {
    let info = engine_info(config, recipe, true, 1024);
    let cfg = engine_config(8, 512, 1024, 64);
    let spec = ExecutorSpec::Cuda {
        device: 0,
        weights,
        mem_fraction_static: 0.9,
        max_total_tokens: Some(65536),
        block_scaled_gemm: false,
        cuda_graph_max_bs: lockstep::engine::defaults::CUDA_GRAPH_MAX_BS,
        weights_cpu_backup: backup,
    };
    Engine::start_with(spec, info, cfg).unwrap_or_else(|e| panic!("{e}"))
}

/// 16 greedy tokens with their logprobs and top-5 alternatives.
pub fn greedy(rid: String, ids: Vec<u32>) -> GenerateRequest {
    greedy_request(rid, ids, 16, None, 5)
}

/// `max_new` greedy tokens with their logprobs and `top` alternatives, and input logprobs from
/// `logprob_start_len` on when given.
pub fn greedy_request(
    rid: String,
    ids: Vec<u32>,
    max_new: usize,
    logprob_start_len: Option<usize>,
    top: usize,
) -> GenerateRequest {
    let params = SamplingParams {
        max_new_tokens: Some(max_new as i64),
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
        logprob_start_len,
        top_logprobs_num: top,
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
