//! One bucket's payload and its expected checksums: what the client sends for each tensor
//! (as given, or quantized on the client with the recipe) and the checkpoint-layout bytes the
//! server will hold for it after commit, hashed as `GET /weights_checksum` hashes them. Both
//! come from `quant::slot`, as the server's own preparation does.
//!
//! The server's slot formats come from the names it reports (the parts each slot has), so the
//! client needs no config.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use safetensors::tensor::{Dtype, TensorView};

use super::body::{BodyTensor, Chunks};
use super::PushError;
use crate::checkpoint::{Checkpoint, CheckpointPart};
use crate::model::checksum::WeightsChecksum;
use crate::model::layout::gate_up_pair;
use crate::quant::slot::{self, Pair, Parts, Slot, SlotError};
use crate::quant::{self, Format, Recipe, TensorFormat};

/// What a server holds, by the names of its checksum.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerLayout {
    /// Checkpoint tensor names (every part of every slot).
    pub tensors: BTreeSet<String>,
    /// Slot format by module (`...q_proj`).
    pub formats: BTreeMap<String, Format>,
    /// Transformer layers (for the recipe's first/last-layer exceptions).
    pub num_layers: usize,
}

impl ServerLayout {
    pub fn from_names<'a>(names: impl IntoIterator<Item = &'a String>) -> ServerLayout {
        let tensors: BTreeSet<String> = names.into_iter().cloned().collect();
        let formats = tensors
            .iter()
            .filter_map(|name| slot::split(name))
            .map(|(module, _)| {
                let has = |suffix: &str| tensors.contains(&format!("{module}.{suffix}"));
                (module.to_string(), slot::format_from_parts(has))
            })
            .collect();
        let num_layers = tensors
            .iter()
            .filter_map(|n| quant::recipe::layer_index(n))
            .max()
            .map_or(0, |l| l + 1);
        ServerLayout {
            tensors,
            formats,
            num_layers,
        }
    }

    /// The server's slot of `module`, shaped by its arriving `weight`, with the recipe's
    /// numerics (needed only when the client must quantize) and its gate/up pair.
    fn slot(
        &self,
        module: &str,
        parts: &Parts<'_>,
        recipe: Option<&Recipe>,
    ) -> Result<Slot, PushError> {
        let format = self.formats.get(module).copied().unwrap_or(Format::Bf16);
        let shape = parts
            .get("weight")
            .map_or(vec![], |w| slot::dense_shape(format, w));
        let dense = parts.get("weight").is_some_and(|w| is_float(w.dtype()));
        if dense && format != Format::Bf16 && recipe.is_none() {
            return Err(PushError::Tensor {
                name: format!("{module}.weight"),
                reason: "the server quantizes this slot; pass --recipe (the server's recipe) so the client can compute what it will hold".into(),
            });
        }
        let cols = shape.get(1).copied().unwrap_or(0);
        let served = |m: &str| {
            let format = *self.formats.get(m)?;
            let numerics = recipe.map(|r| r.format_for(m, self.num_layers).fitting(cols));
            Some(numerics.unwrap_or(TensorFormat::BF16).with(format))
        };
        let pair = gate_up_pair(module)
            .and_then(|(g, u)| Pair::of(&g, served(&g)?, &u, served(&u)?.format));
        let format = served(module).unwrap_or(TensorFormat::BF16);
        Ok(Slot::new(module, shape, format, pair))
    }
}

/// A bucket ready to send.
pub struct PreparedBucket {
    /// The safetensors body of `PUT /update_weights`.
    pub body: Chunks,
    /// Tensors in the body (what the server stages).
    pub tensors: usize,
    /// Checkpoint-layout hashes of every tensor this bucket sets on the server.
    pub expected: WeightsChecksum,
}

