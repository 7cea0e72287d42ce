//! The small built-ins: `least-busy` (the smallest example policy),
//! `round-robin`, `random`, `power-of-two`, `least-kv-usage`, the two-tier
//! `cache-aware` policy and overload-aware `soft-pin`.

use crate::context::WorkerSelectionContext;
use crate::error::{SelectionErrorKind, WorkerSelectionPolicyError};
use crate::inputs::WorkerInputs;
use crate::policy::{WorkerFilter, WorkerPicker, WorkerScorer};
use crate::rng::PolicyRng;
use crate::table::WorkerWithDpRank;
use crate::view::{WorkerCandidate, WorkerCandidates, WorkerInputView};

use super::default_cost::argmin_random_ties;

pub(super) fn load_unavailable() -> WorkerSelectionPolicyError {
    WorkerSelectionPolicyError::failed("load input unavailable")
}

pub(super) fn cache_unavailable() -> WorkerSelectionPolicyError {
    WorkerSelectionPolicyError::failed("cache input unavailable")
}

/// Keeps workers with at least `minimum_blocks` device-resident overlap blocks.
#[derive(Clone, Debug)]
pub struct MinimumDeviceOverlapFilter {
    pub minimum_blocks: f64,
}

impl WorkerFilter for MinimumDeviceOverlapFilter {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::CACHE
    }

    fn keep(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        candidate: WorkerCandidate<'_>,
    ) -> Result<bool, WorkerSelectionPolicyError> {
        let cache = candidate.cache().ok_or_else(cache_unavailable)?;
        Ok(cache.device_overlap_blocks() >= self.minimum_blocks)
    }
}

/// Cost = requests on the worker (running plus queued) above the
/// candidates' minimum. Queued requests count: a worker with a long
/// waiting queue is not idle.
#[derive(Clone, Copy, Debug, Default)]
pub struct ActiveRequestsScorer;

impl WorkerScorer for ActiveRequestsScorer {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD
    }

    fn score(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        let busy =
            |load: crate::view::LoadView<'_>| load.active_requests() + load.waiting_requests();
        let mut minimum = usize::MAX;
        for candidate in candidates.iter() {
            let load = candidate.load().ok_or_else(load_unavailable)?;
            minimum = minimum.min(busy(load));
        }
        for (candidate, cost) in candidates.iter().zip(costs) {
            let load = candidate.load().ok_or_else(load_unavailable)?;
            *cost = (busy(load) - minimum) as f64;
        }
        Ok(())
    }
}

/// The first row of lowest cost.
#[derive(Clone, Copy, Debug, Default)]
pub struct LowestCostPicker;

impl WorkerPicker for LowestCostPicker {
    #[inline(never)]
    fn pick(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        input
            .candidates()
            .iter()
            .enumerate()
            .min_by(|(_, a), (_, b)| a.cost().total_cmp(&b.cost()))
            .map(|(row, _)| row)
            .ok_or_else(|| SelectionErrorKind::NoCandidates.into())
    }

    fn warm(&mut self, context: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) {
        // Stateless: a pick changes nothing.
        let _ = self.pick(context, input);
    }
}

/// Lowest cost, exact ties broken by the instance's seeded RNG.
#[derive(Clone, Debug)]
pub struct LowestCostRandomTiesPicker {
    rng: PolicyRng,
}

impl LowestCostRandomTiesPicker {
    pub fn new(rng: PolicyRng) -> Self {
        LowestCostRandomTiesPicker { rng }
    }
}

impl WorkerPicker for LowestCostRandomTiesPicker {
    #[inline(never)]
    fn pick(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        if input.is_empty() {
            return Err(SelectionErrorKind::NoCandidates.into());
        }
        Ok(argmin_random_ties(input.costs(), &mut self.rng))
    }

    fn warm(&mut self, context: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) {
        super::pick_and_restore(self, |p| &mut p.rng, context, input);
    }
}

/// Cycles through workers in identity order, whatever order the candidates
/// come in: the next worker after the last one picked, wrapping around.
#[derive(Clone, Debug, Default)]
pub struct RoundRobinPicker {
    last: Option<WorkerWithDpRank>,
}

