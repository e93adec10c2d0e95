//! `lockstep train`'s settings: one struct for clap and serde (it is written into the metrics
//! file's first line), every default defined once here.

use std::path::PathBuf;

use super::linear_grad::BackwardMode;
use super::tasks::TaskKind;
use crate::model::loader::Quantization;
use crate::push::args::{PauseArg, DEFAULT_PAUSE};

#[derive(clap::Args, Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TrainArgs {
    /// Rollout server base URL (`lockstep serve` of the embedded model); repeat for several.
    #[arg(long = "server", required = true)]
    pub servers: Vec<String>,
    /// Bearer key of the servers' weight-update endpoints.
    #[arg(long, env = "LOCKSTEP_ADMIN_API_KEY")]
    pub admin_api_key: Option<String>,
    /// The servers' `--quantization` (the trainer's forward uses the same recipe).
    #[arg(long, value_enum, default_value = "bf16")]
    pub quantization: Quantization,
    /// The servers' `--recipe`, if they were given one.
    #[arg(long)]
    pub recipe: Option<PathBuf>,
    /// Operands of the backward GEMMs of quantized layers.
    #[arg(long, value_enum, default_value = "high_precision")]
    pub backward_mode: BackwardMode,
    /// MoE layers use the experts the server routed each token to.
    #[arg(long)]
    pub routing_replay: bool,

    /// Also measure the mismatch a trainer computing in plain BF16 (no quantized forward)
    /// would see against these rollouts: what sharing the contract removes.
    #[arg(long)]
    pub report_bf16_mismatch: bool,

    #[arg(long, value_enum, default_value = "copy")]
    pub task: TaskKind,
    /// GRPO steps (one optimizer step and one push each).
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    #[arg(long, default_value_t = 8)]
    pub prompts_per_step: usize,
    /// Samples per prompt (one group), distinguished by sampling_seed.
    #[arg(long, default_value_t = 8)]
    pub samples_per_prompt: usize,
    /// Supervised steps on task answers before RL, so a tiny model starts with some reward.
    #[arg(long, default_value_t = 3)]
    pub warmup_steps: usize,
    #[arg(long, default_value_t = 16)]
    pub warmup_batch: usize,

    /// Optimizer steps per rollout batch, each on the next of as many mini-batches (past the
    /// first, the importance ratios differ from 1 and the clip acts).
    #[arg(long, default_value_t = 1)]
    pub updates_per_batch: usize,
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f32,
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f32,
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f32,
    #[arg(long, default_value_t = 0.2)]
    pub clip_eps: f32,
    /// k3 KL penalty to the policy after warm-up.
    #[arg(long, default_value_t = 0.0)]
    pub kl_coef: f32,

    /// Seed of the task stream and the sampling seeds.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Seed of the initial dummy weights (0 = what `lockstep serve` starts with).
    #[arg(long, default_value_t = 0)]
    pub init_seed: u64,
    /// Start from these master weights (a checkpoint this trainer wrote) instead.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Metrics, one JSON object per line (the first line holds these settings).
    #[arg(long, default_value = "train_metrics.jsonl")]
    pub metrics: PathBuf,
    /// Write `reward.png` and `mismatch.png` (per GRPO step) into this directory at the end.
    #[arg(long)]
    pub plots: Option<PathBuf>,
    /// Write the f32 master weights here (safetensors) at the end.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Largest PUT /update_weights body, in MiB (a gate/up pair is never split).
    #[arg(long, default_value_t = 8)]
    pub push_bucket_mb: usize,
    /// Pause the servers' generation around each push's commit (as `lockstep push`).
    #[arg(long, value_enum, default_value_t = DEFAULT_PAUSE)]
    pub pause_mode: PauseArg,
}
