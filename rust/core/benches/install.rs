//! The install of one staged chunk into destination memory, verified: the fused pass
//! (`copy_runs_xxh3`: copy with streaming stores, hash each piece while in cache)
//! against the two passes it replaces (xxh3 over the slot, then a plain copy). Sources
//! rotate over 32 chunk-sized buffers (a W=32 ring, larger than the cache), as in a
//! restore, where the slot being installed was filled W chunks ago. The hash alone over
//! such a cold slot is measured both ways: twox-hash's one-shot and `checksum::xxh3_64`,
//! which prefetches a page ahead.

use bsr_io_core::checksum::{xxh3_64, Xxh3};
use bsr_io_core::install::{copy_runs_xxh3, Run};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const CHUNK: usize = 16_408_576; // deepseek-v4-flash, TP=2, 256 tokens
const RING: usize = 32;

fn bench(c: &mut Criterion) {
    let srcs: Vec<Vec<u8>> = (0..RING)
        .map(|k| (0..CHUNK).map(|i| (i * 31 + k) as u8).collect())
        .collect();
    // Two groups, as in the layout: one destination buffer each, several chunks long.
    let split = CHUNK / 2 / 4096 * 4096;
    let mut a = vec![0u8; 4 * split];
    let mut b = vec![0u8; 4 * (CHUNK - split)];
    let mut g = c.benchmark_group("install");
    g.throughput(Throughput::Bytes(CHUNK as u64));
    let mut k = 0usize;
    g.bench_function("fused_copy_xxh3", |bench| {
        bench.iter(|| {
            let slot = k % 4;
            let runs = [
                Run {
                    dst: 0,
                    dst_offset: slot * split,
                    src_offset: 0,
                    len: split,
                },
                Run {
                    dst: 1,
                    dst_offset: slot * (CHUNK - split),
                    src_offset: split,
                    len: CHUNK - split,
                },
            ];
            let h = copy_runs_xxh3(&srcs[k % RING], &mut [&mut a[..], &mut b[..]], &runs);
            k += 1;
            h.unwrap()
        })
    });
    g.bench_function("xxh3_then_copy", |bench| {
        bench.iter(|| {
            let (src, slot) = (&srcs[k % RING], k % 4);
            let h = xxh3_64(src);
            a[slot * split..(slot + 1) * split].copy_from_slice(&src[..split]);
            let n = CHUNK - split;
            b[slot * n..(slot + 1) * n].copy_from_slice(&src[split..]);
            k += 1;
            h
        })
    });
    // The hash alone over a cold slot (filled RING chunks ago), as a direct read leaves
    // it: twox-hash's one-shot hash against the page-at-a-time prefetching one.
    g.bench_function("xxh3_cold_oneshot", |bench| {
        bench.iter(|| {
            k += 1;
            Xxh3::oneshot(&srcs[k % RING])
        })
    });
    g.bench_function("xxh3_cold_prefetch", |bench| {
        bench.iter(|| {
            k += 1;
            xxh3_64(&srcs[k % RING])
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
