//! The model's weights by checkpoint name: what a live weight update may replace, and the
//! replacement itself (pointer swaps on the engine thread, built and validated elsewhere).

use std::collections::BTreeMap;

use rayon::prelude::*;

use super::checksum::WeightsChecksum;
use super::layout::{gate_up_pair, Half, Place, Proj};
use super::store::{SlotParts, StoreError, WeightStore};
use super::{Mlp, Model, SwiGlu};
use crate::backend::cpu::linear::{linear_from, make_linear, DenseWeight};
use crate::backend::Linear;
use crate::checkpoint::CheckpointPart;
use crate::quant::slot::{dense_part, Pair, Slot, Stored};
use crate::quant::{Format, Recipe, TensorFormat};

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

impl SlotShape {
    /// The dense shape and the stored format.
    pub fn dims(&self) -> (Vec<usize>, Format) {
        match *self {
            SlotShape::Linear { rows, cols, format } => (vec![rows, cols], format),
            SlotShape::Vector { len } => (vec![len], Format::Bf16),
            SlotShape::Embedding { rows, cols } => (vec![rows, cols], Format::Bf16),
        }
    }
}

/// The slot of `module` as a model with slot table `slots`, built with `recipe`, holds it:
/// shape and format from the table, the recipe's numerics, and its NVFP4 gate/up pair.
pub fn served_slot(
    slots: &BTreeMap<String, SlotShape>,
    recipe: &Recipe,
    num_layers: usize,
    module: &str,
) -> Option<Slot> {
    let served = |m: &str| {
        let (shape, format) = slots.get(&format!("{m}.weight"))?.dims();
        // The recipe's numerics as the layout gives them, with the format the slot holds.
        let numerics = recipe.format_for(m, num_layers);
        let cols = shape[shape.len() - 1];
        Some((shape, numerics.fitting(cols).with(format)))
    };
    let (shape, format) = served(module)?;
    let pair = gate_up_pair(module)
        .and_then(|(g, u)| Pair::of(&g, served(&g)?.1, &u, served(&u)?.1.format));
    Some(Slot::new(module, shape, format, pair))
}

/// A new value for one slot.
pub enum Replacement {
    Linear(Box<dyn Linear>),
    Vector(Vec<f32>),
    Embedding(DenseWeight),
    /// BF16 bytes already in device memory (a colocated trainer's tensor opened through CUDA
    /// IPC), copied device to device into a BF16 slot of a CUDA store; a host store refuses it.
    Device(DeviceTensor),
    /// A quantized linear slot's stored bytes in device memory (quantized there from a dense
    /// tensor), copied device to device into a slot of its format of a CUDA store.
    DeviceQuantized(DeviceQuantized),
}

/// MXFP8 or NVFP4 stored bytes of a `[rows, cols]` linear slot in device memory, each part
/// hashed where it lies.
pub struct DeviceQuantized {
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
    /// The values (`weight`): FP8 codes, or packed E2M1 pairs.
    pub data: DeviceTensor,
    /// The block scales (`weight_scale_inv` / `weight_scale`).
    pub scales: DeviceTensor,
    /// NVFP4's second-level scale (`weight_scale_2`); unused for MXFP8.
    pub second_level: f32,
}

impl DeviceQuantized {
    /// The checksum entries of its checkpoint parts (`module.suffix`): the device hashes of
    /// the values and block scales, the host's of the scalars.
    pub fn checksum_entries(&self, module: &str) -> Vec<(String, u64)> {
        let none = std::borrow::Cow::Borrowed(&[][..]);
        let parts = crate::quant::slot::quantized_parts(
            self.format,
            self.rows,
            self.cols,
            [none.clone(), none],
            Some(self.second_level),
        );
        parts
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let hash = match i {
                    0 => self.data.hash,
                    1 => self.scales.hash,
                    _ => xxhash_rust::xxh3::xxh3_64(&p.data),
                };
                (format!("{module}.{}", p.suffix), hash)
            })
            .collect()
    }
}

