//! One engine's lifecycle, as the routing core tracks it: registering,
//! live, resyncing, broken, gone ([`EngineState`]), and the bookkeeping of
//! its ring that decides when its view of the KV cache is lost and must be
//! asked for again. The transitions are made by [`crate::Core`]; this
//! module holds the state and the arithmetic, no I/O.

use std::time::Instant;

use crate::index::Slot;

/// Where an engine is in its lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineState {
    /// Connected to the control socket; its Hello has not arrived.
    Registering { since: Instant },
    /// Registered, and every record since it attached (or since its last
    /// complete snapshot) has been applied.
    Live,
    /// Records were lost: its view was cleared and counts as empty, and
    /// snapshot `snapshot_id` was asked for (0: the request waits for its
    /// backoff). `begun`: its SnapshotBegin arrived. `gap_inside`: a record
    /// went missing while it was arriving, so it cannot complete and a
    /// fresh one is asked for.
    Resyncing {
        snapshot_id: u64,
        begun: bool,
        gap_inside: bool,
    },
    /// The core gave up on it (a ring that fails validation, no Hello in
    /// time, a refused registration): it is out of routing, and its
    /// driver must close its connection and report it closed.
    Broken,
    /// Closed and forgotten (also what an unknown id reports).
    Gone,
}

impl EngineState {
    /// The name `workers` reports.
    pub const fn as_str(self) -> &'static str {
        match self {
            EngineState::Registering { .. } => "registering",
            EngineState::Live => "live",
            EngineState::Resyncing { .. } => "resyncing",
            EngineState::Broken => "broken",
            EngineState::Gone => "gone",
        }
    }
}

/// A handle on one engine connection, given by the core when the
/// connection is accepted; stale once the engine is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineId {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

/// What the core knows of one engine connection.
#[derive(Debug)]
pub(crate) struct Engine {
    pub state: EngineState,
    /// The peer's uid, as the kernel reported it at connect.
    pub uid: Option<u32>,
    /// Its router slot, once registered.
    pub slot: Option<Slot>,
    /// The last record (heartbeats included), or the registration.
    pub last_seen: Instant,
    /// Its heartbeat is overdue: out of routing until a record arrives.
    pub late: bool,
    /// Records found missing in its ring so far (the sum of the gaps).
    pub missing: u64,
    /// Records known lost when the last resync was asked for. Their gap
    /// shows on the next committed record (the snapshot's first, when the
    /// drops ended a burst); it is already covered and is not a new loss.
    pub acked_missing: u64,
    /// The producer's own count of dropped records (untrusted: a producer
    /// that lies only causes itself a resync), as of the last drain.
    pub producer_dropped: u64,
    /// A loss was seen in the batch of records being applied.
    pub gap_in_batch: bool,
    /// Resyncs asked for since its view was last complete (the backoff).
    pub resync_attempts: u32,
    /// When the last resync was asked for, or when the next one is due
    /// (`Resyncing` with snapshot id 0).
    pub resync_at: Instant,
    /// The engine's notices about its own feed, one entry per code.
    pub notices: Vec<EngineNotice>,
}

/// What an engine (or the bridge reading it) reported under one notice
/// code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineNotice {
    pub code: u16,
    /// How many times so far.
    pub count: u64,
    /// The latest explanation for people.
    pub message: String,
    /// Whether the condition stands: false once the producer said it is
    /// over (the count is kept).
    pub active: bool,
}

impl Engine {
    pub fn registering(now: Instant, uid: Option<u32>) -> Self {
        Engine {
            state: EngineState::Registering { since: now },
            uid,
            slot: None,
            last_seen: now,
            late: false,
            missing: 0,
            acked_missing: 0,
            producer_dropped: 0,
            gap_in_batch: false,
            resync_attempts: 0,
            resync_at: now,
            notices: Vec::new(),
        }
    }

    /// Registered (live or resyncing): routed on, fed by its ring.
    pub fn registered(&self) -> bool {
        matches!(
            self.state,
            EngineState::Live | EngineState::Resyncing { .. }
        )
    }

    /// A record arrived after `missing_before` lost ones: counts the loss,
    /// and notes whether it is a new one (not the one a pending resync
    /// already covers).
    pub fn note_gap(&mut self, missing_before: u64) {
        self.missing = self.missing.saturating_add(missing_before);
        if missing_before == 0 || self.missing <= self.acked_missing {
            return;
        }
        match &mut self.state {
            // Before the snapshot begins a loss is harmless: the snapshot
            // starts from a cleared view.
            EngineState::Resyncing { begun: false, .. } => {}
            EngineState::Resyncing { gap_inside, .. } => {
                *gap_inside = true;
                self.gap_in_batch = true;
            }
            _ => self.gap_in_batch = true,
        }
    }

    /// Snapshot `id` began arriving.
    pub fn snapshot_begun(&mut self, id: u64) {
        if let EngineState::Resyncing {
            snapshot_id, begun, ..
        } = &mut self.state
            && *snapshot_id == id
            && id != 0
        {
            *begun = true;
            // Every loss before it showed as its own record's gap.
            self.acked_missing = self.missing;
        }
    }

    /// Snapshot `id` ended: back to live, with a complete view (a snapshot
    /// that lost a record was already asked for again, under a new id).
    /// Returns whether it completed the resync.
    pub fn snapshot_ended(&mut self, id: u64) -> bool {
        if let EngineState::Resyncing {
            snapshot_id,
            gap_inside: false,
            begun: true,
        } = self.state
            && snapshot_id == id
        {
            self.state = EngineState::Live;
            self.resync_attempts = 0;
            return true;
        }
        false
    }

