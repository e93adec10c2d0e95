//! Turns per-request timings into the numbers people compare engines by, defined exactly as
//! sglang's bench_serving (and vllm's `bench serve`, which agrees) define them, so a lockstep
//! number can sit next to theirs. docs/bench.md states each definition in words.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Everything measured about one request. Times are seconds; `start_s` counts from the
/// start of the measured run, the others from this request's own send.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RequestRecord {
    pub index: usize,
    /// RL dataset: which prompt group this sample belongs to.
    pub group: Option<usize>,
    pub sampling_seed: Option<u64>,
    pub success: bool,
    pub error: Option<String>,
    /// Still running when `--timeout` ended the run (counted apart from failures: the server
    /// did nothing wrong).
    pub cut_off: bool,
    /// When the request was sent (after waiting for a concurrency slot, as in sglang).
    pub start_s: f64,
    /// Time to the first chunk that carried output; 0 when none came.
    pub ttft_s: f64,
    /// Send to the end of the response (or to the failure).
    pub e2e_s: f64,
    /// Gaps between successive output chunks; a chunk with k > 1 new tokens contributes k
    /// gaps of (gap / k), as sglang's bench does for its native stream.
    pub itl_s: Vec<f64>,
    pub prompt_tokens: usize,
    /// Whether `prompt_tokens` came from the server (else it is the dataset's estimate).
    pub prompt_tokens_from_server: bool,
    pub output_tokens: usize,
    pub finish_reason: Option<String>,
}

/// Distribution of one latency, in milliseconds. All zero when there were no samples (as
/// sglang's `np.mean(x or 0)`), so the JSON keeps one shape.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Distribution {
    pub count: usize,
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl Distribution {
    /// From values in seconds.
    pub fn from_seconds(values: &[f64]) -> Self {
        let mut ms: Vec<f64> = values.iter().map(|v| v * 1000.0).collect();
        ms.sort_by(f64::total_cmp);
        if ms.is_empty() {
            return Self::default();
        }
        let n = ms.len() as f64;
        let mean = ms.iter().sum::<f64>() / n;
        // Population std (numpy's default ddof=0), as sglang prints.
        let std = (ms.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).sqrt();
        Self {
            count: ms.len(),
            mean,
            median: percentile(&ms, 50.0),
            std,
            p90: percentile(&ms, 90.0),
            p95: percentile(&ms, 95.0),
            p99: percentile(&ms, 99.0),
            max: ms[ms.len() - 1],
        }
    }
}

/// numpy.percentile's default ("linear"): rank p/100 * (n - 1) between sorted neighbours.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub completed: usize,
    pub failed: usize,
    pub cut_off: usize,
    /// First send to last completion, seconds.
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub input_throughput: f64,
    pub output_throughput: f64,
    pub total_throughput: f64,
    /// Most output tokens that finished within one 1 s bucket (buckets start at first send).
    pub peak_output_throughput: f64,
    /// Most requests in flight during any one 1 s bucket.
    pub peak_concurrent_requests: usize,
    /// Mean requests in flight: sum of E2E latencies / duration.
    pub concurrency: f64,
    pub ttft_ms: Distribution,
    pub tpot_ms: Distribution,
    pub itl_ms: Distribution,
    pub e2e_ms: Distribution,
    /// Output tokens per 1 s bucket from first send: the throughput-over-time curve.
    pub output_tokens_per_second: Vec<f64>,
    /// Failure messages and how many requests failed with each.
    pub errors: BTreeMap<String, usize>,
}

pub fn summarize(records: &[RequestRecord]) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
    let first_send = records
        .iter()
        .map(|r| r.start_s)
        .fold(f64::INFINITY, f64::min);
    let last_done = records
        .iter()
        .map(|r| r.start_s + r.e2e_s)
        .fold(f64::NEG_INFINITY, f64::max);
    let duration = if records.is_empty() {
        0.0
    } else {
        (last_done - first_send).max(0.0)
    };
    let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };

    let total_input: usize = ok.iter().map(|r| r.prompt_tokens).sum();
    let total_output: usize = ok.iter().map(|r| r.output_tokens).sum();
    let ttfts: Vec<f64> = ok.iter().map(|r| r.ttft_s).collect();
    let e2es: Vec<f64> = ok.iter().map(|r| r.e2e_s).collect();
    let itls: Vec<f64> = ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect();
    let tpots: Vec<f64> = ok
        .iter()
        .filter(|r| r.output_tokens > 1)
        .map(|r| (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) as f64)
        .collect();

    let (buckets, peak_concurrent) = buckets(&ok, first_send, duration);
    let mut errors = BTreeMap::new();
    for r in records.iter().filter(|r| !r.success) {
        let msg = r.error.clone().unwrap_or_else(|| "unknown error".into());
        *errors.entry(msg).or_insert(0) += 1;
    }
    Summary {
        completed: ok.len(),
        failed: records.iter().filter(|r| !r.success && !r.cut_off).count(),
        cut_off: records.iter().filter(|r| r.cut_off).count(),
        duration_s: duration,
        total_input_tokens: total_input,
        total_output_tokens: total_output,
        request_throughput: per_s(ok.len() as f64),
        input_throughput: per_s(total_input as f64),
        output_throughput: per_s(total_output as f64),
        total_throughput: per_s((total_input + total_output) as f64),
        peak_output_throughput: buckets.iter().copied().fold(0.0, f64::max),
        peak_concurrent_requests: peak_concurrent,
        concurrency: per_s(e2es.iter().sum()),
        ttft_ms: Distribution::from_seconds(&ttfts),
        tpot_ms: Distribution::from_seconds(&tpots),
        itl_ms: Distribution::from_seconds(&itls),
        e2e_ms: Distribution::from_seconds(&e2es),
        output_tokens_per_second: buckets,
        errors,
    }
}

