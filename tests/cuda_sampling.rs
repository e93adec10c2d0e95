//! The device sampler (kernels/sampling.cu, `backend::cuda::sampling`) against the CPU sampler
//! `sampling::sample` on fresh random logits. These need an NVIDIA GPU, so they are `#[ignore]`d
//! here and run on the GPU host by scripts/gpu-check.sh (`cuda_sampling --ignored`).
//!
//! What must hold: the same token, the same top-N ids in the same order, logprobs bit for bit
//! (the normalizer is added in one fixed order on both sides, `sampling::fixed_order_sum`, and
//! its log is the same `contract_ln`), the same errors. The probabilities are bit-identical (the
//! device's expf is a port of the host's, checked first), so the order, ties and counts are
//! exact; only the f64 cumulative sums of the top-p cut and the draw are added in another order. A token may therefore differ only when a cut or draw target lies
//! within rounding of a cumulative-probability boundary: such rows are detected with the CPU's
//! own numbers (`near_boundary`, margin 1e-9 relative, far wider than f64 rounding) and counted,
//! never silently passed; they must stay rare.

use cudarc::driver::CudaSlice;
use lockstep::backend::cuda::sampling::{host_expf, sample_rows, DeviceSampler};
use lockstep::backend::cuda::Gpu;
use lockstep::model::cuda::{CudaModel, CudaSizes, CudaWeights};
use lockstep::model::{ForwardBatch, ModelConfig, SeqInput};
use lockstep::quant::Recipe;
use lockstep::sampling::{
    self, apply_penalties, apply_temperature, mask_min_new_tokens, uniform, Decoding, SampleInput,
    SamplerScratch, SamplingError, SamplingParams, TokenHistory, TokenLogprobs,
    ValidSamplingParams,
};

mod common;
use common::cuda::{gpu, seed, Rng};

/// Row shapes: flat and wide ranges, one dominant token, coarse grids with many exact ties and
/// masked tokens, all equal, and occasionally broken rows.
fn logits_row(rng: &mut Rng, v: usize) -> Vec<f32> {
    match rng.below(8) {
        0 => (0..v).map(|_| rng.unit() * 20.0).collect(),
        1 => (0..v).map(|_| rng.unit() * 2.0).collect(),
        2 => (0..v).map(|_| rng.unit() * 200.0 - 100.0).collect(),
        3 => peaked_row(rng, v),
        4 | 5 => grid_row(rng, v),
        6 => vec![rng.pick(&[0.0f32, 1.5, -3.0]); v],
        _ => {
            let mut l: Vec<f32> = (0..v).map(|_| rng.unit() * 10.0).collect();
            match rng.below(4) {
                0 => l[rng.below(v)] = f32::NAN,
                1 => l[rng.below(v)] = f32::INFINITY,
                2 => l.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
                _ => {}
            }
            l
        }
    }
}

/// A bump of small logits with one token 15 above it.
fn peaked_row(rng: &mut Rng, v: usize) -> Vec<f32> {
    let mut l: Vec<f32> = (0..v)
        .map(|_| (rng.unit() + rng.unit() + rng.unit()) * 2.0)
        .collect();
    let spike = rng.below(v);
    l[spike] += 15.0;
    l
}

/// A coarse grid of logits (many exact ties) with a tenth of the tokens masked.
fn grid_row(rng: &mut Rng, v: usize) -> Vec<f32> {
    (0..v)
        .map(|_| {
            if rng.unit() < 0.1 {
                f32::NEG_INFINITY
            } else {
                (rng.unit() * 12.0).floor() * 0.5
            }
        })
        .collect()
}

/// A request's sampling parameters and history, drawn over the ranges that matter.
struct Case {
    params: ValidSamplingParams,
    history: TokenHistory,
    eos: Vec<u32>,
    seed: u64,
    sample_index: u32,
    top_n: usize,
    /// `return_logprob`: a greedy row without it or a top-N takes the argmax alone.
    logprob: bool,
}

impl Case {
    fn random(rng: &mut Rng, v: usize) -> Case {
        let greedy = rng.below(6) == 0;
        Case::drawn(rng, v, greedy)
    }

    /// A greedy row that asks for no logprobs (`argmax_rows` when a launch holds only such).
    fn argmax_only(rng: &mut Rng, v: usize) -> Case {
        Case {
            top_n: 0,
            logprob: false,
            ..Case::drawn(rng, v, true)
        }
    }

