//! Request timings of the io_uring thread, for finding what keeps the queue below its
//! depth (`bsr-lab bench ssd --trace`). Off unless asked for: then the I/O thread stamps
//! each request when it takes it from the channel, when it hands it to the kernel (with
//! how many are in flight and how many wait behind it), and when its completion is
//! reaped, up to a fixed number of events.

use std::time::Instant;

/// One request's life, in nanoseconds since the trace started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEvent {
    /// File offset and length of the request (a resubmitted short transfer is one event).
    pub offset: u64,
    pub bytes: u64,
    /// The I/O thread took the request from the submitter.
    pub queued_ns: u64,
    /// The request went to the kernel.
    pub submit_ns: u64,
    /// Its completion was reaped.
    pub complete_ns: u64,
    /// Requests in flight once this one was pushed (itself included).
    pub depth: u32,
    /// Requests still waiting in the I/O thread's queue behind it at that moment.
    pub waiting: u32,
}

/// Where a traced request stands (kept on the request while it lives).
#[derive(Debug, Clone, Copy, Default)]
pub struct Stamps {
    pub queued: Option<Instant>,
    pub submitted: Option<(Instant, u32, u32)>,
}

#[derive(Debug)]
pub struct Trace {
    start: Instant,
    cap: usize,
    pub events: Vec<TraceEvent>,
}

impl Trace {
    pub fn new(cap: usize) -> Trace {
        Trace {
            start: Instant::now(),
            cap,
            events: Vec::with_capacity(cap.min(1 << 16)),
        }
    }

    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.start).as_nanos() as u64
    }

    /// Record a request whose completion was just reaped (dropped past `cap`).
    pub fn complete(&mut self, offset: u64, bytes: u64, stamps: Stamps) {
        if self.events.len() >= self.cap {
            return;
        }
        let (Some(q), Some((s, depth, waiting))) = (stamps.queued, stamps.submitted) else {
            return; // queued before the trace started
        };
        let now = Instant::now();
        self.events.push(TraceEvent {
            offset,
            bytes,
            queued_ns: self.ns(q),
            submit_ns: self.ns(s),
            complete_ns: self.ns(now),
            depth,
            waiting,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn events_are_relative_and_capped() {
        let mut t = Trace::new(1);
        let q = t.start + Duration::from_micros(5);
        let s = t.start + Duration::from_micros(7);
        let stamps = Stamps {
            queued: Some(q),
            submitted: Some((s, 3, 4)),
        };
        std::thread::sleep(Duration::from_millis(1)); // the completion comes after both
        t.complete(4096, 8192, stamps);
        t.complete(0, 1, stamps); // past the cap: dropped
        t.complete(0, 1, Stamps::default()); // never stamped: dropped
        assert_eq!(t.events.len(), 1);
        let e = t.events[0];
        assert_eq!((e.offset, e.bytes, e.depth, e.waiting), (4096, 8192, 3, 4));
        assert_eq!((e.queued_ns, e.submit_ns), (5_000, 7_000));
        assert!(e.complete_ns >= e.submit_ns);
    }
}
