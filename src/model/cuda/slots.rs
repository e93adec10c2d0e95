//! The device weights by checkpoint name, for weights that live only on the GPU: the slot
//! table a live update is checked against, the checksum in checkpoint layout (each tensor
//! downloaded and hashed in turn), and streamed replacements written into the existing device
//! buffers. Names and layouts follow [`crate::model::slots`] for the host model exactly.

use std::collections::BTreeMap;

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};

use super::CudaWeights;
use crate::backend::cpu::linear::DenseWeight;
use crate::backend::cuda::args::addr;
use crate::backend::cuda::ops::{self, CopyRange, Table, WeightData};
use crate::backend::cuda::weights::GpuMatrix;
use crate::backend::cuda::{CudaError, Gpu};
use crate::backend::Storage;
use crate::checkpoint::CheckpointPart;
use crate::model::checksum::WeightsChecksum;
use crate::model::layout::{place_of, places, Half, Place, Proj};
use crate::model::slots::{Replacement, SlotShape};
use crate::model::store::{SlotParts, StoreError};
use crate::model::{Mlp, ModelConfig};
use crate::quant::{slot, Format, MXFP8_BLOCK, NVFP4_BLOCK};
use half::bf16;

/// Where one checkpoint tensor lives on the device.
enum DeviceSlot<'a> {
    /// Rows `row0..row0 + rows` of matrix `expert` of a stack: group `group` of its parts.
    Linear {
        matrix: &'a mut GpuMatrix,
        expert: usize,
        group: usize,
        row0: usize,
        rows: usize,
    },
    Vector(&'a mut CudaSlice<f32>),
    /// The table, and lm_head when it is tied to it (kept equal on update).
    Embedding {
        table: &'a mut Table,
        tied_head: Option<&'a mut GpuMatrix>,
        cols: usize,
    },
}

fn whole(matrix: &mut GpuMatrix) -> DeviceSlot<'_> {
    let rows = matrix.n;
    DeviceSlot::Linear {
        matrix,
        expert: 0,
        group: 0,
        row0: 0,
        rows,
    }
}

impl CudaWeights {
    /// Every slot in the layout's order and names ([`crate::model::layout::places`]).
    fn slot_locations(&self, cfg: &ModelConfig) -> Vec<(String, Place)> {
        places(cfg).into_iter().map(|p| (p.name(), p)).collect()
    }

