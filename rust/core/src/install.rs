//! The fused install: copy a staged chunk into the destination's memory and hash it in
//! the same pass.
//!
//! Verifying a chunk (xxh3-64 of the payload) and installing it (copying it into the
//! KV blocks) each read the whole slot; done one after the other, a 16 MiB slot is
//! pulled from memory twice. Here the slot is walked once, in pieces small enough to
//! stay in cache: each piece is copied to its destination and then hashed while hot.
//! Bytes written into the destination before the hash is known are allowed: they are
//! installed, not visible, until the restore commits; a mismatch makes the chunk fail.

use xxhash_rust::xxh3::Xxh3;

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
/// Source bytes no run covers are hashed, not copied.
pub fn copy_runs_xxh3(src: &[u8], dsts: &mut [&mut [u8]], runs: &[Run]) -> Result<u64> {
    let lens: Vec<usize> = dsts.iter().map(|d| d.len()).collect();
    check_runs(src.len(), &lens, runs)?;
    let mut h = Xxh3::new();
    let mut pos = 0usize;
    for r in runs {
        // A gap between runs is verified too.
        h.update(&src[pos..r.src_offset]);
        let dst = &mut dsts[r.dst][r.dst_offset..r.dst_offset + r.len];
        let src = &src[r.src_offset..r.src_offset + r.len];
        for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
            copy_streaming(d, s);
            // The copy just pulled this piece of the slot into cache: hash it there.
            h.update(s);
        }
        pos = r.src_offset + r.len;
    }
    h.update(&src[pos..]);
    fence();
    Ok(h.digest())
}

/// The xxh3-64 of a payload of `len` bytes that a direct read left in place along
/// `runs` (`src_offset` is the payload offset): what the record header holds, computed
/// without a copy. The runs must cover the payload exactly, in order.
pub fn xxh3_runs(len: usize, bufs: &[&[u8]], runs: &[Run]) -> Result<u64> {
    let lens: Vec<usize> = bufs.iter().map(|d| d.len()).collect();
    check_runs(len, &lens, runs)?;
    let mut h = Xxh3::new();
    let mut pos = 0usize;
    for (i, r) in runs.iter().enumerate() {
        if r.src_offset != pos {
            return Err(Error::invalid(format!(
                "run {i} starts at payload offset {} but {pos} bytes are covered: a payload \
                 read in place must lie in its runs without gaps",
                r.src_offset
            )));
        }
        h.update(&bufs[r.dst][r.dst_offset..r.dst_offset + r.len]);
        pos += r.len;
    }
    if pos != len {
        return Err(Error::invalid(format!(
            "the runs cover {pos} of the payload's {len} bytes"
        )));
    }
    Ok(h.digest())
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
