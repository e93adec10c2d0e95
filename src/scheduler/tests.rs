//! The scheduler driven by a fake model, in the manner of vLLM's tests/v1/core/test_scheduler.py.

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};

use proptest::prelude::RngExt;
use proptest::test_runner::{RngAlgorithm, TestRng};

use super::*;

/// A scheduler that admits on the prompt alone (no reserve): the mechanics below are those of
/// admission, chunking and preemption; the reserve has tests of its own.
fn scheduler(
    max_running_requests: usize,
    max_batch_tokens: usize,
    num_blocks: usize,
    block_size: usize,
) -> Scheduler {
    reserving(
        max_running_requests,
        max_batch_tokens,
        num_blocks,
        block_size,
        0.0,
    )
}

fn reserving(
    max_running_requests: usize,
    max_batch_tokens: usize,
    num_blocks: usize,
    block_size: usize,
    schedule_conservativeness: f64,
) -> Scheduler {
    let config = SchedulerConfig {
        max_running_requests,
        max_batch_tokens,
        max_context_len: 32768,
        schedule_conservativeness,
    };
    Scheduler::new(config, KvPool::new(num_blocks, block_size))
}

fn add(s: &mut Scheduler, id: u64, prompt: &[u32], max_new_tokens: usize) {
    s.add(SeqRequest {
        id: SeqId(id),
        prompt: prompt.to_vec(),
        max_new_tokens,
        use_prefix_cache: true,
    })
    .unwrap();
}

/// The fake model's token at `pos` of sequence `id`: different per sequence, so a token handed
/// to the wrong sequence or position shows.
fn tok(id: SeqId, pos: usize) -> u32 {
    1000 + (id.0 as u32 * 37 + pos as u32 * 11) % 97
}

/// What the model returns for a step: a token for every chunk that samples.
fn model(out: &SchedulerOutput) -> Vec<StepResult> {
    let token = |s: &ScheduledSeq| s.sample.then(|| tok(s.id, s.start_pos + s.tokens.len()));
    out.seqs
        .iter()
        .map(|s| StepResult {
            id: s.id,
            token: token(s),
            finished: false,
        })
        .collect()
}

fn step(s: &mut Scheduler) -> (SchedulerOutput, Vec<FinishedSeq>) {
    let out = s.schedule();
    let finished = s.update_from_output(&model(&out));
    (out, finished)
}

/// (id, start_pos, number of tokens) of each scheduled sequence.
fn shape(out: &SchedulerOutput) -> Vec<(u64, usize, usize)> {
    out.seqs
        .iter()
        .map(|s| (s.id.0, s.start_pos, s.tokens.len()))
        .collect()
}

fn outputs(id: u64, positions: std::ops::Range<usize>) -> Vec<u32> {
    positions.map(|p| tok(SeqId(id), p)).collect()
}

fn used_blocks(s: &Scheduler) -> usize {
    s.pool().stats().used_blocks
}

#[test]
fn new_requests_join_the_running_batch() {
    let mut s = scheduler(8, 100, 64, 4);
    add(&mut s, 1, &[1, 2, 3, 4, 5], 3);
    let (out, _) = step(&mut s);
    assert_eq!(shape(&out), [(1, 0, 5)]);
    assert!(out.seqs[0].sample);

    add(&mut s, 2, &[7, 8, 9], 2);
    let (out, _) = step(&mut s);
    assert_eq!(
        shape(&out),
        [(1, 5, 1), (2, 0, 3)],
        "decode first, then the new prefill, one batch"
    );
    assert_eq!(out.seqs[0].tokens, [tok(SeqId(1), 5)]);

    let (_, finished) = step(&mut s);
    assert_eq!(
        finished,
        [
            FinishedSeq {
                id: SeqId(1),
                reason: FinishReason::MaxNewTokens,
                output: outputs(1, 5..8)
            },
            FinishedSeq {
                id: SeqId(2),
                reason: FinishReason::MaxNewTokens,
                output: outputs(2, 3..5)
            },
        ]
    );
    assert!(!s.has_work());
    assert_eq!(used_blocks(&s), 0);
}

