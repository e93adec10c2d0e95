//! Sampling on the device (kernels/sampling.cu): the logits rows stay in GPU memory and only the
//! chosen token, its logprob and the top-N alternatives come back, per sampled row.
//!
//! The kernel implements the definition at the top of `crate::sampling::sample` (processing,
//! order, kept set, draw, logprobs). What depends on the request and its history is prepared
//! here, on the host, per row: the uniform of the draw (`sampling::uniform`, so seeding is the
//! CPU's exactly), the parameters, and a compact list of the tokens the penalties and the
//! min_new_tokens mask touch.
//!
//! All buffers are allocated once ([`DeviceSampler::new`]); a step only copies its small inputs
//! in and its results out.

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};

use super::args::View;
use super::device::Gpu;
use super::kernels::Kernel;
use super::CudaError;
use crate::sampling::{uniform, Decoding, SampleInput, SamplingError, TokenLogprobs};

/// Threads per sampled row (`SAMPLE_THREADS` in kernels/sampling.cu).
const SAMPLE_THREADS: u32 = 512;

/// Threads of an `argmax_rows` block (`ARGMAX_THREADS`).
const ARGMAX_THREADS: u32 = 256;

/// The most blocks a greedy row without logprobs is split over (`argmax_rows`): 2,374 of
/// Qwen3's 151,936 logits a block.
const ARGMAX_MAX_SPLITS: usize = 64;

/// Blocks a greedy row without logprobs is split over: enough for four blocks an SM over the
/// launch, at most [`ARGMAX_MAX_SPLITS`] and at least a block's threads' logits each.
fn argmax_splits(rows: usize, vocab: usize, sm_count: u32) -> usize {
    (4 * sm_count.max(1) as usize)
        .div_ceil(rows.max(1))
        .clamp(1, ARGMAX_MAX_SPLITS)
        .min(vocab.div_ceil(ARGMAX_THREADS as usize).max(1))
}

/// The most logprob alternatives the device reports per row; the kernel's gather holds 2048
/// keys. Rows asking for more are sampled on the host (the runner does that).
pub const MAX_DEVICE_TOP_LOGPROBS: usize = 1024;

const PENALTY_REPEAT: u32 = 1;
const PENALTY_MASK: u32 = 2;

const STATUS_OK: i32 = 0;
const STATUS_NON_FINITE: i32 = 1;
const STATUS_NO_CANDIDATES: i32 = 2;

/// One sampled row's parameters (`RowParams` in kernels/sampling.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RowParams {
    pub u: f64,
    pub logits_row: i32,
    pub penalties_begin: i32,
    pub penalties_end: i32,
    /// 0: no top-k truncation.
    pub top_k: i32,
    pub top_n: i32,
    pub greedy: i32,
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition: f32,
    pub frequency: f32,
    pub presence: f32,
    /// 1: the token's logprob is wanted. A greedy row without it and without top-N skips the
    /// normalizer.
    pub logprob: i32,
    pub pad: i32,
}

/// A token the penalties or the mask rewrite (`PenaltyEntry` in kernels/sampling.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PenaltyEntry {
    pub token: u32,
    /// Output occurrences for the frequency/presence penalties; 0 when both are off.
    pub output_count: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct RowResult {
    token: u32,
    logprob: f32,
    status: i32,
    bad_token: u32,
    bad_value: f32,
    num_top: u32,
}

/// One block's share of a split greedy row (`ArgmaxPart` in kernels/sampling.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct ArgmaxPart {
    max: f32,
    first_max: i32,
    bad: i32,
    pad: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct TopEntry {
    token: u32,
    logprob: f32,
}

const _: () = assert!(std::mem::size_of::<RowParams>() == 64);
const _: () = assert!(std::mem::align_of::<RowParams>() == 8);
const _: () = assert!(std::mem::size_of::<PenaltyEntry>() == 12);
const _: () = assert!(std::mem::size_of::<RowResult>() == 24);
const _: () = assert!(std::mem::size_of::<TopEntry>() == 8);
const _: () = assert!(std::mem::size_of::<ArgmaxPart>() == 16);

