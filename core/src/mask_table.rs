//! The KV index's hash table, from a block's sequence hash to the mask of
//! worker slots holding it, laid out for the overlap walk.
//!
//! Every key lives in one of two buckets that its hash fixes, and a bucket
//! is one 64-byte cache line of four (key, mask) slots (two-choice
//! bucketed cuckoo hashing). So a lookup reads at most two known lines and
//! never probes further. That lets the walk ask for the lines of a whole
//! batch of lookups before reading any ([`MaskTable::buckets_of`],
//! [`Bucket::prefetch`]), so that
//! their cache misses overlap; with an open-addressing table, the line a
//! lookup reads last depends on what it read first. The walk tries a
//! key's first bucket before its second, and a key goes to its first bucket
//! whenever that has room, so most lookups read one line.
//!
//! A key that finds both its buckets full takes the place of a resident of
//! one of them, which moves to its own other bucket, and so on (a random
//! walk of at most [`MAX_KICKS`] moves). The table doubles when that walk
//! fails or when it would pass 7/8 full. A slot whose mask is 0 is free:
//! the last worker leaving a key frees its slot, and no tombstones remain.

use kvedge_shm::prefetch::prefetch_read;

/// Slots per bucket: four (key, mask) pairs fill one 64-byte line.
const SLOTS: usize = 4;

/// Moves an insertion may make before the table grows instead.
const MAX_KICKS: usize = 256;

/// Buckets in a table's first allocation (as a power of two).
const MIN_BITS: u32 = 2;

/// Odd multiplier whose product's upper half gives a key's second bucket.
const SECOND: u64 = 0x9E37_79B9_7F4A_7C15;

/// Four slots, one cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy, Default)]
pub(crate) struct Bucket {
    keys: [u64; SLOTS],
    /// 0 marks a free slot (a key held by no worker is not kept).
    masks: [u64; SLOTS],
}

/// The mask of `key` in its two buckets: the first, else the second (a
/// key is in at most one of them). For a caller holding the buckets of
/// [`MaskTable::buckets_of`].
#[inline(always)]
pub(crate) fn mask_in(first: &Bucket, second: &Bucket, key: u64) -> u64 {
    let found = first.mask_of(key);
    if found != 0 {
        found
    } else {
        second.mask_of(key)
    }
}

/// What an empty table's lookups read.
static NO_BUCKET: Bucket = Bucket {
    keys: [0; SLOTS],
    masks: [0; SLOTS],
};

impl Bucket {
    /// Asks the CPU to start loading this bucket's line.
    #[inline(always)]
    pub(crate) fn prefetch(&self) {
        prefetch_read(self);
    }

    /// The mask `key` has in this bucket, 0 if it is not here (a free slot
    /// keeps no key: its mask, 0, is what a match on it contributes).
    #[inline(always)]
    pub(crate) fn mask_of(&self, key: u64) -> u64 {
        let mut m = 0;
        for j in 0..SLOTS {
            // A select the compiler is told not to predict: written as an
            // and with a mask, it became a compare-and-jump per slot, and
            // which slot holds the key is random, so about one jump in a
            // lookup was mispredicted; on a cold line each such miss
            // waited for memory before the walk could go on.
            m |= std::hint::select_unpredictable(self.keys[j] == key, self.masks[j], 0);
        }
        m
    }

    fn slot_of(&self, key: u64) -> Option<usize> {
        let mut hits = 0u32;
        for j in 0..SLOTS {
            hits |= u32::from(self.masks[j] != 0 && self.keys[j] == key) << j;
        }
        (hits != 0).then(|| hits.trailing_zeros() as usize)
    }

    fn free_slot(&self) -> Option<usize> {
        let mut free = 0u32;
        for j in 0..SLOTS {
            free |= u32::from(self.masks[j] == 0) << j;
        }
        (free != 0).then(|| free.trailing_zeros() as usize)
    }
}

/// What [`MaskTable::set`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Set {
    /// The key had all the bits already.
    Had,
    /// The key was there; some of the bits were new.
    Added,
    /// The key was not there; it is now.
    NewKey,
}

/// One entry on its way to a slot during an insertion.
#[derive(Clone, Copy)]
struct Entry {
    hash: u64,
    key: u64,
    mask: u64,
}

