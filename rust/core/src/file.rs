//! Files the engine reads and writes: opened O_DIRECT where the filesystem allows it,
//! buffered otherwise, with the alignment they need and the size writes leave behind.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::align::{self, DioAlign};
use crate::error::{last_errno, Error, Result};
use crate::fstype::{self, Submission};

/// How to open.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    pub write: bool,
    pub create: bool,
    pub direct: bool,
    /// Accept a FIFO or device node (tests that hold requests in flight, raw devices).
    /// Off by default: a data file is a regular file, anything else is refused.
    pub special: bool,
}

/// Undo of a registration in an io_uring file table, run when the file is dropped.
pub struct Registration {
    pub index: u32,
    pub release: Box<dyn Fn(u32) + Send + Sync>,
}

pub struct EngineFile {
    fd: OwnedFd,
    path: String,
    direct: bool,
    writable: bool,
    align: DioAlign,
    /// Inline, or straight to a kernel worker where the file system may hold io_uring's
    /// submitting thread (FUSE, network: fstype.rs).
    submission: Submission,
    /// The device the file lives on (st_dev): the I/O thread bounds bytes in flight per
    /// drive (uring.rs).
    dev: u64,
    /// Logical size: at open, then the furthest end written through the engine.
    size: AtomicU64,
    closed: AtomicBool,
    /// Set by the io_uring thread the first time it sees the file (even if the table
    /// had no room), so registration is tried once.
    registration_tried: AtomicBool,
    registration: OnceLock<Registration>,
}

impl std::fmt::Debug for EngineFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineFile")
            .field("path", &self.path)
            .field("fd", &self.fd.as_raw_fd())
            .field("direct", &self.direct)
            .field("submission", &self.submission)
            .finish()
    }
}

pub(crate) fn open_raw(c: &CString, flags: i32) -> std::result::Result<OwnedFd, i32> {
    // SAFETY: `c` is a NUL-terminated path we own; open returns a new descriptor or -1.
    let fd = unsafe { libc::open(c.as_ptr(), flags, 0o600 as libc::c_uint) };
    if fd < 0 {
        Err(last_errno())
    } else {
        // SAFETY: `fd` was just returned by open and is owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// The error of a failed open: a link at the path (ELOOP under O_NOFOLLOW) says so.
fn open_error(path: &str, errno: i32) -> Error {
    if errno == libc::ELOOP {
        Error::os(
            "open (a symbolic link: files are never opened through one)",
            Some(path),
            errno,
        )
    } else if errno == libc::EXDEV {
        Error::os("open (the path leads out of the store)", Some(path), errno)
    } else {
        Error::os("open", Some(path), errno)
    }
}

/// Back to blocking mode: io_uring would otherwise answer EAGAIN instead of waiting.
fn clear_nonblock(fd: RawFd, path: &str) -> Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own; no memory is passed.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK) } < 0 {
        return Err(Error::last_os("fcntl", Some(path)));
    }
    Ok(())
}

/// `openat2` with `how`, or the errno (ENOSYS where the kernel lacks it, before 5.6).
fn openat2_raw(
    dir: RawFd,
    rel: &CString,
    how: &libc::open_how,
) -> std::result::Result<OwnedFd, i32> {
    // SAFETY: `rel` is NUL-terminated and `how` a live struct of the size passed; the
    // call returns a new descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir,
            rel.as_ptr(),
            how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        Err(last_errno())
    } else {
        // SAFETY: a descriptor openat2 just returned, owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
    }
}

fn openat_raw(dir: RawFd, name: &CString, flags: i32) -> std::result::Result<OwnedFd, i32> {
    // SAFETY: `name` is NUL-terminated; openat returns a new descriptor or -1.
    let fd = unsafe { libc::openat(dir, name.as_ptr(), flags, 0o600 as libc::c_uint) };
    if fd < 0 {
        Err(last_errno())
    } else {
        // SAFETY: a descriptor openat just returned, owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// The components of `path` below `root`: refused (EXDEV, as RESOLVE_BENEATH says)
/// when it is not under it or climbs out with "..".
fn components_below<'a>(root: &str, path: &'a str) -> std::result::Result<Vec<&'a str>, i32> {
    let root = root.trim_end_matches('/');
    let rest = path.strip_prefix(root).ok_or(libc::EXDEV)?;
    if !rest.starts_with('/') {
        return Err(libc::EXDEV);
    }
    let parts: Vec<&str> = rest
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    if parts.is_empty() || parts.contains(&"..") {
        return Err(libc::EXDEV);
    }
    Ok(parts)
}

