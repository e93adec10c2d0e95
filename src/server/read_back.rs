//! An in-place commit's spilled slots, read back layer by layer on a thread of their own, ahead
//! of the engine that writes them.
//!
//! The read-ahead starts when the commit is handed over, while generation still runs, and the
//! commit asks the engine to pause only once it is [`ReadBack::ready`]: every layer is
//! prepared, or the read-ahead's budget is full. Layers whose slots land device to device (BF16
//! into BF16) are read from the spill file into page-locked buffers and copied to the device
//! there, on a side stream, where they wait within the device budget (what is free, less a
//! spare, or `--max-read-ahead-weight-bytes`). So do MXFP8 and NVFP4 slots, spilled in their
//! stored form: their values and block scales go through the same buffers, their scalars are
//! read on the host, and each becomes a [`DeviceQuantized`]. The others wait in host memory
//! within the host budget (`--max-prepared-weight-bytes`). With room for the whole update on the device the
//! pause only copies device to device; with less, the rest is read during the pause, at the
//! speed of the page cache and the host link.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex};

use super::spill::{Spill, SpilledPart};
use super::weights::{
    build_replacements, lands_device_to_device, served_part, StagedTensor, UPLOAD_SPARE_BYTES,
};
use crate::backend::cuda::hash;
use crate::backend::cuda::pinned::HostRing;
use crate::backend::cuda::Gpu;
use crate::engine::{EngineInfo, MoreUpdates};
use crate::model::slots::{DeviceQuantized, DeviceTensor, Replacement};
use crate::quant::Format;

/// How much a read-back may prepare before the engine takes it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Budget {
    /// Bytes of prepared layers waiting in host memory.
    pub host_bytes: usize,
    /// Bytes of prepared layers waiting in device memory; None: what is free, less a spare.
    pub device_bytes: Option<usize>,
}

impl Budget {
    /// One layer ahead, nothing more (a rollback's replay).
    pub(crate) const ONE_AHEAD: Budget = Budget {
        host_bytes: 0,
        device_bytes: Some(0),
    };
}

/// Page-locked buffers for the read-back: a few, so the file's reads and the copies overlap.
const RING_BUFFERS: usize = 4;
const RING_BUFFER_BYTES: usize = 32 << 20;

/// Layers prepared and not yet written, by where they wait.
#[derive(Default)]
struct InFlight {
    groups: usize,
    host: usize,
    device: usize,
    /// The engine stopped asking: the thread ends.
    closed: bool,
}

type Shared = Arc<(Mutex<InFlight>, Condvar)>;

/// A started read-back.
pub(crate) struct ReadBack {
    pub more: MoreUpdates,
    /// Resolves once every layer is prepared or the budget is full (or the thread ended).
    pub ready: tokio::sync::oneshot::Receiver<Progress>,
}

/// How far the read-ahead got before the pause.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Progress {
    pub groups: usize,
    pub of: usize,
    pub device_bytes: usize,
    pub host_bytes: usize,
}

/// A prepared layer and what it holds of each budget.
struct Group {
    updates: Result<Vec<(String, Replacement)>, String>,
    host: usize,
    device: usize,
}

/// The engine's end: takes layers in order and gives back the budget of the one before (which
/// the engine has written and dropped by the time it asks again).
struct Taker {
    rx: Receiver<Group>,
    shared: Shared,
    /// The host and device bytes of the layer taken last.
    last: Option<(usize, usize)>,
}

impl Taker {
    fn next(&mut self) -> Option<Result<Vec<(String, Replacement)>, String>> {
        if let Some((host, device)) = self.last.take() {
            let (lock, room) = &*self.shared;
            let mut f = lock.lock().expect("read-back lock");
            f.groups -= 1;
            f.host -= host;
            f.device -= device;
            room.notify_all();
        }
        let g = self.rx.recv().ok()?;
        self.last = Some((g.host, g.device));
        Some(g.updates)
    }
}

impl Drop for Taker {
    fn drop(&mut self) {
        let (lock, room) = &*self.shared;
        lock.lock().expect("read-back lock").closed = true;
        room.notify_all();
    }
}

