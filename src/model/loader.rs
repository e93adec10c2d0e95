//! Building a [`Model`] from a checkpoint (BF16/F16/F32, block FP8, MXFP8, ModelOpt NVFP4) or
//! from deterministic dummy weights, with linear layers in the formats a recipe assigns.

use super::layout::{Place, Proj};
use std::path::Path;

use half::bf16;
use safetensors::tensor::Dtype;

use super::{Layer, Mlp, Model, ModelConfig, Moe, SwiGlu};
use crate::backend::cpu::linear::{linear_from, make_linear, DenseWeight};
use crate::backend::Linear;
use crate::checkpoint::{to_f32, Checkpoint, CheckpointError};
use crate::quant::nvfp4::{GlobalScale, SecondLevel};
use crate::quant::slot::{self, Slot, Stored};
use crate::quant::{fp8_block, BlockAxis, Format, Mxfp8Tensor, Nvfp4Tensor, Recipe, TensorFormat};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Config(#[from] super::config::ConfigError),
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("--quantization {requested}: {reason}")]
    Quantization { requested: String, reason: String },
}

pub(crate) fn tensor_err(name: &str, reason: impl ToString) -> LoadError {
    LoadError::Tensor {
        name: name.to_string(),
        reason: reason.to_string(),
    }
}

/// `--quantization`: how linear weights are stored and computed (SGLang's names).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Quantization {
    /// Everything in high precision.
    Bf16,
    /// A DeepSeek-style block-FP8 checkpoint (dequantized to f32 on the CPU backend).
    Fp8,
    /// MXFP8 per the recipe: pre-quantized tensors as stored, others quantized at load.
    Mxfp8,
    /// A pre-quantized NVFP4 (ModelOpt layout) checkpoint.
    Nvfp4,
    /// A BF16/FP8 checkpoint whose recipe-selected weights are quantized to NVFP4 at load.
    #[value(name = "nvfp4_online")]
    Nvfp4Online,
}

/// Where weights come from.
pub enum WeightSource<'a> {
    Checkpoint {
        ckpt: &'a Checkpoint,
        fp8_block: Option<(usize, usize)>,
    },
    /// Deterministic pseudo-random weights: the same values for a (seed, tensor name) on every
    /// backend, so full-size configs can be benchmarked without checkpoints.
    Dummy { seed: u64 },
    /// High-precision tensors in memory by checkpoint name (the trainer's serving weights).
    Tensors(&'a std::collections::BTreeMap<String, DenseWeight>),
}

/// Detected checkpoint quantization from `quantization_config`.
pub fn detect_quantization(config: &serde_json::Value) -> Option<Quantization> {
    let qc = config.get("quantization_config")?;
    match (
        qc.get("quant_method")?.as_str()?,
        qc.get("quant_algo").and_then(|a| a.as_str()),
    ) {
        ("modelopt", Some("NVFP4")) => Some(Quantization::Nvfp4),
        ("mxfp8", _) => Some(Quantization::Mxfp8),
        ("fp8", _) => Some(Quantization::Fp8),
        ("lockstep", _) => Some(Quantization::Nvfp4),
        _ => None,
    }
}

