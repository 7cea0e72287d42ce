//! `WorkerInputs`: the optional per-worker signal groups a component declares.
//!
//! The host computes a group only when some component of the policy declares
//! it, and hands a component only the groups that component declared itself:
//! another component asking for a group does not grant access to it.

use std::fmt;
use std::ops::{BitAnd, BitOr, BitOrAssign};

/// A set of optional signal groups.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WorkerInputs(u32);

impl WorkerInputs {
    /// No optional signal: worker identity and request metadata only.
    pub const NONE: WorkerInputs = WorkerInputs(0);
    /// Prefix-cache overlap per tier (device / host / disk) and shared-cache hits.
    pub const CACHE: WorkerInputs = WorkerInputs(1);
    /// Active requests, waiting requests, active prefill tokens, active decode blocks.
    pub const LOAD: WorkerInputs = WorkerInputs(1 << 1);
    /// The cost multiplier from preferred (soft) routing constraints.
    pub const PREFERRED_TAINT: WorkerInputs = WorkerInputs(1 << 2);
    /// KV-cache occupancy: used and total blocks.
    pub const OCCUPANCY: WorkerInputs = WorkerInputs(1 << 3);
    /// The host's predicted time to first token on each candidate, seconds
    /// (see [`crate::predict`]), the request's own prefill within it, and
    /// the requests the host sent the candidate lately (a count halving
    /// every [`crate::table::RECENT_HALF_LIFE_MS`]).
    pub const TTFT: WorkerInputs = WorkerInputs(1 << 4);
    /// Every group.
    pub const ALL: WorkerInputs = WorkerInputs(0b1_1111);

    const NAMES: [(WorkerInputs, &'static str); 5] = [
        (Self::CACHE, "CACHE"),
        (Self::LOAD, "LOAD"),
        (Self::PREFERRED_TAINT, "PREFERRED_TAINT"),
        (Self::OCCUPANCY, "OCCUPANCY"),
        (Self::TTFT, "TTFT"),
    ];

    /// True when every group of `other` is in `self`.
    pub const fn contains(self, other: WorkerInputs) -> bool {
        self.0 & other.0 == other.0
    }

    /// True for the empty set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The groups of `self` missing from `other`.
    pub const fn difference(self, other: WorkerInputs) -> WorkerInputs {
        WorkerInputs(self.0 & !other.0)
    }
}

impl BitOr for WorkerInputs {
    type Output = WorkerInputs;
    fn bitor(self, rhs: WorkerInputs) -> WorkerInputs {
        WorkerInputs(self.0 | rhs.0)
    }
}

impl BitOrAssign for WorkerInputs {
    fn bitor_assign(&mut self, rhs: WorkerInputs) {
        self.0 |= rhs.0;
    }
}

impl BitAnd for WorkerInputs {
    type Output = WorkerInputs;
    fn bitand(self, rhs: WorkerInputs) -> WorkerInputs {
        WorkerInputs(self.0 & rhs.0)
    }
}

impl fmt::Debug for WorkerInputs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for WorkerInputs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("NONE");
        }
        let mut first = true;
        for (group, name) in Self::NAMES {
            if self.contains(group) {
                if !first {
                    f.write_str(" | ")?;
                }
                f.write_str(name)?;
                first = false;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_operations_and_display() {
        let both = WorkerInputs::CACHE | WorkerInputs::LOAD;
        assert!(both.contains(WorkerInputs::CACHE));
        assert!(!both.contains(WorkerInputs::OCCUPANCY));
        assert!(both.contains(WorkerInputs::NONE));
        assert_eq!(both.difference(WorkerInputs::LOAD), WorkerInputs::CACHE);
        assert_eq!(both.to_string(), "CACHE | LOAD");
        assert_eq!(WorkerInputs::NONE.to_string(), "NONE");
        assert_eq!(
            WorkerInputs::ALL & WorkerInputs::PREFERRED_TAINT,
            WorkerInputs::PREFERRED_TAINT
        );
    }
}
