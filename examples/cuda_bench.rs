//! The CUDA baseline of issue 5: copy bandwidth, then for each expert format the prefill and
//! decode throughput of a model config with dummy weights drawn on the device, with the bytes
//! each decode step must move and the fraction of the bandwidth roofline reached.
//!
//! cargo run --release --example cuda_bench -- configs/qwen3-30b-a3b.json \
//!     [--formats bf16,mxfp8,nvfp4] [--batches 1,8,64,256] [--prompt 512] [--steps 256]
//!     [--prefill 8x2048] [--layers N] [--mem-fraction 0.9] [--feed-sampled true]
//!     [--logprobs true]
//!
//! `--feed-sampled true` feeds each decode step the tokens the step before sampled, as serving
//! does (by default every step decodes the same tokens). `--logprobs true` asks each decode row's
//! logprob, as RL rollouts do (by default greedy rows without it, as `lockstep bench`'s random
//! rows: the sampler skips the normalizer). Each decode row is followed by the
//! experts its last step touched per MoE layer, against uniform routing's expectation.
//!
//! `--mem-fraction` is the device memory the model and its KV cache take (default 0.9, as
//! `--mem-fraction-static`): a small one leaves ncu room to save and restore memory when it
//! replays a kernel for several sections.
//!
//! Every sequence has a prompt of its own, so decode rows route like serving's (each decode row
//! is followed by the experts its last step touched per MoE layer, against uniform routing's
//! count, which the roofline assumes).
//!
//! Times are host clocks around whole forward passes after a warm-up pass: prefill ends with
//! the last logits row copied to the host, decode with greedy sampling on the device (only the
//! token comes back), as in serving. Prints one table row per measurement.

use std::time::Instant;

use lockstep::backend::cuda::device::copy_bandwidth;
use lockstep::backend::cuda::Gpu;
use lockstep::model::cuda::{CudaModel, CudaSizes, CudaWeights};
use lockstep::model::{ForwardBatch, ModelConfig, SeqInput};
use lockstep::quant::{Format, Recipe};
use lockstep::sampling::{SampleInput, SamplingParams, TokenHistory};

struct Args {
    config: String,
    formats: Vec<String>,
    batches: Vec<usize>,
    prompt: usize,
    steps: usize,
    prefill: (usize, usize),
    layers: Option<usize>,
    mem_fraction: f32,
    /// Each decode step's inputs are the tokens the last one sampled (as in serving), not the
    /// same tokens every step.
    feed_sampled: bool,
    /// Decode rows ask for their token's logprob (`return_logprob`).
    logprobs: bool,
}

fn parse() -> Args {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        config: it.next().expect("usage: cuda_bench CONFIG.json [options]"),
        formats: vec!["bf16".into(), "mxfp8".into(), "nvfp4".into()],
        batches: vec![1, 8, 64, 256],
        prompt: 512,
        steps: 256,
        prefill: (8, 2048),
        layers: None,
        mem_fraction: 0.9,
        feed_sampled: false,
        logprobs: false,
    };
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--formats" => a.formats = v.split(',').map(String::from).collect(),
            "--batches" => a.batches = v.split(',').map(|b| b.parse().expect("batch")).collect(),
            "--prompt" => a.prompt = v.parse().expect("prompt"),
            "--steps" => a.steps = v.parse().expect("steps"),
            "--layers" => a.layers = Some(v.parse().expect("layers")),
            "--mem-fraction" => a.mem_fraction = v.parse().expect("mem-fraction"),
            "--feed-sampled" => a.feed_sampled = v.parse().expect("--feed-sampled true|false"),
            "--logprobs" => a.logprobs = v.parse().expect("--logprobs true|false"),
            "--prefill" => {
                let (n, len) = v.split_once('x').expect("--prefill NxLEN");
                a.prefill = (n.parse().expect("N"), len.parse().expect("LEN"));
            }
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// Bytes a decode step of `batch` sequences at context `ctx` must read at least: dense weights,
/// the experts the batch is expected to touch (uniform routing), the lm_head and the KV cache.
fn decode_bytes(c: &ModelConfig, expert_format: Format, batch: usize, ctx: usize) -> f64 {
    let h = c.hidden_size as f64;
    let attn = (2.0 * c.q_size() as f64 * h + 2.0 * c.kv_size() as f64 * h) * 2.0;
    let moe = c.moe.as_ref().expect("an MoE config");
    let e = moe.num_experts as f64;
    let touched = e * (1.0 - (1.0 - moe.top_k as f64 / e).powi(batch as i32));
    let expert = 3.0 * h * moe.intermediate_size as f64 * expert_format.bytes_per_element();
    let router = e * h * 2.0;
    let kv = batch as f64 * ctx as f64 * 2.0 * c.kv_size() as f64 * 2.0;
    let per_layer = attn + router + touched * expert + kv;
    c.num_layers as f64 * per_layer + c.vocab_size as f64 * h * 2.0
}