    fn drawn(rng: &mut Rng, v: usize, greedy: bool) -> Case {
        let prompt: Vec<u32> = (0..rng.below(50))
            .map(|_| rng.below(v + 10) as u32)
            .collect();
        let mut history = TokenHistory::new(&prompt);
        let outputs = rng.below(20);
        for _ in 0..outputs {
            history.push(rng.below(v) as u32);
        }
        let params = SamplingParams {
            temperature: if greedy {
                0.0
            } else {
                rng.pick(&[0.3, 0.7, 1.0, 1.0, 1.5])
            },
            top_k: rng.pick(&[-1, -1, 1, 2, 5, 50, 1000, 200_000]),
            top_p: rng.pick(&[1.0, 1.0, 0.95, 0.9, 0.5, 0.1]),
            min_p: rng.pick(&[0.0, 0.0, 0.0, 0.01, 0.1, 0.5]),
            repetition_penalty: rng.pick(&[1.0, 1.0, 1.3, 0.8]),
            frequency_penalty: rng.pick(&[0.0, 0.0, 0.5, -0.3]),
            presence_penalty: rng.pick(&[0.0, 0.0, 0.4]),
            min_new_tokens: rng.pick(&[0, 0, outputs as i64 + 1]),
            stop_token_ids: (0..rng.below(3)).map(|_| rng.below(v) as i64).collect(),
            ..Default::default()
        }
        .validate(&Default::default())
        .expect("valid random params");
        Case {
            params,
            history,
            eos: vec![(v - 1) as u32, rng.below(v) as u32],
            seed: rng.next(),
            sample_index: rng.below(4) as u32,
            top_n: rng.pick(&[0, 0, 1, 5, 20, 100]),
            logprob: rng.below(2) == 0,
        }
    }

    fn input(&self) -> SampleInput<'_> {
        SampleInput {
            params: &self.params,
            history: &self.history,
            eos_token_ids: &self.eos,
            seed: self.seed,
            sample_index: self.sample_index,
            top_logprobs_num: self.top_n,
            logprob: self.logprob,
        }
    }
}

/// The reference's kept set in canonical order with the processed probabilities, and whether a
/// top-p cut or the draw target lies within `margin` (relative) of a cumulative boundary, all
/// from the CPU's own processing (the definition in src/sampling/sample.rs, by a full sort).
fn reference(
    raw: &[f32],
    input: &SampleInput<'_>,
    margin: f64,
) -> Option<(Vec<u32>, Vec<f32>, bool)> {
    let Decoding::Sample {
        top_k,
        top_p,
        min_p,
        ..
    } = input.params.decoding
    else {
        return None;
    };
    let mut l = raw.to_vec();
    apply_penalties(&mut l, &input.params.penalties, input.history);
    mask_min_new_tokens(&mut l, input.params, input.history, input.eos_token_ids);
    apply_temperature(&mut l, &input.params.decoding);
    if l.iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
        return None;
    }
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let p: Vec<f32> = l.iter().map(|&x| (x - max).exp()).collect();
    let total: f64 = p.iter().map(|&x| x as f64).sum();
    let mut kept: Vec<u32> = (0..l.len() as u32)
        .filter(|&t| p[t as usize] > 0.0 && p[t as usize] >= min_p)
        .collect();
    kept.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b)));
    if let Some(k) = top_k {
        kept.truncate(k);
    }
    let mut near = false;
    if top_p < 1.0 {
        let threshold = top_p as f64 * total;
        let mut cum = 0.0f64;
        let mut cut = kept.len();
        for (r, &t) in kept.iter().enumerate() {
            cum += p[t as usize] as f64;
            near |= (cum - threshold).abs() <= margin * total;
            if cum >= threshold {
                cut = r + 1;
                break;
            }
        }
        kept.truncate(cut);
    }
    let mass: f64 = kept.iter().map(|&t| p[t as usize] as f64).sum();
    let target = uniform(
        input.seed,
        input.sample_index as u64,
        input.history.output_len() as u64,
    ) * mass;
    let mut cum = 0.0f64;
    for &t in &kept {
        cum += p[t as usize] as f64;
        near |= (cum - target).abs() <= margin * mass;
    }
    Some((kept, p, near))
}

/// Logprobs are the CPU's bit for bit: the same probabilities, the normalizer added in the same
/// order (`sampling::fixed_order_sum`) and the same `contract_ln`.
fn close(got: f32, want: f32) -> bool {
    got.to_bits() == want.to_bits()
}