/// Open `path`, which must lie under the directory `root`, without following a link in
/// any component below `root`: `openat2` with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS
/// where the kernel has it, else a walk from `root` one directory at a time
/// (O_NOFOLLOW | O_DIRECTORY each), then the last component with `flags` (O_NOFOLLOW).
/// A link anywhere below `root` gives ELOOP (or ENOTDIR from the walk); a path out of
/// `root`, EXDEV. (`root` itself is the caller's choice and may be a link.)
pub(crate) fn open_beneath(
    root: &str,
    path: &str,
    flags: i32,
) -> std::result::Result<OwnedFd, i32> {
    let parts = components_below(root, path)?;
    let croot = CString::new(root).map_err(|_| libc::EINVAL)?;
    let dir = open_raw(&croot, libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)?;
    let rel = CString::new(parts.join("/")).map_err(|_| libc::EINVAL)?;
    // SAFETY: open_how is plain data (three integers); zero is valid for each.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = flags as u64;
    how.mode = if flags & libc::O_CREAT != 0 { 0o600 } else { 0 };
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS;
    if open_path() == OpenPath::Walk {
        return walk_beneath(dir, &parts, flags);
    }
    match openat2_raw(dir.as_raw_fd(), &rel, &how) {
        // ENOSYS: a kernel before 5.6. EPERM: a seccomp profile that refuses openat2 (a
        // container runtime's default may). The walk gives the same answers; a real
        // EPERM (an immutable file opened for writing) comes back from it too.
        Err(libc::ENOSYS) | Err(libc::EPERM) => walk_beneath(dir, &parts, flags),
        other => other,
    }
}

/// How `open_beneath` resolves a path below a store's root in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenPath {
    /// `openat2` with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS.
    Openat2,
    /// One directory at a time with O_NOFOLLOW: `openat2` is missing (ENOSYS) or
    /// refused (EPERM, seccomp).
    Walk,
}

impl OpenPath {
    pub fn name(self) -> &'static str {
        match self {
            OpenPath::Openat2 => "openat2",
            OpenPath::Walk => "walk",
        }
    }
}

static OPEN_PATH: OnceLock<(OpenPath, i32)> = OnceLock::new();

/// The resolution this process uses, probed once by resolving "." below "/" (no
/// permission is needed for it, so an error is the call itself being refused).
pub fn open_path() -> OpenPath {
    open_path_probe().0
}

