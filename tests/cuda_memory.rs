//! `/release_memory_occupation` on a GPU, through the engine handle the endpoints call: the
//! released KV cache and weights go back to the driver (the device's free memory grows by what
//! was released, and another allocator, as a colocated trainer's would, can take at least 90%
//! of it while this engine holds almost nothing else), and what a resume brings back computes
//! the same bits as before: the weights from their host backup (`--enable-weights-cpu-backup`),
//! or, without one, from an update that writes every tensor (resumed weights are absent and
//! refused until then; a partial update is refused).
//!
//! These need an NVIDIA GPU, so they are `#[ignore]`d here and run on the GPU host
//! (scripts/gpu-check.sh).

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use lockstep::backend::cpu::attention::KvDtype;
use lockstep::engine::{
    CudaSource, Engine, EngineConfig, EngineError, EngineHandle, EngineInfo, ExecutorSpec,
    GenerateRequest, MemoryTag, WeightsState,
};
use lockstep::model::loader::load_model;
use lockstep::model::ModelConfig;
use lockstep::quant::Recipe;
use lockstep::sampling::SamplingParams;
use lockstep::tokenizer::Tokenizer;

mod common;
use common::cuda::{seed, Rng};
use common::run_requests;

const GIB: f64 = (1u64 << 30) as f64;

/// A word-level tokenizer with one made-up word per model token (text is not compared).
fn word_tokenizer(vocab: usize) -> Tokenizer {
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

fn start(weights: CudaSource, config: ModelConfig, recipe: &Recipe, backup: bool) -> EngineHandle {
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

fn greedy(rid: String, ids: Vec<u32>) -> GenerateRequest {
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
type Bits = Vec<Vec<(u32, u32, Vec<(u32, u32)>)>>;

fn generate(h: &EngineHandle, prompts: &[Vec<u32>], tag: &str) -> Bits {
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

fn prompts(rng: &mut Rng, vocab: usize) -> Vec<Vec<u32>> {
    [7, 33, 150]
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(vocab) as u32).collect())
        .collect()
}

fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// Device allocations made outside the engine with the driver's own allocator (`cuMemAlloc`,
/// what PyTorch's caching allocator uses), freed on drop.
struct Foreign {
    ctx: Arc<CudaContext>,
    ptrs: Vec<cudarc::driver::sys::CUdeviceptr>,
    bytes: usize,
}

impl Foreign {
    fn new(ctx: &Arc<CudaContext>) -> Foreign {
        Foreign {
            ctx: ctx.clone(),
            ptrs: Vec::new(),
            bytes: 0,
        }
    }

    /// Allocates `bytes` (in chunks of at most 1 GiB) and writes every byte.
    fn take(&mut self, bytes: usize) -> Result<(), cudarc::driver::DriverError> {
        self.ctx.bind_to_thread()?;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(1 << 30);
            // SAFETY: the context is bound; the pointer is freed in drop, written only here.
            unsafe {
                let p = cudarc::driver::result::malloc_sync(n)?;
                self.ptrs.push(p);
                cudarc::driver::result::memset_d8_sync(p, 0xA5, n)?;
            }
            self.bytes += n;
            left -= n;
        }
        Ok(())
    }
}

impl Drop for Foreign {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for p in self.ptrs.drain(..) {
            // SAFETY: allocated by `take`, freed once.
            let _ = unsafe { cudarc::driver::result::free_sync(p) };
        }
    }
}

