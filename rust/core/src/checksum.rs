//! Checksums over chunk payloads: xxh3-64.
//!
//! twox-hash picks its AVX2 or SSE2 kernel at run time, so a wheel built for any x86-64
//! hashes with the widest vectors the host has: a restore verifies every byte from
//! memory, and at the drive's speed that hash is most of its CPU time.
//!
//! A payload a read just left in memory is not in any cache (the device wrote it), so
//! the hash runs at the speed one core pulls lines from DRAM, not at xxh3's. The
//! hardware prefetchers stop at every 4 KiB page; `Xxh3Prefetch` hashes 4 KiB at a time
//! and asks for the lines `AHEAD` bytes further on into L2 first, which keeps more lines
//! in flight: on the development VM it cut the CPU per GiB of a cold buffer by about a
//! quarter (`cargo bench --bench install`, `xxh3_cold`).

use std::hash::Hasher;

pub use twox_hash::XxHash3_64 as Xxh3;

/// Bytes walked per step: one page (what `prefetched_pages` yields).
pub const PAGE: usize = 4096;
/// How far ahead of the step its lines are prefetched.
const AHEAD: usize = 8192;
const LINE: usize = 64;

/// The pages of `bytes[from..to]` in order, each yielded once the lines `AHEAD` bytes
/// past it (anywhere in `bytes`, so also past `to`) have been asked for into L2: the
/// walk every pass over a cold payload (hash, copy) takes.
pub fn prefetched_pages(bytes: &[u8], from: usize, to: usize) -> impl Iterator<Item = &[u8]> {
    (from..to).step_by(PAGE).map(move |pos| {
        let end = (pos + PAGE).min(to);
        prefetch_l2(bytes, pos + AHEAD, end + AHEAD);
        &bytes[pos..end]
    })
}

/// Streaming xxh3-64 that prefetches what it will hash next. Same values as `Xxh3`.
#[derive(Default)]
pub struct Xxh3Prefetch(Xxh3);

impl Xxh3Prefetch {
    pub fn new() -> Self {
        Self(Xxh3::new())
    }

    pub fn write(&mut self, bytes: &[u8]) {
        for page in prefetched_pages(bytes, 0, bytes.len()) {
            self.0.write(page);
        }
    }

    pub fn finish(&self) -> u64 {
        self.0.finish()
    }
}

/// Ask for the lines of `bytes[from..to]` (clipped to `bytes`) into L2; a hint only.
fn prefetch_l2(bytes: &[u8], from: usize, to: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let to = to.min(bytes.len());
        let mut at = from;
        while at < to {
            // SAFETY: `at < bytes.len()`, so the address lies inside the slice; a
            // prefetch never faults and has no other effect than on the caches.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(bytes.as_ptr().add(at) as *const i8) };
            at += LINE;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, from, to);
}

pub fn xxh3_64(bytes: &[u8]) -> u64 {
    let mut h = Xxh3Prefetch::new();
    h.write(bytes);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::{Xxh3, Xxh3Prefetch};

    #[test]
    fn known_values() {
        // Reference values of XXH3_64bits with seed 0.
        assert_eq!(super::xxh3_64(b""), 0x2d06800538d394c2);
        assert_ne!(super::xxh3_64(b"a"), super::xxh3_64(b"b"));
    }

    #[test]
    fn prefetching_hash_equals_the_one_shot_hash() {
        let data: Vec<u8> = (0..100_003u32)
            .map(|i| i.wrapping_mul(2_654_435_761) as u8)
            .collect();
        for len in [0, 1, 240, 241, 4095, 4096, 4097, 12_289, 100_003] {
            let want = Xxh3::oneshot(&data[..len]);
            assert_eq!(super::xxh3_64(&data[..len]), want, "len {len}");
            // Written in uneven pieces, as runs of a payload are.
            let mut h = Xxh3Prefetch::new();
            let cut = len / 3;
            h.write(&data[..cut]);
            h.write(&data[cut..len]);
            assert_eq!(h.finish(), want, "len {len} in two pieces");
        }
    }
}
