//! `dynamo-default-cost-fn`: the default cost policy (Dynamo's, ported).
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
//! so `T` means the same thing whatever the cost scale. Sampling is exact:
//! by rejection (a uniform row kept with probability equal to its weight)
//! for a few tries, then by a full pass over the weights.

use serde::Deserialize;

use crate::config::{RouterConfig, check_non_negative};
use crate::context::{InputTrigger, RoutingPartition, WorkerSelectionContext, WorkerType};
use crate::error::{
    SelectionErrorKind, WorkerSelectionPolicyError, WorkerSelectionPolicyProviderError,
};
use crate::inputs::WorkerInputs;
use crate::policy::{WorkerPicker, WorkerScorer, WorkerSelectionPolicy};
use crate::rng::PolicyRng;
use crate::table::count;
use crate::view::{LoadColumns, WorkerCandidates, WorkerInputView};

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
    /// The weights are the shipped ones' identities and decay is off, so
    /// device overlap alone takes [`fill_unit`].
    unit_path: bool,
    /// A block size and its reciprocal: the block size rarely changes
    /// between requests, and a division costs more than the rest of a
    /// small table's scoring.
    inv_block: (u32, f64),
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
        // Prefill tracked and a credit of one also mean the cache is used
        // and this is not the decode path.
        let unit_path = w.track_prefill_tokens
            && w.prefill_load_scale == 1.0
            && w.overlap_score_credit == 1.0
            && w.decode_active_request_weight == 0.0
            && w.overlap_score_credit_decay == 0.0;
        DefaultCostScorer {
            w,
            decode_path,
            uses_cache,
            unit_path,
            inv_block: (1, 1.0),
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
        let load = candidates
            .load_columns()
            .ok_or_else(|| WorkerSelectionPolicyError::failed("load input unavailable"))?;
        let n = costs.len();
        if self.inv_block.0 != context.block_size() {
            self.inv_block = (context.block_size(), 1.0 / f64::from(context.block_size()));
        }
        let req = PerRequest {
            inv_block: self.inv_block.1,
            prompt_tokens: f64::from(context.prompt_tokens()),
            // At most the prompt's tokens, so within `i64` (and its
            // conversion is one instruction; `u64`'s is a sequence).
            request_blocks: context.request_blocks() as i64 as f64,
        };
        let taint = candidates.preferred_taint_column().map(|t| &t[..n]);
        if self.unit_path && !candidates.has_lower_tier_overlap() {
            // The shipped weights over device overlap alone, the common
            // case, without the general set-up.
            let c = candidates
                .cache_columns()
                .ok_or_else(|| WorkerSelectionPolicyError::failed("cache input unavailable"))?;
            fill_unit(
                &req,
                load.active_prefill_tokens,
                load.active_decode_blocks,
                c.device_blocks,
                costs,
            );
        } else {
            self.fill_general(context, candidates, &req, &load, costs)?;
        }
        if let Some(taint) = taint
            && candidates.has_taint_multipliers()
        {
            for (cost, &m) in costs.iter_mut().zip(taint) {
                *cost = if m.is_nan() { *cost } else { *cost * m };
            }
        }
        Ok(())
    }
}