    fn slot(&mut self, place: Place, cfg: &ModelConfig) -> DeviceSlot<'_> {
        match place {
            Place::Embedding => DeviceSlot::Embedding {
                table: &mut self.embed_tokens,
                tied_head: if cfg.tie_word_embeddings {
                    self.lm_head.as_mut()
                } else {
                    None
                },
                cols: cfg.hidden_size,
            },
            Place::FinalNorm => DeviceSlot::Vector(&mut self.norm),
            Place::LmHead => whole(self.lm_head.as_mut().expect("listed only when present")),
            Place::InputNorm(l) => DeviceSlot::Vector(&mut self.layers[l].input_norm),
            Place::PostAttentionNorm(l) => {
                DeviceSlot::Vector(&mut self.layers[l].post_attention_norm)
            }
            Place::Attention(l, proj) => {
                let layer = &mut self.layers[l];
                whole(match proj {
                    Proj::Q => &mut layer.q_proj,
                    Proj::K => &mut layer.k_proj,
                    Proj::V => &mut layer.v_proj,
                    Proj::O => &mut layer.o_proj,
                })
            }
            Place::QNorm(l) => DeviceSlot::Vector(
                self.layers[l]
                    .q_norm
                    .as_mut()
                    .expect("listed only when present"),
            ),
            Place::KNorm(l) => DeviceSlot::Vector(
                self.layers[l]
                    .k_norm
                    .as_mut()
                    .expect("listed only when present"),
            ),
            Place::Router(l) => match &mut self.layers[l].mlp {
                Mlp::Moe(moe) => whole(&mut moe.router),
                Mlp::Dense(_) => unreachable!("listed only for MoE layers"),
            },
            Place::GateUp(l, e, half) => {
                let (e, group) = (e.unwrap_or(0), (half == Half::Up) as usize);
                let (gate_up, inter) = match &mut self.layers[l].mlp {
                    Mlp::Dense(m) => (&mut m.gate_up, m.inter),
                    Mlp::Moe(m) => (&mut m.experts.gate_up, m.experts.inter),
                };
                DeviceSlot::Linear {
                    matrix: gate_up,
                    expert: e,
                    group,
                    row0: group * inter,
                    rows: inter,
                }
            }
            Place::Down(l, e) => {
                let e = e.unwrap_or(0);
                let down = match &mut self.layers[l].mlp {
                    Mlp::Dense(m) => &mut m.down,
                    Mlp::Moe(m) => &mut m.experts.down,
                };
                let rows = down.n;
                DeviceSlot::Linear {
                    matrix: down,
                    expert: e,
                    group: 0,
                    row0: 0,
                    rows,
                }
            }
        }
    }

    /// What a live update may replace, by checkpoint name (as `Model::slot_shapes`).
    pub fn slot_shapes(&mut self, cfg: &ModelConfig) -> BTreeMap<String, SlotShape> {
        self.slot_locations(cfg)
            .into_iter()
            .map(|(name, loc)| {
                let shape = match self.slot(loc, cfg) {
                    DeviceSlot::Linear { matrix, rows, .. } => SlotShape::Linear {
                        rows,
                        cols: matrix.k,
                        format: match matrix.data {
                            WeightData::F32(_) | WeightData::Bf16(_) => Format::Bf16,
                            WeightData::Mxfp8 { .. } => Format::Mxfp8,
                            WeightData::Nvfp4 { .. } => Format::Nvfp4,
                        },
                    },
                    DeviceSlot::Vector(v) => SlotShape::Vector { len: v.len() },
                    DeviceSlot::Embedding { table, cols, .. } => SlotShape::Embedding {
                        rows: table_len(table) / cols,
                        cols,
                    },
                };
                (name, shape)
            })
            .collect()
    }

    /// Every tensor in checkpoint layout, downloaded one slot at a time and hashed (the same
    /// bytes and hashes as `Model::weights_checksum` of the equal host model).
    pub fn weights_checksum(
        &mut self,
        gpu: &Gpu,
        cfg: &ModelConfig,
    ) -> Result<WeightsChecksum, CudaError> {
        let mut sum = WeightsChecksum::default();
        for (name, loc) in self.slot_locations(cfg) {
            let module = name.strip_suffix(".weight").unwrap_or(&name).to_string();
            let parts = checkpoint_parts(gpu, &self.slot(loc, cfg))?;
            sum.insert_parts(&module, &parts);
        }
        Ok(sum)
    }

    /// The served contents of the slots `names` in checkpoint layout, downloaded.
    pub fn parts_of(
        &mut self,
        gpu: &Gpu,
        cfg: &ModelConfig,
        names: &[String],
    ) -> Result<SlotParts, StoreError> {
        let mut located = Vec::with_capacity(names.len());
        let mut unknown = Vec::new();
        for name in names {
            match place_of(cfg, name) {
                Some(loc) => located.push((name, loc)),
                None => unknown.push(name.clone()),
            }
        }
        if !unknown.is_empty() {
            return Err(StoreError::UnknownNames(unknown));
        }
        located
            .into_iter()
            .map(|(name, loc)| {
                let parts = checkpoint_parts(gpu, &self.slot(loc, cfg))
                    .map_err(|e| StoreError::Device(e.to_string()))?;
                Ok((name.clone(), parts))
            })
            .collect()
    }

    /// Writes validated replacements (names from the slot table) into the device buffers the
    /// weights already live in: every replacement is checked against its slot before any is
    /// written, so a refused update changes nothing. Returns the replacements, for the caller
    /// to free off the engine thread.
    pub fn write_replacements(
        &mut self,
        gpu: &Gpu,
        cfg: &ModelConfig,
        updates: Vec<(String, Replacement)>,
    ) -> Result<Vec<Replacement>, StoreError> {
        // Each name read for its place: a commit of a few tensors does not walk every slot's
        // name (tens of thousands in a large MoE).
        let started = std::time::Instant::now();
        let mut pairs = Vec::with_capacity(updates.len());
        let mut unknown = Vec::new();
        for (name, r) in updates {
            match place_of(cfg, &name) {
                Some(loc) => {
                    fits(&name, &self.slot(loc, cfg), &r)?;
                    pairs.push((loc, r));
                }
                None => unknown.push(name),
            }
        }
        if !unknown.is_empty() {
            unknown.sort_unstable();
            unknown.dedup();
            return Err(StoreError::UnknownNames(unknown));
        }
        let device = |e: CudaError| StoreError::Device(e.to_string());
        let checked = started.elapsed();
        let mut spent = Vec::with_capacity(pairs.len());
        let mut queue = Queued::default();
        for (loc, r) in pairs {
            write_slot(gpu, self.slot(loc, cfg), &r, &mut queue).map_err(device)?;
            spent.push(r);
        }
        let written = started.elapsed();
        let count = queue.len();
        let uploads = queue.run(gpu).map_err(device)?;
        let queued = started.elapsed();
        // The replacements' device memory and the upload are kept until here.
        gpu.synchronize().map_err(device)?;
        drop(uploads);
        // Where an in-place commit's pause goes (scripts/gpu-check.sh sums these lines): host
        // tensors staged (or, large, written), the copies (staged ones uploaded first) queued,
        // the wait for them.
        tracing::debug!(
            "in-place write: {} tensors, checked in {:.3} ms, host writes in {:.3} ms, {} device copies queued in {:.3} ms, waited {:.3} ms for them",
            spent.len(),
            checked.as_secs_f64() * 1e3,
            (written - checked).as_secs_f64() * 1e3,
            count,
            (queued - written).as_secs_f64() * 1e3,
            (started.elapsed() - queued).as_secs_f64() * 1e3
        );
        Ok(spent)
    }
}

