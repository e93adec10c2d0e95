//! `lockstep train` against a real server on a socket (the embedded model on the CPU): the
//! trainer's logprobs match the rollouts' exactly at every step, every push moves the server's
//! weight_version and changes what it generates, and GRPO raises the reward on the easiest task.

use lockstep::train::metrics::StepMetrics;
use lockstep::train::{TrainArgs, Trainer};
use serde_json::{json, Value};

mod common;

/// Starts `lockstep serve` with `extra` flags on a free port, on its own thread.
fn serve(extra: &[&str]) -> String {
    let mut flags = vec!["--enable-return-routed-experts"];
    flags.extend_from_slice(extra);
    common::server::spawn_server(common::server::serve_args(&flags))
}

fn train_args(server: &str, extra: &[&str]) -> TrainArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        train: TrainArgs,
    }
    let metrics = tempfile::NamedTempFile::new().unwrap().into_temp_path();
    let mut argv = vec![
        "lockstep".to_string(),
        "--server".into(),
        server.into(),
        "--metrics".into(),
        metrics.to_str().unwrap().into(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    let args = Cli::parse_from(argv).train;
    metrics.keep().unwrap();
    args
}

/// A greedy completion with its logprobs and the weight version that produced it.
fn probe(server: &str) -> (Vec<u64>, Vec<f64>, String) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let body = json!({"input_ids": [99, 58, 97, 98, 61], "return_logprob": true,
                      "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": true}});
    let v: Value = rt.block_on(async {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<bytes::Bytes>>();
        let req = hyper::Request::post(format!("{server}/generate"))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_string(),
            )))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        use http_body_util::BodyExt;
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap()
    });
    let m = &v["meta_info"];
    (
        v["output_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect(),
        m["output_token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e[0].as_f64().unwrap())
            .collect(),
        m["weight_version"].as_str().unwrap().to_string(),
    )
}

/// `GET path` on the server, as JSON.
fn get_json(server: &str, path: &str) -> Value {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<bytes::Bytes>>();
        let req = hyper::Request::get(format!("{server}{path}"))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        use http_body_util::BodyExt;
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap()
    })
}

fn mean(steps: &[StepMetrics]) -> f64 {
    steps.iter().map(|m| m.reward_mean).sum::<f64>() / steps.len() as f64
}

/// Every step samples from the weights pushed after the step before, the trainer's logprobs
/// equal the rollout's (mismatch exactly 0, with routing replay, MXFP8 on both sides), and
/// the pushes change what the server computes.
#[test]
fn every_push_moves_the_version_and_the_outputs() {
    let server = serve(&["--quantization", "mxfp8"]);
    let before = probe(&server);
    assert_eq!(before.2, "default");
    let plots = tempfile::tempdir().unwrap();
    let args = train_args(
        &server,
        &[
            "--plots",
            plots.path().to_str().unwrap(),
            "--quantization",
            "mxfp8",
            "--routing-replay",
            "--backward-mode",
            "quantized",
            "--steps",
            "3",
            "--warmup-steps",
            "1",
            "--prompts-per-step",
            "4",
            "--samples-per-prompt",
            "4",
        ],
    );
    let mut trainer = Trainer::new(args).unwrap();
    let steps = trainer.run(false).unwrap();
    let grpo: Vec<&StepMetrics> = steps.iter().filter(|m| m.phase == "grpo").collect();
    assert_eq!(grpo.len(), 3);
    // Version train-1 is the post-warm-up push; step k samples from train-(k+1).
    for (k, m) in grpo.iter().enumerate() {
        assert_eq!(m.rollout_weight_versions, vec![format!("train-{}", k + 1)]);
        assert_eq!(m.pushed_version, format!("train-{}", k + 2));
        assert!(m.mismatch.tokens > 0);
        assert_eq!((m.mismatch.max_abs, m.mismatch.k3), (0.0, 0.0), "step {k}");
    }
    let after = probe(&server);
    assert_eq!(after.2, "train-4");
    assert_ne!(
        (before.0, before.1),
        (after.0, after.1),
        "new weights change the outputs"
    );
    // The server holds exactly what the trainer quantized and pushed: its checksum equals the
    // trainer's own serving model's (built by the loader, not by the push), and the one the
    // push reported.
    let held = get_json(&server, "/weights_checksum");
    let held = held["overall"].as_str().unwrap();
    assert_eq!(held, trainer.serving_checksum().unwrap());
    assert_eq!(held, grpo.last().unwrap().pushed_checksum);
    // The metrics file has the settings line, then one line per step.
    let text = std::fs::read_to_string(&trainer.args.metrics).unwrap();
    assert_eq!(text.lines().count(), 1 + steps.len());
    for name in ["reward.png", "mismatch.png"] {
        let bytes = std::fs::read(plots.path().join(name)).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{name} is a PNG");
    }
}

