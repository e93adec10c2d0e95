//! One bucket's payload and its expected checksums: what the client sends for each tensor
//! (as given, or quantized on the client with the recipe and the `quant` module) and the
//! checkpoint-layout bytes the server will hold for it after commit, hashed as
//! `GET /weights_checksum` hashes them.
//!
//! The server's slot formats come from the names it reports (an NVFP4 slot has a
//! `weight_scale_2`, an MXFP8 one a `weight_scale_inv`), so the client needs no config.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use safetensors::tensor::{Dtype, TensorView};

use super::bucket::module_of;
use super::PushError;
use crate::checkpoint::{to_f32, CheckpointPart};
use crate::model::checksum::WeightsChecksum;
use crate::model::layout::{gate_up_partner, shares_gate_up_scale};
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
        let mut formats = BTreeMap::new();
        for name in &tensors {
            let module = module_of(name).to_string();
            let format = if tensors.contains(&format!("{module}.weight_scale_2")) {
                Format::Nvfp4
            } else if tensors.contains(&format!("{module}.weight_scale_inv")) {
                Format::Mxfp8
            } else {
                Format::Bf16
            };
            formats.insert(module, format);
        }
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

    /// The served format of `module` (high precision when the server does not list it).
    fn format_of(&self, module: &str) -> Format {
        self.formats.get(module).copied().unwrap_or(Format::Bf16)
    }
}

/// A bucket ready to send.
pub struct PreparedBucket {
    /// The safetensors body of `PUT /update_weights`.
    pub body: Bytes,
    /// Tensors in the body (what the server stages).
    pub tensors: usize,
    /// Checkpoint-layout hashes of every tensor this bucket sets on the server.
    pub expected: WeightsChecksum,
}

pub struct PrepareOptions<'a> {
    pub layout: &'a ServerLayout,
    pub recipe: Option<&'a Recipe>,
    pub quantize_on_client: bool,
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::BF16 | Dtype::F16 | Dtype::F32)
}

/// Builds the body and expected hashes of one bucket of named tensors.
pub fn prepare_bucket(
    tensors: &[(&str, &TensorView<'_>)],
    opts: &PrepareOptions<'_>,
) -> Result<PreparedBucket, PushError> {
    let by_name: BTreeMap<&str, &TensorView<'_>> = tensors.iter().copied().collect();
    let mut send: Vec<(String, CheckpointPart<'_>)> = Vec::new();
    let mut expected = WeightsChecksum::default();
    let mut quantized_pairs: BTreeSet<String> = BTreeSet::new();
    for &(name, t) in tensors {
        if !opts.layout.tensors.contains(name) {
            return Err(PushError::Tensor {
                name: name.into(),
                reason: "the server has no tensor of that name".into(),
            });
        }
        let module = module_of(name);
        let suffix = suffix_of(name);
        let format = opts.layout.formats[module];
        if suffix != "weight" || !is_float(t.dtype()) || format == Format::Bf16 {
            // Held as sent: pre-quantized parts, or a high-precision slot.
            let part = CheckpointPart::bytes(suffix, t.dtype(), t.shape().to_vec(), t.data());
            expected.insert_parts(module, &[held_as_sent(name, &part)?]);
            send.push((name.to_string(), part));
            continue;
        }
        // A high-precision weight bound for a quantized slot: the server will quantize it;
        // the client quantizes too, to know the bytes (and sends them with --quantize-on-client).
        if quantized_pairs.contains(module) {
            continue;
        }
        let recipe = opts.recipe.ok_or_else(|| PushError::Tensor {
            name: name.into(),
            reason: "the server quantizes this slot; pass --recipe (the server's recipe) so the client can compute what it will hold".into(),
        })?;
        let (rows, cols) = matrix_shape(name, t)?;
        let mut fmt = recipe
            .format_for(module, opts.layout.num_layers)
            .fitting(cols);
        fmt.format = format;
        let parts = match gate_up_partner(module)
            .filter(|p| shares_gate_up_scale(format, opts.layout.format_of(p)))
        {
            Some(partner) => {
                let partner_name = format!("{partner}.weight");
                let other = by_name
                    .get(partner_name.as_str())
                    .filter(|o| is_float(o.dtype()))
                    .ok_or_else(|| PushError::Tensor {
                        name: name.into(),
                        reason: format!(
                            "NVFP4 with a scale shared with `{partner}`: send both in one update"
                        ),
                    })?;
                let (mine, theirs) = (f32_of(name, t)?, f32_of(&partner_name, other)?);
                if mine.len() != theirs.len() {
                    return Err(PushError::Tensor {
                        name: partner_name,
                        reason: "shape differs from its gate/up partner".into(),
                    });
                }
                let (q, qp) =
                    quant::nvfp4::quantize_gate_up(&mine, &theirs, rows, cols, fmt.four_over_six)
                        .map_err(|e| PushError::Tensor {
                        name: name.into(),
                        reason: e.to_string(),
                    })?;
                quantized_pairs.insert(partner.clone());
                vec![
                    (module.to_string(), nvfp4_parts(q)),
                    (partner, nvfp4_parts(qp)),
                ]
            }
            None => vec![(module.to_string(), quantize_one(name, t, rows, cols, &fmt)?)],
        };
        for (m, parts) in parts {
            expected.insert_parts(&m, &parts);
            if opts.quantize_on_client {
                send.extend(parts.into_iter().map(|p| (format!("{m}.{}", p.suffix), p)));
            } else {
                let n = format!("{m}.weight");
                let src = by_name[n.as_str()];
                send.push((
                    n,
                    CheckpointPart::bytes("weight", src.dtype(), src.shape().to_vec(), src.data()),
                ));
            }
        }
    }
    let count = send.len();
    let body = safetensors::tensor::serialize(send.iter().map(|(n, p)| (n.as_str(), p)), None)
        .map_err(|e| PushError::Tensor {
            name: "bucket".into(),
            reason: e.to_string(),
        })?;
    Ok(PreparedBucket {
        body: Bytes::from(body),
        tensors: count,
        expected,
    })
}

/// `x.weight_scale` -> `weight_scale`, as a `'static` suffix of the checkpoint layout.
fn suffix_of(name: &str) -> &'static str {
    [
        "weight_scale_inv",
        "weight_scale_2",
        "weight_scale",
        "input_scale",
        "weight",
    ]
    .into_iter()
    .find(|s| name.ends_with(&format!(".{s}")))
    .unwrap_or("weight")
}

/// What the server holds for a tensor it keeps as sent: high-precision values widened to f32
/// come back as BF16 when exact (as [`CheckpointPart::from_f32`]); `input_scale` is always
/// 1.0 (activations are scaled per token at run time).
fn held_as_sent<'a>(
    name: &str,
    part: &CheckpointPart<'a>,
) -> Result<CheckpointPart<'a>, PushError> {
    if part.suffix == "input_scale" {
        return Ok(CheckpointPart {
            data: Cow::Owned(1f32.to_le_bytes().to_vec()),
            ..part.clone()
        });
    }
    if part.suffix != "weight" || part.dtype == Dtype::BF16 || !is_float(part.dtype) {
        return Ok(part.clone());
    }
    let view = TensorView::new(part.dtype, part.shape.clone(), &part.data).map_err(|e| {
        PushError::Tensor {
            name: name.into(),
            reason: e.to_string(),
        }
    })?;
    let values = f32_of(name, &view)?;
    Ok(CheckpointPart::from_f32("weight", part.shape.clone(), &values).into_owned())
}

