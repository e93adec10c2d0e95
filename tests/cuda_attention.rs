//! Attention on the GPU, on fresh random BF16 caches, for contexts of 1 key, a few keys, block
//! boundaries and several thousand keys, GQA ratios 1/3/4/8/16 and head_dim 64 and 128:
//! - against the CPU `paged_attention`: the one-block-per-(row, head) CUDA-core kernel (f32
//!   math like the CPU's, only the summation order differs: within 1e-5 relative over a case,
//!   1e-4 per row) and the tensor-core kernels split as the engine splits a step (q and p
//!   rounded to BF16, ~1e-3 from the CPU's f32 products: within 1e-2 over a case, 3e-2 per
//!   row; a wrong key, mask or scale is off by ~1);
//! - batch invariance, bitwise: every query row of the tensor-core kernels has the same bits
//!   whether its sequence is prefilled in one chunk, in chunks of 1, 7, 64 or 100 rows on top
//!   of its cached prefix, decoded row by row alone (its keys split over blocks or not), or
//!   decoded among other sequences' rows and chunks in one step.
//!
//! These need an NVIDIA GPU, so they are `#[ignore]`d here and run on the GPU host by
//! scripts/gpu-check.sh (`cuda_attention --ignored`).

use cudarc::driver::CudaSlice;
use lockstep::backend::cpu::attention::{paged_attention, AttentionSeq, KvDtype, KvMemory};
use lockstep::backend::cuda::ops::{self, AttnRows, AttnShape, DecodeSplit};
use lockstep::backend::cuda::Gpu;

mod common;
use common::cuda::{rel_err, seed, Rng};

const BLOCK_SIZE: usize = 16;
/// Every context here fits the split-KV scratch.
const MAX_CONTEXT: usize = 4200;
/// Qwen3-30B-A3B's attention: 32 query heads over 4 KV heads of 128.
const QWEN3_MOE: AttnShape = AttnShape {
    heads: 32,
    kv_heads: 4,
    head_dim: 128,
    block_size: BLOCK_SIZE,
};

/// Split-KV scratch for up to 64 decode rows of `shape`.
fn decode_split(g: &Gpu, shape: AttnShape) -> DecodeSplit {
    let split = DecodeSplit::new(g, shape, MAX_CONTEXT, 64)
        .unwrap()
        .unwrap();
    assert!(
        split.splits(1, shape) > 1,
        "one decode row splits over its keys"
    );
    split
}

/// One attention problem: sequences of `contexts[i]` keys, each with its last `q_lens[i]`
/// positions as query rows (1: a decode row; more: a chunk on top of a cached prefix).
struct Case {
    contexts: Vec<usize>,
    q_lens: Vec<usize>,
    shape: AttnShape,
}

/// The CPU's cache, queries and answer, and the device copies of all of it.
struct Problem {
    rows: usize,
    q_lens: Vec<usize>,
    longest: usize,
    want: Vec<f32>,
    row_ctx: Vec<usize>,
    q: cudarc::driver::CudaSlice<f32>,
    k: cudarc::driver::CudaSlice<u16>,
    v: cudarc::driver::CudaSlice<u16>,
    pos: cudarc::driver::CudaSlice<i32>,
    seq: cudarc::driver::CudaSlice<i32>,
    offsets: cudarc::driver::CudaSlice<i32>,
    tables: cudarc::driver::CudaSlice<i32>,
}

