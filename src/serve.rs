//! `lockstep serve`: its flags (SGLang's names where one exists, each also read from the
//! environment) and the start-up that turns them into a model, an engine and a server.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::cpu::attention::KvDtype;
use crate::engine::{
    defaults, CudaSource, Engine, EngineConfig, EngineHandle, EngineInfo, ExecutorSpec,
};
use crate::model::loader::{self, Quantization};
use crate::model::ModelConfig;
use crate::quant::Recipe;
use crate::server::{self, AppState, Auth, Limits};
use crate::tokenizer::Tokenizer;

/// The embedded default: a small Qwen3-MoE with deterministic random weights and a
/// byte-level tokenizer, so `lockstep serve` works on a fresh machine with no download.
pub const EMBEDDED_CONFIG: &str = include_str!("../configs/embedded-qwen3-moe.json");
const EMBEDDED_SEED: u64 = 0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadFormat {
    /// Read weights from the checkpoint.
    Auto,
    /// Deterministic random weights for the checkpoint's (or config file's) config, standing
    /// for a checkpoint in the `--quantization` format (`nvfp4` and `fp8` included).
    Dummy,
}

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// A CUDA GPU when a driver, a device and NVRTC are present, else the CPU.
    Auto,
    Cuda,
    Cpu,
}

