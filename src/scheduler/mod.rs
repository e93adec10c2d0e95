//! Continuous batching as a pure state machine: which sequences run in the next step, which
//! chunk of each, and which KV blocks they write. No model and no clock: the engine calls
//! [`Scheduler::schedule`], runs the batch, and feeds the sampled tokens back through
//! [`Scheduler::update_from_output`], so every policy here is tested with hand-made outputs.
//!
//! Policy, after vLLM v1 and SGLang:
//! - Each step has a token budget. Decoding sequences go first, one token each, so a long
//!   prompt never stalls generation; partially prefilled and then waiting sequences get chunks
//!   of their prompt while the budget lasts (chunked prefill).
//! - Waiting requests are admitted in FIFO order while blocks and running slots last, and,
//!   as SGLang does (`--schedule-conservativeness`), while the free KV covers what the running
//!   sequences are expected to still need: a ratio of each one's remaining `max_new_tokens`
//!   (clipped to 4096), 0.7 x the conservativeness at first, decaying to 14% of that over 600
//!   steps without preemption and starting over when a step preempts. A conservativeness of 0
//!   admits on the prompt alone.
//! - A decoding sequence that needs a block when none is left preempts the most recently
//!   admitted running sequence by recompute: its KV is freed and it returns to the front of the
//!   waiting queue with its generated tokens, to be prefilled again (the prefix cache may keep
//!   much of it).
//! - A waiting request whose next prompt block a running sequence is computing right now waits
//!   for that block to reach the prefix cache, so the n samples of one prompt (the RL rollout
//!   workload) compute that prompt once. Requests behind it are not held up.

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;

use crate::kv::{BlockId, BlockTable, KvPool};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Batching limits. The block size is the [`KvPool`]'s, so it is not repeated here.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Sequences holding KV and taking part in steps at once.
    pub max_running_requests: usize,
    /// Tokens computed per step over all sequences: decode tokens plus prefill chunks.
    pub max_batch_tokens: usize,
    /// Longest sequence (prompt plus generated tokens) the model accepts.
    pub max_context_len: usize,
    /// How much KV admission keeps free for the running sequences' future tokens (SGLang's
    /// `--schedule-conservativeness`; 0: none, 1: SGLang's default).
    pub schedule_conservativeness: f64,
}

/// Tokens of a sequence's remaining `max_new_tokens` that admission reserves at most (SGLang's
/// `CLIP_MAX_NEW_TOKENS`).
const CLIP_MAX_NEW_TOKENS: usize = 4096;
/// The reserve ratio's start per unit of conservativeness, its floor as a share of the start,
/// and the steps it takes to decay from one to the other (SGLang's defaults).
const INIT_NEW_TOKEN_RATIO: f64 = 0.7;
const MIN_NEW_TOKEN_RATIO_FACTOR: f64 = 0.14;
const NEW_TOKEN_RATIO_DECAY_STEPS: f64 = 600.0;

/// The share of each running sequence's remaining `max_new_tokens` that admission keeps KV
/// free for.
#[derive(Debug, Clone, Copy)]
struct Reserve {
    init: f64,
    min: f64,
    decay: f64,
    ratio: f64,
}

impl Reserve {
    fn new(conservativeness: f64) -> Reserve {
        let init = (INIT_NEW_TOKEN_RATIO * conservativeness.max(0.0)).min(1.0);
        let min = (MIN_NEW_TOKEN_RATIO_FACTOR * init).min(1.0);
        Reserve {
            init,
            min,
            decay: (init - min) / NEW_TOKEN_RATIO_DECAY_STEPS,
            ratio: init,
        }
    }

    fn is_off(&self) -> bool {
        self.init == 0.0
    }

    /// KV tokens expected for `remaining_new` more tokens.
    fn expected(&self, remaining_new: usize) -> usize {
        (self.ratio * remaining_new.min(CLIP_MAX_NEW_TOKENS) as f64).ceil() as usize
    }