/// A tensor's bytes in device memory, in checkpoint layout, with its xxh3_64 (hashed where it
/// lies, so the commit's checksum needs no copy back). A clone shares the memory.
#[derive(Clone)]
pub struct DeviceTensor {
    /// The first byte, in the CUDA context of the store it is written into.
    pub ptr: u64,
    pub bytes: usize,
    /// Its xxh3_64, the checksum's entry for the slot.
    pub hash: u64,
    /// Keeps the memory mapped (and its producer's reference held) while the tensor lives.
    pub owner: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

impl Replacement {
    /// The replacement for a slot of `shape` holding `stored` (`fmt`: the activations'
    /// numerics). A stored form of the wrong kind becomes one the store refuses, by name.
    pub fn of(shape: &SlotShape, stored: Stored, fmt: &TensorFormat) -> Replacement {
        match (shape, stored) {
            (SlotShape::Vector { .. }, Stored::Dense { values, .. }) => {
                Replacement::Vector(values.to_f32())
            }
            (SlotShape::Embedding { .. }, Stored::Dense { values, .. }) => {
                Replacement::Embedding(values)
            }
            (_, stored) => Replacement::Linear(linear_from(stored, fmt)),
        }
    }

    /// Whether its bytes are in device memory (hashed there).
    pub fn on_device(&self) -> bool {
        matches!(
            self,
            Replacement::Device(_) | Replacement::DeviceQuantized(_)
        )
    }

    /// The replacement in checkpoint layout (what the slot will hold after commit).
    pub fn checkpoint_parts(&self, hidden: usize) -> Vec<CheckpointPart<'_>> {
        match self {
            Replacement::Linear(l) => l.checkpoint_parts(),
            Replacement::Vector(v) => vec![CheckpointPart::from_f32("weight", vec![v.len()], v)],
            Replacement::Embedding(e) => dense_parts(e, hidden),
            // Hashed where they lie: see `replacements_checksum`.
            Replacement::Device(_) | Replacement::DeviceQuantized(_) => vec![],
        }
    }
}

fn dense_parts(w: &DenseWeight, cols: usize) -> Vec<CheckpointPart<'_>> {
    vec![dense_part(vec![w.len() / cols, cols], w)]
}

/// The checksum entries of validated replacements (names from the slot table).
pub fn replacements_checksum(updates: &[(String, Replacement)], hidden: usize) -> WeightsChecksum {
    let mut sum = WeightsChecksum::of_parts(
        updates
            .iter()
            .filter(|(_, r)| !r.on_device())
            .map(|(name, r)| (module_of(name).to_string(), r.checkpoint_parts(hidden)))
            .collect(),
    );
    for (name, r) in updates {
        match r {
            // A device tensor is the slot's one checkpoint part (`weight`).
            Replacement::Device(DeviceTensor { hash, .. }) => {
                sum.tensors
                    .insert(format!("{}.weight", module_of(name)), *hash);
            }
            Replacement::DeviceQuantized(q) => {
                sum.tensors.extend(q.checksum_entries(module_of(name)));
            }
            _ => {}
        }
    }
    sum
}

/// `x.weight` -> `x`: the parts of a slot are named `x.<suffix>`.
fn module_of(slot: &str) -> &str {
    slot.strip_suffix(".weight").unwrap_or(slot)
}