/// Default KV capacity on the CPU (on CUDA the cache is sized from device memory).

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCacheDtype {
    /// F32 for F32 checkpoints, BF16 otherwise (SGLang's `auto`: the model's dtype).
    Auto,
    Bf16,
    F32,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Hugging Face model directory. Without it the embedded demo model is served.
    #[arg(
        long = "model-path",
        visible_alias = "model",
        env = "LOCKSTEP_MODEL_PATH",
        help_heading = "Model"
    )]
    pub model_path: Option<PathBuf>,
    /// Name reported by /v1/models (default: the directory name, or "lockstep-embedded").
    #[arg(long, env = "LOCKSTEP_SERVED_MODEL_NAME", help_heading = "Model")]
    pub served_model_name: Option<String>,
    /// How linear weights are stored and computed; default: whatever the checkpoint holds.
    #[arg(
        long,
        value_enum,
        env = "LOCKSTEP_QUANTIZATION",
        help_heading = "Model"
    )]
    pub quantization: Option<Quantization>,
    /// Precision recipe YAML (default: configs/<quantization>.yaml, built in).
    #[arg(long, env = "LOCKSTEP_RECIPE", help_heading = "Model")]
    pub recipe: Option<PathBuf>,
    #[arg(
        long,
        value_enum,
        default_value = "auto",
        env = "LOCKSTEP_LOAD_FORMAT",
        help_heading = "Model"
    )]
    pub load_format: LoadFormat,
    /// Where the model runs.
    #[arg(
        long,
        value_enum,
        default_value = "auto",
        env = "LOCKSTEP_DEVICE",
        help_heading = "Model"
    )]
    pub device: DeviceChoice,
    /// CUDA device ordinal (SGLang's --base-gpu-id).
    #[arg(
        long,
        default_value_t = 0,
        env = "LOCKSTEP_BASE_GPU_ID",
        help_heading = "Model"
    )]
    pub base_gpu_id: usize,
    /// Share of GPU memory for weights and the KV cache; the KV cache gets what the weights and
    /// activation buffers leave of it.
    #[arg(
        long,
        default_value_t = 0.85,
        env = "LOCKSTEP_MEM_FRACTION_STATIC",
        help_heading = "Model"
    )]
    pub mem_fraction_static: f32,
    /// Blackwell (sm_100) only: run the MXFP8/NVFP4 GEMMs on cuBLASLt's block-scaled tensor
    /// cores. Faster there, but not batch-invariant (cuBLASLt picks its algorithm by shape) and
    /// never run on Blackwell by this project (docs/gpu.md, docs/determinism.md).
    #[arg(long, env = "LOCKSTEP_CUDA_BLOCK_SCALED_GEMM", help_heading = "Model")]
    pub cuda_block_scaled_gemm: bool,
    /// CUDA: decode steps of up to this many sequences run on CUDA graphs (padded to a capture
    /// size, recorded on that size's second step; SGLang's flag).
    #[arg(
        long,
        default_value_t = defaults::CUDA_GRAPH_MAX_BS,
        env = "LOCKSTEP_CUDA_GRAPH_MAX_BS",
        help_heading = "Model"
    )]
    pub cuda_graph_max_bs: usize,
    /// CUDA: run every step's kernels one launch at a time (SGLang's flag).
    #[arg(long, env = "LOCKSTEP_DISABLE_CUDA_GRAPH", help_heading = "Model")]
    pub disable_cuda_graph: bool,
    /// Longest prompt + output in tokens (default: the model's max_position_embeddings).
    #[arg(long, env = "LOCKSTEP_CONTEXT_LENGTH", help_heading = "Model")]
    pub context_length: Option<usize>,

    #[arg(
        long,
        default_value = "127.0.0.1",
        env = "LOCKSTEP_HOST",
        help_heading = "HTTP"
    )]
    pub host: String,
    #[arg(
        long,
        default_value_t = 30000,
        env = "LOCKSTEP_PORT",
        help_heading = "HTTP"
    )]
    pub port: u16,
    /// Key required for generation endpoints (Authorization: Bearer KEY).
    #[arg(long, env = "LOCKSTEP_API_KEY", help_heading = "HTTP")]
    pub api_key: Option<String>,
    /// Key required for endpoints that change weights or server state.
    #[arg(long, env = "LOCKSTEP_ADMIN_API_KEY", help_heading = "HTTP")]
    pub admin_api_key: Option<String>,
    #[arg(long, default_value_t = 32 << 20, env = "LOCKSTEP_MAX_REQUEST_BYTES", help_heading = "HTTP")]
    pub max_request_bytes: usize,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT.
    #[arg(
        long,
        default_value_t = 30,
        env = "LOCKSTEP_GRACE_PERIOD",
        help_heading = "HTTP"
    )]
    pub grace_period_s: u64,

    /// Requests running at once (default: 64 on the CPU; on CUDA 1024, at most
    /// --chunked-prefill-size, the KV cache bounding them through admission's reserve).
    #[arg(
        long,
        env = "LOCKSTEP_MAX_RUNNING_REQUESTS",
        help_heading = "Scheduling"
    )]
    pub max_running_requests: Option<usize>,
    /// KV cache capacity in tokens (default: 65536 on the CPU; on CUDA, what
    /// --mem-fraction-static leaves, capped by this when given).
    #[arg(long, env = "LOCKSTEP_MAX_TOTAL_TOKENS", help_heading = "Scheduling")]
    pub max_total_tokens: Option<usize>,
    /// Tokens computed per step (prefill chunks + decodes; default: 2048 on the CPU, 8192 on
    /// CUDA, SGLang's default on a GPU of an H200's memory).
    #[arg(
        long,
        env = "LOCKSTEP_CHUNKED_PREFILL_SIZE",
        help_heading = "Scheduling"
    )]
    pub chunked_prefill_size: Option<usize>,
    /// KV cache block size in tokens.
    #[arg(
        long,
        default_value_t = defaults::BLOCK_SIZE,
        env = "LOCKSTEP_PAGE_SIZE",
        help_heading = "Scheduling"
    )]
    pub page_size: usize,
    /// Requests queued beyond this are answered 503 with Retry-After.
    #[arg(
        long,
        default_value_t = defaults::MAX_QUEUED_REQUESTS,
        env = "LOCKSTEP_MAX_QUEUED_REQUESTS",
        help_heading = "Scheduling"
    )]
    pub max_queued_requests: usize,
    /// How much free KV admission keeps for the running requests' future tokens, as SGLang's
    /// flag of the name: at 1, 70% of each one's remaining max_new_tokens (clipped to 4096),
    /// decaying to 10% as steps pass without preemption; higher admits fewer requests at once
    /// (fewer preemptions), 0 admits on the prompt alone.
    #[arg(
        long,
        default_value_t = defaults::SCHEDULE_CONSERVATIVENESS,
        env = "LOCKSTEP_SCHEDULE_CONSERVATIVENESS",
        help_heading = "Scheduling"
    )]
    pub schedule_conservativeness: f64,
    #[arg(
        long,
        value_enum,
        default_value = "auto",
        env = "LOCKSTEP_KV_CACHE_DTYPE",
        help_heading = "Scheduling"
    )]
    pub kv_cache_dtype: KvCacheDtype,

    /// Largest `n` (samples per prompt) a request may ask for.
    #[arg(
        long,
        default_value_t = 64,
        env = "LOCKSTEP_MAX_N",
        help_heading = "Limits"
    )]
    pub max_n: usize,
    /// Largest top_logprobs_num / logprobs a request may ask for.
    #[arg(
        long,
        default_value_t = 20,
        env = "LOCKSTEP_MAX_TOP_LOGPROBS",
        help_heading = "Limits"
    )]
    pub max_top_logprobs: usize,
    /// Allow `return_routed_experts` (off: such requests get 400).
    #[arg(
        long,
        env = "LOCKSTEP_ENABLE_RETURN_ROUTED_EXPERTS",
        help_heading = "Limits"
    )]
    pub enable_return_routed_experts: bool,

    /// Largest streamed weight-update bucket, and largest total of parts a session holds
    /// waiting for others (a gate/up half without its partner, pre-quantized parts); whole
    /// slots are prepared on arrival and not counted.
    #[arg(long, default_value_t = 4 << 30, env = "LOCKSTEP_MAX_STAGED_WEIGHT_BYTES", help_heading = "Weights")]
    pub max_staged_weight_bytes: usize,
    /// Prepared slots (bucket bytes) a streamed update that writes in place keeps in memory
    /// until its commit; the rest wait in an unlinked file in --weight-spill-dir and are read
    /// back a layer at a time during the commit's pause (which they lengthen), so host memory
    /// stays bounded. Default: 1 GiB when the weights live only on the device, no bound when
    /// they are in host memory (the CPU backend).
    #[arg(
        long,
        env = "LOCKSTEP_MAX_PREPARED_WEIGHT_BYTES",
        help_heading = "Weights"
    )]
    pub max_prepared_weight_bytes: Option<usize>,
    /// Directory of the spill files of in-place weight updates (default: $TMPDIR or /tmp; use
    /// one on a disk, not a tmpfs, or the spill stays in memory).
    #[arg(long, env = "LOCKSTEP_WEIGHT_SPILL_DIR", help_heading = "Weights")]
    pub weight_spill_dir: Option<std::path::PathBuf>,
    /// Keep what an in-place commit with spilled slots overwrites (in an undo file beside the
    /// spill) so that a commit that fails midway is rolled back to the old weights instead of
    /// marking them absent. It writes the overwritten weights to disk during the commit's pause.
    #[arg(
        long,
        env = "LOCKSTEP_WEIGHT_UPDATE_ROLLBACK",
        help_heading = "Weights"
    )]
    pub weight_update_rollback: bool,
    /// Device memory an in-place commit (a session past --max-prepared-weight-bytes, or
    /// --weight-update-shadow off) fills with its spilled layers, read back from disk while
    /// generation goes on, before it pauses generation to write them; the rest is read during
    /// the pause. Default: what is free on the device, less 1 GiB.
    #[arg(
        long,
        env = "LOCKSTEP_MAX_READ_AHEAD_WEIGHT_BYTES",
        help_heading = "Weights"
    )]
    pub max_read_ahead_weight_bytes: Option<usize>,
    /// Seconds a streamed weight update session may stay idle before it is dropped.
    #[arg(
        long,
        default_value_t = 600,
        env = "LOCKSTEP_WEIGHT_UPDATE_TIMEOUT",
        help_heading = "Weights"
    )]
    pub weight_update_timeout_s: u64,
    /// Where a streamed weight update writes: `auto` into a shadow copy on the device when
    /// free device memory holds one beside the served weights (commit is a swap between two
    /// steps; the KV cache is sized first, so lower --mem-fraction-static to leave room),
    /// else in place at commit (generation stands still for the writes); `on` always a
    /// shadow (refused when it does not fit; on the CPU the copy is made on the engine
    /// thread); `off` always in place.
    #[arg(
        long,
        value_enum,
        default_value_t = crate::server::weights::ShadowMode::Auto,
        env = "LOCKSTEP_WEIGHT_UPDATE_SHADOW",
        help_heading = "Weights"
    )]
    pub weight_update_shadow: crate::server::weights::ShadowMode,
    /// Directory that `/update_weights_from_disk` may read checkpoints from (off when unset).
    #[arg(long, env = "LOCKSTEP_WEIGHTS_ROOT", help_heading = "Weights")]
    pub weights_root: Option<PathBuf>,
    /// CUDA: `/release_memory_occupation` copies the weights to host memory before freeing
    /// them, and resume restores them bit for bit (SGLang's flag). Off: resumed weights are
    /// absent (generation refused) until an update writes every tensor. The CPU backend's
    /// weights are host memory and always come back.
    #[arg(
        long,
        env = "LOCKSTEP_ENABLE_WEIGHTS_CPU_BACKUP",
        help_heading = "Weights"
    )]
    pub enable_weights_cpu_backup: bool,

    /// trace, debug, info, warn or error.
    #[arg(
        long,
        default_value = "info",
        env = "LOCKSTEP_LOG_LEVEL",
        help_heading = "Runtime"
    )]
    pub log_level: String,
    /// CPU threads for the model (default: all cores).
    #[arg(long, env = "LOCKSTEP_THREADS", help_heading = "Runtime")]
    pub threads: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Load(#[from] loader::LoadError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    Recipe(#[from] crate::quant::recipe::RecipeError),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl ServeArgs {
    /// `--max-running-requests`, or its default on the device (`cuda`) the engine runs on.
    pub fn running_requests(&self, cuda: bool) -> usize {
        self.max_running_requests.unwrap_or(if cuda {
            defaults::CUDA_MAX_RUNNING_REQUESTS.min(self.batch_tokens(cuda))
        } else {
            defaults::MAX_RUNNING_REQUESTS
        })
    }

    /// `--chunked-prefill-size`, or its default on the device (`cuda`) the engine runs on.
    pub fn batch_tokens(&self, cuda: bool) -> usize {
        self.chunked_prefill_size.unwrap_or(if cuda {
            defaults::CUDA_MAX_BATCH_TOKENS
        } else {
            defaults::MAX_BATCH_TOKENS
        })
    }

    /// The largest decode batch run on a CUDA graph (0: none, `--disable-cuda-graph`).
    pub fn cuda_graph_rows(&self) -> usize {
        if self.disable_cuda_graph {
            0
        } else {
            self.cuda_graph_max_bs
        }
    }
}

