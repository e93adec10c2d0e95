//! The trainer's weights: f32 master copies by checkpoint name, and the serving model built
//! from them (BF16 values, linear layers in the recipe's formats) exactly as a server builds
//! it from the same BF16 tensors.

use std::collections::BTreeMap;

use half::bf16;

use crate::backend::cpu::linear::DenseWeight;
use crate::checkpoint::OwnedTensor;
use crate::model::loader::{self, LoadError, WeightSource};
use crate::model::slots::SlotShape;
use crate::model::{Model, ModelConfig};
use crate::quant::Recipe;

/// Gradients (or optimizer moments): one f32 buffer per parameter name.
pub type Grads = BTreeMap<String, Vec<f32>>;

/// One master tensor.
#[derive(Clone, Debug)]
pub struct Param {
    pub shape: Vec<usize>,
    pub value: Vec<f32>,
}

/// What the served weights hold: BF16 (what a push sends), or the master f32 values unrounded
/// (gradient checks only; no server holds these).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServingPrecision {
    Bf16,
    F32,
}

#[derive(Clone, Debug)]
pub struct Params {
    pub config: ModelConfig,
    pub tensors: BTreeMap<String, Param>,
}

impl Params {
    /// The master copy of a model's weights (its linear layers dequantized: build it with
    /// the BF16 recipe to start from the original values).
    pub fn from_model(model: &mut Model) -> Params {
        let shapes = model.slot_shapes();
        let values = model.slot_values();
        let tensors = values
            .into_iter()
            .map(|(name, value)| {
                let shape = match &shapes[&name] {
                    SlotShape::Linear { rows, cols, .. } | SlotShape::Embedding { rows, cols } => {
                        vec![*rows, *cols]
                    }
                    SlotShape::Vector { len } => vec![*len],
                };
                (name, Param { shape, value })
            })
            .collect();
        Params {
            config: model.config.clone(),
            tensors,
        }
    }

    /// The embedded model's deterministic dummy weights for `seed` (what `lockstep serve`
    /// starts with), as master weights.
    pub fn dummy(config: ModelConfig, seed: u64) -> Result<Params, LoadError> {
        let mut model = loader::dummy_model(config, &Recipe::bf16(), seed)?;
        Ok(Params::from_model(&mut model))
    }

    /// The model a server holds after receiving these weights as BF16 tensors.
    pub fn serving_model(
        &self,
        recipe: &Recipe,
        precision: ServingPrecision,
    ) -> Result<Model, LoadError> {
        let map: BTreeMap<String, DenseWeight> = self
            .tensors
            .iter()
            .map(|(name, p)| {
                let w = match precision {
                    ServingPrecision::Bf16 => {
                        DenseWeight::Bf16(p.value.iter().map(|&v| bf16::from_f32(v)).collect())
                    }
                    ServingPrecision::F32 => DenseWeight::F32(p.value.clone()),
                };
                (name.clone(), w)
            })
            .collect();
        loader::build_model(self.config.clone(), WeightSource::Tensors(&map), recipe)
    }

    /// The master values of every tensor, unrounded.
    pub fn values(&self) -> Grads {
        self.tensors
            .iter()
            .map(|(n, p)| (n.clone(), p.value.clone()))
            .collect()
    }

    /// The BF16 values of every tensor (the high-precision operands of the backward).
    pub fn bf16_values(&self) -> Grads {
        self.tensors
            .iter()
            .map(|(n, p)| {
                let v = p
                    .value
                    .iter()
                    .map(|&x| bf16::from_f32(x).to_f32())
                    .collect();
                (n.clone(), v)
            })
            .collect()
    }

    /// Every tensor as BF16 in checkpoint layout: the body of a weight push.
    pub fn to_bf16_tensors(&self) -> BTreeMap<String, OwnedTensor> {
        self.tensors
            .iter()
            .map(|(n, p)| (n.clone(), OwnedTensor::bf16(p.shape.clone(), &p.value)))
            .collect()
    }

    pub fn zeros(&self) -> Grads {
        self.tensors
            .iter()
            .map(|(n, p)| (n.clone(), vec![0f32; p.value.len()]))
            .collect()
    }
}