#[test]
fn long_prompts_are_prefilled_in_chunks_under_the_budget() {
    let mut s = scheduler(8, 8, 64, 4);
    let prompt: Vec<u32> = (0..20).collect();
    add(&mut s, 1, &prompt, 2);
    let chunks: Vec<_> = (0..3).map(|_| step(&mut s).0).collect();
    assert_eq!(
        chunks.iter().map(shape).collect::<Vec<_>>(),
        [[(1, 0, 8)], [(1, 8, 8)], [(1, 16, 4)]]
    );
    assert_eq!(
        chunks.iter().map(|o| o.seqs[0].sample).collect::<Vec<_>>(),
        [false, false, true]
    );
    assert_eq!(chunks[1].seqs[0].tokens, &prompt[8..16]);
    assert_eq!(
        chunks[1].seqs[0].block_table.len(),
        4,
        "the table covers the chunk"
    );

    add(&mut s, 2, &(0..10).map(|t| t + 50).collect::<Vec<_>>(), 1);
    let (out, finished) = step(&mut s);
    assert_eq!(
        shape(&out),
        [(1, 20, 1), (2, 0, 7)],
        "the decode takes one token of the budget"
    );
    assert_eq!(finished.len(), 1);
    let (out, finished) = step(&mut s);
    assert_eq!(shape(&out), [(2, 7, 3)]);
    assert_eq!(finished[0].output, outputs(2, 10..11));
}

#[test]
fn at_most_max_running_requests_run() {
    let mut s = scheduler(2, 100, 64, 4);
    for id in 1..=3 {
        add(&mut s, id, &[1, 2], 2);
    }
    let (out, _) = step(&mut s);
    assert_eq!(shape(&out), [(1, 0, 2), (2, 0, 2)]);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    let (out, finished) = step(&mut s);
    assert_eq!(shape(&out), [(1, 2, 1), (2, 2, 1)]);
    assert_eq!(finished.len(), 2);
    let (out, _) = step(&mut s);
    assert_eq!(shape(&out), [(3, 0, 2)]);
}

#[test]
fn a_sequence_in_flight_is_not_scheduled_twice() {
    let mut s = scheduler(8, 100, 64, 4);
    add(&mut s, 1, &[1, 2, 3], 4);
    let out = s.schedule();
    assert!(s.schedule().is_empty());
    s.update_from_output(&model(&out));
    s.update_from_output(&model(&out)); // a repeated result is ignored
    let out = s.schedule();
    assert_eq!(shape(&out), [(1, 3, 1)]);
    // A sampling chunk that came back without a token is recomputed rather than stalling.
    s.update_from_output(&[StepResult {
        id: SeqId(1),
        token: None,
        finished: false,
    }]);
    assert_eq!(shape(&s.schedule()), [(1, 3, 1)]);
}

#[test]
fn decode_preempts_the_newest_sequence_which_later_recomputes_and_completes() {
    // 4 blocks of 2 tokens: two 3-token prompts fill the pool after their first decode.
    let mut s = scheduler(8, 100, 4, 2);
    add(&mut s, 1, &[1, 2, 3], 4);
    add(&mut s, 2, &[4, 5, 6], 4);
    assert_eq!(shape(&step(&mut s).0), [(1, 0, 3), (2, 0, 3)]);
    assert_eq!(shape(&step(&mut s).0), [(1, 3, 1), (2, 3, 1)]);

    let (out, _) = step(&mut s);
    assert_eq!(shape(&out), [(1, 4, 1)]);
    assert_eq!(out.preempted, [SeqId(2)]);
    assert_eq!(
        (s.num_running(), s.num_waiting(), s.stats().preemptions),
        (1, 1, 1)
    );

    let (out, finished) = step(&mut s);
    assert_eq!(shape(&out), [(1, 5, 1)], "2 does not fit yet");
    assert_eq!(finished[0].output, outputs(1, 3..7));

    // 2's first block survived in the prefix cache; the rest, including the two tokens it had
    // generated, is recomputed in one chunk that samples.
    let (out, _) = step(&mut s);
    let seq = &out.seqs[0];
    assert_eq!(
        (seq.id, seq.start_pos, seq.cached_tokens, seq.sample),
        (SeqId(2), 2, 2, true)
    );
    assert_eq!(seq.tokens, [6, tok(SeqId(2), 3), tok(SeqId(2), 4)]);
    let (_, finished) = step(&mut s);
    assert_eq!(
        finished,
        [FinishedSeq {
            id: SeqId(2),
            reason: FinishReason::MaxNewTokens,
            output: outputs(2, 3..7)
        }]
    );
    assert_eq!(used_blocks(&s), 0);
}