impl WorkerPicker for RoundRobinPicker {
    #[inline(never)]
    fn pick(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        let workers = input.as_candidates().workers();
        let mut next: Option<usize> = None;
        let mut lowest: Option<usize> = None;
        for (row, w) in workers.iter().enumerate() {
            if lowest.is_none_or(|l| *w < workers[l]) {
                lowest = Some(row);
            }
            if self.last.is_none_or(|last| *w > last) && next.is_none_or(|n| *w < workers[n]) {
                next = Some(row);
            }
        }
        let row = next
            .or(lowest)
            .ok_or_else(|| WorkerSelectionPolicyError::from(SelectionErrorKind::NoCandidates))?;
        self.last = Some(workers[row]);
        Ok(row)
    }

    fn warm(&mut self, context: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) {
        super::pick_and_restore(self, |p| &mut p.last, context, input);
    }
}

/// A uniformly random candidate.
#[derive(Clone, Debug)]
pub struct RandomPicker {
    rng: PolicyRng,
}

impl RandomPicker {
    pub fn new(rng: PolicyRng) -> Self {
        RandomPicker { rng }
    }
}

impl WorkerPicker for RandomPicker {
    #[inline(never)]
    fn pick(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        if input.is_empty() {
            return Err(SelectionErrorKind::NoCandidates.into());
        }
        Ok(self.rng.below(input.len()))
    }

    fn warm(&mut self, context: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) {
        super::pick_and_restore(self, |p| &mut p.rng, context, input);
    }
}

/// Two distinct random candidates; the one with fewer active plus waiting
/// requests wins (the first drawn on a tie).
#[derive(Clone, Debug)]
pub struct PowerOfTwoPicker {
    rng: PolicyRng,
}

impl PowerOfTwoPicker {
    pub fn new(rng: PolicyRng) -> Self {
        PowerOfTwoPicker { rng }
    }
}

impl WorkerPicker for PowerOfTwoPicker {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD
    }

    #[inline(never)]
    fn pick(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        let n = input.len();
        if n == 0 {
            return Err(SelectionErrorKind::NoCandidates.into());
        }
        if n == 1 {
            return Ok(0);
        }
        let load = input
            .as_candidates()
            .load_columns()
            .ok_or_else(load_unavailable)?;
        let a = self.rng.below(n);
        let b = (a + 1 + self.rng.below(n - 1)) % n;
        let busy =
            |r: usize| f64::from(load.active_requests[r]) + f64::from(load.waiting_requests[r]);
        Ok(if busy(b) < busy(a) { b } else { a })
    }

    fn warm(&mut self, context: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) {
        super::pick_and_restore(self, |p| &mut p.rng, context, input);
    }
}

/// Cost = projected KV usage: used blocks plus what the queued requests
/// will need (as many blocks each as the worker's running requests hold on
/// average), over total blocks. A worker that has not reported its
/// capacity is unknown, not full: its usage is estimated from its requests
/// (running, queued and kvedge's own reservations, which the load columns
/// include) at the usage per request of the candidates that did report (0
/// per request when none did). An idle unknown worker thus costs 0 and gets
/// traffic until it reports, and a busy one is not mistaken for idle.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvUsageScorer;

/// `used` plus `waiting` requests of the average running one's size, over
/// `total`; `None` when the capacity is unknown.
fn projected_kv_usage(used: u32, total: u32, active: u32, waiting: u32) -> Option<f64> {
    if total == 0 {
        return None;
    }
    let per_request = f64::from(used) / f64::from(active.max(1));
    Some((f64::from(used) + f64::from(waiting) * per_request) / f64::from(total))
}

impl WorkerScorer for KvUsageScorer {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::OCCUPANCY | WorkerInputs::LOAD
    }

    fn score(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        let occ = candidates
            .occupancy_columns()
            .ok_or_else(|| WorkerSelectionPolicyError::failed("occupancy input unavailable"))?;
        let load = candidates.load_columns().ok_or_else(load_unavailable)?;
        let usage = |r: usize| {
            projected_kv_usage(
                occ.kv_used_blocks[r],
                occ.kv_total_blocks[r],
                load.active_requests[r],
                load.waiting_requests[r],
            )
        };
        let requests =
            |r: usize| f64::from(load.active_requests[r]) + f64::from(load.waiting_requests[r]);
        let (mut sum, mut known) = (0.0, 0usize);
        for r in 0..costs.len() {
            if let Some(u) = usage(r) {
                sum += u / requests(r).max(1.0);
                known += 1;
            }
        }
        let per_request = if known == 0 { 0.0 } else { sum / known as f64 };
        for (r, cost) in costs.iter_mut().enumerate() {
            *cost = usage(r).unwrap_or(per_request * requests(r));
        }
        Ok(())
    }
}

