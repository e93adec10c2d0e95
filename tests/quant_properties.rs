//! Properties of the contract that must hold for any input: bounded round-trip error, MXFP8
//! scales that never clip, results independent of thread count and (per-token) of row order,
//! and the specified behaviour of zero rows and non-finite elements.

use lockstep::quant::codec::{e4m3_decode, e8m0_decode};
use lockstep::quant::{
    mxfp8, nvfp4, GlobalScale, Nvfp4Options, ScaleGranularity, MXFP8_BLOCK, NVFP4_BLOCK,
};
use proptest::prelude::*;

/// Matrices of normal-range values with a per-block magnitude, so blocks differ in scale.
fn matrix(
    max_rows: usize,
    max_blocks: usize,
    block: usize,
) -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
    (1..=max_rows, 1..=max_blocks).prop_flat_map(move |(rows, blocks)| {
        let cols = blocks * block;
        (
            Just(rows),
            Just(cols),
            prop::collection::vec((-1.0f32..1.0, -8i32..8), rows * cols),
        )
            .prop_map(|(r, c, v)| {
                (
                    r,
                    c,
                    v.into_iter().map(|(m, e)| m * 2f32.powi(e * 3)).collect(),
                )
            })
    })
}

fn per_token() -> Nvfp4Options {
    Nvfp4Options {
        granularity: ScaleGranularity::PerToken,
        four_over_six: None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn mxfp8_round_trip_error_is_within_half_an_e4m3_step((rows, cols, x) in matrix(6, 5, MXFP8_BLOCK)) {
        let q = mxfp8::quantize_rowwise(&x, rows, cols).unwrap();
        let d = q.dequantize();
        for (i, (&a, &b)) in x.iter().zip(&d).enumerate() {
            let scale = e8m0_decode(q.scales[i / MXFP8_BLOCK]);
            // E4M3 has 3 mantissa bits (relative half-step 2^-4) and subnormal step 2^-9.
            let bound = (a.abs() * 2f32.powi(-4)).max(scale * 2f32.powi(-10));
            prop_assert!((a - b).abs() <= bound, "x={a} deq={b} bound={bound}");
        }
    }

    #[test]
    fn mxfp8_scale_never_clips_the_block_max((rows, cols, x) in matrix(6, 5, MXFP8_BLOCK)) {
        let q = mxfp8::quantize_rowwise(&x, rows, cols).unwrap();
        for (block, &code) in x.chunks(MXFP8_BLOCK).zip(&q.scales) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            prop_assert!(amax / e8m0_decode(code) <= 448.0);
        }
        let c = mxfp8::quantize_columnwise(&x.repeat(32), rows * 32, cols).unwrap();
        for (j, &code) in c.scales.iter().enumerate() {
            let col = j % cols;
            let stripe = j / cols;
            let amax = (0..32).map(|r| x[((stripe * 32 + r) % rows) * cols + col].abs()).fold(0f32, f32::max);
            prop_assert!(amax / e8m0_decode(code) <= 448.0);
        }
    }

    #[test]
    fn nvfp4_round_trip_error_is_within_one_scale_step((rows, cols, x) in matrix(6, 6, NVFP4_BLOCK)) {
        for granularity in [ScaleGranularity::PerTensor, ScaleGranularity::PerToken] {
            let q = nvfp4::quantize(&x, rows, cols, &Nvfp4Options { granularity, four_over_six: None }).unwrap();
            let d = q.dequantize();
            for (i, (&a, &b)) in x.iter().zip(&d).enumerate() {
                let (r, c) = (i / cols, i % cols);
                let s8 = q.scales[r * (cols / NVFP4_BLOCK) + c / NVFP4_BLOCK];
                if s8 == 0 {
                    // A block far below the tensor amax underflows its E4M3 scale: the contract
                    // sends its nonzero elements to ±6 codes, which decode to 0 with s8 = 0.
                    prop_assert!(q.code(r, c) & 7 == 0 || q.code(r, c) & 7 == 7);
                    prop_assert_eq!(b, 0.0);
                    continue;
                }
                if s8 < 0x08 {
                    // Subnormal block scales carry few bits; only the sign is guaranteed.
                    prop_assert!(b == 0.0 || (a < 0.0) == (b < 0.0));
                    continue;
                }
                let step = e4m3_decode(s8) * q.global.of_row(r);
                // The widest E2M1 gap is 2 (4 -> 6), so RN error <= 1 step; a block scale rounded
                // down by E4M3 can push the block max past 6 by < 2^-4 * 6 < 1 step.
                let amax_b = x[i - c % NVFP4_BLOCK..][..NVFP4_BLOCK].iter().fold(0f32, |m, v| m.max(v.abs()));
                let bound = step * 1.0001 + amax_b * 1e-6;
                prop_assert!((a - b).abs() <= bound, "x={a} deq={b} step={step}");
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_thread_count((rows, cols, x) in matrix(40, 8, MXFP8_BLOCK)) {
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let m = mxfp8::quantize_rowwise(&x, rows, cols).unwrap();
                let t = nvfp4::quantize(&x, rows, cols, &Nvfp4Options::default()).unwrap();
                let p = nvfp4::quantize(&x, rows, cols, &per_token()).unwrap();
                (m, t, p)
            })
        };
        prop_assert_eq!(run(1), run(5));
    }

    #[test]
    fn per_token_rows_do_not_depend_on_their_neighbours((rows, cols, x) in matrix(8, 4, NVFP4_BLOCK), seed in any::<u64>()) {
        let mut order: Vec<usize> = (0..rows).collect();
        let mut s = seed;
        for i in (1..rows).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, (s >> 33) as usize % (i + 1));
        }
        let shuffled: Vec<f32> = order.iter().flat_map(|&r| x[r * cols..][..cols].iter().copied()).collect();
        let a = nvfp4::quantize(&x, rows, cols, &per_token()).unwrap();
        let b = nvfp4::quantize(&shuffled, rows, cols, &per_token()).unwrap();
        for (new_r, &old_r) in order.iter().enumerate() {
            prop_assert_eq!(&a.data[old_r * cols / 2..][..cols / 2], &b.data[new_r * cols / 2..][..cols / 2]);
            prop_assert_eq!(&a.scales[old_r * cols / 16..][..cols / 16], &b.scales[new_r * cols / 16..][..cols / 16]);
            prop_assert_eq!(a.global.of_row(old_r).to_bits(), b.global.of_row(new_r).to_bits());
            // The same row quantized alone gives the same bytes: no leakage across tokens.
            let alone = nvfp4::quantize(&x[old_r * cols..][..cols], 1, cols, &per_token()).unwrap();
            prop_assert_eq!(&alone.data[..], &a.data[old_r * cols / 2..][..cols / 2]);
        }
    }
}

