//! Decode steps on CUDA graphs: the launches of a step's layers (every kernel from the
//! embedding to the last layer's output) recorded once per row count and replayed, so a step
//! costs one graph launch instead of a thousand kernel launches. A server records every row
//! count at start-up (`CudaModel::capture_decode_graphs`); a row count without a recording
//! (after the weights moved) runs eagerly once and is recorded on its second run.
//!
//! A recording holds the addresses of every buffer it touches: the weights, the KV cache, the
//! step buffers, the metadata buffers and the GEMM scratch. The metadata a step changes (its
//! tokens, positions, KV slots, block tables) is written into the fixed metadata buffers before
//! the replay, so the same recording serves every step of its row count. Whatever moves a
//! buffer drops the recordings: the owner calls [`StepGraphs::clear`] when the weights or the
//! KV cache are replaced, released or resumed (not when an update writes the weights in
//! place), and a grown GEMM scratch is seen here (it is sized for the largest step up front,
//! so only an oversized test launch grows it).
//!
//! A replay queues exactly the launches the eager run queues, with the same arguments, so its
//! bits are the eager run's (tests/cuda_generate.rs compares rollouts on graphs with eager
//! re-scoring bit for bit).

use std::collections::{HashMap, HashSet};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

use super::{Cuda, CudaError, Gpu};

/// Decode steps by how they ran (label `mode`): `replay` (a recording), `record` (run while
/// recording), `eager` (launch by launch: a row count's first run, or one whose recording
/// failed). Served at `/metrics` (docs/api.md).
pub const GRAPH_STEPS: &str = "lockstep_engine_cuda_graph_steps_total";

/// Row counts a decode step is padded to so that a few recordings serve every batch: SGLang's
/// capture sizes up to 256 (1, 2, 4, 8, then every 8 to 128, every 16 to 192, then 224, 256).
pub const GRAPH_ROWS: [usize; 25] = [
    1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 144, 160, 176, 192,
    224, 256,
];

/// The padded row count for a decode step of `rows` rows: the smallest of [`GRAPH_ROWS`] that
/// holds it and is at most `max_rows`, or None (run it eagerly).
pub fn padded_rows(rows: usize, max_rows: usize) -> Option<usize> {
    GRAPH_ROWS
        .iter()
        .copied()
        .find(|&r| r >= rows)
        .filter(|&r| rows > 0 && r <= max_rows)
}

/// The recordings, by row count.
#[derive(Default)]
pub struct StepGraphs {
    graphs: HashMap<usize, CudaGraph>,
    /// Row counts run eagerly once (the first run of a shape grows the GEMM scratch; the
    /// second is recorded).
    warmed: HashSet<usize>,
    /// Row counts whose recording failed: they run eagerly from then on.
    refused: HashSet<usize>,
    /// The GEMM scratch's generation the recordings were made with.
    scratch: u64,
}

/// Recordings on their way out: destroyed on a thread of their own.
struct Dropped(#[allow(dead_code)] HashMap<usize, CudaGraph>);

// SAFETY: a recording is driver handles and the stream it was made on; the driver's calls are
// thread-safe, and destroying an executable graph that is still running frees it when it
// completes (cuGraphExecDestroy).
unsafe impl Send for Dropped {}

impl StepGraphs {
    /// Drops every recording (their buffers moved or are gone). Destroying them takes some
    /// milliseconds each (25 sizes after start-up), so it happens off the calling thread: a
    /// weight swap does not stall generation for it.
    pub fn clear(&mut self, gpu: &Gpu) {
        self.warmed.clear();
        if self.graphs.is_empty() {
            return;
        }
        let dropped = Dropped(std::mem::take(&mut self.graphs));
        let ctx = gpu.ctx.clone();
        std::thread::spawn(move || {
            if let Err(e) = ctx.bind_to_thread() {
                tracing::warn!("destroying the dropped CUDA graphs on the calling thread: {e}");
            }
            drop(dropped);
        });
    }

    /// How many row counts have a recording.
    pub fn recorded(&self) -> usize {
        self.graphs.len()
    }

    /// Runs a step of `rows` rows on `cuda`: replays its recording, or runs `layers` (eagerly
    /// the first time, then recording them).
    pub fn run(
        &mut self,
        cuda: &mut Cuda,
        rows: usize,
        layers: &mut dyn FnMut(&mut Cuda) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let generation = cuda.gpu.gemm_scratch_generation();
        if generation != self.scratch {
            self.clear(&cuda.gpu);
            self.scratch = generation;
        }
        if let Some(graph) = self.graphs.get(&rows) {
            metrics::counter!(GRAPH_STEPS, "mode" => "replay").increment(1);
            return Ok(graph.launch()?);
        }
        if self.refused.contains(&rows) || self.warmed.insert(rows) {
            metrics::counter!(GRAPH_STEPS, "mode" => "eager").increment(1);
            return layers(cuda);
        }
        metrics::counter!(GRAPH_STEPS, "mode" => "record").increment(1);
        let started = std::time::Instant::now();
        let stream = cuda.gpu.stream.clone();
        // Thread-local: the loader and IPC threads keep allocating on their own streams.
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let queued = layers(cuda);
        let captured = stream.end_capture(CUgraphInstantiate_flags(0));
        let same_scratch = cuda.gpu.gemm_scratch_generation() == generation;
        match (queued, captured) {
            (Ok(()), Ok(Some(graph))) if same_scratch => {
                graph.launch()?;
                self.graphs.insert(rows, graph);
                tracing::debug!(
                    "recorded the decode step of {rows} rows on a CUDA graph in {:.1} ms",
                    started.elapsed().as_secs_f64() * 1e3
                );
                Ok(())
            }
            (queued, captured) => {
                // Nothing queued during a capture ran: run the step now.
                let why = match (&queued, &captured) {
                    (Err(e), _) => e.to_string(),
                    (_, Err(e)) => e.to_string(),
                    (_, Ok(None)) => "the capture was empty".into(),
                    _ => "the GEMM scratch grew while recording".into(),
                };
                tracing::warn!("decode steps of {rows} rows run without a CUDA graph: {why}");
                self.refused.insert(rows);
                layers(cuda)
            }
        }
    }
}
