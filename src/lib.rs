//! lockstep: MoE serving for RL rollouts and a trainer that share one low-precision contract.
//!
//! The map of the modules is shared/ARCHITECTURE.md; the contract is [`quant`].

pub mod backend;
pub mod bench;
pub mod checkpoint;
pub mod convert;
pub mod engine;
pub mod kv;
pub mod model;
pub mod push;
pub mod quant;
pub mod quantize;
pub mod sampling;
pub mod scheduler;
pub mod serve;
pub mod server;
pub mod tokenizer;
pub mod train;