/// The recipe a server applies for `--quantization` over a checkpoint stored as `stored`.
pub fn serving_recipe(
    requested: Option<Quantization>,
    stored: Option<Quantization>,
    recipe: Option<Recipe>,
) -> Result<Recipe, LoadError> {
    let err = |q: Quantization, reason: &str| LoadError::Quantization {
        requested: format!("{q:?}").to_lowercase(),
        reason: reason.into(),
    };
    let builtin = |name| {
        recipe
            .clone()
            .unwrap_or_else(|| Recipe::builtin(name).expect("shipped recipe"))
    };
    Ok(match (requested.or(stored), stored) {
        (None, _) | (Some(Quantization::Bf16), None) => recipe.unwrap_or_else(Recipe::bf16),
        (Some(Quantization::Bf16), Some(_)) => {
            return Err(err(
                Quantization::Bf16,
                "the checkpoint is already quantized",
            ))
        }
        (Some(Quantization::Fp8), Some(Quantization::Fp8)) => recipe.unwrap_or_else(Recipe::bf16),
        (Some(Quantization::Fp8), _) => {
            return Err(err(
                Quantization::Fp8,
                "needs a block-FP8 checkpoint (quant_method fp8)",
            ))
        }
        (Some(Quantization::Mxfp8), None | Some(Quantization::Fp8 | Quantization::Mxfp8)) => {
            builtin("mxfp8")
        }
        (Some(Quantization::Nvfp4), Some(Quantization::Nvfp4)) => builtin("nvfp4"),
        (Some(Quantization::Nvfp4), _) => {
            return Err(err(
                Quantization::Nvfp4,
                "needs an NVFP4 checkpoint; use nvfp4_online to quantize a BF16/FP8 one at load",
            ))
        }
        (Some(Quantization::Nvfp4Online), None | Some(Quantization::Fp8)) => builtin("nvfp4"),
        (Some(q), Some(s)) => {
            return Err(err(
                q,
                &format!("the checkpoint is already quantized as {s:?}"),
            ))
        }
    })
}

/// The recipe for dummy weights (`--load-format dummy`, the embedded model) under
/// `--quantization`: they stand for a checkpoint stored in the requested format, as SGLang's
/// dummy loader initializes a quantized model's own parameters. So `nvfp4` (an NVFP4
/// checkpoint) serves what `nvfp4_online` makes of the same drawn weights, and `fp8` (block
/// FP8) what a block-FP8 checkpoint serves; the other formats as over a BF16 checkpoint.
pub fn dummy_recipe(
    requested: Option<Quantization>,
    recipe: Option<Recipe>,
) -> Result<Recipe, LoadError> {
    let stored = requested.filter(|q| matches!(q, Quantization::Nvfp4 | Quantization::Fp8));
    serving_recipe(requested, stored, recipe)
}

impl WeightSource<'_> {
    fn contains(&self, name: &str) -> bool {
        match self {
            WeightSource::Checkpoint { ckpt, .. } => ckpt.contains(name),
            WeightSource::Dummy { .. } => false,
            WeightSource::Tensors(map) => map.contains_key(name),
        }
    }

    /// A high-precision matrix `[rows, cols]` (block FP8 dequantized).
    fn dense(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        init: DummyInit,
    ) -> Result<DenseWeight, LoadError> {
        let ckpt = match self {
            WeightSource::Dummy { seed } => {
                return Ok(DenseWeight::Bf16(dummy_values(
                    *seed,
                    name,
                    rows * cols,
                    init,
                )))
            }
            WeightSource::Tensors(map) => {
                let w = map.get(name).ok_or_else(|| tensor_err(name, "missing"))?;
                if w.len() != rows * cols {
                    return Err(tensor_err(
                        name,
                        format!("{} values, expected [{rows}, {cols}]", w.len()),
                    ));
                }
                return Ok(w.clone());
            }
            WeightSource::Checkpoint { ckpt, .. } => ckpt,
        };
        let t = checked_tensor(ckpt, name, &[rows, cols])?;
        if t.dtype() != Dtype::F8_E4M3 {
            return slot::dense_of(name, &t).map_err(|e| tensor_err(name, e.reason));
        }
        let WeightSource::Checkpoint {
            fp8_block: Some(block),
            ..
        } = self
        else {
            return Err(tensor_err(
                name,
                "F8_E4M3 weight without a block-FP8 quantization_config",
            ));
        };
        let scale = fp8_scale_inv(ckpt, name)?;
        let w = fp8_block::dequantize(t.data(), &scale, rows, cols, *block);
        Ok(DenseWeight::F32(w.map_err(|e| tensor_err(name, e))?))
    }

    fn vector(&self, name: &str, len: usize, init: DummyInit) -> Result<Vec<f32>, LoadError> {
        match self {
            WeightSource::Dummy { seed } => Ok(dummy_values(*seed, name, len, init)
                .into_iter()
                .map(|v| v.to_f32())
                .collect()),
            WeightSource::Tensors(map) => {
                let w = map.get(name).ok_or_else(|| tensor_err(name, "missing"))?;
                if w.len() != len {
                    return Err(tensor_err(
                        name,
                        format!("{} values, expected [{len}]", w.len()),
                    ));
                }
                Ok(w.to_f32())
            }
            WeightSource::Checkpoint { ckpt, .. } => {
                Ok(to_f32(name, &checked_tensor(ckpt, name, &[len])?)?)
            }
        }
    }

    /// The linear layer `module` in a stored quantized format, if the checkpoint has one.
    fn prequantized(
        &self,
        module: &str,
        rows: usize,
        cols: usize,
        fmt: &TensorFormat,
    ) -> Result<Option<Box<dyn Linear>>, LoadError> {
        let WeightSource::Checkpoint { ckpt, .. } = self else {
            return Ok(None);
        };
        let stored = match prequantized_parts(ckpt, module, rows, cols)? {
            Some(Prequantized::Nvfp4 {
                data,
                scales,
                s_dec,
            }) => Stored::Nvfp4(Nvfp4Tensor {
                rows,
                cols,
                data: data.to_vec(),
                scales: scales.to_vec(),
                global: GlobalScale::PerTensor(s_dec),
            }),
            Some(Prequantized::Mxfp8 { data, scales }) => Stored::Mxfp8(Mxfp8Tensor {
                rows,
                cols,
                axis: BlockAxis::Rowwise,
                data: data.to_vec(),
                scales: scales.to_vec(),
            }),
            None => return Ok(None),
        };
        Ok(Some(linear_from(stored, fmt)))
    }
}