/// Starts reading `spill` back (see the module's text). With `gpu` (a stream of its own), BF16
/// slots are staged on the device.
pub(crate) fn start(
    info: Arc<EngineInfo>,
    spill: Spill,
    gpu: Option<Gpu>,
    budget: Budget,
) -> ReadBack {
    let writes = spill.slots();
    let groups = spill.groups();
    let of = groups.len();
    // At most one layer beyond the budget sits in the channel; the budget bounds the rest.
    let (tx, rx) = std::sync::mpsc::sync_channel(of.max(1));
    let (ready_tx, ready) = tokio::sync::oneshot::channel();
    let shared: Shared = Arc::default();
    let thread_shared = shared.clone();
    std::thread::spawn(move || {
        let mut reader = Reader::new(info, spill, gpu, budget);
        reader.run(groups, tx, thread_shared, ready_tx);
    });
    let mut taker = Taker {
        rx,
        shared,
        last: None,
    };
    ReadBack {
        more: MoreUpdates {
            writes,
            next: Box::new(move || taker.next()),
            undo: None,
        },
        ready,
    }
}

struct Reader {
    info: Arc<EngineInfo>,
    spill: Spill,
    /// The side stream and its page-locked ring (None: everything takes the host path).
    device: Option<(Gpu, HostRing)>,
    host_budget: usize,
    device_budget: usize,
    spent: Spent,
}

/// Where the read-back's time went, logged when it ends.
#[derive(Default)]
struct Spent {
    /// Reading the spill file into the page-locked buffers.
    file: std::time::Duration,
    /// Allocating the layers' device buffers.
    alloc: std::time::Duration,
    /// Staging layers on the device in all (file reads, copies, hashes, allocation).
    device: std::time::Duration,
    /// Reading and preparing layers in host memory.
    host: std::time::Duration,
    /// Waiting for the engine to take layers (the budget was full).
    waiting: std::time::Duration,
    bytes: usize,
}

impl Reader {
    fn new(info: Arc<EngineInfo>, spill: Spill, gpu: Option<Gpu>, budget: Budget) -> Reader {
        let device = gpu.and_then(|gpu| {
            match HostRing::new(&gpu, RING_BUFFERS, RING_BUFFER_BYTES) {
                Ok(ring) => Some((gpu, ring)),
                Err(e) => {
                    tracing::warn!("spilled BF16 slots are read back through host memory: no page-locked buffers ({e})");
                    None
                }
            }
        });
        let free = device
            .as_ref()
            .and_then(|(gpu, _)| gpu.memory().ok())
            .map_or(0, |(free, _)| free.saturating_sub(UPLOAD_SPARE_BYTES));
        Reader {
            info,
            spill,
            device_budget: budget.device_bytes.map_or(free, |b| b.min(free)),
            host_budget: budget.host_bytes,
            spent: Spent::default(),
            device,
        }
    }

