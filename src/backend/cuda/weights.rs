//! Weights in GPU memory: every linear layer (or a layer's stack of experts) as one
//! [`GpuMatrix`] in its storage format. Built either by uploading a model the CPU loader built
//! (checkpoints of every format, quantized byte-identically by the `quant` module), or by
//! drawing dummy weights on the device and quantizing them there with the contract's kernels
//! (`--load-format dummy`, so full-size models need no host copy).

use cudarc::driver::CudaSlice;

use super::ops::{self, Nvfp4Params, WeightData};
use super::{CudaError, Gpu};
use crate::backend::{Linear, Storage};
use crate::model::loader::{dummy_bound, dummy_key};
use crate::quant::nvfp4::{ScaleGranularity, SecondLevel};
use crate::quant::{Format, TensorFormat};

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

/// Draws dummy weights on the device: the same values as `loader::dummy_model` on the CPU,
/// quantized by the GPU quantizers into the recipe's format.
pub struct DummyWeights<'a> {
    pub gpu: &'a Gpu,
    pub seed: u64,
}

impl DummyWeights<'_> {
    /// One BF16 tensor `[rows, cols]` with fan-in `cols`.
    pub fn bf16(&self, name: &str, rows: usize, cols: usize) -> Result<CudaSlice<u16>, CudaError> {
        let mut out = self.gpu.alloc::<u16>(rows * cols)?;
        ops::dummy_fill_bf16(
            self.gpu,
            &mut out,
            rows * cols,
            dummy_key(self.seed, name),
            dummy_bound(cols),
        )?;
        Ok(out)
    }

    /// A stack like [`GpuMatrix::upload`]'s: matrix e is the tensors `parts[e]` (name, rows),
    /// each `[rows, k]`, in format `fmt`. `share_level`: NVFP4 parts of one matrix share one
    /// second-level scale (gate and up), as the CPU loader does.
    pub fn matrix(
        &self,
        parts: &[Vec<(String, usize)>],
        k: usize,
        fmt: &TensorFormat,
        share_level: bool,
    ) -> Result<GpuMatrix, CudaError> {
        let gpu = self.gpu;
        let n: usize = parts[0].iter().map(|p| p.1).sum();
        let groups = parts[0].len();
        let total = parts.len() * n * k;
        let act = match fmt.format {
            Format::Bf16 => Activation::Plain,
            Format::Mxfp8 => Activation::Mxfp8,
            Format::Nvfp4 => Activation::Nvfp4 {
                per_token: fmt.activation_scale == ScaleGranularity::PerToken,
                params: Nvfp4Params::from_four_over_six(fmt.four_over_six),
            },
        };
        let data = match fmt.format {
            Format::Bf16 => {
                let mut all = gpu.alloc::<u16>(total)?;
                let mut at = 0;
                for (name, rows) in parts.iter().flatten() {
                    let t = self.bf16(name, *rows, k)?;
                    gpu.stream
                        .memcpy_dtod(&t, &mut all.slice_mut(at..at + rows * k))?;
                    at += rows * k;
                }
                WeightData::Bf16(all)
            }
            Format::Mxfp8 => {
                let mut data = gpu.alloc::<u8>(total)?;
                let mut scales = gpu.alloc::<u8>(total / 32)?;
                let mut at = 0;
                for (name, rows) in parts.iter().flatten() {
                    let t = self.bf16(name, *rows, k)?;
                    let m = rows * k;
                    let (mut d, mut s) = (gpu.alloc::<u8>(m)?, gpu.alloc::<u8>(m / 32)?);
                    ops::mxfp8_quantize(gpu, &t, m, &mut d, &mut s, None)?;
                    gpu.stream
                        .memcpy_dtod(&d, &mut data.slice_mut(at..at + m))?;
                    gpu.stream
                        .memcpy_dtod(&s, &mut scales.slice_mut(at / 32..(at + m) / 32))?;
                    at += m;
                }
                WeightData::Mxfp8 { data, scales }
            }
            Format::Nvfp4 => {
                let params = Nvfp4Params::from_four_over_six(fmt.four_over_six);
                let mut data = gpu.alloc::<u8>(total / 2)?;
                let mut scales = gpu.alloc::<u8>(total / 16)?;
                let mut s_dec = Vec::with_capacity(parts.len() * groups);
                let mut amax_buf = gpu.alloc::<u32>(2)?;
                let mut at = 0;
                for matrix in parts {
                    let tensors = matrix
                        .iter()
                        .map(|(name, rows)| self.bf16(name, *rows, k))
                        .collect::<Result<Vec<_>, _>>()?;
                    let mut amaxes = Vec::with_capacity(tensors.len());
                    for (t, (_, rows)) in tensors.iter().zip(matrix) {
                        ops::amax(gpu, t, rows * k, &mut amax_buf)?;
                        amaxes.push(ops::amax_value(&gpu.download(&amax_buf, 2)?, rows * k));
                    }
                    // The CPU loader's gate/up scale (`nvfp4::gate_up_level`): the joint amax
                    // over the recipe's second-level range (6 x the E4M3 range with
                    // four-over-six, 2688 without).
                    let shared = share_level.then(|| amaxes.iter().fold(0f32, |a, &b| a.max(b)));
                    for ((t, (_, rows)), a) in tensors.iter().zip(matrix).zip(&amaxes) {
                        let amax = shared.unwrap_or(*a);
                        s_dec.push(SecondLevel::from_amax(amax, params.range).s_dec);
                        let m = rows * k;
                        let (mut d, mut s) = (gpu.alloc::<u8>(m / 2)?, gpu.alloc::<u8>(m / 16)?);
                        ops::nvfp4_quantize_bf16(gpu, t, *rows, k, amax, params, &mut d, &mut s)?;
                        gpu.stream
                            .memcpy_dtod(&d, &mut data.slice_mut(at / 2..(at + m) / 2))?;
                        gpu.stream
                            .memcpy_dtod(&s, &mut scales.slice_mut(at / 16..(at + m) / 16))?;
                        at += m;
                    }
                }
                WeightData::Nvfp4 {
                    data,
                    scales,
                    s_dec: gpu.upload(&s_dec)?,
                    groups,
                }
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
