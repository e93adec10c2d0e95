//! `lockstep bench`: a load generator that drives a serving engine (lockstep, SGLang, vLLM or
//! any OpenAI-compatible server) with streamed requests and reports the latency and
//! throughput numbers that sglang's bench_serving and vllm's `bench serve` report, plus the
//! RL rollout view (groups of seeded samples, stragglers, prefix-cache hits).
//!
//! Layout: [`dataset`] makes the workload, [`client`] sends and times one request, [`sse`]
//! reads the streams, [`metrics`] computes the numbers, [`report`] prints and saves them,
//! [`plot`] draws them. This file holds the arguments and the run loop. Definitions of every
//! metric: docs/bench.md.

pub mod client;
pub mod dataset;
pub mod metrics;
pub mod plot;
pub mod report;
pub mod rng;
pub mod sse;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::time::Instant;

pub use metrics::{Distribution, PrefixCacheStats, RequestRecord, RolloutSummary, Summary};
pub use report::{print_report, render_report, BenchConfig, BenchReport};

use client::{BodyOptions, Target};
use dataset::{Arrival, RandomSpec};
use rng::BenchRng;
use sse::WireFormat;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("--{flag}: {reason}")]
    Arg { flag: &'static str, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("dataset: {0}")]
    Dataset(String),
    #[error("--tokenizer: {0}")]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// Warmup exists to catch a wrong URL or backend before the measured run: its failure
    /// stops the bench instead of producing a report of N identical errors.
    #[error("warmup request failed: {0}")]
    Warmup(String),
    #[error("plot {path}: {reason}")]
    Plot { path: PathBuf, reason: String },
    #[error("writing the JSON report: {0}")]
    Json(#[from] serde_json::Error),
    #[error("starting the async runtime: {0}")]
    Runtime(std::io::Error),
}

/// What the bench needs from a tokenizer; implemented by the serving tokenizer in main.rs, so
/// this module does not depend on how tokenizers are loaded.
pub trait BenchTokenizer: Send + Sync {
    fn encode(&self, text: &str) -> Vec<u32>;
    fn decode(&self, ids: &[u32]) -> String;
    fn vocab_size(&self) -> usize;
}

/// The serving tokenizer, without special tokens: the bench sizes raw text, as sglang's
/// bench encodes with `add_special_tokens=False`.
impl BenchTokenizer for crate::tokenizer::Tokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        // The byte-level and HF vocabularies only fail on internal errors; an empty count
        // then shows up as a wrong estimate, and the server's own count still wins.
        crate::tokenizer::Tokenizer::encode(self, text, false).unwrap_or_default()
    }
    fn decode(&self, ids: &[u32]) -> String {
        crate::tokenizer::Tokenizer::decode(self, ids, true).unwrap_or_default()
    }
    fn vocab_size(&self) -> usize {
        crate::tokenizer::Tokenizer::vocab_size(self)
    }
}

/// `--tokenizer PATH`: a model directory (tokenizer.json and its config) or a bare
/// tokenizer.json.
pub fn load_tokenizer(path: &std::path::Path) -> Result<Arc<dyn BenchTokenizer>, BenchError> {
    let tok = if path.is_dir() {
        crate::tokenizer::Tokenizer::from_dir(path)?
    } else {
        crate::tokenizer::Tokenizer::from_file(path)?
    };
    Ok(Arc::new(tok))
}

/// Which request format to speak (the server is whatever answers at --base-url).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// POST /generate, SGLang native stream.
    Lockstep,
    /// POST /generate, SGLang native stream.
    Sglang,
    /// POST /v1/completions.
    Vllm,
    /// POST /v1/completions.
    OpenaiCompletions,
    /// POST /v1/chat/completions.
    OpenaiChat,
}

impl Backend {
    pub fn wire(self) -> WireFormat {
        match self {
            Backend::Lockstep | Backend::Sglang => WireFormat::Native,
            Backend::Vllm | Backend::OpenaiCompletions => WireFormat::Completions,
            Backend::OpenaiChat => WireFormat::Chat,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Lockstep => "lockstep",
            Backend::Sglang => "sglang",
            Backend::Vllm => "vllm",
            Backend::OpenaiCompletions => "openai-completions",
            Backend::OpenaiChat => "openai-chat",
        }
    }
}

/// `random`, `sharegpt:FILE` or `rl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Dataset {
    Random,
    ShareGpt(PathBuf),
    Rl,
}

impl FromStr for Dataset {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "random" => Ok(Dataset::Random),
            "rl" => Ok(Dataset::Rl),
            _ => match s.strip_prefix("sharegpt:") {
                Some(path) if !path.is_empty() => Ok(Dataset::ShareGpt(PathBuf::from(path))),
                _ => Err(format!("`{s}`: expected random, rl or sharegpt:FILE")),
            },
        }
    }
}

