//! Publishing a record file in one call: the temp file's creation, the header and
//! payload written from the slot, fdatasync, the rename over the final name and the
//! directory's fsync, one after another on a kept runner thread (runners.rs), while the
//! caller waits once, with the record's deadline.
//!
//! Why one call: done as separate calls from Python, a record took three thread
//! hand-offs and two io_uring round trips, about 35 context switches and 1-2 ms of CPU
//! with the GIL taken back at each step (the raw write of the same bytes: 0.15 ms and 9
//! switches). Here the GIL is released once and the chain runs on one thread.
//!
//! Every step may block in the kernel for as long as a stalled drive likes, so the
//! caller waits at most its deadline and then gets `Error::Stalled`, naming the step
//! the chain was in. The chain looks before each step whether its caller gave up, and if
//! so removes the temp file and ends; a rename already in the kernel may still complete
//! and publish the record, which was written whole and fdatasynced before the rename
//! began (a reader verifies it like any record another process wrote). The slot stays
//! out of the ring until its bytes are written (`write_started`), whether or not anyone
//! still waits.

mod dirsync;
pub mod runners;
pub mod stall;

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::align::AlignedBlock;
use crate::arena::SlotLease;
use crate::error::{Error, Result};
use crate::file::{open_beneath, open_raw};

/// What to publish: the slot's first `length` bytes after `head`, as `dest`, written
/// through the temp file `tmp` beside it.
#[derive(Debug, Clone)]
pub struct Spec {
    /// A store's directory: `tmp` is created below it with no link followed.
    pub root: Option<String>,
    pub tmp: String,
    pub dest: String,
    /// Written at offset 0 (the record's header).
    pub head: Vec<u8>,
    pub length: u64,
    /// Give the slot back to the ring as soon as its bytes are written, not after the
    /// fdatasync, rename and directory fsync.
    pub release_slot: bool,
    /// fdatasync the temp file before the rename and fsync the directory after it. Off,
    /// a record outlives a process crash (the page cache keeps it) but a power loss may
    /// leave it torn or unnamed: readers verify every record, so that costs a miss.
    pub durable: bool,
}

/// The published file, as the index keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    pub dev: u64,
    pub ino: u64,
    pub mtime_ns: i64,
    pub size: u64,
}

/// The steps of a publication, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Create,
    Write,
    Sync,
    Rename,
    DirSync,
}

impl Step {
    /// What a message calls it.
    pub fn describe(self) -> &'static str {
        match self {
            Step::Create => "temp file's creation",
            Step::Write => "write",
            Step::Sync => "fdatasync",
            Step::Rename => "rename",
            Step::DirSync => "directory's fsync",
        }
    }

    /// Its short name (the stall double's argument).
    pub fn parse(name: &str) -> Option<Step> {
        Some(match name {
            "create" => Step::Create,
            "write" => Step::Write,
            "fdatasync" => Step::Sync,
            "rename" => Step::Rename,
            "dirsync" => Step::DirSync,
            _ => return None,
        })
    }
}

struct State {
    step: Step,
    given_up: bool,
    result: Option<Result<Published>>,
}

struct Job {
    state: Mutex<State>,
    ended: Condvar,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The chain's hold on the slot: the slot cannot be released or changed until its bytes
/// are written (or the chain ends before writing them).
struct WriteHold {
    lease: Arc<SlotLease>,
    release: bool,
}

impl Drop for WriteHold {
    fn drop(&mut self) {
        self.lease.write_ended();
        if self.release {
            let _ = self.lease.release(); // refused only while another write is in flight
        }
    }
}

/// Removes the temp file unless the rename took it.
struct TempFile {
    path: CString,
    armed: bool,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.armed {
            // SAFETY: `path` is a NUL-terminated path we own.
            unsafe { libc::unlink(self.path.as_ptr()) };
        }
    }
}

