//! `dynamo-default-cost-fn`: the default cost policy of seed 000.
//!
//! For each candidate, with `B` the block size, `R` the request's blocks
//! (prompt tokens / B, rounded up) and `P` its prompt tokens:
//!
//! ```text
//! raw_prefill_blocks  = (active_prefill_tokens + P) / B          (0 when prefill is not tracked)
//! decay               = 1 / (1 + overlap_score_credit_decay * excess)
//!   excess            = (active_prefill_tokens - min over candidates) / B / R
//! credit_blocks       = overlap_score_credit * decay * device_overlap
//!                     + host_cache_hit_weight * host_overlap
//!                     + disk_cache_hit_weight * disk_overlap
//!                     + shared_cache_multiplier * shared_beyond
//! decode_blocks       = active_decode_blocks + R
//! cost                = prefill_load_scale * max(raw_prefill_blocks - credit_blocks, 0)
//!                     + decode_blocks
//!                     + decode_active_request_weight * active_requests
//! ```
//!
//! A decode pool that does not track prefill but keeps a positive overlap
//! credit scores `max(decode_blocks - credit_blocks, 0) + request term`
//! instead (cache-hot decode workers win, backlog still counts). A preferred
//! taint multiplier, when present, multiplies the cost.
//!
//! The picker takes the lowest cost at temperature 0, breaking exact ties
//! with the instance's seeded RNG. At temperature `T > 0` it samples row `i`
//! with probability proportional to `exp(-(cost_i - min) / ((max - min) * T))`
//! (uniform when all costs are equal): costs are normalised by their range,
//! so `T` means the same thing whatever the cost scale.

use serde::Deserialize;

use crate::config::{RouterConfig, check_non_negative};
use crate::context::{InputTrigger, RoutingPartition, WorkerSelectionContext, WorkerType};
use crate::error::{WorkerSelectionPolicyError, WorkerSelectionPolicyProviderError};
use crate::inputs::WorkerInputs;
use crate::policy::{WorkerPicker, WorkerScorer, WorkerSelectionPolicy};
use crate::rng::PolicyRng;
use crate::view::{WorkerCandidates, WorkerInputView};

/// Parameters as written in YAML; omitted ones inherit [`RouterConfig`].
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DefaultCostParameters {
    pub overlap_score_credit: Option<f64>,
    pub overlap_score_credit_decay: Option<f64>,
    pub prefill_load_scale: Option<f64>,
    pub router_temperature: Option<f64>,
    pub decode_active_request_weight: Option<f64>,
    pub host_cache_hit_weight: Option<f64>,
    pub disk_cache_hit_weight: Option<f64>,
    pub shared_cache_multiplier: Option<f64>,
    /// Seed of the sampling RNG (mixed with the partition); inherits the
    /// router seed.
    pub seed: Option<u64>,
}

impl DefaultCostParameters {
    pub fn validate(&self) -> Result<(), WorkerSelectionPolicyProviderError> {
        let fields = [
            ("overlap_score_credit", self.overlap_score_credit),
            (
                "overlap_score_credit_decay",
                self.overlap_score_credit_decay,
            ),
            ("prefill_load_scale", self.prefill_load_scale),
            ("router_temperature", self.router_temperature),
            (
                "decode_active_request_weight",
                self.decode_active_request_weight,
            ),
            ("host_cache_hit_weight", self.host_cache_hit_weight),
            ("disk_cache_hit_weight", self.disk_cache_hit_weight),
            ("shared_cache_multiplier", self.shared_cache_multiplier),
        ];
        for (name, value) in fields {
            if let Some(v) = value {
                check_non_negative(name, v).map_err(WorkerSelectionPolicyProviderError::new)?;
            }
        }
        Ok(())
    }

