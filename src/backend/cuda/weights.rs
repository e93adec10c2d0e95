//! Weights in GPU memory: every linear layer (or a layer's stack of experts) as one
//! [`GpuMatrix`] in its storage format, and its upload from CPU layers (checkpoints of every
//! format, quantized byte-identically by the `quant` module). Loading from checkpoints and
//! dummy weights drawn on the device live with the model (`model::cuda`).

use super::ops::{Nvfp4Params, WeightData};
use super::{CudaError, Gpu};
use crate::backend::{Linear, Storage};
use crate::quant::nvfp4::ScaleGranularity;

/// How a layer's input is quantized before its GEMM (follows the weight format).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    Plain,
    Mxfp8,
    Nvfp4 {
        per_token: bool,
        params: Nvfp4Params,
    },
}

/// `experts` matrices of `[n, k]` (one for a dense layer), stacked.
pub struct GpuMatrix {
    pub experts: usize,
    pub n: usize,
    pub k: usize,
    pub data: WeightData,
    pub act: Activation,
}

impl GpuMatrix {
    pub fn bytes(&self) -> usize {
        match &self.data {
            WeightData::F32(d) => d.len() * 4,
            WeightData::Bf16(d) => d.len() * 2,
            WeightData::Mxfp8 { data, scales } => data.len() + scales.len(),
            WeightData::Nvfp4 {
                data,
                scales,
                s_dec,
                ..
            } => data.len() + scales.len() + s_dec.len() * 4,
        }
    }

    /// Uploads CPU layers: matrix e is `parts[e]` concatenated along the output dimension
    /// (e.g. `[gate, up]`). All parts must share one storage format.
    pub fn upload(gpu: &Gpu, parts: &[Vec<&dyn Linear>]) -> Result<GpuMatrix, CudaError> {
        let first = parts
            .first()
            .and_then(|p| p.first())
            .ok_or_else(|| CudaError::Unsupported("an empty weight stack".into()))?;
        let k = first.in_features();
        let n: usize = parts[0].iter().map(|l| l.out_features()).sum();
        let groups = parts[0].len();
        let mixed = || {
            CudaError::Unsupported(
                "one GEMM over layers of different formats or shapes (recipe splits a stack)"
                    .into(),
            )
        };
        for p in parts {
            if p.iter().map(|l| l.out_features()).sum::<usize>() != n
                || p.iter()
                    .any(|l| l.in_features() != k || l.format() != first.format())
            {
                return Err(mixed());
            }
        }
        let all = parts.iter().flatten();
        let (data, act) = match first.storage() {
            Storage::F32(_) => {
                let mut host = Vec::with_capacity(parts.len() * n * k);
                for l in all {
                    let Storage::F32(w) = l.storage() else {
                        return Err(mixed());
                    };
                    host.extend_from_slice(w);
                }
                (WeightData::F32(gpu.upload(&host)?), Activation::Plain)
            }
            Storage::Bf16(_) => {
                let mut host = Vec::with_capacity(parts.len() * n * k);
                for l in all {
                    let Storage::Bf16(w) = l.storage() else {
                        return Err(mixed());
                    };
                    host.extend(w.iter().map(|v| v.to_bits()));
                }
                (WeightData::Bf16(gpu.upload(&host)?), Activation::Plain)
            }
            Storage::Mxfp8(_) => {
                let (mut data, mut scales) = (Vec::new(), Vec::new());
                for l in all {
                    let Storage::Mxfp8(t) = l.storage() else {
                        return Err(mixed());
                    };
                    data.extend_from_slice(&t.data);
                    scales.extend_from_slice(&t.scales);
                }
                (
                    WeightData::Mxfp8 {
                        data: gpu.upload(&data)?,
                        scales: gpu.upload(&scales)?,
                    },
                    Activation::Mxfp8,
                )
            }
            Storage::Nvfp4 {
                activation_scale,
                four_over_six,
                ..
            } => {
                let (mut data, mut scales, mut s_dec) = (Vec::new(), Vec::new(), Vec::new());
                for l in all {
                    let Storage::Nvfp4 { weight, .. } = l.storage() else {
                        return Err(mixed());
                    };
                    data.extend_from_slice(&weight.data);
                    scales.extend_from_slice(&weight.scales);
                    s_dec.push(weight.global.of_row(0));
                }
                (
                    WeightData::Nvfp4 {
                        data: gpu.upload(&data)?,
                        scales: gpu.upload(&scales)?,
                        s_dec: gpu.upload(&s_dec)?,
                        groups,
                    },
                    Activation::Nvfp4 {
                        per_token: activation_scale == ScaleGranularity::PerToken,
                        params: Nvfp4Params::from_four_over_six(four_over_six),
                    },
                )
            }
        };
        Ok(GpuMatrix {
            experts: parts.len(),
            n,
            k,
            data,
            act,
        })
    }
}
