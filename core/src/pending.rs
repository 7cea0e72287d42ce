//! Prefix reservations: the blocks a worker is about to cache because the
//! router just sent it a prompt, counted as that worker's overlap until its
//! engine reports them.
//!
//! An engine publishes a block when its prefill has computed it, tens to
//! hundreds of milliseconds after the pick. Without this table a second
//! request with the same new prefix, arriving in between, sees no worker
//! holding it and goes wherever load says: the prefix is computed twice,
//! on two engines, and both keep it. (A router that guesses from the text
//! it sent inserts the text at pick time, and sends the second request
//! after the first.) So a pick notes its prompt's sequence hashes for the
//! chosen worker, and the overlap walk takes, per worker, the deeper of
//! what the index says and what the worker was sent: the engine's events
//! stay the truth, a reservation only fills the gap until they arrive.
//!
//! A reservation lasts `window_ms` (`daemon.prefix_reservation_ms`; 0 turns
//! the table off). The table is a fixed array of (hash, worker mask,
//! deadline) entries, two ways per hash: noting a block replaces an expired
//! entry or the one that expires first, so it never allocates, never grows
//! and is never swept on the hot path. It is a hint and may forget: losing
//! an entry to a collision only loses the hint. A worker that leaves or
//! clears its cache is removed from every entry, so a slot reused by a new
//! engine inherits nothing, and a block its engine reports removed from
//! the device tier leaves its reservations.
//!
//! An entry also counts the picks that sent its block while it lived
//! ([`PendingPrefixes::picks`]): a block many recent prompts shared (a
//! system prompt) has a high count, the history of one conversation a
//! count of one or none. The router tells the policy that count for the
//! deepest block some candidate holds (`prefix_sharers`).

use crate::index::{MAX_WORKERS, Slot};

use std::hash::BuildHasher;

/// Entries in the table (a power of two): 32 bytes each, 1 MiB.
pub const CAPACITY: usize = 1 << 15;

/// Blocks noted per pick at most: beyond them a prompt's tail is left to
/// the engine's events (a quarter of the table, so one huge prompt cannot
/// flush every other worker's reservations).
pub const MAX_NOTED: usize = CAPACITY / 4;

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    hash: u64,
    /// Workers sent a prompt with this block; 0 marks a free entry.
    mask: u64,
    until_ms: u64,
    /// Picks that noted it since the entry was made (it lives while one
    /// comes within the window of the last).
    picks: u32,
}

impl Entry {
    fn live(&self, now_ms: u64) -> bool {
        self.mask != 0 && self.until_ms > now_ms
    }
}

/// The prefix-reservation table.
#[derive(Debug)]
pub struct PendingPrefixes {
    entries: Box<[Entry]>,
    /// Seeded with a constant: which entries collide must not differ from
    /// run to run, or the same trace would route differently (the
    /// simulator's replays are reproducible). A peer that crafts colliding
    /// prompts can only make reservations be forgotten.
    hasher: foldhash::fast::FixedState,
    window_ms: u64,
    /// Entries noted since the table was made (whether or not still live).
    noted: u64,
}

impl PendingPrefixes {
    pub fn new(window_ms: u64) -> Self {
        PendingPrefixes {
            entries: vec![Entry::default(); CAPACITY].into_boxed_slice(),
            hasher: foldhash::fast::FixedState::with_seed(0x6b76_6564_6765),
            window_ms,
            noted: 0,
        }
    }

    pub fn window_ms(&self) -> u64 {
        self.window_ms
    }

    /// A new window applies to reservations noted from now on; 0 also
    /// forgets the ones held.
    pub fn set_window(&mut self, window_ms: u64) {
        self.window_ms = window_ms;
        if window_ms == 0 {
            self.entries.fill(Entry::default());
        }
    }

    /// The two entries `hash` may live in.
    fn ways(&self, hash: u64) -> [usize; 2] {
        let i = (self.hasher.hash_one(hash) as usize) & (CAPACITY - 1);
        [i, i ^ 1]
    }

