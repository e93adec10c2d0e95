//! `lockstep push`'s flags (every default defined here once) and their [`PushOptions`].

use std::path::PathBuf;
use std::time::Duration;

use super::client::RetryPolicy;
use super::{PushError, PushOptions};
use crate::engine::PauseMode;
use crate::quant::Recipe;

/// Retry defaults, shared by `lockstep push` and the trainer's pushes.
pub const DEFAULT_RETRIES: usize = 3;
pub const DEFAULT_BACKOFF_MS: u64 = 500;
pub const DEFAULT_TIMEOUT_S: u64 = 600;

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy {
            retries: DEFAULT_RETRIES,
            backoff: Duration::from_millis(DEFAULT_BACKOFF_MS),
            timeout: Duration::from_secs(DEFAULT_TIMEOUT_S),
        }
    }
}

/// `--pause-mode`'s default: commit between two engine steps, nothing paused.
pub const DEFAULT_PAUSE: PauseArg = PauseArg::None;

/// `--pause-mode`: SGLang's pause modes, or none (commit between two engine steps).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum PauseArg {
    Abort,
    Retract,
    #[value(name = "in_place")]
    InPlace,
    None,
}

impl PauseArg {
    /// The engine's pause mode, or None for a commit between two engine steps.
    pub fn mode(self) -> Option<PauseMode> {
        match self {
            PauseArg::Abort => Some(PauseMode::Abort),
            PauseArg::Retract => Some(PauseMode::Retract),
            PauseArg::InPlace => Some(PauseMode::InPlace),
            PauseArg::None => None,
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct PushArgs {
    /// A server to update (repeat for many; all get the same update, concurrently).
    #[arg(long = "server", required = true)]
    pub servers: Vec<String>,
    /// Checkpoint directory (or one .safetensors file): BF16/F16/F32 tensors, or a checkpoint
    /// made by `lockstep convert`, or just the tensors that changed.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The servers' precision recipe (default: the checkpoint's recorded one, else the
    /// servers' built-in one).
    #[arg(long)]
    pub recipe: Option<PathBuf>,
    /// Quantize on the client and send what the servers will hold (saves the servers the work).
    #[arg(long)]
    pub quantize_on_client: bool,
    /// Largest bucket (one PUT) in MiB; a gate/up pair is never split.
    #[arg(long, default_value_t = 512)]
    pub bucket_mb: usize,
    /// The new weight version (default: the next integer after the first server's).
    #[arg(long)]
    pub weight_version: Option<String>,
    /// The servers' admin key.
    #[arg(long, env = "LOCKSTEP_ADMIN_API_KEY")]
    pub api_key: Option<String>,
    /// Pause generation around the commit.
    #[arg(long, value_enum, default_value_t = DEFAULT_PAUSE)]
    pub pause_mode: PauseArg,
    /// Retries of a failed call (bucket, begin, checksum), with doubling backoff.
    #[arg(long, default_value_t = DEFAULT_RETRIES)]
    pub retries: usize,
    /// First backoff in milliseconds.
    #[arg(long, default_value_t = DEFAULT_BACKOFF_MS)]
    pub backoff_ms: u64,
    /// Per-call timeout in seconds.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_S)]
    pub timeout_s: u64,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

impl PushArgs {
    pub fn options(&self) -> Result<PushOptions, PushError> {
        if self.bucket_mb == 0 {
            return Err(PushError::Arg {
                flag: "bucket-mb",
                reason: "must be at least 1".into(),
            });
        }
        let recipe = self
            .recipe
            .as_deref()
            .map(Recipe::from_file)
            .transpose()
            .map_err(|e| PushError::Recipe(e.to_string()))?;
        Ok(PushOptions {
            servers: self.servers.clone(),
            api_key: self.api_key.clone(),
            bucket_bytes: self.bucket_mb << 20,
            weight_version: self.weight_version.clone(),
            recipe,
            quantize_on_client: self.quantize_on_client,
            pause_mode: self.pause_mode.mode(),
            retry: RetryPolicy {
                retries: self.retries,
                backoff: Duration::from_millis(self.backoff_ms),
                timeout: Duration::from_secs(self.timeout_s),
            },
            progress: true,
        })
    }
}
