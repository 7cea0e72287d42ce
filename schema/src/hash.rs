//! Token-block hashing, one implementation for engines, the daemon, the CLI
//! and the C library. Identical to NVIDIA Dynamo 1.6's router hashing, so
//! mixed deployments agree on block identity:
//!
//! - **local hash** of a full block = `xxh3_64(le_u32(tokens), seed = block_seed)`;
//! - **sequence hash** `s[0] = local[0]`, and
//!   `s[i] = xxh3_64(le_u64(s[i-1]) ++ le_u64(local[i]), seed = 1337)`;
//! - a trailing partial block is not hashed;
//! - **block seed** = 1337, wrapping-plus `xxh3_64(lora_name, seed 0)` when a
//!   LoRA adapter name is given, wrapping-plus `xxh3_64(namespace, seed 1)`
//!   when a cache namespace is given (empty strings count as absent). The
//!   chain seed stays 1337 in every case.
//!
//! Test vectors (block size 4, tokens `0..=9`, so two full blocks and a partial
//! one): see `tests::vectors` below, reproduced in `docs/hashing.md`.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of the plain local hash and of the sequence chain.
pub const SEED: u64 = 1337;

/// The local-hash seed for an optional LoRA name and cache namespace.
pub fn block_seed(lora_name: Option<&str>, namespace: Option<&str>) -> u64 {
    let mut seed = SEED;
    if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
    }
    if let Some(ns) = namespace.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(ns.as_bytes(), 1));
    }
    seed
}

/// Local hash of one full block.
pub fn local_hash(block: &[u32], seed: u64) -> u64 {
    // Hash the little-endian bytes in chunks on the stack: no allocation, and
    // a no-op conversion on little-endian hosts.
    if cfg!(target_endian = "little") {
        xxh3_64_with_seed(bytemuck::cast_slice(block), seed)
    } else {
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(seed);
        for t in block {
            h.update(&t.to_le_bytes());
        }
        h.digest()
    }
}

/// Chains `local` onto the previous sequence hash.
pub fn chain(parent: u64, local: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, SEED)
}

/// Number of full blocks in `n_tokens`.
pub fn full_blocks(n_tokens: usize, block_size: usize) -> usize {
    n_tokens.checked_div(block_size).unwrap_or(0)
}

/// Writes the (sequence hash, local hash) pair of every full block of
/// `tokens` into `out` (which must hold [`full_blocks`] entries), continuing
/// the chain after `parent` when given. Returns how many were written.
pub fn hash_blocks_into(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    parent: Option<u64>,
    out: &mut [(u64, u64)],
) -> usize {
    chain_blocks(tokens, block_size, seed, parent, out, |seq, local| {
        (seq, local)
    })
}

/// Walks the full blocks of `tokens` (at most `out.len()`), chaining each
/// block's local hash after the previous sequence hash, and stores
/// `make(sequence, local)` for each; returns how many were written.
fn chain_blocks<T>(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    parent: Option<u64>,
    out: &mut [T],
    make: impl Fn(u64, u64) -> T,
) -> usize {
    if block_size == 0 {
        return 0;
    }
    let mut prev = parent;
    let mut n = 0;
    for (block, slot) in tokens.chunks_exact(block_size).zip(out.iter_mut()) {
        let local = local_hash(block, seed);
        let seq = prev.map_or(local, |p| chain(p, local));
        *slot = make(seq, local);
        prev = Some(seq);
        n += 1;
    }
    n
}

/// Writes the sequence hash of every full block of `tokens` into `out`
/// (which must hold [`full_blocks`] entries), continuing the chain after
/// `parent` when given; returns how many were written. No allocation.
pub fn sequence_hashes_into(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    parent: Option<u64>,
    out: &mut [u64],
) -> usize {
    chain_blocks(tokens, block_size, seed, parent, out, |seq, _| seq)
}

