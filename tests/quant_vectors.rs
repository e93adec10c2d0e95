//! The contract's test data, byte for byte: every vector in tests/data/quant_vectors.safetensors
//! was produced by scripts/quant_reference.py (numpy + ml_dtypes, written from the contract
//! page, not from this code). Packed bytes, scale bytes and global scales must match exactly.

use std::collections::BTreeMap;

use lockstep::quant::codec::{e2m1_encode, e4m3_encode, e8m0_round_up};
use lockstep::quant::{
    fp8_block, mxfp8, nvfp4, swizzle, ErrorMetric, FourOverSix, GlobalScale, Nvfp4Options,
    ScaleGranularity,
};
use safetensors::SafeTensors;

struct Vectors {
    tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)>,
}

impl Vectors {
    fn load() -> Vectors {
        let bytes = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/quant_vectors.safetensors"
        ))
        .expect("vectors present");
        let st = SafeTensors::deserialize(&bytes).expect("valid safetensors");
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, (t.shape().to_vec(), t.data().to_vec())))
            .collect();
        Vectors { tensors }
    }
    fn bytes(&self, name: &str) -> &[u8] {
        &self
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("missing {name}"))
            .1
    }
    fn shape(&self, name: &str) -> &[usize] {
        &self.tensors[name].0
    }
    fn f32s(&self, name: &str) -> Vec<f32> {
        self.bytes(name)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    /// Case names that carry an input matrix.
    fn cases(&self) -> Vec<String> {
        self.tensors
            .keys()
            .filter_map(|k| k.strip_suffix("/input"))
            .map(str::to_string)
            .collect()
    }
}

fn assert_bytes_eq(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: got {:#04x}, want {:#04x}",
            got[i], want[i]
        );
    }
}

/// f32 global scales compared by bit pattern (so 0.0 vs -0.0 or NaN payloads would show).
fn assert_scales_eq(what: &str, got: &GlobalScale, want: &[f32]) {
    let got: Vec<u32> = match got {
        GlobalScale::PerTensor(s) => vec![s.to_bits()],
        GlobalScale::PerToken(v) => v.iter().map(|s| s.to_bits()).collect(),
    };
    let want: Vec<u32> = want.iter().map(|s| s.to_bits()).collect();
    assert_eq!(got, want, "{what}: global scales");
}

#[test]
fn codecs_match_the_reference_tables() {
    let v = Vectors::load();
    for (name, enc) in [
        ("e4m3", e4m3_encode as fn(f32) -> u8),
        ("e2m1", e2m1_encode),
        ("e8m0", e8m0_round_up),
    ] {
        let input = v.f32s(&format!("codec/{name}_in"));
        let got: Vec<u8> = input.iter().map(|&x| enc(x)).collect();
        assert!(input.len() > 10, "{name} table is not trivial");
        assert_bytes_eq(
            &format!("codec {name}"),
            &got,
            v.bytes(&format!("codec/{name}_out")),
        );
    }
}

#[test]
fn mxfp8_rowwise_and_columnwise_match_byte_for_byte() {
    let v = Vectors::load();
    let mut columnwise_cases = 0;
    for case in v.cases() {
        let (rows, cols) = (
            v.shape(&format!("{case}/input"))[0],
            v.shape(&format!("{case}/input"))[1],
        );
        let x = v.f32s(&format!("{case}/input"));
        let q = mxfp8::quantize_rowwise(&x, rows, cols).unwrap();
        assert_bytes_eq(
            &format!("{case} mxfp8_row data"),
            &q.data,
            v.bytes(&format!("{case}/mxfp8_row/data")),
        );
        assert_bytes_eq(
            &format!("{case} mxfp8_row scale"),
            &q.scales,
            v.bytes(&format!("{case}/mxfp8_row/scale")),
        );
        if v.has(&format!("{case}/mxfp8_col/data")) {
            columnwise_cases += 1;
            let q = mxfp8::quantize_columnwise(&x, rows, cols).unwrap();
            assert_bytes_eq(
                &format!("{case} mxfp8_col data"),
                &q.data,
                v.bytes(&format!("{case}/mxfp8_col/data")),
            );
            assert_bytes_eq(
                &format!("{case} mxfp8_col scale"),
                &q.scales,
                v.bytes(&format!("{case}/mxfp8_col/scale")),
            );
        }
    }
    assert!(columnwise_cases >= 3, "columnwise vectors present");
}