    /// The end of a batch: whether a resync must be asked for now: records
    /// were lost while live, or while a snapshot arrived (it cannot
    /// complete, and waiting for its end would wait forever if the end
    /// itself was lost). Drops at the end of a burst have no later record
    /// to show them, so the producer's own count is compared when the ring
    /// was drained.
    pub fn end_batch(&mut self, producer_dropped: u64, drained: bool) -> bool {
        self.producer_dropped = producer_dropped;
        let known = self.missing.max(self.acked_missing);
        let gap = std::mem::take(&mut self.gap_in_batch) || (drained && producer_dropped > known);
        match self.state {
            EngineState::Live => gap,
            EngineState::Resyncing {
                begun, gap_inside, ..
            } => begun && (gap || gap_inside),
            _ => false,
        }
    }

    /// The wait before resync attempt `attempts` (1 for the first): the
    /// first two go at once, later ones back off (1 s, 2 s, 4 s, ... up to
    /// 30 s), so an engine that cannot deliver a snapshot is not asked in
    /// a loop.
    pub fn backoff(attempts: u32) -> std::time::Duration {
        let secs = match attempts {
            0..=2 => return std::time::Duration::ZERO,
            n => 1u64 << (n - 3).min(5),
        };
        std::time::Duration::from_secs(secs.min(30))
    }

    /// Most notice codes kept per engine (a producer cannot grow the
    /// daemon's memory with made-up codes).
    pub const MAX_NOTICES: usize = 16;

    /// The engine reports `code` `count` times so far, with `message`;
    /// a code carrying [`notice::OVER`](kvedge_schema::messages::notice::OVER)
    /// says the condition is over (its message, if any, replaces the
    /// last one).
    pub fn notice(&mut self, code: u16, count: u64, message: &str) {
        let (code, over) = kvedge_schema::messages::notice::split(code);
        if let Some(n) = self.notices.iter_mut().find(|n| n.code == code) {
            n.count = count;
            n.active = !over;
            if !message.is_empty() && n.message != message {
                n.message.clear();
                n.message.push_str(message);
            }
        } else if self.notices.len() < Self::MAX_NOTICES {
            self.notices.push(EngineNotice {
                code,
                count,
                message: message.to_owned(),
                active: !over,
            });
        }
    }

    /// A resync was asked for as snapshot `snapshot_id` at `now` (0: it
    /// waits until `now`, its backoff).
    pub fn resyncing(&mut self, snapshot_id: u64, now: Instant) {
        self.state = EngineState::Resyncing {
            snapshot_id,
            begun: false,
            gap_inside: false,
        };
        self.resync_at = now;
        self.acked_missing = self.missing.max(self.producer_dropped);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::disallowed_methods)] // a test starts its clock once
    fn live() -> Engine {
        let mut e = Engine::registering(Instant::now(), None);
        e.state = EngineState::Live;
        e
    }

    #[test]
    fn a_gap_asks_for_one_resync_and_a_complete_snapshot_ends_it() {
        let mut e = live();
        e.note_gap(3);
        assert!(e.end_batch(3, true));
        e.resyncing(7, e.last_seen);
        // The snapshot's first record carries the gap already asked for.
        e.note_gap(0);
        e.snapshot_begun(7);
        assert!(!e.end_batch(3, true));
        assert!(e.snapshot_ended(7));
        assert_eq!(e.state, EngineState::Live);
        assert!(!e.end_batch(3, true));
    }

    #[test]
    fn a_loss_inside_a_snapshot_asks_again_at_once_and_its_end_does_not_count() {
        let mut e = live();
        e.note_gap(1);
        assert!(e.end_batch(1, true));
        e.resyncing(9, e.last_seen);
        e.snapshot_begun(9);
        e.note_gap(2);
        assert!(
            e.end_batch(3, false),
            "the snapshot cannot complete: ask again now, not at an end that may be lost"
        );
        e.resyncing(10, e.last_seen);
        assert!(!e.snapshot_ended(9), "the old snapshot's end is stale");
        assert!(!e.snapshot_ended(10), "an end without its begin");
        e.snapshot_begun(10);
        assert!(e.snapshot_ended(10));
        assert_eq!(e.state, EngineState::Live);
        assert!(!e.end_batch(3, true));
    }

    #[test]
    fn trailing_drops_of_a_snapshot_ask_again_once_drained() {
        let mut e = live();
        e.note_gap(1);
        assert!(e.end_batch(1, true));
        e.resyncing(4, e.last_seen);
        e.snapshot_begun(4);
        // Its last records (the end among them) were dropped: no record
        // follows to show the gap, but the producer's count does.
        assert!(!e.end_batch(1, true));
        assert!(e.end_batch(6, true));
    }

    #[test]
    fn resync_attempts_back_off() {
        assert_eq!(Engine::backoff(1), std::time::Duration::ZERO);
        assert_eq!(Engine::backoff(2), std::time::Duration::ZERO);
        assert_eq!(Engine::backoff(3).as_secs(), 1);
        assert_eq!(Engine::backoff(4).as_secs(), 2);
        assert_eq!(Engine::backoff(40).as_secs(), 30);
    }

    #[test]
    fn trailing_drops_count_only_once_drained() {
        let mut e = live();
        assert!(!e.end_batch(5, false), "the ring was not drained");
        assert!(e.end_batch(5, true));
        e.resyncing(1, e.last_seen);
        // Their gap shows on the next record: already covered.
        e.note_gap(5);
        e.snapshot_begun(1);
        assert!(e.snapshot_ended(1));
        assert!(!e.end_batch(5, true));
    }
}
