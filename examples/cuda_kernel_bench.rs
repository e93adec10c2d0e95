//! The grouped expert GEMM kernels alone, on a model's expert shapes: for each weight format
//! and each kernel (FFMA, BF16 tensor cores in tiles, for few rows, wgmma), the time of one
//! gate/up projection (section `moe`) or down projection (`moe_down`) over `tokens * top_k`
//! routed rows, with the bytes it must read and the FLOPs it must do, against the measured copy
//! bandwidth and the H200's dense BF16 tensor rate.
//!
//! cargo run --release --example cuda_kernel_bench -- configs/qwen3-30b-a3b.json \
//!     [--tokens 1,8,64,256,4096] [--sections attention,dense,moe,moe_down,sampling]
//!     [--rows 64,128,256] [--repeat 20]
//!
//! `--rows`: the dense projections' row counts (default 1 to 4,096); `--repeat`: timed runs a
//! measurement (default 20; 1 under ncu, which times each launch itself).
//!
//! Also paged attention alone at prefill and decode shapes, against the bytes of K/V it reads,
//! and the dense attention projections at decode row counts on each tensor-core kernel.
//!
//! Random routing (uniform), dummy weights drawn on the device; median of 20 timed runs after
//! a warm-up, host clock around a synchronized launch.

use std::time::Instant;

use lockstep::backend::cuda::device::copy_bandwidth;
use lockstep::backend::cuda::ops::{
    self, AttnRows, AttnShape, GemmPath, GemmRows, MoePlan, Nvfp4Out, SplitK,
};
use lockstep::backend::cuda::pinned::ring_bandwidth;
use lockstep::backend::cuda::weights::Activation;
use lockstep::backend::cuda::Gpu;
use lockstep::model::cuda::DummyWeights;
use lockstep::model::ModelConfig;
use lockstep::quant::Recipe;

/// Dense BF16 tensor-core rate used for the compute roofline (docs: ~790-900 TFLOP/s measured
/// with cuBLAS on the H200 in an earlier session; the lower end).
const TENSOR_FLOPS: f64 = 790e12;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut it = std::env::args().skip(1);
    let config = it.next().expect(
        "usage: cuda_kernel_bench CONFIG.json [--tokens a,b] [--sections attention,dense,moe,moe_down,sampling] [--rows a,b] [--repeat n]",
    );
    let mut row_counts = ROW_COUNTS.to_vec();
    let mut token_counts = vec![1usize, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096];
    const SECTIONS: [&str; 5] = ["attention", "dense", "moe", "moe_down", "sampling"];
    // By default the first three (moe_down and sampling on request).
    let mut sections: Vec<String> = SECTIONS[..3].iter().map(|s| s.to_string()).collect();
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--tokens" => token_counts = v.split(',').map(|t| t.parse().expect("tokens")).collect(),
            "--rows" => row_counts = v.split(',').map(|t| t.parse().expect("rows")).collect(),
            "--repeat" => {
                let n: usize = v.parse().expect("--repeat: a count");
                REPEAT.set(n.max(1)).expect("--repeat once");
            }
            "--sections" => {
                sections = v.split(',').map(str::to_string).collect();
                if let Some(bad) = sections.iter().find(|s| !SECTIONS.contains(&s.as_str())) {
                    panic!("--sections: unknown section {bad} (attention, dense, moe, moe_down, sampling)");
                }
            }
            other => panic!("unknown flag {other}"),
        }
    }
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).expect("config")).expect("json");
    let cfg = ModelConfig::from_json(raw).expect("config");
    let moe = cfg.moe.clone().expect("an MoE config");
    let (experts, top_k, hidden) = (moe.num_experts, moe.top_k, cfg.hidden_size);
    let gpu = Gpu::open(0).expect("CUDA device");
    let bw = copy_bandwidth(&gpu).expect("copy bandwidth");
    // The ring an in-place weight commit reads its spilled layers back through (server/read_back.rs).
    let h2d = ring_bandwidth(&gpu, 4, 32 << 20).expect("host-to-device bandwidth");
    println!(
        "device {} ({}), copy bandwidth {:.0} GB/s, host to device through 4 page-locked buffers of 32 MiB {:.1} GB/s; {experts} experts, top-{top_k}",
        gpu.name,
        gpu.arch,
        bw / 1e9,
        h2d / 1e9
    );
    let max_tokens = *token_counts.iter().max().unwrap_or(&1);
    // The largest input a launch reads: tokens x hidden (gate/up), routed rows x intermediate
    // (down), or a dense projection's rows x its inputs.
    let max_rows = *row_counts.iter().max().unwrap_or(&1);
    let max_x = (max_tokens * hidden)
        .max(max_tokens * top_k * moe.intermediate_size)
        .max(max_rows * hidden.max(cfg.num_heads * cfg.head_dim));
    let x_host: Vec<f32> = (0..max_x)
        .map(|i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / 8.4e6 - 1.0)
        .collect();
    let x = gpu.upload(&x_host).expect("x");
    let wanted = |section: &str| sections.iter().any(|s| s == section);
    if wanted("attention") {
        attention(&gpu, &cfg, bw);
    }
    if wanted("dense") {
        dense(&gpu, &cfg, bw, &x, &row_counts);
        dense_qkv(&gpu, &cfg, bw, &x, &row_counts);
    }
    for (section, projection) in [("moe", Projection::GateUp), ("moe_down", Projection::Down)] {
        if wanted(section) {
            expert_gemms(&gpu, &cfg, bw, &x, &token_counts, projection);
        }
    }
    if wanted("sampling") {
        sampling(&gpu, &cfg, &token_counts);
    }
}