#[test]
fn nvfp4_all_variants_match_byte_for_byte() {
    let v = Vectors::load();
    let fos = |e4m3_range, metric| Some(FourOverSix { e4m3_range, metric });
    let variants = [
        ("nvfp4_tensor", ScaleGranularity::PerTensor, None),
        ("nvfp4_token", ScaleGranularity::PerToken, None),
        (
            "nvfp4_4o6_e256_abs",
            ScaleGranularity::PerTensor,
            fos(256.0, ErrorMetric::Absolute),
        ),
        (
            "nvfp4_4o6_e448_sq",
            ScaleGranularity::PerTensor,
            fos(448.0, ErrorMetric::Squared),
        ),
        (
            "nvfp4_token_4o6_e256_abs",
            ScaleGranularity::PerToken,
            fos(256.0, ErrorMetric::Absolute),
        ),
    ];
    let cases = v.cases();
    assert!(cases.len() >= 10, "all contract cases present: {cases:?}");
    for case in cases {
        let (rows, cols) = (
            v.shape(&format!("{case}/input"))[0],
            v.shape(&format!("{case}/input"))[1],
        );
        let x = v.f32s(&format!("{case}/input"));
        for (variant, granularity, four_over_six) in variants {
            let q = nvfp4::quantize(
                &x,
                rows,
                cols,
                &Nvfp4Options {
                    granularity,
                    four_over_six,
                },
            )
            .unwrap();
            let what = format!("{case} {variant}");
            assert_bytes_eq(
                &format!("{what} data"),
                &q.data,
                v.bytes(&format!("{case}/{variant}/data")),
            );
            assert_bytes_eq(
                &format!("{what} scale"),
                &q.scales,
                v.bytes(&format!("{case}/{variant}/scale")),
            );
            assert_scales_eq(
                &what,
                &q.global,
                &v.f32s(&format!("{case}/{variant}/global_scale")),
            );
        }
    }
}

#[test]
fn nvfp4_gate_up_joint_scale_matches() {
    let v = Vectors::load();
    let shape = v.shape("gateup_small/gate").to_vec();
    let (g, u) = (v.f32s("gateup_small/gate"), v.f32s("gateup_small/up"));
    let (qg, qu) = nvfp4::quantize_gate_up(&g, &u, shape[0], shape[1], None).unwrap();
    assert_bytes_eq("gate data", &qg.data, v.bytes("gateup_small/gate_data"));
    assert_bytes_eq("gate scale", &qg.scales, v.bytes("gateup_small/gate_scale"));
    assert_bytes_eq("up data", &qu.data, v.bytes("gateup_small/up_data"));
    assert_bytes_eq("up scale", &qu.scales, v.bytes("gateup_small/up_scale"));
    let want = v.f32s("gateup_small/global_scale");
    assert_scales_eq("gate", &qg.global, &want);
    assert_scales_eq("up", &qu.global, &want);
}

#[test]
fn swizzle_matches_the_reference_layout() {
    let v = Vectors::load();
    for case in ["swizzle_200x7", "swizzle_128x4", "swizzle_1x3"] {
        let shape = v.shape(&format!("{case}/in"));
        let got = swizzle::swizzle_128x4(v.bytes(&format!("{case}/in")), shape[0], shape[1]);
        assert_bytes_eq(case, &got, v.bytes(&format!("{case}/out")));
        assert_eq!(
            swizzle::unswizzle_128x4(&got, shape[0], shape[1]),
            v.bytes(&format!("{case}/in"))
        );
    }
}

#[test]
fn block_fp8_dequantization_matches() {
    let v = Vectors::load();
    let shape = v.shape("fp8block_200x300/weight").to_vec();
    let got = fp8_block::dequantize(
        v.bytes("fp8block_200x300/weight"),
        &v.f32s("fp8block_200x300/scale_inv"),
        shape[0],
        shape[1],
        (128, 128),
    )
    .unwrap();
    let want = v.f32s("fp8block_200x300/out");
    assert_eq!(
        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
}
