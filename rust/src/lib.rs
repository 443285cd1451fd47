//! bsr-io engine: io_uring O_DIRECT reads and writes between files and a ring of W
//! page-aligned staging slots. Plain Rust; `python.rs` is the only PyO3 module.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod align;
pub mod arena;
pub mod backend;
pub mod checksum;
pub mod engine;
pub mod error;
pub mod file;

#[cfg(feature = "python")]
mod python;

pub use arena::{Arena, SlotLease};
pub use backend::{OpState, Pending};
pub use engine::{BackendChoice, Engine, EngineConfig, Features};
pub use error::{Error, Result};
pub use file::{EngineFile, OpenOptions};