/// The device sampler alone on a step of `rows` rows: greedy without logprobs (as the server's
/// benchmark rows decode: `argmax_rows`, each row split over blocks), greedy with its logprob
/// (`sample_rows`: a block a row over the whole vocabulary) and at temperature 1 with a seed
/// (as RL rollouts sample: a draw from the whole distribution, the token's logprob), at
/// each token count up to 1,024 rows: the parameters' upload, the launch and the results'
/// download, median of 20. Logits uniform in [-8, 8) from a fixed hash (rows differ), so the
/// draw's radix select narrows a wide distribution.
fn sampling(gpu: &Gpu, cfg: &ModelConfig, token_counts: &[usize]) {
    use lockstep::backend::cuda::sampling::{sample_rows, DeviceSampler};
    use lockstep::sampling::{SampleInput, SamplingParams, TokenHistory};
    let vocab = cfg.vocab_size;
    let counts: Vec<usize> = token_counts
        .iter()
        .copied()
        .filter(|&r| r <= 1024)
        .collect();
    let max_rows = counts.iter().copied().max().unwrap_or(1);
    let logits_host: Vec<f32> = (0..max_rows * vocab)
        .map(|i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / 1.05e6 - 8.0)
        .collect();
    let mut logits = gpu.upload(&logits_host).expect("logits");
    let mut sampler = DeviceSampler::new(gpu, vocab, max_rows, max_rows, 64).expect("sampler");
    let history = TokenHistory::new(&[1, 2, 3]);
    println!();
    println!("Device sampling over {vocab} logits a row");
    println!("| rows | kind | us a step | us a row |");
    println!("|---|---|---|---|");
    // (What the row is, temperature, whether it asks for its logprob, the argmax path on.)
    for (kind, temperature, logprob, argmax) in [
        ("greedy, no logprob (argmax_rows)", 0.0, false, true),
        ("greedy, logprob", 0.0, true, false),
        ("temperature 1, seeded", 1.0, true, false),
    ] {
        sampler.set_greedy_argmax(argmax);
        let params = SamplingParams {
            temperature,
            ..Default::default()
        }
        .validate(&Default::default())
        .expect("sampling params");
        for &rows in &counts {
            let inputs: Vec<(usize, SampleInput<'_>)> = (0..rows)
                .map(|r| {
                    let input = SampleInput {
                        params: &params,
                        history: &history,
                        eos_token_ids: &[],
                        seed: r as u64,
                        sample_index: 0,
                        top_logprobs_num: 0,
                        logprob,
                    };
                    (r, input)
                })
                .collect();
            // No kind writes the logits (no penalties, no temperature to divide by).
            sample_rows(gpu, &mut sampler, &mut logits, &inputs).expect("warm-up");
            let times: Vec<f64> = (0..20)
                .map(|_| {
                    let t = Instant::now();
                    sample_rows(gpu, &mut sampler, &mut logits, &inputs).expect("sample");
                    t.elapsed().as_secs_f64()
                })
                .collect();
            let us = median(times) * 1e6;
            println!("| {rows} | {kind} | {us:.1} | {:.2} |", us / rows as f64);
        }
    }
}

/// One projection of the experts: gate/up (hidden -> 2 x intermediate, each routed row read
/// from its token's row through the plan) or down (intermediate -> hidden, over the routed rows
/// in the plan's order, as the layer runs it).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Projection {
    GateUp,
    Down,
}

