//! Checkpoints loaded straight to the GPU (`CudaWeights::from_checkpoint`) against the CPU
//! loader's model uploaded (`CudaWeights::upload(load_model(..))`): every device buffer equal
//! byte for byte, the same slot table and checksum, identical logits; a streamed update
//! written into device-loaded weights equal to the same update applied to the host model; and
//! an update from disk loaded beside the served weights while requests run, then swapped in;
//! a streamed update written into a device shadow while requests run, then swapped in; BF16
//! tensors in device memory written device to device, or quantized on the device for MXFP8 and
//! NVFP4 layers; the device hasher and the page-locked upload ring.
//! These need an NVIDIA GPU, so they are `#[ignore]`d here and run on the GPU host by
//! scripts/gpu-check.sh (`cuda_load --ignored`), from the repository root.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use lockstep::backend::cpu::linear::{DenseF32, DenseWeight};
use lockstep::backend::cuda::ops::{Table, WeightData};
use lockstep::backend::cuda::weights::GpuMatrix;
use lockstep::backend::cuda::Gpu;
use lockstep::backend::Linear;
use lockstep::checkpoint::{write_file, Checkpoint, OwnedTensor};
use lockstep::model::cuda::{CudaModel, CudaSizes, CudaWeights};
use lockstep::model::loader::{dummy_model, load_model, open_serving_checkpoint, Quantization};
use lockstep::model::slots::{replacements_checksum, DeviceTensor, Replacement};
use lockstep::model::{ForwardBatch, Mlp, Model, ModelConfig, SeqInput};
use lockstep::quant::Recipe;
use safetensors::tensor::Dtype;

mod common;
use common::cuda::{gpu, seed, Rng};
use common::engine::{block_on, generate, prompts, start};

fn embedded_config() -> serde_json::Value {
    serde_json::from_str(lockstep::serve::EMBEDDED_CONFIG).unwrap()
}

fn write_checkpoint(dir: &Path, tensors: BTreeMap<String, OwnedTensor>, config: serde_json::Value) {
    std::fs::create_dir_all(dir).unwrap();
    write_file(&dir.join("model.safetensors"), &tensors, None).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// A BF16 checkpoint of the embedded Qwen3-MoE with fresh random weights.
fn bf16_checkpoint(dir: &Path, seed: u64) {
    let cfg = ModelConfig::from_json(embedded_config()).unwrap();
    let mut m = dummy_model(cfg, &Recipe::bf16(), seed).unwrap();
    write_checkpoint(
        dir,
        m.checkpoint_tensors().into_iter().collect(),
        embedded_config(),
    );
}

/// The same model as a DeepSeek-style block-FP8 checkpoint with a ragged block (48 x 80) and
/// random per-block scales, so the device dequantization's indexing is exercised.
fn block_fp8_checkpoint(bf16_dir: &Path, dir: &Path, seed: u64) {
    let (bn, bk) = (48usize, 80usize);
    let src = Checkpoint::open(bf16_dir).unwrap();
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    let mut tensors = BTreeMap::new();
    for name in src.names() {
        let t = src.tensor(name).unwrap();
        let owned = OwnedTensor::from_view(&t);
        if !(t.shape().len() == 2 && name.ends_with("_proj.weight")) {
            tensors.insert(name.to_string(), owned);
            continue;
        }
        let (rows, cols) = (t.shape()[0], t.shape()[1]);
        let x = lockstep::checkpoint::to_f32(name, &t).unwrap();
        let scales: Vec<f32> = (0..rows.div_ceil(bn) * cols.div_ceil(bk))
            .map(|_| 2f32.powi(-9) * (0.5 + next()))
            .collect();
        let q: Vec<u8> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let s = scales[(i / cols / bn) * cols.div_ceil(bk) + (i % cols) / bk];
                lockstep::quant::codec::e4m3_encode(v / s)
            })
            .collect();
        tensors.insert(
            format!("{name}_scale_inv"),
            OwnedTensor::f32(vec![rows.div_ceil(bn), cols.div_ceil(bk)], &scales),
        );
        tensors.insert(
            name.to_string(),
            OwnedTensor::new(Dtype::F8_E4M3, vec![rows, cols], q),
        );
    }
    let mut config = embedded_config();
    config["quantization_config"] =
        serde_json::json!({"quant_method": "fp8", "weight_block_size": [bn, bk]});
    write_checkpoint(dir, tensors, config);
}

/// `lockstep convert` of `src` under a built-in recipe.
fn converted(src: &Path, out: &Path, recipe: &str) {
    let recipe = Recipe::builtin(recipe).unwrap();
    lockstep::convert::convert(&lockstep::convert::ConvertOptions {
        input: src,
        output: out,
        recipe: &recipe,
        max_shard_bytes: 1 << 20,
        progress: false,
    })
    .unwrap();
}

fn bytes<T: cudarc::driver::DeviceRepr + Default + Clone + bytemuck::Pod>(
    g: &Gpu,
    s: &cudarc::driver::CudaSlice<T>,
) -> Vec<u8> {
    bytemuck::cast_slice(&g.download(s, s.len()).unwrap()).to_vec()
}