impl fmt::Display for Dataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // pad() so width/alignment flags work in the summary table.
        match self {
            Dataset::Random => f.pad("random"),
            Dataset::Rl => f.pad("rl"),
            Dataset::ShareGpt(p) => f.pad(&format!("sharegpt:{}", p.display())),
        }
    }
}

impl From<Dataset> for String {
    fn from(d: Dataset) -> String {
        d.to_string()
    }
}

impl TryFrom<String> for Dataset {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

/// Requests (RL: prompt groups) per second, or `inf` to send everything at once.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct RequestRate(pub f64);

impl RequestRate {
    pub fn is_inf(self) -> bool {
        self.0.is_infinite()
    }
}

impl FromStr for RequestRate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("inf") {
            return Ok(RequestRate(f64::INFINITY));
        }
        match s.parse::<f64>() {
            Ok(r) if r > 0.0 && !r.is_nan() => Ok(RequestRate(r)),
            _ => Err(format!("`{s}`: expected a positive number or inf")),
        }
    }
}

impl fmt::Display for RequestRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_inf() {
            f.pad("inf")
        } else {
            f.pad(&self.0.to_string())
        }
    }
}

impl From<RequestRate> for String {
    fn from(r: RequestRate) -> String {
        r.to_string()
    }
}

impl TryFrom<String> for RequestRate {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

/// Lengths used when --input-len / --output-len are not given (sglang's random defaults).
pub const DEFAULT_INPUT_LEN: usize = 1024;
pub const DEFAULT_OUTPUT_LEN: usize = 1024;

/// `lockstep bench` arguments; also the `config` block of the JSON report.
#[derive(Clone, Debug, clap::Args, Serialize, Deserialize)]
pub struct BenchArgs {
    /// Server to load. Only this URL (plain http) is ever contacted.
    #[arg(
        long,
        env = "LOCKSTEP_BENCH_BASE_URL",
        default_value = "http://127.0.0.1:30000"
    )]
    pub base_url: String,
    /// Request format: native /generate (lockstep, sglang) or OpenAI (/v1/completions for vllm
    /// and openai-completions, /v1/chat/completions for openai-chat).
    #[arg(long, value_enum, default_value_t = Backend::Lockstep)]
    pub backend: Backend,
    /// random, sharegpt:FILE or rl (P prompts x --rl-group-size seeded samples).
    #[arg(long, default_value = "random")]
    pub dataset: Dataset,
    /// Requests to send (rl: prompt groups, each of --rl-group-size requests).
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Poisson arrival rate in requests (rl: groups) per second, or inf for all at once.
    #[arg(long, default_value = "inf")]
    pub request_rate: RequestRate,
    /// Most requests in flight at once (unbounded when absent).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Prompt tokens for random/rl [default: 1024].
    #[arg(long)]
    pub input_len: Option<usize>,
    /// Output tokens for random/rl [default: 1024]; for sharegpt it replaces each recorded
    /// answer's length.
    #[arg(long)]
    pub output_len: Option<usize>,
    /// Lengths are drawn uniformly from [max(1, len * ratio), len] (sglang's
    /// --random-range-ratio); 1.0 makes every length exact.
    #[arg(long, default_value_t = 0.0)]
    pub range_ratio: f64,
    /// Seed of every random choice: prompts, lengths, arrival gaps.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Tokenizer to size prompts exactly. Without it prompts are random common words (about
    /// one token each) and input tokens are counted from the server's prompt_tokens/usage.
    #[arg(long, env = "LOCKSTEP_BENCH_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Requests sent one by one before the measured run, excluded from every metric.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Write the full report (config, summary, every request) as JSON here.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// Draw latency CDFs and output throughput over time into this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Overall time limit in seconds (warmup included); requests still running are cut off
    /// and reported as such.
    #[arg(long, default_value_t = 3600.0)]
    pub timeout: f64,
    /// rl: samples per prompt, distinguished by sampling_seed 0..n.
    #[arg(long, default_value_t = 8)]
    pub rl_group_size: usize,
    /// rl: ask the server for routed experts too (lockstep/SGLang extension), to measure
    /// their cost.
    #[arg(long)]
    pub return_routed_experts: bool,
    /// Model name for the OpenAI forms [default: the first entry of GET /v1/models].
    #[arg(long)]
    pub model: Option<String>,
    /// Bearer token for a server started with --api-key.
    #[arg(long, env = "LOCKSTEP_API_KEY", hide_env_values = true)]
    #[serde(skip)]
    pub api_key: Option<String>,
}