/// Flag combinations the engine cannot run with, reported before anything is loaded.
fn check_sizes(
    args: &ServeArgs,
    max_running_requests: usize,
    batch_tokens: usize,
) -> Result<(), ServeError> {
    let bad = |msg: String| Err(ServeError::Config(msg));
    if !(args.schedule_conservativeness >= 0.0 && args.schedule_conservativeness.is_finite()) {
        return bad(format!(
            "--schedule-conservativeness must be a number >= 0, not {}",
            args.schedule_conservativeness
        ));
    }
    if max_running_requests == 0 || args.page_size == 0 || args.max_queued_requests == 0 {
        return bad(
            "--max-running-requests, --page-size and --max-queued-requests must be positive".into(),
        );
    }
    if batch_tokens < max_running_requests {
        return bad(format!(
            "--chunked-prefill-size {batch_tokens} must be at least --max-running-requests {max_running_requests}: every running request decodes one token per step"
        ));
    }
    if let Some(t) = args.max_total_tokens.filter(|&t| t < args.page_size) {
        return bad(format!(
            "--max-total-tokens {t} is smaller than one page (--page-size {})",
            args.page_size
        ));
    }
    if !(args.mem_fraction_static > 0.0 && args.mem_fraction_static <= 1.0) {
        return bad(format!(
            "--mem-fraction-static {} must be in (0, 1]",
            args.mem_fraction_static
        ));
    }
    if args.context_length == Some(0) {
        return bad("--context-length must be positive".into());
    }
    Ok(())
}

