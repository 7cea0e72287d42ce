//! Load accounting: what each worker is doing, as the router should see it.
//!
//! An engine's Load report is the truth. Between reports the daemon projects:
//! a selection reserves one active request, its uncached prefill tokens and
//! its blocks on the chosen worker; `prefill_done` releases the prefill part
//! and `finish` the rest. A report supersedes the reservations made before
//! it (the engine now counts those requests itself), so after `finish` the
//! projection is exactly the engine's last report. A report supersedes only
//! what it measures: an engine read from its metrics counts requests but
//! not prefill tokens or KV blocks ([`NOT_MEASURED`]), and there the
//! reservations' tokens and blocks stay counted until `prefill_done` and
//! `finish` (otherwise every scrape would make a busy worker look idle).
//! Reservations nobody releases expire after a TTL. Time comes from the
//! caller.
//!
//! The prefill queued ahead of a new request ([`LoadTable::queued_prefill`])
//! is less than the reservations' prefill tokens: the worker has been
//! computing them since they were made. Per worker a backlog counts them in
//! as they are reserved and falls at the worker's prefill speed (as the
//! caller learned it), never below zero and never above the reservations
//! still pending; so a worker two long prompts into a prefill that is
//! nearly done looks nearly free, not two prompts away.
//!
//! Neither a report nor the expiry scans the reservations: a report bumps
//! its worker's epochs (a part of a reservation counts while its epoch is
//! current; requests, prefill tokens and blocks have one each),
//! and reservations are linked in the order they were made and expire from
//! its head. A release unlinks its reservation at once, so the head is
//! always a live reservation and nothing is left behind to skip or sweep.
//! That order is expiry order while the TTL stays the same; after a reload
//! shortens it, newer reservations wait for the older ones ahead of them,
//! so they expire at most one old TTL late.

use std::collections::HashMap;

use kvedge_policies::affinity::SessionUndo;

use kvedge_policies::LoadRow;

use crate::index::{MAX_WORKERS, Slot};

/// A report's token or block count that the engine does not measure.
pub const NOT_MEASURED: u64 = kvedge_schema::messages::Load::NOT_MEASURED;

/// Reports per worker that superseded its reservations' requests,
/// prefill tokens and blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Epochs {
    requests: u64,
    prefill: u64,
    blocks: u64,
}

/// The last Load report of a worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    pub active_requests: u32,
    pub waiting_requests: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub kv_used_blocks: u64,
    pub kv_total_blocks: u64,
}

#[derive(Clone, Copy, Debug)]
struct Reservation {
    slot: Slot,
    prefill_tokens: u64,
    blocks: u64,
    /// The worker's report epochs (requests, prefill tokens, blocks) when
    /// it was made: each part is counted in the projection while no report
    /// that measures it has come since.
    epoch: Epochs,
    prefill_pending: bool,
    expires_ms: u64,
    /// When it was reserved, and the prefill work the predictor counted
    /// for it (the queue ahead plus its own), for learning the worker's
    /// prefill speed at `prefill_done`.
    reserved_ms: u64,
    work_tokens: f64,
    /// What its select did to its session's binding, until the dispatch
    /// is known to have worked (its prefill done): an abort puts it back.
    undo: Option<SessionUndo>,
}

/// A first `prefill_done` of a reservation: what its prefill took.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillTiming {
    pub slot: Slot,
    pub reserved_ms: u64,
    pub work_tokens: f64,
}

impl From<&kvedge_schema::messages::Load> for LoadReport {
    fn from(l: &kvedge_schema::messages::Load) -> Self {
        LoadReport {
            active_requests: l.active_requests,
            waiting_requests: l.waiting_requests,
            active_prefill_tokens: l.active_prefill_tokens,
            active_decode_blocks: l.active_decode_blocks,
            kv_used_blocks: l.kv_used_blocks,
            kv_total_blocks: l.kv_total_blocks,
        }
    }
}

/// Why a release did nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("unknown request id {0} (finished, expired or never reserved)")]
    UnknownRequest(u64),
}

/// No node: the end of the reservation order.
const NIL: usize = usize::MAX;

/// A reservation in the order they were made.
#[derive(Clone, Copy, Debug)]
struct Node {
    request_id: u64,
    r: Reservation,
    prev: usize,
    next: usize,
}

