//! The engine on the embedded Qwen3-MoE: seeded sampling independent of the batch, prefix
//! caching, preemption without loss, aborts that free KV, prompt logprobs that agree with
//! decode logprobs, and routed-expert capture.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockstep::backend::cpu::attention::KvDtype;
use lockstep::engine::{
    Engine, EngineConfig, EngineEvent, EngineHandle, EngineInfo, GenerateRequest, TokenOut,
};
use lockstep::model::{loader, ModelConfig};
use lockstep::quant::Recipe;
use lockstep::sampling::{Finish, SamplingParams};
use lockstep::serve::EMBEDDED_CONFIG;
use lockstep::tokenizer::Tokenizer;

mod common;
use common::run_requests;

fn engine(max_total_tokens: usize, block_size: usize) -> EngineHandle {
    engine_with(max_total_tokens, block_size, 256, 1.0)
}

fn engine_with(
    max_total_tokens: usize,
    block_size: usize,
    max_queued_requests: usize,
    schedule_conservativeness: f64,
) -> EngineHandle {
    let (model, info) = embedded(block_size);
    let cfg = EngineConfig {
        max_running_requests: 16,
        max_batch_tokens: 64,
        max_total_tokens,
        block_size,
        max_context_len: 512,
        max_queued_requests,
        kv_dtype: KvDtype::Bf16,
        schedule_conservativeness,
    };
    // Returns once the engine has run its warm-up step.
    let h = Engine::start(model, info, cfg).expect("engine starts");
    assert!(h.shared.warm.load(Ordering::Acquire), "warm once started");
    h
}

/// The embedded model (dummy BF16 weights) and its engine info.
fn embedded(block_size: usize) -> (lockstep::model::Model, EngineInfo) {
    let cfg = ModelConfig::from_json(serde_json::from_str(EMBEDDED_CONFIG).unwrap()).unwrap();
    let recipe = Recipe::bf16();
    let mut model = loader::dummy_model(cfg.clone(), &recipe, 0).unwrap();
    let checksum = Arc::new(model.weights_checksum());
    let info = EngineInfo {
        model_path: "embedded".into(),
        served_model_name: "test".into(),
        config: cfg,
        tokenizer: Arc::new(Tokenizer::embedded()),
        quantization: "bf16".into(),
        recipe_name: recipe.name.clone(),
        recipe_hash: recipe.hash(),
        recipe: recipe.clone(),
        slots: Default::default(),
        weights_on_device: false,
        max_context_len: 512,
        block_size,
        weight_version: std::sync::RwLock::new("v0".into()),
        weights_checksum: std::sync::RwLock::new(("v0".into(), checksum)),
    };
    (model, info)
}

#[test]
fn a_start_up_that_panics_returns_its_error_instead_of_waiting() {
    let (model, info) = embedded(16);
    // The scheduler refuses a step budget that cannot hold every running sequence's decode.
    let cfg = EngineConfig {
        max_running_requests: 16,
        max_batch_tokens: 8,
        max_total_tokens: 4096,
        block_size: 16,
        max_context_len: 512,
        max_queued_requests: 4,
        kv_dtype: KvDtype::Bf16,
        schedule_conservativeness: 1.0,
    };
    let err = Engine::start(model, info, cfg).err().expect("refused");
    assert!(
        err.to_string()
            .contains("max_batch_tokens must be at least max_running_requests"),
        "{err}"
    );
}

fn request(
    prompt: &[u32],
    max_new: i64,
    temperature: f64,
    seed: u64,
    sample_index: u32,
) -> GenerateRequest {
    let params = SamplingParams {
        max_new_tokens: Some(max_new),
        temperature,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    GenerateRequest {
        rid: format!("r{seed}-{sample_index}"),
        input_ids: prompt.to_vec(),
        params: params.validate(&Default::default()).unwrap(),
        seed,
        sample_index,
        return_logprob: true,
        logprob_start_len: None,
        top_logprobs_num: 0,
        return_routed_experts: false,
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 31 + salt * 17) % 256)
        .collect()
}

fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "timed out waiting: {what}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn ids(tokens: &[TokenOut]) -> Vec<u32> {
    tokens.iter().map(|t| t.id).collect()
}

