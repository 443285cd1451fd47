//! `Slot`: one leased staging slot, exported to Python through the buffer protocol, and
//! `Exported`, a borrowed export of any Python buffer.

use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use bsr_io_core::checksum::{self, Xxh3Prefetch};
use bsr_io_core::install::{self, Run, Span};
use bsr_io_core::{Error, SlotLease};

use crate::errors::Raise;
use crate::non_negative;
use bsr_io_core::claims::Claim;

/// A contiguous export of any buffer object, released on drop (with the GIL held).
pub(crate) struct Exported {
    view: Box<ffi::Py_buffer>,
}

impl Exported {
    pub(crate) fn get(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Exported> {
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

    pub(crate) fn addr(&self) -> usize {
        self.view.buf as usize
    }

    pub(crate) fn len(&self) -> usize {
        self.view.len as usize
    }
}

/// Exports of `bufs` (writable ones for destinations) and their spans, in order: the
/// exports pin the memory for as long as the caller keeps them.
pub(crate) fn export_spans(
    bufs: &[Bound<'_, PyAny>],
    writable: bool,
) -> PyResult<(Vec<Exported>, Vec<Span>)> {
    let exports = bufs
        .iter()
        .map(|b| Exported::get(b, writable))
        .collect::<PyResult<Vec<_>>>()?;
    let spans = exports
        .iter()
        .map(|e| Span {
            addr: e.addr(),
            len: e.len(),
        })
        .collect();
    Ok((exports, spans))
}

/// (buffer index, offset in it, source offset, length) tuples as the core's runs.
pub(crate) fn to_runs(runs: Vec<(usize, usize, usize, usize)>) -> Vec<Run> {
    runs.into_iter()
        .map(|(dst, dst_offset, src_offset, len)| Run {
            dst,
            dst_offset,
            src_offset,
            len,
        })
        .collect()
}

impl Drop for Exported {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer; `Exported` is
        // not Send, so this runs on the thread that holds the GIL.
        unsafe { ffi::PyBuffer_Release(&mut *self.view) };
    }
}

#[pyclass(name = "Slot", module = "bsr_io._core", frozen, weakref)]
pub(crate) struct PySlot {
    pub(crate) lease: Arc<SlotLease>,
    /// Live buffer exports (memoryviews, numpy arrays, tensors made through one): the
    /// slot is not given back, nor written to a file, while any of them lives.
    exports: AtomicUsize,
    /// Exports ever made: a view made since `gathered` was set may have written.
    export_count: AtomicU64,
    /// The xxh3-64 `gather` computed of the bytes it wrote, while nothing else can have
    /// changed them since (`checksum` then returns it: a save hashes its record in the
    /// copy's pass, and hands the GIL over once per record fewer).
    gathered: Mutex<Option<Gathered>>,
}

#[derive(Clone, Copy)]
struct Gathered {
    len: usize,
    xxh3: u64,
    export_count: u64,
}

impl PySlot {
    pub(crate) fn new(lease: Arc<SlotLease>) -> PySlot {
        PySlot {
            lease,
            exports: AtomicUsize::new(0),
            export_count: AtomicU64::new(0),
            gathered: Mutex::new(None),
        }
    }

    /// `gather`'s hash, if the slot's valid bytes are still exactly what it wrote.
    fn gathered_xxh3(&self) -> Option<u64> {
        let g = (*self.gathered.lock().ok()?)?;
        let unchanged = g.len == self.lease.len()
            && g.export_count == self.export_count.load(Ordering::Acquire)
            && self.exports.load(Ordering::Acquire) == 0;
        unchanged.then_some(g.xxh3)
    }

    fn forget_gathered(&self) {
        if let Ok(mut g) = self.gathered.lock() {
            *g = None;
        }
    }

    /// Refuse to hand the slot to a write while Python can still change its bytes.
    pub(crate) fn check_no_views(&self) -> PyResult<()> {
        match self.exports.load(Ordering::Acquire) {
            0 => Ok(()),
            n => Err(PyBufferError::new_err(format!(
                "{n} view(s) of the slot are alive (memoryview, numpy array, tensor); \
                 drop them before the slot is written or released"
            ))),
        }
    }
}

#[pymethods]
impl PySlot {
    /// Give the slot back to the engine's ring now, deterministically. Refused (BufferError)
    /// while a view of it lives, (ValueError) while a write from it is in flight; with
    /// `after_writes`, such a write keeps the slot until it ends and then returns it
    /// itself (a publication given up at its deadline whose write the kernel still holds).
    /// Later use of this Slot raises ValueError; releasing twice is a no-op.
    #[pyo3(signature = (*, after_writes = false))]
    fn release(&self, after_writes: bool) -> PyResult<()> {
        self.check_no_views()?;
        if after_writes {
            self.lease.release_after_writes();
            return Ok(());
        }
        self.lease.release().raise()
    }

    #[getter]
    fn released(&self) -> bool {
        self.lease.is_released()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Release on leaving the block, whatever happened inside it.
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> PyResult<()> {
        self.release(false)
    }

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
        self.forget_gathered();
        let length = non_negative("length", length)?;
        self.lease.set_len(length as usize).raise()
    }

    #[pyo3(signature = (offset = 0, length = None))]
    fn checksum(&self, py: Python<'_>, offset: i64, length: Option<i64>) -> PyResult<u64> {
        let offset = non_negative("offset", offset)? as usize;
        let length = match length {
            Some(l) => non_negative("length", l)? as usize,
            None => self.lease.len().saturating_sub(offset),
        };
        if offset == 0 && length == self.lease.len() {
            if let Some(h) = self.gathered_xxh3() {
                return Ok(h);
            }
        }
        let lease = Arc::clone(&self.lease);
        py.detach(move || {
            // SAFETY: the slot is leased to Python and no engine operation writes into
            // a leased slot; Python-side writers racing with this would be a caller bug
            // that can only produce a wrong checksum, not unsoundness in Rust state.
            let bytes = unsafe { lease.bytes(offset, length) }?;
            Ok::<_, Error>(checksum::xxh3_64(bytes))
        })
        .raise()
    }

    #[pyo3(signature = (data, offset = 0))]
    fn fill_from(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: i64) -> PyResult<()> {
        self.forget_gathered();
        let offset = non_negative("offset", offset)? as usize;
        let src = Exported::get(data, false)?;
        let (addr, len) = (src.addr(), src.len());
        let lease = Arc::clone(&self.lease);
        py.detach(move || {
            // SAFETY: `src` stays exported (and its memory valid) until it drops after
            // this closure returns; `addr..addr+len` is that export.
            unsafe { lease.copy_in_raw(offset, addr as *const u8, len) }
        })
        .raise()?;
        drop(src);
        Ok(())
    }

    /// Copy the slot's valid bytes into the writable buffers `dsts` along `runs`
    /// ((buffer index, offset in it, slot offset, length), in slot order) and return
    /// the xxh3-64 of all the valid bytes: verify-while-install, one pass over the slot,
    /// GIL released.
    fn install_xxh3(
        &self,
        py: Python<'_>,
        dsts: Vec<Bound<'_, PyAny>>,
        runs: Vec<(usize, usize, usize, usize)>,
    ) -> PyResult<u64> {
        let (exports, spans) = export_spans(&dsts, true)?;
        let (slot_addr, slot_len) = (self.lease.addr(), self.lease.len());
        // A destination must not overlap the slot being read.
        if spans
            .iter()
            .any(|d| d.addr < slot_addr + slot_len && slot_addr < d.addr + d.len)
        {
            return Err(Error::invalid(
                "an install destination overlaps the slot it is copied from",
            ))
            .raise();
        }
        let runs = to_runs(runs);
        let lens: Vec<usize> = spans.iter().map(|d| d.len).collect();
        install::check_runs(slot_len, &lens, &runs).raise()?;
        // Exactly the bytes this call writes, held until it returns: another thread's
        // install of another chunk into the same buffers claims other ranges.
        let claim = Claim::take(install::run_ranges(&spans, &runs)).raise()?;
        let lease = Arc::clone(&self.lease);
        let hash = py
            .detach(move || {
                // SAFETY: the slot is leased to Python, so no engine operation writes into
                // it; its valid bytes live as long as `lease`.
                let src = unsafe { lease.bytes(0, slot_len) }?;
                // SAFETY: each span is a writable export held in `exports` until after
                // this closure returns, so the runs' bytes are valid for writes; `claim`
                // holds exactly those bytes, so no other install or in-place hash on any
                // thread touches them meanwhile (Python code writing the same tensors
                // during an install is the caller's error, as with any buffer export).
                let h = unsafe { install::copy_runs_xxh3_raw(src, &spans, &runs) };
                drop(claim);
                h
            })
            .raise()?;
        drop(exports);
        Ok(hash)
    }

    /// Copy `runs` ((buffer index, offset in it, slot offset, length), in slot order) of
    /// the buffers `srcs` into the slot's valid bytes and zero the bytes no run covers:
    /// a record gathered from scattered pages in one call, GIL released (a save's cut on
    /// vLLM's forward thread hands the GIL to other threads once, not once per page).
    /// Returns the xxh3-64 of the valid bytes, hashed run by run while they are still in
    /// cache; `checksum()` of the whole slot returns it until the bytes may have changed.
    fn gather(
        &self,
        py: Python<'_>,
        srcs: Vec<Bound<'_, PyAny>>,
        runs: Vec<(usize, usize, usize, usize)>,
    ) -> PyResult<u64> {
        self.forget_gathered();
        let (exports, spans) = export_spans(&srcs, false)?;
        let slot_len = self.lease.len();
        let runs = to_runs(runs);
        let lens: Vec<usize> = spans.iter().map(|d| d.len).collect();
        install::check_runs(slot_len, &lens, &runs).raise()?;
        // A view alive now could write while the GIL is released: no hash is kept then.
        let count = self.export_count.load(Ordering::Acquire);
        let viewless = self.exports.load(Ordering::Acquire) == 0;
        let lease = Arc::clone(&self.lease);
        let xxh3 = py
            .detach(move || {
                let mut hash = Xxh3Prefetch::new();
                let mut end = 0;
                for r in &runs {
                    lease.zero(end, r.src_offset)?;
                    let src = (spans[r.dst].addr + r.dst_offset) as *const u8;
                    // SAFETY: `check_runs` put the run inside its source's export, which
                    // `exports` holds until after this closure returns.
                    unsafe { lease.copy_in_raw(r.src_offset, src, r.len) }?;
                    let next = r.src_offset + r.len;
                    // SAFETY: the slot is leased to Python and this call is what writes
                    // it; the bytes were just written, in bounds (`check_runs`).
                    hash.write(unsafe { lease.bytes(end, next - end) }?);
                    end = next;
                }
                lease.zero(end, slot_len)?;
                // SAFETY: as above, the tail just zeroed.
                hash.write(unsafe { lease.bytes(end, slot_len - end) }?);
                Ok::<_, Error>(hash.finish())
            })
            .raise()?;
        drop(exports);
        if viewless {
            if let Ok(mut g) = self.gathered.lock() {
                *g = Some(Gathered {
                    len: slot_len,
                    xxh3,
                    export_count: count,
                });
            }
        }
        Ok(xxh3)
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
        if lease.is_released() {
            return Err(PyBufferError::new_err(
                "the slot was released; lease a new one (engine.lease())",
            ));
        }
        if lease.write_in_flight() {
            // The write owns the slot until it completes: no Python view meanwhile.
            return Err(PyBufferError::new_err(
                "a write from this slot is in flight; wait for it before viewing the slot",
            ));
        }
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
        slf.get().exports.fetch_add(1, Ordering::AcqRel);
        slf.get().export_count.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.fetch_sub(1, Ordering::AcqRel);
    }

    fn __repr__(&self) -> String {
        format!(
            "Slot(index={}, len={}, capacity={}{})",
            self.lease.index(),
            self.lease.len(),
            self.lease.capacity(),
            if self.lease.is_released() {
                ", released"
            } else {
                ""
            }
        )
    }
}
