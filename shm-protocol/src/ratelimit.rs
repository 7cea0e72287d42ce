//! A rate limit for log lines: one a period per kind of trouble, with the
//! number held back since, so that a hostile or broken peer cannot fill
//! the journal or spend a thread's time on logging. Time is passed in.

use std::time::{Duration, Instant};

/// The clock of one kind of log line.
#[derive(Debug, Clone, Copy)]
pub struct RateLimit {
    every: Duration,
    last: Option<Instant>,
    held_back: u64,
}

impl Default for RateLimit {
    /// One a second.
    fn default() -> Self {
        RateLimit::new(Duration::from_secs(1))
    }
}

impl RateLimit {
    /// At most one line every `every`.
    pub const fn new(every: Duration) -> RateLimit {
        RateLimit {
            every,
            last: None,
            held_back: 0,
        }
    }

    /// Whether a line may be logged at `now`; if so, how many were held
    /// back since the last one.
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|t| now.saturating_duration_since(t) < self.every)
        {
            self.held_back += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held_back))
    }
}

/// A suffix for a line that follows `held_back` suppressed ones.
pub fn held_back(n: u64) -> String {
    match n {
        0 => String::new(),
        1 => " (1 more like it held back)".to_owned(),
        n => format!(" ({n} more like it held back)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_a_period_with_the_count_held_back() {
        let t = Instant::now();
        let mut r = RateLimit::default();
        assert_eq!(r.allow(t), Some(0));
        for i in 1..=5 {
            assert_eq!(r.allow(t + Duration::from_millis(i * 10)), None);
        }
        assert_eq!(r.allow(t + Duration::from_secs(1)), Some(5));
        assert_eq!(r.allow(t + Duration::from_secs(1)), None);
        assert_eq!(held_back(5), " (5 more like it held back)");
    }
}
