//! Keeping the select path warm between paced requests. A frontend that
//! sends a select every few milliseconds finds the routing loop asleep
//! and its caches taken by the engines' ingest and by other processes:
//! the code, the policy's state, the worker columns and the first lines
//! of the KV index all come back from memory, which made a select several
//! times slower than back to back. While selects keep coming
//! (`daemon.warm_for_ms` after the last one), the core runs the part of a
//! select that decides nothing ([`crate::router::Router::warm`]) whenever
//! `daemon.warm_us` passed without one, with the last select's model and
//! role and the first [`WARM_BLOCKS`] hashes of its prompt (the part
//! requests most often share). Back-to-back traffic never triggers it.

use std::time::{Duration, Instant};

use kvedge_policies::WorkerType;

/// Hashes of the last prompt a warm-up walks: enough to bring the walk's
/// code and the index's shared prefixes back, not a whole prompt.
pub const WARM_BLOCKS: usize = 16;

/// What the last select asked, kept for the warm-ups after it.
#[derive(Debug)]
pub(crate) struct Warmth {
    pub model: String,
    pub role: WorkerType,
    pub prompt_tokens: u32,
    /// At most [`WARM_BLOCKS`].
    pub hashes: Vec<u64>,
    /// The hashes are a prompt's text chunks (matched in the approximate
    /// index), not its KV blocks.
    pub approximate: bool,
    /// When the last select was answered; none yet: nothing to warm.
    last_select: Option<Instant>,
    /// When the last select or warm-up ran.
    last_run: Instant,
    pub runs: u64,
}

impl Warmth {
    pub fn new(now: Instant) -> Self {
        Warmth {
            model: String::new(),
            role: WorkerType::Aggregated,
            prompt_tokens: 0,
            hashes: Vec::with_capacity(WARM_BLOCKS),
            approximate: false,
            last_select: None,
            last_run: now,
            runs: 0,
        }
    }

    /// A select was answered at `now` (allocates only when the model's
    /// name outgrows the last one's).
    pub fn selected(
        &mut self,
        now: Instant,
        model: &str,
        role: WorkerType,
        prompt_tokens: u32,
        hashes: &[u64],
        approximate: bool,
    ) {
        if self.model != model {
            self.model.clear();
            self.model.push_str(model);
        }
        self.role = role;
        self.prompt_tokens = prompt_tokens;
        self.hashes.clear();
        self.hashes
            .extend_from_slice(&hashes[..hashes.len().min(WARM_BLOCKS)]);
        self.approximate = approximate;
        self.last_select = Some(now);
        self.last_run = now;
    }

    /// When the next warm-up is due, if warming is on (`every` > 0) and
    /// the last select is less than `lasting` old at that time.
    pub fn next(&self, every: Duration, lasting: Duration) -> Option<Instant> {
        let last_select = self.last_select?;
        let at = self.last_run + every;
        (!every.is_zero() && at < last_select + lasting).then_some(at)
    }

    /// A warm-up ran at `now`.
    pub fn ran(&mut self, now: Instant) {
        self.last_run = now;
        self.runs += 1;
    }
}
