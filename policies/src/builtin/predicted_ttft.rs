//! `predicted-ttft`: the candidate with the lowest predicted time to first
//! token, plus a price on the prefill work the request adds, wins (exact
//! ties broken by the instance's seeded RNG).
//!
//! The prediction is the host's `TTFT` signal, made by the one predictor
//! the rule language's `PredictedTTFT` objective also uses
//! ([`crate::predict`]): the prefill queued ahead of the request (the
//! engine's report plus what is left of the host's reservations not yet in
//! one, as the worker computes them at its speed), the request's own
//! prefill with device, host and disk hits priced apart, over
//! the worker's learned prefill speed, plus a wait per queued request. The
//! predictor's parameters are the configuration's `ttft:` section, so the
//! policy and the rules never disagree about a worker.
//!
//! ```text
//! new   = min own_prefill over the candidates        (the work no worker has cached)
//! share = recent_selections / their mean over the candidates   (1 when none)
//! cost  = ttft + recompute_weight · own_prefill + balance_weight · share · new
//! ```
//!
//! TTFT alone is indifferent between waiting behind the prefill that is
//! computing a prompt's prefix on one worker and computing the same prefix
//! again, in parallel, on an idle one: both give the first token at about
//! the same time. They are not equal for the fleet: the second spends a
//! worker's prefill time on work already being done and keeps the prefix
//! in two caches instead of one. `recompute_weight` (default 4) prices the
//! request's own prefill that much again, so a prompt goes where its
//! prefix is (or is being computed) unless the queue there costs more than
//! `1 + recompute_weight` times computing it elsewhere.
//!
//! TTFT is also blind to what a prefill starts. The part of a prompt no
//! worker holds makes the worker that computes it the home of every later
//! request that shares it: a new system prompt or a conversation's first
//! turn brings a stream. A worker that is momentarily idle but already
//! home to the busiest streams is the wrong place for another one, and its
//! queue says so only when the stream has come. `balance_weight`
//! (default 1) prices that new part by how much of the recent traffic the
//! worker got (`recent_selections`, the requests the host sent it, a count that
//! halves every 10 s, over the candidates' mean): a cold prompt goes to a
//! worker with less recent traffic unless its queue costs more than the
//! difference; a request whose prefix is cached somewhere brings little
//! new work, so the term barely moves it. With both weights 0 the cost is
//! exactly the rules' `PredictedTTFT`.

use crate::context::WorkerSelectionContext;
use crate::error::WorkerSelectionPolicyError;
use crate::inputs::WorkerInputs;
use crate::policy::WorkerScorer;
use crate::view::WorkerCandidates;

/// `recompute_weight` by default.
pub const DEFAULT_RECOMPUTE_WEIGHT: f64 = 4.0;

/// `balance_weight` by default.
pub const DEFAULT_BALANCE_WEIGHT: f64 = 1.0;

/// Scores each candidate with its predicted TTFT, plus its own predicted
/// prefill priced by `recompute_weight`, plus the prefill no candidate has
/// cached priced by `balance_weight` times the candidate's share of recent
/// traffic; seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictedTtftScorer {
    pub recompute_weight: f64,
    pub balance_weight: f64,
}

impl Default for PredictedTtftScorer {
    fn default() -> Self {
        PredictedTtftScorer {
            recompute_weight: DEFAULT_RECOMPUTE_WEIGHT,
            balance_weight: DEFAULT_BALANCE_WEIGHT,
        }
    }
}

impl WorkerScorer for PredictedTtftScorer {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::TTFT
    }

    fn score(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        let ttft = candidates
            .ttft_column()
            .ok_or_else(|| WorkerSelectionPolicyError::failed("ttft input unavailable"))?;
        let prefill = candidates.prefill_column().unwrap_or(&[]);
        // A host that predicts TTFT but not its parts prices no work; one
        // that does not count recent selections balances nothing.
        let own = |i: usize| prefill.get(i).copied().filter(|p| !p.is_nan());
        let recent = candidates.recent_column().unwrap_or(&[]);
        let count = |i: usize| {
            recent
                .get(i)
                .copied()
                .filter(|r| r.is_finite() && *r >= 0.0)
        };
        let mut new = f64::INFINITY;
        let (mut total, mut known) = (0.0, 0usize);
        for i in 0..costs.len() {
            new = new.min(own(i).unwrap_or(0.0));
            if let Some(r) = count(i) {
                total += r;
                known += 1;
            }
        }
        let mean = total / known.max(1) as f64;
        if !new.is_finite() {
            new = 0.0;
        }
        for (i, (cost, &t)) in costs.iter_mut().zip(ttft).enumerate() {
            if t.is_nan() {
                return Err(WorkerSelectionPolicyError::failed(
                    "the host predicted no TTFT for a candidate",
                ));
            }
            let share = match count(i) {
                Some(r) if mean > 0.0 => r / mean,
                _ => 1.0,
            };
            *cost = t
                + self.recompute_weight * own(i).unwrap_or(0.0)
                + self.balance_weight * share * new;
        }
        Ok(())
    }
}
