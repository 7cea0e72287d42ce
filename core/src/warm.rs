//! Keeping the select path warm between paced requests. A frontend that
//! sends a select every few milliseconds finds the routing loop asleep
//! and its caches taken by the engines' ingest and by other processes:
//! the code, the policy's state, the worker columns and the first lines
//! of the KV index all come back from memory, which made a select several
//! times slower than back to back. While selects keep coming, the core
//! runs the part of a select that decides nothing
//! ([`crate::router::Router::warm`]) with the last select's model and
//! role and the first [`WARM_BLOCKS`] hashes of its prompt (the part
//! requests most often share). Its cost is bounded per select, not per
//! second, and it is spent where the next select is likely to come: the
//! warm-ups close in on the time the next select is expected (the mean
//! gap between selects after the last one), halving the distance each
//! time but never closer together than `daemon.warm_us`; they run every
//! `daemon.warm_us` for an eighth of a gap around that time, then every
//! [`WARMS_PER_GAP`]th of a gap; and none is due once no select came for
//! [`IDLE_GAPS`] mean gaps, or [`AT_LEAST`] if that is longer (a pause in
//! back-to-back traffic, between bursts), or `daemon.warm_for_ms` if
//! that is sooner. At ten
//! selects a second that is about ten to twenty warm-ups a gap, not a
//! hundred. Back-to-back traffic never triggers it; a daemon without
//! traffic does no work for it.

use std::time::{Duration, Instant};

use kvedge_policies::WorkerType;

use crate::pacing::Gaps;

/// Once the next select is overdue, a warm-up every this fraction of the
/// mean gap between selects.
pub const WARMS_PER_GAP: u32 = 4;
/// Warm-ups run every `daemon.warm_us` for this fraction of the mean gap
/// after the time the next select was expected.
pub const AROUND: u32 = 8;
/// Selects stopped coming when none came for this many mean gaps...
pub const IDLE_GAPS: u32 = 4;
/// ... and at least this long.
pub const AT_LEAST: Duration = Duration::from_millis(100);

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
    /// When selects were answered; none yet: nothing to warm.
    selects: Gaps,
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
            selects: Gaps::new(),
            last_run: now,
            runs: 0,
        }
    }

    /// A select was answered at `now` (allocates only when the model's
    /// name outgrows the last one's). Gaps count as at most `lasting`
    /// (`daemon.warm_for_ms`).
    #[allow(clippy::too_many_arguments)] // one select's facts, as it has them
    pub fn selected(
        &mut self,
        now: Instant,
        lasting: Duration,
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
        self.selects.arrived(now, lasting);
        self.last_run = now;
    }

    /// When the next warm-up is due, if warming is on (`every` > 0) and
    /// selects are still coming at that time (see the module's doc).
    pub fn next(&self, every: Duration, lasting: Duration) -> Option<Instant> {
        let last_select = self.selects.last()?;
        if every.is_zero() {
            return None;
        }
        // One select so far: its gap is unknown, take the longest.
        let gap = self.selects.mean().unwrap_or(lasting);
        let expected = last_select + gap;
        let from = self.last_run;
        let step = if from < expected {
            ((expected - from) / 2).max(every)
        } else if from < expected + gap / AROUND {
            every
        } else {
            every.max(gap / WARMS_PER_GAP)
        };
        let at = from + step;
        let until = (gap * IDLE_GAPS).max(AT_LEAST).min(lasting);
        (at < last_select + until).then_some(at)
    }

    /// A warm-up ran at `now`.
    pub fn ran(&mut self, now: Instant) {
        self.last_run = now;
        self.runs += 1;
    }
}
