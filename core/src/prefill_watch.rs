//! Prefills seen in the engines' own events: a reservation's prefill is
//! done when its engine reports the prompt's last new block stored.
//!
//! An engine publishes a block once its prefill has computed it (the
//! prefix reservations in `pending.rs` rest on the same fact), and the
//! prompt's last full block is computed in the step that makes the
//! request's first token. So a pick whose prompt has a full block the
//! chosen worker does not hold yet watches that block's sequence hash on
//! that worker, and the worker's Stored event of it on the device tier is
//! the request's `prefill_done`, with no word from whoever carries the
//! response (a gateway that does not pass the response's body to the
//! picker never sends one). Whichever comes first, the event or a client's
//! `prefill_done`, counts; the other finds nothing left to do.
//!
//! The table is a fixed array of (hash, worker, request) entries, two ways
//! per (hash, worker); a new watch takes a free way or the older one, so it
//! never allocates, never grows and is never swept on the hot path. It is
//! a hint and may forget: a watch lost to a collision leaves that
//! reservation's prefill to `prefill_done` or `finish`, as without the
//! table. An entry names its reservation by request id, worker and the
//! time it was made, and fires only while that reservation still waits for
//! its prefill, so an entry left behind by a finished request is inert.

use std::hash::BuildHasher;

use crate::index::Slot;

/// Entries in the table (a power of two): 32 bytes each, 256 KiB.
pub const CAPACITY: usize = 1 << 13;

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    hash: u64,
    request_id: u64,
    reserved_ms: u64,
    /// The worker's slot plus one; 0 marks a free entry.
    slot: u32,
}

/// A watched reservation whose block came: what names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    pub request_id: u64,
    pub reserved_ms: u64,
}

/// The table of watched prompt blocks.
#[derive(Debug)]
pub struct PrefillWatch {
    entries: Box<[Entry]>,
    /// Seeded with a constant, as the prefix reservations are: the same
    /// trace must route the same way run after run.
    hasher: foldhash::fast::FixedState,
    /// Whether anything was ever watched: until then a Stored event costs
    /// no lookup.
    used: bool,
}

impl Default for PrefillWatch {
    fn default() -> Self {
        PrefillWatch {
            // Each entry written here (a struct's copies are), so a
            // select's watch takes no page fault.
            entries: vec![Entry::default(); CAPACITY].into_boxed_slice(),
            hasher: foldhash::fast::FixedState::with_seed(0x7072_6566_696c),
            used: false,
        }
    }
}

impl PrefillWatch {
    /// The two entries (`hash`, `slot`) may live in.
    fn ways(&self, hash: u64, slot: Slot) -> [usize; 2] {
        let key = hash ^ (slot.index() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let i = (self.hasher.hash_one(key) as usize) & (CAPACITY - 1);
        [i, i ^ 1]
    }

    /// Watches for `slot` storing the block `hash`: request `request_id`,
    /// reserved at `reserved_ms`, has its prefill done then. Allocates
    /// nothing.
    pub fn watch(&mut self, slot: Slot, hash: u64, request_id: u64, reserved_ms: u64) {
        let [a, b] = self.ways(hash, slot);
        let e = &self.entries;
        let at = if e[a].slot == 0 {
            a
        } else if e[b].slot == 0 || e[b].reserved_ms < e[a].reserved_ms {
            b
        } else {
            a
        };
        self.entries[at] = Entry {
            hash,
            request_id,
            reserved_ms,
            slot: slot.index() as u32 + 1,
        };
        self.used = true;
    }

    /// `slot` stored `hash` on its device tier: the reservation that
    /// watched for it, if any (its entry is taken). Allocates nothing.
    pub fn stored(&mut self, slot: Slot, hash: u64) -> Option<Seen> {
        if !self.used {
            return None;
        }
        let tag = slot.index() as u32 + 1;
        for i in self.ways(hash, slot) {
            let e = self.entries[i];
            if e.slot == tag && e.hash == hash {
                self.entries[i] = Entry::default();
                return Some(Seen {
                    request_id: e.request_id,
                    reserved_ms: e.reserved_ms,
                });
            }
        }
        None
    }

    /// Drops every watch on `slot` (it left; an engine that clears its
    /// cache still stores what its running prefills compute, so that keeps
    /// them). Sweeps the table: rare, and never on a select.
    pub fn forget(&mut self, slot: Slot) {
        let tag = slot.index() as u32 + 1;
        for e in self.entries.iter_mut().filter(|e| e.slot == tag) {
            *e = Entry::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(i: usize) -> Slot {
        Slot::new(i).unwrap()
    }

    #[test]
    fn a_watched_block_fires_once_for_its_worker_only() {
        let mut w = PrefillWatch::default();
        assert_eq!(w.stored(s(0), 7), None, "nothing watched yet");
        w.watch(s(1), 7, 42, 100);
        assert_eq!(w.stored(s(0), 7), None, "another worker stored it");
        assert_eq!(w.stored(s(1), 8), None, "another block");
        assert_eq!(
            w.stored(s(1), 7),
            Some(Seen {
                request_id: 42,
                reserved_ms: 100
            })
        );
        assert_eq!(w.stored(s(1), 7), None, "taken");
    }

    #[test]
    fn a_worker_that_leaves_keeps_no_watch() {
        let mut w = PrefillWatch::default();
        w.watch(s(1), 7, 42, 100);
        w.watch(s(2), 7, 43, 100);
        w.forget(s(1));
        assert_eq!(w.stored(s(1), 7), None);
        assert_eq!(w.stored(s(2), 7).map(|x| x.request_id), Some(43));
    }

    #[test]
    fn a_full_table_keeps_the_newer_watches_and_stays_its_size() {
        let mut w = PrefillWatch::default();
        let n = CAPACITY as u64 * 4;
        for i in 0..n {
            w.watch(s(0), i, i, i);
        }
        assert_eq!(w.entries.len(), CAPACITY);
        let kept_old = (0..n / 4).filter(|&i| w.stored(s(0), i).is_some()).count();
        let kept_new = (n - n / 4..n)
            .filter(|&i| w.stored(s(0), i).is_some())
            .count();
        assert!(
            kept_new > kept_old * 4,
            "newer watches win: {kept_new} of the newest quarter against {kept_old} of the oldest"
        );
    }
}
