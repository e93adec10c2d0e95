//! The model's shape, read from a Hugging Face `config.json` (Qwen3-MoE, Qwen3, Llama).

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config.json: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("config.json: architecture {0:?} is not supported (Qwen3MoeForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM)")]
    Architecture(Vec<String>),
    #[error("config.json: {field}: {reason}")]
    Field { field: &'static str, reason: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Qwen3Moe,
    Qwen3,
    Llama,
}

/// RoPE frequency scaling from `rope_scaling`.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.x wavelength-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
}

/// Inverse frequencies of RoPE for `head_dim`, with the config's scaling applied.
pub fn rope_inv_freq(head_dim: usize, theta: f32, scaling: &RopeScaling) -> Vec<f32> {
    let half = head_dim / 2;
    (0..half)
        .map(|i| {
            let base = 1.0 / (theta as f64).powf((2 * i) as f64 / head_dim as f64);
            let f = match *scaling {
                RopeScaling::None => base,
                RopeScaling::Linear { factor } => base / factor as f64,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                } => {
                    let (factor, low, high, orig) = (
                        factor as f64,
                        low_freq_factor as f64,
                        high_freq_factor as f64,
                        original_max_position_embeddings as f64,
                    );
                    let wavelen = 2.0 * std::f64::consts::PI / base;
                    let (low_wavelen, high_wavelen) = (orig / low, orig / high);
                    if wavelen < high_wavelen {
                        base
                    } else if wavelen > low_wavelen {
                        base / factor
                    } else {
                        let smooth = (orig / wavelen - low) / (high - low);
                        (1.0 - smooth) * base / factor + smooth * base
                    }
                }
            };
            f as f32
        })
        .collect()
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default)]
    intermediate_size: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    /// transformers >= 5 folds rope_theta and rope_scaling into one object.
    #[serde(default)]
    rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    max_position_embeddings: Option<usize>,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    /// transformers >= 5 writes `num_local_experts` for Qwen3-MoE.
    #[serde(default, alias = "num_local_experts")]
    num_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    moe_intermediate_size: Option<usize>,
    #[serde(default)]
    norm_topk_prob: Option<bool>,
    #[serde(default)]
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    #[serde(default)]
    eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    attention_bias: Option<bool>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}

/// Mixture-of-experts shape (Qwen3-MoE).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Dense MLP width (Qwen3, Llama, and Qwen3-MoE's `mlp_only_layers`).
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Per-head RMSNorm on q and k (Qwen3).
    pub qk_norm: bool,
    pub moe: Option<MoeConfig>,
    pub eos_token_ids: Vec<u32>,
    /// The raw config.json, kept for /get_model_info and checkpoint detection.
    pub raw: serde_json::Value,
}

