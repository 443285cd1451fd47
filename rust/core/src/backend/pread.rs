//! The portable backend: a pool of threads doing pread/pwrite into the same arena, used
//! when io_uring is refused or asked against (`BSR_IO_BACKEND=pread`). A worker that
//! panics breaks the pool: every queued request fails, the engine takes no more I/O.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::{panic_message, Health, OpState, Request};
use crate::error::{last_errno, Error, Result};

#[derive(Default)]
struct Queue {
    requests: VecDeque<Request>,
    closing: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
    health: Arc<Health>,
    /// Fault double for tests: the next request a worker takes panics it.
    #[cfg(test)]
    panic_next: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub struct PreadPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    request_bytes: u64,
}

impl PreadPool {
    pub fn start(threads: usize, request_bytes: u64, health: Arc<Health>) -> Result<PreadPool> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            ready: Condvar::new(),
            health,
            #[cfg(test)]
            panic_next: Default::default(),
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

    pub fn submit(&self, op: Arc<OpState>) -> Result<()> {
        let reqs = op.requests(self.request_bytes);
        let mut q = self.shared.queue();
        // Checked under the queue lock: a worker breaking the pool drains it under the
        // same lock, so no request slips in after the drain.
        if let Err(e) = self.shared.health.check() {
            drop(q);
            reqs.into_iter().for_each(|r| r.abandon(e.clone()));
            return Err(e);
        }
        q.requests.extend(reqs);
        drop(q);
        self.shared.ready.notify_all();
        Ok(())
    }

    /// Fault double for tests: the next request a worker takes panics it.
    #[cfg(test)]
    pub(crate) fn inject_panic(&self) {
        self.shared
            .panic_next
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Finish everything queued, then stop the threads.
    pub fn shutdown(&mut self) {
        self.shared.queue().closing = true;
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
            let mut q = shared.queue();
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
        if !req.op.launch() {
            req.abandon(Error::Withdrawn); // its caller gave it up before it ran
            continue;
        }
        // The request lives outside the unwind so a panic leaves it here to fail.
        let mut current = Some(req);
        let run = catch_unwind(AssertUnwindSafe(|| {
            // Loop on short transfers and EINTR until the request ends.
            while let Some(req) = current.as_ref() {
                #[cfg(test)]
                if shared
                    .panic_next
                    .swap(false, std::sync::atomic::Ordering::SeqCst)
                {
                    panic!("fault double: a pread worker panics (injected by a test)");
                }
                let res = transfer(req);
                current = current.take().and_then(|r| r.account(res));
            }
        }));
        if let Err(panic) = run {
            break_pool(shared, current, &*panic);
            return;
        }
    }
}

/// A worker panicked: mark the engine broken, fail the request it held and every queued
/// one, and let the other workers finish what they hold and stop.
fn break_pool(shared: &Shared, held: Option<Request>, panic: &(dyn std::any::Any + Send)) {
    let err = shared.health.mark(Error::Broken {
        errno: libc::EIO,
        reason: format!("a pread worker panicked: {}", panic_message(panic)),
    });
    let queued = {
        let mut q = shared.queue();
        q.closing = true;
        std::mem::take(&mut q.requests)
    };
    shared.ready.notify_all();
    held.into_iter()
        .chain(queued)
        .for_each(|r| r.abandon(err.clone()));
}

fn transfer(req: &Request) -> std::result::Result<u64, i32> {
    let fd = req.op.file.fd();
    let len = req.remaining() as usize;
    let off = req.file_offset() as libc::off_t;
    let rc = if req.is_sync() {
        // SAFETY: fdatasync on the op's open descriptor; no memory is passed.
        unsafe { libc::fdatasync(fd) as libc::ssize_t }
    } else if req.is_read() {
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
        let pool = PreadPool::start(3, 4096, Arc::default()).unwrap();
        let p = read_op(&f, &arena, 8192, 40 << 10);
        pool.submit(Arc::clone(&p.op)).unwrap();
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
        let pool = PreadPool::start(2, 4096, Arc::default()).unwrap();
        let p = read_op(&f, &arena, (64 << 10) - 4096, 16 << 10);
        pool.submit(Arc::clone(&p.op)).unwrap();
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
        let pool = PreadPool::start(1, 4096, Arc::default()).unwrap();
        pool.submit(Arc::clone(&op)).unwrap();
        let err = op.wait(None).unwrap_err();
        assert_eq!(err.errno(), Some(libc::EBADF), "{err}");
        assert!(err.to_string().starts_with("write failed"));
    }

    #[test]
    fn abandoned_reads_and_shutdown_return_every_slot() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, true);
        let arena = Arena::new(4, 16 << 10).unwrap();
        let mut pool = PreadPool::start(2, 4096, Arc::default()).unwrap();
        let mut ops = Vec::new(); // what an I/O thread might still hold after the end
        let mut kept = None;
        for i in 0..4 {
            let p = read_op(&f, &arena, i * (16 << 10), 16 << 10);
            pool.submit(Arc::clone(&p.op)).unwrap();
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

    #[test]
    fn a_worker_panic_fails_every_op_and_breaks_the_pool() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, true);
        let arena = Arena::new(3, 16 << 10).unwrap();
        let health = Arc::new(Health::default());
        // One worker, so the queued ops are still queued when it panics.
        let mut pool = PreadPool::start(1, 4096, Arc::clone(&health)).unwrap();
        pool.inject_panic(); // fault double: the worker panics at its next request
        let ops: Vec<Pending> = (0..3)
            .map(|i| {
                let p = read_op(&f, &arena, i * (16 << 10), 16 << 10);
                pool.submit(Arc::clone(&p.op)).unwrap();
                p
            })
            .collect();
        for p in &ops {
            let err = p
                .wait(Some(std::time::Duration::from_secs(10)))
                .unwrap_err();
            assert!(
                matches!(&err, Error::Broken { errno: libc::EIO, reason } if reason.contains("panic")),
                "{err:?}"
            );
        }
        assert!(health.is_broken());
        // Later submits are refused at once, and their op ends (no waiter hangs).
        let late = read_op(&f, &arena, 0, 4096);
        drop(ops);
        assert!(matches!(
            pool.submit(Arc::clone(&late.op)),
            Err(Error::Broken { .. })
        ));
        assert!(late.is_done());
        drop(late);
        pool.shutdown(); // joins the dead worker without hanging
        assert_eq!(arena.free_slots(), 3);
        // Control: the same reads on a pool with no fault succeed.
        let pool = PreadPool::start(1, 4096, Arc::default()).unwrap();
        let p = read_op(&f, &arena, 0, 16 << 10);
        pool.submit(Arc::clone(&p.op)).unwrap();
        assert_eq!(p.wait(None), Ok(16 << 10));
    }
}
