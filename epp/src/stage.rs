//! How long the picker's stages take, for the metrics: a fixed-bucket
//! histogram of atomics per stage (kept with the picker's other counters
//! in [`crate::server::Stats`]), recorded on the serving thread and read
//! once a second. Two stages are timed, the two a request always passes
//! through: reading its prompt (the body parsed, the template rendered,
//! the tokenizer run, with any wait for the pool and on it) and its
//! select (the round trip to the routing core).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// The buckets' upper bounds, in nanoseconds: 5 µs to 1 s.
pub const BOUNDS_NS: [u64; 14] = [
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    200_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    50_000_000,
    100_000_000,
    1_000_000_000,
];

/// One stage's durations: a count per bucket (the last for durations past
/// every bound), their count and their sum.
#[derive(Debug, Default)]
pub struct Durations {
    buckets: [AtomicU64; BOUNDS_NS.len() + 1],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// What [`Durations`] held when read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Read {
    /// Per bucket of [`BOUNDS_NS`], then past them all (not cumulative).
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_ns: u64,
}

impl Durations {
    pub fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let b = BOUNDS_NS.partition_point(|&bound| bound < ns);
        self.buckets[b].fetch_add(1, Relaxed);
        self.count.fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    pub fn read(&self) -> Read {
        Read {
            buckets: self.buckets.iter().map(|b| b.load(Relaxed)).collect(),
            count: self.count.load(Relaxed),
            sum_ns: self.sum_ns.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_lands_in_the_first_bucket_at_or_above_it() {
        let d = Durations::default();
        for us in [1, 5, 6, 150, 2_000_000] {
            d.record(Duration::from_micros(us));
        }
        let r = d.read();
        assert_eq!(r.count, 5);
        assert_eq!(r.sum_ns, 2_000_162_000);
        let mut want = vec![0; BOUNDS_NS.len() + 1];
        want[0] = 2; // 1 and 5 µs: at or below 5 µs
        want[1] = 1; // 6 µs
        want[5] = 1; // 150 µs: at or below 200 µs
        want[BOUNDS_NS.len()] = 1; // 2 s: past every bound
        assert_eq!(r.buckets, want);
    }
}
