//! PyO3 bindings of `bsr-io-core`: the `bsr_io._core` extension module. Converts between
//! Python objects and the engine, releases the GIL around every submit and wait, and maps
//! the core's `Error` onto an exception tree (errors.rs). One module per exposed type.

#![deny(clippy::undocumented_unsafe_blocks)]

mod direct;
mod engine;
mod errors;
mod file;
mod pending;
mod slot;
mod stall;

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyList};

use bsr_io_core::{align, checksum, prefix};

use crate::errors::{exc_type, type_err, value_err, BsrError, Exc, Raise};
use crate::slot::Exported;

pub(crate) fn non_negative(name: &str, v: i64) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| value_err(format!("{name} must be >= 0, got {v}")))
}

pub(crate) fn positive(name: &str, v: i64) -> PyResult<u64> {
    match v {
        1.. => Ok(v as u64),
        _ => Err(value_err(format!("{name} must be positive, got {v}"))),
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

/// Token bytes from which the prefix hash runs without the GIL: 32K int64 tokens, the
/// scheduler's `hash_inline_tokens`, past which it hashes on a thread of its own anyway.
/// Below it the GIL is kept: given away, it went to another thread of vLLM's engine core
/// and came back only after that thread's turn, so a 1,536-token prompt's hash took
/// 0.79 ms on the scheduler thread at saturation where the hash itself takes 0.024 ms.
const DETACH_BYTES: usize = 32_768 * 8;

/// `prefix::chain` over `le` (int64 tokens), without the GIL from `DETACH_BYTES` up.
fn chain_of(py: Python<'_>, prev: u128, le: &[u8], chunk: usize) -> Vec<u128> {
    if le.len() < DETACH_BYTES {
        prefix::chain(prev, le, chunk)
    } else {
        py.detach(|| prefix::chain(prev, le, chunk))
    }
}

/// Chained prefix hashes (`bsr_io.keys.extend_prefix_hashes`): `tokens` is a list of ints
/// or little-endian int64 bytes. A list's ints are read with the GIL held, the hashing of
/// a long prompt runs without it, so a scheduler thread hashing one does not stall the
/// others.
#[pyfunction]
#[pyo3(signature = (tokens, chunk_tokens, prev = 0))]
fn prefix_hashes(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    chunk_tokens: i64,
    prev: u128,
) -> PyResult<Vec<u128>> {
    let chunk = positive("chunk_tokens", chunk_tokens)? as usize;
    if let Ok(raw) = tokens.cast::<PyBytes>() {
        let raw = raw.as_bytes();
        if raw.len() % 8 != 0 {
            return Err(value_err(format!(
                "token bytes must be int64s, got {} bytes",
                raw.len()
            )));
        }
        // bytes are immutable and `tokens` keeps them alive while the GIL is released.
        return Ok(chain_of(py, prev, raw, chunk));
    }
    let list = tokens
        .cast::<PyList>()
        .map_err(|_| type_err("tokens must be a list of ints or little-endian int64 bytes"))?;
    let mut le = Vec::with_capacity(list.len() * 8);
    for (i, t) in list.iter().enumerate() {
        // Python's bool is an int: refuse it, as numpy's dtype check does for arrays.
        if t.is_instance_of::<PyBool>() {
            return Err(type_err(format!(
                "token ids must be integers, got bool at index {i}"
            )));
        }
        le.extend_from_slice(&t.extract::<i64>()?.to_le_bytes());
    }
    Ok(chain_of(py, prev, &le, chunk))
}

#[pyfunction]
fn dio_alignment(py: Python<'_>, path: PathBuf) -> PyResult<(u64, u64)> {
    let path = path
        .to_str()
        .ok_or_else(|| value_err("path is not valid UTF-8"))?
        .to_owned();
    let a = py.detach(|| align::probe_path(&path)).raise()?;
    Ok((a.mem, a.offset))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<file::PyFile>()?;
    m.add_class::<slot::PySlot>()?;
    m.add_class::<pending::PyPending>()?;
    m.add_class::<direct::PyDirectRead>()?;
    m.add_class::<direct::PyMemoryRegistration>()?;
    m.add_class::<stall::PyPublishStall>()?;
    m.add("BsrError", py.get_type::<BsrError>())?;
    for exc in Exc::ALL {
        m.add(exc.spec().0, exc_type(py, exc)?)?;
    }
    m.add_function(wrap_pyfunction!(xxh3_64, m)?)?;
    m.add_function(wrap_pyfunction!(dio_alignment, m)?)?;
    m.add_function(wrap_pyfunction!(prefix_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(direct::xxh3_runs, m)?)?;
    m.add_function(wrap_pyfunction!(stall::stall_publish, m)?)?;
    Ok(())
}
