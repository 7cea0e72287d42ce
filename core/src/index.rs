//! The KV index: which local workers hold each block (by sequence hash), per
//! tier, and the prefix-overlap query the router runs for every request.
//!
//! Layout, chosen for memory and for the overlap walk:
//! - per tier, a map from sequence hash to a 64-bit mask of worker slots
//!   (a node routes to at most [`MAX_WORKERS`] workers), so a block held
//!   by several workers costs one entry. The map is split into
//!   [`SHARDS`] tables by bits of the key's hash, so a table that grows
//!   doubles only its own eighth: one table of 10 million entries briefly
//!   held its old and new arrays at once, 1.5 times its size. (More shards
//!   saved little more memory and made the overlap walk slower.) Each
//!   table keeps a key in one of two 64-byte buckets that its hash fixes
//!   (see `mask_table`), so a lookup reads at most two known cache lines.
//!   Keys are hashed with a fast seeded hash (foldhash), not by identity:
//!   keys come from engines, and sequential or crafted ones would otherwise
//!   crowd a few buckets (with an open-addressing table, sequential
//!   hashes once made unrelated lookups thousands of times slower);
//! - nothing per entry besides: per worker and tier a count, and which
//!   shards it stored into since it was last cleared, so `Cleared` and a
//!   worker's death clear its bit in those shards only. A worker holding
//!   few blocks also keeps their list (up to [`LISTED`] per tier), and its
//!   `Cleared` costs O(its blocks); a larger one's sweeps its shards, which
//!   is O(the tier): somewhat slower than per-worker hash sets, which
//!   would cost 25 bytes an entry.
//!
//! Capacity is counted in (block, worker, tier) entries. When a store would
//! exceed it, room is made by evicting entries of the worker that holds the
//! most (so one engine cannot keep a later one out), its oldest-stored
//! first: engines report when a block enters and leaves their cache, not
//! when it is reused, so the block resident longest is the best guess at
//! the least recently used. [`KvIndex::evicted`] counts them, and a log
//! line says when eviction starts. A worker's store order is kept in a
//! queue, but only while the index is at least half full: far from
//! capacity, where most nodes live, a store costs no more than its table
//! insert and no memory goes to the queues. When the index first reaches
//! half, the queues start from the tables as they are (the blocks already
//! held count as equally old); below a quarter they are dropped again.
//! Removed hashes leave a queue lazily. Once they are most of it, the
//! queue is compacted a few entries per later change (see `Compaction`),
//! so that no single change pays for the whole queue; and a queue grows
//! by chunks (`ChunkQueue`), never by copying itself.
//!
//! The overlap query walks the request's hashes in order, keeping for each
//! tier the mask of workers whose prefix is still unbroken, and stops as soon
//! as every mask is empty. It looks hashes up in doubling batches (8, 16,
//! 32, 64), and first asks the CPU for both buckets of every hash in the
//! batch (a prefetch, which does not wait), then reads them. So the cache
//! misses of a large or cold index overlap instead of queuing, while a
//! short prefix still stops after a few.

use std::collections::HashSet;
use std::hash::BuildHasher;

use kvedge_schema::messages::Tier;

use crate::chunk_queue::ChunkQueue;
use crate::mask_table::{Bucket, MaskTable, Set, mask_in};

/// Most worker slots one index tracks.
pub use kvedge_config::MAX_WORKERS;

/// Hash tables per tier (a power of two, at most 64: a worker's shards
/// are one mask).
pub const SHARDS: usize = 8;

/// Blocks per worker and tier whose hashes are also listed, so that
/// clearing a small worker does not sweep its shards.
pub const LISTED: usize = 4096;

/// A worker's position in the index (0..64), assigned at registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(u8);

impl Slot {
    pub fn new(index: usize) -> Option<Slot> {
        (index < MAX_WORKERS).then_some(Slot(index as u8))
    }
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
    fn bit(self) -> u64 {
        1u64 << self.0
    }
}

/// Per-slot, per-tier prefix overlap, in blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overlap {
    /// `blocks[tier][slot]`.
    pub blocks: [[u32; MAX_WORKERS]; 3],
}

impl Default for Overlap {
    fn default() -> Self {
        Overlap {
            blocks: [[0; MAX_WORKERS]; 3],
        }
    }
}

impl Overlap {
    pub fn get(&self, slot: Slot, tier: Tier) -> u32 {
        self.blocks[tier as usize][slot.index()]
    }
}

/// One tier: hash -> worker mask, in shards. A key is hashed once (a
/// seeded foldhash); bits 40-42 of that hash choose the shard. The
/// shard's table takes a key's first bucket from the low bits and its
/// second from the upper half of a product, so neither is fixed by the
/// shard.
#[derive(Debug, Default)]
struct TierMap {
    hasher: foldhash::fast::RandomState,
    shards: Box<[MaskTable; SHARDS]>,
    /// Distinct blocks.
    len: usize,
}

/// The shard of a key whose hash is `hash`.
#[inline(always)]
fn shard_of(hash: u64) -> usize {
    ((hash >> 40) as usize) & (SHARDS - 1)
}

impl TierMap {
    #[inline(always)]
    fn hash(&self, h: u64) -> u64 {
        self.hasher.hash_one(h)
    }

    #[inline(always)]
    fn get(&self, h: u64) -> u64 {
        self.get_hashed(self.hash(h), h)
    }

    #[inline(always)]
    fn get_hashed(&self, hash: u64, h: u64) -> u64 {
        self.shards[shard_of(hash)].get(hash, h)
    }

    /// The buckets a lookup of `hash` may read.
    #[inline(always)]
    fn buckets_of(&self, hash: u64) -> (&Bucket, &Bucket) {
        self.shards[shard_of(hash)].buckets_of(hash)
    }

    /// Sets `bit` on `h` (whose hash is `hash`); false if it was set.
    fn set_hashed(&mut self, hash: u64, h: u64, bit: u64) -> bool {
        let hasher = &self.hasher;
        match self.shards[shard_of(hash)].set(hash, h, bit, &|k| hasher.hash_one(k)) {
            Set::Had => false,
            Set::Added => true,
            Set::NewKey => {
                self.len += 1;
                true
            }
        }
    }

    /// Clears `bit` on `h`; false if it was not set.
    fn unset(&mut self, h: u64, bit: u64) -> bool {
        let hash = self.hash(h);
        match self.shards[shard_of(hash)].unset(hash, h, bit) {
            None => false,
            Some(left) => {
                self.len -= usize::from(left);
                true
            }
        }
    }

