//! io_uring backend. One dedicated thread owns the ring: it takes operations from a
//! channel, splits them into requests, keeps at most `queue_depth` in flight, reaps
//! completions and resubmits short transfers. A command sent while it waits for a
//! completion wakes it (wake.rs): an operation waits for room in the queue, never for
//! an unrelated completion. Setup degrades step by step: fixed buffers (the slots, with
//! room for caller memory: memory.rs) and registered files, then plain reads and writes
//! on raw descriptors.
//!
//! An error the thread cannot retry (io_uring_enter failing with anything but
//! EINTR/EAGAIN/EBUSY, a completion no request owns) or a panic breaks the engine: every
//! queued and in-flight operation fails with that error, later submits are refused, and
//! the thread stops. Requests still in the submission queue, which the kernel never
//! took, give their slots back at once; slots of requests the kernel holds stay leased
//! until their completion is reaped, or for good when it never is (better a leaked slot
//! than memory the kernel may still write handed to someone else).

use std::collections::{HashSet, VecDeque};
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};

use super::memory::{MemoryTable, MEMORY_ENTRIES};
use super::trace::{Trace, TraceEvent};
use super::wake::{Waker, WAKE};
use super::{panic_message, Health, Request};
use crate::arena::{Arena, SlotLease};
use crate::error::{describe_errno, Error, Result};
use crate::file::{EngineFile, Registration};
use crate::fstype::Submission;

/// The kernel's limits on registered buffers.
const MAX_FIXED_BUFFERS: usize = 1 << 14;
const MAX_FIXED_BUFFER_BYTES: usize = 1 << 30;
/// Slots in the sparse file table.
const FILE_TABLE: u32 = 1024;
/// A memory registration's claim: waiting for the I/O thread, taken by it (it registers
/// now), or given up by its caller at its deadline (it is never registered).
const CLAIM_WAITING: u8 = 0;
const CLAIM_TAKEN: u8 = 1;
const CLAIM_GIVEN_UP: u8 = 2;
/// How long a broken ring's thread keeps reaping what the kernel still holds.
const ORPHAN_GRACE: Duration = Duration::from_millis(100);
/// The wake poll's place in `unsubmitted` (no slab index is this large).
const WAKE_ID: usize = usize::MAX;

#[derive(Debug, Clone)]
pub struct UringConfig {
    pub queue_depth: u32,
    pub request_bytes: u64,
    /// Bytes in flight per drive (0: only the queue depth bounds them).
    pub inflight_bytes: u64,
    /// Try fixed buffers and registered files (false: plain io_uring).
    pub register: bool,
}

#[derive(Debug, Clone, Default)]
pub struct UringInfo {
    pub fixed_buffers: bool,
    pub registered_files: bool,
    /// Buffer-table entries for caller memory (0: it cannot be registered).
    pub memory_entries: usize,
    pub notes: Vec<String>,
    /// The ring's descriptor, for tests to watch the kernel's side (its fdinfo).
    pub ring_fd: i32,
}

enum Command {
    /// An operation's requests, split by the submitter.
    Op(Vec<Request>),
    Unregister(u32),
    /// Register caller memory ((address, length) regions) and say with which entries,
    /// unless its caller gave up first (`CLAIM_GIVEN_UP`).
    RegisterMemory(
        Vec<(usize, usize)>,
        Arc<AtomicU8>,
        mpsc::SyncSender<Result<Vec<u16>>>,
    ),
    UnregisterMemory(Vec<u16>),
    /// Start recording request timings (at most this many events), dropping any earlier.
    TraceStart(usize),
    /// Stop recording and hand over what was recorded.
    TraceTake(mpsc::SyncSender<Vec<TraceEvent>>),
    Shutdown,
    #[cfg(test)]
    Inject(Fault),
}

/// Fault doubles for tests: what the I/O thread does wrong next.
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(crate) enum Fault {
    /// io_uring_enter fails with `errno` after `after` more calls succeed.
    EnterErrno { errno: i32, after: usize },
    /// The next reap finds a completion whose user_data no request has.
    UnknownUserData,
    /// The thread panics at its next submit.
    Panic,
    /// The thread stops listening for wakes, as where no eventfd could be made.
    Deaf,
}

pub struct UringDriver {
    tx: Sender<Command>,
    /// Ends the thread's wait for completions when a command arrives (wake.rs).
    waker: Option<Arc<Waker>>,
    thread: Option<JoinHandle<()>>,
    health: Arc<Health>,
    request_bytes: u64,
    pub info: UringInfo,
}

/// Why io_uring could not start: (errno, what failed).
pub type SetupError = (i32, String);

