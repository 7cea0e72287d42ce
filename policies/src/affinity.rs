//! Session affinity: which worker a session's turns go to.
//!
//! Hard mode (the default) turns a live binding into an exact target: the
//! request skips the policy. Soft mode hands the binding to the policy as an
//! advisory [`AffinityTarget`]; the policy may keep it or choose another
//! worker. Either way the host rebinds only after a successful dispatch
//! ([`SessionAffinityTable::bind`]), so a failed selection or dispatch leaves
//! the previous binding intact.
//!
//! Bounded: at most [`MAX_SESSIONS`] bindings, session ids of at most
//! [`MAX_SESSION_ID_BYTES`] bytes. Ids are kept as 128-bit xxh3 digests, so
//! the table is allocated once, its memory written at once, and binding a
//! new session neither allocates nor takes a page fault.
//! A full table makes room for a new session in constant time: the binding
//! refreshed longest ago goes, found at the head of the bind order kept
//! beside the map. Time comes from the caller (milliseconds of a monotonic
//! clock).

use std::collections::HashMap;

use crate::context::{AffinityTarget, WorkerSelectionContext};
use crate::table::WorkerWithDpRank;

/// Most sessions the table holds.
pub const MAX_SESSIONS: usize = 65_536;
/// Longest session id accepted, in bytes.
pub const MAX_SESSION_ID_BYTES: usize = 256;

/// How a binding steers the next turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AffinityMode {
    /// The bound worker is an exact target.
    #[default]
    Hard,
    /// The bound worker is advice to the policy.
    Soft,
}

/// A session id the table refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionIdError {
    #[error("session id is empty")]
    Empty,
    #[error("session id is {len} bytes; the limit is {MAX_SESSION_ID_BYTES}")]
    TooLong { len: usize },
}

#[derive(Clone, Copy, Debug)]
struct Binding {
    worker: WorkerWithDpRank,
    expires_ms: u64,
    /// Its place in the bind order (see [`SessionAffinityTable`]).
    seq: u64,
}

/// What a select did to its session's binding, kept with its reservation
/// until the dispatch is known to have worked: enough to put the previous
/// binding back ([`SessionAffinityTable::undo`]). Plain data; no
/// allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionUndo {
    key: u128,
    /// The binding the select made (`None`: a final turn ended it).
    made: Option<WorkerWithDpRank>,
    /// The live binding before it, and its expiry.
    previous: Option<(WorkerWithDpRank, u64)>,
}

/// An entry of the bind order: a binding's key, or a place left behind
/// (the binding was refreshed, moved or removed since).
#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    key: [u64; 2],
    live: bool,
}

/// Session id -> worker, with a TTL refreshed on every bind.
///
/// Beside the map, the binds in the order they were made, in a ring of
/// places numbered by a counter (`head..tail`, place `seq` at
/// `seq % ring.len()`): each binding's last bind holds its key there, and
/// the binding records its place. A rebind, a removal or an expiry only
/// marks the old place left, so the binding refreshed longest ago (the
/// closest to expiry while the TTL stays the same) is the first live place
/// from the head, and a full table makes room without a scan. Each bind
/// also moves the head on by up to two places while more than half the
/// ring is in use: a left place is dropped, an expired binding removed, a
/// live one moved to the tail. That is the one approximation: a binding
/// not refreshed for about the capacity's worth of binds keeps its expiry
/// but counts as refreshed for eviction. The ring holds twice the capacity
/// and two more places, so at most half of them hold live bindings and
/// the head's two steps per bind keep up; a bind allocates nothing.
#[derive(Debug)]
pub struct SessionAffinityTable {
    mode: AffinityMode,
    ttl_ms: u64,
    capacity: usize,
    /// Keyed by the id's digest, which is not seeded (and ids come from
    /// clients), hashed again with a seeded foldhash: as hard to crowd
    /// into one bucket as with the default SipHash, and a bind or lookup
    /// takes about two thirds of the time (BENCHMARKS.md).
    map: Map,
    ring: Vec<Entry>,
    head: u64,
    tail: u64,
}