#[test]
fn seeded_samples_do_not_depend_on_the_batch_and_differ_by_index() {
    let h = engine(8192, 16);
    let p = prompt(20, 1);
    let alone = run_requests(&h, vec![request(&p, 12, 1.0, 7, 0)]);
    let mut crowd = vec![
        request(&prompt(33, 2), 9, 0.8, 1, 0),
        request(&p, 12, 1.0, 7, 0),
    ];
    crowd.extend((0..4).map(|i| request(&prompt(5 + i, 3 + i as u32), 15, 1.0, 99, i as u32)));
    let batched = run_requests(&h, crowd);
    assert_eq!(
        ids(&alone[0].0),
        ids(&batched[1].0),
        "same seed, same tokens, whatever the batch"
    );
    assert_eq!(alone[0].1.output_ids, ids(&alone[0].0));
    let logprobs = |t: &[TokenOut]| {
        t.iter()
            .map(|t| t.logprob.unwrap().to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        logprobs(&alone[0].0),
        logprobs(&batched[1].0),
        "logprobs are bitwise batch-invariant"
    );

    let samples = run_requests(&h, (0..4).map(|i| request(&p, 12, 1.0, 7, i)).collect());
    assert_eq!(ids(&samples[0].0), ids(&alone[0].0));
    for i in 1..4 {
        assert_ne!(
            ids(&samples[i].0),
            ids(&samples[0].0),
            "sample {i} differs from sample 0"
        );
    }
}

#[test]
fn repeated_prompts_hit_the_prefix_cache_with_identical_results() {
    let h = engine(8192, 4);
    let p = prompt(30, 5);
    let first = run_requests(&h, vec![request(&p, 6, 0.0, 0, 0)]);
    let second = run_requests(&h, vec![request(&p, 6, 0.0, 0, 0)]);
    assert_eq!(first[0].1.cached_tokens, 0);
    // 29 tokens may be reused (the last prompt token is always computed): 7 full blocks of 4.
    assert_eq!(second[0].1.cached_tokens, 28);
    assert_eq!(ids(&first[0].0), ids(&second[0].0));
    let bits = |t: &[TokenOut]| {
        t.iter()
            .map(|t| t.logprob.unwrap().to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        bits(&first[0].0),
        bits(&second[0].0),
        "a prefix-cache hit changes no logit"
    );
}

#[test]
fn preemption_under_a_tiny_kv_pool_loses_and_changes_nothing() {
    let reqs = || {
        (0..6)
            .map(|i| request(&prompt(10, 10 + i), 20, 1.0, 100 + i as u64, 0))
            .collect::<Vec<_>>()
    };
    let roomy = run_requests(&engine(8192, 4), reqs());
    // 16 blocks of 4 tokens = 64 tokens for 6 sequences that each grow to 30: preemptions
    // (admission keeps nothing free for future tokens, so it admits them all at once).
    let tight_engine = engine_with(64, 4, 256, 0.0);
    let tight = run_requests(&tight_engine, reqs());
    // The same pool with SGLang's reserve admits fewer at once; the tokens are the same.
    let reserving = run_requests(&engine(64, 4), reqs());
    for (i, ((a, b), c)) in roomy.iter().zip(&tight).zip(&reserving).enumerate() {
        assert_eq!(b.0.len(), 20, "request {i} got all its tokens exactly once");
        assert_eq!(
            ids(&a.0),
            ids(&b.0),
            "request {i}: recompute after preemption gives the same tokens"
        );
        assert_eq!(ids(&a.0), ids(&c.0), "request {i} with the reserve");
        assert_eq!(b.1.reason, Finish::Length { length: 20 });
    }
    // The engine publishes its counters right after the step that finished the last request.
    let shared = &tight_engine.shared;
    wait_until("every block returned", || {
        shared.kv_used_blocks.load(Ordering::Acquire) == 0
            && shared.running.load(Ordering::Acquire) == 0
    });
    assert!(
        shared.preemptions.load(Ordering::Acquire) > 0,
        "the tight pool forced preemptions"
    );
}

#[test]
fn dropping_the_receiver_aborts_and_frees_kv() {
    let h = engine(8192, 4);
    let rx = h.submit(request(&prompt(40, 9), 400, 1.0, 3, 0)).unwrap();
    wait_until("the request runs", || {
        h.shared.kv_used_blocks.load(Ordering::Acquire) > 0
    });
    drop(rx);
    wait_until("KV freed after the client went away", || {
        h.shared.kv_used_blocks.load(Ordering::Acquire) == 0
            && h.shared.running.load(Ordering::Acquire) == 0
    });
}

#[test]
fn abort_by_rid_finishes_with_abort() {
    let h = engine(8192, 4);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut rx = h.submit(request(&prompt(8, 1), 400, 1.0, 42, 0)).unwrap();
    let finish = rt.block_on(async {
        let mut seen = 0;
        loop {
            match rx.recv().await.unwrap() {
                EngineEvent::Token(_) => {
                    seen += 1;
                    if seen == 2 {
                        h.abort(Some("r42-0".into()), false).unwrap();
                    }
                }
                EngineEvent::Finished(f) => return f,
                EngineEvent::Error(e) => panic!("{e}"),
            }
        }
    });
    assert!(matches!(finish.reason, Finish::Abort { .. }));
    assert!(finish.output_ids.len() < 400);
}

#[test]
fn prompt_logprobs_agree_with_decode_logprobs_and_experts_are_captured() {
    let h = engine(8192, 4);
    let p = prompt(9, 4);
    let gen = run_requests(&h, vec![request(&p, 5, 1.0, 11, 0)]).remove(0);
    // Re-score prompt + generated tokens as a prompt: the logprob of each generated token must
    // be the same number the decode step reported (temperature 1, no penalties).
    let mut full = p.clone();
    full.extend(ids(&gen.0));
    let mut rescore = request(&full, 1, 1.0, 0, 0);
    rescore.logprob_start_len = Some(0);
    rescore.top_logprobs_num = 3;
    rescore.return_routed_experts = true;
    let (_, f) = run_requests(&h, vec![rescore]).remove(0);
    let input = f.input_logprobs.expect("input logprobs");
    assert_eq!(input.len(), full.len());
    assert_eq!(input[0].logprob, None);
    for (k, t) in gen.0.iter().enumerate() {
        let lp = &input[p.len() + k];
        assert_eq!(lp.token, t.id);
        assert_eq!(
            lp.logprob.unwrap().to_bits(),
            t.logprob.unwrap().to_bits(),
            "token {k}: prefill and decode agree bitwise"
        );
        assert!(lp.top.len() == 3 && lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }
    let routed = f.routed_experts.expect("routed experts");
    assert_eq!((f.moe_layers, f.top_k), (4, 2));
    assert_eq!(routed.len(), (full.len() + 1 - 1) * 4 * 2);
    assert!(routed.iter().all(|&e| (0..8).contains(&e)));
    for token in routed.chunks(2) {
        assert_ne!(token[0], token[1], "top-2 picks two distinct experts");
    }
}

#[test]
fn admission_is_bounded_and_never_refuses_below_the_bound() {
    use lockstep::engine::{EngineError, PauseMode};
    let h = engine_with(8192, 16, 8, 1.0);
    // Bursts below the bound are always accepted (a racy queue counter once refused them).
    for round in 0..30 {
        let reqs = (0..6)
            .map(|i| request(&prompt(4, i), 2, 1.0, round * 10 + i as u64, 0))
            .collect();
        assert_eq!(run_requests(&h, reqs).len(), 6);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(h.pause(PauseMode::InPlace)).unwrap();
    let held: Vec<_> = (0..8)
        .map(|i| {
            h.submit(request(&prompt(4, i), 2, 1.0, i as u64, 0))
                .unwrap()
        })
        .collect();
    match h.submit(request(&prompt(4, 99), 2, 1.0, 99, 0)) {
        Err(EngineError::Overloaded(n)) => assert_eq!(n, 8),
        other => panic!("expected Overloaded, got {:?}", other.map(|_| ())),
    }
    rt.block_on(h.continue_generation()).unwrap();
    rt.block_on(async {
        for mut rx in held {
            loop {
                match rx.recv().await.unwrap() {
                    EngineEvent::Finished(f) => {
                        assert_eq!(f.output_ids.len(), 2);
                        break;
                    }
                    EngineEvent::Error(e) => panic!("{e}"),
                    EngineEvent::Token(_) => {}
                }
            }
        }
    });
}

#[test]
fn a_weight_swap_mid_request_is_attributed_to_version_spans() {
    let h = engine(8192, 16);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cfg = ModelConfig::from_json(serde_json::from_str(EMBEDDED_CONFIG).unwrap()).unwrap();
    let new_weights = loader::dummy_model(cfg, &Recipe::bf16(), 1).unwrap();
    let mut rx = h.submit(request(&prompt(6, 2), 30, 1.0, 5, 0)).unwrap();
    let (tokens, finish) = rt.block_on(async {
        let mut tokens: Vec<TokenOut> = Vec::new();
        let mut swap = Some(new_weights);
        loop {
            match rx.recv().await.unwrap() {
                EngineEvent::Token(t) => {
                    tokens.push(t);
                    if tokens.len() == 5 {
                        let mut model = swap.take().unwrap();
                        let sum = Arc::new(model.weights_checksum());
                        let aborted = h.swap_model(model, sum, "v1".into(), false).await.unwrap();
                        assert_eq!(aborted, 0);
                    }
                }
                EngineEvent::Finished(f) => return (tokens, f),
                EngineEvent::Error(e) => panic!("{e}"),
            }
        }
    });
    assert_eq!(tokens.len(), 30);
    assert_eq!(h.weight_version(), "v1");
    let spans = &finish.weight_versions;
    assert_eq!(spans.len(), 2, "{spans:?}");
    assert_eq!((spans[0].version.as_str(), spans[0].start), ("v0", 0));
    assert_eq!((spans[1].version.as_str(), spans[1].end), ("v1", 30));
    assert_eq!(spans[0].end, spans[1].start);
    assert!(
        spans[0].end >= 5,
        "tokens before the swap keep the old version"
    );
    for (i, t) in tokens.iter().enumerate() {
        let want = if i < spans[0].end { "v0" } else { "v1" };
        assert_eq!(t.weight_version, want, "token {i}");
    }
    // A different architecture is refused and changes nothing.
    let mut other = serde_json::from_str::<serde_json::Value>(EMBEDDED_CONFIG).unwrap();
    other["num_hidden_layers"] = serde_json::json!(2);
    let small =
        loader::dummy_model(ModelConfig::from_json(other).unwrap(), &Recipe::bf16(), 1).unwrap();
    assert!(rt
        .block_on(h.swap_model(small, Default::default(), "v2".into(), false))
        .is_err());
    assert_eq!(h.weight_version(), "v1");
}

/// A request's outcome as bits: tokens, their logprobs and text, the finish, the routed experts
/// and the prompt logprobs (the arrival-dependent queue time and cache hits left out).
fn outcome(r: &(Vec<TokenOut>, lockstep::engine::FinishInfo)) -> String {
    let (tokens, f) = r;
    let bits = |v: f32| v.to_bits();
    let tokens: Vec<_> = tokens
        .iter()
        .map(|t| (t.id, t.text.clone(), t.logprob.map(bits)))
        .collect();
    let input: Option<Vec<_>> = f.input_logprobs.as_ref().map(|lps| {
        lps.iter()
            .map(|lp| {
                let top: Vec<_> = lp.top.iter().map(|&(t, v)| (t, bits(v))).collect();
                (lp.token, lp.logprob.map(bits), top)
            })
            .collect()
    });
    format!(
        "{tokens:?} {:?} {:?} {:?} {:?} {input:?}",
        f.reason, f.text, f.output_ids, f.routed_experts
    )
}

#[test]
fn a_crowd_of_requests_gets_what_each_gets_alone() {
    // 24 requests at once, steps of up to 16 sequences, each request with its own options
    // (greedy or seeded, prompt logprobs, routed experts, a stop token or a stop string where
    // its free run would go on): each gets, bit for bit, what it gets alone.
    let h = engine(16384, 16);
    let ask = |i: u32, stop: Vec<String>, stop_token_ids: Vec<i64>| {
        let params = SamplingParams {
            max_new_tokens: Some(10),
            temperature: if i.is_multiple_of(3) { 0.0 } else { 1.0 },
            // SGLang's rule: ignore_eos ignores the stop tokens too.
            ignore_eos: stop_token_ids.is_empty(),
            stop,
            stop_token_ids,
            ..SamplingParams::default()
        };
        let mut r = request(
            &prompt(6 + i as usize, 40 + i),
            10,
            1.0,
            500 + i as u64,
            i % 2,
        );
        r.params = params.validate(&Default::default()).unwrap();
        r.return_routed_experts = i % 4 == 1;
        if i % 4 == 2 {
            r.logprob_start_len = Some(0);
            r.top_logprobs_num = 2;
        }
        r
    };
    let free = run_requests(&h, (0..24).map(|i| ask(i, vec![], vec![])).collect());
    let reqs: Vec<GenerateRequest> = (0..24u32)
        .map(|i| {
            let f = &free[i as usize].1;
            match i % 6 {
                3 => ask(i, vec![], vec![f.output_ids[4] as i64]),
                5 => {
                    let stop: String = f.text.chars().skip(3).take(2).collect();
                    assert!(!stop.is_empty(), "request {i}'s free text is long enough");
                    ask(i, vec![stop], vec![])
                }
                _ => ask(i, vec![], vec![]),
            }
        })
        .collect();
    let alone: Vec<_> = reqs
        .iter()
        .map(|r| run_requests(&h, vec![r.clone()]).remove(0))
        .collect();
    let crowd = run_requests(&h, reqs);
    let stopped = alone
        .iter()
        .filter(|r| matches!(r.1.reason, Finish::Stop { .. }))
        .count();
    assert!(
        stopped >= 8,
        "the stop tokens and strings end 8 requests early ({stopped})"
    );
    for (i, (a, c)) in alone.iter().zip(&crowd).enumerate() {
        assert_eq!(
            outcome(a),
            outcome(c),
            "request {i}: the crowd changes nothing"
        );
    }
}
