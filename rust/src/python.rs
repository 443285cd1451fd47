//! The only PyO3 module: `bsr_io._core`. Converts between Python objects and the
//! engine, releases the GIL around every submit and wait, and maps `Error` onto an
//! exception tree rooted at `OSError` with errno set.

use std::ffi::c_int;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyBufferError, PyFileNotFoundError, PyOSError, PyPermissionError};
use pyo3::exceptions::{PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType, PyWeakrefReference};
use pyo3::{create_exception, ffi};

use crate::arena::SlotLease;
use crate::backend::{OpKind, Pending};
use crate::checksum;
use crate::engine::{BackendChoice, Engine, EngineConfig};
use crate::error::Error;
use crate::file::{EngineFile, OpenOptions};

create_exception!(
    bsr_io._core,
    BsrIoError,
    PyOSError,
    "Root of engine errors; errno is set."
);
create_exception!(
    bsr_io._core,
    AlignmentError,
    BsrIoError,
    "O_DIRECT refused an offset, length or address (EINVAL)."
);
create_exception!(
    bsr_io._core,
    ShortReadError,
    BsrIoError,
    "The file ended before the requested range did."
);
create_exception!(
    bsr_io._core,
    EngineClosedError,
    BsrIoError,
    "The engine (or file) was closed."
);
create_exception!(
    bsr_io._core,
    BackendUnavailable,
    BsrIoError,
    "The requested backend cannot run here."
);
create_exception!(
    bsr_io._core,
    NoFreeSlot,
    BsrIoError,
    "All slots are leased or in flight (EAGAIN)."
);
create_exception!(
    bsr_io._core,
    NoSpaceError,
    BsrIoError,
    "The device is full (ENOSPC)."
);

/// Engine errors that are also the builtin errno classes, so `except FileNotFoundError`
/// and `except PermissionError` work.
static FILE_MISSING: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static FILE_PERMISSION: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn mixed_type(
    py: Python<'_>,
    name: &str,
    builtin: Bound<'_, PyType>,
    doc: &str,
) -> PyResult<Py<PyType>> {
    let bases = PyTuple::new(py, [py.get_type::<BsrIoError>(), builtin])?;
    let ns = PyDict::new(py);
    ns.set_item("__module__", "bsr_io._core")?;
    ns.set_item("__doc__", doc)?;
    let t = py.get_type::<PyType>().call1((name, bases, ns))?;
    Ok(t.cast_into::<PyType>()?.unbind())
}

fn file_missing(py: Python<'_>) -> PyResult<&Py<PyType>> {
    FILE_MISSING.get_or_try_init(py, || {
        mixed_type(
            py,
            "FileMissingError",
            py.get_type::<PyFileNotFoundError>(),
            "The file does not exist (ENOENT).",
        )
    })
}

fn file_permission(py: Python<'_>) -> PyResult<&Py<PyType>> {
    FILE_PERMISSION.get_or_try_init(py, || {
        mixed_type(
            py,
            "FilePermissionError",
            py.get_type::<PyPermissionError>(),
            "Access to the file was refused (EACCES, EPERM).",
        )
    })
}

fn to_pyerr(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    let args = (
        e.errno().unwrap_or(0),
        msg.clone(),
        e.path().map(str::to_owned),
    );
    match &e {
        Error::InvalidArgument(_) => PyValueError::new_err(msg),
        Error::Timeout => PyTimeoutError::new_err((libc::ETIMEDOUT, msg)),
        Error::Alignment(_) => AlignmentError::new_err(args),
        Error::ShortRead { .. } => ShortReadError::new_err(args),
        Error::Closed(_) => EngineClosedError::new_err(args),
        Error::BackendUnavailable { .. } => BackendUnavailable::new_err(args),
        Error::NoFreeSlot { .. } => NoFreeSlot::new_err(args),
        Error::Os { errno, op, .. } => {
            let mixed = match *errno {
                libc::ENOENT => Some(file_missing(py)),
                libc::EACCES | libc::EPERM => Some(file_permission(py)),
                _ => None,
            };
            match (mixed, *errno) {
                (Some(Ok(t)), _) => PyErr::from_type(t.bind(py).clone(), args),
                (Some(Err(err)), _) => err,
                (None, libc::ENOSPC) => NoSpaceError::new_err(args),
                // EINVAL from a transfer on an O_DIRECT file is an alignment refusal.
                (None, libc::EINVAL) if matches!(*op, "read" | "write") => {
                    AlignmentError::new_err(args)
                }
                _ => BsrIoError::new_err(args),
            }
        }
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        Python::attach(|py| to_pyerr(py, e))
    }
}