    /// Clears `bit` everywhere in shard `s`.
    fn sweep(&mut self, s: usize, bit: u64) {
        self.len -= self.shards[s].unset_everywhere(bit);
    }

    /// Every (hash, mask).
    fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.shards.iter().flat_map(|s| s.iter())
    }
}

/// What the index keeps about one worker in one tier.
#[derive(Debug, Default)]
struct Held {
    /// Entries it holds.
    count: usize,
    /// The shards it stored into since it was last cleared (a shard may no
    /// longer hold any of its entries).
    shards: u64,
    /// While it is short, every hash it stored since it was last cleared
    /// (some since removed, some twice); `None` once it grew past
    /// [`LISTED`], when clearing sweeps `shards` instead.
    listed: Option<Vec<u64>>,
}

impl Held {
    fn fresh() -> Self {
        Held {
            listed: Some(Vec::new()),
            ..Held::default()
        }
    }

    fn note(&mut self, h: u64, shard: usize) {
        self.shards |= 1 << shard;
        if let Some(list) = &mut self.listed {
            if list.len() < LISTED {
                list.push(h);
            } else {
                self.listed = None;
            }
        }
    }
}

/// Stale entries (removed hashes, and repeats) a store-order queue may
/// hold beyond its live ones before it is compacted: a compaction starts
/// once the queue is longer than twice its live entries plus this.
const COMPACT_SLACK: usize = 1024;

/// Queue entries a compaction looks at per hash an index change stores or
/// removes, and at least per change. A compaction starts when over half
/// of its queue is stale, so it has the queue's length to look at, and
/// each hash stored meanwhile lengthens the queue by one; at four per
/// hash it ends long before the next could start.
const COMPACT_PER_HASH: usize = 4;
const COMPACT_PER_CHANGE: usize = 16;

/// Table buckets (about three keys each) the walk that starts keeping
/// store order reads per hash a store brings. It has the tables' buckets
/// to read, about a quarter of the capacity's worth when it starts at half
/// of it, and at least half the capacity's hashes come before eviction
/// needs it done.
const WALK_PER_HASH: usize = 2;

/// Buckets the walk reads at once when it starts (tens of microseconds):
/// an index this small is queued whole, and exactly as it was.
const WALK_AT_ONCE: usize = 4096;

/// The walk over the tables, a few buckets per stored hash, that queues
/// the entries held when the index first reached half full (building those
/// queues at once held the routing thread for too long in a large index).
/// Its place is table `shard` of tier `tier`, bucket `bucket` of
/// the `size` the table had when the walk reached it.
///
/// Keys the tables move meanwhile may be read twice (a second copy in a
/// queue is harmless) or not at all, when an insertion moves one from a
/// bucket not read yet into one already read; such an entry is found when
/// its worker's queues run out (`KvIndex::requeue`).
#[derive(Debug)]
struct Walk {
    tier: usize,
    shard: usize,
    bucket: usize,
    size: usize,
}

/// Which of a worker's two store-order queues in a tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Queue {
    /// `KvIndex::earlier`: what it held when the order started to be kept.
    Earlier,
    /// `KvIndex::order`: what it stored since.
    Order,
}

/// A compaction of worker `w`'s store-order queues in tier `t`, first
/// `earlier[w][t]` then `order[w][t]` (`queue` says which it is in), in
/// progress, done a few entries per index change: a queue of 20 million
/// entries, compacted at once, held the routing thread for 4.7 s.
///
/// In the queue it is in, the entries before `write` are kept (live, each
/// hash once across both queues, in store order); those from `write` to
/// `read` are free, dropped at the end; those from `read` on, with every
/// hash stored since it started, are yet to be looked at. Eviction takes
/// the oldest kept entry, or the first not looked at while none is kept.
#[derive(Debug)]
struct Compaction {
    w: usize,
    t: usize,
    queue: Queue,
    write: usize,
    read: usize,
    /// The hashes kept so far.
    seen: HashSet<u64, foldhash::fast::RandomState>,
}

/// The index.
#[derive(Debug)]
pub struct KvIndex {
    tiers: [TierMap; 3],
    held: Vec<[Held; 3]>,
    /// Per worker and tier, hashes in the order they were stored (some
    /// already removed: checked against the tier map when evicting).
    order: Vec<[ChunkQueue; 3]>,
    /// Per worker and tier, the hashes it held when store order started
    /// to be kept, in table order (equally old, and older than `order`'s;
    /// some since removed). Evicted first.
    earlier: Vec<[ChunkQueue; 3]>,
    /// The walk over the tables that fills `earlier`, while it runs.
    walk: Option<Walk>,
    entries: usize,
    capacity: usize,
    refused_full: u64,
    evicted: u64,
    /// Eviction has started and the index has not drained below 90% since
    /// (it is logged once per episode).
    evicting: bool,
    /// The store-order queues are kept (the index is at least half full,
    /// and has not drained below a quarter since).
    ordered: bool,
    /// The compaction of one store-order queue, while it runs.
    compaction: Option<Compaction>,
    /// Log when eviction starts (off for the approximate memory, where
    /// evicting the oldest decisions is the normal course).
    warn_when_full: bool,
}

impl KvIndex {
    /// An index of at most `capacity` (block, worker, tier) entries.
    pub fn new(capacity: usize) -> Self {
        KvIndex {
            tiers: Default::default(),
            held: (0..MAX_WORKERS)
                .map(|_| [Held::fresh(), Held::fresh(), Held::fresh()])
                .collect(),
            order: (0..MAX_WORKERS).map(|_| Default::default()).collect(),
            earlier: (0..MAX_WORKERS).map(|_| Default::default()).collect(),
            walk: None,
            entries: 0,
            capacity,
            refused_full: 0,
            evicted: 0,
            evicting: false,
            ordered: false,
            compaction: None,
            warn_when_full: true,
        }
    }

    /// The same index, silent when it starts evicting.
    pub fn quiet(mut self) -> Self {
        self.warn_when_full = false;
        self
    }

    /// (block, worker, tier) entries indexed.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Distinct blocks indexed in `tier`.
    pub fn blocks(&self, tier: Tier) -> usize {
        self.tiers[tier as usize].len
    }

    /// Entries not indexed because the index was full and nothing could
    /// be evicted.
    pub fn refused_full(&self) -> u64 {
        self.refused_full
    }