/// Two-tier cache-aware choice. Load is active plus waiting requests. When
/// the load is imbalanced (max - min > `balance_abs_threshold` and max >
/// `balance_rel_threshold` * min) the least-loaded worker wins. Otherwise the
/// worker with the most device overlap wins if that overlap covers at least
/// `cache_threshold` of the request's blocks, else the least-loaded one.
/// Ties: least loaded goes to more overlap, most overlap goes to less load.
#[derive(Clone, Debug)]
pub struct CacheAwarePicker {
    pub balance_abs_threshold: f64,
    pub balance_rel_threshold: f64,
    pub cache_threshold: f64,
}

impl WorkerPicker for CacheAwarePicker {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::CACHE | WorkerInputs::LOAD
    }

    #[inline(never)]
    fn pick(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        let c = input.as_candidates();
        let load = c.load_columns().ok_or_else(load_unavailable)?;
        let cache = c.cache_columns().ok_or_else(cache_unavailable)?;
        let n = input.len();
        if n == 0 {
            return Err(SelectionErrorKind::NoCandidates.into());
        }
        let busy =
            |r: usize| f64::from(load.active_requests[r]) + f64::from(load.waiting_requests[r]);
        let (mut least, mut most_cached) = (0, 0);
        let (mut min_load, mut max_load) = (f64::INFINITY, 0.0f64);
        for r in 0..n {
            let (l, d) = (busy(r), cache.device_blocks[r]);
            min_load = min_load.min(l);
            max_load = max_load.max(l);
            let (ll, ld) = (busy(least), cache.device_blocks[least]);
            if l < ll || (l == ll && d > ld) {
                least = r;
            }
            let (ml, md) = (busy(most_cached), cache.device_blocks[most_cached]);
            if d > md || (d == md && l < ml) {
                most_cached = r;
            }
        }
        let imbalanced = max_load - min_load > self.balance_abs_threshold
            && max_load > self.balance_rel_threshold * min_load;
        if imbalanced {
            return Ok(least);
        }
        let blocks = context.request_blocks();
        let match_rate = if blocks == 0 {
            0.0
        } else {
            f64::from(cache.device_blocks[most_cached]) / blocks as f64
        };
        Ok(if blocks > 0 && match_rate >= self.cache_threshold {
            most_cached
        } else {
            least
        })
    }

    fn warm(&mut self, context: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) {
        // Stateless: a pick changes nothing.
        let _ = self.pick(context, input);
    }
}

/// Overload-aware soft affinity: keeps the session's affinity target while
/// its requests (running plus queued) stay at or below
/// `max_active_requests`; otherwise (or without a target among the
/// candidates) the candidate with the fewest requests, running plus queued,
/// exact ties broken by the seeded RNG. A target without a rank matches its
/// least-loaded rank.
#[derive(Clone, Debug)]
pub struct SoftPinPicker {
    pub max_active_requests: u32,
    rng: PolicyRng,
    scratch: Vec<f64>,
}

impl SoftPinPicker {
    pub fn new(max_active_requests: u32, rng: PolicyRng) -> Self {
        SoftPinPicker {
            max_active_requests,
            rng,
            scratch: Vec::new(),
        }
    }
}

impl WorkerPicker for SoftPinPicker {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD
    }

    #[inline(never)]
    fn pick(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        let c = input.as_candidates();
        let load = c.load_columns().ok_or_else(load_unavailable)?;
        if input.is_empty() {
            return Err(SelectionErrorKind::NoCandidates.into());
        }
        let busy = |r: usize| load.active_requests[r].saturating_add(load.waiting_requests[r]);
        if let Some(target) = context.affinity_target() {
            let pinned = c
                .workers()
                .iter()
                .enumerate()
                .filter(|(_, w)| target.matches(**w))
                .min_by_key(|(r, _)| busy(*r));
            if let Some((row, _)) = pinned
                && busy(row) <= self.max_active_requests
            {
                return Ok(row);
            }
        }
        self.scratch.clear();
        self.scratch
            .extend((0..input.len()).map(|r| f64::from(busy(r))));
        Ok(argmin_random_ties(&self.scratch, &mut self.rng))
    }

    fn warm(&mut self, context: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) {
        super::pick_and_restore(self, |p| &mut p.rng, context, input);
    }
}