/// Reservations the table holds without growing.
const RESERVED: usize = 4096;

/// The id map, empty, with room for [`RESERVED`] reservations and its
/// memory written once. A fresh allocation is only reserved address space:
/// the first write to each page takes a page fault, and the map's writes land on random pages, so about one
/// reserve in four took one during a new daemon's first few hundred
/// selects. Filling every slot and clearing the map takes them here.
fn prefaulted_index() -> HashMap<u64, usize> {
    let mut index = HashMap::with_capacity(RESERVED);
    for id in 0..index.capacity() as u64 {
        index.insert(id, 0);
    }
    index.clear();
    index
}

/// An empty vector with room for [`RESERVED`] items, its memory written
/// once (as for [`prefaulted_index`]).
fn prefaulted_vec<T: Clone>(fill: T) -> Vec<T> {
    // Not `vec![fill; n]`: for a zero value that asks the allocator for
    // zeroed memory, which it maps without writing.
    let mut v = Vec::with_capacity(RESERVED);
    v.resize(RESERVED, fill);
    v.clear();
    v
}

/// A worker's reserved prefill as it computes it: `tokens` left at
/// `at_ms`, falling at its prefill speed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Backlog {
    tokens: f64,
    at_ms: u64,
}

impl Backlog {
    /// What is left at `now_ms` at `tokens_per_second` (a clock that went
    /// back computes nothing).
    fn at(self, now_ms: u64, tokens_per_second: f64) -> f64 {
        let elapsed = now_ms.saturating_sub(self.at_ms) as f64 / 1e3;
        let done = elapsed * tokens_per_second;
        if done.is_finite() && done > 0.0 {
            (self.tokens - done).max(0.0)
        } else {
            self.tokens
        }
    }
}

/// Per-worker reports plus outstanding reservations.
#[derive(Debug)]
pub struct LoadTable {
    reports: [LoadReport; MAX_WORKERS],
    extra: [(u32, u64, u64); MAX_WORKERS],
    /// Per worker, the reservations' prefill not yet computed.
    backlog: [Backlog; MAX_WORKERS],
    /// Request id -> its node.
    index: HashMap<u64, usize>,
    /// The reservations, linked oldest (`head`) to newest (`tail`); the
    /// nodes of released ones wait in `free` for reuse.
    nodes: Vec<Node>,
    free: Vec<usize>,
    head: usize,
    tail: usize,
    /// Reports received per worker, by the part they superseded.
    epochs: [Epochs; MAX_WORKERS],
    ttl_ms: u64,
    expired: u64,
}

impl LoadTable {
    pub fn new(ttl_ms: u64) -> Self {
        LoadTable {
            reports: [LoadReport::default(); MAX_WORKERS],
            extra: [(0, 0, 0); MAX_WORKERS],
            backlog: [Backlog::default(); MAX_WORKERS],
            index: prefaulted_index(),
            nodes: prefaulted_vec(Node {
                request_id: 0,
                r: Reservation {
                    slot: Slot::new(0).expect("slot 0"),
                    prefill_tokens: 0,
                    blocks: 0,
                    epoch: Epochs::default(),
                    prefill_pending: false,
                    expires_ms: 0,
                    reserved_ms: 0,
                    work_tokens: 0.0,
                    undo: None,
                },
                prev: NIL,
                next: NIL,
            }),
            free: prefaulted_vec(NIL),
            head: NIL,
            tail: NIL,
            epochs: [Epochs::default(); MAX_WORKERS],
            ttl_ms,
            expired: 0,
        }
    }

    /// Links a new reservation at the tail; returns its node.
    fn push(&mut self, request_id: u64, r: Reservation) -> usize {
        let node = Node {
            request_id,
            r,
            prev: self.tail,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        match self.tail {
            NIL => self.head = i,
            t => self.nodes[t].next = i,
        }
        self.tail = i;
        i
    }

    /// Unlinks node `i` (its id already gone from the index) and takes
    /// it out of the projection.
    fn release(&mut self, i: usize) {
        let Node { r, prev, next, .. } = self.nodes[i];
        match prev {
            NIL => self.head = next,
            p => self.nodes[p].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n].prev = prev,
        }
        self.free.push(i);
        self.unproject(&r);
    }

