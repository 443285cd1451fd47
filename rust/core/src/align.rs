//! O_DIRECT alignment: the STATX_DIOALIGN probe (with a fallback) and the arithmetic of
//! rounding requests and interpreting short transfers.

use std::ffi::CString;
use std::os::fd::RawFd;

use crate::error::{Error, Result};

/// Alignment used when the kernel cannot tell us (a safe upper bound for logical blocks).
pub const FALLBACK_ALIGN: u64 = 4096;

/// Where an alignment figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlignSource {
    /// statx reported STATX_DIOALIGN.
    Statx,
    /// The block device's logical block size from sysfs.
    LogicalBlock,
    /// Nothing known: 4096.
    Fallback,
}

/// O_DIRECT requirements for one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DioAlign {
    pub mem: u64,
    pub offset: u64,
    pub source: AlignSource,
    /// statx said the file does not support direct I/O at all.
    pub unsupported: bool,
}

/// Probe an open file descriptor.
pub fn probe_fd(fd: RawFd) -> Result<DioAlign> {
    statx_align(fd, c"", libc::AT_EMPTY_PATH, None)
}

/// Probe a path (the file itself, or the directory it would be created in).
pub fn probe_path(path: &str) -> Result<DioAlign> {
    let c = CString::new(path).map_err(|_| Error::invalid("path contains a NUL byte"))?;
    statx_align(libc::AT_FDCWD, &c, 0, Some(path))
}

fn statx_align(
    dirfd: RawFd,
    path: &std::ffi::CStr,
    flags: i32,
    name: Option<&str>,
) -> Result<DioAlign> {
    // SAFETY: statx is plain data; all-zero is a valid value that the kernel overwrites.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a NUL-terminated string we own and `stx` is a live local the
    // kernel writes into; neither outlives this call.
    let rc = unsafe { libc::statx(dirfd, path.as_ptr(), flags, libc::STATX_DIOALIGN, &mut stx) };
    if rc != 0 {
        return Err(Error::last_os("statx", name));
    }
    let regular = u32::from(stx.stx_mode) & libc::S_IFMT == libc::S_IFREG;
    // Directories report no direct I/O support; for them the device's figure applies.
    if regular && stx.stx_mask & libc::STATX_DIOALIGN != 0 {
        let (mem, off) = (
            stx.stx_dio_mem_align as u64,
            stx.stx_dio_offset_align as u64,
        );
        if off == 0 {
            return Ok(DioAlign {
                mem: FALLBACK_ALIGN,
                offset: FALLBACK_ALIGN,
                source: AlignSource::Statx,
                unsupported: true,
            });
        }
        return Ok(DioAlign {
            mem,
            offset: off,
            source: AlignSource::Statx,
            unsupported: false,
        });
    }
    let (source, block) = match logical_block_size(stx.stx_dev_major, stx.stx_dev_minor) {
        Some(b) => (AlignSource::LogicalBlock, b),
        None => (AlignSource::Fallback, FALLBACK_ALIGN),
    };
    Ok(DioAlign {
        mem: block,
        offset: block,
        source,
        unsupported: false,
    })
}

fn logical_block_size(major: u32, minor: u32) -> Option<u64> {
    // A partition has no queue/ of its own; its disk's is one level up.
    ["queue/logical_block_size", "../queue/logical_block_size"]
        .iter()
        .find_map(|tail| {
            let p = format!("/sys/dev/block/{major}:{minor}/{tail}");
            std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok()
        })
        .filter(|b| b.is_power_of_two())
}

pub fn round_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

pub fn is_aligned(x: u64, align: u64) -> bool {
    x % align == 0
}

/// What one request's transfer result means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transfer {
    /// All bytes moved.
    Complete,
    /// Some bytes moved; submit the rest at the advanced position.
    Partial,
    /// A read reached the end of the file.
    EndOfFile,
    /// A write moved nothing: the device refused without an errno.
    Stalled,
}

