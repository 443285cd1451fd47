//! `File`: an engine file (O_DIRECT where the filesystem allows) as a Python object.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use bsr_io_core::{EngineFile, Error};

use crate::errors::{py_err, Raise};
use crate::non_negative;

#[pyclass(name = "File", module = "bsr_io._core", frozen)]
pub(crate) struct PyFile {
    pub(crate) file: Mutex<Option<Arc<EngineFile>>>,
    pub(crate) path: String,
    pub(crate) direct: bool,
    pub(crate) writable: bool,
    pub(crate) alignment: u64,
    pub(crate) last_size: AtomicU64,
}

impl PyFile {
    pub(crate) fn get(&self) -> PyResult<Arc<EngineFile>> {
        let f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        f.clone().ok_or_else(|| py_err(Error::Closed("file")))
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
        py.detach(|| f.sync()).raise()
    }

    fn truncate(&self, size: i64) -> PyResult<()> {
        let size = non_negative("size", size)?;
        self.get()?.truncate(size).raise()
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
