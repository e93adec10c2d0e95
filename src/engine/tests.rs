//! The engine's memory release and resume on the embedded model, with the CPU executor and
//! with a stand-in for a device without a weights backup (whose resumed weights hold other
//! values until an update writes them all): what is refused in each state, and that what comes
//! back computes the same bits as before.

use std::sync::Arc;

use super::executor::{CpuExecutor, Executor, ReleasedWeights, ShadowCopy, StepOutput};
use super::*;
use crate::backend::cpu::attention::KvDtype;
use crate::model::{loader, ForwardBatch};
use crate::quant::Recipe;
use crate::sampling::{SampleInput, SamplingParams};

fn embedded(seed: u64) -> Model {
    let cfg = ModelConfig::from_json(serde_json::from_str(crate::serve::EMBEDDED_CONFIG).unwrap())
        .unwrap();
    loader::dummy_model(cfg, &Recipe::bf16(), seed).unwrap()
}

fn info(model: &mut Model) -> EngineInfo {
    EngineInfo::for_test(model, Recipe::bf16(), false)
}

fn config() -> EngineConfig {
    EngineConfig {
        max_running_requests: 4,
        max_batch_tokens: 64,
        max_total_tokens: 1024,
        block_size: 16,
        max_context_len: 256,
        max_queued_requests: 16,
        kv_dtype: KvDtype::Bf16,
        schedule_conservativeness: 1.0,
    }
}

/// A device without a weights backup: releasing keeps nothing, and the resumed weights hold
/// other values (`garbage`) until an update writes them.
struct NoBackup {
    cpu: CpuExecutor,
    garbage: Option<Model>,
}

