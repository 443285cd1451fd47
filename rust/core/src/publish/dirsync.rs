//! Group commit of directory fsyncs. A record is durable under its name only once its
//! directory is fsynced after the rename; renames that come in while one fsync runs
//! share the next, as a journal commits many transactions at once. A failed fsync
//! covers nobody: each rename it would have covered gets the error or runs its own.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use crate::error::{Error, Result};

#[derive(Default)]
struct Counts {
    /// Renames done in the directory, counted before they ask for its fsync.
    renamed: u64,
    /// Renames that an fsync begun after them has made durable.
    synced: u64,
    running: bool,
}

#[derive(Default)]
struct Dir {
    counts: Mutex<Counts>,
    turn: Condvar,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn dir_of(path: &str) -> Arc<Dir> {
    static DIRS: OnceLock<Mutex<HashMap<String, Arc<Dir>>>> = OnceLock::new();
    let mut dirs = locked(DIRS.get_or_init(Mutex::default));
    Arc::clone(dirs.entry(path.to_owned()).or_default())
}

/// Return once an fsync of `dir` that began after this call has succeeded: the caller's
/// own, or one another caller started meanwhile that covers it.
pub(crate) fn sync(dir: &str, fsync: impl Fn(&str) -> Result<()>) -> Result<()> {
    let d = dir_of(dir);
    let covers = {
        let mut c = locked(&d.counts);
        c.renamed += 1;
        let ticket = c.renamed;
        while c.running {
            c = d.turn.wait(c).unwrap_or_else(|p| p.into_inner());
        }
        if c.synced >= ticket {
            return Ok(());
        }
        c.running = true;
        c.renamed // every rename counted so far precedes this fsync
    };
    let res = fsync(dir);
    let mut c = locked(&d.counts);
    c.running = false;
    if res.is_ok() {
        c.synced = c.synced.max(covers);
    }
    d.turn.notify_all();
    res
}

/// fsync of the directory at `path`.
pub(crate) fn fsync_dir(path: &str) -> Result<()> {
    let c = CString::new(path).map_err(|_| Error::invalid("path contains a NUL byte"))?;
    // SAFETY: `c` is a NUL-terminated path we own; open returns a descriptor or -1.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(Error::last_os("directory's fsync", Some(path)));
    }
    // SAFETY: `fd` was just opened and is ours.
    let res = if unsafe { libc::fsync(fd) } == 0 {
        Ok(())
    } else {
        Err(Error::last_os("directory's fsync", Some(path)))
    };
    // SAFETY: closed once, here.
    unsafe { libc::close(fd) };
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::thread;
    use std::time::Duration;

    #[test]
    fn renames_during_an_fsync_share_the_next_one() {
        let dir = "/test/group-commit";
        let calls = Arc::new(AtomicUsize::new(0));
        let slow = {
            let calls = Arc::clone(&calls);
            move |_: &str| {
                calls.fetch_add(1, Ordering::SeqCst);
                thread::sleep(Duration::from_millis(200));
                Ok(())
            }
        };
        let first = {
            let slow = slow.clone();
            thread::spawn(move || sync(dir, slow))
        };
        thread::sleep(Duration::from_millis(50)); // the first fsync runs
        let later: Vec<_> = (0..4)
            .map(|_| {
                let slow = slow.clone();
                thread::spawn(move || sync(dir, slow))
            })
            .collect();
        first.join().unwrap().unwrap();
        for t in later {
            t.join().unwrap().unwrap();
        }
        // One for the first rename, one shared by the four that came during it.
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn callers_one_after_another_each_get_an_fsync_and_a_failure_covers_nobody() {
        let dir = "/test/one-by-one";
        let calls = AtomicUsize::new(0);
        for _ in 0..3 {
            sync(dir, |_| {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        let failed = sync(dir, |_| {
            Err(Error::os("directory's fsync", None, libc::EIO))
        });
        assert!(matches!(
            failed,
            Err(Error::Os {
                errno: libc::EIO,
                ..
            })
        ));
        // The next caller is not counted as covered by the failed fsync.
        sync(dir, |_| {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 4);
    }
}