fn free_memory(ctx: &Arc<CudaContext>) -> usize {
    ctx.mem_get_info().unwrap().0
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn released_memory_goes_to_another_allocator_and_the_backup_restores_the_same_bits() {
    let mut rng = Rng(seed());
    let mut raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string("configs/qwen3-30b-a3b.json").unwrap())
            .unwrap();
    raw["num_hidden_layers"] = 4.into();
    let config = ModelConfig::from_json(raw).unwrap();
    let recipe = Recipe::builtin("bf16").unwrap();
    let weights = CudaSource::Dummy {
        config: config.clone(),
        recipe: recipe.clone(),
        seed: 3,
    };
    let h = start(weights, config.clone(), &recipe, true);
    assert!(h.memory().weights_backup);
    let prompts = prompts(&mut rng, config.vocab_size);
    let before = generate(&h, &prompts, "before");

    // Leave the engine little room beside what it holds, so the allocation below can only
    // come from what the release gives back.
    let ctx = CudaContext::new(0).unwrap();
    let mut squeeze = Foreign::new(&ctx);
    let spare = 1usize << 30;
    squeeze
        .take(free_memory(&ctx).saturating_sub(spare))
        .unwrap();
    let free_before = free_memory(&ctx);
    println!(
        "squeezed {:.2} GiB; free {:.2} GiB",
        squeeze.bytes as f64 / GIB,
        free_before as f64 / GIB
    );

    let r = block_on(h.release_memory(None)).unwrap();
    assert_eq!(r.state.released(), vec!["kv_cache", "weights"]);
    assert_eq!(r.state.weights, WeightsState::Released { backup: true });
    // Weights (~6 GiB at this shape in BF16) and the 65536-token KV cache (0.5 GiB).
    assert!(r.bytes > 4 << 30, "released {} bytes", r.bytes);
    let free_after = free_memory(&ctx);
    println!(
        "released {:.2} GiB; free {:.2} -> {:.2} GiB",
        r.bytes as f64 / GIB,
        free_before as f64 / GIB,
        free_after as f64 / GIB
    );
    let wanted = r.bytes / 10 * 9;
    assert!(
        free_after >= free_before + wanted,
        "the driver got back {} of {} released bytes",
        free_after.saturating_sub(free_before),
        r.bytes
    );
    assert!(
        matches!(
            h.submit(greedy("r".into(), vec![1, 2])),
            Err(EngineError::Unavailable(_))
        ),
        "no generation while released"
    );
    let mut trainer = Foreign::new(&ctx);
    trainer.take(wanted).expect("90% of the released bytes");
    assert!(
        trainer.bytes > spare,
        "more than was free before the release"
    );
    drop(trainer);
    drop(squeeze);

    let r = block_on(h.resume_memory(None)).unwrap();
    assert_eq!(r.state.released(), Vec::<&str>::new());
    assert_eq!(r.state.weights, WeightsState::Resident);
    assert_eq!(generate(&h, &prompts, "after"), before, "bit for bit");
    h.shutdown();
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn weights_resumed_without_a_backup_are_absent_until_an_update_writes_every_tensor() {
    let mut rng = Rng(seed());
    let dir = Path::new("tests/data/reference/qwen3_moe");
    let host = || load_model(dir, None, None).unwrap().0;
    let (served, recipe) = load_model(dir, None, None).unwrap();
    let config = served.config.clone();
    let h = start(CudaSource::Model(served), config.clone(), &recipe, false);
    assert!(!h.memory().weights_backup);
    let prompts = prompts(&mut rng, config.vocab_size);
    let before = generate(&h, &prompts, "before");

    let r = block_on(h.release_memory(Some(vec![MemoryTag::Weights]))).unwrap();
    assert_eq!(r.state.weights, WeightsState::Released { backup: false });
    assert!(r.bytes > 0);
    let r = block_on(h.resume_memory(Some(vec![MemoryTag::Weights]))).unwrap();
    assert_eq!(r.state.weights, WeightsState::Absent);
    assert!(matches!(
        h.submit(greedy("r".into(), vec![1, 2])),
        Err(EngineError::Unavailable(_))
    ));

    // The resumed buffers hold zeros; one tensor is not enough to serve them.
    let mut model = host();
    let checksum = Arc::new(model.weights_checksum());
    let one: Vec<_> = model.into_replacements().into_iter().take(1).collect();
    let partial = block_on(h.apply_weights(one, checksum.clone(), "v1".into()));
    assert!(matches!(partial, Err(EngineError::MemoryState(_))));
    assert_eq!(h.memory().weights, WeightsState::Absent);

    // Every tensor, written into the resumed buffers: present, and the same bits as before.
    block_on(h.apply_weights(host().into_replacements(), checksum.clone(), "v1".into())).unwrap();
    assert_eq!(h.memory().weights, WeightsState::Resident);
    assert_eq!(generate(&h, &prompts, "after"), before, "bit for bit");
    h.shutdown();
}
