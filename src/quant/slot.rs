//! One slot of the served weights (a layout tensor in its format) in checkpoint layout: which
//! parts it has (`weight`, `weight_scale`, ...), what each may arrive as, and its stored bytes
//! prepared from dense values (quantized per the contract) or from pre-quantized parts
//! (checked and kept). The NVFP4 gate/up shared second-level scale is decided here and only
//! here. `convert`, `lockstep push`, live updates and the CPU layers all go through it.

use std::borrow::Cow;
use std::collections::BTreeMap;

use half::bf16;
use safetensors::tensor::{Dtype, TensorView};

use super::nvfp4::{self, GlobalScale, SecondLevel};
use super::{mxfp8, Element, Format, Mxfp8Tensor, Nvfp4Tensor, QuantError, TensorFormat};
use crate::checkpoint::{to_f32, CheckpointPart};

/// A slot's tensor that fails its checks, by name.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("tensor `{name}`: {reason}")]
pub struct SlotError {
    pub name: String,
    pub reason: String,
}

/// The arriving parts of one slot by suffix (`weight`, `weight_scale`, ...).
pub type Parts<'a> = BTreeMap<&'static str, TensorView<'a>>;

/// Every part suffix of the checkpoint layout.
const SUFFIXES: [&str; 5] = [
    "weight_scale_inv",
    "weight_scale_2",
    "weight_scale",
    "input_scale",
    "weight",
];

const FLOATS: &[Dtype] = &[Dtype::BF16, Dtype::F16, Dtype::F32];

/// Whether a tensor of `dtype` is dense (BF16, F16, F32): a whole `weight` by itself.
pub fn is_dense(dtype: Dtype) -> bool {
    FLOATS.contains(&dtype)
}

/// `m.weight_scale` -> (`m`, `weight_scale`); None for a name with no part suffix.
pub fn split(name: &str) -> Option<(&str, &'static str)> {
    SUFFIXES
        .into_iter()
        .find_map(|s| Some((name.strip_suffix(s)?.strip_suffix('.')?, s)))
}

/// One part of a slot: its suffix, shape and the dtypes it may arrive as (the first is stored).
struct Part {
    suffix: &'static str,
    shape: Vec<usize>,
    dtypes: &'static [Dtype],
}

/// THE checkpoint layout of a tensor of `shape` stored as `format` (`[rows, cols]` when
/// quantized): the dense tensor itself, MXFP8 with E8M0 `weight_scale_inv`, or ModelOpt NVFP4.
fn layout(format: Format, shape: &[usize]) -> Vec<Part> {
    let part = |suffix, shape, dtypes| Part {
        suffix,
        shape,
        dtypes,
    };
    let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(0));
    match format {
        Format::Bf16 => vec![part("weight", shape.to_vec(), FLOATS)],
        Format::Mxfp8 => vec![
            part("weight", vec![rows, cols], &[Dtype::F8_E4M3]),
            part(
                "weight_scale_inv",
                vec![rows, cols / super::MXFP8_BLOCK],
                &[Dtype::U8],
            ),
        ],
        Format::Nvfp4 => vec![
            part("weight", vec![rows, cols / 2], &[Dtype::U8]),
            part(
                "weight_scale",
                vec![rows, cols / super::NVFP4_BLOCK],
                &[Dtype::F8_E4M3, Dtype::U8],
            ),
            part("weight_scale_2", vec![], &[Dtype::F32]),
            part("input_scale", vec![], &[Dtype::F32]),
        ],
    }
}

/// The format of a slot that has exactly the parts `has` says (a server's checksum names).
pub fn format_from_parts(has: impl Fn(&str) -> bool) -> Format {
    [Format::Nvfp4, Format::Mxfp8]
        .into_iter()
        .find(|f| layout(*f, &[0, 0]).iter().all(|p| has(p.suffix)))
        .unwrap_or(Format::Bf16)
}