/// Room the map is allocated with for a capacity: twice it. Evictions
/// leave tombstones in the map, and a map out of room rehashes; at most
/// half full, it rehashes in place, where a fuller one would allocate a
/// larger table in the middle of a bind.
fn map_capacity(capacity: usize) -> usize {
    2 * capacity
}

type Map = HashMap<u128, Binding, foldhash::fast::RandomState>;

/// An empty map with room for `capacity` bindings, its memory written
/// once: a fresh allocation is only reserved address space, and the first
/// write to each of its pages takes a page fault. Filling every slot and clearing the map takes those
/// faults here, not one in each bind of a new session until the whole
/// table has been used (about ten of its capacities of new sessions).
fn prefaulted_map(capacity: usize) -> Map {
    let mut map = Map::with_capacity_and_hasher(map_capacity(capacity), Default::default());
    let unused = Binding {
        worker: WorkerWithDpRank::new(0, 0),
        expires_ms: 0,
        seq: 0,
    };
    // As many keys as it holds without growing, spread by the map's hash
    // over all its buckets.
    for key in 0..map.capacity() as u128 {
        map.insert(key, unused);
    }
    map.clear();
    map
}

/// Places of the bind order for a capacity (see [`SessionAffinityTable`]).
fn ring_len(capacity: usize) -> usize {
    2 * capacity + 2
}

/// The index of place `seq` in a ring of `len` places.
fn ring_index(seq: u64, len: usize) -> usize {
    (seq % len as u64) as usize
}

fn split(key: u128) -> [u64; 2] {
    [key as u64, (key >> 64) as u64]
}

fn join([lo, hi]: [u64; 2]) -> u128 {
    u128::from(lo) | (u128::from(hi) << 64)
}

impl SessionAffinityTable {
    /// A table of at most `capacity` sessions (clamped to 1..=MAX_SESSIONS),
    /// allocated in full, and its memory written, now.
    pub fn new(mode: AffinityMode, ttl_ms: u64, capacity: usize) -> Self {
        let capacity = capacity.clamp(1, MAX_SESSIONS);
        SessionAffinityTable {
            mode,
            ttl_ms,
            capacity,
            map: prefaulted_map(capacity),
            ring: vec![Entry::default(); ring_len(capacity)],
            head: 0,
            tail: 0,
        }
    }

    /// The ring index of place `seq`.
    fn at(&self, seq: u64) -> usize {
        ring_index(seq, self.ring.len())
    }

    /// Marks a binding's place left.
    fn leave(&mut self, seq: u64) {
        let i = self.at(seq);
        self.ring[i].live = false;
    }

    /// Moves the head on before a bind takes the tail's place: by up to
    /// two places while more than half the ring is in use, and always
    /// until one place is free.
    fn make_room(&mut self, now_ms: u64) {
        let places = self.ring.len() as u64;
        let mut steps = 0;
        while self.tail - self.head >= places || (steps < 2 && self.tail - self.head > places / 2) {
            self.step_head(now_ms);
            steps += 1;
        }
    }

    /// Moves the head on by one place: a left place is dropped, an expired
    /// binding removed, a live one moved to the tail (in place when the
    /// ring is full: the tail's place is then the head's).
    fn step_head(&mut self, now_ms: u64) {
        let from = self.at(self.head);
        let entry = self.ring[from];
        self.head += 1;
        if !entry.live {
            return;
        }
        self.ring[from].live = false;
        let key = join(entry.key);
        let Some(b) = self.map.get_mut(&key) else {
            return;
        };
        if b.expires_ms <= now_ms {
            self.map.remove(&key);
            return;
        }
        b.seq = self.tail;
        let to = self.at(self.tail);
        self.ring[to] = entry;
        self.tail += 1;
    }

