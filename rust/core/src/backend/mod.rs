//! What the backends share: an operation (one slot <-> one file range), split into
//! requests; each backend moves requests and reports how each ended.

pub mod pread;
pub mod uring;

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::align::{self, Transfer};
use crate::arena::SlotLease;
use crate::error::{Error, Result};
use crate::file::EngineFile;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
}

#[derive(Debug, Default)]
struct Progress {
    outstanding: usize,
    error: Option<Error>,
    /// Bytes from the op's start at which a read found the end of the file.
    eof_at: Option<u64>,
    /// Set once every request ended: bytes done, or the error.
    result: Option<Result<u64>>,
    /// The caller dropped its handle: nobody will take the slot of this read.
    abandoned: bool,
}

/// One read or write between a slot and a file range. It owns its slot (through the
/// lease) until every request has completed.
#[derive(Debug)]
pub struct OpState {
    pub kind: OpKind,
    pub file: Arc<EngineFile>,
    /// File offset of byte 0 of the slot.
    pub offset: u64,
    /// Bytes the caller asked for.
    pub want: u64,
    /// Bytes actually transferred: `want` rounded up to the file's alignment.
    pub extent: u64,
    pub slot_index: usize,
    slot_addr: usize,
    lease: Mutex<Option<Arc<SlotLease>>>,
    progress: Mutex<Progress>,
    done: Condvar,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl OpState {
    pub fn new(
        kind: OpKind,
        file: Arc<EngineFile>,
        offset: u64,
        want: u64,
        extent: u64,
        lease: Arc<SlotLease>,
    ) -> Arc<OpState> {
        Arc::new(OpState {
            kind,
            file,
            offset,
            want,
            extent,
            slot_index: lease.index(),
            slot_addr: lease.addr(),
            lease: Mutex::new(Some(lease)),
            progress: Mutex::new(Progress::default()),
            done: Condvar::new(),
        })
    }

    /// Cut the op into requests of at most `request_bytes`.
    pub fn requests(self: &Arc<Self>, request_bytes: u64) -> Vec<Request> {
        let reqs: Vec<Request> = align::split(self.extent, request_bytes)
            .map(|(start, len)| Request {
                op: Arc::clone(self),
                start,
                len,
                moved: 0,
            })
            .collect();
        locked(&self.progress).outstanding = reqs.len();
        reqs
    }

    /// Fail before any request was issued (closed file, engine shutting down).
    pub fn fail_now(&self, err: Error) {
        let mut p = locked(&self.progress);
        p.error = Some(err);
        self.finalize(&mut p);
    }

    fn request_ended(&self, start: u64, moved: u64, outcome: RequestEnd) {
        let mut p = locked(&self.progress);
        match outcome {
            RequestEnd::Complete => {}
            RequestEnd::EndOfFile => {
                let at = start + moved;
                p.eof_at = Some(p.eof_at.map_or(at, |e| e.min(at)));
            }
            RequestEnd::Failed(e) => {
                if p.error.is_none() {
                    p.error = Some(e);
                }
            }
        }
        p.outstanding -= 1;
        if p.outstanding == 0 {
            self.finalize(&mut p);
        }
    }

    fn finalize(&self, p: &mut Progress) {
        let result = match p.error.take() {
            Some(e) => Err(e),
            None => match self.kind {
                OpKind::Read => {
                    let valid = align::valid_len(self.want, p.eof_at);
                    if valid < self.want {
                        Err(Error::ShortRead {
                            path: self.file.path().to_owned(),
                            offset: self.offset,
                            wanted: self.want,
                            got: valid,
                        })
                    } else {
                        Ok(self.want)
                    }
                }
                OpKind::Write if self.extent > self.want => {
                    self.file.trim_padding().map(|()| self.want)
                }
                OpKind::Write => Ok(self.want),
            },
        };
        let mut lease = locked(&self.lease);
        if let (OpKind::Write, Some(l)) = (self.kind, lease.as_ref()) {
            l.write_ended();
        }
        if p.abandoned {
            lease.take();
        }
        match (&result, self.kind) {
            (Ok(n), OpKind::Read) => {
                if let Some(l) = lease.as_ref() {
                    // `want` never exceeds the capacity (checked at submit).
                    let _ = l.set_len(*n as usize);
                }
            }
            // A failed read gives its slot back at once; a write's slot belongs to
            // the caller, who still holds it, so dropping our share is all we do.
            _ => {
                lease.take();
            }
        }
        drop(lease);
        p.result = Some(result);
        self.done.notify_all();
    }

    pub fn is_done(&self) -> bool {
        locked(&self.progress).result.is_some()
    }

    /// Wait for the end; `None` waits forever.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<u64> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut p = locked(&self.progress);
        loop {
            if let Some(r) = &p.result {
                return r.clone();
            }
            p = match deadline {
                None => self.done.wait(p).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::Timeout);
                    }
                    self.done
                        .wait_timeout(p, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// Hand the filled slot of a successful read to the caller (once).
    pub fn take_lease(&self) -> Option<Arc<SlotLease>> {
        locked(&self.lease).take()
    }

    /// The caller gave up its handle: free a slot nobody took, now if the op is done,
    /// else as it completes. Deterministic, whatever the I/O thread still holds.
    fn abandon(&self) {
        let mut p = locked(&self.progress);
        if p.result.is_some() {
            drop(p);
            locked(&self.lease).take();
        } else {
            p.abandoned = true;
        }
    }
}

/// The caller's handle on a submitted operation.
#[derive(Debug)]
pub struct Pending {
    op: Arc<OpState>,
}

impl Pending {
    pub fn new(op: Arc<OpState>) -> Pending {
        Pending { op }
    }
}

impl std::ops::Deref for Pending {
    type Target = OpState;

    fn deref(&self) -> &OpState {
        &self.op
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.op.abandon();
    }
}

/// How a request ended.
#[derive(Debug)]
pub enum RequestEnd {
    Complete,
    EndOfFile,
    Failed(Error),
}

/// A contiguous piece of an op, at most `request_bytes` long.
#[derive(Debug)]
pub struct Request {
    pub op: Arc<OpState>,
    /// Offset of the piece inside the op (and the slot).
    pub start: u64,
    pub len: u64,
    /// Bytes of the piece already moved (after short transfers).
    pub moved: u64,
}

impl Request {
    pub fn file_offset(&self) -> u64 {
        self.op.offset + self.start + self.moved
    }

    pub fn addr(&self) -> usize {
        self.op.slot_addr + (self.start + self.moved) as usize
    }

    pub fn remaining(&self) -> u64 {
        self.len - self.moved
    }

    pub fn is_read(&self) -> bool {
        self.op.kind == OpKind::Read
    }

    /// Account a transfer result (`Ok(bytes)` or errno). Returns the request back when
    /// the rest must be submitted again, or `None` once it has ended.
    pub fn account(mut self, res: std::result::Result<u64, i32>) -> Option<Request> {
        let end = match res {
            Err(libc::EAGAIN) | Err(libc::EINTR) => return Some(self),
            Err(errno) => RequestEnd::Failed(Error::os(
                if self.is_read() { "read" } else { "write" },
                Some(self.op.file.path()),
                errno,
            )),
            Ok(got) => {
                let asked = self.remaining();
                let kind = align::classify(asked, got, self.op.file.alignment(), self.is_read());
                self.moved += got.min(asked);
                match kind {
                    Transfer::Complete => RequestEnd::Complete,
                    Transfer::Partial => return Some(self),
                    Transfer::EndOfFile => RequestEnd::EndOfFile,
                    Transfer::Stalled => {
                        RequestEnd::Failed(Error::os("write", Some(self.op.file.path()), libc::EIO))
                    }
                }
            }
        };
        self.op.request_ended(self.start, self.moved, end);
        None
    }

    /// End the request with an error without transferring (engine torn down).
    pub fn abandon(self, err: Error) {
        self.op
            .request_ended(self.start, self.moved, RequestEnd::Failed(err));
    }
}