/// The dense shape of a slot stored as `format` whose `weight` arrives as `weight`.
pub fn dense_shape(format: Format, weight: &TensorView<'_>) -> Vec<usize> {
    match (format, weight.shape()) {
        (Format::Nvfp4, [rows, half]) if !FLOATS.contains(&weight.dtype()) => vec![*rows, half * 2],
        (_, shape) => shape.to_vec(),
    }
}

/// THE gate/up rule: an NVFP4 gate and up are quantized with one shared second-level scale
/// exactly when both are NVFP4.
pub fn shares_gate_up_scale(gate: Format, up: Format) -> bool {
    gate == Format::Nvfp4 && up == Format::Nvfp4
}

/// An NVFP4 gate/up pair (modules) quantized with one second-level scale.
#[derive(Clone, Debug, PartialEq)]
pub struct Pair {
    pub gate: String,
    pub up: String,
    /// The gate's format: its four-over-six range sets the shared scale.
    pub gate_format: TensorFormat,
}

impl Pair {
    /// The pair of `gate` and `up`, if they share a scale ([`shares_gate_up_scale`]).
    pub fn of(gate: &str, gate_format: TensorFormat, up: &str, up_format: Format) -> Option<Pair> {
        shares_gate_up_scale(gate_format.format, up_format).then(|| Pair {
            gate: gate.into(),
            up: up.into(),
            gate_format,
        })
    }
}

/// The second-level scale of an NVFP4 gate/up pair: from the larger of the two amaxes, in the
/// gate's range (as `quant::nvfp4::quantize_gate_up`).
pub fn shared_level(gate: &TensorFormat, gate_w: &DenseWeight, up_w: &DenseWeight) -> SecondLevel {
    nvfp4::gate_up_level(gate_w.amax().max(up_w.amax()), gate.four_over_six)
}

/// High-precision values of a tensor, before (or instead of) quantization.
#[derive(Clone, Debug, PartialEq)]
pub enum DenseWeight {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl DenseWeight {
    pub fn len(&self) -> usize {
        match self {
            DenseWeight::F32(v) => v.len(),
            DenseWeight::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            DenseWeight::F32(v) => v.clone(),
            DenseWeight::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    fn amax(&self) -> f32 {
        match self {
            DenseWeight::F32(v) => nvfp4::parallel_amax(v),
            DenseWeight::Bf16(v) => nvfp4::parallel_amax(v),
        }
    }
}

/// A BF16/F16/F32 tensor's values: BF16 kept (one copy), F16/F32 widened to f32.
pub fn dense_of(name: &str, t: &TensorView<'_>) -> Result<DenseWeight, SlotError> {
    if t.dtype() != Dtype::BF16 {
        return to_f32(name, t)
            .map(DenseWeight::F32)
            .map_err(|_| SlotError {
                name: name.into(),
                reason: format!("dtype {:?} is not BF16, F16 or F32", t.dtype()),
            });
    }
    // A copy: the bytes may be unaligned for a direct cast.
    let mut v = vec![bf16::ZERO; t.data().len() / 2];
    bytemuck::cast_slice_mut::<bf16, u8>(&mut v).copy_from_slice(t.data());
    Ok(DenseWeight::Bf16(v))
}

/// A slot's stored form: what the served weights hold.
#[derive(Clone, Debug, PartialEq)]
pub enum Stored {
    /// High precision as given: BF16 kept, F16/F32 as f32.
    Dense {
        shape: Vec<usize>,
        values: DenseWeight,
    },
    Mxfp8(Mxfp8Tensor),
    Nvfp4(Nvfp4Tensor),
}

impl Stored {
    /// In checkpoint layout: what `convert` writes and `GET /weights_checksum` hashes.
    pub fn parts(&self) -> Vec<CheckpointPart<'_>> {
        match self {
            Stored::Dense { shape, values } => vec![dense_part(shape.clone(), values)],
            Stored::Mxfp8(q) => mxfp8_parts(q),
            Stored::Nvfp4(q) => nvfp4_parts(q),
        }
    }
}

/// A dense `weight` in checkpoint layout: BF16 as held, f32 as BF16 when exact
/// ([`CheckpointPart::from_f32`]).
pub fn dense_part(shape: Vec<usize>, w: &DenseWeight) -> CheckpointPart<'_> {
    match w {
        DenseWeight::Bf16(v) => CheckpointPart::bf16("weight", shape, v),
        DenseWeight::F32(v) => CheckpointPart::from_f32("weight", shape, v),
    }
}

pub fn mxfp8_parts(q: &Mxfp8Tensor) -> Vec<CheckpointPart<'_>> {
    quantized_parts(
        Format::Mxfp8,
        q.rows,
        q.cols,
        [Cow::Borrowed(&q.data[..]), Cow::Borrowed(&q.scales[..])],
        None,
    )
}