fn table_len(t: &Table) -> usize {
    match t {
        Table::Bf16(t) => t.len(),
        Table::F32(t) => t.len(),
    }
}

fn down<T: DeviceRepr + Default + Clone + ValidAsZeroBits>(
    gpu: &Gpu,
    s: &CudaSlice<T>,
    from: usize,
    len: usize,
) -> Result<Vec<T>, CudaError> {
    let mut host = vec![T::default(); len];
    if len > 0 {
        gpu.stream
            .memcpy_dtoh(&s.slice(from..from + len), &mut host)?;
    }
    Ok(host)
}

/// One slot's tensors in checkpoint layout (the host `Linear::checkpoint_parts`), from the
/// bytes on the device; the layout itself is `quant::slot`'s.
fn checkpoint_parts(
    gpu: &Gpu,
    slot: &DeviceSlot<'_>,
) -> Result<Vec<CheckpointPart<'static>>, CudaError> {
    let dense = |shape: Vec<usize>, w: DenseWeight| slot::dense_part(shape, &w).into_owned();
    let bf16 = |bits: Vec<u16>| DenseWeight::Bf16(bits.into_iter().map(bf16::from_bits).collect());
    Ok(match slot {
        DeviceSlot::Vector(v) => vec![dense(
            vec![v.len()],
            DenseWeight::F32(down(gpu, v, 0, v.len())?),
        )],
        DeviceSlot::Embedding { table, cols, .. } => {
            let shape = vec![table_len(table) / cols, *cols];
            match table {
                Table::Bf16(t) => vec![dense(shape, bf16(down(gpu, t, 0, t.len())?))],
                Table::F32(t) => vec![dense(shape, DenseWeight::F32(down(gpu, t, 0, t.len())?))],
            }
        }
        DeviceSlot::Linear {
            matrix,
            expert,
            group,
            row0,
            rows,
        } => {
            let k = matrix.k;
            let a = (expert * matrix.n + row0) * k;
            let m = rows * k;
            let bytes = |v: Vec<u8>| std::borrow::Cow::Owned(v);
            match &matrix.data {
                WeightData::F32(w) => {
                    vec![dense(vec![*rows, k], DenseWeight::F32(down(gpu, w, a, m)?))]
                }
                WeightData::Bf16(w) => vec![dense(vec![*rows, k], bf16(down(gpu, w, a, m)?))],
                WeightData::Mxfp8 { data, scales } => slot::quantized_parts(
                    Format::Mxfp8,
                    *rows,
                    k,
                    [
                        bytes(down(gpu, data, a, m)?),
                        bytes(down(gpu, scales, a / MXFP8_BLOCK, m / MXFP8_BLOCK)?),
                    ],
                    None,
                ),
                WeightData::Nvfp4 {
                    data,
                    scales,
                    s_dec,
                    groups,
                } => slot::quantized_parts(
                    Format::Nvfp4,
                    *rows,
                    k,
                    [
                        bytes(down(gpu, data, a / 2, m / 2)?),
                        bytes(down(gpu, scales, a / NVFP4_BLOCK, m / NVFP4_BLOCK)?),
                    ],
                    Some(down(gpu, s_dec, expert * groups + group, 1)?[0]),
                ),
            }
        }
    })
}