    /// After a step: back to the start when it had to preempt, else one decay step down.
    fn after_step(&mut self, preempted: bool) {
        self.ratio = if preempted {
            self.init
        } else {
            (self.ratio - self.decay).max(self.min)
        };
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqRequest {
    pub id: SeqId,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    /// False for requests that need every prompt position computed by themselves (prompt
    /// logprobs, routed experts of the prompt): they neither reuse cached prefix blocks.
    pub use_prefix_cache: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SchedulerError {
    #[error("sequence {0} is already queued or running")]
    DuplicateId(SeqId),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_new_tokens must be at least 1")]
    ZeroMaxNewTokens,
    /// `max` is one below the model context or the KV pool capacity, whichever is smaller.
    #[error("the prompt has {len} tokens; at most {max} leave room to generate")]
    PromptTooLong { len: usize, max: usize },
}

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub id: SeqId,
    /// Position of `tokens[0]`; KV for every earlier position is already in `block_table`.
    pub start_pos: usize,
    /// The tokens to compute, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: Vec<u32>,
    /// The sequence's whole table, covering at least `start_pos + tokens.len()` positions.
    pub block_table: Vec<BlockId>,
    /// The chunk ends at the last known token: the model must produce the next one.
    pub sample: bool,
    /// Tokens reused from the prefix cache; nonzero only in the step that (re)admits the
    /// sequence, where it equals `start_pos`.
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    pub seqs: Vec<ScheduledSeq>,
    /// Sequences moved back to the waiting queue in this step, KV freed.
    pub preempted: Vec<SeqId>,
}

impl SchedulerOutput {
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

/// The engine's verdict on one scheduled sequence after the step ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepResult {
    pub id: SeqId,
    /// The sampled token; `None` for a chunk that did not sample.
    pub token: Option<u32>,
    /// The engine's stop criteria (EOS, stop token or string) were met.
    pub finished: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The engine reported `finished`.
    Stop,
    MaxNewTokens,
    /// The sequence filled the model context or the KV pool.
    MaxContext,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedSeq {
    pub id: SeqId,
    pub reason: FinishReason,
    /// Every generated token.
    pub output: Vec<u32>,
}

/// Cumulative counters for /metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub preemptions: u64,
    /// Tokens of (re)admitted sequences, and how many of them the prefix cache supplied.
    pub admitted_tokens: u64,
    pub prefix_hit_tokens: u64,
}

#[derive(Debug)]
struct Seq {
    id: SeqId,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_new_tokens: usize,
    use_prefix_cache: bool,
    /// Leading tokens whose KV is written in `table`.
    num_computed: usize,
    /// Tokens scheduled in a step whose result has not come back; such a sequence is skipped.
    in_flight: usize,
    /// `None` while waiting: a waiting sequence holds no KV.
    table: Option<BlockTable>,
}

impl Seq {
    fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    fn table(&mut self) -> &mut BlockTable {
        self.table
            .as_mut()
            .expect("a running sequence has a block table")
    }

    /// KV tokens this sequence still needs beyond its blocks: the rest of its known tokens,
    /// and what `reserve` expects of its remaining `max_new_tokens`.
    fn outstanding(&self, reserve: &Reserve) -> usize {
        let held = self.table.as_ref().map_or(0, BlockTable::capacity);
        let generated = self.tokens.len() - self.prompt_len;
        self.tokens.len().saturating_sub(held)
            + reserve.expected(self.max_new_tokens.saturating_sub(generated))
    }

    /// Back to the waiting state: KV freed (by Drop), everything to be recomputed.
    fn reset(&mut self) {
        self.table = None;
        self.num_computed = 0;
        self.in_flight = 0;
    }
}

pub struct Scheduler {
    config: SchedulerConfig,
    pool: KvPool,
    /// The longest sequence allowed: the model context, or the whole pool if smaller, so that
    /// any single sequence can always run alone and preemption always ends.
    max_len: usize,
    waiting: VecDeque<Seq>,
    /// In admission order: preemption takes from the back.
    running: Vec<Seq>,
    ids: HashSet<SeqId>,
    paused: bool,
    stats: SchedulerStats,
    reserve: Reserve,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, pool: KvPool) -> Scheduler {
        assert!(
            config.max_running_requests > 0,
            "max_running_requests must be positive"
        );
        // As in vLLM: otherwise decoding sequences late in the running list could starve.
        assert!(
            config.max_batch_tokens >= config.max_running_requests,
            "max_batch_tokens must be at least max_running_requests, so every decode fits a step"
        );
        let max_len = config
            .max_context_len
            .min(pool.num_blocks() * pool.block_size());
        let config_reserve = config.schedule_conservativeness;
        Scheduler {
            config,
            pool,
            max_len,
            waiting: VecDeque::new(),
            running: Vec::new(),
            ids: HashSet::new(),
            paused: false,
            stats: SchedulerStats::default(),
            reserve: Reserve::new(config_reserve),
        }
    }

    pub fn add(&mut self, req: SeqRequest) -> Result<(), SchedulerError> {
        if self.ids.contains(&req.id) {
            return Err(SchedulerError::DuplicateId(req.id));
        }
        if req.prompt.is_empty() {
            return Err(SchedulerError::EmptyPrompt);
        }
        if req.max_new_tokens == 0 {
            return Err(SchedulerError::ZeroMaxNewTokens);
        }
        if req.prompt.len() >= self.max_len {
            return Err(SchedulerError::PromptTooLong {
                len: req.prompt.len(),
                max: self.max_len.saturating_sub(1),
            });
        }
        self.ids.insert(req.id);
        self.waiting.push_back(Seq {
            id: req.id,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            max_new_tokens: req.max_new_tokens,
            use_prefix_cache: req.use_prefix_cache,
            num_computed: 0,
            in_flight: 0,
            table: None,
        });
        Ok(())
    }

    /// Drops a waiting or running sequence, freeing its KV now. A result for it that is still in
    /// flight is ignored. False if the id is unknown (already finished or aborted).
    pub fn abort(&mut self, id: SeqId) -> bool {
        if !self.ids.remove(&id) {
            return false;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i);
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
        }
        true
    }