/// A linear layer stored already quantized in a checkpoint (`lockstep convert`'s layouts):
/// its parts as the checkpoint holds them, shapes checked.
pub enum Prequantized<'a> {
    /// ModelOpt NVFP4: packed E2M1 `[rows, cols/2]`, E4M3 block scales `[rows, cols/16]` and
    /// the weight's S_dec (`weight_scale_2`).
    Nvfp4 {
        data: &'a [u8],
        scales: &'a [u8],
        s_dec: f32,
    },
    /// MXFP8: E4M3 `[rows, cols]` and E8M0 `weight_scale_inv` `[rows, cols/32]`.
    Mxfp8 { data: &'a [u8], scales: &'a [u8] },
}

/// The stored quantized parts of the linear layer `module`, if the checkpoint has them
/// (an NVFP4 `weight_scale_2`, or a U8 `weight_scale_inv`: block FP8's is a float tensor),
/// each checked against the checkpoint layout of `quant::slot`.
pub fn prequantized_parts<'a>(
    ckpt: &'a Checkpoint,
    module: &str,
    rows: usize,
    cols: usize,
) -> Result<Option<Prequantized<'a>>, LoadError> {
    let has = |suffix: &str| ckpt.contains(&format!("{module}.{suffix}"));
    let format = if has("weight_scale_2") {
        Format::Nvfp4
    } else if has("weight_scale_inv")
        && ckpt.tensor(&format!("{module}.weight_scale_inv"))?.dtype() == Dtype::U8
    {
        Format::Mxfp8
    } else {
        return Ok(None);
    };
    let slot = Slot::new(
        module,
        vec![rows, cols],
        TensorFormat::BF16.with(format),
        None,
    );
    let part = |suffix: &str| -> Result<_, LoadError> {
        let t = ckpt.tensor(&slot.name(suffix))?;
        let checked = slot.check_stored(suffix, t.dtype(), t.shape());
        checked.map_err(|e| tensor_err(&e.name, e.reason))?;
        Ok(t)
    };
    let data = part("weight")?.data();
    Ok(Some(match format {
        Format::Nvfp4 => Prequantized::Nvfp4 {
            data,
            scales: part("weight_scale")?.data(),
            s_dec: to_f32(&slot.name("weight_scale_2"), &part("weight_scale_2")?)?[0],
        },
        _ => Prequantized::Mxfp8 {
            data,
            scales: part("weight_scale_inv")?.data(),
        },
    }))
}

