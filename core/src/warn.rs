//! Rate-limited warnings: a flood of one kind of trouble (refused
//! connections, silent registrations, dropped clients) is logged at most
//! once a second per kind, with the number of occurrences the limit held
//! back, so a hostile peer cannot fill the journal or spend the routing
//! thread's time on logging.

use std::time::Instant;

use kvedge_shm::ratelimit::RateLimit;

/// The kinds of warning that are rate-limited, each on its own clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Warn {
    /// A query connection refused at admission.
    ClientRefused,
    /// A query connection dropped by its driver (slow reader, input budget).
    ClientDropped,
    /// An engine connection refused, or closed before registering.
    Registration,
    /// An engine's resync (asked, re-asked, given up).
    Resync,
}

const KINDS: usize = 4;

/// One clock per [`Warn`] kind (one warning a second each).
#[derive(Debug, Default)]
pub(crate) struct Warnings([RateLimit; KINDS]);

impl Warnings {
    /// Whether a warning of `kind` may be logged at `now`; if so, how many
    /// of its kind were held back since the last one.
    pub fn allow(&mut self, now: Instant, kind: Warn) -> Option<u64> {
        self.0[kind as usize].allow(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    #[allow(clippy::disallowed_methods)] // a test starts its clock once
    fn one_warning_a_second_per_kind_with_the_count_held_back() {
        let t = Instant::now();
        let mut w = Warnings::default();
        assert_eq!(w.allow(t, Warn::Registration), Some(0));
        for _ in 0..5 {
            assert_eq!(
                w.allow(t + Duration::from_millis(10), Warn::Registration),
                None
            );
        }
        assert_eq!(w.allow(t, Warn::ClientDropped), Some(0), "kinds are apart");
        assert_eq!(
            w.allow(t + Duration::from_secs(1), Warn::Registration),
            Some(5)
        );
    }
}
