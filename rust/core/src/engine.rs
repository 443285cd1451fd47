//! The engine: a window of staging slots, a backend that moves bytes between slots and
//! files, leasing, and the checks on every request before it reaches the kernel.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::align::{is_aligned, round_up, AlignedBlock};
use crate::arena::{Arena, SlotLease, PAGE};
use crate::backend::pread::PreadPool;
use crate::backend::trace::TraceEvent;
use crate::backend::uring::{UringConfig, UringDriver};
use crate::backend::{Health, OpKind, OpState, Pending, Segment};
use crate::error::{describe_errno, Error, Result};
use crate::file::{EngineFile, OpenOptions};

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// io_uring with everything the kernel allows, else the pread pool.
    Auto,
    /// io_uring (fixed buffers and registered files where allowed); no fallback.
    Uring,
    /// io_uring without fixed buffers or registered files.
    UringPlain,
    /// The pread/pwrite thread pool.
    Pread,
}

impl BackendChoice {
    /// Parse a backend name (`None` or "auto" is Auto).
    pub fn parse(name: Option<&str>) -> Result<BackendChoice> {
        match name.map(str::trim) {
            None | Some("") | Some("auto") => Ok(BackendChoice::Auto),
            Some("io_uring") => Ok(BackendChoice::Uring),
            Some("io_uring_plain") => Ok(BackendChoice::UringPlain),
            Some("pread") => Ok(BackendChoice::Pread),
            Some(other) => Err(Error::invalid(format!(
                "unknown backend {other:?}: use auto, io_uring, io_uring_plain or pread"
            ))),
        }
    }

    /// The explicit choice, else `BSR_IO_BACKEND`, else Auto.
    pub fn resolve(name: Option<&str>) -> Result<BackendChoice> {
        match name {
            Some(n) if n != "auto" => Self::parse(Some(n)),
            _ => Self::parse(std::env::var("BSR_IO_BACKEND").ok().as_deref()),
        }
    }
}

/// Default request size: what a drive is sent per request (the io_uring backend keeps
/// the block layer from merging them, uring.rs `send`). 1 MiB is what fio reads at its
/// best with; on this project's virtio drive 4 MiB requests ran at 0.83x of it, and a
/// drive with a smaller limit has the block layer split them anyway. The per-request
/// CPU (a submission, a bio, an interrupt) is 2,048 requests per 2 GiB: noise.
pub const DEFAULT_REQUEST_BYTES: usize = 1 << 20;

/// Default bound on bytes in flight per drive (io_uring backend). What keeps a drive at
/// its limit is bytes in flight, not requests; more only queues in the device, and a
/// small restore then has all its chunks land at once, leaving no read for its hashes to
/// overlap. 32 MiB: on this project's virtio drive the engine read 2-4 GiB restores
/// about 1.03x faster than at 8 MiB, which only helped restores of one or two chunks
/// (docs/results/ttft-sweep.json, `fast_over_fast_compare_paired`); fio there is fastest
/// at 4-8 MiB, the engine is not (design notes). Not measured: a real NVMe drive.
pub const DEFAULT_INFLIGHT_BYTES: usize = 32 << 20;

/// How long `trace_take` waits for the I/O thread to hand over its trace (it does so
/// between two reaps): past it the thread is held in the kernel, and the caller hears so.
const TRACE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub window: usize,
    pub slot_bytes: usize,
    pub queue_depth: usize,
    pub request_bytes: usize,
    /// At most this many bytes in flight per drive (0: only `queue_depth` bounds them).
    /// A drive with nothing in flight always takes one request, however long.
    pub inflight_bytes: usize,
    pub backend: BackendChoice,
}

impl EngineConfig {
    pub fn new(window: usize, slot_bytes: usize) -> Self {
        EngineConfig {
            window,
            slot_bytes,
            queue_depth: 32,
            request_bytes: DEFAULT_REQUEST_BYTES,
            inflight_bytes: DEFAULT_INFLIGHT_BYTES,
            backend: BackendChoice::Auto,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.window < 1 {
            return Err(Error::invalid(format!(
                "window must be at least 1, got {}",
                self.window
            )));
        }
        if self.slot_bytes == 0 {
            return Err(Error::invalid("slot_bytes must be positive, got 0"));
        }
        if self.queue_depth < 1 || self.queue_depth > 4096 {
            return Err(Error::invalid(format!(
                "queue_depth must be in 1..=4096, got {}",
                self.queue_depth
            )));
        }
        let rb = self.request_bytes as u64;
        if rb == 0 || !is_aligned(rb, PAGE) || rb > 1 << 30 {
            return Err(Error::invalid(format!(
                "request_bytes must be a positive multiple of 4096 up to 1 GiB, got {rb}"
            )));
        }
        Ok(())
    }
}

/// Caller memory registered with the engine's ring (`Engine::register_memory`). Dropping
/// it unregisters the memory, queued behind the operations submitted before.
#[derive(Default)]
pub struct MemoryRegistration {
    indices: Vec<u16>,
    release: Option<Box<dyn Fn(Vec<u16>) + Send + Sync>>,
}

impl MemoryRegistration {
    /// Buffer-table entries it holds (0: nothing registered, reads stay plain).
    pub fn entries(&self) -> usize {
        self.indices.len()
    }
}

impl Drop for MemoryRegistration {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release(std::mem::take(&mut self.indices));
        }
    }
}

/// What the probe found and which path the engine took.
#[derive(Debug, Clone)]
pub struct Features {
    pub backend: &'static str,
    pub fixed_buffers: bool,
    pub registered_files: bool,
    /// Caller memory can be registered (`register_memory`) for direct reads.
    pub registered_memory: bool,
    pub mlock: bool,
    pub hugepages: bool,
    pub queue_depth: usize,
    pub request_bytes: usize,
    /// Bytes in flight per drive (0: unbounded but for the queue depth; pread: unused).
    pub inflight_bytes: usize,
    /// How paths below a store's root are resolved: "openat2" or "walk".
    pub open_path: &'static str,
    pub notes: Vec<String>,
}

enum Driver {
    Uring(UringDriver),
    Pread(PreadPool),
}

impl Driver {
    fn submit(&self, op: Arc<OpState>) -> Result<()> {
        match self {
            Driver::Uring(d) => d.submit(op),
            Driver::Pread(p) => p.submit(op),
        }
    }
}