enum SlotMut<'a> {
    Linear(&'a mut Box<dyn Linear>),
    Vector(&'a mut Vec<f32>),
    Embedding(&'a mut DenseWeight),
}

impl Model {
    /// Every slot, in the layout's order ([`super::layout::places`]) and by its names.
    fn slots_mut(&mut self) -> Vec<(String, SlotMut<'_>)> {
        let mut out: Vec<(Place, SlotMut<'_>)> = vec![
            (Place::Embedding, SlotMut::Embedding(&mut self.embed_tokens)),
            (Place::FinalNorm, SlotMut::Vector(&mut self.norm)),
        ];
        if !self.config.tie_word_embeddings {
            out.push((Place::LmHead, SlotMut::Linear(&mut self.lm_head)));
        }
        for (l, layer) in self.layers.iter_mut().enumerate() {
            out.push((Place::InputNorm(l), SlotMut::Vector(&mut layer.input_norm)));
            out.push((
                Place::PostAttentionNorm(l),
                SlotMut::Vector(&mut layer.post_attention_norm),
            ));
            for (proj, lin) in Proj::ALL.into_iter().zip([
                &mut layer.q_proj,
                &mut layer.k_proj,
                &mut layer.v_proj,
                &mut layer.o_proj,
            ]) {
                out.push((Place::Attention(l, proj), SlotMut::Linear(lin)));
            }
            if let (Some(q), Some(k)) = (layer.q_norm.as_mut(), layer.k_norm.as_mut()) {
                out.push((Place::QNorm(l), SlotMut::Vector(q)));
                out.push((Place::KNorm(l), SlotMut::Vector(k)));
            }
            fn swiglu(l: usize, e: Option<usize>, m: &mut SwiGlu) -> [(Place, SlotMut<'_>); 3] {
                [
                    (
                        Place::GateUp(l, e, Half::Gate),
                        SlotMut::Linear(&mut m.gate),
                    ),
                    (Place::GateUp(l, e, Half::Up), SlotMut::Linear(&mut m.up)),
                    (Place::Down(l, e), SlotMut::Linear(&mut m.down)),
                ]
            }
            match &mut layer.mlp {
                Mlp::Dense(m) => out.extend(swiglu(l, None, m)),
                Mlp::Moe(moe) => {
                    out.push((Place::Router(l), SlotMut::Linear(&mut moe.router)));
                    for (e, ex) in moe.experts.iter_mut().enumerate() {
                        out.extend(swiglu(l, Some(e), ex));
                    }
                }
            }
        }
        out.into_iter().map(|(p, s)| (p.name(), s)).collect()
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

    /// Every tensor the model holds, hashed in checkpoint layout.
    pub fn weights_checksum(&mut self) -> WeightsChecksum {
        WeightsChecksum::of_parts(self.checkpoint_parts())
    }

    /// Every tensor the model holds in checkpoint layout, copied out (what a trainer pushes,
    /// and what a checkpoint of the served weights would hold).
    pub fn checkpoint_tensors(&mut self) -> Vec<(String, crate::checkpoint::OwnedTensor)> {
        self.checkpoint_parts()
            .into_iter()
            .flat_map(|(module, parts)| {
                parts
                    .into_iter()
                    .map(move |p| (format!("{module}.{}", p.suffix), p.to_owned_tensor()))
            })
            .collect()
    }

    fn checkpoint_parts(&mut self) -> Vec<(String, Vec<CheckpointPart<'_>>)> {
        self.checkpoint_parts_where(|_| true)
    }

    /// [`Self::checkpoint_parts`] of the slots whose names `want` takes (only theirs are made).
    fn checkpoint_parts_where(
        &mut self,
        mut want: impl FnMut(&str) -> bool,
    ) -> Vec<(String, Vec<CheckpointPart<'_>>)> {
        let hidden = self.config.hidden_size;
        self.slots_mut()
            .into_iter()
            .filter(|(name, _)| want(name))
            .map(|(name, slot)| {
                let parts = match slot {
                    SlotMut::Linear(l) => shared(l).checkpoint_parts(),
                    SlotMut::Vector(v) => {
                        let v = shared(v);
                        vec![CheckpointPart::from_f32("weight", vec![v.len()], v)]
                    }
                    SlotMut::Embedding(e) => dense_parts(shared(e), hidden),
                };
                (module_of(&name).to_string(), parts)
            })
            .collect()
    }

    /// The whole model as replacements, one per slot (what a whole-model update writes into
    /// another store of the same layout).
    pub fn into_replacements(mut self) -> Vec<(String, Replacement)> {
        let empty = || -> Box<dyn Linear> {
            Box::new(crate::backend::cpu::linear::DenseF32 {
                weight: vec![],
                out_features: 0,
                in_features: 0,
            })
        };
        self.slots_mut()
            .into_iter()
            .map(|(name, slot)| {
                let r = match slot {
                    SlotMut::Linear(l) => Replacement::Linear(std::mem::replace(l, empty())),
                    SlotMut::Vector(v) => Replacement::Vector(std::mem::take(v)),
                    SlotMut::Embedding(e) => {
                        Replacement::Embedding(std::mem::replace(e, DenseWeight::F32(vec![])))
                    }
                };
                (name, r)
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

    /// Writes replacements into the served weights: into the existing buffers where kind,
    /// size and storage match (always, for replacements built from the slot table), else by
    /// swapping a same-shaped value in. Every replacement is checked against its slot first,
    /// so a refused update changes nothing. Returns what is left to free (the replacements
    /// copied from, or the values swapped out), so the caller can drop it off the engine
    /// thread.
    pub fn apply_replacements(
        &mut self,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, StoreError> {
        let mut updates: BTreeMap<String, Replacement> = updates.into_iter().collect();
        let (spent, embedding_changed) = {
            let mut pairs = Vec::with_capacity(updates.len());
            for (name, slot) in self.slots_mut() {
                if let Some(r) = updates.remove(&name) {
                    fits(&name, &slot, &r)?;
                    pairs.push((name, slot, r));
                }
            }
            if !updates.is_empty() {
                return Err(StoreError::UnknownNames(updates.into_keys().collect()));
            }
            let embedding = pairs
                .iter()
                .any(|(_, s, _)| matches!(s, SlotMut::Embedding(_)));
            // Copies of independent slots: spread over the cores (the engine stands still).
            let spent: Vec<Replacement> = pairs
                .into_par_iter()
                .map(|(name, slot, r)| write_slot(&name, slot, r))
                .collect();
            (spent, embedding)
        };
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
        Ok(spent)
    }
}

impl WeightStore for Model {
    fn slot_shapes(&mut self) -> BTreeMap<String, SlotShape> {
        Model::<crate::backend::cpu::Cpu>::slot_shapes(self)
    }

    fn checksum(&mut self) -> Result<WeightsChecksum, StoreError> {
        Ok(self.weights_checksum())
    }

    fn write(
        &mut self,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, StoreError> {
        self.apply_replacements(updates)
    }

    fn parts_of(&mut self, names: &[String]) -> Result<SlotParts, StoreError> {
        let mut want: BTreeMap<&str, &String> = names.iter().map(|n| (module_of(n), n)).collect();
        let out: SlotParts = self
            .checkpoint_parts_where(|name| want.contains_key(module_of(name)))
            .into_iter()
            .filter_map(|(module, parts)| {
                let name = want.remove(module.as_str())?;
                Some((
                    name.clone(),
                    parts.into_iter().map(CheckpointPart::into_owned).collect(),
                ))
            })
            .collect();
        if !want.is_empty() {
            return Err(StoreError::UnknownNames(
                want.into_values().cloned().collect(),
            ));
        }
        Ok(out)
    }
}

/// Checks that `r` has the kind and shape of `slot` (a linear layer also its format).
fn fits(name: &str, slot: &SlotMut<'_>, r: &Replacement) -> Result<(), StoreError> {
    let refuse = |why: &str| Err(StoreError::mismatch(name, why));
    match (slot, r) {
        (SlotMut::Vector(v), Replacement::Vector(n)) if v.len() == n.len() => Ok(()),
        (SlotMut::Embedding(e), Replacement::Embedding(n)) if e.len() == n.len() => Ok(()),
        (SlotMut::Linear(l), Replacement::Linear(n)) => {
            if (l.out_features(), l.in_features()) != (n.out_features(), n.in_features()) {
                refuse("shape differs from the served layer")
            } else if l.format() != n.format() {
                refuse("format differs from the served layer")
            } else {
                Ok(())
            }
        }
        (
            SlotMut::Vector(_) | SlotMut::Embedding(_),
            Replacement::Vector(_) | Replacement::Embedding(_),
        ) => refuse("size differs from the served tensor"),
        (_, Replacement::Device(_) | Replacement::DeviceQuantized(_)) => {
            refuse("a tensor in device memory can only be written into weights on a CUDA device")
        }
        _ => refuse("the wrong kind of tensor"),
    }
}

/// `&mut` -> `&` by move, so what borrows from it may live for the whole of the loan.
fn shared<T: ?Sized>(r: &mut T) -> &T {
    r
}

/// Writes one replacement into its slot (in place when kind and size match, else by swapping)
/// and returns what is left to free.
fn write_slot(name: &str, slot: SlotMut<'_>, r: Replacement) -> Replacement {
    match (slot, r) {
        (SlotMut::Linear(dst), Replacement::Linear(new)) => {
            if dst.overwrite_from(&*new) {
                Replacement::Linear(new)
            } else {
                Replacement::Linear(std::mem::replace(dst, new))
            }
        }
        (SlotMut::Vector(dst), Replacement::Vector(new)) => {
            if dst.len() == new.len() {
                dst.copy_from_slice(&new);
                Replacement::Vector(new)
            } else {
                Replacement::Vector(std::mem::replace(dst, new))
            }
        }
        (SlotMut::Embedding(dst), Replacement::Embedding(new)) => match (&mut *dst, &new) {
            (DenseWeight::Bf16(d), DenseWeight::Bf16(n)) if d.len() == n.len() => {
                d.copy_from_slice(n);
                Replacement::Embedding(new)
            }
            (DenseWeight::F32(d), DenseWeight::F32(n)) if d.len() == n.len() => {
                d.copy_from_slice(n);
                Replacement::Embedding(new)
            }
            _ => Replacement::Embedding(std::mem::replace(dst, new)),
        },
        _ => unreachable!("`{name}`: checked by `fits`"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    /// The slot table is the layout's: the same names in the same order.
    #[test]
    fn slots_follow_the_layout() {
        let cfg: crate::model::ModelConfig = crate::model::ModelConfig::from_json(
            serde_json::from_str(crate::serve::EMBEDDED_CONFIG).unwrap(),
        )
        .unwrap();
        let recipe = crate::quant::Recipe::builtin("nvfp4").unwrap();
        let mut m = crate::model::loader::dummy_model(cfg.clone(), &recipe, 0).unwrap();
        let names: Vec<String> = m.slots_mut().into_iter().map(|(n, _)| n).collect();
        let want: Vec<String> = crate::model::layout::places(&cfg)
            .iter()
            .map(Place::name)
            .collect();
        assert_eq!(names, want);
        let shapes = m.slot_shapes();
        for t in crate::model::layout::ModelLayout::of(&cfg, &recipe).tensors {
            let want = (t.shape.clone(), t.format.format);
            assert_eq!(shapes[&t.name].dims(), want, "{}", t.name);
        }
    }

    /// A refused update is an error naming the tensor, and changes nothing.
    #[test]
    fn refused_replacements_change_nothing() {
        let cfg: crate::model::ModelConfig = crate::model::ModelConfig::from_json(
            serde_json::from_str(crate::serve::EMBEDDED_CONFIG).unwrap(),
        )
        .unwrap();
        let mut m =
            crate::model::loader::dummy_model(cfg, &crate::quant::Recipe::bf16(), 0).unwrap();
        let before = m.weights_checksum();
        let norm = "model.norm.weight".to_string();
        let good = || Replacement::Vector(vec![0.5; m_hidden()]);
        fn m_hidden() -> usize {
            crate::model::ModelConfig::from_json(
                serde_json::from_str(crate::serve::EMBEDDED_CONFIG).unwrap(),
            )
            .unwrap()
            .hidden_size
        }
        let unknown = m.apply_replacements(vec![
            (norm.clone(), good()),
            ("model.layers.99.mlp.gate.weight".into(), good()),
        ]);
        assert_eq!(
            unknown.err(),
            Some(StoreError::UnknownNames(vec![
                "model.layers.99.mlp.gate.weight".into()
            ]))
        );
        let short = m.apply_replacements(vec![
            (norm.clone(), good()),
            (
                "model.layers.0.input_layernorm.weight".into(),
                Replacement::Vector(vec![1.0; 3]),
            ),
        ]);
        assert!(
            matches!(&short, Err(StoreError::Mismatch { name, .. }) if name == "model.layers.0.input_layernorm.weight"),
            "{:?}",
            short.err()
        );
        let kind = m.apply_replacements(vec![(
            "model.layers.0.self_attn.q_proj.weight".into(),
            good(),
        )]);
        assert!(matches!(kind, Err(StoreError::Mismatch { .. })));
        assert_eq!(
            m.weights_checksum(),
            before,
            "refused updates wrote nothing"
        );
        m.apply_replacements(vec![(norm, good())]).unwrap();
        assert_ne!(m.weights_checksum(), before);
    }

    /// Addresses of every buffer the served weights live in.
    fn buffers(m: &mut Model) -> Vec<usize> {
        m.checkpoint_parts()
            .iter()
            .flat_map(|(_, parts)| parts.iter())
            .filter_map(|p| match &p.data {
                Cow::Borrowed(b) => Some(b.as_ptr() as usize),
                Cow::Owned(_) => None,
            })
            .collect()
    }

    /// An update writes into the buffers the model already has (no allocation, no moving),
    /// and the model then holds exactly the new weights.
    #[test]
    fn replacements_are_written_into_the_existing_buffers() {
        let cfg: crate::model::ModelConfig = crate::model::ModelConfig::from_json(
            serde_json::from_str(crate::serve::EMBEDDED_CONFIG).unwrap(),
        )
        .unwrap();
        for recipe in ["bf16", "nvfp4", "mxfp8"] {
            let recipe = crate::quant::Recipe::builtin(recipe).unwrap();
            let mut served = crate::model::loader::dummy_model(cfg.clone(), &recipe, 0).unwrap();
            let mut new = crate::model::loader::dummy_model(cfg.clone(), &recipe, 1).unwrap();
            let want = new.weights_checksum();
            let new = new.into_replacements();
            assert_ne!(served.weights_checksum(), want);
            let before = buffers(&mut served);
            assert!(!before.is_empty());
            let spent = served.apply_replacements(new).unwrap();
            assert_eq!(spent.len(), served.slot_shapes().len());
            assert_eq!(
                buffers(&mut served),
                before,
                "{}: buffers moved",
                recipe.name
            );
            assert_eq!(served.weights_checksum(), want, "{}", recipe.name);
        }
    }
}