fn matrix_buffers(g: &Gpu, what: &str, m: &GpuMatrix, out: &mut Vec<(String, Vec<u8>)>) {
    out.push((
        format!("{what} shape/act"),
        format!("{} {} {} {:?}", m.experts, m.n, m.k, m.act).into_bytes(),
    ));
    match &m.data {
        WeightData::F32(d) => out.push((format!("{what} f32"), bytes(g, d))),
        WeightData::Bf16(d) => out.push((format!("{what} bf16"), bytes(g, d))),
        WeightData::Mxfp8 { data, scales } => {
            out.push((format!("{what} mxfp8 data"), bytes(g, data)));
            out.push((format!("{what} mxfp8 scales"), bytes(g, scales)));
        }
        WeightData::Nvfp4 {
            data,
            scales,
            s_dec,
            groups,
        } => {
            out.push((format!("{what} nvfp4 data"), bytes(g, data)));
            out.push((format!("{what} nvfp4 scales"), bytes(g, scales)));
            out.push((format!("{what} nvfp4 s_dec"), bytes(g, s_dec)));
            out.push((
                format!("{what} nvfp4 groups"),
                groups.to_le_bytes().to_vec(),
            ));
        }
    }
}

/// Every device buffer of `w`, named, downloaded.
fn buffers(g: &Gpu, w: &CudaWeights) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    match &w.embed_tokens {
        Table::Bf16(t) => out.push(("embed bf16".into(), bytes(g, t))),
        Table::F32(t) => out.push(("embed f32".into(), bytes(g, t))),
    }
    if let Some(h) = &w.lm_head {
        matrix_buffers(g, "lm_head", h, &mut out);
    }
    out.push(("norm".into(), bytes(g, &w.norm)));
    for (l, layer) in w.layers.iter().enumerate() {
        let p = format!("layer {l}");
        out.push((format!("{p} input_norm"), bytes(g, &layer.input_norm)));
        out.push((
            format!("{p} post_norm"),
            bytes(g, &layer.post_attention_norm),
        ));
        if let (Some(q), Some(k)) = (&layer.q_norm, &layer.k_norm) {
            out.push((format!("{p} q_norm"), bytes(g, q)));
            out.push((format!("{p} k_norm"), bytes(g, k)));
        }
        for (n, m) in [
            ("q", &layer.q_proj),
            ("k", &layer.k_proj),
            ("v", &layer.v_proj),
            ("o", &layer.o_proj),
        ] {
            matrix_buffers(g, &format!("{p} {n}"), m, &mut out);
        }
        match &layer.mlp {
            Mlp::Dense(m) => {
                out.push((format!("{p} inter"), m.inter.to_le_bytes().to_vec()));
                matrix_buffers(g, &format!("{p} gate_up"), &m.gate_up, &mut out);
                matrix_buffers(g, &format!("{p} down"), &m.down, &mut out);
            }
            Mlp::Moe(moe) => {
                let e = &moe.experts;
                out.push((
                    format!("{p} moe"),
                    format!(
                        "{} {} {} {}",
                        e.inter, e.count, moe.top_k, moe.norm_topk_prob
                    )
                    .into_bytes(),
                ));
                matrix_buffers(g, &format!("{p} router"), &moe.router, &mut out);
                matrix_buffers(g, &format!("{p} gate_up"), &e.gate_up, &mut out);
                matrix_buffers(g, &format!("{p} down"), &e.down, &mut out);
            }
        }
    }
    out
}

fn assert_same_buffers(what: &str, got: &[(String, Vec<u8>)], want: &[(String, Vec<u8>)]) {
    assert_eq!(got.len(), want.len(), "{what}: buffer count");
    for ((gn, gb), (wn, wb)) in got.iter().zip(want) {
        assert_eq!(gn, wn, "{what}: buffer order");
        assert!(gb == wb, "{what}: `{gn}` differs from the uploaded model's");
    }
}

fn sizes() -> CudaSizes {
    CudaSizes {
        max_batch_tokens: 64,
        max_running_requests: 4,
        block_size: 4,
        max_context_len: 64,
        mem_fraction_static: 0.9,
        max_total_tokens: Some(64),
        block_scaled_gemm: false,
        graph_max_rows: lockstep::engine::defaults::CUDA_GRAPH_MAX_BS,
    }
}