impl DefaultCostScorer {
    /// Every shape but [`fill_unit`]'s: one branch-free loop per shape,
    /// chosen once per call. Not inlined, so that the unit path's caller
    /// keeps a small frame.
    #[inline(never)]
    fn fill_general(
        &self,
        context: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        req: &PerRequest,
        load: &LoadColumns<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        let w = &self.w;
        let n = costs.len();
        let prefill = &load.active_prefill_tokens[..n];
        // Without cache input (all credits zero, or plain disaggregated
        // decode) the credit columns read as zeros.
        let (device, host, disk, shared) = if self.uses_cache {
            let c = candidates
                .cache_columns()
                .ok_or_else(|| WorkerSelectionPolicyError::failed("cache input unavailable"))?;
            (
                c.device_blocks,
                c.host_blocks,
                c.disk_blocks,
                c.shared_beyond_blocks,
            )
        } else {
            (&[][..], &[][..], &[][..], &[][..])
        };
        let decay_on = w.track_prefill_tokens && w.overlap_score_credit_decay > 0.0;
        let min_prefill = if decay_on {
            f64::from(prefill.iter().copied().min().unwrap_or(0))
        } else {
            0.0
        };
        let terms = Terms {
            w: *w,
            track: if w.track_prefill_tokens { 1.0 } else { 0.0 },
            req: *req,
            decay_scale: if decay_on {
                w.overlap_score_credit_decay
                    / f64::from(context.block_size())
                    / req.request_blocks.max(1.0)
            } else {
                0.0
            },
            min_prefill,
        };
        let cols = Columns {
            prefill,
            decode: load.active_decode_blocks,
            active: load.active_requests,
            device,
            host,
            disk,
            shared,
        };
        let lower = candidates.has_lower_tier_overlap();
        match (self.uses_cache, lower, decay_on, self.decode_path) {
            (false, ..) => fill::<false, false, false, false>(&terms, &cols, costs),
            (true, false, false, false) => fill::<true, false, false, false>(&terms, &cols, costs),
            (true, false, false, true) => fill::<true, false, false, true>(&terms, &cols, costs),
            (true, false, true, false) => fill::<true, false, true, false>(&terms, &cols, costs),
            (true, false, true, true) => fill::<true, false, true, true>(&terms, &cols, costs),
            (true, true, false, false) => fill::<true, true, false, false>(&terms, &cols, costs),
            (true, true, false, true) => fill::<true, true, false, true>(&terms, &cols, costs),
            (true, true, true, false) => fill::<true, true, true, false>(&terms, &cols, costs),
            (true, true, true, true) => fill::<true, true, true, true>(&terms, &cols, costs),
        }
        Ok(())
    }
}

/// The request's constants every loop uses.
#[derive(Clone, Copy)]
struct PerRequest {
    inv_block: f64,
    prompt_tokens: f64,
    request_blocks: f64,
}

/// Per-call constants of the cost formula.
struct Terms {
    w: DefaultCostWeights,
    track: f64,
    req: PerRequest,
    decay_scale: f64,
    min_prefill: f64,
}

/// The input columns, each exactly as long as the cost slice (or empty
/// when unused).
struct Columns<'a> {
    prefill: &'a [u32],
    decode: &'a [u32],
    active: &'a [u32],
    device: &'a [u32],
    host: &'a [u32],
    disk: &'a [u32],
    shared: &'a [u32],
}

/// [`fill`] with the shipped weights (prefill tracked, `prefill_load_scale`
/// and `overlap_score_credit` 1, `decode_active_request_weight` 0), device
/// overlap only, no decay, the prefill path: it leaves out the
/// multiplications by one and the request term, which are exact
/// (`x * 1.0 == x`; the term is `+0.0` on a non-negative sum), so it gives
/// `fill::<true, false, false, false>`'s bits. The columns are separate
/// arguments, as in [`fill_loop`].
#[inline(always)]
fn fill_unit(u: &PerRequest, prefill: &[u32], decode: &[u32], device: &[u32], costs: &mut [f64]) {
    let n = costs.len();
    let (prefill, decode, device) = (&prefill[..n], &decode[..n], &device[..n]);
    for i in 0..n {
        let raw_prefill_blocks = (count(prefill[i]) + u.prompt_tokens) * u.inv_block;
        let decode_blocks = count(decode[i]) + u.request_blocks;
        costs[i] = (raw_prefill_blocks - count(device[i])).max(0.0) + decode_blocks;
    }
}

/// The cost formula over columns, one loop per shape.
#[inline(always)]
fn fill<const CACHE: bool, const LOWER: bool, const DECAY: bool, const DECODE: bool>(
    t: &Terms,
    c: &Columns<'_>,
    costs: &mut [f64],
) {
    fill_loop::<CACHE, LOWER, DECAY, DECODE>(
        t, c.prefill, c.decode, c.active, c.device, c.host, c.disk, c.shared, costs,
    );
}

