//! The fused install: copy a staged chunk into the destination's memory and hash it in
//! the same pass.
//!
//! Verifying a chunk (xxh3-64 of the payload) and installing it (copying it into the
//! KV blocks) each read the whole slot; done one after the other, a 16 MiB slot is
//! pulled from memory twice. Here the slot is walked once, in pieces small enough to
//! stay in cache: each piece is copied to its destination and then hashed while hot.
//! Bytes written into the destination before the hash is known are allowed: they are
//! installed, not visible, until the restore commits; a mismatch makes the chunk fail.
//!
//! Destinations are named by address (`Span`), not borrowed whole: several install
//! threads write different chunks into the same KV buffers at once, so none of them may
//! hold a `&mut` over a whole buffer. Each run becomes a slice of exactly its own bytes,
//! for the time it is copied; what must hold across threads is that the run ranges of
//! calls running at once are disjoint (the binding enforces it, see `copy_runs_xxh3_raw`).

use std::hash::Hasher;

use crate::checksum::{prefetched_pages, Xxh3, Xxh3Prefetch, PAGE};

use crate::error::{Error, Result};

/// Bytes copied and hashed per step: fits in L2 with room to spare, so the hash reads
/// what the copy just brought in.
const PIECE: usize = 64 << 10;

/// `len` bytes at `src_offset` of the slot go to destination buffer `dst` at
/// `dst_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub dst: usize,
    pub dst_offset: usize,
    pub src_offset: usize,
    pub len: usize,
}

/// A buffer by address and length: a destination (or, for `xxh3_runs_raw`, a source)
/// that other threads may be using elsewhere while a call touches its runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub addr: usize,
    pub len: usize,
}

impl Span {
    pub fn of(buf: &[u8]) -> Span {
        Span {
            addr: buf.as_ptr() as usize,
            len: buf.len(),
        }
    }
}

/// The absolute byte ranges `(start, end)` the `runs` cover in `bufs` (runs checked).
pub fn run_ranges(bufs: &[Span], runs: &[Run]) -> Vec<(usize, usize)> {
    runs.iter()
        .filter(|r| r.len > 0)
        .map(|r| {
            let start = bufs[r.dst].addr + r.dst_offset;
            (start, start + r.len)
        })
        .collect()
}

/// Check `runs` against the source length and the destination sizes: in source order,
/// not overlapping in the source, every range inside its buffer.
pub fn check_runs(src_len: usize, dst_lens: &[usize], runs: &[Run]) -> Result<()> {
    let mut end = 0usize;
    for (i, r) in runs.iter().enumerate() {
        if r.src_offset < end {
            return Err(Error::invalid(format!(
                "install run {i} starts at slot offset {} before the previous run ends ({end}); \
                 runs must be in slot order and must not overlap",
                r.src_offset
            )));
        }
        end = r
            .src_offset
            .checked_add(r.len)
            .filter(|&e| e <= src_len)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "install run {i} ({} bytes at slot offset {}) passes the slot's {src_len} \
                     valid bytes",
                    r.len, r.src_offset
                ))
            })?;
        let cap = *dst_lens.get(r.dst).ok_or_else(|| {
            Error::invalid(format!(
                "install run {i} names destination {} of {}",
                r.dst,
                dst_lens.len()
            ))
        })?;
        if r.dst_offset.checked_add(r.len).map_or(true, |e| e > cap) {
            return Err(Error::invalid(format!(
                "install run {i} ({} bytes at offset {}) passes the end of destination {} \
                 ({cap} bytes)",
                r.len, r.dst_offset, r.dst
            )));
        }
    }
    Ok(())
}

