use proptest::prelude::RngExt;
use proptest::test_runner::{RngAlgorithm, TestRng};

use super::*;

fn used(pool: &KvPool) -> usize {
    pool.stats().used_blocks
}

/// A sequence whose KV for `tokens` is written and committed, as the engine leaves it after a
/// prefill step.
fn computed(pool: &KvPool, tokens: &[u32]) -> BlockTable {
    let (mut table, _) = pool.match_prefix(tokens);
    table.ensure_capacity(tokens.len()).unwrap();
    table.commit_full_blocks(tokens);
    table
}

#[test]
fn blocks_return_to_the_pool_on_drop() {
    let pool = KvPool::new(8, 4);
    let a = pool.allocate(3).unwrap();
    assert_eq!(a.blocks(), &[0, 1, 2]);
    assert_eq!(used(&pool), 3);
    assert!(pool.can_allocate(5) && !pool.can_allocate(6));
    assert_eq!(
        pool.allocate(6).unwrap_err(),
        KvError::OutOfBlocks {
            needed: 6,
            available: 5
        }
    );
    assert_eq!(used(&pool), 3, "a failed allocation takes nothing");
    drop(a);
    assert_eq!(used(&pool), 0);
    assert_eq!(pool.num_available(), 8);
}

#[test]
fn tables_grow_a_block_at_a_time() {
    let pool = KvPool::new(4, 4);
    let mut t = pool.new_table();
    t.ensure_capacity(5).unwrap();
    assert_eq!((t.blocks().len(), t.capacity()), (2, 8));
    t.ensure_capacity(8).unwrap();
    assert_eq!(t.blocks().len(), 2);
    t.ensure_capacity(9).unwrap();
    assert_eq!(t.blocks().len(), 3);
    assert!(t.ensure_capacity(17).is_err());
    assert_eq!(t.blocks().len(), 3);
}

#[test]
fn samples_of_one_prompt_share_its_full_blocks() {
    let pool = KvPool::new(16, 4);
    let prompt: Vec<u32> = (0..10).collect();
    let a = computed(&pool, &prompt);
    assert_eq!(
        pool.stats().cached_blocks,
        2,
        "two full blocks, the partial third is not cached"
    );

    let (mut b, cached) = pool.match_prefix(&prompt);
    assert_eq!(cached, 8);
    assert_eq!(b.blocks(), &a.blocks()[..2]);
    b.ensure_capacity(prompt.len()).unwrap();
    assert_eq!(
        used(&pool),
        4,
        "the second sample adds only its own partial block"
    );

    drop(a);
    assert_eq!(used(&pool), 3, "shared blocks stay while b holds them");
    drop(b);
    assert_eq!(used(&pool), 0);
    assert_eq!(pool.stats().evictable_blocks, 2);
}

#[test]
fn the_last_prompt_token_is_never_matched() {
    let pool = KvPool::new(8, 4);
    let prompt: Vec<u32> = (0..8).collect();
    let _a = computed(&pool, &prompt);
    assert_eq!(
        pool.match_prefix(&prompt).1,
        4,
        "8 tokens match 7 at most, rounded down to a block"
    );
    assert_eq!(pool.match_prefix(&prompt[..4]).1, 0);
    assert_eq!(pool.match_prefix(&[]).1, 0);
}

#[test]
fn unreferenced_cached_blocks_are_evicted_least_recently_used_first() {
    let pool = KvPool::new(4, 2);
    for t in [[1, 2], [3, 4], [5, 6]] {
        computed(&pool, &t);
    }
    // Touch [1, 2] so that [3, 4] becomes the oldest.
    assert_eq!(pool.match_prefix(&[1, 2, 0]).1, 2);
    assert_eq!(
        pool.stats(),
        KvStats {
            total_blocks: 4,
            used_blocks: 0,
            cached_blocks: 3,
            evictable_blocks: 3
        }
    );

    let _t = pool.allocate(2).unwrap(); // the free block, then one eviction
    assert_eq!(pool.match_prefix(&[3, 4, 0]).1, 0, "oldest evicted");
    assert_eq!(pool.match_prefix(&[5, 6, 0]).1, 2);
    assert_eq!(pool.match_prefix(&[1, 2, 0]).1, 2);
    assert_eq!(pool.stats().cached_blocks, 2);
}

#[test]
fn a_sequence_releases_its_tail_before_its_prefix() {
    let pool = KvPool::new(3, 2);
    computed(&pool, &[1, 2, 3, 4, 5]);
    let _t = pool.allocate(2).unwrap();
    assert_eq!(
        pool.match_prefix(&[1, 2, 3, 4, 5]).1,
        2,
        "the first block outlives the second"
    );
}

#[test]
fn blocks_computed_twice_are_cached_once() {
    let pool = KvPool::new(8, 2);
    let a = computed(&pool, &[1, 2, 3]);
    let mut b = pool.new_table();
    b.ensure_capacity(3).unwrap();
    b.commit_full_blocks(&[1, 2, 3]);
    assert_eq!(pool.stats().cached_blocks, 1);
    let (c, _) = pool.match_prefix(&[1, 2, 3]);
    assert_eq!(c.blocks(), &a.blocks()[..1]);
    drop((a, b, c));
    assert_eq!(pool.stats().evictable_blocks, 1);
    pool.check_invariants([]);
}

