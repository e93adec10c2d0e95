//! The engine's sizes and limits, with every default defined once.

use crate::backend::cpu::attention::KvDtype;

/// Sizes and limits of the engine. Defaults are defined once here; the CLI reads them.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub max_running_requests: usize,
    /// Tokens computed per step (chunked prefill budget).
    pub max_batch_tokens: usize,
    /// KV cache capacity in tokens.
    pub max_total_tokens: usize,
    pub block_size: usize,
    pub max_context_len: usize,
    /// Requests waiting beyond this are refused (503) instead of queued.
    pub max_queued_requests: usize,
    pub kv_dtype: KvDtype,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running_requests: 64,
            max_batch_tokens: 2048,
            max_total_tokens: 65536,
            block_size: 16,
            max_context_len: 4096,
            max_queued_requests: 1024,
            kv_dtype: KvDtype::Bf16,
        }
    }
}