    /// Removes the binding refreshed longest ago, and the left places
    /// before it; false when there is none.
    fn evict_oldest(&mut self) -> bool {
        while self.head < self.tail {
            let entry = self.ring[self.at(self.head)];
            self.head += 1;
            if entry.live {
                self.map.remove(&join(entry.key));
                return true;
            }
        }
        false
    }

    pub fn mode(&self) -> AffinityMode {
        self.mode
    }

    /// New settings for a live table (a configuration reload): bindings are
    /// kept, and the new TTL applies from their next refresh. A smaller
    /// capacity drops the bindings refreshed longest ago down to it now; a
    /// larger one is allocated and its memory written now (the bind order
    /// rebuilt, in the same order), so binds still allocate nothing and
    /// take no page fault.
    pub fn reconfigure(&mut self, mode: AffinityMode, ttl_ms: u64, capacity: usize) {
        self.mode = mode;
        self.ttl_ms = ttl_ms;
        self.capacity = capacity.clamp(1, MAX_SESSIONS);
        while self.map.len() > self.capacity && self.evict_oldest() {}
        if self.map.capacity() < map_capacity(self.capacity) {
            // A larger map, its memory written now (see `prefaulted_map`).
            let mut map = prefaulted_map(self.capacity);
            map.extend(self.map.drain());
            self.map = map;
        }
        if ring_len(self.capacity) > self.ring.len() {
            let old = std::mem::replace(
                &mut self.ring,
                vec![Entry::default(); ring_len(self.capacity)],
            );
            let (head, tail) = (self.head, self.tail);
            (self.head, self.tail) = (0, 0);
            for seq in head..tail {
                let entry = old[ring_index(seq, old.len())];
                if entry.live
                    && let Some(b) = self.map.get_mut(&join(entry.key))
                {
                    b.seq = self.tail;
                    self.ring[self.tail as usize] = entry;
                    self.tail += 1;
                }
            }
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn key(session_id: &str) -> Result<u128, SessionIdError> {
        match session_id.len() {
            0 => Err(SessionIdError::Empty),
            len if len > MAX_SESSION_ID_BYTES => Err(SessionIdError::TooLong { len }),
            _ => Ok(xxhash_rust::xxh3::xxh3_128(session_id.as_bytes())),
        }
    }

    /// The live binding of `session_id` (an expired one is dropped).
    pub fn lookup(
        &mut self,
        session_id: &str,
        now_ms: u64,
    ) -> Result<Option<WorkerWithDpRank>, SessionIdError> {
        let key = Self::key(session_id)?;
        match self.map.get(&key) {
            Some(b) if b.expires_ms > now_ms => Ok(Some(b.worker)),
            Some(&b) => {
                self.map.remove(&key);
                self.leave(b.seq);
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// Applies the binding of the context's session: an exact target in hard
    /// mode, an affinity target in soft mode. A context that already has an
    /// explicit target, or no session, is returned unchanged.
    pub fn apply<'a>(
        &mut self,
        context: WorkerSelectionContext<'a>,
    ) -> Result<WorkerSelectionContext<'a>, SessionIdError> {
        if context.pinned_worker().is_some() {
            return Ok(context);
        }
        let Some(session) = context.session_context() else {
            return Ok(context);
        };
        let Some(worker) = self.lookup(session.session_id(), context.now_ms())? else {
            return Ok(context);
        };
        Ok(match self.mode {
            AffinityMode::Hard => context.with_pinned_worker(worker),
            AffinityMode::Soft => context.with_affinity_target(AffinityTarget::from(worker)),
        })
    }

    /// [`SessionAffinityTable::bind`], returning what puts the previous
    /// binding back should the dispatch fail ([`SessionAffinityTable::undo`]).
    pub fn bind_undoable(
        &mut self,
        session_id: &str,
        worker: WorkerWithDpRank,
        now_ms: u64,
    ) -> Result<SessionUndo, SessionIdError> {
        let key = Self::key(session_id)?;
        let previous = self.live(key, now_ms);
        self.bind_key(key, worker, now_ms.saturating_add(self.ttl_ms), now_ms);
        Ok(SessionUndo {
            key,
            made: Some(worker),
            previous,
        })
    }

    /// [`SessionAffinityTable::end`], returning what puts the binding back
    /// should the final turn's dispatch fail.
    pub fn end_undoable(
        &mut self,
        session_id: &str,
        now_ms: u64,
    ) -> Result<SessionUndo, SessionIdError> {
        let key = Self::key(session_id)?;
        let previous = self.live(key, now_ms);
        if let Some(b) = self.map.remove(&key) {
            self.leave(b.seq);
        }
        Ok(SessionUndo {
            key,
            made: None,
            previous,
        })
    }

    /// A dispatch failed before a response stream: its session's binding
    /// goes back to what it was before the select, unless another select
    /// of the session has changed it since (then the newer one stands).
    /// Returns whether anything changed.
    pub fn undo(&mut self, undo: SessionUndo, now_ms: u64) -> bool {
        let current = self.map.get(&undo.key).map(|b| b.worker);
        if current != undo.made {
            return false;
        }
        match undo.previous {
            Some((worker, expires_ms)) if expires_ms > now_ms => {
                self.bind_key(undo.key, worker, expires_ms, now_ms);
            }
            _ => {
                if let Some(b) = self.map.remove(&undo.key) {
                    self.leave(b.seq);
                }
            }
        }
        true
    }

    /// The live binding under `key` and its expiry.
    fn live(&self, key: u128, now_ms: u64) -> Option<(WorkerWithDpRank, u64)> {
        self.map
            .get(&key)
            .filter(|b| b.expires_ms > now_ms)
            .map(|b| (b.worker, b.expires_ms))
    }

    /// Binds (or rebinds) `session_id` to `worker` after a successful
    /// dispatch, refreshing the TTL. When the table is full, the binding
    /// refreshed longest ago goes (under one TTL, the closest to expiry),
    /// but for the approximation the type's documentation describes.
    pub fn bind(
        &mut self,
        session_id: &str,
        worker: WorkerWithDpRank,
        now_ms: u64,
    ) -> Result<(), SessionIdError> {
        let key = Self::key(session_id)?;
        self.bind_key(key, worker, now_ms.saturating_add(self.ttl_ms), now_ms);
        Ok(())
    }

    /// Binds `key` to `worker` until `expires_ms`.
    fn bind_key(&mut self, key: u128, worker: WorkerWithDpRank, expires_ms: u64, now_ms: u64) {
        self.make_room(now_ms);
        let seq = self.tail;
        let places = self.ring.len();
        if let Some(b) = self.map.get_mut(&key) {
            self.ring[ring_index(b.seq, places)].live = false;
            *b = Binding {
                worker,
                expires_ms,
                seq,
            };
        } else {
            while self.map.len() >= self.capacity && self.evict_oldest() {}
            self.map.insert(
                key,
                Binding {
                    worker,
                    expires_ms,
                    seq,
                },
            );
        }
        self.ring[ring_index(seq, places)] = Entry {
            key: split(key),
            live: true,
        };
        self.tail += 1;
    }

    /// Forgets a session (its final turn was dispatched).
    pub fn end(&mut self, session_id: &str) -> Result<bool, SessionIdError> {
        let Some(b) = self.map.remove(&Self::key(session_id)?) else {
            return Ok(false);
        };
        self.leave(b.seq);
        Ok(true)
    }

    /// Drops every binding to a worker that left; returns how many.
    pub fn forget_worker(&mut self, worker_id: u64) -> usize {
        self.remove_where(|b| b.worker.worker_id == worker_id)
    }

    /// Drops expired bindings; returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        self.remove_where(|b| b.expires_ms <= now_ms)
    }

    /// Removes the bindings `gone` picks, leaving their places; how many.
    fn remove_where(&mut self, gone: impl Fn(&Binding) -> bool) -> usize {
        let before = self.map.len();
        let ring = &mut self.ring;
        let places = ring.len();
        self.map.retain(|_, b| {
            if gone(b) {
                ring[ring_index(b.seq, places)].live = false;
                return false;
            }
            true
        });
        before - self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    impl SessionAffinityTable {
        /// The bind order's bookkeeping: every binding has exactly one live
        /// place, inside `head..tail`, holding its key; nothing else is live.
        fn check(&self) -> Result<(), String> {
            let places = self.ring.len() as u64;
            if self.tail - self.head > places {
                return Err(format!(
                    "{} places in use of {places}",
                    self.tail - self.head
                ));
            }
            for (&key, b) in &self.map {
                if !(self.head..self.tail).contains(&b.seq) {
                    return Err(format!(
                        "place {} outside {}..{}",
                        b.seq, self.head, self.tail
                    ));
                }
                let e = self.ring[self.at(b.seq)];
                if !e.live || join(e.key) != key {
                    return Err(format!("place {} does not hold its binding", b.seq));
                }
            }
            let live = (self.head..self.tail)
                .filter(|&s| self.ring[self.at(s)].live)
                .count();
            if live != self.map.len() {
                return Err(format!("{live} live places, {} bindings", self.map.len()));
            }
            Ok(())
        }
    }

    #[test]
    fn an_idle_binding_moves_to_the_tail_and_stays() {
        let w = WorkerWithDpRank::new(1, 0);
        let mut t = SessionAffinityTable::new(AffinityMode::Hard, 1_000, 3);
        t.bind("idle", w, 0).unwrap();
        let first = t.map[&SessionAffinityTable::key("idle").unwrap()].seq;
        for now in 1..20 {
            t.bind("busy", w, now).unwrap();
            t.check().unwrap();
        }
        let moved = t.map[&SessionAffinityTable::key("idle").unwrap()].seq;
        assert!(moved > first, "moved from place {first} to {moved}");
        assert!(t.tail - t.head <= t.ring.len() as u64 / 2 + 1);
        assert_eq!(t.lookup("idle", 20).unwrap(), Some(w));
        // Expired by the time the head reaches it again: removed, not moved.
        for now in 1_000..1_020 {
            t.bind("busy", w, now).unwrap();
            t.check().unwrap();
        }
        assert_eq!(t.len(), 1);
    }

    proptest! {
        #[test]
        fn the_bind_order_stays_consistent(
            capacity in 1usize..12,
            shrink_to in 1usize..12,
            grow_to in 1usize..40,
            ops in proptest::collection::vec((0u8..6, 0u8..30, 0u64..40), 1..800),
        ) {
            let mut t = SessionAffinityTable::new(AffinityMode::Hard, 100, capacity);
            let mut now = 0;
            for (i, (op, s, arg)) in ops.into_iter().enumerate() {
                let id = format!("s{s}");
                let w = WorkerWithDpRank::new(arg % 3, 0);
                match op {
                    0..=2 => t.bind(&id, w, now).unwrap(),
                    3 => {
                        let _ = t.lookup(&id, now).unwrap();
                    }
                    4 => {
                        t.end(&id).unwrap();
                    }
                    _ => match arg % 4 {
                        0 => now += arg,
                        1 => {
                            t.forget_worker(arg % 3);
                        }
                        2 => {
                            t.expire(now);
                        }
                        _ => now += 1,
                    },
                }
                if i == 300 {
                    t.reconfigure(AffinityMode::Hard, 50, shrink_to);
                }
                if i == 500 {
                    t.reconfigure(AffinityMode::Soft, 100, grow_to);
                }
                prop_assert!(t.check().is_ok(), "after op {i}: {:?}", t.check());
            }
        }
    }
}
