//! The model's weights by checkpoint name: what a live weight update may replace, and the
//! replacement itself (pointer swaps on the engine thread, built and validated elsewhere).

use std::collections::BTreeMap;

use super::{Mlp, Model};
use crate::backend::cpu::linear::{make_linear, DenseWeight};
use crate::backend::Linear;
use crate::quant::{Format, TensorFormat};

/// What a checkpoint tensor name holds in the served model.
#[derive(Clone, Debug, PartialEq)]
pub enum SlotShape {
    /// A linear layer's `weight` `[rows, cols]`, stored in `format`.
    Linear {
        rows: usize,
        cols: usize,
        format: Format,
    },
    /// A norm weight.
    Vector { len: usize },
    /// The token embedding `[vocab, hidden]`.
    Embedding { rows: usize, cols: usize },
}

/// A new value for one slot.
pub enum Replacement {
    Linear(Box<dyn Linear>),
    Vector(Vec<f32>),
    Embedding(DenseWeight),
}

enum SlotMut<'a> {
    Linear(&'a mut Box<dyn Linear>),
    Vector(&'a mut Vec<f32>),
    Embedding(&'a mut DenseWeight),
}

impl Model {
    fn slots_mut(&mut self) -> Vec<(String, SlotMut<'_>)> {
        let mut out: Vec<(String, SlotMut<'_>)> = Vec::new();
        out.push((
            "model.embed_tokens.weight".into(),
            SlotMut::Embedding(&mut self.embed_tokens),
        ));
        out.push(("model.norm.weight".into(), SlotMut::Vector(&mut self.norm)));
        if !self.config.tie_word_embeddings {
            out.push(("lm_head.weight".into(), SlotMut::Linear(&mut self.lm_head)));
        }
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{l}");
            out.push((
                format!("{p}.input_layernorm.weight"),
                SlotMut::Vector(&mut layer.input_norm),
            ));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                SlotMut::Vector(&mut layer.post_attention_norm),
            ));
            for (name, lin) in [
                ("q_proj", &mut layer.q_proj),
                ("k_proj", &mut layer.k_proj),
                ("v_proj", &mut layer.v_proj),
                ("o_proj", &mut layer.o_proj),
            ] {
                out.push((format!("{p}.self_attn.{name}.weight"), SlotMut::Linear(lin)));
            }
            if let Some(n) = layer.q_norm.as_mut() {
                out.push((format!("{p}.self_attn.q_norm.weight"), SlotMut::Vector(n)));
            }
            if let Some(n) = layer.k_norm.as_mut() {
                out.push((format!("{p}.self_attn.k_norm.weight"), SlotMut::Vector(n)));
            }
            match &mut layer.mlp {
                Mlp::Dense(m) => {
                    out.push((
                        format!("{p}.mlp.gate_proj.weight"),
                        SlotMut::Linear(&mut m.gate),
                    ));
                    out.push((
                        format!("{p}.mlp.up_proj.weight"),
                        SlotMut::Linear(&mut m.up),
                    ));
                    out.push((
                        format!("{p}.mlp.down_proj.weight"),
                        SlotMut::Linear(&mut m.down),
                    ));
                }
                Mlp::Moe(moe) => {
                    out.push((
                        format!("{p}.mlp.gate.weight"),
                        SlotMut::Linear(&mut moe.router),
                    ));
                    for (e, ex) in moe.experts.iter_mut().enumerate() {
                        out.push((
                            format!("{p}.mlp.experts.{e}.gate_proj.weight"),
                            SlotMut::Linear(&mut ex.gate),
                        ));
                        out.push((
                            format!("{p}.mlp.experts.{e}.up_proj.weight"),
                            SlotMut::Linear(&mut ex.up),
                        ));
                        out.push((
                            format!("{p}.mlp.experts.{e}.down_proj.weight"),
                            SlotMut::Linear(&mut ex.down),
                        ));
                    }
                }
            }
        }
        out
    }

    /// Every replaceable tensor by its checkpoint name.
    pub fn slot_shapes(&mut self) -> BTreeMap<String, SlotShape> {
        let hidden = self.config.hidden_size;
        self.slots_mut()
            .into_iter()
            .map(|(name, slot)| {
                let shape = match slot {
                    SlotMut::Linear(l) => SlotShape::Linear {
                        rows: l.out_features(),
                        cols: l.in_features(),
                        format: l.format(),
                    },
                    SlotMut::Vector(v) => SlotShape::Vector { len: v.len() },
                    SlotMut::Embedding(e) => SlotShape::Embedding {
                        rows: e.len() / hidden,
                        cols: hidden,
                    },
                };
                (name, shape)
            })
            .collect()
    }

    /// Every replaceable tensor's values by checkpoint name (linear layers dequantized).
    pub fn slot_values(&mut self) -> BTreeMap<String, Vec<f32>> {
        self.slots_mut()
            .into_iter()
            .map(|(name, slot)| {
                let v = match slot {
                    SlotMut::Linear(l) => l.dequantized_weight(),
                    SlotMut::Vector(v) => v.clone(),
                    SlotMut::Embedding(e) => e.to_f32(),
                };
                (name, v)
            })
            .collect()
    }

    /// Swaps in validated replacements. Callers check names and shapes first
    /// ([`Model::slot_shapes`]); an unknown name is a bug and panics.
    pub fn apply_replacements(&mut self, updates: Vec<(String, Replacement)>) {
        let mut updates: BTreeMap<String, Replacement> = updates.into_iter().collect();
        let mut embedding_changed = false;
        for (name, slot) in self.slots_mut() {
            let Some(r) = updates.remove(&name) else {
                continue;
            };
            match (slot, r) {
                (SlotMut::Linear(dst), Replacement::Linear(new)) => *dst = new,
                (SlotMut::Vector(dst), Replacement::Vector(new)) => *dst = new,
                (SlotMut::Embedding(dst), Replacement::Embedding(new)) => {
                    *dst = new;
                    embedding_changed = true;
                }
                _ => panic!("replacement of the wrong kind for `{name}`"),
            }
        }
        assert!(
            updates.is_empty(),
            "unknown weight names: {:?}",
            updates.keys().collect::<Vec<_>>()
        );
        if embedding_changed && self.config.tie_word_embeddings {
            // Tied: lm_head is the embedding matrix.
            self.lm_head = make_linear(
                self.embed_tokens.clone(),
                self.config.vocab_size,
                self.config.hidden_size,
                &TensorFormat::BF16,
                None,
            );
        }
    }
}
