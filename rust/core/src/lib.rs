//! bsr-io engine: io_uring O_DIRECT reads and writes between files and a ring of W
//! page-aligned staging slots. Plain Rust, no Python: the `bsr-io-python` crate binds it
//! as `bsr_io._core`.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod align;
pub mod arena;
pub mod backend;
pub mod checksum;
pub mod claims;
pub mod engine;
pub mod error;
pub mod file;
pub mod fstype;
pub mod install;
pub mod landing;
pub mod prefix;
pub mod publish;

pub use arena::{Arena, SlotLease};
pub use backend::trace::TraceEvent;
pub use backend::{OpState, Pending};
pub use engine::{BackendChoice, Engine, EngineConfig, Features, MemoryRegistration};
pub use error::{Error, Result};
pub use file::{EngineFile, OpenOptions};
