//! Kept threads for calls that may block in the kernel for as long as a stalled drive
//! likes. A call takes an idle runner or, none being idle, starts one: a call stuck in
//! the kernel holds its runner, never the next call. Runners are kept per CPU set,
//! scheduling policy and nice value of the calling thread, which a new thread inherits:
//! a call runs where and as its caller would (the vLLM connector pins its writers off
//! the forward's cores, and their work must stay there).

use std::collections::HashMap;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread;
use std::time::Duration;

use crate::error::{Error, Result};

type Call = Box<dyn FnOnce() + Send>;

/// A runner idle this long ends.
const IDLE: Duration = Duration::from_secs(30);

#[derive(Clone, PartialEq, Eq, Hash)]
struct Placement {
    cpus: Vec<u8>,
    policy: i32,
    nice: i32,
}

impl Placement {
    /// The calling thread's (0 = this thread, on Linux).
    fn current() -> Placement {
        // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a live local of the size passed.
        let ok = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
        let cpus = if ok == 0 {
            let n = std::mem::size_of_val(&set);
            // SAFETY: `set` is a live local of `n` bytes, read as bytes while it lives.
            unsafe { std::slice::from_raw_parts(&set as *const _ as *const u8, n) }.to_vec()
        } else {
            Vec::new()
        };
        // SAFETY: plain queries of the calling thread, no memory passed.
        let policy = unsafe { libc::sched_getscheduler(0) };
        // SAFETY: as above (getpriority may return -1 as a valid value; it is a key only).
        let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        Placement { cpus, policy, nice }
    }
}

#[derive(Default)]
struct Idle {
    /// Runners waiting for a call: their id and their inbox.
    waiting: Vec<(u64, Sender<Call>)>,
    next_id: u64,
}

#[derive(Default)]
struct Pool {
    /// The process these threads belong to: a forked child has none of them.
    pid: u32,
    by_placement: HashMap<Placement, Arc<Mutex<Idle>>>,
}

fn pool() -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(Mutex::default)
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn idle_for_caller() -> Arc<Mutex<Idle>> {
    let key = Placement::current();
    let mut p = locked(pool());
    let pid = std::process::id();
    if p.pid != pid {
        p.by_placement.clear();
        p.pid = pid;
    }
    Arc::clone(p.by_placement.entry(key).or_default())
}

/// Run `call` on a runner of the caller's placement.
pub(crate) fn run(call: Call) -> Result<()> {
    let idle = idle_for_caller();
    let mut call = call;
    loop {
        let taken = locked(&idle).waiting.pop();
        match taken {
            Some((_, inbox)) => match inbox.send(call) {
                Ok(()) => return Ok(()),
                // The runner ended meanwhile (it cannot: it leaves the list first); try
                // the next one with the call it gave back.
                Err(mpsc::SendError(back)) => call = back,
            },
            None => return start(idle, call),
        }
    }
}

fn start(idle: Arc<Mutex<Idle>>, first: Call) -> Result<()> {
    let id = {
        let mut i = locked(&idle);
        i.next_id += 1;
        i.next_id
    };
    thread::Builder::new()
        .name("bsr-publish".into())
        .spawn(move || serve(idle, id, first))
        .map(drop)
        .map_err(|e| {
            Error::os(
                "thread spawn",
                None,
                e.raw_os_error().unwrap_or(libc::EAGAIN),
            )
        })
}

fn serve(idle: Arc<Mutex<Idle>>, id: u64, first: Call) {
    let (tx, rx) = mpsc::channel::<Call>();
    let mut call = first;
    loop {
        call();
        locked(&idle).waiting.push((id, tx.clone()));
        call = loop {
            match rx.recv_timeout(IDLE) {
                Ok(next) => break next,
                Err(RecvTimeoutError::Timeout) => {
                    let mut i = locked(&idle);
                    if let Some(at) = i.waiting.iter().position(|(w, _)| *w == id) {
                        i.waiting.swap_remove(at);
                        return; // nobody counts on this runner any more
                    }
                    // Taken just now: its call is on the way.
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        };
    }
}