    /// Fills omitted parameters from the router configuration.
    pub fn resolve(&self, config: &RouterConfig) -> DefaultCostWeights {
        DefaultCostWeights {
            overlap_score_credit: self
                .overlap_score_credit
                .unwrap_or(config.overlap_score_credit),
            overlap_score_credit_decay: self
                .overlap_score_credit_decay
                .unwrap_or(config.overlap_score_credit_decay),
            prefill_load_scale: self.prefill_load_scale.unwrap_or(config.prefill_load_scale),
            router_temperature: self.router_temperature.unwrap_or(config.router_temperature),
            decode_active_request_weight: self
                .decode_active_request_weight
                .unwrap_or(config.decode_active_request_weight),
            host_cache_hit_weight: self
                .host_cache_hit_weight
                .unwrap_or(config.host_cache_hit_weight),
            disk_cache_hit_weight: self
                .disk_cache_hit_weight
                .unwrap_or(config.disk_cache_hit_weight),
            shared_cache_multiplier: self
                .shared_cache_multiplier
                .unwrap_or_else(|| config.effective_shared_cache_multiplier()),
            track_prefill_tokens: config.track_prefill_tokens,
            seed: self.seed.unwrap_or(config.seed),
        }
    }
}

/// Resolved weights of one instance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DefaultCostWeights {
    pub overlap_score_credit: f64,
    pub overlap_score_credit_decay: f64,
    pub prefill_load_scale: f64,
    pub router_temperature: f64,
    pub decode_active_request_weight: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub shared_cache_multiplier: f64,
    pub track_prefill_tokens: bool,
    pub seed: u64,
}

/// The cost formula of the module docs, as a scorer.
#[derive(Clone, Debug)]
pub struct DefaultCostScorer {
    w: DefaultCostWeights,
    decode_path: bool,
    uses_cache: bool,
}

impl DefaultCostScorer {
    pub fn new(weights: DefaultCostWeights, worker_type: WorkerType) -> Self {
        let w = weights;
        let decode_path = worker_type == WorkerType::Decode
            && !w.track_prefill_tokens
            && w.overlap_score_credit > 0.0;
        let any_credit = w.overlap_score_credit > 0.0
            || w.host_cache_hit_weight > 0.0
            || w.disk_cache_hit_weight > 0.0
            || w.shared_cache_multiplier > 0.0;
        // Without tracked prefill the prefill term is zero whatever the
        // overlap, so the cache lookup would be wasted (plain disaggregated
        // decode); likewise when every credit is zero.
        let uses_cache = any_credit && (w.track_prefill_tokens || decode_path);
        DefaultCostScorer {
            w,
            decode_path,
            uses_cache,
        }
    }
}

impl WorkerScorer for DefaultCostScorer {
    fn required_worker_inputs(&self) -> WorkerInputs {
        let base = WorkerInputs::LOAD | WorkerInputs::PREFERRED_TAINT;
        if self.uses_cache {
            base | WorkerInputs::CACHE
        } else {
            base
        }
    }

