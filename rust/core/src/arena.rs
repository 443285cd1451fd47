//! The staging arena: one anonymous mapping cut into W slots, the free ring, and the
//! exact live/peak accounting of staging bytes (the restoration working set).
//!
//! The mapping is made at once, its pages only at the first lease: a restore that reads
//! every chunk straight into its destination never leases a slot, so its slots never
//! become resident (nor locked, nor pinned by the ring).

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::align::round_up;
use crate::error::{Error, Result};

pub const PAGE: u64 = 4096;
const HUGE_PAGE: usize = 2 << 20;
/// Memory left free beyond the arena, for the rest of the process (the interpreter, the
/// destination's buffers, page tables): an arena that takes the last of it invites the
/// OOM killer as surely as one that does not fit.
pub const HEADROOM: u64 = 128 << 20;

/// Free ring and counters, under one lock so `live` and `peak` are exact.
#[derive(Debug)]
struct Ledger {
    free: VecDeque<usize>,
    live_slots: usize,
    peak_slots: usize,
}

/// What the arena could and could not do when it was set up.
#[derive(Debug, Clone, Default)]
pub struct ArenaFeatures {
    /// The slots can be locked and pinned (CAP_IPC_LOCK, or RLIMIT_MEMLOCK holds them);
    /// done at the first lease.
    pub mlock: bool,
    pub hugepages: bool,
    pub notes: Vec<String>,
}

#[derive(Debug)]
pub struct Arena {
    base: NonNull<u8>,
    map_bytes: usize,
    slot_bytes: usize,
    window: usize,
    ledger: Mutex<Ledger>,
    /// Whether the pages were faulted in (and locked where allowed): at the first lease.
    resident: Mutex<bool>,
    pub features: ArenaFeatures,
}

// SAFETY: the mapping is owned by the Arena and only unmapped in its Drop; slots are
// handed out exclusively through the ledger, so sharing the base pointer is sound.
unsafe impl Send for Arena {}
// SAFETY: as above; all mutable state is behind the ledger's Mutex.
unsafe impl Sync for Arena {}