    fn run(
        &mut self,
        groups: Vec<Vec<SpilledPart>>,
        tx: SyncSender<Group>,
        shared: Shared,
        ready: tokio::sync::oneshot::Sender<Progress>,
    ) {
        let of = groups.len();
        let mut ready = Some(ready);
        let mut signal = |f: &InFlight| {
            if let Some(r) = ready.take() {
                let _ = r.send(Progress {
                    groups: f.groups,
                    of,
                    device_bytes: f.device,
                    host_bytes: f.host,
                });
            }
        };
        let started = std::time::Instant::now();
        for parts in groups {
            let (to_device, to_host): (Vec<SpilledPart>, Vec<SpilledPart>) =
                parts.into_iter().partition(|p| {
                    self.device.is_some() && lands_device_to_device(&self.info, &p.name, p.dtype)
                });
            let (quantized, to_host) = match self.device {
                Some(_) => match quantized_slots(&self.info, &self.spill, to_host) {
                    Ok(split) => split,
                    Err(e) => {
                        let failed = Group {
                            updates: Err(e),
                            host: 0,
                            device: 0,
                        };
                        let _ = tx.send(failed);
                        break;
                    }
                },
                None => (Vec::new(), to_host),
            };
            let device: usize = to_device
                .iter()
                .chain(quantized.iter().flat_map(|q| [&q.values, &q.scales]))
                .map(|p| p.len.next_multiple_of(256))
                .sum();
            let host: usize = to_host.iter().map(|p| p.len).sum();
            let waited = std::time::Instant::now();
            {
                let (lock, room) = &*shared;
                let mut f = lock.lock().expect("read-back lock");
                while !f.closed
                    && f.groups > 0
                    && (f.host + host > self.host_budget || f.device + device > self.device_budget)
                {
                    signal(&f);
                    f = room.wait(f).expect("read-back lock");
                }
                if f.closed {
                    return;
                }
            }
            self.spent.waiting += waited.elapsed();
            let group = self.prepare(to_device, quantized, to_host, device, host);
            self.spent.bytes += group.host + group.device;
            let failed = group.updates.is_err();
            {
                let mut f = shared.0.lock().expect("read-back lock");
                f.groups += 1;
                f.host += group.host;
                f.device += group.device;
            }
            if tx.send(group).is_err() || failed {
                break;
            }
        }
        signal(&shared.0.lock().expect("read-back lock"));
        let t = &self.spent;
        tracing::info!(
            "read-back of {of} spilled layers ({} bytes) took {:.1} ms: on the device {:.1} ms (spill file reads {:.1} ms, allocations {:.1} ms), in host memory {:.1} ms, waiting for the engine {:.1} ms",
            t.bytes,
            started.elapsed().as_secs_f64() * 1e3,
            t.device.as_secs_f64() * 1e3,
            t.file.as_secs_f64() * 1e3,
            t.alloc.as_secs_f64() * 1e3,
            t.host.as_secs_f64() * 1e3,
            t.waiting.as_secs_f64() * 1e3,
        );
    }

    /// One layer's replacements, with the device and host bytes they hold.
    fn prepare(
        &mut self,
        to_device: Vec<SpilledPart>,
        quantized: Vec<QuantizedSlot>,
        mut to_host: Vec<SpilledPart>,
        device: usize,
        host: usize,
    ) -> Group {
        let failed = |e| Group {
            updates: Err(e),
            host: 0,
            device: 0,
        };
        let mut updates = Vec::new();
        let mut device_bytes = 0;
        let mut host_bytes = host;
        if !to_device.is_empty() || !quantized.is_empty() {
            let started = std::time::Instant::now();
            let staged = self.stage_on_device(&to_device, &quantized, device);
            self.spent.device += started.elapsed();
            match staged {
                Ok(u) => {
                    updates = u;
                    device_bytes = device;
                }
                Err(Staging::Failed(e)) => return failed(e),
                Err(Staging::NoRoom(e)) => {
                    tracing::warn!(
                        "a spilled layer is read back through host memory: staging it on the device failed ({e})"
                    );
                    let back = to_device
                        .into_iter()
                        .chain(quantized.into_iter().flat_map(|q| q.parts));
                    for p in back {
                        host_bytes += p.len;
                        to_host.push(p);
                    }
                }
            }
        }
        let started = std::time::Instant::now();
        let read = self.read_to_host(to_host);
        self.spent.host += started.elapsed();
        match read {
            Ok(u) => {
                updates.extend(u);
                Group {
                    updates: Ok(updates),
                    host: host_bytes,
                    device: device_bytes,
                }
            }
            Err(e) => failed(e),
        }
    }