// SAFETY: plain `repr(C)` structs of integers and floats with the kernel's layout (asserted
// above), valid for any bit pattern, zero included.
unsafe impl DeviceRepr for RowParams {}
unsafe impl ValidAsZeroBits for RowParams {}
unsafe impl DeviceRepr for PenaltyEntry {}
unsafe impl ValidAsZeroBits for PenaltyEntry {}
unsafe impl DeviceRepr for RowResult {}
unsafe impl ValidAsZeroBits for RowResult {}
unsafe impl DeviceRepr for TopEntry {}
unsafe impl ValidAsZeroBits for TopEntry {}
unsafe impl DeviceRepr for ArgmaxPart {}
unsafe impl ValidAsZeroBits for ArgmaxPart {}

/// The kernel parameters of one row and the tokens its penalties and mask touch (appended to
/// `entries`; each penalized token once, masked tokens in a second phase of the kernel).
pub fn row_params(
    input: &SampleInput<'_>,
    vocab: usize,
    logits_row: usize,
    entries: &mut Vec<PenaltyEntry>,
) -> RowParams {
    let params = input.params;
    let history = input.history;
    let begin = entries.len();
    let pen = &params.penalties;
    let frequency_or_presence = pen.frequency != 0.0 || pen.presence != 0.0;
    let in_vocab = |t: u32| (t as usize) < vocab;
    if pen.repetition != 1.0 {
        // Every output token is also in the seen set, so this covers both penalties.
        for t in history.seen_tokens().filter(|&t| in_vocab(t)) {
            entries.push(PenaltyEntry {
                token: t,
                output_count: if frequency_or_presence {
                    history.output_count(t)
                } else {
                    0
                },
                flags: PENALTY_REPEAT,
            });
        }
    } else if frequency_or_presence {
        for (t, count) in history.output_counts().filter(|&(t, _)| in_vocab(t)) {
            entries.push(PenaltyEntry {
                token: t,
                output_count: count,
                flags: 0,
            });
        }
    }
    if history.output_len() < params.min_new_tokens {
        for &t in input.eos_token_ids.iter().chain(&params.stop_token_ids) {
            if in_vocab(t) {
                entries.push(PenaltyEntry {
                    token: t,
                    output_count: 0,
                    flags: PENALTY_MASK,
                });
            }
        }
    }
    let mut row = RowParams {
        logits_row: logits_row as i32,
        penalties_begin: begin as i32,
        penalties_end: entries.len() as i32,
        top_n: input.top_logprobs_num.min(vocab) as i32,
        logprob: input.logprob as i32,
        repetition: pen.repetition,
        frequency: pen.frequency,
        presence: pen.presence,
        ..Default::default()
    };
    match params.decoding {
        Decoding::Greedy => {
            row.greedy = 1;
            row.temperature = 1.0;
            row.top_p = 1.0;
        }
        Decoding::Sample {
            temperature,
            top_k,
            top_p,
            min_p,
        } => {
            let position = history.output_len() as u64;
            row.u = uniform(input.seed, input.sample_index as u64, position);
            row.temperature = temperature;
            // A top-k of the vocabulary or more keeps everything, as no top-k does.
            row.top_k = top_k.filter(|&k| k < vocab).map_or(0, |k| k as i32);
            row.top_p = top_p;
            row.min_p = min_p;
        }
    }
    row
}

/// Device buffers of the sampler, sized once.
pub struct DeviceSampler {
    vocab: usize,
    /// Rows one launch samples (the probabilities scratch holds that many rows).
    rows_per_launch: usize,
    /// Sampled rows per step (result slots).
    max_slots: usize,
    probs: CudaSlice<f32>,
    params: CudaSlice<RowParams>,
    penalties: CudaSlice<PenaltyEntry>,
    results: CudaSlice<RowResult>,
    tops: CudaSlice<TopEntry>,
    /// `argmax_rows`' per-block results (room for [`ARGMAX_MAX_SPLITS`] a row of a launch) and
    /// per-row tickets (zero between launches: the row's last block resets its own).
    parts: CudaSlice<ArgmaxPart>,
    tickets: CudaSlice<u32>,
    host_params: Vec<RowParams>,
    host_penalties: Vec<PenaltyEntry>,
    row_penalties: Vec<PenaltyEntry>,
    /// Slots used in this step and the top-N stride it was begun with.
    used: usize,
    top_stride: usize,
    /// Greedy rows that ask for no logprob take their first maximum alone (`sample_rows`
    /// stops after its first walk; launches of only such rows go to `argmax_rows`). Off
    /// (`LOCKSTEP_GREEDY_ARGMAX=0`, or [`DeviceSampler::set_greedy_argmax`]), they compute the
    /// logprob they do not report, as before. H100, 2026-12-06, NVFP4 steps (`cuda_bench
    /// --steps 32`, three rounds interleaved): batch 1 5.15-5.19 -> 5.10-5.12 ms, 64 18.07-18.08
    /// -> 17.98-18.01, 256 26.87-26.94 -> 26.80-26.81.
    greedy_argmax: bool,
}