impl Arena {
    /// Map `window` slots of `slot_bytes` (rounded up to 4096).
    pub fn new(window: usize, slot_bytes: usize) -> Result<Arc<Arena>> {
        if window < 1 {
            return Err(Error::invalid(format!(
                "window must be at least 1, got {window}"
            )));
        }
        if slot_bytes == 0 {
            return Err(Error::invalid("slot_bytes must be positive, got 0"));
        }
        let slot_bytes = round_up(slot_bytes as u64, PAGE) as usize;
        let span = slot_bytes
            .checked_mul(window)
            .ok_or_else(|| Error::invalid("window * slot_bytes overflows"))?;
        // Map whole 2 MiB pages even when the slots end inside one: the kernel then aligns
        // the mapping to 2 MiB and MADV_HUGEPAGE can back it with huge pages. On 4 KiB
        // pages a 1 MiB O_DIRECT request is 256 discontiguous segments, more than a
        // virtio-blk queue takes at once (max_segments 254), so every request is split.
        let map_bytes = round_up(span as u64, HUGE_PAGE as u64) as usize;
        // Refuse before mapping: populating an arena the machine cannot hold would get
        // this process (or a neighbour) OOM-killed instead of an error.
        if let Some((available, source)) = available_memory() {
            check_fits(map_bytes as u64, available, source)?;
        }
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::last_os("mmap staging arena", None));
        }
        let base = NonNull::new(ptr.cast::<u8>()).expect("mmap returned NULL");
        let mut features = ArenaFeatures::default();
        // SAFETY: advice on the mapping we just created and own.
        let rc = unsafe { libc::madvise(ptr, map_bytes, libc::MADV_HUGEPAGE) };
        features.hugepages = rc == 0;
        if rc != 0 {
            features.notes.push("madvise(MADV_HUGEPAGE) refused".into());
        }
        // Pages are faulted in and locked at the first lease (`make_resident`); whether
        // they may be locked (and pinned by the ring) is known now.
        features.mlock = may_lock(map_bytes as u64);
        if !features.mlock {
            features.notes.push(format!(
                "mlock refused ({}): staging pages may be swapped",
                crate::error::describe_errno(libc::ENOMEM)
            ));
        }
        Ok(Arc::new(Arena {
            base,
            map_bytes,
            slot_bytes,
            window,
            ledger: Mutex::new(Ledger {
                free: (0..window).collect(),
                live_slots: 0,
                peak_slots: 0,
            }),
            resident: Mutex::new(false),
            features,
        }))
    }

    /// Fault every page in (after the huge page advice, so faults can use 2 MiB pages)
    /// and lock it where allowed, once, before the first slot is handed out. ENOMEM when
    /// the memory is not there (then nothing is leased; a later lease tries again).
    fn make_resident(&self) -> Result<()> {
        let mut done = self.resident.lock().unwrap_or_else(|p| p.into_inner());
        if *done {
            return Ok(());
        }
        if let Err(errno) = populate(self.base, self.map_bytes) {
            return Err(match (errno, available_memory()) {
                (libc::ENOMEM, Some((available, source))) => Error::NoMemory {
                    asked: self.map_bytes as u64,
                    headroom: 0,
                    available,
                    source,
                },
                _ => Error::os("populate staging arena", None, errno),
            });
        }
        if self.features.mlock {
            // SAFETY: locks pages of our own mapping; a refusal leaves them swappable.
            unsafe { libc::mlock(self.base.as_ptr().cast(), self.map_bytes) };
        }
        *done = true;
        Ok(())
    }

    /// Whether the slots' pages are resident (a slot was leased).
    pub fn is_resident(&self) -> bool {
        *self.resident.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn window(&self) -> usize {
        self.window
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    pub fn base_addr(&self) -> usize {
        self.base.as_ptr() as usize
    }

    pub fn map_bytes(&self) -> usize {
        // The slots' span; the mapping itself runs on to the next 2 MiB boundary.
        self.slot_bytes * self.window
    }

    /// Address of slot `index`.
    pub fn slot_addr(&self, index: usize) -> usize {
        assert!(index < self.window, "slot index {index} out of range");
        self.base_addr() + index * self.slot_bytes
    }

    /// Take a free slot (it counts as live until the lease drops).
    pub fn try_lease(self: &Arc<Self>) -> Result<SlotLease> {
        self.make_resident()?;
        let mut l = self.ledger();
        let index = l.free.pop_front().ok_or(Error::NoFreeSlot {
            window: self.window,
        })?;
        l.live_slots += 1;
        l.peak_slots = l.peak_slots.max(l.live_slots);
        drop(l);
        Ok(SlotLease {
            arena: Arc::clone(self),
            index,
            len: AtomicUsize::new(self.slot_bytes),
            writes_in_flight: AtomicUsize::new(0),
            released: AtomicBool::new(false),
            given_back: AtomicBool::new(false),
        })
    }

    fn release(&self, index: usize) {
        let mut l = self.ledger();
        debug_assert!(!l.free.contains(&index), "slot {index} released twice");
        l.free.push_back(index);
        l.live_slots -= 1;
    }

    pub fn free_slots(&self) -> usize {
        self.ledger().free.len()
    }

    pub fn live_bytes(&self) -> usize {
        self.ledger().live_slots * self.slot_bytes
    }

    pub fn peak_bytes(&self) -> usize {
        self.ledger().peak_slots * self.slot_bytes
    }

    /// Restart the peak from what is live now.
    pub fn reset_peak(&self) {
        let mut l = self.ledger();
        l.peak_slots = l.live_slots;
    }
}

/// Fault every page in now so the first read does not pay for it. MADV_POPULATE_WRITE
/// fails with ENOMEM when the memory is not there, where touching the pages would get
/// the process killed. Ok(false): the kernel (before 5.14) does not know the advice;
/// the pages then fault in at first use (and `mlock`, where allowed, populates them,
/// failing just as cleanly).
fn populate(base: NonNull<u8>, bytes: usize) -> std::result::Result<bool, i32> {
    // SAFETY: populating our own private mapping, writable by construction.
    let rc = unsafe { libc::madvise(base.as_ptr().cast(), bytes, libc::MADV_POPULATE_WRITE) };
    if rc == 0 {
        return Ok(true);
    }
    match crate::error::last_errno() {
        libc::EINVAL => Ok(false),
        errno => Err(errno),
    }
}

/// Whether `bytes` more may be locked (and pinned by io_uring, which counts against the
/// same limit): CAP_IPC_LOCK, or an RLIMIT_MEMLOCK that holds them.
fn may_lock(bytes: u64) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap_ipc_lock = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0); // CAP_IPC_LOCK is capability 14
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we own.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } == 0;
    cap_ipc_lock || (ok && (lim.rlim_cur == libc::RLIM_INFINITY || lim.rlim_cur >= bytes))
}

