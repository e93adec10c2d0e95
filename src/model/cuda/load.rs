//! Loading a checkpoint straight into GPU memory: tensor by tensor from the memory-mapped
//! safetensors shards, each uploaded as its raw bytes and turned into its served format on the
//! device, so the host never holds more than about one tensor.
//!
//! The result equals, byte for byte, [`CudaWeights::upload`] of the CPU loader's model: the
//! same names, shapes, format decisions ([`crate::model::loader`]'s shared helpers) and the
//! device twins of its arithmetic (block-FP8 dequantization, the contract's MXFP8 and NVFP4
//! quantizers, whose bytes equal the `quant` module's).

use cudarc::driver::CudaSlice;
use safetensors::tensor::Dtype;

use super::{assemble, CudaWeights, DeviceSource};
use crate::backend::cuda::ops::{self, Nvfp4Out, Nvfp4Params, Table, WeightData};
use crate::backend::cuda::weights::{Activation, GpuMatrix};
use crate::backend::cuda::{CudaError, Gpu};
use crate::checkpoint::to_f32;
use crate::model::layout::Place;
use crate::model::loader::{
    checked_tensor, fp8_scale_inv, gate_up_shares_level, linear_format, lm_head_is_embedding,
    prequantized_parts, tensor_err, LoadError, Prequantized, ServingCheckpoint,
};
use crate::quant::nvfp4::{ScaleGranularity, SecondLevel};
use crate::quant::{Format, TensorFormat};

#[derive(Debug, thiserror::Error)]
pub enum DeviceLoadError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

impl From<crate::checkpoint::CheckpointError> for DeviceLoadError {
    fn from(e: crate::checkpoint::CheckpointError) -> Self {
        DeviceLoadError::Load(e.into())
    }
}

/// A high-precision matrix on the device: the CPU loader's `DenseWeight`.
enum DeviceDense {
    Bf16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

/// One `[rows, k]` matrix in its served format, before it joins its stack.
enum Part {
    Dense(DeviceDense),
    Mxfp8 {
        data: CudaSlice<u8>,
        scales: CudaSlice<u8>,
    },
    Nvfp4 {
        data: CudaSlice<u8>,
        scales: CudaSlice<u8>,
        s_dec: f32,
        act: Activation,
    },
}

/// The activation an NVFP4 layer of format `fmt` quantizes its input with (as the CPU's
/// `Nvfp4Linear` carries it).
fn nvfp4_activation(fmt: &TensorFormat) -> Activation {
    Activation::Nvfp4 {
        per_token: fmt.activation_scale == ScaleGranularity::PerToken,
        params: Nvfp4Params::from_four_over_six(fmt.four_over_six),
    }
}

struct DeviceLoader<'a> {
    gpu: &'a Gpu,
    src: &'a ServingCheckpoint,
}