impl Problem {
    fn new(g: &Gpu, rng: &mut Rng, case: &Case) -> Problem {
        let s = case.shape;
        let (kvw, qw) = (s.kv_heads * s.head_dim, s.heads * s.head_dim);
        let blocks: Vec<usize> = case
            .contexts
            .iter()
            .map(|c| c.div_ceil(s.block_size))
            .collect();
        // Blocks in a shuffled order, with spare ones, so the tables are really followed.
        let num_blocks = blocks.iter().sum::<usize>() + 3;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let mut tables: Vec<Vec<u32>> = Vec::new();
        let mut next = 0;
        for &b in &blocks {
            tables.push(ids[next..next + b].to_vec());
            next += b;
        }
        let mut cache = KvMemory::new(
            KvDtype::Bf16,
            1,
            num_blocks,
            s.block_size,
            s.kv_heads,
            s.head_dim,
        );
        for (table, &ctx) in tables.iter().zip(&case.contexts) {
            for p in 0..ctx {
                cache.write(0, table, p, &rng.vec(kvw, 1.0), &rng.vec(kvw, 1.0));
            }
        }
        let seqs: Vec<AttentionSeq<'_>> = tables
            .iter()
            .zip(case.contexts.iter().zip(&case.q_lens))
            .map(|(t, (&ctx, &len))| AttentionSeq {
                block_table: t,
                start_pos: ctx - len,
                len,
            })
            .collect();
        let rows: usize = case.q_lens.iter().sum();
        // Scale 3 gives scores of unit spread: softmaxes neither flat nor one-hot.
        let q = rng.vec(rows * qw, 3.0);
        let mut want = vec![0f32; rows * qw];
        paged_attention(&cache, 0, &seqs, &q, s.heads, &mut want);
        let (mut pos, mut seq, mut row_ctx) = (Vec::new(), Vec::new(), Vec::new());
        for (i, (&ctx, &len)) in case.contexts.iter().zip(&case.q_lens).enumerate() {
            for p in ctx - len..ctx {
                pos.push(p as i32);
                seq.push(i as i32);
                row_ctx.push(p + 1);
            }
        }
        let mut offsets = Vec::new();
        let mut flat = Vec::new();
        for t in &tables {
            offsets.push(flat.len() as i32);
            flat.extend(t.iter().map(|&b| b as i32));
        }
        // The cache rows no sequence wrote (the ends of last blocks, the spare blocks) hold NaN,
        // as a server's stale or never-written rows may: no kernel may let them into a result
        // (keys past a row's position are masked and their V rows copied as zeros, or zeroed).
        let mut written = vec![false; num_blocks * s.block_size];
        for (table, &ctx) in tables.iter().zip(&case.contexts) {
            for p in 0..ctx {
                written[table[p / s.block_size] as usize * s.block_size + p % s.block_size] = true;
            }
        }
        let stale = |mut bits: Vec<u16>| {
            for (row, _) in written.iter().enumerate().filter(|(_, &w)| !w) {
                bits[row * kvw..(row + 1) * kvw].fill(0x7fc0);
            }
            bits
        };
        Problem {
            rows,
            q_lens: case.q_lens.clone(),
            longest: *case.contexts.iter().max().unwrap(),
            want,
            row_ctx,
            q: g.upload(&q).unwrap(),
            k: g.upload(&stale(cache.k_bits(0))).unwrap(),
            v: g.upload(&stale(cache.v_bits(0))).unwrap(),
            pos: g.upload(&pos).unwrap(),
            seq: g.upload(&seq).unwrap(),
            offsets: g.upload(&offsets).unwrap(),
            tables: g.upload(&flat).unwrap(),
        }
    }

    fn meta(&self) -> AttnRows<'_> {
        AttnRows {
            pos: &self.pos,
            seq: &self.seq,
            table_offsets: &self.offsets,
            block_tables: &self.tables,
        }
    }

    /// Checks one output against the CPU's within `case_tol` over the case and `row_tol` per
    /// row; returns the case-wide relative error.
    fn check(&self, got: &[f32], what: &str, s: AttnShape, case_tol: f64, row_tol: f64) -> f64 {
        let width = s.heads * s.head_dim;
        let err = rel_err(got, &self.want);
        assert!(err < case_tol, "{what}: relative error {err}");
        for (r, ctx) in self.row_ctx.iter().enumerate() {
            let e = rel_err(&got[r * width..][..width], &self.want[r * width..][..width]);
            assert!(
                e < row_tol,
                "{what}: row {r} ({ctx} keys) relative error {e}"
            );
        }
        err
    }
}

