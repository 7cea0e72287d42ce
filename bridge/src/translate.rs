//! From an engine's events to kvedge's: the engine's block hashes (sha256
//! of a pickled tuple in vLLM, which no other process can recompute) are
//! replaced by kvedge's own sequence hashes, computed from the events'
//! token ids with the same scheme as every frontend uses, LoRA name and
//! cache salt folded into the seed. A per-worker map from the engine's hash
//! to kvedge's applies later removals and parent links.
//!
//! Nothing is ever indexed under a hash kvedge is not sure of: an event
//! with the wrong block size, without token ids, after an unknown parent,
//! with keys kvedge cannot fold in (multimodal inputs), of another KV cache
//! group or on an unknown medium is skipped and counted, and the count is
//! reported as a [`notice`] on the worker.

use std::collections::HashMap;

use kvedge_schema::hash;
use kvedge_schema::messages::{StoredBlock, Tier, notice};

use crate::decode::{Event, Extra, Removed, Stored};

/// Where translated events go: the worker's ring in the daemon, a vector
/// in tests.
pub trait Sink {
    /// Blocks became resident in `tier`, hashed with block seed `seed`.
    fn stored(&mut self, tier: Tier, blocks: &[StoredBlock], seed: u64);
    /// Blocks (kvedge's sequence hashes) left `tier`.
    fn removed(&mut self, tier: Tier, hashes: &[u64]);
    /// Every block is gone.
    fn cleared(&mut self);
}

/// The notice codes a translator counts, in [`Counts`] order.
pub const COUNTED: [u16; 10] = [
    notice::BLOCK_SIZE_MISMATCH,
    notice::NO_TOKEN_IDS,
    notice::UNKNOWN_PARENT,
    notice::UNKNOWN_REMOVAL,
    notice::EXTRA_KEYS,
    notice::OTHER_GROUP,
    notice::UNKNOWN_MEDIUM,
    notice::UNDECODABLE,
    notice::UNKNOWN_EVENT,
    notice::TOO_MANY_BLOCKS,
];

/// How many events (or blocks, for removals) each skip reason took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts(pub [u64; COUNTED.len()]);

impl Counts {
    pub fn get(&self, code: u16) -> u64 {
        COUNTED
            .iter()
            .position(|&c| c == code)
            .map_or(0, |i| self.0[i])
    }

    fn add(&mut self, code: u16, n: u64) {
        if let Some(i) = COUNTED.iter().position(|&c| c == code) {
            self.0[i] += n;
        }
    }
}

/// What kvedge knows of one engine block.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// kvedge's sequence hash.
    sequence: u64,
    local: u64,
    /// The block seed its chain was hashed with (children use it too).
    seed: u64,
    /// Tiers it is resident in (bit per [`Tier`]).
    tiers: u8,
}

fn bit(tier: Tier) -> u8 {
    1 << tier as u8
}

/// The engine's medium name as a kvedge tier.
pub fn tier_of(medium: Option<&str>) -> Option<Tier> {
    match medium {
        None => Some(Tier::Device),
        Some(m) if m.eq_ignore_ascii_case("gpu") || m.eq_ignore_ascii_case("cuda") => {
            Some(Tier::Device)
        }
        Some(m)
            if m.eq_ignore_ascii_case("cpu")
                || m.eq_ignore_ascii_case("cpu_pinned")
                || m.eq_ignore_ascii_case("host") =>
        {
            Some(Tier::Host)
        }
        Some(m)
            if m.eq_ignore_ascii_case("disk")
                || m.eq_ignore_ascii_case("storage")
                || m.eq_ignore_ascii_case("local_disk") =>
        {
            Some(Tier::Disk)
        }
        Some(_) => None,
    }
}

/// One worker's translation state.
#[derive(Debug)]
pub struct Translator {
    block_size: u32,
    capacity: usize,
    map: HashMap<u64, Entry, foldhash::fast::RandomState>,
    hashes: Vec<(u64, u64)>,
    blocks: Vec<StoredBlock>,
    removed: Vec<u64>,
    counts: Counts,
    /// The first skip of each kind, for a log line once per engine: the
    /// code and a sentence with the fix.
    first: Vec<(u16, String)>,
    reported: u16,
}

impl Translator {
    /// A translator for an engine started with `block_size`, remembering at
    /// most `capacity` blocks.
    pub fn new(block_size: u32, capacity: usize) -> Self {
        Translator {
            block_size,
            capacity,
            map: HashMap::with_capacity_and_hasher(
                capacity.min(1 << 16),
                foldhash::fast::RandomState::default(),
            ),
            hashes: Vec::with_capacity(64),
            blocks: Vec::with_capacity(64),
            removed: Vec::with_capacity(64),
            counts: Counts::default(),
            first: Vec::new(),
            reported: 0,
        }
    }