/// Publish `spec` from `lease` within `timeout` (None: no limit). On any error nothing
/// is published and no temp file is left, except where a stalled rename completes late
/// (module doc).
pub fn publish(lease: &Arc<SlotLease>, spec: Spec, timeout: Option<Duration>) -> Result<Published> {
    lease.check_live()?;
    if spec.length == 0 || spec.length > lease.capacity() as u64 {
        return Err(Error::invalid(format!(
            "length {} must be positive and at most the slot capacity {}",
            spec.length,
            lease.capacity()
        )));
    }
    let deadline = timeout.map(|t| Instant::now() + t);
    let tmp = spec.tmp.clone();
    lease.write_started();
    let hold = WriteHold {
        lease: Arc::clone(lease),
        release: spec.release_slot,
    };
    let job = Arc::new(Job {
        state: Mutex::new(State {
            step: Step::Create,
            given_up: false,
            result: None,
        }),
        ended: Condvar::new(),
    });
    let theirs = Arc::clone(&job);
    runners::run(Box::new(move || {
        let res =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| chain(&spec, hold, &theirs)))
                .unwrap_or_else(|_| {
                    Err(Error::os("publish (its thread panicked)", None, libc::EIO))
                });
        locked(&theirs.state).result = Some(res);
        theirs.ended.notify_all();
    }))?;
    let mut st = locked(&job.state);
    loop {
        if let Some(res) = st.result.take() {
            return res;
        }
        match deadline {
            None => st = job.ended.wait(st).unwrap_or_else(|p| p.into_inner()),
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    st.given_up = true;
                    return Err(Error::Stalled {
                        step: st.step.describe(),
                        path: tmp,
                    });
                }
                st = job
                    .ended
                    .wait_timeout(st, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
    }
}

/// Enter `step` unless the caller gave up (then the chain ends and cleans up).
fn enter(job: &Job, step: Step, tmp: &str) -> Result<()> {
    {
        let mut st = locked(&job.state);
        if st.given_up {
            return Err(Error::Timeout);
        }
        st.step = step;
    }
    stall::at(step, tmp);
    Ok(())
}

fn chain(spec: &Spec, hold: WriteHold, job: &Job) -> Result<Published> {
    let c = |p: &str| CString::new(p).map_err(|_| Error::invalid("path contains a NUL byte"));
    let (ctmp, cdest) = (c(&spec.tmp)?, c(&spec.dest)?);
    enter(job, Step::Create, &spec.tmp)?;
    let fd = create(spec, &ctmp)?;
    let mut temp = TempFile {
        path: ctmp,
        armed: true,
    };
    enter(job, Step::Write, &spec.tmp)?;
    write_all(fd.as_raw_fd(), spec, &hold.lease, &spec.tmp)?;
    drop(hold); // its bytes are in the file: the slot may go back to the ring
    if spec.durable {
        enter(job, Step::Sync, &spec.tmp)?;
        // SAFETY: `fd` is open and ours.
        if unsafe { libc::fdatasync(fd.as_raw_fd()) } != 0 {
            return Err(Error::last_os("fdatasync", Some(&spec.tmp)));
        }
    }
    let published = stat(fd.as_raw_fd(), &spec.tmp)?;
    drop(fd);
    enter(job, Step::Rename, &spec.tmp)?;
    // SAFETY: both are NUL-terminated paths we own.
    if unsafe { libc::rename(temp.path.as_ptr(), cdest.as_ptr()) } != 0 {
        return Err(Error::last_os("rename", Some(&spec.dest)));
    }
    temp.armed = false;
    if !spec.durable {
        return Ok(published);
    }
    enter(job, Step::DirSync, &spec.tmp)?;
    let dir = Path::new(&spec.dest)
        .parent()
        .and_then(Path::to_str)
        .filter(|d| !d.is_empty())
        .unwrap_or(".");
    dirsync::sync(dir, dirsync::fsync_dir)?;
    Ok(published)
}