impl DeviceLoader<'_> {
    fn format(&self, module: &str, cols: usize) -> TensorFormat {
        linear_format(&self.src.recipe, module, self.src.config.num_layers, cols)
    }

    /// Tensor `name` `[rows, cols]` in high precision on the device (block FP8 dequantized
    /// there); the CPU loader's `WeightSource::dense`.
    fn dense(&self, name: &str, rows: usize, cols: usize) -> Result<DeviceDense, DeviceLoadError> {
        let (gpu, ckpt) = (self.gpu, &self.src.ckpt);
        let t = checked_tensor(ckpt, name, &[rows, cols])?;
        Ok(match t.dtype() {
            Dtype::BF16 => {
                // The view may be unaligned for u16: one tensor's copy on the host.
                let bits: Vec<u16> = t
                    .data()
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
                DeviceDense::Bf16(gpu.upload(&bits)?)
            }
            Dtype::F32 | Dtype::F16 => DeviceDense::F32(gpu.upload(&to_f32(name, &t)?)?),
            Dtype::F8_E4M3 => {
                let Some(block) = self.src.fp8_block else {
                    return Err(tensor_err(
                        name,
                        "F8_E4M3 weight without a block-FP8 quantization_config",
                    )
                    .into());
                };
                let scale = fp8_scale_inv(ckpt, name)?;
                let want = rows.div_ceil(block.0.max(1)) * cols.div_ceil(block.1.max(1));
                if block.0 == 0 || block.1 == 0 || scale.len() != want {
                    return Err(tensor_err(
                        name,
                        format!(
                            "weight_scale_inv has {} elements, expected {want} for block {block:?}",
                            scale.len()
                        ),
                    )
                    .into());
                }
                let q = gpu.upload(t.data())?;
                let s = gpu.upload(&scale)?;
                let mut out = gpu.alloc::<f32>(rows * cols)?;
                ops::fp8_block_dequantize(gpu, &q, &s, rows, cols, block, &mut out)?;
                DeviceDense::F32(out)
            }
            other => {
                return Err(
                    tensor_err(name, format!("dtype {other:?} is not a weight dtype")).into(),
                )
            }
        })
    }

    fn vector(&self, name: &str, len: usize) -> Result<CudaSlice<f32>, DeviceLoadError> {
        let t = checked_tensor(&self.src.ckpt, name, &[len])?;
        Ok(self.gpu.upload(&to_f32(name, &t)?)?)
    }

    /// NaN-skipping amax of a dense matrix (the `quant` module's `parallel_amax`).
    fn amax(&self, w: &DeviceDense, n: usize) -> Result<f32, CudaError> {
        let mut buf = self.gpu.alloc::<u32>(2)?;
        match w {
            DeviceDense::Bf16(x) => ops::amax(self.gpu, x, n, &mut buf)?,
            DeviceDense::F32(x) => ops::amax(self.gpu, x, n, &mut buf)?,
        }
        Ok(ops::amax_value(&self.gpu.download(&buf, 2)?, n))
    }

    /// Quantizes a dense matrix into `fmt` on the device (`make_linear`'s job). `shared_amax`:
    /// the gate/up pair's joint amax, else the matrix's own.
    fn quantize(
        &self,
        w: DeviceDense,
        rows: usize,
        cols: usize,
        fmt: &TensorFormat,
        shared_amax: Option<f32>,
    ) -> Result<Part, CudaError> {
        let gpu = self.gpu;
        let n = rows * cols;
        Ok(match fmt.format {
            Format::Bf16 => Part::Dense(w),
            Format::Mxfp8 => {
                let (mut data, mut scales) = (gpu.alloc::<u8>(n)?, gpu.alloc::<u8>(n / 32)?);
                match &w {
                    DeviceDense::Bf16(x) => {
                        ops::mxfp8_quantize(gpu, x, n, &mut data, &mut scales, None)?
                    }
                    DeviceDense::F32(x) => {
                        ops::mxfp8_quantize(gpu, x, n, &mut data, &mut scales, None)?
                    }
                }
                Part::Mxfp8 { data, scales }
            }
            Format::Nvfp4 => {
                let params = Nvfp4Params::from_four_over_six(fmt.four_over_six);
                let amax = match shared_amax {
                    Some(a) => a,
                    None => self.amax(&w, n)?,
                };
                let (mut data, mut scales) = (gpu.alloc::<u8>(n / 2)?, gpu.alloc::<u8>(n / 16)?);
                match &w {
                    DeviceDense::Bf16(x) => ops::nvfp4_quantize_bf16(
                        gpu,
                        x,
                        rows,
                        cols,
                        amax,
                        params,
                        &mut data,
                        &mut scales,
                    )?,
                    DeviceDense::F32(x) => {
                        // The f32 quantizer reads a per-tensor amax from the device, in
                        // `ops::amax`'s layout: [bits, any number].
                        let tensor_amax = gpu.upload(&[amax.to_bits(), !amax.is_nan() as u32])?;
                        let mut row_s_dec = gpu.alloc::<f32>(rows)?;
                        ops::nvfp4_quantize_f32(
                            gpu,
                            x,
                            rows,
                            cols,
                            false,
                            Some(&tensor_amax),
                            params,
                            Nvfp4Out {
                                data: &mut data,
                                scales: &mut scales,
                                row_s_dec: &mut row_s_dec,
                                deq: None,
                                words: None,
                            },
                        )?
                    }
                }
                Part::Nvfp4 {
                    data,
                    scales,
                    s_dec: SecondLevel::from_amax(amax, params.range).s_dec,
                    act: nvfp4_activation(fmt),
                }
            }
        })
    }

    /// Linear layer `module` `[rows, cols]`: as stored if the checkpoint has it quantized,
    /// else dense and quantized into the recipe's format (the CPU `Builder::linear`).
    fn linear(
        &self,
        module: &str,
        rows: usize,
        cols: usize,
        shared_amax: Option<f32>,
    ) -> Result<Part, DeviceLoadError> {
        let fmt = self.format(module, cols);
        if let Some(p) = prequantized_parts(&self.src.ckpt, module, rows, cols)? {
            return Ok(match p {
                Prequantized::Nvfp4 {
                    data,
                    scales,
                    s_dec,
                } => Part::Nvfp4 {
                    data: self.gpu.upload(data)?,
                    scales: self.gpu.upload(scales)?,
                    s_dec,
                    act: nvfp4_activation(&fmt),
                },
                Prequantized::Mxfp8 { data, scales } => Part::Mxfp8 {
                    data: self.gpu.upload(data)?,
                    scales: self.gpu.upload(scales)?,
                },
            });
        }
        let w = self.dense(&format!("{module}.weight"), rows, cols)?;
        let shared = shared_amax.filter(|_| fmt.format == Format::Nvfp4);
        Ok(self.quantize(w, rows, cols, &fmt, shared)?)
    }

    /// A BF16-format matrix from a dense tensor (router, lm_head: never quantized).
    fn plain(&self, name: &str, rows: usize, cols: usize) -> Result<GpuMatrix, DeviceLoadError> {
        let mut s = Stack::new(1, rows, cols, 1);
        s.push(self.gpu, Part::Dense(self.dense(name, rows, cols)?), rows)?;
        Ok(s.finish(self.gpu)?)
    }

    fn single(&self, module: &str, rows: usize, cols: usize) -> Result<GpuMatrix, DeviceLoadError> {
        let mut s = Stack::new(1, rows, cols, 1);
        s.push(self.gpu, self.linear(module, rows, cols, None)?, rows)?;
        Ok(s.finish(self.gpu)?)
    }

    /// The SwiGLUs `prefixes` (a dense MLP, or every expert of a layer) as a gate+up stack and
    /// a down stack; an NVFP4 gate/up pair quantized at load shares one second-level scale.
    fn swiglu(
        &self,
        prefixes: &[String],
        hidden: usize,
        inter: usize,
    ) -> Result<(GpuMatrix, GpuMatrix), DeviceLoadError> {
        let gpu = self.gpu;
        let mut gate_up = Stack::new(prefixes.len(), 2 * inter, hidden, 2);
        let mut down = Stack::new(prefixes.len(), hidden, inter, 1);
        for p in prefixes {
            let (g, u, d) = (
                format!("{p}.gate_proj"),
                format!("{p}.up_proj"),
                format!("{p}.down_proj"),
            );
            let (gf, uf) = (self.format(&g, hidden), self.format(&u, hidden));
            let stored = self.src.ckpt.contains(&format!("{g}.weight_scale_2"));
            if gate_up_shares_level(&gf, &uf, stored) {
                let gw = self.dense(&format!("{g}.weight"), inter, hidden)?;
                let uw = self.dense(&format!("{u}.weight"), inter, hidden)?;
                let n = inter * hidden;
                let amax = self.amax(&gw, n)?.max(self.amax(&uw, n)?);
                gate_up.push(
                    gpu,
                    self.quantize(gw, inter, hidden, &gf, Some(amax))?,
                    inter,
                )?;
                gate_up.push(
                    gpu,
                    self.quantize(uw, inter, hidden, &uf, Some(amax))?,
                    inter,
                )?;
            } else {
                gate_up.push(gpu, self.linear(&g, inter, hidden, None)?, inter)?;
                gate_up.push(gpu, self.linear(&u, inter, hidden, None)?, inter)?;
            }
            down.push(gpu, self.linear(&d, hidden, inter, None)?, hidden)?;
        }
        Ok((gate_up.finish(gpu)?, down.finish(gpu)?))
    }
}