/// Two prefill chunks and a decode step; the logits and routed experts of every step.
fn run_steps(m: &mut CudaModel, seed: u64) -> Vec<(Vec<u32>, Vec<i32>)> {
    let vocab = m.config.vocab_size.min(250) as u64;
    let a: Vec<u32> = (0..13).map(|i| ((seed + i * 31) % vocab) as u32).collect();
    let b: Vec<u32> = (0..6)
        .map(|i| ((seed * 7 + i * 17) % vocab) as u32)
        .collect();
    let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..5).rev().collect(), (5..8).collect());
    let steps: Vec<Vec<(&[u32], usize, &[u32])>> = vec![
        vec![(&a[..8], 0, &ta[..])],
        vec![(&a[8..], 8, &ta[..]), (&b[..], 0, &tb[..])],
        vec![(&a[..1], 13, &ta[..]), (&b[..1], 6, &tb[..])],
    ];
    steps
        .into_iter()
        .map(|step| {
            let batch = ForwardBatch {
                seqs: step
                    .iter()
                    .map(|&(tokens, start_pos, block_table)| SeqInput {
                        tokens,
                        start_pos,
                        block_table,
                        logits_from: Some(0),
                    })
                    .collect(),
            };
            let out = m.forward(&batch).unwrap();
            (
                out.logits.iter().map(|v| v.to_bits()).collect(),
                out.routed_experts,
            )
        })
        .collect()
}

/// Device-loaded vs uploaded: buffers, slot table, checksum, logits.
fn check_load(what: &str, dir: &Path, quantization: Option<Quantization>, seed: u64) {
    let g = gpu();
    let (mut model, _) = load_model(dir, quantization, None).unwrap();
    let uploaded = CudaWeights::upload(&g, &model).unwrap();
    let src = open_serving_checkpoint(dir, quantization, None).unwrap();
    let mut loaded = CudaWeights::from_checkpoint(&g, &src).unwrap();
    assert_same_buffers(what, &buffers(&g, &loaded), &buffers(&g, &uploaded));
    let cfg = model.config.clone();
    assert_eq!(
        loaded.slot_shapes(&cfg),
        model.slot_shapes(),
        "{what}: slots"
    );
    assert_eq!(
        loaded.weights_checksum(&g, &cfg).unwrap(),
        model.weights_checksum(),
        "{what}: checksum from the device"
    );
    drop(g);
    let mut a = CudaModel::new(gpu(), cfg.clone(), uploaded, sizes()).unwrap();
    let want = run_steps(&mut a, seed);
    drop(a);
    let mut b = CudaModel::new(gpu(), cfg, loaded, sizes()).unwrap();
    let got = run_steps(&mut b, seed);
    assert!(got == want, "{what}: logits or routed experts differ");
    println!("{what}: equal byte for byte, identical logits");
}

fn scratch(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join(name);
    (tmp, p)
}

/// Applies the same update to the host model and to the device weights: the device checksum
/// changes and equals the host's, and every device buffer equals the host model uploaded.
/// Returns the device checksum after it.
fn update_both(
    g: &Gpu,
    host: &mut Model,
    dev: &mut CudaWeights,
    for_host: Vec<(String, Replacement)>,
    for_dev: Vec<(String, Replacement)>,
    what: &str,
) -> lockstep::model::checksum::WeightsChecksum {
    let cfg = host.config.clone();
    let before = dev.weights_checksum(g, &cfg).unwrap();
    host.apply_replacements(for_host).unwrap();
    dev.write_replacements(g, &cfg, for_dev).unwrap();
    let after = dev.weights_checksum(g, &cfg).unwrap();
    assert_ne!(before, after, "{what}: the update changed nothing");
    assert_eq!(
        after,
        host.weights_checksum(),
        "{what}: checksum after the update"
    );
    let uploaded = CudaWeights::upload(g, host).unwrap();
    assert_same_buffers(what, &buffers(g, dev), &buffers(g, &uploaded));
    after
}

/// Two BF16 checkpoints of the embedded config (the served weights and an update), from
/// `seed` and `seed + 1`, in a directory that lives as long as the handle.
fn old_and_new(seed: u64) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let (tmp, root) = scratch("ckpts");
    let (old, new) = (root.join("old"), root.join("new"));
    bf16_checkpoint(&old, seed);
    bf16_checkpoint(&new, seed + 1);
    (tmp, old, new)
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn device_loaded_weights_equal_the_uploaded_cpu_model() {
    let seed = seed();
    println!("seed {seed}");
    for r in ["qwen3_moe", "qwen3", "llama"] {
        let dir = PathBuf::from(format!("tests/data/reference/{r}"));
        check_load(&format!("reference {r} (f32)"), &dir, None, seed);
    }
    let moe = Path::new("tests/data/reference/qwen3_moe");
    // F32 weights quantized on the device (the f32 quantizer path).
    check_load(
        "reference qwen3_moe mxfp8",
        moe,
        Some(Quantization::Mxfp8),
        seed,
    );
    check_load(
        "reference qwen3_moe nvfp4_online",
        moe,
        Some(Quantization::Nvfp4Online),
        seed,
    );

    let (_tmp, root) = scratch("ckpts");
    let bf16 = root.join("bf16");
    bf16_checkpoint(&bf16, seed);
    check_load("bf16", &bf16, None, seed);
    check_load("bf16 mxfp8", &bf16, Some(Quantization::Mxfp8), seed);
    check_load(
        "bf16 nvfp4_online",
        &bf16,
        Some(Quantization::Nvfp4Online),
        seed,
    );

    let fp8 = root.join("fp8");
    block_fp8_checkpoint(&bf16, &fp8, seed);
    check_load("block-fp8", &fp8, Some(Quantization::Fp8), seed);
    check_load("block-fp8 mxfp8", &fp8, Some(Quantization::Mxfp8), seed);
    check_load(
        "block-fp8 nvfp4_online",
        &fp8,
        Some(Quantization::Nvfp4Online),
        seed,
    );

    for recipe in ["mxfp8", "nvfp4"] {
        let out = root.join(format!("converted-{recipe}"));
        converted(&bf16, &out, recipe);
        check_load(&format!("converted {recipe}"), &out, None, seed);
    }
    let out = root.join("converted-fp8-nvfp4");
    converted(&fp8, &out, "nvfp4");
    check_load("converted block-fp8 -> nvfp4", &out, None, seed);
}

