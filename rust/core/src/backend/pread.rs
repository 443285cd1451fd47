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
