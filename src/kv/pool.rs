//! The block pool (free list, refcounts, prefix-cache index, LRU of evictable blocks) and the
//! per-sequence [`BlockTable`] that holds references into it.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

use super::{block_hash, BlockId, KvError, ROOT_HASH};

/// What a cached block holds, kept beside its hash so that a hash collision can never hand a
/// sequence another prefix's KV.
#[derive(Debug, PartialEq, Eq)]
struct CacheKey {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
}

#[derive(Debug, Default)]
struct Block {
    refs: u32,
    /// Set while the block is in the prefix cache.
    key: Option<CacheKey>,
    /// When the block last became unreferenced: its key in `Pool::lru`.
    lru_tick: u64,
}

/// Every block is in exactly one state: free (no refs, no key), evictable (no refs, key, on the
/// LRU list) or in use (refs > 0, key or not).
#[derive(Debug)]
struct Pool {
    block_size: usize,
    blocks: Vec<Block>,
    free: Vec<BlockId>,
    cached: HashMap<u64, BlockId>,
    lru: BTreeMap<u64, BlockId>,
    tick: u64,
    weight_version: u64,
}

impl Pool {
    fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Takes a free block, or evicts the least recently used cached one. The caller has checked
    /// `available()`, so running dry here is a bug.
    fn alloc(&mut self) -> BlockId {
        let id = self.free.pop().unwrap_or_else(|| {
            let (_, id) = self
                .lru
                .pop_first()
                .expect("alloc without an available block");
            let key = self.blocks[id as usize]
                .key
                .take()
                .expect("evictable block has a key");
            self.cached.remove(&key.hash);
            id
        });
        self.blocks[id as usize].refs = 1;
        id
    }

    fn retain(&mut self, id: BlockId) {
        let block = &mut self.blocks[id as usize];
        if block.refs == 0 {
            self.lru.remove(&block.lru_tick);
        }
        block.refs += 1;
    }

    fn release(&mut self, id: BlockId) {
        let block = &mut self.blocks[id as usize];
        block.refs -= 1;
        if block.refs > 0 {
            return;
        }
        if block.key.is_some() {
            self.tick += 1;
            block.lru_tick = self.tick;
            self.lru.insert(self.tick, id);
        } else {
            self.free.push(id);
        }
    }

    fn lookup(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<BlockId> {
        let id = *self.cached.get(&hash)?;
        let key = self.blocks[id as usize].key.as_ref()?;
        (key.parent == parent && *key.tokens == *tokens).then_some(id)
    }

    /// Makes `id` shareable under `hash`, unless another block already holds the same content
    /// (two sequences computed it in the same step): that one stays, and `id` is freed normally.
    fn register(&mut self, id: BlockId, hash: u64, parent: u64, tokens: &[u32]) {
        if self.cached.contains_key(&hash) {
            return;
        }
        self.cached.insert(hash, id);
        self.blocks[id as usize].key = Some(CacheKey {
            hash,
            parent,
            tokens: tokens.into(),
        });
    }
}

/// Counters for /metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvStats {
    pub total_blocks: usize,
    /// Referenced by at least one sequence.
    pub used_blocks: usize,
    /// In the prefix cache, referenced or not.
    pub cached_blocks: usize,
    /// Cached and unreferenced: reclaimable on demand.
    pub evictable_blocks: usize,
}

/// Handle to the engine's block pool; clones share it. Single-threaded by design (the engine
/// thread alone owns KV memory), hence `Rc<RefCell>` rather than a lock.
#[derive(Debug, Clone)]
pub struct KvPool(Rc<RefCell<Pool>>);