/// A real learning signal on the easiest task, fixed seeds: the mean reward of the last five
/// steps clearly exceeds that of the first five.
#[test]
fn grpo_raises_the_reward_on_copy() {
    let server = serve(&[]);
    let args = train_args(
        &server,
        &[
            "--task", "copy", "--steps", "30", "--lr", "5e-4", "--seed", "1",
        ],
    );
    let steps = Trainer::new(args).unwrap().run(false).unwrap();
    let grpo: Vec<StepMetrics> = steps.into_iter().filter(|m| m.phase == "grpo").collect();
    let (first, last) = (mean(&grpo[..5]), mean(&grpo[grpo.len() - 5..]));
    eprintln!("reward first 5 steps {first:.3}, last 5 steps {last:.3}");
    assert!(last > first + 0.1, "reward {first:.3} -> {last:.3}");
    for m in &grpo {
        assert_eq!(m.mismatch.max_abs, 0.0);
    }
}

/// Two servers: groups are spread over both, both receive every push (paused in place around
/// each commit), and afterwards they
/// hold the same weights (same greedy outputs and logprobs, bit for bit). The saved master
/// weights resume into a trainer whose first push reproduces those outputs.
#[test]
fn two_servers_stay_in_lockstep_and_a_saved_run_resumes() {
    let (a, b) = (
        serve(&["--quantization", "nvfp4_online"]),
        serve(&["--quantization", "nvfp4_online"]),
    );
    let saved = tempfile::NamedTempFile::new().unwrap().into_temp_path();
    let args = train_args(
        &a,
        &[
            "--server",
            &b,
            "--quantization",
            "nvfp4_online",
            "--routing-replay",
            "--steps",
            "2",
            "--warmup-steps",
            "1",
            "--prompts-per-step",
            "4",
            "--samples-per-prompt",
            "4",
            "--save",
            saved.to_str().unwrap(),
            "--pause-mode",
            "in_place",
        ],
    );
    let mut trainer = Trainer::new(args).unwrap();
    let steps = trainer.run(false).unwrap();
    for m in steps.iter().filter(|m| m.phase == "grpo") {
        assert_eq!(m.mismatch.max_abs, 0.0);
    }
    let want = trainer.serving_checksum().unwrap();
    for s in [&a, &b] {
        assert_eq!(get_json(s, "/weights_checksum")["overall"], json!(want));
    }
    let (pa, pb) = (probe(&a), probe(&b));
    assert_eq!(pa.2, "train-3");
    assert_eq!(pa, pb, "both servers hold the same weights");

    // Resume on a fresh server: zero steps, so only the initial push happens.
    let c = serve(&["--quantization", "nvfp4_online"]);
    let args = train_args(
        &c,
        &[
            "--quantization",
            "nvfp4_online",
            "--steps",
            "0",
            "--warmup-steps",
            "0",
            "--resume",
            saved.to_str().unwrap(),
        ],
    );
    Trainer::new(args).unwrap().run(false).unwrap();
    let pc = probe(&c);
    assert_eq!(pc.2, "train-1");
    assert_eq!(
        (pc.0, pc.1),
        (pa.0, pa.1),
        "the resumed weights are the saved ones"
    );
}

/// With one update per batch the ratios are exactly 1 (mismatch 0), so nothing is clipped;
/// with two mini-batch updates the second sees a moved policy and the clip acts.
#[test]
fn several_updates_per_batch_make_the_clip_act() {
    let server = serve(&[]);
    let run = |updates: &str| {
        let args = train_args(
            &server,
            &[
                "--updates-per-batch",
                updates,
                "--lr",
                "3e-2",
                "--clip-eps",
                "0.05",
                "--steps",
                "2",
                "--warmup-steps",
                "1",
                "--prompts-per-step",
                "4",
                "--samples-per-prompt",
                "4",
            ],
        );
        let steps = Trainer::new(args).unwrap().run(false).unwrap();
        steps
            .into_iter()
            .filter(|m| m.phase == "grpo")
            .collect::<Vec<StepMetrics>>()
    };
    for m in run("1") {
        assert_eq!(m.mismatch.max_abs, 0.0);
        assert_eq!(m.clip_fraction, 0.0);
    }
    // A step whose groups all have equal rewards has zero advantages and clips nothing, so
    // the check is over the run.
    let two = run("2");
    for m in &two {
        assert_eq!(m.mismatch.max_abs, 0.0, "measured before the first update");
    }
    assert!(
        two.iter().any(|m| m.clip_fraction > 0.0),
        "nothing clipped: {:?}",
        two.iter().map(|m| m.clip_fraction).collect::<Vec<_>>()
    );
}