/// Refuse an arena of `asked` bytes that would leave less than `HEADROOM` of `available`.
fn check_fits(asked: u64, available: u64, source: &'static str) -> Result<()> {
    if asked.saturating_add(HEADROOM) > available {
        return Err(Error::NoMemory {
            asked,
            headroom: HEADROOM,
            available,
            source,
        });
    }
    Ok(())
}

/// Memory this process can still get, and where the figure comes from: MemAvailable,
/// lowered to what the process's memory cgroup has left where that is less. `None`
/// where neither can be read (the check is then skipped; populating still fails clean).
pub fn available_memory() -> Option<(u64, &'static str)> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let host = (
        meminfo_available(&meminfo)?,
        "MemAvailable in /proc/meminfo",
    );
    Some(match cgroup_room() {
        Some(room) if room < host.0 => (room, "what the memory cgroup's limit leaves"),
        _ => host,
    })
}

/// MemAvailable from /proc/meminfo text, in bytes.
fn meminfo_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then_some(kib * 1024)
}

/// Bytes the cgroup (v2, else v1, as mounted in this namespace) can still charge: its
/// limit less its usage, counting inactive page cache as free (the kernel reclaims it
/// first). `None` without a limit.
fn cgroup_room() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let (limit, usage, stat, inactive) = if let Some(max) = read("/sys/fs/cgroup/memory.max") {
        let usage = read("/sys/fs/cgroup/memory.current")?;
        (
            max,
            usage,
            read("/sys/fs/cgroup/memory.stat"),
            "inactive_file",
        )
    } else {
        let limit = read("/sys/fs/cgroup/memory/memory.limit_in_bytes")?;
        let usage = read("/sys/fs/cgroup/memory/memory.usage_in_bytes")?;
        let stat = read("/sys/fs/cgroup/memory/memory.stat");
        (limit, usage, stat, "total_inactive_file")
    };
    cgroup_room_from(&limit, &usage, stat.as_deref(), inactive)
}

fn cgroup_room_from(limit: &str, usage: &str, stat: Option<&str>, inactive: &str) -> Option<u64> {
    // "max" (v2) or a near-u64::MAX page-rounded value (v1): no limit.
    let limit: u64 = limit.trim().parse().ok().filter(|&l| l < 1 << 60)?;
    let usage: u64 = usage.trim().parse().ok()?;
    let reclaimable = stat
        .and_then(|s| {
            s.lines()
                .filter_map(|l| l.split_once(' '))
                .find(|(k, _)| *k == inactive)
                .and_then(|(_, v)| v.trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(reclaimable)))
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: the last Arc is gone, so no lease, slot view or in-flight request
        // (each of which holds an Arc) can still point into the mapping.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.map_bytes) };
    }
}