impl UringDriver {
    pub fn start(
        cfg: UringConfig,
        arena: Arc<Arena>,
        health: Arc<Health>,
    ) -> std::result::Result<Self, SetupError> {
        let (tx, rx) = mpsc::channel();
        let (setup_tx, setup_rx) = mpsc::sync_channel(1);
        let waker = Waker::new().ok().map(Arc::new);
        let thread_waker = waker.clone();
        let unregister_tx = tx.clone();
        let request_bytes = cfg.request_bytes;
        let thread_health = Arc::clone(&health);
        let thread = std::thread::Builder::new()
            .name("bsr-io-uring".into())
            .spawn(move || {
                // The ring is created on the thread that will be its only submitter.
                match RingLoop::setup(&cfg, arena, unregister_tx, thread_waker) {
                    Ok((mut ring_loop, info)) => {
                        let _ = setup_tx.send(Ok(info));
                        let err = match catch_unwind(AssertUnwindSafe(|| ring_loop.run(&rx))) {
                            Ok(Ok(())) => return,
                            Ok(Err(e)) => e,
                            Err(panic) => Error::Broken {
                                errno: libc::EIO,
                                reason: format!(
                                    "the io_uring thread panicked: {}",
                                    panic_message(&*panic)
                                ),
                            },
                        };
                        ring_loop.break_down(thread_health.mark(err), &rx);
                    }
                    Err(e) => {
                        let _ = setup_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| {
                (
                    e.raw_os_error().unwrap_or(0),
                    format!("spawn I/O thread: {e}"),
                )
            })?;
        match setup_rx.recv() {
            Ok(Ok(info)) => Ok(UringDriver {
                tx,
                waker,
                thread: Some(thread),
                health,
                request_bytes,
                info,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err((libc::EIO, "io_uring thread died during setup".into()))
            }
        }
    }

    /// Hand the op to the I/O thread. (A thread that breaks meanwhile fails the
    /// requests, whether it took them from the channel or they drop with it.)
    pub fn submit(&self, op: Arc<super::OpState>) -> Result<()> {
        if let Err(e) = self.health.check() {
            op.fail_now(e.clone());
            return Err(e);
        }
        let reqs = op.requests(self.request_bytes);
        self.tx
            .send(Command::Op(reqs))
            .map_err(|mpsc::SendError(cmd)| {
                // The thread is gone: it broke (and said why), or it was shut down.
                let err = self.health.check().err().unwrap_or(Error::Closed("engine"));
                if let Command::Op(reqs) = cmd {
                    reqs.into_iter().for_each(|r| r.abandon(err.clone()));
                }
                err
            })?;
        self.wake();
        Ok(())
    }

    fn wake(&self) {
        if let Some(w) = &self.waker {
            w.wake();
        }
    }

    pub fn request_bytes(&self) -> u64 {
        self.request_bytes
    }

    /// Ask the I/O thread to register caller memory with the ring (memory.rs), queued
    /// in order with the operations sent before and after; the caller waits for its
    /// answer with `MemoryRequest::wait`, holding no lock of the engine's meanwhile.
    pub fn request_memory(&self, regions: Vec<(usize, usize)>) -> Result<MemoryRequest> {
        let (tx, reply) = mpsc::sync_channel(1);
        let claim = Arc::new(AtomicU8::new(CLAIM_WAITING));
        self.send(Command::RegisterMemory(regions, Arc::clone(&claim), tx))?;
        Ok(MemoryRequest {
            reply,
            claim,
            health: Arc::clone(&self.health),
        })
    }

    /// What unregisters memory registered here, queued behind the operations sent
    /// before it (a ring already gone took its table with it).
    pub fn memory_release(&self) -> Box<dyn Fn(Vec<u16>) + Send + Sync> {
        let tx = self.tx.clone();
        Box::new(move |indices| {
            let _ = tx.send(Command::UnregisterMemory(indices));
        })
    }

    /// Start tracing requests (see trace.rs); a trace already running starts over.
    pub fn trace_start(&self, max_events: usize) -> Result<()> {
        self.send(Command::TraceStart(max_events))
    }

    /// Stop tracing; the events (empty when no trace ran) come with `TraceRequest::wait`,
    /// which the caller does holding no lock of the engine's.
    pub fn trace_take(&self) -> Result<TraceRequest> {
        let (tx, reply) = mpsc::sync_channel(1);
        self.send(Command::TraceTake(tx))?;
        Ok(TraceRequest {
            reply,
            health: Arc::clone(&self.health),
        })
    }

    fn send(&self, cmd: Command) -> Result<()> {
        self.tx.send(cmd).map_err(|_| self.gone())?;
        self.wake();
        Ok(())
    }

    fn gone(&self) -> Error {
        gone(&self.health)
    }

    /// Fault double for tests (see `Fault`).
    #[cfg(test)]
    pub(crate) fn inject(&self, fault: Fault) {
        let _ = self.tx.send(Command::Inject(fault));
        self.wake();
    }

    /// Finish every queued and in-flight operation, then stop the thread.
    pub fn shutdown(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        self.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for UringDriver {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The op a request belongs to, as a key that is unique while any of its requests is
/// in flight (the request holds the op).
fn op_key(req: &Request) -> usize {
    Arc::as_ptr(&req.op) as usize
}

/// Whether `req`'s op may put it in flight: no cap, nothing of it in flight (the first
/// request always goes), or room under its cap.
fn op_room(capped: &[(usize, u64)], req: &Request) -> bool {
    let cap = req.op.inflight_cap;
    if cap == 0 {
        return true;
    }
    let key = op_key(req);
    let used = capped.iter().find(|c| c.0 == key).map_or(0, |c| c.1);
    used == 0 || used + req.remaining() <= cap
}

/// Why the I/O thread ended without answering: it broke (and said why), or it was shut
/// down.
fn gone(health: &Health) -> Error {
    health.check().err().unwrap_or(Error::Closed("engine"))
}

/// A trace asked of the I/O thread (`UringDriver::trace_take`).
pub struct TraceRequest {
    reply: Receiver<Vec<TraceEvent>>,
    health: Arc<Health>,
}

impl TraceRequest {
    /// The events, once the thread takes the command: it does between two reaps, so a
    /// wait past `timeout` means a thread held in the kernel (`Error::Timeout`).
    pub fn wait(self, timeout: Duration) -> Result<Vec<TraceEvent>> {
        match self.reply.recv_timeout(timeout) {
            Ok(events) => Ok(events),
            Err(RecvTimeoutError::Disconnected) => Err(gone(&self.health)),
            Err(RecvTimeoutError::Timeout) => Err(Error::Timeout),
        }
    }
}

/// A memory registration handed to the I/O thread (`UringDriver::request_memory`).
/// Dropped unanswered (its caller unwinding), it is given up: never registered, or,
/// taken already, its entries emptied by the thread that finds no one to hand them to.
pub struct MemoryRequest {
    reply: Receiver<Result<Vec<u16>>>,
    claim: Arc<AtomicU8>,
    health: Arc<Health>,
}

impl MemoryRequest {
    /// The entries the registration took. `timeout` bounds the wait for the I/O thread
    /// to take the command (a waiting thread is woken for it, wake.rs, but one held in a
    /// system call, or without an eventfd, takes it only when that ends): past it
    /// `Error::Timeout`, and the thread will never register it.
    pub fn wait(self, timeout: Option<Duration>) -> Result<Vec<u16>> {
        let Some(timeout) = timeout else {
            return self.reply.recv().map_err(|_| self.gone())?;
        };
        match self.reply.recv_timeout(timeout) {
            Ok(got) => got,
            Err(RecvTimeoutError::Disconnected) => Err(self.gone()),
            Err(RecvTimeoutError::Timeout) => {
                let give_up = self.claim.compare_exchange(
                    CLAIM_WAITING,
                    CLAIM_GIVEN_UP,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                if give_up.is_ok() {
                    return Err(Error::Timeout);
                }
                // The thread took it just now: the registration itself (pinning pages, no
                // I/O) is under way; its result is the caller's, who still holds the memory.
                self.reply.recv().map_err(|_| self.gone())?
            }
        }
    }

    /// The thread ended without answering: it broke (and said why), or it was shut down.
    fn gone(&self) -> Error {
        gone(&self.health)
    }
}

impl Drop for MemoryRequest {
    fn drop(&mut self) {
        // A no-op once answered (taken) or timed out (given up).
        let _ = self.claim.compare_exchange(
            CLAIM_WAITING,
            CLAIM_GIVEN_UP,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}

/// What a user_data names.
#[derive(Debug, Default)]
enum InFlight {
    #[default]
    Free,
    Request(Request),
    /// A request failed while the kernel still held it: its slot stays leased (here)
    /// until the completion comes.
    Orphan(Option<Arc<SlotLease>>),
}

/// State of the I/O thread. Field order matters: the ring (and with it the kernel's
/// pins on the arena) is dropped before the slots it may still use and the arena.
struct RingLoop {
    ring: IoUring,
    /// Its poll is in the ring while `wake_armed`; None where no eventfd could be made
    /// (commands then wait for the next completion).
    waker: Option<Arc<Waker>>,
    wake_armed: bool,
    slab: Vec<InFlight>,
    free_ids: Vec<usize>,
    queue: VecDeque<Request>,
    /// In flight: pushed to the submission queue (and parked in the slab).
    in_flight: usize,
    /// Ids pushed to the submission queue that the kernel has not taken yet, oldest
    /// first (it takes them in order); `WAKE_ID` stands for the wake poll.
    unsubmitted: VecDeque<usize>,
    queue_depth: usize,
    /// Per drive (st_dev), at most this many bytes in flight; 0: no bound but the depth.
    /// A deep queue of large requests only waits in the device, and a small load's
    /// chunks then all land at once; bounded, its first chunk lands while the rest are
    /// read, so its hash overlaps them.
    inflight_limit: u64,
    /// (device, bytes in flight on it), one entry per drive seen.
    drives: Vec<(u64, u64)>,
    /// (op, bytes of it in flight) for ops with a cap of their own (`inflight_cap`),
    /// while any of theirs is in flight.
    capped: Vec<(usize, u64)>,
    /// Per slab id: the (device, bytes, capped op or 0) its request counted.
    counted: Vec<(u64, u64, usize)>,
    /// (file, end offset) of the request pushed last: the next one that continues it is
    /// sent in a submission of its own (`send`).
    last_pushed: Option<(usize, u64)>,
    fixed_buffers: bool,
    /// The slots' table entries are still empty: filled at the first slot request, so a
    /// ring whose every read goes straight into caller memory never pins the arena.
    slots_pending: bool,
    /// Caller memory in the buffer table (direct reads into it go READ_FIXED).
    memory: MemoryTable,
    file_table: Vec<bool>,
    reaped: Vec<(u64, i32)>,
    trace: Option<Trace>,
    /// Handed to registered files so their drop frees the table entry (in order with
    /// the operations already queued).
    unregister_tx: Sender<Command>,
    #[cfg(test)]
    fault: Option<Fault>,
    _arena: Arc<Arena>,
}

fn errno_of(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

impl RingLoop {
    fn setup(
        cfg: &UringConfig,
        arena: Arc<Arena>,
        unregister_tx: Sender<Command>,
        waker: Option<Arc<Waker>>,
    ) -> std::result::Result<(RingLoop, UringInfo), SetupError> {
        let mut info = UringInfo::default();
        // Room for the wake poll beside a full queue of requests.
        let entries = (cfg.queue_depth + 1).next_power_of_two();
        let ring = match IoUring::builder()
            .setup_single_issuer()
            .setup_coop_taskrun()
            .build(entries)
        {
            Ok(r) => r,
            Err(e) => {
                info.notes.push(format!(
                    "io_uring SINGLE_ISSUER|COOP_TASKRUN refused ({}), plain setup",
                    describe_errno(errno_of(&e))
                ));
                IoUring::new(entries).map_err(|e| (errno_of(&e), format!("io_uring_setup: {e}")))?
            }
        };
        info.ring_fd = ring.as_raw_fd();
        let mut slots_pending = false;
        if cfg.register {
            (info.fixed_buffers, info.memory_entries, slots_pending) =
                register_buffers(&ring, &arena, &mut info.notes);
            match ring.submitter().register_files_sparse(FILE_TABLE) {
                Ok(()) => info.registered_files = true,
                Err(e) => info.notes.push(format!(
                    "registered files refused ({}): raw descriptors",
                    describe_errno(errno_of(&e))
                )),
            }
        }
        if waker.is_none() {
            info.notes.push(
                "no eventfd: an operation sent while others are in flight waits for the \
                 next completion"
                    .into(),
            );
        }
        let ring_loop = RingLoop {
            ring,
            waker,
            wake_armed: false,
            slab: Vec::with_capacity(cfg.queue_depth as usize),
            free_ids: Vec::new(),
            queue: VecDeque::new(),
            in_flight: 0,
            unsubmitted: VecDeque::new(),
            last_pushed: None,
            queue_depth: cfg.queue_depth as usize,
            inflight_limit: cfg.inflight_bytes,
            drives: Vec::new(),
            capped: Vec::new(),
            counted: Vec::with_capacity(cfg.queue_depth as usize),
            fixed_buffers: info.fixed_buffers,
            slots_pending,
            memory: MemoryTable::new(arena.window(), info.memory_entries),
            file_table: vec![
                false;
                if info.registered_files {
                    FILE_TABLE as usize
                } else {
                    0
                }
            ],
            reaped: Vec::with_capacity(cfg.queue_depth as usize),
            trace: None,
            unregister_tx,
            #[cfg(test)]
            fault: None,
            _arena: arena,
        };
        Ok((ring_loop, info))
    }

    /// Move requests until shutdown (Ok) or an error that cannot be retried (Err).
    fn run(&mut self, rx: &Receiver<Command>) -> Result<()> {
        let mut closing = false;
        loop {
            if self.in_flight == 0 && self.queue.is_empty() {
                if closing {
                    return Ok(());
                }
                match rx.recv() {
                    Ok(cmd) => closing |= self.handle(cmd),
                    Err(_) => return Ok(()),
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                closing |= self.handle(cmd);
            }
            self.fill();
            if self.in_flight > 0 {
                // Say we are about to wait, then look once more: a command sent from here
                // on writes the eventfd, one sent before is taken now (wake.rs).
                if let Some(w) = &self.waker {
                    w.park();
                }
                while let Ok(cmd) = rx.try_recv() {
                    closing |= self.handle(cmd);
                }
                self.fill();
                let reaped = self.submit_and_reap();
                if let Some(w) = &self.waker {
                    w.unpark();
                }
                reaped?;
            }
        }
    }

    /// Returns true on shutdown.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Op(mut reqs) => {
                if let Some(first) = reqs.first() {
                    let file = Arc::clone(&first.op.file);
                    if !self.file_table.is_empty() && file.claim_registration() {
                        self.register(&file);
                    }
                }
                if self.trace.is_some() {
                    let now = Some(Instant::now());
                    reqs.iter_mut().for_each(|r| r.stamps.queued = now);
                }
                self.queue.extend(reqs);
            }
            Command::TraceStart(cap) => self.trace = Some(Trace::new(cap)),
            Command::TraceTake(reply) => {
                let events = self.trace.take().map(|t| t.events).unwrap_or_default();
                let _ = reply.send(events);
            }
            Command::Unregister(index) => {
                if let Some(used) = self.file_table.get_mut(index as usize) {
                    let _ = self.ring.submitter().register_files_update(index, &[-1]);
                    *used = false;
                }
            }
            Command::RegisterMemory(regions, claim, reply) => {
                // SAFETY (of what follows): the caller keeps the regions mapped until it
                // has our reply or has given up. Given up (CLAIM_GIVEN_UP), it may free them,
                // so they are not touched; taken, it waits for the reply (uring.rs
                // `MemoryRequest::wait`), so they are still its memory while the
                // kernel pins them, and registered entries always reach an owner that
                // will unregister them.
                let taken = claim.compare_exchange(
                    CLAIM_WAITING,
                    CLAIM_TAKEN,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                if taken.is_ok() {
                    let got = self.register_memory(&regions);
                    if let Err(mpsc::SendError(Ok(indices))) = reply.send(got) {
                        // Nobody to hand them to (cannot happen: a taken claim is waited
                        // for): never leave entries naming memory no one holds.
                        self.clear_entries(&indices);
                        self.memory.remove(&indices);
                    }
                }
            }
            Command::UnregisterMemory(indices) => {
                self.clear_entries(&indices);
                self.memory.remove(&indices);
            }
            Command::Shutdown => return true,
            #[cfg(test)]
            Command::Inject(Fault::Deaf) => self.waker = None,
            #[cfg(test)]
            Command::Inject(fault) => self.fault = Some(fault),
        }
        false
    }

    /// Put the file in the ring's file table on its first operation; a full table
    /// leaves it on its raw descriptor.
    fn register(&mut self, file: &EngineFile) {
        let Some(index) = self.file_table.iter().position(|used| !used) else {
            return;
        };
        let index = index as u32;
        if self
            .ring
            .submitter()
            .register_files_update(index, &[file.fd()])
            .is_err()
        {
            return;
        }
        self.file_table[index as usize] = true;
        let tx = self.unregister_tx.clone();
        file.set_registration(Registration {
            index,
            release: Box::new(move |i| {
                // The ring may be gone already; its table went with it.
                let _ = tx.send(Command::Unregister(i));
            }),
        });
    }

    /// Put caller memory in the buffer table: every piece, or none (an error, undone).
    fn register_memory(&mut self, regions: &[(usize, usize)]) -> Result<Vec<u16>> {
        let Some(pieces) = self.memory.plan(regions) else {
            return Err(Error::invalid(format!(
                "no room to register this memory: the ring keeps {MEMORY_ENTRIES} entries \
                 of at most 1 GiB for caller memory"
            )));
        };
        for (n, p) in pieces.iter().enumerate() {
            let iov = libc::iovec {
                iov_base: p.start as *mut libc::c_void,
                iov_len: p.end - p.start,
            };
            // SAFETY: whoever registers keeps the memory mapped, at the same pages, until
            // it unregisters (Engine::register_memory); the kernel pins it meanwhile.
            let res = unsafe {
                self.ring
                    .submitter()
                    .register_buffers_update(p.index.into(), &[iov], None)
            };
            if let Err(e) = res {
                self.clear_entries(&pieces[..n].iter().map(|p| p.index).collect::<Vec<_>>());
                return Err(Error::os(
                    "register memory with io_uring",
                    None,
                    errno_of(&e),
                ));
            }
        }
        self.memory.insert(&pieces);
        Ok(pieces.iter().map(|p| p.index).collect())
    }

    /// Empty these buffer-table entries; requests already in the kernel keep theirs.
    fn clear_entries(&self, indices: &[u16]) {
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        for &i in indices {
            // SAFETY: an empty entry names no memory.
            let _ = unsafe {
                self.ring
                    .submitter()
                    .register_buffers_update(i.into(), &[empty], None)
            };
        }
    }

    /// Fill the slots' table entries, at the first request into a slot (the arena is
    /// resident by then: a slot was leased). Refused, slot requests go plain.
    fn register_slots_now(&mut self) {
        self.slots_pending = false;
        // SAFETY: the iovecs cover the arena's mapping, which this thread keeps alive (it
        // holds an Arc<Arena>) for longer than the ring that pins it.
        let res = unsafe {
            self.ring
                .submitter()
                .register_buffers_update(0, &slot_iovecs(&self._arena), None)
        };
        if res.is_err() {
            self.fixed_buffers = false;
        }
    }

    /// Queue requests up to the queue depth (and the wake poll, when it is not queued).
    fn fill(&mut self) {
        if let (Some(w), false) = (&self.waker, self.wake_armed) {
            // SAFETY: a poll of the waker's eventfd, which the loop keeps open for as long
            // as the ring lives (field order); it names no memory.
            if unsafe { self.ring.submission().push(&w.poll_entry()) }.is_ok() {
                self.wake_armed = true;
                self.unsubmitted.push_back(WAKE_ID);
            }
        }
        while self.in_flight < self.queue_depth {
            let Some(mut req) = self.next_request() else {
                break;
            };
            if !req.op.launch() {
                req.abandon(Error::Withdrawn); // its caller gave it up before it was sent
                continue;
            }
            if self.slots_pending && req.op.fixed_index.is_some() {
                self.register_slots_now();
            }
            let id = self.free_ids.pop().unwrap_or_else(|| {
                self.slab.push(InFlight::Free);
                self.counted.push((0, 0, 0));
                self.slab.len() - 1
            });
            let entry = self.entry(&req, id as u64);
            let (file, at) = (Arc::as_ptr(&req.op.file) as usize, req.file_offset());
            if self.last_pushed == Some((file, at)) {
                // The block layer would merge it with the request before it into one
                // larger than request_bytes (a plugged submission); some drives are
                // slower on those (measured: 4 MiB at 0.83x of 1 MiB, design notes).
                self.send();
            }
            // SAFETY: the entry points into a slot owned by `req`'s op (its lease keeps
            // the arena mapped), or into caller memory that the op's submitter keeps
            // valid until the op ends (`Engine::submit_read_into`); `req` is parked in
            // the slab until its completion is reaped. A break-down before that keeps a
            // slot's share (`InFlight::Orphan`) and ends a direct read's op only with
            // `Error::KernelOwned`, on which its waiter keeps the memory for good
            // (`break_down`), so the memory outlives the kernel's use of it.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                // Submission queue full: send what is there first.
                self.free_ids.push(id);
                self.queue.push_front(req);
                break;
            }
            self.in_flight += 1;
            self.count(id, &req);
            if self.trace.is_some() {
                let (depth, waiting) = (self.in_flight as u32, self.queue.len() as u32);
                req.stamps.submitted = Some((Instant::now(), depth, waiting));
            }
            self.last_pushed = Some((file, at + req.remaining()));
            self.slab[id] = InFlight::Request(req);
            self.unsubmitted.push_back(id);
        }
    }

    /// Hand the kernel what is in the submission queue, without waiting. An error leaves
    /// the entries there for the next `enter`, which reports it.
    fn send(&mut self) {
        if self.ring.submission().is_empty() {
            return;
        }
        let _ = self.ring.submit();
        self.trim_unsubmitted();
    }

    fn trim_unsubmitted(&mut self) {
        let left = self.ring.submission().len();
        while self.unsubmitted.len() > left {
            self.unsubmitted.pop_front();
        }
    }

    /// The first queued request whose drive, and whose op where it has a cap, have room
    /// for it (in order, so one drive's requests keep theirs); with no bound, the
    /// queue's head.
    fn next_request(&mut self) -> Option<Request> {
        if self.inflight_limit == 0 && self.no_caps_queued() {
            return self.queue.pop_front();
        }
        let limit = self.inflight_limit;
        let (drives, capped) = (&self.drives, &self.capped);
        let room = |r: &Request| {
            let dev = r.op.file.dev();
            let used = drives.iter().find(|d| d.0 == dev).map_or(0, |d| d.1);
            // An idle drive takes any request: one longer than the bound must still go.
            let drive = limit == 0 || used == 0 || used + r.remaining() <= limit;
            drive && op_room(capped, r)
        };
        let at = self.queue.iter().position(room)?;
        self.queue.remove(at)
    }

    fn no_caps_queued(&self) -> bool {
        !matches!(self.queue.front(), Some(r) if r.op.inflight_cap > 0)
    }

    /// Count `req`'s bytes in flight on its drive, and on its op where the op has a cap,
    /// for slab entry `id` (taken back at its reap).
    fn count(&mut self, id: usize, req: &Request) {
        let (dev, bytes) = (req.op.file.dev(), req.remaining());
        let op = if req.op.inflight_cap > 0 {
            op_key(req)
        } else {
            0
        };
        self.counted[id] = (dev, bytes, op);
        match self.drives.iter_mut().find(|d| d.0 == dev) {
            Some(d) => d.1 += bytes,
            None => self.drives.push((dev, bytes)),
        }
        if op != 0 {
            match self.capped.iter_mut().find(|c| c.0 == op) {
                Some(c) => c.1 += bytes,
                None => self.capped.push((op, bytes)),
            }
        }
    }

    fn uncount(&mut self, id: usize) {
        let (dev, bytes, op) = std::mem::take(&mut self.counted[id]);
        if let Some(d) = self.drives.iter_mut().find(|d| d.0 == dev) {
            d.1 -= bytes;
        }
        if op != 0 {
            // An op's entry goes with its last request in flight: its address may be
            // another op's once it has ended.
            self.capped.retain_mut(|c| {
                if c.0 == op {
                    c.1 -= bytes;
                }
                c.1 > 0
            });
        }
    }

    fn entry(&self, req: &Request, user_data: u64) -> squeue::Entry {
        let ptr = req.addr() as *mut u8;
        let len = req.remaining() as u32;
        let off = req.file_offset();
        let read = req.is_read();
        // A slot's own entry, or for caller memory (a direct read) the entry of memory
        // registered around it, if any.
        let buffer = match req.op.fixed_index {
            Some(i) => self.fixed_buffers.then_some(i as u16),
            None => self.memory.lookup(ptr as usize, len as usize),
        };
        let (fixed, buf_index) = (buffer.is_some(), buffer.unwrap_or(0));
        macro_rules! build {
            ($fd:expr) => {
                match (read, fixed) {
                    (true, true) => opcode::ReadFixed::new($fd, ptr, len, buf_index)
                        .offset(off)
                        .build(),
                    (true, false) => opcode::Read::new($fd, ptr, len).offset(off).build(),
                    (false, true) => opcode::WriteFixed::new($fd, ptr, len, buf_index)
                        .offset(off)
                        .build(),
                    (false, false) => opcode::Write::new($fd, ptr, len).offset(off).build(),
                }
            };
        }
        macro_rules! sync {
            ($fd:expr) => {
                opcode::Fsync::new($fd)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build()
            };
        }
        let e = match (req.op.file.registered_index(), req.is_sync()) {
            (Some(i), true) => sync!(types::Fixed(i)),
            (None, true) => sync!(types::Fd(req.op.file.fd())),
            (Some(i), false) => build!(types::Fixed(i)),
            (None, false) => build!(types::Fd(req.op.file.fd())),
        };
        let e = e.user_data(user_data);
        match req.op.file.submission() {
            Submission::Inline => e,
            // Its file system may hold this thread in io_uring_enter for the whole
            // request, and every other file's requests with it: a kernel worker waits
            // instead (fstype.rs).
            Submission::Async => e.flags(squeue::Flags::ASYNC),
        }
    }

    /// io_uring_enter, waiting for `want` completions (through the fault double in tests).
    fn enter(&mut self, want: usize) -> std::io::Result<usize> {
        #[cfg(test)]
        match self.fault.take() {
            Some(Fault::Panic) => panic!("fault double: the io_uring thread panics"),
            Some(Fault::EnterErrno { errno, after: 0 }) => {
                return Err(std::io::Error::from_raw_os_error(errno))
            }
            Some(Fault::EnterErrno { errno, after }) => {
                self.fault = Some(Fault::EnterErrno {
                    errno,
                    after: after - 1,
                })
            }
            other => self.fault = other,
        }
        let res = self.ring.submit_and_wait(want);
        // Whatever the outcome, what is left in the submission queue was not taken.
        self.trim_unsubmitted();
        res
    }

    fn submit_and_reap(&mut self) -> Result<()> {
        if let Err(e) = self.enter(1) {
            match errno_of(&e) {
                // Interrupted, or the completion queue is full: reap, then go on.
                libc::EINTR | libc::EAGAIN | libc::EBUSY => {}
                errno => {
                    return Err(Error::Broken {
                        errno,
                        reason: "io_uring_enter failed".into(),
                    })
                }
            }
        }
        self.reap()
    }

    /// Account every completion there is. A completion no request owns means the ring
    /// and this thread disagree on what is in flight: nothing after it can be trusted.
    fn reap(&mut self) -> Result<()> {
        self.reaped.clear();
        self.reaped
            .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        #[cfg(test)]
        if let Some(Fault::UnknownUserData) = self.fault {
            self.fault = None;
            self.reaped.push((u64::MAX, 0));
        }
        let mut unknown = None;
        for i in 0..self.reaped.len() {
            let (user_data, res) = self.reaped[i];
            if user_data == WAKE {
                self.woken(res);
                continue;
            }
            let id = user_data as usize;
            let taken = match self.slab.get_mut(id) {
                Some(entry) => std::mem::take(entry),
                None => InFlight::Free,
            };
            match taken {
                InFlight::Free => {
                    unknown.get_or_insert(user_data);
                    continue;
                }
                InFlight::Orphan(_slot) => {} // the kernel is done with it: let it go
                InFlight::Request(req) => {
                    let res = if res < 0 { Err(-res) } else { Ok(res as u64) };
                    let traced = (req.op.offset + req.start, req.len, req.stamps);
                    match req.account(res) {
                        Some(again) => self.queue.push_front(again),
                        None => {
                            if let Some(t) = self.trace.as_mut() {
                                t.complete(traced.0, traced.1, traced.2);
                            }
                        }
                    }
                }
            }
            self.uncount(id);
            self.free_ids.push(id);
            self.in_flight -= 1;
        }
        match unknown {
            None => Ok(()),
            Some(user_data) => Err(Error::Broken {
                errno: libc::EIO,
                reason: format!("io_uring returned a completion for user_data {user_data}, which no request has"),
            }),
        }
    }

    /// The wake poll ended: fired (poll it again at the next `fill`), or refused, in
    /// which case commands wait for completions as they did without it, rather than
    /// the loop re-arming a poll the kernel keeps refusing.
    fn woken(&mut self, res: i32) {
        self.wake_armed = false;
        match &self.waker {
            Some(w) if res >= 0 => w.drain(),
            _ => self.waker = None,
        }
    }

    /// The ring cannot go on: fail every queued and in-flight request with `err`, and
    /// every op still in the channel; keep the slots the kernel may still use until
    /// their completion comes (for a short while), then stop. Nothing is submitted
    /// from here on.
    ///
    /// A direct read the kernel holds writes the caller's memory, which no lease of
    /// ours keeps: its requests stay parked until their completion comes, and those
    /// still out after the grace fail their op with `Error::KernelOwned`, so the waiter
    /// keeps that memory (forgets it, as a slot is forgotten here) instead of taking it
    /// back while the kernel may still write it.
    fn break_down(&mut self, err: Error, rx: &Receiver<Command>) {
        for req in self.queue.drain(..) {
            req.abandon(err.clone());
        }
        // Pushed but never taken by the kernel: no memory of theirs is in its hands.
        let untaken: HashSet<usize> = self.unsubmitted.drain(..).collect();
        for (id, entry) in self.slab.iter_mut().enumerate() {
            if let InFlight::Request(req) = std::mem::take(entry) {
                if untaken.contains(&id) {
                    req.abandon(err.clone());
                    self.in_flight -= 1;
                } else if req.is_direct() {
                    *entry = InFlight::Request(req); // its completion decides, below
                } else {
                    let slot = req.op.slot_share();
                    req.abandon(err.clone());
                    *entry = InFlight::Orphan(slot);
                }
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            if let Command::Op(reqs) = cmd {
                reqs.into_iter().for_each(|r| r.abandon(err.clone()));
            }
        }
        // Ops sent from now on are dropped with the channel when this thread ends, and
        // their requests fail as they drop; submits after `health` was marked are refused.
        let deadline = Instant::now() + ORPHAN_GRACE;
        while self.in_flight > 0 && Instant::now() < deadline {
            // An enter that submits nothing and waits for nothing lets the kernel post
            // completions; it may fail again, since the ring is what broke.
            // SAFETY: no submission entry is handed to the kernel, no argument passed.
            let _ = unsafe { self.ring.submitter().enter::<libc::sigset_t>(0, 0, 0, None) };
            let _ = self.reap();
            // A direct read that ended short is never pushed again: the kernel is done
            // with its memory.
            for req in self.queue.drain(..) {
                req.abandon(err.clone());
            }
            if self.in_flight > 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let (errno, reason) = match &err {
            Error::Broken { errno, reason } => (*errno, reason.clone()),
            other => (other.errno().unwrap_or(libc::EIO), other.to_string()),
        };
        for entry in &mut self.slab {
            match std::mem::take(entry) {
                InFlight::Request(req) => {
                    // Still the kernel's: its op fails with KernelOwned.
                    req.abandon(Error::KernelOwned {
                        errno,
                        reason: reason.clone(),
                    });
                }
                InFlight::Orphan(slot) => {
                    // Never reaped: the kernel may still write the slot after the ring is
                    // gone. Keep it (and the arena) mapped for the life of the process.
                    std::mem::forget(slot);
                }
                InFlight::Free => {}
            }
        }
    }
}

/// Register a sparse buffer table: the slots' entries first, filled at the first slot
/// request (`register_slots_now`), then entries for caller memory; else the slots alone,
/// at once (an older kernel). Returns (slots registered, entries for caller memory,
/// slots still to fill in); says why not. Pinning counts against RLIMIT_MEMLOCK as
/// mlock does: where the arena may not be locked, nothing is registered.
fn register_buffers(ring: &IoUring, arena: &Arena, notes: &mut Vec<String>) -> (bool, usize, bool) {
    if !arena.features.mlock {
        notes.push(memlock_note(libc::ENOMEM));
        return (false, 0, false);
    }
    let entries = MEMORY_ENTRIES.min(MAX_FIXED_BUFFERS.saturating_sub(arena.window()));
    if entries > 0 && arena.slot_bytes() <= MAX_FIXED_BUFFER_BYTES {
        let table = (arena.window() + entries) as u32;
        match ring.submitter().register_buffers_sparse(table) {
            Ok(()) => return (true, entries, true),
            Err(e) => notes.push(format!(
                "sparse buffer table refused ({}): caller memory is not registered",
                describe_errno(errno_of(&e))
            )),
        }
    }
    (register_slots(ring, arena, notes), 0, false)
}

fn slot_iovecs(arena: &Arena) -> Vec<libc::iovec> {
    (0..arena.window())
        .map(|i| libc::iovec {
            iov_base: arena.slot_addr(i) as *mut libc::c_void,
            iov_len: arena.slot_bytes(),
        })
        .collect()
}

fn memlock_note(errno: i32) -> String {
    let why = if errno == libc::ENOMEM {
        " (RLIMIT_MEMLOCK too low to pin the arena)"
    } else {
        ""
    };
    format!(
        "fixed buffers refused: {}{why}; plain reads and writes",
        describe_errno(errno)
    )
}

/// Register each slot as one fixed buffer. Returns whether it worked; says why not.
fn register_slots(ring: &IoUring, arena: &Arena, notes: &mut Vec<String>) -> bool {
    if arena.window() > MAX_FIXED_BUFFERS || arena.slot_bytes() > MAX_FIXED_BUFFER_BYTES {
        notes.push(format!(
            "fixed buffers skipped: at most {MAX_FIXED_BUFFERS} buffers of 1 GiB each"
        ));
        return false;
    }
    // SAFETY: the iovecs cover the arena's mapping, which the I/O thread keeps alive
    // (it holds an Arc<Arena>) for longer than the ring that pins it.
    match unsafe { ring.submitter().register_buffers(&slot_iovecs(arena)) } {
        Ok(()) => true,
        Err(e) => {
            notes.push(memlock_note(errno_of(&e)));
            false
        }
    }
}

#[cfg(test)]
mod tests {
    //! The io_uring driver on real files, registered and plain: more requests than the
    //! queue depth, the end of the file, an errno in a completion, and a read abandoned
    //! while the kernel holds it (on a FIFO, so it stays in flight until we write).
    //! Skipped where the kernel refuses io_uring.

    use std::ffi::CString;
    use std::io::Write;

    use super::super::tests::{data_file, pattern};
    use super::super::{OpKind, OpState, Pending, Segment};
    use super::*;
    use crate::file::OpenOptions;

    fn drivers(arena: &Arc<Arena>, queue_depth: u32) -> Vec<UringDriver> {
        [true, false]
            .into_iter()
            .filter_map(|register| start(arena, queue_depth, register, Arc::default()))
            .collect()
    }

    fn start(
        arena: &Arc<Arena>,
        queue_depth: u32,
        register: bool,
        health: Arc<Health>,
    ) -> Option<UringDriver> {
        let cfg = UringConfig {
            queue_depth,
            request_bytes: 4096,
            inflight_bytes: 0,
            register,
        };
        UringDriver::start(cfg, Arc::clone(arena), health).ok()
    }

    /// A FIFO opened for reading by the engine, and its writing end: a read of it stays
    /// with the kernel until the test writes.
    fn fifo(dir: &tempfile::TempDir, name: &str) -> (Arc<EngineFile>, std::fs::File) {
        let path = dir.path().join(name);
        let c = CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let opts = OpenOptions {
            special: true,
            ..Default::default()
        };
        let f = Arc::new(EngineFile::open(path.to_str().unwrap(), opts).unwrap());
        let w = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        (f, w)
    }

    fn broken_with(r: Result<u64>, errno: i32) -> bool {
        matches!(r, Err(Error::Broken { errno: e, .. }) if e == errno)
    }

    /// How many submission entries the kernel has taken from the ring (its fdinfo). The
    /// kernel may leave the ring's lines out while another thread holds the ring's lock
    /// (the I/O thread submitting): that reads as 0, and the caller polls again.
    fn taken_by_kernel(d: &UringDriver) -> u32 {
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", d.info.ring_fd));
        info.unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("SqHead:"))
            .map_or(0, |v| v.trim().parse().unwrap())
    }

    #[test]
    fn an_enter_error_fails_queued_and_in_flight_ops_and_keeps_the_kernels_slot() {
        let dir = tempfile::tempdir().unwrap();
        for (i, register) in [true, false].into_iter().enumerate() {
            let arena = Arena::new(3, 40 << 10).unwrap();
            let health = Arc::new(Health::default());
            let Some(mut d) = start(&arena, 2, register, Arc::clone(&health)) else {
                return; // io_uring refused here
            };
            let (pipe, mut writer) = fifo(&dir, &format!("fifo{i}"));
            // Two requests on the FIFO: both go to the kernel, which holds them.
            let stuck = read_op(&pipe, &arena, 0, 8192);
            d.submit(Arc::clone(&stuck.op)).unwrap();
            let t0 = Instant::now();
            while taken_by_kernel(&d) < 2 {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "the kernel never took them"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            let f = data_file(&dir, true);
            let big = read_op(&f, &arena, 0, 40 << 10); // 10 requests, all still queued
            d.submit(Arc::clone(&big.op)).unwrap();
            // Fault double: the next io_uring_enter fails with EBADF.
            d.inject(Fault::EnterErrno {
                errno: libc::EBADF,
                after: 0,
            });
            // Wake the thread: one FIFO request ends short and is pushed again, then
            // the enter fails; the other FIFO request stays with the kernel.
            writer.write_all(&[7; 100]).unwrap();
            let t = Some(Duration::from_secs(10));
            assert!(broken_with(stuck.wait(t), libc::EBADF), "{register}");
            assert!(broken_with(big.wait(t), libc::EBADF), "{register}");
            assert!(broken_with(health.check().map(|()| 0), libc::EBADF));
            d.shutdown(); // the thread stopped already: no hang
            drop((stuck, big));
            // The kernel may still write the FIFO read's slot: it never comes back.
            // `big` never reached the kernel: its slot came back at once.
            assert_eq!(arena.free_slots(), 2, "{register}");
        }
    }

    #[test]
    fn a_break_down_leaves_a_direct_read_the_kernel_holds_with_the_kernel() {
        let dir = tempfile::tempdir().unwrap();
        for (i, register) in [true, false].into_iter().enumerate() {
            let arena = Arena::new(1, 4096).unwrap();
            let health = Arc::new(Health::default());
            let Some(mut d) = start(&arena, 2, register, Arc::clone(&health)) else {
                return; // io_uring refused here
            };
            // A FIFO as the source: the kernel holds the read until someone writes.
            let (pipe, mut writer) = fifo(&dir, &format!("direct{i}"));
            let mut dest = vec![0u8; 3 * 4096];
            let base = dest.as_mut_ptr() as usize;
            let seg = |at: usize| Segment {
                start: at as u64,
                addr: base + at,
                len: 4096,
            };
            // Two requests: both go to the kernel, which holds them.
            let segs = vec![seg(0), seg(4096)];
            let stuck = Pending::new(OpState::direct_read(Arc::clone(&pipe), 0, segs));
            d.submit(Arc::clone(&stuck.op)).unwrap();
            let t0 = Instant::now();
            while taken_by_kernel(&d) < 2 {
                assert!(t0.elapsed() < Duration::from_secs(10), "never taken");
                std::thread::sleep(Duration::from_millis(1));
            }
            // Control: a direct read still queued when the engine breaks.
            let f = data_file(&dir, false);
            let queued = Pending::new(OpState::direct_read(Arc::clone(&f), 0, vec![seg(8192)]));
            d.submit(Arc::clone(&queued.op)).unwrap();
            d.inject(Fault::EnterErrno {
                errno: libc::EBADF,
                after: 0,
            });
            // Wake the thread: one request ends short and is pushed again, then the
            // enter fails; the other stays with the kernel.
            writer.write_all(&[7; 100]).unwrap();
            let t = Some(Duration::from_secs(10));
            let r = stuck.wait(t);
            assert!(
                matches!(
                    &r,
                    Err(Error::KernelOwned {
                        errno: libc::EBADF,
                        ..
                    })
                ),
                "{register}: {r:?}"
            );
            let text = r.unwrap_err().to_string();
            assert!(
                text.contains("destination blocks still owned by the kernel"),
                "{text}"
            );
            assert!(stuck.is_done() && !stuck.memory_returned(), "{register}");
            // The read the kernel never took fails as the engine did; its memory is back.
            let q = queued.wait(t);
            assert!(
                broken_with(q.clone(), libc::EBADF) || q == Err(Error::Closed("engine")),
                "{q:?}"
            );
            assert!(queued.memory_returned());
            d.shutdown();
            // The test's buffer outlives nothing it lent: the FIFO read is never
            // completed (its writer never writes), as the real caller forgets it.
            std::mem::forget(dest);
        }
    }

    #[test]
    fn a_completion_nobody_owns_breaks_the_engine() {
        let dir = tempfile::tempdir().unwrap();
        let arena = Arena::new(1, 16 << 10).unwrap();
        let health = Arc::new(Health::default());
        let Some(mut d) = start(&arena, 2, true, Arc::clone(&health)) else {
            return;
        };
        let f = data_file(&dir, true);
        d.inject(Fault::UnknownUserData); // fault double: a stray completion
        let p = read_op(&f, &arena, 0, 16 << 10);
        d.submit(Arc::clone(&p.op)).unwrap();
        let r = p.wait(Some(Duration::from_secs(10)));
        assert!(
            matches!(&r, Err(Error::Broken { errno: libc::EIO, reason }) if reason.contains("user_data")),
            "{r:?}"
        );
        d.shutdown();
        drop(p);
        assert_eq!(arena.free_slots(), 1);
    }

    #[test]
    fn a_panic_of_the_io_thread_fails_every_op() {
        let dir = tempfile::tempdir().unwrap();
        let arena = Arena::new(2, 16 << 10).unwrap();
        let health = Arc::new(Health::default());
        let Some(mut d) = start(&arena, 2, false, Arc::clone(&health)) else {
            return;
        };
        let f = data_file(&dir, true);
        d.inject(Fault::Panic); // fault double: the thread panics at its next enter
        let ops: Vec<Pending> = [0, 16 << 10]
            .into_iter()
            .map(|off| {
                let p = read_op(&f, &arena, off, 16 << 10);
                // Refused (Broken) when the thread broke before this submit.
                let _ = d.submit(Arc::clone(&p.op));
                p
            })
            .collect();
        for p in &ops {
            let r = p.wait(Some(Duration::from_secs(10)));
            assert!(
                matches!(
                    r,
                    Err(Error::Broken {
                        errno: libc::EIO,
                        ..
                    })
                ),
                "{r:?}"
            );
        }
        let why = health.check().unwrap_err().to_string();
        assert!(why.contains("panicked"), "{why}");
        d.shutdown();
        drop(ops);
        assert_eq!(
            arena.free_slots(),
            2,
            "the ring was never entered: all reaped"
        );
        // Control: the same reads on a driver with no fault succeed.
        let d = start(&arena, 2, false, Arc::default()).unwrap();
        let p = read_op(&f, &arena, 0, 16 << 10);
        d.submit(Arc::clone(&p.op)).unwrap();
        assert_eq!(p.wait(Some(Duration::from_secs(10))), Ok(16 << 10));
    }

    fn read_op(f: &Arc<EngineFile>, a: &Arc<Arena>, off: u64, n: u64) -> Pending {
        let lease = Arc::new(a.try_lease().unwrap());
        Pending::new(OpState::new(OpKind::Read, Arc::clone(f), off, n, n, lease))
    }

    #[test]
    fn more_requests_than_the_queue_depth() {
        let dir = tempfile::tempdir().unwrap();
        let arena = Arena::new(1, 40 << 10).unwrap();
        for d in drivers(&arena, 2) {
            let f = data_file(&dir, true); // a file belongs to one engine (its ring's table)
            let p = read_op(&f, &arena, 4096, 40 << 10); // 10 requests, 2 in flight
            d.submit(Arc::clone(&p.op)).unwrap();
            assert_eq!(p.wait(Some(Duration::from_secs(10))), Ok(40 << 10));
            let lease = p.take_lease().unwrap();
            // SAFETY: the read is complete and the lease is ours alone.
            let got = unsafe { lease.bytes(0, 40 << 10) }.unwrap();
            assert_eq!(got, &pattern(64 << 10)[4096..4096 + (40 << 10)]);
        }
    }

    #[test]
    fn a_read_past_the_end_is_short() {
        let dir = tempfile::tempdir().unwrap();
        let arena = Arena::new(1, 16 << 10).unwrap();
        for d in drivers(&arena, 4) {
            let f = data_file(&dir, true);
            let p = read_op(&f, &arena, (64 << 10) - 8192, 16 << 10);
            d.submit(Arc::clone(&p.op)).unwrap();
            let r = p.wait(Some(Duration::from_secs(10)));
            assert!(
                matches!(r, Err(Error::ShortRead { got: 8192, .. })),
                "{r:?}"
            );
            drop(p);
            assert_eq!(arena.free_slots(), 1);
        }
    }

    #[test]
    fn an_errno_in_a_completion_fails_the_op() {
        let dir = tempfile::tempdir().unwrap();
        let arena = Arena::new(1, 4096).unwrap();
        for d in drivers(&arena, 4) {
            let f = data_file(&dir, false); // read-only descriptor
            let lease = Arc::new(arena.try_lease().unwrap());
            lease.write_started();
            let op = OpState::new(OpKind::Write, Arc::clone(&f), 0, 4096, 4096, lease);
            d.submit(Arc::clone(&op)).unwrap();
            let err = op.wait(Some(Duration::from_secs(10))).unwrap_err();
            assert_eq!(err.errno(), Some(libc::EBADF), "{err}");
            drop(op);
            assert_eq!(arena.free_slots(), 1);
        }
    }

    #[test]
    fn a_read_abandoned_in_flight_frees_its_slot_when_the_kernel_is_done() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let opts = OpenOptions {
            special: true,
            ..Default::default()
        };
        let f = Arc::new(EngineFile::open(fifo.to_str().unwrap(), opts).unwrap());
        let arena = Arena::new(1, 4096).unwrap();
        let Some(d) = drivers(&arena, 4).into_iter().next() else {
            return;
        };
        let p = read_op(&f, &arena, 0, 4096);
        let op = Arc::clone(&p.op);
        d.submit(Arc::clone(&op)).unwrap();
        assert_eq!(
            op.wait(Some(Duration::from_millis(50))),
            Err(Error::Timeout)
        );
        drop(p); // abandoned while the kernel holds the request
        assert_eq!(
            arena.free_slots(),
            0,
            "never reused while the kernel may write it"
        );
        let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        w.write_all(&pattern(4096)).unwrap();
        assert_eq!(op.wait(Some(Duration::from_secs(10))), Ok(4096));
        assert_eq!(arena.free_slots(), 1, "back to the ring at the completion");
    }
}