/// A table from key to a non-zero mask. Callers hash keys (one hash serves
/// them and this table) and pass the hash beside the key; operations that
/// move entries also take the hash function, to find a moved key's other
/// bucket.
#[derive(Default)]
pub(crate) struct MaskTable {
    /// A power of two of buckets, or none before the first insertion.
    buckets: Vec<Bucket>,
    len: usize,
    /// State of the choice of which resident moves (xorshift).
    kick: u64,
}

impl std::fmt::Debug for MaskTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MaskTable")
            .field("len", &self.len)
            .field("buckets", &self.buckets.len())
            .finish()
    }
}

/// The two buckets of a key whose hash is `hash`, in a table of `n`
/// buckets (a power of two, at least 2): the hash's low bits, and bits of
/// its product with an odd constant (moved off the first if they agree).
/// Both are masked by `n - 1`, which also spares the reads their bounds
/// checks.
#[inline(always)]
fn homes(hash: u64, n: usize) -> (usize, usize) {
    let last = n - 1;
    let first = hash as usize & last;
    let second = (hash.wrapping_mul(SECOND) >> 32) as usize & last;
    (first, (second ^ usize::from(second == first)) & last)
}

impl MaskTable {
    /// Keys held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The mask of `key` (whose hash is `hash`), 0 when absent.
    #[inline(always)]
    pub(crate) fn get(&self, hash: u64, key: u64) -> u64 {
        let (first, second) = self.buckets_of(hash);
        mask_in(first, second, key)
    }

    /// The two buckets a lookup of `hash` may read (an empty table's
    /// stand-in bucket when it has none), for a caller that asks for both
    /// lines before reading either.
    #[inline(always)]
    pub(crate) fn buckets_of(&self, hash: u64) -> (&Bucket, &Bucket) {
        if self.buckets.is_empty() {
            return (&NO_BUCKET, &NO_BUCKET);
        }
        let (a, b) = homes(hash, self.buckets.len());
        (&self.buckets[a], &self.buckets[b])
    }

    fn position(&self, hash: u64, key: u64) -> Option<(usize, usize)> {
        if self.buckets.is_empty() {
            return None;
        }
        let (a, b) = homes(hash, self.buckets.len());
        match self.buckets[a].slot_of(key) {
            Some(j) => Some((a, j)),
            None => self.buckets[b].slot_of(key).map(|j| (b, j)),
        }
    }

    /// Sets `bits` (non-zero) in the mask of `key`, adding the key if it is
    /// absent.
    pub(crate) fn set(
        &mut self,
        hash: u64,
        key: u64,
        bits: u64,
        hasher: &impl Fn(u64) -> u64,
    ) -> Set {
        debug_assert!(bits != 0, "a key is kept only with a non-zero mask");
        if let Some((i, j)) = self.position(hash, key) {
            let mask = &mut self.buckets[i].masks[j];
            let had = *mask & bits == bits;
            *mask |= bits;
            return if had { Set::Had } else { Set::Added };
        }
        if (self.len + 1) * 8 > self.buckets.len() * SLOTS * 7 {
            self.grow(hasher);
        }
        let mut moving = Entry {
            hash,
            key,
            mask: bits,
        };
        while let Err(homeless) = self.place(moving, hasher) {
            self.grow(hasher);
            moving = homeless;
        }
        self.len += 1;
        Set::NewKey
    }

    /// Clears `bits` in the mask of `key`: `None` if none of them was set,
    /// else whether the key left (its mask became 0).
    pub(crate) fn unset(&mut self, hash: u64, key: u64, bits: u64) -> Option<bool> {
        let (i, j) = self.position(hash, key)?;
        let slot = &mut self.buckets[i].masks[j];
        if *slot & bits == 0 {
            return None;
        }
        *slot &= !bits;
        if *slot != 0 {
            return Some(false);
        }
        self.buckets[i].keys[j] = 0;
        self.len -= 1;
        Some(true)
    }

