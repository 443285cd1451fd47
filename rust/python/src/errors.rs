//! The exception tree of `bsr_io._core` and the mapping of the core's `Error` onto it:
//! every engine error is an `OSError` with errno set.

use pyo3::create_exception;
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyPermissionError};
use pyo3::exceptions::{PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use bsr_io_core::Error;

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

pub(crate) fn file_missing(py: Python<'_>) -> PyResult<&Py<PyType>> {
    FILE_MISSING.get_or_try_init(py, || {
        mixed_type(
            py,
            "FileMissingError",
            py.get_type::<PyFileNotFoundError>(),
            "The file does not exist (ENOENT).",
        )
    })
}

pub(crate) fn file_permission(py: Python<'_>) -> PyResult<&Py<PyType>> {
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

/// The Python exception for a core error. (The orphan rule forbids `From<Error> for
/// PyErr` outside the core crate, and the core has no Python in it.)
pub(crate) fn py_err(e: Error) -> PyErr {
    Python::attach(|py| to_pyerr(py, e))
}

/// `result.raise()?`: a core result as a Python one.
pub(crate) trait Raise<T> {
    fn raise(self) -> PyResult<T>;
}

impl<T> Raise<T> for bsr_io_core::Result<T> {
    fn raise(self) -> PyResult<T> {
        self.map_err(py_err)
    }
}