fn empty_linear() -> Box<dyn Linear> {
    Box::new(DenseF32 {
        weight: vec![],
        out_features: 0,
        in_features: 0,
    })
}

/// Some slots of `m` as replacements: a norm, the embedding, an attention projection and one
/// expert's gate, up and down (parts of the stacked expert buffers).
fn some_replacements(m: &mut Model) -> Vec<(String, Replacement)> {
    let mut out = vec![
        (
            "model.embed_tokens.weight".to_string(),
            Replacement::Embedding(std::mem::replace(
                &mut m.embed_tokens,
                DenseWeight::F32(vec![]),
            )),
        ),
        (
            "model.layers.0.input_layernorm.weight".to_string(),
            Replacement::Vector(std::mem::take(&mut m.layers[0].input_norm)),
        ),
        (
            "model.layers.0.self_attn.q_proj.weight".to_string(),
            Replacement::Linear(std::mem::replace(&mut m.layers[0].q_proj, empty_linear())),
        ),
    ];
    let Mlp::Moe(moe) = &mut m.layers[1].mlp else {
        panic!("the embedded model is MoE")
    };
    let e = 3;
    let ex = &mut moe.experts[e];
    for (part, lin) in [
        ("gate_proj", &mut ex.gate),
        ("up_proj", &mut ex.up),
        ("down_proj", &mut ex.down),
    ] {
        out.push((
            format!("model.layers.1.mlp.experts.{e}.{part}.weight"),
            Replacement::Linear(std::mem::replace(lin, empty_linear())),
        ));
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn streamed_update_on_device_loaded_weights_matches_the_host_model() {
    let seed = seed();
    println!("seed {seed}");
    let (_tmp, old, new) = old_and_new(seed);
    for q in [
        None,
        Some(Quantization::Mxfp8),
        Some(Quantization::Nvfp4Online),
    ] {
        let what = format!("{q:?}");
        let g = gpu();
        let (mut host, _) = load_model(&old, q, None).unwrap();
        let src = open_serving_checkpoint(&old, q, None).unwrap();
        let mut dev = CudaWeights::from_checkpoint(&g, &src).unwrap();
        // The same replacements twice (they are moved into their targets).
        let for_host = some_replacements(&mut load_model(&new, q, None).unwrap().0);
        let for_dev = some_replacements(&mut load_model(&new, q, None).unwrap().0);
        let cfg = host.config.clone();
        let after = update_both(&g, &mut host, &mut dev, for_host, for_dev, &what);
        // A replacement of the wrong shape is refused and changes nothing.
        let (mut other, _) = load_model(&new, q, None).unwrap();
        let wrong = vec![
            (
                "model.layers.0.input_layernorm.weight".to_string(),
                Replacement::Vector(std::mem::take(&mut other.layers[0].input_norm)),
            ),
            (
                "model.layers.0.self_attn.k_proj.weight".to_string(),
                Replacement::Linear(std::mem::replace(
                    &mut other.layers[0].q_proj,
                    empty_linear(),
                )),
            ),
        ];
        assert!(dev.write_replacements(&g, &cfg, wrong).is_err());
        assert_eq!(
            dev.weights_checksum(&g, &cfg).unwrap(),
            after,
            "{what}: refused update wrote"
        );
        println!("{what}: streamed update on the device equals the host model's");
    }
}

/// A tensor's bytes put in device memory, as a colocated trainer's tensor reaches the store
/// (`/update_weights_from_tensor`): hashed where it lies.
fn device_tensor(g: &Gpu, bytes: &[u8]) -> Replacement {
    use cudarc::driver::DevicePtr;
    let buf = g.upload(bytes).unwrap();
    let ptr = buf.device_ptr(&g.stream).0;
    g.synchronize().unwrap();
    let hash = lockstep::backend::cuda::hash::xxh3_of_device(&g, &[(ptr, bytes.len())]).unwrap()[0];
    Replacement::Device(DeviceTensor {
        ptr,
        bytes: bytes.len(),
        hash,
        owner: Arc::new(buf),
    })
}

/// The device hasher gives the `xxhash` crate's xxh3_64 of the bytes: for every length up to
/// 300 (all of xxh3's short-input cases), lengths around its 1 KiB blocks, ranges longer than
/// one launch block's window of blocks (256 KiB), and ranges at odd addresses (its unaligned
/// path), all in one launch.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn device_bytes_hash_like_the_host() {
    use cudarc::driver::DevicePtr;
    let mut rng = Rng(seed());
    let g = gpu();
    let mut lens: Vec<usize> = (0..=300).collect();
    lens.extend([
        1023,
        1024,
        1025,
        1087,
        1088,
        2047,
        2048,
        2049,
        16 * 1024 - 1,
    ]);
    lens.extend([
        (256 << 10) - 5,
        256 << 10,
        (256 << 10) + 1,
        (3 << 20) + 12345,
    ]);
    let total: usize = lens.iter().map(|n| n + 8).sum();
    let host: Vec<u8> = (0..total).map(|_| rng.next() as u8).collect();
    let buf = g.upload(&host).unwrap();
    g.synchronize().unwrap();
    let base = buf.device_ptr(&g.stream).0;
    // Range i starts (i % 8) bytes into its slot: every alignment is taken.
    let mut ranges = Vec::with_capacity(lens.len());
    let mut at = 0;
    for (i, &n) in lens.iter().enumerate() {
        ranges.push((at + i % 8, n));
        at += n + 8;
    }
    let device: Vec<(u64, usize)> = ranges.iter().map(|&(a, n)| (base + a as u64, n)).collect();
    let got = lockstep::backend::cuda::hash::xxh3_of_device(&g, &device).unwrap();
    for (i, &(a, n)) in ranges.iter().enumerate() {
        assert_eq!(
            got[i],
            xxhash_rust::xxh3::xxh3_64(&host[a..a + n]),
            "range {i}: {n} bytes at offset {a}"
        );
    }
    println!(
        "{} device ranges hashed as the host hashes them",
        ranges.len()
    );
}

/// Dense BF16 weights quantized on the device into MXFP8 and NVFP4 slots (an attention
/// projection, an expert's NVFP4 gate/up pair sharing one scale, its down projection) store
/// the host's bytes: the weights after the write equal, buffer for buffer, the host model
/// given the same update, and the checksum predicted from the device hashes is the one served.
/// A pair's half without its partner is refused, naming the partner.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn dense_weights_quantized_on_the_device_store_the_hosts_bytes() {
    use lockstep::model::cuda::quantize::{quantize_slots, quantizes, Dense};
    use lockstep::model::slots::served_slot;
    let seed = seed();
    let (_tmp, old, new) = old_and_new(seed);
    let newck = Checkpoint::open(&new).unwrap();
    for q in [Quantization::Mxfp8, Quantization::Nvfp4Online] {
        let what = format!("{q:?}");
        let g = gpu();
        let (mut host, recipe) = load_model(&old, Some(q), None).unwrap();
        let src = open_serving_checkpoint(&old, Some(q), None).unwrap();
        let mut dev = CudaWeights::from_checkpoint(&g, &src).unwrap();
        let cfg = host.config.clone();
        let slots = host.slot_shapes();
        let dense_of = |name: &str| {
            let module = name.strip_suffix(".weight")?;
            let slot = served_slot(&slots, &recipe, cfg.num_layers, module)?;
            quantizes(&slot).then(|| {
                let t = newck.tensor(name).unwrap();
                assert_eq!(t.dtype(), Dtype::BF16);
                let bits: Vec<u16> = t
                    .data()
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
                Dense {
                    slot,
                    values: g.upload(&bits).unwrap(),
                }
            })
        };
        let new_model = || load_model(&new, Some(q), None).unwrap().0;
        let for_host = some_replacements(&mut new_model());
        let dense: Vec<Dense> = for_host.iter().filter_map(|(n, _)| dense_of(n)).collect();
        assert!(
            dense.len() >= 3,
            "{what}: {} slots quantized on the device",
            dense.len()
        );
        let quantized = quantize_slots(&g, dense).unwrap();
        let names: Vec<String> = quantized.iter().map(|(n, _)| n.clone()).collect();
        let mut for_dev: Vec<(String, Replacement)> = some_replacements(&mut new_model())
            .into_iter()
            .filter(|(n, _)| !names.contains(n))
            .collect();
        for_dev.extend(quantized);
        let predicted = replacements_checksum(&for_dev, cfg.hidden_size);
        let after = update_both(&g, &mut host, &mut dev, for_host, for_dev, &what);
        for (name, h) in &predicted.tensors {
            assert_eq!(
                after.tensors.get(name),
                Some(h),
                "{what}: {name}'s predicted hash"
            );
        }
        println!(
            "{what}: {} slots quantized on the device, bytes equal to the host's",
            names.len()
        );
        if q == Quantization::Nvfp4Online {
            let gate = "model.layers.1.mlp.experts.3.gate_proj.weight";
            let lonely = dense_of(gate).expect("an NVFP4 gate");
            assert!(lonely.slot.pair.is_some(), "the gate shares its scale");
            let e = quantize_slots(&g, vec![lonely]).err().expect("refused");
            assert!(e.to_string().contains("experts.3.up_proj"), "{e}");
        }
    }
}