/// Picks the device: `auto` uses CUDA when a driver, a device and NVRTC are all present.
fn resolve_device(choice: DeviceChoice) -> Result<bool, ServeError> {
    let gpu_ready = || {
        crate::backend::cuda::device_count() > 0 && crate::backend::cuda::kernels::nvrtc_available()
    };
    match choice {
        DeviceChoice::Cpu => Ok(false),
        DeviceChoice::Auto => Ok(gpu_ready()),
        DeviceChoice::Cuda if gpu_ready() => Ok(true),
        DeviceChoice::Cuda => Err(ServeError::Config(
            "--device cuda: no usable CUDA device (needs libcuda, a GPU and libnvrtc)".into(),
        )),
    }
}

/// The weights as start-up has them: built on the host, or (dummy weights for the GPU) only
/// their config, to be drawn on the device.
enum Loaded {
    Host(Box<crate::model::Model>),
    DeviceDummy(ModelConfig),
    /// A checkpoint the engine loads straight to the GPU (only its config read here).
    DeviceCheckpoint(ModelConfig, crate::engine::DiskWeights),
}

impl Loaded {
    fn config(&self) -> &ModelConfig {
        match self {
            Loaded::Host(m) => &m.config,
            Loaded::DeviceDummy(c) | Loaded::DeviceCheckpoint(c, _) => c,
        }
    }
}

