//! `lockstep convert`: a Hugging Face checkpoint (BF16/F16/F32 or DeepSeek-style block FP8)
//! -> an MXFP8 / NVFP4 checkpoint in the layouts SGLang and vLLM load, following a recipe.
//!
//! Which tensors are quantized, their shapes and formats come from the model's layout
//! (`model::layout`); their bytes from `quant::slot`. Tensors are read one at a time from
//! memory-mapped shards and written in bounded shards, so memory stays near one shard plus one
//! expert. Output appears under its final name only when everything succeeded.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

use crate::checkpoint::{to_f32, Checkpoint, CheckpointError, OwnedTensor, ShardedWriter};
use crate::model::layout::{ModelLayout, TensorSpec};
use crate::model::ModelConfig;
use crate::quant::slot::{self, DenseWeight};
use crate::quant::{fp8_block, Format, Recipe, MXFP8_BLOCK, NVFP4_BLOCK};

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config.json: {0}")]
    Config(String),
    #[error(transparent)]
    Model(#[from] crate::model::config::ConfigError),
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("output {0} already exists and is not empty")]
    OutputExists(PathBuf),
}

pub struct ConvertOptions<'a> {
    pub input: &'a Path,
    pub output: &'a Path,
    pub recipe: &'a Recipe,
    pub max_shard_bytes: usize,
    pub progress: bool,
}

#[derive(Debug, Default, PartialEq)]
pub struct ConvertReport {
    pub tensors_in: usize,
    pub tensors_out: usize,
    /// Linear weights per output format.
    pub weights_by_format: BTreeMap<String, usize>,
    pub bytes_out: usize,
}

/// How the source checkpoint stores its weights.
enum Source {
    HighPrecision,
    /// DeepSeek-style block FP8 with `weight_scale_inv` per block.
    BlockFp8 {
        block: (usize, usize),
    },
}

pub fn convert(opts: &ConvertOptions<'_>) -> Result<ConvertReport, ConvertError> {
    let ckpt = Checkpoint::open(opts.input)?;
    let mut config = ckpt
        .config()?
        .ok_or_else(|| ConvertError::Config(format!("no config.json in {}", ckpt.dir.display())))?;
    let layout = ModelLayout::of(&ModelConfig::from_json(config.clone())?, opts.recipe);
    let specs: HashMap<&str, &TensorSpec> = layout
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    let source = source_format(&config)?;

    let staging = staging_dir(opts.output)?;
    let mut metadata = HashMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    metadata.insert("lockstep_recipe_hash".to_string(), opts.recipe.hash());
    let mut writer = ShardedWriter::new(&staging, opts.max_shard_bytes, metadata);
    let mut report = ConvertReport::default();
    let mut ignored = BTreeSet::new();

    let names: Vec<String> = ckpt
        .names()
        .filter(|n| {
            !(matches!(source, Source::BlockFp8 { .. }) && n.ends_with(".weight_scale_inv"))
        })
        .map(str::to_string)
        .collect();
    report.tensors_in = ckpt.names().count();
    let bar = progress_bar(names.len() as u64, opts.progress);
    let mut done = BTreeSet::new();
    for name in &names {
        bar.inc(1);
        // The layout's linear layers follow the recipe; everything else is copied.
        let Some(spec) = specs.get(name.as_str()).filter(|t| t.place.quantizable()) else {
            writer.add(name.clone(), copy_tensor(&ckpt, name, &source)?)?;
            continue;
        };
        let format = format!("{:?}", spec.format.format).to_lowercase();
        *report.weights_by_format.entry(format).or_default() += 1;
        if spec.format.format == Format::Bf16 {
            ignored.insert(spec.module().to_string());
            writer.add(name.clone(), copy_tensor(&ckpt, name, &source)?)?;
            continue;
        }
        if !done.insert(name.clone()) {
            continue;
        }
        // An NVFP4 gate/up pair is written together, at its gate (which sorts first).
        let slot = layout.slot(spec);
        let halves: Vec<&TensorSpec> = match &slot.pair {
            Some(p)
                if [&p.gate, &p.up]
                    .iter()
                    .all(|m| ckpt.contains(&format!("{m}.weight"))) =>
            {
                [&p.gate, &p.up]
                    .map(|m| specs[format!("{m}.weight").as_str()])
                    .into()
            }
            _ => vec![spec],
        };
        let values = halves
            .iter()
            .map(|t| load_dense(&ckpt, t, &source))
            .collect::<Result<Vec<_>, _>>()?;
        let shared = match (&slot.pair, &values[..]) {
            (Some(p), [gate, up]) => Some(slot::shared_level(&p.gate_format, gate, up)),
            _ => None,
        };
        for (t, w) in halves.into_iter().zip(values) {
            let stored = layout
                .slot(t)
                .quantize(w, shared)
                .map_err(|e| tensor_err(&e.name, e.reason))?;
            for part in stored.parts() {
                let name = format!("{}.{}", t.module(), part.suffix);
                writer.add(name, part.to_owned_tensor())?;
            }
            done.insert(t.name.clone());
        }
    }
    bar.finish_and_clear();
    report.bytes_out = writer.finish()?;
    report.tensors_out = count_tensors(&staging)?;

    config["quantization_config"] = quantization_config(opts.recipe, &report, &ignored);
    write_json(&staging.join("config.json"), &config)?;
    if report.weights_by_format.contains_key("nvfp4") {
        write_json(
            &staging.join("hf_quant_config.json"),
            &hf_quant_config(&ignored),
        )?;
    }
    let recipe_path = staging.join("lockstep_recipe.yaml");
    std::fs::write(&recipe_path, &opts.recipe.source).map_err(|source| ConvertError::Io {
        path: recipe_path,
        source,
    })?;
    copy_side_files(&ckpt.dir, &staging)?;
    std::fs::rename(&staging, opts.output).map_err(|source| ConvertError::Io {
        path: opts.output.to_path_buf(),
        source,
    })?;
    Ok(report)
}

