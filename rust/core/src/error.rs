//! One error type for the engine. Every variant knows its errno so the binding can
//! raise an `OSError` subclass with `errno` set.

use std::fmt;

/// What went wrong, with enough context to say so in one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A system call failed; `errno` is what the kernel returned.
    Os {
        op: &'static str,
        path: Option<String>,
        errno: i32,
    },
    /// O_DIRECT constraints not met (offset, length or address not aligned).
    Alignment(String),
    /// The file ended before the requested range did.
    ShortRead {
        path: String,
        offset: u64,
        wanted: u64,
        got: u64,
    },
    /// The engine (or the file) was closed.
    Closed(&'static str),
    /// A backend that was asked for explicitly cannot run.
    BackendUnavailable {
        backend: &'static str,
        errno: i32,
        reason: String,
    },
    /// Every slot of the window is leased or in flight.
    NoFreeSlot { window: usize },
    /// The I/O thread met an error it cannot retry, or panicked: every queued and
    /// in-flight operation failed with it, and the engine takes no more I/O.
    Broken { errno: i32, reason: String },
    /// The engine broke down while the kernel still held a direct read: the caller's
    /// memory it targets may still be written, so it is not the caller's to reuse.
    KernelOwned { errno: i32, reason: String },
    /// The staging arena would not fit in the memory this process can get.
    NoMemory {
        asked: u64,
        /// Kept free beyond `asked` for the rest of the process.
        headroom: u64,
        available: u64,
        /// Where `available` comes from (MemAvailable, a cgroup limit, the kernel).
        source: &'static str,
    },
    /// A caller passed something invalid; the message says what.
    InvalidArgument(String),
    /// A wait ran past its timeout.
    Timeout,
    /// Its caller withdrew the read before any of it reached the kernel.
    Withdrawn,
    /// A publication was still in `step` at its deadline (publish.rs): the device
    /// stalled, or the machine is starved.
    Stalled { step: &'static str, path: String },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn os(op: &'static str, path: Option<&str>, errno: i32) -> Self {
        Error::Os {
            op,
            path: path.map(str::to_owned),
            errno,
        }
    }

    /// The error of the last failed libc call on this thread.
    pub fn last_os(op: &'static str, path: Option<&str>) -> Self {
        Self::os(op, path, last_errno())
    }

    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// errno carried to Python (`None` for pure argument errors).
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Os { errno, .. } => Some(*errno),
            Error::Alignment(_) => Some(libc::EINVAL),
            Error::ShortRead { .. } => Some(libc::ENODATA),
            Error::Closed("file") => Some(libc::EBADF),
            Error::Closed(_) => Some(libc::ESHUTDOWN),
            Error::BackendUnavailable { errno, .. } => Some(*errno),
            Error::NoFreeSlot { .. } => Some(libc::EAGAIN),
            Error::Broken { errno, .. } => Some(*errno),
            Error::KernelOwned { errno, .. } => Some(*errno),
            Error::NoMemory { .. } => Some(libc::ENOMEM),
            Error::InvalidArgument(_) => None,
            Error::Timeout => Some(libc::ETIMEDOUT),
            Error::Withdrawn => Some(libc::ECANCELED),
            Error::Stalled { .. } => Some(libc::ETIMEDOUT),
        }
    }

    /// The file path the error is about, when there is one.
    pub fn path(&self) -> Option<&str> {
        match self {
            Error::Os { path, .. } => path.as_deref(),
            Error::ShortRead { path, .. } => Some(path),
            Error::Stalled { path, .. } => Some(path),
            _ => None,
        }
    }
}

pub fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// `strerror` text for an errno, via std's table.
pub fn describe_errno(errno: i32) -> String {
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    // std appends " (os error N)"; Python adds its own "[Errno N]".
    match text.find(" (os error") {
        Some(cut) => text[..cut].to_owned(),
        None => text,
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Os { op, errno, .. } => write!(f, "{op} failed: {}", describe_errno(*errno)),
            Error::Alignment(msg) => write!(f, "{msg}"),
            Error::ShortRead {
                path,
                offset,
                wanted,
                got,
            } => write!(
                f,
                "short read on {path}: wanted {wanted} bytes at offset {offset}, \
                 the file ended after {got}"
            ),
            Error::Closed(what) => write!(f, "the {what} is closed"),
            Error::BackendUnavailable {
                backend, reason, ..
            } => write!(f, "backend {backend:?} is unavailable: {reason}"),
            Error::NoFreeSlot { window } => write!(
                f,
                "all {window} slots are leased or in flight; drop a Slot (and its views) first"
            ),
            Error::Broken { errno, reason } => write!(
                f,
                "the engine is broken: {reason} ({}); every queued and in-flight operation \
                 failed and no more I/O is accepted: close it and create a new Engine",
                describe_errno(*errno)
            ),
            Error::KernelOwned { errno, reason } => write!(
                f,
                "destination blocks still owned by the kernel: the engine broke down \
                 ({reason}: {}) while a direct read into them was in flight; they may \
                 still be written and must not be reused",
                describe_errno(*errno)
            ),
            Error::NoMemory {
                asked,
                headroom,
                available,
                source,
            } => {
                write!(
                    f,
                    "the staging arena needs {asked} bytes ({})",
                    human(*asked)
                )?;
                if *headroom > 0 {
                    write!(f, " plus {} of headroom", human(*headroom))?;
                }
                write!(
                    f,
                    ", but only {available} bytes ({}) are available ({source}): use a \
                     smaller window or slot size",
                    human(*available)
                )
            }
            Error::InvalidArgument(msg) => write!(f, "{msg}"),
            Error::Timeout => write!(f, "timed out waiting for the operation"),
            Error::Stalled { step, path } => {
                write!(f, "the {step} of {path} had not ended at the deadline")
            }
            Error::Withdrawn => write!(
                f,
                "the read was withdrawn before it reached the kernel; its memory was never \
                 written"
            ),
        }
    }
}

impl std::error::Error for Error {}

/// Bytes in MiB or GiB, for messages.
fn human(bytes: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    let mib = bytes as f64 / MIB;
    if mib >= 1024.0 {
        format!("{:.2} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_kept_and_message_readable() {
        let e = Error::os("open", Some("/x"), libc::ENOENT);
        assert_eq!(e.errno(), Some(libc::ENOENT));
        assert_eq!(e.path(), Some("/x"));
        assert_eq!(e.to_string(), "open failed: No such file or directory");
        assert_eq!(Error::NoFreeSlot { window: 2 }.errno(), Some(libc::EAGAIN));
        assert_eq!(Error::invalid("bad").errno(), None);
    }

    #[test]
    fn broken_and_no_memory_say_what_and_keep_errno() {
        let b = Error::Broken {
            errno: libc::EBADF,
            reason: "io_uring_enter failed".into(),
        };
        assert_eq!(b.errno(), Some(libc::EBADF));
        assert!(b
            .to_string()
            .contains("io_uring_enter failed (Bad file descriptor)"));
        let m = Error::NoMemory {
            asked: 3 << 30,
            headroom: 128 << 20,
            available: 1 << 30,
            source: "MemAvailable",
        };
        assert_eq!(m.errno(), Some(libc::ENOMEM));
        let text = m.to_string();
        for part in ["3221225472 bytes (3.00 GiB)", "1073741824 bytes (1.00 GiB)"] {
            assert!(text.contains(part), "{text}");
        }
    }
}