impl ModelConfig {
    pub fn from_json(value: serde_json::Value) -> Result<ModelConfig, ConfigError> {
        let raw: RawConfig = serde_json::from_value(value.clone())?;
        let architecture = match raw
            .architectures
            .first()
            .map(String::as_str)
            .or(raw.model_type.as_deref())
        {
            Some("Qwen3MoeForCausalLM" | "qwen3_moe") => Architecture::Qwen3Moe,
            Some("Qwen3ForCausalLM" | "qwen3") => Architecture::Qwen3,
            Some("LlamaForCausalLM" | "llama") => Architecture::Llama,
            _ => return Err(ConfigError::Architecture(raw.architectures)),
        };
        if raw.attention_bias == Some(true) {
            return Err(ConfigError::Field {
                field: "attention_bias",
                reason: "attention biases are not supported".into(),
            });
        }
        let field = |field: &'static str, reason: &str| ConfigError::Field {
            field,
            reason: reason.into(),
        };
        if raw.num_attention_heads == 0 || raw.hidden_size == 0 || raw.num_hidden_layers == 0 {
            return Err(field(
                "num_attention_heads",
                "hidden_size, num_hidden_layers and num_attention_heads must be positive",
            ));
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if num_kv_heads == 0 || raw.num_attention_heads % num_kv_heads != 0 {
            return Err(field(
                "num_key_value_heads",
                "must divide num_attention_heads",
            ));
        }
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads);
        if head_dim % 2 != 0 {
            return Err(field("head_dim", "must be even for RoPE"));
        }
        let moe = match (architecture, raw.num_experts) {
            (Architecture::Qwen3Moe, Some(n)) if n > 0 => {
                let top_k = raw
                    .num_experts_per_tok
                    .ok_or_else(|| field("num_experts_per_tok", "required for Qwen3-MoE"))?;
                if top_k == 0 || top_k > n {
                    return Err(field("num_experts_per_tok", "must be in 1..=num_experts"));
                }
                Some(MoeConfig {
                    num_experts: n,
                    top_k,
                    intermediate_size: raw
                        .moe_intermediate_size
                        .ok_or_else(|| field("moe_intermediate_size", "required for Qwen3-MoE"))?,
                    norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
                    decoder_sparse_step: raw.decoder_sparse_step.unwrap_or(1).max(1),
                    mlp_only_layers: raw.mlp_only_layers.clone(),
                })
            }
            (Architecture::Qwen3Moe, _) => {
                return Err(field("num_experts", "required (> 0) for Qwen3-MoE"))
            }
            _ => None,
        };
        let intermediate_size = raw.intermediate_size.unwrap_or(0);
        if moe.is_none() && intermediate_size == 0 {
            return Err(field("intermediate_size", "required for dense models"));
        }
        Ok(ModelConfig {
            architecture,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            rms_norm_eps: raw.rms_norm_eps as f32,
            rope_theta: raw
                .rope_parameters
                .as_ref()
                .and_then(|p| p.get("rope_theta"))
                .and_then(|t| t.as_f64())
                .unwrap_or(raw.rope_theta) as f32,
            rope_scaling: rope_scaling(raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref()))?,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qk_norm: architecture != Architecture::Llama,
            moe,
            eos_token_ids: token_ids(raw.eos_token_id.as_ref()),
            raw: value,
        })
    }

    /// Whether layer `l` uses the sparse MoE block (Qwen3-MoE's `decoder_sparse_step` and
    /// `mlp_only_layers` rules) or a dense MLP.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| {
            !m.mlp_only_layers.contains(&l) && (l + 1) % m.decoder_sparse_step == 0
        })
    }

    /// Layers whose MLP is a mixture of experts.
    pub fn num_moe_layers(&self) -> usize {
        (0..self.num_layers)
            .filter(|&l| self.is_moe_layer(l))
            .count()
    }

    pub fn q_size(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// RoPE's inverse frequencies for this model.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        rope_inv_freq(self.head_dim, self.rope_theta, &self.rope_scaling)
    }

    /// The shapes the backend ops need.
    pub fn dims(&self) -> crate::backend::Dims {
        crate::backend::Dims {
            hidden: self.hidden_size,
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            vocab: self.vocab_size,
            eps: self.rms_norm_eps,
        }
    }

    pub fn kv_size(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

fn token_ids(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|n| vec![n as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|n| n as u32)
            .collect(),
        _ => vec![],
    }
}

fn rope_scaling(v: Option<&serde_json::Value>) -> Result<RopeScaling, ConfigError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let num = |k: &str, default: Option<f64>| -> Result<f32, ConfigError> {
        v.get(k)
            .and_then(|x| x.as_f64())
            .or(default)
            .map(|x| x as f32)
            .ok_or(ConfigError::Field {
                field: "rope_scaling",
                reason: format!("missing `{k}`"),
            })
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: num("factor", None)?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor", None)?,
            low_freq_factor: num("low_freq_factor", Some(1.0))?,
            high_freq_factor: num("high_freq_factor", Some(4.0))?,
            original_max_position_embeddings: num(
                "original_max_position_embeddings",
                Some(8192.0),
            )?,
        }),
        other => Err(ConfigError::Field {
            field: "rope_scaling",
            reason: format!("rope_type `{other}` is not supported (default, linear, llama3)"),
        }),
    }
}