    /// The TTL of reservations made from now on.
    pub fn set_ttl(&mut self, ttl_ms: u64) {
        self.ttl_ms = ttl_ms;
    }

    /// A worker's Load report: the truth, superseding earlier reservations
    /// in what it measures (a count of [`NOT_MEASURED`] is taken as 0 and
    /// leaves the reservations' part counted).
    pub fn report(&mut self, slot: Slot, mut report: LoadReport) {
        let i = slot.index();
        self.extra[i].0 = 0;
        self.epochs[i].requests += 1;
        if report.active_prefill_tokens == NOT_MEASURED {
            report.active_prefill_tokens = 0;
        } else {
            self.extra[i].1 = 0;
            self.backlog[i] = Backlog::default();
            self.epochs[i].prefill += 1;
        }
        if report.active_decode_blocks == NOT_MEASURED {
            report.active_decode_blocks = 0;
        } else {
            self.extra[i].2 = 0;
            self.epochs[i].blocks += 1;
        }
        self.reports[i] = report;
    }

    /// Reserves a selected request on `slot`; `work_tokens` is the
    /// prefill work predicted for it (see [`PrefillTiming`]), and
    /// `tokens_per_second` the worker's prefill speed, at which its
    /// backlog falls.
    #[allow(clippy::too_many_arguments)]
    pub fn reserve(
        &mut self,
        request_id: u64,
        slot: Slot,
        prefill_tokens: u64,
        blocks: u64,
        now_ms: u64,
        work_tokens: f64,
        tokens_per_second: f64,
    ) {
        if let Some(old) = self.index.remove(&request_id) {
            self.release(old);
        }
        let left = self.backlog_at(slot, now_ms, tokens_per_second);
        self.backlog[slot.index()] = Backlog {
            tokens: left + prefill_tokens as f64,
            at_ms: now_ms.max(self.backlog[slot.index()].at_ms),
        };
        let e = &mut self.extra[slot.index()];
        e.0 += 1;
        e.1 += prefill_tokens;
        e.2 += blocks;
        let i = self.push(
            request_id,
            Reservation {
                slot,
                prefill_tokens,
                blocks,
                epoch: self.epochs[slot.index()],
                prefill_pending: true,
                expires_ms: now_ms.saturating_add(self.ttl_ms),
                reserved_ms: now_ms,
                work_tokens,
                undo: None,
            },
        );
        // Headroom: a map at most half full leaves few tombstones on
        // removal, so churn does not make it rehash all its buckets in
        // place (in one reserve) when they use up its room.
        if self.index.len() * 2 >= self.index.capacity() {
            self.index.reserve(self.index.len());
        }
        self.index.insert(request_id, i);
    }

    /// The request finished its prefill: its prefill tokens leave the
    /// projection. The first report of it returns its timing.
    pub fn prefill_done(&mut self, request_id: u64) -> Result<Option<PrefillTiming>, LoadError> {
        let &i = self
            .index
            .get(&request_id)
            .ok_or(LoadError::UnknownRequest(request_id))?;
        let r = &mut self.nodes[i].r;
        if r.epoch.prefill == self.epochs[r.slot.index()].prefill && r.prefill_pending {
            let e = &mut self.extra[r.slot.index()];
            e.1 = e.1.saturating_sub(r.prefill_tokens);
        }
        let first = std::mem::replace(&mut r.prefill_pending, false);
        // A response stream came back: the session's new binding stands.
        r.undo = None;
        Ok(first.then_some(PrefillTiming {
            slot: r.slot,
            reserved_ms: r.reserved_ms,
            work_tokens: r.work_tokens,
        }))
    }

    /// Whether `request_id` is a reservation on `slot` made at
    /// `reserved_ms` whose prefill is not yet done.
    pub fn prefill_pending(&self, request_id: u64, slot: Slot, reserved_ms: u64) -> bool {
        self.index.get(&request_id).is_some_and(|&i| {
            let r = &self.nodes[i].r;
            r.slot == slot && r.reserved_ms == reserved_ms && r.prefill_pending
        })
    }

