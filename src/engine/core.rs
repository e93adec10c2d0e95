//! The engine loop: drain commands, schedule a step, run the model, sample, emit events.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use super::config::EngineConfig;
use super::executor::{self, DeviceLoader, Executor, ExecutorSpec, ShadowWeights, StepOutput};
use super::memory::{MemoryState, MemoryTag, WeightsState};
use super::request::{
    EngineEvent, FinishInfo, GenerateRequest, InputLogprob, TokenOut, VersionSpan,
};
use super::{
    Command, EngineError, EngineHandle, EngineInfo, EngineShared, Installed, MemoryReport,
    PauseMode, DECODE_STEP_SECONDS, STEP_SECONDS, STEP_TOKENS,
};
use crate::kv::KvPool;
use crate::model::{ForwardBatch, Model, SeqInput};
use crate::sampling::{
    self, Finish, SampleInput, StopChecker, StopStatus, TokenHistory, ValidSamplingParams,
};
use crate::scheduler::{
    FinishReason, Scheduler, SchedulerConfig, SchedulerOutput, SeqId, SeqRequest, StepResult,
};
use crate::tokenizer::{IncrementalDecoder, Tokenizer};

/// One generating sequence as the engine sees it.
struct Active {
    req: GenerateRequest,
    events: mpsc::UnboundedSender<EngineEvent>,
    history: TokenHistory,
    stop: StopChecker,
    decoder: IncrementalDecoder,
    output: Vec<u32>,
    /// The weight versions that computed the output, as runs of output positions (one entry a
    /// version change, not a token).
    token_versions: Vec<VersionSpan>,
    /// Next prompt index whose input logprob is still to be computed.
    input_lp_next: usize,
    input_logprobs: Vec<InputLogprob>,
    /// Routed experts of every forwarded position, `[pos][moe_layers * top_k]`.
    routed: Vec<Vec<i32>>,
    cached_tokens: Option<usize>,
    arrived: Instant,
    queue_time: Option<f64>,
    finish: Option<(Finish, usize)>,
}

pub struct Engine;

impl Engine {
    /// Starts the engine thread on the CPU and returns its handle once the model has run a
    /// warm-up step.
    pub fn start(
        model: Model,
        info: EngineInfo,
        cfg: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        Self::start_with(ExecutorSpec::Cpu(model), info, cfg)
    }

    /// Starts the engine on the backend `spec` names (built on the engine thread) and returns
    /// its handle once it has run a warm-up step, or why it could not start (a device that
    /// cannot be opened, a kernel that does not compile, too little memory).
    pub fn start_with(
        spec: ExecutorSpec,
        info: EngineInfo,
        cfg: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        Self::start_on(move |cfg| executor::build(spec, cfg), info, cfg)
    }