/// A stack of `experts` matrices `[n, k]`, each `groups` parts along n, filled part by part
/// into buffers allocated once at the first part (so the device holds the stack plus one
/// part, never two stacks). Every part must share the first one's storage, as
/// [`GpuMatrix::upload`] requires.
struct Stack {
    experts: usize,
    n: usize,
    k: usize,
    groups: usize,
    /// Elements written so far.
    at: usize,
    data: Option<WeightData>,
    s_dec: Vec<f32>,
    act: Activation,
}

impl Stack {
    fn new(experts: usize, n: usize, k: usize, groups: usize) -> Stack {
        Stack {
            experts,
            n,
            k,
            groups,
            at: 0,
            data: None,
            s_dec: Vec::new(),
            act: Activation::Plain,
        }
    }

    fn mixed() -> CudaError {
        CudaError::Unsupported(
            "one GEMM over layers of different formats or shapes (recipe splits a stack)".into(),
        )
    }

    fn push(&mut self, gpu: &Gpu, part: Part, rows: usize) -> Result<(), CudaError> {
        let total = self.experts * self.n * self.k;
        let m = rows * self.k;
        let (a, b) = (self.at, self.at + m);
        if b > total {
            return Err(CudaError::Capacity(format!(
                "a weight stack of {total} elements given {b}"
            )));
        }
        if self.data.is_none() {
            self.data = Some(match &part {
                Part::Dense(DeviceDense::Bf16(_)) => WeightData::Bf16(gpu.alloc(total)?),
                Part::Dense(DeviceDense::F32(_)) => WeightData::F32(gpu.alloc(total)?),
                Part::Mxfp8 { .. } => WeightData::Mxfp8 {
                    data: gpu.alloc(total)?,
                    scales: gpu.alloc(total / 32)?,
                },
                Part::Nvfp4 { .. } => WeightData::Nvfp4 {
                    data: gpu.alloc(total / 2)?,
                    scales: gpu.alloc(total / 16)?,
                    // Uploaded by `finish` once every part's S_dec is known.
                    s_dec: gpu.alloc(1)?,
                    groups: self.groups,
                },
            });
            self.act = match &part {
                Part::Dense(_) => Activation::Plain,
                Part::Mxfp8 { .. } => Activation::Mxfp8,
                Part::Nvfp4 { act, .. } => *act,
            };
        }
        let st = &gpu.stream;
        match (self.data.as_mut().expect("allocated above"), part) {
            (WeightData::Bf16(all), Part::Dense(DeviceDense::Bf16(p))) => {
                st.memcpy_dtod(&p.slice(0..m), &mut all.slice_mut(a..b))?
            }
            (WeightData::F32(all), Part::Dense(DeviceDense::F32(p))) => {
                st.memcpy_dtod(&p.slice(0..m), &mut all.slice_mut(a..b))?
            }
            (WeightData::Mxfp8 { data, scales }, Part::Mxfp8 { data: d, scales: s }) => {
                st.memcpy_dtod(&d.slice(0..m), &mut data.slice_mut(a..b))?;
                st.memcpy_dtod(&s.slice(0..m / 32), &mut scales.slice_mut(a / 32..b / 32))?;
            }
            (
                WeightData::Nvfp4 { data, scales, .. },
                Part::Nvfp4 {
                    data: d,
                    scales: s,
                    s_dec,
                    ..
                },
            ) => {
                st.memcpy_dtod(&d.slice(0..m / 2), &mut data.slice_mut(a / 2..b / 2))?;
                st.memcpy_dtod(&s.slice(0..m / 16), &mut scales.slice_mut(a / 16..b / 16))?;
                self.s_dec.push(s_dec);
            }
            _ => return Err(Self::mixed()),
        }
        self.at = b;
        Ok(())
    }