    /// Notes that `slot` was sent a prompt of these sequence hashes at
    /// `now_ms`. Allocates nothing.
    pub fn note(&mut self, slot: Slot, hashes: &[u64], now_ms: u64) {
        if self.window_ms == 0 {
            return;
        }
        let until_ms = now_ms.saturating_add(self.window_ms);
        let bit = 1u64 << slot.index();
        for &hash in hashes.iter().take(MAX_NOTED) {
            let [a, b] = self.ways(hash);
            let e = &self.entries;
            let at = if e[a].hash == hash && e[a].live(now_ms) {
                a
            } else if e[b].hash == hash && e[b].live(now_ms) {
                b
            } else {
                // A free or expired entry, else the one that expires first.
                let victim = match (e[a].live(now_ms), e[b].live(now_ms)) {
                    (false, _) => a,
                    (true, false) => b,
                    (true, true) if e[b].until_ms < e[a].until_ms => b,
                    (true, true) => a,
                };
                self.entries[victim] = Entry {
                    hash,
                    mask: 0,
                    until_ms,
                    picks: 0,
                };
                victim
            };
            let entry = &mut self.entries[at];
            entry.mask |= bit;
            entry.until_ms = entry.until_ms.max(until_ms);
            entry.picks = entry.picks.saturating_add(1);
            self.noted += 1;
        }
    }

    /// How many picks noted `hash` since its entry was made (0 when it
    /// has none live).
    pub fn picks(&self, hash: u64, now_ms: u64) -> u32 {
        self.live(hash, now_ms).map_or(0, |e| e.picks)
    }

    /// The live entry of `hash`, if any.
    fn live(&self, hash: u64, now_ms: u64) -> Option<&Entry> {
        self.ways(hash)
            .into_iter()
            .map(|i| &self.entries[i])
            .find(|e| e.hash == hash && e.live(now_ms))
    }

    /// The workers with a live reservation of `hash`.
    pub fn mask(&self, hash: u64, now_ms: u64) -> u64 {
        self.live(hash, now_ms).map_or(0, |e| e.mask)
    }

    /// Raises `device[slot]`, for every slot in `candidates`, to the depth
    /// of the prefix of `hashes` reserved for it (blocks from the start).
    /// Walks the hashes only while some candidate's reserved prefix goes
    /// on: a prompt nobody was sent costs one lookup. Allocates nothing.
    pub fn deepen(
        &self,
        hashes: &[u64],
        candidates: u64,
        now_ms: u64,
        device: &mut [u32; MAX_WORKERS],
    ) {
        if self.window_ms == 0 {
            return;
        }
        let mut alive = candidates;
        for (depth, &h) in hashes.iter().enumerate() {
            let next = alive & self.mask(h, now_ms);
            if next != alive {
                raise(device, alive ^ next, depth as u32);
                alive = next;
                if alive == 0 {
                    return;
                }
            }
        }
        raise(device, alive, hashes.len() as u32);
    }

    /// Drops `slot` from the reservations of `hashes` (its engine evicted
    /// them). Allocates nothing.
    pub fn unnote(&mut self, slot: Slot, hashes: &[u64]) {
        let bit = 1u64 << slot.index();
        for &hash in hashes {
            for i in self.ways(hash) {
                if self.entries[i].hash == hash {
                    self.entries[i].mask &= !bit;
                }
            }
        }
    }

    /// Drops `slot` from every reservation (it left, or its engine cleared
    /// its cache). Sweeps the table: rare, and never on a select.
    pub fn forget(&mut self, slot: Slot) {
        let bit = 1u64 << slot.index();
        for e in self.entries.iter_mut() {
            e.mask &= !bit;
        }
    }

    /// Blocks noted since start (a counter for `stats`).
    pub fn noted(&self) -> u64 {
        self.noted
    }
}