/// Every kernel on one expert projection, in each weight format, at each token count.
fn expert_gemms(
    gpu: &Gpu,
    cfg: &ModelConfig,
    bw: f64,
    x: &cudarc::driver::CudaSlice<f32>,
    token_counts: &[usize],
    projection: Projection,
) {
    let moe = cfg.moe.clone().expect("an MoE config");
    let (experts, top_k, inter) = (moe.num_experts, moe.top_k, moe.intermediate_size);
    let (n, k, module) = match projection {
        Projection::GateUp => (2 * inter, cfg.hidden_size, "gate_proj"),
        Projection::Down => (cfg.hidden_size, inter, "down_proj"),
    };
    println!();
    println!("{projection:?} of {experts} experts [{n} x {k}], top-{top_k}");
    println!("| experts | kernel | tokens | rows | us | GB/s | TFLOP/s | of roofline |");
    println!("|---|---|---|---|---|---|---|---|");
    let max_tokens = *token_counts.iter().max().unwrap_or(&1);
    // Rows of x a launch reads: the tokens (gate/up, through the plan's row_token) or the
    // routed rows themselves (down).
    let x_rows = |tokens: usize| match projection {
        Projection::GateUp => tokens,
        Projection::Down => tokens * top_k,
    };
    let max_rows = x_rows(max_tokens);
    let dummy = DummyWeights { gpu, seed: 7 };
    let mut deq = gpu.alloc::<f32>(max_rows * k).expect("deq");
    let mut data = gpu.alloc::<u8>(max_rows * k).expect("data");
    let mut scales = gpu.alloc::<u8>(max_rows * k / 16).expect("scales");
    let mut row_scale = gpu.alloc::<f32>(max_rows).expect("row scale");
    let mut out = gpu.alloc::<f32>(max_tokens * top_k * n).expect("out");
    for name in ["bf16", "mxfp8", "nvfp4"] {
        let recipe = Recipe::builtin(name).expect("recipe");
        let fmt = recipe.format_for(
            &format!("model.layers.0.mlp.experts.0.{module}"),
            cfg.num_layers,
        );
        let parts: Vec<Vec<(String, usize)>> = (0..experts)
            .map(|e| match projection {
                Projection::GateUp => {
                    vec![(format!("e{e}.gate"), inter), (format!("e{e}.up"), inter)]
                }
                Projection::Down => vec![(format!("e{e}.down"), n)],
            })
            .collect();
        let m = dummy
            .matrix(&parts, k, &fmt, projection == Projection::GateUp)
            .expect("weights");
        let bytes_per_param = fmt.format.bytes_per_element();
        for &tokens in token_counts {
            // Uniform random routing: token t picks top_k distinct experts.
            let ids: Vec<i32> = (0..tokens)
                .flat_map(|t| {
                    let start = (t * 7919) % experts;
                    (0..top_k).map(move |s| ((start + s * 13) % experts) as i32)
                })
                .collect();
            let dids = gpu.upload(&ids).expect("ids");
            let pairs = tokens * top_k;
            let rows = x_rows(tokens);
            let mut plan = MoePlan::new(gpu, pairs, experts).expect("plan");
            plan.build(gpu, &dids, tokens, top_k, experts)
                .expect("plan");
            let (xin, rs) = match m.act {
                Activation::Plain => (x, None),
                Activation::Mxfp8 => {
                    ops::mxfp8_quantize(gpu, x, rows * k, &mut data, &mut scales, Some(&mut deq))
                        .expect("quantize");
                    (&deq, None)
                }
                Activation::Nvfp4 { params, .. } => {
                    ops::nvfp4_quantize_f32(
                        gpu,
                        x,
                        rows,
                        k,
                        true,
                        None,
                        params,
                        Nvfp4Out {
                            data: &mut data,
                            scales: &mut scales,
                            row_s_dec: &mut row_scale,
                            deq: Some(&mut deq),
                            words: None,
                        },
                    )
                    .expect("quantize");
                    (&deq, Some(&row_scale))
                }
            };
            let touched = ids.iter().collect::<std::collections::BTreeSet<_>>().len();
            let bytes = touched as f64 * (n * k) as f64 * bytes_per_param
                + (rows * k * 4) as f64
                + (pairs * n * 4) as f64;
            let flops = 2.0 * (pairs * n * k) as f64;
            let roofline = (bytes / bw).max(flops / TENSOR_FLOPS);
            for path in GemmPath::EXPLICIT.into_iter().chain([GemmPath::Auto]) {
                // The FFMA and few-rows kernels are far behind from a few hundred tokens; the
                // block-split one takes plans of up to 16 tokens (else it runs as Skinny4).
                if tokens > 256 && matches!(path, GemmPath::Ffma | GemmPath::Skinny)
                    || tokens > ops::BLOCK_SPLIT_MAX_TILE_ROWS && path == GemmPath::SkinnyKSplit
                {
                    continue;
                }
                let row_index = (projection == Projection::GateUp).then_some(&plan.row_token);
                let mut run = || {
                    ops::grouped_gemm_on(
                        path,
                        SplitK::Auto,
                        gpu,
                        xin,
                        row_index,
                        rs,
                        &m.data,
                        GemmRows::Plan(&plan),
                        pairs,
                        n,
                        k,
                        &mut out,
                    )
                    .expect("gemm");
                };
                run();
                gpu.synchronize().expect("sync");
                let times: Vec<f64> = (0..20)
                    .map(|_| {
                        let t = Instant::now();
                        run();
                        gpu.synchronize().expect("sync");
                        t.elapsed().as_secs_f64()
                    })
                    .collect();
                let s = median(times);
                println!(
                    "| {name} | {path:?} | {tokens} | {pairs} | {:.1} | {:.0} | {:.1} | {:.0}% |",
                    s * 1e6,
                    bytes / s / 1e9,
                    flops / s / 1e12,
                    100.0 * roofline / s
                );
            }
        }
    }
}