    /// Entries evicted to make room for newer ones.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Blocks `slot` holds in `tier`.
    pub fn worker_blocks(&self, slot: Slot, tier: Tier) -> usize {
        self.held[slot.index()][tier as usize].count
    }

    /// Whether `slot` holds `hash` in `tier`.
    pub fn holds(&self, slot: Slot, tier: Tier, hash: u64) -> bool {
        self.tiers[tier as usize].get(hash) & slot.bit() != 0
    }

    /// Records that `slot` stored `hashes` in `tier`. Returns how many were
    /// new; when the index is full, older entries are evicted for them.
    pub fn store(&mut self, slot: Slot, tier: Tier, hashes: &[u64]) -> usize {
        let t = tier as usize;
        let (w, bit) = (slot.index(), slot.bit());
        let mut added = 0;
        for &h in hashes {
            let hash = self.tiers[t].hash(h);
            if self.entries >= self.capacity {
                if self.tiers[t].get_hashed(hash, h) & bit != 0 {
                    continue;
                }
                if !self.evict_one() {
                    self.refused_full += 1;
                    continue;
                }
            }
            if !self.tiers[t].set_hashed(hash, h, bit) {
                continue;
            }
            let held = &mut self.held[w][t];
            held.count += 1;
            held.note(h, shard_of(hash));
            if self.ordered {
                self.order[w][t].push_back(h);
            }
            self.entries += 1;
            added += 1;
            if !self.ordered && self.entries >= self.capacity / 2 {
                self.start_ordering();
            }
        }
        self.compact_step(hashes.len());
        if self.walk.is_some() {
            self.walk_on(hashes.len() * WALK_PER_HASH);
        }
        added
    }

    /// Starts keeping store order. The entries held so far are queued by
    /// a walk over the tables that later stores move on (see [`Walk`]).
    fn start_ordering(&mut self) {
        self.compaction = None;
        for queues in self.order.iter_mut().chain(&mut self.earlier) {
            for queue in queues.iter_mut() {
                queue.clear();
            }
        }
        self.walk = Some(Walk {
            tier: 0,
            shard: 0,
            bucket: 0,
            size: self.tiers[0].shards[0].bucket_count(),
        });
        self.ordered = true;
        self.walk_on(WALK_AT_ONCE);
    }

    /// Moves the walk on by up to `buckets` buckets, and ends it after the
    /// last table.
    #[inline(never)]
    fn walk_on(&mut self, mut buckets: usize) {
        while let Some(walk) = &mut self.walk {
            let table = &self.tiers[walk.tier].shards[walk.shard];
            if table.bucket_count() != walk.size {
                // The table doubled under the walk: read it again.
                walk.bucket = 0;
                walk.size = table.bucket_count();
            }
            let to = walk.bucket.saturating_add(buckets).min(walk.size);
            for (h, mask) in table.iter_buckets(walk.bucket, to) {
                let mut m = mask;
                while m != 0 {
                    self.earlier[m.trailing_zeros() as usize][walk.tier].push_back(h);
                    m &= m - 1;
                }
            }
            buckets -= to - walk.bucket;
            walk.bucket = to;
            if walk.bucket < walk.size {
                return;
            }
            // The next table, or the end.
            let (tier, shard) = if walk.shard + 1 < SHARDS {
                (walk.tier, walk.shard + 1)
            } else {
                (walk.tier + 1, 0)
            };
            if tier == self.tiers.len() {
                self.walk = None;
                return;
            }
            *walk = Walk {
                tier,
                shard,
                bucket: 0,
                size: self.tiers[tier].shards[shard].bucket_count(),
            };
            if buckets == 0 {
                return;
            }
        }
    }

    /// Queues every entry of worker `w` in tier `t` again, from the table:
    /// for a worker whose queues ran out while it still holds entries (the
    /// walk missed some, see [`Walk`]). Reads the whole tier, once.
    #[cold]
    fn requeue(&mut self, w: usize, t: usize) {
        let bit = 1u64 << w;
        for (h, m) in self.tiers[t].iter() {
            if m & bit != 0 {
                self.earlier[w][t].push_back(h);
            }
        }
    }

    /// Below a quarter full: stops keeping store order, and frees it.
    fn maybe_stop_ordering(&mut self) {
        if self.evicting && self.entries < self.capacity / 10 * 9 {
            self.evicting = false;
        }
        if self.ordered && self.entries < self.capacity / 4 {
            for queues in self.order.iter_mut().chain(&mut self.earlier) {
                *queues = Default::default();
            }
            self.compaction = None;
            self.walk = None;
            self.ordered = false;
        }
    }

    /// Evicts the oldest-stored entry of the worker holding the most
    /// (from its largest tier); false if the index is empty.
    fn evict_one(&mut self) -> bool {
        let Some((w, t)) = (0..MAX_WORKERS)
            .max_by_key(|&w| self.held[w].iter().map(|h| h.count).sum::<usize>())
            .and_then(|w| {
                let t = (0..3).max_by_key(|&t| self.held[w][t].count)?;
                (self.held[w][t].count > 0).then_some((w, t))
            })
        else {
            return false;
        };
        if !self.evicting {
            self.evicting = true;
            if self.warn_when_full {
                tracing::warn!(
                    capacity = self.capacity,
                    "the KV index is full (daemon.index_capacity): evicting the oldest entries of the worker holding the most"
                );
            }
        }
        if !self.ordered {
            self.start_ordering();
        }
        if self.walk.is_some() {
            // Eviction came before the walk was done (the index reached
            // half full and full in a few stores): finish it now.
            self.walk_on(usize::MAX);
        }
        let bit = 1u64 << w;
        for requeued in [false, true] {
            if requeued {
                self.requeue(w, t);
            }
            for q in [Queue::Earlier, Queue::Order] {
                while let Some(h) = self.pop_oldest(w, t, q) {
                    if self.tiers[t].unset(h, bit) {
                        self.evicted_one(w, t);
                        return true;
                    }
                }
            }
        }
        false
    }

    fn evicted_one(&mut self, w: usize, t: usize) {
        self.held[w][t].count -= 1;
        self.entries -= 1;
        self.evicted += 1;
    }

