//! What `/release_memory_occupation` has released, as a pure state machine: which of SGLang's
//! memory tags a release or resume may act on, why generation or a weight update cannot run
//! in a given state, and the messages that say so (naming what is released and the endpoint to
//! call). The engine thread applies the transitions it allows; the executors free and
//! reallocate the memory.

use std::fmt::Write as _;

/// SGLang's memory tags (`sglang.srt.constants.GPU_MEMORY_TYPE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MemoryTag {
    /// The KV cache (and with it the prefix cache's contents).
    KvCache,
    /// The model's weights.
    Weights,
    /// SGLang's captured CUDA graphs. lockstep captures none, so this tag frees nothing and is
    /// never reported as released; it is accepted because slime and Miles send it.
    CudaGraph,
}

impl MemoryTag {
    /// Every tag (SGLang's `GPU_MEMORY_ALL_TYPES`), in the order a release acts on them.
    pub const ALL: [MemoryTag; 3] = [MemoryTag::KvCache, MemoryTag::Weights, MemoryTag::CudaGraph];

    pub fn name(self) -> &'static str {
        match self {
            MemoryTag::KvCache => "kv_cache",
            MemoryTag::Weights => "weights",
            MemoryTag::CudaGraph => "cuda_graph",
        }
    }

    pub fn parse(s: &str) -> Option<MemoryTag> {
        MemoryTag::ALL.into_iter().find(|t| t.name() == s)
    }
}

/// Where the weights stand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WeightsState {
    /// In place and serving.
    #[default]
    Resident,
    /// Their memory is freed. `backup`: resume restores their values (a host copy was kept, or
    /// they live on the host anyway); otherwise resume leaves them absent.
    Released { backup: bool },
    /// Memory reallocated without a backup (SGLang: "garbage until the next weight update"):
    /// no generation until an update writes every tensor.
    Absent,
}

impl WeightsState {
    pub fn name(self) -> &'static str {
        match self {
            WeightsState::Resident => "resident",
            WeightsState::Released { .. } => "released",
            WeightsState::Absent => "absent",
        }
    }
}

/// The engine's memory, as `/get_server_info` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MemoryState {
    pub kv_released: bool,
    pub weights: WeightsState,
    /// Releasing the weights keeps a host copy that resume restores (always on the CPU
    /// backend, whose weights are host memory; on CUDA, `--enable-weights-cpu-backup`).
    pub weights_backup: bool,
}

const RESUME: &str = "POST /resume_memory_occupation";

impl MemoryState {
    /// The tags released now (`memory_released` in `/get_server_info`), in SGLang's names.
    pub fn released(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.kv_released {
            out.push(MemoryTag::KvCache.name());
        }
        if matches!(self.weights, WeightsState::Released { .. }) {
            out.push(MemoryTag::Weights.name());
        }
        out
    }

    /// Why generation cannot run now (the 503's message), or None when it can.
    pub fn unavailable(&self) -> Option<String> {
        let released = self.released();
        let mut why = String::new();
        if !released.is_empty() {
            let tags = released
                .iter()
                .map(|t| format!("\"{t}\""))
                .collect::<Vec<_>>()
                .join(", ");
            let _ = write!(
                why,
                "memory is released ({}) by /release_memory_occupation; {RESUME} {{\"tags\": [{tags}]}} before generating",
                released.join(", ")
            );
        }
        if self.weights == WeightsState::Absent {
            if !why.is_empty() {
                why.push_str("; ");
            }
            why.push_str(&absent_message());
        }
        (!why.is_empty()).then_some(why)
    }

    /// The tags a release acts on: `tags` when each can be released now (all or none is
    /// acted on), or with no tags (SGLang's "every tag") whatever is not released yet.
    pub fn to_release(&self, tags: Option<&[MemoryTag]>) -> Result<Vec<MemoryTag>, String> {
        let released = |t: &MemoryTag| match t {
            MemoryTag::KvCache => self.kv_released,
            MemoryTag::Weights => matches!(self.weights, WeightsState::Released { .. }),
            MemoryTag::CudaGraph => false,
        };
        let Some(tags) = tags else {
            let todo: Vec<MemoryTag> = MemoryTag::ALL
                .into_iter()
                .filter(|t| !released(t))
                .collect();
            if todo == [MemoryTag::CudaGraph] {
                return Err(format!("everything is already released; {RESUME} first"));
            }
            return Ok(todo);
        };
        let already: Vec<&str> = tags
            .iter()
            .filter(|t| released(t))
            .map(|t| t.name())
            .collect();
        if already.is_empty() {
            Ok(tags.to_vec())
        } else {
            Err(format!(
                "{} already released; {RESUME} first",
                already.join(", ")
            ))
        }
    }

    /// The tags a resume acts on: `tags` when each is released now (all or none is acted
    /// on), or with no tags whatever is released.
    pub fn to_resume(&self, tags: Option<&[MemoryTag]>) -> Result<Vec<MemoryTag>, String> {
        let resident = |t: &MemoryTag| match t {
            MemoryTag::KvCache => !self.kv_released,
            MemoryTag::Weights => !matches!(self.weights, WeightsState::Released { .. }),
            MemoryTag::CudaGraph => false,
        };
        let absent = if self.weights == WeightsState::Absent {
            format!(
                " (the weights are allocated but absent: {})",
                absent_message()
            )
        } else {
            String::new()
        };
        let Some(tags) = tags else {
            let todo: Vec<MemoryTag> = MemoryTag::ALL
                .into_iter()
                .filter(|t| !resident(t))
                .collect();
            if todo == [MemoryTag::CudaGraph] {
                return Err(format!(
                    "nothing is released, so there is nothing to resume{absent}"
                ));
            }
            return Ok(todo);
        };
        let not_released: Vec<&str> = tags
            .iter()
            .filter(|t| resident(t))
            .map(|t| t.name())
            .collect();
        if not_released.is_empty() {
            Ok(tags.to_vec())
        } else {
            let absent = if tags.contains(&MemoryTag::Weights) {
                absent
            } else {
                String::new()
            };
            Err(format!(
                "{} not released, so there is nothing to resume{absent}",
                not_released.join(", ")
            ))
        }
    }