/// Checks that `r` has the kind, storage and size of `slot`.
fn fits(name: &str, slot: &DeviceSlot<'_>, r: &Replacement) -> Result<(), StoreError> {
    let refuse = |why: &str| Err(StoreError::mismatch(name, why));
    match (slot, r) {
        (DeviceSlot::Vector(v), Replacement::Vector(n)) if v.len() == n.len() => Ok(()),
        (DeviceSlot::Embedding { table, .. }, Replacement::Embedding(e)) => match (table, e) {
            (Table::Bf16(t), DenseWeight::Bf16(n)) if t.len() == n.len() => Ok(()),
            (Table::F32(t), DenseWeight::F32(n)) if t.len() == n.len() => Ok(()),
            _ => refuse("the embedding's dtype or size differs from the served table"),
        },
        (DeviceSlot::Linear { matrix, rows, .. }, Replacement::Linear(l)) => {
            if l.out_features() != *rows || l.in_features() != matrix.k {
                return refuse("shape differs from the served layer");
            }
            let same = matches!(
                (&matrix.data, l.storage()),
                (WeightData::F32(_), Storage::F32(_))
                    | (WeightData::Bf16(_), Storage::Bf16(_))
                    | (WeightData::Mxfp8 { .. }, Storage::Mxfp8(_))
                    | (WeightData::Nvfp4 { .. }, Storage::Nvfp4 { .. })
            );
            if same {
                Ok(())
            } else {
                refuse("storage format differs from the served layer")
            }
        }
        (DeviceSlot::Linear { matrix, rows, .. }, Replacement::Device(d)) => match &matrix.data {
            WeightData::Bf16(_) if d.bytes == rows * matrix.k * 2 => Ok(()),
            WeightData::Bf16(_) => refuse(&format!(
                "{} bytes in device memory for a BF16 layer of {rows} x {} ({} bytes)",
                d.bytes,
                matrix.k,
                rows * matrix.k * 2
            )),
            _ => refuse("a BF16 tensor in device memory can only replace a layer stored in BF16"),
        },
        (DeviceSlot::Embedding { table, .. }, Replacement::Device(d)) => match table {
            Table::Bf16(t) if t.len() * 2 == d.bytes => Ok(()),
            _ => refuse("the embedding's dtype or size differs from the served table"),
        },
        (DeviceSlot::Linear { matrix, rows, .. }, Replacement::DeviceQuantized(q)) => {
            if (q.rows, q.cols) != (*rows, matrix.k) {
                return refuse("shape differs from the served layer");
            }
            let n = q.rows * q.cols;
            let sizes = match (&matrix.data, q.format) {
                (WeightData::Mxfp8 { .. }, Format::Mxfp8) => (n, n / MXFP8_BLOCK),
                (WeightData::Nvfp4 { .. }, Format::Nvfp4) => (n / 2, n / NVFP4_BLOCK),
                _ => return refuse("storage format differs from the served layer"),
            };
            if (q.data.bytes, q.scales.bytes) == sizes {
                Ok(())
            } else {
                refuse(&format!(
                    "{} value and {} scale bytes in device memory, expected {} and {}",
                    q.data.bytes, q.scales.bytes, sizes.0, sizes.1
                ))
            }
        }
        _ => refuse("the wrong kind of tensor"),
    }
}

/// Adds the copy of `bytes` device bytes at `src` (this context's) to element `at` of `dev` to
/// `q`'s copies (queued together by [`ops::copy_ranges`]).
fn put_device<T: DeviceRepr>(
    gpu: &Gpu,
    src: u64,
    bytes: usize,
    dev: &CudaSlice<T>,
    at: usize,
    q: &mut Queued,
) {
    if bytes > 0 {
        let size = std::mem::size_of::<T>();
        assert!(at + bytes / size <= dev.len(), "a slot outside its buffer");
        q.copies.push(CopyRange {
            dst: addr(gpu, dev) + (at * size) as u64,
            src,
            bytes: bytes as u64,
        });
    }
}