    /// Records that `slot` evicted `hashes` from `tier`.
    pub fn remove(&mut self, slot: Slot, tier: Tier, hashes: &[u64]) -> usize {
        let t = tier as usize;
        let mut removed = 0;
        for &h in hashes {
            if self.tiers[t].unset(h, slot.bit()) {
                self.held[slot.index()][t].count -= 1;
                self.entries -= 1;
                removed += 1;
            }
        }
        self.maybe_compact(slot.index(), t);
        self.compact_step(hashes.len());
        self.maybe_stop_ordering();
        removed
    }

    /// Takes the oldest entry of store-order queue `q` of worker `w` in
    /// tier `t` (perhaps a hash since removed), minding a compaction of it.
    fn pop_oldest(&mut self, w: usize, t: usize, q: Queue) -> Option<u64> {
        let queue = match q {
            Queue::Earlier => &mut self.earlier[w][t],
            Queue::Order => &mut self.order[w][t],
        };
        match &mut self.compaction {
            Some(c) if (c.w, c.t, c.queue) == (w, t, q) => {
                if c.write > 0 {
                    // A kept entry. If its hash is stored again, the new
                    // copy is the one to keep.
                    let h = queue.pop_front()?;
                    c.write -= 1;
                    c.read -= 1;
                    c.seen.remove(&h);
                    Some(h)
                } else {
                    // Nothing kept yet: the oldest is the first not looked
                    // at, which joins the free entries.
                    let h = queue.get(c.read)?;
                    c.read += 1;
                    Some(h)
                }
            }
            Some(c) if (c.w, c.t) == (w, t) => {
                // The other queue of a compaction that passes over both:
                // a hash leaving it may be kept again when stored again.
                let h = queue.pop_front()?;
                c.seen.remove(&h);
                Some(h)
            }
            _ => queue.pop_front(),
        }
    }

    /// Starts compacting worker `w`'s store-order queues in tier `t` (the
    /// earlier one, then the other) once removed hashes (and repeats) are
    /// most of what they hold, unless another compaction is running (this
    /// one then starts on a later removal).
    #[inline(never)]
    fn maybe_compact(&mut self, w: usize, t: usize) {
        if !self.ordered || self.compaction.is_some() {
            return;
        }
        let live = self.held[w][t].count;
        let earlier = self.earlier[w][t].len();
        if earlier + self.order[w][t].len() > 2 * live + COMPACT_SLACK {
            let mut seen = HashSet::with_hasher(foldhash::fast::RandomState::default());
            seen.reserve(live);
            self.compaction = Some(Compaction {
                w,
                t,
                queue: if earlier > 0 {
                    Queue::Earlier
                } else {
                    Queue::Order
                },
                write: 0,
                read: 0,
                seen,
            });
        }
    }

    /// Moves the running compaction on by the entries a change of
    /// `hashes` hashes pays for, and ends it when it reaches the back.
    #[inline(always)]
    fn compact_step(&mut self, hashes: usize) {
        if self.compaction.is_some() {
            self.compact_more(hashes);
        }
    }

    #[inline(never)]
    fn compact_more(&mut self, hashes: usize) {
        let Some(c) = &mut self.compaction else {
            return;
        };
        let queue = match c.queue {
            Queue::Earlier => &mut self.earlier[c.w][c.t],
            Queue::Order => &mut self.order[c.w][c.t],
        };
        let (map, bit) = (&self.tiers[c.t], 1u64 << c.w);
        for _ in 0..(hashes * COMPACT_PER_HASH).max(COMPACT_PER_CHANGE) {
            let Some(h) = queue.get(c.read) else {
                queue.truncate(c.write);
                if c.queue == Queue::Earlier {
                    // On to the later queue, with the hashes kept so far.
                    (c.queue, c.write, c.read) = (Queue::Order, 0, 0);
                    return self.compact_more(hashes);
                }
                self.compaction = None;
                return;
            };
            if map.get(h) & bit != 0 && c.seen.insert(h) {
                queue.set(c.write, h);
                c.write += 1;
            }
            c.read += 1;
        }
    }

    /// Drops everything `slot` holds in `tier` (or in every tier).
    pub fn clear(&mut self, slot: Slot, tier: Option<Tier>) -> usize {
        let tiers: &[Tier] = match &tier {
            Some(t) => std::slice::from_ref(t),
            None => &Tier::ALL,
        };
        let (w, bit) = (slot.index(), slot.bit());
        let mut removed = 0;
        for &tier in tiers {
            let t = tier as usize;
            let held = std::mem::replace(&mut self.held[w][t], Held::fresh());
            self.order[w][t].clear();
            self.earlier[w][t].clear();
            if self
                .compaction
                .as_ref()
                .is_some_and(|c| (c.w, c.t) == (w, t))
            {
                self.compaction = None;
            }
            if held.count > 0 {
                match &held.listed {
                    Some(list) => {
                        for &h in list {
                            self.tiers[t].unset(h, bit);
                        }
                    }
                    None => {
                        let mut b = held.shards;
                        while b != 0 {
                            self.tiers[t].sweep(b.trailing_zeros() as usize, bit);
                            b &= b - 1;
                        }
                    }
                }
            }
            removed += held.count;
            self.entries -= held.count;
        }
        self.maybe_stop_ordering();
        removed
    }

    /// A worker left: drop all its blocks.
    pub fn remove_worker(&mut self, slot: Slot) -> usize {
        self.clear(slot, None)
    }

    /// Prefix overlap of `hashes` (a request's sequence hashes, in order) for
    /// every slot in `candidates` (a mask), per tier, into `out`. Allocates
    /// nothing.
    pub fn overlap(&self, hashes: &[u64], candidates: u64, out: &mut Overlap) {
        for t in 0..3 {
            out.blocks[t] = [0; MAX_WORKERS];
            let map = &self.tiers[t];
            if map.len == 0 || candidates == 0 {
                continue;
            }
            let row = &mut out.blocks[t];
            let mut alive = candidates;
            // Ask for the lines of several lookups before reading any, so
            // their cache misses are in flight together. Batches double (8,
            // 16, 32, 64): a short or absent prefix stops after a few
            // lookups, a long one gets the parallelism.
            const MAX_BATCH: usize = 64;
            let mut homes = [map.buckets_of(0); MAX_BATCH];
            let mut batch = 8;
            let mut start = 0;
            'walk: while start < hashes.len() {
                let chunk = &hashes[start..(start + batch).min(hashes.len())];
                for (home, &h) in homes.iter_mut().zip(chunk) {
                    *home = map.buckets_of(map.hash(h));
                    home.0.prefetch();
                    home.1.prefetch();
                }
                // Each lookup's mask is read as the walk reaches it (the
                // lines are on their way); the mask of workers still
                // matching changes only where a prefix ends.
                for (k, (&(first, second), &h)) in homes.iter().zip(chunk).enumerate() {
                    let next = alive & mask_in(first, second, h);
                    if next != alive {
                        record(row, alive ^ next, (start + k) as u32);
                        alive = next;
                        if alive == 0 {
                            break 'walk;
                        }
                    }
                }
                start += chunk.len();
                batch = (batch * 2).min(MAX_BATCH);
            }
            if alive != 0 {
                record(row, alive, hashes.len() as u32);
            }
        }
    }
}