impl DeviceSampler {
    /// `penalty_capacity` must hold one row's list: at most its distinct context tokens plus its
    /// EOS and stop ids (so `max_context_len` plus a margin). Larger steps are split into
    /// several launches.
    pub fn new(
        gpu: &Gpu,
        vocab: usize,
        rows_per_launch: usize,
        max_slots: usize,
        penalty_capacity: usize,
    ) -> Result<DeviceSampler, CudaError> {
        let rows_per_launch = rows_per_launch.max(1);
        let max_slots = max_slots.max(1);
        Ok(DeviceSampler {
            vocab,
            rows_per_launch,
            max_slots,
            probs: gpu.alloc(rows_per_launch * vocab)?,
            params: gpu.alloc(rows_per_launch)?,
            penalties: gpu.alloc(penalty_capacity.max(1))?,
            results: gpu.alloc(max_slots)?,
            tops: gpu.alloc(max_slots * MAX_DEVICE_TOP_LOGPROBS)?,
            parts: gpu.alloc(rows_per_launch * ARGMAX_MAX_SPLITS)?,
            tickets: gpu.alloc(rows_per_launch)?,
            host_params: Vec::with_capacity(rows_per_launch),
            host_penalties: Vec::with_capacity(penalty_capacity),
            row_penalties: Vec::new(),
            used: 0,
            top_stride: 0,
            greedy_argmax: std::env::var("LOCKSTEP_GREEDY_ARGMAX").map_or(true, |v| v != "0"),
        })
    }

    /// Turns the greedy rows' argmax path on or off (see `greedy_argmax`).
    pub fn set_greedy_argmax(&mut self, on: bool) {
        self.greedy_argmax = on;
    }

    /// Device bytes the sampler holds.
    pub fn bytes(&self) -> usize {
        self.probs.len() * 4
            + self.params.len() * 64
            + self.penalties.len() * 12
            + self.results.len() * 24
            + self.tops.len() * 8
            + self.parts.len() * 16
            + self.tickets.len() * 4
    }

    /// Starts a step whose rows report at most `top_n` alternatives each.
    pub fn begin(&mut self, top_n: usize) -> Result<(), CudaError> {
        if top_n > MAX_DEVICE_TOP_LOGPROBS {
            return Err(CudaError::Capacity(format!(
                "{top_n} top logprobs per row on the device (at most {MAX_DEVICE_TOP_LOGPROBS})"
            )));
        }
        self.used = 0;
        self.top_stride = top_n.max(1);
        Ok(())
    }

