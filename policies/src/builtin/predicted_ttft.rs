//! `predicted-ttft`: the candidate with the lowest predicted time to first
//! token wins (exact ties broken by the instance's seeded RNG).
//!
//! The prediction is the host's `TTFT` signal, made by the one predictor
//! the rule language's `PredictedTTFT` objective also uses
//! ([`crate::predict`]): the prefill queued ahead of the request (the
//! engine's report plus the host's reservations not yet in one), the
//! request's own prefill with device, host and disk hits priced apart, over
//! the worker's learned prefill speed, plus a wait per queued request. The
//! predictor's parameters are the configuration's `ttft:` section, so the
//! policy and the rules never disagree about a worker.

use crate::context::WorkerSelectionContext;
use crate::error::WorkerSelectionPolicyError;
use crate::inputs::WorkerInputs;
use crate::policy::WorkerScorer;
use crate::view::WorkerCandidates;

/// Scores each candidate with its predicted TTFT, seconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct PredictedTtftScorer;

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
        for (cost, &t) in costs.iter_mut().zip(ttft) {
            if t.is_nan() {
                return Err(WorkerSelectionPolicyError::failed(
                    "the host predicted no TTFT for a candidate",
                ));
            }
            *cost = t;
        }
        Ok(())
    }
}