    /// Stops scheduling: [`schedule`](Self::schedule) returns empty outputs until
    /// [`resume`](Self::resume). Nothing is freed.
    pub fn pause(&mut self) {
        self.paused = true;
    }

    pub fn resume(&mut self) {
        self.paused = false;
    }

    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// Moves every running sequence back to the front of the waiting queue (in admission order),
    /// freeing its KV and keeping its generated tokens. Before a weight update this makes every
    /// sequence continue on KV recomputed with the new weights. Returns how many moved.
    pub fn retract_all(&mut self) -> usize {
        let n = self.running.len();
        for mut seq in self.running.drain(..).rev() {
            seq.reset();
            self.waiting.push_front(seq);
        }
        n
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Tokens (prompt and generated so far) of the running sequences: the context they hold
    /// KV for, whatever the block rounding. Load reports (`/get_load`) count these.
    pub fn num_running_tokens(&self) -> usize {
        self.running.iter().map(|s| s.tokens.len()).sum()
    }

    /// Tokens of the waiting sequences: what they will need once admitted (a retracted
    /// sequence counts its generated tokens too, as they are recomputed).
    pub fn num_waiting_tokens(&self) -> usize {
        self.waiting.iter().map(|s| s.tokens.len()).sum()
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// Picks the next step's batch and allocates its blocks. A sequence already in flight (its
    /// result not yet given to `update_from_output`) is not scheduled again.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        if self.paused {
            return out;
        }
        let mut budget = self.config.max_batch_tokens;

        // Decodes: one token each, preempting from the back of the running list for blocks.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &mut self.running[i];
            if seq.in_flight > 0 || seq.remaining() != 1 {
                i += 1;
                continue;
            }
            let needed = seq.num_computed + 1;
            if seq.table().ensure_capacity(needed).is_ok() {
                self.push_chunk(i, 1, 0, &mut out);
                budget -= 1;
                i += 1;
            } else {
                // With no later sequence left to preempt, this one yields itself; either way
                // running[i] is then the next sequence to look at (or this one, retried).
                let victim = self.victim_after(i).unwrap_or(i);
                self.preempt(victim, &mut out);
            }
        }

