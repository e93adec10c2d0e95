//! Live weight updates against real `lockstep serve` processes over loopback: `lockstep push`
//! to several servers (exactness against a fresh server, abort everywhere on failure), pause
//! modes around an update, and resident memory across 200 consecutive updates.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lockstep::checkpoint::{to_f32, write_file, Checkpoint, OwnedTensor};
use lockstep::push::client::{RetryPolicy, Server};
use lockstep::push::{push_checkpoint, push_tensors, PushError, PushOptions};
use serde_json::{json, Value};

/// One `lockstep serve` process on a free port, killed on drop.
struct Proc {
    child: Child,
    url: String,
    log: tempfile::NamedTempFile,
}

impl Proc {
    async fn start(args: &[&str]) -> Proc {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
            .args(["serve", "--port", &port.to_string(), "--log-level", "warn"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap();
        let p = Proc {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        };
        // Start-up (a model load) has a generous deadline; nothing is measured by it.
        let deadline = Instant::now() + Duration::from_secs(120);
        let client = p.client();
        while client.get("/health").await.is_err() {
            assert!(
                Instant::now() < deadline,
                "server did not start: {}",
                std::fs::read_to_string(p.log.path()).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        p
    }

    fn client(&self) -> Server {
        Server::new(&self.url, None, policy()).unwrap()
    }

    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn policy() -> RetryPolicy {
    RetryPolicy {
        retries: 2,
        backoff: Duration::from_millis(100),
        timeout: Duration::from_secs(120),
    }
}

fn options(servers: &[&Proc]) -> PushOptions {
    PushOptions {
        servers: servers.iter().map(|p| p.url.clone()).collect(),
        api_key: None,
        bucket_bytes: 64 << 10,
        weight_version: None,
        recipe: None,
        quantize_on_client: false,
        pause_mode: None,
        retry: policy(),
        progress: false,
    }
}

/// `dir` = the reference Qwen3-MoE checkpoint with every tensor scaled and stored as BF16,
/// plus a minimal tokenizer.
fn bf16_checkpoint(dir: &Path, scale: f32) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/reference/qwen3_moe");
    let ckpt = Checkpoint::open(&src).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let mut tensors = BTreeMap::new();
    for n in ckpt.names() {
        let t = ckpt.tensor(n).unwrap();
        let v: Vec<f32> = to_f32(n, &t).unwrap().iter().map(|x| x * scale).collect();
        tensors.insert(n.to_string(), OwnedTensor::bf16(t.shape().to_vec(), &v));
    }
    write_file(&dir.join("model.safetensors"), &tensors, None).unwrap();
    let tokenizer = r#"{"version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hello": 1}, "unk_token": "<unk>"}}"#;
    std::fs::write(dir.join("tokenizer.json"), tokenizer).unwrap();
}

/// Three BF16 checkpoints of the reference model, its weights scaled by 1, 1.25 and 0.75, in
/// one temporary directory.
fn three_checkpoints() -> (tempfile::TempDir, [std::path::PathBuf; 3]) {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = [("a", 1.0), ("b", 1.25), ("c", 0.75)].map(|(name, scale)| {
        let dir = tmp.path().join(name);
        bf16_checkpoint(&dir, scale);
        dir
    });
    (tmp, dirs)
}

const GREEDY: &str = r#"{"input_ids": [5, 17, 300, 42], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}, "return_logprob": true}"#;

async fn generate(s: &Server, body: &str) -> Value {
    s.post("/generate", &serde_json::from_str(body).unwrap(), false)
        .await
        .unwrap()
}

async fn overall(s: &Server) -> String {
    s.get("/weights_checksum").await.unwrap()["overall"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn version(s: &Server) -> String {
    s.get("/get_weight_version").await.unwrap()["weight_version"]
        .as_str()
        .unwrap()
        .to_string()
}

/// `lockstep push` to two servers: both move to the new version and checksum and then compute
/// bitwise what a fresh server on the new weights computes. Client-side quantization lands on
/// the same bytes as server-side quantization.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_updates_every_server_exactly() {
    let (_tmp, [a, b, c]) = three_checkpoints();
    let q = ["--quantization", "nvfp4_online"];
    let model = |d: &Path| d.to_str().unwrap().to_string();
    let (ma, mb) = (model(&a), model(&b));
    let s1 = Proc::start(&[&["--model-path", &ma][..], &q].concat()).await;
    let s2 = Proc::start(&[&["--model-path", &ma][..], &q].concat()).await;
    let fresh = Proc::start(&[&["--model-path", &mb][..], &q].concat()).await;
    let before = generate(&s1.client(), GREEDY).await;

    let report = push_checkpoint(&options(&[&s1, &s2]), &b).await.unwrap();
    assert!(report.buckets > 1, "64 KiB buckets split the checkpoint");
    assert_eq!(report.weight_version, "1", "default -> 1");
    let want = overall(&fresh.client()).await;
    let expected = generate(&fresh.client(), GREEDY).await;
    for s in [&s1, &s2] {
        let c = s.client();
        assert_eq!(version(&c).await, "1");
        assert_eq!(overall(&c).await, want, "the fresh server's checksum");
        let after = generate(&c, GREEDY).await;
        assert_eq!(after["meta_info"]["weight_version"], "1");
        assert_eq!(after["output_ids"], expected["output_ids"]);
        assert_eq!(
            after["meta_info"]["output_token_logprobs"],
            expected["meta_info"]["output_token_logprobs"],
            "bitwise a fresh server on the new weights"
        );
        assert_ne!(
            after["meta_info"]["output_token_logprobs"],
            before["meta_info"]["output_token_logprobs"]
        );
    }

    // The same new weights quantized by the client to s1 and by the server on s2.
    let mut client_side = options(&[&s1]);
    client_side.quantize_on_client = true;
    client_side.weight_version = Some("c".into());
    let r1 = push_checkpoint(&client_side, &c).await.unwrap();
    assert!(
        r1.staged_tensors > r1.tensors,
        "NVFP4 slots travel as weight + scales"
    );
    let mut server_side = options(&[&s2]);
    server_side.weight_version = Some("c".into());
    push_checkpoint(&server_side, &c).await.unwrap();
    assert_eq!(overall(&s1.client()).await, overall(&s2.client()).await);
    assert_ne!(overall(&s1.client()).await, want);
    assert_eq!(
        generate(&s1.client(), GREEDY).await["meta_info"]["output_token_logprobs"],
        generate(&s2.client(), GREEDY).await["meta_info"]["output_token_logprobs"]
    );
}

/// A model many times the staging limit streams through: a dense weight with no gate/up
/// partner is a whole slot, prepared as it arrives, and never counts against the limit. The
/// server ends on the checkpoint's exact weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_larger_than_the_staging_limit_succeeds() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    bf16_checkpoint(&a, 1.0);
    bf16_checkpoint(&b, 1.25);
    let model = |d: &Path| d.to_str().unwrap().to_string();
    let (ma, mb) = (model(&a), model(&b));
    // The BF16 checkpoint is 441 KB in 64 KiB buckets; the limit also bounds one bucket's body.
    let s = Proc::start(&["--model-path", &ma, "--max-staged-weight-bytes", "100000"]).await;
    let fresh = Proc::start(&["--model-path", &mb]).await;
    let report = push_checkpoint(&options(&[&s]), &b).await.unwrap();
    assert!(report.buckets > 1, "{report:?}");
    let c = s.client();
    assert_eq!(version(&c).await, "1");
    assert_eq!(overall(&c).await, overall(&fresh.client()).await);
    assert_eq!(
        generate(&c, GREEDY).await["meta_info"]["output_token_logprobs"],
        generate(&fresh.client(), GREEDY).await["meta_info"]["output_token_logprobs"],
        "bitwise a fresh server on the new weights"
    );
}

/// An in-place update past `--max-prepared-weight-bytes` (here one byte: every prepared slot)
/// waits on disk, in an unlinked file of `--weight-spill-dir`, and is read back a layer at a
/// time during the commit: the server ends on the checkpoint's exact weights, NVFP4 experts
/// (quantized on arrival, read back as their parts) included, with the overwritten slots kept
/// for a rollback (`--weight-update-rollback`) on the way; an aborted session leaves the served
/// weights as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_place_update_past_the_memory_bound_waits_on_disk_and_lands_exactly() {
    let (tmp, [a, b, c]) = three_checkpoints();
    let spill = tmp.path().join("spill");
    std::fs::create_dir(&spill).unwrap();
    let q = ["--quantization", "nvfp4_online"];
    let model = |d: &Path| d.to_str().unwrap().to_string();
    let (ma, mb, dir) = (model(&a), model(&b), model(&spill));
    let args = [
        "--model-path",
        &ma,
        "--weight-update-shadow",
        "off",
        "--max-prepared-weight-bytes",
        "1",
        "--weight-spill-dir",
        &dir,
        "--weight-update-rollback",
    ];
    let s = Proc::start(&[&args[..], &q].concat()).await;
    let fresh = Proc::start(&[&["--model-path", &mb][..], &q].concat()).await;
    let cl = s.client();

    // One bucket by hand: it is staged in place, and spilled.
    let (session, staged) = stage(&cl, bucket_of(&c, "layers.1.mlp")).await;
    assert_eq!(staged["mode"], "in_place", "{staged}");
    assert!(staged["spilled_bytes"].as_u64().unwrap() > 0, "{staged}");
    assert_eq!(
        std::fs::read_dir(&spill).unwrap().count(),
        0,
        "the spill file is unlinked"
    );
    let before = overall(&cl).await;
    cl.post("/abort_weight_update", &json!({"session": session}), false)
        .await
        .unwrap();
    assert_eq!(
        overall(&cl).await,
        before,
        "an aborted session changes nothing"
    );

    let report = push_checkpoint(&options(&[&s]), &b).await.unwrap();
    assert!(report.buckets > 1, "{report:?}");
    assert_eq!(report.servers[0].mode.as_deref(), Some("in_place"));
    assert_eq!(version(&cl).await, "1");
    assert_eq!(overall(&cl).await, overall(&fresh.client()).await);
    assert_eq!(
        generate(&cl, GREEDY).await["meta_info"]["output_token_logprobs"],
        generate(&fresh.client(), GREEDY).await["meta_info"]["output_token_logprobs"],
        "bitwise a fresh server on the new weights"
    );
}

/// One server refusing a bucket (its limit, which also bounds one bucket, is below the 64 KiB
/// buckets) aborts the push on every server: both keep the old weights and version, and
/// neither keeps a session open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_server_aborts_the_push_everywhere() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    bf16_checkpoint(&a, 1.0);
    bf16_checkpoint(&b, 1.25);
    let ma = a.to_str().unwrap().to_string();
    let s1 = Proc::start(&["--model-path", &ma]).await;
    let s2 = Proc::start(&["--model-path", &ma, "--max-staged-weight-bytes", "30000"]).await;
    let sums = (overall(&s1.client()).await, overall(&s2.client()).await);
    let out = generate(&s1.client(), GREEDY).await;

    let err = push_checkpoint(&options(&[&s1, &s2]), &b)
        .await
        .unwrap_err();
    match &err {
        PushError::Server { url, reason } => {
            assert_eq!(url, &s2.url, "{err}");
            assert!(reason.contains("max-staged-weight-bytes"), "{err}");
        }
        other => panic!("{other}"),
    }
    for (s, sum) in [(&s1, &sums.0), (&s2, &sums.1)] {
        let c = s.client();
        assert_eq!(version(&c).await, "default");
        assert_eq!(&overall(&c).await, sum);
        // The session was aborted: a new one opens at once.
        let v = c
            .post(
                "/begin_weight_update",
                &json!({"weight_version": "x"}),
                false,
            )
            .await
            .unwrap();
        c.post(
            "/abort_weight_update",
            &json!({"session": v["session"]}),
            false,
        )
        .await
        .unwrap();
    }
    assert_eq!(
        generate(&s1.client(), GREEDY).await["meta_info"]["output_token_logprobs"],
        out["meta_info"]["output_token_logprobs"],
        "the old weights still serve"
    );
}

/// The embedded model's weights from another seed, in checkpoint layout.
fn embedded_weights(seed: u64) -> Vec<(String, OwnedTensor)> {
    let cfg = lockstep::model::ModelConfig::from_json(
        serde_json::from_str(lockstep::serve::EMBEDDED_CONFIG).unwrap(),
    )
    .unwrap();
    let recipe = lockstep::quant::Recipe::bf16();
    let mut model = lockstep::model::loader::dummy_model(cfg, &recipe, seed).unwrap();
    model.checkpoint_tensors()
}

fn views(t: &[(String, OwnedTensor)]) -> Vec<(String, safetensors::tensor::TensorView<'_>)> {
    t.iter()
        .map(|(n, t)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect()
}

/// 200 consecutive streamed updates (alternating two weight sets) leave the server's
/// resident memory where it was after 20: updates do not leak staging or old weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_updates_do_not_grow_resident_memory() {
    let s = Proc::start(&[]).await;
    let sets = [embedded_weights(1), embedded_weights(2)];
    let model_bytes: usize = sets[0].iter().map(|(_, t)| t.data.len()).sum();
    let mut opts = options(&[&s]);
    opts.bucket_bytes = 1 << 30;
    let mut rss_at_20 = 0;
    for i in 1..=200 {
        opts.weight_version = Some(i.to_string());
        push_tensors(&opts, views(&sets[i % 2])).await.unwrap();
        if i == 20 {
            rss_at_20 = s.rss_kib();
        }
    }
    let rss_at_200 = s.rss_kib();
    assert_eq!(version(&s.client()).await, "200");
    // Tolerance: two model copies (the update's staged tensors plus its replacements can sit
    // in the allocator's free lists between updates) plus 8 MiB of allocator arenas. A leak of
    // even 2% of each update would exceed it: 180 updates x 2% = 3.6 model copies.
    let tolerance_kib = (2 * model_bytes / 1024 + 8 * 1024) as u64;
    eprintln!(
        "VmRSS after 20 updates {rss_at_20} KiB, after 200 {rss_at_200} KiB (model {} KiB)",
        model_bytes / 1024
    );
    assert!(
        rss_at_200 <= rss_at_20 + tolerance_kib,
        "VmRSS {rss_at_20} KiB after 20 updates, {rss_at_200} KiB after 200 (tolerance {tolerance_kib} KiB, model {} KiB)",
        model_bytes / 1024
    );
}

/// A long greedy request, started in the background; returns once it has produced tokens.
async fn long_request(s: &Proc, max_new_tokens: usize) -> tokio::task::JoinHandle<Value> {
    let c = s.client();
    let baseline = generated_tokens(&c).await;
    let body = json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": true}});
    let worker = s.client();
    let task = tokio::spawn(async move { worker.post("/generate", &body, false).await.unwrap() });
    while generated_tokens(&c).await == baseline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    task
}

async fn generated_tokens(c: &Server) -> u64 {
    c.get("/get_server_info").await.unwrap()["generated_tokens"]
        .as_u64()
        .expect("generated_tokens in /get_server_info")
}

/// Requests running or queued.
async fn in_flight(c: &Server) -> u64 {
    let info = c.get("/get_server_info").await.unwrap();
    info["num_running_reqs"].as_u64().unwrap() + info["num_queue_reqs"].as_u64().unwrap()
}

const LONG: usize = 3000;

/// Pause modes around an update: abort finishes the request with finish_reason abort and
/// partial output; retract and in_place finish it on the new weights after
/// /continue_generation, with weight_versions spans showing both versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_modes_around_an_update() {
    let s = Proc::start(&[]).await;
    let c = s.client();
    let new = embedded_weights(7);

    // abort, through `lockstep push --pause-mode abort`.
    let req = long_request(&s, LONG).await;
    let mut opts = options(&[&s]);
    opts.bucket_bytes = 1 << 30;
    opts.pause_mode = Some(lockstep::engine::PauseMode::Abort);
    opts.weight_version = Some("v1".into());
    push_tensors(&opts, views(&new)).await.unwrap();
    let out = req.await.unwrap();
    assert_eq!(out["meta_info"]["finish_reason"]["type"], "abort", "{out}");
    let n = out["output_ids"].as_array().unwrap().len();
    assert!(n > 0 && n < LONG, "partial output: {n} tokens");
    assert_eq!(out["meta_info"]["completion_tokens"], n);

    // retract and in_place: paused, updated while paused, continued.
    for (mode, version, seed) in [("retract", "v2", 8), ("in_place", "v3", 9)] {
        let req = long_request(&s, LONG).await;
        let paused = c
            .post("/pause_generation", &json!({"mode": mode}), false)
            .await
            .unwrap();
        assert_eq!(paused["success"], true, "{paused}");
        let mut opts = options(&[&s]);
        opts.bucket_bytes = 1 << 30;
        opts.weight_version = Some(version.into());
        push_tensors(&opts, views(&embedded_weights(seed)))
            .await
            .unwrap();
        assert_eq!(
            in_flight(&c).await,
            1,
            "{mode}: the request waits for continue"
        );
        c.post("/continue_generation", &json!({}), false)
            .await
            .unwrap();
        let out = req.await.unwrap();
        let meta = &out["meta_info"];
        assert_eq!(meta["finish_reason"]["type"], "length", "{mode}: {out}");
        assert_eq!(meta["completion_tokens"], LONG);
        assert_eq!(meta["weight_version"], version);
        let spans = meta["weight_versions"].as_array().unwrap();
        assert!(spans.len() >= 2, "{mode}: {spans:?}");
        assert_eq!(spans.last().unwrap()["version"], version, "{mode}");
        assert_ne!(
            spans[0]["version"], version,
            "{mode}: earlier tokens on the old weights"
        );
        assert_eq!(spans.last().unwrap()["end"], LONG);
    }
}

/// A bucket PUT that fails with a 5xx is retried (bounded), a 4xx is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_buckets_are_retried_within_the_bound_and_refusals_are_not() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    // A stand-in server: answers `status` to the first `failures` PUTs, then 200.
    async fn flaky(status: u16, failures: usize) -> (String, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let app = axum::Router::new().route(
            "/update_weights",
            axum::routing::put(move || {
                let n = seen.fetch_add(1, Ordering::SeqCst);
                async move {
                    let code = if n < failures { status } else { 200 };
                    (
                        axum::http::StatusCode::from_u16(code).unwrap(),
                        axum::Json(json!({"success": code == 200, "message": "stand-in"})),
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (url, calls)
    }
    let with_retries = |url: &str, retries| {
        Server::new(
            url,
            None,
            RetryPolicy {
                retries,
                backoff: Duration::from_millis(1),
                timeout: Duration::from_secs(30),
            },
        )
        .unwrap()
    };
    let body = bytes::Bytes::from_static(b"bucket");

    let (url, calls) = flaky(503, 2).await;
    assert!(with_retries(&url, 2)
        .put_bucket("s", body.clone())
        .await
        .is_ok());
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "two failures, then success"
    );

    let (url, calls) = flaky(503, 2).await;
    assert!(with_retries(&url, 1)
        .put_bucket("s", body.clone())
        .await
        .is_err());
    assert_eq!(calls.load(Ordering::SeqCst), 2, "one retry, no more");

    let (url, calls) = flaky(400, 1).await;
    let err = with_retries(&url, 3)
        .put_bucket("s", body)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("400"), "{err}");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "a refusal is not retried");
}

/// The `lockstep push` command itself: flags to options, the JSON report, the exit status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_push_command_updates_a_server_and_reports() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    bf16_checkpoint(&a, 1.0);
    bf16_checkpoint(&b, 1.25);
    let s = Proc::start(&["--model-path", a.to_str().unwrap()]).await;
    let push = |extra: &[&str]| {
        let mut args = vec![
            "push",
            "--server",
            &s.url,
            "--checkpoint",
            b.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
            .args(&args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, stdout, stderr) = push(&["--weight-version", "cli", "--bucket-mb", "1", "--json"]);
    assert!(ok, "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["weight_version"], "cli");
    assert!(report["buckets"].as_u64().unwrap() >= 1);
    assert_eq!(
        report["servers"][0]["checksum"],
        json!(overall(&s.client()).await)
    );
    assert!(stderr.contains("GB/s"), "{stderr}");
    assert_eq!(version(&s.client()).await, "cli");

    // A bad flag value fails with the flag named, before anything is sent.
    let (ok, _, stderr) = push(&["--bucket-mb", "0"]);
    assert!(!ok);
    assert!(stderr.contains("bucket-mb"), "{stderr}");
    assert_eq!(version(&s.client()).await, "cli");
}

/// One bucket of the checkpoint in `dir`: its tensors whose names contain `part`.
fn bucket_of(dir: &Path, part: &str) -> bytes::Bytes {
    let ckpt = Checkpoint::open(dir).unwrap();
    let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = ckpt
        .names()
        .filter(|n| n.contains(part))
        .map(|n| (n.to_string(), ckpt.tensor(n).unwrap()))
        .collect();
    assert!(!tensors.is_empty(), "no tensor of {part}");
    safetensors::serialize(tensors, None).unwrap().into()
}

/// Opens a session and stages one bucket; returns the session id and the bucket's answer.
async fn stage(c: &Server, bucket: bytes::Bytes) -> (String, Value) {
    let begun = c
        .post("/begin_weight_update", &json!({}), false)
        .await
        .unwrap();
    let session = begun["session"].as_str().unwrap().to_string();
    let staged = c.put_bucket(&session, bucket).await.unwrap();
    (session, staged)
}

fn status_of(r: Result<Value, lockstep::push::client::CallError>) -> (u16, String) {
    match r {
        Err(lockstep::push::client::CallError::Status { status, message }) => {
            (status.as_u16(), message)
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Streamed into a shadow copy (`--weight-update-shadow on`): a push lands the bits of a fresh
/// server, as one written in place does, and each server says which way it wrote. A commit
/// whose checksum does not match, or that another update overtook while it streamed, changes
/// nothing of what is served; the weights' memory is not released while a shadow exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_into_a_shadow_copy_lands_the_same_bits_and_a_refused_commit_changes_nothing() {
    let (tmp, [a, b, c]) = three_checkpoints();
    let q = ["--quantization", "nvfp4_online"];
    let model = |d: &Path| d.to_str().unwrap().to_string();
    let (ma, mb, root) = (model(&a), model(&b), model(tmp.path()));
    let shadow_args = ["--model-path", &ma, "--weight-update-shadow", "on"];
    let root_args = ["--weights-root", &root];
    let shadow = Proc::start(&[&shadow_args[..], &q, &root_args].concat()).await;
    let in_place_args = ["--model-path", &ma, "--weight-update-shadow", "off"];
    let in_place = Proc::start(&[&in_place_args[..], &q].concat()).await;
    let fresh = Proc::start(&[&["--model-path", &mb][..], &q].concat()).await;

    let report = push_checkpoint(&options(&[&shadow, &in_place]), &b)
        .await
        .unwrap();
    assert!(report.buckets > 1, "{report:?}");
    let modes: Vec<_> = report.servers.iter().map(|s| s.mode.as_deref()).collect();
    assert_eq!(modes, [Some("shadow"), Some("in_place")]);
    let want = overall(&fresh.client()).await;
    let expected = generate(&fresh.client(), GREEDY).await;
    for s in [&shadow, &in_place] {
        let cl = s.client();
        assert_eq!(overall(&cl).await, want);
        assert_eq!(
            generate(&cl, GREEDY).await["meta_info"]["output_token_logprobs"],
            expected["meta_info"]["output_token_logprobs"],
            "bitwise a fresh server on the new weights"
        );
    }

    // A checksum that does not match: the shadow is dropped, the served weights stay.
    let s = shadow.client();
    let (session, staged) = stage(&s, bucket_of(&c, "layers.0.self_attn")).await;
    assert_eq!(staged["mode"], "shadow", "{staged}");
    let end = json!({"session": session, "checksum": "0123456789abcdef"});
    let (code, message) = status_of(s.post("/end_weight_update", &end, false).await);
    assert_eq!(code, 400, "{message}");
    assert!(message.contains("checksum mismatch"), "{message}");
    assert_eq!(version(&s).await, "1");
    assert_eq!(overall(&s).await, want);
    assert_eq!(
        generate(&s, GREEDY).await["meta_info"]["output_token_logprobs"],
        expected["meta_info"]["output_token_logprobs"]
    );

    // While a shadow exists its memory is taken: no release until the session ends.
    let (session, _) = stage(&s, bucket_of(&c, "layers.0.self_attn")).await;
    let (code, message) = status_of(
        s.post("/release_memory_occupation", &json!({}), false)
            .await,
    );
    assert_eq!(code, 409, "{message}");
    assert!(message.contains("shadow copy"), "{message}");
    s.post("/abort_weight_update", &json!({"session": session}), false)
        .await
        .unwrap();
    s.post("/release_memory_occupation", &json!({}), false)
        .await
        .unwrap();
    s.post("/resume_memory_occupation", &json!({}), false)
        .await
        .unwrap();

    // An update from disk commits while a session streams into a shadow of the weights it
    // replaced: that session's commit is refused and the update from disk stays served.
    let (session, _) = stage(&s, bucket_of(&c, "layers.0.self_attn")).await;
    let disk = json!({"model_path": model(&c), "weight_version": "disk"});
    s.post("/update_weights_from_disk", &disk, false)
        .await
        .unwrap();
    let from_disk = overall(&s).await;
    assert_ne!(from_disk, want);
    let (code, message) = status_of(
        s.post("/end_weight_update", &json!({"session": session}), false)
            .await,
    );
    assert_eq!(code, 409, "{message}");
    assert!(
        message.contains("other weights were swapped in"),
        "{message}"
    );
    assert_eq!(version(&s).await, "disk");
    assert_eq!(overall(&s).await, from_disk);
}

/// A trainer that goes away mid-update: its session, idle past `--weight-update-timeout-s`, is
/// dropped by the server on its own, shadow copy and all, so the weights' memory can be
/// released again and a new session opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_session_is_dropped_with_its_shadow() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    bf16_checkpoint(&a, 1.0);
    bf16_checkpoint(&b, 1.25);
    let ma = a.to_str().unwrap().to_string();
    let args = [
        "--model-path",
        &ma,
        "--weight-update-shadow",
        "on",
        "--weight-update-timeout-s",
        "1",
    ];
    let s = Proc::start(&args).await;
    let c = s.client();
    let sum = overall(&c).await;
    let bucket = bucket_of(&b, "layers.0.self_attn");
    let (session, staged) = stage(&c, bucket.clone()).await;
    assert_eq!(staged["mode"], "shadow", "{staged}");
    // No request comes; the server drops the session by itself once it is idle past 1 s. Until
    // then a bucket for it is refused as timed out (409, the session still held); once dropped,
    // the session is unknown (404).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, message) = status_of(c.put_bucket(&session, bucket.clone()).await);
        if code == 404 {
            break;
        }
        assert_eq!(code, 409, "{message}");
        assert!(message.contains("timed out"), "{message}");
        assert!(Instant::now() < deadline, "never dropped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.post("/release_memory_occupation", &json!({}), false)
        .await
        .unwrap();
    c.post("/resume_memory_occupation", &json!({}), false)
        .await
        .unwrap();
    assert_eq!(overall(&c).await, sum, "nothing of the session was served");
    assert_eq!(version(&c).await, "default");
}