    /// `parts`, and the values and block scales of the `quantized` slots, read into one device
    /// buffer (`bytes`, each at a 256-byte boundary) through the page-locked ring, hashed there
    /// and checked against what the spill recorded.
    fn stage_on_device(
        &mut self,
        parts: &[SpilledPart],
        quantized: &[QuantizedSlot],
        bytes: usize,
    ) -> Result<Vec<(String, Replacement)>, Staging> {
        let (gpu, ring) = self.device.as_mut().expect("called with a device");
        let started = std::time::Instant::now();
        let buf = gpu
            .alloc::<u8>(bytes)
            .map_err(|e| Staging::NoRoom(e.to_string()))?;
        self.spent.alloc += started.elapsed();
        let base = cudarc::driver::DevicePtr::device_ptr(&buf, &gpu.stream).0;
        let mut layout = Vec::with_capacity(parts.len() + 2 * quantized.len());
        let mut at = 0;
        let stored = quantized.iter().flat_map(|q| [&q.values, &q.scales]);
        for p in parts.iter().chain(stored) {
            layout.push((p, at));
            at += p.len.next_multiple_of(256);
        }
        // The layer as one span: a ring buffer holds several small parts, read at once.
        let (spill, file) = (&self.spill, &mut self.spent.file);
        ring.upload(gpu, base, bytes, |off, chunk| {
            let started = std::time::Instant::now();
            let read = spill.read_laid_out(&layout, off, chunk);
            *file += started.elapsed();
            read
        })
        .map_err(|e| Staging::Failed(format!("reading a layer back from the spill file: {e}")))?;
        let ranges: Vec<(u64, usize)> = layout
            .iter()
            .map(|&(p, start)| (base + start as u64, p.len))
            .collect();
        // Ordered after the copies on the same stream; synchronized before it returns.
        let hashes = hash::xxh3_of_device(gpu, &ranges)
            .map_err(|e| Staging::Failed(format!("hashing spilled slots on the device: {e}")))?;
        let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::new(buf);
        let tensors = layout
            .iter()
            .zip(ranges.into_iter().zip(hashes))
            .map(|(&(p, _), ((ptr, bytes), hash))| {
                if self.spill.hash_of(p) != Some(hash) {
                    return Err(Staging::Failed(format!(
                        "`{}` read back from the spill file differs from what was written to it",
                        p.name
                    )));
                }
                Ok(DeviceTensor {
                    ptr,
                    bytes,
                    hash,
                    owner: owner.clone(),
                })
            })
            .collect::<Result<Vec<_>, Staging>>()?;
        let (dense, stored) = tensors.split_at(parts.len());
        let mut updates: Vec<(String, Replacement)> = parts
            .iter()
            .zip(dense)
            .map(|(p, t)| (p.name.clone(), Replacement::Device(t.clone())))
            .collect();
        // Laid out above: each quantized slot's values, then its block scales.
        for (q, pair) in quantized.iter().zip(stored.chunks_exact(2)) {
            let r = Replacement::DeviceQuantized(DeviceQuantized {
                format: q.format,
                rows: q.rows,
                cols: q.cols,
                data: pair[0].clone(),
                scales: pair[1].clone(),
                second_level: q.second_level,
            });
            updates.push((q.values.name.clone(), r));
        }
        Ok(updates)
    }

    /// `parts` read into host memory and prepared as a pushed bucket's are.
    fn read_to_host(&self, parts: Vec<SpilledPart>) -> Result<Vec<(String, Replacement)>, String> {
        let mut staged = BTreeMap::new();
        for part in parts {
            let data = self
                .spill
                .read(&part)
                .map_err(|e| format!("reading `{}` back from the spill file: {e}", part.name))?;
            let t = StagedTensor {
                dtype: part.dtype,
                shape: part.shape,
                data: bytes::Bytes::from(data),
            };
            staged.insert(part.name, t);
        }
        build_replacements(&self.info, staged).map_err(|e| e.to_string())
    }
}

/// An MXFP8 or NVFP4 slot spilled in its stored form, every part as the served slot stores it.
struct QuantizedSlot {
    format: Format,
    rows: usize,
    cols: usize,
    /// `weight`: the codes.
    values: SpilledPart,
    /// `weight_scale_inv` (MXFP8) or `weight_scale` (NVFP4): the block scales.
    scales: SpilledPart,
    /// NVFP4's `weight_scale_2`, read on the host; 1 for MXFP8 (unused).
    second_level: f32,
    /// All of them, scalars included (for the host path when the device has no room).
    parts: Vec<SpilledPart>,
}