    /// [`Engine::start_with`] over the executor `build` makes on the engine thread (tests
    /// give stand-ins for a device here).
    pub(crate) fn start_on(
        build: impl FnOnce(&EngineConfig) -> Result<Box<dyn Executor>, EngineError> + Send + 'static,
        info: EngineInfo,
        cfg: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(cfg.max_queued_requests.max(1) * 2);
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let shared = Arc::new(EngineShared::default());
        let info = Arc::new(info);
        let handle = EngineHandle {
            tx,
            shared: shared.clone(),
            info: info.clone(),
            max_queued: cfg.max_queued_requests,
        };
        std::thread::Builder::new()
            .name("lockstep-engine".into())
            .spawn(move || {
                // A panic is a bug; the guard still fails /health and answers every waiter.
                let result = catch_unwind(AssertUnwindSafe(|| {
                    let started =
                        build(&cfg).and_then(|exec| Core::start(exec, info, shared.clone(), &cfg));
                    let mut core = match started {
                        Ok(core) => core,
                        Err(e) => {
                            *shared.last_error.lock().expect("error lock") = Some(e.to_string());
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    shared.healthy.store(true, Ordering::Release);
                    if let Err(e) = core.warm_up() {
                        core.fail(&e);
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                    shared.warm.store(true, Ordering::Release);
                    let _ = ready_tx.send(Ok(()));
                    if let Err(e) = core.run(&rx) {
                        core.fail(&e);
                    }
                }));
                if let Err(panic) = result {
                    let msg = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "engine panicked".into());
                    tracing::error!("engine thread panicked: {msg}");
                    *shared.last_error.lock().expect("error lock") =
                        Some(format!("engine panicked: {msg}"));
                }
                shared.healthy.store(false, Ordering::Release);
                // A start-up that panicked never sent its ready message: dropping the sender
                // ends `start_with`'s wait with the error recorded above.
                drop(ready_tx);
                if shared.last_error.lock().expect("error lock").is_some() {
                    // Requests in flight learned of it from `fail` or from their dropped
                    // senders; keep answering commands so nobody waits forever.
                    drain_after_failure(&rx, &shared);
                }
            })
            .expect("spawn engine thread");
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(handle),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(EngineError::Stopped(handle.last_error())),
        }
    }
}

fn drain_after_failure(rx: &std::sync::mpsc::Receiver<Command>, shared: &EngineShared) {
    let msg = shared
        .last_error
        .lock()
        .ok()
        .and_then(|e| e.clone())
        .unwrap_or_default();
    while let Ok(cmd) = rx.recv() {
        match cmd {
            Command::Generate(_, tx) => {
                shared.in_channel.fetch_sub(1, Ordering::AcqRel);
                // `msg` is the failure's own text (it already says the engine stopped).
                let _ = tx.send(EngineEvent::Error(EngineError::Failed(msg.clone())));
            }
            Command::FlushCache(reply) => {
                let _ = reply.send(Err(EngineError::Stopped(msg.clone())));
            }
            Command::Shutdown => return,
            _ => {}
        }
    }
}

struct Core {
    exec: Box<dyn Executor>,
    sched: Scheduler,
    seqs: HashMap<SeqId, Active>,
    next_id: u64,
    tokenizer: Arc<Tokenizer>,
    eos: Vec<u32>,
    info: Arc<EngineInfo>,
    shared: Arc<EngineShared>,
    /// Set by `Shutdown`: new requests are refused and the loop ends once nothing runs.
    shutting_down: bool,
    /// What is released (published to `shared.memory` on every change).
    memory: MemoryState,
    /// Cloned into every shadow copy of the weights: more than one count means one exists.
    shadows: Arc<()>,
}

impl Core {
    /// Builds the executor and the scheduler over its KV blocks; device-only weights publish
    /// their slot table and checksum here.
    fn start(
        mut exec: Box<dyn Executor>,
        info: Arc<EngineInfo>,
        shared: Arc<EngineShared>,
        cfg: &EngineConfig,
    ) -> Result<Core, EngineError> {
        let catalog = exec
            .device_catalog()
            .map_err(|e| EngineError::Start(e.to_string()))?;
        if let Some(c) = catalog {
            let _ = info.slots.set(c.slots);
            *info.weights_checksum.write().expect("checksum lock") =
                ("default".to_string(), Arc::new(c.checksum));
        }
        let num_blocks = exec.num_kv_blocks();
        let pool = KvPool::new(num_blocks, cfg.block_size);
        let sched = Scheduler::new(
            SchedulerConfig {
                max_running_requests: cfg.max_running_requests,
                max_batch_tokens: cfg.max_batch_tokens,
                max_context_len: cfg.max_context_len,
                schedule_conservativeness: cfg.schedule_conservativeness,
            },
            pool,
        );
        shared.kv_total_blocks.store(num_blocks, Ordering::Release);
        let tokenizer = info.tokenizer.clone();
        let mut eos = tokenizer.eos_token_ids().to_vec();
        for id in &exec.config().eos_token_ids {
            if !eos.contains(id) {
                eos.push(*id);
            }
        }
        let memory = MemoryState {
            weights_backup: exec.keeps_weights_backup(),
            ..MemoryState::default()
        };
        *shared.memory.lock().expect("memory lock") = memory;
        Ok(Core {
            exec,
            sched,
            seqs: HashMap::new(),
            next_id: 1,
            tokenizer,
            eos,
            info,
            shared,
            shutting_down: false,
            memory,
            shadows: Arc::new(()),
        })
    }

    /// The engine cannot go on (a device failure): every request learns why, /health fails.
    fn fail(&mut self, e: &EngineError) {
        tracing::error!("engine stopped: {e}");
        *self.shared.last_error.lock().expect("error lock") = Some(e.to_string());
        self.shared.healthy.store(false, Ordering::Release);
        for (_, a) in self.seqs.drain() {
            let _ = a.events.send(EngineEvent::Error(e.clone()));
        }
    }

    fn num_moe_layers(&self) -> usize {
        self.exec.config().num_moe_layers()
    }

    fn top_k(&self) -> usize {
        self.exec.config().moe.as_ref().map_or(0, |m| m.top_k)
    }

    /// One forward pass and one greedy sample over a short prompt so the first request does not
    /// pay for page faults, thread-pool start-up or the first sampler launch; its KV blocks are
    /// freed right after.
    fn warm_up(&mut self) -> Result<(), EngineError> {
        let table: Vec<u32> = vec![0];
        let tokens = [0u32];
        let batch = ForwardBatch {
            seqs: vec![SeqInput {
                tokens: &tokens,
                start_pos: 0,
                block_table: &table,
                logits_from: Some(0),
            }],
        };
        let params = ValidSamplingParams::default();
        let history = TokenHistory::new(&tokens);
        let input = SampleInput {
            params: &params,
            history: &history,
            eos_token_ids: &self.eos,
            seed: 0,
            sample_index: 0,
            top_logprobs_num: 0,
            logprob: false,
        };
        self.exec.step(&batch, &[Some(input)]).map(drop)
    }