fn record(row: &mut [u32; MAX_WORKERS], mut slots: u64, blocks: u32) {
    while slots != 0 {
        let s = slots.trailing_zeros() as usize;
        row[s] = blocks;
        slots &= slots - 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(i: usize) -> Slot {
        Slot::new(i).unwrap()
    }

    #[test]
    fn prefix_overlap_per_worker_and_tier() {
        let mut ix = KvIndex::new(1000);
        ix.store(s(0), Tier::Device, &[1, 2, 3, 4]);
        ix.store(s(1), Tier::Device, &[1, 2]);
        ix.store(s(1), Tier::Host, &[1, 2, 3]);
        ix.store(s(2), Tier::Device, &[2, 3, 4]); // no block 1: overlap 0
        let mut out = Overlap::default();
        ix.overlap(&[1, 2, 3, 9], 0b111, &mut out);
        assert_eq!(out.get(s(0), Tier::Device), 3);
        assert_eq!(out.get(s(1), Tier::Device), 2);
        assert_eq!(out.get(s(1), Tier::Host), 3);
        assert_eq!(out.get(s(2), Tier::Device), 0);
        // Only candidates are counted.
        ix.overlap(&[1, 2, 3, 9], 0b010, &mut out);
        assert_eq!(
            (out.get(s(0), Tier::Device), out.get(s(1), Tier::Device)),
            (0, 2)
        );
        // A full match runs to the end.
        ix.overlap(&[1, 2, 3, 4], 0b001, &mut out);
        assert_eq!(out.get(s(0), Tier::Device), 4);
    }

    #[test]
    fn remove_clear_and_worker_death_keep_counts_exact() {
        let mut ix = KvIndex::new(1000);
        ix.store(s(0), Tier::Device, &[1, 2, 3]);
        ix.store(s(1), Tier::Device, &[1, 2]);
        ix.store(s(1), Tier::Disk, &[7]);
        assert_eq!((ix.entries(), ix.blocks(Tier::Device)), (6, 3));
        assert_eq!(
            ix.store(s(0), Tier::Device, &[1]),
            0,
            "duplicates are not counted twice"
        );
        assert_eq!(ix.remove(s(0), Tier::Device, &[2, 99]), 1);
        assert!(!ix.holds(s(0), Tier::Device, 2) && ix.holds(s(1), Tier::Device, 2));
        assert_eq!(ix.clear(s(1), Some(Tier::Device)), 2);
        assert_eq!(
            ix.blocks(Tier::Device),
            2,
            "blocks 1 and 3, held by worker 0"
        );
        assert_eq!(ix.remove_worker(s(1)), 1);
        assert_eq!(ix.remove_worker(s(0)), 2);
        assert_eq!(
            (ix.entries(), ix.blocks(Tier::Device), ix.blocks(Tier::Disk)),
            (0, 0, 0)
        );
    }

    #[test]
    fn a_full_index_evicts_the_oldest_of_the_largest_holder() {
        let mut ix = KvIndex::new(4);
        // One worker fills the index; its own newer blocks push out its
        // oldest.
        assert_eq!(ix.store(s(0), Tier::Device, &[1, 2, 3, 4, 5, 6]), 6);
        assert_eq!((ix.entries(), ix.evicted(), ix.refused_full()), (4, 2, 0));
        assert!(!ix.holds(s(0), Tier::Device, 1) && !ix.holds(s(0), Tier::Device, 2));
        assert!(ix.holds(s(0), Tier::Device, 6));
        // A later worker gets room, taken from the one holding the most,
        // oldest first (3, then 4), until they hold the same.
        assert_eq!(ix.store(s(1), Tier::Device, &[10, 11]), 2);
        assert_eq!(ix.worker_blocks(s(0), Tier::Device), 2);
        assert!(ix.holds(s(0), Tier::Device, 5) && ix.holds(s(0), Tier::Device, 6));
        assert!(!ix.holds(s(0), Tier::Device, 3) && !ix.holds(s(0), Tier::Device, 4));
        // Removed hashes leave the order queue too: a removal then an
        // eviction never evicts a stale hash.
        ix.remove(s(0), Tier::Device, &[5]);
        assert_eq!(ix.store(s(1), Tier::Device, &[12, 13]), 2);
        assert_eq!(ix.entries(), 4);
        // s(1) held the most then (3 to 1): its oldest went.
        assert!(!ix.holds(s(1), Tier::Device, 10));
        assert_eq!(ix.overlap_count(&[6], s(0)), 1);
    }

    #[test]
    fn store_order_is_kept_only_while_at_least_half_full() {
        let mut ix = KvIndex::new(8);
        ix.store(s(0), Tier::Device, &[1, 2, 3]);
        assert!(!ix.ordered, "far from capacity: no queue");
        ix.store(s(0), Tier::Device, &[4]);
        assert!(ix.ordered && ix.walk.is_none(), "half full: queued at once");
        assert_eq!(
            (ix.earlier[0][0].len(), ix.order[0][0].len()),
            (4, 0),
            "the blocks held then, queued by the walk"
        );
        ix.store(s(0), Tier::Device, &[5, 6, 7, 8, 9]);
        assert_eq!((ix.entries(), ix.evicted()), (8, 1));
        // A worker cleared leaves neither of its queues behind.
        let mut cleared = KvIndex::new(8);
        cleared.store(s(4), Tier::Device, &[10, 11, 12]);
        cleared.store(s(3), Tier::Device, &[1]);
        cleared.store(s(3), Tier::Device, &[2]);
        assert_eq!(
            (cleared.earlier[3][0].len(), cleared.order[3][0].len()),
            (1, 1)
        );
        cleared.clear(s(3), Some(Tier::Device));
        assert!(cleared.ordered, "worker 4 keeps it over a quarter full");
        assert_eq!(
            (cleared.earlier[3][0].len(), cleared.order[3][0].len()),
            (0, 0)
        );
        ix.remove(s(0), Tier::Device, &[1, 2, 3, 5, 6, 7, 8, 9]);
        assert!(
            !ix.ordered && ix.order[0][0].chunks() == 0 && ix.earlier[0][0].chunks() == 0,
            "below a quarter: freed"
        );
        // Evicting again starts from the sets as they are.
        ix.store(s(1), Tier::Device, &[20, 21, 22, 23, 24, 25, 26, 27]);
        assert_eq!(ix.entries(), 8);
        assert!(ix.worker_blocks(s(1), Tier::Device) >= 7);
    }

    impl KvIndex {
        /// The hashes store-order queue `q` of worker `w` in tier `t`
        /// still holds, oldest first (without the free entries of a
        /// compaction of it).
        fn queued(&self, w: usize, t: usize, q: Queue) -> Vec<u64> {
            let queue = match q {
                Queue::Earlier => &self.earlier[w][t],
                Queue::Order => &self.order[w][t],
            };
            let all = (0..queue.len()).map(|i| queue.get(i).unwrap());
            match &self.compaction {
                Some(c) if (c.w, c.t, c.queue) == (w, t, q) => all
                    .enumerate()
                    .filter(|&(i, _)| i < c.write || i >= c.read)
                    .map(|(_, h)| h)
                    .collect(),
                _ => all.collect(),
            }
        }
    }

    /// A compaction looks at a few entries per change, not the whole
    /// queue at once, and evictions during it still take the oldest live
    /// entry first: from the entries kept so far, then from those not
    /// looked at yet.
    #[test]
    fn a_compaction_runs_a_few_entries_per_change_and_keeps_store_order() {
        let n = COMPACT_SLACK as u64;
        let mut ix = KvIndex::new(8 * COMPACT_SLACK);
        // Worker 1 holds a little; worker 0's first blocks bring the index
        // to half full (they count as equally old, and are queued apart),
        // then 0..4n in order.
        ix.store(
            s(1),
            Tier::Device,
            &(1_000_000..1_000_000 + n).collect::<Vec<_>>(),
        );
        let early: Vec<u64> = (2_000_000..2_000_000 + 3 * n).collect();
        ix.store(s(0), Tier::Device, &early);
        assert!(ix.ordered);
        let ordered: Vec<u64> = (0..4 * n).collect();
        for chunk in ordered.chunks(64) {
            ix.store(s(0), Tier::Device, chunk);
        }
        assert_eq!(ix.entries(), 8 * COMPACT_SLACK);
        assert!(ix.walk.is_none(), "the walk over the tables is done");
        assert_eq!(ix.order[0][0].len(), ordered.len());
        // The early blocks leave, then three in four of the others, eight
        // per change, until over half of worker 0's queue is stale.
        for chunk in early.chunks(8) {
            ix.remove(s(0), Tier::Device, chunk);
        }
        assert!(ix.compaction.is_none());
        let leaving: Vec<u64> = (0..4 * n).filter(|h| h % 4 != 0).collect();
        let mut removed = 0;
        for chunk in leaving.chunks(8) {
            ix.remove(s(0), Tier::Device, chunk);
            removed += chunk.len();
            if ix.compaction.is_some() {
                break;
            }
        }
        let c = ix.compaction.as_ref().expect("a compaction started");
        assert_eq!(c.w, 0);
        // One change's worth looked at, not the queue.
        assert!(c.read <= 8 * COMPACT_PER_HASH, "{} looked at", c.read);
        let queue = ix.order[0][0].len();
        assert_eq!(queue, 4 * COMPACT_SLACK);
        // Through the early blocks' queue (all of them gone), then part
        // of the way through the ordered ones.
        assert_eq!(ix.compaction.as_ref().unwrap().queue, Queue::Earlier);
        while ix.compaction.as_ref().unwrap().queue == Queue::Earlier {
            ix.compact_step(1);
        }
        assert_eq!(ix.earlier[0][0].len(), 0);
        ix.compact_step(COMPACT_SLACK / COMPACT_PER_HASH);
        let c = ix.compaction.as_ref().expect("still compacting");
        assert!(c.write > 0 && c.read > c.write && c.read < queue);
        let live: Vec<u64> = (0..4 * n)
            .filter(|&h| ix.holds(s(0), Tier::Device, h))
            .collect();
        assert_eq!(live.len(), 4 * COMPACT_SLACK - removed);
        assert_eq!(
            ix.queued(0, 0, Queue::Order)
                .iter()
                .filter(|h| live.contains(h))
                .count(),
            live.len()
        );
        // Evictions take worker 0's live blocks oldest first, across the
        // kept entries and on into the rest.
        let kept = ix.compaction.as_ref().unwrap().write;
        for (i, &h) in live.iter().enumerate().take(kept + 50) {
            assert!(ix.evict_one());
            assert!(!ix.holds(s(0), Tier::Device, h), "eviction {i} spared {h}");
            if let Some(&next) = live.get(i + 1) {
                assert!(
                    ix.holds(s(0), Tier::Device, next),
                    "eviction {i} took {next}"
                );
            }
        }
        // The first block evicted, stored again: its new copy is queued
        // (the kept copy it had left the queue with the eviction).
        ix.store(s(0), Tier::Device, &[live[0]]);
        // Enough changes finish it: the queue is the live blocks, in order.
        while ix.compaction.is_some() {
            ix.compact_step(1);
        }
        let mut left: Vec<u64> = live[kept + 50..].to_vec();
        left.push(live[0]);
        assert_eq!(ix.queued(0, 0, Queue::Order), left);
        assert_eq!(ix.order[0][0].len(), left.len());
    }

    /// The entries held when the order started, once mostly removed, are
    /// compacted too (a little per change, keeping their order), so that
    /// an eviction does not first wade through them.
    #[test]
    fn the_earlier_queue_is_compacted_too() {
        let n = COMPACT_SLACK as u64;
        let mut ix = KvIndex::new(8 * COMPACT_SLACK);
        let held: Vec<u64> = (0..4 * n).map(|i| i * 7919).collect();
        ix.store(s(0), Tier::Device, &held);
        assert!(ix.ordered && ix.walk.is_none());
        let before = ix.queued(0, 0, Queue::Earlier);
        assert_eq!(before.len(), held.len());
        // Another worker keeps the index over a quarter full.
        ix.store(
            s(1),
            Tier::Device,
            &(1 << 40..(1 << 40) + 3 * n).collect::<Vec<_>>(),
        );
        let (leaving, staying): (Vec<u64>, Vec<u64>) = held.iter().partition(|&&h| h % 4 != 0);
        let mut compacted = false;
        for chunk in leaving.chunks(8) {
            ix.remove(s(0), Tier::Device, chunk);
            compacted |= ix
                .compaction
                .as_ref()
                .is_some_and(|c| c.queue == Queue::Earlier);
        }
        assert!(compacted, "no compaction of the earlier queue");
        while ix.compaction.is_some() {
            ix.compact_step(1);
        }
        // It started once over half the queue was stale (after 2.5n of the
        // 3n removals) and dropped those: what is left is the live
        // entries, in their order, and the removals after it passed them.
        let left = ix.queued(0, 0, Queue::Earlier);
        assert!(
            left.len() <= staying.len() + leaving.len() / 6 + 8,
            "{} left",
            left.len()
        );
        let live: Vec<u64> = left.into_iter().filter(|h| staying.contains(h)).collect();
        let kept: Vec<u64> = before.into_iter().filter(|h| staying.contains(h)).collect();
        assert_eq!(live, kept);
    }

    /// A large index is queued by a walk that each store moves on a few
    /// buckets, not at once; the entries it misses (keys moved under it)
    /// are few, and are queued again from the table if a worker's queues
    /// run out.
    #[test]
    fn a_large_index_is_queued_by_a_walk_a_few_buckets_per_store() {
        let cap = 1 << 17;
        let mut ix = KvIndex::new(cap).quiet();
        let mut fresh = 0u64;
        let mut batch = || -> Vec<u64> {
            fresh += 16;
            (fresh - 16..fresh).collect()
        };
        while !ix.ordered {
            ix.store(s(0), Tier::Device, &batch());
        }
        let buckets: usize = ix.tiers[0].shards.iter().map(|t| t.bucket_count()).sum();
        assert!(buckets > 2 * WALK_AT_ONCE, "{buckets} buckets");
        assert!(ix.walk.is_some(), "walked in part");
        let mut stores = 0;
        while ix.walk.is_some() {
            ix.store(s(1), Tier::Device, &batch());
            stores += 1;
        }
        // At two buckets per hash, of 16-hash stores, give or take a
        // table that doubled under it.
        let expected = (buckets - WALK_AT_ONCE) / (WALK_PER_HASH * 16);
        assert!(
            stores > expected / 2 && stores <= expected * 3 / 2 + 2,
            "{stores} stores to walk {buckets} buckets"
        );
        let queued: HashSet<u64> = (0..ix.earlier[0][0].len())
            .map(|i| ix.earlier[0][0].get(i).unwrap())
            .collect();
        let live: Vec<u64> = ix.tiers[0]
            .iter()
            .filter(|(_, m)| m & 1 != 0)
            .map(|(h, _)| h)
            .collect();
        let missed = live.iter().filter(|h| !queued.contains(h)).count();
        assert!(
            missed * 100 <= live.len(),
            "{missed} of {} missed",
            live.len()
        );
        // Worker 0 holds the most; with its queues gone, an eviction
        // queues its entries from the table again and takes one.
        ix.earlier[0][0].clear();
        ix.order[0][0].clear();
        let (entries, evicted) = (ix.entries(), ix.evicted());
        assert!(ix.evict_one());
        assert_eq!((ix.entries(), ix.evicted()), (entries - 1, evicted + 1));
        assert_eq!(ix.worker_blocks(s(0), Tier::Device), live.len() - 1);
        assert_eq!(ix.earlier[0][0].len(), live.len() - 1);
    }

    /// Random stores, removals, stores again and clears in an index kept
    /// at capacity: every live entry stays in its worker's queue, also
    /// while a compaction runs, and the queues stay within a few times
    /// their live entries, even for an engine that stores and removes the
    /// same few hashes over and over.
    #[test]
    fn store_order_queues_hold_every_live_entry_and_stay_bounded() {
        let mut next = splitmix(0x000d_de12);
        let cap = 6 * COMPACT_SLACK;
        let mut ix = KvIndex::new(cap);
        let mut compactions = 0;
        // What worker 1 stored, oldest first; it removes its oldest, as
        // an engine's cache does. Worker 0 only stores, and holds the
        // most: evictions take its blocks.
        let mut stored = std::collections::VecDeque::new();
        let mut fresh = 0u64;
        for step in 0..8000 {
            let w = (next() % 3) as usize;
            let was_compacting = ix.compaction.is_some();
            let roll = next() % 1000;
            let mut new = || -> Vec<u64> {
                (0..16)
                    .map(|_| {
                        fresh += 1;
                        // Now and then a block stored before.
                        if fresh.is_multiple_of(7) {
                            fresh / 2
                        } else {
                            fresh
                        }
                    })
                    .collect()
            };
            if roll == 0 {
                if w == 1 {
                    stored.clear();
                }
                ix.clear(s(w), Some(Tier::Device));
            } else if w == 0 {
                ix.store(s(0), Tier::Device, &new());
            } else if w == 1 && (stored.len() < 2000 || roll < 500) {
                let hashes = new();
                stored.extend(&hashes);
                ix.store(s(1), Tier::Device, &hashes);
            } else if w == 1 {
                let oldest: Vec<u64> = stored.drain(..16).collect();
                ix.remove(s(1), Tier::Device, &oldest);
            } else {
                // Worker 2 stores and removes the same eight hashes.
                let hashes: Vec<u64> = (0..8).map(|_| (1 << 40) | (next() % 8)).collect();
                if roll < 500 {
                    ix.store(s(2), Tier::Device, &hashes);
                } else {
                    ix.remove(s(2), Tier::Device, &hashes);
                }
            }
            compactions += usize::from(!was_compacting && ix.compaction.is_some());
            if !ix.ordered {
                continue;
            }
            assert!(ix.walk.is_none(), "a small index is walked at once");
            for w in 0..3 {
                let queued: HashSet<u64> = ix
                    .queued(w, 0, Queue::Order)
                    .into_iter()
                    .chain(ix.queued(w, 0, Queue::Earlier))
                    .collect();
                let live = ix.worker_blocks(s(w), Tier::Device);
                for h in ix.tiers[0].iter().filter(|(_, m)| m & s(w).bit() != 0) {
                    assert!(queued.contains(&h.0), "step {step}: {:x} not queued", h.0);
                }
                assert!(
                    ix.order[w][0].len() <= 4 * live + 4 * COMPACT_SLACK,
                    "step {step}: worker {w}'s queue of {} for {live} blocks",
                    ix.order[w][0].len()
                );
            }
        }
        assert!(
            ix.ordered && ix.evicted() > 0 && compactions >= 3,
            "{compactions} compactions, {} evicted, {} entries, ordered {}",
            ix.evicted(),
            ix.entries(),
            ix.ordered
        );
    }

    impl KvIndex {
        fn overlap_count(&self, hashes: &[u64], slot: Slot) -> u32 {
            let mut o = Overlap::default();
            self.overlap(hashes, slot.bit(), &mut o);
            o.get(slot, Tier::Device)
        }
    }

    /// Deterministic, well-mixed values (splitmix64) from `state`.
    fn splitmix(mut state: u64) -> impl FnMut() -> u64 {
        move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
    }

    /// Random stores, removals and clears against a plain set of (hash,
    /// worker, tier) entries, with workers small enough to keep their list
    /// and large enough to be swept, and hashes removed and stored again.
    #[test]
    fn random_operations_agree_with_a_plain_model() {
        let mut next = splitmix(0x5eed);
        let mut ix = KvIndex::new(usize::MAX);
        let mut model: HashSet<(u64, usize, usize)> = HashSet::new();
        let tiers = [Tier::Device, Tier::Host, Tier::Disk];
        // Clears that swept shards rather than walking a list.
        let mut swept = 0;
        for step in 0..3000 {
            let w = (next() % 4) as usize;
            let t = (next() % 2) as usize;
            // Worker 3 stores far more than LISTED; the others stay small.
            let space = if w == 3 { 40_000 } else { 3_000 };
            let n = if w == 3 { 400 } else { 20 };
            let hashes: Vec<u64> = (0..n).map(|_| next() % space).collect();
            match next() % 10 {
                0..=5 => {
                    let new = hashes.iter().filter(|&&h| model.insert((h, w, t))).count();
                    assert_eq!(ix.store(s(w), tiers[t], &hashes), new, "step {step}");
                }
                6..=8 => {
                    let gone = hashes.iter().filter(|&&h| model.remove(&(h, w, t))).count();
                    assert_eq!(ix.remove(s(w), tiers[t], &hashes), gone, "step {step}");
                }
                _ => {
                    if ix.held[w][t].listed.is_none() {
                        swept += 1;
                    }
                    let gone = model.iter().filter(|e| e.1 == w && e.2 == t).count();
                    model.retain(|e| !(e.1 == w && e.2 == t));
                    assert_eq!(ix.clear(s(w), Some(tiers[t])), gone, "step {step}");
                }
            }
            assert_eq!(ix.entries(), model.len(), "step {step}");
            for &h in hashes.iter().take(8) {
                for w in 0..4 {
                    assert_eq!(ix.holds(s(w), tiers[t], h), model.contains(&(h, w, t)));
                }
            }
        }
        for w in 0..4 {
            for (t, &tier) in tiers.iter().enumerate().take(2) {
                let n = model.iter().filter(|e| e.1 == w && e.2 == t).count();
                assert_eq!(ix.worker_blocks(s(w), tier), n);
            }
        }
        let distinct: HashSet<u64> = model.iter().filter(|e| e.2 == 0).map(|e| e.0).collect();
        assert_eq!(ix.blocks(Tier::Device), distinct.len());
        assert!(swept >= 5, "the large worker was swept {swept} times");
        for w in 0..4 {
            ix.remove_worker(s(w));
        }
        assert_eq!(
            (ix.entries(), ix.blocks(Tier::Device), ix.blocks(Tier::Host)),
            (0, 0, 0)
        );
    }

    /// The walk against its definition (per worker and tier, the leading
    /// hashes held), over requests whose prefixes break at random places
    /// and run past every batch boundary, with random candidate masks.
    #[test]
    fn overlap_agrees_with_counting_leading_hashes() {
        let mut next = splitmix(0x00dd_ba11);
        let tiers = [Tier::Device, Tier::Host, Tier::Disk];
        let mut ix = KvIndex::new(usize::MAX);
        let mut model: HashSet<(u64, usize, usize)> = HashSet::new();
        let chain: Vec<u64> = (0..300).map(|_| next()).collect();
        // Each of 70 (worker, tier) pairs holds a prefix of the chain with
        // a few holes, so prefixes end everywhere, also inside batches.
        for _ in 0..70 {
            let (w, t) = ((next() % 64) as usize, (next() % 3) as usize);
            let len = (next() % 301) as usize;
            let held: Vec<u64> = chain[..len]
                .iter()
                .copied()
                .filter(|_| !next().is_multiple_of(40))
                .collect();
            ix.store(s(w), tiers[t], &held);
            model.extend(held.iter().map(|&h| (h, w, t)));
        }
        // Unrelated entries, so the tables have other keys in their buckets.
        let noise: Vec<u64> = (0..20_000).map(|_| next()).collect();
        ix.store(s(5), Tier::Device, &noise);
        let mut out = Overlap::default();
        for round in 0..400 {
            let len = match round % 4 {
                0 => (next() % 10) as usize,
                _ => (next() % 301) as usize,
            };
            let mut request = chain[..len].to_vec();
            if round % 3 == 0 && len > 0 {
                let at = (next() % len as u64) as usize;
                request[at] = next(); // a miss in the middle
            }
            let candidates = match round % 5 {
                0 => u64::MAX,
                1 => 0,
                _ => next() & next(),
            };
            ix.overlap(&request, candidates, &mut out);
            for t in 0..3 {
                for w in 0..64 {
                    let expected = if candidates & (1 << w) == 0 {
                        0
                    } else {
                        request
                            .iter()
                            .take_while(|&&h| model.contains(&(h, w, t)))
                            .count() as u32
                    };
                    assert_eq!(
                        out.blocks[t][w], expected,
                        "round {round}, worker {w}, tier {t}"
                    );
                }
            }
        }
    }

    #[test]
    fn slots_are_bounded() {
        assert!(Slot::new(63).is_some());
        assert!(Slot::new(64).is_none());
    }
}