fn non_negative(name: &str, v: i64) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| PyValueError::new_err(format!("{name} must be >= 0, got {v}")))
}

fn positive(name: &str, v: i64) -> PyResult<u64> {
    match v {
        1.. => Ok(v as u64),
        _ => Err(PyValueError::new_err(format!(
            "{name} must be positive, got {v}"
        ))),
    }
}

/// A contiguous export of any buffer object, released on drop (with the GIL held).
struct Exported {
    view: Box<ffi::Py_buffer>,
}

impl Exported {
    fn get(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Exported> {
        let mut view = Box::new(ffi::Py_buffer::new());
        let flags = if writable {
            ffi::PyBUF_WRITABLE
        } else {
            ffi::PyBUF_SIMPLE
        };
        // SAFETY: `obj` is a live object (we hold the GIL and a reference); `view` is a
        // boxed Py_buffer that we release exactly once in Drop.
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) } != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(Exported { view })
    }

    fn addr(&self) -> usize {
        self.view.buf as usize
    }

    fn len(&self) -> usize {
        self.view.len as usize
    }
}

impl Drop for Exported {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer; `Exported` is
        // not Send, so this runs on the thread that holds the GIL.
        unsafe { ffi::PyBuffer_Release(&mut *self.view) };
    }
}

#[pyclass(name = "File", module = "bsr_io._core", frozen)]
struct PyFile {
    file: Mutex<Option<Arc<EngineFile>>>,
    path: String,
    direct: bool,
    writable: bool,
    alignment: u64,
    last_size: AtomicU64,
}

impl PyFile {
    fn get(&self) -> PyResult<Arc<EngineFile>> {
        let f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        f.clone().ok_or_else(|| Error::Closed("file").into())
    }
}

#[pymethods]
impl PyFile {
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    #[getter]
    fn size(&self) -> u64 {
        match self.get() {
            Ok(f) => f.size(),
            Err(_) => self.last_size.load(Ordering::Acquire),
        }
    }

    #[getter]
    fn direct(&self) -> bool {
        self.direct
    }

    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }

    #[getter]
    fn alignment(&self) -> u64 {
        self.alignment
    }

    fn fileno(&self) -> PyResult<i32> {
        Ok(self.get()?.fd())
    }

    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        let f = self.get()?;
        Ok(py.detach(|| f.sync())?)
    }

    fn truncate(&self, size: i64) -> PyResult<()> {
        let size = non_negative("size", size)?;
        Ok(self.get()?.truncate(size)?)
    }

    fn close(&self) {
        let taken = self.file.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(f) = taken {
            self.last_size.store(f.size(), Ordering::Release);
            // In-flight operations keep their own reference; the descriptor closes
            // when the last of them completes.
            f.close();
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) {
        self.close();
    }

    fn __repr__(&self) -> String {
        format!(
            "File({:?}, direct={}, writable={}, size={})",
            self.path,
            self.direct,
            self.writable,
            self.size()
        )
    }
}

#[pyclass(name = "Slot", module = "bsr_io._core", frozen, weakref)]
struct PySlot {
    lease: Arc<SlotLease>,
}

#[pymethods]
impl PySlot {
    #[getter]
    fn index(&self) -> usize {
        self.lease.index()
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.lease.capacity()
    }

    #[getter]
    fn address(&self) -> usize {
        self.lease.addr()
    }

    fn __len__(&self) -> usize {
        self.lease.len()
    }

    fn set_length(&self, length: i64) -> PyResult<()> {
        let length = non_negative("length", length)?;
        Ok(self.lease.set_len(length as usize)?)
    }