impl KvPool {
    pub fn new(num_blocks: usize, block_size: usize) -> KvPool {
        assert!(block_size > 0, "block_size must be positive");
        assert!(
            BlockId::try_from(num_blocks).is_ok(),
            "{num_blocks} blocks do not fit a BlockId"
        );
        let pool = Pool {
            block_size,
            blocks: (0..num_blocks).map(|_| Block::default()).collect(),
            // Reversed so that blocks are handed out from id 0 upwards, which reads well in logs.
            free: (0..num_blocks as BlockId).rev().collect(),
            cached: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            weight_version: 0,
        };
        KvPool(Rc::new(RefCell::new(pool)))
    }

    pub fn block_size(&self) -> usize {
        self.0.borrow().block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.0.borrow().blocks.len()
    }

    /// Blocks an allocation can get now: free ones plus evictable cached ones.
    pub fn num_available(&self) -> usize {
        self.0.borrow().available()
    }

    pub fn can_allocate(&self, num_blocks: usize) -> bool {
        num_blocks <= self.num_available()
    }

    pub fn weight_version(&self) -> u64 {
        self.0.borrow().weight_version
    }

    /// An empty table, to be grown with [`BlockTable::ensure_capacity`].
    pub fn new_table(&self) -> BlockTable {
        BlockTable {
            pool: self.clone(),
            blocks: Vec::new(),
            hashes: Vec::new(),
            weight_version: self.weight_version(),
        }
    }

    /// A table of `num_blocks` fresh blocks, or an error and nothing allocated.
    pub fn allocate(&self, num_blocks: usize) -> Result<BlockTable, KvError> {
        let mut table = self.new_table();
        table.ensure_capacity(num_blocks * self.block_size())?;
        Ok(table)
    }

    /// The longest cached prefix of `tokens`, as a table that shares those blocks, and the
    /// number of tokens it covers. The match stops one token short of the end, rounded down to a
    /// block, because the last token must be computed for the model to produce logits.
    pub fn match_prefix(&self, tokens: &[u32]) -> (BlockTable, usize) {
        let mut table = self.new_table();
        let mut pool = self.0.borrow_mut();
        let max_blocks = tokens.len().saturating_sub(1) / pool.block_size;
        for chunk in tokens.chunks_exact(pool.block_size).take(max_blocks) {
            let parent = table.hashes.last().copied().unwrap_or(ROOT_HASH);
            let hash = block_hash(parent, pool.weight_version, chunk);
            let Some(id) = pool.lookup(hash, parent, chunk) else {
                break;
            };
            pool.retain(id);
            table.blocks.push(id);
            table.hashes.push(hash);
        }
        let cached = table.blocks.len() * pool.block_size;
        (table, cached)
    }

    /// Forgets every cached hash because the weights changed: KV computed under the old weights
    /// must not be reused. Referenced blocks stay with their owners, unshared; evictable ones
    /// become free.
    pub fn flush(&self, new_weight_version: u64) {
        let mut pool = self.0.borrow_mut();
        let pool = &mut *pool;
        pool.weight_version = new_weight_version;
        pool.cached.clear();
        for block in &mut pool.blocks {
            block.key = None;
        }
        pool.free
            .extend(std::mem::take(&mut pool.lru).into_values());
    }

    pub fn stats(&self) -> KvStats {
        let pool = self.0.borrow();
        KvStats {
            total_blocks: pool.blocks.len(),
            used_blocks: pool.blocks.len() - pool.available(),
            cached_blocks: pool.cached.len(),
            evictable_blocks: pool.lru.len(),
        }
    }