/// [`fill`]'s loop. The columns are separate arguments so the compiler
/// knows the cost slice overlaps none of them (slices read out of a struct
/// do not tell it) and vectorises without a run-time overlap check; each is
/// cut to the cost slice's length once, so no row is bounds-checked.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn fill_loop<const CACHE: bool, const LOWER: bool, const DECAY: bool, const DECODE: bool>(
    t: &Terms,
    prefill: &[u32],
    decode: &[u32],
    active: &[u32],
    device: &[u32],
    host: &[u32],
    disk: &[u32],
    shared: &[u32],
    costs: &mut [f64],
) {
    let w = &t.w;
    let n = costs.len();
    let (prefill, decode, active) = (&prefill[..n], &decode[..n], &active[..n]);
    // The cache columns are empty when unused.
    let device = if CACHE { &device[..n] } else { device };
    let (host, disk, shared) = if LOWER {
        (&host[..n], &disk[..n], &shared[..n])
    } else {
        (host, disk, shared)
    };
    for i in 0..n {
        let prefill = count(prefill[i]);
        let raw_prefill_blocks = t.track * (prefill + t.req.prompt_tokens) * t.req.inv_block;
        let decode_blocks = count(decode[i]) + t.req.request_blocks;
        let request_cost = w.decode_active_request_weight * count(active[i]);
        let credit = if CACHE {
            let decay = if DECAY {
                1.0 / (1.0 + t.decay_scale * (prefill - t.min_prefill))
            } else {
                1.0
            };
            let device = w.overlap_score_credit * decay * count(device[i]);
            if LOWER {
                device
                    + w.host_cache_hit_weight * count(host[i])
                    + w.disk_cache_hit_weight * count(disk[i])
                    + w.shared_cache_multiplier * count(shared[i])
            } else {
                device
            }
        } else {
            0.0
        };
        costs[i] = if DECODE {
            (decode_blocks - credit).max(0.0) + request_cost
        } else {
            w.prefill_load_scale * (raw_prefill_blocks - credit).max(0.0)
                + decode_blocks
                + request_cost
        };
    }
}

/// Lowest cost with seeded tie-breaking, or softmax sampling.
#[derive(Clone, Debug)]
pub struct DefaultPicker {
    temperature: f64,
    rng: PolicyRng,
    scratch: SoftmaxScratch,
}

impl DefaultPicker {
    pub fn new(temperature: f64, rng: PolicyRng) -> Self {
        DefaultPicker {
            temperature,
            rng,
            scratch: SoftmaxScratch::default(),
        }
    }
}

impl WorkerPicker for DefaultPicker {
    #[inline(never)]
    fn pick(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        let costs = input.costs();
        if costs.is_empty() {
            return Err(SelectionErrorKind::NoCandidates.into());
        }
        let (min, max) = input.cost_range();
        if self.temperature == 0.0 {
            Ok(nth_minimum(costs, min, &mut self.rng))
        } else {
            Ok(softmax_sample(
                costs,
                (min, max),
                self.temperature,
                &mut self.rng,
                &mut self.scratch,
            ))
        }
    }

    fn warm(&mut self, context: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) {
        super::pick_and_restore(self, |p| &mut p.rng, context, input);
    }
}

/// The row of lowest cost; exact ties are broken uniformly by one draw of
/// the RNG (no draw without a tie). Costs must not be NaN.
pub(crate) fn argmin_random_ties(costs: &[f64], rng: &mut PolicyRng) -> usize {
    let (min, _) = crate::policy::finite_range(costs).unwrap_or((f64::NAN, f64::NAN));
    nth_minimum(costs, min, rng)
}

/// `1 << row` for each row a bit mask can hold.
const ROW_BITS: [u64; 64] = {
    let mut bits = [0u64; 64];
    let mut row = 0;
    while row < 64 {
        bits[row] = 1 << row;
        row += 1;
    }
    bits
};

/// The row of cost `min` (which must occur), ties broken by one draw.
#[inline(always)]
fn nth_minimum(costs: &[f64], min: f64, rng: &mut PolicyRng) -> usize {
    if costs.len() > 64 {
        // Long: a vectorised count of ties, then one early-exit search.
        let ties = costs.iter().filter(|&&c| c == min).count();
        let nth = if ties > 1 { rng.below(ties) } else { 0 };
        return costs
            .iter()
            .enumerate()
            .filter(|(_, c)| **c == min)
            .nth(nth)
            .map_or(0, |(row, _)| row);
    }
    // Short: the rows at the minimum as a bit mask, built without a branch:
    // each row's bit, kept where the row is at the minimum (a compare's
    // all-ones or zero), ORed together; this vectorises on baseline x86-64.
    // Then the first set bit, or the nth on a tie.
    let bits = &ROW_BITS[..costs.len()];
    let mut mask = 0u64;
    for (&c, &bit) in costs.iter().zip(bits) {
        mask |= bit & 0u64.wrapping_sub(u64::from(c == min));
    }
    if mask == 0 {
        return 0;
    }
    let ties = mask.count_ones() as usize;
    if ties > 1 {
        for _ in 0..rng.below(ties) {
            mask &= mask - 1;
        }
    }
    mask.trailing_zeros() as usize
}