/// Splits `parts` into the MXFP8 and NVFP4 slots whose every part is spilled, in the served
/// slot's stored layout (checked part by part), and the rest. The slots' scalar parts are read
/// here and checked against the spill's hashes; an `input_scale` other than 1 (the stored form
/// carries no other) leaves its slot to the host path.
fn quantized_slots(
    info: &EngineInfo,
    spill: &Spill,
    parts: Vec<SpilledPart>,
) -> Result<(Vec<QuantizedSlot>, Vec<SpilledPart>), String> {
    let mut by_module: BTreeMap<String, Vec<SpilledPart>> = BTreeMap::new();
    let mut rest = Vec::new();
    for p in parts {
        match crate::quant::slot::split(&p.name) {
            Some((module, _)) => by_module.entry(module.to_string()).or_default().push(p),
            None => rest.push(p),
        }
    }
    let mut slots = Vec::new();
    for (module, mut parts) in by_module {
        let stored = served_part(info, &format!("{module}.weight"))
            .ok()
            .map(|(slot, _)| slot)
            .filter(|slot| {
                matches!(slot.format.format, Format::Mxfp8 | Format::Nvfp4) && slot.shape.len() == 2
            });
        let Some(slot) = stored else {
            rest.extend(parts);
            continue;
        };
        let (format, rows, cols) = (slot.format.format, slot.shape[0], slot.shape[1]);
        let none = std::borrow::Cow::Borrowed(&[][..]);
        let want =
            crate::quant::slot::quantized_parts(format, rows, cols, [none.clone(), none], None);
        // The spilled parts in the stored layout's order, or None when they differ from it.
        let mut ordered = Vec::with_capacity(want.len());
        for w in &want {
            let name = slot.name(w.suffix);
            let found = parts
                .iter()
                .position(|p| p.name == name && p.dtype == w.dtype && p.shape == w.shape);
            match found {
                Some(i) => ordered.push(parts.swap_remove(i)),
                None => break,
            }
        }
        if ordered.len() != want.len() || !parts.is_empty() {
            rest.extend(ordered);
            rest.extend(parts);
            continue;
        }
        let scalar = |p: &SpilledPart| -> Result<f32, String> {
            let bytes = spill
                .read(p)
                .map_err(|e| format!("reading `{}` back from the spill file: {e}", p.name))?;
            if spill.hash_of(p) != Some(xxhash_rust::xxh3::xxh3_64(&bytes)) {
                return Err(format!(
                    "`{}` read back from the spill file differs from what was written to it",
                    p.name
                ));
            }
            let four: [u8; 4] = bytes[..]
                .try_into()
                .map_err(|_| format!("`{}` is not one f32", p.name))?;
            Ok(f32::from_le_bytes(four))
        };
        let (second_level, input_scale) = match format {
            Format::Nvfp4 => (scalar(&ordered[2])?, scalar(&ordered[3])?),
            _ => (1.0, 1.0),
        };
        if input_scale != 1.0 {
            rest.extend(ordered);
            continue;
        }
        slots.push(QuantizedSlot {
            format,
            rows,
            cols,
            values: ordered[0].clone(),
            scales: ordered[1].clone(),
            second_level,
            parts: ordered,
        });
    }
    Ok((slots, rest))
}

/// Why a layer was not staged on the device.
enum Staging {
    /// No device memory for it: it takes the host path.
    NoRoom(String),
    /// Reading or checking it failed: the commit cannot go on.
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::loader;
    use crate::model::ModelConfig;
    use crate::quant::Recipe;

    /// The embedded model's engine description with NVFP4 experts.
    fn nvfp4_info() -> EngineInfo {
        let cfg =
            ModelConfig::from_json(serde_json::from_str(crate::serve::EMBEDDED_CONFIG).unwrap())
                .unwrap();
        let recipe = Recipe::builtin("nvfp4").unwrap();
        let mut model = loader::dummy_model(cfg, &recipe, 7).unwrap();
        EngineInfo::for_test(&mut model, recipe, true)
    }

    /// A BF16 tensor of `shape` with values from `seed`.
    fn bf16(shape: &[usize], seed: u32) -> StagedTensor {
        let n: usize = shape.iter().product();
        let data: Vec<u8> = (0..n)
            .flat_map(|i| {
                let x = ((i as u32).wrapping_mul(2654435761) ^ seed) % 2001;
                half::bf16::from_f32((x as f32 - 1000.0) / 4000.0).to_le_bytes()
            })
            .collect();
        StagedTensor {
            dtype: safetensors::tensor::Dtype::BF16,
            shape: shape.to_vec(),
            data: bytes::Bytes::from(data),
        }
    }