/// The tensor-core kernels over `rows` query rows, split as the engine splits a step
/// (`ops::attention_split`): prefill tiles for sequences of several rows, the decode kernel for
/// single rows (split over their keys with `split`, when the batch is small).
#[allow(clippy::too_many_arguments)]
fn tensor_core_attention(
    g: &Gpu,
    q: &CudaSlice<f32>,
    k: &CudaSlice<u16>,
    v: &CudaSlice<u16>,
    meta: &AttnRows<'_>,
    q_lens: &[usize],
    shape: AttnShape,
    split: Option<&DecodeSplit>,
) -> Vec<f32> {
    let rows: usize = q_lens.iter().sum();
    let n = rows * shape.heads * shape.head_dim;
    let (tiles, decode_rows) = ops::attention_split(q_lens.iter().copied());
    let (dt, dr) = (g.upload(&tiles).unwrap(), g.upload(&decode_rows).unwrap());
    let mut out = g.upload(&vec![f32::NAN; n]).unwrap();
    ops::prefill_attention(
        g,
        q,
        &mut out,
        k,
        v,
        meta,
        &dt,
        tiles.len() / 2,
        rows,
        shape,
        ops::PrefillBlocks::chosen(g, shape),
    )
    .unwrap();
    ops::decode_attention(
        g,
        q,
        &mut out,
        k,
        v,
        meta,
        Some(&dr),
        decode_rows.len(),
        rows,
        shape,
        split,
    )
    .unwrap();
    g.download(&out, n).unwrap()
}