/// Compares one row's results; returns whether it was an allowed boundary exclusion.
fn check_row(
    what: &str,
    raw: &[f32],
    input: &SampleInput<'_>,
    got: &Result<TokenLogprobs, SamplingError>,
    want: &Result<TokenLogprobs, SamplingError>,
) -> bool {
    match (got, want) {
        (Err(g), Err(w)) => {
            match (g, w) {
                (
                    SamplingError::NonFiniteLogit { token: a, value: x },
                    SamplingError::NonFiniteLogit { token: b, value: y },
                ) => assert!(
                    a == b && (x == y || (x.is_nan() && y.is_nan())),
                    "{what}: {g:?} vs {w:?}"
                ),
                _ => assert_eq!(g, w, "{what}"),
            }
            false
        }
        (Ok(g), Ok(w)) => {
            let mut excluded = false;
            if g.token != w.token {
                let near = reference(raw, input, 1e-9).is_some_and(|(_, _, near)| near);
                assert!(
                    near,
                    "{what}: device token {} vs CPU {} ({:?})",
                    g.token, w.token, input.params
                );
                excluded = true;
            } else {
                assert!(
                    close(g.logprob, w.logprob),
                    "{what}: logprob {} vs {}",
                    g.logprob,
                    w.logprob
                );
            }
            let ids = |t: &TokenLogprobs| t.top.iter().map(|e| e.0).collect::<Vec<_>>();
            assert_eq!(ids(g), ids(w), "{what}: top-{} ids", input.top_logprobs_num);
            for (a, b) in g.top.iter().zip(&w.top) {
                assert!(close(a.1, b.1), "{what}: top logprob {} vs {}", a.1, b.1);
            }
            excluded
        }
        _ => panic!("{what}: device {got:?} vs CPU {want:?}"),
    }
}

