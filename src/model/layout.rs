//! Every tensor of a model, listed once: its checkpoint name, shape, kind, served format, its
//! place in the model (layer, expert, gate/up half) and its gate/up partner. The slot tables
//! (host and device), the checksums, the trainer's parameter and gradient names, `convert`'s
//! formats and shapes and the gate/up pairing of convert, push and live updates read it
//! instead of restating it.

use super::ModelConfig;
pub use crate::quant::slot::shares_gate_up_scale;
use crate::quant::slot::{Pair, Slot};
use crate::quant::{Recipe, TensorFormat};

/// One of a layer's attention projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proj {
    Q,
    K,
    V,
    O,
}

impl Proj {
    pub const ALL: [Proj; 4] = [Proj::Q, Proj::K, Proj::V, Proj::O];

    fn name(self) -> &'static str {
        match self {
            Proj::Q => "q_proj",
            Proj::K => "k_proj",
            Proj::V => "v_proj",
            Proj::O => "o_proj",
        }
    }
}

/// Which half of a stacked gate/up matrix (gate first, as the device stacks them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Half {
    Gate,
    Up,
}

/// Where a tensor lives in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Place {
    Embedding,
    FinalNorm,
    LmHead,
    InputNorm(usize),
    PostAttentionNorm(usize),
    Attention(usize, Proj),
    QNorm(usize),
    KNorm(usize),
    Router(usize),
    /// Layer, expert (None: the dense MLP), half.
    GateUp(usize, Option<usize>, Half),
    /// Layer, expert (None: the dense MLP).
    Down(usize, Option<usize>),
}

/// What a tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorKind {
    /// The token embedding, `[vocab, hidden]`.
    Embedding,
    /// A norm weight, `[len]`.
    Norm,
    /// A linear layer's weight, `[out, in]`.
    Linear,
}

/// `...layers.{l}.mlp` or `...layers.{l}.mlp.experts.{e}`: a SwiGLU's module prefix.
fn swiglu_prefix(layer: usize, expert: Option<usize>) -> String {
    match expert {
        Some(e) => format!("model.layers.{layer}.mlp.experts.{e}"),
        None => format!("model.layers.{layer}.mlp"),
    }
}

impl Place {
    /// The checkpoint module (`model.layers.3.self_attn.q_proj`); the tensor is
    /// `{module}.weight`.
    pub fn module(&self) -> String {
        match *self {
            Place::Embedding => "model.embed_tokens".into(),
            Place::FinalNorm => "model.norm".into(),
            Place::LmHead => "lm_head".into(),
            Place::InputNorm(l) => format!("model.layers.{l}.input_layernorm"),
            Place::PostAttentionNorm(l) => format!("model.layers.{l}.post_attention_layernorm"),
            Place::Attention(l, p) => format!("model.layers.{l}.self_attn.{}", p.name()),
            Place::QNorm(l) => format!("model.layers.{l}.self_attn.q_norm"),
            Place::KNorm(l) => format!("model.layers.{l}.self_attn.k_norm"),
            Place::Router(l) => format!("model.layers.{l}.mlp.gate"),
            Place::GateUp(l, e, Half::Gate) => format!("{}.gate_proj", swiglu_prefix(l, e)),
            Place::GateUp(l, e, Half::Up) => format!("{}.up_proj", swiglu_prefix(l, e)),
            Place::Down(l, e) => format!("{}.down_proj", swiglu_prefix(l, e)),
        }
    }

    /// A SwiGLU's module prefix (`...mlp` or `...mlp.experts.{e}`) for its gate/up/down.
    pub fn swiglu_prefix(layer: usize, expert: Option<usize>) -> String {
        swiglu_prefix(layer, expert)
    }

    /// The checkpoint tensor name (`{module}.weight`).
    pub fn name(&self) -> String {
        format!("{}.weight", self.module())
    }

    /// A linear layer whose format the recipe decides (the router, lm_head, embeddings and
    /// norms are never quantized).
    pub fn quantizable(&self) -> bool {
        matches!(
            self,
            Place::Attention(..) | Place::GateUp(..) | Place::Down(..)
        )
    }
}

/// One tensor of the model.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub place: Place,
    /// Checkpoint name (`{module}.weight`).
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: TensorKind,
    /// The format it is served in (BF16 stands for high precision: BF16 or F32 as stored).
    pub format: TensorFormat,
}