        // Partially prefilled sequences: as large a chunk as budget and blocks allow.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if self.running[i].in_flight == 0 {
                let n = self.running[i].remaining().min(budget);
                let n = self.grow_for_chunk(i, n, &mut out);
                if n > 0 {
                    self.push_chunk(i, n, 0, &mut out);
                    budget -= n;
                }
            }
            i += 1;
        }

        // Admission, unless this step had to preempt: memory is short, and the victims at the
        // front of the queue would only be admitted to be preempted again.
        let bs = self.pool.block_size();
        let mut reserved: usize = if self.reserve.is_off() {
            0
        } else {
            self.running
                .iter()
                .map(|s| s.outstanding(&self.reserve))
                .sum()
        };
        let mut w = 0;
        while out.preempted.is_empty()
            && w < self.waiting.len()
            && budget > 0
            && self.running.len() < self.config.max_running_requests
        {
            let seq = &self.waiting[w];
            let (mut table, cached) = if seq.use_prefix_cache {
                self.pool.match_prefix(&seq.tokens)
            } else {
                (self.pool.new_table(), 0)
            };
            if self.pending_in_running(seq, &table) {
                w += 1;
                continue;
            }
            // The free KV must cover what the running sequences are expected to still need and
            // what this one will (a request alone is always admitted, so none waits forever).
            if !self.reserve.is_off() && !self.running.is_empty() {
                let generated = seq.tokens.len() - seq.prompt_len;
                let own = (seq.tokens.len() - cached)
                    + self
                        .reserve
                        .expected(seq.max_new_tokens.saturating_sub(generated));
                if reserved + own > self.pool.num_available() * bs {
                    break;
                }
            }
            let n = (seq.tokens.len() - cached).min(budget);
            if table.ensure_capacity(cached + n).is_err() {
                break;
            }
            let mut seq = self.waiting.remove(w).expect("index checked");
            self.stats.admitted_tokens += seq.tokens.len() as u64;
            self.stats.prefix_hit_tokens += cached as u64;
            seq.num_computed = cached;
            seq.table = Some(table);
            if !self.reserve.is_off() {
                reserved += seq.outstanding(&self.reserve);
            }
            self.running.push(seq);
            self.push_chunk(self.running.len() - 1, n, cached, &mut out);
            budget -= n;
        }
        if !out.is_empty() {
            self.reserve.after_step(!out.preempted.is_empty());
        }
        out
    }

    /// Applies a step's results: advances computed tokens, offers newly full blocks to the
    /// prefix cache, appends sampled tokens, and removes (freeing their KV) the sequences that
    /// finished, which it returns. Results for unknown or not-in-flight sequences are ignored.
    pub fn update_from_output(&mut self, results: &[StepResult]) -> Vec<FinishedSeq> {
        let index: HashMap<SeqId, usize> = self
            .running
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id, i))
            .collect();
        let mut done = Vec::new();
        for r in results {
            let Some(&i) = index.get(&r.id) else { continue };
            let seq = &mut self.running[i];
            if seq.in_flight == 0 {
                continue;
            }
            seq.num_computed += std::mem::take(&mut seq.in_flight);
            let sampled = seq.num_computed == seq.tokens.len();
            seq.table
                .as_mut()
                .expect("running")
                .commit_full_blocks(&seq.tokens[..seq.num_computed]);
            if let (true, Some(token)) = (sampled, r.token) {
                seq.tokens.push(token);
            }
            // A sampling chunk that brought no token recomputes its last position next step
            // instead of stalling with nothing left to compute.
            seq.num_computed = seq.num_computed.min(seq.tokens.len() - 1);

            let reason = if r.finished {
                FinishReason::Stop
            } else if seq.tokens.len() - seq.prompt_len >= seq.max_new_tokens {
                FinishReason::MaxNewTokens
            } else if seq.tokens.len() >= self.max_len {
                FinishReason::MaxContext
            } else {
                continue;
            };
            done.push((i, reason));
        }
        // Remove from the back so the remaining indices stay valid, then report in step order.
        done.sort_unstable_by_key(|&(i, _)| std::cmp::Reverse(i));
        let mut finished: Vec<FinishedSeq> = done
            .into_iter()
            .map(|(i, reason)| {
                let mut seq = self.running.remove(i);
                self.ids.remove(&seq.id);
                FinishedSeq {
                    id: seq.id,
                    reason,
                    output: seq.tokens.split_off(seq.prompt_len),
                }
            })
            .collect();
        finished.reverse();
        finished
    }

    /// The most recently admitted running sequence after `i` that is not part of this step.
    fn victim_after(&self, i: usize) -> Option<usize> {
        (i + 1..self.running.len())
            .rev()
            .find(|&j| self.running[j].in_flight == 0)
    }

    fn preempt(&mut self, i: usize, out: &mut SchedulerOutput) {
        let mut seq = self.running.remove(i);
        seq.reset();
        self.stats.preemptions += 1;
        out.preempted.push(seq.id);
        // Victims are taken newest first, so pushing each to the front keeps admission order.
        self.waiting.push_front(seq);
    }

    /// Grows running[i]'s table for a chunk of up to `n` tokens and returns the chunk that fits.
    /// A prefill chunk shrinks to the blocks available rather than preempting; only when not a
    /// single token fits does it preempt a later sequence, and with none left it waits.
    fn grow_for_chunk(&mut self, i: usize, n: usize, out: &mut SchedulerOutput) -> usize {
        let bs = self.pool.block_size();
        loop {
            let available = self.pool.num_available() * bs;
            let seq = &mut self.running[i];
            let start = seq.num_computed;
            let table = seq.table();
            let fit = n.min(table.capacity() + available - start);
            if fit > 0 {
                table
                    .ensure_capacity(start + fit)
                    .expect("room was checked");
                return fit;
            }
            match self.victim_after(i) {
                Some(j) => self.preempt(j, out),
                None => return 0,
            }
        }
    }

    fn push_chunk(&mut self, i: usize, n: usize, cached_tokens: usize, out: &mut SchedulerOutput) {
        let seq = &mut self.running[i];
        let start = seq.num_computed;
        seq.in_flight = n;
        out.seqs.push(ScheduledSeq {
            id: seq.id,
            start_pos: start,
            tokens: seq.tokens[start..start + n].to_vec(),
            block_table: seq.table().blocks().to_vec(),
            sample: start + n == seq.tokens.len(),
            cached_tokens,
        });
    }

    /// Whether a running sequence still prefilling is computing the next block `seq` could take
    /// from the prefix cache (given `table`, its current match).
    fn pending_in_running(&self, seq: &Seq, table: &BlockTable) -> bool {
        // The last token is always computed, so only blocks before it are worth waiting for.
        let usable = &seq.tokens[..seq.tokens.len() - 1];
        self.running.iter().any(|r| {
            r.num_computed + 1 < r.tokens.len()
                && table.next_block_pending_in(
                    usable,
                    r.table.as_ref().expect("running"),
                    &r.tokens,
                )
        })
    }
}