#[test]
fn zero_rows_quantize_to_zero_codes_and_zero_token_scale() {
    let cols = 64;
    let mut x: Vec<f32> = (0..2 * cols).map(|i| (i as f32 - 50.0) / 7.0).collect();
    x[cols..].fill(0.0);
    let q = nvfp4::quantize(&x, 2, cols, &per_token()).unwrap();
    assert!(q.data[cols / 2..].iter().all(|&b| b == 0));
    assert!(q.scales[cols / 16..].iter().all(|&b| b == 0));
    assert_eq!(
        q.global,
        GlobalScale::PerToken(vec![q.global.of_row(0), 0.0])
    );
    assert!(q.global.of_row(0) > 0.0);
    let m = mxfp8::quantize_rowwise(&x, 2, cols).unwrap();
    assert!(m.data[cols..].iter().all(|&b| b == 0) && m.scales[2..].iter().all(|&s| s == 0));
}

#[test]
fn non_finite_elements_follow_the_contract() {
    let mut x = vec![1.0f32; 32];
    x[0] = f32::NAN;
    x[1] = f32::INFINITY;
    x[2] = f32::NEG_INFINITY;
    x[3] = -448.0;
    let m = mxfp8::quantize_rowwise(&x, 1, 32).unwrap();
    // amax = Inf -> scale code 0xFE; NaN stays NaN, Inf saturates, finite values scaled by 2^-127.
    assert_eq!(m.scales, vec![0xFE]);
    assert_eq!(&m.data[..3], &[0x7F, 0x7E, 0xFE]);
    let all_nan = mxfp8::quantize_rowwise(&[f32::NAN; 32], 1, 32).unwrap();
    assert_eq!(all_nan.scales, vec![0xFF]);
    assert!(all_nan.dequantize().iter().all(|v| v.is_nan()));

    let q = nvfp4::quantize(&x, 1, 32, &Nvfp4Options::default()).unwrap();
    // E2M1 has no NaN/Inf: NaN -> +6 (code 7), +Inf -> +6, -Inf -> -6 (code 0xF).
    assert_eq!(q.code(0, 0), 0x7);
    assert_eq!(q.code(0, 1), 0x7);
    assert_eq!(q.code(0, 2), 0xF);
}