pub fn nvfp4_parts(q: &Nvfp4Tensor) -> Vec<CheckpointPart<'_>> {
    quantized_parts(
        Format::Nvfp4,
        q.rows,
        q.cols,
        [Cow::Borrowed(&q.data[..]), Cow::Borrowed(&q.scales[..])],
        Some(q.global.of_row(0)),
    )
}

/// A quantized `[rows, cols]` tensor in checkpoint layout from its stored bytes, wherever they
/// were read from: `[values, block scales]`, and for NVFP4 its second-level scale
/// (`weight_scale_2`). Activations are scaled per token at run time; ModelOpt loaders still
/// expect an `input_scale`, so it is 1.0.
pub fn quantized_parts<'a>(
    format: Format,
    rows: usize,
    cols: usize,
    [values, scales]: [Cow<'a, [u8]>; 2],
    second_level: Option<f32>,
) -> Vec<CheckpointPart<'a>> {
    let scalar = |v: f32| Cow::Owned(v.to_le_bytes().to_vec());
    let mut data = vec![values, scales];
    if format == Format::Nvfp4 {
        data.push(scalar(second_level.unwrap_or(1.0)));
        data.push(scalar(1.0));
    }
    stored_parts(format, rows, cols, data)
}

fn stored_parts(
    format: Format,
    rows: usize,
    cols: usize,
    data: Vec<Cow<'_, [u8]>>,
) -> Vec<CheckpointPart<'_>> {
    let parts = layout(format, &[rows, cols]).into_iter().zip(data);
    parts
        .map(|(p, data)| CheckpointPart {
            suffix: p.suffix,
            dtype: p.dtypes[0],
            shape: p.shape,
            data,
        })
        .collect()
}

/// Dense values `w` of `shape` stored as `fmt`: kept for BF16, else quantized per the
/// contract (NVFP4 per tensor, or with `shared`, its gate/up pair's second-level scale).
pub fn store(
    w: DenseWeight,
    shape: &[usize],
    fmt: &TensorFormat,
    shared: Option<SecondLevel>,
) -> Result<Stored, QuantError> {
    let invalid = |what: String| Err(QuantError::Invalid(what));
    if w.len() != shape.iter().product::<usize>() {
        return invalid(format!("{} values for shape {shape:?}", w.len()));
    }
    if fmt.format == Format::Bf16 {
        let shape = shape.to_vec();
        return Ok(Stored::Dense { shape, values: w });
    }
    let &[rows, cols] = shape else {
        return invalid(format!("shape {shape:?} is not a matrix"));
    };
    match &w {
        DenseWeight::F32(x) => quantized(x, rows, cols, fmt, shared),
        DenseWeight::Bf16(x) => quantized(x, rows, cols, fmt, shared),
    }
}