#[test]
fn abort_frees_waiting_and_running_sequences() {
    let mut s = scheduler(2, 100, 16, 4);
    for id in 1..=3 {
        add(&mut s, id, &[id as u32; 6], 5);
    }
    let out = s.schedule();
    assert_eq!(used_blocks(&s), 4);
    assert!(s.abort(SeqId(3)), "waiting");
    assert!(s.abort(SeqId(1)), "running, result in flight");
    assert!(!s.abort(SeqId(1)));
    assert_eq!(used_blocks(&s), 2);
    assert!(
        s.update_from_output(&model(&out)).is_empty(),
        "1's late result is ignored"
    );
    assert_eq!(shape(&s.schedule()), [(2, 6, 1)]);
    assert!(s.abort(SeqId(2)));
    assert_eq!(used_blocks(&s), 0);
    assert!(!s.has_work());
    add(&mut s, 1, &[1], 1); // an aborted id may be reused
}

#[test]
fn samples_of_one_prompt_compute_it_once() {
    let mut s = scheduler(16, 100, 64, 4);
    let prompt: Vec<u32> = (0..10).collect();
    for id in 1..=4 {
        add(&mut s, id, &prompt, 2);
    }
    add(&mut s, 5, &[9, 9, 9, 9, 9, 9], 2);

    let (out, _) = step(&mut s);
    assert_eq!(
        shape(&out),
        [(1, 0, 10), (5, 0, 6)],
        "2..4 wait for 1's blocks; 5 is not held up"
    );
    let (out, _) = step(&mut s);
    assert_eq!(
        shape(&out),
        [(1, 10, 1), (5, 6, 1), (2, 8, 2), (3, 8, 2), (4, 8, 2)]
    );
    let first = &out.seqs[2].block_table[..2];
    for seq in &out.seqs[2..] {
        assert_eq!(seq.cached_tokens, 8);
        assert_eq!(&seq.block_table[..2], first, "shared prefix blocks");
    }
    assert_eq!(s.stats().prefix_hit_tokens, 24);
    while s.has_work() {
        step(&mut s);
    }
    assert_eq!(used_blocks(&s), 0);
}

#[test]
fn pause_keeps_state_and_resume_continues() {
    let mut s = scheduler(8, 100, 64, 4);
    add(&mut s, 1, &[1, 2, 3], 3);
    step(&mut s);
    s.pause();
    add(&mut s, 2, &[4, 5], 3);
    assert!(s.schedule().is_empty());
    assert!(s.has_work() && s.is_paused());
    assert_eq!((s.num_running(), s.num_waiting()), (1, 1));
    s.resume();
    assert_eq!(shape(&s.schedule()), [(1, 3, 1), (2, 0, 2)]);
}

#[test]
fn retract_all_requeues_running_sequences_for_recompute() {
    let mut s = scheduler(8, 100, 64, 4);
    add(&mut s, 1, &[1, 2, 3, 4, 5, 6], 10);
    add(&mut s, 2, &[7, 8, 9, 10, 11], 10);
    for _ in 0..3 {
        step(&mut s);
    }
    add(&mut s, 3, &[12], 10);
    assert_eq!(s.retract_all(), 2);
    assert_eq!(
        (s.num_running(), s.num_waiting(), used_blocks(&s)),
        (0, 3, 0)
    );

    // Their committed blocks are still cached: only the tails are recomputed.
    assert_eq!(shape(&s.schedule()), [(1, 8, 1), (2, 4, 4), (3, 0, 1)]);

    // After a weight update nothing old is reused.
    s.retract_all();
    s.pool().flush(1);
    let out = s.schedule();
    assert_eq!(shape(&out), [(1, 0, 9), (2, 0, 8), (3, 0, 1)]);
    assert_eq!(out.seqs[0].tokens[6..], outputs(1, 6..9));
    s.update_from_output(&model(&out));
    while s.has_work() {
        for f in step(&mut s).1 {
            let prompt_len = [6, 5, 1][f.id.0 as usize - 1];
            assert_eq!(f.output, outputs(f.id.0, prompt_len..prompt_len + 10));
        }
    }
}

