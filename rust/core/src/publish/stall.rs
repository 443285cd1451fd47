//! Fault double: holds a publication at one step, just before its system call, as a
//! stalled drive holds that call in the kernel, until the test releases it. Only tests
//! arm it (`bsr_io._core.stall_publish`); unarmed, a step pays one atomic load.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::Step;

static ARMED: AtomicUsize = AtomicUsize::new(0);
static STALLS: Mutex<Vec<Arc<Stall>>> = Mutex::new(Vec::new());

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug)]
pub struct Stall {
    step: Step,
    /// Publications of temp files under this path prefix only.
    under: String,
    hits: AtomicUsize,
    /// The threads it held (their kernel ids): where a publication ran.
    threads: Mutex<Vec<i32>>,
    released: Mutex<bool>,
    turn: Condvar,
}

/// Hold every publication under `under` at `step` until `release()`.
pub fn arm(step: Step, under: &str) -> Arc<Stall> {
    let s = Arc::new(Stall {
        step,
        under: under.to_owned(),
        hits: AtomicUsize::new(0),
        threads: Mutex::new(Vec::new()),
        released: Mutex::new(false),
        turn: Condvar::new(),
    });
    locked(&STALLS).push(Arc::clone(&s));
    ARMED.fetch_add(1, Ordering::SeqCst);
    s
}

impl Stall {
    /// Publications it has held.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// The kernel thread ids of the publications it held, in order.
    pub fn threads(&self) -> Vec<i32> {
        locked(&self.threads).clone()
    }

    /// Let the held ones go on, and hold no more. Idempotent.
    pub fn release(&self) {
        let mut all = locked(&STALLS);
        if let Some(at) = all.iter().position(|s| std::ptr::eq(&**s, self)) {
            all.swap_remove(at);
            ARMED.fetch_sub(1, Ordering::SeqCst);
        }
        drop(all);
        *locked(&self.released) = true;
        self.turn.notify_all();
    }
}

/// Called by the chain as it enters `step` for the temp file `tmp`.
pub(crate) fn at(step: Step, tmp: &str) {
    if ARMED.load(Ordering::SeqCst) == 0 {
        return;
    }
    let held = locked(&STALLS)
        .iter()
        .find(|s| s.step == step && tmp.starts_with(&s.under))
        .cloned();
    if let Some(s) = held {
        // SAFETY: gettid takes no arguments and cannot fail.
        locked(&s.threads).push(unsafe { libc::gettid() });
        s.hits.fetch_add(1, Ordering::SeqCst);
        let mut released = locked(&s.released);
        while !*released {
            released = s.turn.wait(released).unwrap_or_else(|p| p.into_inner());
        }
    }
}
