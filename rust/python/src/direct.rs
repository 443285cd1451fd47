//! `DirectRead`: a read straight from a file into the caller's buffers (a host KV
//! cache's blocks), with no staging slot; and `xxh3_runs`, the payload's hash taken
//! where the read left it.

use std::sync::Mutex;
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use bsr_io_core::install::{self, Run};
use bsr_io_core::landing;
use bsr_io_core::{Error, MemoryRegistration, Pending};

use crate::errors::{raise_wait, value_err, Raise};
use crate::pending::timeout_arg;
use crate::slot::{export_spans, to_runs, Exported};
use bsr_io_core::claims::Claim;

/// Buffer exports pinning the destination memory while the kernel may write it.
pub(crate) struct Held {
    _exports: Vec<Exported>,
}

impl Held {
    pub(crate) fn new(exports: Vec<Exported>) -> Held {
        Held { _exports: exports }
    }
}

// SAFETY: the exports are never used after construction except to be released, which
// happens only where the GIL is held (a wait's return, a registration's close, or the
// owner's deallocation): PyBuffer_Release needs the GIL, not the thread that took them.
unsafe impl Send for Held {}
// SAFETY: as above; shared references give no access to the exports.
unsafe impl Sync for Held {}

/// (buffer, offset in it, payload offset, length) tuples as the core's runs, checked to
/// cover `[0, total)` of the payload in order, each inside its buffer.
pub(crate) fn payload_runs(
    lens: &[usize],
    runs: Vec<(usize, usize, usize, usize)>,
) -> PyResult<(usize, Vec<Run>)> {
    let runs = to_runs(runs);
    let mut total = 0;
    for (i, r) in runs.iter().enumerate() {
        if r.src_offset != total {
            return Err(value_err(format!(
                "run {i} starts at payload offset {} where {total} was expected: the runs \
                 must cover the payload in order, without gaps",
                r.src_offset
            )));
        }
        total += r.len;
    }
    install::check_runs(total, lens, &runs).raise()?;
    Ok((total, runs))
}

/// Buffers registered with an engine's ring (`Engine.register_memory`). `close()`, or
/// collection, unregisters them, then releases the exports that kept them alive.
#[pyclass(name = "MemoryRegistration", module = "bsr_io._core", frozen)]
pub(crate) struct PyMemoryRegistration {
    // A tuple drops in order: the registration goes before the memory it names.
    state: Mutex<Option<(MemoryRegistration, Held)>>,
    entries: usize,
}