/// Bytes copied to the device through the page-locked ring (an in-place commit's read-back)
/// arrive exactly where they were sent, whatever their length against the ring's buffers, and
/// a source that fails to fill a buffer fails the upload.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn uploads_through_the_page_locked_ring_arrive_exactly() {
    use cudarc::driver::DevicePtr;
    use lockstep::backend::cuda::pinned::{HostRing, UploadError};
    let mut rng = Rng(seed());
    let g = gpu();
    let chunk = 4096;
    let mut ring = HostRing::new(&g, 3, chunk).unwrap();
    // Lengths around the buffer size and over the whole ring, at unaligned offsets.
    let lens = [1, 4095, 4096, 4097, 3 * 4096, 3 * 4096 + 1, 10 * 4096 + 77];
    let total: usize = lens.iter().map(|n| n + 3).sum();
    let host: Vec<u8> = (0..total).map(|_| rng.next() as u8).collect();
    let buf = g.alloc::<u8>(total).unwrap();
    let base = buf.device_ptr(&g.stream).0;
    let mut at = 0;
    for &n in &lens {
        let src = &host[at + 3..at + 3 + n];
        ring.upload(&g, base + (at + 3) as u64, n, |off, out| {
            out.copy_from_slice(&src[off..off + out.len()]);
            Ok(())
        })
        .unwrap();
        at += n + 3;
    }
    let got = g.download(&buf, total).unwrap();
    g.synchronize().unwrap();
    let mut at = 0;
    for &n in &lens {
        assert!(
            got[at + 3..at + 3 + n] == host[at + 3..at + 3 + n],
            "{n} bytes at {}",
            at + 3
        );
        at += n + 3;
    }
    let e = ring
        .upload(&g, base, 2 * chunk, |off, _| {
            if off == 0 {
                Ok(())
            } else {
                Err(std::io::Error::other("the file is gone"))
            }
        })
        .unwrap_err();
    assert!(matches!(e, UploadError::Read(_)), "{e}");
}