/// Loads the model and starts the engine thread.
pub fn start_engine(args: &ServeArgs) -> Result<(EngineHandle, Limits), ServeError> {
    let cuda = resolve_device(args.device)?;
    let max_running_requests = args.running_requests(cuda);
    let batch_tokens = args.batch_tokens(cuda);
    check_sizes(args, max_running_requests, batch_tokens)?;
    let recipe = args.recipe.as_deref().map(Recipe::from_file).transpose()?;
    let dummy = |cfg: ModelConfig, recipe: &Recipe| -> Result<Loaded, ServeError> {
        Ok(if cuda {
            Loaded::DeviceDummy(cfg)
        } else {
            Loaded::Host(Box::new(loader::dummy_model(cfg, recipe, EMBEDDED_SEED)?))
        })
    };
    let (loaded, tokenizer, recipe, model_path, name, stored_f32) = match &args.model_path {
        None => {
            let cfg = ModelConfig::from_json(
                serde_json::from_str(EMBEDDED_CONFIG).expect("embedded config is JSON"),
            )
            .map_err(loader::LoadError::from)?;
            let recipe = loader::dummy_recipe(args.quantization, recipe)?;
            (
                dummy(cfg, &recipe)?,
                Tokenizer::embedded(),
                recipe,
                "embedded".to_string(),
                "lockstep-embedded".to_string(),
                false,
            )
        }
        Some(dir) => {
            let tokenizer = Tokenizer::from_dir(dir)?;
            let name = dir
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("model")
                .to_string();
            let raw: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)
                    .map_err(|e| ServeError::Config(format!("config.json: {e}")))?;
            let f32_weights = ["torch_dtype", "dtype"]
                .iter()
                .any(|k| raw.get(*k).and_then(|v| v.as_str()) == Some("float32"));
            let (loaded, recipe) = match args.load_format {
                LoadFormat::Auto if cuda => {
                    // Opening reads headers and config only; the engine loads the tensors.
                    let opened =
                        loader::open_serving_checkpoint(dir, args.quantization, recipe.clone())?;
                    let disk = crate::engine::DiskWeights {
                        dir: dir.clone(),
                        quantization: args.quantization,
                        recipe,
                    };
                    (Loaded::DeviceCheckpoint(opened.config, disk), opened.recipe)
                }
                LoadFormat::Auto => {
                    let (m, r) = loader::load_model(dir, args.quantization, recipe)?;
                    (Loaded::Host(Box::new(m)), r)
                }
                LoadFormat::Dummy => {
                    let recipe = loader::dummy_recipe(args.quantization, recipe)?;
                    let cfg = ModelConfig::from_json(raw).map_err(loader::LoadError::from)?;
                    (dummy(cfg, &recipe)?, recipe)
                }
            };
            (
                loaded,
                tokenizer,
                recipe,
                dir.display().to_string(),
                name,
                f32_weights && args.load_format == LoadFormat::Auto,
            )
        }
    };
    let config = loaded.config().clone();
    if tokenizer.vocab_size() > config.vocab_size {
        tracing::warn!(
            "tokenizer has {} tokens, the model {}; ids beyond the model are refused",
            tokenizer.vocab_size(),
            config.vocab_size
        );
    }
    let context_len = args
        .context_length
        .unwrap_or(config.max_position_embeddings);
    let kv_dtype = match args.kv_cache_dtype {
        KvCacheDtype::Bf16 => KvDtype::Bf16,
        KvCacheDtype::F32 if cuda => {
            return Err(ServeError::Config(
                "--kv-cache-dtype f32 is CPU-only; the CUDA KV cache is BF16".into(),
            ))
        }
        KvCacheDtype::F32 => KvDtype::F32,
        KvCacheDtype::Auto if stored_f32 && !cuda => KvDtype::F32,
        KvCacheDtype::Auto => KvDtype::Bf16,
    };
    let limits = Limits {
        max_n: args.max_n,
        max_top_logprobs: args.max_top_logprobs,
        context_len,
        vocab_size: config.vocab_size,
        allow_routed_experts: args.enable_return_routed_experts,
        on_gpu: cuda,
    };
    let quantization = args
        .quantization
        .map(|q| format!("{q:?}").to_lowercase())
        .unwrap_or_else(|| recipe.name.clone());
    // Slot shapes (what a streamed update may replace) and the checksum of host-built models
    // are known now; those of weights on the device are published by the engine once there.
    let weights_on_device = cuda;
    let (spec, slots, checksum) = match loaded {
        // Host-built models are the CPU backend's (on CUDA, weights are loaded or drawn on
        // the device).
        Loaded::Host(mut model) => {
            let slots = model.slot_shapes();
            let checksum = model.weights_checksum();
            let spec = ExecutorSpec::Cpu(*model);
            (spec, std::sync::OnceLock::from(slots), checksum)
        }
        Loaded::DeviceCheckpoint(_, disk) => (
            ExecutorSpec::Cuda {
                device: args.base_gpu_id,
                weights: CudaSource::Checkpoint(disk),
                mem_fraction_static: args.mem_fraction_static,
                max_total_tokens: args.max_total_tokens,
                block_scaled_gemm: args.cuda_block_scaled_gemm,
                cuda_graph_max_bs: args.cuda_graph_rows(),
                weights_cpu_backup: args.enable_weights_cpu_backup,
            },
            std::sync::OnceLock::new(),
            Default::default(),
        ),
        Loaded::DeviceDummy(config) => (
            ExecutorSpec::Cuda {
                device: args.base_gpu_id,
                weights: CudaSource::Dummy {
                    config,
                    recipe: recipe.clone(),
                    seed: EMBEDDED_SEED,
                },
                mem_fraction_static: args.mem_fraction_static,
                max_total_tokens: args.max_total_tokens,
                block_scaled_gemm: args.cuda_block_scaled_gemm,
                cuda_graph_max_bs: args.cuda_graph_rows(),
                weights_cpu_backup: args.enable_weights_cpu_backup,
            },
            Default::default(),
            Default::default(),
        ),
    };
    let checksum = Arc::new(checksum);
    let info = EngineInfo {
        model_path,
        served_model_name: args.served_model_name.clone().unwrap_or(name),
        config,
        tokenizer: Arc::new(tokenizer),
        quantization,
        recipe_name: recipe.name.clone(),
        recipe_hash: recipe.hash(),
        recipe: recipe.clone(),
        slots,
        weights_on_device,
        max_context_len: context_len,
        block_size: args.page_size,
        weight_version: std::sync::RwLock::new("default".to_string()),
        weights_checksum: std::sync::RwLock::new(("default".to_string(), checksum)),
    };
    let cfg = EngineConfig {
        max_running_requests,
        max_batch_tokens: batch_tokens,
        max_total_tokens: args.max_total_tokens.unwrap_or(defaults::MAX_TOTAL_TOKENS),
        block_size: args.page_size,
        max_context_len: context_len,
        max_queued_requests: args.max_queued_requests,
        kv_dtype,
        schedule_conservativeness: args.schedule_conservativeness,
    };
    // Start-up failures on the engine thread (a device that cannot be opened, a kernel that
    // does not compile, too little memory) end `serve` with their message.
    let engine =
        Engine::start_with(spec, info, cfg).map_err(|e| ServeError::Config(e.to_string()))?;
    Ok((engine, limits))
}