impl PyMemoryRegistration {
    pub(crate) fn new(reg: MemoryRegistration, held: Held) -> Self {
        PyMemoryRegistration {
            entries: reg.entries(),
            state: Mutex::new(Some((reg, held))),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Option<(MemoryRegistration, Held)>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PyMemoryRegistration {
    /// Unregister the buffers (again: nothing).
    fn close(&self) {
        let state = self.state().take();
        drop(state);
    }

    /// The ring's buffer entries it took (0: the backend registers nothing; reads into
    /// the buffers work, unregistered).
    #[getter]
    fn entries(&self) -> usize {
        self.entries
    }

    #[getter]
    fn closed(&self) -> bool {
        self.state().is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) {
        self.close();
    }
}

#[pyclass(name = "DirectRead", module = "bsr_io._core", frozen)]
pub(crate) struct PyDirectRead {
    pub(crate) op: Pending,
    pub(crate) held: Mutex<Option<Held>>,
}

impl PyDirectRead {
    fn held(&self) -> std::sync::MutexGuard<'_, Option<Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PyDirectRead {
    fn done(&self) -> bool {
        self.op.is_done()
    }

    /// Give the read up if none of it has reached the kernel yet (queued in the engine):
    /// True then, and the buffers are the caller's again at once, never written. False
    /// once the kernel has it: it goes on, and may still write them.
    fn withdraw(&self) -> bool {
        let won = self.op.withdraw();
        if won {
            drop(self.held().take());
        }
        won
    }

    /// Bytes read, once the read has ended; the buffers are then the caller's again,
    /// unless it ended with KernelOwnedError (the engine broke down while the kernel
    /// held the read): then they stay exported for good.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u64> {
        let timeout = timeout_arg(timeout)?;
        let op = &self.op;
        let res = py.detach(|| op.wait(timeout));
        match res {
            Err(Error::Timeout) => {} // still in flight: the read keeps its buffers
            Err(Error::KernelOwned { .. }) => self.keep_for_good(),
            _ => drop(self.held().take()), // the kernel gave the memory back
        }
        raise_wait(res, op)
    }

    /// As `wait`, hashing the bytes as they land (the engine's requests, in order), so
    /// that only the last request's bytes are left to hash once the read has ended:
    /// (xxh3-64 of the whole payload in run order, when the read ended on the
    /// `time.perf_counter` clock). Any error of the read is raised as `wait` raises it,
    /// and what was hashed of it is dropped.
    #[pyo3(signature = (timeout = None))]
    fn wait_xxh3(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<(u64, f64)> {
        let timeout = timeout_arg(timeout)?;
        let op = &self.op;
        // The read's own pieces: no install or hash of this process may write them while
        // they are hashed (as `xxh3_runs` claims its runs).
        let ranges = op
            .segments()
            .iter()
            .map(|s| (s.addr, s.addr + s.len as usize))
            .collect();
        let claim = Claim::take(ranges).raise()?;
        // The exports are this call's while it hashes: a `wait` on another thread that
        // sees the read end first finds none to release.
        let held = self.held().take();
        let res = py.detach(move || {
            // SAFETY: the pieces lie in the exports `held` keeps (or, taken by a withdraw
            // that won, none of them was ever written or landed, so none is read); the
            // kernel writes only requests not yet landed, which are not read; `claim`
            // keeps this process's installs and hashes off them.
            let r = unsafe { landing::xxh3_as_landed(op, timeout) };
            drop(claim);
            r
        });
        match &res {
            Err(Error::Timeout) => *self.held() = held, // still in flight: kept
            Err(Error::KernelOwned { .. }) => std::mem::forget(held),
            _ => drop(held), // the kernel gave the memory back
        }
        let (h, ended) = raise_wait(res, op)?;
        Ok((h, perf_counter_at(ended)))
    }

    #[getter]
    fn length(&self) -> u64 {
        self.op.want
    }
}

/// `at` on the clock of Python's `time.perf_counter` (CLOCK_MONOTONIC on Linux).
fn perf_counter_at(at: Instant) -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to fill; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let now = ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9;
    now - at.elapsed().as_secs_f64()
}

impl PyDirectRead {
    /// The kernel may still write the buffers: keep them exported (pinned, never freed
    /// or resized) for the life of the process rather than let the memory go to
    /// someone else under a pending write.
    fn keep_for_good(&self) {
        if let Some(held) = self.held().take() {
            std::mem::forget(held);
        }
    }
}

impl Drop for PyDirectRead {
    fn drop(&mut self) {
        if !self.op.memory_returned() {
            self.keep_for_good();
        }
    }
}

#[pyfunction]
pub(crate) fn xxh3_runs(
    py: Python<'_>,
    bufs: Vec<Bound<'_, PyAny>>,
    runs: Vec<(usize, usize, usize, usize)>,
) -> PyResult<u64> {
    let (exports, spans) = export_spans(&bufs, false)?;
    let lens: Vec<usize> = spans.iter().map(|s| s.len).collect();
    let (total, runs) = payload_runs(&lens, runs)?;
    // Only the runs' bytes are read, and no install on another thread may write them
    // meanwhile; other chunks' runs of the same buffers stay free for other threads.
    let claim = Claim::take(install::run_ranges(&spans, &runs)).raise()?;
    let h = py
        .detach(move || {
            // SAFETY: each span is an export held in `exports` until after this closure
            // returns, so the runs' bytes are readable; `claim` keeps every install and
            // hash of this process off them. The direct read that filled them has
            // completed (the caller hashes after its wait), so no transfer writes them.
            let h = unsafe { install::xxh3_runs_raw(total, &spans, &runs) };
            drop(claim);
            h
        })
        .raise()?;
    drop(exports);
    Ok(h)
}