    /// The loop: commands between steps, a step whenever there is work. Ends on shutdown, or
    /// with the error of a step that failed.
    fn run(&mut self, rx: &std::sync::mpsc::Receiver<Command>) -> Result<(), EngineError> {
        loop {
            // Block only when there is nothing to step.
            let idle = !self.sched.has_work() || self.sched.is_paused();
            if idle {
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return Ok(()),
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            if self.shutting_down && self.seqs.is_empty() {
                return Ok(());
            }
            if !self.sched.is_paused() {
                self.step()?;
            }
            self.publish();
        }
    }

    fn publish(&self) {
        let stats = self.sched.pool().stats();
        self.shared
            .running
            .store(self.sched.num_running(), Ordering::Release);
        self.shared
            .waiting
            .store(self.sched.num_waiting(), Ordering::Release);
        self.shared
            .kv_used_blocks
            .store(stats.used_blocks, Ordering::Release);
        self.shared
            .running_tokens
            .store(self.sched.num_running_tokens(), Ordering::Release);
        self.shared
            .waiting_tokens
            .store(self.sched.num_waiting_tokens(), Ordering::Release);
        self.shared
            .prefix_hit_tokens
            .store(self.sched.stats().prefix_hit_tokens, Ordering::Release);
        self.shared
            .preemptions
            .store(self.sched.stats().preemptions, Ordering::Release);
        metrics::gauge!("lockstep_num_running_reqs").set(self.sched.num_running() as f64);
        metrics::gauge!("lockstep_num_queue_reqs").set(self.sched.num_waiting() as f64);
        metrics::gauge!("lockstep_kv_blocks_used").set(stats.used_blocks as f64);
        metrics::gauge!("lockstep_kv_blocks_total").set(stats.total_blocks as f64);
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Generate(req, events) => self.admit(*req, events),
            Command::Abort { rid, all } => {
                let ids: Vec<SeqId> = self
                    .seqs
                    .iter()
                    .filter(|(_, a)| all || rid.as_deref() == Some(a.req.rid.as_str()))
                    .map(|(id, _)| *id)
                    .collect();
                for id in ids {
                    self.abort(id, "aborted by request");
                }
            }
            Command::Pause(mode, reply) => {
                let n = self.seqs.len();
                match mode {
                    PauseMode::Abort => {
                        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
                        for id in ids {
                            self.abort(id, "aborted by pause_generation");
                        }
                    }
                    PauseMode::Retract => {
                        self.sched.retract_all();
                    }
                    PauseMode::InPlace => {}
                }
                self.sched.pause();
                self.shared.paused.store(true, Ordering::Release);
                let _ = reply.send(n);
            }
            Command::Continue(reply) => {
                self.sched.resume();
                self.shared.paused.store(false, Ordering::Release);
                let _ = reply.send(());
            }
            Command::FlushCache(reply) => {
                let result = if self.seqs.is_empty() {
                    let version = self.sched.pool().weight_version();
                    self.sched.pool().flush(version);
                    Ok(())
                } else {
                    Err(EngineError::Conflict(format!(
                        "{} requests are running; flush_cache needs an idle engine",
                        self.seqs.len()
                    )))
                };
                let _ = reply.send(result);
            }
            Command::SwapModel {
                model,
                checksum,
                version,
                abort_all,
                reply,
            } => {
                let _ = reply.send(self.swap_model(*model, checksum, version, abort_all));
            }
            Command::DeviceLoader(reply) => {
                let loader = self.exec.loader_stream().map(|gpu| {
                    gpu.map(|gpu| DeviceLoader {
                        gpu,
                        generation: self.sched.pool().weight_version(),
                        held: self.shadows.clone(),
                    })
                });
                let _ = reply.send(loader);
            }
            Command::Shadow { required, reply } => {
                let _ = reply.send(self.shadow(required));
            }
            Command::InstallShadow {
                shadow,
                checksum,
                version,
                abort_all,
                reply,
            } => {
                let _ = reply.send(self.install_shadow(*shadow, checksum, version, abort_all));
            }
            Command::ApplyWeights { commit, reply } => {
                let _ = reply.send(self.apply_weights(commit));
            }
            Command::SideStream(reply) => {
                let _ = reply.send(self.exec.side_stream());
            }
            Command::ReleaseMemory { tags, reply } => {
                let _ = reply.send(self.release_memory(tags.as_deref()));
            }
            Command::ResumeMemory { tags, reply } => {
                let _ = reply.send(self.resume_memory(tags.as_deref()));
            }
            Command::Shutdown => {
                self.shutting_down = true;
                let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
                for id in ids {
                    self.abort(id, "server shutting down");
                }
            }
        }
    }

    fn swap_model(
        &mut self,
        model: Model,
        checksum: Arc<crate::model::checksum::WeightsChecksum>,
        version: String,
        abort_all: bool,
    ) -> Result<usize, EngineError> {
        if !executor::same_shapes(self.exec.config(), &model.config) {
            return Err(EngineError::Conflict("the new weights' config.json differs from the served model's (architecture or shapes)".into()));
        }
        self.check_update(self.info.slots().len())?;
        // Swap first: if the backend refuses the weights, nothing else has changed.
        self.exec.swap(model)?;
        let aborted = self.abort_all_for_update(abort_all);
        self.begin_weight_version(version, checksum);
        Ok(aborted)
    }

    /// A shadow copy of resident weights (absent ones are written whole, in place).
    fn shadow(&mut self, required: bool) -> Result<Option<ShadowWeights>, EngineError> {
        if self.memory.weights != WeightsState::Resident {
            return if required {
                Err(EngineError::MemoryState(format!(
                    "the weights are {}: a shadow copy needs resident weights",
                    self.memory.weights.name()
                )))
            } else {
                Ok(None)
            };
        }
        let generation = self.sched.pool().weight_version();
        Ok(self.exec.shadow(required)?.map(|copy| ShadowWeights {
            copy,
            generation,
            _held: self.shadows.clone(),
        }))
    }