/// Exclusive use of one slot; returns it to the free ring on `release()`, or when the
/// last share is dropped (the fallback, never the plan: a kept traceback must not be
/// able to starve the ring). In-flight operations and Python `Slot` objects share it
/// through an `Arc`. A released lease keeps the arena mapped (it holds the `Arc`), so a
/// stale pointer into it stays valid memory, but every access through it is refused.
#[derive(Debug)]
pub struct SlotLease {
    arena: Arc<Arena>,
    index: usize,
    len: AtomicUsize,
    /// Writes from this slot not yet completed: the slot must not change meanwhile.
    writes_in_flight: AtomicUsize,
    /// Given back to the ring by `release()`; Drop must not give it back twice.
    released: AtomicBool,
    /// Given up by its holder while a write from it was in flight (`release_after_writes`):
    /// the last write to end gives it back to the ring.
    given_back: AtomicBool,
}

impl SlotLease {
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    pub fn capacity(&self) -> usize {
        self.arena.slot_bytes
    }

    pub fn addr(&self) -> usize {
        self.arena.slot_addr(self.index)
    }

    /// Valid bytes.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A write from this slot was submitted.
    pub fn write_started(&self) {
        self.writes_in_flight.fetch_add(1, Ordering::AcqRel);
    }

    /// A write from this slot completed. The last one of a slot given back meanwhile
    /// (`release_after_writes`) returns it to the ring.
    pub fn write_ended(&self) {
        // SeqCst here and in `release_after_writes`: of the last write's end and the
        // holder's give-back, whichever comes second sees the other and releases.
        if self.writes_in_flight.fetch_sub(1, Ordering::SeqCst) == 1
            && self.given_back.load(Ordering::SeqCst)
        {
            let _ = self.release(); // refused only if a new write started: it ends later
        }
    }

    /// Whether a write from this slot is in flight (the kernel may be reading it).
    pub fn write_in_flight(&self) -> bool {
        self.writes_in_flight.load(Ordering::Acquire) > 0
    }