/// Copy `src` into `dsts` along `runs` (checked with `check_runs`) and return the
/// xxh3-64 of all of `src`, which is what a record header holds for its payload.
/// Source bytes no run covers are hashed, not copied. One thread's form of
/// `copy_runs_xxh3_raw`: the destinations are borrowed whole.
pub fn copy_runs_xxh3(src: &[u8], dsts: &mut [&mut [u8]], runs: &[Run]) -> Result<u64> {
    let spans: Vec<Span> = dsts.iter().map(|d| Span::of(d)).collect();
    // SAFETY: every destination is exclusively borrowed for this call, so its runs are
    // valid for writes and nothing else reads or writes them meanwhile; `src` is a
    // shared borrow, so it cannot alias a `&mut` destination.
    unsafe { copy_runs_xxh3_raw(src, &spans, runs) }
}

/// `copy_runs_xxh3` into destinations named by address.
///
/// Only the runs' own bytes are ever borrowed, each as one `&mut [u8]` for the time it
/// is copied: a whole buffer never is, so other threads may write other runs of the same
/// buffers at the same time. A run that overlaps `src` is refused.
///
/// # Safety
///
/// For the whole call, the bytes of every run (`dsts[r.dst].addr + r.dst_offset`,
/// `r.len` bytes) must be valid for writes, and no other thread may read or write them:
/// calls running at once on several threads must pass disjoint run ranges (their own
/// chunks' blocks). Bytes of the buffers outside the runs are never touched.
pub unsafe fn copy_runs_xxh3_raw(src: &[u8], dsts: &[Span], runs: &[Run]) -> Result<u64> {
    let lens: Vec<usize> = dsts.iter().map(|d| d.len).collect();
    check_runs(src.len(), &lens, runs)?;
    let (src_start, src_end) = (src.as_ptr() as usize, src.as_ptr() as usize + src.len());
    for (i, (a, b)) in run_ranges(dsts, runs).into_iter().enumerate() {
        if a < src_end && src_start < b {
            return Err(Error::invalid(format!(
                "install run {i} writes into the slot it copies from"
            )));
        }
    }
    let mut h = Xxh3::new();
    let mut pos = 0usize;
    for r in runs {
        // A gap between runs is verified too.
        h.write(&src[pos..r.src_offset]);
        let start = (dsts[r.dst].addr + r.dst_offset) as *mut u8;
        // SAFETY: check_runs put the run inside its buffer; the caller guarantees those
        // bytes are valid for writes and used by no other thread during the call; they
        // do not overlap `src` (checked above). The slice ends with this iteration.
        let dst = unsafe { std::slice::from_raw_parts_mut(start, r.len) };
        let src = &src[r.src_offset..r.src_offset + r.len];
        for (i, (d, s)) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)).enumerate() {
            // The slot is cold (a device wrote it): its lines are prefetched ahead.
            let from = i * PIECE;
            for (dp, sp) in d
                .chunks_mut(PAGE)
                .zip(prefetched_pages(src, from, from + s.len()))
            {
                copy_streaming(dp, sp);
            }
            // The copy just pulled this piece of the slot into cache: hash it there.
            h.write(s);
        }
        pos = r.src_offset + r.len;
    }
    h.write(&src[pos..]);
    fence();
    Ok(h.finish())
}

/// The xxh3-64 of a payload of `len` bytes that a direct read left in place along
/// `runs` (`src_offset` is the payload offset): what the record header holds, computed
/// without a copy. The runs must cover the payload exactly, in order.
pub fn xxh3_runs(len: usize, bufs: &[&[u8]], runs: &[Run]) -> Result<u64> {
    let spans: Vec<Span> = bufs.iter().map(|b| Span::of(b)).collect();
    // SAFETY: the buffers are borrowed (shared) for the call: readable, and nobody
    // writes them meanwhile.
    unsafe { xxh3_runs_raw(len, &spans, runs) }
}