    fn install_shadow(
        &mut self,
        shadow: ShadowWeights,
        checksum: Arc<crate::model::checksum::WeightsChecksum>,
        version: String,
        abort_all: bool,
    ) -> Result<Installed, EngineError> {
        let started = Instant::now();
        if shadow.generation != self.sched.pool().weight_version() {
            return Err(EngineError::Conflict("other weights were swapped in while this update was written into its shadow copy: nothing changed; send the update again".into()));
        }
        self.check_update(self.info.slots().len())?;
        let displaced = self.exec.install_shadow(shadow.copy)?;
        let aborted = self.abort_all_for_update(abort_all);
        self.begin_weight_version(version, checksum);
        Ok(Installed {
            pause: started.elapsed(),
            aborted,
            displaced,
        })
    }

    /// A weight update that writes `writes` of the model's slots may go ahead: the weights are
    /// in memory, and absent weights are written whole.
    fn check_update(&self, writes: usize) -> Result<(), EngineError> {
        self.memory
            .check_update(writes, self.info.slots().len())
            .map_err(EngineError::MemoryState)
    }

    fn set_memory(&mut self, memory: MemoryState) {
        self.memory = memory;
        *self.shared.memory.lock().expect("memory lock") = memory;
    }

    /// `/release_memory_occupation`: only on an idle engine (SGLang asserts as much; here the
    /// caller learns which requests are in the way), every tag checked before any is acted
    /// on. The KV cache goes first (SGLang's order), then the weights.
    fn release_memory(&mut self, tags: Option<&[MemoryTag]>) -> Result<MemoryReport, EngineError> {
        if !self.seqs.is_empty() {
            let mut rids: Vec<&str> = self.seqs.values().map(|a| a.req.rid.as_str()).collect();
            rids.sort_unstable();
            let more = rids.len().saturating_sub(8);
            rids.truncate(8);
            return Err(EngineError::MemoryState(format!(
                "{} requests are in flight ({}{}): release_memory_occupation needs an idle engine; let them finish or abort them (POST /pause_generation {{\"mode\": \"abort\"}}) first",
                self.seqs.len(),
                rids.join(", "),
                if more > 0 { format!(" and {more} more") } else { String::new() }
            )));
        }
        if Arc::strong_count(&self.shadows) > 1 {
            return Err(EngineError::MemoryState("a streamed weight update holds a shadow copy of the weights (as much memory again): end it (POST /end_weight_update) or abort it (POST /abort_weight_update) first".into()));
        }
        let tags = self
            .memory
            .to_release(tags)
            .map_err(EngineError::MemoryState)?;
        let mut report = MemoryReport {
            tags: Vec::new(),
            bytes: 0,
            state: self.memory,
        };
        let result = self.release_each(&tags, &mut report);
        self.finish_memory(result, report, "released")
    }

    /// Acts on `tags` in release order, recording each in `r` as it is done.
    fn release_each(
        &mut self,
        tags: &[MemoryTag],
        r: &mut MemoryReport,
    ) -> Result<(), EngineError> {
        if tags.contains(&MemoryTag::KvCache) {
            // The cached prefixes index blocks whose contents are about to go.
            let pool = self.sched.pool();
            pool.flush(pool.weight_version());
            r.bytes += self.exec.release_kv()?;
            r.state.kv_released = true;
            r.tags.push(MemoryTag::KvCache);
        }
        if tags.contains(&MemoryTag::Weights) {
            // Absent weights hold no values worth a backup.
            let keep = r.state.weights == WeightsState::Resident;
            let released = self.exec.release_weights(keep)?;
            r.bytes += released.bytes;
            r.state.weights = WeightsState::Released {
                backup: released.backup,
            };
            r.tags.push(MemoryTag::Weights);
        }
        if tags.contains(&MemoryTag::CudaGraph) {
            r.tags.push(MemoryTag::CudaGraph);
        }
        Ok(())
    }

    /// `/resume_memory_occupation`: the weights first, then the KV cache (SGLang's order).
    fn resume_memory(&mut self, tags: Option<&[MemoryTag]>) -> Result<MemoryReport, EngineError> {
        let tags = self
            .memory
            .to_resume(tags)
            .map_err(EngineError::MemoryState)?;
        let mut report = MemoryReport {
            tags: Vec::new(),
            bytes: 0,
            state: self.memory,
        };
        let result = self.resume_each(&tags, &mut report);
        self.finish_memory(result, report, "resumed")
    }

    fn resume_each(&mut self, tags: &[MemoryTag], r: &mut MemoryReport) -> Result<(), EngineError> {
        if tags.contains(&MemoryTag::CudaGraph) {
            r.tags.push(MemoryTag::CudaGraph);
        }
        if tags.contains(&MemoryTag::Weights) {
            let WeightsState::Released { backup } = r.state.weights else {
                unreachable!("checked by to_resume");
            };
            r.bytes += self.exec.resume_weights()?;
            r.state.weights = if backup {
                WeightsState::Resident
            } else {
                WeightsState::Absent
            };
            r.tags.push(MemoryTag::Weights);
        }
        if tags.contains(&MemoryTag::KvCache) {
            r.bytes += self.exec.resume_kv()?;
            r.state.kv_released = false;
            r.tags.push(MemoryTag::KvCache);
        }
        Ok(())
    }

