//! lockstep: MoE serving for RL rollouts and a trainer that share one low-precision contract.
//!
//! The map of the modules is shared/ARCHITECTURE.md; the contract is [`quant`].

pub mod checkpoint;
pub mod convert;
pub mod kv;
pub mod quant;
pub mod quantize;
pub mod scheduler;