    /// The request finished: it leaves the projection entirely.
    pub fn finish(&mut self, request_id: u64) -> Result<(), LoadError> {
        let i = self
            .index
            .remove(&request_id)
            .ok_or(LoadError::UnknownRequest(request_id))?;
        self.release(i);
        Ok(())
    }

    /// Keeps `undo` with reservation `request_id` (see
    /// [`LoadTable::abort`]).
    pub fn set_undo(&mut self, request_id: u64, undo: SessionUndo) {
        if let Some(&i) = self.index.get(&request_id) {
            self.nodes[i].r.undo = Some(undo);
        }
    }

    /// The request was never served (its dispatch failed before a
    /// response stream): released as `finish` does, and what its select
    /// did to its session's binding returned, unless its prefill was
    /// done (the stream had come back).
    pub fn abort(&mut self, request_id: u64) -> Result<Option<SessionUndo>, LoadError> {
        let i = self
            .index
            .remove(&request_id)
            .ok_or(LoadError::UnknownRequest(request_id))?;
        let undo = self.nodes[i].r.undo.take();
        self.release(i);
        Ok(undo)
    }

    fn unproject(&mut self, r: &Reservation) {
        let now = self.epochs[r.slot.index()];
        let e = &mut self.extra[r.slot.index()];
        if r.epoch.requests == now.requests {
            e.0 = e.0.saturating_sub(1);
        }
        if r.prefill_pending && r.epoch.prefill == now.prefill {
            e.1 = e.1.saturating_sub(r.prefill_tokens);
        }
        if r.epoch.blocks == now.blocks {
            e.2 = e.2.saturating_sub(r.blocks);
        }
    }

