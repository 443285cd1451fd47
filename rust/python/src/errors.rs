//! The exception tree of `bsr_io._core` and the mapping of the core's `Error` onto it.
//!
//! `BsrError` is the root of every bsr-io error (the Python package derives its chunk,
//! layout, capacity and record-format errors from it). `BsrIoError`, the root of the
//! engine's errors, derives from both `BsrError` and `OSError` (errno, strerror and
//! filename set). A bad argument raises `BsrValueError` or `BsrTypeError`: a `BsrError`
//! and the matching built-in, so `except ValueError` and `except BsrError` both catch it.
//! PyO3's `create_exception!` takes one static base, so these classes are made once with
//! `type(name, bases, ns)` and cached.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyFileNotFoundError, PyOSError, PyPermissionError};
use pyo3::exceptions::{PyTimeoutError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use bsr_io_core::Error;

create_exception!(
    bsr_io._core,
    BsrError,
    PyException,
    "Root of every bsr-io error: the engine's, and chunk, layout, capacity and record-format errors."
);

/// The engine's exception classes, in creation order (each base before its subclasses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exc {
    BsrIo,
    Alignment,
    ShortRead,
    EngineClosed,
    BackendUnavailable,
    NoFreeSlot,
    NoSpace,
    FileMissing,
    FilePermission,
    WaitTimeout,
    EngineBroken,
    NoMemory,
    KernelOwned,
    Value,
    Type,
}

impl Exc {
    pub(crate) const ALL: [Exc; 15] = [
        Exc::BsrIo,
        Exc::Alignment,
        Exc::ShortRead,
        Exc::EngineClosed,
        Exc::BackendUnavailable,
        Exc::NoFreeSlot,
        Exc::NoSpace,
        Exc::FileMissing,
        Exc::FilePermission,
        Exc::WaitTimeout,
        Exc::EngineBroken,
        Exc::NoMemory,
        Exc::KernelOwned,
        Exc::Value,
        Exc::Type,
    ];

    /// Class name and docstring.
    pub(crate) fn spec(self) -> (&'static str, &'static str) {
        match self {
            Exc::BsrIo => (
                "BsrIoError",
                "Root of engine errors: a BsrError and an OSError; errno is set.",
            ),
            Exc::Alignment => (
                "AlignmentError",
                "O_DIRECT refused an offset, length or address (EINVAL).",
            ),
            Exc::ShortRead => (
                "ShortReadError",
                "The file ended before the requested range did.",
            ),
            Exc::EngineClosed => ("EngineClosedError", "The engine (or file) was closed."),
            Exc::BackendUnavailable => (
                "BackendUnavailable",
                "The requested backend cannot run here.",
            ),
            Exc::NoFreeSlot => ("NoFreeSlot", "All slots are leased or in flight (EAGAIN)."),
            Exc::NoSpace => ("NoSpaceError", "The device is full (ENOSPC)."),
            Exc::FileMissing => (
                "FileMissingError",
                "The file does not exist (ENOENT); also a FileNotFoundError.",
            ),
            Exc::FilePermission => (
                "FilePermissionError",
                "Access to the file was refused (EACCES, EPERM); also a PermissionError.",
            ),
            Exc::WaitTimeout => (
                "WaitTimeoutError",
                "A wait ran past its timeout (ETIMEDOUT); also a TimeoutError.",
            ),
            Exc::EngineBroken => (
                "EngineBrokenError",
                "The engine's I/O thread met an error it cannot retry, or panicked: every \
                 queued and in-flight operation failed with it (errno kept) and no more I/O \
                 is accepted. Close the engine and create a new one.",
            ),
            Exc::KernelOwned => (
                "KernelOwnedError",
                "The engine broke down while the kernel held a direct read: its destination \
                 blocks are still owned by the kernel, may be written at any time, and stay \
                 exported (never handed back). An EngineBrokenError.",
            ),
            Exc::NoMemory => (
                "NoMemoryError",
                "The staging arena does not fit in the memory available (ENOMEM); the \
                 message says how many bytes were asked and how many are available.",
            ),
            Exc::Value => (
                "BsrValueError",
                "An argument of the right type but a wrong value: a BsrError and a ValueError.",
            ),
            Exc::Type => (
                "BsrTypeError",
                "An argument of a wrong type: a BsrError and a TypeError.",
            ),
        }
    }

    fn bases<'py>(self, py: Python<'py>, made: &[Py<PyType>]) -> PyResult<Bound<'py, PyTuple>> {
        let root = || made[0].bind(py).clone();
        match self {
            Exc::BsrIo => PyTuple::new(py, [py.get_type::<BsrError>(), py.get_type::<PyOSError>()]),
            Exc::FileMissing => PyTuple::new(py, [root(), py.get_type::<PyFileNotFoundError>()]),
            Exc::FilePermission => PyTuple::new(py, [root(), py.get_type::<PyPermissionError>()]),
            Exc::WaitTimeout => PyTuple::new(py, [root(), py.get_type::<PyTimeoutError>()]),
            Exc::Value => PyTuple::new(
                py,
                [py.get_type::<BsrError>(), py.get_type::<PyValueError>()],
            ),
            Exc::Type => PyTuple::new(
                py,
                [py.get_type::<BsrError>(), py.get_type::<PyTypeError>()],
            ),
            Exc::KernelOwned => {
                let broken = Exc::ALL.iter().position(|x| *x == Exc::EngineBroken);
                PyTuple::new(py, [made[broken.unwrap_or(0)].bind(py).clone()])
            }
            _ => PyTuple::new(py, [root()]),
        }
    }
}

