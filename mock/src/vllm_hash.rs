//! vLLM's prefix-cache block hashes, computed as vLLM computes them, so the
//! mock engine's KV events carry the very hashes a real vLLM would publish
//! for the same token ids and a router that hashes prompts as vLLM does
//! (rather than reading the events' token ids, as kvedge's bridge does)
//! finds the blocks.
//!
//! vLLM's default (`--prefix-caching-hash-algo sha256`) hashes a block as
//! `sha256(pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=5))`
//! where `parent` is the previous block's 32-byte digest, or for a
//! sequence's first block `NONE_HASH = sha256(pickle.dumps(seed))` with
//! the seed `PYTHONHASHSEED` if set, else `"vllm-none-hash"`. Its events
//! carry the digest's low 64 bits as an integer (big-endian tail; the
//! default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`). The pickle is
//! written here opcode for opcode as CPython's pickler writes these
//! values (a hand-written encoder for three value shapes rather than a
//! pickle crate: the bytes must match CPython's exactly, framing and memo
//! opcodes included). Blocks without extra keys only (no LoRA, multimodal
//! input or cache salt), which is all the mock engine serves.
//!
//! [`Chains`] keeps the digests of the blocks an engine holds, so its
//! Removed events name the same hashes its Stored events did.

use std::collections::HashMap;
use std::sync::OnceLock;

use kvedge_schema::messages::Tier;
use sha2::{Digest as _, Sha256};

/// A block's full vLLM hash.
pub type Digest = [u8; 32];

/// The largest block hashed, in tokens: its pickle stays in one pickle
/// frame (CPython starts a new frame past 64 KiB; at most 5 bytes a token
/// here), the only framing written.
pub const MAX_BLOCK_TOKENS: usize = 8192;

/// The default seed of vLLM's `NONE_HASH`.
pub const DEFAULT_SEED: &str = "vllm-none-hash";

// Pickle opcodes (CPython's Lib/pickle.py).
const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const SHORT_BINUNICODE: u8 = 0x8c;
const SHORT_BINBYTES: u8 = b'C';
const MEMOIZE: u8 = 0x94;
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const EMPTY_TUPLE: u8 = b')';
const TUPLE3: u8 = 0x87;
const NONE: u8 = b'N';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const STOP: u8 = b'.';

/// A protocol-5 pickle of one value, built in `out`: the protocol header,
/// one frame (its length patched in once the value is written), the value,
/// STOP.
fn pickle(out: &mut Vec<u8>, value: impl FnOnce(&mut Vec<u8>)) {
    out.clear();
    out.extend_from_slice(&[PROTO, 5, FRAME]);
    out.extend_from_slice(&[0; 8]);
    value(out);
    out.push(STOP);
    let frame = (out.len() - 11) as u64;
    out[3..11].copy_from_slice(&frame.to_le_bytes());
}

fn int(out: &mut Vec<u8>, v: u32) {
    match v {
        0..=0xff => out.extend_from_slice(&[BININT1, v as u8]),
        0x100..=0xffff => {
            out.push(BININT2);
            out.extend_from_slice(&(v as u16).to_le_bytes());
        }
        0x1_0000..=0x7fff_ffff => {
            out.push(BININT);
            out.extend_from_slice(&v.to_le_bytes());
        }
        // Past i32: a little-endian two's complement of 5 bytes (the top
        // one 0, the sign).
        _ => {
            out.extend_from_slice(&[LONG1, 5]);
            out.extend_from_slice(&v.to_le_bytes());
            out.push(0);
        }
    }
}

/// `sha256(pickle.dumps(seed, protocol=5))`: vLLM's `NONE_HASH` for `seed`.
pub fn none_hash(seed: &str) -> Digest {
    let mut out = Vec::with_capacity(32 + seed.len());
    pickle(&mut out, |out| {
        let s = seed.as_bytes();
        if s.len() <= 0xff {
            out.extend_from_slice(&[SHORT_BINUNICODE, s.len() as u8]);
        } else {
            // BINUNICODE, 4-byte length.
            out.push(b'X');
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        }
        out.extend_from_slice(s);
        out.push(MEMOIZE);
    });
    Sha256::digest(&out).into()
}

/// `NONE_HASH` as this process's vLLM would have it: from `PYTHONHASHSEED`
/// if set, else from [`DEFAULT_SEED`].
pub fn process_none_hash() -> &'static Digest {
    static NONE_HASH: OnceLock<Digest> = OnceLock::new();
    NONE_HASH.get_or_init(|| {
        let seed = std::env::var("PYTHONHASHSEED").ok();
        none_hash(seed.as_deref().unwrap_or(DEFAULT_SEED))
    })
}