/// The attention projections (BF16) alone at decode and small-prefill row counts, on each
/// tensor-core kernel: they all give the same bits, so only speed picks among them.
/// Dense launches a kernel of [`DENSE_CHOICES`] is not timed at: the few-rows kernels from a
/// few hundred rows (far behind), the block-split one past the rows it takes (it would run as
/// Skinny4).
fn dense_choice_skipped(path: GemmPath, rows: usize) -> bool {
    rows > 256 && matches!(path, GemmPath::Skinny | GemmPath::Skinny4)
        || rows > ops::BLOCK_SPLIT_MAX_TILE_ROWS && path == GemmPath::SkinnyKSplit
}

/// Rows of the dense projections' launches.
const ROW_COUNTS: [usize; 11] = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096];
/// The kernels and splits the dense projections are timed on.
const DENSE_CHOICES: [(GemmPath, SplitK); 15] = [
    (GemmPath::TensorCore, SplitK::Off),
    (GemmPath::TensorCore, SplitK::On),
    (GemmPath::TensorCoreWide, SplitK::Off),
    (GemmPath::Wgmma, SplitK::Off),
    (GemmPath::Wgmma, SplitK::On),
    (GemmPath::Wgmma, SplitK::OneWave),
    (GemmPath::Wgmma64, SplitK::Off),
    (GemmPath::Wgmma64, SplitK::On),
    (GemmPath::Wgmma64, SplitK::OneWave),
    (GemmPath::WgmmaTma, SplitK::Off),
    (GemmPath::Skinny, SplitK::Off),
    (GemmPath::Skinny, SplitK::On),
    (GemmPath::Skinny4, SplitK::On),
    (GemmPath::SkinnyKSplit, SplitK::Auto),
    (GemmPath::Auto, SplitK::Auto),
];