pub struct Engine {
    arena: Arc<Arena>,
    driver: Mutex<Option<Driver>>,
    /// Set by an I/O thread that cannot go on (see `Error::Broken`).
    health: Arc<Health>,
    features: Features,
    /// The I/O threads live in this process only; a forked child must not use them.
    pid: u32,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("arena", &self.arena)
            .field("features", &self.features)
            .finish()
    }
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Result<Engine> {
        cfg.validate()?;
        let arena = Arena::new(cfg.window, cfg.slot_bytes)?;
        let mut notes = arena.features.notes.clone();
        let health = Arc::new(Health::default());
        let uring = |register: bool| {
            UringDriver::start(
                UringConfig {
                    queue_depth: cfg.queue_depth as u32,
                    request_bytes: cfg.request_bytes as u64,
                    inflight_bytes: cfg.inflight_bytes as u64,
                    register,
                },
                Arc::clone(&arena),
                Arc::clone(&health),
            )
        };
        let pread = || {
            PreadPool::start(
                cfg.queue_depth.min(8),
                cfg.request_bytes as u64,
                Arc::clone(&health),
            )
        };
        let unavailable =
            |backend: &'static str, (errno, reason): (i32, String)| Error::BackendUnavailable {
                backend,
                errno,
                reason,
            };
        let driver = match cfg.backend {
            BackendChoice::Pread => Driver::Pread(pread()?),
            BackendChoice::Uring => {
                Driver::Uring(uring(true).map_err(|e| unavailable("io_uring", e))?)
            }
            BackendChoice::UringPlain => {
                Driver::Uring(uring(false).map_err(|e| unavailable("io_uring_plain", e))?)
            }
            BackendChoice::Auto => match uring(true) {
                Ok(d) => Driver::Uring(d),
                Err((errno, reason)) => {
                    notes.push(format!(
                        "io_uring unavailable ({reason}: {}): pread pool",
                        describe_errno(errno)
                    ));
                    Driver::Pread(pread()?)
                }
            },
        };
        let (backend, fixed_buffers, registered_files, registered_memory) = match &driver {
            Driver::Uring(d) => {
                notes.extend(d.info.notes.iter().cloned());
                let i = &d.info;
                (
                    "io_uring",
                    i.fixed_buffers,
                    i.registered_files,
                    i.memory_entries > 0,
                )
            }
            Driver::Pread(_) => ("pread", false, false, false),
        };
        let (open_path, refused) = crate::file::open_path_probe();
        if open_path == crate::file::OpenPath::Walk {
            notes.push(format!(
                "openat2 refused ({}): store paths resolved one directory at a time, no link followed",
                describe_errno(refused)
            ));
        }
        let features = Features {
            open_path: open_path.name(),
            backend,
            fixed_buffers,
            registered_files,
            registered_memory,
            mlock: arena.features.mlock,
            hugepages: arena.features.hugepages,
            queue_depth: cfg.queue_depth,
            request_bytes: cfg.request_bytes,
            inflight_bytes: match backend {
                "io_uring" => cfg.inflight_bytes,
                _ => 0,
            },
            notes,
        };
        Ok(Engine {
            arena,
            driver: Mutex::new(Some(driver)),
            health,
            features,
            pid: std::process::id(),
        })
    }

    fn driver(&self) -> MutexGuard<'_, Option<Driver>> {
        self.driver.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn features(&self) -> &Features {
        &self.features
    }

    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    pub fn is_closed(&self) -> bool {
        self.driver().is_none()
    }

    /// Why the engine broke (an I/O thread's unretryable error or panic), if it did.
    pub fn broken(&self) -> Option<Error> {
        self.health.check().err()
    }

    fn check_open(&self) -> Result<()> {
        if std::process::id() != self.pid {
            return Err(Error::invalid(format!(
                "this engine was created in process {} and its I/O threads did not survive \
                 fork; create a new Engine in process {}",
                self.pid,
                std::process::id()
            )));
        }
        if self.is_closed() {
            return Err(Error::Closed("engine"));
        }
        self.health.check()
    }

    pub fn open(&self, path: &str, opts: OpenOptions) -> Result<Arc<EngineFile>> {
        self.open_in(None, path, opts)
    }

    /// `open`; with `root` (a store's directory) the path must lie under it and no
    /// component below it may be a link (`EngineFile::open_in`).
    pub fn open_in(
        &self,
        root: Option<&str>,
        path: &str,
        opts: OpenOptions,
    ) -> Result<Arc<EngineFile>> {
        self.check_open()?;
        // Registration in the io_uring file table happens on the I/O thread, at the
        // file's first operation, so opening never waits for the ring.
        Ok(Arc::new(EngineFile::open_in(root, path, opts)?))
    }

    /// A free slot for the caller to fill (save path).
    pub fn lease(&self) -> Result<Arc<SlotLease>> {
        self.check_open()?;
        Ok(Arc::new(self.arena.try_lease()?))
    }

    fn submit(&self, op: Arc<OpState>) -> Result<Pending> {
        let pending = Pending::new(Arc::clone(&op));
        let guard = self.driver();
        let Some(driver) = guard.as_ref() else {
            op.fail_now(Error::Closed("engine"));
            return Err(Error::Closed("engine"));
        };
        driver.submit(op)?;
        Ok(pending)
    }

    /// Read exactly `length` bytes at `offset` into a free slot.
    pub fn submit_read(&self, file: &Arc<EngineFile>, offset: u64, length: u64) -> Result<Pending> {
        self.check_open()?;
        file.check_open()?;
        let capacity = self.arena.slot_bytes() as u64;
        let extent = checked_extent(file, offset, length, capacity, "slot_bytes")?;
        let lease = Arc::new(self.arena.try_lease()?);
        let op = OpState::new(
            OpKind::Read,
            Arc::clone(file),
            offset,
            length,
            extent,
            lease,
        );
        self.submit(op)
    }

    /// Read the file from `offset` straight into the caller's memory: `pieces` are
    /// (address, length) in file order, contiguous in the file. Each address must meet
    /// the file's O_DIRECT memory alignment and each length its offset alignment
    /// (`Error::Alignment` otherwise: use a slot). No slot is taken. `inflight_cap`:
    /// at most this many of its bytes in the kernel at once (0: only the engine's
    /// bounds), so that its requests land one after another and a hash that follows
    /// them (`landing`) ends soon after the last: for the read nothing comes after.
    ///
    /// # Safety
    /// Every piece must be writable memory that stays valid, and that nothing else reads
    /// or writes, until the kernel has given it back (`memory_returned`: the op ended,
    /// and not with `Error::KernelOwned`); after `Error::KernelOwned` (the engine broke
    /// down with the read in the kernel's hands) it stays the kernel's for good. The
    /// kernel writes it in the meantime. Dropping the `Pending` does not end the
    /// operation.
    pub unsafe fn submit_read_into(
        &self,
        file: &Arc<EngineFile>,
        offset: u64,
        pieces: &[(usize, u64)],
        inflight_cap: u64,
    ) -> Result<Pending> {
        self.check_open()?;
        file.check_open()?;
        let (mem, align) = (file.mem_alignment().max(1), file.alignment());
        if !is_aligned(offset, align) {
            return Err(Error::Alignment(format!(
                "offset {offset} is not a multiple of {align}, the O_DIRECT alignment of {}",
                file.path()
            )));
        }
        if pieces.is_empty() {
            return Err(Error::invalid(
                "a direct read needs at least one piece of memory",
            ));
        }
        let mut segments = Vec::with_capacity(pieces.len());
        let mut start = 0u64;
        for (i, &(addr, len)) in pieces.iter().enumerate() {
            if len == 0 {
                return Err(Error::invalid(format!(
                    "piece {i} of the direct read is empty"
                )));
            }
            if !is_aligned(addr as u64, mem) || !is_aligned(len, align) {
                return Err(Error::Alignment(format!(
                    "piece {i} ({len} bytes at {addr:#x}) is not aligned for O_DIRECT on {} \
                     (memory to {mem}, length to {align} bytes): read it through a slot",
                    file.path()
                )));
            }
            segments.push(Segment { start, addr, len });
            start += len;
        }
        self.submit(OpState::direct_read_capped(
            Arc::clone(file),
            offset,
            segments,
            inflight_cap,
        ))
    }

    /// Register caller memory, `regions` of (address, length), with the I/O ring, so
    /// that direct reads into it (`submit_read_into`) skip pinning its pages per
    /// request. Where the backend cannot (the pread pool, a kernel without sparse buffer
    /// tables) the registration holds nothing and reads work as before.
    ///
    /// The I/O thread registers between its waits: `timeout` bounds the wait for it
    /// (`Error::Timeout` past it, with nothing registered, then or later: a hung
    /// request must not hang the caller, nor pin memory the caller has since freed).
    /// Other callers' operations are queued meanwhile, not held back behind the wait.
    ///
    /// # Safety
    /// Every region must stay mapped, at the same pages (not unmapped, remapped or
    /// discarded), until this returns an error or the registration it returns is
    /// dropped: the kernel pins the pages it finds when it registers, and a direct read
    /// lands in them.
    pub unsafe fn register_memory(
        &self,
        regions: &[(usize, u64)],
        timeout: Option<Duration>,
    ) -> Result<MemoryRegistration> {
        self.check_open()?;
        let mut spans = Vec::with_capacity(regions.len());
        for (i, &(addr, len)) in regions.iter().enumerate() {
            let len = usize::try_from(len).unwrap_or(0);
            if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
                return Err(Error::invalid(format!(
                    "region {i} to register is empty or outside the address space"
                )));
            }
            spans.push((addr, len));
        }
        // Handed over under the driver lock (in order with the operations sent before
        // and after), waited for without it: a registration the I/O thread is slow to
        // take must not hold back other callers' submits past their own deadlines.
        let (request, release) = match self.driver().as_ref() {
            Some(Driver::Uring(d)) if d.info.memory_entries > 0 && !spans.is_empty() => {
                (d.request_memory(spans)?, d.memory_release())
            }
            Some(_) => return Ok(MemoryRegistration::default()),
            None => return Err(Error::Closed("engine")),
        };
        Ok(MemoryRegistration {
            indices: request.wait(timeout)?,
            release: Some(release),
        })
    }

    /// Write slot bytes `[0, length)` at `offset`; pad to the alignment with zeros on
    /// O_DIRECT files and trim the file back afterwards.
    pub fn submit_write(
        &self,
        slot: &Arc<SlotLease>,
        file: &Arc<EngineFile>,
        offset: u64,
        length: Option<u64>,
    ) -> Result<Pending> {
        self.check_open()?;
        file.check_open()?;
        if !Arc::ptr_eq(slot.arena(), &self.arena) {
            return Err(Error::invalid("the slot belongs to another engine"));
        }
        slot.check_live()?;
        if !file.writable() {
            return Err(Error::invalid(format!(
                "{} was opened read-only; open it with write=True",
                file.path()
            )));
        }
        let capacity = slot.capacity() as u64;
        let length = length.unwrap_or(slot.len() as u64);
        let extent = checked_extent(file, offset, length, capacity, "the slot capacity")?;
        if extent > length {
            fill_tail_block(slot, file, offset, length, extent)?;
        }
        file.extend_to(offset + length);
        slot.write_started();
        let op = OpState::new(
            OpKind::Write,
            Arc::clone(file),
            offset,
            length,
            extent,
            Arc::clone(slot),
        );
        self.submit(op)
    }

    /// Publish a record from `slot` in one call (publish.rs): created, written, made
    /// durable and renamed into place within `timeout`, or nothing published.
    pub fn publish(
        &self,
        slot: &Arc<SlotLease>,
        spec: crate::publish::Spec,
        timeout: Option<Duration>,
    ) -> Result<crate::publish::Published> {
        self.check_open()?;
        if !Arc::ptr_eq(slot.arena(), &self.arena) {
            return Err(Error::invalid("the slot belongs to another engine"));
        }
        crate::publish::publish(slot, spec, timeout)
    }

    /// fdatasync `file` on the I/O thread: the caller waits on the `Pending` with a
    /// deadline, so a stalled device holds the I/O thread's call, never the caller.
    pub fn submit_sync(&self, file: &Arc<EngineFile>) -> Result<Pending> {
        self.check_open()?;
        file.check_open()?;
        self.submit(OpState::sync(Arc::clone(file)))
    }

    /// Start recording each request's timings on the I/O thread (io_uring only), at
    /// most `max_events`; see backend/trace.rs.
    pub fn trace_start(&self, max_events: usize) -> Result<()> {
        self.check_open()?;
        match self.driver().as_ref() {
            Some(Driver::Uring(d)) => d.trace_start(max_events),
            Some(Driver::Pread(_)) => Err(Error::invalid(
                "request tracing needs the io_uring backend; this engine runs the pread pool",
            )),
            None => Err(Error::Closed("engine")),
        }
    }

    /// Stop tracing and return what was recorded (completions in reap order). The wait
    /// for the I/O thread holds no lock, so other submissions go on meanwhile.
    pub fn trace_take(&self) -> Result<Vec<TraceEvent>> {
        self.check_open()?;
        let request = match self.driver().as_ref() {
            Some(Driver::Uring(d)) => d.trace_take()?,
            Some(Driver::Pread(_)) => return Ok(Vec::new()),
            None => return Err(Error::Closed("engine")),
        };
        request.wait(TRACE_WAIT)
    }

    /// Stop accepting I/O; waits for what is in flight. Slots stay valid until their
    /// leases drop.
    pub fn close(&self) {
        let driver = self.driver().take();
        if std::process::id() != self.pid {
            // A forked child has a copy of the handles but not the threads: joining
            // them would hang. Leave them to the parent.
            std::mem::forget(driver);
            return;
        }
        match driver {
            Some(Driver::Uring(mut d)) => d.shutdown(),
            Some(Driver::Pread(mut p)) => p.shutdown(),
            None => {}
        }
    }

    /// Fault double for tests: make the I/O thread fail (io_uring: `fault`; the pread
    /// pool: a worker panic, whatever `fault` says).
    #[cfg(test)]
    fn inject(&self, fault: crate::backend::uring::Fault) {
        match self.driver().as_ref() {
            Some(Driver::Uring(d)) => d.inject(fault),
            Some(Driver::Pread(p)) => p.inject_panic(),
            None => {}
        }
    }
}