/// BF16 tensors in device memory (what `/update_weights_from_tensor` makes of a trainer's CUDA
/// IPC tensors) are copied device to device into the embedding, an attention projection and
/// one expert's stacked gate, up and down: the weights then equal the host model given the
/// same tensors, byte for byte, and the precomputed hashes are the checksum's. A device tensor
/// of the wrong size, or for a norm (stored as f32), is refused and changes nothing.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn device_tensors_are_written_device_to_device_like_host_replacements() {
    let seed = seed();
    let (_tmp, old, new) = old_and_new(seed);
    let g = gpu();
    let (mut host, _) = load_model(&old, None, None).unwrap();
    let src = open_serving_checkpoint(&old, None, None).unwrap();
    let mut dev = CudaWeights::from_checkpoint(&g, &src).unwrap();
    let cfg = host.config.clone();
    let for_host = some_replacements(&mut load_model(&new, None, None).unwrap().0);
    let names: Vec<String> = for_host.iter().map(|(n, _)| n.clone()).collect();
    let newck = Checkpoint::open(&new).unwrap();
    let for_dev: Vec<(String, Replacement)> = names
        .iter()
        .map(|n| {
            let t = newck.tensor(n).unwrap();
            if n.contains("layernorm") {
                // Norms stay host replacements (the device keeps them as f32).
                let v = lockstep::checkpoint::to_f32(n, &t).unwrap();
                (n.clone(), Replacement::Vector(v))
            } else {
                assert_eq!(t.dtype(), Dtype::BF16);
                (n.clone(), device_tensor(&g, t.data()))
            }
        })
        .collect();
    let devices = for_dev
        .iter()
        .filter(|(_, r)| matches!(r, Replacement::Device(_)))
        .count();
    assert_eq!(devices, names.len() - 1);
    let predicted = replacements_checksum(&for_dev, cfg.hidden_size);
    let before = dev.weights_checksum(&g, &cfg).unwrap();
    host.apply_replacements(for_host).unwrap();
    dev.write_replacements(&g, &cfg, for_dev).unwrap();
    let after = dev.weights_checksum(&g, &cfg).unwrap();
    assert_ne!(before, after, "the update changed nothing");
    assert_eq!(after, host.weights_checksum(), "checksum after the update");
    for (name, h) in &predicted.tensors {
        assert_eq!(
            after.tensors.get(name),
            Some(h),
            "{name}: the hash made before the write"
        );
    }
    let uploaded = CudaWeights::upload(&g, &host).unwrap();
    assert_same_buffers(
        "device tensors",
        &buffers(&g, &dev),
        &buffers(&g, &uploaded),
    );
    // Refused whole: a norm from device memory beside a good projection, then a projection
    // one element short.
    let q = newck
        .tensor("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    let norm = newck
        .tensor("model.layers.0.input_layernorm.weight")
        .unwrap();
    let wrong = vec![
        (
            "model.layers.0.self_attn.q_proj.weight".to_string(),
            device_tensor(&g, q.data()),
        ),
        (
            "model.layers.0.input_layernorm.weight".to_string(),
            device_tensor(&g, norm.data()),
        ),
    ];
    assert!(dev.write_replacements(&g, &cfg, wrong).is_err());
    let short = vec![(
        "model.layers.0.self_attn.k_proj.weight".to_string(),
        device_tensor(&g, &q.data()[..q.data().len() - 2]),
    )];
    assert!(dev.write_replacements(&g, &cfg, short).is_err());
    assert_eq!(
        dev.weights_checksum(&g, &cfg).unwrap(),
        after,
        "a refused update wrote"
    );
    println!("{devices} device tensors written device to device equal the host model's update");
}

