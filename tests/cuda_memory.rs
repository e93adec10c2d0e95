//! `/release_memory_occupation` on a GPU, through the engine handle the endpoints call: the
//! released KV cache and weights go back to the driver (the device's free memory grows by what
//! was released, and another allocator, as a colocated trainer's would, can take at least 90%
//! of it while this engine holds almost nothing else), and what a resume brings back computes
//! the same bits as before: the weights from their host backup (`--enable-weights-cpu-backup`),
//! or, without one, from an update that writes every tensor (resumed weights are absent and
//! refused until then; a partial update is refused). Without room for a second copy of the
//! weights, updates are written in place.
//!
//! These need an NVIDIA GPU, so they are `#[ignore]`d here and run on the GPU host
//! (scripts/gpu-check.sh).

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use lockstep::engine::{CudaSource, EngineError, MemoryTag, WeightCommit, WeightsState};
use lockstep::model::loader::load_model;
use lockstep::model::ModelConfig;
use lockstep::quant::Recipe;

mod common;
use common::cuda::{seed, Rng};
use common::engine::{block_on, generate, greedy, prompts, start};

const GIB: f64 = (1u64 << 30) as f64;

/// Device allocations made outside the engine with the driver's own allocator (`cuMemAlloc`,
/// what PyTorch's caching allocator uses), freed on drop.
struct Foreign {
    ctx: Arc<CudaContext>,
    ptrs: Vec<cudarc::driver::sys::CUdeviceptr>,
    bytes: usize,
}

impl Foreign {
    fn new(ctx: &Arc<CudaContext>) -> Foreign {
        Foreign {
            ctx: ctx.clone(),
            ptrs: Vec::new(),
            bytes: 0,
        }
    }

    /// Allocates `bytes` (in chunks of at most 1 GiB) and writes every byte.
    fn take(&mut self, bytes: usize) -> Result<(), cudarc::driver::DriverError> {
        self.ctx.bind_to_thread()?;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(1 << 30);
            // SAFETY: the context is bound; the pointer is freed in drop, written only here.
            unsafe {
                let p = cudarc::driver::result::malloc_sync(n)?;
                self.ptrs.push(p);
                cudarc::driver::result::memset_d8_sync(p, 0xA5, n)?;
            }
            self.bytes += n;
            left -= n;
        }
        Ok(())
    }
}

impl Drop for Foreign {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for p in self.ptrs.drain(..) {
            // SAFETY: allocated by `take`, freed once.
            let _ = unsafe { cudarc::driver::result::free_sync(p) };
        }
    }
}