/// Tensor `name` of the checkpoint, with its shape checked.
pub fn checked_tensor<'a>(
    ckpt: &'a Checkpoint,
    name: &str,
    shape: &[usize],
) -> Result<safetensors::tensor::TensorView<'a>, LoadError> {
    let t = ckpt.tensor(name)?;
    if t.shape() != shape {
        return Err(tensor_err(
            name,
            format!("shape {:?}, expected {shape:?}", t.shape()),
        ));
    }
    Ok(t)
}

/// The f32 `weight_scale_inv` of a block-FP8 weight `name`.
pub fn fp8_scale_inv(ckpt: &Checkpoint, name: &str) -> Result<Vec<f32>, LoadError> {
    let scale_name = format!("{name}_scale_inv");
    Ok(to_f32(&scale_name, &ckpt.tensor(&scale_name)?)?)
}

/// The format the recipe gives linear layer `module` (of `cols` inputs) in a model of
/// `num_layers` layers.
pub fn linear_format(
    recipe: &Recipe,
    module: &str,
    num_layers: usize,
    cols: usize,
) -> TensorFormat {
    recipe.format_for(module, num_layers).fitting(cols)
}

/// Whether an NVFP4 gate/up pair is quantized at load with one shared second-level scale:
/// both NVFP4 in the recipe and not stored quantized already.
pub fn gate_up_shares_level(
    gate: &TensorFormat,
    up: &TensorFormat,
    gate_stored_nvfp4: bool,
) -> bool {
    super::layout::shares_gate_up_scale(gate.format, up.format) && !gate_stored_nvfp4
}

/// Whether lm_head is the embedding matrix: tied, or a checkpoint without `lm_head.weight`.
pub fn lm_head_is_embedding(cfg: &ModelConfig, ckpt: Option<&Checkpoint>) -> bool {
    cfg.tie_word_embeddings || ckpt.is_some_and(|c| !c.contains("lm_head.weight"))
}

/// How dummy values are drawn for a tensor.
#[derive(Clone, Copy)]
enum DummyInit {
    /// Uniform with standard deviation 1/sqrt(fan_in).
    FanIn(usize),
    /// Norm weights: 1.
    Ones,
}

/// The key of tensor `name`'s dummy values (FNV-1a of the name, seeded). The CUDA backend
/// generates the same values on the device from this key (kernels/elementwise.cu).
pub fn dummy_key(seed: u64, name: &str) -> u64 {
    let mut key = seed ^ 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        key = (key ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    key
}

/// Dummy weights are uniform in `[-bound, bound]`: standard deviation 1/sqrt(fan_in).
pub fn dummy_bound(fan_in: usize) -> f32 {
    (3.0 / fan_in as f32).sqrt()
}

/// A counter-based generator: value i of tensor `name` depends only on (seed, name, i).
fn dummy_values(seed: u64, name: &str, n: usize, init: DummyInit) -> Vec<bf16> {
    let DummyInit::FanIn(fan_in) = init else {
        return vec![bf16::ONE; n];
    };
    let key = dummy_key(seed, name);
    let bound = dummy_bound(fan_in);
    (0..n as u64)
        .map(|i| {
            let mut z = key.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32;
            bf16::from_f32((u * 2.0 - 1.0) * bound)
        })
        .collect()
}

struct Builder<'a> {
    src: WeightSource<'a>,
    recipe: &'a Recipe,
    num_layers: usize,
}

