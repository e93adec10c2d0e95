//! Paged KV-cache bookkeeping: which fixed-size block of KV memory holds which tokens of which
//! sequence, and which full blocks are shared through the prefix cache. No tensors live here:
//! the engine owns the KV memory and indexes it by [`BlockId`].
//!
//! A sequence's blocks are held by a [`BlockTable`]; dropping the table returns them, so KV is
//! freed on every path (finish, abort, preemption, error) without anyone remembering to.
//!
//! Prefix caching (as in vLLM's automatic prefix caching): a full block is addressed by a hash
//! chained over its parent's hash, its token ids and the weight version, so two sequences with
//! the same prefix under the same weights reuse the same blocks. A block nobody references keeps
//! its hash and sits on an LRU list until an allocation needs it; [`KvPool::flush`] forgets every
//! hash when the weights change.

mod pool;
#[cfg(test)]
mod tests;

pub use pool::{BlockTable, KvPool, KvStats};

/// Index of one block in the engine's KV memory.
pub type BlockId = u32;

/// Tokens per block unless configured otherwise (vLLM's and SGLang's paged default).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    #[error("out of KV blocks: {needed} needed, {available} free or evictable")]
    OutOfBlocks { needed: usize, available: usize },
}

/// Parent hash of a sequence's first block.
const ROOT_HASH: u64 = 0;

/// FNV-1a (64-bit) over the parent hash, the weight version and the block's token ids.
///
/// A fixed function rather than `RandomState`: hashes are the same in every process and run,
/// so they can be logged and compared. FNV is not collision resistant, which is why a cache hit
/// is also checked against the stored parent and tokens (see `pool::CacheKey`).
fn block_hash(parent: u64, weight_version: u64, tokens: &[u32]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let bytes = parent
        .to_le_bytes()
        .into_iter()
        .chain(weight_version.to_le_bytes())
        .chain(tokens.iter().flat_map(|t| t.to_le_bytes()));
    bytes.fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}
