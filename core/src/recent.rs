//! The most recent selections, for the `decisions` op (and `kvedge top`):
//! a fixed ring of small copies, written on every select without
//! allocating, read only when asked. Names (policy, rule, provider) are
//! kept as indices and resolved when read, against the configuration of
//! the same reload generation.

use kvedge_policies::WorkerType;

/// How many selections are kept.
pub const KEPT: usize = 64;

/// One selection, as made.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    /// The router's clock, ms.
    pub at_ms: u64,
    pub role: WorkerType,
    /// The chosen worker (id, dp rank).
    pub worker: Option<(u64, u32)>,
    /// The chosen provider (index into the rules' providers).
    pub provider: Option<usize>,
    /// `ok` or the error's status name.
    pub outcome: &'static str,
    /// The deciding rule (index) and its tier.
    pub rule: Option<usize>,
    pub tier: Option<usize>,
    pub candidates: usize,
    pub survivors: usize,
    pub prompt_blocks: u32,
    pub overlap_blocks: u32,
    /// Recent picks that sent the deepest prompt block a candidate held.
    pub prefix_sharers: u32,
    pub dry_run: bool,
    /// Reloads before it (indices mean something in that configuration).
    pub generation: u64,
}

/// The ring.
#[derive(Debug)]
pub struct Recent {
    ring: [Option<Decision>; KEPT],
    next: usize,
}

impl Default for Recent {
    fn default() -> Self {
        Recent {
            ring: [None; KEPT],
            next: 0,
        }
    }
}

impl Recent {
    pub fn push(&mut self, d: Decision) {
        self.ring[self.next] = Some(d);
        self.next = (self.next + 1) % KEPT;
    }

    /// Newest first.
    pub fn newest_first(&self) -> impl Iterator<Item = &Decision> {
        (1..=KEPT).filter_map(move |i| self.ring[(self.next + KEPT - i) % KEPT].as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(at_ms: u64) -> Decision {
        Decision {
            at_ms,
            role: WorkerType::Aggregated,
            worker: Some((1, 0)),
            provider: None,
            outcome: "ok",
            rule: None,
            tier: None,
            candidates: 1,
            survivors: 1,
            prompt_blocks: 4,
            overlap_blocks: 2,
            prefix_sharers: 0,
            dry_run: false,
            generation: 0,
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_first_and_forgets_the_oldest() {
        let mut r = Recent::default();
        assert_eq!(r.newest_first().count(), 0);
        for t in 0..3 {
            r.push(d(t));
        }
        let at: Vec<u64> = r.newest_first().map(|d| d.at_ms).collect();
        assert_eq!(at, [2, 1, 0]);
        for t in 3..(KEPT as u64 + 10) {
            r.push(d(t));
        }
        let at: Vec<u64> = r.newest_first().map(|d| d.at_ms).collect();
        assert_eq!(at.len(), KEPT);
        assert_eq!(at[0], KEPT as u64 + 9);
        assert_eq!(*at.last().unwrap(), 10);
    }
}