/// vllm's peak computation: each token is placed at its arrival time (start + TTFT, then
/// adding each ITL) and counted in the 1 s bucket it falls in; a request is in flight in every
/// bucket from its start's to its end's.
fn buckets(ok: &[&RequestRecord], origin: f64, duration: f64) -> (Vec<f64>, usize) {
    if ok.is_empty() {
        return (Vec::new(), 0);
    }
    let n = duration.ceil() as usize + 1;
    let mut tokens = vec![0.0; n];
    let mut in_flight = vec![0usize; n];
    let bucket = |t: f64| ((t - origin).max(0.0) as usize).min(n - 1);
    for r in ok {
        let mut t = r.start_s + r.ttft_s;
        if r.output_tokens > 0 {
            tokens[bucket(t)] += 1.0;
        }
        for gap in &r.itl_s {
            t += gap;
            tokens[bucket(t)] += 1.0;
        }
        for slot in &mut in_flight[bucket(r.start_s)..=bucket(r.start_s + r.e2e_s)] {
            *slot += 1;
        }
    }
    // A trailing bucket that no token reached is an artefact of the +1 above.
    while tokens.len() > 1 && tokens.last() == Some(&0.0) && (tokens.len() - 1) as f64 >= duration {
        tokens.pop();
    }
    (tokens, in_flight.into_iter().max().unwrap_or(0))
}

/// The RL rollout view: GRPO waits for the slowest of a prompt's n samples before it can
/// compute advantages, so the group's completion time, not the mean latency, bounds a step.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RolloutSummary {
    pub groups: usize,
    pub group_size: usize,
    /// Groups whose every sample succeeded; only these have a straggler time.
    pub complete_groups: usize,
    pub samples_per_s: f64,
    pub output_tokens_per_s: f64,
    pub total_tokens_per_s: f64,
    /// Per group: first send of any sample to completion of its slowest sample, seconds.
    pub straggler_mean_s: f64,
    pub straggler_median_s: f64,
    pub straggler_max_s: f64,
    pub prefix_cache: Option<PrefixCacheStats>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PrefixCacheStats {
    /// Deltas of the server's counters over the measured run (read after warmup; warmup
    /// prompts are distinct from the measured ones, so they cannot pre-fill its cache).
    pub hit_tokens: f64,
    pub prompt_tokens: f64,
    pub hit_rate: f64,
}

pub fn summarize_rollout(
    records: &[RequestRecord],
    summary: &Summary,
    group_size: usize,
    prefix_cache: Option<PrefixCacheStats>,
) -> RolloutSummary {
    let groups: BTreeSet<usize> = records.iter().filter_map(|r| r.group).collect();
    let mut stragglers = Vec::new();
    for g in &groups {
        let members: Vec<&RequestRecord> = records.iter().filter(|r| r.group == Some(*g)).collect();
        if members.iter().all(|r| r.success) {
            let first = members
                .iter()
                .map(|r| r.start_s)
                .fold(f64::INFINITY, f64::min);
            let last = members
                .iter()
                .map(|r| r.start_s + r.e2e_s)
                .fold(f64::NEG_INFINITY, f64::max);
            stragglers.push(last - first);
        }
    }
    stragglers.sort_by(f64::total_cmp);
    let mean = if stragglers.is_empty() {
        0.0
    } else {
        stragglers.iter().sum::<f64>() / stragglers.len() as f64
    };
    RolloutSummary {
        groups: groups.len(),
        group_size,
        complete_groups: stragglers.len(),
        samples_per_s: summary.request_throughput,
        output_tokens_per_s: summary.output_throughput,
        total_tokens_per_s: summary.total_throughput,
        straggler_mean_s: mean,
        straggler_median_s: percentile(&stragglers, 50.0),
        straggler_max_s: stragglers.last().copied().unwrap_or(0.0),
        prefix_cache,
    }
}