fn raise(device: &mut [u32; MAX_WORKERS], mut slots: u64, depth: u32) {
    while slots != 0 {
        let s = slots.trailing_zeros() as usize;
        device[s] = device[s].max(depth);
        slots &= slots - 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(i: usize) -> Slot {
        Slot::new(i).unwrap()
    }

    fn depths(p: &PendingPrefixes, hashes: &[u64], now: u64) -> [u32; 4] {
        let mut d = [0; MAX_WORKERS];
        p.deepen(hashes, 0b1111, now, &mut d);
        [d[0], d[1], d[2], d[3]]
    }

    #[test]
    fn a_noted_prompt_is_its_workers_prefix_until_the_window_ends() {
        let mut p = PendingPrefixes::new(1000);
        p.note(s(1), &[10, 11, 12], 0);
        p.note(s(2), &[10, 20], 5);
        // 1 was sent 10,11,12; 2 was sent 10 then 20.
        assert_eq!(depths(&p, &[10, 11, 12, 13], 10), [0, 3, 1, 0]);
        assert_eq!(depths(&p, &[10, 20, 21], 10), [0, 1, 2, 0]);
        assert_eq!(
            depths(&p, &[99, 10], 10),
            [0, 0, 0, 0],
            "from the start only"
        );
        // Slot 1's entries end at 1000, slot 2's (noted later) at 1005.
        assert_eq!(depths(&p, &[10, 11], 999), [0, 2, 1, 0]);
        assert_eq!(depths(&p, &[10, 11], 1000), [0, 1, 1, 0]);
        assert_eq!(depths(&p, &[10, 20], 1005), [0, 0, 0, 0]);
    }

    #[test]
    fn a_block_counts_the_picks_that_sent_it_while_its_entry_lives() {
        let mut p = PendingPrefixes::new(1000);
        p.note(s(1), &[10, 11], 0);
        p.note(s(2), &[10], 500);
        p.note(s(1), &[10, 12], 1400);
        assert_eq!(
            (p.picks(10, 1400), p.picks(11, 900), p.picks(12, 1400)),
            (3, 1, 1)
        );
        // Kept alive by each pick within the window of the last; gone after.
        assert_eq!(
            (p.picks(11, 1000), p.picks(10, 2399), p.picks(10, 2400)),
            (0, 3, 0)
        );
        // A new entry starts again at one.
        p.note(s(2), &[10], 3000);
        assert_eq!(p.picks(10, 3000), 1);
    }

    #[test]
    fn deepening_never_lowers_what_the_index_found() {
        let mut p = PendingPrefixes::new(1000);
        p.note(s(0), &[1], 0);
        let mut d = [0; MAX_WORKERS];
        d[0] = 5;
        d[3] = 2;
        p.deepen(&[1, 2, 3, 4, 5], 0b1001, 1, &mut d);
        assert_eq!((d[0], d[3]), (5, 2));
    }

    #[test]
    fn only_candidates_are_deepened() {
        let mut p = PendingPrefixes::new(1000);
        p.note(s(0), &[1, 2], 0);
        p.note(s(1), &[1, 2], 0);
        let mut d = [0; MAX_WORKERS];
        p.deepen(&[1, 2], 0b10, 1, &mut d);
        assert_eq!((d[0], d[1]), (0, 2));
    }

    #[test]
    fn a_worker_that_leaves_or_evicts_keeps_nothing_and_window_zero_is_off() {
        let mut p = PendingPrefixes::new(1000);
        p.note(s(1), &[7, 8], 0);
        p.note(s(2), &[7, 8], 0);
        p.forget(s(1));
        assert_eq!(depths(&p, &[7, 8], 1), [0, 0, 2, 0]);
        // An evicted block ends the reservation's prefix there.
        p.unnote(s(2), &[8]);
        assert_eq!(depths(&p, &[7, 8], 1), [0, 0, 1, 0]);
        p.set_window(0);
        assert_eq!(depths(&p, &[7, 8], 1), [0, 0, 0, 0]);
        p.note(s(3), &[7], 1);
        assert_eq!(depths(&p, &[7], 2), [0, 0, 0, 0]);
    }

    #[test]
    fn a_full_table_replaces_what_expires_first_and_stays_its_size() {
        let mut p = PendingPrefixes::new(1000);
        // Three times the table's entries, noted over time: the newest
        // are kept, the table does not grow, nothing panics.
        let hashes: Vec<u64> = (0..3 * CAPACITY as u64).collect();
        for (t, chunk) in hashes.chunks(MAX_NOTED).enumerate() {
            p.note(s(0), chunk, t as u64);
        }
        assert_eq!(p.entries.len(), CAPACITY);
        let last = &hashes[hashes.len() - 64..];
        let now = (hashes.len() / MAX_NOTED) as u64;
        let kept = last.iter().filter(|&&h| p.mask(h, now) == 1).count();
        assert!(
            kept >= 60,
            "the latest reservations are mostly kept: {kept}"
        );
        // A prompt longer than MAX_NOTED reserves only its head.
        let mut q = PendingPrefixes::new(1000);
        let long: Vec<u64> = (1_000_000..1_000_000 + MAX_NOTED as u64 + 10).collect();
        q.note(s(0), &long, 0);
        let mut d = [0; MAX_WORKERS];
        q.deepen(&long, 1, 1, &mut d);
        assert!(d[0] as usize <= MAX_NOTED);
    }
}
