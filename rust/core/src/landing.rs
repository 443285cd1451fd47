//! A read's bytes hashed as they land: the engine cuts a read into requests that
//! complete roughly in order, so the payload's xxh3-64 can be taken over the completed
//! prefix while the rest is still in flight, leaving only the last request's bytes to
//! hash once the read has ended. The hash is returned only when the whole read ended
//! well; a failed, withdrawn or timed-out read gives its error and the partial hash is
//! dropped with this call's state.

use std::time::{Duration, Instant};

use crate::backend::{OpState, Segment};
use crate::checksum::Xxh3Prefetch;
use crate::error::Result;

/// xxh3-64 of the op's `want` bytes in op order, hashed as they land, and when the op
/// ended. Waits at most `timeout` in all (`Error::Timeout`).
///
/// # Safety
/// The op's memory (`op.segments()`) must stay valid until this returns, and nothing
/// but the op may write it meanwhile (the kernel writes only requests not yet landed).
pub unsafe fn xxh3_as_landed(op: &OpState, timeout: Option<Duration>) -> Result<(u64, Instant)> {
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut h = Xxh3Prefetch::new();
    let mut hashed = 0u64;
    loop {
        let (landed, ended) = op.wait_landed(hashed, deadline)?;
        // SAFETY: `[hashed, landed)` completed (the caller's contract covers the rest).
        unsafe { hash_span(&mut h, op.segments(), hashed, landed) };
        hashed = landed;
        if ended {
            return Ok((h.finish(), op.ended_at().unwrap_or_else(Instant::now)));
        }
    }
}

/// Feed op bytes `[from, to)` of `segments` to `h`.
///
/// # Safety
/// Those bytes are readable and nothing writes them meanwhile.
unsafe fn hash_span(h: &mut Xxh3Prefetch, segments: &[Segment], from: u64, to: u64) {
    for s in segments {
        let (lo, hi) = (from.max(s.start), to.min(s.start + s.len));
        if lo < hi {
            let addr = s.addr + (lo - s.start) as usize;
            // SAFETY: inside segment `s` (lo..hi within its bytes), per the contract.
            h.write(unsafe { std::slice::from_raw_parts(addr as *const u8, (hi - lo) as usize) });
        }
    }
}

#[cfg(test)]
mod tests {
    //! The landed prefix as requests complete out of order, and the hash over it, with
    //! requests accounted by hand (`Request::account`, as the backends do), no I/O.

    use std::sync::Arc;
    use std::time::Duration;

    use super::xxh3_as_landed;
    use crate::backend::tests::{data_file, pattern};
    use crate::backend::{OpState, Segment};
    use crate::checksum::xxh3_64;
    use crate::error::Error;

    fn direct(buf: &mut [u8], split: usize) -> Arc<OpState> {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let addr = buf.as_mut_ptr() as usize;
        let segs = vec![
            Segment {
                start: 0,
                addr,
                len: split as u64,
            },
            Segment {
                start: split as u64,
                addr: addr + split,
                len: (buf.len() - split) as u64,
            },
        ];
        OpState::direct_read(f, 0, segs)
    }

    #[test]
    fn the_prefix_grows_only_without_gaps() {
        let mut buf = vec![0u8; 16384];
        let o = direct(&mut buf, 6000);
        let mut reqs: Vec<_> = o.requests(4096).into_iter().map(Some).collect();
        let ends: Vec<u64> = reqs
            .iter()
            .map(|r| r.as_ref().unwrap().start + r.as_ref().unwrap().len)
            .collect();
        let land = |r: &mut Option<crate::backend::Request>| {
            let r = r.take().unwrap();
            let n = r.remaining();
            assert!(r.account(Ok(n)).is_none());
        };
        let now = Some(std::time::Instant::now());
        land(&mut reqs[1]);
        assert_eq!(o.wait_landed(0, now), Err(Error::Timeout), "a gap at 0");
        land(&mut reqs[0]);
        assert_eq!(o.wait_landed(0, now), Ok((ends[1], false)));
        land(&mut reqs[3]);
        assert_eq!(o.wait_landed(0, now), Ok((ends[1], false)));
        land(&mut reqs[2]);
        assert_eq!(o.wait_landed(ends[1], now), Ok((ends[3], false)));
        for r in reqs.iter_mut().skip(4) {
            land(r);
        }
        assert_eq!(o.wait_landed(ends[3], now), Ok((16384, true)));
    }

    #[test]
    fn a_failed_request_fails_the_wait_whatever_landed() {
        let mut buf = vec![0u8; 8192];
        let o = direct(&mut buf, 4096);
        let mut reqs = o.requests(4096).into_iter();
        let first = reqs.next().unwrap();
        assert!(first.account(Ok(4096)).is_none());
        assert!(reqs.next().unwrap().account(Err(libc::EIO)).is_none());
        let err = o.wait_landed(0, None).unwrap_err();
        assert_eq!(err.errno(), Some(libc::EIO));
        // SAFETY: `buf` outlives the call and the op has ended.
        let got = unsafe { xxh3_as_landed(&o, Some(Duration::ZERO)) };
        assert_eq!(got.unwrap_err().errno(), Some(libc::EIO), "no partial hash");
    }

    #[test]
    fn the_hash_taken_as_requests_land_is_the_payloads() {
        let data = pattern(20_000);
        let mut buf = vec![0u8; data.len()];
        let o = direct(&mut buf, 7000);
        let reqs = o.requests(4096);
        let addr = buf.as_mut_ptr() as usize;
        let landing = Arc::clone(&o);
        // SAFETY: `buf` outlives the hashing thread (joined below); each request's bytes
        // are written before it is accounted, as the kernel does.
        let hasher = std::thread::spawn(move || unsafe {
            xxh3_as_landed(&landing, Some(Duration::from_secs(10)))
        });
        // Out of order: the last request first, then the rest.
        let mut reqs: Vec<_> = reqs.into_iter().collect();
        let last = reqs.pop().unwrap();
        for r in std::iter::once(last).chain(reqs) {
            let (s, n) = (r.start as usize, r.remaining() as usize);
            // SAFETY: request `r`'s bytes lie inside `buf` and nobody reads them yet.
            unsafe {
                std::ptr::copy_nonoverlapping(data[s..].as_ptr(), (addr + s) as *mut u8, n);
            }
            std::thread::sleep(Duration::from_millis(2));
            assert!(r.account(Ok(n as u64)).is_none());
        }
        let (h, _) = hasher.join().unwrap().unwrap();
        assert_eq!(h, xxh3_64(&data));
    }
}