    fn score(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        let w = &self.w;
        let load = candidates
            .load_columns()
            .ok_or(WorkerSelectionPolicyError::Failed(
                "load input unavailable".into(),
            ))?;
        let block_size = f64::from(context.block_size());
        let request_blocks = context.request_blocks() as f64;
        let prompt_tokens = f64::from(context.prompt_tokens());
        let track = w.track_prefill_tokens;
        let decay_on = track && w.overlap_score_credit_decay > 0.0;
        let min_prefill = if decay_on {
            load.active_prefill_tokens
                .iter()
                .copied()
                .min()
                .unwrap_or(0)
        } else {
            0
        };
        let decay_scale = w.overlap_score_credit_decay / block_size / request_blocks.max(1.0);

        let n = costs.len();
        let prefill = &load.active_prefill_tokens[..n];
        let decode = &load.active_decode_blocks[..n];
        let active = &load.active_requests[..n];
        let raw_prefill_blocks = |i: usize| {
            if track {
                (prefill[i] as f64 + prompt_tokens) / block_size
            } else {
                0.0
            }
        };
        let load_terms = |i: usize| {
            let decode_blocks = decode[i] as f64 + request_blocks;
            let request_cost = w.decode_active_request_weight * f64::from(active[i]);
            (decode_blocks, request_cost)
        };
        if self.uses_cache {
            let cache = candidates
                .cache_columns()
                .ok_or(WorkerSelectionPolicyError::Failed(
                    "cache input unavailable".into(),
                ))?;
            let device = &cache.device_blocks[..n];
            let host = &cache.host_blocks[..n];
            let disk = &cache.disk_blocks[..n];
            let shared = &cache.shared_beyond_blocks[..n];
            for (i, cost) in costs.iter_mut().enumerate() {
                let decay = if decay_on {
                    1.0 / (1.0 + decay_scale * prefill[i].saturating_sub(min_prefill) as f64)
                } else {
                    1.0
                };
                let credit = w.overlap_score_credit * decay * f64::from(device[i])
                    + w.host_cache_hit_weight * f64::from(host[i])
                    + w.disk_cache_hit_weight * f64::from(disk[i])
                    + w.shared_cache_multiplier * f64::from(shared[i]);
                let (decode_blocks, request_cost) = load_terms(i);
                *cost = if self.decode_path {
                    (decode_blocks - credit).max(0.0) + request_cost
                } else {
                    w.prefill_load_scale * (raw_prefill_blocks(i) - credit).max(0.0)
                        + decode_blocks
                        + request_cost
                };
            }
        } else {
            // No credit: the prefill term is the raw backlog.
            for (i, cost) in costs.iter_mut().enumerate() {
                let (decode_blocks, request_cost) = load_terms(i);
                *cost = w.prefill_load_scale * raw_prefill_blocks(i) + decode_blocks + request_cost;
            }
        }
        if let Some(taint) = candidates.preferred_taint_column() {
            for (c, &t) in costs.iter_mut().zip(&taint[..n]) {
                if !t.is_nan() {
                    *c *= t;
                }
            }
        }
        Ok(())
    }
}

/// Lowest cost with seeded tie-breaking, or softmax sampling.
#[derive(Clone, Debug)]
pub struct DefaultPicker {
    temperature: f64,
    rng: PolicyRng,
    weights: Vec<f64>,
}

impl DefaultPicker {
    pub fn new(temperature: f64, rng: PolicyRng) -> Self {
        DefaultPicker {
            temperature,
            rng,
            weights: Vec::new(),
        }
    }
}

impl WorkerPicker for DefaultPicker {
    fn pick(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        let costs = input.costs();
        if costs.is_empty() {
            return Err(WorkerSelectionPolicyError::NoCandidates);
        }
        if self.temperature == 0.0 {
            Ok(argmin_random_ties(costs, &mut self.rng))
        } else {
            Ok(softmax_sample(
                costs,
                self.temperature,
                &mut self.rng,
                &mut self.weights,
            ))
        }
    }
}

/// The first-seen minimum, replaced by a later equal one with probability
/// 1/k for the k-th tie (uniform over ties, one RNG draw per tie only).
pub(crate) fn argmin_random_ties(costs: &[f64], rng: &mut PolicyRng) -> usize {
    let mut best = 0;
    let mut best_cost = f64::INFINITY;
    let mut ties = 0usize;
    for (row, &c) in costs.iter().enumerate() {
        if c < best_cost {
            best = row;
            best_cost = c;
            ties = 1;
        } else if c == best_cost {
            ties += 1;
            if rng.below(ties) == 0 {
                best = row;
            }
        }
    }
    best
}

/// Samples a row with probability ∝ exp(-(c - min) / (range * T)).
pub(crate) fn softmax_sample(
    costs: &[f64],
    temperature: f64,
    rng: &mut PolicyRng,
    weights: &mut Vec<f64>,
) -> usize {
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    for &c in costs {
        min = min.min(c);
        max = max.max(c);
    }
    if min == max {
        return rng.below(costs.len());
    }
    // Costs are finite, but their range may not be: normalise by magnitude.
    let range = max - min;
    let magnitude = if range.is_finite() {
        1.0
    } else {
        min.abs().max(max.abs())
    };
    let lo = min / magnitude;
    let scale = -1.0 / ((max / magnitude - lo) * temperature);
    weights.clear();
    weights.extend(
        costs
            .iter()
            .map(|&c| exp_non_positive((c / magnitude - lo) * scale)),
    );
    let sum: f64 = weights.iter().sum();
    let target = rng.unit() * sum;
    let mut cumulative = 0.0;
    for (row, &w) in weights.iter().enumerate() {
        cumulative += w;
        if target < cumulative {
            return row;
        }
    }
    // Rounding left the target at the very top: the last row with weight.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
}