fn tensor_err(name: &str, e: impl ToString) -> ConvertError {
    ConvertError::Tensor {
        name: name.to_string(),
        reason: e.to_string(),
    }
}

fn source_format(config: &serde_json::Value) -> Result<Source, ConvertError> {
    let Some(qc) = config.get("quantization_config") else {
        return Ok(Source::HighPrecision);
    };
    match qc.get("quant_method").and_then(|m| m.as_str()) {
        Some("fp8") => {
            let block = qc.get("weight_block_size").and_then(|b| b.as_array()).and_then(|b| Some((b.first()?.as_u64()? as usize, b.get(1)?.as_u64()? as usize)));
            let block = block.ok_or_else(|| ConvertError::Config("fp8 quantization_config without `weight_block_size` [n, k] (only block FP8 is supported)".into()))?;
            Ok(Source::BlockFp8 { block })
        }
        other => Err(ConvertError::Config(format!("source is already quantized (quant_method {other:?}); convert takes BF16/F16/F32 or block-FP8 checkpoints"))),
    }
}

/// A layout tensor's values (block FP8 dequantized), with its shape checked.
fn load_dense(
    ckpt: &Checkpoint,
    spec: &TensorSpec,
    source: &Source,
) -> Result<DenseWeight, ConvertError> {
    let shape = ckpt.tensor(&spec.name)?.shape().to_vec();
    if shape != spec.shape {
        let reason = format!(
            "shape {shape:?}, expected {:?} from config.json",
            spec.shape
        );
        return Err(tensor_err(&spec.name, reason));
    }
    Ok(DenseWeight::F32(load_f32(ckpt, &spec.name, source)?))
}

fn load_f32(ckpt: &Checkpoint, name: &str, source: &Source) -> Result<Vec<f32>, ConvertError> {
    let t = ckpt.tensor(name)?;
    match (source, t.dtype()) {
        (Source::BlockFp8 { block }, Dtype::F8_E4M3) => {
            let scale_name = format!("{}_scale_inv", name);
            let s = ckpt.tensor(&scale_name)?;
            let scale = to_f32(&scale_name, &s)?;
            let (rows, cols) = (t.shape()[0], t.shape()[1]);
            fp8_block::dequantize(t.data(), &scale, rows, cols, *block)
                .map_err(|e| tensor_err(name, e))
        }
        _ => Ok(to_f32(name, &t)?),
    }
}

