//! Session affinity: which worker a session's turns go to.
//!
//! Hard mode (the default) turns a live binding into an exact target: the
//! request skips the policy. Soft mode hands the binding to the policy as an
//! advisory [`AffinityTarget`]; the policy may keep it or choose another
//! worker. Either way the host rebinds only after a successful dispatch
//! ([`SessionAffinityTable::bind`]), so a failed selection or dispatch leaves
//! the previous binding intact.
//!
//! Bounded: at most [`MAX_SESSIONS`] bindings, session ids of at most
//! [`MAX_SESSION_ID_BYTES`] bytes. Ids are kept as 128-bit xxh3 digests, so
//! the table is allocated once and binding a new session allocates nothing.
//! Time comes from the caller (milliseconds of a monotonic clock).

use std::collections::HashMap;

use crate::context::{AffinityTarget, WorkerSelectionContext};
use crate::table::WorkerWithDpRank;

/// Most sessions the table holds.
pub const MAX_SESSIONS: usize = 65_536;
/// Longest session id accepted, in bytes.
pub const MAX_SESSION_ID_BYTES: usize = 256;

/// How a binding steers the next turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AffinityMode {
    /// The bound worker is an exact target.
    #[default]
    Hard,
    /// The bound worker is advice to the policy.
    Soft,
}

/// A session id the table refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionIdError {
    #[error("session id is empty")]
    Empty,
    #[error("session id is {len} bytes; the limit is {MAX_SESSION_ID_BYTES}")]
    TooLong { len: usize },
}

#[derive(Clone, Copy, Debug)]
struct Binding {
    worker: WorkerWithDpRank,
    expires_ms: u64,
}

/// Session id -> worker, with a TTL refreshed on every bind.
#[derive(Debug)]
pub struct SessionAffinityTable {
    mode: AffinityMode,
    ttl_ms: u64,
    capacity: usize,
    map: HashMap<u128, Binding>,
}

impl SessionAffinityTable {
    /// A table of at most `capacity` sessions (clamped to 1..=MAX_SESSIONS).
    pub fn new(mode: AffinityMode, ttl_ms: u64, capacity: usize) -> Self {
        let capacity = capacity.clamp(1, MAX_SESSIONS);
        SessionAffinityTable {
            mode,
            ttl_ms,
            capacity,
            map: HashMap::with_capacity(capacity),
        }
    }

    pub fn mode(&self) -> AffinityMode {
        self.mode
    }

    /// New settings for a live table (a configuration reload): bindings are
    /// kept; the new TTL applies from their next refresh, and a smaller
    /// capacity only stops new sessions until the table shrinks by expiry.
    pub fn reconfigure(&mut self, mode: AffinityMode, ttl_ms: u64, capacity: usize) {
        self.mode = mode;
        self.ttl_ms = ttl_ms;
        self.capacity = capacity.clamp(1, MAX_SESSIONS);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn key(session_id: &str) -> Result<u128, SessionIdError> {
        match session_id.len() {
            0 => Err(SessionIdError::Empty),
            len if len > MAX_SESSION_ID_BYTES => Err(SessionIdError::TooLong { len }),
            _ => Ok(xxhash_rust::xxh3::xxh3_128(session_id.as_bytes())),
        }
    }

    /// The live binding of `session_id` (an expired one is dropped).
    pub fn lookup(
        &mut self,
        session_id: &str,
        now_ms: u64,
    ) -> Result<Option<WorkerWithDpRank>, SessionIdError> {
        let key = Self::key(session_id)?;
        match self.map.get(&key) {
            Some(b) if b.expires_ms > now_ms => Ok(Some(b.worker)),
            Some(_) => {
                self.map.remove(&key);
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// Applies the binding of the context's session: an exact target in hard
    /// mode, an affinity target in soft mode. A context that already has an
    /// explicit target, or no session, is returned unchanged.
    pub fn apply<'a>(
        &mut self,
        context: WorkerSelectionContext<'a>,
    ) -> Result<WorkerSelectionContext<'a>, SessionIdError> {
        if context.pinned_worker().is_some() {
            return Ok(context);
        }
        let Some(session) = context.session_context() else {
            return Ok(context);
        };
        let Some(worker) = self.lookup(session.session_id(), context.now_ms())? else {
            return Ok(context);
        };
        Ok(match self.mode {
            AffinityMode::Hard => context.with_pinned_worker(worker),
            AffinityMode::Soft => context.with_affinity_target(AffinityTarget::from(worker)),
        })
    }

    /// Binds (or rebinds) `session_id` to `worker` after a successful
    /// dispatch, refreshing the TTL. When the table is full, expired
    /// bindings go first, then the one closest to expiry.
    pub fn bind(
        &mut self,
        session_id: &str,
        worker: WorkerWithDpRank,
        now_ms: u64,
    ) -> Result<(), SessionIdError> {
        let key = Self::key(session_id)?;
        if !self.map.contains_key(&key) && self.map.len() >= self.capacity {
            self.map.retain(|_, b| b.expires_ms > now_ms);
            if self.map.len() >= self.capacity
                && let Some(oldest) = self
                    .map
                    .iter()
                    .min_by_key(|(_, b)| b.expires_ms)
                    .map(|(k, _)| *k)
            {
                self.map.remove(&oldest);
            }
        }
        self.map.insert(
            key,
            Binding {
                worker,
                expires_ms: now_ms.saturating_add(self.ttl_ms),
            },
        );
        Ok(())
    }

    /// Forgets a session (its final turn was dispatched).
    pub fn end(&mut self, session_id: &str) -> Result<bool, SessionIdError> {
        Ok(self.map.remove(&Self::key(session_id)?).is_some())
    }

    /// Drops every binding to a worker that left; returns how many.
    pub fn forget_worker(&mut self, worker_id: u64) -> usize {
        let before = self.map.len();
        self.map.retain(|_, b| b.worker.worker_id != worker_id);
        before - self.map.len()
    }

    /// Drops expired bindings; returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let before = self.map.len();
        self.map.retain(|_, b| b.expires_ms > now_ms);
        before - self.map.len()
    }
}
