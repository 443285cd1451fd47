//! `stall_publish`: the publication stall double (core `publish::stall`) for Python
//! tests, which provoke a stalled drive with it. Nothing else arms it.

use std::sync::Arc;

use pyo3::prelude::*;

use bsr_io_core::publish::stall::{self, Stall};
use bsr_io_core::publish::Step;

use crate::errors::value_err;

#[pyclass(name = "PublishStall", module = "bsr_io._core", frozen)]
pub(crate) struct PyPublishStall {
    stall: Arc<Stall>,
}

#[pymethods]
impl PyPublishStall {
    /// Publications it has held.
    #[getter]
    fn hits(&self) -> usize {
        self.stall.hits()
    }

    /// The kernel thread ids of the publications it held (their runners), in order.
    #[getter]
    fn threads(&self) -> Vec<i32> {
        self.stall.threads()
    }

    /// Let the held ones go on; hold no more.
    fn release(&self) {
        self.stall.release();
    }
}

/// Hold every publication whose temp file is under `under` at `step` ("create",
/// "write", "fdatasync", "rename", "dirsync"), just before its system call, until
/// `release()`: a fault double of a stalled drive.
#[pyfunction]
pub(crate) fn stall_publish(step: &str, under: &str) -> PyResult<PyPublishStall> {
    let step =
        Step::parse(step).ok_or_else(|| value_err(format!("no publication step {step:?}")))?;
    Ok(PyPublishStall {
        stall: stall::arm(step, under),
    })
}
