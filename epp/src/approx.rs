//! The approximate prefix mode, for prompts the picker cannot tokenize (a
//! model configured without a tokenizer, or a chat request without a
//! template): the prompt's text is cut into fixed-size byte chunks, each
//! hashed onto the hash of everything before it, so two prompts sharing
//! their first N chunks share their first N hashes. The core matches them
//! against where earlier approximate selects went (not against what the
//! engines report), which is approximate twice over: a shared prefix that
//! ends inside a chunk is not counted, and the core does not know what the
//! engine has evicted since.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of the first chunk (distinct from the token hashes' 1337, though
/// the two never meet: approximate hashes live in their own index).
const SEED: u64 = 0x6b76_6564_6765_5458; // "kvedgeTX"

/// The chained hashes of `text`'s whole `chunk_bytes`-byte chunks (a
/// trailing partial chunk is not hashed, like a partial KV block).
pub fn chunk_hashes(text: &[u8], chunk_bytes: usize) -> Vec<u64> {
    if chunk_bytes == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(text.len() / chunk_bytes);
    let mut prev = SEED;
    for chunk in text.chunks_exact(chunk_bytes) {
        prev = xxh3_64_with_seed(chunk, prev);
        out.push(prev);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_share_hashes_up_to_the_first_differing_chunk() {
        let doc = "the quick brown fox jumps over the lazy dog. ".repeat(10);
        let a = chunk_hashes(format!("{doc}Question one?").as_bytes(), 64);
        let b = chunk_hashes(format!("{doc}Second question, longer").as_bytes(), 64);
        let whole = doc.len() / 64;
        assert_eq!(a[..whole], b[..whole]);
        assert_eq!(a.len(), (doc.len() + 13) / 64);
        // A change in the first byte changes every hash (they are chained).
        let c = chunk_hashes(format!("T{}", &doc[1..]).as_bytes(), 64);
        assert!(a.iter().zip(&c).all(|(x, y)| x != y));
        assert!(chunk_hashes(b"short", 64).is_empty());
        assert!(chunk_hashes(doc.as_bytes(), 0).is_empty());
    }
}
