//! Checksums over slot contents: xxh3-64.
//!
//! twox-hash picks its AVX2 or SSE2 kernel at run time, so a wheel built for any x86-64
//! hashes with the widest vectors the host has: a restore verifies every byte from
//! memory, and at the drive's speed that hash is most of its CPU time.

pub use twox_hash::XxHash3_64 as Xxh3;

pub fn xxh3_64(bytes: &[u8]) -> u64 {
    Xxh3::oneshot(bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn known_values() {
        // Reference values of XXH3_64bits with seed 0.
        assert_eq!(super::xxh3_64(b""), 0x2d06800538d394c2);
        assert_ne!(super::xxh3_64(b"a"), super::xxh3_64(b"b"));
    }
}