    /// Clears `bits` in every mask; returns how many keys left.
    pub(crate) fn unset_everywhere(&mut self, bits: u64) -> usize {
        let mut left = 0;
        for b in &mut self.buckets {
            for j in 0..SLOTS {
                if b.masks[j] & bits != 0 {
                    b.masks[j] &= !bits;
                    if b.masks[j] == 0 {
                        b.keys[j] = 0;
                        left += 1;
                    }
                }
            }
        }
        self.len -= left;
        left
    }

    /// Every (key, mask).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.iter_buckets(0, usize::MAX)
    }

    /// Buckets in the table (0 before the first insertion; it changes when
    /// the table doubles).
    pub(crate) fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// Every (key, mask) in buckets `from..to` (clamped to the table).
    pub(crate) fn iter_buckets(
        &self,
        from: usize,
        to: usize,
    ) -> impl Iterator<Item = (u64, u64)> + '_ {
        let to = to.min(self.buckets.len());
        self.buckets[from.min(to)..to].iter().flat_map(|b| {
            (0..SLOTS)
                .filter(|&j| b.masks[j] != 0)
                .map(|j| (b.keys[j], b.masks[j]))
        })
    }

    /// Puts `e` (a key not in the table) in a free slot of one of its
    /// buckets, moving residents along if both are full; the entry left
    /// without a place when the moves run out is returned.
    fn place(&mut self, mut e: Entry, hasher: &impl Fn(u64) -> u64) -> Result<(), Entry> {
        if self.buckets.is_empty() {
            return Err(e);
        }
        for _ in 0..MAX_KICKS {
            let (a, b) = homes(e.hash, self.buckets.len());
            for i in [a, b] {
                if let Some(j) = self.buckets[i].free_slot() {
                    let bucket = &mut self.buckets[i];
                    bucket.keys[j] = e.key;
                    bucket.masks[j] = e.mask;
                    return Ok(());
                }
            }
            // Both full: take a resident's place; it moves next.
            self.kick ^= self.kick << 13;
            self.kick ^= self.kick >> 7;
            self.kick ^= self.kick << 17;
            let i = if self.kick & 1 == 0 { a } else { b };
            let j = (self.kick >> 1) as usize % SLOTS;
            let bucket = &mut self.buckets[i];
            let (key, mask) = (bucket.keys[j], bucket.masks[j]);
            bucket.keys[j] = e.key;
            bucket.masks[j] = e.mask;
            e = Entry {
                hash: hasher(key),
                key,
                mask,
            };
        }
        Err(e)
    }

    /// Doubles the table (or makes its first one) and puts every key back.
    fn grow(&mut self, hasher: &impl Fn(u64) -> u64) {
        if self.kick == 0 {
            self.kick = 0x2545_F491_4F6C_DD1D;
        }
        let mut bits = if self.buckets.is_empty() {
            MIN_BITS
        } else {
            self.buckets.len().trailing_zeros() + 1
        };
        let old = std::mem::take(&mut self.buckets);
        'size: loop {
            self.buckets = vec![Bucket::default(); 1 << bits];
            for b in &old {
                for j in 0..SLOTS {
                    if b.masks[j] != 0 {
                        let e = Entry {
                            hash: hasher(b.keys[j]),
                            key: b.keys[j],
                            mask: b.masks[j],
                        };
                        if self.place(e, hasher).is_err() {
                            // Under half full, this does not happen with a
                            // good hash; a larger table is still correct.
                            bits += 1;
                            continue 'size;
                        }
                    }
                }
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;
    use std::hash::BuildHasher;

    fn hasher() -> impl Fn(u64) -> u64 {
        let s = foldhash::fast::RandomState::default();
        move |k| s.hash_one(k)
    }

    #[test]
    fn keys_survive_growth_and_moves_at_seven_eighths() {
        let h = hasher();
        let mut t = MaskTable::default();
        let n = 100_000u64;
        let mut max_load: f64 = 0.0;
        for k in 0..n {
            // Sequential keys, and key 0, are ordinary keys.
            assert_eq!(t.set(h(k), k, 1 << (k % 64), &h), Set::NewKey);
            max_load = max_load.max(t.len() as f64 / (t.buckets.len() * SLOTS) as f64);
        }
        assert_eq!(t.len(), n as usize);
        for k in 0..n {
            assert_eq!(t.get(h(k), k), 1 << (k % 64), "key {k}");
        }
        assert_eq!(t.get(h(n), n), 0);
        // The table filled to its limit before each doubling: the moves
        // found room where both first choices were full.
        assert!(max_load > 0.87, "max load {max_load}");
        // Every key sits in one of its two buckets.
        for (i, b) in t.buckets.iter().enumerate() {
            for j in 0..SLOTS {
                if b.masks[j] != 0 {
                    let (x, y) = homes(h(b.keys[j]), t.buckets.len());
                    assert!(i == x || i == y);
                }
            }
        }
    }

    #[test]
    fn free_slots_read_as_absent_even_for_key_zero() {
        let h = hasher();
        let mut t = MaskTable::default();
        // A free slot holds key 0 with mask 0: key 0 matches it and gets 0.
        assert_eq!(t.get(h(0), 0), 0);
        assert_eq!(t.set(h(7), 7, 0b10, &h), Set::NewKey);
        assert_eq!(t.get(h(0), 0), 0);
        assert_eq!(t.set(h(7), 7, 0b10, &h), Set::Had);
        assert_eq!(t.unset(h(7), 7, 0b1), None);
        assert_eq!(t.unset(h(7), 7, 0b10), Some(true));
        assert_eq!(t.get(h(7), 7), 0);
        assert_eq!(t.len(), 0);
        assert_eq!(t.set(h(0), 0, 0b1000, &h), Set::NewKey);
        assert_eq!(t.get(h(0), 0), 0b1000);
        assert_eq!(t.set(h(7), 7, 0b100, &h), Set::NewKey);
        assert_eq!(t.set(h(7), 7, 0b1, &h), Set::Added);
        assert_eq!(t.get(h(7), 7), 0b101);
        assert_eq!(t.unset(h(0), 0, 0b1000), Some(true));
        assert_eq!(t.get(h(0), 0), 0);
        assert_eq!(t.len(), 1);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Set(u64, u8),
        Unset(u64, u8),
        UnsetEverywhere(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few distinct keys and workers: keys come and go, masks overlap.
        prop_oneof![
            4 => (0..3000u64, 0..8u8).prop_map(|(k, w)| Op::Set(k, w)),
            2 => (0..3000u64, 0..8u8).prop_map(|(k, w)| Op::Unset(k, w)),
            1 => (0..8u8).prop_map(Op::UnsetEverywhere),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec(op(), 1..4000)) {
            let h = hasher();
            let mut t = MaskTable::default();
            let mut model: HashMap<u64, u64> = HashMap::new();
            for op in ops {
                match op {
                    Op::Set(k, w) => {
                        let set = t.set(h(k), k, 1 << w, &h);
                        let e = model.entry(k).or_insert(0);
                        let expected = if *e == 0 {
                            Set::NewKey
                        } else if *e & 1 << w != 0 {
                            Set::Had
                        } else {
                            Set::Added
                        };
                        prop_assert_eq!(set, expected);
                        *e |= 1 << w;
                    }
                    Op::Unset(k, w) => {
                        let m = model.get(&k).copied().unwrap_or(0);
                        let expected = (m & 1 << w != 0).then_some(m == 1 << w);
                        prop_assert_eq!(t.unset(h(k), k, 1 << w), expected);
                        if m & 1 << w != 0 {
                            if m == 1 << w {
                                model.remove(&k);
                            } else {
                                model.insert(k, m & !(1 << w));
                            }
                        }
                    }
                    Op::UnsetEverywhere(w) => {
                        let before = model.len();
                        model.retain(|_, m| {
                            *m &= !(1 << w);
                            *m != 0
                        });
                        prop_assert_eq!(t.unset_everywhere(1 << w), before - model.len());
                    }
                }
                prop_assert_eq!(t.len(), model.len());
            }
            for k in 0..3000u64 {
                prop_assert_eq!(t.get(h(k), k), model.get(&k).copied().unwrap_or(0));
            }
            let mut all: Vec<(u64, u64)> = t.iter().collect();
            all.sort_unstable();
            let mut expected: Vec<(u64, u64)> = model.into_iter().collect();
            expected.sort_unstable();
            prop_assert_eq!(all, expected);
        }
    }
}
