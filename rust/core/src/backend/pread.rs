//! The portable backend: a pool of threads doing pread/pwrite into the same arena, used
//! when io_uring is refused or asked against (`BSR_IO_BACKEND=pread`).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::{OpState, Request};
use crate::error::{last_errno, Error, Result};

#[derive(Default)]
struct Queue {
    requests: VecDeque<Request>,
    closing: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
}

pub struct PreadPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    request_bytes: u64,
}

impl PreadPool {
    pub fn start(threads: usize, request_bytes: u64) -> Result<PreadPool> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            ready: Condvar::new(),
        });
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads.max(1) {
            let s = Arc::clone(&shared);
            let h = std::thread::Builder::new()
                .name(format!("bsr-io-pread-{i}"))
                .spawn(move || worker(&s))
                .map_err(|e| Error::os("spawn I/O thread", None, e.raw_os_error().unwrap_or(0)))?;
            handles.push(h);
        }
        Ok(PreadPool {
            shared,
            threads: handles,
            request_bytes,
        })
    }

    pub fn submit(&self, op: Arc<OpState>) {
        let reqs = op.requests(self.request_bytes);
        let mut q = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.requests.extend(reqs);
        drop(q);
        self.shared.ready.notify_all();
    }

    /// Finish everything queued, then stop the threads.
    pub fn shutdown(&mut self) {
        self.shared
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .closing = true;
        self.shared.ready.notify_all();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for PreadPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn worker(shared: &Shared) {
    loop {
        let req = {
            let mut q = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(r) = q.requests.pop_front() {
                    break r;
                }
                if q.closing {
                    return;
                }
                q = shared.ready.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        let mut req = req;
        // Loop on short transfers and EINTR until the request ends.
        loop {
            let res = transfer(&req);
            match req.account(res) {
                Some(again) => req = again,
                None => break,
            }
        }
    }
}

fn transfer(req: &Request) -> std::result::Result<u64, i32> {
    let fd = req.op.file.fd();
    let len = req.remaining() as usize;
    let off = req.file_offset() as libc::off_t;
    let rc = if req.is_read() {
        // SAFETY: the range lies in a slot owned by this request's op (through its
        // lease) until the request is accounted; nothing else writes it meanwhile.
        unsafe { libc::pread(fd, req.addr() as *mut libc::c_void, len, off) }
    } else {
        // SAFETY: as above; the slot memory is only read.
        unsafe { libc::pwrite(fd, req.addr() as *const libc::c_void, len, off) }
    };
    if rc < 0 {
        Err(last_errno())
    } else {
        Ok(rc as u64)
    }
}

#[cfg(test)]
mod tests {
    //! The pread pool on real files: many requests per op, the end of the file, an
    //! errno from the kernel, an abandoned read, and shutdown finishing queued work.
    //! (EINTR/EAGAIN and short transfers: the accounting tests in backend/mod.rs; the
    //! worker loops on whatever `account` hands back.)

    use super::super::tests::{data_file, pattern};
    use super::super::{OpKind, Pending};
    use super::*;
    use crate::arena::Arena;
    use crate::error::Error;

    fn read_op(f: &Arc<crate::file::EngineFile>, a: &Arc<Arena>, off: u64, n: u64) -> Pending {
        let lease = Arc::new(a.try_lease().unwrap());
        Pending::new(OpState::new(OpKind::Read, Arc::clone(f), off, n, n, lease))
    }

    #[test]
    fn reads_a_range_in_many_requests() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, true);
        let arena = Arena::new(1, 40 << 10).unwrap();
        let pool = PreadPool::start(3, 4096).unwrap();
        let p = read_op(&f, &arena, 8192, 40 << 10);
        pool.submit(Arc::clone(&p.op));
        assert_eq!(p.wait(None), Ok(40 << 10));
        let lease = p.take_lease().unwrap();
        // SAFETY: the read is complete and the lease is ours alone.
        let got = unsafe { lease.bytes(0, 40 << 10) }.unwrap();
        assert_eq!(got, &pattern(64 << 10)[8192..8192 + (40 << 10)]);
    }

    #[test]
    fn a_read_past_the_end_is_short() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, true);
        let arena = Arena::new(1, 16 << 10).unwrap();
        let pool = PreadPool::start(2, 4096).unwrap();
        let p = read_op(&f, &arena, (64 << 10) - 4096, 16 << 10);
        pool.submit(Arc::clone(&p.op));
        assert!(matches!(
            p.wait(None),
            Err(Error::ShortRead { got: 4096, .. })
        ));
        assert_eq!(arena.free_slots(), 1);
    }

    #[test]
    fn an_errno_fails_the_op() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false); // read-only descriptor
        let arena = Arena::new(1, 4096).unwrap();
        let lease = Arc::new(arena.try_lease().unwrap());
        lease.write_started();
        let op = OpState::new(OpKind::Write, Arc::clone(&f), 0, 4096, 4096, lease);
        let pool = PreadPool::start(1, 4096).unwrap();
        pool.submit(Arc::clone(&op));
        let err = op.wait(None).unwrap_err();
        assert_eq!(err.errno(), Some(libc::EBADF), "{err}");
        assert!(err.to_string().starts_with("write failed"));
    }

    #[test]
    fn abandoned_reads_and_shutdown_return_every_slot() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, true);
        let arena = Arena::new(4, 16 << 10).unwrap();
        let mut pool = PreadPool::start(2, 4096).unwrap();
        let mut ops = Vec::new(); // what an I/O thread might still hold after the end
        let mut kept = None;
        for i in 0..4 {
            let p = read_op(&f, &arena, i * (16 << 10), 16 << 10);
            pool.submit(Arc::clone(&p.op));
            ops.push(Arc::clone(&p.op));
            if i == 3 {
                kept = Some(p); // control: a handle someone will still take the slot from
            } // the others: dropped, nobody will wait for them
        }
        pool.shutdown(); // finishes what is queued, then stops
        assert!(ops.iter().all(|o| o.is_done()));
        assert_eq!(
            arena.free_slots(),
            3,
            "abandoned reads gave their slots back"
        );
        drop(kept);
        assert_eq!(arena.free_slots(), 4);
        assert_eq!(arena.live_bytes(), 0);
    }
}
