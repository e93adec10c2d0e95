//! Dummy weights drawn on the device (`--load-format dummy`): the values
//! `loader::dummy_model(cfg, recipe, seed)` builds on the CPU, quantized there by the
//! contract's kernels, so full-size models need no host copy.

use cudarc::driver::CudaSlice;

use super::{assemble, CudaWeights, DeviceSource};
use crate::backend::cuda::ops::{self, Nvfp4Params, Table, WeightData};
use crate::backend::cuda::weights::{Activation, GpuMatrix};
use crate::backend::cuda::{CudaError, Gpu};
use crate::model::layout::shares_gate_up_scale;
use crate::model::layout::Place;
use crate::model::loader::{dummy_bound, dummy_key};
use crate::model::ModelConfig;
use crate::quant::nvfp4::{ScaleGranularity, SecondLevel};
use crate::quant::{Format, Recipe, TensorFormat};

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

/// The dummy generator as a model source: the recipe's formats, norms of ones.
struct DummySource<'a> {
    d: DummyWeights<'a>,
    cfg: &'a ModelConfig,
    recipe: &'a Recipe,
}

impl DummySource<'_> {
    fn format(&self, module: &str, cols: usize) -> TensorFormat {
        self.recipe
            .format_for(module, self.cfg.num_layers)
            .fitting(cols)
    }
}

impl DeviceSource for DummySource<'_> {
    type Error = CudaError;

    fn embedding(&self, place: Place, rows: usize, cols: usize) -> Result<Table, CudaError> {
        Ok(Table::Bf16(self.d.bf16(&place.name(), rows, cols)?))
    }

    fn vector(&self, _place: Place, len: usize) -> Result<CudaSlice<f32>, CudaError> {
        self.d.gpu.upload(&vec![1f32; len])
    }

    fn plain(&self, place: Place, rows: usize, cols: usize) -> Result<GpuMatrix, CudaError> {
        self.d.matrix(
            &[vec![(place.name(), rows)]],
            cols,
            &TensorFormat::BF16,
            false,
        )
    }

    fn linear(&self, place: Place, rows: usize, cols: usize) -> Result<GpuMatrix, CudaError> {
        let f = self.format(&place.module(), cols);
        self.d
            .matrix(&[vec![(place.name(), rows)]], cols, &f, false)
    }

    fn swiglu(
        &self,
        prefixes: &[String],
        hidden: usize,
        inter: usize,
    ) -> Result<(GpuMatrix, GpuMatrix), CudaError> {
        let (g, u) = (
            self.format(&format!("{}.gate_proj", prefixes[0]), hidden),
            self.format(&format!("{}.up_proj", prefixes[0]), hidden),
        );
        if g != u {
            return Err(CudaError::Unsupported(
                "gate and up in different formats".into(),
            ));
        }
        let gate_up: Vec<Vec<(String, usize)>> = prefixes
            .iter()
            .map(|p| {
                vec![
                    (format!("{p}.gate_proj.weight"), inter),
                    (format!("{p}.up_proj.weight"), inter),
                ]
            })
            .collect();
        let down: Vec<Vec<(String, usize)>> = prefixes
            .iter()
            .map(|p| vec![(format!("{p}.down_proj.weight"), hidden)])
            .collect();
        let df = self.format(&format!("{}.down_proj", prefixes[0]), inter);
        Ok((
            self.d.matrix(
                &gate_up,
                hidden,
                &g,
                shares_gate_up_scale(g.format, u.format),
            )?,
            self.d.matrix(&down, inter, &df, false)?,
        ))
    }

    fn lm_head(&self, _table: &Table) -> Result<Option<GpuMatrix>, CudaError> {
        let c = self.cfg;
        (!c.tie_word_embeddings)
            .then(|| self.plain(Place::LmHead, c.vocab_size, c.hidden_size))
            .transpose()
    }
}

impl CudaWeights {
    /// Dummy weights drawn on the device: the values `loader::dummy_model(cfg, recipe, seed)`
    /// builds on the CPU, in the same formats.
    pub fn dummy(
        gpu: &Gpu,
        cfg: &ModelConfig,
        recipe: &Recipe,
        seed: u64,
    ) -> Result<CudaWeights, CudaError> {
        let src = DummySource {
            d: DummyWeights { gpu, seed },
            cfg,
            recipe,
        };
        assemble(gpu, cfg, &src)
    }
}
