//! Decode attention on the GPU against the CPU `paged_attention`, on fresh random BF16 caches:
//! the GQA-aware split kernel (one block per row, KV head and key range, then a combine) under
//! its own plan and under forced key splits, and the one-block-per-head kernel, for contexts of
//! 1 key, a few keys, block boundaries and several thousand keys, GQA ratios 1/4/8/16 and
//! head_dim 64 and 128. Both sides do f32 math over the same BF16 K/V, so only summation order
//! differs: within 1e-5 relative over a case, and 1e-4 per row (a long row sums thousands of
//! terms; one dropped key moves a row by ~1e-3).
//!
//! These need an NVIDIA GPU, so they are `#[ignore]`d here and run on the GPU host by
//! scripts/gpu-check.sh (`cuda_attention --ignored`).

use lockstep::backend::cpu::attention::{paged_attention, AttentionSeq, KvDtype, KvMemory};
use lockstep::backend::cuda::ops::{self, AttnRows, AttnShape, KeySplit, SplitScratch};
use lockstep::backend::cuda::Gpu;

mod common;
use common::cuda::{rel_err, seed, Rng};

const BLOCK_SIZE: usize = 16;

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
            .map(|c| c.div_ceil(BLOCK_SIZE))
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
            BLOCK_SIZE,
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
        Problem {
            rows,
            longest: *case.contexts.iter().max().unwrap(),
            want,
            row_ctx,
            q: g.upload(&q).unwrap(),
            k: g.upload(&cache.k_bits(0)).unwrap(),
            v: g.upload(&cache.v_bits(0)).unwrap(),
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

    /// Checks one output against the CPU's; returns the case-wide relative error.
    fn check(&self, got: &[f32], what: &str, s: AttnShape) -> f64 {
        let width = s.heads * s.head_dim;
        let err = rel_err(got, &self.want);
        assert!(err < 1e-5, "{what}: relative error {err}");
        for (r, ctx) in self.row_ctx.iter().enumerate() {
            let e = rel_err(&got[r * width..][..width], &self.want[r * width..][..width]);
            assert!(e < 1e-4, "{what}: row {r} ({ctx} keys) relative error {e}");
        }
        err
    }
}

/// The key splits a case is run under: one split, the engine's own plan, and forced ranges
/// that do not line up with the KV blocks (and, for short contexts, ranges shorter than the
/// kernel's four warps, so some warps get no keys).
fn splits_for(p: &Problem, s: AttnShape, sm_count: u32) -> Vec<KeySplit> {
    let mut out = vec![
        KeySplit {
            splits: 1,
            chunk: p.longest,
        },
        KeySplit::plan(p.rows, s, p.longest, sm_count, p.rows * s.heads * 64),
    ];
    let mut chunks = vec![37, 256];
    if p.longest <= 64 {
        chunks.extend([1, 3, 5, 16]);
    }
    for chunk in chunks {
        out.push(KeySplit {
            splits: p.longest.div_ceil(chunk),
            chunk,
        });
    }
    // A plan whose last range is longer than `chunk` (it runs to each row's end).
    if p.longest > 8 {
        out.push(KeySplit {
            splits: 2,
            chunk: p.longest / 4,
        });
    }
    out
}

fn contexts(long: bool) -> (Vec<usize>, Vec<usize>) {
    if long {
        (vec![1, 16, 17, 1000, 3001, 4099], vec![1, 1, 2, 1, 3, 1])
    } else {
        (
            vec![1, 2, 3, 5, 15, 16, 17, 32, 33],
            vec![1, 1, 3, 1, 1, 2, 1, 1, 4],
        )
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn decode_attention_matches_the_cpu_for_every_split_gqa_ratio_and_head_dim() {
    let g = Gpu::open(0).expect("a CUDA device");
    let seed = seed();
    println!("seed {seed}");
    let mut rng = Rng(seed);
    let kv_heads = 2;
    for head_dim in [64, 128] {
        for group in [1, 4, 8, 16] {
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
                let mut worst = 0f64;

                // The one-block-per-head kernel on the same data.
                let mut out = g.upload(&vec![f32::NAN; n]).unwrap();
                ops::paged_attention(&g, &p.q, &mut out, &p.k, &p.v, &p.meta(), p.rows, shape)
                    .unwrap();
                let what = format!("paged_attention hd {head_dim} group {group} long {long}");
                worst = worst.max(p.check(&g.download(&out, n).unwrap(), &what, shape));

                for split in splits_for(&p, shape, g.sm_count) {
                    let mut scratch =
                        SplitScratch::new(&g, p.rows * shape.heads * split.splits, head_dim)
                            .unwrap();
                    let mut out = g.upload(&vec![f32::NAN; n]).unwrap();
                    ops::decode_attention(
                        &g,
                        &p.q,
                        &mut out,
                        &p.k,
                        &p.v,
                        &p.meta(),
                        p.rows,
                        shape,
                        split,
                        &mut scratch,
                    )
                    .unwrap();
                    let what = format!(
                        "decode_attention hd {head_dim} group {group} long {long} {split:?}"
                    );
                    worst = worst.max(p.check(&g.download(&out, n).unwrap(), &what, shape));
                }
                println!(
                    "head_dim {head_dim:>3} GQA {group:>2} longest {:>4}: worst relative error {worst:.2e}",
                    p.longest
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
fn decode_attention_refuses_a_scratch_too_small_for_its_split() {
    let g = Gpu::open(0).expect("a CUDA device");
    let mut rng = Rng(seed());
    let shape = AttnShape {
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        block_size: BLOCK_SIZE,
    };
    let case = Case {
        contexts: vec![600],
        q_lens: vec![1],
        shape,
    };
    let p = Problem::new(&g, &mut rng, &case);
    let split = KeySplit {
        splits: 4,
        chunk: 150,
    };
    let mut scratch = SplitScratch::new(&g, shape.heads * 3, shape.head_dim).unwrap();
    let mut out = g.alloc::<f32>(shape.heads * shape.head_dim).unwrap();
    let r = ops::decode_attention(
        &g,
        &p.q,
        &mut out,
        &p.k,
        &p.v,
        &p.meta(),
        1,
        shape,
        split,
        &mut scratch,
    );
    assert!(r.is_err(), "a launch past the scratch must be refused");
}
