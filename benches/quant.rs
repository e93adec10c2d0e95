//! Quantizer throughput on a 4096x4096 BF16 tensor, on one core and on all cores, reported as
//! GB/s of BF16 input (criterion's `Throughput::Bytes`).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use lockstep::quant::{mxfp8, nvfp4, Nvfp4Options, ScaleGranularity};

const N: usize = 4096;

fn input() -> Vec<bf16> {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    (0..N * N)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0)
        })
        .collect()
}

fn quantizers(c: &mut Criterion) {
    let x = input();
    let mut group = c.benchmark_group("quantize_4096x4096_bf16");
    group.throughput(Throughput::Bytes((N * N * 2) as u64));
    group.sample_size(10);
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    for threads in [1, all] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        group.bench_with_input(
            BenchmarkId::new("mxfp8_rowwise", threads),
            &threads,
            |b, _| b.iter(|| pool.install(|| mxfp8::quantize_rowwise(&x, N, N).unwrap())),
        );
        for (name, granularity) in [
            ("nvfp4_per_tensor", ScaleGranularity::PerTensor),
            ("nvfp4_per_token", ScaleGranularity::PerToken),
        ] {
            let opts = Nvfp4Options {
                granularity,
                four_over_six: None,
            };
            group.bench_with_input(BenchmarkId::new(name, threads), &threads, |b, _| {
                b.iter(|| pool.install(|| nvfp4::quantize(&x, N, N, &opts).unwrap()))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, quantizers);
criterion_main!(benches);