/// Uniform draws tried before falling back to a full pass over the weights.
const REJECTION_TRIES: usize = 16;

/// Weights are summed in chunks of this many rows, so the sampled row is
/// found by walking chunk sums, then one chunk: both walks are serial
/// (each step waits for the previous subtraction), so both stay short.
const CHUNK: usize = 8;

/// Samples a row with probability ∝ exp(-(c - min) / (range * T)).
pub(crate) fn softmax_sample(
    costs: &[f64],
    (min, max): (f64, f64),
    temperature: f64,
    rng: &mut PolicyRng,
    scratch: &mut SoftmaxScratch,
) -> usize {
    if min == max {
        return rng.below(costs.len());
    }
    let range = max - min;
    let (offset, scale, inv_magnitude) = if range.is_finite() {
        (min, -1.0 / (range * temperature), 1.0)
    } else {
        // Finite costs whose range overflows: normalise by magnitude first.
        let magnitude = min.abs().max(max.abs());
        let lo = min / magnitude;
        (
            lo,
            -1.0 / ((max / magnitude - lo) * temperature),
            1.0 / magnitude,
        )
    };
    let weight = |c: f64| exp_non_positive((c * inv_magnitude - offset) * scale);
    // Rejection sampling first: draw a row uniformly and keep it with
    // probability equal to its weight (the lowest cost weighs exactly 1).
    // Exact, and O(1) expected when weights are not tiny: at temperature
    // 0.7 every weight is at least e^(-1/0.7) = 0.24, so a draw is kept
    // within ~4 tries. Only when every try is rejected (a very low
    // temperature) does the full pass below run; its result has the same
    // distribution, so the mixture is still exact.
    let n = costs.len();
    for _ in 0..REJECTION_TRIES / 4 {
        // Four tries at once, decided without a branch per try (acceptance
        // is a coin flip the branch predictor cannot learn): the first
        // accepted one wins, exactly as if they had run one after another.
        let mut rows = [0usize; 4];
        let mut thresholds = [0.0f64; 4];
        for k in 0..4 {
            // One 64-bit draw per try: the high half picks the row (bias
            // below n / 2^32), the low half is the acceptance threshold.
            let draw = rng.next_u64();
            rows[k] = (((draw >> 32) * n as u64) >> 32) as usize;
            thresholds[k] = (draw & 0xffff_ffff) as f64 * (1.0 / 4_294_967_296.0);
        }
        let mut accepted = 0u32;
        for k in 0..4 {
            let w = weight(costs[rows[k]]);
            accepted |= u32::from(thresholds[k] < w) << k;
        }
        if accepted != 0 {
            return rows[accepted.trailing_zeros() as usize];
        }
    }
    // Weights and their total in one pass, four independent partial sums.
    let weights = &mut scratch.weights;
    weights.clear();
    weights.resize(costs.len(), 0.0);
    let mut acc = [0.0f64; 4];
    let mut out = weights.chunks_exact_mut(4);
    let mut inp = costs.chunks_exact(4);
    for (w, c) in (&mut out).zip(&mut inp) {
        for k in 0..4 {
            let v = weight(c[k]);
            w[k] = v;
            acc[k] += v;
        }
    }
    let mut total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (w, &c) in out.into_remainder().iter_mut().zip(inp.remainder()) {
        *w = weight(c);
        total += *w;
    }
    let mut target = rng.unit() * total;
    // Find the row: skip whole chunks by their sums, then walk one chunk.
    for (j, chunk) in weights.chunks(CHUNK).enumerate() {
        let chunk_sum: f64 = chunk.iter().sum();
        if target < chunk_sum {
            for (k, &w) in chunk.iter().enumerate() {
                if target < w {
                    return j * CHUNK + k;
                }
                target -= w;
            }
            // Rounding: the chunk's last row with weight.
            return j * CHUNK + chunk.iter().rposition(|&w| w > 0.0).unwrap_or(0);
        }
        target -= chunk_sum;
    }
    // Rounding left the target at the very top: the last row with weight.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
}