pub struct PrepareOptions<'a> {
    pub layout: &'a ServerLayout,
    pub recipe: Option<&'a Recipe>,
    pub quantize_on_client: bool,
    /// The checkpoint the tensors are views of: bytes sent as they are then share its map
    /// instead of being copied into the body.
    pub source: Option<&'a Checkpoint>,
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::BF16 | Dtype::F16 | Dtype::F32)
}

/// The weight of a BF16 slot that arrives as BF16 and alone: what the server will store, byte
/// for byte (`quant::slot` keeps BF16 as given).
fn as_stored<'a, 'b>(s: &Slot, parts: &'b Parts<'a>) -> Option<&'b TensorView<'a>> {
    let w = parts.get("weight")?;
    (s.format.format == Format::Bf16 && w.dtype() == Dtype::BF16 && parts.len() == 1).then_some(w)
}

/// Builds the body and expected hashes of one bucket of named tensors.
pub fn prepare_bucket(
    tensors: &[(&str, &TensorView<'_>)],
    opts: &PrepareOptions<'_>,
) -> Result<PreparedBucket, PushError> {
    let mut by_module: BTreeMap<&str, Parts<'_>> = BTreeMap::new();
    for &(name, t) in tensors {
        let split = slot::split(name).filter(|_| opts.layout.tensors.contains(name));
        let Some((module, suffix)) = split else {
            return Err(PushError::Tensor {
                name: name.into(),
                reason: "the server has no tensor of that name".into(),
            });
        };
        by_module
            .entry(module)
            .or_default()
            .insert(suffix, t.clone());
    }
    let mut slots = BTreeMap::new();
    let shared = |data: &[u8]| {
        opts.source
            .and_then(|c| c.shared(data))
            .unwrap_or_else(|| Bytes::copy_from_slice(data))
    };
    let as_sent = |name: String, t: &TensorView<'_>| BodyTensor {
        name,
        dtype: t.dtype(),
        shape: t.shape().to_vec(),
        data: shared(t.data()),
    };
    let mut send: Vec<BodyTensor> = Vec::new();
    let mut as_is = Vec::new();
    for (module, parts) in by_module {
        let s = opts.layout.slot(module, &parts, opts.recipe)?;
        // A BF16 weight for a BF16 slot is stored as it is: hashed and sent from the
        // checkpoint's bytes, with no copy.
        if let Some(w) = as_stored(&s, &parts) {
            s.check("weight", w.dtype(), w.shape())
                .map_err(|e| PushError::Tensor {
                    name: e.name,
                    reason: e.reason,
                })?;
            let part = CheckpointPart::bytes("weight", w.dtype(), w.shape().to_vec(), w.data());
            as_is.push((module.to_string(), vec![part]));
            send.push(as_sent(s.name("weight"), w));
            continue;
        }
        slots.insert(module.to_string(), (s, parts));
    }
    // Hashing reads every byte of the bucket: the tensors in parallel.
    let mut expected = WeightsChecksum::of_parts(as_is);
    let stored = slot::prepare_all(&slots).map_err(|e: SlotError| PushError::Tensor {
        name: e.name,
        reason: e.reason,
    })?;
    for (module, stored) in &stored {
        let (s, parts) = &slots[module];
        let held = stored.parts();
        expected.insert_parts(module, &held);
        // A dense weight for a quantized slot: the server quantizes it, or the client does.
        let quantized = s.format.format != Format::Bf16 && is_float(parts["weight"].dtype());
        if quantized && opts.quantize_on_client {
            send.extend(held.into_iter().map(|p| BodyTensor {
                name: s.name(p.suffix),
                dtype: p.dtype,
                shape: p.shape,
                data: Bytes::from(p.data.into_owned()),
            }));
        } else {
            send.extend(parts.iter().map(|(suffix, t)| as_sent(s.name(suffix), t)));
        }
    }
    let count = send.len();
    let body = Chunks::safetensors(send).map_err(|reason| PushError::Tensor {
        name: "bucket".into(),
        reason,
    })?;
    Ok(PreparedBucket {
        body,
        tensors: count,
        expected,
    })
}
