//! Batch invariance on the GPU, kernel by kernel, on fresh random data (docs/determinism.md):
//! an op gives a row the same bits whatever else its launch holds. For M in
//! {1, 2, 7, 16, 64, 200, 1024} rows drawn at random from a 1024-row input, in a random order
//! (so a row's position in the launch changes too), every GEMM path (FFMA, tensor cores in
//! tiles and for few rows, the automatic pick) in every weight format, dense and grouped over
//! experts, the activation quantizers, RMSNorm with its residual add, routing and the weighted
//! combine must reproduce, bit for bit, what the full 1024-row launch gave those rows.
//! Attention is checked the same way in tests/cuda_attention.rs, whole models and the engine in
//! tests/cuda_lockstep.rs.
//!
//! These need an NVIDIA GPU, so they are `#[ignore]`d here and run on the GPU host by
//! scripts/gpu-check.sh (`cuda_invariance --ignored`).

use cudarc::driver::CudaSlice;
use half::bf16;
use lockstep::backend::cpu::linear::{make_linear, DenseWeight};
use lockstep::backend::cuda::ops::{self, GemmPath, GemmRows, MoePlan, Nvfp4Out, SplitK};
use lockstep::backend::cuda::weights::{Activation, GpuMatrix};
use lockstep::backend::cuda::Gpu;
use lockstep::backend::Linear;
use lockstep::quant::nvfp4::ScaleGranularity;
use lockstep::quant::{Format, TensorFormat};

mod common;
use common::cuda::{gpu, seed, Rng};

const ROW_COUNTS: [usize; 7] = [1, 2, 7, 16, 64, 200, 1024];
const ALL: usize = 1024;
/// The engine's choice of kernel and split.
const AUTO: (GemmPath, SplitK) = (GemmPath::Auto, SplitK::Auto);
/// The engine's choice and every tensor-core kernel (the ones that share the K chain's bits).
const TENSOR_CORE_CHOICES: [GemmPath; 7] = [
    GemmPath::Auto,
    GemmPath::TensorCore,
    GemmPath::TensorCoreWide,
    GemmPath::Wgmma,
    GemmPath::Skinny,
    GemmPath::Skinny4,
    GemmPath::SkinnyKSplit,
];

/// `m` distinct rows of 0..ALL in a random order.
fn subset(rng: &mut Rng, m: usize) -> Vec<usize> {
    let mut rows: Vec<usize> = (0..ALL).collect();
    for i in 0..m {
        let j = i + rng.below(ALL - i);
        rows.swap(i, j);
    }
    rows.truncate(m);
    rows
}

fn gather(x: &[f32], rows: &[usize], width: usize) -> Vec<f32> {
    rows.iter()
        .flat_map(|&r| x[r * width..(r + 1) * width].iter().copied())
        .collect()
}

fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} is {:e} where the full launch gave {:e}",
            got[i], want[i]
        );
    }
}

fn formats() -> [TensorFormat; 3] {
    [
        TensorFormat::BF16,
        TensorFormat {
            format: Format::Mxfp8,
            ..TensorFormat::BF16
        },
        TensorFormat {
            format: Format::Nvfp4,
            activation_scale: ScaleGranularity::PerToken,
            four_over_six: None,
        },
    ]
}

/// The GEMM input of a layer in format `fmt` for `rows` rows of x: x itself (BF16 layers), or
/// its per-token quantization's dequantized values (and, for NVFP4, the row scales).
struct Input {
    x: CudaSlice<f32>,
    row_scale: Option<CudaSlice<f32>>,
}