    fn finish(self, gpu: &Gpu) -> Result<GpuMatrix, CudaError> {
        let total = self.experts * self.n * self.k;
        if self.at != total {
            return Err(CudaError::Capacity(format!(
                "a weight stack of {total} elements got {}",
                self.at
            )));
        }
        let mut data = self
            .data
            .ok_or_else(|| CudaError::Unsupported("an empty weight stack".into()))?;
        if let WeightData::Nvfp4 { s_dec, .. } = &mut data {
            *s_dec = gpu.upload(&self.s_dec)?;
        }
        Ok(GpuMatrix {
            experts: self.experts,
            n: self.n,
            k: self.k,
            data,
            act: self.act,
        })
    }
}

/// A copy of the embedding table as a BF16-format matrix: lm_head when it is the embedding
/// (what uploading the CPU model's lm_head gives).
fn table_matrix(
    gpu: &Gpu,
    table: &Table,
    rows: usize,
    cols: usize,
) -> Result<GpuMatrix, CudaError> {
    let data = match table {
        Table::Bf16(t) => WeightData::Bf16(gpu.stream.clone_dtod(t)?),
        Table::F32(t) => WeightData::F32(gpu.stream.clone_dtod(t)?),
    };
    Ok(GpuMatrix {
        experts: 1,
        n: rows,
        k: cols,
        data,
        act: Activation::Plain,
    })
}