#[test]
fn finish_reasons() {
    let config = SchedulerConfig {
        max_running_requests: 256,
        max_batch_tokens: 8192,
        max_context_len: 6,
        schedule_conservativeness: 0.0,
    };
    let mut s = Scheduler::new(config, KvPool::new(64, 4));
    add(&mut s, 1, &[1, 2, 3, 4], 10);
    add(&mut s, 2, &[1, 2, 3, 4], 10);
    add(&mut s, 3, &[5], 1);
    let out = s.schedule();
    let mut results = model(&out);
    results[1].finished = true;
    let finished = s.update_from_output(&results);
    assert_eq!(
        finished
            .iter()
            .map(|f| (f.id.0, f.reason, f.output.len()))
            .collect::<Vec<_>>(),
        [
            (2, FinishReason::Stop, 1),
            (3, FinishReason::MaxNewTokens, 1)
        ]
    );
    let (_, finished) = step(&mut s);
    assert_eq!(
        (finished[0].reason, finished[0].output.len()),
        (FinishReason::MaxContext, 2)
    );
}

#[test]
fn impossible_requests_are_refused() {
    // 2 blocks of 4 tokens: no sequence can pass 8 tokens, whatever the model allows.
    let mut s = scheduler(8, 100, 2, 4);
    let req = |id, prompt: Vec<u32>, max_new_tokens| SeqRequest {
        id: SeqId(id),
        prompt,
        max_new_tokens,
        use_prefix_cache: true,
    };
    assert_eq!(s.add(req(1, vec![], 1)), Err(SchedulerError::EmptyPrompt));
    assert_eq!(
        s.add(req(1, vec![1], 0)),
        Err(SchedulerError::ZeroMaxNewTokens)
    );
    assert_eq!(
        s.add(req(1, vec![1; 8], 1)),
        Err(SchedulerError::PromptTooLong { len: 8, max: 7 })
    );
    s.add(req(1, vec![1; 7], 5)).unwrap();
    assert_eq!(
        s.add(req(1, vec![1], 1)),
        Err(SchedulerError::DuplicateId(SeqId(1)))
    );
    let (_, finished) = step(&mut s);
    assert_eq!(finished[0].reason, FinishReason::MaxContext);
}

/// Stand-in for the KV the engine writes at `pos`: a function of the whole prefix, as real keys
/// and values are.
fn kv_value(tokens: &[u32], pos: usize) -> u64 {
    let mut h = DefaultHasher::new();
    tokens[..=pos].hash(&mut h);
    h.finish()
}

#[test]
fn random_long_run_loses_nothing_and_shares_only_correct_kv() {
    let without = random_long_run(0.0);
    assert!(
        without.preemptions > 10 && without.prefix_hit_tokens > 100,
        "the run exercised both: {without:?}"
    );
    // The same requests with SGLang's reserve: nothing lost either, fewer preemptions.
    let with = random_long_run(1.0);
    assert!(
        with.preemptions < without.preemptions && with.prefix_hit_tokens > 100,
        "with the reserve {with:?}, without {without:?}"
    );
}