    #[pyo3(signature = (offset = 0, length = None))]
    fn checksum(&self, py: Python<'_>, offset: i64, length: Option<i64>) -> PyResult<u64> {
        let offset = non_negative("offset", offset)? as usize;
        let length = match length {
            Some(l) => non_negative("length", l)? as usize,
            None => self.lease.len().saturating_sub(offset),
        };
        let lease = Arc::clone(&self.lease);
        py.detach(move || {
            // SAFETY: the slot is leased to Python and no engine operation writes into
            // a leased slot; Python-side writers racing with this would be a caller bug
            // that can only produce a wrong checksum, not unsoundness in Rust state.
            let bytes = unsafe { lease.bytes(offset, length) }?;
            Ok::<_, Error>(checksum::xxh3_64(bytes))
        })
        .map_err(PyErr::from)
    }

    #[pyo3(signature = (data, offset = 0))]
    fn fill_from(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: i64) -> PyResult<()> {
        let offset = non_negative("offset", offset)? as usize;
        let src = Exported::get(data, false)?;
        let (addr, len) = (src.addr(), src.len());
        let lease = Arc::clone(&self.lease);
        py.detach(move || {
            // SAFETY: `src` stays exported (and its memory valid) until it drops after
            // this closure returns; `addr..addr+len` is that export.
            unsafe { lease.copy_in_raw(offset, addr as *const u8, len) }
        })?;
        drop(src);
        Ok(())
    }

    /// Writable export of `len(slot)` bytes. `view.obj` is this Slot, so every view keeps
    /// the slot leased.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("view is NULL"));
        }
        let lease = &slf.get().lease;
        // SAFETY: `view` is a non-null Py_buffer from the caller; the slot memory lives as
        // long as the Slot object, which PyBuffer_FillInfo stores (with a new reference)
        // in view.obj.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                lease.addr() as *mut std::ffi::c_void,
                lease.len() as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "Slot(index={}, len={}, capacity={})",
            self.lease.index(),
            self.lease.len(),
            self.lease.capacity()
        )
    }
}

/// Who gets the slot when the operation is waited on.
enum Handoff {
    /// A read: the filled slot becomes a new `Slot` on the first successful wait.
    Read,
    /// A write: the caller's own slot.
    Write(Py<PySlot>),
    /// Handed out already; a weak reference so the Pending does not pin the slot.
    Given(Py<PyWeakrefReference>),
    /// Being handed out by another thread right now.
    Busy,
}

#[pyclass(name = "Pending", module = "bsr_io._core", frozen)]
struct PyPending {
    op: Pending,
    handoff: Mutex<Handoff>,
}

#[pymethods]
impl PyPending {
    fn done(&self) -> bool {
        self.op.is_done()
    }

    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PySlot>> {
        let timeout = match timeout {
            None => None,
            Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t)),
            Some(t) => {
                return Err(PyValueError::new_err(format!(
                    "timeout must be a non-negative number of seconds, got {t}"
                )))
            }
        };
        let op = &self.op;
        py.detach(|| op.wait(timeout))?;
        let state = std::mem::replace(&mut *self.lock(), Handoff::Busy);
        let slot = match state {
            Handoff::Read => {
                let lease = self.op.take_lease().ok_or_else(|| {
                    PyValueError::new_err("the slot of this read was already handed out")
                })?;
                Py::new(py, PySlot { lease })?
            }
            Handoff::Write(slot) => slot,
            Handoff::Given(weak) => {
                *self.lock() = Handoff::Given(weak.clone_ref(py));
                return match weak.bind(py).upgrade() {
                    Some(s) => Ok(s.cast_into::<PySlot>()?.unbind()),
                    None => Err(PyValueError::new_err(
                        "the slot of this operation was already released",
                    )),
                };
            }
            Handoff::Busy => {
                return Err(PyValueError::new_err(
                    "another thread is taking this operation's slot",
                ))
            }
        };
        let weak = PyWeakrefReference::new(slot.bind(py).as_any())?.unbind();
        *self.lock() = Handoff::Given(weak);
        Ok(slot)
    }

    fn __repr__(&self) -> String {
        let kind = match self.op.kind {
            OpKind::Read => "read",
            OpKind::Write => "write",
        };
        format!(
            "Pending({kind} {} bytes at {} of {:?}, done={})",
            self.op.want,
            self.op.offset,
            self.op.file.path(),
            self.op.is_done()
        )
    }
}

