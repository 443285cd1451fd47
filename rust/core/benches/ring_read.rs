//! Read paths of the engine over one O_DIRECT file: fixed buffers + registered files,
//! plain io_uring, and the pread pool, at a few queue depths and request sizes. Each
//! iteration reads the whole file through a window of 4 slots, all kept in flight.
//!
//! `BSR_IO_BENCH_DIR` picks the directory (default: the system temp dir), and
//! `BSR_IO_BENCH_MIB` the file size (default 256).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bsr_io_core::{BackendChoice, Engine, EngineConfig, EngineFile, OpenOptions};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

const WINDOW: usize = 4;
const SLOT: usize = 16 << 20;

fn bench_file() -> (PathBuf, u64) {
    let dir = std::env::var_os("BSR_IO_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let mib: u64 = std::env::var("BSR_IO_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let size = mib << 20;
    let path = dir.join(format!("bsr-io-ring-read-{mib}MiB.bin"));
    if std::fs::metadata(&path).map(|m| m.len()).ok() != Some(size) {
        write_once(&path, size);
    }
    (path, size)
}

/// Write the file through the engine itself (O_DIRECT, pseudo-random bytes).
fn write_once(path: &std::path::Path, size: u64) {
    let eng = Engine::new(EngineConfig::new(1, SLOT)).expect("engine");
    let _ = std::fs::remove_file(path);
    let file = eng
        .open(
            path.to_str().expect("utf-8 path"),
            OpenOptions {
                create: true,
                direct: true,
                write: true,
                ..Default::default()
            },
        )
        .expect("create bench file");
    let slot = eng.lease().expect("slot");
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut block = vec![0u8; SLOT];
    for off in (0..size).step_by(SLOT) {
        for b in block.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            b.copy_from_slice(&state.to_le_bytes());
        }
        slot.copy_in(0, &block).expect("fill");
        let n = (size - off).min(SLOT as u64);
        eng.submit_write(&slot, &file, off, Some(n))
            .expect("write")
            .wait(None)
            .expect("write");
    }
    file.sync().expect("sync");
}

/// Read `[0, size)` through the window, keeping every slot's read in flight.
fn read_all(eng: &Engine, file: &Arc<EngineFile>, size: u64) -> u64 {
    let mut inflight = VecDeque::with_capacity(WINDOW);
    let mut next = 0u64;
    let mut total = 0u64;
    loop {
        while inflight.len() < WINDOW && next < size {
            let n = (size - next).min(SLOT as u64);
            inflight.push_back(eng.submit_read(file, next, n).expect("submit"));
            next += n;
        }
        let Some(op) = inflight.pop_front() else {
            break;
        };
        total += op.wait(None).expect("read");
        // Dropping the op (and its lease) frees the slot for the next read.
    }
    total
}

fn ring_read(c: &mut Criterion) {
    let (path, size) = bench_file();
    let mut group = c.benchmark_group("ring_read");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Bytes(size));
    let paths = [
        ("fixed_buffers", BackendChoice::Uring),
        ("plain_io_uring", BackendChoice::UringPlain),
        ("pread", BackendChoice::Pread),
    ];
    for (name, backend) in paths {
        for (qd, request) in [(8, 1 << 20), (32, 1 << 20), (32, 256 << 10)] {
            let cfg = EngineConfig {
                queue_depth: qd,
                request_bytes: request,
                backend,
                ..EngineConfig::new(WINDOW, SLOT)
            };
            let Ok(eng) = Engine::new(cfg) else {
                eprintln!("skipping {name}: backend unavailable here");
                break;
            };
            if backend == BackendChoice::Uring && !eng.features().fixed_buffers {
                eprintln!("note: fixed buffers refused: {:?}", eng.features().notes);
            }
            let file = eng
                .open(
                    path.to_str().expect("utf-8 path"),
                    OpenOptions {
                        direct: true,
                        ..Default::default()
                    },
                )
                .expect("open");
            let id = BenchmarkId::new(name, format!("qd{qd}_req{}KiB", request >> 10));
            group.bench_function(id, |b| {
                b.iter(|| assert_eq!(read_all(&eng, &file, size), size))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, ring_read);
criterion_main!(benches);
