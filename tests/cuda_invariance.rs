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
use lockstep::backend::cuda::ops::{self, GemmPath, GemmRows, MoePlan, SplitK};
use lockstep::backend::cuda::weights::GpuMatrix;
use lockstep::backend::Linear;
use lockstep::quant::TensorFormat;

mod common;
use common::cuda::{expert_formats, gemm_on, gpu, layer_input, seed, Rng};

const ROW_COUNTS: [usize; 7] = [1, 2, 7, 16, 64, 200, 1024];
const ALL: usize = 1024;
/// The engine's choice of kernel and split.
const AUTO: (GemmPath, SplitK) = (GemmPath::Auto, SplitK::Auto);
/// Every way of splitting a launch over K: SplitK::OneWave's runs of segments a block (wgmma)
/// among them, which the dense cases' 1,024 rows and the joined launches' 1,100 reach.
const SPLITS: [SplitK; 4] = [SplitK::Auto, SplitK::Off, SplitK::On, SplitK::OneWave];
/// The engine's choice and every tensor-core kernel (the ones that share the K chain's bits).
const TENSOR_CORE_CHOICES: [GemmPath; 8] = [
    GemmPath::Auto,
    GemmPath::TensorCore,
    GemmPath::TensorCoreWide,
    GemmPath::Wgmma,
    GemmPath::Wgmma64,
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
    // tiles; K = 800: three K segments and a partial fourth; K = 2048 and 4096: eight and
    // sixteen segments (q/k/v's and o_proj's, which the wgmma kernel takes split at decode
    // batches).
    for (n, k) in [(100, 96), (136, 800), (576, 2048), (200, 4096)] {
        let x = rng.vec(ALL * k, 2.0);
        let mut layers: Vec<(String, Box<dyn Linear>)> = expert_formats()
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
            let full = layer_input(&g, m.act, &x, ALL, k);
            let want = gemm_on(&g, AUTO, &full, None, &m, GemmRows::Dense(ALL), ALL);
            let full_deq = g.download(&full.x, ALL * k).unwrap();
            for rows_m in ROW_COUNTS {
                let rows = subset(&mut rng, rows_m);
                let what = |how: &str| format!("{name} [{n} x {k}], {rows_m} rows, {how}");
                let want_rows = gather(&want, &rows, n);
                // The rows copied out and quantized on their own.
                let part = layer_input(&g, m.act, &gather(&x, &rows, k), rows_m, k);
                assert_bits(
                    &g.download(&part.x, rows_m * k).unwrap(),
                    &gather(&full_deq, &rows, k),
                    &what("quantized activations"),
                );
                for path in TENSOR_CORE_CHOICES {
                    for split in SPLITS {
                        let choice = (path, split);
                        let got =
                            gemm_on(&g, choice, &part, None, &m, GemmRows::Dense(rows_m), rows_m);
                        assert_bits(&got, &want_rows, &what(&format!("{choice:?}")));
                    }
                }
                // Read in place from the full input through a row index.
                let index: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
                let di = g.upload(&index).unwrap();
                let got = gemm_on(
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
    // K segments and a partial fourth; K = 2048: eight (q, k and v's own). At 1,100 rows the
    // wgmma kernel's 36 tiles take SplitK::OneWave's runs (2 and 3 segments a block), the parts'
    // sums one after the other; K = 1568 (six segments and one span) runs 3, 3 and a last run
    // of that one partial segment.
    let ns = [160usize, 32, 96];
    for k in [800, 1568, 2048] {
        joined_launches_over(&mut rng, &g, ns, k);
    }
}

/// [`joined_launches_give_each_part_the_bits_of_its_own_launch`] for K = `k`.
fn joined_launches_over(rng: &mut Rng, g: &lockstep::backend::cuda::Gpu, ns: [usize; 3], k: usize) {
    let mut kinds: Vec<(String, Vec<Box<dyn Linear>>)> = expert_formats()
        .iter()
        .map(|f| {
            let layers = ns
                .iter()
                .map(|&n| make_linear(bf16_weights(rng, n, k), n, k, f, None))
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
            .map(|l| GpuMatrix::upload(g, &[vec![&**l]]).unwrap())
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
        for rows in [1, 5, 13, 77, 300, 1100] {
            let x = rng.vec(rows * k, 2.0);
            let input = layer_input(g, ms[0].act, &x, rows, k);
            let want: Vec<Vec<f32>> = ms
                .iter()
                .map(|m| gemm_on(g, AUTO, &input, None, m, GemmRows::Dense(rows), rows))
                .collect();
            for &path in paths {
                for split in SPLITS {
                    let mut outs: Vec<CudaSlice<f32>> = ns
                        .iter()
                        .map(|&n| g.upload(&vec![f32::NAN; rows * n]).unwrap())
                        .collect();
                    let mut out_refs: Vec<&mut CudaSlice<f32>> = outs.iter_mut().collect();
                    ops::dense_gemm_parts_on(
                        path,
                        split,
                        g,
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
            &g, &dl, None, tokens, experts, top_k, true, None, &mut ids, &mut w, None,
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
        let y = g.upload(&vec![f32::NAN; tokens * n]).unwrap();
        let c = ops::Combine::new(&g, &dout, None, plan, w, &y, tokens, top_k, n).unwrap();
        ops::moe_combine(&g, &c).unwrap();
        g.download(&y, tokens * n).unwrap()
    };
    for fmt in expert_formats() {
        let cpu: Vec<Box<dyn Linear>> = (0..experts)
            .map(|_| make_linear(bf16_weights(&mut rng, n, k), n, k, &fmt, None))
            .collect();
        let parts: Vec<Vec<&dyn Linear>> = cpu.iter().map(|l| vec![&**l]).collect();
        let m = GpuMatrix::upload(&g, &parts).unwrap();
        let full = layer_input(&g, m.act, &x, ALL, k);
        let pairs = ALL * top_k;
        let out_full = gemm_on(
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
            let part = layer_input(&g, m.act, &gather(&x, &rows, k), tokens, k);
            let want_rows = gather(&want, &rows, top_k * n);
            for path in TENSOR_CORE_CHOICES {
                // K = 288 is two segments: split, the second step adds them and applies the
                // NVFP4 epilogue of each row's expert.
                for split in SPLITS {
                    let choice = (path, split);
                    let out = gemm_on(
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
        ops::rms_norm(
            &g,
            &mut dx,
            Some(&dr),
            None,
            &dw,
            &mut out,
            None,
            rows,
            d,
            1e-6,
        )
        .unwrap();
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
        ops::rms_norm(
            &g,
            &mut dsum,
            None,
            None,
            &dw,
            &mut o,
            Some(&di),
            m,
            d,
            1e-6,
        )
        .unwrap();
        assert_bits(
            &g.download(&o, m * d).unwrap(),
            &gather(&out_full, &rows, d),
            &format!("{m} rows through a row index"),
        );
    }
    println!("rms_norm: every row bitwise equal for every row count");
}

/// A GEMM split over K may leave its segment sums to its reader (`ops::Unfolded`: decode-sized
/// launches of a step that keeps no buffers). Each reader that takes them (the norm's
/// residual, q/k norm + RoPE + KV store, routing with its plan, SwiGLU, the MoE combine) gives
/// the bits it gives from the output the launch's own fold writes, and `fold_unfolded` writes
/// those bits. K = 2,048: eight segments. Rows 20 and 40 (the tiled kernel split over K);
/// dense launches of 1 to 8 rows (9 to 16 over few columns) and plans of one token split K
/// inside a block and leave no sums (one-row launches left the few-rows kernels' split-K sums
/// before 2026-12-05's block-split default, and do again with `LOCKSTEP_BLOCK_SPLIT=0`).
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn readers_of_split_k_sums_give_the_bits_of_the_folded_output() {
    use lockstep::backend::cuda::args::{addr, DevPtr};
    use lockstep::backend::cuda::ops::{AttnShape, Unfolded};
    let g = gpu();
    let mut rng = Rng(seed());
    let k = 2048;
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    let nan = |n: usize| g.upload(&vec![f32::NAN; n]).unwrap();
    let mut matrix = |experts: usize, n: usize| {
        let layers: Vec<Box<dyn Linear>> = (0..experts)
            .map(|_| {
                make_linear(
                    bf16_weights(&mut rng, n, k),
                    n,
                    k,
                    &TensorFormat::BF16,
                    None,
                )
            })
            .collect();
        let parts: Vec<Vec<&dyn Linear>> = layers.iter().map(|l| vec![&**l]).collect();
        GpuMatrix::upload(&g, &parts).unwrap()
    };
    let (m_o, m_gu, m_router) = (matrix(1, 256), matrix(1, 2 * 96), matrix(1, 64));
    let (m_q, m_k, m_v) = (matrix(1, 4 * 128), matrix(1, 2 * 128), matrix(1, 2 * 128));
    let m_down = matrix(8, 160);
    // The folded output and the sums of the same launch over `rows` (the sums stay valid
    // until the next GEMM launch); `fold_unfolded` of them gives the folded output's bits.
    let launch = |m: &GpuMatrix, x: &CudaSlice<f32>, rows: GemmRows<'_>, max_rows: usize| {
        let n = m.n;
        let mut want = nan(max_rows * n);

        ops::grouped_gemm(&g, x, None, None, &m.data, rows, max_rows, n, k, &mut want).unwrap();
        let mut left = nan(max_rows * n);
        let sums =
            ops::grouped_gemm_unfolded(&g, x, None, None, &m.data, rows, max_rows, n, k, &mut left)
                .unwrap()
                .expect("a launch this small splits over K and leaves its sums");
        ops::fold_unfolded(&g, sums, max_rows, n, DevPtr(addr(&g, &left))).unwrap();
        let want_bits = bits(g.download(&want, max_rows * n).unwrap());
        assert_eq!(
            bits(g.download(&left, max_rows * n).unwrap()),
            want_bits,
            "fold_unfolded"
        );
        (sums, want)
    };
    for rows in [20, 40] {
        let x = g.upload(&rng.vec(rows * k, 2.0)).unwrap();
        let what = |reader: &str| format!("{reader}, {rows} rows");

        // The norm's residual.
        let (h, eps) = (m_o.n, 1e-6);
        let (res, dw) = (rng.vec(rows * h, 1.0), g.upload(&rng.vec(h, 1.0)).unwrap());
        let (sums, o) = launch(&m_o, &x, GemmRows::Dense(rows), rows);
        let norm = |residual: &CudaSlice<f32>, sums: Option<Unfolded>| {
            let (mut dx, mut out) = (g.upload(&res).unwrap(), nan(rows * h));
            ops::rms_norm(
                &g,
                &mut dx,
                Some(residual),
                sums,
                &dw,
                &mut out,
                None,
                rows,
                h,
                eps,
            )
            .unwrap();
            (
                bits(g.download(&dx, rows * h).unwrap()),
                bits(g.download(&out, rows * h).unwrap()),
            )
        };
        assert_eq!(norm(&o, Some(sums)), norm(&o, None), "{}", what("rms_norm"));

        // SwiGLU over gate/up.
        let inter = m_gu.n / 2;
        let (sums, gu) = launch(&m_gu, &x, GemmRows::Dense(rows), rows);
        let swiglu = |sums: Option<Unfolded>| {
            let mut h = nan(rows * inter);
            ops::silu_mul(&g, &gu, sums, &mut h, rows, inter).unwrap();
            bits(g.download(&h, rows * inter).unwrap())
        };
        assert_eq!(swiglu(Some(sums)), swiglu(None), "{}", what("silu_mul"));

        // Routing and its plan (one launch up to 8 tokens, else routing then the plan); the
        // folded logits are written into the router's output.
        let (experts, top_k) = (m_router.n, 4);
        let (sums, logits) = launch(&m_router, &x, GemmRows::Dense(rows), rows);
        let logits_want = bits(g.download(&logits, rows * experts).unwrap());
        let route = |logits: &CudaSlice<f32>, sums: Option<Unfolded>| {
            let (mut ids, mut w) = (g.alloc::<i32>(rows * top_k).unwrap(), nan(rows * top_k));
            let mut plan = MoePlan::new(&g, rows * top_k, experts).unwrap();
            ops::route_and_plan(
                &g, logits, sums, rows, experts, top_k, true, None, &mut ids, &mut w, &mut plan,
                None,
            )
            .unwrap();
            (
                g.download(&ids, rows * top_k).unwrap(),
                bits(g.download(&w, rows * top_k).unwrap()),
                g.download(&plan.offsets, experts + 1).unwrap(),
            )
        };
        let router_out = nan(rows * experts);
        let from_sums = route(&router_out, Some(sums));
        assert_eq!(from_sums, route(&logits, None), "{}", what("routing"));
        assert_eq!(
            bits(g.download(&router_out, rows * experts).unwrap()),
            logits_want,
            "{}",
            what("routing's folded logits")
        );

        // The MoE combine over a routing plan's down projection.
        let (ids, weights) = {
            let (mut ids, mut w) = (g.alloc::<i32>(rows * top_k).unwrap(), nan(rows * top_k));
            let dl = g.upload(&rng.vec(rows * 8, 3.0)).unwrap();
            ops::moe_route(
                &g, &dl, None, rows, 8, top_k, true, None, &mut ids, &mut w, None,
            )
            .unwrap();
            (ids, w)
        };
        let mut plan = MoePlan::new(&g, rows * top_k, 8).unwrap();
        plan.build(&g, &ids, rows, top_k, 8).unwrap();
        let pairs = rows * top_k;
        let xp = g.upload(&rng.vec(pairs * k, 2.0)).unwrap();
        let (sums, down) = launch(&m_down, &xp, GemmRows::Plan(&plan), pairs);
        let hidden = m_down.n;
        let combine = |sums: Option<Unfolded>| {
            let y = nan(rows * hidden);
            let c = ops::Combine::new(&g, &down, sums, &plan, &weights, &y, rows, top_k, hidden)
                .unwrap();
            ops::moe_combine(&g, &c).unwrap();
            bits(g.download(&y, rows * hidden).unwrap())
        };
        assert_eq!(
            combine(Some(sums)),
            combine(None),
            "{}",
            what("moe_combine")
        );
        // The same combine inside the norm that reads it.
        let (res, dw) = (
            rng.vec(rows * hidden, 1.0),
            g.upload(&rng.vec(hidden, 1.0)).unwrap(),
        );
        let combined_norm = |sums: Option<Unfolded>| {
            let (mut dx, mut out, y) = (
                g.upload(&res).unwrap(),
                nan(rows * hidden),
                nan(rows * hidden),
            );
            let c = ops::Combine::new(&g, &down, sums, &plan, &weights, &y, rows, top_k, hidden)
                .unwrap();
            ops::rms_norm_combined(&g, &mut dx, &c, &dw, &mut out, eps).unwrap();
            (
                bits(g.download(&dx, rows * hidden).unwrap()),
                bits(g.download(&out, rows * hidden).unwrap()),
            )
        };
        assert_eq!(
            combined_norm(Some(sums)),
            combined_norm(None),
            "{}",
            what("rms_norm_combined")
        );

        // q/k norm + RoPE + KV store over one launch of q, k and v, at head dims 128 and 64
        // (the kernel's register path at each width).
        let ns = [m_q.n, m_k.n, m_v.n];
        let data = [&m_q.data, &m_k.data, &m_v.data];
        let mut want: Vec<CudaSlice<f32>> = ns.iter().map(|&n| nan(rows * n)).collect();
        let mut refs: Vec<&mut CudaSlice<f32>> = want.iter_mut().collect();
        ops::dense_gemm_parts(&g, &x, None, &data, &ns, rows, k, &mut refs).unwrap();
        let mut left: Vec<CudaSlice<f32>> = ns.iter().map(|&n| nan(rows * n)).collect();
        let mut refs: Vec<&mut CudaSlice<f32>> = left.iter_mut().collect();
        let sums =
            ops::dense_gemm_parts_unfolded(&g, &x, None, &data, &ns, rows, k, &mut refs).unwrap();
        assert_eq!(sums.len(), 3, "{}", what("q, k and v left as sums"));
        let pos: Vec<i32> = (0..rows as i32).map(|r| 7 * r + 3).collect();
        let (pos, slots) = (
            g.upload(&pos).unwrap(),
            g.upload(&(0..rows as i32).collect::<Vec<_>>()).unwrap(),
        );
        let cache = rows * ns[1];
        for hd in [128, 64] {
            let shape = AttnShape {
                heads: ns[0] / hd,
                kv_heads: ns[1] / hd,
                head_dim: hd,
                block_size: 16,
            };
            let (qn, kn) = (
                g.upload(&rng.vec(hd, 1.0)).unwrap(),
                g.upload(&rng.vec(hd, 1.0)).unwrap(),
            );
            let half = hd / 2;
            let inv_freq: Vec<f32> = (0..half)
                .map(|i| 1e4f32.powf(-(i as f32) / half as f32))
                .collect();
            let inv_freq = g.upload(&inv_freq).unwrap();
            // Each run on fresh copies: the kernel writes q and k in place.
            let rope = |qkv: &[CudaSlice<f32>], sums: [Option<Unfolded>; 3]| {
                let (mut kc, mut vc) = (
                    g.upload(&vec![0xFFFFu16; cache]).unwrap(),
                    g.upload(&vec![0xFFFFu16; cache]).unwrap(),
                );
                let mut q = g
                    .upload(&g.download(&qkv[0], rows * ns[0]).unwrap())
                    .unwrap();
                let mut kk = g
                    .upload(&g.download(&qkv[1], rows * ns[1]).unwrap())
                    .unwrap();
                ops::qk_norm_rope_store(
                    &g,
                    &mut q,
                    &mut kk,
                    &qkv[2],
                    sums,
                    Some((&qn, &kn)),
                    &inv_freq,
                    &pos,
                    &slots,
                    &mut kc,
                    &mut vc,
                    rows,
                    shape,
                    1e-6,
                )
                .unwrap();
                (
                    bits(g.download(&q, rows * ns[0]).unwrap()),
                    bits(g.download(&kk, rows * ns[1]).unwrap()),
                    g.download(&kc, cache).unwrap(),
                    g.download(&vc, cache).unwrap(),
                )
            };
            let sums = [Some(sums[0]), Some(sums[1]), Some(sums[2])];
            assert_eq!(
                rope(&left, sums),
                rope(&want, [None; 3]),
                "{}, head dim {hd}",
                what("q/k norm + RoPE + KV store")
            );
        }
    }
    println!("every reader of split-K sums gave the folded output's bits at 1, 20 and 40 rows");
}