fn free_memory(ctx: &Arc<CudaContext>) -> usize {
    ctx.mem_get_info().unwrap().0
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn released_memory_goes_to_another_allocator_and_the_backup_restores_the_same_bits() {
    let mut rng = Rng(seed());
    let mut raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string("configs/qwen3-30b-a3b.json").unwrap())
            .unwrap();
    raw["num_hidden_layers"] = 4.into();
    let config = ModelConfig::from_json(raw).unwrap();
    let recipe = Recipe::builtin("bf16").unwrap();
    let weights = CudaSource::Dummy {
        config: config.clone(),
        recipe: recipe.clone(),
        seed: 3,
    };
    let h = start(weights, config.clone(), &recipe, true);
    assert!(h.memory().weights_backup);
    let prompts = prompts(&mut rng, config.vocab_size);
    let before = generate(&h, &prompts, "before");

    // Leave the engine little room beside what it holds, so the allocation below can only
    // come from what the release gives back.
    let ctx = CudaContext::new(0).unwrap();
    let mut squeeze = Foreign::new(&ctx);
    let spare = 1usize << 30;
    squeeze
        .take(free_memory(&ctx).saturating_sub(spare))
        .unwrap();
    let free_before = free_memory(&ctx);
    println!(
        "squeezed {:.2} GiB; free {:.2} GiB",
        squeeze.bytes as f64 / GIB,
        free_before as f64 / GIB
    );

    let r = block_on(h.release_memory(None)).unwrap();
    assert_eq!(r.state.released(), vec!["kv_cache", "weights"]);
    assert_eq!(r.state.weights, WeightsState::Released { backup: true });
    // Weights (~6 GiB at this shape in BF16) and the 65536-token KV cache (0.5 GiB).
    assert!(r.bytes > 4 << 30, "released {} bytes", r.bytes);
    let free_after = free_memory(&ctx);
    println!(
        "released {:.2} GiB; free {:.2} -> {:.2} GiB",
        r.bytes as f64 / GIB,
        free_before as f64 / GIB,
        free_after as f64 / GIB
    );
    let wanted = r.bytes / 10 * 9;
    assert!(
        free_after >= free_before + wanted,
        "the driver got back {} of {} released bytes",
        free_after.saturating_sub(free_before),
        r.bytes
    );
    assert!(
        matches!(
            h.submit(greedy("r".into(), vec![1, 2])),
            Err(EngineError::Unavailable(_))
        ),
        "no generation while released"
    );
    let mut trainer = Foreign::new(&ctx);
    trainer.take(wanted).expect("90% of the released bytes");
    assert!(
        trainer.bytes > spare,
        "more than was free before the release"
    );
    drop(trainer);
    drop(squeeze);

    let r = block_on(h.resume_memory(None)).unwrap();
    assert_eq!(r.state.released(), Vec::<&str>::new());
    assert_eq!(r.state.weights, WeightsState::Resident);
    assert_eq!(generate(&h, &prompts, "after"), before, "bit for bit");
    h.shutdown();
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn weights_resumed_without_a_backup_are_absent_until_an_update_writes_every_tensor() {
    let mut rng = Rng(seed());
    let dir = Path::new("tests/data/reference/qwen3_moe");
    let host = || load_model(dir, None, None).unwrap().0;
    let (served, recipe) = load_model(dir, None, None).unwrap();
    let config = served.config.clone();
    let h = start(CudaSource::Model(served), config.clone(), &recipe, false);
    assert!(!h.memory().weights_backup);
    let prompts = prompts(&mut rng, config.vocab_size);
    let before = generate(&h, &prompts, "before");

    let r = block_on(h.release_memory(Some(vec![MemoryTag::Weights]))).unwrap();
    assert_eq!(r.state.weights, WeightsState::Released { backup: false });
    assert!(r.bytes > 0);
    let r = block_on(h.resume_memory(Some(vec![MemoryTag::Weights]))).unwrap();
    assert_eq!(r.state.weights, WeightsState::Absent);
    assert!(matches!(
        h.submit(greedy("r".into(), vec![1, 2])),
        Err(EngineError::Unavailable(_))
    ));

    // The resumed buffers hold zeros; one tensor is not enough to serve them.
    let mut model = host();
    let checksum = Arc::new(model.weights_checksum());
    let one: Vec<_> = model.into_replacements().into_iter().take(1).collect();
    let partial = block_on(h.apply_weights(WeightCommit::of(one, checksum.clone(), "v1".into())));
    assert!(matches!(partial, Err(EngineError::MemoryState(_))));
    assert_eq!(h.memory().weights, WeightsState::Absent);

    // Every tensor, written into the resumed buffers: present, and the same bits as before.
    block_on(h.apply_weights(WeightCommit::of(
        host().into_replacements(),
        checksum.clone(),
        "v1".into(),
    )))
    .unwrap();
    assert_eq!(h.memory().weights, WeightsState::Resident);
    assert_eq!(generate(&h, &prompts, "after"), before, "bit for bit");
    h.shutdown();
}

/// A device without room for a second copy of the weights (the rest taken by another
/// allocator): a streamed update gets no shadow (`auto` writes in place; `on` is refused,
/// naming the flag to change), an update from disk gets no device loader (it is loaded on the
/// host and written in place), and that in-place update serves the new weights' bits.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn with_no_room_for_a_second_copy_updates_are_written_in_place() {
    use lockstep::model::loader::dummy_model;
    let mut rng = Rng(seed());
    let dir = Path::new("tests/data/reference/qwen3_moe");
    let (reference, recipe) = load_model(dir, None, None).unwrap();
    let config = reference.config.clone();
    // Served and new weights of one layout (the update writes each tensor over its like).
    let served = dummy_model(config.clone(), &recipe, 4).unwrap();
    let new = || dummy_model(config.clone(), &recipe, 5).unwrap();
    let prompts = prompts(&mut rng, config.vocab_size);
    let fresh = start(CudaSource::Model(new()), config.clone(), &recipe, false);
    let want = generate(&fresh, &prompts, "fresh");
    fresh.shutdown();

    let h = start(CudaSource::Model(served), config.clone(), &recipe, false);
    let before = generate(&h, &prompts, "before");
    assert_ne!(before, want, "the two weight sets differ");
    let ctx = CudaContext::new(0).unwrap();
    let mut squeeze = Foreign::new(&ctx);
    squeeze
        .take(free_memory(&ctx).saturating_sub(256 << 20))
        .unwrap();
    println!(
        "squeezed {:.2} GiB; free {:.2} GiB",
        squeeze.bytes as f64 / GIB,
        free_memory(&ctx) as f64 / GIB
    );

    assert!(matches!(block_on(h.shadow_weights(false)), Ok(None)));
    match block_on(h.shadow_weights(true)) {
        Err(EngineError::Conflict(m)) => assert!(m.contains("--mem-fraction-static"), "{m}"),
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("a shadow without room for it"),
    }
    assert!(block_on(h.device_loader()).unwrap().is_none());

    let mut model = new();
    let sum = Arc::new(model.weights_checksum());
    block_on(h.swap_model(model, sum.clone(), "v1".into(), false)).unwrap();
    assert_eq!(
        generate(&h, &prompts, "after"),
        want,
        "the new weights' bits"
    );
    assert!(*h.weights_checksum().1 == *sum);
    drop(squeeze);
    h.shutdown();
}