    /// Publishes what a release or resume did, also when it failed part-way (the error then
    /// says what was done before it).
    fn finish_memory(
        &mut self,
        result: Result<(), EngineError>,
        report: MemoryReport,
        verb: &str,
    ) -> Result<MemoryReport, EngineError> {
        self.set_memory(report.state);
        self.publish();
        match result {
            Ok(()) => {
                tracing::info!("{verb} {} ({} bytes)", names(&report.tags), report.bytes);
                Ok(report)
            }
            Err(e) => Err(partly(e, verb, &report.tags)),
        }
    }

    /// With `abort_all`, aborts every request (after new weights are in place).
    fn abort_all_for_update(&mut self, abort_all: bool) -> usize {
        if !abort_all {
            return 0;
        }
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for &id in &ids {
            self.abort(id, "aborted for a weight update");
        }
        ids.len()
    }

    /// After new weights are in place: cached prefix blocks hold KV of the old weights, so
    /// nobody may reuse them, and tokens from now on report the new version.
    /// A commit (see [`super::EngineHandle::apply_weights`]): how long generation stood still,
    /// and what is left to free.
    fn apply_weights(
        &mut self,
        commit: super::WeightCommit,
    ) -> Result<(std::time::Duration, Vec<crate::model::slots::Replacement>), EngineError> {
        let started = Instant::now();
        let super::WeightCommit {
            updates,
            mut more,
            checksum,
            version,
        } = commit;
        let slots = self.info.slots();
        let writes = updates
            .iter()
            .filter(|(n, _)| slots.contains_key(n))
            .count();
        self.check_update(writes + more.as_ref().map_or(0, |m| m.writes))?;
        let mut undo = more.as_mut().and_then(|m| m.undo.take());
        // Groups follow: what `updates` overwrite is kept first (nothing is written yet).
        if let Some(log) = undo.as_mut() {
            self.keep_for_undo(log.as_mut(), &updates)?;
        }
        let spent = self.exec.apply(updates)?;
        // The groups' time by phase: waiting for the next group, writing it, freeing it.
        let (mut taking, mut freeing) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
        if let Some(mut more) = more {
            let mut wrote = !spent.is_empty();
            let mut group = 0;
            loop {
                let asked = Instant::now();
                let Some(next) = (more.next)() else { break };
                taking += asked.elapsed();
                let written = match (next, undo.as_mut()) {
                    (Err(e), _) => Err(EngineError::Failed(e)),
                    (Ok(updates), Some(log)) => self
                        .keep_for_undo(log.as_mut(), &updates)
                        .and_then(|()| self.exec.apply(updates)),
                    (Ok(updates), None) => self.exec.apply(updates),
                };
                match written {
                    // Freed at once: only one group's copy is held at a time.
                    Ok(done) => {
                        wrote |= !done.is_empty();
                        let freed = Instant::now();
                        drop(done);
                        freeing += freed.elapsed();
                    }
                    Err(e) if !wrote => return Err(e),
                    Err(e) => {
                        let why = format!("group {group} of the update could not be written ({e})");
                        return Err(self.roll_back(undo, &why));
                    }
                }
                group += 1;
            }
        }
        let written = started.elapsed();
        self.begin_weight_version(version, checksum);
        let pause = started.elapsed();
        tracing::info!(
            "weights committed: {writes} tensors written in {:.1} ms (of which taking groups {:.1} ms, freeing them {:.1} ms), the version moved in {:.1} ms",
            written.as_secs_f64() * 1e3,
            taking.as_secs_f64() * 1e3,
            freeing.as_secs_f64() * 1e3,
            (pause - written).as_secs_f64() * 1e3
        );
        Ok((pause, spent))
    }

    /// Keeps the served contents of the slots `updates` are about to overwrite in `log`.
    fn keep_for_undo(
        &mut self,
        log: &mut dyn super::UndoLog,
        updates: &[(String, crate::model::slots::Replacement)],
    ) -> Result<(), EngineError> {
        let names: Vec<String> = updates.iter().map(|(n, _)| n.clone()).collect();
        let parts = self.exec.parts_of(&names)?;
        log.keep(parts)
            .map_err(|e| EngineError::Failed(format!("keeping what the update overwrites: {e}")))
    }

    /// After a commit in groups wrote part of an update and cannot finish (`why`): what it
    /// overwrote is written back from its undo log, so the weights and version stay as they
    /// were. Without a log, or when writing back fails too, the weights are marked absent.
    fn roll_back(&mut self, undo: Option<Box<dyn super::UndoLog>>, why: &str) -> EngineError {
        let Some(log) = undo else {
            return self.weights_lost(why);
        };
        let mut replay = log.replay();
        while let Some(group) = (replay.next)() {
            let restored = group
                .map_err(EngineError::Failed)
                .and_then(|g| self.exec.apply(g));
            if let Err(e) = restored {
                return self.weights_lost(&format!("{why}, and rolling back failed ({e})"));
            }
        }
        EngineError::Failed(format!(
            "{why}; what it had written was rolled back: the weights and version are as before"
        ))
    }

    /// After a commit wrote part of an update and cannot finish: the weights are neither the old
    /// ones nor the new, so they are marked absent (generation is refused until an update writes
    /// every tensor) rather than served.
    fn weights_lost(&mut self, why: &str) -> EngineError {
        let memory = MemoryState {
            weights: WeightsState::Absent,
            ..self.memory
        };
        self.set_memory(memory);
        EngineError::Failed(format!(
            "{why}; the weights are marked absent: generation is refused until an update writes every tensor"
        ))
    }

