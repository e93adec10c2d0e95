//! End-to-end: the bench against a tiny in-process server that streams known frames over
//! real HTTP/1.1 (chunked, with a frame split across two chunks), for each wire format.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

#[derive(Clone, Copy, Default)]
struct Mode {
    fail: bool,
    stall: bool,
}

#[derive(Clone, Default)]
struct Seen {
    requests: Arc<Mutex<Vec<(String, Value)>>>,
    metrics_calls: Arc<Mutex<usize>>,
}

async fn fake_server(mode: Mode) -> (String, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Seen::default();
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                return;
            };
            let s = s.clone();
            tokio::spawn(async move {
                let _ = handle(conn, mode, s).await;
            });
        }
    });
    (url, seen)
}

async fn read_request(conn: &mut TcpStream) -> std::io::Result<(String, String, Value)> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let header_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        let n = conn.read(&mut tmp).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..header_end]).to_string();
    let mut first = head.lines().next().unwrap_or("").split(' ');
    let method = first.next().unwrap_or("").to_string();
    let path = first.next().unwrap_or("").to_string();
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    while buf.len() < header_end + len {
        let n = conn.read(&mut tmp).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    let body = serde_json::from_slice(&buf[header_end..]).unwrap_or(Value::Null);
    Ok((method, path, body))
}

async fn chunk(conn: &mut TcpStream, data: &[u8]) -> std::io::Result<()> {
    conn.write_all(format!("{:x}\r\n", data.len()).as_bytes())
        .await?;
    conn.write_all(data).await?;
    conn.write_all(b"\r\n").await?;
    conn.flush().await
}

async fn respond(
    conn: &mut TcpStream,
    status: &str,
    ctype: &str,
    body: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body.as_bytes()).await
}

async fn handle(mut conn: TcpStream, mode: Mode, seen: Seen) -> std::io::Result<()> {
    let (method, path, body) = read_request(&mut conn).await?;
    if method == "GET" && path == "/metrics" {
        let calls = {
            let mut c = seen.metrics_calls.lock().unwrap();
            *c += 1;
            *c
        };
        // Second scrape: 70 of 100 new prompt tokens were prefix-cache hits.
        let (hit, prompt) = if calls == 1 { (5, 50) } else { (75, 150) };
        let text = format!(
            "# TYPE lockstep_prompt_tokens_total counter\nlockstep_prompt_tokens_total {prompt}\n\
             lockstep_prefix_cache_hit_tokens_total {hit}\n"
        );
        return respond(&mut conn, "200 OK", "text/plain", &text).await;
    }
    if method == "GET" && path == "/v1/models" {
        let text = json!({"object": "list", "data": [{"id": "fake-model"}]}).to_string();
        return respond(&mut conn, "200 OK", "application/json", &text).await;
    }
    seen.requests
        .lock()
        .unwrap()
        .push((path.clone(), body.clone()));
    if mode.fail {
        let text =
            json!({"error": {"message": "engine on fire", "type": "server_error"}}).to_string();
        return respond(
            &mut conn,
            "500 Internal Server Error",
            "application/json",
            &text,
        )
        .await;
    }
    if mode.stall {
        tokio::time::sleep(Duration::from_secs(30)).await;
    }
    let n = ["max_new_tokens", "max_tokens", "max_completion_tokens"]
        .iter()
        .find_map(|k| body["sampling_params"][k].as_u64().or(body[k].as_u64()))
        .unwrap_or(1) as usize;
    let prompt = body["text"]
        .as_str()
        .or(body["prompt"].as_str())
        .or(body["messages"][0]["content"].as_str())
        .unwrap_or("");
    let prompt_tokens = prompt.split_whitespace().count();
    let mut frames: Vec<String> = Vec::new();
    match path.as_str() {
        "/generate" => {
            for k in 1..=n {
                let fin = if k == n {
                    json!({"type": "length", "length": n})
                } else {
                    Value::Null
                };
                frames.push(
                    json!({
                        "text": "ab".repeat(k),
                        "output_ids": (0..k).collect::<Vec<_>>(),
                        "meta_info": {"id": "r", "prompt_tokens": prompt_tokens,
                                      "completion_tokens": k, "finish_reason": fin}
                    })
                    .to_string(),
                );
            }
        }
        "/v1/completions" => {
            for k in 1..=n {
                let fin = if k == n { json!("length") } else { Value::Null };
                frames.push(
                    json!({"choices": [{"index": 0, "text": "ab", "finish_reason": fin}]})
                        .to_string(),
                );
            }
        }
        "/v1/chat/completions" => {
            frames.push(
                json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                    .to_string(),
            );
            for _ in 1..=n {
                frames.push(
                    json!({"choices": [{"index": 0, "delta": {"content": "ab"}}]}).to_string(),
                );
            }
        }
        _ => return respond(&mut conn, "404 Not Found", "text/plain", "no").await,
    }
    if path != "/generate" {
        frames.push(
            json!({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                          "total_tokens": prompt_tokens + n}})
            .to_string(),
        );
    }
    frames.push("[DONE]".into());
    conn.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
    )
    .await?;
    for (i, f) in frames.iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(3)).await;
        let sse = format!("data: {f}\n\n");
        if i == 1 {
            // A frame split across two HTTP chunks (and so, usually, two reads).
            let (a, b) = sse.as_bytes().split_at(sse.len() / 2);
            chunk(&mut conn, a).await?;
            tokio::time::sleep(Duration::from_millis(2)).await;
            chunk(&mut conn, b).await?;
        } else {
            chunk(&mut conn, sse.as_bytes()).await?;
        }
    }
    conn.write_all(b"0\r\n\r\n").await?;
    conn.flush().await
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
}