/// `e^x` for `x <= 0` (and NaN-free input), relative error below 1e-9 down
/// to x = -708 and an absolute error below 3e-308 beyond. `f64::exp` costs a
/// libm call per candidate; this is a branch-free polynomial the compiler
/// vectorises, and softmax weights never need more.
#[inline]
pub(crate) fn exp_non_positive(x: f64) -> f64 {
    const LOG2_E: f64 = std::f64::consts::LOG2_E;
    const LN_2: f64 = std::f64::consts::LN_2;
    // 2^y with y clamped where 2^n stays a normal number.
    let y = (x * LOG2_E).clamp(-1022.0, 0.0);
    let n = (y + 0.5).floor();
    let t = (y - n) * LN_2; // |t| <= ln2 / 2
    // Taylor series of e^t to degree 9: truncation below 2e-11 relative.
    let p = 1.0
        + t * (1.0
            + t * (1.0 / 2.0
                + t * (1.0 / 6.0
                    + t * (1.0 / 24.0
                        + t * (1.0 / 120.0
                            + t * (1.0 / 720.0
                                + t * (1.0 / 5040.0
                                    + t * (1.0 / 40320.0 + t * (1.0 / 362880.0)))))))));
    let bits = ((n as i64 + 1023) as u64) << 52;
    p * f64::from_bits(bits)
}

/// Builds the default policy for a partition.
pub fn default_cost_policy(
    config: &RouterConfig,
    parameters: &DefaultCostParameters,
    partition: &RoutingPartition,
) -> WorkerSelectionPolicy {
    let w = parameters.resolve(config);
    let rng = PolicyRng::for_partition(w.seed, partition);
    WorkerSelectionPolicy::new(
        config.clone(),
        partition.worker_type.as_str(),
        vec![Box::new(DefaultCostScorer::new(w, partition.worker_type))],
        Box::new(DefaultPicker::new(w.router_temperature, rng)),
    )
}

/// Sends tool-result turns to the candidate with the most device overlap
/// (a tool result extends a prompt the engine just served); every other turn
/// goes to the inner default picker.
#[derive(Clone, Debug)]
pub struct ToolResultCacheLocalPicker {
    inner: DefaultPicker,
}

impl ToolResultCacheLocalPicker {
    pub fn new(inner: DefaultPicker) -> Self {
        ToolResultCacheLocalPicker { inner }
    }
}

impl WorkerPicker for ToolResultCacheLocalPicker {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::CACHE
    }

    fn pick(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        let tool_turn = context
            .session_context()
            .is_some_and(|s| s.input_trigger() == InputTrigger::ToolResult);
        if !tool_turn {
            return self.inner.pick(context, input);
        }
        let cache =
            input
                .as_candidates()
                .cache_columns()
                .ok_or(WorkerSelectionPolicyError::Failed(
                    "cache input unavailable".into(),
                ))?;
        let costs = input.costs();
        // Most device overlap; among equals, lowest cost; then first row.
        let mut best = 0;
        for row in 1..costs.len() {
            let (d, bd) = (cache.device_blocks[row], cache.device_blocks[best]);
            if d > bd || (d == bd && costs[row] < costs[best]) {
                best = row;
            }
        }
        Ok(best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_libm() {
        let mut x = 0.0f64;
        while x > -708.0 {
            let (fast, exact) = (exp_non_positive(x), x.exp());
            assert!(
                ((fast - exact) / exact).abs() < 1e-9,
                "x={x}: {fast} vs {exact}"
            );
            x -= 0.0137;
        }
        for x in [-708.5, -745.0, -1e6, f64::NEG_INFINITY] {
            assert!(exp_non_positive(x) < 3e-308, "x={x}");
        }
        assert_eq!(exp_non_positive(0.0), 1.0);
    }
}