impl TensorSpec {
    /// The checkpoint module (the name without `.weight`).
    pub fn module(&self) -> &str {
        self.name.strip_suffix(".weight").unwrap_or(&self.name)
    }
}

/// Every tensor of a model under a recipe, in the order the model holds them: embedding,
/// final norm, lm_head (untied), then each layer's norms, attention, q/k norms, router and
/// SwiGLU(s) with gate, up, down per expert.
#[derive(Clone, Debug)]
pub struct ModelLayout {
    pub tensors: Vec<TensorSpec>,
}

/// Every tensor's place, in the layout's order (no recipe needed).
pub fn places(cfg: &ModelConfig) -> Vec<Place> {
    let mut out = vec![Place::Embedding, Place::FinalNorm];
    if !cfg.tie_word_embeddings {
        out.push(Place::LmHead);
    }
    for l in 0..cfg.num_layers {
        out.push(Place::InputNorm(l));
        out.push(Place::PostAttentionNorm(l));
        out.extend(Proj::ALL.map(|p| Place::Attention(l, p)));
        if cfg.qk_norm {
            out.extend([Place::QNorm(l), Place::KNorm(l)]);
        }
        let experts: Vec<Option<usize>> = match cfg.moe.as_ref().filter(|_| cfg.is_moe_layer(l)) {
            Some(moe) => {
                out.push(Place::Router(l));
                (0..moe.num_experts).map(Some).collect()
            }
            None => vec![None],
        };
        for e in experts {
            out.push(Place::GateUp(l, e, Half::Gate));
            out.push(Place::GateUp(l, e, Half::Up));
            out.push(Place::Down(l, e));
        }
    }
    out
}

/// The place of checkpoint tensor `name` in a model of `cfg` (None: no such tensor), without
/// listing every place: what [`places`] would name so, found by reading the name.
pub fn place_of(cfg: &ModelConfig, name: &str) -> Option<Place> {
    // A layer or expert number as `format!` writes it (no sign, no leading zero).
    fn index(s: &str) -> Option<usize> {
        let canonical = !s.is_empty()
            && s.bytes().all(|b| b.is_ascii_digit())
            && (s == "0" || !s.starts_with('0'));
        canonical.then(|| s.parse().ok()).flatten()
    }
    fn swiglu(l: usize, e: Option<usize>, proj: &str) -> Option<Place> {
        match proj {
            "gate_proj" => Some(Place::GateUp(l, e, Half::Gate)),
            "up_proj" => Some(Place::GateUp(l, e, Half::Up)),
            "down_proj" => Some(Place::Down(l, e)),
            _ => None,
        }
    }
    let place = match name.strip_suffix(".weight")? {
        "model.embed_tokens" => Place::Embedding,
        "model.norm" => Place::FinalNorm,
        "lm_head" => Place::LmHead,
        module => {
            let (l, rest) = module.strip_prefix("model.layers.")?.split_once('.')?;
            let l = index(l)?;
            match rest {
                "input_layernorm" => Place::InputNorm(l),
                "post_attention_layernorm" => Place::PostAttentionNorm(l),
                "self_attn.q_norm" => Place::QNorm(l),
                "self_attn.k_norm" => Place::KNorm(l),
                "mlp.gate" => Place::Router(l),
                _ => match rest.strip_prefix("self_attn.") {
                    Some(proj) => {
                        Place::Attention(l, *Proj::ALL.iter().find(|p| p.name() == proj)?)
                    }
                    None => {
                        let mlp = rest.strip_prefix("mlp.")?;
                        match mlp.strip_prefix("experts.") {
                            Some(expert) => {
                                let (e, proj) = expert.split_once('.')?;
                                swiglu(l, Some(index(e)?), proj)?
                            }
                            None => swiglu(l, None, mlp)?,
                        }
                    }
                },
            }
        }
    };
    // The rules `places` lists by.
    let layer_ok = |l: usize| l < cfg.num_layers;
    let experts = |l: usize| {
        cfg.moe
            .as_ref()
            .filter(|_| cfg.is_moe_layer(l))
            .map(|m| m.num_experts)
    };
    let expert_ok = |l: usize, e: Option<usize>| {
        layer_ok(l)
            && match (experts(l), e) {
                (Some(n), Some(e)) => e < n,
                (None, None) => true,
                _ => false,
            }
    };
    let exists = match place {
        Place::Embedding | Place::FinalNorm => true,
        Place::LmHead => !cfg.tie_word_embeddings,
        Place::InputNorm(l) | Place::PostAttentionNorm(l) | Place::Attention(l, _) => layer_ok(l),
        Place::QNorm(l) | Place::KNorm(l) => cfg.qk_norm && layer_ok(l),
        Place::Router(l) => layer_ok(l) && experts(l).is_some(),
        Place::GateUp(l, e, _) | Place::Down(l, e) => expert_ok(l, e),
    };
    exists.then_some(place)
}

