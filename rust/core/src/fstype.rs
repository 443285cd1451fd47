//! Whose file system a file lives on, as far as io_uring's submitting thread cares.
//!
//! io_uring first issues a read or write inline, inside `io_uring_enter`, asking the
//! file system not to block (IOCB_NOWAIT); a local block file system answers at once or
//! says EAGAIN and the request goes to a kernel worker. FUSE (its direct I/O path waits
//! for the server's answer) and network file systems may instead hold the caller for the
//! whole request: one slow file then holds the ring's only thread and every other file's
//! requests behind it. Requests on such files are sent with IOSQE_ASYNC, straight to a
//! worker. Decided once per file, at open, from `fstatfs`: the local block file systems
//! below keep the inline path (a worker hop costs latency); anything else, known remote,
//! unknown, or whose statfs fails (a FUSE server that does not answer STATFS), is
//! treated as able to block. On a local file system fstatfs is one cheap call; on FUSE or
//! NFS it asks the server, once per open, beside the open's own round trips.

use std::os::fd::RawFd;

/// `statfs.f_type` of the file systems whose requests are issued inline
/// (<linux/magic.h>; ZFS's from OpenZFS).
const INLINE: &[(u32, &str)] = &[
    (0xEF53, "ext2/3/4"),
    (0x5846_5342, "xfs"),
    (0x9123_683E, "btrfs"),
    (0xF2F5_2010, "f2fs"),
    (0xCA45_1A4E, "bcachefs"),
    (0x2FC1_2FC1, "zfs"),
    (0x3153_464A, "jfs"),
    (0x0102_1994, "tmpfs"),
    (0x8584_58F6, "ramfs"),
    // An overlay passes each request to the file below it (a local upper or lower layer).
    (0x794C_7630, "overlayfs"),
    // Device nodes and FIFOs opened `special`: a FIFO's read waits on a poll, never in
    // the submitter.
    (0x6264_6576, "bdev"),
    (0x5049_5045, "pipefs"),
];

/// How io_uring should issue requests on a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submission {
    /// Inline in `io_uring_enter` (a local block file system, or statfs unknown).
    Inline,
    /// Straight to a kernel worker (IOSQE_ASYNC): the file system may block the caller.
    Async,
}

/// The submission a file on a file system of type `magic` needs.
pub fn submission_for(magic: u32) -> Submission {
    if INLINE.iter().any(|(m, _)| *m == magic) {
        Submission::Inline
    } else {
        Submission::Async
    }
}

/// `submission_for` the file system holding `fd`; Async when fstatfs fails (a local
/// block file system answers it; a FUSE server may refuse STATFS).
pub fn submission_of(fd: RawFd) -> Submission {
    // SAFETY: statfs is plain data, zero is valid for every field.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is an open descriptor of the caller's; `st` is a live local.
    if unsafe { libc::fstatfs(fd, &mut st) } != 0 {
        return Submission::Async;
    }
    // f_type's width differs by target; the magic numbers are 32-bit.
    submission_for(st.f_type as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn fuse_and_network_file_systems_are_async_local_ones_inline() {
        // fuse, nfs, cifs, smb2, ceph, 9p, and one no file system has: all may block.
        for magic in [
            0x6573_5546,
            0x6969,
            0xFF53_4D42,
            0xFE53_4D42,
            0x00C3_6400,
            0x0102_1997,
            0x1234_5678,
        ] {
            assert_eq!(submission_for(magic), Submission::Async, "{magic:#x}");
        }
        // ext4, xfs, btrfs, tmpfs, overlayfs.
        for magic in [0xEF53, 0x5846_5342, 0x9123_683E, 0x0102_1994, 0x794C_7630] {
            assert_eq!(submission_for(magic), Submission::Inline, "{magic:#x}");
        }
    }

    #[test]
    fn a_file_on_the_local_disk_is_issued_inline() {
        // The crate's directory is on a local disk wherever cargo builds it; tmp may not
        // be (a FUSE or network /tmp would rightly say Async).
        let f = std::fs::File::open(env!("CARGO_MANIFEST_DIR")).unwrap();
        let here = {
            // SAFETY: statfs is plain data; fstatfs fills our local from an open fd.
            let mut st: libc::statfs = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            assert_eq!(unsafe { libc::fstatfs(f.as_raw_fd(), &mut st) }, 0);
            st.f_type as u32
        };
        if INLINE.iter().any(|(m, _)| *m == here) {
            assert_eq!(submission_of(f.as_raw_fd()), Submission::Inline);
        }
        assert_eq!(submission_of(-1), Submission::Async, "fstatfs failed");
    }
}