impl PyPending {
    fn lock(&self) -> std::sync::MutexGuard<'_, Handoff> {
        self.handoff.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pyclass(name = "Engine", module = "bsr_io._core", frozen)]
struct PyEngine {
    inner: Engine,
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
        Ok(py.detach(|| self.inner.submit_read(&f, offset, length))?)
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
        let lease = Arc::clone(&slot.get().lease);
        Ok(py.detach(|| self.inner.submit_write(&lease, &f, offset, length))?)
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (window, slot_bytes, *, queue_depth = 32, request_bytes = 1 << 20, backend = None))]
    fn new(
        py: Python<'_>,
        window: i64,
        slot_bytes: i64,
        queue_depth: i64,
        request_bytes: i64,
        backend: Option<&str>,
    ) -> PyResult<Self> {
        let as_usize = |name: &str, v: i64, min: i64| {
            if v < min {
                Err(PyValueError::new_err(format!(
                    "{name} must be at least {min}, got {v}"
                )))
            } else {
                Ok(v as usize)
            }
        };
        let cfg = EngineConfig {
            window: as_usize("window", window, 1)?,
            slot_bytes: as_usize("slot_bytes", slot_bytes, 1)?,
            queue_depth: as_usize("queue_depth", queue_depth, 1)?,
            request_bytes: as_usize("request_bytes", request_bytes, 1)?,
            backend: BackendChoice::resolve(backend)?,
        };
        let inner = py.detach(|| Engine::new(cfg))?;
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
        d.set_item("mlock", f.mlock)?;
        d.set_item("hugepages", f.hugepages)?;
        d.set_item("queue_depth", f.queue_depth)?;
        d.set_item("request_bytes", f.request_bytes)?;
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

    #[pyo3(signature = (path, *, write = false, create = false, direct = true))]
    fn open(
        &self,
        py: Python<'_>,
        path: PathBuf,
        write: bool,
        create: bool,
        direct: bool,
    ) -> PyResult<PyFile> {
        let path = path
            .to_str()
            .ok_or_else(|| PyValueError::new_err("path is not valid UTF-8"))?
            .to_owned();
        let opts = OpenOptions {
            write,
            create,
            direct,
        };
        let f = py.detach(|| self.inner.open(&path, opts))?;
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
        Ok(PySlot {
            lease: self.inner.lease()?,
        })
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
        Ok(py.detach(|| op.wait(None))?)
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

    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close())
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
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

#[pyfunction]
fn xxh3_64(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u64> {
    let src = Exported::get(data, false)?;
    let (addr, len) = (src.addr(), src.len());
    let h = py.detach(move || {
        // SAFETY: the export `src` keeps `addr..addr+len` valid until it drops below.
        checksum::xxh3_64(unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
    });
    drop(src);
    Ok(h)
}

#[pyfunction]
fn dio_alignment(py: Python<'_>, path: PathBuf) -> PyResult<(u64, u64)> {
    let path = path
        .to_str()
        .ok_or_else(|| PyValueError::new_err("path is not valid UTF-8"))?
        .to_owned();
    let a = py.detach(|| crate::align::probe_path(&path))?;
    Ok((a.mem, a.offset))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyEngine>()?;
    m.add_class::<PyFile>()?;
    m.add_class::<PySlot>()?;
    m.add_class::<PyPending>()?;
    m.add("BsrIoError", py.get_type::<BsrIoError>())?;
    m.add("AlignmentError", py.get_type::<AlignmentError>())?;
    m.add("ShortReadError", py.get_type::<ShortReadError>())?;
    m.add("EngineClosedError", py.get_type::<EngineClosedError>())?;
    m.add("BackendUnavailable", py.get_type::<BackendUnavailable>())?;
    m.add("NoFreeSlot", py.get_type::<NoFreeSlot>())?;
    m.add("NoSpaceError", py.get_type::<NoSpaceError>())?;
    m.add("FileMissingError", file_missing(py)?.clone_ref(py))?;
    m.add("FilePermissionError", file_permission(py)?.clone_ref(py))?;
    m.add_function(wrap_pyfunction!(xxh3_64, m)?)?;
    m.add_function(wrap_pyfunction!(dio_alignment, m)?)?;
    Ok(())
}
