//! `lockstep train`: a GRPO trainer on the CPU that shares the serving forward pass and the
//! low-precision contract, learns from rollouts served over HTTP and streams its weights back.
//!
//! - [`params`]: f32 master weights and the serving model built from them;
//! - [`policy`]: logprobs of sampled sequences through the engine's forward, and their gradient;
//! - [`backward`], [`ops_grad`], [`linear_grad`]: hand-written reverse mode, backward modes;
//! - [`optim`]: AdamW with gradient clipping;
//! - [`tasks`]: verifiable tasks with exact rewards;
//! - [`grpo`]: advantages, the clipped policy-gradient loss, mismatch metrics;
//! - [`client`]: rollouts over HTTP (pushes go through [`crate::push`]);
//! - [`run`]: the loop; [`args`] its settings; [`metrics`] its JSONL output; [`plot`] PNG curves.

pub mod args;
pub mod backward;
pub mod client;
pub mod grpo;
pub mod linear_grad;
pub mod metrics;
pub mod ops_grad;
pub mod optim;
pub mod params;
pub mod plot;
pub mod policy;
pub mod run;
pub mod tasks;

pub use args::TrainArgs;
pub use run::Trainer;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{url}: {reason}")]
    Http { url: String, reason: String },
    #[error("--{flag}: {reason}")]
    Arg { flag: &'static str, reason: String },
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
    #[error(transparent)]
    Load(#[from] crate::model::loader::LoadError),
    #[error("weight push: {0}")]
    Push(#[from] crate::push::PushError),
    #[error(transparent)]
    Recipe(#[from] crate::quant::recipe::RecipeError),
}
