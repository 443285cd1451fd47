//! What the backends share: an operation (one slot <-> one file range), split into
//! requests; each backend moves requests and reports how each ended. A request never
//! vanishes: one dropped before it ended (an I/O thread that panicked or stopped) fails
//! its operation, so no waiter is left hanging. `Health` is how an I/O thread that can
//! no longer work tells the engine.

pub mod memory;
pub mod pread;
pub mod trace;
pub mod uring;
pub mod wake;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::align::{self, Transfer};
use crate::arena::SlotLease;
use crate::error::{Error, Result};
use crate::file::EngineFile;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
    /// fdatasync of the file: one request of no bytes, so its wait has a deadline like
    /// any transfer's (a stalled device holds the I/O thread's call, not the caller).
    Sync,
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
    /// Bytes from the op's start whose requests all completed: the prefix a waiter may
    /// read while the rest is still in flight (`OpState::wait_landed`).
    landed: u64,
    /// Requests that completed past a gap, start -> end, taken into `landed` as it
    /// reaches them (requests tile the op, so each key is an earlier request's end).
    ahead: BTreeMap<u64, u64>,
    /// Threads in `wait_landed`: only then does a landed request wake anyone.
    watching: usize,
}

impl Progress {
    /// Request `[from, to)` completed; whether the landed prefix grew.
    fn land(&mut self, from: u64, to: u64) -> bool {
        if from > self.landed {
            self.ahead.insert(from, to);
            return false;
        }
        let before = self.landed;
        self.landed = self.landed.max(to);
        while let Some(end) = self.ahead.remove(&self.landed) {
            self.landed = end;
        }
        self.landed > before
    }
}

/// A piece of an operation's memory: `len` bytes at `addr`, for the op's bytes
/// `[start, start + len)` (file offset `op.offset + start`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub start: u64,
    pub addr: usize,
    pub len: u64,
}

/// One read or write between memory and a file range: a slot, which the op owns
/// (through the lease) until every request has completed, or, for a direct read, the
/// caller's memory in segments (`Engine::submit_read_into`), which the caller keeps
/// valid until then.
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
    /// The slot's index among the registered fixed buffers; None for caller memory.
    pub fixed_index: Option<usize>,
    /// At most this many of its bytes in the kernel at once (0: no bound of its own):
    /// its requests then land one after another, and a hash that follows them
    /// (`landing`) is nearly done when the last lands (io_uring backend).
    pub inflight_cap: u64,
    segments: Vec<Segment>,
    lease: Mutex<Option<Arc<SlotLease>>>,
    progress: Mutex<Progress>,
    done: Condvar,
    /// Woken as the landed prefix grows, for `wait_landed`'s waiters.
    grew: Condvar,
    /// When every request had ended (the op's result was set).
    ended: OnceLock<Instant>,
    /// When it was submitted, and when its first request reached the kernel: what a
    /// wait that ran past its deadline reports (`Pending::whereabouts`).
    sent: Instant,
    pushed: OnceLock<Instant>,
    /// QUEUED until a request is handed to the kernel (LAUNCHED) or the caller withdraws
    /// the read first (WITHDRAWN): whichever comes first decides, once.
    launch: AtomicU8,
}