    /// Queues the sampling of `rows` (`(row index in logits, inputs)`) of `logits`, a buffer of
    /// rows of `vocab` floats; the rows are processed in place. Their results take the next
    /// slots of the step, in order.
    pub fn sample(
        &mut self,
        gpu: &Gpu,
        logits: &mut CudaSlice<f32>,
        rows: &[(usize, SampleInput<'_>)],
    ) -> Result<(), CudaError> {
        if self.used + rows.len() > self.max_slots {
            return Err(CudaError::Capacity(format!(
                "{} sampled rows in a step (at most {})",
                self.used + rows.len(),
                self.max_slots
            )));
        }
        self.host_params.clear();
        self.host_penalties.clear();
        let mut first_slot = self.used;
        for (row, input) in rows {
            if (row + 1) * self.vocab > logits.len() {
                return Err(CudaError::Capacity(format!(
                    "logits row {row} outside a buffer of {} rows",
                    logits.len() / self.vocab.max(1)
                )));
            }
            if input.top_logprobs_num.min(self.vocab) > self.top_stride {
                return Err(CudaError::Capacity(format!(
                    "{} top logprobs in a step begun for {}",
                    input.top_logprobs_num, self.top_stride
                )));
            }
            self.row_penalties.clear();
            let mut params = row_params(input, self.vocab, *row, &mut self.row_penalties);
            if !self.greedy_argmax {
                params.logprob = 1;
            }
            let needed = self.row_penalties.len();
            if needed > self.penalties.len() {
                return Err(CudaError::Capacity(format!(
                    "a row with {needed} penalized tokens (at most {})",
                    self.penalties.len()
                )));
            }
            let full = self.host_params.len() == self.rows_per_launch
                || self.host_penalties.len() + needed > self.penalties.len();
            if full {
                self.launch(gpu, logits, first_slot)?;
                first_slot += self.host_params.len();
                self.host_params.clear();
                self.host_penalties.clear();
            }
            let offset = self.host_penalties.len() as i32;
            params.penalties_begin = offset;
            params.penalties_end = offset + needed as i32;
            self.host_penalties.extend_from_slice(&self.row_penalties);
            self.host_params.push(params);
        }
        if !self.host_params.is_empty() {
            self.launch(gpu, logits, first_slot)?;
        }
        self.used += rows.len();
        Ok(())
    }

    fn launch(
        &mut self,
        gpu: &Gpu,
        logits: &mut CudaSlice<f32>,
        first_slot: usize,
    ) -> Result<(), CudaError> {
        // Copies from pageable host memory are staged before they return, and the stream runs
        // them after the previous launch, so the host vectors and device buffers can be reused.
        gpu.write(&self.host_params, &mut self.params)?;
        gpu.write(&self.host_penalties, &mut self.penalties)?;
        let rows = self.host_params.len();
        let argmax_only = self
            .host_params
            .iter()
            .all(|p| p.greedy == 1 && p.logprob == 0 && p.top_n == 0);
        if argmax_only {
            let splits = argmax_splits(rows, self.vocab, gpu.sm_count);
            return gpu.launch(
                Kernel::ArgmaxRows,
                (splits as u32, rows as u32, 1),
                ARGMAX_THREADS,
                // `parts` holds ARGMAX_MAX_SPLITS blocks of every row of a launch, `tickets` a
                // ticket a row (both sized by `new` for `rows_per_launch`).
                (
                    View::whole(logits),
                    self.vocab as i32,
                    View::whole(&self.params),
                    View::whole(&self.penalties),
                    splits as i32,
                    View::whole(&self.parts),
                    View::whole(&self.tickets),
                    first_slot as i32,
                    View::whole(&self.results),
                ),
            );
        }
        gpu.launch(
            Kernel::SampleRows,
            (rows as u32, 1, 1),
            SAMPLE_THREADS,
            // Sized by `new` for the rows of one launch and the slots of a step; `begin` and
            // `sample` check the rows, slots and penalty lists against them.
            (
                View::whole(logits),
                View::whole(&self.probs),
                self.vocab as i32,
                View::whole(&self.params),
                View::whole(&self.penalties),
                first_slot as i32,
                self.top_stride as i32,
                View::whole(&self.results),
                View::whole(&self.tops),
            ),
        )
    }

    /// Waits for the step and returns one result per slot, in slot order.
    pub fn finish(
        &mut self,
        gpu: &Gpu,
    ) -> Result<Vec<Result<TokenLogprobs, SamplingError>>, CudaError> {
        let n = self.used;
        let results = gpu.download(&self.results, n)?;
        let tops = gpu.download(&self.tops, n * self.top_stride)?;
        gpu.synchronize()?;
        Ok(results
            .iter()
            .enumerate()
            .map(|(slot, r)| match r.status {
                STATUS_OK => {
                    let top = &tops[slot * self.top_stride..][..r.num_top as usize];
                    Ok(TokenLogprobs {
                        token: r.token,
                        logprob: r.logprob,
                        top: top.iter().map(|e| (e.token, e.logprob)).collect(),
                    })
                }
                STATUS_NON_FINITE => Err(SamplingError::NonFiniteLogit {
                    token: r.bad_token,
                    value: r.bad_value,
                }),
                STATUS_NO_CANDIDATES => Err(SamplingError::NoCandidates),
                other => panic!("sample_rows wrote status {other}"),
            })
            .collect())
    }
}

/// The device's port of the host's `expf` (what the probabilities use) on `n` values, for the
/// test that checks it against `f32::exp` bit for bit.
pub fn host_expf(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    if x.len() < n || out.len() < n {
        return Err(CudaError::Capacity(format!(
            "host_expf of {n} values with buffers of {} and {}",
            x.len(),
            out.len()
        )));
    }
    gpu.launch(
        Kernel::HostExpf,
        (gpu.grid_for(n, 256), 1, 1),
        256,
        (View::whole(x), View::whole(out), n as u64),
    )
}

/// Samples `rows` of `logits` in one step: [`DeviceSampler::begin`], `sample`, `finish`.
pub fn sample_rows(
    gpu: &Gpu,
    sampler: &mut DeviceSampler,
    logits: &mut CudaSlice<f32>,
    rows: &[(usize, SampleInput<'_>)],
) -> Result<Vec<Result<TokenLogprobs, SamplingError>>, CudaError> {
    let top_n = rows
        .iter()
        .map(|(_, i)| i.top_logprobs_num)
        .max()
        .unwrap_or(0);
    sampler.begin(top_n.min(sampler.vocab))?;
    sampler.sample(gpu, logits, rows)?;
    sampler.finish(gpu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{SamplingParams, TokenHistory};

    fn valid(p: SamplingParams) -> crate::sampling::ValidSamplingParams {
        p.validate(&Default::default()).unwrap()
    }

    #[test]
    fn row_params_carry_the_cpu_inputs() {
        let params = valid(SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.2,
            frequency_penalty: 0.5,
            min_new_tokens: 3,
            stop_token_ids: vec![7, 1000],
            ..Default::default()
        });
        let mut history = TokenHistory::new(&[1, 2, 2, 500]);
        history.push(2);
        history.push(3);
        let input = SampleInput {
            params: &params,
            history: &history,
            eos_token_ids: &[9],
            seed: 42,
            sample_index: 2,
            top_logprobs_num: 5,
            logprob: true,
        };
        let mut entries = vec![PenaltyEntry::default()];
        let row = row_params(&input, 100, 6, &mut entries);
        assert_eq!(row.u, uniform(42, 2, 2));
        assert_eq!(
            (
                row.logits_row,
                row.top_k,
                row.top_n,
                row.greedy,
                row.logprob
            ),
            (6, 40, 5, 0, 1)
        );
        assert_eq!((row.temperature, row.top_p, row.min_p), (0.7, 0.9, 0.05));
        assert_eq!((row.penalties_begin, row.penalties_end), (1, 6));
        let mut got = entries[1..].to_vec();
        got.sort_by_key(|e| (e.flags, e.token));
        let e = |token, output_count, flags| PenaltyEntry {
            token,
            output_count,
            flags,
        };
        // Seen {1, 2, 3} (500 is outside the vocabulary), counts {2: 1, 3: 1}; mask 7 and 9.
        assert_eq!(
            got,
            vec![
                e(1, 0, PENALTY_REPEAT),
                e(2, 1, PENALTY_REPEAT),
                e(3, 1, PENALTY_REPEAT),
                e(7, 0, PENALTY_MASK),
                e(9, 0, PENALTY_MASK),
            ]
        );
    }

    #[test]
    fn neutral_penalties_and_greedy_need_no_list() {
        let params = valid(SamplingParams {
            temperature: 0.0,
            top_k: 100,
            ..Default::default()
        });
        let mut history = TokenHistory::new(&[1, 2]);
        history.push(4);
        let input = SampleInput {
            params: &params,
            history: &history,
            eos_token_ids: &[9],
            seed: 1,
            sample_index: 0,
            top_logprobs_num: 0,
            logprob: false,
        };
        let mut entries = Vec::new();
        let row = row_params(&input, 50, 0, &mut entries);
        assert!(entries.is_empty());
        assert_eq!((row.greedy, row.top_k, row.u, row.logprob), (1, 0, 0.0, 0));
        // Only frequency/presence: the output tokens alone.
        let params = valid(SamplingParams {
            presence_penalty: 0.3,
            top_k: 10,
            ..Default::default()
        });
        let input = SampleInput {
            params: &params,
            ..input
        };
        let row = row_params(&input, 50, 0, &mut entries);
        assert_eq!(
            entries,
            vec![PenaltyEntry {
                token: 4,
                output_count: 1,
                flags: 0
            }]
        );
        assert_eq!(row.top_k, 10);
    }
}
