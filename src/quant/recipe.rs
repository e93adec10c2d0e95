//! Precision recipes: which format each tensor gets.
//!
//! The YAML schema follows the TransformerEngine/Miles matchers: named `configs`, ordered
//! `matchers` (`type: glob`, `pattern`, `enabled`, `config`; first enabled match wins), plus
//! layer-count exceptions (`num_layers_at_start_in_bf16`, `num_layers_at_end_in_bf16`, an
//! integer or a percentage such as "15%", rounded up) and `extra_high_precision_layers`
//! (names or globs kept BF16). The same recipe object drives convert, serve, push and train.

use serde::Deserialize;

use super::nvfp4::{ErrorMetric, FourOverSix, ScaleGranularity};

#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    #[error("recipe is not valid YAML for the schema: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("matcher `{matcher}`: {reason}")]
    Matcher { matcher: String, reason: String },
    #[error("config `{config}`: {reason}")]
    Config { config: String, reason: String },
    #[error("{field}: {reason}")]
    Field { field: &'static str, reason: String },
}

/// The storage/compute format of one linear layer's weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Bf16,
    Mxfp8,
    Nvfp4,
}

impl Format {
    /// Stored bytes per weight, block scales included (the bandwidth a GEMM must read).
    pub fn bytes_per_element(self) -> f64 {
        match self {
            Format::Bf16 => 2.0,
            Format::Mxfp8 => 1.0 + 1.0 / 32.0,
            Format::Nvfp4 => 0.5 + 1.0 / 16.0,
        }
    }
}

/// Everything needed to quantize one tensor and the activations that meet it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorFormat {
    pub format: Format,
    /// NVFP4 activations: per-token (the default) or per-tensor second-level scales.
    pub activation_scale: ScaleGranularity,
    pub four_over_six: Option<FourOverSix>,
}

impl TensorFormat {
    /// This format if its block tiles a row of `cols` elements, else BF16: widths a format cannot
    /// tile stay high precision (as SGLang and vLLM skip such layers too).
    pub fn fitting(self, cols: usize) -> TensorFormat {
        let block = match self.format {
            Format::Bf16 => return self,
            Format::Mxfp8 => super::MXFP8_BLOCK,
            Format::Nvfp4 => super::NVFP4_BLOCK,
        };
        if cols % block == 0 {
            self
        } else {
            TensorFormat::BF16
        }
    }

    /// These numerics with another storage format.
    pub fn with(self, format: Format) -> TensorFormat {
        TensorFormat { format, ..self }
    }