/// An in-place commit in groups (a spilled update read back layer by layer) on a GPU: it serves
/// exactly the new weights; one whose third group fails after two were written is rolled back
/// from its undo file (the served slots read back from the device before each group overwrote
/// them), so the old weights compute the same bits as before, under the old version and
/// checksum.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn an_in_place_commit_that_fails_midway_rolls_back_to_the_same_bits() {
    use lockstep::engine::MoreUpdates;
    use lockstep::model::loader::dummy_model;
    use lockstep::model::slots::Replacement;
    use lockstep::server::weights::SpillUndo;
    let mut rng = Rng(seed());
    let dir = Path::new("tests/data/reference/qwen3_moe");
    let (reference, recipe) = load_model(dir, None, None).unwrap();
    let config = reference.config.clone();
    let served = || dummy_model(config.clone(), &recipe, 4).unwrap();
    let new = || dummy_model(config.clone(), &recipe, 5).unwrap();
    let prompts = prompts(&mut rng, config.vocab_size);
    let fresh = start(CudaSource::Model(new()), config.clone(), &recipe, false);
    let want = generate(&fresh, &prompts, "fresh");
    fresh.shutdown();

    let h = start(CudaSource::Model(served()), config.clone(), &recipe, false);
    let before = generate(&h, &prompts, "before");
    assert_ne!(before, want, "the two weight sets differ");
    let (version, served_sum) = (h.weight_version(), h.weights_checksum().1);
    type Groups = Vec<Result<Vec<(String, Replacement)>, String>>;
    // A few slots in hand, the rest in groups of seven.
    let split = |mut all: Vec<(String, Replacement)>| -> (Vec<(String, Replacement)>, Groups) {
        let mut rest = all.split_off(3);
        let mut groups = Vec::new();
        while !rest.is_empty() {
            let tail = rest.split_off(rest.len().min(7));
            groups.push(Ok(std::mem::replace(&mut rest, tail)));
        }
        (all, groups)
    };
    let commit = |head, groups: Groups, sum, undo| {
        let writes = groups.iter().map(|g| g.as_ref().map_or(1, Vec::len)).sum();
        let mut groups = groups.into_iter();
        WeightCommit {
            more: Some(MoreUpdates {
                writes,
                next: Box::new(move || groups.next()),
                undo,
            }),
            ..WeightCommit::of(head, sum, "v1".into())
        }
    };

    let mut model = new();
    let sum = Arc::new(model.weights_checksum());
    let (head, mut groups) = split(model.into_replacements());
    assert!(groups.len() > 3);
    groups.truncate(2);
    groups.push(Err("the spill file is gone".into()));
    let undo_dir = tempfile::tempdir().unwrap();
    let undo = SpillUndo::create(undo_dir.path(), h.info.clone()).unwrap();
    let e = block_on(h.apply_weights(commit(head, groups, sum.clone(), Some(Box::new(undo)))))
        .err()
        .expect("the third group fails");
    assert!(e.to_string().contains("rolled back"), "{e}");
    assert_eq!(h.memory().weights, WeightsState::Resident);
    assert_eq!(h.weight_version(), version);
    assert!(*h.weights_checksum().1 == *served_sum);
    assert_eq!(
        generate(&h, &prompts, "rolled"),
        before,
        "bitwise the weights before the commit"
    );

    let (head, groups) = split(new().into_replacements());
    block_on(h.apply_weights(commit(head, groups, sum.clone(), None))).unwrap();
    assert_eq!(h.weight_version(), "v1");
    assert!(*h.weights_checksum().1 == *sum);
    assert_eq!(
        generate(&h, &prompts, "after"),
        want,
        "the new weights' bits"
    );
    h.shutdown();
}