/// `xxh3_runs` over buffers named by address: only the runs' own bytes are borrowed,
/// each as one `&[u8]` while it is hashed, so other threads may write elsewhere in the
/// same buffers (other chunks' installs or direct reads).
///
/// # Safety
///
/// For the whole call the bytes of every run must be valid for reads and written by
/// nobody (no thread, no device or kernel transfer).
pub unsafe fn xxh3_runs_raw(len: usize, bufs: &[Span], runs: &[Run]) -> Result<u64> {
    let lens: Vec<usize> = bufs.iter().map(|d| d.len).collect();
    check_runs(len, &lens, runs)?;
    let mut h = Xxh3Prefetch::new();
    let mut pos = 0usize;
    for (i, r) in runs.iter().enumerate() {
        if r.src_offset != pos {
            return Err(Error::invalid(format!(
                "run {i} starts at payload offset {} but {pos} bytes are covered: a payload \
                 read in place must lie in its runs without gaps",
                r.src_offset
            )));
        }
        let start = (bufs[r.dst].addr + r.dst_offset) as *const u8;
        // SAFETY: check_runs put the run inside its buffer; the caller guarantees those
        // bytes are readable and written by nobody during the call.
        h.write(unsafe { std::slice::from_raw_parts(start, r.len) });
        pos += r.len;
    }
    if pos != len {
        return Err(Error::invalid(format!(
            "the runs cover {pos} of the payload's {len} bytes"
        )));
    }
    Ok(h.finish())
}

/// Copy with non-temporal stores: the destination (KV blocks, written once, read much
/// later by someone else) does not pass through the cache, which saves reading each
/// line before it is overwritten and keeps the slot's bytes in cache for the hash.
#[cfg(target_arch = "x86_64")]
fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    debug_assert_eq!(dst.len(), src.len());
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let body = (dst.len() - head) / 64 * 64;
    // SAFETY: `head..head + body` lies inside both slices (same length), the destination
    // pointer is 16-byte aligned there, and 64 bytes are moved per step of 4 x 16.
    unsafe {
        let mut d = dst.as_mut_ptr().add(head) as *mut __m128i;
        let mut s = src.as_ptr().add(head) as *const __m128i;
        for _ in 0..body / 64 {
            let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
            let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            d = d.add(4);
            s = s.add(4);
        }
    }
    let done = head + body;
    dst[done..].copy_from_slice(&src[done..]);
}

#[cfg(not(target_arch = "x86_64"))]
fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