    fn begin_weight_version(
        &mut self,
        version: String,
        checksum: Arc<crate::model::checksum::WeightsChecksum>,
    ) {
        let pool = self.sched.pool();
        pool.flush(pool.weight_version() + 1);
        if self.memory.weights == WeightsState::Absent {
            // Only a whole-model update gets here with absent weights (`check_update`).
            let memory = MemoryState {
                weights: WeightsState::Resident,
                ..self.memory
            };
            self.set_memory(memory);
        }
        *self.info.weights_checksum.write().expect("checksum lock") = (version.clone(), checksum);
        *self
            .info
            .weight_version
            .write()
            .expect("weight version lock") = version;
    }

    fn admit(&mut self, req: GenerateRequest, events: mpsc::UnboundedSender<EngineEvent>) {
        // Count it as waiting before it leaves the channel count, so admission control never
        // sees it in neither; the next publish() stores the exact number.
        self.shared.waiting.fetch_add(1, Ordering::AcqRel);
        self.shared.in_channel.fetch_sub(1, Ordering::AcqRel);
        if self.shutting_down {
            let _ = events.send(EngineEvent::Error(EngineError::Unavailable(
                "server shutting down".into(),
            )));
            return;
        }
        // A release may have been handled after the handler's own check.
        if let Some(why) = self.memory.unavailable() {
            let _ = events.send(EngineEvent::Error(EngineError::Unavailable(why)));
            return;
        }
        let decoder = match IncrementalDecoder::new(
            self.tokenizer.clone(),
            &req.input_ids,
            req.params.skip_special_tokens,
        ) {
            Ok(d) => d,
            Err(e) => {
                let _ = events.send(EngineEvent::Error(EngineError::Failed(format!(
                    "detokenizer: {e}"
                ))));
                return;
            }
        };
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let seq = SeqRequest {
            id,
            prompt: req.input_ids.clone(),
            max_new_tokens: req.params.max_new_tokens.max(1),
            use_prefix_cache: !req.needs_full_prefill(),
        };
        if let Err(e) = self.sched.add(seq) {
            let _ = events.send(EngineEvent::Error(EngineError::Failed(e.to_string())));
            return;
        }
        let input_lp_next = match (req.return_logprob, req.logprob_start_len) {
            (true, Some(l)) => l,
            _ => usize::MAX,
        };
        let active = Active {
            history: TokenHistory::new(&req.input_ids),
            stop: StopChecker::new(&req.params, &self.eos),
            decoder,
            output: Vec::new(),
            token_versions: Vec::new(),
            input_lp_next,
            input_logprobs: Vec::new(),
            routed: Vec::new(),
            cached_tokens: None,
            arrived: Instant::now(),
            queue_time: None,
            finish: None,
            req,
            events,
        };
        if active.req.params.max_new_tokens == 0 {
            // Nothing to generate (e.g. a prompt-logprob-only request) still needs the prefill
            // when logprobs are asked for; otherwise finish at once.
            if !active.req.needs_full_prefill() {
                self.sched.abort(id);
                let mut active = active;
                active.finish = Some((Finish::Length { length: 0 }, 0));
                self.finalize(active, 0);
                return;
            }
        }
        self.seqs.insert(id, active);
    }

    fn abort(&mut self, id: SeqId, message: &str) {
        self.sched.abort(id);
        if let Some(mut a) = self.seqs.remove(&id) {
            let text_len = a.decoder.text().len();
            a.finish = Some((
                Finish::Abort {
                    message: message.into(),
                },
                text_len,
            ));
            self.finalize(a, 0);
        }
    }

    /// One engine step: plan (schedule, the batch and its sampling inputs) -> execute ->
    /// output processing (routed experts, input logprobs, the sampled token and its stop
    /// check, per sequence) -> finish (the scheduler's update, finished requests answered).
    fn step(&mut self) -> Result<(), EngineError> {
        self.drop_disconnected();
        let started = Instant::now();
        let out = self.sched.schedule();
        if out.seqs.is_empty() {
            return Ok(());
        }
        let logits_from: Vec<Option<usize>> = out
            .seqs
            .iter()
            .map(|s| {
                self.seqs
                    .get(&s.id)
                    .and_then(|a| logits_rows(a, s.start_pos, s.tokens.len(), s.sample))
            })
            .collect();
        let scheduled = Instant::now();
        let step = self.execute(&out, &logits_from)?;
        let executed = Instant::now();
        let results = self.process_outputs(&out, &logits_from, step);
        let processed = Instant::now();
        self.finish(&results);
        // Where a step's time goes: the forward pass (with sampling) against the host work
        // around it, which a faster device does not shorten (docs/api.md, Metrics).
        let phases = [
            ("schedule", scheduled - started),
            ("forward", executed - scheduled),
            ("outputs", processed - executed),
            ("finish", processed.elapsed()),
        ];
        for (phase, took) in phases {
            metrics::histogram!(STEP_SECONDS, "phase" => phase).record(took.as_secs_f64());
        }
        let tokens: usize = out.seqs.iter().map(|s| s.tokens.len()).sum();
        metrics::histogram!(STEP_TOKENS).record(tokens as f64);
        if tokens == out.seqs.len() {
            metrics::histogram!(DECODE_STEP_SECONDS).record((executed - scheduled).as_secs_f64());
        }
        Ok(())
    }