    /// Checks that a weight update may write now. `writes`/`of` count the slots the update
    /// writes and the model has (a partial update cannot make absent weights whole).
    pub fn check_update(&self, writes: usize, of: usize) -> Result<(), String> {
        match self.weights {
            WeightsState::Resident => Ok(()),
            WeightsState::Released { .. } => Err(format!(
                "the weights are released (/release_memory_occupation), so there is no memory to write them into; {RESUME} {{\"tags\": [\"weights\"]}} first, then update"
            )),
            WeightsState::Absent if writes >= of => Ok(()),
            WeightsState::Absent => Err(format!(
                "{}; this update writes {writes} of the {of} tensors, which would serve the rest absent",
                absent_message()
            )),
        }
    }
}

fn absent_message() -> String {
    "the weights are absent: they were resumed without a host backup (--enable-weights-cpu-backup is off), so they hold no values until an update writes every tensor (POST /update_weights_from_disk, or a streamed update that sends every tensor)".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_parse_by_sglang_names_only() {
        for t in MemoryTag::ALL {
            assert_eq!(MemoryTag::parse(t.name()), Some(t));
        }
        assert_eq!(MemoryTag::parse("kv"), None);
        assert_eq!(MemoryTag::parse("Weights"), None);
    }

    #[test]
    fn generation_is_refused_naming_what_is_released_and_the_endpoint() {
        let mut s = MemoryState::default();
        assert_eq!(s.unavailable(), None);
        s.kv_released = true;
        let why = s.unavailable().unwrap();
        assert!(why.contains("kv_cache") && why.contains(RESUME), "{why}");
        assert!(!why.contains("weights"), "{why}");
        s.weights = WeightsState::Released { backup: true };
        assert_eq!(s.released(), vec!["kv_cache", "weights"]);
        let why = s.unavailable().unwrap();
        assert!(why.contains("\"kv_cache\", \"weights\""), "{why}");
        s = MemoryState {
            weights: WeightsState::Absent,
            ..MemoryState::default()
        };
        assert!(s.released().is_empty(), "absent weights hold memory");
        let why = s.unavailable().unwrap();
        assert!(
            why.contains("absent") && why.contains("update_weights_from_disk"),
            "{why}"
        );
    }

    #[test]
    fn releasing_twice_and_resuming_what_is_resident_are_refused() {
        use MemoryTag::*;
        let mut s = MemoryState::default();
        assert_eq!(s.to_release(None), Ok(vec![KvCache, Weights, CudaGraph]));
        assert_eq!(s.to_release(Some(&[Weights])), Ok(vec![Weights]));
        let e = s.to_resume(Some(&[KvCache])).unwrap_err();
        assert!(e.contains("kv_cache not released"), "{e}");
        let e = s.to_resume(None).unwrap_err();
        assert!(e.contains("nothing is released"), "{e}");
        s.kv_released = true;
        let e = s.to_release(Some(&[Weights, KvCache])).unwrap_err();
        assert!(e.contains("kv_cache already released"), "{e}");
        // No tags: every tag not released yet.
        assert_eq!(s.to_release(None), Ok(vec![Weights, CudaGraph]));
        let e = s.to_resume(Some(&[KvCache, Weights])).unwrap_err();
        assert!(e.contains("weights not released"), "{e}");
        assert_eq!(s.to_resume(None), Ok(vec![KvCache, CudaGraph]));
        s.weights = WeightsState::Released { backup: true };
        let e = s.to_release(None).unwrap_err();
        assert!(e.contains("everything is already released"), "{e}");
        // No CUDA graphs: the tag alone is never a conflict.
        assert_eq!(s.to_resume(Some(&[CudaGraph])), Ok(vec![CudaGraph]));
        assert_eq!(s.to_release(Some(&[CudaGraph])), Ok(vec![CudaGraph]));
        s = MemoryState {
            weights: WeightsState::Absent,
            ..MemoryState::default()
        };
        let e = s.to_resume(Some(&[Weights])).unwrap_err();
        assert!(e.contains("absent"), "{e}");
        assert_eq!(s.to_release(Some(&[Weights])), Ok(vec![Weights]));
    }

    #[test]
    fn updates_need_weights_in_memory_and_absent_weights_need_every_tensor() {
        let mut s = MemoryState::default();
        assert_eq!(s.check_update(1, 10), Ok(()));
        s.weights = WeightsState::Released { backup: false };
        let e = s.check_update(10, 10).unwrap_err();
        assert!(e.contains("resume_memory_occupation"), "{e}");
        s.weights = WeightsState::Absent;
        let e = s.check_update(9, 10).unwrap_err();
        assert!(e.contains("9 of the 10"), "{e}");
        assert_eq!(s.check_update(10, 10), Ok(()));
    }
}
