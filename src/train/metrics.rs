//! Per-step metrics, written as JSON lines as they happen.

use std::io::Write;
use std::path::Path;

use super::grpo::Mismatch;
use super::TrainError;

#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct StepMetrics {
    /// "warmup" or "grpo".
    pub phase: String,
    pub step: usize,
    pub loss: f64,
    pub reward_mean: f64,
    pub reward_std: f64,
    pub mismatch: Mismatch,
    /// With `--report-bf16-mismatch`: the mismatch of a plain-BF16 forward on the same weights.
    pub mismatch_bf16_forward: Option<Mismatch>,
    pub grad_norm: f64,
    pub clip_fraction: f64,
    pub completion_tokens: usize,
    /// The weight version every rollout of the step was sampled with (as the servers said).
    pub rollout_weight_versions: Vec<String>,
    /// The version pushed after the step.
    pub pushed_version: String,
    /// The overall checksum the servers reported after that push (verified by the push
    /// against what the trainer quantized and sent).
    pub pushed_checksum: String,
    pub rollout_s: f64,
    pub train_s: f64,
    pub push_s: f64,
}

pub struct MetricsWriter {
    file: std::fs::File,
}

impl MetricsWriter {
    pub fn create(
        path: &Path,
        settings: &impl serde::Serialize,
    ) -> Result<MetricsWriter, TrainError> {
        let io = |e: std::io::Error| TrainError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        let mut file = std::fs::File::create(path).map_err(io)?;
        writeln!(file, "{}", serde_json::json!({ "settings": settings })).map_err(io)?;
        Ok(MetricsWriter { file })
    }

    pub fn write(&mut self, m: &StepMetrics) -> Result<(), TrainError> {
        writeln!(
            self.file,
            "{}",
            serde_json::to_string(m).expect("plain data")
        )
        .and_then(|_| self.file.flush())
        .map_err(|e| TrainError::Io {
            path: "metrics".into(),
            reason: e.to_string(),
        })
    }
}