fn dense(
    gpu: &Gpu,
    cfg: &ModelConfig,
    bw: f64,
    x: &cudarc::driver::CudaSlice<f32>,
    row_counts: &[usize],
) {
    let dummy = DummyWeights { gpu, seed: 9 };
    let (h, q) = (cfg.hidden_size, cfg.num_heads * cfg.head_dim);
    let kv = cfg.num_kv_heads * cfg.head_dim;
    let experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    println!("| dense bf16 | kernel | rows | us | GB/s | of roofline |");
    println!("|---|---|---|---|---|---|");
    // The router and the LM head at decode batches only (the LM head's output is rows x vocab
    // floats).
    for (name, n, k, most_rows) in [
        ("q_proj", q, h, usize::MAX),
        ("k_proj", kv, h, usize::MAX),
        ("o_proj", h, q, usize::MAX),
        ("router", experts, h, 256),
        ("lm_head", cfg.vocab_size, h, 256),
    ] {
        if n == 0 {
            continue;
        }
        let parts = vec![vec![(format!("{name}"), n)]];
        let m = dummy
            .matrix(&parts, k, &lockstep::quant::TensorFormat::BF16, false)
            .expect("weights");
        for &rows in row_counts.iter().filter(|&&r| r <= most_rows) {
            if rows * k > x.len() {
                continue;
            }
            let mut out = gpu.alloc::<f32>(rows * n).expect("out");
            let bytes = (n * k * 2 + rows * k * 4 + rows * n * 4) as f64;
            for (path, split) in DENSE_CHOICES {
                if dense_choice_skipped(path, rows) {
                    continue;
                }
                let s = time(gpu, || {
                    ops::grouped_gemm_on(
                        path,
                        split,
                        gpu,
                        x,
                        None,
                        None,
                        &m.data,
                        GemmRows::Dense(rows),
                        rows,
                        n,
                        k,
                        &mut out,
                    )
                    .expect("gemm")
                });
                println!(
                    "| {name} [{n} x {k}] | {path:?}, split {split:?} | {rows} | {:.1} | {:.0} | {:.0}% |",
                    s * 1e6,
                    bytes / s / 1e9,
                    100.0 * bytes / bw / s
                );
            }
        }
    }
}