/// MXFP8, else NVFP4 (the caller keeps BF16 dense).
fn quantized<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    fmt: &TensorFormat,
    shared: Option<SecondLevel>,
) -> Result<Stored, QuantError> {
    if fmt.format == Format::Mxfp8 {
        return Ok(Stored::Mxfp8(mxfp8::quantize_rowwise(x, rows, cols)?));
    }
    super::check_aligned(1, cols, super::NVFP4_BLOCK)?;
    // Alone, the per-tensor scale `nvfp4::quantize` derives from the tensor's own amax.
    let fos = fmt.four_over_six;
    let level = shared.unwrap_or_else(|| nvfp4::gate_up_level(nvfp4::parallel_amax(x), fos));
    Ok(Stored::Nvfp4(nvfp4::quantize_with_level(
        x, rows, cols, level, fos,
    )))
}

/// One slot: the tensor `{module}.weight` of (dense) `shape`, stored as `format`.
#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    pub module: String,
    /// `[rows, cols]` for a linear layer, `[len]` for a norm.
    pub shape: Vec<usize>,
    pub format: TensorFormat,
    /// The NVFP4 gate/up pair it belongs to, if it shares a second-level scale.
    pub pair: Option<Pair>,
}

impl Slot {
    pub fn new(module: &str, shape: Vec<usize>, format: TensorFormat, pair: Option<Pair>) -> Slot {
        let module = module.into();
        Slot {
            module,
            shape,
            format,
            pair,
        }
    }

    /// The checkpoint name of its part `suffix`.
    pub fn name(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.module)
    }

    fn error(&self, suffix: &str, reason: impl Into<String>) -> SlotError {
        SlotError {
            name: self.name(suffix),
            reason: reason.into(),
        }
    }

    fn parts(&self) -> Result<Vec<Part>, SlotError> {
        if self.shape.is_empty() || (self.format.format != Format::Bf16 && self.shape.len() != 2) {
            let reason = format!(
                "shape {:?} cannot hold {:?}",
                self.shape, self.format.format
            );
            return Err(self.error("weight", reason));
        }
        Ok(layout(self.format.format, &self.shape))
    }

    /// Checks one arriving tensor of the slot: a dense `weight` (BF16/F16/F32 of the slot's
    /// shape) or a stored part ([`Slot::check_stored`]).
    pub fn check(&self, suffix: &str, dtype: Dtype, shape: &[usize]) -> Result<(), SlotError> {
        if suffix != "weight" || !FLOATS.contains(&dtype) {
            return self.check_stored(suffix, dtype, shape);
        }
        self.parts()?;
        if shape != self.shape {
            let reason = format!("shape {shape:?}, expected {:?}", self.shape);
            return Err(self.error(suffix, reason));
        }
        Ok(())
    }

    /// Checks one tensor of the slot as stored in its format (a scalar may be `[1]`).
    pub fn check_stored(
        &self,
        suffix: &str,
        dtype: Dtype,
        shape: &[usize],
    ) -> Result<(), SlotError> {
        let err = |reason: String| Err(self.error(suffix, reason));
        let Some(part) = self.parts()?.into_iter().find(|p| p.suffix == suffix) else {
            let format = self.format.format;
            return err(format!("`{suffix}` is not a part of a {format:?} tensor"));
        };
        if !part.dtypes.contains(&dtype) {
            return err(format!(
                "dtype {dtype:?}, expected one of {:?}",
                part.dtypes
            ));
        }
        if shape != part.shape && !(part.shape.is_empty() && shape == [1]) {
            return err(format!("shape {shape:?}, expected {:?}", part.shape));
        }
        Ok(())
    }

    /// The stored form from dense values ([`store`]).
    pub fn quantize(
        &self,
        w: DenseWeight,
        shared: Option<SecondLevel>,
    ) -> Result<Stored, SlotError> {
        store(w, &self.shape, &self.format, shared).map_err(|e| self.error("weight", e.to_string()))
    }

    /// The stored form from arriving parts, each checked: a dense `weight` is quantized
    /// ([`Slot::quantize`]), pre-quantized parts are kept (`input_scale` is always 1.0).
    pub fn prepare(
        &self,
        parts: &Parts<'_>,
        shared: Option<SecondLevel>,
    ) -> Result<Stored, SlotError> {
        for (suffix, t) in parts {
            self.check(suffix, t.dtype(), t.shape())?;
        }
        let Some(weight) = parts.get("weight") else {
            return Err(self.error("weight", "its scale tensors arrived without it"));
        };
        if FLOATS.contains(&weight.dtype()) {
            return self.quantize(dense_of(&self.name("weight"), weight)?, shared);
        }
        let need = |suffix: &str| {
            let reason = format!(
                "{:?} `{}` arrived without it",
                self.format.format, self.module
            );
            parts.get(suffix).ok_or_else(|| self.error(suffix, reason))
        };
        let (rows, cols, data) = (self.shape[0], self.shape[1], weight.data().to_vec());
        Ok(match self.format.format {
            Format::Nvfp4 => {
                let s2 = need("weight_scale_2")?;
                let s_dec = to_f32(&self.name("weight_scale_2"), s2)
                    .map_err(|e| self.error("weight_scale_2", e.to_string()))?[0];
                Stored::Nvfp4(Nvfp4Tensor {
                    rows,
                    cols,
                    data,
                    scales: need("weight_scale")?.data().to_vec(),
                    global: GlobalScale::PerTensor(s_dec),
                })
            }
            Format::Mxfp8 => Stored::Mxfp8(Mxfp8Tensor {
                rows,
                cols,
                axis: super::BlockAxis::Rowwise,
                data,
                scales: need("weight_scale_inv")?.data().to_vec(),
            }),
            Format::Bf16 => return Err(self.error("weight", "a BF16 tensor must be dense")),
        })
    }
}