    pub const BF16: TensorFormat = TensorFormat {
        format: Format::Bf16,
        activation_scale: ScaleGranularity::PerToken,
        four_over_six: None,
    };
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigPayload {
    format: Format,
    #[serde(default)]
    activation_scale: Option<String>,
    #[serde(default)]
    four_over_six: bool,
    #[serde(default)]
    four_over_six_range: Option<f32>,
    #[serde(default)]
    four_over_six_metric: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MatcherPayload {
    #[serde(rename = "type")]
    kind: String,
    pattern: String,
    #[serde(default = "yes")]
    enabled: bool,
    config: String,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum LayerCount {
    Count(usize),
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecipeFile {
    #[serde(default)]
    name: Option<String>,
    configs: serde_yaml::Mapping,
    matchers: serde_yaml::Mapping,
    #[serde(default)]
    num_layers_at_start_in_bf16: Option<LayerCount>,
    #[serde(default)]
    num_layers_at_end_in_bf16: Option<LayerCount>,
    #[serde(default)]
    extra_high_precision_layers: Vec<String>,
}

/// A number of layers, absolute or as a fraction of the model's depth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LayerSpan {
    Layers(usize),
    /// Percent of the layers, rounded up.
    Percent(f64),
}

impl LayerSpan {
    pub fn resolve(self, num_layers: usize) -> usize {
        match self {
            LayerSpan::Layers(n) => n.min(num_layers),
            // Round before ceil so 15% of 20 layers is 3, not 4 from 3.0000000000000004.
            LayerSpan::Percent(p) => {
                (((p * num_layers as f64 / 100.0) * 1e9).round() / 1e9).ceil() as usize
            }
        }
    }
}

#[derive(Clone, Debug)]
struct Matcher {
    name: String,
    pattern: glob::Pattern,
    config: TensorFormat,
}

/// A parsed precision recipe.
#[derive(Clone, Debug)]
pub struct Recipe {
    pub name: String,
    matchers: Vec<Matcher>,
    pub bf16_layers_at_start: LayerSpan,
    pub bf16_layers_at_end: LayerSpan,
    extra_high_precision: Vec<glob::Pattern>,
    /// The YAML it was parsed from, recorded in converted checkpoints.
    pub source: String,
}

/// Parts of the model that stay BF16 whatever a recipe says: they are not linear layers the
/// quantized GEMMs handle (norms, embeddings, router, lm_head).
pub fn always_high_precision(name: &str) -> bool {
    let module = name.strip_suffix(".weight").unwrap_or(name);
    module.ends_with("norm")
        || module.contains("embed_tokens")
        || module.ends_with("lm_head")
        || module.ends_with(".mlp.gate")
        || module.ends_with("shared_expert_gate")
}

/// Layer index from a HF tensor name (`model.layers.N.`...).
pub fn layer_index(name: &str) -> Option<usize> {
    let rest = name.split("layers.").nth(1)?;
    rest.split('.').next()?.parse().ok()
}

impl Recipe {
    pub fn from_yaml(text: &str) -> Result<Recipe, RecipeError> {
        let file: RecipeFile = serde_yaml::from_str(text)?;
        let mut configs = std::collections::HashMap::new();
        for (k, v) in &file.configs {
            let name = yaml_key(k, "configs")?;
            let payload: ConfigPayload =
                serde_yaml::from_value(v.clone()).map_err(|e| RecipeError::Config {
                    config: name.clone(),
                    reason: e.to_string(),
                })?;
            configs.insert(name.clone(), tensor_format(&name, payload)?);
        }
        let mut matchers = Vec::new();
        for (k, v) in &file.matchers {
            let name = yaml_key(k, "matchers")?;
            let m: MatcherPayload =
                serde_yaml::from_value(v.clone()).map_err(|e| RecipeError::Matcher {
                    matcher: name.clone(),
                    reason: e.to_string(),
                })?;
            let err = |reason: String| RecipeError::Matcher {
                matcher: name.clone(),
                reason,
            };
            if m.kind != "glob" {
                return Err(err(format!(
                    "type `{}` is not supported (only `glob`)",
                    m.kind
                )));
            }
            let config = *configs.get(&m.config).ok_or_else(|| {
                err(format!(
                    "config `{}` is not defined under `configs`",
                    m.config
                ))
            })?;
            let pattern = glob::Pattern::new(&m.pattern)
                .map_err(|e| err(format!("pattern `{}`: {e}", m.pattern)))?;
            if m.enabled {
                matchers.push(Matcher {
                    name,
                    pattern,
                    config,
                });
            }
        }
        let extra_high_precision = file
            .extra_high_precision_layers
            .iter()
            .map(|p| {
                glob::Pattern::new(p).map_err(|e| RecipeError::Field {
                    field: "extra_high_precision_layers",
                    reason: format!("`{p}`: {e}"),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Recipe {
            name: file.name.unwrap_or_else(|| "custom".into()),
            matchers,
            bf16_layers_at_start: layer_span(
                file.num_layers_at_start_in_bf16,
                "num_layers_at_start_in_bf16",
            )?,
            bf16_layers_at_end: layer_span(
                file.num_layers_at_end_in_bf16,
                "num_layers_at_end_in_bf16",
            )?,
            extra_high_precision,
            source: text.to_string(),
        })
    }

    pub fn from_file(path: &std::path::Path) -> Result<Recipe, RecipeError> {
        let text = std::fs::read_to_string(path).map_err(|e| RecipeError::Field {
            field: "recipe",
            reason: format!("{}: {e}", path.display()),
        })?;
        Recipe::from_yaml(&text)
    }

    /// The all-BF16 recipe (no matchers).
    pub fn bf16() -> Recipe {
        Recipe::from_yaml(include_str!("../../configs/bf16.yaml"))
            .expect("configs/bf16.yaml parses")
    }

    /// The shipped recipe for a `--quantization` name, if there is one.
    pub fn builtin(name: &str) -> Option<Recipe> {
        let text = match name {
            "bf16" => include_str!("../../configs/bf16.yaml"),
            "mxfp8" => include_str!("../../configs/mxfp8.yaml"),
            "nvfp4" => include_str!("../../configs/nvfp4.yaml"),
            _ => return None,
        };
        Some(Recipe::from_yaml(text).expect("shipped recipes parse"))
    }

    /// The format of tensor `name` (a HF module or weight name) in a model with `num_layers`.
    pub fn format_for(&self, name: &str, num_layers: usize) -> TensorFormat {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        if always_high_precision(module)
            || self.extra_high_precision.iter().any(|p| p.matches(module))
        {
            return TensorFormat::BF16;
        }
        if let Some(layer) = layer_index(module) {
            let start = self.bf16_layers_at_start.resolve(num_layers);
            let end = self.bf16_layers_at_end.resolve(num_layers);
            if layer < start || layer + end >= num_layers {
                return TensorFormat::BF16;
            }
        }
        self.matchers
            .iter()
            .find(|m| m.pattern.matches(module))
            .map_or(TensorFormat::BF16, |m| m.config)
    }

    /// Name of the matcher that decided `name` (for logs and `convert`'s report).
    pub fn matcher_for(&self, name: &str) -> Option<&str> {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        self.matchers
            .iter()
            .find(|m| m.pattern.matches(module))
            .map(|m| m.name.as_str())
    }

    /// A stable 64-bit FNV-1a hash of the recipe text, so a server can refuse a push made
    /// under another recipe.
    pub fn hash(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.source.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{h:016x}")
    }

    /// The distinct low-precision formats this recipe can assign.
    pub fn formats(&self) -> Vec<Format> {
        let mut v: Vec<Format> = self
            .matchers
            .iter()
            .map(|m| m.config.format)
            .filter(|f| *f != Format::Bf16)
            .collect();
        v.dedup();
        v
    }
}

fn yaml_key(k: &serde_yaml::Value, section: &'static str) -> Result<String, RecipeError> {
    k.as_str().map(str::to_string).ok_or(RecipeError::Field {
        field: section,
        reason: format!("key {k:?} is not a string"),
    })
}

fn layer_span(v: Option<LayerCount>, field: &'static str) -> Result<LayerSpan, RecipeError> {
    match v {
        None => Ok(LayerSpan::Layers(0)),
        Some(LayerCount::Count(n)) => Ok(LayerSpan::Layers(n)),
        Some(LayerCount::Text(t)) => {
            let p = t
                .trim()
                .strip_suffix('%')
                .and_then(|p| p.trim().parse::<f64>().ok());
            match p {
                Some(p) if (0.0..=100.0).contains(&p) => Ok(LayerSpan::Percent(p)),
                _ => Err(RecipeError::Field {
                    field,
                    reason: format!("`{t}` is neither a layer count nor a percentage like \"15%\""),
                }),
            }
        }
    }
}

fn tensor_format(name: &str, p: ConfigPayload) -> Result<TensorFormat, RecipeError> {
    let err = |reason: String| RecipeError::Config {
        config: name.to_string(),
        reason,
    };
    let activation_scale = match p.activation_scale.as_deref() {
        None | Some("per_token") => ScaleGranularity::PerToken,
        Some("per_tensor") => ScaleGranularity::PerTensor,
        Some(o) => {
            return Err(err(format!(
                "activation_scale `{o}` (expected per_token or per_tensor)"
            )))
        }
    };
    let four_over_six = if p.four_over_six {
        if p.format != Format::Nvfp4 {
            return Err(err("four_over_six applies to nvfp4 only".into()));
        }
        let e4m3_range = p.four_over_six_range.unwrap_or(256.0);
        if e4m3_range != 256.0 && e4m3_range != 448.0 {
            return Err(err(format!(
                "four_over_six_range {e4m3_range} (expected 256 or 448)"
            )));
        }
        let metric = match p.four_over_six_metric.as_deref() {
            None | Some("abs") => ErrorMetric::Absolute,
            Some("squared") => ErrorMetric::Squared,
            Some(o) => {
                return Err(err(format!(
                    "four_over_six_metric `{o}` (expected abs or squared)"
                )))
            }
        };
        Some(FourOverSix { e4m3_range, metric })
    } else {
        None
    };
    Ok(TensorFormat {
        format: p.format,
        activation_scale,
        four_over_six,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvfp4_recipe_quantizes_routed_experts_only_outside_the_last_15_percent() {
        let r = Recipe::builtin("nvfp4").unwrap();
        let n = 48;
        assert_eq!(
            r.format_for("model.layers.0.mlp.experts.3.gate_proj.weight", n)
                .format,
            Format::Nvfp4
        );
        assert_eq!(
            r.format_for("model.layers.39.mlp.experts.3.down_proj.weight", n)
                .format,
            Format::Nvfp4
        );
        // ceil(0.15 * 48) = 8 -> layers 40..47 stay BF16.
        assert_eq!(
            r.format_for("model.layers.40.mlp.experts.3.down_proj.weight", n)
                .format,
            Format::Bf16
        );
        assert_eq!(
            r.format_for("model.layers.0.self_attn.q_proj.weight", n)
                .format,
            Format::Bf16
        );
        assert_eq!(
            r.format_for("model.layers.0.mlp.gate.weight", n).format,
            Format::Bf16
        );
        assert_eq!(
            r.format_for("model.layers.0.mlp.shared_expert.up_proj.weight", n)
                .format,
            Format::Bf16
        );
        assert_eq!(r.format_for("lm_head.weight", n).format, Format::Bf16);
        assert_eq!(
            r.format_for("model.layers.1.mlp.experts.0.up_proj", n)
                .activation_scale,
            ScaleGranularity::PerToken
        );
    }

    #[test]
    fn mxfp8_recipe_covers_attention_and_all_experts() {
        let r = Recipe::builtin("mxfp8").unwrap();
        for name in [
            "model.layers.5.self_attn.o_proj.weight",
            "model.layers.5.mlp.experts.1.up_proj.weight",
            "model.layers.5.mlp.shared_expert.down_proj.weight",
            "model.layers.5.mlp.down_proj.weight",
        ] {
            assert_eq!(r.format_for(name, 10).format, Format::Mxfp8, "{name}");
        }
        for name in [
            "model.layers.5.self_attn.q_norm.weight",
            "model.embed_tokens.weight",
            "model.layers.5.mlp.gate.weight",
            "model.norm.weight",
        ] {
            assert_eq!(r.format_for(name, 10).format, Format::Bf16, "{name}");
        }
    }

    #[test]
    fn first_enabled_match_wins_and_exceptions_apply() {
        let yaml = r#"
configs:
  fp4: {format: nvfp4, four_over_six: true, four_over_six_range: 448, four_over_six_metric: squared}
  fp8: {format: mxfp8}
matchers:
  off: {type: glob, pattern: "*", enabled: false, config: fp8}
  down: {type: glob, pattern: "*.experts.*.down_proj", config: fp8}
  experts: {type: glob, pattern: "*.experts.*", config: fp4}
num_layers_at_start_in_bf16: 1
num_layers_at_end_in_bf16: "25%"
extra_high_precision_layers: ["model.layers.2.mlp.experts.7.*"]
"#;
        let r = Recipe::from_yaml(yaml).unwrap();
        let f = |name: &str| r.format_for(name, 8).format;
        assert_eq!(f("model.layers.0.mlp.experts.0.up_proj"), Format::Bf16);
        assert_eq!(f("model.layers.1.mlp.experts.0.up_proj"), Format::Nvfp4);
        assert_eq!(f("model.layers.1.mlp.experts.0.down_proj"), Format::Mxfp8);
        assert_eq!(f("model.layers.2.mlp.experts.7.up_proj"), Format::Bf16);
        assert_eq!(f("model.layers.5.mlp.experts.0.up_proj"), Format::Nvfp4);
        assert_eq!(f("model.layers.6.mlp.experts.0.up_proj"), Format::Bf16);
        assert_eq!(f("model.layers.1.self_attn.q_proj"), Format::Bf16);
        let fos = r
            .format_for("model.layers.1.mlp.experts.0.up_proj", 8)
            .four_over_six
            .unwrap();
        assert_eq!(
            fos,
            FourOverSix {
                e4m3_range: 448.0,
                metric: ErrorMetric::Squared
            }
        );
        assert_eq!(
            r.matcher_for("model.layers.1.mlp.experts.0.down_proj"),
            Some("down")
        );
    }

    #[test]
    fn bad_recipes_name_the_offending_part() {
        let undefined =
            "configs: {a: {format: bf16}}\nmatchers: {m: {type: glob, pattern: '*', config: b}}\n";
        assert!(Recipe::from_yaml(undefined)
            .unwrap_err()
            .to_string()
            .contains("`m`"));
        let regex =
            "configs: {a: {format: bf16}}\nmatchers: {m: {type: regex, pattern: '*', config: a}}\n";
        assert!(Recipe::from_yaml(regex)
            .unwrap_err()
            .to_string()
            .contains("regex"));
        let typo = "configs: {a: {format: bf16, fourover: 1}}\nmatchers: {}\n";
        assert!(Recipe::from_yaml(typo)
            .unwrap_err()
            .to_string()
            .contains("`a`"));
        let pct = "configs: {}\nmatchers: {}\nnum_layers_at_end_in_bf16: lots\n";
        assert!(Recipe::from_yaml(pct)
            .unwrap_err()
            .to_string()
            .contains("num_layers_at_end_in_bf16"));
    }
}