/// Host tensors up to this size are gathered into one upload per in-place group: a copy call
/// from pageable memory costs ~80 us whatever its size (H200, 2026-12-02: the ~1,600 norms of
/// a 16 GB commit took 129 ms one by one).
const STAGED_MAX_BYTES: usize = 1 << 20;
/// Staged bytes uploaded at a time (a whole small model written in place stages no more).
const STAGED_UPLOAD_BYTES: usize = 64 << 20;

/// The writes of one in-place group, queued to run together: device-to-device copies, and small
/// host tensors gathered into one buffer, uploaded once and then copied like the others.
#[derive(Default)]
struct Queued {
    copies: Vec<CopyRange>,
    staged: Vec<u8>,
    /// (destination address, offset in `staged`, bytes).
    staged_copies: Vec<(u64, usize, usize)>,
    /// Staged bytes uploaded so far, the sources of some of `copies`.
    uploads: Vec<CudaSlice<u8>>,
}

impl Queued {
    /// Copies listed, staged ones included.
    fn len(&self) -> usize {
        self.copies.len() + self.staged_copies.len()
    }

    /// Uploads the staged bytes and lists their copies.
    fn upload_staged(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        if self.staged.is_empty() {
            return Ok(());
        }
        let up = gpu.upload(&self.staged)?;
        let base = addr(gpu, &up);
        self.copies.extend(
            self.staged_copies
                .drain(..)
                .map(|(dst, at, bytes)| CopyRange {
                    dst,
                    src: base + at as u64,
                    bytes: bytes as u64,
                }),
        );
        self.staged.clear();
        self.uploads.push(up);
        Ok(())
    }

    /// Queues every copy as one launch (see [`ops::copy_ranges`]). The returned uploads must
    /// live until the copies are done.
    fn run(mut self, gpu: &Gpu) -> Result<Vec<CudaSlice<u8>>, CudaError> {
        self.upload_staged(gpu)?;
        // SAFETY: every range is a slot's span of its device buffer (checked by `fits`; slots
        // never overlap) and either a replacement's device memory, kept mapped by its owner
        // until the copies are done, or an upload, which the caller keeps as long.
        unsafe { ops::copy_ranges(gpu, &self.copies) }?;
        Ok(self.uploads)
    }
}

/// Writes `host` at element `at` of `dev`: a small tensor is staged in `q` (16-byte aligned, so
/// its copy moves 16 bytes at a time), a large one copied at once.
fn put<T: DeviceRepr>(
    gpu: &Gpu,
    host: &[T],
    dev: &mut CudaSlice<T>,
    at: usize,
    q: &mut Queued,
) -> Result<(), CudaError> {
    let size = std::mem::size_of_val(host);
    if size == 0 {
        return Ok(());
    }
    if size > STAGED_MAX_BYTES {
        gpu.stream
            .memcpy_htod(host, &mut dev.slice_mut(at..at + host.len()))?;
        return Ok(());
    }
    assert!(at + host.len() <= dev.len(), "a slot outside its buffer");
    if q.staged.len() + size > STAGED_UPLOAD_BYTES {
        q.upload_staged(gpu)?;
    }
    let offset = q.staged.len().next_multiple_of(16);
    q.staged.resize(offset, 0);
    // SAFETY: `host` is `size` initialized bytes of plain device-representable values.
    let bytes = unsafe { std::slice::from_raw_parts(host.as_ptr() as *const u8, size) };
    q.staged.extend_from_slice(bytes);
    let dst = addr(gpu, dev) + (at * std::mem::size_of::<T>()) as u64;
    q.staged_copies.push((dst, offset, size));
    Ok(())
}

