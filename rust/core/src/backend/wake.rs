//! Waking the io_uring thread while it waits in the kernel. The thread waits for a
//! completion whenever a request is in flight; without a wake, an operation sent
//! meanwhile sat in the channel until some completion came, so one slow request (an
//! fdatasync behind a busy journal, a read of a stalled device) held back every later
//! one on the same engine, however fast it would have been.
//!
//! The thread keeps a one-shot poll of an eventfd in the ring. Before it waits it says so
//! (`park`) and looks at the channel once more; a sender that finds it parked writes the
//! eventfd, which ends the wait. Either the thread sees the command or the sender sees
//! the flag (both sides order their store before their load), so no command waits for an
//! unrelated completion, and a thread that is running costs its senders no system call.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, Ordering};

use io_uring::{opcode, squeue, types};

/// The wake poll's user_data: never a request's (those index the slab).
pub const WAKE: u64 = u64::MAX - 1;

#[derive(Debug)]
pub struct Waker {
    fd: OwnedFd,
    parked: AtomicBool,
}

impl Waker {
    pub fn new() -> std::io::Result<Waker> {
        // SAFETY: eventfd takes no pointers; a descriptor it returns is ours alone.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Waker {
            // SAFETY: a fresh descriptor nothing else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            parked: AtomicBool::new(false),
        })
    }

    /// The sender's side, after its command is in the channel: end the thread's wait if
    /// it is waiting (or about to).
    pub fn wake(&self) {
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: 8 bytes from a live buffer. A full counter (EAGAIN) already wakes.
            unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        }
    }

    /// The thread is about to wait: after this it must look at the channel once more.
    pub fn park(&self) {
        self.parked.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    pub fn unpark(&self) {
        self.parked.store(false, Ordering::Relaxed);
    }

    /// The poll fired: reset the counter before polling again.
    pub fn drain(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: 8 bytes into a live buffer; nonblocking, so an empty counter returns.
        unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    }

    /// A one-shot poll for the eventfd becoming readable.
    pub fn poll_entry(&self) -> squeue::Entry {
        opcode::PollAdd::new(types::Fd(self.fd.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(WAKE)
    }
}