impl BenchArgs {
    /// Checks the limits clap cannot express, naming the flag.
    fn check(&self) -> Result<(), BenchError> {
        let arg = |flag, reason: &str| {
            Err(BenchError::Arg {
                flag,
                reason: reason.to_string(),
            })
        };
        if self.num_prompts == 0 {
            return arg("num-prompts", "must be at least 1");
        }
        if self.max_concurrency == Some(0) {
            return arg("max-concurrency", "must be at least 1");
        }
        if !(0.0..=1.0).contains(&self.range_ratio) {
            return arg("range-ratio", "must lie in [0, 1]");
        }
        if !(self.timeout > 0.0 && self.timeout.is_finite()) {
            return arg("timeout", "must be a positive number of seconds");
        }
        if self.rl_group_size == 0 {
            return arg("rl-group-size", "must be at least 1");
        }
        if self.input_len == Some(0) || self.output_len == Some(0) {
            return arg("input-len/--output-len", "must be at least 1");
        }
        if let Some(p) = &self.plot {
            if p.extension().and_then(|e| e.to_str()) != Some("svg") {
                return arg(
                    "plot",
                    "only .svg is supported (PNG would pull in an image stack)",
                );
            }
        }
        Ok(())
    }
}

/// Runs the benchmark on a fresh multi-threaded runtime (for main.rs, which is synchronous).
pub fn run_blocking(args: BenchArgs) -> Result<BenchReport, BenchError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(BenchError::Runtime)?
        .block_on(run(args))
}

/// Runs the benchmark, loading `--tokenizer` when given.
pub async fn run(args: BenchArgs) -> Result<BenchReport, BenchError> {
    let tok = args.tokenizer.as_deref().map(load_tokenizer).transpose()?;
    run_with_tokenizer(args, tok).await
}

/// Runs the benchmark with the given tokenizer (`--tokenizer` is not read here): warmup, the
/// measured run, then the report (written to --output-json and --plot when given). Failed
/// requests are part of the report, not an error.
pub async fn run_with_tokenizer(
    args: BenchArgs,
    tokenizer: Option<Arc<dyn BenchTokenizer>>,
) -> Result<BenchReport, BenchError> {
    args.check()?;
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout);
    let target = Target::new(&args.base_url, args.api_key.clone())?;
    let tok = tokenizer.as_ref();
    let mut rng = BenchRng::new(args.seed);
    let spec = RandomSpec {
        num_prompts: args.num_prompts,
        input_len: args.input_len.unwrap_or(DEFAULT_INPUT_LEN),
        output_len: args.output_len.unwrap_or(DEFAULT_OUTPUT_LEN),
        range_ratio: args.range_ratio,
    };
    let rollout = args.dataset == Dataset::Rl;
    let arrivals: Vec<Arrival> = match &args.dataset {
        Dataset::Random => dataset::random(&spec, &mut rng, tok),
        Dataset::Rl => dataset::rl(&spec, args.rl_group_size, &mut rng, tok),
        Dataset::ShareGpt(path) => {
            dataset::sharegpt(path, args.num_prompts, args.output_len, &mut rng, tok)?
        }
    };
    // Drawn after the dataset so a given seed keeps its prompts whatever the rate.
    let gaps: Vec<f64> = arrivals
        .iter()
        .map(|_| {
            if args.request_rate.is_inf() {
                0.0
            } else {
                rng.exponential(args.request_rate.0)
            }
        })
        .collect();

    let http = client::http_client();
    let model = match (&args.model, args.backend.wire()) {
        (Some(m), _) => m.clone(),
        (None, WireFormat::Native) => String::new(),
        (None, _) => client::served_model(&http, &target).await,
    };
    let opts = BodyOptions {
        model: model.clone(),
        rollout,
        return_routed_experts: args.return_routed_experts,
    };

    // Warmup prompts are fresh random ones of the first arrivals' lengths, not the measured
    // prompts themselves (sglang reuses the first): otherwise warmup would put a measured
    // prompt in the prefix cache and flatter its TTFT and the rl hit rate.
    let mut warm_rng = BenchRng::new(args.seed ^ 0x5741_524D_5550); // "WARMUP"
    let warm_start = Instant::now();
    for i in 0..args.warmup {
        let shape = &arrivals[i % arrivals.len()][0];
        let (prompt, prompt_len) =
            dataset::random_prompt(&mut warm_rng, shape.prompt_len.max(1), tok);
        let req = dataset::BenchRequest {
            prompt,
            prompt_len,
            ..shape.clone()
        };
        let rec = client::send_one(
            &http,
            &target,
            args.backend,
            &req,
            &opts,
            warm_start,
            deadline,
        )
        .await;
        if !rec.success {
            return Err(BenchError::Warmup(rec.error.unwrap_or_default()));
        }
    }

    let metrics_before = if rollout {
        client::get_text(&http, &target, "/metrics").await.ok()
    } else {
        None
    };

    let planned: usize = arrivals.iter().map(Vec::len).sum();
    let progress = progress_bar(planned as u64);
    let records = measured_run(
        &http, &target, &args, &opts, arrivals, &gaps, deadline, &progress,
    )
    .await;
    progress.finish_and_clear();

    let summary = metrics::summarize(&records);
    let rollout_summary = if rollout {
        let after = client::get_text(&http, &target, "/metrics").await.ok();
        let cache = match (metrics_before, after) {
            (Some(b), Some(a)) => metrics::prefix_cache_delta(&b, &a),
            _ => None,
        };
        Some(metrics::summarize_rollout(
            &records,
            &summary,
            args.rl_group_size,
            cache,
        ))
    } else {
        None
    };
    let report = BenchReport {
        config: BenchConfig {
            args: args.clone(),
            served_model: (!model.is_empty()).then_some(model),
            planned_requests: planned,
        },
        summary,
        rollout: rollout_summary,
        requests: records,
    };
    if let Some(path) = &args.output_json {
        report::write_json(&report, path)?;
    }
    if let Some(path) = &args.plot {
        plot::write_svg(&report, path)?;
    }
    Ok(report)
}