/// Hashes blocks as vLLM's `hash_block_tokens` does, reusing one buffer.
#[derive(Debug, Default)]
pub struct Hasher {
    buf: Vec<u8>,
}

impl Hasher {
    /// The hash of the block holding `tokens` after the block whose digest
    /// is `parent` (vLLM's `NONE_HASH` for a sequence's first block).
    ///
    /// # Panics
    /// If `tokens` holds more than [`MAX_BLOCK_TOKENS`] (callers check the
    /// block size once, up front).
    pub fn block(&mut self, parent: &Digest, tokens: &[u32]) -> Digest {
        assert!(
            tokens.len() <= MAX_BLOCK_TOKENS,
            "block of {} tokens",
            tokens.len()
        );
        pickle(&mut self.buf, |out| {
            out.extend_from_slice(&[SHORT_BINBYTES, 32]);
            out.extend_from_slice(parent);
            out.push(MEMOIZE);
            match tokens.len() {
                0 => out.push(EMPTY_TUPLE),
                n @ 1..=3 => {
                    tokens.iter().for_each(|&t| int(out, t));
                    out.push(TUPLE1 + (n as u8 - 1));
                    out.push(MEMOIZE);
                }
                _ => {
                    out.push(MARK);
                    tokens.iter().for_each(|&t| int(out, t));
                    out.push(TUPLE);
                    out.push(MEMOIZE);
                }
            }
            out.extend_from_slice(&[NONE, TUPLE3, MEMOIZE]);
        });
        Sha256::digest(&self.buf).into()
    }

    /// The hashes of `tokens`' whole blocks of `block_size`, first to last.
    pub fn sequence(&mut self, none: &Digest, tokens: &[u32], block_size: usize) -> Vec<Digest> {
        let mut parent = *none;
        tokens
            .chunks_exact(block_size)
            .map(|block| {
                parent = self.block(&parent, block);
                parent
            })
            .collect()
    }
}

/// The integer a vLLM event carries for a block hash: its low 64 bits.
pub fn external(d: &Digest) -> u64 {
    let mut tail = [0; 8];
    tail.copy_from_slice(&d[24..]);
    u64::from_be_bytes(tail)
}

/// One engine's vLLM hashes by kvedge block hash: exact for every block it
/// holds (in any tier), so a Removed event names what the Stored event
/// did, and a few pools' worth of recent ones, for the parents of later
/// Stored events. Both are bounded: the first by what the engine holds,
/// the second by `capacity` (two generations, like the HTTP front's token
/// memory).
#[derive(Debug)]
pub struct Chains {
    none: Digest,
    hasher: Hasher,
    /// Each block held: digest, tiers (a bit per tier), parent.
    held: HashMap<u64, Held>,
    /// Blocks whose last tier went in this batch: dropped at its end
    /// unless stored again (a block leaving the device for the host is
    /// Removed, then Stored).
    emptied: Vec<u64>,
    recent: HashMap<u64, Digest>,
    older: HashMap<u64, Digest>,
    capacity: usize,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    digest: Digest,
    tiers: u8,
    parent: Option<u64>,
}

fn bit(tier: Tier) -> u8 {
    1 << (tier as u8)
}

impl Chains {
    /// Chains starting at `none` (vLLM's `NONE_HASH`), remembering about
    /// `capacity` blocks no longer held.
    pub fn new(none: Digest, capacity: usize) -> Self {
        Chains {
            none,
            hasher: Hasher::default(),
            held: HashMap::new(),
            emptied: Vec::new(),
            recent: HashMap::new(),
            older: HashMap::new(),
            capacity: capacity.max(1),
        }
    }

    fn known(&self, hash: u64) -> Option<Digest> {
        self.held
            .get(&hash)
            .map(|b| b.digest)
            .or_else(|| self.recent.get(&hash).copied())
            .or_else(|| self.older.get(&hash).copied())
    }

    fn remember(&mut self, hash: u64, digest: Digest) {
        if self.recent.len() >= self.capacity {
            self.older = std::mem::take(&mut self.recent);
        }
        self.recent.insert(hash, digest);
    }