    /// A client that went away mid-prefill frees its KV before we spend a step on it.
    fn drop_disconnected(&mut self) {
        let gone: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, a)| a.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.abort(id, "client disconnected");
        }
    }

    /// The forward pass over the scheduled chunks, sampling every sequence that takes its next
    /// token this step (on whichever device holds the logits).
    fn execute(
        &mut self,
        out: &SchedulerOutput,
        logits_from: &[Option<usize>],
    ) -> Result<StepOutput, EngineError> {
        let batch = ForwardBatch {
            seqs: out
                .seqs
                .iter()
                .zip(logits_from)
                .map(|(s, &from)| SeqInput {
                    tokens: &s.tokens,
                    start_pos: s.start_pos,
                    block_table: &s.block_table,
                    logits_from: from,
                })
                .collect(),
        };
        let samples: Vec<Option<SampleInput<'_>>> = out
            .seqs
            .iter()
            .map(|s| {
                let a = self
                    .seqs
                    .get(&s.id)
                    .filter(|a| s.sample && a.finish.is_none())?;
                Some(SampleInput {
                    params: &a.req.params,
                    history: &a.history,
                    eos_token_ids: &self.eos,
                    seed: a.req.seed,
                    sample_index: a.req.sample_index,
                    top_logprobs_num: a.req.top_logprobs_num,
                    logprob: a.req.return_logprob,
                })
            })
            .collect();
        self.exec.step(&batch, &samples)
    }

    /// Turns the step's output into each sequence's events and its scheduler result.
    fn process_outputs(
        &mut self,
        out: &SchedulerOutput,
        logits_from: &[Option<usize>],
        step: StepOutput,
    ) -> Vec<StepResult> {
        let (fwd, mut sampled) = (step.forward, step.sampled);
        let per_token = self.num_moe_layers() * self.top_k();
        let vocab = self.exec.config().vocab_size;
        let version = self
            .info
            .weight_version
            .read()
            .expect("weight version lock")
            .clone();
        let mut results = Vec::with_capacity(out.seqs.len());
        let mut token_row = 0;
        for (i, s) in out.seqs.iter().enumerate() {
            let n = s.tokens.len();
            let rows = token_row..token_row + n;
            token_row += n;
            let Some(a) = self.seqs.get_mut(&s.id) else {
                continue;
            };
            if a.cached_tokens.is_none() {
                a.cached_tokens = Some(s.cached_tokens);
                a.queue_time = Some(a.arrived.elapsed().as_secs_f64());
            }
            if a.req.return_routed_experts && per_token > 0 {
                for (j, r) in rows.enumerate() {
                    let pos = s.start_pos + j;
                    if a.routed.len() <= pos {
                        a.routed.resize(pos + 1, Vec::new());
                    }
                    a.routed[pos] = fwd.routed_experts[r * per_token..][..per_token].to_vec();
                }
            }
            let (first_row, num_rows) = fwd.logit_rows[i];
            let from = logits_from[i].unwrap_or(n);
            let logits = &fwd.logits[first_row * vocab..(first_row + num_rows) * vocab];
            record_input_logprobs(a, s.start_pos + from, logits, vocab);
            let mut result = StepResult {
                id: s.id,
                token: None,
                finished: false,
            };
            if let Some(sample) = sampled[i].take() {
                take_token(a, sample, &version, &self.shared, &mut result);
            } else if s.sample && a.req.params.max_new_tokens == 0 {
                // Prompt-only request: the prefill is done.
                a.finish = Some((Finish::Length { length: 0 }, 0));
                result.finished = true;
            }
            results.push(result);
        }
        results
    }

    /// The scheduler learns the step's tokens; requests that finished are answered.
    fn finish(&mut self, results: &[StepResult]) {
        let per_token = self.num_moe_layers() * self.top_k();
        for f in self.sched.update_from_output(results) {
            if let Some(mut a) = self.seqs.remove(&f.id) {
                if a.finish.is_none() {
                    let text_len = a.decoder.text().len();
                    a.finish = Some(match f.reason {
                        FinishReason::MaxContext | FinishReason::MaxNewTokens => (
                            Finish::Length {
                                length: a.output.len(),
                            },
                            text_len,
                        ),
                        _ => (
                            Finish::Abort {
                                message: format!("{:?}", f.reason),
                            },
                            text_len,
                        ),
                    });
                }
                self.finalize(a, per_token);
            }
        }
    }

    fn finalize(&mut self, mut a: Active, per_token: usize) {
        let (reason, text_len) = a.finish.take().unwrap_or((
            Finish::Abort {
                message: "unknown".into(),
            },
            0,
        ));
        let _ = a.decoder.finish();
        let full = a.decoder.text();
        // Only a stop trims; otherwise the decoder's flush may have added held-back bytes.
        let text = match reason {
            Finish::Stop { .. } => full[..text_len.min(full.len())].to_string(),
            _ => full.to_string(),
        };
        let routed_experts = (a.req.return_routed_experts && per_token > 0).then(|| {
            let total = (a.req.input_ids.len() + a.output.len()).saturating_sub(1);
            let mut flat = Vec::with_capacity(total * per_token);
            for pos in 0..total {
                match a.routed.get(pos) {
                    Some(r) if r.len() == per_token => flat.extend_from_slice(r),
                    _ => flat.extend(std::iter::repeat_n(-1, per_token)),
                }
            }
            flat
        });
        let info = FinishInfo {
            reason,
            text,
            prompt_tokens: a.req.input_ids.len(),
            cached_tokens: a.cached_tokens.unwrap_or(0),
            input_logprobs: (a.req.return_logprob && a.req.logprob_start_len.is_some())
                .then(|| std::mem::take(&mut a.input_logprobs)),
            routed_experts,
            moe_layers: self.num_moe_layers(),
            top_k: self.top_k(),
            weight_versions: std::mem::take(&mut a.token_versions),
            queue_time: a.queue_time.unwrap_or(0.0),
            output_ids: std::mem::take(&mut a.output),
        };
        let _ = a.events.send(EngineEvent::Finished(Box::new(info)));
    }
}