fn upload_rows(g: &Gpu, rows: &[Vec<f32>]) -> CudaSlice<f32> {
    g.upload(&rows.concat()).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn device_expf_equals_the_host_expf() {
    let g = gpu();
    // Every 13th float in [-110, 0] (the probabilities' arguments are <= 0), and the edges.
    let mut x: Vec<f32> = (0x8000_0000u32..=0xc2dc_0000)
        .step_by(13)
        .map(f32::from_bits)
        .collect();
    x.extend([
        0.0,
        -0.0,
        f32::NEG_INFINITY,
        f32::from_bits(0xc2cf_f1b4),
        f32::from_bits(0xc2cf_f1b3),
        f32::from_bits(0xc2cf_f1b5),
        -88.0,
        -87.99999,
        f32::MIN_POSITIVE,
        1e-30,
        5.0,
    ]);
    let n = x.len();
    let dx = g.upload(&x).unwrap();
    let mut dy = g.alloc::<f32>(n).unwrap();
    host_expf(&g, &dx, &mut dy, n).unwrap();
    let y = g.download(&dy, n).unwrap();
    let bad: Vec<(f32, f32, f32)> = x
        .iter()
        .zip(&y)
        .filter(|(a, b)| a.exp().to_bits() != b.to_bits())
        .map(|(a, b)| (*a, *b, a.exp()))
        .take(10)
        .collect();
    assert!(
        bad.is_empty(),
        "device expf differs from the host's on {} values, e.g. (x, device, host) {bad:?}",
        x.iter()
            .zip(&y)
            .filter(|(a, b)| a.exp().to_bits() != b.to_bits())
            .count()
    );
    println!("device expf equals the host's on {n} arguments");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn device_sampling_equals_the_cpu_sampler() {
    let g = gpu();
    let mut rng = Rng(seed());
    let (mut rows_checked, mut excluded) = (0usize, 0usize);
    for (v, rounds) in [
        (3usize, 20),
        (17, 20),
        (1000, 20),
        (32_000, 8),
        (151_936, 12),
    ] {
        // 8 rows per launch and a small penalty buffer: a batch of 16 takes several launches.
        let mut sampler = DeviceSampler::new(&g, v, 8, 64, 200).unwrap();
        // Greedy rows without logprobs stop after the max walk (the CPU's tokens, logprob 0).
        sampler.set_greedy_argmax(true);
        let mut scratch = SamplerScratch::default();
        for round in 0..rounds {
            let batch = 16;
            let cases: Vec<Case> = (0..batch).map(|_| Case::random(&mut rng, v)).collect();
            let raws: Vec<Vec<f32>> = (0..batch).map(|_| logits_row(&mut rng, v)).collect();
            let mut dev = upload_rows(&g, &raws);
            let rows: Vec<(usize, SampleInput<'_>)> = cases
                .iter()
                .enumerate()
                .map(|(i, c)| (i, c.input()))
                .collect();
            let got = sample_rows(&g, &mut sampler, &mut dev, &rows).unwrap();
            for (i, c) in cases.iter().enumerate() {
                let mut row = raws[i].clone();
                let want = sampling::sample(&mut row, &c.input(), &mut scratch);
                let what = format!("vocab {v} round {round} row {i}");
                excluded += check_row(&what, &raws[i], &c.input(), &got[i], &want) as usize;
                rows_checked += 1;
            }
        }
    }
    println!("{rows_checked} rows equal, {excluded} boundary exclusions");
    assert!(
        excluded * 100 <= rows_checked,
        "{excluded} of {rows_checked} rows differ at a boundary: more than rounding explains"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn device_draws_cover_exactly_the_cpu_kept_set() {
    let g = gpu();
    let mut rng = Rng(seed());
    let (v, draws) = (1000usize, 2048usize);
    let mut sampler = DeviceSampler::new(&g, v, 256, draws, 1 << 16).unwrap();
    let mut scratch = SamplerScratch::default();
    for (temperature, top_k, top_p, min_p) in [
        (1.0, -1, 1.0, 0.0),
        (0.9, 20, 0.8, 0.02),
        (1.3, -1, 0.9, 0.0),
        (0.7, 50, 1.0, 0.05),
        (1.0, 7, 1.0, 0.0),
    ] {
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            ..Default::default()
        }
        .validate(&Default::default())
        .unwrap();
        let history = TokenHistory::new(&[]);
        // A peaked row over a coarse grid: ties inside the kept set and at its edges.
        let raw: Vec<f32> = (0..v).map(|_| (rng.unit() * 16.0).floor() * 0.4).collect();
        let base = rng.next();
        let inputs: Vec<SampleInput<'_>> = (0..draws)
            .map(|d| SampleInput {
                params: &params,
                history: &history,
                eos_token_ids: &[],
                seed: base.wrapping_add(d as u64),
                sample_index: 0,
                top_logprobs_num: 0,
                logprob: true,
            })
            .collect();
        let mut dev = upload_rows(&g, &vec![raw.clone(); draws]);
        let rows: Vec<(usize, SampleInput<'_>)> = inputs.iter().copied().enumerate().collect();
        let got = sample_rows(&g, &mut sampler, &mut dev, &rows).unwrap();
        let (kept, p, _) = reference(&raw, &inputs[0], 0.0).unwrap();
        let mass: f64 = kept.iter().map(|&t| p[t as usize] as f64).sum();
        let mut seen = std::collections::BTreeSet::new();
        for (d, input) in inputs.iter().enumerate() {
            let token = got[d].as_ref().unwrap().token;
            let want = sampling::sample(&mut raw.clone(), input, &mut scratch).unwrap();
            let what = format!("t={temperature} k={top_k} p={top_p} min_p={min_p} draw {d}");
            if token != want.token {
                assert!(
                    reference(&raw, input, 1e-9).unwrap().2,
                    "{what}: device {token} vs CPU {}",
                    want.token
                );
            }
            assert!(kept.contains(&token), "{what}: {token} is not kept");
            seen.insert(token);
        }
        // A kept token with probability q is missed by 2048 draws with chance (1-q)^2048:
        // below 1e-9 for q >= 1%.
        for &t in &kept {
            let q = p[t as usize] as f64 / mass;
            assert!(
                q < 0.01 || seen.contains(&t),
                "kept token {t} (q = {q:.3}) never drawn"
            );
        }
        println!(
            "t={temperature} k={top_k} p={top_p} min_p={min_p}: kept {}, drawn {}",
            kept.len(),
            seen.len()
        );
    }
}

/// A draw with no top-k, top-p or min-p takes its own path on the device: the kept mass is the
/// normalizer, and the draw's first histogram pass is built on the probabilities' walk. A min-p
/// below every probability of the row keeps the same tokens through the general path (the mass
/// walk, the histogram's own walk): the two must give the same draws bit for bit.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn untruncated_draws_give_the_bits_of_the_general_path() {
    let g = gpu();
    let mut rng = Rng(seed());
    let params = |min_p: f64| {
        SamplingParams {
            temperature: 1.0,
            min_p,
            ..Default::default()
        }
        .validate(&Default::default())
        .unwrap()
    };
    // Every finite logit of a row lies within 60 of its maximum: p >= e^-60 > 1e-30 = min_p.
    let (untruncated, general) = (params(0.0), params(1e-30));
    let history = TokenHistory::new(&[]);
    for v in [1000usize, 151_936] {
        let rows = 64;
        let mut sampler = DeviceSampler::new(&g, v, rows, rows, 64).unwrap();
        let raws: Vec<Vec<f32>> = (0..rows)
            .map(|r| match r % 3 {
                0 => (0..v).map(|_| rng.unit() * 60.0).collect(),
                1 => peaked_row(&mut rng, v),
                _ => grid_row(&mut rng, v),
            })
            .collect();
        let base = rng.next();
        let mut draw = |params: &ValidSamplingParams| {
            let inputs: Vec<(usize, SampleInput<'_>)> = (0..rows)
                .map(|r| {
                    let input = SampleInput {
                        params,
                        history: &history,
                        eos_token_ids: &[],
                        seed: base.wrapping_add(r as u64),
                        sample_index: 0,
                        top_logprobs_num: 0,
                        logprob: true,
                    };
                    (r, input)
                })
                .collect();
            let mut dev = upload_rows(&g, &raws);
            sample_rows(&g, &mut sampler, &mut dev, &inputs).unwrap()
        };
        let (fast, slow) = (draw(&untruncated), draw(&general));
        for (r, (a, b)) in fast.iter().zip(&slow).enumerate() {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            assert_eq!(
                (a.token, a.logprob.to_bits()),
                (b.token, b.logprob.to_bits()),
                "vocab {v} row {r}: untruncated {a:?} vs min-p {b:?}"
            );
        }
    }
}

/// Launches of greedy rows without logprobs split each row over blocks (`argmax_rows`): the
/// tokens and errors of the CPU's greedy rows and of the device's rows that also compute the
/// logprob (`sample_rows`), at every row count from one (64 blocks a row) to 300 (two launches
/// of a block or two a row), penalties and masks included; a launch's tickets are left for the
/// next (several launches a sampler).
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn greedy_rows_without_logprobs_give_the_tokens_of_rows_with_them() {
    let g = gpu();
    let mut rng = Rng(seed());
    let mut scratch = SamplerScratch::default();
    let mut checked = 0;
    for (v, batches) in [
        (3usize, &[1usize, 5][..]),
        (300, &[1, 2, 40]),
        (1000, &[1, 7, 64]),
        (151_936, &[1, 2, 8, 33, 300]),
    ] {
        let mut sampler = DeviceSampler::new(&g, v, 256, 300, 4096).unwrap();
        sampler.set_greedy_argmax(true);
        for &batch in batches {
            for round in 0..2 {
                let cases: Vec<Case> = (0..batch).map(|_| Case::argmax_only(&mut rng, v)).collect();
                let raws: Vec<Vec<f32>> = (0..batch).map(|_| logits_row(&mut rng, v)).collect();
                let with_logprob: Vec<Case> = cases
                    .iter()
                    .map(|c| Case {
                        params: c.params.clone(),
                        history: c.history.clone(),
                        eos: c.eos.clone(),
                        logprob: true,
                        ..*c
                    })
                    .collect();
                let run = |sampler: &mut DeviceSampler, cases: &[Case]| {
                    let rows: Vec<(usize, SampleInput<'_>)> = cases
                        .iter()
                        .enumerate()
                        .map(|(i, c)| (i, c.input()))
                        .collect();
                    let mut dev = upload_rows(&g, &raws);
                    sample_rows(&g, sampler, &mut dev, &rows).unwrap()
                };
                let (alone, full) = (run(&mut sampler, &cases), run(&mut sampler, &with_logprob));
                for (i, c) in cases.iter().enumerate() {
                    let what = format!("vocab {v} batch {batch} round {round} row {i}");
                    let want = sampling::sample(&mut raws[i].clone(), &c.input(), &mut scratch);
                    check_row(&what, &raws[i], &c.input(), &alone[i], &want);
                    match (&alone[i], &full[i]) {
                        (Ok(a), Ok(f)) => {
                            assert_eq!(a.token, f.token, "{what}: without logprob vs with");
                            assert_eq!(a.logprob, 0.0, "{what}: no logprob was asked");
                        }
                        (Err(a), Err(f)) => {
                            assert_eq!(format!("{a:?}"), format!("{f:?}"), "{what}: the same error")
                        }
                        (a, f) => panic!("{what}: without logprob {a:?}, with {f:?}"),
                    }
                    checked += 1;
                }
            }
        }
    }
    println!("{checked} greedy rows without logprobs equal the CPU's and the logprob rows'");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn forward_and_sample_equals_forward_then_the_cpu_sampler() {
    // The model path: rows sampled right after their lm_head chunk (one sequence's 300 logits
    // rows span two chunks of 256), the other rows copied to the host as before.
    let mut raw: serde_json::Value =
        serde_json::from_str(lockstep::serve::EMBEDDED_CONFIG).unwrap();
    raw["num_hidden_layers"] = 2.into();
    let cfg = ModelConfig::from_json(raw).unwrap();
    let g = gpu();
    let w = CudaWeights::dummy(&g, &cfg, &Recipe::bf16(), 9).unwrap();
    let sizes = CudaSizes {
        max_batch_tokens: 512,
        max_running_requests: 4,
        block_size: 16,
        max_context_len: 512,
        mem_fraction_static: 0.9,
        max_total_tokens: Some(1024),
        block_scaled_gemm: false,
        graph_max_rows: lockstep::engine::defaults::CUDA_GRAPH_MAX_BS,
    };
    let mut model = CudaModel::new(g, cfg.clone(), w, sizes).unwrap();
    let mut rng = Rng(seed());
    let v = cfg.vocab_size;
    let a: Vec<u32> = (0..300).map(|_| rng.below(v) as u32).collect();
    let b: Vec<u32> = (0..5).map(|_| rng.below(v) as u32).collect();
    let c: Vec<u32> = (0..9).map(|_| rng.below(v) as u32).collect();
    let (ta, tb, tc): (Vec<u32>, Vec<u32>, Vec<u32>) =
        ((0..19).collect(), vec![19], (20..21).collect());
    let batch = ForwardBatch {
        seqs: vec![
            SeqInput {
                tokens: &a,
                start_pos: 0,
                block_table: &ta,
                logits_from: Some(0),
            },
            SeqInput {
                tokens: &b,
                start_pos: 0,
                block_table: &tb,
                logits_from: Some(4),
            },
            SeqInput {
                tokens: &c,
                start_pos: 0,
                block_table: &tc,
                logits_from: Some(6),
            },
        ],
    };
    // Every row asks for its logprob: the model's sampler takes greedy rows without one as
    // `LOCKSTEP_GREEDY_ARGMAX` says, and off it reports a logprob where the CPU reports 0.
    let cases: Vec<Case> = (0..3)
        .map(|_| Case {
            logprob: true,
            ..Case::random(&mut rng, v)
        })
        .collect();
    // The second sequence is not sampled (a mid-prefill chunk asking for prompt logprobs).
    let samples: Vec<Option<SampleInput<'_>>> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| (i != 1).then(|| c.input()))
        .collect();
    let all = model.forward(&batch).unwrap();
    let (host, sampled) = model.forward_and_sample(&batch, &samples).unwrap();
    assert_eq!(all.logit_rows, vec![(0, 300), (300, 1), (301, 3)]);
    assert_eq!(host.logit_rows, vec![(0, 299), (299, 1), (300, 2)]);
    // The same batch twice gives the same logits; the host rows are the unsampled ones.
    let rows_of = |out: &lockstep::model::ForwardOutput, i: usize, k: usize| {
        let (first, _) = out.logit_rows[i];
        out.logits[(first + k) * v..][..v].to_vec()
    };
    for (i, n) in [(0, 299), (1, 1), (2, 2)] {
        for k in 0..n {
            assert!(
                rows_of(&host, i, k) == rows_of(&all, i, k),
                "sequence {i} row {k} differs between two identical forwards"
            );
        }
    }
    let mut scratch = SamplerScratch::default();
    for (i, n) in [(0, 300), (2, 3)] {
        let raw_row = rows_of(&all, i, n - 1);
        let input = samples[i].unwrap();
        let want = sampling::sample(&mut raw_row.clone(), &input, &mut scratch);
        let got = sampled[i].as_ref().expect("sampled on the device");
        check_row(&format!("sequence {i}"), &raw_row, &input, got, &want);
    }
    assert!(sampled[1].is_none());
}