/// q, k and v over one input: three launches (`Auto`, as the engine ran them before) against
/// one joined launch on each kernel (the same bits; only speed picks).
fn dense_qkv(
    gpu: &Gpu,
    cfg: &ModelConfig,
    bw: f64,
    x: &cudarc::driver::CudaSlice<f32>,
    row_counts: &[usize],
) {
    let dummy = DummyWeights { gpu, seed: 10 };
    let (h, q) = (cfg.hidden_size, cfg.num_heads * cfg.head_dim);
    let kv = cfg.num_kv_heads * cfg.head_dim;
    let ns = [q, kv, kv];
    let ms: Vec<_> = ["q_proj", "k_proj", "v_proj"]
        .iter()
        .zip(ns)
        .map(|(name, n)| {
            let parts = vec![vec![(name.to_string(), n)]];
            dummy
                .matrix(&parts, h, &lockstep::quant::TensorFormat::BF16, false)
                .expect("weights")
        })
        .collect();
    let data: Vec<_> = ms.iter().map(|m| &m.data).collect();
    let n_all: usize = ns.iter().sum();
    for &rows in row_counts {
        if rows * h > x.len() {
            continue;
        }
        let mut outs: Vec<_> = ns
            .iter()
            .map(|&n| gpu.alloc::<f32>(rows * n).expect("out"))
            .collect();
        let bytes = (n_all * h * 2 + rows * h * 4 + rows * n_all * 4) as f64;
        let report = |how: &str, s: f64| {
            println!(
                "| qkv [{q}+{kv}+{kv} x {h}] | {how} | {rows} | {:.1} | {:.0} | {:.0}% |",
                s * 1e6,
                bytes / s / 1e9,
                100.0 * bytes / bw / s
            )
        };
        let s = time(gpu, || {
            for ((m, &n), out) in ms.iter().zip(&ns).zip(outs.iter_mut()) {
                ops::grouped_gemm(
                    gpu,
                    x,
                    None,
                    None,
                    &m.data,
                    GemmRows::Dense(rows),
                    rows,
                    n,
                    h,
                    out,
                )
                .expect("gemm");
            }
        });
        report("three launches, Auto", s);
        for (path, split) in DENSE_CHOICES {
            if dense_choice_skipped(path, rows) {
                continue;
            }
            let s = time(gpu, || {
                let mut refs: Vec<_> = outs.iter_mut().collect();
                ops::dense_gemm_parts_on(path, split, gpu, x, None, &data, &ns, rows, h, &mut refs)
                    .expect("joined gemm")
            });
            report(&format!("one launch, {path:?}, split {split:?}"), s);
        }
    }
}

/// Timed runs a measurement (`--repeat`, default 20).
static REPEAT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