fn args(url: &str, extra: &[&str]) -> BenchArgs {
    let mut argv = vec!["bench", "--base-url", url];
    argv.extend_from_slice(extra);
    Cli::try_parse_from(argv).unwrap().args
}

fn assert_consistent(report: &BenchReport, n: usize, out_len: usize, in_len: usize) {
    let s = &report.summary;
    assert_eq!(report.requests.len(), n);
    assert_eq!(
        (s.completed, s.failed, s.cut_off),
        (n, 0, 0),
        "{:?}",
        s.errors
    );
    assert!(s.errors.is_empty());
    assert_eq!(s.total_output_tokens, n * out_len);
    assert_eq!(s.total_input_tokens, n * in_len);
    assert!(s.duration_s > 0.0);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
    assert!(close(
        s.output_throughput,
        (n * out_len) as f64 / s.duration_s
    ));
    assert!(close(
        s.input_throughput,
        (n * in_len) as f64 / s.duration_s
    ));
    assert!(close(s.request_throughput, n as f64 / s.duration_s));
    assert!(close(
        s.total_throughput,
        (n * (in_len + out_len)) as f64 / s.duration_s
    ));
    let sum_e2e: f64 = report.requests.iter().map(|r| r.e2e_s).sum();
    assert!(close(s.concurrency, sum_e2e / s.duration_s));
    // Duration is first send to last completion.
    let first = report
        .requests
        .iter()
        .map(|r| r.start_s)
        .fold(f64::MAX, f64::min);
    let last = report
        .requests
        .iter()
        .map(|r| r.start_s + r.e2e_s)
        .fold(0.0, f64::max);
    assert!(close(s.duration_s, last - first));
    for r in &report.requests {
        assert!(r.success && r.error.is_none());
        assert_eq!(r.output_tokens, out_len);
        assert_eq!(r.prompt_tokens, in_len);
        assert!(r.prompt_tokens_from_server);
        assert!(r.ttft_s > 0.0 && r.ttft_s <= r.e2e_s);
        // One token per frame: out_len - 1 gaps.
        assert_eq!(r.itl_s.len(), out_len - 1);
        assert!(r.itl_s.iter().all(|g| *g >= 0.0));
        assert!(r.ttft_s + r.itl_s.iter().sum::<f64>() <= r.e2e_s + 1e-9);
    }
    assert_eq!(s.itl_ms.count, n * (out_len - 1));
    assert_eq!(s.tpot_ms.count, n);
    let bucketed: f64 = s.output_tokens_per_second.iter().sum();
    assert_eq!(bucketed as usize, n * out_len);
    assert!(
        s.peak_output_throughput >= s.output_throughput.min(bucketed) - 1e-9 || s.duration_s < 1.0
    );
    let mut idx: Vec<usize> = report.requests.iter().map(|r| r.index).collect();
    idx.sort();
    assert_eq!(idx, (0..n).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_wire_format_end_to_end_with_json_report() {
    for (backend, path) in [
        ("lockstep", "/generate"),
        ("sglang", "/generate"),
        ("vllm", "/v1/completions"),
        ("openai-completions", "/v1/completions"),
        ("openai-chat", "/v1/chat/completions"),
    ] {
        let (url, seen) = fake_server(Mode::default()).await;
        let dir = tempfile::tempdir().unwrap();
        let json_path = dir.path().join("r.json");
        let svg_path = dir.path().join("r.svg");
        let a = args(
            &url,
            &[
                "--backend",
                backend,
                "--num-prompts",
                "6",
                "--request-rate",
                "200",
                "--max-concurrency",
                "3",
                "--input-len",
                "8",
                "--output-len",
                "5",
                "--range-ratio",
                "1",
                "--warmup",
                "2",
                "--timeout",
                "30",
                "--output-json",
                json_path.to_str().unwrap(),
                "--plot",
                svg_path.to_str().unwrap(),
            ],
        );
        let report = run(a).await.unwrap();
        assert_consistent(&report, 6, 5, 8);
        assert!(report.rollout.is_none());
        // Warmup requests reached the server but not the report.
        let reqs = seen.requests.lock().unwrap().clone();
        assert_eq!(reqs.len(), 8, "{backend}");
        assert!(reqs.iter().all(|(p, b)| p == path && b["stream"] == true));
        // Warmup (sent first, one by one) never uses a measured prompt.
        let prompt = |b: &Value| {
            [&b["text"], &b["prompt"], &b["messages"][0]["content"]]
                .iter()
                .find_map(|v| v.as_str())
                .unwrap()
                .to_string()
        };
        let measured: Vec<String> = reqs[2..].iter().map(|(_, b)| prompt(b)).collect();
        assert!(reqs[..2]
            .iter()
            .all(|(_, b)| !measured.contains(&prompt(b))));
        if path != "/generate" {
            assert_eq!(report.config.served_model.as_deref(), Some("fake-model"));
            assert!(reqs.iter().all(|(_, b)| b["model"] == "fake-model"));
        }

        let back: BenchReport =
            serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
        assert_eq!(back.requests.len(), report.requests.len());
        for (b, r) in back.requests.iter().zip(&report.requests) {
            assert_eq!(
                (b.index, b.output_tokens, b.itl_s.len()),
                (r.index, r.output_tokens, r.itl_s.len())
            );
            assert!((b.ttft_s - r.ttft_s).abs() < 1e-12 && (b.e2e_s - r.e2e_s).abs() < 1e-12);
        }
        // Counts exactly; floats to printing precision (serde_json's default float parsing
        // may differ in the last bit).
        let (b, s) = (&back.summary, &report.summary);
        assert_eq!(
            (b.completed, b.total_output_tokens),
            (s.completed, s.total_output_tokens)
        );
        assert!((b.output_throughput - s.output_throughput).abs() < 1e-9 * s.output_throughput);
        assert!((b.itl_ms.p90 - s.itl_ms.p90).abs() < 1e-9 * s.itl_ms.p90.max(1.0));
        assert_eq!(back.config.args.backend.name(), backend);
        let raw: Value =
            serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
        assert_eq!(raw["config"]["request_rate"], "200");
        assert_eq!(raw["config"]["dataset"], "random");
        assert!(raw["config"].get("api_key").is_none());
        assert!(raw["requests"][0]["itl_s"].is_array());

        let svg = std::fs::read_to_string(&svg_path).unwrap();
        assert!(svg.contains("<svg") && svg.contains("TTFT CDF"));

        let table = render_report(&report);
        assert!(table.contains("Serving Benchmark Result"));
        assert!(table.contains("Successful requests:                     6"));
        assert!(table.contains("Median ITL (ms):"));
        if backend == "lockstep" {
            println!("{table}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rl_groups_seeds_logprobs_and_prefix_cache() {
    let (url, seen) = fake_server(Mode::default()).await;
    let a = args(
        &url,
        &[
            "--dataset",
            "rl",
            "--num-prompts",
            "3",
            "--rl-group-size",
            "4",
            "--input-len",
            "6",
            "--output-len",
            "3",
            "--range-ratio",
            "1",
            "--warmup",
            "0",
            "--return-routed-experts",
        ],
    );
    let report = run(a).await.unwrap();
    assert_consistent(&report, 12, 3, 6);
    let r = report.rollout.as_ref().unwrap();
    assert_eq!((r.groups, r.complete_groups, r.group_size), (3, 3, 4));
    assert!(r.straggler_max_s >= r.straggler_mean_s && r.straggler_mean_s > 0.0);
    assert_eq!(r.samples_per_s, report.summary.request_throughput);
    let p = r.prefix_cache.as_ref().unwrap();
    assert_eq!((p.hit_tokens, p.prompt_tokens), (70.0, 100.0));
    assert!((p.hit_rate - 0.7).abs() < 1e-12);

    let reqs = seen.requests.lock().unwrap().clone();
    assert_eq!(reqs.len(), 12);
    for (_, b) in &reqs {
        assert_eq!(b["return_logprob"], true);
        assert_eq!(b["return_routed_experts"], true);
    }
    // Each prompt is sent with seeds 0..4, once each.
    let mut by_prompt: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    for (_, b) in &reqs {
        by_prompt
            .entry(b["text"].as_str().unwrap().to_string())
            .or_default()
            .push(b["sampling_params"]["sampling_seed"].as_u64().unwrap());
    }
    assert_eq!(by_prompt.len(), 3);
    for seeds in by_prompt.values_mut() {
        seeds.sort();
        assert_eq!(seeds, &vec![0, 1, 2, 3]);
    }
    assert!(render_report(&report).contains("Prefix cache hit rate:                   70.00%"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_reported_not_raised() {
    let (url, _) = fake_server(Mode {
        fail: true,
        ..Default::default()
    })
    .await;
    let base = [
        "--num-prompts",
        "4",
        "--input-len",
        "4",
        "--output-len",
        "2",
    ];
    let mut with_warmup = base.to_vec();
    with_warmup.extend(["--warmup", "1"]);
    match run(args(&url, &with_warmup)).await {
        Err(BenchError::Warmup(msg)) => {
            assert!(msg.contains("HTTP 500") && msg.contains("engine on fire"))
        }
        other => panic!("expected a warmup error, got {other:?}"),
    }
    let mut no_warmup = base.to_vec();
    no_warmup.extend(["--warmup", "0"]);
    let report = run(args(&url, &no_warmup)).await.unwrap();
    let s = &report.summary;
    assert_eq!((s.completed, s.failed), (0, 4));
    assert_eq!(s.errors.len(), 1);
    assert!(s.errors.keys().next().unwrap().contains("engine on fire"));
    assert_eq!(s.output_throughput, 0.0);
    assert!(render_report(&report).contains("engine on fire"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_limit_cuts_off_a_stalled_server() {
    let (url, _) = fake_server(Mode {
        stall: true,
        ..Default::default()
    })
    .await;
    let a = args(
        &url,
        &[
            "--num-prompts",
            "3",
            "--max-concurrency",
            "1",
            "--warmup",
            "0",
            "--timeout",
            "0.3",
        ],
    );
    let started = std::time::Instant::now();
    let report = run(a).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    let s = &report.summary;
    assert_eq!((s.completed, s.failed, s.cut_off), (0, 0, 3));
    // One was sent and cut mid-flight; two never got a slot.
    assert_eq!(
        report
            .requests
            .iter()
            .filter(|r| r.error.as_deref().unwrap().starts_with("never sent"))
            .count(),
        2
    );
}

#[test]
fn argument_limits_name_the_flag() {
    let bad = [
        (vec!["--num-prompts", "0"], "num-prompts"),
        (vec!["--max-concurrency", "0"], "max-concurrency"),
        (vec!["--range-ratio", "1.5"], "range-ratio"),
        (vec!["--plot", "x.png"], "plot"),
        (vec!["--timeout", "0"], "timeout"),
    ];
    for (extra, flag) in bad {
        let err = args("http://127.0.0.1:1", &extra).check().unwrap_err();
        assert!(err.to_string().starts_with(&format!("--{flag}")), "{err}");
    }
    assert!(Cli::try_parse_from(["b", "--request-rate", "-1"]).is_err());
    assert!(Cli::try_parse_from(["b", "--dataset", "sharegpt:"]).is_err());
    let a = args(
        "http://x:1",
        &["--request-rate", "INF", "--dataset", "sharegpt:/d.json"],
    );
    assert!(a.request_rate.is_inf());
    assert_eq!(a.dataset, Dataset::ShareGpt("/d.json".into()));
}

#[tokio::test]
async fn missing_tokenizer_is_an_error() {
    let a = args(
        "http://127.0.0.1:1",
        &["--tokenizer", "/nowhere/tokenizer.json"],
    );
    assert!(matches!(run(a).await, Err(BenchError::Tokenizer(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_tokenizer_prompts_are_sized_in_its_tokens() {
    let tok: Arc<dyn BenchTokenizer> = Arc::new(crate::tokenizer::Tokenizer::embedded());
    let spec = dataset::RandomSpec {
        num_prompts: 5,
        input_len: 12,
        output_len: 3,
        range_ratio: 1.0,
    };
    for arrival in dataset::random(&spec, &mut rng::BenchRng::new(4), Some(&tok)) {
        let r = &arrival[0];
        assert_eq!(r.prompt_len, tok.encode(&r.prompt).len());
    }
    let (url, _) = fake_server(Mode::default()).await;
    let a = args(
        &url,
        &[
            "--num-prompts",
            "3",
            "--input-len",
            "12",
            "--output-len",
            "3",
            "--warmup",
            "0",
        ],
    );
    let report = run_with_tokenizer(a, Some(tok)).await.unwrap();
    assert_eq!(report.summary.completed, 3);
}