/// Retained buffers of softmax sampling.
#[derive(Clone, Debug, Default)]
pub(crate) struct SoftmaxScratch {
    weights: Vec<f64>,
}

/// `e^x` for `x <= 0` (and NaN-free input), relative error below 5e-6 down
/// to x = -708 and an absolute error below 3e-308 beyond. `f64::exp` costs a
/// libm call per candidate; this is branch-free arithmetic the compiler
/// vectorises (rounding and the power of two come from the bits of
/// `y + 1.5 * 2^52`, since `floor` and float-to-int conversion do not
/// vectorise on baseline x86-64), and softmax weights never need more.
#[inline]
pub(crate) fn exp_non_positive(x: f64) -> f64 {
    const LOG2_E: f64 = std::f64::consts::LOG2_E;
    const LN_2: f64 = std::f64::consts::LN_2;
    const ROUND: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    // 2^y with y clamped where 2^n stays a normal number.
    let y = x * LOG2_E;
    // (Plain compares, not f64::max/min: those handle NaN and cost more.)
    let y = if y < -1022.0 { -1022.0 } else { y };
    let y = if y > 0.0 { 0.0 } else { y };
    let shifted = y + ROUND; // n = round(y) sits in the low mantissa bits
    let n = shifted - ROUND;
    let t = (y - n) * LN_2; // |t| <= ln2 / 2
    // Taylor series of e^t to degree 5 (truncation below 2.5e-6 relative:
    // sampling probabilities off by parts per million at most), evaluated
    // in Estrin's form for a short dependency chain.
    let t2 = t * t;
    let p = (1.0 + t) + t2 * (0.5 + t * (1.0 / 6.0)) + (t2 * t2) * (1.0 / 24.0 + t * (1.0 / 120.0));
    // Exponent field n + 1023: the low 12 bits of (bits + 1023), moved up.
    let two_n = f64::from_bits(shifted.to_bits().wrapping_add(1023) << 52);
    p * two_n
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
    .first_scorer_writes_all()
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

    #[inline(never)]
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
        let cache = input
            .as_candidates()
            .cache_columns()
            .ok_or_else(|| WorkerSelectionPolicyError::failed("cache input unavailable"))?;
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

    fn warm(&mut self, context: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) {
        super::pick_and_restore(self, |p| &mut p.inner.rng, context, input);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::{CacheRow, CandidateRow, CandidateTable, LoadRow, WorkerWithDpRank};

    /// A table of `n` workers with every signal group; worker `i` has the
    /// cache row, load row and taint multiplier `row(i)` gives.
    fn table_of(n: u64, row: impl Fn(u64) -> (CacheRow, LoadRow, Option<f64>)) -> CandidateTable {
        let mut table = CandidateTable::new();
        table.reset(WorkerInputs::ALL);
        for i in 0..n {
            let (cache, load, taint) = row(i);
            table.push(CandidateRow {
                worker: WorkerWithDpRank::new(i, 0),
                cache,
                load,
                preferred_taint_multiplier: taint,
                ..CandidateRow::default()
            });
        }
        table
    }

    #[test]
    fn nth_minimum_picks_as_the_plain_definition_does_with_the_same_draws() {
        // The definition: the rows at the minimum in order, the only one
        // without a draw, else the one a single `below(ties)` names.
        fn plain(costs: &[f64], min: f64, rng: &mut PolicyRng) -> usize {
            let rows: Vec<usize> = (0..costs.len()).filter(|&i| costs[i] == min).collect();
            match rows.len() {
                0 => 0,
                1 => rows[0],
                n => rows[rng.below(n)],
            }
        }
        let mut values = PolicyRng::seed_from_u64(11);
        for round in 0..2000 {
            // Lengths around the chunk and the short/long boundary, few
            // distinct values so that ties are common.
            let n = 1 + round % 70;
            let costs: Vec<f64> = (0..n).map(|_| (values.below(4) as f64) * 0.5).collect();
            let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
            let (mut a, mut b) = (
                PolicyRng::seed_from_u64(round as u64),
                PolicyRng::seed_from_u64(round as u64),
            );
            assert_eq!(
                nth_minimum(&costs, min, &mut a),
                plain(&costs, min, &mut b),
                "round {round}: {costs:?}"
            );
            assert_eq!(a.next_u64(), b.next_u64(), "round {round}: draws differ");
        }
    }

    #[test]
    fn the_unit_weight_loop_gives_the_general_loops_bits() {
        let w = DefaultCostParameters::default().resolve(&RouterConfig::default());
        let scorer = DefaultCostScorer::new(w, WorkerType::Prefill);
        assert!(scorer.unit_path, "the shipped weights take the unit loop");
        let mut rng = PolicyRng::seed_from_u64(3);
        // Counts from 0 to the table's 2^31 - 1 ceiling, small ones often
        // (where the max(.., 0) clamp and ties happen).
        let draw = |rng: &mut PolicyRng| {
            let v = rng.next_u64();
            (if v & 1 == 0 {
                v >> 60
            } else {
                (v >> 33) & 0x7fff_ffff
            }) as u32
        };
        for round in 0..200 {
            let n = 1 + round % 37;
            let col = |rng: &mut PolicyRng| (0..n).map(|_| draw(rng)).collect::<Vec<u32>>();
            let (prefill, decode, active, device) =
                (col(&mut rng), col(&mut rng), col(&mut rng), col(&mut rng));
            let prompt_tokens = f64::from(draw(&mut rng) % 100_000);
            let block_size = f64::from(1 + draw(&mut rng) % 64);
            let terms = Terms {
                w,
                track: 1.0,
                req: PerRequest {
                    inv_block: 1.0 / block_size,
                    prompt_tokens,
                    request_blocks: (prompt_tokens / block_size).ceil(),
                },
                decay_scale: 0.0,
                min_prefill: 0.0,
            };
            let cols = Columns {
                prefill: &prefill,
                decode: &decode,
                active: &active,
                device: &device,
                host: &[],
                disk: &[],
                shared: &[],
            };
            let (mut general, mut unit) = (vec![f64::NAN; n], vec![f64::NAN; n]);
            fill::<true, false, false, false>(&terms, &cols, &mut general);
            fill_unit(&terms.req, &prefill, &decode, &device, &mut unit);
            let bits = |v: &[f64]| v.iter().map(|c| c.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&general), bits(&unit), "round {round}");
        }
        // Any other weight keeps the general loop.
        for config in [
            RouterConfig {
                prefill_load_scale: 2.0,
                ..RouterConfig::default()
            },
            RouterConfig {
                overlap_score_credit: 0.5,
                ..RouterConfig::default()
            },
            RouterConfig {
                decode_active_request_weight: 1.0,
                ..RouterConfig::default()
            },
            RouterConfig {
                track_prefill_tokens: false,
                ..RouterConfig::default()
            },
            RouterConfig {
                overlap_score_credit_decay: 0.5,
                ..RouterConfig::default()
            },
        ] {
            let w = DefaultCostParameters::default().resolve(&config);
            assert!(!DefaultCostScorer::new(w, WorkerType::Prefill).unit_path);
        }
    }

    #[test]
    fn a_scorer_kept_across_block_sizes_scores_as_a_fresh_one() {
        let table = table_of(11, |i| {
            let cache = CacheRow {
                device_blocks: (i * 5 % 13) as u32,
                ..CacheRow::default()
            };
            let load = LoadRow {
                active_requests: (i % 3) as u32,
                waiting_requests: 0,
                active_prefill_tokens: i * 37,
                active_decode_blocks: i * 11 % 7,
            };
            (cache, load, None)
        });
        // The shipped weights, and the general loop with decay on.
        for config in [
            RouterConfig::default(),
            RouterConfig {
                overlap_score_credit_decay: 0.5,
                prefill_load_scale: 1.5,
                ..RouterConfig::default()
            },
        ] {
            let w = DefaultCostParameters::default().resolve(&config);
            let mut kept = DefaultCostScorer::new(w, WorkerType::Prefill);
            let grant = kept.required_worker_inputs();
            for block_size in [16, 7, 16, 1, 64, 64, 7, 3] {
                let ctx = WorkerSelectionContext::new("r", 1000, block_size);
                let score = |scorer: &mut DefaultCostScorer| {
                    let mut costs = vec![f64::NAN; table.len()];
                    scorer
                        .score(&ctx, WorkerCandidates::new(&table, grant), &mut costs)
                        .unwrap();
                    costs.iter().map(|c| c.to_bits()).collect::<Vec<_>>()
                };
                let fresh = score(&mut DefaultCostScorer::new(w, WorkerType::Prefill));
                assert_eq!(score(&mut kept), fresh, "block size {block_size}");
                // Against the formula with the division written out.
                let b = f64::from(block_size);
                let expected = (0..table.len())
                    .map(|i| {
                        let prefill = (i as f64 * 37.0 + 1000.0) / b;
                        let device = ((i * 5) % 13) as f64;
                        let decode = ((i * 11) % 7) as f64 + (1000.0 / b).ceil();
                        let excess = (i as f64 * 37.0) / b / (1000.0 / b).ceil();
                        let decay = 1.0 / (1.0 + w.overlap_score_credit_decay * excess);
                        w.prefill_load_scale * (prefill - decay * device).max(0.0) + decode
                    })
                    .collect::<Vec<_>>();
                let got = score(&mut kept);
                for (row, (&g, e)) in got.iter().zip(&expected).enumerate() {
                    let g = f64::from_bits(g);
                    assert!(
                        (g - e).abs() <= 1e-9 * e.abs().max(1.0),
                        "block size {block_size}, row {row}: {g} against {e}"
                    );
                }
            }
        }
    }

    /// The executor skips the NaN pre-fill for this scorer (it is marked
    /// `first_scorer_writes_all`), so every loop must write every row.
    #[test]
    fn every_cost_loop_writes_every_row() {
        let configs = [
            // The unit loop.
            RouterConfig::default(),
            // No credit at all: no cache columns.
            RouterConfig {
                overlap_score_credit: 0.0,
                host_cache_hit_weight: 0.0,
                disk_cache_hit_weight: 0.0,
                shared_cache_multiplier: Some(0.0),
                ..RouterConfig::default()
            },
            // The general prefill loop, with and without decay.
            RouterConfig {
                prefill_load_scale: 2.0,
                ..RouterConfig::default()
            },
            RouterConfig {
                overlap_score_credit_decay: 1.0,
                ..RouterConfig::default()
            },
            // Untracked prefill: the decode path for decode workers.
            RouterConfig {
                track_prefill_tokens: false,
                ..RouterConfig::default()
            },
        ];
        for config in configs {
            let w = DefaultCostParameters::default().resolve(&config);
            for worker_type in [WorkerType::Prefill, WorkerType::Decode] {
                // Without and with lower tiers, without and with taints.
                for (lower, taint) in [(false, false), (true, false), (false, true), (true, true)] {
                    for n in 1..=19u64 {
                        let table = table_of(n, |i| {
                            let cache = CacheRow {
                                device_blocks: (i % 5) as u32,
                                host_blocks: u32::from(lower) * (i % 3) as u32,
                                ..CacheRow::default()
                            };
                            let load = LoadRow {
                                active_requests: (i % 4) as u32,
                                waiting_requests: 0,
                                active_prefill_tokens: i * 100,
                                active_decode_blocks: i % 9,
                            };
                            (cache, load, taint.then_some(0.5))
                        });
                        let mut scorer = DefaultCostScorer::new(w, worker_type);
                        let grant = scorer.required_worker_inputs();
                        let ctx = WorkerSelectionContext::new("r", 300, 16);
                        let mut costs = vec![f64::NAN; n as usize];
                        scorer
                            .score(&ctx, WorkerCandidates::new(&table, grant), &mut costs)
                            .unwrap();
                        assert!(
                            costs.iter().all(|c| c.is_finite()),
                            "{config:?} {worker_type:?} lower={lower} taint={taint} n={n}: {costs:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn fast_exp_matches_libm() {
        let mut x = 0.0f64;
        while x > -708.0 {
            let (fast, exact) = (exp_non_positive(x), x.exp());
            assert!(
                ((fast - exact) / exact).abs() < 5e-6,
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
