//! The core's counters: plain integers bumped on the paths they count
//! (nothing here allocates after warm-up or locks), copied out by `stats`
//! and by a metrics scrape.

use kvedge_schema::EventRef;

use crate::latency::Histogram;

/// Names of the ring record kinds, for metrics, in [`event_kind`] order.
pub(crate) const EVENT_KINDS: [&str; 8] = [
    "stored",
    "removed",
    "cleared",
    "load",
    "heartbeat",
    "snapshot_begin",
    "snapshot_end",
    "notice",
];

/// The index of `e`'s kind in [`EVENT_KINDS`].
pub(crate) fn event_kind(e: &EventRef<'_>) -> usize {
    match e {
        EventRef::Stored(_) => 0,
        EventRef::Removed(_) => 1,
        EventRef::Cleared(_) => 2,
        EventRef::Load(_) => 3,
        EventRef::Heartbeat(_) => 4,
        EventRef::SnapshotBegin(_) => 5,
        EventRef::SnapshotEnd(_) => 6,
        EventRef::Notice(_) => 7,
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// The endpoint picker's bounds, as its driver last reported them.
    pub picker: Option<crate::metrics::PickerStats>,
    /// How the routing loop waits, as its driver last reported it.
    pub routing_loop: crate::metrics::LoopStats,
    pub selects: u64,
    /// Error replies, of any request.
    pub errors: u64,
    /// Time in the core per select, as its driver measured it.
    pub select_latency: Histogram,
    pub reloads: u64,
    pub reload_failures: u64,
    pub refused_registrations: u64,
    pub refused_connections: u64,
    /// Query connections dropped by their driver, by [`crate::ClientDrop`].
    pub dropped_clients: [u64; 2],
    /// Ring records applied, by [`EVENT_KINDS`] index.
    pub events: [u64; 8],
    /// Records found missing in rings.
    pub ring_gaps: u64,
    pub resyncs: u64,
    /// Drops counted by engines that have left.
    pub departed_drops: u64,
    /// (policy, rule, outcome, count): grows by one entry per new
    /// combination, so the select path does not allocate after warm-up.
    pub selections: Vec<(String, Option<String>, &'static str, u64)>,
}

impl Counters {
    /// Counts a selection of `policy` and `rule` with `outcome` (allocates
    /// only for a new combination).
    pub fn count_selection(&mut self, policy: &str, rule: Option<&str>, outcome: &'static str) {
        match self
            .selections
            .iter_mut()
            .find(|(p, r, o, _)| p == policy && r.as_deref() == rule && *o == outcome)
        {
            Some(e) => e.3 += 1,
            None => self
                .selections
                .push((policy.to_owned(), rule.map(str::to_owned), outcome, 1)),
        }
    }
}