/// 20,000 steps of random requests, aborts, retractions, cache flushes and pauses over a pool
/// of 16 blocks, every chunk's tokens and KV checked against the fake model; returns the
/// scheduler's counters.
fn random_long_run(schedule_conservativeness: f64) -> SchedulerStats {
    const BS: usize = 4;
    const BLOCKS: usize = 16;
    const STOP: u32 = 17; // tokens divisible by this are the engine's EOS
    let config = SchedulerConfig {
        max_running_requests: 6,
        max_batch_tokens: 24,
        max_context_len: 40,
        schedule_conservativeness,
    };
    let pool = KvPool::new(BLOCKS, BS);
    let mut s = Scheduler::new(config.clone(), pool.clone());
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[11; 32]);
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|p| (0..rng.random_range(4..14)).map(|i| p * 100 + i).collect())
        .collect();

    // Every request's full token sequence as the fake model will produce it.
    let mut expected: HashMap<SeqId, (usize, Vec<u32>, usize)> = HashMap::new();
    let full = |id: SeqId, prompt: &[u32], pos: usize| {
        if pos < prompt.len() {
            prompt[pos]
        } else {
            tok(id, pos)
        }
    };
    let mut live: Vec<SeqId> = Vec::new();
    let mut done: HashSet<SeqId> = HashSet::new();
    let mut memory = vec![[None::<(u64, u64)>; BS]; BLOCKS];
    let mut next_id = 0;

    for step in 0..20_000 {
        let adding = step < 2000;
        if adding && rng.random_bool(0.3) {
            let mut prompt = prefixes[rng.random_range(0..3)].clone();
            prompt.extend((0..rng.random_range(1..20)).map(|_| rng.random_range(0..4)));
            let max_new = rng.random_range(1..25);
            next_id += 1;
            add(&mut s, next_id, &prompt, max_new);
            expected.insert(SeqId(next_id), (prompt.len(), prompt, max_new));
            live.push(SeqId(next_id));
        }
        if rng.random_bool(0.02) && !live.is_empty() {
            let id = live.swap_remove(rng.random_range(0..live.len()));
            assert!(s.abort(id));
            assert!(done.insert(id));
        }
        if rng.random_bool(0.01) {
            s.retract_all();
        }
        if rng.random_bool(0.02) {
            pool.flush(pool.weight_version() + 1);
        }
        if adding && rng.random_bool(0.02) {
            s.pause();
        } else if !adding || rng.random_bool(0.3) {
            s.resume();
        }

        let out = s.schedule();
        let version = pool.weight_version();
        assert!(out.num_tokens() <= config.max_batch_tokens);
        assert!(out.seqs.len() <= config.max_running_requests);
        let mut results = Vec::new();
        for seq in &out.seqs {
            let (_, prompt, _) = &expected[&seq.id];
            let end = seq.start_pos + seq.tokens.len();
            let tokens: Vec<u32> = (0..end + 1).map(|p| full(seq.id, prompt, p)).collect();
            assert_eq!(
                seq.tokens,
                tokens[seq.start_pos..end],
                "{} chunk tokens",
                seq.id
            );
            assert!(seq.block_table.len() * BS >= end);
            let slot = |p: usize| (seq.block_table[p / BS] as usize, p % BS);
            for p in 0..seq.start_pos {
                let (b, o) = slot(p);
                let (v, value) = memory[b][o].expect("KV before start_pos is written");
                assert_eq!(
                    value,
                    kv_value(&tokens, p),
                    "{} reads wrong KV at {p}",
                    seq.id
                );
                assert!(
                    p >= seq.cached_tokens || v == version,
                    "shared KV from old weights"
                );
            }
            for p in seq.start_pos..end {
                let (b, o) = slot(p);
                memory[b][o] = Some((version, kv_value(&tokens, p)));
            }
            let token = seq.sample.then(|| tokens[end]);
            results.push(StepResult {
                id: seq.id,
                token,
                finished: token.is_some_and(|t| t % STOP == 0),
            });
        }
        for f in s.update_from_output(&results) {
            let (prompt_len, prompt, max_new) = &expected[&f.id];
            assert!(done.insert(f.id), "{} finished twice", f.id);
            live.retain(|&id| id != f.id);
            assert_eq!(
                f.output,
                (*prompt_len..prompt_len + f.output.len())
                    .map(|p| full(f.id, prompt, p))
                    .collect::<Vec<_>>()
            );
            let stops = f.output.iter().filter(|&&t| t % STOP == 0).count();
            let last_stops = f.output.last().is_some_and(|t| t % STOP == 0);
            match f.reason {
                FinishReason::Stop => assert!(stops == 1 && last_stops),
                FinishReason::MaxNewTokens => assert!(stops == 0 && f.output.len() == *max_new),
                FinishReason::MaxContext => {
                    assert!(stops == 0 && prompt_len + f.output.len() == 40)
                }
            }
        }
        pool.check_invariants(s.running.iter().map(|q| q.table.as_ref().unwrap()));
        assert!(s.waiting.iter().all(|q| q.table.is_none()));
        if !adding && !s.has_work() {
            break;
        }
    }
    assert!(!s.has_work(), "every request finishes");
    assert_eq!(done.len(), expected.len());
    assert_eq!(pool.stats().used_blocks, 0);
    s.stats()
}

