//! `lockstep quantize`: the contract as a tool. Every 2-D BF16/F16/F32 tensor `X` of a
//! safetensors file becomes `X.data`, `X.scale` (and `X.global_scale` for NVFP4), unswizzled
//! and row-major, so other trainers can check their quantizers against ours byte for byte.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::Dtype;

use crate::checkpoint::{to_f32, write_file, CheckpointError, OwnedTensor, SafetensorsFile};
use crate::quant::{
    self, FourOverSix, GlobalScale, Nvfp4Options, ScaleGranularity, MXFP8_BLOCK, NVFP4_BLOCK,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum QuantFormat {
    Mxfp8,
    Nvfp4,
    #[value(name = "nvfp4-per-token")]
    Nvfp4PerToken,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantizeOptions {
    pub format: QuantFormat,
    pub four_over_six: Option<FourOverSix>,
    /// MXFP8 only: 32x1 blocks along dim 0.
    pub columnwise: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("{0}")]
    Options(String),
}

/// Checks every tensor first, then quantizes and writes; on any error nothing is written.
pub fn quantize_file(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
) -> Result<usize, QuantizeError> {
    if opts.columnwise && opts.format != QuantFormat::Mxfp8 {
        return Err(QuantizeError::Options(
            "--columnwise applies to --format mxfp8 only".into(),
        ));
    }
    if opts.four_over_six.is_some() && opts.format == QuantFormat::Mxfp8 {
        return Err(QuantizeError::Options(
            "--four-over-six applies to nvfp4 formats only".into(),
        ));
    }
    let file = SafetensorsFile::open(input)?;
    let st = file.view()?;
    let mut names: Vec<&str> = st.names();
    names.sort();
    for name in &names {
        let t = st.tensor(name).map_err(|e| CheckpointError::Tensor {
            name: name.to_string(),
            reason: e.to_string(),
        })?;
        check_tensor(name, t.dtype(), t.shape(), opts)?;
    }
    let mut out = BTreeMap::new();
    for name in &names {
        let t = st.tensor(name).map_err(|e| CheckpointError::Tensor {
            name: name.to_string(),
            reason: e.to_string(),
        })?;
        let (rows, cols) = (t.shape()[0], t.shape()[1]);
        let x = to_f32(name, &t)?;
        for (suffix, tensor) in quantize_tensor(&x, rows, cols, opts) {
            out.insert(format!("{name}.{suffix}"), tensor);
        }
    }
    write_file(output, &out, None)?;
    Ok(names.len())
}

fn check_tensor(
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    opts: &QuantizeOptions,
) -> Result<(), QuantizeError> {
    let err = |reason: String| QuantizeError::Tensor {
        name: name.to_string(),
        reason,
    };
    if !matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
        return Err(err(format!("dtype {dtype:?} is not BF16, F16 or F32")));
    }
    if shape.len() != 2 {
        return Err(err(format!(
            "rank {} (shape {shape:?}); only 2-D tensors are quantized",
            shape.len()
        )));
    }
    let (rows, cols) = (shape[0], shape[1]);
    match opts.format {
        QuantFormat::Mxfp8 if opts.columnwise => {
            if rows % MXFP8_BLOCK != 0 {
                return Err(err(format!(
                    "first dim {rows} is not a multiple of {MXFP8_BLOCK} (columnwise MXFP8 block)"
                )));
            }
        }
        QuantFormat::Mxfp8 => {
            if cols % MXFP8_BLOCK != 0 {
                return Err(err(format!(
                    "last dim {cols} is not a multiple of {MXFP8_BLOCK} (MXFP8 block)"
                )));
            }
        }
        QuantFormat::Nvfp4 | QuantFormat::Nvfp4PerToken => {
            if cols % NVFP4_BLOCK != 0 {
                return Err(err(format!(
                    "last dim {cols} is not a multiple of {NVFP4_BLOCK} (NVFP4 block)"
                )));
            }
        }
    }
    Ok(())
}

/// The output tensors (suffix, tensor) of one checked input.
pub fn quantize_tensor(
    x: &[f32],
    rows: usize,
    cols: usize,
    opts: &QuantizeOptions,
) -> Vec<(&'static str, OwnedTensor)> {
    match opts.format {
        QuantFormat::Mxfp8 => {
            let q = if opts.columnwise {
                quant::mxfp8::quantize_columnwise(x, rows, cols)
            } else {
                quant::mxfp8::quantize_rowwise(x, rows, cols)
            }
            .expect("shape checked");
            let scale_shape = if opts.columnwise {
                vec![rows / MXFP8_BLOCK, cols]
            } else {
                vec![rows, cols / MXFP8_BLOCK]
            };
            vec![
                (
                    "data",
                    OwnedTensor::new(Dtype::U8, vec![rows, cols], q.data),
                ),
                ("scale", OwnedTensor::new(Dtype::U8, scale_shape, q.scales)),
            ]
        }
        QuantFormat::Nvfp4 | QuantFormat::Nvfp4PerToken => {
            let granularity = if opts.format == QuantFormat::Nvfp4 {
                ScaleGranularity::PerTensor
            } else {
                ScaleGranularity::PerToken
            };
            let q = quant::nvfp4::quantize(
                x,
                rows,
                cols,
                &Nvfp4Options {
                    granularity,
                    four_over_six: opts.four_over_six,
                },
            )
            .expect("shape checked");
            let global = match &q.global {
                GlobalScale::PerTensor(s) => OwnedTensor::f32(vec![], &[*s]),
                GlobalScale::PerToken(v) => OwnedTensor::f32(vec![rows], v),
            };
            vec![
                (
                    "data",
                    OwnedTensor::new(Dtype::U8, vec![rows, cols / 2], q.data),
                ),
                (
                    "scale",
                    OwnedTensor::new(Dtype::F8_E4M3, vec![rows, cols / NVFP4_BLOCK], q.scales),
                ),
                ("global_scale", global),
            ]
        }
    }
}
