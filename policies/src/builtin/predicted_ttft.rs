//! `predicted-ttft`: the candidate with the lowest predicted time to first
//! token, plus a price on the prefill work the request adds, wins (exact
//! ties broken by the instance's seeded RNG).
//!
//! The prediction is the host's `TTFT` signal, made by the one predictor
//! the rule language's `PredictedTTFT` objective also uses
//! ([`crate::predict`]): the prefill queued ahead of the request (the
//! engine's report plus the host's reservations not yet in one), the
//! request's own prefill with device, host and disk hits priced apart, over
//! the worker's learned prefill speed, plus a wait per queued request. The
//! predictor's parameters are the configuration's `ttft:` section, so the
//! policy and the rules never disagree about a worker.
//!
//! ```text
//! cost = ttft + recompute_weight · own_prefill
//! ```
//!
//! TTFT alone is indifferent between waiting behind the prefill that is
//! computing a prompt's prefix on one worker and computing the same prefix
//! again, in parallel, on an idle one: both give the first token at about
//! the same time. They are not equal for the fleet: the second spends a
//! worker's prefill time on work already being done and keeps the prefix
//! in two caches instead of one. `recompute_weight` (default 2) prices the
//! request's own prefill that much again, so a prompt goes where its
//! prefix is (or is being computed) unless the queue there costs more than
//! `1 + recompute_weight` times computing it elsewhere. With 0 the cost is
//! exactly the rules' `PredictedTTFT`.

use crate::context::WorkerSelectionContext;
use crate::error::WorkerSelectionPolicyError;
use crate::inputs::WorkerInputs;
use crate::policy::WorkerScorer;
use crate::view::WorkerCandidates;

/// `recompute_weight` by default.
pub const DEFAULT_RECOMPUTE_WEIGHT: f64 = 2.0;

/// Scores each candidate with its predicted TTFT plus `recompute_weight`
/// times its own predicted prefill, seconds.
#[derive(Clone, Copy, Debug)]
pub struct PredictedTtftScorer {
    pub recompute_weight: f64,
}

impl Default for PredictedTtftScorer {
    fn default() -> Self {
        PredictedTtftScorer {
            recompute_weight: DEFAULT_RECOMPUTE_WEIGHT,
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
        for (i, (cost, &t)) in costs.iter_mut().zip(ttft).enumerate() {
            if t.is_nan() {
                return Err(WorkerSelectionPolicyError::failed(
                    "the host predicted no TTFT for a candidate",
                ));
            }
            // A host that predicts TTFT but not its parts prices no work.
            let own = prefill.get(i).copied().filter(|p| !p.is_nan());
            *cost = t + self.recompute_weight * own.unwrap_or(0.0);
        }
        Ok(())
    }
}