fn main() {
    let a = parse();
    let mut raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&a.config).expect("config")).expect("json");
    if let Some(l) = a.layers {
        raw["num_hidden_layers"] = l.into();
    }
    let cfg = ModelConfig::from_json(raw).expect("config");
    let gpu = Gpu::open(0).expect("CUDA device");
    let bw = copy_bandwidth(&gpu).expect("copy bandwidth");
    println!(
        "device {} ({}), copy bandwidth {:.0} GB/s",
        gpu.name,
        gpu.arch,
        bw / 1e9
    );
    println!(
        "decode rows: greedy, {}",
        if a.logprobs {
            "with the token's logprob"
        } else {
            "no logprob asked"
        }
    );
    drop(gpu);
    let max_batch = *a.batches.iter().max().unwrap_or(&1);
    let block = 16;
    println!("| experts | what | batch | tokens/s | ms/step | bytes/step (GB) | roofline ms | of roofline |");
    println!("|---|---|---|---|---|---|---|---|");
    for f in &a.formats {
        let recipe = Recipe::builtin(f).unwrap_or_else(|| panic!("recipe {f}"));
        let expert_format = recipe
            .format_for("model.layers.0.mlp.experts.0.gate_proj", cfg.num_layers)
            .format;
        let gpu = Gpu::open(0).expect("CUDA device");
        let t = Instant::now();
        let weights = CudaWeights::dummy(&gpu, &cfg, &recipe, 0).expect("dummy weights");
        gpu.synchronize().expect("sync");
        let load_s = t.elapsed().as_secs_f64();
        let ctx_len = (a.prompt + a.steps + 1).max(a.prefill.1);
        let mut model = CudaModel::new(
            gpu,
            cfg.clone(),
            weights,
            CudaSizes {
                max_batch_tokens: 8192.max(max_batch),
                max_running_requests: max_batch.max(a.prefill.0),
                block_size: block,
                max_context_len: ctx_len,
                mem_fraction_static: a.mem_fraction,
                max_total_tokens: None,
                block_scaled_gemm: false,
                graph_max_rows: lockstep::engine::defaults::CUDA_GRAPH_MAX_BS,
            },
        )
        .expect("model");
        eprintln!(
            "{f}: weights {:.2} GiB drawn and quantized on the device in {load_s:.1}s",
            model.weight_bytes as f64 / (1u64 << 30) as f64
        );
        let blocks_per_seq = ctx_len.div_ceil(block);
        let tables: Vec<Vec<u32>> = (0..max_batch.max(a.prefill.0))
            .map(|s| ((s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32).collect())
            .collect();
        assert!(
            tables.len() * blocks_per_seq <= model.num_kv_blocks(),
            "KV cache too small for the benchmark"
        );
        let token = |i: usize| ((i * 7919) % 150000) as u32;

        // Prefill: N prompts of LEN tokens, 8192 tokens per step (a longer prompt in chunks of
        // 8192, as the server's chunked prefill takes it).
        let (pn, plen) = a.prefill;
        let prompts: Vec<Vec<u32>> = (0..pn)
            .map(|s| (0..plen).map(|i| token(s * plen + i)).collect())
            .collect();
        let run_prefill = |model: &mut CudaModel| {
            if plen > 8192 {
                for (s, prompt) in prompts.iter().enumerate() {
                    for start in (0..plen).step_by(8192) {
                        let end = (start + 8192).min(plen);
                        let seq = SeqInput {
                            tokens: &prompt[start..end],
                            start_pos: start,
                            block_table: &tables[s],
                            logits_from: (end == plen).then_some(end - start - 1),
                        };
                        let batch = ForwardBatch { seqs: vec![seq] };
                        model.forward(&batch).expect("prefill chunk");
                    }
                }
                return;
            }
            let per_step = (8192 / plen).max(1);
            for group in (0..pn).collect::<Vec<_>>().chunks(per_step) {
                let batch = ForwardBatch {
                    seqs: group
                        .iter()
                        .map(|&s| SeqInput {
                            tokens: &prompts[s][..plen.min(8192)],
                            start_pos: 0,
                            block_table: &tables[s],
                            logits_from: Some(plen.min(8192) - 1),
                        })
                        .collect(),
                };
                model.forward(&batch).expect("prefill");
            }
        };
        run_prefill(&mut model);
        let t = Instant::now();
        run_prefill(&mut model);
        let s = t.elapsed().as_secs_f64();
        println!(
            "| {f} | prefill {pn}x{plen} | {pn} | {:.0} | {:.1} | | | |",
            (pn * plen) as f64 / s,
            s * 1e3
        );

        for &b in &a.batches {
            // Prompts first (not timed), then `steps` decode steps of all b sequences. Each
            // sequence has a prompt of its own, as in serving: with one shared prompt the rows'
            // hidden states are alike and route to a few experts (cuda_bench before 2026-12-02
            // shared one; its decode rows read a fraction of the expert bytes they claimed).
            let prompts: Vec<Vec<u32>> = (0..b)
                .map(|s| (0..a.prompt).map(|i| token(1 + s * a.prompt + i)).collect())
                .collect();
            let per_step = (8192 / a.prompt).max(1);
            for group in (0..b).collect::<Vec<_>>().chunks(per_step) {
                let batch = ForwardBatch {
                    seqs: group
                        .iter()
                        .map(|&s| SeqInput {
                            tokens: &prompts[s],
                            start_pos: 0,
                            block_table: &tables[s],
                            logits_from: Some(a.prompt - 1),
                        })
                        .collect(),
                };
                model.forward(&batch).expect("prompt");
            }
            let mut ids: Vec<[u32; 1]> = (0..b).map(|s| [token(s)]).collect();
            let params = SamplingParams {
                temperature: 0.0,
                ..Default::default()
            }
            .validate(&Default::default())
            .expect("greedy params");
            let histories: Vec<TokenHistory> =
                prompts.iter().map(|p| TokenHistory::new(p)).collect();
            let step = |model: &mut CudaModel, i: usize, ids: &mut Vec<[u32; 1]>| {
                let batch = ForwardBatch {
                    seqs: (0..b)
                        .map(|s| SeqInput {
                            tokens: &ids[s],
                            start_pos: a.prompt + i,
                            block_table: &tables[s],
                            logits_from: Some(0),
                        })
                        .collect(),
                };
                // Sampled on the device, as in serving: only the token comes back.
                let greedy: Vec<Option<SampleInput<'_>>> = (0..b)
                    .map(|s| {
                        Some(SampleInput {
                            params: &params,
                            history: &histories[s],
                            eos_token_ids: &[],
                            seed: 0,
                            sample_index: 0,
                            top_logprobs_num: 0,
                            logprob: a.logprobs,
                        })
                    })
                    .collect();
                let (out, sampled) = model.forward_and_sample(&batch, &greedy).expect("decode");
                let next: Vec<[u32; 1]> = sampled
                    .iter()
                    .map(|t| match t {
                        Some(Ok(t)) => [t.token],
                        other => panic!("not sampled: {other:?}"),
                    })
                    .collect();
                drop(batch);
                if a.feed_sampled {
                    *ids = next;
                }
                out.routed_experts
            };
            // Two warm-up steps: the first runs launch by launch, the second records the
            // step on a CUDA graph (backend/cuda/graphs.rs); the timed steps replay it.
            step(&mut model, 0, &mut ids);
            step(&mut model, 1, &mut ids);
            if a.steps <= 2 {
                // Only the warm-up runs (as the ncu profiles and prefill-only runs ask): no time.
                println!(
                    "| {f} | decode (prompt {}, warm-up only) | {b} | | | | | |",
                    a.prompt
                );
                continue;
            }
            let mut routed = Vec::new();
            let t = Instant::now();
            for i in 2..a.steps {
                routed = step(&mut model, i, &mut ids);
            }
            let s = t.elapsed().as_secs_f64() / (a.steps - 2) as f64;
            let bytes = decode_bytes(&cfg, expert_format, b, a.prompt + a.steps / 2);
            let roof = bytes / bw;
            println!(
                "| {f} | decode (prompt {}, {} steps) | {b} | {:.0} | {:.2} | {:.2} | {:.2} | {:.0}% |",
                a.prompt,
                a.steps,
                b as f64 / s,
                s * 1e3,
                bytes / 1e9,
                roof * 1e3,
                100.0 * roof / s
            );
            // A dense model routes nothing: no experts to count.
            if routed.is_empty() {
                continue;
            }
            let moe = cfg.moe.as_ref().expect("an MoE config");
            let layers = cfg.num_moe_layers();
            let mut touched = 0;
            for l in 0..layers {
                let mut seen = vec![false; moe.num_experts];
                for r in 0..b {
                    let at = (r * layers + l) * moe.top_k;
                    for &e in &routed[at..at + moe.top_k] {
                        seen[e as usize] = true;
                    }
                }
                touched += seen.iter().filter(|&&x| x).count();
            }
            let e = moe.num_experts as f64;
            println!(
                "|   | experts touched per MoE layer (last step) | {b} | {:.1} of {} (uniform routing: {:.1}) | | | | |",
                touched as f64 / layers.max(1) as f64,
                moe.num_experts,
                e * (1.0 - (1.0 - moe.top_k as f64 / e).powi(b as i32))
            );
        }
    }
}