    /// NVFP4 slots spilled in stored form come out whole, in the stored layout, with the
    /// second-level scale the host quantizer chose (one for both halves of a gate/up pair);
    /// other slots, and a slot whose `input_scale` is not 1, are left to the host path.
    #[test]
    fn spilled_nvfp4_slots_are_recognised_whole() {
        let info = nvfp4_info();
        let hidden = info.config.hidden_size;
        // A gate/up pair of one expert in an NVFP4 layer, and a BF16 norm.
        let gate = info
            .slots()
            .keys()
            .map(|n| n.as_str())
            .find(|n| {
                n.ends_with("gate_proj.weight")
                    && served_part(&info, n)
                        .is_ok_and(|(s, _)| s.format.format == Format::Nvfp4 && s.pair.is_some())
            })
            .expect("an NVFP4 expert")
            .to_string();
        let up = gate.replace("gate_proj", "up_proj");
        let norm = "model.norm.weight".to_string();
        let shape = |n: &str| served_part(&info, n).unwrap().0.shape;
        let staged: BTreeMap<String, StagedTensor> = [
            (gate.clone(), bf16(&shape(&gate), 1)),
            (up.clone(), bf16(&shape(&up), 2)),
            (norm.clone(), bf16(&shape(&norm), 3)),
        ]
        .into_iter()
        .collect();
        let prepared = build_replacements(&info, staged).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut spill = Spill::create(dir.path()).unwrap();
        for (name, r) in &prepared {
            let module = name.strip_suffix(".weight").unwrap();
            spill
                .write_parts(name.clone(), module, &r.checkpoint_parts(hidden))
                .unwrap();
        }
        let parts: Vec<SpilledPart> = spill.groups().into_iter().flatten().collect();
        let (slots, rest) = quantized_slots(&info, &spill, parts).unwrap();

        let rest: Vec<&str> = rest.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(rest, [norm.as_str()], "the BF16 norm takes the host path");
        let names: Vec<&str> = slots.iter().map(|q| q.values.name.as_str()).collect();
        assert_eq!(names.len(), 2);
        assert!(names.contains(&gate.as_str()) && names.contains(&up.as_str()));
        for q in &slots {
            let (rows, cols) = (shape(&q.values.name)[0], shape(&q.values.name)[1]);
            assert_eq!((q.format, q.rows, q.cols), (Format::Nvfp4, rows, cols));
            assert_eq!(q.values.shape, [rows, cols / 2]);
            assert_eq!(
                q.scales.name,
                q.values.name.replace(".weight", ".weight_scale")
            );
            // The second level is the one spilled, read back.
            let spilled = q
                .parts
                .iter()
                .find(|p| p.name.ends_with(".weight_scale_2"))
                .unwrap();
            let bytes = spill.read(spilled).unwrap();
            assert_eq!(q.second_level.to_le_bytes().to_vec(), bytes);
            assert!(q.second_level > 0.0);
        }
        assert_eq!(
            slots[0].second_level.to_bits(),
            slots[1].second_level.to_bits(),
            "the pair shares its second-level scale"
        );

        // The same gate slot with an input scale of 2: not the stored form, so the host path.
        let module = gate.strip_suffix(".weight").unwrap();
        let r = &prepared.iter().find(|(n, _)| *n == gate).unwrap().1;
        let mut odd = r.checkpoint_parts(hidden);
        let input = odd.iter_mut().find(|p| p.suffix == "input_scale").unwrap();
        input.data = std::borrow::Cow::Owned(2.0f32.to_le_bytes().to_vec());
        let mut spill = Spill::create(dir.path()).unwrap();
        spill.write_parts(gate.clone(), module, &odd).unwrap();
        let parts: Vec<SpilledPart> = spill.groups().into_iter().flatten().collect();
        let (slots, rest) = quantized_slots(&info, &spill, parts).unwrap();
        assert!(slots.is_empty());
        assert_eq!(
            rest.len(),
            4,
            "every part of the slot goes to the host path"
        );
    }
}
