//! How closely things arrive: a running mean of the gaps between events
//! (selects, or the routing loop's bursts of work), which decides whether
//! busy work that only pays off under close arrivals is worth its CPU.
//! The routing loop spins after a burst only while bursts come closer
//! together than the spin lasts, and the core warms the select path only
//! a few times per gap between selects, and not at all once selects
//! stopped coming (see `docs/operations.md`, "Latency"). Time is passed
//! in; nothing here reads a clock.

use std::time::{Duration, Instant};

/// A running mean of the gaps between arrivals: each new gap moves it a
/// quarter of the way (an exponentially weighted mean that forgets a
/// change of pace within a handful of arrivals).
#[derive(Clone, Copy, Debug, Default)]
pub struct Gaps {
    last: Option<Instant>,
    mean: Option<Duration>,
}

impl Gaps {
    pub const fn new() -> Self {
        Gaps {
            last: None,
            mean: None,
        }
    }

    /// Something arrived at `now`. The gap since the last arrival counts
    /// as at most `cap`, so that one long pause (a night without traffic)
    /// is forgotten as quickly as any other slow arrival.
    pub fn arrived(&mut self, now: Instant, cap: Duration) {
        if let Some(last) = self.last {
            self.record(now.saturating_duration_since(last), cap);
        }
        self.last = Some(now);
    }

    /// A gap measured by the caller (counted as at most `cap`), with no
    /// arrival time of its own.
    pub fn record(&mut self, gap: Duration, cap: Duration) {
        let gap = gap.min(cap);
        self.mean = Some(match self.mean {
            None => gap,
            Some(m) if gap >= m => m + (gap - m) / 4,
            Some(m) => m - (m - gap) / 4,
        });
    }

    /// The mean gap, once two arrivals were seen.
    pub fn mean(&self) -> Option<Duration> {
        self.mean
    }

    /// When the last arrival was.
    pub fn last(&self) -> Option<Instant> {
        self.last
    }

    /// Whether arrivals come, on average, less than `within` apart.
    pub fn closer_than(&self, within: Duration) -> bool {
        self.mean.is_some_and(|m| m < within)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Duration = Duration::from_millis(10);

    /// Virtual time starts at any instant; only differences count.
    #[allow(clippy::disallowed_methods)]
    fn start() -> Instant {
        Instant::now()
    }

    fn every(g: &mut Gaps, t: &mut Instant, gap: Duration, n: usize) {
        for _ in 0..n {
            *t += gap;
            g.arrived(*t, CAP);
        }
    }

    #[test]
    fn the_mean_follows_the_pace_within_a_few_arrivals() {
        let mut g = Gaps::new();
        let mut t = start();
        g.arrived(t, CAP);
        assert_eq!(g.mean(), None, "one arrival is no gap");
        every(&mut g, &mut t, Duration::from_micros(50), 1);
        assert_eq!(g.mean(), Some(Duration::from_micros(50)));
        assert!(g.closer_than(Duration::from_micros(200)));

        // Paced at 20 ms (counted as 10 ms): the mean rises past any spin
        // within two arrivals.
        every(&mut g, &mut t, Duration::from_millis(20), 2);
        assert!(!g.closer_than(Duration::from_micros(200)), "{:?}", g.mean());
        every(&mut g, &mut t, Duration::from_millis(20), 30);
        assert!(g.mean().unwrap() > Duration::from_millis(9));
        assert!(g.mean().unwrap() <= CAP);

        // Back to back again: from the cap (fifty times 200 µs) to under
        // 200 µs within sixteen arrivals (the mean keeps three quarters).
        every(&mut g, &mut t, Duration::from_micros(30), 16);
        assert!(g.closer_than(Duration::from_micros(200)), "{:?}", g.mean());
    }

    #[test]
    fn a_long_pause_counts_as_the_cap() {
        let mut g = Gaps::new();
        let mut t = start();
        g.arrived(t, CAP);
        every(&mut g, &mut t, Duration::from_secs(3600), 1);
        assert_eq!(g.mean(), Some(CAP));
        assert_eq!(g.last(), Some(t));
    }
}
