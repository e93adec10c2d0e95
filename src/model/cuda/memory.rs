//! Releasing the device weights' memory for a colocated trainer (`/release_memory_occupation`)
//! and bringing it back. Every weight buffer is visited in one fixed order ([`walk`]); a release
//! swaps each for a one-element placeholder (so the model keeps its structure and nothing can
//! point at freed memory) after copying it to the host when a backup is kept; a resume
//! allocates each at its old size again, from the backup (the same bits) or zeroed (absent:
//! never served until an update writes every tensor). Both allocate everything new before
//! touching the model, so a failure (the trainer still holds the memory) changes nothing.
//! [`CudaWeights::copy_on`] copies every buffer on another stream: a streamed update's shadow.
//! RoPE's frequencies stay resident: they are derived from the config, no update writes them,
//! and they are a few kilobytes.

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};

use super::CudaWeights;
use crate::backend::cuda::backend::{Cuda, CudaExperts, CudaSwiGlu};
use crate::backend::cuda::ops::{Table, WeightData};
use crate::backend::cuda::weights::GpuMatrix;
use crate::backend::cuda::{CudaError, Gpu};
use crate::model::{Layer, Mlp, Model, Moe};

/// A released buffer's host copy.
enum Host {
    U8(Vec<u8>),
    U16(Vec<u16>),
    F32(Vec<f32>),
}

/// A device buffer taken out of (or about to go into) the model.
enum Device {
    U8(CudaSlice<u8>),
    U16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

/// The element types weight buffers hold, and their place in [`Host`] and [`Device`].
trait Elem: DeviceRepr + ValidAsZeroBits + Default + Clone + 'static {
    fn host(v: Vec<Self>) -> Host;
    fn host_ref(h: &Host) -> Option<&[Self]>;
    fn device(s: CudaSlice<Self>) -> Device;
    fn from_device(d: Device) -> Option<CudaSlice<Self>>;
}

macro_rules! elem {
    ($t:ty, $v:ident) => {
        impl Elem for $t {
            fn host(v: Vec<Self>) -> Host {
                Host::$v(v)
            }
            fn host_ref(h: &Host) -> Option<&[Self]> {
                match h {
                    Host::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn device(s: CudaSlice<Self>) -> Device {
                Device::$v(s)
            }
            fn from_device(d: Device) -> Option<CudaSlice<Self>> {
                match d {
                    Device::$v(s) => Some(s),
                    _ => None,
                }
            }
        }
    };
}
elem!(u8, U8);
elem!(u16, U16);
elem!(f32, F32);

/// One pass over every weight buffer.
trait Visit {
    fn visit<T: Elem>(&mut self, gpu: &Gpu, s: &mut CudaSlice<T>) -> Result<(), CudaError>;
}

/// Every weight buffer of `w`, always in the same order.
fn walk(w: &mut CudaWeights, gpu: &Gpu, v: &mut impl Visit) -> Result<(), CudaError> {
    match &mut w.embed_tokens {
        Table::Bf16(t) => v.visit(gpu, t)?,
        Table::F32(t) => v.visit(gpu, t)?,
    }
    v.visit(gpu, &mut w.norm)?;
    if let Some(head) = &mut w.lm_head {
        matrix(head, gpu, v)?;
    }
    for l in &mut w.layers {
        v.visit(gpu, &mut l.input_norm)?;
        v.visit(gpu, &mut l.post_attention_norm)?;
        for m in [&mut l.q_proj, &mut l.k_proj, &mut l.v_proj, &mut l.o_proj] {
            matrix(m, gpu, v)?;
        }
        for n in [&mut l.q_norm, &mut l.k_norm].into_iter().flatten() {
            v.visit(gpu, n)?;
        }
        match &mut l.mlp {
            Mlp::Dense(m) => {
                matrix(&mut m.gate_up, gpu, v)?;
                matrix(&mut m.down, gpu, v)?;
            }
            Mlp::Moe(m) => {
                matrix(&mut m.router, gpu, v)?;
                matrix(&mut m.experts.gate_up, gpu, v)?;
                matrix(&mut m.experts.down, gpu, v)?;
            }
        }
    }
    Ok(())
}

fn matrix(m: &mut GpuMatrix, gpu: &Gpu, v: &mut impl Visit) -> Result<(), CudaError> {
    match &mut m.data {
        WeightData::F32(d) => v.visit(gpu, d),
        WeightData::Bf16(d) => v.visit(gpu, d),
        WeightData::Mxfp8 { data, scales } => {
            v.visit(gpu, data)?;
            v.visit(gpu, scales)
        }
        WeightData::Nvfp4 {
            data,
            scales,
            s_dec,
            ..
        } => {
            v.visit(gpu, data)?;
            v.visit(gpu, scales)?;
            v.visit(gpu, s_dec)
        }
    }
}

/// Each buffer's length and the total bytes.
#[derive(Default)]
struct Measure {
    lens: Vec<usize>,
    bytes: usize,
}

impl Visit for Measure {
    fn visit<T: Elem>(&mut self, _: &Gpu, s: &mut CudaSlice<T>) -> Result<(), CudaError> {
        self.lens.push(s.len());
        self.bytes += s.len() * std::mem::size_of::<T>();
        Ok(())
    }
}

/// Each buffer copied to host memory (allocated fallibly: a host too small for the backup is
/// an error, not an abort).
#[derive(Default)]
struct Backup {
    host: Vec<Host>,
}

impl Visit for Backup {
    fn visit<T: Elem>(&mut self, gpu: &Gpu, s: &mut CudaSlice<T>) -> Result<(), CudaError> {
        let mut host: Vec<T> = Vec::new();
        host.try_reserve_exact(s.len()).map_err(|_| {
            CudaError::Capacity(format!(
                "no host memory for the weights' backup ({} more bytes)",
                s.len() * std::mem::size_of::<T>()
            ))
        })?;
        host.resize(s.len(), T::default());
        gpu.stream.memcpy_dtoh(s, &mut host)?;
        self.host.push(T::host(host));
        Ok(())
    }
}

/// A new buffer per visited one: `lens[i]` elements (0: a one-element placeholder), holding
/// `host[i]` when given, else zeros.
struct Allocate<'a> {
    lens: &'a [usize],
    host: Option<&'a [Host]>,
    fresh: Vec<Device>,
}

impl Visit for Allocate<'_> {
    fn visit<T: Elem>(&mut self, gpu: &Gpu, _: &mut CudaSlice<T>) -> Result<(), CudaError> {
        let i = self.fresh.len();
        let s = match self.host {
            Some(host) => {
                let values = host.get(i).and_then(T::host_ref).ok_or_else(changed)?;
                gpu.upload(values)?
            }
            None => gpu.alloc::<T>(*self.lens.get(i).ok_or_else(changed)?)?,
        };
        self.fresh.push(T::device(s));
        Ok(())
    }
}