/// Prepares the slots of one update (by module) with [`Slot::prepare`]; the dense halves of
/// each NVFP4 gate/up pair get one shared second-level scale, so both halves must be in the
/// update, dense and of one shape.
///
/// Slots are prepared in parallel (each one's copy out of its tensor is serial); a failure is
/// the first in module order, whichever finished first.
pub fn prepare_all(
    slots: &BTreeMap<String, (Slot, Parts<'_>)>,
) -> Result<Vec<(String, Stored)>, SlotError> {
    use rayon::prelude::*;
    let dense = |parts: &Parts<'_>| {
        parts
            .get("weight")
            .is_some_and(|w| FLOATS.contains(&w.dtype()))
    };
    // Each pair's shared scale, once, from the first of its halves in module order.
    let mut pairs: BTreeMap<&str, (&Slot, &Pair)> = BTreeMap::new();
    for (slot, parts) in slots.values() {
        if let Some(pair) = slot.pair.as_ref().filter(|_| dense(parts)) {
            pairs.entry(pair.gate.as_str()).or_insert((slot, pair));
        }
    }
    let levels: Vec<Result<(&str, SecondLevel), SlotError>> = pairs
        .into_par_iter()
        .map(|(gate, (slot, pair))| Ok((gate, pair_level(slots, slot, pair)?)))
        .collect();
    let levels: BTreeMap<&str, SecondLevel> = levels.into_iter().collect::<Result<_, _>>()?;
    let out: Vec<Result<(String, Stored), SlotError>> = slots
        .par_iter()
        .map(|(module, (slot, parts))| {
            let shared = slot
                .pair
                .as_ref()
                .filter(|_| dense(parts))
                .map(|pair| levels[pair.gate.as_str()]);
            Ok((module.clone(), slot.prepare(parts, shared)?))
        })
        .collect();
    out.into_iter().collect()
}

