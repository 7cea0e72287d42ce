//! Latency samples read as the benches report them: the sample at a
//! quantile's rank (nearest rank, no interpolation).

use std::time::Duration;

/// Samples, sorted.
#[derive(Clone, Debug)]
pub struct Percentiles(Vec<Duration>);

impl Percentiles {
    /// `samples`, at least one.
    pub fn of(mut samples: Vec<Duration>) -> Percentiles {
        assert!(!samples.is_empty(), "percentiles of no sample");
        samples.sort();
        Percentiles(samples)
    }

    /// The sample at quantile `q` (0 to 1): the one at index `len * q`.
    pub fn at(&self, q: f64) -> Duration {
        let i = ((self.0.len() as f64 * q) as usize).min(self.0.len() - 1);
        self.0[i]
    }

    pub fn p50(&self) -> Duration {
        self.at(0.5)
    }

    pub fn p99(&self) -> Duration {
        self.at(0.99)
    }

    /// p50 and p99.
    pub fn p50_p99(&self) -> (Duration, Duration) {
        (self.p50(), self.p99())
    }

    /// p50 and p99 in microseconds, as the benches' tables print them.
    pub fn p50_p99_us(&self) -> (f64, f64) {
        (Self::us(self.p50()), Self::us(self.p99()))
    }

    /// A duration in microseconds.
    pub fn us(d: Duration) -> f64 {
        d.as_secs_f64() * 1e6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_read_at_their_rank() {
        let p = Percentiles::of((1..=100).rev().map(Duration::from_micros).collect());
        assert_eq!(p.p50(), Duration::from_micros(51));
        assert_eq!(p.p99(), Duration::from_micros(100));
        assert_eq!(p.at(0.0), Duration::from_micros(1));
        assert_eq!(Percentiles::us(Duration::from_micros(3)), 3.0);
        assert_eq!(p.p50_p99_us(), (51.0, 100.0));
    }
}
