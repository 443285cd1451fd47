//! `Engine`: the window of W slots and its backend, as a Python object. Every submit
//! and wait releases the GIL.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use bsr_io_core::engine::{DEFAULT_INFLIGHT_BYTES, DEFAULT_REQUEST_BYTES};
use bsr_io_core::publish::Spec;
use bsr_io_core::{BackendChoice, Engine, EngineConfig, OpenOptions, Pending};

use crate::direct::{payload_runs, Held, PyDirectRead, PyMemoryRegistration};
use crate::errors::{int_arg, opt_str_arg, raise_wait, value_err, Raise};
use crate::file::PyFile;
use crate::pending::{timeout_arg, Handoff, PyPending};
use crate::slot::{Exported, PySlot};
use crate::{non_negative, positive};

fn utf8(p: &std::path::Path, what: &str) -> PyResult<String> {
    p.to_str()
        .map(str::to_owned)
        .ok_or_else(|| value_err(format!("{what} is not valid UTF-8")))
}

/// One traced request as Python sees it (see `trace_take`).
type TraceTuple = (u64, u64, u64, u64, u64, u32, u32);

#[pyclass(name = "Engine", module = "bsr_io._core", frozen, weakref)]
pub(crate) struct PyEngine {
    inner: Engine,
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        // The last reference went away (CPython holds the GIL here): joining the I/O
        // thread waits for what is in flight, which may take long (a slow device, a
        // FIFO), and must not stop every other Python thread meanwhile. Nothing can
        // reach this object any more, so letting the GIL go is safe.
        // (No interpreter to attach to, at its very end: close as `close()` would.)
        let inner = &self.inner;
        if Python::try_attach(|py| py.detach(|| inner.close())).is_none() {
            inner.close();
        }
    }
}

impl PyEngine {
    fn read_op(
        &self,
        py: Python<'_>,
        file: &PyFile,
        offset: i64,
        length: i64,
    ) -> PyResult<Pending> {
        let offset = non_negative("offset", offset)?;
        let length = positive("length", length)?;
        let f = file.get()?;
        py.detach(|| self.inner.submit_read(&f, offset, length))
            .raise()
    }