/// Non-temporal stores are weakly ordered: make them visible before the caller goes on.
fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions (SSE2 is part of x86_64).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_hash_in_place_equals_the_hash_of_the_payload() {
        let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let mut a = vec![0u8; 8000];
        let mut b = vec![0u8; 3000];
        a[100..7100].copy_from_slice(&payload[..7000]);
        b[..3000].copy_from_slice(&payload[7000..]);
        let runs = [
            super::Run {
                dst: 0,
                dst_offset: 100,
                src_offset: 0,
                len: 7000,
            },
            super::Run {
                dst: 1,
                dst_offset: 0,
                src_offset: 7000,
                len: 3000,
            },
        ];
        let want = crate::checksum::xxh3_64(&payload);
        assert_eq!(super::xxh3_runs(10_000, &[&a, &b], &runs).unwrap(), want);
        b[5] ^= 1; // control: one flipped byte in place changes it
        assert_ne!(super::xxh3_runs(10_000, &[&a, &b], &runs).unwrap(), want);
        // A gap or a short cover is refused, not hashed.
        assert!(super::xxh3_runs(10_000, &[&a, &b], &runs[1..]).is_err());
        assert!(super::xxh3_runs(10_001, &[&a, &b], &runs).is_err());
    }

    use super::*;
    use crate::checksum::xxh3_64;

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 + i / 251) as u8).collect()
    }

    #[test]
    fn hash_equals_one_shot_and_bytes_land() {
        let src = pattern(300_000);
        let (mut a, mut b) = (vec![0u8; 200_000], vec![0u8; 150_000]);
        let runs = [
            Run {
                dst: 1,
                dst_offset: 10,
                src_offset: 0,
                len: 100_000,
            },
            Run {
                dst: 0,
                dst_offset: 0,
                src_offset: 100_000,
                len: 70_001,
            },
            // 29,999-byte gap: hashed, not copied.
            Run {
                dst: 0,
                dst_offset: 80_000,
                src_offset: 200_000,
                len: 100_000,
            },
        ];
        let h = copy_runs_xxh3(&src, &mut [&mut a[..], &mut b[..]], &runs).unwrap();
        assert_eq!(h, xxh3_64(&src));
        assert_eq!(&b[10..100_010], &src[..100_000]);
        assert_eq!(&a[..70_001], &src[100_000..170_001]);
        assert_eq!(&a[80_000..180_000], &src[200_000..]);
        assert!(a[70_001..80_000].iter().all(|&x| x == 0));
    }

    #[test]
    fn a_flipped_byte_changes_the_hash() {
        let mut src = pattern(1 << 20);
        let mut dst = vec![0u8; 1 << 20];
        let runs = [Run {
            dst: 0,
            dst_offset: 0,
            src_offset: 0,
            len: 1 << 20,
        }];
        let good = copy_runs_xxh3(&src, &mut [&mut dst[..]], &runs).unwrap();
        src[777_777] ^= 1;
        let bad = copy_runs_xxh3(&src, &mut [&mut dst[..]], &runs).unwrap();
        assert_ne!(good, bad);
        assert_eq!(bad, xxh3_64(&src));
    }

    #[test]
    fn threads_install_disjoint_runs_of_one_buffer_at_once() {
        // Four threads each copy their own quarter of one destination buffer, as install
        // threads do with different chunks' blocks of one KV tensor: no thread borrows
        // more than its runs, so this is sound (run it under Miri to check).
        let n = 1 << 16;
        let srcs: Vec<Vec<u8>> = (0..4)
            .map(|k| pattern(n).iter().map(|b| b ^ k).collect())
            .collect();
        let mut dst = vec![0u8; 4 * n];
        let span = Span::of(&dst);
        std::thread::scope(|s| {
            for (k, src) in srcs.iter().enumerate() {
                s.spawn(move || {
                    let runs = [Run {
                        dst: 0,
                        dst_offset: k * n,
                        src_offset: 0,
                        len: n,
                    }];
                    // SAFETY: thread k writes only [k*n, (k+1)*n) of `dst`, which lives
                    // (and is touched by nobody else) until the scope ends.
                    let h = unsafe { copy_runs_xxh3_raw(src, &[span], &runs) }.unwrap();
                    assert_eq!(h, xxh3_64(src));
                });
            }
        });
        for (k, src) in srcs.iter().enumerate() {
            assert_eq!(&dst[k * n..(k + 1) * n], &src[..]);
        }
        dst[0] ^= 1; // the buffer is ours again
    }

    #[test]
    fn a_run_into_its_own_slot_is_refused() {
        let mut buf = pattern(4096);
        let span = Span::of(&buf);
        let src = buf.as_ptr();
        // SAFETY: the source slice is the buffer's first half, the run its second half
        // shifted to overlap the first: refused before any byte is written.
        let r = unsafe {
            let src = std::slice::from_raw_parts(src, 2048);
            let runs = [Run {
                dst: 0,
                dst_offset: 1024,
                src_offset: 0,
                len: 2048,
            }];
            copy_runs_xxh3_raw(src, &[span], &runs)
        };
        assert!(r.is_err());
        buf[0] = 0;
    }

    #[test]
    fn bad_runs_are_refused() {
        let src = pattern(1000);
        let mut d = vec![0u8; 500];
        let mut dsts = [&mut d[..]];
        let run = |dst, dst_offset, src_offset, len| Run {
            dst,
            dst_offset,
            src_offset,
            len,
        };
        for runs in [
            vec![run(0, 0, 900, 200)],                    // past the slot
            vec![run(0, 400, 0, 200)],                    // past the destination
            vec![run(1, 0, 0, 10)],                       // no such destination
            vec![run(0, 0, 100, 10), run(0, 20, 50, 10)], // out of order
            vec![run(0, 0, usize::MAX, 2)],               // overflow
        ] {
            assert!(copy_runs_xxh3(&src, &mut dsts, &runs).is_err(), "{runs:?}");
        }
    }
}