fn progress_bar(len: u64) -> ProgressBar {
    // indicatif draws to stderr and hides itself when stderr is not a terminal (CI, tests).
    let pb = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// Sends the arrivals on their Poisson schedule and collects one record per request sent
/// (or cut off waiting for a slot), in request order.
#[allow(clippy::too_many_arguments)]
async fn measured_run(
    http: &client::Http,
    target: &Target,
    args: &BenchArgs,
    opts: &BodyOptions,
    arrivals: Vec<Arrival>,
    gaps: &[f64],
    deadline: Instant,
    progress: &ProgressBar,
) -> Vec<RequestRecord> {
    let limit = args.max_concurrency.map(|c| Arc::new(Semaphore::new(c)));
    let run_start = Instant::now();
    let mut tasks = Vec::new();
    let mut index = 0;
    for (arrival, gap) in arrivals.into_iter().zip(gaps) {
        if Instant::now() >= deadline {
            break;
        }
        for req in arrival {
            let (http, target, opts, limit, progress) = (
                http.clone(),
                target.clone(),
                opts.clone(),
                limit.clone(),
                progress.clone(),
            );
            let backend = args.backend;
            let i = index;
            index += 1;
            tasks.push(tokio::spawn(async move {
                // As in sglang, a request's clock starts once it holds a slot: the cap shapes
                // the load, it is not server latency.
                let never_sent = || RequestRecord {
                    index: i,
                    group: req.group,
                    sampling_seed: req.sampling_seed,
                    cut_off: true,
                    error: Some(
                        "never sent: waiting for a slot when --timeout ended the run".into(),
                    ),
                    start_s: (deadline - run_start).as_secs_f64(),
                    ..Default::default()
                };
                let _permit = match &limit {
                    Some(sem) => {
                        match tokio::time::timeout_at(deadline, sem.clone().acquire_owned()).await {
                            Ok(p) => Some(p.expect("semaphore never closed")),
                            Err(_) => None,
                        }
                    }
                    None => None,
                };
                // A slot freed by a request cut at the deadline is not a chance to send.
                if (limit.is_some() && _permit.is_none()) || Instant::now() >= deadline {
                    progress.inc(1);
                    return never_sent();
                }
                let mut rec =
                    client::send_one(&http, &target, backend, &req, &opts, run_start, deadline)
                        .await;
                rec.index = i;
                progress.inc(1);
                rec
            }));
        }
        // sglang's schedule: send, then wait the next exponential gap.
        if *gap > 0.0 {
            let wake = Instant::now() + Duration::from_secs_f64(*gap);
            tokio::time::sleep_until(wake.min(deadline)).await;
        }
    }
    let mut records = Vec::with_capacity(tasks.len());
    for t in tasks {
        match t.await {
            Ok(r) => records.push(r),
            // A panic in one request task is a bench bug; keep the rest of the report.
            Err(e) => records.push(RequestRecord {
                index: records.len(),
                error: Some(format!("bench task failed: {e}")),
                ..Default::default()
            }),
        }
    }
    records
}

#[cfg(test)]
mod tests;