fn contexts(long: bool) -> (Vec<usize>, Vec<usize>) {
    if long {
        (vec![1, 16, 17, 1000, 3001, 4099], vec![1, 1, 2, 1, 3, 1])
    } else {
        (
            vec![1, 2, 3, 5, 15, 16, 17, 32, 33, 64, 65, 130],
            vec![1, 1, 3, 1, 1, 2, 1, 1, 4, 1, 65, 70],
        )
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn attention_matches_the_cpu_for_every_gqa_ratio_and_head_dim() {
    let g = Gpu::open(0).expect("a CUDA device");
    let mut rng = Rng(seed());
    let kv_heads = 2;
    for head_dim in [64, 128] {
        for group in [1, 3, 4, 8, 16] {
            for long in [false, true] {
                let shape = AttnShape {
                    heads: kv_heads * group,
                    kv_heads,
                    head_dim,
                    block_size: BLOCK_SIZE,
                };
                let (ctx, q_lens) = contexts(long);
                let case = Case {
                    contexts: ctx,
                    q_lens,
                    shape,
                };
                let p = Problem::new(&g, &mut rng, &case);
                let n = p.rows * shape.heads * head_dim;
                let what = format!("hd {head_dim} group {group} long {long}");

                let mut out = g.upload(&vec![f32::NAN; n]).unwrap();
                ops::paged_attention(&g, &p.q, &mut out, &p.k, &p.v, &p.meta(), p.rows, shape)
                    .unwrap();
                let cuda_cores = p.check(
                    &g.download(&out, n).unwrap(),
                    &format!("paged_attention {what}"),
                    shape,
                    1e-5,
                    1e-4,
                );
                let split = decode_split(&g, shape);
                let mut tensor = 0f64;
                for (how, split) in [("", None), (", keys split", Some(&split))] {
                    let got = tensor_core_attention(
                        &g,
                        &p.q,
                        &p.k,
                        &p.v,
                        &p.meta(),
                        &p.q_lens,
                        shape,
                        split,
                    );
                    let err = p.check(
                        &got,
                        &format!("tensor cores {what}{how}"),
                        shape,
                        1e-2,
                        3e-2,
                    );
                    tensor = tensor.max(err);
                }
                println!(
                    "head_dim {head_dim:>3} GQA {group:>2} longest {:>4}: relative error {cuda_cores:.2e} (CUDA cores), {tensor:.2e} (tensor cores)",
                    p.longest
                );
            }
        }
    }
}

/// Sequences in one cache with a query row for every position, run through the tensor-core
/// kernels in steps of any composition.
struct Rows {
    shape: AttnShape,
    contexts: Vec<usize>,
    /// Per sequence, `[position][heads * head_dim]` flattened.
    q: Vec<Vec<f32>>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    offsets: CudaSlice<i32>,
    tables: CudaSlice<i32>,
}

impl Rows {
    fn new(g: &Gpu, rng: &mut Rng, contexts: &[usize], shape: AttnShape) -> Rows {
        let case = Case {
            contexts: contexts.to_vec(),
            q_lens: contexts.to_vec(),
            shape,
        };
        let p = Problem::new(g, rng, &case);
        let width = shape.heads * shape.head_dim;
        let all = g.download(&p.q, p.rows * width).unwrap();
        let mut q = Vec::new();
        let mut at = 0;
        for &c in contexts {
            q.push(all[at * width..(at + c) * width].to_vec());
            at += c;
        }
        Rows {
            shape,
            contexts: contexts.to_vec(),
            q,
            k: p.k,
            v: p.v,
            offsets: p.offsets,
            tables: p.tables,
        }
    }

    /// Every sequence in one chunk: the parts of [`Rows::prefilled`].
    fn whole(&self) -> Vec<(usize, usize, usize)> {
        self.contexts
            .iter()
            .enumerate()
            .map(|(s, &c)| (s, 0, c))
            .collect()
    }

    /// The reference of the bitwise tests: every sequence prefilled in one chunk, all in one
    /// step; each sequence's output rows.
    fn prefilled(&self, g: &Gpu) -> Vec<Vec<f32>> {
        self.step(g, &self.whole(), None)
    }

    /// Every sequence prefilled in one chunk by `ops::prefill_attention` in `blocks`; each
    /// sequence's output rows.
    fn prefilled_in_blocks(&self, g: &Gpu, blocks: ops::PrefillBlocks) -> Vec<Vec<f32>> {
        self.run(g, &self.whole(), |q, meta, lens| {
            let rows: usize = lens.iter().sum();
            let n = rows * self.shape.heads * self.shape.head_dim;
            let tiles = ops::prefill_tiles(lens.iter().copied());
            let dt = g.upload(&tiles).unwrap();
            let mut out = g.upload(&vec![f32::NAN; n]).unwrap();
            let (k, v) = (&self.k, &self.v);
            let num_tiles = tiles.len() / 2;
            ops::prefill_attention(
                g, q, &mut out, k, v, meta, &dt, num_tiles, rows, self.shape, blocks,
            )
            .unwrap();
            g.download(&out, n).unwrap()
        })
    }

    /// One step of `(sequence, first position, rows)` parts; returns each part's output rows.
    fn step(
        &self,
        g: &Gpu,
        parts: &[(usize, usize, usize)],
        split: Option<&DecodeSplit>,
    ) -> Vec<Vec<f32>> {
        self.run(g, parts, |q, meta, lens| {
            tensor_core_attention(g, q, &self.k, &self.v, meta, lens, self.shape, split)
        })
    }

    /// The parts' query rows, positions and sequences on the device, handed to `attend` (which
    /// returns every row's output); each part's output rows.
    fn run(
        &self,
        g: &Gpu,
        parts: &[(usize, usize, usize)],
        attend: impl FnOnce(&CudaSlice<f32>, &AttnRows<'_>, &[usize]) -> Vec<f32>,
    ) -> Vec<Vec<f32>> {
        let width = self.shape.heads * self.shape.head_dim;
        let (mut q, mut pos, mut seq) = (Vec::new(), Vec::new(), Vec::new());
        for &(s, first, len) in parts {
            assert!(first + len <= self.contexts[s]);
            q.extend_from_slice(&self.q[s][first * width..(first + len) * width]);
            pos.extend((first..first + len).map(|p| p as i32));
            seq.extend(std::iter::repeat_n(s as i32, len));
        }
        let (dq, dpos, dseq) = (
            g.upload(&q).unwrap(),
            g.upload(&pos).unwrap(),
            g.upload(&seq).unwrap(),
        );
        let meta = AttnRows {
            pos: &dpos,
            seq: &dseq,
            table_offsets: &self.offsets,
            block_tables: &self.tables,
        };
        let lens: Vec<usize> = parts.iter().map(|p| p.2).collect();
        let out = attend(&dq, &meta, &lens);
        let mut at = 0;
        lens.iter()
            .map(|&len| {
                let part = out[at * width..(at + len) * width].to_vec();
                at += len;
                part
            })
            .collect()
    }
}

fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} is {} where one chunk gave {}",
            got[i], want[i]
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn attention_rows_have_the_same_bits_however_they_are_batched() {
    let g = Gpu::open(0).expect("a CUDA device");
    let mut rng = Rng(seed());
    // Contexts at and around the 64-key tiles, the 128-key chunks and the 16-token blocks.
    let contexts = [1, 17, 63, 64, 65, 128, 129, 200, 257, 1000];
    for (head_dim, heads, kv_heads) in [(128, 32, 4), (128, 16, 16), (64, 9, 3), (64, 32, 2)] {
        let shape = AttnShape {
            heads,
            kv_heads,
            head_dim,
            block_size: BLOCK_SIZE,
        };
        let rows = Rows::new(&g, &mut rng, &contexts, shape);
        let split = decode_split(&g, shape);
        let width = heads * head_dim;
        let what = |s: usize, how: &str| {
            format!(
                "hd {head_dim} heads {heads}/{kv_heads}, {} keys, {how}",
                contexts[s]
            )
        };
        let want = rows.prefilled(&g);
        // Prefill in every kind of block the shape allows (one query head; two sharing K and V,
        // copied by their threads or by the TMA unit: Hopper at head_dim 128), against the
        // default's bits.
        for blocks in ops::PrefillBlocks::ALL {
            if !blocks.possible(&g, shape) {
                continue;
            }
            let got = rows.prefilled_in_blocks(&g, blocks);
            for (s, got) in got.iter().enumerate() {
                assert_same_bits(got, &want[s], &what(s, &format!("blocks {blocks:?}")));
            }
        }
        for (s, &c) in contexts.iter().enumerate() {
            // Alone, in one chunk.
            assert_same_bits(
                &rows.step(&g, &[(s, 0, c)], None)[0],
                &want[s],
                &what(s, "alone"),
            );
            // Chunked prefill on top of the cached prefix (chunk 1: the decode kernel, its
            // keys split over blocks or walked by one).
            for (chunk, split) in [
                (1, None),
                (1, Some(&split)),
                (7, None),
                (64, None),
                (100, None),
            ] {
                let mut got = Vec::new();
                for first in (0..c).step_by(chunk) {
                    let part = (s, first, chunk.min(c - first));
                    got.extend(rows.step(&g, &[part], split).remove(0));
                }
                let how = format!("chunks of {chunk}, split {}", split.is_some());
                assert_same_bits(&got, &want[s], &what(s, &how));
            }
        }
        // Decode steps: position p of every sequence long enough, in one batch, in a random
        // order, next to another sequence's chunk.
        for p in [0, 16, 63, 64, 99, 127, 128, 199, 256, 999] {
            let mut parts: Vec<(usize, usize, usize)> = (0..contexts.len())
                .filter(|&s| contexts[s] > p)
                .map(|s| (s, p, 1))
                .collect();
            for i in (1..parts.len()).rev() {
                parts.swap(i, rng.below(i + 1));
            }
            let chunk_at = rng.below(parts.len() + 1);
            parts.insert(chunk_at, (contexts.len() - 1, 500, 37));
            let got = rows.step(&g, &parts, Some(&split));
            for (part, out) in parts.iter().zip(&got) {
                let (s, first, len) = *part;
                let want_rows = &want[s][first * width..(first + len) * width];
                assert_same_bits(
                    out,
                    want_rows,
                    &what(s, &format!("in a step of {} parts", parts.len())),
                );
            }
        }
        println!(
            "hd {head_dim} heads {heads}/{kv_heads}: every row bitwise equal in every batching"
        );
    }
}

/// `decode_attention` runs head_dim 128 at three blocks an SM while its grid fits in one wave of
/// them, at four beyond: decode rows on both sides of that switch, in one step of every
/// sequence (four blocks a row: past the switch) and alone (under it), with the bits of the
/// same rows prefilled.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn decode_rows_have_the_same_bits_on_either_side_of_the_kernel_switch() {
    let g = Gpu::open(0).expect("a CUDA device");
    let mut rng = Rng(seed());
    let shape = QWEN3_MOE;
    // One step of these rows launches 4 blocks a row, more than three an SM can hold at once.
    let count = 3 * g.sm_count as usize / shape.kv_heads + 8;
    let contexts: Vec<usize> = (0..count).map(|_| 1 + rng.below(200)).collect();
    let rows = Rows::new(&g, &mut rng, &contexts, shape);
    let width = shape.heads * shape.head_dim;
    let want = rows.prefilled(&g);
    let last: Vec<(usize, usize, usize)> = contexts
        .iter()
        .enumerate()
        .map(|(s, &c)| (s, c - 1, 1))
        .collect();
    let together = rows.step(&g, &last, None);
    for (s, &c) in contexts.iter().enumerate() {
        let want_row = &want[s][(c - 1) * width..c * width];
        let what = format!("sequence {s} ({c} keys)");
        assert_same_bits(
            &together[s],
            want_row,
            &format!("{what}, in a step of {count}"),
        );
        let alone = rows.step(&g, &[last[s]], None).remove(0);
        assert_same_bits(&alone, want_row, &format!("{what}, alone"));
    }
    println!("{count} decode rows: the same bits in one step and alone, as prefilled");
}

/// A split decode block takes the chunks z, z + splits, ... of its row. The most rows that split
/// at 32 query heads over 4 KV heads (33, 8 ways), over 9 to 16 chunks of keys, so every block
/// walks two chunks or more (the longest rows' fa_attend steps to its next chunk past the other
/// blocks'), give the bits of the unsplit walk, which is within the CPU's tolerance.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn split_decode_blocks_walking_several_chunks_give_the_unsplit_bits() {
    let g = Gpu::open(0).expect("a CUDA device");
    let mut rng = Rng(seed());
    let shape = QWEN3_MOE;
    let split = decode_split(&g, shape);
    let count = (1..=64)
        .rev()
        .find(|&n| split.splits(n, shape) > 1)
        .expect("a row count that splits");
    let splits = split.splits(count, shape);
    // More chunks than splits: block 0 takes chunks 0 and `splits` at least.
    let shortest = splits * ops::ATTENTION_CHUNK_KEYS + 1;
    assert!(
        shortest + 900 <= MAX_CONTEXT,
        "{count} rows split {splits} ways"
    );
    let case = Case {
        contexts: (0..count).map(|_| shortest + rng.below(900)).collect(),
        q_lens: vec![1; count],
        shape,
    };
    let p = Problem::new(&g, &mut rng, &case);
    let run =
        |split| tensor_core_attention(&g, &p.q, &p.k, &p.v, &p.meta(), &p.q_lens, shape, split);
    let whole = run(None);
    p.check(&whole, "unsplit", shape, 1e-2, 3e-2);
    assert_same_bits(
        &run(Some(&split)),
        &whole,
        &format!("{count} rows split {splits} ways"),
    );
    println!("{count} decode rows of {shortest}+ keys split {splits} ways: the unsplit bits");
}