/// `/update_weights_from_disk` on device-only weights (what the endpoint calls): a loader
/// puts the new checkpoint on the device on its own stream while requests run on the old
/// weights, then the engine swaps it in. The requests finish; afterwards the engine serves
/// the bits, and reports the checksum, of an engine started on the new checkpoint. A
/// checkpoint of another config is loaded but refused at the swap, and the old weights keep
/// serving.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn an_update_from_disk_loads_beside_running_requests_and_swaps_in_its_bits() {
    let TwoCheckpoints {
        dirs: [_a, (_b, dir_b)],
        prompts,
        want,
        want_sum,
        h,
        before: _,
    } = two_checkpoints();
    let running = long_requests(&h, &prompts);
    let loader = block_on(h.device_loader())
        .unwrap()
        .expect("room for a second copy");
    let dir = dir_b.clone();
    let loaded = std::thread::spawn(move || loader.load(&disk(&dir)))
        .join()
        .unwrap()
        .unwrap();
    let installed = install(&h, loaded, "v1").unwrap();
    assert_eq!(installed.aborted, 0);
    assert_swapped_in(&h, running, &prompts, &want, "v1");
    assert!(
        *h.weights_checksum().1 == *want_sum,
        "the new checkpoint's checksum"
    );

    // Another config: loaded, refused at the swap; the served weights and version stay.
    let other = Path::new("tests/data/reference/qwen3_moe");
    let loader = block_on(h.device_loader())
        .unwrap()
        .expect("room for a second copy");
    let loaded = loader.load(&disk(other)).unwrap();
    let refused = install(&h, loaded, "v2");
    assert!(
        refused.is_err(),
        "a checkpoint of another config is refused"
    );
    assert_eq!(h.weight_version(), "v1");
    assert_eq!(
        generate(&h, &prompts, "kept"),
        want,
        "the served weights are untouched"
    );
    h.shutdown();
    println!("update from disk beside running requests: swapped in, bitwise the fresh engine's");
}

/// Checkpoint `dir` as the server's `--model-path`, loaded as it is.
fn disk(dir: &Path) -> lockstep::engine::DiskWeights {
    lockstep::engine::DiskWeights {
        dir: dir.to_path_buf(),
        quantization: None,
        recipe: None,
    }
}

/// Two BF16 checkpoints of the embedded config (a, then b), what an engine started on b
/// serves, and an engine serving a.
struct TwoCheckpoints {
    dirs: [(tempfile::TempDir, PathBuf); 2],
    prompts: Vec<Vec<u32>>,
    /// An engine on b: its greedy bits and checksum.
    want: common::engine::Bits,
    want_sum: Arc<lockstep::model::checksum::WeightsChecksum>,
    /// The engine on a, and its greedy bits.
    h: lockstep::engine::EngineHandle,
    before: common::engine::Bits,
}

fn two_checkpoints() -> TwoCheckpoints {
    use lockstep::engine::CudaSource;
    let seed = seed();
    println!("seed {seed}");
    let mut rng = Rng(seed);
    let (a, b) = (scratch("a"), scratch("b"));
    bf16_checkpoint(&a.1, seed);
    bf16_checkpoint(&b.1, seed ^ 0x5eed);
    let config = ModelConfig::from_json(embedded_config()).unwrap();
    let recipe = Recipe::bf16();
    let prompts = prompts(&mut rng, config.vocab_size);
    let on = |dir: &Path| {
        start(
            CudaSource::Checkpoint(disk(dir)),
            config.clone(),
            &recipe,
            false,
        )
    };
    let fresh = on(&b.1);
    let want = generate(&fresh, &prompts, "fresh");
    let want_sum = fresh.weights_checksum().1;
    fresh.shutdown();
    let h = on(&a.1);
    let before = generate(&h, &prompts, "before");
    assert_ne!(before, want, "the two checkpoints differ");
    TwoCheckpoints {
        dirs: [a, b],
        prompts,
        want,
        want_sum,
        h,
        before,
    }
}

