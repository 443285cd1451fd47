//! `Pending`: one submitted read or write, and who gets its slot when it is waited on.

use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyWeakrefReference;

use bsr_io_core::backend::OpKind;
use bsr_io_core::Pending;

use crate::errors::{raise_wait, value_err};
use crate::slot::PySlot;

/// Who gets the slot when the operation is waited on.
pub(crate) enum Handoff {
    /// A read: the filled slot becomes a new `Slot` on the first successful wait.
    Read,
    /// A write: the caller's own slot.
    Write(Py<PySlot>),
    /// Handed out already; a weak reference so the Pending does not pin the slot.
    Given(Py<PyWeakrefReference>),
    /// Being handed out by another thread right now.
    Busy,
}

/// A wait's `timeout` argument: None waits for good; a negative or non-finite number is
/// the caller's error.
pub(crate) fn timeout_arg(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Some(Duration::from_secs_f64(t))),
        Some(t) => Err(value_err(format!(
            "timeout must be a non-negative number of seconds, got {t}"
        ))),
    }
}

#[pyclass(name = "Pending", module = "bsr_io._core", frozen)]
pub(crate) struct PyPending {
    pub(crate) op: Pending,
    pub(crate) handoff: Mutex<Handoff>,
}

#[pymethods]
impl PyPending {
    fn done(&self) -> bool {
        self.op.is_done()
    }

    /// Give a read up if none of it has reached the kernel yet: True then, and its slot
    /// goes back to the ring at once; False once the kernel has it (or for a write).
    fn withdraw(&self) -> bool {
        self.op.withdraw()
    }

    #[pyo3(signature = (timeout = None))]
    pub(crate) fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PySlot>> {
        let timeout = timeout_arg(timeout)?;
        let op = &self.op;
        raise_wait(py.detach(|| op.wait(timeout)), op)?;
        let state = std::mem::replace(&mut *self.lock(), Handoff::Busy);
        let slot = match state {
            Handoff::Read => {
                let lease = self
                    .op
                    .take_lease()
                    .ok_or_else(|| value_err("the slot of this read was already handed out"))?;
                Py::new(py, PySlot::new(lease))?
            }
            Handoff::Write(slot) => slot,
            Handoff::Given(weak) => {
                *self.lock() = Handoff::Given(weak.clone_ref(py));
                return match weak.bind(py).upgrade() {
                    Some(s) => Ok(s.cast_into::<PySlot>()?.unbind()),
                    None => Err(value_err("the slot of this operation was already released")),
                };
            }
            Handoff::Busy => {
                return Err(value_err("another thread is taking this operation's slot"))
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
            OpKind::Sync => "sync",
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