impl ModelLayout {
    pub fn of(cfg: &ModelConfig, recipe: &Recipe) -> ModelLayout {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let moe = cfg.moe.as_ref();
        let inter = |e: Option<usize>| match e {
            Some(_) => moe.map_or(0, |m| m.intermediate_size),
            None => cfg.intermediate_size,
        };
        let tensors = places(cfg)
            .into_iter()
            .map(|place| {
                let (kind, shape) = match place {
                    Place::Embedding => (TensorKind::Embedding, vec![v, h]),
                    Place::FinalNorm | Place::InputNorm(_) | Place::PostAttentionNorm(_) => {
                        (TensorKind::Norm, vec![h])
                    }
                    Place::QNorm(_) | Place::KNorm(_) => (TensorKind::Norm, vec![cfg.head_dim]),
                    Place::LmHead => (TensorKind::Linear, vec![v, h]),
                    Place::Attention(_, Proj::Q) => (TensorKind::Linear, vec![cfg.q_size(), h]),
                    Place::Attention(_, Proj::K | Proj::V) => {
                        (TensorKind::Linear, vec![cfg.kv_size(), h])
                    }
                    Place::Attention(_, Proj::O) => (TensorKind::Linear, vec![h, cfg.q_size()]),
                    Place::Router(_) => (
                        TensorKind::Linear,
                        vec![moe.map_or(0, |m| m.num_experts), h],
                    ),
                    Place::GateUp(_, e, _) => (TensorKind::Linear, vec![inter(e), h]),
                    Place::Down(_, e) => (TensorKind::Linear, vec![h, inter(e)]),
                };
                let name = place.name();
                let format = match place.quantizable() {
                    true => recipe
                        .format_for(&place.module(), cfg.num_layers)
                        .fitting(shape[1]),
                    false => TensorFormat::BF16,
                };
                TensorSpec {
                    place,
                    name,
                    shape,
                    kind,
                    format,
                }
            })
            .collect();
        ModelLayout { tensors }
    }