/// Sequence hashes of every full block of `tokens` (allocating convenience).
pub fn sequence_hashes(
    tokens: &[u32],
    block_size: usize,
    lora_name: Option<&str>,
    namespace: Option<&str>,
) -> Vec<u64> {
    let mut out = vec![0; full_blocks(tokens.len(), block_size)];
    let n = sequence_hashes_into(
        tokens,
        block_size,
        block_seed(lora_name, namespace),
        None,
        &mut out,
    );
    out.truncate(n);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le_bytes(tokens: &[u32]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn scheme_is_the_documented_one() {
        // Recompute by the letter of the spec, independently of the helpers.
        let tokens: Vec<u32> = (0..10).collect();
        let l0 = xxh3_64_with_seed(&le_bytes(&tokens[0..4]), 1337);
        let l1 = xxh3_64_with_seed(&le_bytes(&tokens[4..8]), 1337);
        let mut cat = l0.to_le_bytes().to_vec();
        cat.extend_from_slice(&l1.to_le_bytes());
        let s1 = xxh3_64_with_seed(&cat, 1337);
        assert_eq!(sequence_hashes(&tokens, 4, None, None), vec![l0, s1]);
    }

    /// Vectors computed independently with Python's `xxhash` package (see
    /// docs/hashing.md for the script), block size 4, tokens 0..10.
    #[test]
    fn vectors() {
        let tokens: Vec<u32> = (0..10).collect();
        let plain = sequence_hashes(&tokens, 4, None, None);
        assert_eq!(plain, VECTOR_PLAIN);
        assert_eq!(
            sequence_hashes(&tokens, 4, Some("sql-lora"), None),
            VECTOR_LORA
        );
        assert_eq!(
            sequence_hashes(&tokens, 4, None, Some("tenant-a")),
            VECTOR_NS
        );
        assert_eq!(
            sequence_hashes(&tokens, 4, Some("sql-lora"), Some("tenant-a")),
            VECTOR_BOTH
        );
    }

    pub(crate) const VECTOR_PLAIN: [u64; 2] = [9143094415614847814, 9510318385840434533];
    pub(crate) const VECTOR_LORA: [u64; 2] = [2536401604203606606, 11852724217320681974];
    pub(crate) const VECTOR_NS: [u64; 2] = [17009624042690211646, 18279821067719767880];
    pub(crate) const VECTOR_BOTH: [u64; 2] = [2702659810043579679, 1949775453534899289];

    #[test]
    fn block_size_16_vector() {
        let tokens: Vec<u32> = (0..32).collect();
        assert_eq!(
            sequence_hashes(&tokens, 16, None, None),
            [15310707395893867146, 13769157705258532664]
        );
    }

    #[test]
    fn empty_salts_are_absent() {
        assert_eq!(block_seed(Some(""), Some("")), SEED);
        assert_eq!(block_seed(None, None), SEED);
        assert_ne!(block_seed(Some("a"), None), SEED);
        assert_ne!(block_seed(Some("a"), None), block_seed(None, Some("a")));
    }

    #[test]
    fn partial_block_is_not_hashed() {
        let tokens: Vec<u32> = (0..10).collect();
        assert_eq!(
            sequence_hashes(&tokens[..3], 4, None, None),
            Vec::<u64>::new()
        );
        assert_eq!(
            sequence_hashes(&tokens[..7], 4, None, None),
            sequence_hashes(&tokens[..4], 4, None, None)
        );
        assert_eq!(sequence_hashes(&tokens, 0, None, None), Vec::<u64>::new());
    }

    #[test]
    fn salt_changes_local_hash_but_not_chain_seed() {
        let tokens: Vec<u32> = (0..8).collect();
        let seed = block_seed(Some("x"), None);
        let l0 = local_hash(&tokens[..4], seed);
        let l1 = local_hash(&tokens[4..], seed);
        assert_eq!(
            sequence_hashes(&tokens, 4, Some("x"), None),
            vec![l0, chain(l0, l1)]
        );
    }

    #[test]
    fn parent_continues_the_chain() {
        let tokens: Vec<u32> = (0..12).collect();
        let all = sequence_hashes(&tokens, 4, None, None);
        let mut out = [(0, 0); 2];
        hash_blocks_into(&tokens[4..], 4, SEED, Some(all[0]), &mut out);
        assert_eq!([out[0].0, out[1].0], [all[1], all[2]]);
    }
}