/// Puts the allocated buffers in, keeping the ones they displace (freed when dropped).
struct Install {
    fresh: std::vec::IntoIter<Device>,
    old: Vec<Device>,
}

impl Visit for Install {
    fn visit<T: Elem>(&mut self, _: &Gpu, s: &mut CudaSlice<T>) -> Result<(), CudaError> {
        // `Allocate` walked the same buffers in the same order: kinds and count match.
        let new = self
            .fresh
            .next()
            .and_then(T::from_device)
            .expect("allocated by a walk over the same buffers");
        self.old.push(T::device(std::mem::replace(s, new)));
        Ok(())
    }
}

fn changed() -> CudaError {
    CudaError::Unsupported("the weights' buffers differ from those that were released".into())
}

/// Released weights: every buffer's size, and the host backup when one was kept.
pub struct ParkedWeights {
    lens: Vec<usize>,
    host: Option<Vec<Host>>,
    /// Device bytes the buffers held.
    pub bytes: usize,
}

impl CudaWeights {
    /// Swaps every buffer in walk order for `fresh`; the displaced ones are dropped (freed).
    fn install(&mut self, gpu: &Gpu, fresh: Vec<Device>) -> Result<(), CudaError> {
        let mut install = Install {
            fresh: fresh.into_iter(),
            old: Vec::new(),
        };
        walk(self, gpu, &mut install)?;
        drop(install.old);
        Ok(())
    }

    /// Frees every weight buffer (each becomes a one-element placeholder), first copying
    /// them all to the host when `backup`. On failure nothing is freed.
    pub fn release(&mut self, gpu: &Gpu, backup: bool) -> Result<ParkedWeights, CudaError> {
        let mut sizes = Measure::default();
        walk(self, gpu, &mut sizes)?;
        let host = if backup {
            let mut b = Backup::default();
            walk(self, gpu, &mut b)?;
            gpu.synchronize()?;
            Some(b.host)
        } else {
            None
        };
        let placeholders = vec![0; sizes.lens.len()];
        let mut alloc = Allocate {
            lens: &placeholders,
            host: None,
            fresh: Vec::with_capacity(placeholders.len()),
        };
        walk(self, gpu, &mut alloc)?;
        self.install(gpu, alloc.fresh)?;
        Ok(ParkedWeights {
            lens: sizes.lens,
            host,
            bytes: sizes.bytes,
        })
    }