/// Sums every sample of `name` in Prometheus text format (all label sets); None when the
/// server does not export it, as SGLang and vLLM do not export lockstep's names.
pub fn prometheus_value(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // Must be the whole metric name, not a prefix of a longer one.
        let rest = match rest.chars().next() {
            Some('{') => match rest.find('}') {
                Some(end) => &rest[end + 1..],
                None => continue,
            },
            Some(' ') | Some('\t') => rest,
            _ => continue,
        };
        if let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

pub const PREFIX_HIT_METRIC: &str = "lockstep_prefix_cache_hit_tokens_total";
pub const PROMPT_TOKENS_METRIC: &str = "lockstep_prompt_tokens_total";

/// Hit rate over the run from two scrapes of /metrics.
pub fn prefix_cache_delta(before: &str, after: &str) -> Option<PrefixCacheStats> {
    let hit =
        prometheus_value(after, PREFIX_HIT_METRIC)? - prometheus_value(before, PREFIX_HIT_METRIC)?;
    let prompt = prometheus_value(after, PROMPT_TOKENS_METRIC)?
        - prometheus_value(before, PROMPT_TOKENS_METRIC)?;
    Some(PrefixCacheStats {
        hit_tokens: hit,
        prompt_tokens: prompt,
        hit_rate: if prompt > 0.0 { hit / prompt } else { 0.0 },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * (1.0 + a.abs().max(b.abs()))
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        // numpy.percentile([1,2,3,4], 50) = 2.5; 90 -> rank 2.7 -> 3.7; 99 -> rank 2.97 -> 3.97
        assert!(close(percentile(&v, 50.0), 2.5));
        assert!(close(percentile(&v, 90.0), 3.7));
        assert!(close(percentile(&v, 99.0), 3.97));
        assert!(close(percentile(&v, 0.0), 1.0));
        assert!(close(percentile(&v, 100.0), 4.0));
        assert!(close(percentile(&[5.0], 95.0), 5.0));
        assert_eq!(percentile(&[], 50.0), 0.0);

        // Seconds in, milliseconds out, unsorted input.
        let d = Distribution::from_seconds(&[0.004, 0.001, 0.003, 0.002]);
        assert_eq!(d.count, 4);
        assert!(close(d.mean, 2.5));
        assert!(close(d.median, 2.5));
        assert!(close(d.p95, 3.85)); // rank 2.85
        assert!(close(d.max, 4.0));
        assert!(close(d.std, 1.25f64.sqrt())); // population variance of 1..4 = 1.25
        assert_eq!(Distribution::from_seconds(&[]), Distribution::default());
    }

    fn rec(start: f64, ttft: f64, itl: &[f64], prompt: usize, out: usize) -> RequestRecord {
        RequestRecord {
            success: true,
            start_s: start,
            ttft_s: ttft,
            e2e_s: ttft + itl.iter().sum::<f64>(),
            itl_s: itl.to_vec(),
            prompt_tokens: prompt,
            output_tokens: out,
            ..Default::default()
        }
    }

    #[test]
    fn summary_by_hand() {
        // A: sent at 0.0, first token at 0.5, then tokens at 1.0, 1.5, 2.0 (e2e 2.0, 4 tokens).
        // B: sent at 1.0, first token at 1.2, then 1.4 and 2.4 (e2e 1.4, 3 tokens).
        // C: sent at 0.5, failed after 0.1 s.
        // D: sent at 3.0, a single token at 4.0 (e2e 1.0): no TPOT, no ITL.
        let a = rec(0.0, 0.5, &[0.5, 0.5, 0.5], 10, 4);
        let b = rec(1.0, 0.2, &[0.2, 1.0], 20, 3);
        let c = RequestRecord {
            start_s: 0.5,
            e2e_s: 0.1,
            error: Some("HTTP 500: boom".into()),
            ..Default::default()
        };
        let d = rec(3.0, 1.0, &[], 5, 1);
        let s = summarize(&[a, b, c, d]);
        // Duration: first send 0.0 to last completion 4.0.
        assert!(close(s.duration_s, 4.0));
        assert_eq!((s.completed, s.failed, s.cut_off), (3, 1, 0));
        assert_eq!((s.total_input_tokens, s.total_output_tokens), (35, 8));
        assert!(close(s.request_throughput, 3.0 / 4.0));
        assert!(close(s.input_throughput, 35.0 / 4.0));
        assert!(close(s.output_throughput, 8.0 / 4.0));
        assert!(close(s.total_throughput, 43.0 / 4.0));
        // Concurrency: (2.0 + 1.4 + 1.0) / 4.0.
        assert!(close(s.concurrency, 4.4 / 4.0));
        // TPOT: A (2.0-0.5)/3 = 0.5, B (1.4-0.2)/2 = 0.6; D excluded.
        assert_eq!(s.tpot_ms.count, 2);
        assert!(close(s.tpot_ms.mean, 550.0));
        // ITL pooled over requests: 0.5,0.5,0.5,0.2,1.0 -> sorted .2 .5 .5 .5 1.0.
        assert_eq!(s.itl_ms.count, 5);
        assert!(close(s.itl_ms.mean, 540.0));
        assert!(close(s.itl_ms.median, 500.0));
        assert!(close(s.itl_ms.p90, 800.0)); // rank 3.6 between 500 and 1000
        assert!(close(s.itl_ms.max, 1000.0));
        assert!(close(s.ttft_ms.mean, (500.0 + 200.0 + 1000.0) / 3.0));
        assert!(close(s.e2e_ms.max, 2000.0));
        // Token times: A 0.5 1.0 1.5 2.0; B 1.2 1.4 2.4; D 4.0.
        // Buckets [0,1): 1  [1,2): 1.0 1.5 1.2 1.4 = 4  [2,3): 2.0 2.4 = 2  [3,4): 0  [4,5): 1
        assert_eq!(s.output_tokens_per_second, vec![1.0, 4.0, 2.0, 0.0, 1.0]);
        assert!(close(s.peak_output_throughput, 4.0));
        // In flight: A buckets 0-2, B 1-2, D 3-4 -> max 2.
        assert_eq!(s.peak_concurrent_requests, 2);
        assert_eq!(s.errors.get("HTTP 500: boom"), Some(&1));
    }

    #[test]
    fn empty_and_all_failed_runs_do_not_divide_by_zero() {
        let s = summarize(&[]);
        assert_eq!(s.completed, 0);
        assert_eq!(s.request_throughput, 0.0);
        let failed = RequestRecord {
            cut_off: true,
            error: Some("time limit".into()),
            ..Default::default()
        };
        let s = summarize(&[failed]);
        assert_eq!((s.completed, s.failed, s.cut_off), (0, 0, 1));
        assert!(s.output_tokens_per_second.is_empty());
    }

    #[test]
    fn rollout_straggler_is_slowest_sample_of_each_group() {
        let mut recs = Vec::new();
        // Group 0: sends at 0.0 and 0.1, ends at 1.0 and 3.0 -> straggler 3.0.
        // Group 1: sends at 1.0, 1.0, ends 2.0, 2.5 -> 1.5.
        // Group 2: one failed sample -> not complete.
        for (g, start, e2e, ok) in [
            (0, 0.0, 1.0, true),
            (0, 0.1, 2.9, true),
            (1, 1.0, 1.0, true),
            (1, 1.0, 1.5, true),
            (2, 1.0, 0.5, true),
            (2, 1.0, 0.2, false),
        ] {
            recs.push(RequestRecord {
                group: Some(g),
                success: ok,
                start_s: start,
                e2e_s: e2e,
                ..Default::default()
            });
        }
        let s = summarize(&recs);
        let r = summarize_rollout(&recs, &s, 2, None);
        assert_eq!((r.groups, r.complete_groups, r.group_size), (3, 2, 2));
        assert!(close(r.straggler_max_s, 3.0));
        assert!(close(r.straggler_mean_s, 2.25));
        assert!(close(r.straggler_median_s, 2.25));
        assert!(close(r.samples_per_s, 5.0 / 3.0)); // 5 completed over 0.0..3.0
    }

    #[test]
    fn prometheus_counters_and_hit_rate() {
        let before =
            "# HELP lockstep_prompt_tokens_total x\n# TYPE lockstep_prompt_tokens_total counter\n\
                      lockstep_prompt_tokens_total 100\n\
                      lockstep_prefix_cache_hit_tokens_total{model=\"a\"} 10\n\
                      lockstep_prefix_cache_hit_tokens_total{model=\"b\"} 5\n\
                      lockstep_prompt_tokens_total_bogus 999\n";
        let after = "lockstep_prompt_tokens_total 500\n\
                     lockstep_prefix_cache_hit_tokens_total{model=\"a\"} 215\n\
                     lockstep_prefix_cache_hit_tokens_total{model=\"b\"} 100 1700000000\n";
        assert_eq!(prometheus_value(before, PROMPT_TOKENS_METRIC), Some(100.0));
        assert_eq!(prometheus_value(before, PREFIX_HIT_METRIC), Some(15.0));
        let p = prefix_cache_delta(before, after).unwrap();
        assert!(close(p.hit_tokens, 300.0));
        assert!(close(p.prompt_tokens, 400.0));
        assert!(close(p.hit_rate, 0.75));
        // SGLang / vLLM export other names: no number rather than a wrong one.
        assert_eq!(prefix_cache_delta("sglang:foo 1\n", "sglang:foo 2\n"), None);
    }
}