/// O_DIRECT writes whole blocks. Fill the slot's padding `[length, extent)` with what
/// the file holds there (zeros past its end), so the padded write never clobbers bytes
/// the caller did not ask to write.
fn fill_tail_block(
    slot: &SlotLease,
    file: &EngineFile,
    offset: u64,
    length: u64,
    extent: u64,
) -> Result<()> {
    slot.zero(length as usize, extent as usize)?;
    let tail_start = offset + length;
    if tail_start >= file.size() {
        return Ok(());
    }
    let align = file.alignment() as usize;
    let block_start = tail_start - tail_start % align as u64;
    let block = AlignedBlock::new(align.max(file.mem_alignment() as usize))?;
    let mut got = 0usize;
    while got < align {
        // SAFETY: `block` is our own allocation of at least `align` bytes, aligned for
        // O_DIRECT; the kernel writes `align - got` bytes at its offset `got`.
        let rc = unsafe {
            libc::pread(
                file.fd(),
                block.ptr.add(got).cast(),
                align - got,
                (block_start + got as u64) as libc::off_t,
            )
        };
        match rc {
            0 => break,
            n if n > 0 => got += n as usize,
            _ if crate::error::last_errno() == libc::EINTR => {}
            _ => return Err(Error::last_os("read tail block", Some(file.path()))),
        }
        if !is_aligned(got as u64, align as u64) {
            break;
        }
    }
    // Bytes of the block after the caller's end, up to what the file holds.
    let from = (tail_start - block_start) as usize;
    let to = got.min(align);
    if to > from {
        // SAFETY: `from..to` lies inside `block`, which we own and the read filled.
        let old = unsafe { std::slice::from_raw_parts(block.ptr.add(from), to - from) };
        slot.copy_in(length as usize, old)?;
    }
    Ok(())
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}