    /// The vLLM hashes of a Stored event's blocks, a chain after `parent`
    /// (kvedge hashes), whose token ids are `tokens`, `block_size` a
    /// block. Returns the
    /// parent's and the blocks' event integers; `None` as the parent's
    /// when the event has none. A block already held keeps its digest (a
    /// block moving to another tier). A parent no longer known (gone from
    /// the engine and from memory) gives its blocks hashes no vLLM would
    /// compute; the mock's pool sizes make that rare, and kvedge's bridge
    /// reads token ids, not these.
    pub fn stored(
        &mut self,
        tier: Tier,
        parent: Option<u64>,
        hashes: &[u64],
        tokens: &[u32],
        block_size: usize,
        out: &mut Vec<u64>,
    ) -> Option<u64> {
        out.clear();
        let mut prev = match parent {
            None => self.none,
            Some(p) => self.known(p).unwrap_or_else(|| unknown(p)),
        };
        let parent_event = parent.map(|p| {
            self.remember(p, prev);
            external(&prev)
        });
        let mut prev_hash = parent;
        for (&h, block) in hashes.iter().zip(tokens.chunks(block_size.max(1))) {
            let digest = match self.held.get(&h) {
                Some(b) => b.digest,
                None => self.hasher.block(&prev, block),
            };
            self.held
                .entry(h)
                .or_insert(Held {
                    digest,
                    tiers: 0,
                    parent: prev_hash,
                })
                .tiers |= bit(tier);
            self.remember(h, digest);
            out.push(external(&digest));
            prev = digest;
            prev_hash = Some(h);
        }
        parent_event
    }

    /// The event integers of a Removed event's blocks.
    pub fn removed(&mut self, tier: Tier, hashes: &[u64], out: &mut Vec<u64>) {
        out.clear();
        for &h in hashes {
            let digest = match self.held.get_mut(&h) {
                Some(b) => {
                    b.tiers &= !bit(tier);
                    if b.tiers == 0 {
                        self.emptied.push(h);
                    }
                    b.digest
                }
                None => self.known(h).unwrap_or_else(|| unknown(h)),
            };
            out.push(external(&digest));
        }
    }

    /// Ends a batch: blocks held in no tier any more are forgotten (their
    /// digests stay among the recent ones).
    pub fn end_batch(&mut self) {
        for h in std::mem::take(&mut self.emptied) {
            if let Some(b) = self.held.get(&h).copied()
                && b.tiers == 0
            {
                self.held.remove(&h);
                self.remember(h, b.digest);
            }
        }
    }

    /// The parent of a block held (kvedge hashes): a block moving to
    /// another tier is published as vLLM's offloading does, one block an
    /// event with its own parent and token ids.
    pub fn parent_of(&self, hash: u64) -> Option<u64> {
        self.held.get(&hash).and_then(|b| b.parent)
    }

    /// Blocks held in some tier (for tests).
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

/// A stand-in digest for a block whose vLLM hash cannot be known: its
/// kvedge hash in the event integer's place.
fn unknown(hash: u64) -> Digest {
    let mut d = [0; 32];
    d[24..].copy_from_slice(&hash.to_be_bytes());
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_take_cpythons_shortest_opcode() {
        let enc = |v| {
            let mut out = Vec::new();
            int(&mut out, v);
            out
        };
        assert_eq!(enc(0), [BININT1, 0]);
        assert_eq!(enc(255), [BININT1, 255]);
        assert_eq!(enc(256), [BININT2, 0, 1]);
        assert_eq!(enc(65_536), [BININT, 0, 0, 1, 0]);
        assert_eq!(enc(0x7fff_ffff), [BININT, 0xff, 0xff, 0xff, 0x7f]);
        assert_eq!(enc(0x8000_0000), [LONG1, 5, 0, 0, 0, 0x80, 0]);
    }

    #[test]
    fn the_event_integer_is_the_digests_big_endian_tail() {
        let mut d = [0; 32];
        d[24..].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(external(&d), 0x0102_0304_0506_0708);
    }

    #[test]
    fn a_block_moving_tiers_keeps_its_hash_and_a_removed_one_names_it() {
        let mut c = Chains::new(none_hash(DEFAULT_SEED), 16);
        let toks =
            |hashes: &[u64]| -> Vec<u32> { hashes.iter().flat_map(|&h| [h as u32; 4]).collect() };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let stored = c.stored(Tier::Device, None, &[1, 2], &toks(&[1, 2]), 4, &mut a);
        assert_eq!(stored, None);
        // The device copy goes, the host takes it: one batch.
        c.removed(Tier::Device, &[2], &mut b);
        assert_eq!(b, a[1..]);
        let parent = c.stored(Tier::Host, None, &[2], &toks(&[2]), 4, &mut b);
        assert_eq!((parent, &b[..]), (None, &a[1..]));
        c.end_batch();
        assert_eq!(c.held(), 2);
        assert_eq!((c.parent_of(1), c.parent_of(2)), (None, Some(1)));
        // A child of block 1 names its vLLM hash as the parent.
        let parent = c.stored(Tier::Device, Some(1), &[3], &toks(&[3]), 4, &mut b);
        assert_eq!(parent, Some(a[0]));
        // Gone from every tier: forgotten as held, still named right.
        c.removed(Tier::Host, &[2], &mut b);
        c.end_batch();
        assert_eq!(c.held(), 2);
        c.removed(Tier::Device, &[2], &mut b);
        assert_eq!(b, a[1..]);
    }
}
