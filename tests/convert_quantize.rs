//! `lockstep quantize` and `lockstep convert` on small generated checkpoints with the
//! Qwen3-MoE tensor names: layouts, shared gate/up scales, recipe exceptions, block-FP8 sources,
//! and errors that name the tensor and write nothing.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use lockstep::checkpoint::{to_f32, write_file, Checkpoint, OwnedTensor};
use lockstep::quant::codec::e4m3_encode;
use lockstep::quant::{mxfp8, nvfp4, Nvfp4Options, ScaleGranularity};
use safetensors::tensor::Dtype;

const HIDDEN: usize = 64;
const INTER: usize = 32;
const EXPERTS: usize = 2;
const LAYERS: usize = 4;

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn qwen3_moe_tensors() -> BTreeMap<String, OwnedTensor> {
    let mut t = BTreeMap::new();
    let mut seed = 1;
    let mut add = |name: String, shape: Vec<usize>| {
        seed += 1;
        let n = shape.iter().product();
        t.insert(name, OwnedTensor::bf16(shape, &values(n, seed)));
    };
    add("model.embed_tokens.weight".into(), vec![100, HIDDEN]);
    add("lm_head.weight".into(), vec![100, HIDDEN]);
    add("model.norm.weight".into(), vec![HIDDEN]);
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            add(format!("{p}.self_attn.{proj}.weight"), vec![HIDDEN, HIDDEN]);
        }
        for norm in [
            "self_attn.q_norm",
            "self_attn.k_norm",
            "input_layernorm",
            "post_attention_layernorm",
        ] {
            add(format!("{p}.{norm}.weight"), vec![16]);
        }
        add(format!("{p}.mlp.gate.weight"), vec![EXPERTS, HIDDEN]);
        for e in 0..EXPERTS {
            add(
                format!("{p}.mlp.experts.{e}.gate_proj.weight"),
                vec![INTER, HIDDEN],
            );
            add(
                format!("{p}.mlp.experts.{e}.up_proj.weight"),
                vec![INTER, HIDDEN],
            );
            add(
                format!("{p}.mlp.experts.{e}.down_proj.weight"),
                vec![HIDDEN, INTER],
            );
        }
    }
    // Give gate and up of one expert very different ranges so a shared scale is visible.
    let up = t
        .get_mut("model.layers.0.mlp.experts.0.up_proj.weight")
        .unwrap();
    *up = OwnedTensor::bf16(
        up.shape.clone(),
        &values(INTER * HIDDEN, 99)
            .iter()
            .map(|v| v * 40.0)
            .collect::<Vec<_>>(),
    );
    t
}

fn config(quantization: Option<serde_json::Value>) -> serde_json::Value {
    let mut c = serde_json::json!({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": 4, "head_dim": 16, "num_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": INTER});
    if let Some(q) = quantization {
        c["quantization_config"] = q;
    }
    c
}

/// Writes the tensors as two shards with an index, plus config and a tokenizer file.
fn write_checkpoint(dir: &Path, tensors: BTreeMap<String, OwnedTensor>, config: serde_json::Value) {
    std::fs::create_dir_all(dir).unwrap();
    let (a, b): (BTreeMap<_, _>, BTreeMap<_, _>) = tensors
        .into_iter()
        .enumerate()
        .partition(|(i, _)| i % 2 == 0)
        .into();
    let mut weight_map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        let part: BTreeMap<String, OwnedTensor> = part.into_values().collect();
        for name in part.keys() {
            weight_map.insert(name.clone(), file.into());
        }
        write_file(&dir.join(file), &part, None).unwrap();
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": weight_map}).to_string(),
    )
    .unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        "{\"eos_token\": \"<|im_end|>\"}",
    )
    .unwrap();
}

fn lockstep(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .output()
        .unwrap()
}