/// Queues a checked replacement's writes into its slot's device buffers in `queue` (a large
/// host tensor is copied at once).
fn write_slot(
    gpu: &Gpu,
    slot: DeviceSlot<'_>,
    r: &Replacement,
    queue: &mut Queued,
) -> Result<(), CudaError> {
    match (slot, r) {
        (DeviceSlot::Vector(v), Replacement::Vector(n)) => put(gpu, n, v, 0, queue),
        (
            DeviceSlot::Embedding {
                table, tied_head, ..
            },
            Replacement::Embedding(e),
        ) => {
            match (table, e) {
                (Table::Bf16(t), DenseWeight::Bf16(n)) => {
                    put(gpu, bytemuck::cast_slice::<_, u16>(n), t, 0, queue)?
                }
                (Table::F32(t), DenseWeight::F32(n)) => put(gpu, n, t, 0, queue)?,
                _ => unreachable!("checked by `fits`"),
            }
            // Tied: lm_head is the embedding matrix (the host model rebuilds it likewise).
            match (tied_head.map(|h| &mut h.data), e) {
                (Some(WeightData::Bf16(h)), DenseWeight::Bf16(n)) => {
                    put(gpu, bytemuck::cast_slice::<_, u16>(n), h, 0, queue)
                }
                (Some(WeightData::F32(h)), DenseWeight::F32(n)) => put(gpu, n, h, 0, queue),
                _ => Ok(()),
            }
        }
        (
            DeviceSlot::Linear {
                matrix,
                expert,
                group,
                row0,
                ..
            },
            Replacement::Linear(l),
        ) => {
            let a = (expert * matrix.n + row0) * matrix.k;
            match (&mut matrix.data, l.storage()) {
                (WeightData::F32(w), Storage::F32(n)) => put(gpu, n, w, a, queue),
                (WeightData::Bf16(w), Storage::Bf16(n)) => {
                    put(gpu, bytemuck::cast_slice::<_, u16>(n), w, a, queue)
                }
                (WeightData::Mxfp8 { data, scales }, Storage::Mxfp8(t)) => {
                    put(gpu, &t.data, data, a, queue)?;
                    put(gpu, &t.scales, scales, a / MXFP8_BLOCK, queue)
                }
                (
                    WeightData::Nvfp4 {
                        data,
                        scales,
                        s_dec,
                        groups,
                    },
                    Storage::Nvfp4 { weight, .. },
                ) => {
                    put(gpu, &weight.data, data, a / 2, queue)?;
                    put(gpu, &weight.scales, scales, a / NVFP4_BLOCK, queue)?;
                    put(
                        gpu,
                        &[weight.global.of_row(0)],
                        s_dec,
                        expert * *groups + group,
                        queue,
                    )
                }
                _ => unreachable!("checked by `fits`"),
            }
        }
        (
            DeviceSlot::Linear {
                matrix,
                expert,
                row0,
                ..
            },
            Replacement::Device(d),
        ) => {
            let a = (expert * matrix.n + row0) * matrix.k;
            match &mut matrix.data {
                WeightData::Bf16(w) => {
                    put_device(gpu, d.ptr, d.bytes, w, a, queue);
                    Ok(())
                }
                _ => unreachable!("checked by `fits`"),
            }
        }
        (
            DeviceSlot::Linear {
                matrix,
                expert,
                group,
                row0,
                ..
            },
            Replacement::DeviceQuantized(q),
        ) => {
            let a = (expert * matrix.n + row0) * matrix.k;
            let (data, scales) = (&q.data, &q.scales);
            match &mut matrix.data {
                WeightData::Mxfp8 { data: d, scales: s } => {
                    put_device(gpu, data.ptr, data.bytes, d, a, queue);
                    put_device(gpu, scales.ptr, scales.bytes, s, a / MXFP8_BLOCK, queue);
                    Ok(())
                }
                WeightData::Nvfp4 {
                    data: d,
                    scales: s,
                    s_dec,
                    groups,
                } => {
                    put_device(gpu, data.ptr, data.bytes, d, a / 2, queue);
                    put_device(gpu, scales.ptr, scales.bytes, s, a / NVFP4_BLOCK, queue);
                    put(
                        gpu,
                        &[q.second_level],
                        s_dec,
                        expert * *groups + group,
                        queue,
                    )
                }
                _ => unreachable!("checked by `fits`"),
            }
        }
        (
            DeviceSlot::Embedding {
                table: Table::Bf16(t),
                tied_head,
                ..
            },
            Replacement::Device(d),
        ) => {
            put_device(gpu, d.ptr, d.bytes, t, 0, queue);
            // Tied: lm_head is the embedding matrix.
            if let Some(WeightData::Bf16(h)) = tied_head.map(|h| &mut h.data) {
                put_device(gpu, d.ptr, d.bytes, h, 0, queue);
            }
            Ok(())
        }
        _ => unreachable!("checked by `fits`"),
    }
}