    /// Blocks known (in any tier).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Skips so far, by reason.
    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    /// Skip reasons seen for the first time since the last call, each with
    /// a sentence that says what is wrong and how to fix it (for one log
    /// line per engine and reason).
    pub fn take_first_skips(&mut self) -> impl Iterator<Item = (u16, String)> + '_ {
        self.first.drain(..)
    }

    fn skip(&mut self, code: u16, n: u64, why: impl FnOnce() -> String) {
        self.counts.add(code, n);
        let flag = 1u16 << (code % 16);
        if self.reported & flag == 0 {
            self.reported |= flag;
            self.first.push((code, why()));
        }
    }

    /// Counts a payload that did not decode.
    pub fn undecodable(&mut self, why: &str) {
        self.skip(notice::UNDECODABLE, 1, || {
            format!("a payload did not decode ({why}); it was skipped")
        });
    }

    /// Forgets every block and tells the sink so.
    pub fn reset(&mut self, sink: &mut impl Sink) {
        self.map.clear();
        sink.cleared();
    }

    /// Publishes every known block again (a snapshot for the daemon).
    pub fn republish(&mut self, sink: &mut impl Sink) {
        for tier in Tier::ALL {
            // Grouped by seed so each record carries one.
            self.blocks.clear();
            let mut seed = None;
            for e in self.map.values().filter(|e| e.tiers & bit(tier) != 0) {
                if seed.is_some_and(|s| s != e.seed) || self.blocks.len() == 256 {
                    sink.stored(tier, &self.blocks, seed.unwrap_or(hash::SEED));
                    self.blocks.clear();
                }
                seed = Some(e.seed);
                self.blocks.push(StoredBlock {
                    sequence_hash: e.sequence,
                    local_hash: e.local,
                });
            }
            if !self.blocks.is_empty() {
                sink.stored(tier, &self.blocks, seed.unwrap_or(hash::SEED));
            }
        }
    }

    /// Applies one decoded event.
    pub fn apply(&mut self, event: &Event<'_>, sink: &mut impl Sink) {
        match event {
            Event::Stored(s) => self.stored(s, sink),
            Event::Removed(r) => self.removed(r, sink),
            Event::Cleared => self.reset(sink),
            Event::Unknown(tag) => self.skip(notice::UNKNOWN_EVENT, 1, || {
                format!("events of type `{tag}` are not known to kvedge and are skipped")
            }),
            Event::Invalid {
                tag,
                field,
                problem,
            } => self.skip(notice::UNDECODABLE, 1, || {
                format!("a `{tag}` event's `{field}` did not decode ({problem}); it was skipped")
            }),
        }
    }

    /// The seed for a chain's first block, or why none can be had.
    fn root_seed(&self, s: &Stored<'_>) -> Result<u64, &'static str> {
        let Extra {
            first,
            first_more,
            later,
            later_more,
        } = s.extra;
        if first_more || later_more || later.is_some_and(|l| Some(l) != s.lora_name) {
            return Err("multimodal or other extra keys");
        }
        let mut salt = None;
        for key in first.into_iter().flatten() {
            if Some(key) == s.lora_name {
                continue;
            }
            if salt.replace(key).is_some() {
                return Err("more than one extra key on the first block");
            }
        }
        if salt.is_some() && s.parent.is_some() {
            return Err("a cache salt on a block that has a parent");
        }
        // SGLang names the salt on every event of a salted request; a
        // chain's later blocks inherit it from their parent, as here.
        if let Some(named) = s.cache_salt.filter(|_| s.parent.is_none()) {
            match salt {
                None => salt = Some(named),
                Some(key) if key == named => {}
                Some(_) => return Err("two different cache salts"),
            }
        }
        Ok(hash::block_seed(s.lora_name, salt))
    }

    /// The tier an event's blocks live in, or `None` (counted) when kvedge
    /// does not read them: an unknown medium, another KV cache group.
    fn placement(&mut self, medium: Option<&str>, group_idx: Option<i64>) -> Option<Tier> {
        let Some(tier) = tier_of(medium) else {
            let medium = medium.unwrap_or_default().to_owned();
            self.skip(notice::UNKNOWN_MEDIUM, 1, || {
                format!("blocks on medium `{medium}` are skipped (kvedge knows GPU, CPU/CPU_PINNED and DISK/STORAGE; a pool shared by every engine, such as SGLang's EXTERNAL, favours none)")
            });
            return None;
        };
        if group_idx.is_some_and(|g| g != 0) {
            self.skip(notice::OTHER_GROUP, 1, || {
                "events of KV cache groups other than 0 (a hybrid model's other attention types) are skipped".into()
            });
            return None;
        }
        Some(tier)
    }

    fn stored(&mut self, s: &Stored<'_>, sink: &mut impl Sink) {
        let n = s.hashes.len() as u64;
        let Some(tier) = self.placement(s.medium, s.group_idx) else {
            return;
        };
        let bs = self.block_size;
        if let Some(got) = s.block_size
            && got != i64::from(bs)
        {
            return self.skip(notice::BLOCK_SIZE_MISMATCH, 1, || {
                format!("the engine's blocks hold {got} tokens but kvedge is configured for {bs}: set `block_size: {got}` for this engine (its blocks are not indexed until then)")
            });
        }
        if s.tokens.is_empty() && !s.hashes.is_empty() {
            return self.skip(notice::NO_TOKEN_IDS, 1, || {
                "stored events carry no token ids, so kvedge cannot compute the blocks' hashes; use an engine version that sends token_ids".into()
            });
        }
        if s.tokens.len() as u64 != n * u64::from(bs) {
            let tokens = s.tokens.len();
            return self.skip(notice::BLOCK_SIZE_MISMATCH, 1, || {
                format!("an event has {tokens} token ids for {n} blocks, not {n} x {bs}: check `block_size` (the engine's blocks are not indexed)")
            });
        }
        if s.lora_id.is_some() && s.lora_name.is_none() {
            return self.skip(notice::EXTRA_KEYS, 1, || {
                "an adapter's blocks name only its numeric LoRA id; kvedge hashes LoRA by name and skips them".into()
            });
        }
        let (parent, seed) = match s.parent {
            Some(p) => match self.map.get(&p) {
                Some(e) => (Some(e.sequence), e.seed),
                None => {
                    return self.skip(notice::UNKNOWN_PARENT, 1, || {
                        "a stored block's parent was never seen (events before kvedge started, or lost); it is skipped until a chain starts again".into()
                    });
                }
            },
            None => (None, hash::SEED),
        };
        // A chain's first block sets the seed (LoRA name, cache salt);
        // its children inherit it, and may carry nothing else.
        let seed = match (parent, self.root_seed(s)) {
            (Some(_), Ok(_)) => seed,
            (None, Ok(root)) => root,
            (_, Err(why)) => {
                return self.skip(notice::EXTRA_KEYS, 1, || {
                    format!("blocks hashed with {why} cannot be matched from token ids; they are skipped")
                });
            }
        };
        self.hashes.clear();
        self.hashes.resize(s.hashes.len(), (0, 0));
        hash::hash_blocks_into(s.tokens, bs as usize, seed, parent, &mut self.hashes);
        self.blocks.clear();
        for (&engine, &(sequence, local)) in s.hashes.iter().zip(&self.hashes) {
            let len = self.map.len();
            match self.map.get_mut(&engine) {
                Some(e) => e.tiers |= bit(tier),
                None if len >= self.capacity => {
                    let cap = self.capacity;
                    self.skip(notice::TOO_MANY_BLOCKS, 1, || {
                        format!("the engine holds more than {cap} blocks (daemon.index_capacity); further blocks are not indexed")
                    });
                    break;
                }
                None => {
                    self.map.insert(
                        engine,
                        Entry {
                            sequence,
                            local,
                            seed,
                            tiers: bit(tier),
                        },
                    );
                }
            }
            self.blocks.push(StoredBlock {
                sequence_hash: sequence,
                local_hash: local,
            });
        }
        if !self.blocks.is_empty() {
            sink.stored(tier, &self.blocks, seed);
        }
    }

    fn removed(&mut self, r: &Removed<'_>, sink: &mut impl Sink) {
        let Some(tier) = self.placement(r.medium, r.group_idx) else {
            return;
        };
        self.removed.clear();
        let mut unknown = 0;
        for engine in r.hashes {
            match self.map.get_mut(engine) {
                Some(e) if e.tiers & bit(tier) != 0 => {
                    e.tiers &= !bit(tier);
                    self.removed.push(e.sequence);
                    if e.tiers == 0 {
                        self.map.remove(engine);
                    }
                }
                _ => unknown += 1,
            }
        }
        if unknown > 0 {
            self.skip(notice::UNKNOWN_REMOVAL, unknown, || {
                "removals of blocks kvedge never indexed (skipped earlier, or stored before kvedge started) are ignored".into()
            });
        }
        if !self.removed.is_empty() {
            sink.removed(tier, &self.removed);
        }
    }
}