fn f32_of(name: &str, t: &TensorView<'_>) -> Result<Vec<f32>, PushError> {
    to_f32(name, t).map_err(|e| PushError::Tensor {
        name: name.into(),
        reason: e.to_string(),
    })
}

fn matrix_shape(name: &str, t: &TensorView<'_>) -> Result<(usize, usize), PushError> {
    match t.shape() {
        [r, c] => Ok((*r, *c)),
        s => Err(PushError::Tensor {
            name: name.into(),
            reason: format!("shape {s:?} is not a matrix"),
        }),
    }
}

fn quantize_one(
    name: &str,
    t: &TensorView<'_>,
    rows: usize,
    cols: usize,
    fmt: &TensorFormat,
) -> Result<Vec<CheckpointPart<'static>>, PushError> {
    let x = f32_of(name, t)?;
    let err = |e: quant::QuantError| PushError::Tensor {
        name: name.into(),
        reason: e.to_string(),
    };
    // The caller quantizes only for quantized slots: MXFP8, else NVFP4.
    Ok(if fmt.format == Format::Mxfp8 {
        let q = quant::mxfp8::quantize_rowwise(&x, rows, cols).map_err(err)?;
        vec![
            owned("weight", Dtype::F8_E4M3, vec![rows, cols], q.data),
            owned(
                "weight_scale_inv",
                Dtype::U8,
                vec![rows, cols / quant::MXFP8_BLOCK],
                q.scales,
            ),
        ]
    } else {
        let opts = quant::Nvfp4Options {
            granularity: quant::ScaleGranularity::PerTensor,
            four_over_six: fmt.four_over_six,
        };
        nvfp4_parts(quant::nvfp4::quantize(&x, rows, cols, &opts).map_err(err)?)
    })
}

/// The ModelOpt layout `lockstep convert` writes for an NVFP4 weight.
fn nvfp4_parts(q: quant::Nvfp4Tensor) -> Vec<CheckpointPart<'static>> {
    let (rows, cols) = (q.rows, q.cols);
    let s_dec = q.global.of_row(0);
    vec![
        owned("weight", Dtype::U8, vec![rows, cols / 2], q.data),
        owned(
            "weight_scale",
            Dtype::F8_E4M3,
            vec![rows, cols / quant::NVFP4_BLOCK],
            q.scales,
        ),
        owned(
            "weight_scale_2",
            Dtype::F32,
            vec![],
            s_dec.to_le_bytes().to_vec(),
        ),
        owned(
            "input_scale",
            Dtype::F32,
            vec![],
            1f32.to_le_bytes().to_vec(),
        ),
    ]
}

fn owned(
    suffix: &'static str,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
) -> CheckpointPart<'static> {
    CheckpointPart {
        suffix,
        dtype,
        shape,
        data: Cow::Owned(data),
    }
}
