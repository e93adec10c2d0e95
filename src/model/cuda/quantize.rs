//! Dense BF16 tensors of a weight update quantized on the device into their slots' MXFP8 or
//! NVFP4 formats, byte for byte what the host's `slot::prepare_all` stores: the contract's
//! quantizer kernels (the ones loading uses), an NVFP4 tensor's second-level scale from its own
//! amax, or, for a gate/up pair, from the larger of its halves' amaxes. The stored parts are
//! hashed where they lie. A colocated trainer's or a pushed bucket's BF16 weights thus reach a
//! quantized server's slots without host memory or host quantization in between.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr};

use crate::backend::cuda::ops::{self, Nvfp4Params};
use crate::backend::cuda::{hash, CudaError, Gpu};
use crate::model::slots::{DeviceQuantized, DeviceTensor, Replacement};
use crate::quant::nvfp4::SecondLevel;
use crate::quant::slot::Slot;
use crate::quant::{Format, MXFP8_BLOCK, NVFP4_BLOCK};

/// One dense tensor on the device, bound for `slot`'s `weight`.
pub struct Dense {
    pub slot: Slot,
    pub values: CudaSlice<u16>,
}

/// Whether `slot`'s `weight` can be quantized here from a dense BF16 tensor: an MXFP8 or
/// NVFP4 matrix whose gate/up partner, if it shares a scale with one, has the same
/// four-over-six setting (the pair's scale is then the same whichever half sets it).
pub fn quantizes(slot: &Slot) -> bool {
    let format = slot.format.format;
    let (blocked, cols) = match slot.shape[..] {
        [_, cols] => (matches!(format, Format::Mxfp8 | Format::Nvfp4), cols),
        _ => (false, 0),
    };
    blocked
        && cols % MXFP8_BLOCK == 0
        && slot
            .pair
            .as_ref()
            .is_none_or(|p| p.gate_format.four_over_six == slot.format.four_over_six)
}

/// The stored bytes of each tensor's slot, as device replacements by slot name
/// (`module.weight`). Every slot must pass [`quantizes`], and both halves of an NVFP4 gate/up
/// pair must be here. Synchronizes `gpu`'s stream.
pub fn quantize_slots(
    gpu: &Gpu,
    dense: Vec<Dense>,
) -> Result<Vec<(String, Replacement)>, CudaError> {
    let dims = |d: &Dense| (d.slot.shape[0], d.slot.shape[1]);
    // Every NVFP4 tensor's amax, queued at once, then read back.
    let mut amax_bufs = Vec::new();
    for d in dense
        .iter()
        .filter(|d| d.slot.format.format == Format::Nvfp4)
    {
        let (rows, cols) = dims(d);
        let mut buf = gpu.alloc::<u32>(2)?;
        ops::amax(gpu, &d.values, rows * cols, &mut buf)?;
        amax_bufs.push((d.slot.module.as_str(), rows * cols, buf));
    }
    let mut amax = BTreeMap::new();
    for (module, n, buf) in &amax_bufs {
        amax.insert(*module, ops::amax_value(&gpu.download(buf, 2)?, *n));
    }
    let mut stored = Vec::with_capacity(dense.len());
    for d in &dense {
        let (rows, cols) = dims(d);
        let n = rows * cols;
        let slot = &d.slot;
        let (data, scales, second_level) = match slot.format.format {
            Format::Mxfp8 => {
                let (mut data, mut scales) =
                    (gpu.alloc::<u8>(n)?, gpu.alloc::<u8>(n / MXFP8_BLOCK)?);
                ops::mxfp8_quantize(gpu, &d.values, n, &mut data, &mut scales, None)?;
                (data, scales, 1.0)
            }
            Format::Nvfp4 => {
                let a = match &slot.pair {
                    None => amax[slot.module.as_str()],
                    Some(p) => {
                        let half = |m: &str| {
                            amax.get(m).copied().ok_or_else(|| {
                                CudaError::Load(format!(
                                    "`{}` shares its NVFP4 scale with `{m}`, which is not in the update",
                                    slot.module
                                ))
                            })
                        };
                        half(&p.gate)?.max(half(&p.up)?)
                    }
                };
                let params = Nvfp4Params::from_four_over_six(slot.format.four_over_six);
                let (mut data, mut scales) =
                    (gpu.alloc::<u8>(n / 2)?, gpu.alloc::<u8>(n / NVFP4_BLOCK)?);
                ops::nvfp4_quantize_bf16(
                    gpu,
                    &d.values,
                    rows,
                    cols,
                    a,
                    params,
                    &mut data,
                    &mut scales,
                )?;
                (data, scales, SecondLevel::from_amax(a, params.range).s_dec)
            }
            Format::Bf16 => {
                return Err(CudaError::Load(format!(
                    "`{}` is stored in BF16: nothing to quantize",
                    slot.module
                )))
            }
        };
        stored.push((slot, rows, cols, data, scales, second_level));
    }
    let ranges: Vec<(u64, usize)> = stored
        .iter()
        .flat_map(|(_, _, _, data, scales, _)| {
            [
                (data.device_ptr(&gpu.stream).0, data.len()),
                (scales.device_ptr(&gpu.stream).0, scales.len()),
            ]
        })
        .collect();
    // Ordered after the quantizers on the same stream; synchronized before it returns.
    let hashes = hash::xxh3_of_device(gpu, &ranges)?;
    Ok(stored
        .into_iter()
        .zip(ranges.chunks(2).zip(hashes.chunks(2)))
        .map(|((slot, rows, cols, data, scales, second_level), (r, h))| {
            let tensor =
                |owner: CudaSlice<u8>, (ptr, bytes): (u64, usize), hash: u64| DeviceTensor {
                    ptr,
                    bytes,
                    hash,
                    owner: Arc::new(owner),
                };
            let q = DeviceQuantized {
                format: slot.format.format,
                rows,
                cols,
                data: tensor(data, r[0], h[0]),
                scales: tensor(scales, r[1], h[1]),
                second_level,
            };
            (slot.name("weight"), Replacement::DeviceQuantized(q))
        })
        .collect())
}