fn time(gpu: &Gpu, mut run: impl FnMut()) -> f64 {
    run();
    gpu.synchronize().expect("sync");
    median(
        (0..*REPEAT.get_or_init(|| 20))
            .map(|_| {
                let t = Instant::now();
                run();
                gpu.synchronize().expect("sync");
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// Paged attention of one layer: `seqs` sequences of context `ctx`, the last `rows_per_seq`
/// positions of each as query rows (prefill: all of them; decode: one).
fn attention(gpu: &Gpu, cfg: &ModelConfig, bw: f64) {
    let shape = AttnShape {
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        block_size: 16,
    };
    println!("| attention | seqs | context | query rows | us | K/V GB/s | of roofline |");
    println!("|---|---|---|---|---|---|---|");
    for (what, seqs, ctx, rows_per_seq) in [
        ("prefill", 1usize, 512usize, 512usize),
        ("prefill", 2, 2048, 2048),
        // The last 8,192-row chunk of a 32k prompt (its TTFT's largest attention launch).
        ("prefill", 1, 32768, 8192),
        ("decode", 1, 8192, 1),
        ("decode", 64, 512, 1),
        ("decode", 256, 512, 1),
        ("decode", 256, 768, 1),
        ("decode", 64, 4096, 1),
        ("decode", 16, 512, 1),
        ("decode", 16, 4096, 1),
        ("decode", 32, 4096, 1),
        ("decode", 1, 32768, 1),
    ] {
        let blocks_per_seq = ctx.div_ceil(shape.block_size);
        let kv_width = shape.kv_heads * shape.head_dim;
        let cache_elems = seqs * blocks_per_seq * shape.block_size * kv_width;
        let cache: Vec<u16> = (0..cache_elems)
            .map(|i| 0x3c00 ^ ((i as u16).wrapping_mul(40503) & 0x00ff))
            .collect();
        let (k, v) = (
            gpu.upload(&cache).expect("k"),
            gpu.upload(&cache).expect("v"),
        );
        let rows = seqs * rows_per_seq;
        let (mut pos, mut seq) = (Vec::new(), Vec::new());
        for s in 0..seqs {
            for p in ctx - rows_per_seq..ctx {
                pos.push(p as i32);
                seq.push(s as i32);
            }
        }
        let offsets: Vec<i32> = (0..seqs).map(|s| (s * blocks_per_seq) as i32).collect();
        let tables: Vec<i32> = (0..(seqs * blocks_per_seq) as i32).collect();
        let q_host: Vec<f32> = (0..rows * shape.heads * shape.head_dim)
            .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
            .collect();
        let q = gpu.upload(&q_host).expect("q");
        let mut out = gpu.alloc::<f32>(q_host.len()).expect("out");
        let (pos, seq) = (
            gpu.upload(&pos).expect("pos"),
            gpu.upload(&seq).expect("seq"),
        );
        let (offsets, tables) = (
            gpu.upload(&offsets).expect("offsets"),
            gpu.upload(&tables).expect("tables"),
        );
        let meta = AttnRows {
            pos: &pos,
            seq: &seq,
            table_offsets: &offsets,
            block_tables: &tables,
        };
        let bytes = 2.0 * (cache_elems * 2) as f64;
        let tiles = ops::prefill_tiles(std::iter::repeat_n(rows_per_seq, seqs));
        let dtiles = gpu.upload(&tiles).expect("tiles");
        let decode = rows_per_seq == 1;
        let split = if decode {
            ops::DecodeSplit::new(gpu, shape, ctx, rows).expect("split scratch")
        } else {
            None
        };
        let kernels: &[&str] = if decode {
            &[
                "paged_attention",
                "prefill_attention",
                "decode_attention",
                "decode_attention split-KV",
            ]
        } else if ops::PrefillBlocks::TwoHeadsTma.possible(gpu, shape) {
            &[
                "paged_attention",
                "prefill_attention",
                "prefill_attention two heads a block",
                "prefill_attention two heads, TMA copies",
            ]
        } else {
            &["paged_attention", "prefill_attention"]
        };
        // The one-row-at-a-time paged kernel is left out of the long prompt (seconds a run).
        let long = rows * ctx > 1 << 26;
        for &kernel in kernels
            .iter()
            .filter(|&&k| !(long && k == "paged_attention"))
        {
            let s = time(gpu, || {
                if kernel == "paged_attention" {
                    ops::paged_attention(gpu, &q, &mut out, &k, &v, &meta, rows, shape)
                } else if decode && kernel != "prefill_attention" {
                    let split = split.as_ref().filter(|_| kernel.ends_with("split-KV"));
                    ops::decode_attention(
                        gpu, &q, &mut out, &k, &v, &meta, None, rows, rows, shape, split,
                    )
                } else {
                    ops::prefill_attention(
                        gpu,
                        &q,
                        &mut out,
                        &k,
                        &v,
                        &meta,
                        &dtiles,
                        tiles.len() / 2,
                        rows,
                        shape,
                        match kernel {
                            "prefill_attention two heads a block" => ops::PrefillBlocks::TwoHeads,
                            "prefill_attention two heads, TMA copies" => {
                                ops::PrefillBlocks::TwoHeadsTma
                            }
                            _ => ops::PrefillBlocks::OneHead,
                        },
                    )
                }
                .expect("attention")
            });
            let splits = match (&split, kernel.ends_with("split-KV")) {
                (Some(p), true) => format!(" ({} splits)", p.splits(rows, shape)),
                _ => String::new(),
            };
            println!(
                "| {what}, {kernel}{splits} | {seqs} | {ctx} | {rows} | {:.1} | {:.0} | {:.0}% |",
                s * 1e6,
                bytes / s / 1e9,
                100.0 * bytes / bw / s
            );
        }
    }
}