    /// Drops reservations past their TTL; returns how many. Costs the
    /// number dropped, not the number outstanding; allocates nothing.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let mut gone = 0;
        while self.head != NIL && self.nodes[self.head].r.expires_ms <= now_ms {
            let i = self.head;
            self.index.remove(&self.nodes[i].request_id);
            self.release(i);
            gone += 1;
        }
        self.expired += gone as u64;
        gone
    }

    /// When the oldest reservation expires, ms.
    pub fn next_expiry_ms(&self) -> Option<u64> {
        (self.head != NIL).then(|| self.nodes[self.head].r.expires_ms)
    }

    /// A worker left: its report and reservations go.
    pub fn remove_worker(&mut self, slot: Slot) {
        let mut i = self.head;
        while i != NIL {
            let Node {
                request_id,
                r,
                next,
                ..
            } = self.nodes[i];
            if r.slot == slot {
                self.index.remove(&request_id);
                self.release(i);
            }
            i = next;
        }
        self.reports[slot.index()] = LoadReport::default();
        self.extra[slot.index()] = (0, 0, 0);
        self.backlog[slot.index()] = Backlog::default();
    }

    /// The reservations' prefill tokens on `slot` not yet computed at
    /// `now_ms`, the worker computing at `tokens_per_second`: at most those
    /// still pending.
    fn backlog_at(&self, slot: Slot, now_ms: u64, tokens_per_second: f64) -> f64 {
        let pending = self.extra[slot.index()].1 as f64;
        self.backlog[slot.index()]
            .at(now_ms, tokens_per_second)
            .min(pending)
    }

    /// The prefill queued ahead of a new request on `slot` at `now_ms`,
    /// tokens: the engine's report plus the reservations' part it does not
    /// count, less what the worker computed of them since at
    /// `tokens_per_second`.
    pub fn queued_prefill(&self, slot: Slot, now_ms: u64, tokens_per_second: f64) -> u64 {
        let reported = self.reports[slot.index()].active_prefill_tokens;
        reported.saturating_add(self.backlog_at(slot, now_ms, tokens_per_second).round() as u64)
    }

    /// The projected load of `slot`: report plus pending reservations.
    pub fn projected(&self, slot: Slot) -> LoadRow {
        let r = &self.reports[slot.index()];
        let e = &self.extra[slot.index()];
        LoadRow {
            active_requests: r.active_requests.saturating_add(e.0),
            waiting_requests: r.waiting_requests,
            active_prefill_tokens: r.active_prefill_tokens.saturating_add(e.1),
            active_decode_blocks: r.active_decode_blocks.saturating_add(e.2),
        }
    }

    /// The last report of `slot`.
    pub fn reported(&self, slot: Slot) -> LoadReport {
        self.reports[slot.index()]
    }

    /// Outstanding reservations.
    pub fn reservations(&self) -> usize {
        self.index.len()
    }

    /// Reservations dropped by the TTL so far.
    pub fn expired(&self) -> u64 {
        self.expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(i: usize) -> Slot {
        Slot::new(i).unwrap()
    }

    fn report(active: u32, prefill: u64, decode: u64) -> LoadReport {
        LoadReport {
            active_requests: active,
            active_prefill_tokens: prefill,
            active_decode_blocks: decode,
            ..LoadReport::default()
        }
    }

    #[test]
    fn reservations_project_until_released() {
        let mut t = LoadTable::new(60_000);
        t.report(s(0), report(2, 100, 10));
        t.reserve(1, s(0), 500, 32, 0, 0.0, 0.0);
        t.reserve(2, s(0), 300, 16, 0, 0.0, 0.0);
        let p = t.projected(s(0));
        assert_eq!(
            (
                p.active_requests,
                p.active_prefill_tokens,
                p.active_decode_blocks
            ),
            (4, 900, 58)
        );
        t.prefill_done(1).unwrap();
        assert_eq!(t.projected(s(0)).active_prefill_tokens, 400);
        t.finish(1).unwrap();
        t.finish(2).unwrap();
        let p = t.projected(s(0));
        assert_eq!(
            (
                p.active_requests,
                p.active_prefill_tokens,
                p.active_decode_blocks
            ),
            (2, 100, 10)
        );
        assert_eq!(t.finish(2), Err(LoadError::UnknownRequest(2)));
    }

    #[test]
    fn a_report_supersedes_earlier_reservations() {
        let mut t = LoadTable::new(60_000);
        t.reserve(1, s(1), 500, 32, 0, 0.0, 0.0);
        // The engine now counts request 1 itself.
        t.report(s(1), report(1, 500, 32));
        assert_eq!(t.projected(s(1)).active_requests, 1, "not counted twice");
        t.finish(1).unwrap();
        assert_eq!(
            t.projected(s(1)).active_requests,
            1,
            "the report stands until the next one"
        );
    }

    #[test]
    fn a_reservation_after_a_report_counts_until_the_next_one() {
        let mut t = LoadTable::new(60_000);
        t.reserve(1, s(1), 500, 32, 0, 0.0, 0.0);
        t.report(s(1), report(1, 500, 32));
        t.reserve(2, s(1), 100, 8, 0, 0.0, 0.0);
        assert_eq!(t.projected(s(1)).active_requests, 2);
        t.prefill_done(1).unwrap(); // superseded: changes nothing
        assert_eq!(t.projected(s(1)).active_prefill_tokens, 600);
        t.prefill_done(2).unwrap();
        assert_eq!(t.projected(s(1)).active_prefill_tokens, 500);
        t.report(s(1), report(2, 0, 40));
        t.finish(2).unwrap();
        assert_eq!(t.projected(s(1)).active_requests, 2);
    }

    #[test]
    fn the_queued_prefill_falls_at_the_workers_speed_and_never_past_what_is_pending() {
        let mut t = LoadTable::new(60_000);
        // 1,000 tokens a second.
        t.reserve(1, s(1), 1_000, 8, 0, 0.0, 1_000.0);
        assert_eq!(t.queued_prefill(s(1), 0, 1_000.0), 1_000);
        assert_eq!(t.queued_prefill(s(1), 400, 1_000.0), 600);
        t.reserve(2, s(1), 300, 8, 500, 0.0, 1_000.0);
        assert_eq!(t.queued_prefill(s(1), 500, 1_000.0), 800);
        assert_eq!(
            t.queued_prefill(s(1), 5_000, 1_000.0),
            0,
            "never below zero"
        );
        // At 600 ms 700 tokens are left by the speed, but request 1's
        // prefill is done (the engine was faster): at most request 2's 300
        // can be.
        assert_eq!(t.queued_prefill(s(1), 600, 1_000.0), 700);
        t.prefill_done(1).unwrap();
        assert_eq!(t.queued_prefill(s(1), 600, 1_000.0), 300);
        // A slower engine still: a report of what it measures replaces it.
        t.report(s(1), report(2, NOT_MEASURED, NOT_MEASURED));
        assert_eq!(t.queued_prefill(s(1), 1_000, 1_000.0), 300);
        t.report(s(1), report(2, 700, 16));
        assert_eq!(t.queued_prefill(s(1), 1_000, 1_000.0), 700);
        // Unknown speed drains nothing; a leaving worker takes it along.
        t.reserve(3, s(2), 100, 8, 0, 0.0, f64::NAN);
        assert_eq!(t.queued_prefill(s(2), 9_000, f64::NAN), 100);
        t.remove_worker(s(2));
        assert_eq!(t.queued_prefill(s(2), 9_000, 1_000.0), 0);
    }

    #[test]
    fn a_report_that_counts_only_requests_leaves_reserved_tokens_and_blocks_counted() {
        let mut t = LoadTable::new(60_000);
        t.reserve(1, s(1), 500, 32, 0, 0.0, 0.0);
        t.reserve(2, s(1), 200, 20, 0, 0.0, 0.0);
        // A metrics scrape: two requests running, tokens and blocks unknown.
        t.report(s(1), report(2, NOT_MEASURED, NOT_MEASURED));
        let p = t.projected(s(1));
        assert_eq!(
            (
                p.active_requests,
                p.active_prefill_tokens,
                p.active_decode_blocks
            ),
            (2, 700, 52),
            "requests from the report, tokens and blocks still reserved"
        );
        assert_eq!(t.reported(s(1)).active_prefill_tokens, 0, "not u64::MAX");
        t.prefill_done(1).unwrap();
        assert_eq!(t.projected(s(1)).active_prefill_tokens, 200);
        t.finish(1).unwrap();
        let p = t.projected(s(1));
        assert_eq!(
            (
                p.active_requests,
                p.active_prefill_tokens,
                p.active_decode_blocks
            ),
            (2, 200, 20),
            "the request count stands until the next report"
        );
        // A report that measures blocks but not tokens supersedes blocks.
        t.report(s(1), report(1, NOT_MEASURED, 25));
        let p = t.projected(s(1));
        assert_eq!((p.active_prefill_tokens, p.active_decode_blocks), (200, 25));
        t.finish(2).unwrap();
        let p = t.projected(s(1));
        assert_eq!(
            (
                p.active_requests,
                p.active_prefill_tokens,
                p.active_decode_blocks
            ),
            (1, 0, 25)
        );
    }

    #[test]
    fn expiry_follows_reservation_order_and_finished_ids_do_not_pile_up() {
        let mut t = LoadTable::new(1_000);
        // One forgotten reservation, then 5,000 that finish.
        t.reserve(1, s(0), 1, 1, 0, 0.0, 0.0);
        for id in 2..5_002 {
            t.reserve(id, s(0), 1, 1, 10, 0.0, 0.0);
            t.finish(id).unwrap();
            t.expire(10);
        }
        assert_eq!(t.nodes.len(), 2, "released nodes are reused");
        assert_eq!(t.expire(999), 0);
        assert_eq!(t.expire(1_000), 1);
        assert_eq!(
            (t.reservations(), t.projected(s(0)).active_requests),
            (0, 0)
        );
        // Reserved again under the same id: the later expiry stands.
        t.reserve(7, s(0), 1, 1, 2_000, 0.0, 0.0);
        t.reserve(7, s(0), 1, 1, 2_500, 0.0, 0.0);
        assert_eq!(t.expire(3_000), 0);
        assert_eq!(t.expire(3_500), 1);
        assert_eq!(t.expired(), 2);
    }

    #[test]
    fn forgotten_reservations_expire_and_workers_leave_cleanly() {
        let mut t = LoadTable::new(1_000);
        t.reserve(1, s(2), 10, 1, 0, 0.0, 0.0);
        t.reserve(2, s(2), 10, 1, 500, 0.0, 0.0);
        assert_eq!(t.expire(999), 0);
        assert_eq!(t.expire(1_000), 1);
        assert_eq!((t.projected(s(2)).active_requests, t.expired()), (1, 1));
        t.report(s(3), report(5, 0, 0));
        t.reserve(3, s(3), 1, 1, 0, 0.0, 0.0);
        t.remove_worker(s(3));
        assert_eq!(t.projected(s(3)), LoadRow::default());
        assert_eq!(t.finish(3), Err(LoadError::UnknownRequest(3)));
    }

    /// What the table should hold, the slow, obvious way.
    #[derive(Default)]
    struct Model {
        reports: [LoadReport; 4],
        epochs: [u64; 4],
        /// (id, slot, prefill, blocks, epoch, prefill pending, expires)
        live: Vec<(u64, usize, u64, u64, u64, bool, u64)>,
    }

    impl Model {
        fn projected(&self, slot: usize) -> LoadRow {
            let r = &self.reports[slot];
            let mine = || {
                self.live
                    .iter()
                    .filter(move |l| l.1 == slot && l.4 == self.epochs[slot])
            };
            LoadRow {
                active_requests: r.active_requests + mine().count() as u32,
                waiting_requests: r.waiting_requests,
                active_prefill_tokens: r.active_prefill_tokens
                    + mine().filter(|l| l.5).map(|l| l.2).sum::<u64>(),
                active_decode_blocks: r.active_decode_blocks + mine().map(|l| l.3).sum::<u64>(),
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Reserve(u64, usize, u64, u64),
        PrefillDone(u64),
        Finish(u64),
        Report(usize, u32, u64, u64),
        Expire(u64),
        RemoveWorker(usize),
    }

    fn any_op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            6 => (0u64..40, 0usize..4, 0u64..1000, 0u64..64)
                .prop_map(|(id, slot, p, b)| Op::Reserve(id, slot, p, b)),
            2 => (0u64..40).prop_map(Op::PrefillDone),
            4 => (0u64..40).prop_map(Op::Finish),
            1 => (0usize..4, 0u32..8, 0u64..1000, 0u64..64)
                .prop_map(|(slot, a, p, b)| Op::Report(slot, a, p, b)),
            3 => (0u64..300).prop_map(Op::Expire),
            1 => (0usize..4).prop_map(Op::RemoveWorker),
        ]
    }

    proptest::proptest! {
        /// Whatever the reservations, releases, reports, departures and
        /// expiries, the projection, the count and the next expiry are the
        /// model's.
        #[test]
        fn the_table_agrees_with_a_model(ops in proptest::collection::vec(any_op(), 1..400)) {
            const TTL: u64 = 1_000;
            let mut t = LoadTable::new(TTL);
            let mut m = Model::default();
            let mut now = 0;
            for op in ops {
                match op {
                    Op::Reserve(id, slot, p, b) => {
                        t.reserve(id, s(slot), p, b, now, 0.0, 0.0);
                        m.live.retain(|l| l.0 != id);
                        m.live.push((id, slot, p, b, m.epochs[slot], true, now + TTL));
                    }
                    Op::PrefillDone(id) => {
                        let known = m.live.iter_mut().find(|l| l.0 == id);
                        proptest::prop_assert_eq!(t.prefill_done(id).is_ok(), known.is_some());
                        if let Some(l) = known {
                            l.5 = false;
                        }
                    }
                    Op::Finish(id) => {
                        let before = m.live.len();
                        m.live.retain(|l| l.0 != id);
                        proptest::prop_assert_eq!(t.finish(id).is_ok(), m.live.len() < before);
                    }
                    Op::Report(slot, a, p, b) => {
                        let r = report(a, p, b);
                        t.report(s(slot), r);
                        m.reports[slot] = r;
                        m.epochs[slot] += 1;
                    }
                    Op::Expire(ms) => {
                        now += ms;
                        let before = m.live.len();
                        m.live.retain(|l| l.6 > now);
                        proptest::prop_assert_eq!(t.expire(now), before - m.live.len());
                    }
                    Op::RemoveWorker(slot) => {
                        t.remove_worker(s(slot));
                        m.live.retain(|l| l.1 != slot);
                        m.reports[slot] = LoadReport::default();
                    }
                }
                for slot in 0..4 {
                    proptest::prop_assert_eq!(t.projected(s(slot)), m.projected(slot));
                }
                proptest::prop_assert_eq!(t.reservations(), m.live.len());
                proptest::prop_assert_eq!(
                    t.next_expiry_ms(),
                    m.live.iter().map(|l| l.6).min()
                );
            }
        }
    }
}