impl Builder<'_> {
    fn format(&self, module: &str, cols: usize) -> TensorFormat {
        linear_format(self.recipe, module, self.num_layers, cols)
    }

    fn linear(
        &self,
        module: &str,
        rows: usize,
        cols: usize,
        shared: Option<SecondLevel>,
    ) -> Result<Box<dyn Linear>, LoadError> {
        let fmt = self.format(module, cols);
        if let Some(l) = self.src.prequantized(module, rows, cols, &fmt)? {
            return Ok(l);
        }
        let w = self.src.dense(
            &format!("{module}.weight"),
            rows,
            cols,
            DummyInit::FanIn(cols),
        )?;
        Ok(make_linear(
            w,
            rows,
            cols,
            &fmt,
            shared.filter(|_| fmt.format == Format::Nvfp4),
        ))
    }

    fn swiglu(&self, prefix: &str, hidden: usize, inter: usize) -> Result<SwiGlu, LoadError> {
        let (g, u, d) = (
            format!("{prefix}.gate_proj"),
            format!("{prefix}.up_proj"),
            format!("{prefix}.down_proj"),
        );
        // NVFP4 gate and up share one second-level scale (from the amax of both).
        let gf = self.format(&g, hidden);
        let stored = self.src.contains(&format!("{g}.weight_scale_2"));
        let dense = |m: &str| {
            let name = format!("{m}.weight");
            self.src
                .dense(&name, inter, hidden, DummyInit::FanIn(hidden))
        };
        let shared = match gate_up_shares_level(&gf, &self.format(&u, hidden), stored) {
            true => Some(slot::shared_level(&gf, &dense(&g)?, &dense(&u)?)),
            false => None,
        };
        Ok(SwiGlu {
            gate: self.linear(&g, inter, hidden, shared)?,
            up: self.linear(&u, inter, hidden, shared)?,
            down: self.linear(&d, hidden, inter, None)?,
        })
    }

    fn layer(&self, cfg: &ModelConfig, l: usize) -> Result<Layer, LoadError> {
        let h = cfg.hidden_size;
        let norm = |place: Place, len| self.src.vector(&place.name(), len, DummyInit::Ones);
        let qk_norm = |place| cfg.qk_norm.then(|| norm(place, cfg.head_dim)).transpose();
        let attention =
            |proj, rows, cols| self.linear(&Place::Attention(l, proj).module(), rows, cols, None);
        let mlp = match cfg.moe.as_ref().filter(|_| cfg.is_moe_layer(l)) {
            Some(moe) => {
                let router = make_linear(
                    self.src.dense(
                        &Place::Router(l).name(),
                        moe.num_experts,
                        h,
                        DummyInit::FanIn(h),
                    )?,
                    moe.num_experts,
                    h,
                    &TensorFormat::BF16,
                    None,
                );
                let experts = (0..moe.num_experts)
                    .map(|e| {
                        self.swiglu(&Place::swiglu_prefix(l, Some(e)), h, moe.intermediate_size)
                    })
                    .collect::<Result<_, _>>()?;
                Mlp::Moe(Moe {
                    router,
                    experts,
                    top_k: moe.top_k,
                    norm_topk_prob: moe.norm_topk_prob,
                })
            }
            None => {
                Mlp::Dense(self.swiglu(&Place::swiglu_prefix(l, None), h, cfg.intermediate_size)?)
            }
        };
        Ok(Layer {
            input_norm: norm(Place::InputNorm(l), h)?,
            post_attention_norm: norm(Place::PostAttentionNorm(l), h)?,
            q_proj: attention(Proj::Q, cfg.q_size(), h)?,
            k_proj: attention(Proj::K, cfg.kv_size(), h)?,
            v_proj: attention(Proj::V, cfg.kv_size(), h)?,
            o_proj: attention(Proj::O, h, cfg.q_size())?,
            q_norm: qk_norm(Place::QNorm(l))?,
            k_norm: qk_norm(Place::KNorm(l))?,
            mlp,
        })
    }
}

