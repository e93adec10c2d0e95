//! Paged attention on the CPU over the paged KV cache.
//!
//! New keys and values are written to their cache slots first and every query then reads
//! only from the cache, so a token sees the same stored K/V whether its prefix was computed in
//! this chunk, an earlier chunk, or by another request (prefix cache): logits do not depend on
//! chunking, batching or cache hits. The cache dtype follows the model (SGLang's
//! `--kv-cache-dtype auto`): BF16 for BF16/quantized checkpoints, F32 for F32 ones.

use half::bf16;
use rayon::prelude::*;

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    Bf16,
    F32,
}

trait KvElem: Copy + Send + Sync {
    fn load(self) -> f32;
    fn store(x: f32) -> Self;
}
impl KvElem for bf16 {
    #[inline]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn store(x: f32) -> Self {
        bf16::from_f32(x)
    }
}
impl KvElem for f32 {
    #[inline]
    fn load(self) -> f32 {
        self
    }
    #[inline]
    fn store(x: f32) -> Self {
        x
    }
}

/// Per layer K and V buffers of `[num_blocks, block_size, kv_heads, head_dim]`.
enum KvData {
    Bf16 {
        k: Vec<Vec<bf16>>,
        v: Vec<Vec<bf16>>,
    },
    F32 {
        k: Vec<Vec<f32>>,
        v: Vec<Vec<f32>>,
    },
}

/// The physical KV cache, owned by the engine thread.
pub struct KvMemory {
    pub block_size: usize,
    pub num_blocks: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    data: KvData,
}

impl KvMemory {
    pub fn new(
        dtype: KvDtype,
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> KvMemory {
        let n = num_blocks * block_size * kv_heads * head_dim;
        let data = match dtype {
            KvDtype::Bf16 => KvData::Bf16 {
                k: vec![vec![bf16::ZERO; n]; num_layers],
                v: vec![vec![bf16::ZERO; n]; num_layers],
            },
            KvDtype::F32 => KvData::F32 {
                k: vec![vec![0.0; n]; num_layers],
                v: vec![vec![0.0; n]; num_layers],
            },
        };
        KvMemory {
            block_size,
            num_blocks,
            kv_heads,
            head_dim,
            data,
        }
    }

    pub fn dtype(&self) -> KvDtype {
        match self.data {
            KvData::Bf16 { .. } => KvDtype::Bf16,
            KvData::F32 { .. } => KvDtype::F32,
        }
    }

    /// Bytes one token occupies across all layers (K and V).
    pub fn bytes_per_token(
        dtype: KvDtype,
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> usize {
        let elem = if dtype == KvDtype::Bf16 { 2 } else { 4 };
        2 * num_layers * kv_heads * head_dim * elem
    }

    /// The raw BF16 bits of layer `layer`'s K cache (tests compare other backends' caches).
    pub fn k_bits(&self, layer: usize) -> Vec<u16> {
        match &self.data {
            KvData::Bf16 { k, .. } => k[layer].iter().map(|v| v.to_bits()).collect(),
            KvData::F32 { .. } => panic!("k_bits of an F32 cache"),
        }
    }

    /// The raw BF16 bits of layer `layer`'s V cache.
    pub fn v_bits(&self, layer: usize) -> Vec<u16> {
        match &self.data {
            KvData::Bf16 { v, .. } => v[layer].iter().map(|x| x.to_bits()).collect(),
            KvData::F32 { .. } => panic!("v_bits of an F32 cache"),
        }
    }

    /// `x` as this cache stores it (rounded to its dtype): what attention reads back.
    pub fn stored(&self, x: &[f32]) -> Vec<f32> {
        match self.data {
            KvData::Bf16 { .. } => x.iter().map(|&v| bf16::store(v).load()).collect(),
            KvData::F32 { .. } => x.to_vec(),
        }
    }

    /// Stores K and V (`[kv_heads * head_dim]` each) of the token at `pos`.
    pub fn write(&mut self, layer: usize, block_table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let s = slot(
            self.block_size,
            self.kv_heads * self.head_dim,
            block_table,
            pos,
        );
        fn put<T: KvElem>(dst: &mut [T], src: &[f32]) {
            for (d, x) in dst.iter_mut().zip(src) {
                *d = T::store(*x);
            }
        }
        let w = k.len();
        match &mut self.data {
            KvData::Bf16 { k: kc, v: vc } => {
                put(&mut kc[layer][s..s + w], k);
                put(&mut vc[layer][s..s + w], v);
            }
            KvData::F32 { k: kc, v: vc } => {
                put(&mut kc[layer][s..s + w], k);
                put(&mut vc[layer][s..s + w], v);
            }
        }
    }
}

#[inline]
fn slot(block_size: usize, width: usize, block_table: &[u32], pos: usize) -> usize {
    let block = block_table[pos / block_size] as usize;
    (block * block_size + pos % block_size) * width
}

/// One sequence's query rows in a batch: queries for positions `start_pos..start_pos + len`.
pub struct AttentionSeq<'a> {
    pub block_table: &'a [u32],
    pub start_pos: usize,
    pub len: usize,
}

/// Causal GQA attention for every query row of every sequence. `q`: `[total_rows, heads *
/// head_dim]` in sequence order; `out` the same shape.
pub fn paged_attention(
    mem: &KvMemory,
    layer: usize,
    seqs: &[AttentionSeq<'_>],
    q: &[f32],
    num_heads: usize,
    out: &mut [f32],
) {
    match &mem.data {
        KvData::Bf16 { k, v } => attend(mem, &k[layer], &v[layer], seqs, q, num_heads, out),
        KvData::F32 { k, v } => attend(mem, &k[layer], &v[layer], seqs, q, num_heads, out),
    }
}

fn attend<T: KvElem>(
    mem: &KvMemory,
    kc: &[T],
    vc: &[T],
    seqs: &[AttentionSeq<'_>],
    q: &[f32],
    num_heads: usize,
    out: &mut [f32],
) {
    let hd = mem.head_dim;
    let kv_width = mem.kv_heads * hd;
    let group = num_heads / mem.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let width = num_heads * hd;
    let rows: Vec<(&[u32], usize)> = seqs
        .iter()
        .flat_map(|s| (0..s.len).map(move |i| (s.block_table, s.start_pos + i)))
        .collect();
    out.par_chunks_mut(width)
        .zip(q.par_chunks(width))
        .zip(rows.par_iter())
        .for_each(|((o, qrow), &(table, pos))| {
            let mut scores = vec![0f32; pos + 1];
            for h in 0..num_heads {
                let kvh = h / group;
                let qh = &qrow[h * hd..][..hd];
                for (t, s) in scores.iter_mut().enumerate() {
                    let base = slot(mem.block_size, kv_width, table, t) + kvh * hd;
                    let mut acc = 0f32;
                    for (a, b) in qh.iter().zip(&kc[base..base + hd]) {
                        acc += a * b.load();
                    }
                    *s = acc * scale;
                }
                super::ops::softmax_inplace(&mut scores);
                let oh = &mut o[h * hd..][..hd];
                oh.fill(0.0);
                for (t, p) in scores.iter().enumerate() {
                    let base = slot(mem.block_size, kv_width, table, t) + kvh * hd;
                    for (acc, v) in oh.iter_mut().zip(&vc[base..base + hd]) {
                        *acc += p * v.load();
                    }
                }
            }
        });
}