    /// Panics unless every block is in exactly one state and refcounts match `tables`.
    #[cfg(test)]
    pub(crate) fn check_invariants<'a>(&self, tables: impl IntoIterator<Item = &'a BlockTable>) {
        let pool = self.0.borrow();
        let mut refs = vec![0u32; pool.blocks.len()];
        for table in tables {
            for &id in &table.blocks {
                refs[id as usize] += 1;
            }
        }
        for (i, block) in pool.blocks.iter().enumerate() {
            let id = i as BlockId;
            assert_eq!(block.refs, refs[i], "block {id} refcount");
            let in_free = pool.free.contains(&id);
            let in_lru = pool.lru.get(&block.lru_tick) == Some(&id);
            match (block.refs, &block.key) {
                (0, None) => assert!(in_free && !in_lru, "free block {id}"),
                (0, Some(_)) => assert!(in_lru && !in_free, "evictable block {id}"),
                _ => assert!(!in_free && !in_lru, "used block {id}"),
            }
            if let Some(key) = &block.key {
                assert_eq!(
                    pool.cached.get(&key.hash),
                    Some(&id),
                    "block {id} cache index"
                );
            }
        }
        assert_eq!(
            pool.free.len() + pool.lru.len() + refs.iter().filter(|&&r| r > 0).count(),
            pool.blocks.len()
        );
        assert_eq!(
            pool.cached.len(),
            pool.blocks.iter().filter(|b| b.key.is_some()).count()
        );
    }
}

/// One sequence's blocks, in position order. Dropping it returns them to the pool.
#[derive(Debug)]
pub struct BlockTable {
    pool: KvPool,
    blocks: Vec<BlockId>,
    /// Chain hashes of the leading full blocks whose KV is written (matched or committed).
    hashes: Vec<u64>,
    /// The weights `hashes` were computed under. After a flush this table's KV is from old
    /// weights, so it must never enter the cache again.
    weight_version: u64,
}

impl BlockTable {
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Tokens the allocated blocks can hold.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * self.pool.block_size()
    }

    /// Grows the table to hold `num_tokens`, all or nothing.
    pub fn ensure_capacity(&mut self, num_tokens: usize) -> Result<(), KvError> {
        let mut pool = self.pool.0.borrow_mut();
        let needed = num_tokens
            .div_ceil(pool.block_size)
            .saturating_sub(self.blocks.len());
        if needed > pool.available() {
            return Err(KvError::OutOfBlocks {
                needed,
                available: pool.available(),
            });
        }
        self.blocks.extend((0..needed).map(|_| pool.alloc()));
        Ok(())
    }

    /// Offers the full blocks of `tokens` (the sequence's tokens whose KV is now written) that
    /// are not committed yet to the prefix cache.
    pub fn commit_full_blocks(&mut self, tokens: &[u32]) {
        let mut pool = self.pool.0.borrow_mut();
        if self.weight_version != pool.weight_version {
            return;
        }
        let bs = pool.block_size;
        let full = (tokens.len() / bs).min(self.blocks.len());
        for i in self.hashes.len()..full {
            let parent = self.hashes.last().copied().unwrap_or(ROOT_HASH);
            let chunk = &tokens[i * bs..(i + 1) * bs];
            let hash = block_hash(parent, pool.weight_version, chunk);
            pool.register(self.blocks[i], hash, parent, chunk);
            self.hashes.push(hash);
        }
    }

    /// Whether the next block `tokens` needs from the cache is the next one `other` (holding
    /// `other_tokens`) will commit: both sit on the same cached chain and agree on that block's
    /// tokens. A sequence that waits for it reuses `other`'s KV instead of computing it again.
    pub fn next_block_pending_in(
        &self,
        tokens: &[u32],
        other: &BlockTable,
        other_tokens: &[u32],
    ) -> bool {
        let bs = self.pool.block_size();
        let k = self.hashes.len();
        let block = k * bs..(k + 1) * bs;
        other.hashes.len() == k
            && other.weight_version == self.weight_version
            && other.hashes.last() == self.hashes.last()
            && tokens
                .get(block.clone())
                .is_some_and(|b| other_tokens.get(block) == Some(b))
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        let mut pool = self.pool.0.borrow_mut();
        // Tail first, so a sequence's last blocks get the oldest LRU ticks and are evicted
        // before the prefix blocks that other sequences are likelier to share.
        for &id in self.blocks.iter().rev() {
            pool.release(id);
        }
    }
}