fn pair_level(
    slots: &BTreeMap<String, (Slot, Parts<'_>)>,
    slot: &Slot,
    pair: &Pair,
) -> Result<SecondLevel, SlotError> {
    let other = if slot.module == pair.gate {
        &pair.up
    } else {
        &pair.gate
    };
    let half = |module: &str| {
        let found = slots.get(module).and_then(|(s, parts)| {
            Some((
                s,
                parts
                    .get("weight")
                    .filter(|w| FLOATS.contains(&w.dtype()))?,
            ))
        });
        match found {
            Some((s, w)) if s.shape == slot.shape => dense_of(&s.name("weight"), w),
            Some((s, _)) => Err(s.error("weight", "its shape differs from its gate/up partner's")),
            None => Err(SlotError {
                name: format!("{other}.weight"),
                reason: format!(
                    "`{}` is NVFP4 with a scale shared with `{other}`: send both, in high precision, in one update",
                    slot.module
                ),
            }),
        }
    };
    Ok(shared_level(
        &pair.gate_format,
        &half(&pair.gate)?,
        &half(&pair.up)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{FourOverSix, Nvfp4Options, ScaleGranularity};

    /// Fresh pseudo-random BF16 values, magnitudes spread over blocks, one row zeroed.
    fn values(rows: usize, cols: usize, seed: u64) -> Vec<bf16> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut v: Vec<bf16> = (0..rows * cols)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                bf16::from_f32(u * 2f32.powi((i / 16 % 7) as i32 * 3 - 9))
            })
            .collect();
        v[cols..2 * cols].fill(bf16::ZERO);
        v
    }

    fn slot(module: &str, format: Format, pair: Option<Pair>) -> Slot {
        Slot::new(module, vec![48, 64], TensorFormat::BF16.with(format), pair)
    }

    fn view<'a>(dtype: Dtype, shape: &[usize], data: &'a [u8]) -> TensorView<'a> {
        TensorView::new(dtype, shape.to_vec(), data).unwrap()
    }

    /// Dense BF16 or F32 in: the quantizers' own bytes; a pair shares `quantize_gate_up`'s
    /// scale; the parts re-arriving pre-quantized are kept as they are.
    #[test]
    fn slots_store_the_contracts_bytes() {
        let (rows, cols) = (48, 64);
        let (g, u) = (values(rows, cols, 1), values(rows, cols, 2));
        let gf: Vec<f32> = g.iter().map(|v| v.to_f32()).collect();
        let uf: Vec<f32> = u.iter().map(|v| v.to_f32() * 40.0).collect();
        for w in [DenseWeight::Bf16(g.clone()), DenseWeight::F32(gf.clone())] {
            let mx = slot("m", Format::Mxfp8, None).quantize(w.clone(), None);
            let want = mxfp8::quantize_rowwise(&gf, rows, cols).unwrap();
            assert_eq!(mx.unwrap(), Stored::Mxfp8(want));
            for four_over_six in [None, Some(FourOverSix::default())] {
                let mut s = slot("m", Format::Nvfp4, None);
                s.format.four_over_six = four_over_six;
                let granularity = ScaleGranularity::PerTensor;
                let opts = Nvfp4Options {
                    granularity,
                    four_over_six,
                };
                let want = nvfp4::quantize(&gf, rows, cols, &opts).unwrap();
                assert_eq!(s.quantize(w.clone(), None).unwrap(), Stored::Nvfp4(want));
            }
            let dense = slot("m", Format::Bf16, None).quantize(w, None).unwrap();
            assert_eq!(
                &*dense.parts()[0].data,
                bytemuck::cast_slice::<bf16, u8>(&g)
            );
        }

        let (want_g, want_u) = nvfp4::quantize_gate_up(&gf, &uf, rows, cols, None).unwrap();
        let (gate, up) = ("experts.0.gate_proj", "experts.0.up_proj");
        let format = slot(gate, Format::Nvfp4, None).format;
        assert!(Pair::of(gate, format, up, Format::Mxfp8).is_none());
        let pair = Pair::of(gate, format, up, Format::Nvfp4);
        let up_bytes: Vec<u8> = uf.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut batch = BTreeMap::new();
        for (m, w) in [
            (
                gate,
                view(Dtype::BF16, &[rows, cols], bytemuck::cast_slice(&g)),
            ),
            (up, view(Dtype::F32, &[rows, cols], &up_bytes)),
        ] {
            let s = slot(m, Format::Nvfp4, pair.clone());
            batch.insert(m.to_string(), (s, Parts::from([("weight", w)])));
        }
        let stored = prepare_all(&batch).unwrap();
        assert_eq!(stored[0].1, Stored::Nvfp4(want_g.clone()));
        assert_eq!(stored[1].1, Stored::Nvfp4(want_u));

        let parts = stored[0].1.parts();
        let got: Vec<_> = parts
            .iter()
            .map(|p| (p.suffix, p.dtype, p.shape.clone()))
            .collect();
        assert_eq!(
            got,
            [
                ("weight", Dtype::U8, vec![rows, cols / 2]),
                ("weight_scale", Dtype::F8_E4M3, vec![rows, cols / 16]),
                ("weight_scale_2", Dtype::F32, vec![]),
                ("input_scale", Dtype::F32, vec![]),
            ]
        );
        assert_eq!(&*parts[3].data, 1f32.to_le_bytes());
        let arriving: Parts<'_> = parts
            .iter()
            .map(|p| (p.suffix, view(p.dtype, &p.shape, &p.data)))
            .collect();
        assert_eq!(
            dense_shape(Format::Nvfp4, &arriving["weight"]),
            vec![rows, cols]
        );
        let again = batch[gate].0.prepare(&arriving, None).unwrap();
        assert_eq!(again, Stored::Nvfp4(want_g));

        // One half alone: the error names the missing other half.
        batch.remove(up);
        assert_eq!(
            prepare_all(&batch).unwrap_err().name,
            format!("{up}.weight")
        );
    }

    /// Names split into module and part, formats follow the parts; an unknown part, a wrong
    /// dtype or shape, or a missing part is an error naming the tensor.
    #[test]
    fn parts_are_checked_by_name() {
        assert_eq!(split("a.b.weight_scale_2"), Some(("a.b", "weight_scale_2")));
        assert_eq!(split("a.bweight"), None);
        let names = ["weight", "weight_scale", "weight_scale_2", "input_scale"];
        assert_eq!(format_from_parts(|s| names.contains(&s)), Format::Nvfp4);
        assert_eq!(format_from_parts(|s| names[..2].contains(&s)), Format::Bf16);

        let mx = slot("m.q_proj", Format::Mxfp8, None);
        let err = mx.check("weight_scale_2", Dtype::F32, &[]).unwrap_err();
        assert_eq!(err.name, "m.q_proj.weight_scale_2");
        let err = mx.check("weight", Dtype::BF16, &[64, 48]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("tensor `m.q_proj.weight`: shape"),
            "{err}"
        );
        let err = mx
            .check("weight_scale_inv", Dtype::F32, &[48, 2])
            .unwrap_err();
        assert!(err.reason.contains("dtype F32"), "{err}");
        mx.check("weight_scale_inv", Dtype::U8, &[48, 2]).unwrap();
        slot("m", Format::Nvfp4, None)
            .check("input_scale", Dtype::F32, &[1])
            .unwrap();

        let weight = [0u8; 48 * 64];
        let only_weight = Parts::from([("weight", view(Dtype::F8_E4M3, &[48, 64], &weight))]);
        let err = mx.prepare(&only_weight, None).unwrap_err();
        assert_eq!(err.name, "m.q_proj.weight_scale_inv", "{err}");
        let norm = Slot {
            shape: vec![64],
            ..slot("m.norm", Format::Bf16, None)
        };
        let err = norm
            .quantize(DenseWeight::F32(vec![1.0; 3]), None)
            .unwrap_err();
        assert_eq!(err.name, "m.norm.weight");
    }
}