/// Classify a transfer of `got` bytes out of `asked` on a file needing `align`.
/// An O_DIRECT read stops short only at the end of the file, and then usually at an
/// unaligned position that could not be resubmitted anyway.
pub fn classify(asked: u64, got: u64, align: u64, is_read: bool) -> Transfer {
    if got >= asked {
        Transfer::Complete
    } else if got == 0 {
        if is_read {
            Transfer::EndOfFile
        } else {
            Transfer::Stalled
        }
    } else if is_read && !is_aligned(got, align) {
        Transfer::EndOfFile
    } else {
        Transfer::Partial
    }
}

/// Bytes of a read of `want` that are valid when the file ended `eof_at` bytes into it.
pub fn valid_len(want: u64, eof_at: Option<u64>) -> u64 {
    eof_at.map_or(want, |e| e.min(want))
}

/// Split `[0, extent)` into requests of at most `request` bytes: (start, len) pairs.
pub fn split(extent: u64, request: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..extent.div_ceil(request)).map(move |i| {
        let start = i * request;
        (start, request.min(extent - start))
    })
}

/// A zeroed heap block aligned for O_DIRECT: to its own size (at least 512 bytes) by
/// `new`, to `align` by `copy_of`.
pub(crate) struct AlignedBlock {
    pub(crate) ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl AlignedBlock {
    pub(crate) fn new(size: usize) -> Result<AlignedBlock> {
        Self::aligned(size, size.max(512))
    }

    /// A copy of `bytes` (at least one byte long) aligned to `align`.
    pub(crate) fn copy_of(bytes: &[u8], align: usize) -> Result<AlignedBlock> {
        let block = Self::aligned(bytes.len(), align)?;
        // SAFETY: `block` holds `bytes.len()` bytes of its own, apart from `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), block.ptr, bytes.len()) };
        Ok(block)
    }

    fn aligned(size: usize, align: usize) -> Result<AlignedBlock> {
        if size == 0 {
            return Err(Error::invalid("an aligned block needs at least one byte"));
        }
        let layout = std::alloc::Layout::from_size_align(size, align)
            .map_err(|_| Error::invalid(format!("bad alignment {align} for {size} bytes")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::os("alloc", None, libc::ENOMEM));
        }
        Ok(AlignedBlock { ptr, layout })
    }
}

impl Drop for AlignedBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `aligned` with this layout and not freed elsewhere.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding() {
        assert_eq!(round_up(0, 4096), 0);
        assert_eq!(round_up(1, 4096), 4096);
        assert_eq!(round_up(4096, 4096), 4096);
        assert_eq!(round_up(4097, 512), 4608);
        assert!(is_aligned(8192, 4096));
        assert!(!is_aligned(8193, 4096));
    }

    #[test]
    fn short_transfers() {
        assert_eq!(classify(4096, 4096, 4096, true), Transfer::Complete);
        assert_eq!(classify(8192, 0, 4096, true), Transfer::EndOfFile);
        // Tail of a 5000-byte file read as 8192: 5000 back, unaligned: the end.
        assert_eq!(classify(8192, 5000, 4096, true), Transfer::EndOfFile);
        // Aligned partial: resubmit; the next attempt tells whether it was the end.
        assert_eq!(classify(8192, 4096, 4096, true), Transfer::Partial);
        // Buffered files (align 1) resubmit any partial.
        assert_eq!(classify(8192, 5000, 1, true), Transfer::Partial);
        assert_eq!(classify(8192, 5000, 1, false), Transfer::Partial);
        assert_eq!(classify(8192, 0, 1, false), Transfer::Stalled);
    }

    #[test]
    fn valid_bytes() {
        assert_eq!(valid_len(5000, None), 5000);
        assert_eq!(valid_len(5000, Some(5000)), 5000);
        assert_eq!(valid_len(5000, Some(8192)), 5000);
        assert_eq!(valid_len(5000, Some(4096)), 4096);
    }

    #[test]
    fn splitting() {
        let v: Vec<_> = split(10, 4).collect();
        assert_eq!(v, vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(split(8, 4).count(), 2);
        assert_eq!(split(0, 4).count(), 0);
    }

    #[test]
    fn probe_tmp_dir() {
        let a = probe_path("/tmp").unwrap();
        assert!(a.offset.is_power_of_two() && a.mem.is_power_of_two());
        assert!(probe_path("/definitely/not/here").is_err());
    }
}
