//! The bench's output: the report type, the summary table in sglang bench_serving's layout
//! (so results can be read side by side), and the JSON file.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::metrics::{Distribution, RequestRecord, RolloutSummary, Summary};
use super::{BenchArgs, BenchError, Dataset};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchConfig {
    #[serde(flatten)]
    pub args: BenchArgs,
    /// The model name sent in OpenAI requests: --model, or what /v1/models listed (absent
    /// for /generate).
    pub served_model: Option<String>,
    /// Requests the dataset held; fewer are recorded when --timeout stopped the arrivals.
    pub planned_requests: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchReport {
    pub config: BenchConfig,
    pub summary: Summary,
    pub rollout: Option<RolloutSummary>,
    /// Every measured request (warmup excluded), in send order.
    pub requests: Vec<RequestRecord>,
}

pub fn write_json(report: &BenchReport, path: &Path) -> Result<(), BenchError> {
    let text = serde_json::to_string_pretty(report)?;
    std::fs::write(path, text).map_err(|source| BenchError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Prints the summary table to stdout.
pub fn print_report(report: &BenchReport) {
    print!("{}", render_report(report));
}

const WIDTH: usize = 50;

fn title(out: &mut String, name: &str, fill: char) {
    // sglang centres titles in a 50-wide rule (Python's str.center).
    let pad = WIDTH.saturating_sub(name.chars().count());
    let left: String = std::iter::repeat_n(fill, pad / 2).collect();
    let right: String = std::iter::repeat_n(fill, pad - pad / 2).collect();
    let _ = writeln!(out, "{left}{name}{right}");
}

fn row(out: &mut String, label: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{:<40} {:<10}", label, value);
}

fn num(out: &mut String, label: &str, value: f64) {
    row(out, label, format!("{value:.2}"));
}

fn latency(out: &mut String, name: &str, short: &str, d: &Distribution, rows: &[&str]) {
    title(out, name, '-');
    for which in rows {
        let (label, v) = match *which {
            "mean" => ("Mean", d.mean),
            "median" => ("Median", d.median),
            "std" => ("Std", d.std),
            "p90" => ("P90", d.p90),
            "p95" => ("P95", d.p95),
            "p99" => ("P99", d.p99),
            _ => ("Max", d.max),
        };
        num(out, &format!("{label} {short} (ms):"), v);
    }
}

/// The summary table as text: sglang's labels and order, with lockstep's additions (peak
/// concurrency, P90/P95/max everywhere, failures, the rollout block) where sglang has none.
pub fn render_report(report: &BenchReport) -> String {
    let s = &report.summary;
    let c = &report.config.args;
    let mut out = String::new();
    title(&mut out, " Serving Benchmark Result ", '=');
    row(&mut out, "Backend:", c.backend.name());
    row(&mut out, "Dataset:", &c.dataset);
    row(&mut out, "Traffic request rate:", c.request_rate);
    row(
        &mut out,
        "Max request concurrency:",
        c.max_concurrency
            .map(|m| m.to_string())
            .unwrap_or_else(|| "not set".into()),
    );
    row(&mut out, "Successful requests:", s.completed);
    row(&mut out, "Failed requests:", s.failed);
    if s.cut_off > 0 {
        row(&mut out, "Cut off by time limit:", s.cut_off);
    }
    num(&mut out, "Benchmark duration (s):", s.duration_s);
    row(&mut out, "Total input tokens:", s.total_input_tokens);
    row(&mut out, "Total generated tokens:", s.total_output_tokens);
    num(
        &mut out,
        "Request throughput (req/s):",
        s.request_throughput,
    );
    num(
        &mut out,
        "Input token throughput (tok/s):",
        s.input_throughput,
    );
    num(
        &mut out,
        "Output token throughput (tok/s):",
        s.output_throughput,
    );
    num(
        &mut out,
        "Peak output token throughput (tok/s):",
        s.peak_output_throughput,
    );
    row(
        &mut out,
        "Peak concurrent requests:",
        s.peak_concurrent_requests,
    );
    num(
        &mut out,
        "Total token throughput (tok/s):",
        s.total_throughput,
    );
    num(&mut out, "Concurrency:", s.concurrency);
    let all = ["mean", "median", "p90", "p95", "p99", "max"];
    latency(
        &mut out,
        "End-to-End Latency",
        "E2E Latency",
        &s.e2e_ms,
        &all,
    );
    latency(&mut out, "Time to First Token", "TTFT", &s.ttft_ms, &all);
    latency(
        &mut out,
        "Time per Output Token (excl. 1st token)",
        "TPOT",
        &s.tpot_ms,
        &all,
    );
    latency(&mut out, "Inter-Token Latency", "ITL", &s.itl_ms, &all);
    if let Some(r) = &report.rollout {
        title(&mut out, "RL Rollout", '-');
        row(
            &mut out,
            "Prompt groups (complete / sent):",
            format!("{} / {}", r.complete_groups, r.groups),
        );
        row(&mut out, "Samples per group:", r.group_size);
        num(&mut out, "Rollout throughput (samples/s):", r.samples_per_s);
        num(
            &mut out,
            "Rollout throughput (output tok/s):",
            r.output_tokens_per_s,
        );
        num(
            &mut out,
            "Mean group straggler time (s):",
            r.straggler_mean_s,
        );
        num(
            &mut out,
            "Median group straggler time (s):",
            r.straggler_median_s,
        );
        num(&mut out, "Max group straggler time (s):", r.straggler_max_s);
        match &r.prefix_cache {
            Some(p) => row(
                &mut out,
                "Prefix cache hit rate:",
                format!(
                    "{:.2}% ({:.0}/{:.0} tokens)",
                    p.hit_rate * 100.0,
                    p.hit_tokens,
                    p.prompt_tokens
                ),
            ),
            None => row(
                &mut out,
                "Prefix cache hit rate:",
                "n/a (no lockstep /metrics)",
            ),
        }
    }
    if !s.errors.is_empty() {
        title(&mut out, "Errors", '-');
        for (msg, n) in &s.errors {
            let _ = writeln!(out, "{n:>6} x {msg}");
        }
    }
    title(&mut out, "", '=');
    if matches!(c.dataset, Dataset::Random | Dataset::Rl) && c.tokenizer.is_none() {
        let from_server = report
            .requests
            .iter()
            .filter(|r| r.success)
            .all(|r| r.prompt_tokens_from_server);
        if !from_server {
            out.push_str("note: input tokens are estimates (no --tokenizer and the server reported no prompt_tokens)\n");
        }
    }
    out
}