/// `open_path` and, for the walk, the errno `openat2` answered the probe with.
pub fn open_path_probe() -> (OpenPath, i32) {
    *OPEN_PATH.get_or_init(|| {
        let root = c"/".to_owned();
        let Ok(dir) = open_raw(&root, libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) else {
            return (OpenPath::Openat2, 0); // no root to probe: try openat2 at each open
        };
        // SAFETY: open_how is plain data (three integers); zero is valid for each.
        let mut how: libc::open_how = unsafe { std::mem::zeroed() };
        how.flags = (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64;
        how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS;
        match openat2_raw(dir.as_raw_fd(), &c".".to_owned(), &how) {
            Err(e @ (libc::ENOSYS | libc::EPERM)) => (OpenPath::Walk, e),
            _ => (OpenPath::Openat2, 0),
        }
    })
}

/// The walk `open_beneath` falls back to: from the directory `dir`, each component but
/// the last as a directory that is no link, then the last with `flags`.
fn walk_beneath(dir: OwnedFd, parts: &[&str], flags: i32) -> std::result::Result<OwnedFd, i32> {
    let mut at = dir;
    let (last, dirs) = parts.split_last().ok_or(libc::EXDEV)?;
    for part in dirs {
        let c = CString::new(*part).map_err(|_| libc::EINVAL)?;
        let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        at = match openat_raw(at.as_raw_fd(), &c, flags) {
            // O_PATH | O_NOFOLLOW on a link opens the link itself: not a directory.
            Err(libc::ENOTDIR) | Err(libc::ELOOP) => return Err(libc::ELOOP),
            other => other?,
        };
    }
    let c = CString::new(*last).map_err(|_| libc::EINVAL)?;
    openat_raw(at.as_raw_fd(), &c, flags)
}

impl EngineFile {
    pub fn open(path: &str, opts: OpenOptions) -> Result<EngineFile> {
        Self::open_in(None, path, opts)
    }

    /// `open`, and with `root` (a store's directory) the path is resolved below it with
    /// no link followed in any component (see `open_beneath`).
    pub fn open_in(root: Option<&str>, path: &str, opts: OpenOptions) -> Result<EngineFile> {
        let c = CString::new(path).map_err(|_| Error::invalid("path contains a NUL byte"))?;
        if root.is_some_and(|r| r.contains('\0')) {
            return Err(Error::invalid("root contains a NUL byte"));
        }
        let open = |flags: i32| match root {
            Some(r) => open_beneath(r, path, flags),
            None => open_raw(&c, flags),
        };
        let write = opts.write || opts.create;
        // O_NONBLOCK: a FIFO (or device) at `path` must not block the open; it is refused
        // below, before any byte moves, and the flag is cleared for regular files.
        // O_NOFOLLOW: a link swapped in at a record's path (after a probe that refused
        // links) must not be followed to a file elsewhere.
        let mut flags = libc::O_CLOEXEC
            | libc::O_NONBLOCK
            | libc::O_NOFOLLOW
            | if write { libc::O_RDWR } else { libc::O_RDONLY };
        if opts.create {
            flags |= libc::O_CREAT;
        }
        let mut direct = opts.direct;
        let fd = match open(flags | if direct { libc::O_DIRECT } else { 0 }) {
            Ok(fd) => fd,
            // Filesystems without direct I/O (some tmpfs, overlay) refuse with EINVAL.
            Err(libc::EINVAL) if direct => {
                direct = false;
                open(flags).map_err(|e| open_error(path, e))?
            }
            Err(e) => return Err(open_error(path, e)),
        };
        // SAFETY: stat is plain data, zero is valid; fstat writes into our local.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open and owned here; `st` is a live local.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::last_os("fstat", Some(path)));
        }
        match st.st_mode & libc::S_IFMT {
            libc::S_IFREG => {}
            libc::S_IFDIR => return Err(Error::os("open", Some(path), libc::EISDIR)),
            libc::S_IFIFO | libc::S_IFCHR | libc::S_IFBLK if opts.special => {}
            _ => {
                return Err(Error::os(
                    "open (not a regular file: a FIFO, socket or device)",
                    Some(path),
                    libc::EINVAL,
                ))
            }
        }
        clear_nonblock(fd.as_raw_fd(), path)?;
        let align = align::probe_fd(fd.as_raw_fd())?;
        let submission = fstype::submission_of(fd.as_raw_fd());
        Ok(EngineFile {
            fd,
            path: path.to_owned(),
            direct,
            writable: write,
            align,
            submission,
            dev: st.st_dev as u64,
            size: AtomicU64::new(st.st_size as u64),
            closed: AtomicBool::new(false),
            registration_tried: AtomicBool::new(false),
            registration: OnceLock::new(),
        })
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn direct(&self) -> bool {
        self.direct
    }

    pub fn writable(&self) -> bool {
        self.writable
    }

    /// How io_uring issues this file's requests (decided at open, fstype.rs).
    pub fn submission(&self) -> Submission {
        self.submission
    }

    /// The device it lives on (st_dev at open).
    pub fn dev(&self) -> u64 {
        self.dev
    }

    /// Offset/length alignment for I/O on this file (1 when buffered).
    pub fn alignment(&self) -> u64 {
        if self.direct {
            self.align.offset.max(1)
        } else {
            1
        }
    }

    /// Alignment of memory addresses for O_DIRECT (slots are page-aligned anyway).
    pub fn mem_alignment(&self) -> u64 {
        if self.direct {
            self.align.mem.max(1)
        } else {
            1
        }
    }

    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Record that bytes up to `end` exist now (a write was submitted).
    pub fn extend_to(&self, end: u64) {
        self.size.fetch_max(end, Ordering::AcqRel);
    }

    /// Cut O_DIRECT padding: shrink the file to its logical size if a padded write made
    /// it longer.
    pub fn trim_padding(&self) -> Result<()> {
        let logical = self.size();
        // SAFETY: stat is plain data, zero is valid.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: our own open descriptor and a live local.
        if unsafe { libc::fstat(self.fd(), &mut st) } != 0 {
            return Err(Error::last_os("fstat", Some(&self.path)));
        }
        if st.st_size as u64 > logical {
            self.ftruncate(logical)?;
        }
        Ok(())
    }

    fn ftruncate(&self, size: u64) -> Result<()> {
        // SAFETY: our own open descriptor.
        if unsafe { libc::ftruncate(self.fd(), size as libc::off_t) } != 0 {
            return Err(Error::last_os("ftruncate", Some(&self.path)));
        }
        Ok(())
    }

    pub fn truncate(&self, size: u64) -> Result<()> {
        self.check_open()?;
        if !self.writable {
            return Err(Error::os("truncate", Some(&self.path), libc::EBADF));
        }
        self.ftruncate(size)?;
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    pub fn sync(&self) -> Result<()> {
        self.check_open()?;
        // SAFETY: our own open descriptor.
        if unsafe { libc::fdatasync(self.fd()) } != 0 {
            return Err(Error::last_os("fdatasync", Some(&self.path)));
        }
        Ok(())
    }

    /// No further I/O is accepted; the descriptor closes when the last user drops.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub fn check_open(&self) -> Result<()> {
        if self.is_closed() {
            Err(Error::Closed("file"))
        } else {
            Ok(())
        }
    }

    /// True the first time only: whoever gets it tries to register the file.
    pub fn claim_registration(&self) -> bool {
        !self.registration_tried.swap(true, Ordering::AcqRel)
    }

    pub fn set_registration(&self, reg: Registration) {
        let _ = self.registration.set(reg);
    }

    /// Index in the io_uring file table, when registered.
    pub fn registered_index(&self) -> Option<u32> {
        self.registration.get().map(|r| r.index)
    }
}

impl Drop for EngineFile {
    fn drop(&mut self) {
        if let Some(reg) = self.registration.get() {
            (reg.release)(reg.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_at_the_path_is_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("record");
        std::fs::write(&target, vec![7u8; 8192]).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        for (write, create) in [(false, false), (true, false), (true, true)] {
            let opts = OpenOptions {
                write,
                create,
                direct: true,
                ..Default::default()
            };
            let e = EngineFile::open(link.to_str().unwrap(), opts).unwrap_err();
            assert_eq!(e.errno(), Some(libc::ELOOP), "{e}");
            assert!(e.to_string().contains("symbolic link"), "{e}");
        }
        // Control: the file itself opens.
        EngineFile::open(target.to_str().unwrap(), OpenOptions::default()).unwrap();
    }

    /// A store `root/chunks/ab/record`, a directory `outside` holding a record of the same
    /// name, and `root/chunks/cd/record` (another directory inside the store).
    fn store() -> (tempfile::TempDir, String, String) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        for d in ["store/chunks/ab", "store/chunks/cd", "outside"] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        for f in [
            "store/chunks/ab/record",
            "store/chunks/cd/record",
            "outside/record",
        ] {
            std::fs::write(dir.path().join(f), vec![1u8; 4096]).unwrap();
        }
        let record = root.join("chunks/ab/record").to_str().unwrap().to_owned();
        (dir, root.to_str().unwrap().to_owned(), record)
    }

    #[test]
    fn no_component_below_the_root_is_followed_through_a_link() {
        let flags = libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW;
        for target in ["outside", "store/chunks/cd"] {
            let (dir, root, record) = store();
            // Control: the record opens below its root, both ways.
            assert!(open_beneath(&root, &record, flags).is_ok());
            let parts = components_below(&root, &record).unwrap();
            let at = open_raw(&CString::new(root.as_str()).unwrap(), libc::O_PATH).unwrap();
            assert!(walk_beneath(at, &parts, flags).is_ok());
            // The record's directory swapped for a link (after a probe).
            let ab = dir.path().join("store/chunks/ab");
            std::fs::remove_dir_all(&ab).unwrap();
            std::os::unix::fs::symlink(dir.path().join(target), &ab).unwrap();
            assert_eq!(open_beneath(&root, &record, flags).err(), Some(libc::ELOOP));
            let at = open_raw(&CString::new(root.as_str()).unwrap(), libc::O_PATH).unwrap();
            assert_eq!(walk_beneath(at, &parts, flags).err(), Some(libc::ELOOP));
            let opts = OpenOptions::default();
            let e = EngineFile::open_in(Some(&root), &record, opts).unwrap_err();
            assert_eq!(e.errno(), Some(libc::ELOOP), "{e}");
            // Without a root only the last component is checked: the link is followed.
            assert!(EngineFile::open(&record, opts).is_ok());
        }
    }

    #[test]
    fn a_path_out_of_the_root_is_refused() {
        let (_dir, root, record) = store();
        let opts = OpenOptions::default();
        for path in [
            format!("{root}/chunks/../../outside/record"),
            record.replace("/store/", "/outside/"),
            format!("{root}x/chunks/ab/record"),
        ] {
            let e = EngineFile::open_in(Some(&root), &path, opts).unwrap_err();
            assert_eq!(e.errno(), Some(libc::EXDEV), "{path}: {e}");
        }
        assert!(EngineFile::open_in(Some(&format!("{root}/")), &record, opts).is_ok());
    }

    #[test]
    fn fifo_and_directory_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path we own.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // Without O_NONBLOCK this open would wait forever for a writer.
        for write in [false, true] {
            let opts = OpenOptions {
                write,
                direct: true,
                ..Default::default()
            };
            let e = EngineFile::open(fifo.to_str().unwrap(), opts).unwrap_err();
            assert_eq!(e.errno(), Some(libc::EINVAL), "{e}");
        }
        let e = EngineFile::open(dir.path().to_str().unwrap(), OpenOptions::default());
        assert_eq!(e.unwrap_err().errno(), Some(libc::EISDIR));
        // A regular file is opened in blocking mode, as io_uring needs.
        let reg = dir.path().join("reg");
        std::fs::write(&reg, b"x").unwrap();
        let f = EngineFile::open(reg.to_str().unwrap(), OpenOptions::default()).unwrap();
        // SAFETY: F_GETFL on our own open descriptor.
        let fl = unsafe { libc::fcntl(f.fd(), libc::F_GETFL) };
        assert_eq!(fl & libc::O_NONBLOCK, 0);
        // Asked for explicitly, a FIFO opens (blocking mode for its requests).
        let special = OpenOptions {
            special: true,
            ..Default::default()
        };
        let f = EngineFile::open(fifo.to_str().unwrap(), special).unwrap();
        // SAFETY: F_GETFL on our own open descriptor.
        let fl = unsafe { libc::fcntl(f.fd(), libc::F_GETFL) };
        assert_eq!(fl & libc::O_NONBLOCK, 0);
    }

    #[test]
    fn open_missing_keeps_errno() {
        let e = EngineFile::open("/no/such/file", OpenOptions::default()).unwrap_err();
        assert_eq!(e.errno(), Some(libc::ENOENT));
    }

    #[test]
    fn create_direct_and_truncate() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let p = p.to_str().unwrap();
        let f = EngineFile::open(
            p,
            OpenOptions {
                create: true,
                direct: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(f.writable());
        assert_eq!(f.size(), 0);
        assert!(f.alignment().is_power_of_two());
        f.truncate(10000).unwrap();
        assert_eq!(std::fs::metadata(p).unwrap().len(), 10000);
        f.close();
        assert!(matches!(f.sync(), Err(Error::Closed("file"))));
        let st = std::fs::metadata(p).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(st.permissions().mode() & 0o777, 0o600);
    }
}