    /// Given back by its holder: in the ring already, or once its writes end.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire) || self.given_back.load(Ordering::Acquire)
    }

    /// Give the slot back to the free ring now. Refused while a write from it is in
    /// flight (the operation owns it until it completes). Idempotent.
    pub fn release(&self) -> Result<()> {
        self.check_no_write()?;
        if !self.released.swap(true, Ordering::AcqRel) {
            self.arena.release(self.index);
        }
        Ok(())
    }

    /// Give the slot up now: back to the ring at once, or, while a write from it is in
    /// flight (a publication its caller stopped waiting for, whose write the kernel still
    /// holds), by the last such write as it ends, never before: the kernel may still read
    /// the bytes. Either way the holder may not use it again (`check_live`). Idempotent.
    pub fn release_after_writes(&self) {
        self.given_back.store(true, Ordering::SeqCst);
        if self.writes_in_flight.load(Ordering::SeqCst) == 0 {
            let _ = self.release(); // refused only if a write started: its end releases
        }
    }

    /// Refuse any use of a released slot: its memory may belong to another lease now.
    pub fn check_live(&self) -> Result<()> {
        if self.is_released() {
            return Err(Error::invalid(
                "the slot was released; lease a new one (engine.lease())",
            ));
        }
        Ok(())
    }

    fn check_no_write(&self) -> Result<()> {
        if self.writes_in_flight.load(Ordering::Acquire) > 0 {
            return Err(Error::invalid(
                "the slot has a write in flight; wait for it before changing the slot",
            ));
        }
        Ok(())
    }

    pub fn set_len(&self, len: usize) -> Result<()> {
        self.check_live()?;
        self.check_no_write()?;
        if len > self.capacity() {
            return Err(Error::invalid(format!(
                "length {len} exceeds the slot capacity {}",
                self.capacity()
            )));
        }
        self.len.store(len, Ordering::Release);
        Ok(())
    }

    /// Bytes `[offset, offset+len)` of the slot.
    ///
    /// # Safety
    /// The caller must make sure no write into that range (by the kernel or another
    /// thread) runs while the returned slice lives.
    pub unsafe fn bytes(&self, offset: usize, len: usize) -> Result<&[u8]> {
        self.check_range(offset, len)?;
        // SAFETY: in bounds (checked), the lease keeps the mapping alive; exclusivity of
        // access is the caller's promise.
        Ok(unsafe { std::slice::from_raw_parts((self.addr() + offset) as *const u8, len) })
    }

    /// Copy `src` into the slot at `offset`.
    pub fn copy_in(&self, offset: usize, src: &[u8]) -> Result<()> {
        // SAFETY: `src` is a live slice for the whole call.
        unsafe { self.copy_in_raw(offset, src.as_ptr(), src.len()) }
    }

    /// Copy `len` bytes from `src` into the slot at `offset`; `src` may overlap the slot
    /// (a Python view of this very slot).
    ///
    /// # Safety
    /// `src..src+len` must be readable memory for the duration of the call.
    pub unsafe fn copy_in_raw(&self, offset: usize, src: *const u8, len: usize) -> Result<()> {
        self.check_no_write()?;
        self.check_range(offset, len)?;
        // SAFETY: destination in bounds and the slot is leased to us; the source is
        // readable by the caller's promise; `copy` is memmove, so overlap is fine.
        unsafe { std::ptr::copy(src, (self.addr() + offset) as *mut u8, len) };
        Ok(())
    }

    /// Zero bytes `[from, to)` (padding of an unaligned O_DIRECT write).
    pub fn zero(&self, from: usize, to: usize) -> Result<()> {
        self.check_no_write()?;
        self.check_range(from, to.saturating_sub(from))?;
        // SAFETY: in bounds; the slot is leased to us.
        unsafe { std::ptr::write_bytes((self.addr() + from) as *mut u8, 0, to - from) };
        Ok(())
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        self.check_live()?;
        match offset.checked_add(len) {
            Some(end) if end <= self.capacity() => Ok(()),
            _ => Err(Error::invalid(format!(
                "range [{offset}, {offset}+{len}) is outside the slot (capacity {})",
                self.capacity()
            ))),
        }
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        if !self.released.load(Ordering::Acquire) {
            self.arena.release(self.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_accounting_is_exact() {
        let a = Arena::new(3, 5000).unwrap();
        assert_eq!(a.slot_bytes(), 8192);
        assert_eq!(a.free_slots(), 3);
        let s1 = a.try_lease().unwrap();
        let s2 = a.try_lease().unwrap();
        let s3 = a.try_lease().unwrap();
        assert!(matches!(
            a.try_lease(),
            Err(Error::NoFreeSlot { window: 3 })
        ));
        assert_eq!(a.live_bytes(), 3 * 8192);
        drop(s2);
        assert_eq!(a.live_bytes(), 2 * 8192);
        assert_eq!(a.peak_bytes(), 3 * 8192);
        a.reset_peak();
        assert_eq!(a.peak_bytes(), 2 * 8192);
        assert_ne!(s1.addr(), s3.addr());
        assert_eq!(s1.addr() % 4096, 0);
    }

    #[test]
    fn release_is_explicit_and_once() {
        let a = Arena::new(2, 4096).unwrap();
        let s = Arc::new(a.try_lease().unwrap());
        let other_share = Arc::clone(&s);
        s.release().unwrap();
        // Back in the ring although a share still lives; a second release is a no-op.
        assert_eq!(a.free_slots(), 2);
        s.release().unwrap();
        assert!(s.copy_in(0, b"x").is_err() && s.set_len(1).is_err());
        drop(other_share);
        drop(s);
        assert_eq!(a.free_slots(), 2);
        assert_eq!(a.live_bytes(), 0);
        // A write in flight owns the slot: release is refused until it ends.
        let w = a.try_lease().unwrap();
        w.write_started();
        assert!(w.release().is_err());
        w.write_ended();
        w.release().unwrap();
        assert_eq!(a.free_slots(), 2);
    }

    #[test]
    fn a_slot_given_back_during_a_write_returns_when_the_write_ends() {
        let a = Arena::new(2, 4096).unwrap();
        let w = Arc::new(a.try_lease().unwrap());
        let op_share = Arc::clone(&w); // what an in-flight operation holds
        w.write_started();
        w.write_started();
        w.release_after_writes();
        // Not in the ring while the kernel may still read it; no use by its holder.
        assert_eq!(a.free_slots(), 1);
        assert!(w.is_released() && w.copy_in(0, b"x").is_err() && w.check_live().is_err());
        // One write still in flight, then the last one's end gives it back, once (not
        // again on Drop).
        w.write_ended();
        assert_eq!(a.free_slots(), 1);
        w.write_ended();
        assert_eq!(a.free_slots(), 2);
        drop(op_share);
        drop(w);
        assert_eq!(a.free_slots(), 2);
        // With no write in flight it goes back at once.
        let s = a.try_lease().unwrap();
        s.release_after_writes();
        assert_eq!(a.free_slots(), 2);
        s.release_after_writes();
        drop(s);
        assert_eq!(a.live_bytes(), 0);
    }

    #[test]
    fn bad_sizes() {
        assert!(matches!(
            Arena::new(0, 4096),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(Arena::new(1, 0), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn copy_and_bounds() {
        let a = Arena::new(1, 4096).unwrap();
        let s = a.try_lease().unwrap();
        s.copy_in(10, b"abc").unwrap();
        // SAFETY: nothing else touches this slot in the test.
        assert_eq!(unsafe { s.bytes(10, 3) }.unwrap(), b"abc");
        assert!(s.copy_in(4095, b"ab").is_err());
        assert!(s.set_len(4097).is_err());
    }

    #[test]
    fn a_window_larger_than_memory_is_refused_before_mapping() {
        let Some((available, _)) = available_memory() else {
            return; // no /proc/meminfo here: nothing to check against
        };
        // Twice what is available: refused by the check, never mapped or populated.
        let slot = 1usize << 30;
        let window = (2 * available / slot as u64 + 1) as usize;
        match Arena::new(window, slot) {
            Err(Error::NoMemory {
                asked,
                available: seen,
                ..
            }) => {
                assert_eq!(asked, window as u64 * slot as u64);
                // What the check saw is what there was (within what others took meanwhile).
                assert!(
                    seen.abs_diff(available) < available / 4,
                    "{seen} vs {available}"
                );
            }
            other => panic!("expected NoMemory, got {other:?}"),
        }
        // Control: a window that fits is mapped and populated.
        let a = Arena::new(4, 1 << 20).unwrap();
        assert_eq!(a.map_bytes(), 4 << 20);
    }

    #[test]
    fn the_fit_check_keeps_headroom() {
        assert!(check_fits(1 << 30, (1 << 30) + HEADROOM, "t").is_ok());
        let err = check_fits(1 << 30, (1 << 30) + HEADROOM - 1, "t").unwrap_err();
        assert_eq!(err.errno(), Some(libc::ENOMEM));
        assert!(err.to_string().contains("1073741824 bytes"), "{err}");
    }

    #[test]
    fn memory_figures_parse() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2000 kB\n";
        assert_eq!(meminfo_available(meminfo), Some(2000 * 1024));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
        // v2: no limit; a limit less usage, with inactive page cache counted as free.
        assert_eq!(
            cgroup_room_from("max\n", "5\n", None, "inactive_file"),
            None
        );
        let stat = "anon 10\ninactive_file 300\nactive_file 7\n";
        assert_eq!(
            cgroup_room_from("1000\n", "800\n", Some(stat), "inactive_file"),
            Some(500)
        );
        // v1's "unlimited" is a huge page-rounded number.
        assert_eq!(
            cgroup_room_from("9223372036854771712\n", "1\n", None, "total_inactive_file"),
            None
        );
    }
}