impl DeviceSource for DeviceLoader<'_> {
    type Error = DeviceLoadError;

    /// The layer's checkpoint pages leave the resident set: loading holds about one layer
    /// of the mapped file on the host, not the whole model.
    fn layer_done(&self) {
        self.src.ckpt.release_pages();
    }

    fn embedding(&self, place: Place, rows: usize, cols: usize) -> Result<Table, Self::Error> {
        Ok(match self.dense(&place.name(), rows, cols)? {
            DeviceDense::Bf16(t) => Table::Bf16(t),
            DeviceDense::F32(t) => Table::F32(t),
        })
    }

    fn vector(&self, place: Place, len: usize) -> Result<CudaSlice<f32>, Self::Error> {
        DeviceLoader::vector(self, &place.name(), len)
    }

    fn plain(&self, place: Place, rows: usize, cols: usize) -> Result<GpuMatrix, Self::Error> {
        DeviceLoader::plain(self, &place.name(), rows, cols)
    }

    fn linear(&self, place: Place, rows: usize, cols: usize) -> Result<GpuMatrix, Self::Error> {
        self.single(&place.module(), rows, cols)
    }

    fn swiglu(
        &self,
        prefixes: &[String],
        hidden: usize,
        inter: usize,
    ) -> Result<(GpuMatrix, GpuMatrix), Self::Error> {
        DeviceLoader::swiglu(self, prefixes, hidden, inter)
    }

    /// As the host loader: the table's copy when tied or the checkpoint has no lm_head.
    fn lm_head(&self, table: &Table) -> Result<Option<GpuMatrix>, Self::Error> {
        let cfg = &self.src.config;
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        Ok(Some(if lm_head_is_embedding(cfg, Some(&self.src.ckpt)) {
            table_matrix(self.gpu, table, v, h)?
        } else {
            DeviceLoader::plain(self, &Place::LmHead.name(), v, h)?
        }))
    }
}

impl CudaWeights {
    /// Loads an opened checkpoint straight into device memory (see the module doc).
    pub fn from_checkpoint(
        gpu: &Gpu,
        src: &ServingCheckpoint,
    ) -> Result<CudaWeights, DeviceLoadError> {
        assemble(gpu, &src.config, &DeviceLoader { gpu, src })
    }
}