/// Prefill in every kind of block the GPU has (one query head; two sharing K and V, copied by
/// their threads or by the TMA unit, which takes a box a page, or a tile's part of a page) gives
/// the bits of one head a block at pages of 16 to 128 tokens.
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn prefill_blocks_of_every_kind_agree_at_every_page_size() {
    let g = Gpu::open(0).expect("a CUDA device");
    let mut rng = Rng(seed());
    let contexts = [1, 63, 65, 200, 1000, 3001];
    for block_size in [16, 32, 64, 128] {
        let shape = AttnShape {
            block_size,
            ..QWEN3_MOE
        };
        let rows = Rows::new(&g, &mut rng, &contexts, shape);
        let want = rows.prefilled_in_blocks(&g, ops::PrefillBlocks::OneHead);
        for blocks in ops::PrefillBlocks::ALL {
            if !blocks.possible(&g, shape) {
                continue;
            }
            let got = rows.prefilled_in_blocks(&g, blocks);
            for (s, got) in got.iter().enumerate() {
                let what = format!(
                    "{block_size}-token pages, {} keys, blocks {blocks:?}",
                    contexts[s]
                );
                assert_same_bits(got, &want[s], &what);
            }
        }
        println!("{block_size}-token pages: every kind of prefill block gives the same bits");
    }
}