fn names(tags: &[MemoryTag]) -> String {
    if tags.is_empty() {
        return "nothing".into();
    }
    tags.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
}

/// A release or resume that failed after acting on `done`: the error says what did happen.
fn partly(e: EngineError, verb: &str, done: &[MemoryTag]) -> EngineError {
    let done: Vec<MemoryTag> = done
        .iter()
        .copied()
        .filter(|t| *t != MemoryTag::CudaGraph)
        .collect();
    if done.is_empty() {
        return e;
    }
    let msg = format!("{} {verb}; then: {e}", names(&done));
    match e {
        EngineError::Unavailable(_) => EngineError::Unavailable(msg),
        EngineError::MemoryState(_) => EngineError::MemoryState(msg),
        _ => EngineError::Stopped(msg),
    }
}

/// Input logprobs from a chunk's logits rows (the first at position `first_pos`): the logits
/// at position p score prompt token p + 1.
fn record_input_logprobs(a: &mut Active, first_pos: usize, logits: &[f32], vocab: usize) {
    let prompt_len = a.req.input_ids.len();
    for (k, row) in logits.chunks(vocab).enumerate() {
        let next = first_pos + k + 1;
        if a.input_lp_next <= next && next < prompt_len && a.input_lp_next != usize::MAX {
            if a.input_logprobs.is_empty() && a.input_lp_next == 0 {
                a.input_logprobs.push(InputLogprob {
                    token: a.req.input_ids[0],
                    logprob: None,
                    top: vec![],
                });
            }
            if let Ok(lp) =
                sampling::prompt_logprobs(row, a.req.input_ids[next], a.req.top_logprobs_num)
            {
                a.input_logprobs.push(InputLogprob {
                    token: lp.token,
                    logprob: Some(lp.logprob),
                    top: lp.top,
                });
            }
            a.input_lp_next = next + 1;
        }
    }
}

/// A sampled token joins its sequence: history, detokenized text, the token event, the stop
/// check.
fn take_token(
    a: &mut Active,
    sample: Result<sampling::TokenLogprobs, sampling::SamplingError>,
    version: &str,
    shared: &EngineShared,
    result: &mut StepResult,
) {
    let t = match sample {
        Ok(t) => t,
        Err(e) => {
            a.finish = Some((
                Finish::Abort {
                    message: format!("sampling failed: {e}"),
                },
                0,
            ));
            result.finished = true;
            return;
        }
    };
    a.history.push(t.token);
    a.output.push(t.token);
    extend_spans(&mut a.token_versions, version, a.output.len() - 1);
    let before = a.decoder.text().len();
    let text = match a.decoder.push(t.token) {
        Ok(_) => a.decoder.text()[before..].to_string(),
        Err(_) => String::new(),
    };
    let status = a.stop.check(t.token, a.decoder.text());
    let event = TokenOut {
        id: t.token,
        text,
        logprob: a.req.return_logprob.then_some(t.logprob),
        top_logprobs: t.top,
        weight_version: version.to_string(),
    };
    shared.generated_tokens.fetch_add(1, Ordering::Relaxed);
    let alive = a.events.send(EngineEvent::Token(event)).is_ok();
    result.token = Some(t.token);
    if let StopStatus::Finished { finish, text_len } = status {
        a.finish = Some((finish, text_len));
        result.finished = true;
    } else if !alive {
        // The client went away: stop computing for it, free its KV now.
        a.finish = Some((
            Finish::Abort {
                message: "client disconnected".into(),
            },
            0,
        ));
        result.finished = true;
    }
}

/// The first chunk row whose logits this step needs, if any.
fn logits_rows(a: &Active, start: usize, len: usize, sample: bool) -> Option<usize> {
    let mut from = if sample { Some(len - 1) } else { None };
    if a.input_lp_next != usize::MAX {
        // Position p scores token p + 1, so prompt token j needs row j - 1.
        let prompt_len = a.req.input_ids.len();
        let first_pos = a.input_lp_next.max(1) - 1;
        if first_pos + 1 < prompt_len && first_pos < start + len {
            let row = first_pos.saturating_sub(start);
            from = Some(from.map_or(row, |f: usize| f.min(row)));
        }
    }
    from
}

/// Output position `at` was computed by weights `version`: the last run grows, or a new one
/// starts.
fn extend_spans(spans: &mut Vec<VersionSpan>, version: &str, at: usize) {
    match spans.last_mut() {
        Some(s) if s.version == version => s.end = at + 1,
        _ => spans.push(VersionSpan {
            version: version.to_string(),
            start: at,
            end: at + 1,
        }),
    }
}