impl Executor for NoBackup {
    fn config(&self) -> &ModelConfig {
        self.cpu.config()
    }
    fn num_kv_blocks(&self) -> usize {
        self.cpu.num_kv_blocks()
    }
    fn step(
        &mut self,
        batch: &ForwardBatch<'_>,
        samples: &[Option<SampleInput<'_>>],
    ) -> Result<StepOutput, EngineError> {
        self.cpu.step(batch, samples)
    }
    fn swap(&mut self, new: Model) -> Result<(), EngineError> {
        self.cpu.swap(new)
    }
    fn apply(
        &mut self,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, EngineError> {
        self.cpu.apply(updates)
    }
    fn parts_of(
        &mut self,
        names: &[String],
    ) -> Result<crate::model::store::SlotParts, EngineError> {
        self.cpu.parts_of(names)
    }
    fn shadow(&mut self, required: bool) -> Result<Option<ShadowCopy>, EngineError> {
        self.cpu.shadow(required)
    }
    fn install_shadow(&mut self, copy: ShadowCopy) -> Result<ShadowCopy, EngineError> {
        self.cpu.install_shadow(copy)
    }
    fn keeps_weights_backup(&self) -> bool {
        false
    }
    fn release_kv(&mut self) -> Result<usize, EngineError> {
        self.cpu.release_kv()
    }
    fn resume_kv(&mut self) -> Result<usize, EngineError> {
        self.cpu.resume_kv()
    }
    fn release_weights(&mut self, _keep: bool) -> Result<ReleasedWeights, EngineError> {
        Ok(ReleasedWeights {
            bytes: 0,
            backup: false,
        })
    }
    fn resume_weights(&mut self) -> Result<usize, EngineError> {
        let garbage = self.garbage.take().expect("resumed once");
        self.cpu.swap(garbage)?;
        Ok(0)
    }
}

fn greedy(rid: &str) -> GenerateRequest {
    let params = SamplingParams {
        max_new_tokens: Some(6),
        temperature: 0.0,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    GenerateRequest {
        rid: rid.into(),
        input_ids: vec![5, 17, 3, 42, 9],
        params: params.validate(&Default::default()).unwrap(),
        seed: 0,
        sample_index: 0,
        return_logprob: true,
        logprob_start_len: None,
        top_logprobs_num: 2,
        return_routed_experts: false,
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// One token as bits: id, logprob, top (id, logprob).
type TokenBits = (u32, u32, Vec<(u32, u32)>);

/// The tokens of a greedy run.
fn run(h: &EngineHandle, rid: &str) -> Vec<TokenBits> {
    let mut rx = h.submit(greedy(rid)).expect("submitted");
    let mut out = Vec::new();
    rt().block_on(async {
        loop {
            match rx.recv().await.expect("an event") {
                EngineEvent::Token(t) => out.push((
                    t.id,
                    t.logprob.unwrap().to_bits(),
                    t.top_logprobs
                        .iter()
                        .map(|(i, l)| (*i, l.to_bits()))
                        .collect(),
                )),
                EngineEvent::Finished(_) => break,
                EngineEvent::Error(e) => panic!("{e}"),
            }
        }
    });
    assert_eq!(out.len(), 6);
    out
}

#[test]
fn weights_resumed_without_a_backup_serve_nothing_until_an_update_writes_every_tensor() {
    let mut model = embedded(0);
    let info = info(&mut model);
    let cfg = config();
    let h = Engine::start_on(
        move |cfg| {
            Ok(Box::new(NoBackup {
                cpu: CpuExecutor::new(model, cfg),
                garbage: Some(embedded(99)),
            }) as Box<dyn Executor>)
        },
        info,
        cfg,
    )
    .unwrap();
    assert!(!h.memory().weights_backup);
    let before = run(&h, "a");
    let rt = rt();

    let r = rt
        .block_on(h.release_memory(Some(vec![MemoryTag::Weights])))
        .unwrap();
    assert_eq!(r.state.weights, WeightsState::Released { backup: false });
    // No memory to write into: updates wait for a resume.
    let one = || {
        embedded(0)
            .into_replacements()
            .into_iter()
            .take(1)
            .collect::<Vec<_>>()
    };
    let e = rt
        .block_on(h.apply_weights(WeightCommit::of(one(), Default::default(), "v1".into())))
        .err()
        .expect("refused");
    assert!(
        matches!(&e, EngineError::MemoryState(m) if m.contains("resume_memory_occupation")),
        "{e}"
    );

    let r = rt
        .block_on(h.resume_memory(Some(vec![MemoryTag::Weights])))
        .unwrap();
    assert_eq!(r.state.weights, WeightsState::Absent);
    let e = h.submit(greedy("b")).unwrap_err();
    assert!(
        matches!(&e, EngineError::Unavailable(m) if m.contains("absent")),
        "{e}"
    );
    let e = rt
        .block_on(h.resume_memory(Some(vec![MemoryTag::Weights])))
        .unwrap_err();
    assert!(matches!(e, EngineError::MemoryState(_)), "{e}");

    // A partial update would serve the rest absent.
    let slots = h.info.slots().len();
    let e = rt
        .block_on(h.apply_weights(WeightCommit::of(one(), Default::default(), "v1".into())))
        .err()
        .expect("refused");
    assert!(
        matches!(&e, EngineError::MemoryState(m) if m.contains(&format!("1 of the {slots}"))),
        "{e}"
    );
    assert_eq!(h.memory().weights, WeightsState::Absent);
    assert_eq!(h.weight_version(), "v0", "nothing changed");

    // Every tensor (the weights from before): present again, the same bits as before.
    let mut original = embedded(0);
    let sum = Arc::new(original.weights_checksum());
    rt.block_on(h.apply_weights(WeightCommit::of(
        original.into_replacements(),
        sum,
        "v1".into(),
    )))
    .unwrap();
    assert_eq!(h.memory().weights, WeightsState::Resident);
    assert_eq!(h.weight_version(), "v1");
    assert_eq!(run(&h, "c"), before);
}

/// `updates` then `groups` as one commit: the groups are handed out one by one, as a spilled
/// update reads them back; `undo` keeps what they overwrite.
fn commit_in_groups(
    updates: Vec<(String, Replacement)>,
    groups: Vec<Result<Vec<(String, Replacement)>, String>>,
    checksum: Arc<crate::model::checksum::WeightsChecksum>,
    version: &str,
    undo: Option<Box<dyn UndoLog>>,
) -> WeightCommit {
    let writes = groups.iter().map(|g| g.as_ref().map_or(1, Vec::len)).sum();
    let mut groups = groups.into_iter();
    WeightCommit {
        more: Some(MoreUpdates {
            writes,
            next: Box::new(move || groups.next()),
            undo,
        }),
        ..WeightCommit::of(updates, checksum, version.into())
    }
}

/// A commit whose slots come group by group (an in-place update read back from its spill file)
/// serves exactly the new weights. A first group that fails before anything was written changes
/// nothing. A group that fails after others were written is rolled back from the undo log (the
/// served slots kept in a file before each group overwrote them): the old weights are served
/// bitwise, under the old version and checksum. Without a log such weights, neither old nor
/// new, are marked absent, not served, and the version stays.
#[test]
fn a_commit_in_groups_serves_the_new_weights_or_rolls_back() {
    let mut m = embedded(0);
    let h = Engine::start(embedded(0), info(&mut m), config()).unwrap();
    let rt = rt();
    let before = run(&h, "a");
    let mut new = embedded(7);
    let want = run(
        &Engine::start(embedded(7), info(&mut embedded(7)), config()).unwrap(),
        "a",
    );
    assert_ne!(before, want);
    let sum = Arc::new(new.weights_checksum());
    // A few slots in hand, the rest in groups of five.
    let groups_of = |model: Model| {
        let mut all = model.into_replacements();
        let mut rest = all.split_off(3);
        let mut groups = Vec::new();
        while !rest.is_empty() {
            let tail = rest.split_off(rest.len().min(5));
            groups.push(Ok(std::mem::replace(&mut rest, tail)));
        }
        (all, groups)
    };
    let (all, groups) = groups_of(new);
    assert!(groups.len() > 2);
    rt.block_on(h.apply_weights(commit_in_groups(all, groups, sum.clone(), "v1", None)))
        .unwrap();
    assert_eq!(h.weight_version(), "v1");
    assert_eq!(
        run(&h, "b"),
        want,
        "bitwise an engine started on the new weights"
    );
    assert_eq!(*h.weights_checksum().1, *sum);

    // Nothing written yet when the first group fails: nothing changes.
    let e = rt
        .block_on(h.apply_weights(commit_in_groups(
            vec![],
            vec![Err("the disk is gone".into())],
            sum.clone(),
            "v2",
            None,
        )))
        .err()
        .expect("refused");
    assert!(e.to_string().contains("the disk is gone"), "{e}");
    assert_eq!(h.weight_version(), "v1");
    assert_eq!(run(&h, "c"), want);

    // A group fails after two were written: rolled back from the undo log.
    let mut other = embedded(3);
    let other_sum = Arc::new(other.weights_checksum());
    let (head, mut groups) = groups_of(other);
    groups.truncate(2);
    groups.push(Err("the disk is gone".into()));
    let dir = tempfile::tempdir().unwrap();
    let undo = crate::server::weights::SpillUndo::create(dir.path(), h.info.clone()).unwrap();
    let e = rt
        .block_on(h.apply_weights(commit_in_groups(
            head,
            groups,
            other_sum.clone(),
            "v2",
            Some(Box::new(undo)),
        )))
        .err()
        .expect("refused");
    assert!(e.to_string().contains("rolled back"), "{e}");
    assert_eq!(h.memory().weights, WeightsState::Resident);
    assert_eq!(h.weight_version(), "v1");
    assert_eq!(*h.weights_checksum().1, *sum);
    assert_eq!(run(&h, "d"), want, "bitwise the weights before the commit");

    // The same without a log: absent, and the version stays.
    let (head, mut groups) = groups_of(embedded(3));
    groups.truncate(1);
    groups.push(Err("the disk is gone".into()));
    let e = rt
        .block_on(h.apply_weights(commit_in_groups(head, groups, other_sum, "v2", None)))
        .err()
        .expect("refused");
    assert!(e.to_string().contains("marked absent"), "{e}");
    assert_eq!(h.memory().weights, WeightsState::Absent);
    assert_eq!(h.weight_version(), "v1");
    assert!(matches!(
        h.submit(greedy("e")).unwrap_err(),
        EngineError::Unavailable(_)
    ));
}

#[test]
fn release_needs_an_idle_engine_and_acts_once_per_tag() {
    let model = embedded(0);
    let mut m = embedded(0);
    let h = Engine::start(model, info(&mut m), config()).unwrap();
    assert!(
        h.memory().weights_backup,
        "the CPU's weights are host memory"
    );
    let before = run(&h, "a");
    let rt = rt();

    // A request held by a pause is in flight: the release names it and changes nothing.
    rt.block_on(h.pause(PauseMode::InPlace)).unwrap();
    let mut held = h.submit(greedy("held-1")).unwrap();
    let e = rt.block_on(h.release_memory(None)).unwrap_err();
    assert!(
        matches!(&e, EngineError::MemoryState(m) if m.contains("held-1")),
        "{e}"
    );
    assert_eq!(
        h.memory(),
        MemoryState {
            weights_backup: true,
            ..MemoryState::default()
        }
    );
    rt.block_on(h.continue_generation()).unwrap();
    rt.block_on(async {
        while let Some(ev) = held.recv().await {
            if matches!(ev, EngineEvent::Finished(_)) {
                return;
            }
            assert!(matches!(ev, EngineEvent::Token(_)), "{ev:?}");
        }
        panic!("no finish");
    });

    let r = rt.block_on(h.release_memory(None)).unwrap();
    assert_eq!(r.tags, MemoryTag::ALL.to_vec());
    assert!(r.bytes > 0, "the KV cache's bytes");
    assert_eq!(r.state.released(), vec!["kv_cache", "weights"]);
    let e = rt
        .block_on(h.release_memory(Some(vec![MemoryTag::KvCache])))
        .unwrap_err();
    assert!(
        matches!(&e, EngineError::MemoryState(m) if m.contains("already released")),
        "{e}"
    );
    let e = h.submit(greedy("b")).unwrap_err();
    assert!(
        matches!(&e, EngineError::Unavailable(m) if m.contains("resume_memory_occupation")),
        "{e}"
    );

    // One tag at a time, as verl and slime resume: weights, then the KV cache.
    let r = rt
        .block_on(h.resume_memory(Some(vec![MemoryTag::Weights])))
        .unwrap();
    assert_eq!(r.state.released(), vec!["kv_cache"]);
    assert!(h.submit(greedy("c")).is_err(), "still no KV cache");
    rt.block_on(h.resume_memory(Some(vec![MemoryTag::CudaGraph, MemoryTag::KvCache])))
        .unwrap();
    assert_eq!(h.memory().released(), Vec::<&str>::new());
    assert_eq!(run(&h, "d"), before);
}
