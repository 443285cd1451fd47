//! Byte ranges that a fused install (or an in-place hash) is using right now, across
//! every thread of the process: a call claims the exact ranges of its runs before it
//! touches them, and is refused if another call holds an overlapping one. This is what
//! makes `install::copy_runs_xxh3_raw`'s cross-thread condition hold by construction:
//! install threads work on one set of KV buffers at once, each only on its own chunk's
//! runs, and two calls can never write (or read while another writes) the same bytes.

use std::sync::Mutex;

use crate::error::Error;

static CLAIMED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// The ranges one call holds; given back on drop (also when the call fails or panics).
pub struct Claim {
    ranges: Vec<(usize, usize)>,
}

impl Claim {
    /// Claim `ranges` (absolute `[start, end)` byte ranges), or say which range is in use.
    pub fn take(mut ranges: Vec<(usize, usize)>) -> Result<Claim, Error> {
        ranges.sort_unstable();
        if let Some(w) = ranges.windows(2).find(|w| w[0].1 > w[1].0) {
            return Err(Error::invalid(format!(
                "install runs overlap each other at bytes {:#x}..{:#x}; each byte of the \
                 destination takes one run",
                w[1].0,
                w[0].1.min(w[1].1)
            )));
        }
        let mut claimed = CLAIMED.lock().unwrap_or_else(|p| p.into_inner());
        for &(a, b) in &ranges {
            if claimed.iter().any(|&(c, d)| a < d && c < b) {
                return Err(Error::invalid(format!(
                    "install runs overlap bytes {a:#x}..{b:#x} that another install or hash is \
                     using now; concurrent installs must each write their own chunk's blocks"
                )));
            }
        }
        claimed.extend_from_slice(&ranges);
        Ok(Claim { ranges })
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut claimed = CLAIMED.lock().unwrap_or_else(|p| p.into_inner());
        for r in &self.ranges {
            if let Some(i) = claimed.iter().position(|c| c == r) {
                claimed.swap_remove(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Claim;

    #[test]
    fn overlapping_claims_are_refused_until_released() {
        assert!(Claim::take(vec![(0, 10), (5, 15)]).is_err()); // its own runs overlap
        let a = Claim::take(vec![(1000, 2000), (5000, 6000)]).unwrap();
        assert!(Claim::take(vec![(1999, 2001)]).is_err());
        let b = Claim::take(vec![(2000, 3000), (0, 1000)]).unwrap(); // touching is fine
        drop(a);
        let c = Claim::take(vec![(1500, 1600)]).unwrap();
        drop((b, c));
    }
}
