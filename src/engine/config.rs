//! The engine's sizes and limits, with every default defined once.

use crate::backend::cpu::attention::KvDtype;

/// Every default of the engine's sizes, defined once: [`EngineConfig::default`] and the
/// `serve` flags (`--max-running-requests`, `--chunked-prefill-size`, ...) read these.
pub mod defaults {
    /// `--max-running-requests` on the CPU backend.
    pub const MAX_RUNNING_REQUESTS: usize = 64;
    /// `--max-running-requests` on a CUDA device (vLLM's GPU default; at most the step's
    /// tokens, `--chunked-prefill-size`): the KV cache, through admission's reserve, is what
    /// bounds the running requests there.
    pub const CUDA_MAX_RUNNING_REQUESTS: usize = 1024;
    /// Tokens per step (`--chunked-prefill-size`) on the CPU backend.
    pub const MAX_BATCH_TOKENS: usize = 2048;
    /// The same on a CUDA device: SGLang's default for a GPU of an H200's memory. Through the
    /// server at 256 streams (512 in / 256 out, H200, 2026-12-02) 3,658 output tok/s against
    /// 3,434 with 2048; one stream the same.
    pub const CUDA_MAX_BATCH_TOKENS: usize = 8192;
    /// KV capacity of the CPU backend (a device sizes its cache from memory).
    pub const MAX_TOTAL_TOKENS: usize = 65536;
    /// `--max-prepared-weight-bytes` when the weights live only on the device: the bucket
    /// bytes of prepared slots an in-place update keeps in host memory before it spills them
    /// (with weights in host memory nothing spills: reading back costs commit time).
    pub const DEVICE_MAX_PREPARED_WEIGHT_BYTES: usize = 1 << 30;
    /// KV block size (`--page-size`).
    pub const BLOCK_SIZE: usize = 16;
    pub const MAX_CONTEXT_LEN: usize = 4096;
    pub const MAX_QUEUED_REQUESTS: usize = 1024;
    /// `--cuda-graph-max-bs`: the largest decode batch run on a CUDA graph (SGLang's top
    /// capture size).
    pub const CUDA_GRAPH_MAX_BS: usize = 256;
    /// `--schedule-conservativeness` (SGLang's default).
    pub const SCHEDULE_CONSERVATIVENESS: f64 = 1.0;
}

/// Sizes and limits of the engine.
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
    /// KV admission keeps free for the running requests' future tokens
    /// ([`crate::scheduler::SchedulerConfig::schedule_conservativeness`]).
    pub schedule_conservativeness: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running_requests: defaults::MAX_RUNNING_REQUESTS,
            max_batch_tokens: defaults::MAX_BATCH_TOKENS,
            max_total_tokens: defaults::MAX_TOTAL_TOKENS,
            block_size: defaults::BLOCK_SIZE,
            max_context_len: defaults::MAX_CONTEXT_LEN,
            max_queued_requests: defaults::MAX_QUEUED_REQUESTS,
            kv_dtype: KvDtype::Bf16,
            schedule_conservativeness: defaults::SCHEDULE_CONSERVATIVENESS,
        }
    }
}