/// The bytes an operation of `length` at `offset` moves on `file`: `length` rounded up
/// to the file's O_DIRECT alignment. Both must fit in `capacity` (`what` names it).
fn checked_extent(
    file: &EngineFile,
    offset: u64,
    length: u64,
    capacity: u64,
    what: &str,
) -> Result<u64> {
    if length == 0 {
        return Err(Error::invalid("length must be positive, got 0"));
    }
    if length > capacity {
        return Err(Error::invalid(format!(
            "length {length} exceeds {what} {capacity}"
        )));
    }
    let align = file.alignment();
    if !is_aligned(offset, align) {
        return Err(Error::Alignment(format!(
            "offset {offset} is not a multiple of {align}, the O_DIRECT alignment of {}",
            file.path()
        )));
    }
    let extent = round_up(length, align);
    if extent > capacity {
        return Err(Error::Alignment(format!(
            "length {length} rounded up to the alignment {align} exceeds {what} {capacity}"
        )));
    }
    Ok(extent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn backends() -> Vec<BackendChoice> {
        let mut v = vec![BackendChoice::Pread];
        // Skip, not fail, where the kernel refuses io_uring.
        if Engine::new(EngineConfig {
            backend: BackendChoice::Uring,
            ..EngineConfig::new(1, 4096)
        })
        .is_ok()
        {
            v.push(BackendChoice::Uring);
            v.push(BackendChoice::UringPlain);
        }
        v
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[test]
    fn sync_runs_on_the_io_thread_on_every_backend() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, pattern(8192)).unwrap();
        let path = path.to_str().unwrap();
        for b in backends() {
            let e = Engine::new(EngineConfig {
                backend: b,
                ..EngineConfig::new(1, 8192)
            })
            .unwrap();
            let write = OpenOptions {
                write: true,
                ..Default::default()
            };
            let f = e.open(path, write).unwrap();
            let op = e.submit_sync(&f).unwrap();
            assert_eq!(
                op.wait(Some(std::time::Duration::from_secs(10))),
                Ok(0),
                "{b:?}"
            );
            // A descriptor fdatasync refuses (a FIFO: EINVAL) fails the op, naming it.
            let fifo = dir.path().join(format!("fifo-{b:?}"));
            let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
            // SAFETY: a NUL-terminated path we own.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            let special = OpenOptions {
                special: true,
                ..Default::default()
            };
            let p = e.open(fifo.to_str().unwrap(), special).unwrap();
            let err = e.submit_sync(&p).unwrap().wait(None).unwrap_err();
            assert_eq!(err.errno(), Some(libc::EINVAL), "{b:?}: {err}");
            assert!(err.to_string().starts_with("fdatasync failed"), "{err}");
        }
    }

    #[test]
    fn read_tail_and_short_on_every_backend() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let data = pattern(3 * 65536 + 1234);
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        let path = path.to_str().unwrap();
        for b in backends() {
            let e = Engine::new(EngineConfig {
                backend: b,
                request_bytes: 65536,
                queue_depth: 4,
                ..EngineConfig::new(2, 4 * 65536)
            })
            .unwrap();
            let f = e
                .open(
                    path,
                    OpenOptions {
                        direct: true,
                        ..Default::default()
                    },
                )
                .unwrap();
            // Whole file, unaligned tail included.
            let op = e.submit_read(&f, 0, data.len() as u64).unwrap();
            assert_eq!(op.wait(None).unwrap(), data.len() as u64, "{b:?}");
            let lease = op.take_lease().unwrap();
            // SAFETY: the read completed; nothing else writes this slot.
            assert_eq!(unsafe { lease.bytes(0, data.len()) }.unwrap(), &data[..]);
            assert_eq!(e.arena().live_bytes(), e.arena().slot_bytes());
            drop(lease);
            assert_eq!(e.arena().live_bytes(), 0);
            // Past the end: short.
            let op = e.submit_read(&f, 65536, 4 * 65536).unwrap();
            match op.wait(None) {
                Err(Error::ShortRead { got, .. }) => assert_eq!(got, data.len() as u64 - 65536),
                other => panic!("{b:?}: expected a short read, got {other:?}"),
            }
            drop(op);
            assert_eq!(e.arena().free_slots(), 2);
            if f.direct() {
                assert!(matches!(
                    e.submit_read(&f, 100, 10),
                    Err(Error::Alignment(_))
                ));
            }
            e.close();
            assert!(matches!(
                e.submit_read(&f, 0, 10),
                Err(Error::Closed("engine"))
            ));
        }
    }

    #[test]
    fn write_pads_and_trims() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let path = path.to_str().unwrap();
        for b in backends() {
            let _ = std::fs::remove_file(path);
            let e = Engine::new(EngineConfig {
                backend: b,
                ..EngineConfig::new(2, 1 << 20)
            })
            .unwrap();
            let f = e
                .open(
                    path,
                    OpenOptions {
                        create: true,
                        direct: true,
                        ..Default::default()
                    },
                )
                .unwrap();
            let data = pattern(300_001);
            let slot = e.lease().unwrap();
            slot.copy_in(0, &data).unwrap();
            let op = e
                .submit_write(&slot, &f, 0, Some(data.len() as u64))
                .unwrap();
            assert_eq!(op.wait(None).unwrap(), data.len() as u64);
            assert_eq!(std::fs::read(path).unwrap(), data, "{b:?}");
            assert_eq!(f.size(), data.len() as u64);
        }
    }

    #[test]
    fn dropped_handle_frees_slot_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, pattern(1 << 20)).unwrap();
        let path = path.to_str().unwrap();
        for b in backends() {
            let e = Engine::new(EngineConfig {
                backend: b,
                ..EngineConfig::new(2, 64 << 10)
            })
            .unwrap();
            let f = e
                .open(
                    path,
                    OpenOptions {
                        direct: true,
                        ..Default::default()
                    },
                )
                .unwrap();
            // Wait, drop, resubmit at once: the slot must be free the moment the
            // handle is gone, whatever the I/O thread still holds.
            let mut ops = std::collections::VecDeque::new();
            for i in 0..400u64 {
                if ops.len() == 2 {
                    let op: Pending = ops.pop_front().unwrap();
                    op.wait(None).unwrap();
                }
                ops.push_back(e.submit_read(&f, (i % 16) * (64 << 10), 64 << 10).unwrap());
            }
            // Dropped before completion: freed when the read completes.
            drop(ops);
            e.close();
            assert_eq!(e.arena().free_slots(), 2, "{b:?}");
        }
    }

    #[test]
    fn registered_file_table_entries_are_reused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, pattern(8192)).unwrap();
        let path = path.to_str().unwrap();
        let Ok(e) = Engine::new(EngineConfig {
            backend: BackendChoice::Uring,
            ..EngineConfig::new(1, 8192)
        }) else {
            return; // io_uring refused here: nothing to check
        };
        if !e.features().registered_files {
            return;
        }
        // More opens than the table has entries: each close must free its entry.
        for _ in 0..1500 {
            let f = e
                .open(
                    path,
                    OpenOptions {
                        direct: true,
                        ..Default::default()
                    },
                )
                .unwrap();
            assert_eq!(f.registered_index(), None);
            e.submit_read(&f, 0, 8192).unwrap().wait(None).unwrap();
            assert!(f.registered_index().is_some());
        }
    }

    #[test]
    fn bytes_in_flight_stay_within_the_drives_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, pattern(1 << 20)).unwrap();
        let path = path.to_str().unwrap();
        let opts = OpenOptions {
            direct: true,
            ..Default::default()
        };
        // Most requests in flight at once over one 1 MiB read of 16 requests of 64 KiB,
        // the queue 16 deep, with this bound on bytes in flight (None: io_uring refused).
        let deepest = |inflight_bytes: usize, request_bytes: usize| {
            let e = Engine::new(EngineConfig {
                backend: BackendChoice::Uring,
                request_bytes,
                queue_depth: 16,
                inflight_bytes,
                ..EngineConfig::new(1, 1 << 20)
            })
            .ok()?;
            let f = e.open(path, opts).unwrap();
            e.trace_start(1000).unwrap();
            let op = e.submit_read(&f, 0, 1 << 20).unwrap();
            assert_eq!(op.wait(None).unwrap(), 1 << 20);
            let lease = op.take_lease().unwrap();
            // SAFETY: the read completed; nothing else writes this slot.
            let got = unsafe { lease.bytes(0, 1 << 20) }.unwrap();
            assert_eq!(got, &pattern(1 << 20)[..]);
            let events = e.trace_take().unwrap();
            assert_eq!(events.len(), (1 << 20) / request_bytes);
            events.iter().map(|ev| ev.depth).max()
        };
        let Some(unbounded) = deepest(0, 64 << 10) else {
            return; // io_uring refused here
        };
        // Control: only the depth bounds them (all 16 pushed before the first reap).
        assert_eq!(unbounded, 16);
        assert_eq!(
            deepest(128 << 10, 64 << 10),
            Some(2),
            "2 x 64 KiB fit 128 KiB"
        );
        // A request longer than the bound still goes, alone, to an idle drive.
        assert_eq!(deepest(64 << 10, 256 << 10), Some(1));
    }

    #[test]
    fn a_direct_read_with_a_cap_keeps_its_bytes_in_flight_under_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let data = pattern(1 << 20);
        std::fs::write(&path, &data).unwrap();
        let path = path.to_str().unwrap();
        let opts = OpenOptions {
            direct: true,
            ..Default::default()
        };
        let block = AlignedBlock::new(1 << 20).unwrap();
        let addr = block.ptr as usize;
        // Most requests in flight at once over one direct read of 1 MiB in 16 requests
        // of 64 KiB, the queue 16 deep and no drive bound, with this cap on the read
        // (None: io_uring refused); and its bytes, which must be the file's either way.
        let deepest = |cap: u64| {
            let e = Engine::new(EngineConfig {
                backend: BackendChoice::Uring,
                request_bytes: 64 << 10,
                queue_depth: 16,
                inflight_bytes: 0,
                ..EngineConfig::new(1, 4096)
            })
            .ok()?;
            let f = e.open(path, opts).unwrap();
            e.trace_start(1000).unwrap();
            // SAFETY: `block` is ours, alive and untouched until after the wait.
            let op = unsafe { e.submit_read_into(&f, 0, &[(addr, 1 << 20)], cap) }.unwrap();
            assert_eq!(op.wait(None).unwrap(), 1 << 20);
            // SAFETY: the read ended; the block is ours.
            let got = unsafe { std::slice::from_raw_parts(block.ptr, 1 << 20) };
            assert!(got == &data[..], "cap {cap}: the file's bytes");
            let events = e.trace_take().unwrap();
            assert_eq!(events.len(), 16);
            events.iter().map(|ev| ev.depth).max()
        };
        let Some(uncapped) = deepest(0) else {
            return; // io_uring refused here
        };
        // Control: without a cap every request is pushed before the first reap.
        assert_eq!(uncapped, 16);
        assert_eq!(deepest(192 << 10), Some(3), "3 x 64 KiB fit 192 KiB");
        // A cap below one request still lets one go at a time.
        assert_eq!(deepest(4096), Some(1));
    }

    #[test]
    fn a_trace_records_every_request_of_a_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, pattern(1 << 20)).unwrap();
        let path = path.to_str().unwrap();
        let Ok(e) = Engine::new(EngineConfig {
            backend: BackendChoice::Uring,
            request_bytes: 64 << 10,
            queue_depth: 4,
            ..EngineConfig::new(2, 512 << 10)
        }) else {
            return; // io_uring refused here
        };
        let opts = OpenOptions {
            direct: true,
            ..Default::default()
        };
        let f = e.open(path, opts).unwrap();
        // Control: no trace running, nothing recorded.
        e.submit_read(&f, 0, 512 << 10).unwrap().wait(None).unwrap();
        assert!(e.trace_take().unwrap().is_empty());
        e.trace_start(1000).unwrap();
        let ops: Vec<_> = [0u64, 512 << 10]
            .iter()
            .map(|&off| e.submit_read(&f, off, 512 << 10).unwrap())
            .collect();
        ops.iter().for_each(|op| assert!(op.wait(None).is_ok()));
        let events = e.trace_take().unwrap();
        assert_eq!(events.len(), 16, "8 requests of 64 KiB per 512 KiB read");
        let mut offsets: Vec<u64> = events.iter().map(|ev| ev.offset).collect();
        offsets.sort_unstable();
        assert_eq!(offsets, (0..16).map(|i| i * (64 << 10)).collect::<Vec<_>>());
        for ev in &events {
            assert!(ev.queued_ns <= ev.submit_ns && ev.submit_ns <= ev.complete_ns);
            assert!((1..=4).contains(&ev.depth), "{ev:?}");
        }
        assert!(
            events.iter().any(|ev| ev.waiting > 0),
            "16 requests, depth 4"
        );
        assert!(e.trace_take().unwrap().is_empty(), "taking stops the trace");
        if let Ok(p) = Engine::new(EngineConfig {
            backend: BackendChoice::Pread,
            ..EngineConfig::new(1, 4096)
        }) {
            assert!(matches!(p.trace_start(10), Err(Error::InvalidArgument(_))));
        }
    }

    /// A 1 MiB file of `pattern` bytes (the directory, its path, the bytes) and, per
    /// backend, an engine of `window` 4 KiB slots making 64 KiB requests.
    fn direct_setup(
        window: usize,
    ) -> (
        tempfile::TempDir,
        String,
        Vec<u8>,
        Vec<(BackendChoice, Engine)>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let data = pattern(1 << 20);
        std::fs::write(&path, &data).unwrap();
        let engines = backends()
            .into_iter()
            .map(|b| {
                let cfg = EngineConfig {
                    backend: b,
                    request_bytes: 64 << 10,
                    queue_depth: 4,
                    ..EngineConfig::new(window, 4096)
                };
                (b, Engine::new(cfg).unwrap())
            })
            .collect();
        let path = path.to_str().unwrap().to_owned();
        (dir, path, data, engines)
    }

    #[test]
    fn a_direct_read_fills_the_callers_memory_and_refuses_misalignment() {
        let (_dir, path, data, engines) = direct_setup(1);
        let path = path.as_str();
        for (b, e) in engines {
            let opts = OpenOptions {
                direct: true,
                ..Default::default()
            };
            let f = e.open(path, opts).unwrap();
            // Two pieces of our own aligned memory, 3 pages apart in the file's order.
            let a = AlignedBlock::new(256 << 10).unwrap();
            let b2 = AlignedBlock::new(128 << 10).unwrap();
            let pieces = [(a.ptr as usize, 256 << 10), (b2.ptr as usize, 128 << 10)];
            // SAFETY: both blocks are ours, alive until after the wait below, untouched.
            let op = unsafe { e.submit_read_into(&f, 12288, &pieces, 0) }.unwrap();
            assert_eq!(op.wait(None).unwrap(), 384 << 10, "{b:?}");
            // SAFETY: the read ended; the blocks are ours.
            let (ga, gb) = unsafe {
                (
                    std::slice::from_raw_parts(a.ptr, 256 << 10),
                    std::slice::from_raw_parts(b2.ptr, 128 << 10),
                )
            };
            assert_eq!(ga, &data[12288..12288 + (256 << 10)]);
            assert_eq!(gb, &data[12288 + (256 << 10)..12288 + (384 << 10)]);
            assert_eq!(e.arena().free_slots(), 1, "no slot taken");
            assert_eq!(e.arena().peak_bytes(), 0);
            if f.direct() && f.mem_alignment() > 1 {
                // SAFETY: refused before any I/O is issued.
                let bad = unsafe { e.submit_read_into(&f, 0, &[(a.ptr as usize + 1, 4096)], 0) };
                assert!(matches!(bad, Err(Error::Alignment(_))), "{b:?}");
                // SAFETY: as above.
                let bad = unsafe { e.submit_read_into(&f, 0, &[(a.ptr as usize, 100)], 0) };
                assert!(matches!(bad, Err(Error::Alignment(_))), "{b:?}");
            }
            // Past the end: short, as for a slot.
            // SAFETY: `a` is ours and alive until after the wait.
            let op = unsafe { e.submit_read_into(&f, (1 << 20) - 4096, &pieces[..1], 0) }.unwrap();
            assert!(matches!(
                op.wait(None),
                Err(Error::ShortRead { got: 4096, .. })
            ));
        }
    }

    /// Wait (2 s at most) for the ring's buffer-table line for `index` in its fdinfo to
    /// read `want` ("<none>" when empty); the last line seen. The kernel leaves the lines
    /// out while the I/O thread holds the ring's lock, and an unregistration is queued to
    /// that thread: poll.
    fn buffer_entry(e: &Engine, index: usize, want: &str) -> String {
        let fd = match e.driver().as_ref() {
            Some(Driver::Uring(d)) => d.info.ring_fd,
            _ => unreachable!("io_uring only"),
        };
        let prefix = format!("{index:5}: ");
        let mut seen = String::from("(no line)");
        for _ in 0..1000 {
            let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
            if let Some(line) = info.lines().find_map(|l| l.strip_prefix(&prefix)) {
                seen = line.to_owned();
                if seen == want {
                    break;
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        seen
    }

    /// A uring engine and a FIFO nobody writes yet (a hung device), opened in it, with
    /// the writer that releases it. None where the kernel refuses io_uring.
    fn hung_source(
        dir: &std::path::Path,
        window: usize,
        queue_depth: usize,
    ) -> Option<(Engine, Arc<EngineFile>, std::fs::File)> {
        let e = Engine::new(EngineConfig {
            backend: BackendChoice::Uring,
            queue_depth,
            ..EngineConfig::new(window, 4096)
        })
        .ok()?;
        let fifo = dir.join("stall");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path we own.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let special = OpenOptions {
            special: true,
            ..Default::default()
        };
        let src = e.open(fifo.to_str().unwrap(), special).unwrap();
        let writer = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&fifo)
            .unwrap();
        Some((e, src, writer))
    }

    /// `hung_source` (W=4, depth 32) beside a healthy 8 KiB file opened in the same
    /// engine; the temporary directory holds both.
    #[allow(clippy::type_complexity)]
    fn hung_and_healthy() -> Option<(
        tempfile::TempDir,
        Engine,
        Arc<EngineFile>,
        std::fs::File,
        Arc<EngineFile>,
    )> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, pattern(8192)).unwrap();
        let (e, src, writer) = hung_source(dir.path(), 4, 32)?;
        let f = e
            .open(path.to_str().unwrap(), OpenOptions::default())
            .unwrap();
        Some((dir, e, src, writer, f))
    }

    #[test]
    fn a_read_behind_a_hung_read_is_not_held_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, pattern(8192)).unwrap();
        // Control first: an I/O thread deaf to wakes holds the second read until the
        // hung one ends (what every engine did before wakes).
        for deaf in [true, false] {
            let sub = dir.path().join(format!("deaf-{deaf}"));
            std::fs::create_dir(&sub).unwrap();
            let Some((e, src, writer)) = hung_source(&sub, 4, 32) else {
                return; // the kernel refuses io_uring
            };
            if deaf {
                e.inject(crate::backend::uring::Fault::Deaf);
            }
            let stuck = e.submit_read(&src, 0, 4096).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            let f = e
                .open(path.to_str().unwrap(), OpenOptions::default())
                .unwrap();
            let t0 = std::time::Instant::now();
            let quick = e.submit_read(&f, 0, 4096).unwrap();
            let got = quick.wait(Some(Duration::from_secs(if deaf { 1 } else { 10 })));
            // Where each op is, as a timed-out wait reports it.
            let hung = stuck.whereabouts();
            assert!(hung.contains("in the kernel for"), "{hung}");
            if deaf {
                assert!(matches!(got, Err(Error::Timeout)), "deaf: {got:?}");
                let held = quick.whereabouts();
                assert!(held.contains("not yet handed to the kernel"), "{held}");
            } else {
                assert_eq!(got, Ok(4096), "{:?}", t0.elapsed());
                assert!(!stuck.is_done(), "the hung read ended on its own");
            }
            std::io::Write::write_all(&mut &writer, &[0u8; 8192]).unwrap();
            assert_eq!(stuck.wait(Some(Duration::from_secs(10))), Ok(4096));
            assert_eq!(quick.wait(Some(Duration::from_secs(10))), Ok(4096));
            let lease = quick.take_lease().unwrap();
            // SAFETY: the read completed; nothing else writes this slot.
            let got = unsafe { lease.bytes(0, 4096) }.unwrap();
            assert_eq!(got, &pattern(8192)[..4096]);
            drop(stuck.take_lease());
        }
    }

    #[test]
    fn a_read_still_queued_is_withdrawn_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, pattern(1 << 16)).unwrap();
        // One place in the queue, held by the hung read: what follows stays queued.
        let Some((e, src, writer)) = hung_source(dir.path(), 4, 1) else {
            return;
        };
        let stuck = e.submit_read(&src, 0, 4096).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let f = e
            .open(path.to_str().unwrap(), OpenOptions::default())
            .unwrap();
        let block = AlignedBlock::new(64 << 10).unwrap();
        // SAFETY: `block` is ours, 64 KiB long.
        unsafe { std::ptr::write_bytes(block.ptr, 0xAB, 64 << 10) };
        // SAFETY: `block` stays mapped, untouched by us, until the end of the test.
        let direct = unsafe { e.submit_read_into(&f, 0, &[(block.ptr as usize, 64 << 10)], 0) };
        let direct = direct.unwrap();
        let slotted = e.submit_read(&f, 0, 4096).unwrap();
        let w = e.open(
            path.to_str().unwrap(),
            OpenOptions {
                write: true,
                ..Default::default()
            },
        );
        let lease = e.lease().unwrap();
        lease.copy_in(0, &pattern(4096)).unwrap();
        let write = e.submit_write(&lease, &w.unwrap(), 0, Some(4096)).unwrap();
        let free = e.arena().free_slots();
        // The kernel's read, and any write, go on; the queued reads end now.
        assert!(!stuck.withdraw() && !write.withdraw());
        assert!(direct.withdraw() && slotted.withdraw());
        assert_eq!(direct.wait(Some(Duration::ZERO)), Err(Error::Withdrawn));
        assert!(direct.memory_returned());
        assert_eq!(slotted.wait(Some(Duration::ZERO)), Err(Error::Withdrawn));
        assert_eq!(
            e.arena().free_slots(),
            free + 1,
            "the slot is back in the ring"
        );
        // Control: a read queued the same way and kept runs once the lane frees.
        let kept = e.submit_read(&f, 4096, 4096).unwrap();
        std::io::Write::write_all(&mut &writer, &[0u8; 8192]).unwrap();
        assert_eq!(stuck.wait(Some(Duration::from_secs(10))), Ok(4096));
        assert_eq!(write.wait(Some(Duration::from_secs(10))), Ok(4096));
        assert_eq!(kept.wait(Some(Duration::from_secs(10))), Ok(4096));
        assert!(!kept.withdraw(), "a read that ran cannot be withdrawn");
        // The withdrawn direct read never ran: its memory holds what it held.
        // SAFETY: the read was withdrawn before the kernel had it; nothing writes `block`.
        let held = unsafe { std::slice::from_raw_parts(block.ptr, 64 << 10) };
        assert!(held.iter().all(|&b| b == 0xAB));
        drop((stuck.take_lease(), kept.take_lease(), lease));
    }

    #[test]
    fn a_registration_behind_a_hung_request_is_taken_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let Some((e, src, writer)) = hung_source(dir.path(), 4, 32) else {
            return;
        };
        if !matches!(e.driver().as_ref(), Some(Driver::Uring(d)) if d.info.memory_entries > 0) {
            return; // no room for caller memory here: nothing is registered
        }
        let stuck = e.submit_read(&src, 0, 4096).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let kept = AlignedBlock::new(64 << 10).unwrap();
        // SAFETY: `kept` stays mapped until after `reg` is dropped.
        let reg = unsafe {
            e.register_memory(
                &[(kept.ptr as usize, 64 << 10)],
                Some(Duration::from_secs(10)),
            )
        }
        .unwrap();
        assert_eq!(reg.entries(), 1);
        assert!(!stuck.is_done(), "the hung read ended on its own");
        std::io::Write::write_all(&mut &writer, &[0u8; 8192]).unwrap();
        assert_eq!(stuck.wait(Some(Duration::from_secs(10))), Ok(4096));
        drop(reg);
    }

    #[test]
    fn a_registration_behind_a_hung_request_times_out_and_never_happens() {
        let dir = tempfile::tempdir().unwrap();
        let Some((e, src, writer)) = hung_source(dir.path(), 2, 32) else {
            return; // the kernel refuses io_uring
        };
        if !matches!(e.driver().as_ref(), Some(Driver::Uring(d)) if d.info.memory_entries > 0) {
            return; // no room for caller memory here: nothing to wait for
        }
        // The I/O thread deaf to wakes (no eventfd) and held by a read of a FIFO nobody
        // writes (a hung device): it takes commands only between completions.
        e.inject(crate::backend::uring::Fault::Deaf);
        let stuck = e.submit_read(&src, 0, 4096).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let given_up = AlignedBlock::new(64 << 10).unwrap();
        let t0 = std::time::Instant::now();
        let wait = Some(Duration::from_millis(200));
        // SAFETY: `given_up` stays mapped to the end (past it a caller may free it).
        let got = unsafe { e.register_memory(&[(given_up.ptr as usize, 64 << 10)], wait) };
        assert!(matches!(got, Err(Error::Timeout)), "{:?}", got.err());
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        std::io::Write::write_all(&mut &writer, &[0u8; 8192]).unwrap();
        assert_eq!(stuck.wait(Some(Duration::from_secs(10))).unwrap(), 4096);
        drop(stuck.take_lease());
        // A read sent after the given-up command ends after the thread handled it: the
        // first caller-memory entry (after the two slots) is still empty.
        let after = e.submit_read(&src, 0, 4096).unwrap();
        assert_eq!(after.wait(Some(Duration::from_secs(10))).unwrap(), 4096);
        drop(after.take_lease());
        assert_eq!(buffer_entry(&e, 2, "<none>"), "<none>");
        // A registration now takes that entry.
        let kept = AlignedBlock::new(64 << 10).unwrap();
        let addr = kept.ptr as usize;
        // SAFETY: `kept` stays mapped until after `reg` is dropped.
        let reg = unsafe { e.register_memory(&[(addr, 64 << 10)], wait) }.unwrap();
        assert_eq!(reg.entries(), 1);
        let want = format!("0x{addr:x}/{}", 64 << 10);
        assert_eq!(buffer_entry(&e, 2, &want), want);
        drop(reg);
    }

    #[test]
    fn a_registration_waiting_for_the_thread_holds_back_no_other_submit() {
        let Some((_dir, e, src, writer, f)) = hung_and_healthy() else {
            return; // the kernel refuses io_uring
        };
        if !matches!(e.driver().as_ref(), Some(Driver::Uring(d)) if d.info.memory_entries > 0) {
            return; // no room for caller memory here: nothing to wait for
        }
        // The I/O thread deaf to wakes and held by a read of a FIFO nobody writes (a
        // stalled device): it takes commands only when that read ends.
        e.inject(crate::backend::uring::Fault::Deaf);
        let stuck = e.submit_read(&src, 0, 4096).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        // Control, nothing registering: a read of the healthy file is queued at once and
        // its own deadline governs it (it is withdrawn there, never sent).
        let control = e.submit_read(&f, 0, 4096).unwrap();
        assert_eq!(control.wait(Some(Duration::ZERO)), Err(Error::Timeout));
        assert!(control.withdraw());
        let block = AlignedBlock::new(64 << 10).unwrap();
        let addr = block.ptr as usize;
        let e = &e;
        std::thread::scope(|s| {
            let (started_tx, started) = std::sync::mpsc::channel();
            let registering = s.spawn(move || {
                started_tx.send(()).unwrap();
                // SAFETY: `block` stays mapped until after the registration is dropped.
                unsafe { e.register_memory(&[(addr, 64 << 10)], Some(Duration::from_secs(30))) }
            });
            started.recv().unwrap();
            // Into its wait.
            std::thread::sleep(Duration::from_millis(100));
            // The same read while the registration waits for the held thread: queued
            // as at once, not after the registration (up to its 30 s) ends.
            let read = e.submit_read(&f, 0, 4096).unwrap();
            let still_waiting = !registering.is_finished();
            assert_eq!(read.wait(Some(Duration::ZERO)), Err(Error::Timeout));
            assert!(read.withdraw());
            let kept = e.submit_read(&f, 4096, 4096).unwrap();
            assert!(
                still_waiting,
                "the submit waited for the registration to end"
            );
            assert!(!registering.is_finished() && !kept.is_done());
            // The stall ends: the thread takes the registration, then the kept read.
            std::io::Write::write_all(&mut &writer, &[0u8; 8192]).unwrap();
            assert_eq!(stuck.wait(Some(Duration::from_secs(10))), Ok(4096));
            assert_eq!(kept.wait(Some(Duration::from_secs(10))), Ok(4096));
            let reg = registering.join().unwrap().unwrap();
            assert_eq!(reg.entries(), 1);
            // Its entry follows the four slots'.
            let want = format!("0x{addr:x}/{}", 64 << 10);
            assert_eq!(buffer_entry(e, 4, &want), want);
            drop((stuck.take_lease(), kept.take_lease(), reg));
        });
    }

    #[test]
    fn a_trace_taken_while_the_thread_is_held_blocks_no_submit() {
        let Some((_dir, e, src, writer, f)) = hung_and_healthy() else {
            return; // the kernel refuses io_uring
        };
        e.trace_start(16).unwrap();
        // The I/O thread held by a read of a FIFO nobody writes: it answers the trace
        // only when that read ends.
        e.inject(crate::backend::uring::Fault::Deaf);
        let stuck = e.submit_read(&src, 0, 4096).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let e = &e;
        std::thread::scope(|s| {
            let taking = s.spawn(move || e.trace_take());
            // Into its wait.
            std::thread::sleep(Duration::from_millis(100));
            // A submit meanwhile is queued at once, not after the trace's wait.
            let t0 = std::time::Instant::now();
            let read = e.submit_read(&f, 0, 4096).unwrap();
            assert!(t0.elapsed() < Duration::from_secs(1), "the submit waited");
            assert!(!taking.is_finished());
            std::io::Write::write_all(&mut &writer, &[0u8; 8192]).unwrap();
            assert_eq!(stuck.wait(Some(Duration::from_secs(10))), Ok(4096));
            assert_eq!(read.wait(Some(Duration::from_secs(10))), Ok(4096));
            assert!(taking.join().unwrap().is_ok());
            drop((stuck.take_lease(), read.take_lease()));
        });
    }

    #[test]
    fn registered_memory_takes_direct_reads_until_dropped() {
        let (_dir, path, data, engines) = direct_setup(2);
        for (b, e) in engines {
            let f = e.open(&path, OpenOptions::default()).unwrap();
            let block = AlignedBlock::new(512 << 10).unwrap();
            let addr = block.ptr as usize;
            // The first 256 KiB only: requests in it read into the registered buffer,
            // the rest (the same op) as plain reads.
            // SAFETY: `block` is ours and stays mapped until after `reg` is dropped.
            let reg = unsafe { e.register_memory(&[(addr, 256 << 10)], None) }.unwrap();
            let table = match e.driver().as_ref() {
                Some(Driver::Uring(d)) => d.info.memory_entries,
                _ => 0,
            };
            assert_eq!(reg.entries(), usize::from(table > 0), "{b:?}");
            if table > 0 {
                // The entry after the two slots holds exactly the region.
                let want = format!("0x{addr:x}/{}", 256 << 10);
                assert_eq!(buffer_entry(&e, 2, &want), want);
            }
            // SAFETY: `block` is ours, alive and untouched until after the wait.
            let op = unsafe { e.submit_read_into(&f, 4096, &[(addr, 512 << 10)], 0) }.unwrap();
            assert_eq!(op.wait(None).unwrap(), 512 << 10, "{b:?}");
            // SAFETY: the read ended; the block is ours.
            let got = unsafe { std::slice::from_raw_parts(block.ptr, 512 << 10) };
            assert!(got == &data[4096..4096 + (512 << 10)], "{b:?}");
            drop(reg);
            if table > 0 {
                let now = buffer_entry(&e, 2, "<none>");
                assert_eq!(now, "<none>", "dropped: the entry is empty");
            }
            // SAFETY: as above; `block` is still ours.
            let op = unsafe { e.submit_read_into(&f, 8192, &[(addr, 256 << 10)], 0) }.unwrap();
            assert_eq!(op.wait(None).unwrap(), 256 << 10, "{b:?}");
            // SAFETY: the read ended.
            let got = unsafe { std::slice::from_raw_parts(block.ptr, 256 << 10) };
            assert!(got == &data[8192..8192 + (256 << 10)], "{b:?}");
            // SAFETY: refused before anything is registered.
            let bad = unsafe { e.register_memory(&[(addr, 0)], None) };
            assert!(matches!(bad, Err(Error::InvalidArgument(_))), "{b:?}");
        }
    }

    #[test]
    fn bad_config() {
        for cfg in [
            EngineConfig::new(0, 4096),
            EngineConfig::new(1, 0),
            EngineConfig {
                queue_depth: 0,
                ..EngineConfig::new(1, 4096)
            },
            EngineConfig {
                request_bytes: 1000,
                ..EngineConfig::new(1, 4096)
            },
        ] {
            assert!(matches!(Engine::new(cfg), Err(Error::InvalidArgument(_))));
        }
        assert!(BackendChoice::parse(Some("nope")).is_err());
    }

    #[test]
    fn a_broken_io_thread_fails_every_op_and_refuses_the_next() {
        use crate::backend::uring::Fault;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, pattern(1 << 20)).unwrap();
        let path = path.to_str().unwrap();
        let faults = [
            Fault::EnterErrno {
                errno: libc::ENOMEM,
                after: 0,
            },
            Fault::Panic,
        ];
        for b in backends() {
            for fault in faults {
                let e = Engine::new(EngineConfig {
                    backend: b,
                    request_bytes: 64 << 10,
                    queue_depth: 2,
                    ..EngineConfig::new(4, 256 << 10)
                })
                .unwrap();
                let opts = OpenOptions {
                    direct: true,
                    ..Default::default()
                };
                let f = e.open(path, opts).unwrap();
                let slot = e.lease().unwrap(); // a leased slot survives the break
                e.inject(fault); // fault double
                let ops: Vec<_> = (0..3)
                    .map(|i| e.submit_read(&f, i * (256 << 10), 256 << 10))
                    .collect();
                let mut errors = Vec::new();
                for op in ops {
                    // A submit after the break is refused; one before it fails on wait.
                    // A pread pool has several workers: one may have taken an op before
                    // another broke the pool, and ends it whole (its bytes are right).
                    match op {
                        Ok(op) => match op.wait(Some(std::time::Duration::from_secs(10))) {
                            Ok(_) if matches!(b, BackendChoice::Pread) => {}
                            Ok(n) => panic!("{b:?} {fault:?}: an op ended ({n} B) after the break"),
                            Err(err) => errors.push(err),
                        },
                        Err(err) => errors.push(err),
                    }
                }
                assert!(!errors.is_empty(), "{b:?} {fault:?}: no op saw the break");
                let expected = match (b, fault) {
                    (BackendChoice::Pread, _) | (_, Fault::Panic) => libc::EIO,
                    _ => libc::ENOMEM,
                };
                for err in &errors {
                    assert!(
                        matches!(err, Error::Broken { errno, .. } if *errno == expected),
                        "{b:?} {fault:?}: {err:?}"
                    );
                }
                assert!(e.broken().is_some(), "{b:?}");
                assert!(matches!(
                    e.submit_read(&f, 0, 4096),
                    Err(Error::Broken { .. })
                ));
                assert!(matches!(e.lease(), Err(Error::Broken { .. })));
                assert!(matches!(
                    e.submit_write(&slot, &f, 0, Some(4096)),
                    Err(Error::Broken { .. })
                ));
                e.close(); // joins a thread that already stopped: returns at once
                assert!(matches!(
                    e.submit_read(&f, 0, 4096),
                    Err(Error::Closed("engine"))
                ));
                drop(slot);
                assert_eq!(e.arena().free_slots(), 4, "{b:?} {fault:?}");
            }
        }
    }
}