/// The temp file, new (O_EXCL), its missing directories made private (0700); O_DIRECT
/// where the file system takes it and the record's pieces are block-aligned.
fn create(spec: &Spec, ctmp: &CString) -> Result<OwnedFd> {
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC | libc::O_NOFOLLOW;
    let open = || match &spec.root {
        Some(r) => open_beneath(r, &spec.tmp, flags),
        None => open_raw(ctmp, flags),
    };
    let fd = match open() {
        Err(libc::ENOENT) => {
            if let Some(dir) = Path::new(&spec.tmp).parent() {
                mkdir_private(dir)?;
            }
            open()
        }
        other => other,
    }
    .map_err(|e| Error::os("temp file's creation", Some(&spec.tmp), e))?;
    if aligned(spec) {
        // SAFETY: F_GETFL/F_SETFL on a descriptor we own. A file system without direct
        // I/O refuses (EINVAL) and the file stays buffered: fdatasync makes it durable.
        unsafe {
            let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
            if fl >= 0 {
                libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_DIRECT);
            }
        }
    }
    Ok(fd)
}

const BLOCK: u64 = 4096;

fn aligned(spec: &Spec) -> bool {
    (spec.head.len() as u64) % BLOCK == 0 && spec.length % BLOCK == 0
}

fn mkdir_private(dir: &Path) -> Result<()> {
    let mut missing = Vec::new();
    let mut p = dir;
    while !p.exists() {
        missing.push(p);
        match p.parent() {
            Some(up) => p = up,
            None => break,
        }
    }
    for d in missing.into_iter().rev() {
        let path = d
            .to_str()
            .ok_or_else(|| Error::invalid("path is not UTF-8"))?;
        let c = CString::new(path).map_err(|_| Error::invalid("path contains a NUL byte"))?;
        // SAFETY: a NUL-terminated path we own.
        if unsafe { libc::mkdir(c.as_ptr(), 0o700) } != 0 {
            let e = crate::error::last_errno();
            if e != libc::EEXIST {
                return Err(Error::os("mkdir", Some(path), e));
            }
        }
    }
    Ok(())
}

/// The header, then the slot's `length` bytes, from offset 0: one pwritev, repeated on
/// a short write for what is left.
fn write_all(fd: i32, spec: &Spec, lease: &SlotLease, path: &str) -> Result<()> {
    // The header's copy aligned for O_DIRECT (none for an empty header).
    let head = match spec.head.is_empty() {
        true => None,
        false => Some(AlignedBlock::copy_of(&spec.head, BLOCK as usize)?),
    };
    let mut pieces = [
        (head.as_ref().map_or(0, |h| h.ptr as usize), spec.head.len()),
        (lease.addr(), spec.length as usize),
    ];
    let mut offset: i64 = 0;
    let mut first = if spec.head.is_empty() { 1 } else { 0 };
    while first < pieces.len() {
        let iov: Vec<libc::iovec> = pieces[first..]
            .iter()
            .map(|&(addr, len)| libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: len,
            })
            .collect();
        // SAFETY: each iovec is live memory: the header copy we own, and the slot, which
        // the write hold keeps leased and unchanged until this returns.
        let n = unsafe { libc::pwritev(fd, iov.as_ptr(), iov.len() as i32, offset) };
        if n < 0 {
            return Err(Error::last_os("write", Some(path)));
        }
        if n == 0 {
            return Err(Error::os("write", Some(path), libc::EIO));
        }
        let mut n = n as usize;
        offset += n as i64;
        while first < pieces.len() && n >= pieces[first].1 {
            n -= pieces[first].1;
            first += 1;
        }
        if first < pieces.len() {
            pieces[first].0 += n;
            pieces[first].1 -= n;
        }
    }
    Ok(())
}

fn stat(fd: i32, path: &str) -> Result<Published> {
    // SAFETY: stat is plain data; fstat writes into our local.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open; `st` is a live local.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(Error::last_os("fstat", Some(path)));
    }
    Ok(Published {
        dev: st.st_dev,
        ino: st.st_ino,
        mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec,
        size: st.st_size as u64,
    })
}

#[cfg(test)]
mod tests;