#[test]
fn flush_stops_sharing_but_keeps_owners_blocks() {
    let pool = KvPool::new(8, 2);
    let prompt = [1, 2, 3, 4, 5];
    let mut a = computed(&pool, &prompt);
    drop(computed(&pool, &[7, 8, 9]));
    assert_eq!(pool.stats().cached_blocks, 3);

    pool.flush(1);
    assert_eq!(pool.weight_version(), 1);
    assert_eq!(
        pool.stats(),
        KvStats {
            total_blocks: 8,
            used_blocks: 3,
            cached_blocks: 0,
            evictable_blocks: 0
        }
    );
    assert_eq!(pool.match_prefix(&prompt).1, 0);

    // a's KV is from the old weights: growing it must not make it shareable again.
    a.ensure_capacity(7).unwrap();
    a.commit_full_blocks(&[1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(pool.stats().cached_blocks, 0);

    let b = computed(&pool, &prompt);
    assert_eq!(pool.match_prefix(&prompt).1, 4);
    pool.check_invariants([&a, &b]);
}

#[test]
fn the_hash_covers_parent_tokens_and_weight_version() {
    let h = block_hash(ROOT_HASH, 0, &[1, 2]);
    assert_eq!(h, block_hash(ROOT_HASH, 0, &[1, 2]), "deterministic");
    assert_ne!(h, block_hash(ROOT_HASH, 1, &[1, 2]));
    assert_ne!(h, block_hash(ROOT_HASH, 0, &[2, 1]));
    assert_ne!(h, block_hash(h, 0, &[1, 2]));
    // FNV-1a of 16 zero bytes, checked with an independent Python FNV-1a: pins the function,
    // so hashes stay the same across releases.
    assert_eq!(block_hash(0, 0, &[]), 0x8820_1fb9_60ff_6465);
}

/// What the engine would have written at position `pos` of `tokens` under `version`: a stand-in
/// for real KV that depends on the whole prefix, as attention's keys and values do.
fn kv_value(version: u64, tokens: &[u32], pos: usize) -> u64 {
    block_hash(ROOT_HASH, version, &tokens[..=pos])
}

#[test]
fn random_operations_never_leak_or_share_wrong_kv() {
    const BS: usize = 4;
    let pool = KvPool::new(24, BS);
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
    let mut memory = vec![[None::<u64>; BS]; 24];
    let mut live: Vec<(BlockTable, Vec<u32>)> = Vec::new();
    let mut hit_tokens = 0;
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|p| (0..rng.random_range(2..14)).map(|i| p * 100 + i).collect())
        .collect();

    for _ in 0..5000 {
        let version = pool.weight_version();
        match rng.random_range(0..10) {
            0..=3 => {
                let mut tokens = prefixes[rng.random_range(0..3)].clone();
                tokens.extend((0..rng.random_range(0..6)).map(|_| rng.random_range(0..3)));
                let (mut table, cached) = pool.match_prefix(&tokens);
                assert!(cached < tokens.len().max(1) && cached % BS == 0);
                hit_tokens += cached;
                for pos in 0..cached {
                    let slot = memory[table.blocks()[pos / BS] as usize][pos % BS];
                    assert_eq!(
                        slot,
                        Some(kv_value(version, &tokens, pos)),
                        "shared KV at {pos}"
                    );
                }
                if table.ensure_capacity(tokens.len()).is_ok() {
                    for pos in cached..tokens.len() {
                        memory[table.blocks()[pos / BS] as usize][pos % BS] =
                            Some(kv_value(version, &tokens, pos));
                    }
                    table.commit_full_blocks(&tokens);
                    live.push((table, tokens));
                }
            }
            4..=5 if !live.is_empty() => {
                let i = rng.random_range(0..live.len());
                let (table, tokens) = &mut live[i];
                let start = tokens.len();
                tokens.extend((0..rng.random_range(1..6)).map(|_| rng.random_range(0..3)));
                if table.ensure_capacity(tokens.len()).is_ok() {
                    for pos in start..tokens.len() {
                        memory[table.blocks()[pos / BS] as usize][pos % BS] =
                            Some(kv_value(version, tokens, pos));
                    }
                    table.commit_full_blocks(tokens);
                } else {
                    tokens.truncate(start);
                }
            }
            6..=8 if !live.is_empty() => {
                live.swap_remove(rng.random_range(0..live.len()));
            }
            9 if rng.random_bool(0.05) => pool.flush(version + 1),
            _ => {}
        }
        pool.check_invariants(live.iter().map(|(t, _)| t));
    }
    live.clear();
    pool.check_invariants([]);
    assert_eq!(used(&pool), 0);
    assert!(
        hit_tokens > 1000,
        "the run exercised sharing ({hit_tokens} hit tokens)"
    );
}