fn quantized(g: &Gpu, m: &GpuMatrix, x: &[f32], rows: usize, k: usize) -> Input {
    let dx = g.upload(x).unwrap();
    let (mut data, mut scales) = (
        g.alloc::<u8>(rows * k).unwrap(),
        g.alloc::<u8>(rows * k / 16).unwrap(),
    );
    let mut deq = g.alloc::<f32>(rows * k).unwrap();
    match m.act {
        Activation::Plain => Input {
            x: dx,
            row_scale: None,
        },
        Activation::Mxfp8 => {
            ops::mxfp8_quantize(g, &dx, rows * k, &mut data, &mut scales, Some(&mut deq)).unwrap();
            Input {
                x: deq,
                row_scale: None,
            }
        }
        Activation::Nvfp4 { per_token, params } => {
            assert!(per_token, "the recipes' default");
            let mut row_scale = g.alloc::<f32>(rows).unwrap();
            ops::nvfp4_quantize_f32(
                g,
                &dx,
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
                },
            )
            .unwrap();
            Input {
                x: deq,
                row_scale: Some(row_scale),
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn gemm(
    g: &Gpu,
    (path, split): (GemmPath, SplitK),
    input: &Input,
    row_index: Option<&CudaSlice<i32>>,
    m: &GpuMatrix,
    rows: GemmRows<'_>,
    out_rows: usize,
) -> Vec<f32> {
    let mut out = g.upload(&vec![f32::NAN; out_rows * m.n]).unwrap();
    ops::grouped_gemm_on(
        path,
        split,
        g,
        &input.x,
        row_index,
        input.row_scale.as_ref(),
        &m.data,
        rows,
        out_rows,
        m.n,
        m.k,
        &mut out,
    )
    .unwrap();
    g.download(&out, out_rows * m.n).unwrap()
}

fn bf16_weights(rng: &mut Rng, n: usize, k: usize) -> DenseWeight {
    DenseWeight::Bf16(
        rng.vec(n * k, 0.08)
            .into_iter()
            .map(bf16::from_f32)
            .collect(),
    )
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn dense_gemm_rows_have_the_same_bits_for_every_row_count_and_path() {
    let g = gpu();
    let mut rng = Rng(seed());
    // K = 96: a partial group of spans for the few-rows kernel; N = 100, 136: partial column
    // tiles; K = 800: three K segments and a partial fourth; K = 2048: eight segments.
    for (n, k) in [(100, 96), (136, 800), (576, 2048)] {
        let x = rng.vec(ALL * k, 2.0);
        let mut layers: Vec<(String, Box<dyn Linear>)> = formats()
            .iter()
            .map(|f| {
                let l = make_linear(bf16_weights(&mut rng, n, k), n, k, f, None);
                (format!("{:?}", f.format), l)
            })
            .collect();
        let f32_w = DenseWeight::F32(rng.vec(n * k, 0.08));
        layers.push((
            "F32".into(),
            make_linear(f32_w, n, k, &TensorFormat::BF16, None),
        ));
        for (name, layer) in &layers {
            let m = GpuMatrix::upload(&g, &[vec![&**layer]]).unwrap();
            let full = quantized(&g, &m, &x, ALL, k);
            let want = gemm(&g, AUTO, &full, None, &m, GemmRows::Dense(ALL), ALL);
            let full_deq = g.download(&full.x, ALL * k).unwrap();
            for rows_m in ROW_COUNTS {
                let rows = subset(&mut rng, rows_m);
                let what = |how: &str| format!("{name} [{n} x {k}], {rows_m} rows, {how}");
                let want_rows = gather(&want, &rows, n);
                // The rows copied out and quantized on their own.
                let part = quantized(&g, &m, &gather(&x, &rows, k), rows_m, k);
                assert_bits(
                    &g.download(&part.x, rows_m * k).unwrap(),
                    &gather(&full_deq, &rows, k),
                    &what("quantized activations"),
                );
                for path in TENSOR_CORE_CHOICES {
                    for split in [SplitK::Auto, SplitK::Off, SplitK::On] {
                        let choice = (path, split);
                        let got =
                            gemm(&g, choice, &part, None, &m, GemmRows::Dense(rows_m), rows_m);
                        assert_bits(&got, &want_rows, &what(&format!("{choice:?}")));
                    }
                }
                // Read in place from the full input through a row index.
                let index: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
                let di = g.upload(&index).unwrap();
                let got = gemm(
                    &g,
                    (GemmPath::Auto, SplitK::On),
                    &full,
                    Some(&di),
                    &m,
                    GemmRows::Dense(rows_m),
                    rows_m,
                );
                assert_bits(&got, &want_rows, &what("through a row index, split over K"));
            }
            println!("{name} [{n} x {k}]: every row bitwise equal for every row count and path");
        }
    }
}

/// Layers over one input in one launch (the attention's q, k and v): each part's output has the
/// bits of its own launch, on every kernel, split or not, in every format (each NVFP4 layer
/// with its own S_dec).
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn joined_launches_give_each_part_the_bits_of_its_own_launch() {
    let g = gpu();
    let mut rng = Rng(seed());
    // Parts of 160, 32 and 96 columns: partial column blocks on every kernel; K = 800: three
    // K segments and a partial fourth.
    let (ns, k) = ([160usize, 32, 96], 800);
    let mut kinds: Vec<(String, Vec<Box<dyn Linear>>)> = formats()
        .iter()
        .map(|f| {
            let layers = ns
                .iter()
                .map(|&n| make_linear(bf16_weights(&mut rng, n, k), n, k, f, None))
                .collect();
            (format!("{:?}", f.format), layers)
        })
        .collect();
    let f32_layers = ns
        .iter()
        .map(|&n| {
            let w = DenseWeight::F32(rng.vec(n * k, 0.08));
            make_linear(w, n, k, &TensorFormat::BF16, None)
        })
        .collect();
    kinds.push(("F32".into(), f32_layers));
    for (name, layers) in &kinds {
        let ms: Vec<GpuMatrix> = layers
            .iter()
            .map(|l| GpuMatrix::upload(&g, &[vec![&**l]]).unwrap())
            .collect();
        let data: Vec<_> = ms.iter().map(|m| &m.data).collect();
        assert!(
            ops::joinable(&data),
            "{name}: three dense layers of one format"
        );
        let paths: &[GemmPath] = if name == "F32" {
            &[GemmPath::Auto, GemmPath::Ffma]
        } else {
            &TENSOR_CORE_CHOICES
        };
        for rows in [1, 5, 13, 77, 300] {
            let x = rng.vec(rows * k, 2.0);
            let input = quantized(&g, &ms[0], &x, rows, k);
            let want: Vec<Vec<f32>> = ms
                .iter()
                .map(|m| gemm(&g, AUTO, &input, None, m, GemmRows::Dense(rows), rows))
                .collect();
            for &path in paths {
                for split in [SplitK::Auto, SplitK::Off, SplitK::On] {
                    let mut outs: Vec<CudaSlice<f32>> = ns
                        .iter()
                        .map(|&n| g.upload(&vec![f32::NAN; rows * n]).unwrap())
                        .collect();
                    let mut out_refs: Vec<&mut CudaSlice<f32>> = outs.iter_mut().collect();
                    ops::dense_gemm_parts_on(
                        path,
                        split,
                        &g,
                        &input.x,
                        input.row_scale.as_ref(),
                        &data,
                        &ns,
                        rows,
                        k,
                        &mut out_refs,
                    )
                    .unwrap();
                    for (i, (out, want)) in outs.iter().zip(&want).enumerate() {
                        let got = g.download(out, rows * ns[i]).unwrap();
                        let what = format!("{name}, {rows} rows, {path:?} {split:?}, part {i}");
                        assert_bits(&got, want, &what);
                    }
                }
            }
        }
        println!("{name}: every part of a joined launch bitwise its own launch's");
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn moe_rows_have_the_same_bits_for_every_token_count_and_path() {
    let g = gpu();
    let mut rng = Rng(seed());
    // K = 288: 9 spans; N = 96: a partial column tile.
    let (experts, top_k, n, k) = (16, 4, 96, 288);
    let logits = rng.vec(ALL * experts, 3.0);
    let x = rng.vec(ALL * k, 2.0);
    let route = |l: &[f32], tokens: usize| {
        let (mut ids, mut w) = (
            g.alloc::<i32>(tokens * top_k).unwrap(),
            g.alloc::<f32>(tokens * top_k).unwrap(),
        );
        let dl = g.upload(l).unwrap();
        ops::moe_route(
            &g, &dl, tokens, experts, top_k, true, None, &mut ids, &mut w,
        )
        .unwrap();
        (ids, w)
    };
    let (ids_full, w_full) = route(&logits, ALL);
    let (ids_h, w_h) = (
        g.download(&ids_full, ALL * top_k).unwrap(),
        g.download(&w_full, ALL * top_k).unwrap(),
    );
    let mut plan_full = MoePlan::new(&g, ALL * top_k, experts).unwrap();
    plan_full.build(&g, &ids_full, ALL, top_k, experts).unwrap();
    // Output rows of (token, slot) pairs, as the combine reads them.
    let by_slot = |out: &[f32], plan: &MoePlan, tokens: usize| -> Vec<f32> {
        let slot_row = g.download(&plan.slot_row, tokens * top_k).unwrap();
        slot_row
            .iter()
            .flat_map(|&r| out[r as usize * n..][..n].iter().copied())
            .collect()
    };
    let combine = |out: &[f32], plan: &MoePlan, w: &CudaSlice<f32>, tokens: usize| {
        let dout = g.upload(out).unwrap();
        let mut y = g.upload(&vec![f32::NAN; tokens * n]).unwrap();
        ops::moe_combine(&g, &dout, plan, w, &mut y, tokens, top_k, n).unwrap();
        g.download(&y, tokens * n).unwrap()
    };
    for fmt in formats() {
        let cpu: Vec<Box<dyn Linear>> = (0..experts)
            .map(|_| make_linear(bf16_weights(&mut rng, n, k), n, k, &fmt, None))
            .collect();
        let parts: Vec<Vec<&dyn Linear>> = cpu.iter().map(|l| vec![&**l]).collect();
        let m = GpuMatrix::upload(&g, &parts).unwrap();
        let full = quantized(&g, &m, &x, ALL, k);
        let pairs = ALL * top_k;
        let out_full = gemm(
            &g,
            AUTO,
            &full,
            Some(&plan_full.row_token),
            &m,
            GemmRows::Plan(&plan_full),
            pairs,
        );
        let want = by_slot(&out_full, &plan_full, ALL);
        let want_y = combine(&out_full, &plan_full, &w_full, ALL);
        for tokens in ROW_COUNTS {
            let rows = subset(&mut rng, tokens);
            let what = |how: &str| format!("{:?} experts, {tokens} tokens, {how}", fmt.format);
            let (ids, w) = route(&gather(&logits, &rows, experts), tokens);
            let ids_want: Vec<i32> = rows
                .iter()
                .flat_map(|&r| ids_h[r * top_k..(r + 1) * top_k].iter().copied())
                .collect();
            assert_eq!(
                g.download(&ids, tokens * top_k).unwrap(),
                ids_want,
                "{}",
                what("routed experts")
            );
            assert_bits(
                &g.download(&w, tokens * top_k).unwrap(),
                &gather(&w_h, &rows, top_k),
                &what("routing weights"),
            );
            let mut plan = MoePlan::new(&g, tokens * top_k, experts).unwrap();
            plan.build(&g, &ids, tokens, top_k, experts).unwrap();
            let part = quantized(&g, &m, &gather(&x, &rows, k), tokens, k);
            let want_rows = gather(&want, &rows, top_k * n);
            for path in TENSOR_CORE_CHOICES {
                // K = 288 is two segments: split, the second step adds them and applies the
                // NVFP4 epilogue of each row's expert.
                for split in [SplitK::Auto, SplitK::Off, SplitK::On] {
                    let choice = (path, split);
                    let out = gemm(
                        &g,
                        choice,
                        &part,
                        Some(&plan.row_token),
                        &m,
                        GemmRows::Plan(&plan),
                        tokens * top_k,
                    );
                    assert_bits(
                        &by_slot(&out, &plan, tokens),
                        &want_rows,
                        &what(&format!("{choice:?}")),
                    );
                    assert_bits(
                        &combine(&out, &plan, &w, tokens),
                        &gather(&want_y, &rows, n),
                        &what(&format!("combine after {choice:?}")),
                    );
                }
            }
        }
        println!(
            "{:?} experts: routing, every expert row and the combine bitwise equal for every token count",
            fmt.format
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn rms_norm_rows_have_the_same_bits_for_every_row_count() {
    let g = gpu();
    let mut rng = Rng(seed());
    let d = 2048;
    let (x, res, w) = (
        rng.vec(ALL * d, 3.0),
        rng.vec(ALL * d, 3.0),
        rng.vec(d, 1.5),
    );
    let dw = g.upload(&w).unwrap();
    let norm = |x: &[f32], res: &[f32], rows: usize| {
        let (mut dx, dr) = (g.upload(x).unwrap(), g.upload(res).unwrap());
        let mut out = g.upload(&vec![f32::NAN; rows * d]).unwrap();
        ops::rms_norm(&g, &mut dx, Some(&dr), &dw, &mut out, None, rows, d, 1e-6).unwrap();
        (
            g.download(&dx, rows * d).unwrap(),
            g.download(&out, rows * d).unwrap(),
        )
    };
    let (sum_full, out_full) = norm(&x, &res, ALL);
    for m in ROW_COUNTS {
        let rows = subset(&mut rng, m);
        let (sum, out) = norm(&gather(&x, &rows, d), &gather(&res, &rows, d), m);
        assert_bits(
            &sum,
            &gather(&sum_full, &rows, d),
            &format!("{m} rows: x + residual"),
        );
        assert_bits(
            &out,
            &gather(&out_full, &rows, d),
            &format!("{m} rows: normed"),
        );
        // The final norm reads its rows in place through a row index.
        let mut dsum = g.upload(&sum_full).unwrap();
        let index: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let di = g.upload(&index).unwrap();
        let mut o = g.upload(&vec![f32::NAN; m * d]).unwrap();
        ops::rms_norm(&g, &mut dsum, None, &dw, &mut o, Some(&di), m, d, 1e-6).unwrap();
        assert_bits(
            &g.download(&o, m * d).unwrap(),
            &gather(&out_full, &rows, d),
            &format!("{m} rows through a row index"),
        );
    }
    println!("rms_norm: every row bitwise equal for every row count");
}