/// Builds the server state over a started engine.
pub fn app_state(args: &ServeArgs, engine: EngineHandle, limits: Limits) -> AppState {
    // The recipe the served weights were built with (parsed once, at start).
    let recipe = Some(engine.info.recipe.clone());
    let max_running_requests = args.running_requests(limits.on_gpu);
    let max_prepared = args
        .max_prepared_weight_bytes
        .unwrap_or(if engine.info.weights_on_device {
            defaults::DEVICE_MAX_PREPARED_WEIGHT_BYTES
        } else {
            usize::MAX
        });
    AppState {
        served_model_name: engine.info.served_model_name.clone().into(),
        engine,
        limits: Arc::new(limits),
        auth: Arc::new(Auth {
            api_key: args.api_key.clone(),
            admin_api_key: args.admin_api_key.clone(),
        }),
        shutting_down: Arc::new(AtomicBool::new(false)),
        started: Instant::now(),
        max_request_bytes: args.max_request_bytes,
        max_running_requests,
        weights: Arc::new(crate::server::weights::WeightSettings {
            quantization: args.quantization,
            recipe,
            weights_root: args.weights_root.clone(),
            shadow: args.weight_update_shadow,
        }),
        updates: Arc::new(crate::server::weights::WeightUpdates::new(
            args.max_staged_weight_bytes,
            Duration::from_secs(args.weight_update_timeout_s),
            max_prepared,
            args.weight_spill_dir
                .clone()
                .unwrap_or_else(std::env::temp_dir),
            args.weight_update_rollback,
            args.max_read_ahead_weight_bytes,
        )),
    }
}

/// Runs the server until a signal, then shuts down gracefully.
pub async fn run(args: ServeArgs) -> Result<(), ServeError> {
    server::metrics::handle();
    let started = Instant::now();
    let (engine, limits) = start_engine(&args)?;
    let state = app_state(&args, engine.clone(), limits);
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .map_err(|e| ServeError::Config(format!("--host/--port: {e}")))?;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(
        "serving {} ({}, quantization {}) on http://{} (loaded in {:.2}s)",
        engine.info.served_model_name,
        engine.info.model_path,
        engine.info.quantization,
        listener.local_addr()?,
        started.elapsed().as_secs_f64()
    );
    server::serve(state, listener, Duration::from_secs(args.grace_period_s)).await?;
    engine.shutdown();
    tracing::info!("server stopped");
    Ok(())
}