static TYPES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

/// The class of `e`, made on first use.
pub(crate) fn exc_type(py: Python<'_>, e: Exc) -> PyResult<Bound<'_, PyType>> {
    let types = TYPES.get_or_try_init(py, || {
        let mut made: Vec<Py<PyType>> = Vec::with_capacity(Exc::ALL.len());
        for exc in Exc::ALL {
            let (name, doc) = exc.spec();
            let ns = PyDict::new(py);
            ns.set_item("__module__", "bsr_io._core")?;
            ns.set_item("__doc__", doc)?;
            let bases = exc.bases(py, &made)?;
            let t = py.get_type::<PyType>().call1((name, bases, ns))?;
            made.push(t.cast_into::<PyType>()?.unbind());
        }
        Ok::<_, PyErr>(made)
    })?;
    let i = Exc::ALL.iter().position(|x| *x == e).unwrap_or(0);
    Ok(types[i].bind(py).clone())
}

fn to_pyerr(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    let args = (
        e.errno().unwrap_or(0),
        msg.clone(),
        e.path().map(str::to_owned),
    );
    let exc = match &e {
        Error::InvalidArgument(_) => return value_error_in(py, Exc::Value, msg),
        Error::Timeout | Error::Stalled { .. } => Exc::WaitTimeout,
        Error::Withdrawn => Exc::BsrIo,
        Error::Alignment(_) => Exc::Alignment,
        Error::ShortRead { .. } => Exc::ShortRead,
        Error::Closed(_) => Exc::EngineClosed,
        Error::BackendUnavailable { .. } => Exc::BackendUnavailable,
        Error::NoFreeSlot { .. } => Exc::NoFreeSlot,
        Error::Broken { .. } => Exc::EngineBroken,
        Error::KernelOwned { .. } => Exc::KernelOwned,
        Error::NoMemory { .. } => Exc::NoMemory,
        Error::Os { errno, op, .. } => match *errno {
            libc::ENOENT => Exc::FileMissing,
            libc::EACCES | libc::EPERM => Exc::FilePermission,
            libc::ENOSPC => Exc::NoSpace,
            // EINVAL from a transfer on an O_DIRECT file is an alignment refusal.
            libc::EINVAL if matches!(*op, "read" | "write") => Exc::Alignment,
            _ => Exc::BsrIo,
        },
    };
    let err = match exc_type(py, exc) {
        Ok(t) => PyErr::from_type(t, args),
        Err(err) => return err,
    };
    if let Error::Stalled { step, .. } = e {
        // Which step of a publication was under way, for the caller's message.
        if let Err(failed) = err.value(py).setattr("step", step) {
            return failed;
        }
    }
    err
}

/// A `BsrValueError` or `BsrTypeError` (`exc`) saying `msg`.
fn value_error_in(py: Python<'_>, exc: Exc, msg: String) -> PyErr {
    match exc_type(py, exc) {
        Ok(t) => PyErr::from_type(t, (msg,)),
        Err(err) => err,
    }
}

/// `BsrValueError(msg)`: an argument of the right type and a wrong value.
pub(crate) fn value_err(msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| value_error_in(py, Exc::Value, msg))
}

/// `BsrTypeError(msg)`: an argument of a wrong type.
pub(crate) fn type_err(msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| value_error_in(py, Exc::Type, msg))
}

/// The integer argument `name`, or `BsrTypeError` naming it: PyO3's own conversion of a
/// typed parameter raises a plain `TypeError`, which is not a `BsrError`.
pub(crate) fn int_arg(arg: &Bound<'_, PyAny>, name: &str) -> PyResult<i64> {
    arg.extract::<i64>().map_err(|_| {
        let got = arg
            .get_type()
            .name()
            .map_or_else(|_| "?".to_string(), |n| n.to_string());
        type_err(format!("{name} must be an integer, got {got}"))
    })
}

/// The optional string argument `name`, or `BsrTypeError` naming it.
pub(crate) fn opt_str_arg(arg: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<String>> {
    match arg {
        None => Ok(None),
        Some(a) if a.is_none() => Ok(None),
        Some(a) => a.extract::<String>().map(Some).map_err(|_| {
            let got = a
                .get_type()
                .name()
                .map_or_else(|_| "?".to_string(), |n| n.to_string());
            type_err(format!("{name} must be a string or None, got {got}"))
        }),
    }
}

/// The Python exception for a core error. (The orphan rule forbids `From<Error> for
/// PyErr` outside the core crate, and the core has no Python in it.)
pub(crate) fn py_err(e: Error) -> PyErr {
    Python::attach(|py| to_pyerr(py, e))
}

/// `result.raise()?` for a wait on `op`: a timeout says where the op is (in the kernel,
/// or queued in the engine), which a plain timeout cannot tell apart.
pub(crate) fn raise_wait<T>(res: bsr_io_core::Result<T>, op: &bsr_io_core::Pending) -> PyResult<T> {
    match res {
        Err(Error::Timeout) => Python::attach(|py| {
            let msg = format!("{}: {}", Error::Timeout, op.whereabouts());
            let args = (libc::ETIMEDOUT, msg, None::<String>);
            match exc_type(py, Exc::WaitTimeout) {
                Ok(t) => Err(PyErr::from_type(t, args)),
                Err(err) => Err(err),
            }
        }),
        other => other.raise(),
    }
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