/// Builds the model from `src` with every linear layer in its recipe format.
pub fn build_model(
    cfg: ModelConfig,
    src: WeightSource<'_>,
    recipe: &Recipe,
) -> Result<Model, LoadError> {
    let b = Builder {
        src,
        recipe,
        num_layers: cfg.num_layers,
    };
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let embed = b
        .src
        .dense(&Place::Embedding.name(), v, h, DummyInit::FanIn(h))?;
    let layers = (0..cfg.num_layers)
        .map(|l| {
            let layer = b.layer(&cfg, l);
            // What the layer took from the mapped file is copied: its pages may leave the
            // resident set (the whole checkpoint would otherwise count once more).
            if let WeightSource::Checkpoint { ckpt, .. } = &b.src {
                ckpt.release_pages();
            }
            layer
        })
        .collect::<Result<Vec<_>, _>>()?;
    let norm = b.src.vector(&Place::FinalNorm.name(), h, DummyInit::Ones)?;
    // Tied embeddings (or a checkpoint without lm_head) reuse the embedding matrix.
    let lm_head = if cfg.tie_word_embeddings
        || (!matches!(b.src, WeightSource::Dummy { .. }) && !b.src.contains("lm_head.weight"))
    {
        make_linear(embed.clone(), v, h, &TensorFormat::BF16, None)
    } else {
        make_linear(
            b.src.dense("lm_head.weight", v, h, DummyInit::FanIn(h))?,
            v,
            h,
            &TensorFormat::BF16,
            None,
        )
    };
    Ok(Model::new(cfg, embed, layers, norm, lm_head))
}

/// A checkpoint opened for serving: its config, the recipe its layers are served in and its
/// block-FP8 block size. Shared by the CPU loader and the CUDA device loader.
pub struct ServingCheckpoint {
    pub ckpt: Checkpoint,
    pub config: ModelConfig,
    pub recipe: Recipe,
    /// Some for a DeepSeek-style block-FP8 checkpoint: `weight_block_size` (rows, cols).
    pub fp8_block: Option<(usize, usize)>,
}

/// Opens a Hugging Face model directory (memory-mapped; no tensor is read yet) and settles
/// the recipe: `recipe`, else the one `lockstep convert` recorded, then `--quantization`.
pub fn open_serving_checkpoint(
    dir: &Path,
    quantization: Option<Quantization>,
    recipe: Option<Recipe>,
) -> Result<ServingCheckpoint, LoadError> {
    let ckpt = Checkpoint::open(dir)?;
    let raw = ckpt
        .config()?
        .ok_or_else(|| tensor_err("config.json", format!("missing in {}", dir.display())))?;
    // A checkpoint written by `lockstep convert` records the recipe it was made with.
    let recorded = dir.join("lockstep_recipe.yaml");
    let recipe = match recipe {
        Some(r) => Some(r),
        None if recorded.exists() => {
            Some(Recipe::from_file(&recorded).map_err(|e| tensor_err("lockstep_recipe.yaml", e))?)
        }
        None => None,
    };
    let stored = detect_quantization(&raw);
    let recipe = serving_recipe(quantization, stored, recipe)?;
    let fp8_block = (stored == Some(Quantization::Fp8)).then(|| {
        let b = raw["quantization_config"]["weight_block_size"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        (
            b.first().and_then(|v| v.as_u64()).unwrap_or(128) as usize,
            b.get(1).and_then(|v| v.as_u64()).unwrap_or(128) as usize,
        )
    });
    let config = ModelConfig::from_json(raw)?;
    Ok(ServingCheckpoint {
        ckpt,
        config,
        recipe,
        fp8_block,
    })
}

/// Loads a Hugging Face model directory for serving.
pub fn load_model(
    dir: &Path,
    quantization: Option<Quantization>,
    recipe: Option<Recipe>,
) -> Result<(Model, Recipe), LoadError> {
    let s = open_serving_checkpoint(dir, quantization, recipe)?;
    let model = build_model(
        s.config,
        WeightSource::Checkpoint {
            ckpt: &s.ckpt,
            fp8_block: s.fp8_block,
        },
        &s.recipe,
    )?;
    Ok((model, s.recipe))
}

/// A model with deterministic dummy weights (`--load-format dummy`, the embedded default).
pub fn dummy_model(cfg: ModelConfig, recipe: &Recipe, seed: u64) -> Result<Model, LoadError> {
    build_model(cfg, WeightSource::Dummy { seed }, recipe)
}