/// With the reserve, a request waits while the free KV would not cover the running sequence's
/// expected future tokens and its own; without it, both are admitted at once.
#[test]
fn admission_keeps_kv_free_for_the_running_sequences_future_tokens() {
    // 64 tokens of KV. Each request: an 8-token prompt, up to 40 new tokens (0.7 x 40 = 28
    // expected): 28 + (8 + 28) > 64 - 8.
    for (conservativeness, admitted) in [(1.0, 1), (0.0, 2)] {
        let mut s = reserving(8, 64, 16, 4, conservativeness);
        add(&mut s, 1, &[1; 8], 40);
        add(&mut s, 2, &[2; 8], 40);
        let out = s.schedule();
        assert_eq!(
            out.seqs.len(),
            admitted,
            "conservativeness {conservativeness}"
        );
        assert_eq!(s.num_running(), admitted);
    }
}

/// The reserve's ratio decays as steps pass without preemption, faster than a long-running
/// sequence uses up its share, so a waiting request is admitted while the first still runs.
#[test]
fn the_reserve_decays_and_admits_the_waiting_request_before_the_first_finishes() {
    // 2000 tokens of KV; up to 2000 new tokens each (1400 expected at first): the second waits.
    let mut s = reserving(8, 64, 500, 4, 1.0);
    add(&mut s, 1, &[1; 4], 2000);
    add(&mut s, 2, &[2; 4], 2000);
    let mut admitted_at = None;
    for step_no in 0..1000 {
        let out = s.schedule();
        if out.seqs.iter().any(|q| q.id == SeqId(2)) {
            admitted_at = Some(step_no);
            break;
        }
        assert!(
            s.update_from_output(&model(&out)).is_empty(),
            "nothing finishes"
        );
    }
    let at = admitted_at.expect("admitted within 1000 steps");
    assert!(at > 100, "held back at first (admitted at step {at})");
    assert_eq!(s.num_running(), 2);
    assert_eq!(s.stats().preemptions, 0);
}

/// The ratio: 0.7 x conservativeness at first (at most 1), one decay step down per step to
/// 14% of the start, back to the start after a step that preempted.
#[test]
fn the_reserve_ratio_decays_to_its_floor_and_restarts_after_a_preemption() {
    let mut r = Reserve::new(1.0);
    assert_eq!(r.ratio, 0.7);
    assert_eq!(r.expected(100), 70);
    assert_eq!(
        r.expected(10_000),
        2868,
        "clipped to 4096 tokens, rounded up"
    );
    for _ in 0..600 {
        r.after_step(false);
    }
    assert!((r.ratio - 0.098).abs() < 1e-9, "{}", r.ratio);
    r.after_step(false);
    assert!((r.ratio - 0.098).abs() < 1e-9, "stays at the floor");
    r.after_step(true);
    assert_eq!(r.ratio, 0.7);
    assert_eq!(
        Reserve::new(2.0).ratio,
        1.0,
        "at most every remaining token"
    );
    assert!(Reserve::new(0.0).is_off());
}

#[test]
fn token_counts_follow_sequences_from_waiting_to_running_to_gone() {
    // max_running_requests 1: the second request stays waiting while the first runs.
    let mut s = scheduler(1, 64, 16, 4);
    add(&mut s, 1, &[1, 2, 3, 4, 5], 3);
    add(&mut s, 2, &[6, 7], 3);
    assert_eq!((s.num_running_tokens(), s.num_waiting_tokens()), (0, 7));
    step(&mut s);
    // Sequence 1 prefilled and sampled one token; sequence 2 still waits.
    assert_eq!((s.num_running_tokens(), s.num_waiting_tokens()), (6, 2));
    step(&mut s);
    assert_eq!(s.num_running_tokens(), 7);
    assert!(s.abort(SeqId(1)));
    assert!(s.abort(SeqId(2)));
    assert_eq!((s.num_running_tokens(), s.num_waiting_tokens()), (0, 0));
}
