//! `prefill-times-requests`: for a request whose prefix recent requests
//! shared, the candidate whose prefill work times its request count is
//! lowest wins; for any other, the `predicted-ttft` cost decides (exact
//! ties broken by the instance's seeded RNG).
//!
//! For each candidate, with `B` the block size and `P` the prompt's tokens:
//!
//! ```text
//! cached    = B · (device_overlap + host_cache_hit_weight · host_overlap
//!                  + disk_cache_hit_weight · disk_overlap)
//! uncached  = max(P − cached, 1)
//! cost      = ((1 + recompute_weight) · uncached + active_prefill_tokens)
//!             · (active_requests + waiting_requests + 1)
//! ```
//!
//! The first factor is the prefill the request would wait for and add; the
//! second the batch it would join. An additive cost (the default cost,
//! `predicted-ttft`) moves a request off a worker when the queue there
//! outgrows the prefix it would save; the product moves it sooner the
//! busier the worker already is, so a hot prefix spreads to a second
//! worker while its first is still absorbing it. With `recompute_weight`
//! 0 this is the shape of vllm-router's `kv_aware` cost, here over
//! kvedge's view of each worker:
//! the engine's reported requests plus kvedge's reservations on it, and the
//! prefill tokens its reservations still hold (released when the engine's
//! event of the prompt's last block, or a client's `prefill_done`, says the
//! prefill is over).
//!
//! With `recompute_weight` 0 the product spreads a prefix even while it is
//! being computed: a second request for a new prompt finds the first one's
//! worker busy with that very prefill, and an idle worker computing the
//! same prefix again costs less. In a burst of new prompts every worker
//! then computes every prefix. `recompute_weight` prices the request's own
//! prefill that much again (as `predicted-ttft` does), so a prompt waits
//! for the prefix being computed unless the queue there costs more.
//!
//! The product pays where many requests share a prefix: the copy it makes
//! on a less busy worker serves the prefix's later requests. Where one
//! conversation owns its history it does not: the conversation leaves the
//! worker that holds it whenever that worker is busy, and its cache is
//! lost. So a request whose deepest held prefix fewer than `min_sharers`
//! recent picks sent (the host's `prefix_sharers`: picks that noted that
//! block within its prefix-reservation window of each other) is scored as
//! `predicted-ttft` scores it, with that policy's default weights; a
//! shared one by the product. `min_sharers` 0 scores every request by the
//! product.
//!
//! `uncached` is at least one token because an engine computes at least
//! the prompt's last token, however much of it is cached: with a prompt
//! cached whole on two idle workers, the one with fewer requests wins
//! instead of a coin toss.

use crate::context::WorkerSelectionContext;
use crate::error::WorkerSelectionPolicyError;
use crate::inputs::WorkerInputs;
use crate::policy::WorkerScorer;
use crate::view::WorkerCandidates;

use super::simple::{cache_unavailable, load_unavailable};

/// `recompute_weight` by default.
pub const DEFAULT_RECOMPUTE_WEIGHT: f64 = 1.0;

/// `min_sharers` by default.
pub const DEFAULT_MIN_SHARERS: u32 = 4;

/// The cost of the module docs, as a scorer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillTimesRequestsScorer {
    /// The price of the request's own prefill, over the prefill itself.
    pub recompute_weight: f64,
    /// Credit for a block held in host memory, as a fraction of a device
    /// block's.
    pub host_cache_hit_weight: f64,
    /// Credit for a block held on disk.
    pub disk_cache_hit_weight: f64,
    /// A request whose deepest held prefix fewer recent picks sent is
    /// scored by this instead (0: never).
    pub min_sharers: u32,
    pub private: super::predicted_ttft::PredictedTtftScorer,
}

impl WorkerScorer for PrefillTimesRequestsScorer {
    fn required_worker_inputs(&self) -> WorkerInputs {
        if self.min_sharers > 0 {
            WorkerInputs::LOAD | WorkerInputs::CACHE | WorkerInputs::TTFT
        } else {
            WorkerInputs::LOAD | WorkerInputs::CACHE
        }
    }

    fn score(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        if context.prefix_sharers() < self.min_sharers {
            return self.private.score(context, candidates, costs);
        }
        let load = candidates.load_columns().ok_or_else(load_unavailable)?;
        let cache = candidates.cache_columns().ok_or_else(cache_unavailable)?;
        let block = f64::from(context.block_size());
        let prompt = f64::from(context.prompt_tokens());
        let lower = candidates.has_lower_tier_overlap();
        let own = 1.0 + self.recompute_weight;
        for (i, cost) in costs.iter_mut().enumerate() {
            let mut blocks = f64::from(cache.device_blocks[i]);
            if lower {
                blocks += self.host_cache_hit_weight * f64::from(cache.host_blocks[i])
                    + self.disk_cache_hit_weight * f64::from(cache.disk_blocks[i]);
            }
            let uncached = (prompt - block * blocks).max(1.0);
            let prefill = own * uncached + f64::from(load.active_prefill_tokens[i]);
            let requests =
                f64::from(load.active_requests[i]) + f64::from(load.waiting_requests[i]) + 1.0;
            *cost = prefill * requests;
        }
        Ok(())
    }
}