/// Four greedy requests of 200 tokens, submitted to `h`.
fn long_requests(
    h: &lockstep::engine::EngineHandle,
    prompts: &[Vec<u32>],
) -> Vec<tokio::sync::mpsc::UnboundedReceiver<lockstep::engine::EngineEvent>> {
    (0..4)
        .map(|i| {
            let mut r =
                common::engine::greedy(format!("long{i}"), prompts[i % prompts.len()].clone());
            r.params.max_new_tokens = 200;
            h.submit(r).unwrap()
        })
        .collect()
}

/// Hashes loaded weights on their stream and swaps them in (what `/update_weights_from_disk`
/// does with a device loader's result).
fn install(
    h: &lockstep::engine::EngineHandle,
    mut loaded: lockstep::engine::ShadowWeights,
    version: &str,
) -> Result<lockstep::engine::Installed, lockstep::engine::EngineError> {
    use lockstep::model::store::WeightStore;
    let sum = loaded.checksum().unwrap();
    block_on(h.install_shadow(loaded, Arc::new(sum), version.into(), false))
}

/// After a swap to `version`: the requests that spanned it finish with every token, and the
/// engine serves `want`'s bits.
fn assert_swapped_in(
    h: &lockstep::engine::EngineHandle,
    running: Vec<tokio::sync::mpsc::UnboundedReceiver<lockstep::engine::EngineEvent>>,
    prompts: &[Vec<u32>],
    want: &common::engine::Bits,
    version: &str,
) {
    assert_eq!(
        finish_all(running),
        vec![200; 4],
        "every token of a request that spans the update"
    );
    assert_eq!(h.weight_version(), version);
    assert_eq!(
        &generate(h, prompts, "after"),
        want,
        "the new checkpoint's bits"
    );
}

/// Waits for every request of `running` to finish; returns how many tokens each produced.
fn finish_all(
    running: Vec<tokio::sync::mpsc::UnboundedReceiver<lockstep::engine::EngineEvent>>,
) -> Vec<usize> {
    use lockstep::engine::EngineEvent;
    block_on(async {
        let mut counts = Vec::new();
        for mut rx in running {
            let mut tokens = 0;
            loop {
                match rx.recv().await.expect("event") {
                    EngineEvent::Token(_) => tokens += 1,
                    EngineEvent::Finished(_) => break,
                    EngineEvent::Error(e) => {
                        panic!("a request running through the update failed: {e}")
                    }
                }
            }
            counts.push(tokens);
        }
        counts
    })
}

/// A streamed update into a device shadow (what `--weight-update-shadow` does per bucket):
/// the copy starts equal to the served weights (its checksum, from the device), every slot of
/// another checkpoint is written into it on its own stream while requests run on the
/// originals, and the swap makes the engine serve, bit for bit and by checksum, what an engine
/// started on that checkpoint serves; the requests spanning it finish. A shadow made before
/// another update was swapped in is refused at its swap, changing nothing.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn a_streamed_update_into_a_device_shadow_swaps_in_beside_running_requests() {
    use lockstep::model::store::WeightStore;
    let TwoCheckpoints {
        dirs: [(_a, dir_a), (_b, dir_b)],
        prompts,
        want,
        want_sum,
        h,
        before,
    } = two_checkpoints();
    let served_sum = h.weights_checksum().1;
    let running = long_requests(&h, &prompts);
    let mut shadow = block_on(h.shadow_weights(true))
        .unwrap()
        .expect("room for a shadow of the small model");
    assert!(shadow.on_device());
    assert!(
        shadow.checksum().unwrap() == *served_sum,
        "the copy equals the served weights"
    );
    let updates = load_model(&dir_b, None, None)
        .unwrap()
        .0
        .into_replacements();
    let shadow = std::thread::spawn(move || {
        shadow.write(updates).unwrap();
        shadow
    })
    .join()
    .unwrap();
    let mut shadow = shadow;
    let sum = shadow.checksum().unwrap();
    assert!(sum == *want_sum, "the shadow holds the new checkpoint");
    let installed = block_on(h.install_shadow(shadow, Arc::new(sum), "v1".into(), false)).unwrap();
    println!(
        "shadow swapped in; generation stood still {:?}",
        installed.pause
    );
    assert_swapped_in(&h, running, &prompts, &want, "v1");

    // Overtaken: a shadow of v1, then an update from disk swapped in first.
    let late = block_on(h.shadow_weights(true)).unwrap().expect("room");
    let loader = block_on(h.device_loader())
        .unwrap()
        .expect("room for a second copy");
    let loaded = loader.load(&disk(&dir_a)).unwrap();
    install(&h, loaded, "v2").unwrap();
    let refused = block_on(h.install_shadow(late, served_sum.clone(), "v3".into(), false));
    assert!(refused.is_err(), "a shadow of replaced weights is refused");
    assert_eq!(h.weight_version(), "v2");
    assert_eq!(
        generate(&h, &prompts, "v2"),
        before,
        "the update from disk serves"
    );
    h.shutdown();
    println!("streamed update into a device shadow: swapped in, bitwise the fresh engine's");
}