    /// Allocates every buffer at its released size: the backup's bytes, or zeros. On failure
    /// nothing is allocated and the weights stay released.
    pub fn restore(&mut self, gpu: &Gpu, parked: &ParkedWeights) -> Result<(), CudaError> {
        let mut alloc = Allocate {
            lens: &parked.lens,
            host: parked.host.as_deref(),
            fresh: Vec::with_capacity(parked.lens.len()),
        };
        walk(self, gpu, &mut alloc)?;
        if alloc.fresh.len() != parked.lens.len() {
            return Err(changed());
        }
        // The uploads are done before the placeholders go and the caller drops the backup.
        gpu.synchronize()?;
        self.install(gpu, alloc.fresh)
    }
}

// ---------------------------------------------------------------------------------------------
// A copy of the weights on another stream: a streamed update's shadow.

fn dup<T: DeviceRepr>(gpu: &Gpu, s: &CudaSlice<T>) -> Result<CudaSlice<T>, CudaError> {
    Ok(gpu.stream.clone_dtod(s)?)
}

fn dup_matrix(gpu: &Gpu, m: &GpuMatrix) -> Result<GpuMatrix, CudaError> {
    let data = match &m.data {
        WeightData::F32(d) => WeightData::F32(dup(gpu, d)?),
        WeightData::Bf16(d) => WeightData::Bf16(dup(gpu, d)?),
        WeightData::Mxfp8 { data, scales } => WeightData::Mxfp8 {
            data: dup(gpu, data)?,
            scales: dup(gpu, scales)?,
        },
        WeightData::Nvfp4 {
            data,
            scales,
            s_dec,
            groups,
        } => WeightData::Nvfp4 {
            data: dup(gpu, data)?,
            scales: dup(gpu, scales)?,
            s_dec: dup(gpu, s_dec)?,
            groups: *groups,
        },
    };
    Ok(GpuMatrix {
        experts: m.experts,
        n: m.n,
        k: m.k,
        data,
        act: m.act,
    })
}

fn dup_layer(gpu: &Gpu, l: &Layer<Cuda>) -> Result<Layer<Cuda>, CudaError> {
    let norm = |n: &Option<CudaSlice<f32>>| n.as_ref().map(|n| dup(gpu, n)).transpose();
    let mlp = match &l.mlp {
        Mlp::Dense(m) => Mlp::Dense(CudaSwiGlu {
            gate_up: dup_matrix(gpu, &m.gate_up)?,
            down: dup_matrix(gpu, &m.down)?,
            inter: m.inter,
        }),
        Mlp::Moe(m) => Mlp::Moe(Moe {
            router: dup_matrix(gpu, &m.router)?,
            experts: CudaExperts {
                gate_up: dup_matrix(gpu, &m.experts.gate_up)?,
                down: dup_matrix(gpu, &m.experts.down)?,
                inter: m.experts.inter,
                count: m.experts.count,
            },
            top_k: m.top_k,
            norm_topk_prob: m.norm_topk_prob,
        }),
    };
    Ok(Layer {
        input_norm: dup(gpu, &l.input_norm)?,
        post_attention_norm: dup(gpu, &l.post_attention_norm)?,
        q_proj: dup_matrix(gpu, &l.q_proj)?,
        k_proj: dup_matrix(gpu, &l.k_proj)?,
        v_proj: dup_matrix(gpu, &l.v_proj)?,
        o_proj: dup_matrix(gpu, &l.o_proj)?,
        q_norm: norm(&l.q_norm)?,
        k_norm: norm(&l.k_norm)?,
        mlp,
    })
}

impl CudaWeights {
    /// A copy of every buffer, allocated and copied on `gpu`'s stream (a loader's, so the
    /// copy runs beside the engine's kernels, which only read the originals). On failure
    /// (no room) what was allocated is freed and the served weights are untouched.
    pub fn copy_on(&self, gpu: &Gpu) -> Result<CudaWeights, CudaError> {
        let embed_tokens = match &self.embed_tokens {
            Table::Bf16(t) => Table::Bf16(dup(gpu, t)?),
            Table::F32(t) => Table::F32(dup(gpu, t)?),
        };
        Ok(Model {
            config: self.config.clone(),
            embed_tokens,
            layers: self
                .layers
                .iter()
                .map(|l| dup_layer(gpu, l))
                .collect::<Result<_, _>>()?,
            norm: dup(gpu, &self.norm)?,
            lm_head: self
                .lm_head
                .as_ref()
                .map(|h| dup_matrix(gpu, h))
                .transpose()?,
            inv_freq: dup(gpu, &self.inv_freq)?,
        })
    }
}