    pub fn get(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The NVFP4 gate/up pair whose second-level scale this tensor shares, if any
    /// (`quant::slot` holds the rule).
    pub fn pair(&self, spec: &TensorSpec) -> Option<Pair> {
        let Place::GateUp(l, e, _) = spec.place else {
            return None;
        };
        let half = |h| {
            self.tensors
                .iter()
                .find(|t| t.place == Place::GateUp(l, e, h))
        };
        let (gate, up) = (half(Half::Gate)?, half(Half::Up)?);
        Pair::of(gate.module(), gate.format, up.module(), up.format.format)
    }

    /// The tensor as a `quant::slot::Slot` (what prepares its stored bytes).
    pub fn slot(&self, spec: &TensorSpec) -> Slot {
        Slot::new(
            spec.module(),
            spec.shape.clone(),
            spec.format,
            self.pair(spec),
        )
    }
}

/// The gate/up pair (`...gate_proj`, `...up_proj`) `module` is a half of, by module name: for
/// names that come from outside (a checkpoint, an update) before any layout check.
pub fn gate_up_pair(module: &str) -> Option<(String, String)> {
    let prefix = (module.strip_suffix("gate_proj")).or_else(|| module.strip_suffix("up_proj"))?;
    Some((format!("{prefix}gate_proj"), format!("{prefix}up_proj")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Format;

    fn config(tie: bool) -> ModelConfig {
        let mut raw: serde_json::Value =
            serde_json::from_str(crate::serve::EMBEDDED_CONFIG).unwrap();
        raw["tie_word_embeddings"] = tie.into();
        ModelConfig::from_json(raw).unwrap()
    }

    /// `place_of` finds every place by its name, in tied and untied, MoE, dense and mixed
    /// models, and nothing else: names a layout does not hold, numbers out of range or not
    /// written as `format!` writes them, and a dense MLP's names in a MoE layer (and back).
    #[test]
    fn every_place_is_found_by_its_name_and_nothing_else() {
        let mut mixed = config(true);
        if let Some(m) = mixed.moe.as_mut() {
            m.mlp_only_layers = vec![0];
        }
        let mut dense = config(false);
        dense.moe = None;
        dense.qk_norm = false;
        for cfg in [config(false), config(true), mixed, dense] {
            let all = places(&cfg);
            for p in &all {
                assert_eq!(place_of(&cfg, &p.name()), Some(*p), "{}", p.name());
            }
            let last = cfg.num_layers;
            let mut absent = vec![
                "model.embed_tokens".to_string(),
                "model.embed_tokens.weight_scale".into(),
                format!("model.layers.{last}.input_layernorm.weight"),
                "model.layers.01.input_layernorm.weight".into(),
                "model.layers.+1.input_layernorm.weight".into(),
                "model.layers..input_layernorm.weight".into(),
                "model.layers.0.self_attn.x_proj.weight".into(),
                "model.layers.0.mlp.experts.00.up_proj.weight".into(),
                "model.layers.0.mlp.experts.0.side_proj.weight".into(),
                "lm_head.weight.weight".into(),
            ];
            for l in 0..cfg.num_layers {
                let moe = cfg.moe.as_ref().filter(|_| cfg.is_moe_layer(l));
                absent.push(match moe {
                    Some(m) => format!(
                        "model.layers.{l}.mlp.experts.{}.up_proj.weight",
                        m.num_experts
                    ),
                    None => format!("model.layers.{l}.mlp.experts.0.up_proj.weight"),
                });
                if moe.is_some() {
                    absent.push(format!("model.layers.{l}.mlp.up_proj.weight"));
                } else {
                    absent.push(format!("model.layers.{l}.mlp.gate.weight"));
                }
            }
            if cfg.tie_word_embeddings {
                absent.push("lm_head.weight".into());
            }
            if !cfg.qk_norm {
                absent.push("model.layers.0.self_attn.q_norm.weight".into());
            }
            for name in absent {
                assert_eq!(place_of(&cfg, &name), None, "{name}");
            }
        }
    }

    #[test]
    fn names_shapes_and_formats_follow_the_config_and_recipe() {
        let cfg = config(false);
        let moe = cfg.moe.clone().unwrap();
        let nvfp4 = ModelLayout::of(&cfg, &Recipe::builtin("nvfp4").unwrap());
        // Each name once; per MoE layer a router and three tensors per expert.
        let mut names: Vec<&str> = nvfp4.tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), nvfp4.tensors.len());
        let per_layer = 2 + 4 + 2 * cfg.qk_norm as usize + 1 + 3 * moe.num_experts;
        assert_eq!(nvfp4.tensors.len(), 3 + cfg.num_layers * per_layer);
        let up = nvfp4
            .get("model.layers.1.mlp.experts.2.up_proj.weight")
            .unwrap();
        assert_eq!(up.shape, vec![moe.intermediate_size, cfg.hidden_size]);
        assert_eq!(up.place, Place::GateUp(1, Some(2), Half::Up));
        assert_eq!(up.format.format, Format::Nvfp4);
        let router = nvfp4.get("model.layers.1.mlp.gate.weight").unwrap();
        assert_eq!(
            router.format.format,
            Format::Bf16,
            "routers stay high precision"
        );
        let pair = nvfp4.slot(up).pair.unwrap();
        assert_eq!(pair.gate, "model.layers.1.mlp.experts.2.gate_proj");
        // BF16 experts share nothing; a tied model has no lm_head.
        let bf16 = ModelLayout::of(&cfg, &Recipe::bf16());
        assert!(bf16.pair(bf16.get(&up.name).unwrap()).is_none());
        assert!(nvfp4.get("lm_head.weight").is_some());
        assert!(ModelLayout::of(&config(true), &Recipe::bf16())
            .get("lm_head.weight")
            .is_none());
    }

    #[test]
    fn pairs_are_gate_and_up_only() {
        let pair = |g: &str, u: &str| Some((g.to_string(), u.to_string()));
        let (g, u) = ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj");
        assert_eq!(gate_up_pair(u), pair(g, u));
        assert_eq!(gate_up_pair(g), pair(g, u));
        assert_eq!(gate_up_pair("model.layers.0.mlp.down_proj"), None);
    }
}
