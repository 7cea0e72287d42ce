//! A fixed-size latency histogram (sixteen buckets per power of two, so a
//! reported quantile is at most 6.25% above the truth), cheap enough to
//! record every selection on the hot path without allocating.

/// Buckets per power of two: `1 << SUB_BITS`.
const SUB_BITS: u32 = 4;
const SUBS: usize = 1 << SUB_BITS;
/// Buckets for values below 2^40 ns; larger ones share the last.
const BUCKETS: usize = SUBS * (40 - SUB_BITS as usize + 1);

/// Nanosecond latencies up to 2^40 ns (about 18 minutes).
#[derive(Clone, Debug)]
pub struct Histogram {
    buckets: [u64; BUCKETS],
    count: u64,
    sum_ns: u64,
    max_ns: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: [0; BUCKETS],
            count: 0,
            sum_ns: 0,
            max_ns: 0,
        }
    }
}

/// Values below `SUBS` have a bucket each; above, each power of two
/// `2^log` is split into `SUBS` buckets of width `2^(log - SUB_BITS)`.
fn bucket(ns: u64) -> usize {
    if ns < SUBS as u64 {
        return ns as usize;
    }
    let log = 63 - ns.leading_zeros(); // >= SUB_BITS
    let sub = ((ns >> (log - SUB_BITS)) as usize) & (SUBS - 1);
    (SUBS * (log - SUB_BITS + 1) as usize + sub).min(BUCKETS - 1)
}

/// The largest value that lands in bucket `b`.
fn upper(b: usize) -> u64 {
    if b < SUBS {
        return b as u64;
    }
    let shift = (b / SUBS - 1) as u32; // log - SUB_BITS
    let sub = (b % SUBS) as u64;
    ((SUBS as u64 + sub + 1) << shift) - 1
}

impl Histogram {
    pub fn record(&mut self, ns: u64) {
        self.buckets[bucket(ns)] += 1;
        self.count += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn mean_ns(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_ns as f64 / self.count as f64
        }
    }

    pub fn max_ns(&self) -> u64 {
        self.max_ns
    }

    /// The upper bound of the bucket holding the `q` quantile (0 when empty).
    pub fn quantile_ns(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (b, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return upper(b).min(self.max_ns);
            }
        }
        self.max_ns
    }

    /// What was recorded after `earlier`, a copy of this histogram taken
    /// before: for the latency of one phase of a run (a benchmark's paced
    /// selects without its warm-up). Each bucket's count is the difference;
    /// the maximum is the upper edge of the highest bucket that grew (the
    /// largest value since is not kept), at most this histogram's maximum.
    /// A histogram that is not a later state of `earlier` gives the
    /// differences that are positive and zero for the rest.
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let mut out = Histogram::default();
        for (b, (&now, &then)) in self.buckets.iter().zip(&earlier.buckets).enumerate() {
            let n = now.saturating_sub(then);
            if n > 0 {
                out.buckets[b] = n;
                out.count += n;
                out.max_ns = upper(b).min(self.max_ns);
            }
        }
        out.sum_ns = self.sum_ns.saturating_sub(earlier.sum_ns);
        out
    }

    /// Total of all recorded values, ns.
    pub fn sum_ns(&self) -> u64 {
        self.sum_ns
    }

    /// Counts per `bounds` bucket (seconds, ascending), each internal
    /// bucket going to the first bound at or above its upper edge, and the
    /// rest to a final `+Inf`: the (non-cumulative) buckets of a Prometheus
    /// histogram. A value is never counted below its true bucket.
    pub fn prometheus_buckets(&self, bounds: &[f64]) -> Vec<(f64, u64)> {
        let mut out: Vec<(f64, u64)> = bounds.iter().map(|&b| (b, 0)).collect();
        out.push((f64::INFINITY, 0));
        for (b, &n) in self.buckets.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let edge = upper(b) as f64 / 1e9;
            let i = bounds
                .iter()
                .position(|&x| edge <= x)
                .unwrap_or(bounds.len());
            out[i].1 += n;
        }
        out
    }

    /// Count, mean, p50, p90, p99 and max, in microseconds.
    pub fn summary(&self) -> kvedge_wire::LatencySummary {
        let us = |ns: u64| ns as f64 / 1e3;
        kvedge_wire::LatencySummary {
            count: self.count,
            mean_us: self.mean_ns() / 1e3,
            p50_us: us(self.quantile_ns(0.5)),
            p90_us: us(self.quantile_ns(0.9)),
            p99_us: us(self.quantile_ns(0.99)),
            max_us: us(self.max_ns),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_and_bound_it_within_a_sixteenth() {
        let last = BUCKETS - 1;
        let values = (0..70_000u64)
            .chain((20..45).flat_map(|p| [(1u64 << p) - 1, 1 << p, (1 << p) + 12_345]))
            .chain([u64::MAX / 4, u64::MAX]);
        for ns in values {
            let b = bucket(ns);
            assert!(upper(b) >= ns.min(upper(last)), "{ns} in bucket {b}");
            if b > 0 && ns < 1 << 40 {
                assert!(upper(b - 1) < ns, "{ns}: bucket {b} is not the first fit");
                assert!(
                    upper(b) as f64 <= ns as f64 * (1.0 + 1.0 / 16.0),
                    "{ns}: bucket {b} reaches {}",
                    upper(b)
                );
            }
        }
        assert_eq!(upper(last), (1 << 40) - 1, "the last bucket ends at 2^40");
    }

    #[test]
    fn since_keeps_only_what_came_after() {
        let mut h = Histogram::default();
        // A warm-up of fast values, then a phase of slow ones.
        for _ in 0..200 {
            h.record(1_000);
        }
        let before = h.clone();
        for ns in 1..=300u64 {
            h.record(10_000 + ns * 100);
        }
        let phase = h.since(&before);
        assert_eq!(phase.count(), 300);
        assert_eq!(
            phase.sum_ns(),
            (1..=300u64).map(|ns| 10_000 + ns * 100).sum::<u64>()
        );
        // The phase's median is its own (about 25 µs), not the whole run's,
        // which the warm-up pulls down to about 15 µs.
        let p50 = phase.quantile_ns(0.5);
        assert!((25_000..=26_600).contains(&p50), "{p50}");
        assert!(h.quantile_ns(0.5) < 16_000, "{}", h.quantile_ns(0.5));
        assert_eq!(phase.quantile_ns(1.0), 40_000);
        assert!(phase.max_ns() >= 40_000 && phase.max_ns() <= h.max_ns());
        // Nothing since: empty.
        let none = h.since(&h);
        assert_eq!(
            (none.count(), none.quantile_ns(0.99), none.max_ns()),
            (0, 0, 0)
        );
    }

    #[test]
    fn quantiles() {
        let mut h = Histogram::default();
        for ns in 1..=1000u64 {
            h.record(ns * 1000);
        }
        let p50 = h.quantile_ns(0.5);
        assert!((500_000..=531_250).contains(&p50), "{p50}");
        assert_eq!(h.quantile_ns(1.0), 1_000_000);
        assert_eq!(h.count(), 1000);
    }
}