/// Runs `lockstep convert` with a shipped recipe and requires success.
fn convert_ok(src: &Path, out: &Path, recipe_name: &str) {
    let run = lockstep(&[
        "convert",
        "--input",
        src.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--recipe",
        &recipe(recipe_name),
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

fn recipe(name: &str) -> String {
    format!("{}/configs/{name}.yaml", env!("CARGO_MANIFEST_DIR"))
}

fn f32_of(ckpt: &Checkpoint, name: &str) -> Vec<f32> {
    to_f32(name, &ckpt.tensor(name).unwrap()).unwrap()
}

#[test]
fn convert_nvfp4_writes_modelopt_layout_with_shared_gate_up_scales_and_bf16_exceptions() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, out) = (tmp.path().join("hf"), tmp.path().join("nvfp4"));
    write_checkpoint(&src, qwen3_moe_tensors(), config(None));
    convert_ok(&src, &out, "nvfp4");

    let hf = Checkpoint::open(&src).unwrap();
    let q = Checkpoint::open(&out).unwrap();
    // ceil(15% of 4 layers) = 1: layers 0..2 quantized, layer 3 BF16.
    for l in 0..LAYERS - 1 {
        for e in 0..EXPERTS {
            let p = format!("model.layers.{l}.mlp.experts.{e}");
            let (g, u) = (
                f32_of(&hf, &format!("{p}.gate_proj.weight")),
                f32_of(&hf, &format!("{p}.up_proj.weight")),
            );
            let (qg, qu) = nvfp4::quantize_gate_up(&g, &u, INTER, HIDDEN, None).unwrap();
            let w = q.tensor(&format!("{p}.gate_proj.weight")).unwrap();
            assert_eq!(
                (w.dtype(), w.shape()),
                (Dtype::U8, &[INTER, HIDDEN / 2][..])
            );
            assert_eq!(&*w.data(), &qg.data[..]);
            assert_eq!(
                &*q.tensor(&format!("{p}.up_proj.weight")).unwrap().data(),
                &qu.data[..]
            );
            let s = q.tensor(&format!("{p}.gate_proj.weight_scale")).unwrap();
            assert_eq!(
                (s.dtype(), s.shape()),
                (Dtype::F8_E4M3, &[INTER, HIDDEN / 16][..])
            );
            assert_eq!(&*s.data(), &qg.scales[..]);
            let (s2g, s2u) = (
                f32_of(&q, &format!("{p}.gate_proj.weight_scale_2")),
                f32_of(&q, &format!("{p}.up_proj.weight_scale_2")),
            );
            assert_eq!(s2g, vec![qg.global.of_row(0)]);
            assert_eq!(s2g, s2u, "gate and up share one weight_scale_2");
            assert_eq!(f32_of(&q, &format!("{p}.down_proj.input_scale")), vec![1.0]);
            let d = f32_of(&hf, &format!("{p}.down_proj.weight"));
            let qd = nvfp4::quantize(
                &d,
                HIDDEN,
                INTER,
                &Nvfp4Options {
                    granularity: ScaleGranularity::PerTensor,
                    four_over_six: None,
                },
            )
            .unwrap();
            assert_eq!(
                &*q.tensor(&format!("{p}.down_proj.weight")).unwrap().data(),
                &qd.data[..]
            );
        }
    }
    let last = "model.layers.3.mlp.experts.0.gate_proj.weight";
    assert_eq!(q.tensor(last).unwrap().dtype(), Dtype::BF16);
    assert!(!q.contains("model.layers.3.mlp.experts.0.gate_proj.weight_scale"));
    assert_eq!(
        &*q.tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .data(),
        &*hf.tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .data()
    );
    assert_eq!(
        q.tensor("model.layers.0.mlp.gate.weight").unwrap().dtype(),
        Dtype::BF16
    );

    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    let qc = &cfg["quantization_config"];
    assert_eq!(
        (
            qc["quant_method"].as_str(),
            qc["quant_algo"].as_str(),
            qc["group_size"].as_u64()
        ),
        (Some("modelopt"), Some("NVFP4"), Some(16))
    );
    let ignore: Vec<&str> = qc["ignore"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        ignore.contains(&"model.layers.0.self_attn.q_proj")
            && ignore.contains(&"model.layers.3.mlp.experts.1.down_proj")
    );
    assert!(!ignore.contains(&"model.layers.0.mlp.experts.0.up_proj"));
    assert!(out.join("hf_quant_config.json").exists());
    assert_eq!(
        std::fs::read_to_string(out.join("lockstep_recipe.yaml")).unwrap(),
        std::fs::read_to_string(recipe("nvfp4")).unwrap()
    );
    assert!(out.join("tokenizer_config.json").exists());
}

#[test]
fn convert_mxfp8_from_block_fp8_source_dequantizes_then_quantizes() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, out) = (tmp.path().join("fp8"), tmp.path().join("mxfp8"));
    // A block-FP8 source: every 2-D linear weight stored as e4m3 + weight_scale_inv per 128x128.
    let mut tensors = BTreeMap::new();
    for (name, t) in qwen3_moe_tensors() {
        let linear = t.shape.len() == 2 && name.ends_with("_proj.weight");
        if !linear {
            tensors.insert(name, t);
            continue;
        }
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let x: Vec<f32> = values(rows * cols, rows as u64 * 7 + cols as u64)
            .iter()
            .map(|v| v * 300.0)
            .collect();
        let bytes: Vec<u8> = x.iter().map(|&v| e4m3_encode(v)).collect();
        tensors.insert(
            format!("{}_scale_inv", name),
            OwnedTensor::f32(
                vec![rows.div_ceil(128), cols.div_ceil(128)],
                &vec![0.125; rows.div_ceil(128) * cols.div_ceil(128)],
            ),
        );
        tensors.insert(
            name,
            OwnedTensor::new(Dtype::F8_E4M3, vec![rows, cols], bytes),
        );
    }
    write_checkpoint(
        &src,
        tensors,
        config(Some(
            serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]}),
        )),
    );
    convert_ok(&src, &out, "mxfp8");

    let hf = Checkpoint::open(&src).unwrap();
    let q = Checkpoint::open(&out).unwrap();
    let name = "model.layers.1.self_attn.o_proj.weight";
    let src_w = hf.tensor(name).unwrap();
    let deq =
        lockstep::quant::fp8_block::dequantize(&src_w.data(), &[0.125], HIDDEN, HIDDEN, (128, 128))
            .unwrap();
    let want = mxfp8::quantize_rowwise(&deq, HIDDEN, HIDDEN).unwrap();
    let w = q.tensor(name).unwrap();
    assert_eq!((w.dtype(), &*w.data()), (Dtype::F8_E4M3, &want.data[..]));
    let s = q
        .tensor("model.layers.1.self_attn.o_proj.weight_scale_inv")
        .unwrap();
    assert_eq!(
        (s.dtype(), s.shape(), &*s.data()),
        (Dtype::U8, &[HIDDEN, HIDDEN / 32][..], &want.scales[..])
    );
    // mxfp8.yaml has no layer exceptions: the last layer's experts are MXFP8 too.
    assert_eq!(
        q.tensor("model.layers.3.mlp.experts.1.down_proj.weight")
            .unwrap()
            .dtype(),
        Dtype::F8_E4M3
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization_config"]["quant_method"], "mxfp8");
    assert!(!out.join("hf_quant_config.json").exists());

    // Converting into a non-empty directory is refused.
    let again = lockstep(&[
        "convert",
        "--input",
        src.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--recipe",
        &recipe("mxfp8"),
    ]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
}

#[test]
fn quantize_writes_data_scale_and_global_scale_per_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let (input, output) = (
        tmp.path().join("in.safetensors"),
        tmp.path().join("out.safetensors"),
    );
    let a = values(4 * 64, 5);
    let b = values(32 * 32, 6);
    let tensors = BTreeMap::from([
        ("a".to_string(), OwnedTensor::bf16(vec![4, 64], &a)),
        ("b".to_string(), OwnedTensor::f32(vec![32, 32], &b)),
    ]);
    write_file(&input, &tensors, None).unwrap();

    let run = lockstep(&[
        "quantize",
        "--format",
        "nvfp4-per-token",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let out = Checkpoint::open(&output).unwrap();
    let a_bf16 = to_f32("a", &Checkpoint::open(&input).unwrap().tensor("a").unwrap()).unwrap();
    let want = nvfp4::quantize(
        &a_bf16,
        4,
        64,
        &Nvfp4Options {
            granularity: ScaleGranularity::PerToken,
            four_over_six: None,
        },
    )
    .unwrap();
    assert_eq!(&*out.tensor("a.data").unwrap().data(), &want.data[..]);
    assert_eq!(out.tensor("a.scale").unwrap().dtype(), Dtype::F8_E4M3);
    assert_eq!(&*out.tensor("a.scale").unwrap().data(), &want.scales[..]);
    assert_eq!(out.tensor("a.global_scale").unwrap().shape(), &[4]);
    assert_eq!(out.names().count(), 6);

    let run = lockstep(&[
        "quantize",
        "--format",
        "mxfp8",
        "--columnwise",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    // `a` has 4 rows: not a multiple of the 32-row columnwise block, so nothing is written.
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("tensor `a`") && err.contains("32"), "{err}");
}

#[test]
fn quantize_rejects_unsupported_tensors_by_name_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("out.safetensors");
    for (name, t, what) in [
        (
            "odd",
            OwnedTensor::f32(vec![2, 24], &values(48, 1)),
            "multiple of 32",
        ),
        (
            "cube",
            OwnedTensor::f32(vec![2, 2, 32], &values(128, 2)),
            "rank 3",
        ),
        (
            "ints",
            OwnedTensor::new(Dtype::I32, vec![1, 32], vec![0; 128]),
            "I32",
        ),
    ] {
        let input = tmp.path().join(format!("{name}.safetensors"));
        let tensors = BTreeMap::from([
            (
                "fine".to_string(),
                OwnedTensor::f32(vec![1, 32], &values(32, 3)),
            ),
            (name.to_string(), t),
        ]);
        write_file(&input, &tensors, None).unwrap();
        let run = lockstep(&[
            "quantize",
            "--format",
            "mxfp8",
            "--input",
            input.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
        ]);
        assert!(!run.status.success());
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(
            err.contains(&format!("tensor `{name}`")) && err.contains(what),
            "{err}"
        );
        assert!(!output.exists(), "nothing written on error");
    }
}