    fn write_op(
        &self,
        py: Python<'_>,
        slot: &Bound<'_, PySlot>,
        file: &PyFile,
        offset: i64,
        length: Option<i64>,
    ) -> PyResult<Pending> {
        let offset = non_negative("offset", offset)?;
        let length = length.map(|l| positive("length", l)).transpose()?;
        let f = file.get()?;
        // The write owns the slot until it completes: no writable view may outlive it.
        slot.get().check_no_views()?;
        let lease = Arc::clone(&slot.get().lease);
        py.detach(|| self.inner.submit_write(&lease, &f, offset, length))
            .raise()
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(
        signature = (window, slot_bytes, *, queue_depth = None, request_bytes = None, backend = None, inflight_bytes = None),
        text_signature = "(window, slot_bytes, *, queue_depth=32, request_bytes=1048576, backend=None, inflight_bytes=33554432)"
    )]
    fn new(
        py: Python<'_>,
        window: &Bound<'_, PyAny>,
        slot_bytes: &Bound<'_, PyAny>,
        queue_depth: Option<&Bound<'_, PyAny>>,
        request_bytes: Option<&Bound<'_, PyAny>>,
        backend: Option<&Bound<'_, PyAny>>,
        inflight_bytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        // Arguments converted here, not by PyO3, so a wrong type is a BsrTypeError.
        let as_usize = |name: &str, arg: &Bound<'_, PyAny>, min: i64| {
            let v = int_arg(arg, name)?;
            if v < min {
                Err(value_err(format!("{name} must be at least {min}, got {v}")))
            } else {
                Ok(v as usize)
            }
        };
        let cfg = EngineConfig {
            window: as_usize("window", window, 1)?,
            slot_bytes: as_usize("slot_bytes", slot_bytes, 1)?,
            queue_depth: queue_depth.map_or(Ok(32), |a| as_usize("queue_depth", a, 1))?,
            request_bytes: request_bytes.map_or(Ok(DEFAULT_REQUEST_BYTES), |a| {
                as_usize("request_bytes", a, 1)
            })?,
            inflight_bytes: inflight_bytes.map_or(Ok(DEFAULT_INFLIGHT_BYTES), |a| {
                as_usize("inflight_bytes", a, 0)
            })?,
            backend: BackendChoice::resolve(opt_str_arg(backend, "backend")?.as_deref()).raise()?,
        };
        let inner = py.detach(|| Engine::new(cfg)).raise()?;
        Ok(PyEngine { inner })
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.inner.features().backend
    }

    #[getter]
    fn features<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let f = self.inner.features();
        let d = PyDict::new(py);
        d.set_item("backend", f.backend)?;
        d.set_item("fixed_buffers", f.fixed_buffers)?;
        d.set_item("registered_files", f.registered_files)?;
        d.set_item("registered_memory", f.registered_memory)?;
        d.set_item("mlock", f.mlock)?;
        d.set_item("hugepages", f.hugepages)?;
        d.set_item("queue_depth", f.queue_depth)?;
        d.set_item("request_bytes", f.request_bytes)?;
        d.set_item("inflight_bytes", f.inflight_bytes)?;
        d.set_item("open_path", f.open_path)?;
        d.set_item("notes", f.notes.join("; "))?;
        Ok(d)
    }

    #[getter]
    fn window(&self) -> usize {
        self.inner.arena().window()
    }

    #[getter]
    fn slot_bytes(&self) -> usize {
        self.inner.arena().slot_bytes()
    }

    #[getter]
    fn arena_address(&self) -> usize {
        self.inner.arena().base_addr()
    }

    #[getter]
    fn arena_bytes(&self) -> usize {
        self.inner.arena().map_bytes()
    }

    #[pyo3(signature = (path, *, write = false, create = false, direct = true, special = false, root = None))]
    #[allow(clippy::too_many_arguments)]
    fn open(
        &self,
        py: Python<'_>,
        path: PathBuf,
        write: bool,
        create: bool,
        direct: bool,
        special: bool,
        root: Option<PathBuf>,
    ) -> PyResult<PyFile> {
        let path = utf8(&path, "path")?;
        let root = root.map(|r| utf8(&r, "root")).transpose()?;
        let opts = OpenOptions {
            write,
            create,
            direct,
            special,
        };
        let f = py
            .detach(|| self.inner.open_in(root.as_deref(), &path, opts))
            .raise()?;
        Ok(PyFile {
            path,
            direct: f.direct(),
            writable: f.writable(),
            alignment: f.alignment(),
            last_size: AtomicU64::new(f.size()),
            file: Mutex::new(Some(f)),
        })
    }

    fn lease(&self) -> PyResult<PySlot> {
        Ok(PySlot::new(self.inner.lease().raise()?))
    }

    fn submit_read(
        &self,
        py: Python<'_>,
        file: &PyFile,
        offset: i64,
        length: i64,
    ) -> PyResult<PyPending> {
        let op = self.read_op(py, file, offset, length)?;
        Ok(PyPending {
            op,
            handoff: Mutex::new(Handoff::Read),
        })
    }

    fn read(
        &self,
        py: Python<'_>,
        file: &PyFile,
        offset: i64,
        length: i64,
    ) -> PyResult<Py<PySlot>> {
        self.submit_read(py, file, offset, length)?.wait(py, None)
    }

    /// Read the file from `offset` straight into `dsts` along `runs` ((buffer, offset in
    /// it, payload offset, length), covering the payload in order): no slot. AlignmentError
    /// when a run's memory or length does not suit O_DIRECT on this file. `inflight`: at
    /// most this many of its bytes in the kernel at once (its requests then land one
    /// after another, for `DirectRead.wait_xxh3` to hash as they land); None: only the
    /// engine's bounds.
    #[pyo3(signature = (file, offset, dsts, runs, *, inflight = None))]
    fn submit_read_into(
        &self,
        py: Python<'_>,
        file: &PyFile,
        offset: i64,
        dsts: Vec<Bound<'_, PyAny>>,
        runs: Vec<(usize, usize, usize, usize)>,
        inflight: Option<i64>,
    ) -> PyResult<PyDirectRead> {
        let offset = non_negative("offset", offset)?;
        let cap = match inflight {
            None => 0,
            Some(n) if n > 0 => n as u64,
            Some(n) => {
                return Err(value_err(format!(
                    "inflight must be a positive byte count or None, got {n}"
                )))
            }
        };
        let exports = dsts
            .iter()
            .map(|d| Exported::get(d, true))
            .collect::<PyResult<Vec<_>>>()?;
        let lens: Vec<usize> = exports.iter().map(|e| e.len()).collect();
        let (_, runs) = payload_runs(&lens, runs)?;
        let pieces: Vec<(usize, u64)> = runs
            .iter()
            .map(|r| (exports[r.dst].addr() + r.dst_offset, r.len as u64))
            .collect();
        // The kernel writes every piece at once: no two may share memory.
        let mut spans = pieces.clone();
        spans.sort_unstable();
        if spans.windows(2).any(|w| w[0].0 + w[0].1 as usize > w[1].0) {
            return Err(value_err(
                "the runs of a direct read overlap in memory; give each byte one place",
            ));
        }
        let f = file.get()?;
        let engine = &self.inner;
        // SAFETY: every piece lies inside a writable export (checked by `payload_runs`)
        // that the returned DirectRead holds until the kernel gave the memory back
        // (`memory_returned`); dropped before, or after a break-down that left the read
        // with the kernel (`Error::KernelOwned`), it holds them for good. The pieces do
        // not overlap.
        let op = py
            .detach(|| unsafe { engine.submit_read_into(&f, offset, &pieces, cap) })
            .raise()?;
        Ok(PyDirectRead {
            op,
            held: Mutex::new(Some(Held::new(exports))),
        })
    }

    /// Register the writable buffers `bufs` with the I/O ring: direct reads into them
    /// then skip pinning their pages per request. The registration holds the buffers
    /// (they can be neither freed nor resized) until it is closed or collected. The I/O
    /// thread registers between its waits (it is woken for it): waited for at most
    /// `timeout` seconds (WaitTimeoutError then, and the buffers are never registered).
    #[pyo3(signature = (bufs, timeout = None))]
    fn register_memory(
        &self,
        py: Python<'_>,
        bufs: Vec<Bound<'_, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<PyMemoryRegistration> {
        let timeout = timeout_arg(timeout)?;
        let exports = bufs
            .iter()
            .map(|b| Exported::get(b, true))
            .collect::<PyResult<Vec<_>>>()?;
        let regions: Vec<(usize, u64)> =
            exports.iter().map(|e| (e.addr(), e.len() as u64)).collect();
        let engine = &self.inner;
        // SAFETY: the exports keep every region's memory alive and its size fixed; the
        // returned object drops the registration before it releases them, and on an
        // error (a timeout included) nothing was or will be registered before they drop.
        let reg = py
            .detach(|| unsafe { engine.register_memory(&regions, timeout) })
            .raise()?;
        Ok(PyMemoryRegistration::new(reg, Held::new(exports)))
    }

    /// Publish a record in one call: `head`, then the slot's first `length` bytes,
    /// into the new temp file `tmp`, made durable and renamed to `dest` (its directory
    /// fsynced), within `timeout` seconds; (st_dev, st_ino, st_mtime_ns, st_size) of the
    /// record. WaitTimeoutError (with `.step`) past the deadline, nothing published but
    /// by a rename already under way; OSError naming the failed step. `durable` false:
    /// neither the fdatasync nor the directory's fsync.
    #[pyo3(signature = (slot, tmp, dest, head, length, *, root = None, release = false, durable = true, timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn publish(
        &self,
        py: Python<'_>,
        slot: &Bound<'_, PySlot>,
        tmp: PathBuf,
        dest: PathBuf,
        head: &[u8],
        length: i64,
        root: Option<PathBuf>,
        release: bool,
        durable: bool,
        timeout: Option<f64>,
    ) -> PyResult<(u64, u64, i64, u64)> {
        let timeout = timeout_arg(timeout)?;
        let spec = Spec {
            root: root.map(|r| utf8(&r, "root")).transpose()?,
            tmp: utf8(&tmp, "tmp")?,
            dest: utf8(&dest, "dest")?,
            head: head.to_vec(),
            length: positive("length", length)?,
            release_slot: release,
            durable,
        };
        // The chain reads the slot until its bytes are written: no writable view may
        // outlive the call.
        slot.get().check_no_views()?;
        let lease = Arc::clone(&slot.get().lease);
        let got = py
            .detach(|| self.inner.publish(&lease, spec, timeout))
            .raise()?;
        Ok((got.dev, got.ino, got.mtime_ns, got.size))
    }

    #[pyo3(signature = (slot, file, offset, length = None))]
    fn submit_write(
        &self,
        py: Python<'_>,
        slot: &Bound<'_, PySlot>,
        file: &PyFile,
        offset: i64,
        length: Option<i64>,
    ) -> PyResult<PyPending> {
        let op = self.write_op(py, slot, file, offset, length)?;
        Ok(PyPending {
            op,
            handoff: Mutex::new(Handoff::Write(slot.clone().unbind())),
        })
    }

    #[pyo3(signature = (slot, file, offset, length = None))]
    fn write(
        &self,
        py: Python<'_>,
        slot: &Bound<'_, PySlot>,
        file: &PyFile,
        offset: i64,
        length: Option<i64>,
    ) -> PyResult<u64> {
        let op = self.write_op(py, slot, file, offset, length)?;
        py.detach(|| op.wait(None)).raise()
    }

    /// fdatasync `file` on the engine's I/O thread, waiting at most `timeout` seconds:
    /// WaitTimeoutError then, while the sync goes on without a waiter.
    #[pyo3(signature = (file, timeout = None))]
    fn sync(&self, py: Python<'_>, file: &PyFile, timeout: Option<f64>) -> PyResult<()> {
        let timeout = timeout_arg(timeout)?;
        let f = file.get()?;
        let engine = &self.inner;
        let op = py.detach(|| engine.submit_sync(&f)).raise()?;
        raise_wait(py.detach(|| op.wait(timeout)), &op).map(drop)
    }

    fn free_slots(&self) -> usize {
        self.inner.arena().free_slots()
    }

    fn live_bytes(&self) -> usize {
        self.inner.arena().live_bytes()
    }

    fn peak_bytes(&self) -> usize {
        self.inner.arena().peak_bytes()
    }

    fn reset_peak(&self) {
        self.inner.arena().reset_peak()
    }

    /// Start recording request timings on the I/O thread (io_uring only).
    #[pyo3(signature = (max_events = 1 << 20))]
    fn trace_start(&self, py: Python<'_>, max_events: i64) -> PyResult<()> {
        let cap = positive("max_events", max_events)? as usize;
        py.detach(|| self.inner.trace_start(cap)).raise()
    }

    /// Stop recording; the events as (offset, bytes, queued_ns, submit_ns, complete_ns,
    /// depth, waiting) tuples in completion order.
    fn trace_take(&self, py: Python<'_>) -> PyResult<Vec<TraceTuple>> {
        let events = py.detach(|| self.inner.trace_take()).raise()?;
        Ok(events
            .into_iter()
            .map(|e| {
                (
                    e.offset,
                    e.bytes,
                    e.queued_ns,
                    e.submit_ns,
                    e.complete_ns,
                    e.depth,
                    e.waiting,
                )
            })
            .collect())
    }

    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close())
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Why the engine broke (its I/O thread's error, as a message), or None.
    #[getter]
    fn broken(&self) -> Option<String> {
        self.inner.broken().map(|e| e.to_string())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) {
        self.close(py)
    }

    fn __repr__(&self) -> String {
        let a = self.inner.arena();
        format!(
            "Engine(window={}, slot_bytes={}, backend={:?}, live_bytes={})",
            a.window(),
            a.slot_bytes(),
            self.inner.features().backend,
            a.live_bytes()
        )
    }
}