/// Non-quantized tensors keep their dtype, except block-FP8 weights, which become BF16.
fn copy_tensor(
    ckpt: &Checkpoint,
    name: &str,
    source: &Source,
) -> Result<OwnedTensor, ConvertError> {
    let t = ckpt.tensor(name)?;
    if matches!(source, Source::BlockFp8 { .. }) && t.dtype() == Dtype::F8_E4M3 {
        return Ok(OwnedTensor::bf16(
            t.shape().to_vec(),
            &load_f32(ckpt, name, source)?,
        ));
    }
    Ok(OwnedTensor::from_view(&t))
}

fn quantization_config(
    recipe: &Recipe,
    report: &ConvertReport,
    ignored: &BTreeSet<String>,
) -> serde_json::Value {
    let has = |f: &str| report.weights_by_format.contains_key(f);
    let lockstep = serde_json::json!({"recipe": recipe.name, "recipe_hash": recipe.hash(), "activation_scale": "per_token"});
    let ignore: Vec<&String> = ignored.iter().collect();
    match (has("nvfp4"), has("mxfp8")) {
        (true, false) => {
            serde_json::json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NVFP4_BLOCK, "ignore": ignore, "lockstep": lockstep})
        }
        (false, true) => {
            serde_json::json!({"quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, MXFP8_BLOCK], "scale_fmt": "ue8m0", "ignored_layers": ignore, "lockstep": lockstep})
        }
        (true, true) => {
            serde_json::json!({"quant_method": "lockstep", "formats": ["nvfp4", "mxfp8"], "ignore": ignore, "lockstep": lockstep})
        }
        (false, false) => serde_json::json!({"quant_method": "none", "lockstep": lockstep}),
    }
}

fn hf_quant_config(ignored: &BTreeSet<String>) -> serde_json::Value {
    serde_json::json!({
        "producer": {"name": "lockstep", "version": env!("CARGO_PKG_VERSION")},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": NVFP4_BLOCK, "exclude_modules": ignored}
    })
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), ConvertError> {
    std::fs::write(
        path,
        serde_json::to_string_pretty(v).expect("json serializes"),
    )
    .map_err(|source| ConvertError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Tokenizer, generation config, chat template...: everything but weights and files we rewrite.
fn copy_side_files(from: &Path, to: &Path) -> Result<(), ConvertError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ConvertError::Io { path, source }
    };
    for entry in std::fs::read_dir(from).map_err(io(from))? {
        let p = entry.map_err(io(from))?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let skip = name.ends_with(".safetensors")
            || matches!(
                name,
                "config.json"
                    | "model.safetensors.index.json"
                    | "hf_quant_config.json"
                    | "lockstep_recipe.yaml"
            );
        if p.is_file() && !skip {
            std::fs::copy(&p, to.join(name)).map_err(io(&p))?;
        }
    }
    Ok(())
}

fn staging_dir(output: &Path) -> Result<PathBuf, ConvertError> {
    if output.exists() {
        let empty = std::fs::read_dir(output)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false);
        if !empty {
            return Err(ConvertError::OutputExists(output.to_path_buf()));
        }
        std::fs::remove_dir(output).map_err(|source| ConvertError::Io {
            path: output.to_path_buf(),
            source,
        })?;
    }
    let name = output.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let staging = output.with_file_name(format!(".{name}.partial"));
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(|source| ConvertError::Io {
            path: staging.clone(),
            source,
        })?;
    }
    std::fs::create_dir_all(&staging).map_err(|source| ConvertError::Io {
        path: staging.clone(),
        source,
    })?;
    Ok(staging)
}

fn count_tensors(dir: &Path) -> Result<usize, ConvertError> {
    Ok(Checkpoint::open(dir)?.names().count())
}

fn progress_bar(len: u64, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} converting [{bar:40}] {pos}/{len} tensors {elapsed}",
        )
        .expect("valid template"),
    );
    bar
}
