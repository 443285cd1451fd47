//! Chained prefix hashes of token chunks: the key half that names a prefix.
//!
//! Chunk i's hash is blake2b-256 (personal `bsr-prefix`) over the domain tag, chunk
//! i-1's hash and chunk i's token ids as little-endian int64, truncated to 128 bits.
//! `bsr_io.keys` documents the scheme; this is its implementation, here so that a
//! serving engine's scheduler can hash a 512K-token prompt in milliseconds without
//! holding the GIL.

use blake2b_simd::Params;

/// Tag that versions the scheme (changing it changes every key).
pub const DOMAIN: &[u8] = b"bsr-io/prefix/v2";

/// Hashes of the full chunks of `tokens` (token ids as little-endian int64, the form
/// the hash covers) after `prev` (the hash of the chunk before the first token, zero
/// for the start of a sequence), in order. A partial last chunk has no hash.
/// `chunk_tokens` must be positive.
pub fn chain(prev: u128, tokens: &[u8], chunk_tokens: usize) -> Vec<u128> {
    assert!(chunk_tokens > 0, "chunk_tokens must be positive");
    let mut params = Params::new();
    params.hash_length(32).personal(b"bsr-prefix");
    let mut link = prev.to_le_bytes();
    let chunk_bytes = chunk_tokens * 8;
    let mut out = Vec::with_capacity(tokens.len() / chunk_bytes);
    for chunk in tokens.chunks_exact(chunk_bytes) {
        let mut st = params.to_state();
        st.update(DOMAIN).update(&link).update(chunk);
        link.copy_from_slice(&st.finalize().as_bytes()[..16]);
        out.push(u128::from_le_bytes(link));
    }
    out
}

#[cfg(test)]
mod tests {
    fn le(toks: &[i64]) -> Vec<u8> {
        toks.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    fn chain(prev: u128, toks: &[i64], chunk: usize) -> Vec<u128> {
        super::chain(prev, &le(toks), chunk)
    }

    #[test]
    fn chains_and_continues() {
        let toks: Vec<i64> = (0..1000).map(|i| i * 31 - 7).collect();
        let all = chain(0, &toks, 100);
        assert_eq!(all.len(), 10);
        // Continuing from hash k gives the same tail: a growing sequence hashes once.
        assert_eq!(chain(all[3], &toks[400..], 100), all[4..]);
        // One token changed changes its chunk and every later one, not earlier ones.
        let mut other = toks.clone();
        other[450] += 1;
        let b = chain(0, &other, 100);
        assert_eq!(b[..4], all[..4]);
        assert!(b[4..].iter().zip(&all[4..]).all(|(x, y)| x != y));
        assert!(chain(0, &toks[..99], 100).is_empty());
    }
}
