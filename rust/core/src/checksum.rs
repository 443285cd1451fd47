//! Checksums over slot contents: xxh3-64 (several GB/s per core).

pub fn xxh3_64(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
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