const QUEUED: u8 = 0;
const LAUNCHED: u8 = 1;
const WITHDRAWN: u8 = 2;

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
            fixed_index: Some(lease.index()),
            inflight_cap: 0,
            segments: vec![Segment {
                start: 0,
                addr: lease.addr(),
                len: extent,
            }],
            lease: Mutex::new(Some(lease)),
            progress: Mutex::new(Progress::default()),
            done: Condvar::new(),
            grew: Condvar::new(),
            ended: OnceLock::new(),
            sent: Instant::now(),
            pushed: OnceLock::new(),
            launch: AtomicU8::new(QUEUED),
        })
    }

    /// A read of `segments` (contiguous in the file from `offset`, in order) into the
    /// caller's memory. Whoever builds it keeps that memory valid and untouched until
    /// the op has ended (see `Engine::submit_read_into`).
    pub fn direct_read(file: Arc<EngineFile>, offset: u64, segments: Vec<Segment>) -> Arc<OpState> {
        OpState::direct_read_capped(file, offset, segments, 0)
    }

    /// As `direct_read`, with at most `inflight_cap` bytes of it in the kernel at once
    /// (0: no bound of its own; the first request always goes, however long).
    pub fn direct_read_capped(
        file: Arc<EngineFile>,
        offset: u64,
        segments: Vec<Segment>,
        inflight_cap: u64,
    ) -> Arc<OpState> {
        let total = segments.iter().map(|s| s.len).sum();
        Arc::new(OpState {
            kind: OpKind::Read,
            file,
            offset,
            want: total,
            extent: total,
            fixed_index: None,
            inflight_cap,
            segments,
            lease: Mutex::new(None),
            progress: Mutex::new(Progress::default()),
            done: Condvar::new(),
            grew: Condvar::new(),
            ended: OnceLock::new(),
            sent: Instant::now(),
            pushed: OnceLock::new(),
            launch: AtomicU8::new(QUEUED),
        })
    }

    /// An fdatasync of `file` (`OpKind::Sync`).
    pub fn sync(file: Arc<EngineFile>) -> Arc<OpState> {
        Arc::new(OpState {
            kind: OpKind::Sync,
            file,
            offset: 0,
            want: 0,
            extent: 0,
            fixed_index: None,
            inflight_cap: 0,
            segments: vec![Segment {
                start: 0,
                addr: 0,
                len: 0,
            }],
            lease: Mutex::new(None),
            progress: Mutex::new(Progress::default()),
            done: Condvar::new(),
            grew: Condvar::new(),
            ended: OnceLock::new(),
            sent: Instant::now(),
            pushed: OnceLock::new(),
            launch: AtomicU8::new(QUEUED),
        })
    }

    /// Cut the op into requests of at most `request_bytes`, none across a segment end
    /// (a sync: one request of no bytes).
    pub fn requests(self: &Arc<Self>, request_bytes: u64) -> Vec<Request> {
        if self.kind == OpKind::Sync {
            locked(&self.progress).outstanding = 1;
            return vec![Request {
                op: Arc::clone(self),
                start: 0,
                len: 0,
                moved: 0,
                addr: 0,
                ended: false,
                stamps: trace::Stamps::default(),
            }];
        }
        let reqs: Vec<Request> = self
            .segments
            .iter()
            .flat_map(|seg| {
                align::split(seg.len, request_bytes).map(move |(at, len)| Request {
                    op: Arc::clone(self),
                    start: seg.start + at,
                    len,
                    moved: 0,
                    addr: seg.addr + at as usize,
                    ended: false,
                    stamps: trace::Stamps::default(),
                })
            })
            .collect();
        locked(&self.progress).outstanding = reqs.len();
        reqs
    }

    /// Before a request is handed to the kernel (io_uring) or a pread worker: false when
    /// the read was withdrawn, and the request must end unsent (`Request::withdrawn`).
    pub fn launch(&self) -> bool {
        let was =
            self.launch
                .compare_exchange(QUEUED, LAUNCHED, Ordering::AcqRel, Ordering::Acquire);
        if matches!(was, Err(WITHDRAWN)) {
            return false;
        }
        if self.pushed.get().is_none() {
            let _ = self.pushed.set(Instant::now());
        }
        true
    }

    /// Give up a read none of whose requests has reached the kernel: it ends now
    /// (`Error::Withdrawn`), its memory untouched and the caller's again, and its
    /// requests end unsent when the I/O thread comes to them. False once one was
    /// handed over, or for a write or a sync (a write withdrawn halfway would leave its
    /// file half written): the op goes on.
    pub fn withdraw(&self) -> bool {
        if self.kind != OpKind::Read {
            return false;
        }
        let won = self
            .launch
            .compare_exchange(QUEUED, WITHDRAWN, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if won {
            self.fail_now(Error::Withdrawn);
        }
        won
    }

    /// Fail before any request was issued (closed file, engine shutting down).
    pub fn fail_now(&self, err: Error) {
        let mut p = locked(&self.progress);
        p.error = Some(err);
        self.finalize(&mut p);
    }

    /// Another share of the op's slot, while the op holds one. An I/O thread that gives
    /// up on a request the kernel still holds keeps the slot out of the ring with it.
    pub fn slot_share(&self) -> Option<Arc<SlotLease>> {
        locked(&self.lease).clone()
    }

    fn request_ended(&self, start: u64, moved: u64, outcome: RequestEnd) {
        let mut p = locked(&self.progress);
        if p.result.is_some() {
            return; // ended already (failed before its requests were issued)
        }
        let mut grew = false;
        match outcome {
            RequestEnd::Complete => grew = p.land(start, start + moved),
            RequestEnd::EndOfFile => {
                let at = start + moved;
                p.eof_at = Some(p.eof_at.map_or(at, |e| e.min(at)));
            }
            // Memory the kernel may still write outranks any other failure: the
            // waiter must not take it back.
            RequestEnd::Failed(e @ Error::KernelOwned { .. }) => p.error = Some(e),
            RequestEnd::Failed(e) => {
                if p.error.is_none() {
                    p.error = Some(e);
                }
            }
        }
        p.outstanding -= 1;
        if p.outstanding == 0 {
            self.finalize(&mut p);
        } else if grew && p.watching > 0 {
            self.grew.notify_all();
        }
    }

    fn finalize(&self, p: &mut Progress) {
        if p.result.is_some() {
            return; // once: a second end would give the slot back twice
        }
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
                OpKind::Write | OpKind::Sync => Ok(self.want),
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
        let _ = self.ended.set(Instant::now());
        self.done.notify_all();
        self.grew.notify_all();
    }

    pub fn is_done(&self) -> bool {
        locked(&self.progress).result.is_some()
    }

    /// Whether the kernel gave the op's memory back: it ended, and not with
    /// `Error::KernelOwned` (a break-down with a direct read still in the kernel's
    /// hands, whose memory may be written at any time from then on).
    pub fn memory_returned(&self) -> bool {
        matches!(&locked(&self.progress).result, Some(r) if !matches!(r, Err(Error::KernelOwned { .. })))
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

    /// Wait until more than `past` bytes from the op's start have landed (their requests
    /// completed) or the op has ended, at most until `deadline` (`Error::Timeout`).
    /// `Ok((landed, ended))`: `ended` once every request ended well, and then `landed` is
    /// `want`. Once the op failed, its error, whatever had landed: a prefix is only ever
    /// used by a caller that also sees the whole op succeed.
    pub fn wait_landed(&self, past: u64, deadline: Option<Instant>) -> Result<(u64, bool)> {
        let mut p = locked(&self.progress);
        loop {
            match &p.result {
                Some(Ok(_)) => return Ok((self.want, true)),
                Some(Err(e)) => return Err(e.clone()),
                None => {}
            }
            let landed = p.landed.min(self.want);
            if landed > past {
                return Ok((landed, false));
            }
            p.watching += 1;
            p = match deadline {
                None => self.grew.wait(p).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        p.watching -= 1;
                        return Err(Error::Timeout);
                    }
                    self.grew
                        .wait_timeout(p, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
            p.watching -= 1;
        }
    }

    /// When the op ended (its last request), once it has.
    pub fn ended_at(&self) -> Option<Instant> {
        self.ended.get().copied()
    }

    /// The op's memory in order: for op bytes `[s.start, s.start + s.len)`, `s.addr`.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Where the op is, for a wait that ran past its deadline: a request the kernel
    /// holds (a stalled device) or one still queued in the engine behind others.
    pub fn whereabouts(&self) -> String {
        let what = match self.kind {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Sync => "fdatasync",
        };
        let age = self.sent.elapsed().as_secs_f64();
        let at = if self.is_done() {
            "ended".to_owned()
        } else if let Some(p) = self.pushed.get() {
            format!("in the kernel for {:.3} s", p.elapsed().as_secs_f64())
        } else {
            "not yet handed to the kernel".to_owned()
        };
        format!("{what} of {} sent {age:.3} s ago, {at}", self.file.path())
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
    /// Memory address of the piece's first byte.
    addr: usize,
    /// Accounted or abandoned: its op knows how it ended.
    ended: bool,
    /// Timings while the I/O thread traces (trace.rs).
    pub stamps: trace::Stamps,
}

impl Drop for Request {
    fn drop(&mut self) {
        if !self.ended {
            // Dropped unended: a panicking I/O thread unwinding, or a channel dropped
            // with the request in it. Fail the op rather than leave its waiter hanging.
            let err = Error::Broken {
                errno: libc::EIO,
                reason: "the I/O thread stopped before this request ended".into(),
            };
            self.op
                .request_ended(self.start, self.moved, RequestEnd::Failed(err));
        }
    }
}

impl Request {
    pub fn file_offset(&self) -> u64 {
        self.op.offset + self.start + self.moved
    }

    pub fn addr(&self) -> usize {
        self.addr + self.moved as usize
    }

    pub fn remaining(&self) -> u64 {
        self.len - self.moved
    }

    pub fn is_read(&self) -> bool {
        self.op.kind == OpKind::Read
    }

    pub fn is_sync(&self) -> bool {
        self.op.kind == OpKind::Sync
    }

    /// A read straight into the caller's memory (no slot of ours).
    pub fn is_direct(&self) -> bool {
        self.op.kind == OpKind::Read && self.op.fixed_index.is_none()
    }

    /// Account a transfer result (`Ok(bytes)` or errno). Returns the request back when
    /// the rest must be submitted again, or `None` once it has ended.
    pub fn account(mut self, res: std::result::Result<u64, i32>) -> Option<Request> {
        let end = match res {
            Err(libc::EAGAIN) | Err(libc::EINTR) => return Some(self),
            Err(errno) => RequestEnd::Failed(Error::os(
                match self.op.kind {
                    OpKind::Read => "read",
                    OpKind::Write => "write",
                    OpKind::Sync => "fdatasync",
                },
                Some(self.op.file.path()),
                errno,
            )),
            Ok(_) if self.op.kind == OpKind::Sync => RequestEnd::Complete,
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
        self.ended = true;
        self.op.request_ended(self.start, self.moved, end);
        None
    }

    /// End the request with an error without transferring (engine torn down).
    pub fn abandon(mut self, err: Error) {
        self.ended = true;
        self.op
            .request_ended(self.start, self.moved, RequestEnd::Failed(err));
    }
}

/// Whether the backend still works. Set once, by the I/O thread that found it cannot
/// go on; every submit checks it (a lock-free read).
#[derive(Debug, Default)]
pub struct Health {
    broken: OnceLock<Error>,
}

impl Health {
    pub fn check(&self) -> Result<()> {
        self.broken.get().map_or(Ok(()), |e| Err(e.clone()))
    }

    pub fn is_broken(&self) -> bool {
        self.broken.get().is_some()
    }

    /// Record why the backend stopped; the first cause stays. Returns the recorded one.
    pub fn mark(&self, err: Error) -> Error {
        self.broken.get_or_init(|| err).clone()
    }
}

/// What a caught panic said, for the engine's broken error.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into())
}

#[cfg(test)]
pub(crate) mod tests {
    //! Request accounting as both backends drive it: `Request::account` on the results a
    //! kernel can give (complete, short, EAGAIN/EINTR, end of file, errno), without I/O.

    use super::*;
    use crate::arena::Arena;
    use crate::file::OpenOptions;

    pub(crate) fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 % 251) as u8).collect()
    }

    /// A 64 KiB pattern file, opened buffered (alignment 1) or O_DIRECT where allowed.
    pub(crate) fn data_file(dir: &tempfile::TempDir, direct: bool) -> Arc<EngineFile> {
        let path = dir.path().join("data");
        std::fs::write(&path, pattern(64 << 10)).unwrap();
        let opts = OpenOptions {
            direct,
            ..Default::default()
        };
        Arc::new(EngineFile::open(path.to_str().unwrap(), opts).unwrap())
    }

    fn op(kind: OpKind, file: &Arc<EngineFile>, arena: &Arc<Arena>, want: u64) -> Arc<OpState> {
        let lease = Arc::new(arena.try_lease().unwrap());
        if kind == OpKind::Write {
            lease.write_started();
        }
        OpState::new(kind, Arc::clone(file), 0, want, want, lease)
    }

    /// A write of a whole 4096-byte slot the caller leased (and still holds).
    fn callers_write(f: &Arc<EngineFile>, arena: &Arc<Arena>) -> (Arc<SlotLease>, Arc<OpState>) {
        let lease = Arc::new(arena.try_lease().unwrap());
        lease.write_started();
        let o = OpState::new(
            OpKind::Write,
            Arc::clone(f),
            0,
            4096,
            4096,
            Arc::clone(&lease),
        );
        (lease, o)
    }

    #[test]
    fn requests_are_counted_and_the_op_ends_with_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let arena = Arena::new(1, 16 << 10).unwrap();
        let o = op(OpKind::Read, &f, &arena, 10_000);
        let reqs = o.requests(4096);
        let lens: Vec<u64> = reqs.iter().map(|r| r.len).collect();
        assert_eq!(lens, [4096, 4096, 1808]);
        let mut it = reqs.into_iter();
        for r in it.by_ref().take(2) {
            let n = r.remaining();
            assert!(r.account(Ok(n)).is_none());
            assert!(!o.is_done(), "ended before its last request");
        }
        let last = it.next().unwrap();
        assert!(last.account(Ok(1808)).is_none());
        assert_eq!(o.wait(None), Ok(10_000));
        assert_eq!(o.take_lease().unwrap().len(), 10_000);
    }

    #[test]
    fn a_direct_read_splits_per_segment_and_keeps_no_slot() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let segs = vec![
            Segment {
                start: 0,
                addr: 0x10000,
                len: 6000,
            },
            Segment {
                start: 6000,
                addr: 0x40000,
                len: 4096,
            },
        ];
        let o = OpState::direct_read(Arc::clone(&f), 4096, segs);
        assert_eq!((o.want, o.extent, o.fixed_index), (10096, 10096, None));
        let reqs = o.requests(4096);
        let got: Vec<(u64, u64, usize, u64)> = reqs
            .iter()
            .map(|r| (r.start, r.len, r.addr(), r.file_offset()))
            .collect();
        assert_eq!(
            got,
            [
                (0, 4096, 0x10000, 4096),
                (4096, 1904, 0x11000, 8192),
                (6000, 4096, 0x40000, 10096)
            ]
        );
        for r in reqs {
            let n = r.remaining();
            assert!(r.account(Ok(n)).is_none());
        }
        assert_eq!(o.wait(None), Ok(10096));
        assert!(
            o.take_lease().is_none(),
            "caller memory: no slot to hand over"
        );
    }

    #[test]
    fn eagain_and_eintr_resubmit_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let arena = Arena::new(1, 4096).unwrap();
        let o = op(OpKind::Read, &f, &arena, 4096);
        let mut r = o.requests(4096).pop().unwrap();
        for errno in [libc::EAGAIN, libc::EINTR] {
            r = r.account(Err(errno)).expect("resubmitted, not ended");
            assert_eq!((r.moved, r.file_offset(), r.remaining()), (0, 0, 4096));
            assert!(!o.is_done());
        }
        assert!(r.account(Ok(4096)).is_none());
        assert_eq!(o.wait(None), Ok(4096));
    }

    #[test]
    fn short_transfer_moves_position_and_address() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let arena = Arena::new(1, 8192).unwrap();
        let o = op(OpKind::Read, &f, &arena, 8192);
        let r = o.requests(8192).pop().unwrap();
        let addr = r.addr();
        let r = r.account(Ok(3000)).expect("the rest is submitted again");
        assert_eq!(
            (r.moved, r.file_offset(), r.remaining()),
            (3000, 3000, 5192)
        );
        assert_eq!(r.addr(), addr + 3000);
        assert!(r.account(Ok(5192)).is_none());
        assert_eq!(o.wait(None), Ok(8192));
    }

    #[test]
    fn read_of_nothing_is_the_end_of_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let arena = Arena::new(1, 8192).unwrap();
        let o = op(OpKind::Read, &f, &arena, 8192);
        let mut reqs = o.requests(4096).into_iter();
        let first = reqs.next().unwrap().account(Ok(1000)).unwrap();
        assert!(first.account(Ok(0)).is_none()); // the file ended 1000 bytes in
        assert!(reqs.next().unwrap().account(Ok(0)).is_none());
        match o.wait(None) {
            Err(Error::ShortRead { wanted, got, .. }) => assert_eq!((wanted, got), (8192, 1000)),
            other => panic!("expected a short read, got {other:?}"),
        }
        assert_eq!(arena.free_slots(), 1, "a failed read gives its slot back");
    }

    #[test]
    fn unaligned_short_direct_read_ends_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, true);
        let a = f.alignment();
        if a == 1 {
            return; // no O_DIRECT here: every short read is resubmitted (test above)
        }
        let arena = Arena::new(1, 4 * a as usize).unwrap();
        let o = op(OpKind::Read, &f, &arena, 4 * a);
        let r = o.requests(4 * a).pop().unwrap();
        // Aligned and short: more may come. Unaligned and short: the end of the file.
        let r = r.account(Ok(a)).expect("aligned short read is resubmitted");
        assert!(r.account(Ok(a + 100)).is_none());
        assert!(matches!(o.wait(None), Err(Error::ShortRead { got, .. }) if got == 2 * a + 100));
    }

    #[test]
    fn first_error_wins_and_frees_the_read_slot() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let arena = Arena::new(2, 8192).unwrap();
        let o = op(OpKind::Read, &f, &arena, 8192);
        let mut reqs = o.requests(4096).into_iter();
        assert!(reqs.next().unwrap().account(Err(libc::EIO)).is_none());
        assert!(!o.is_done(), "the other request is still out");
        assert_eq!(arena.free_slots(), 1);
        assert!(reqs.next().unwrap().account(Err(libc::ENOSPC)).is_none());
        let err = o.wait(None).unwrap_err();
        assert_eq!((err.errno(), err.path()), (Some(libc::EIO), Some(f.path())));
        assert!(err.to_string().starts_with("read failed"), "{err}");
        assert!(o.take_lease().is_none());
        assert_eq!(arena.free_slots(), 2);
    }

    #[test]
    fn write_that_moves_nothing_fails_and_keeps_the_callers_slot() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let arena = Arena::new(1, 4096).unwrap();
        let (lease, o) = callers_write(&f, &arena);
        assert!(o.requests(4096).pop().unwrap().account(Ok(0)).is_none());
        assert_eq!(o.wait(None).unwrap_err().errno(), Some(libc::EIO));
        assert!(!lease.write_in_flight());
        assert_eq!(arena.free_slots(), 0, "the caller still holds its slot");
        drop(lease);
        assert_eq!(arena.free_slots(), 1);
    }

    #[test]
    fn abandoned_read_frees_its_slot_when_it_ends() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let arena = Arena::new(2, 4096).unwrap();
        // Dropped while in flight: the slot stays with the kernel until the request ends.
        let o = op(OpKind::Read, &f, &arena, 4096);
        let r = o.requests(4096).pop().unwrap();
        drop(Pending::new(Arc::clone(&o)));
        assert_eq!(arena.free_slots(), 1);
        assert!(r.account(Ok(4096)).is_none());
        assert_eq!(
            arena.free_slots(),
            2,
            "nobody will take it: back to the ring"
        );
        // Control: the same successful read with its handle kept holds the slot.
        let o = op(OpKind::Read, &f, &arena, 4096);
        let kept = Pending::new(Arc::clone(&o));
        assert!(o.requests(4096).pop().unwrap().account(Ok(4096)).is_none());
        assert_eq!(arena.free_slots(), 1);
        drop(kept); // dropped after the end: freed at once
        assert_eq!(arena.free_slots(), 2);
    }

    #[test]
    fn a_request_dropped_unended_fails_its_op() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let arena = Arena::new(1, 8192).unwrap();
        let o = op(OpKind::Read, &f, &arena, 8192);
        let mut reqs = o.requests(4096).into_iter();
        let first = reqs.next().unwrap();
        // What a panicking I/O thread does to the request in its hands.
        let unwound = std::thread::spawn(move || {
            let _held = first;
            panic!("fault double: an I/O thread panics holding a request");
        })
        .join();
        assert!(unwound.is_err());
        assert!(!o.is_done(), "the other request is still out");
        drop(reqs); // and a queue dropped with its requests in it
        let err = o.wait(Some(Duration::from_secs(5))).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Broken {
                    errno: libc::EIO,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(arena.free_slots(), 1, "a failed read gives its slot back");
        // Control: accounted requests end the op without the guard having a say.
        let o = op(OpKind::Read, &f, &arena, 4096);
        let r = o.requests(4096).pop().unwrap();
        assert!(r.account(Ok(4096)).is_none());
        assert_eq!(o.wait(Some(Duration::ZERO)), Ok(4096));
    }

    #[test]
    fn an_op_ends_once() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let arena = Arena::new(1, 4096).unwrap();
        let (lease, o) = callers_write(&f, &arena);
        let r = o.requests(4096).pop().unwrap();
        o.fail_now(Error::Closed("engine"));
        assert!(!lease.write_in_flight());
        // The request still out ends later: no second end, no second write_ended.
        r.abandon(Error::Timeout);
        assert_eq!(o.wait(Some(Duration::ZERO)), Err(Error::Closed("engine")));
        lease.write_started();
        assert!(
            lease.write_in_flight(),
            "the count was not driven below zero"
        );
        lease.write_ended();
    }

    #[test]
    fn health_keeps_the_first_cause() {
        let h = Health::default();
        assert_eq!(h.check(), Ok(()));
        let first = Error::Broken {
            errno: libc::EBADF,
            reason: "first".into(),
        };
        assert_eq!(h.mark(first.clone()), first);
        let second = Error::Broken {
            errno: libc::EIO,
            reason: "second".into(),
        };
        assert_eq!(h.mark(second), first);
        assert!(h.is_broken());
        assert_eq!(h.check(), Err(first));
    }

    #[test]
    fn wait_times_out_while_a_request_is_out() {
        let dir = tempfile::tempdir().unwrap();
        let f = data_file(&dir, false);
        let arena = Arena::new(1, 4096).unwrap();
        let o = op(OpKind::Read, &f, &arena, 4096);
        let r = o.requests(4096).pop().unwrap();
        assert_eq!(o.wait(Some(Duration::from_millis(5))), Err(Error::Timeout));
        r.abandon(Error::Closed("engine"));
        assert_eq!(o.wait(Some(Duration::ZERO)), Err(Error::Closed("engine")));
    }
}
