//! The shipped policy types, each registered under a stable type name with
//! parameters validated once at startup (finite and non-negative where
//! numeric, unknown fields rejected).
//!
//! | type | components |
//! |---|---|
//! | `dynamo-default-cost-fn` | default cost scorer + argmin/softmax picker |
//! | `least-busy` | min-device-overlap filter + requests (running plus queued) scorer + lowest-cost picker |
//! | `round-robin` | next worker in identity order |
//! | `random` | uniform, seeded |
//! | `power-of-two` | two random candidates, fewer requests wins |
//! | `least-kv-usage` | projected KV usage scorer (queue counted, unknown capacity estimated) + lowest cost (seeded ties) |
//! | `cache-aware` | least loaded when imbalanced, else best overlap above a threshold |
//! | `soft-pin` | keep the soft-affinity target until overloaded |
//! | `tool-result-cache-local` | default cost, but tool-result turns go to the most device overlap |
//! | `predicted-ttft` | the host's predicted time to first token plus a price on the request's own prefill (`recompute_weight`) + lowest cost (seeded ties); the built-in for aggregated and prefill workers |
//! | `prefill-times-requests` | ((1 + `recompute_weight`) × uncached prompt tokens + queued prefill tokens) × (requests + 1) + lowest cost (seeded ties) |

pub mod default_cost;
pub mod predicted_ttft;
pub mod prefill_times_requests;
pub mod simple;

use std::sync::Arc;

use serde::Deserialize;

use crate::config::check_non_negative;
use crate::error::{WorkerSelectionPolicyProviderError, WorkerSelectionPolicyRegistryError};
use crate::policy::{WorkerFilter, WorkerPicker, WorkerScorer, WorkerSelectionPolicy};
use crate::registry::{
    RouterPluginRegistry, WorkerSelectionPolicyFactory, WorkerSelectionPolicyParameters,
};
use crate::rng::PolicyRng;

use default_cost::{
    DefaultCostParameters, DefaultCostScorer, DefaultPicker, ToolResultCacheLocalPicker,
};
use simple::*;

/// A shipped picker's [`WorkerPicker::warm`]: `pick`, then the state it
/// may change (reached by `state`) put back as it was. The shipped pickers'
/// `pick` is not inlined, so this runs the machine code a select runs.
fn pick_and_restore<P: WorkerPicker, S: Clone>(
    picker: &mut P,
    state: impl Fn(&mut P) -> &mut S,
    context: &crate::context::WorkerSelectionContext<'_>,
    input: crate::view::WorkerInputView<'_>,
) {
    let saved = state(picker).clone();
    let _ = picker.pick(context, input);
    *state(picker) = saved;
}

/// Type name of the default cost policy.
pub const DEFAULT_COST_FN: &str = "dynamo-default-cost-fn";

/// Type name of the predicted-TTFT policy.
pub const PREDICTED_TTFT: &str = "predicted-ttft";

/// Type name of the prefill-times-requests policy.
pub const PREFILL_TIMES_REQUESTS: &str = "prefill-times-requests";

/// The type of the built-in policy (the `default` selection) for `role`:
/// `predicted-ttft` where the worker computes the prompt (aggregated and
/// prefill), so a request goes where its first token comes soonest, which
/// prices cache hits and queues in the same unit and balances only where
/// that pays; the default cost elsewhere (decode and encode workers do not
/// prefill the request's prompt).
pub fn builtin_type(role: crate::context::WorkerType) -> &'static str {
    use crate::context::WorkerType;
    match role {
        WorkerType::Aggregated | WorkerType::Prefill => PREDICTED_TTFT,
        WorkerType::Decode | WorkerType::Encode => DEFAULT_COST_FN,
    }
}

/// The built-in policy for `partition` (see [`builtin_type`]), seeded with
/// the router seed.
pub fn builtin_policy(
    config: &crate::config::RouterConfig,
    partition: &crate::context::RoutingPartition,
) -> WorkerSelectionPolicy {
    let policy = match builtin_type(partition.worker_type) {
        PREDICTED_TTFT => predicted_ttft_policy(
            config,
            partition.worker_type,
            partition,
            config.seed,
            predicted_ttft::PredictedTtftScorer::default(),
        ),
        _ => {
            default_cost::default_cost_policy(config, &DefaultCostParameters::default(), partition)
        }
    };
    policy.allow_side_passes()
}

/// Registers every shipped type.
pub fn register_builtins(
    registry: &mut RouterPluginRegistry,
) -> Result<(), WorkerSelectionPolicyRegistryError> {
    registry.register_worker_selection(DEFAULT_COST_FN, Arc::new(default_cost_provider))?;
    registry.register_worker_selection("least-busy", Arc::new(least_busy_provider))?;
    registry.register_worker_selection("round-robin", Arc::new(round_robin_provider))?;
    registry.register_worker_selection("random", Arc::new(random_provider))?;
    registry.register_request_classifier(
        crate::classifier::PROMPT_LIMIT,
        Arc::new(crate::classifier::prompt_limit_provider),
    )?;
    registry.register_worker_selection("power-of-two", Arc::new(power_of_two_provider))?;
    registry.register_worker_selection("least-kv-usage", Arc::new(least_kv_usage_provider))?;
    registry.register_worker_selection("cache-aware", Arc::new(cache_aware_provider))?;
    registry.register_worker_selection("soft-pin", Arc::new(soft_pin_provider))?;
    registry
        .register_worker_selection("tool-result-cache-local", Arc::new(tool_result_provider))?;
    registry.register_worker_selection(PREDICTED_TTFT, Arc::new(predicted_ttft_provider))?;
    registry.register_worker_selection(
        PREFILL_TIMES_REQUESTS,
        Arc::new(prefill_times_requests_provider),
    )?;
    Ok(())
}

type ProviderResult = Result<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError>;

fn non_negative(name: &str, value: f64) -> Result<(), WorkerSelectionPolicyProviderError> {
    check_non_negative(name, value).map_err(WorkerSelectionPolicyProviderError::new)
}

fn default_cost_provider(parameters: &WorkerSelectionPolicyParameters) -> ProviderResult {
    let p: DefaultCostParameters = parameters.deserialize()?;
    p.validate()?;
    Ok(Arc::new(move |config, _worker_type, partition| {
        default_cost::default_cost_policy(config, &p, partition)
    }))
}

fn tool_result_provider(parameters: &WorkerSelectionPolicyParameters) -> ProviderResult {
    let p: DefaultCostParameters = parameters.deserialize()?;
    p.validate()?;
    Ok(Arc::new(move |config, worker_type, partition| {
        let w = p.resolve(config);
        let rng = PolicyRng::for_partition(w.seed, partition);
        WorkerSelectionPolicy::new(
            config.clone(),
            worker_type.as_str(),
            vec![Box::new(DefaultCostScorer::new(w, worker_type))],
            Box::new(ToolResultCacheLocalPicker::new(DefaultPicker::new(
                w.router_temperature,
                rng,
            ))),
        )
        .first_scorer_writes_all()
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LeastBusyParameters {
    min_device_overlap_blocks: f64,
}

fn least_busy_provider(parameters: &WorkerSelectionPolicyParameters) -> ProviderResult {
    let p: LeastBusyParameters = parameters.deserialize()?;
    non_negative("min_device_overlap_blocks", p.min_device_overlap_blocks)?;
    let minimum_blocks = p.min_device_overlap_blocks;
    Ok(Arc::new(move |config, worker_type, _partition| {
        let filters: Vec<Box<dyn WorkerFilter>> =
            vec![Box::new(MinimumDeviceOverlapFilter { minimum_blocks })];
        let scorers: Vec<Box<dyn WorkerScorer>> = vec![Box::new(ActiveRequestsScorer)];
        WorkerSelectionPolicy::new_with_filters(
            config.clone(),
            worker_type.as_str(),
            filters,
            scorers,
            Box::new(LowestCostPicker),
        )
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParameters {}

fn round_robin_provider(parameters: &WorkerSelectionPolicyParameters) -> ProviderResult {
    let NoParameters {} = parameters.deserialize()?;
    Ok(Arc::new(|config, worker_type, _partition| {
        WorkerSelectionPolicy::new(
            config.clone(),
            worker_type.as_str(),
            Vec::new(),
            Box::new(RoundRobinPicker::default()),
        )
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SeedParameters {
    seed: Option<u64>,
}

/// The scorers and picker of a seeded policy.
type SeededParts = (Vec<Box<dyn WorkerScorer>>, Box<dyn WorkerPicker>);

/// A provider whose only parameter is the RNG seed and whose policy is
/// `scorers` + a picker built from the partition's RNG.
fn seeded(
    parameters: &WorkerSelectionPolicyParameters,
    build: fn(PolicyRng) -> SeededParts,
) -> ProviderResult {
    let p: SeedParameters = parameters.deserialize()?;
    Ok(Arc::new(move |config, worker_type, partition| {
        let rng = PolicyRng::for_partition(p.seed.unwrap_or(config.seed), partition);
        let (scorers, picker) = build(rng);
        WorkerSelectionPolicy::new(config.clone(), worker_type.as_str(), scorers, picker)
    }))
}

fn random_provider(parameters: &WorkerSelectionPolicyParameters) -> ProviderResult {
    seeded(parameters, |rng| {
        (Vec::new(), Box::new(RandomPicker::new(rng)))
    })
}

fn power_of_two_provider(parameters: &WorkerSelectionPolicyParameters) -> ProviderResult {
    seeded(parameters, |rng| {
        (Vec::new(), Box::new(PowerOfTwoPicker::new(rng)))
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PredictedTtftParameters {
    seed: Option<u64>,
    #[serde(default = "default_recompute_weight")]
    recompute_weight: f64,
    #[serde(default = "default_balance_weight")]
    balance_weight: f64,
}

fn default_recompute_weight() -> f64 {
    predicted_ttft::DEFAULT_RECOMPUTE_WEIGHT
}

fn default_balance_weight() -> f64 {
    predicted_ttft::DEFAULT_BALANCE_WEIGHT
}

fn predicted_ttft_provider(parameters: &WorkerSelectionPolicyParameters) -> ProviderResult {
    let p: PredictedTtftParameters = parameters.deserialize()?;
    non_negative("recompute_weight", p.recompute_weight)?;
    non_negative("balance_weight", p.balance_weight)?;
    let scorer = predicted_ttft::PredictedTtftScorer {
        recompute_weight: p.recompute_weight,
        balance_weight: p.balance_weight,
    };
    Ok(Arc::new(move |config, worker_type, partition| {
        predicted_ttft_policy(
            config,
            worker_type,
            partition,
            p.seed.unwrap_or(config.seed),
            scorer,
        )
    }))
}

fn predicted_ttft_policy(
    config: &crate::config::RouterConfig,
    worker_type: crate::context::WorkerType,
    partition: &crate::context::RoutingPartition,
    seed: u64,
    scorer: predicted_ttft::PredictedTtftScorer,
) -> WorkerSelectionPolicy {
    WorkerSelectionPolicy::new(
        config.clone(),
        worker_type.as_str(),
        vec![Box::new(scorer)],
        Box::new(LowestCostRandomTiesPicker::new(PolicyRng::for_partition(
            seed, partition,
        ))),
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PrefillTimesRequestsParameters {
    seed: Option<u64>,
    #[serde(default = "default_product_recompute_weight")]
    recompute_weight: f64,
    #[serde(default = "default_min_sharers")]
    min_sharers: u32,
    host_cache_hit_weight: Option<f64>,
    disk_cache_hit_weight: Option<f64>,
}

fn default_product_recompute_weight() -> f64 {
    prefill_times_requests::DEFAULT_RECOMPUTE_WEIGHT
}

fn default_min_sharers() -> u32 {
    prefill_times_requests::DEFAULT_MIN_SHARERS
}

fn prefill_times_requests_provider(parameters: &WorkerSelectionPolicyParameters) -> ProviderResult {
    let p: PrefillTimesRequestsParameters = parameters.deserialize()?;
    non_negative("recompute_weight", p.recompute_weight)?;
    for (name, value) in [
        ("host_cache_hit_weight", p.host_cache_hit_weight),
        ("disk_cache_hit_weight", p.disk_cache_hit_weight),
    ] {
        if let Some(v) = value {
            non_negative(name, v)?;
        }
    }
    Ok(Arc::new(move |config, worker_type, partition| {
        let scorer = prefill_times_requests::PrefillTimesRequestsScorer {
            recompute_weight: p.recompute_weight,
            host_cache_hit_weight: p
                .host_cache_hit_weight
                .unwrap_or(config.host_cache_hit_weight),
            disk_cache_hit_weight: p
                .disk_cache_hit_weight
                .unwrap_or(config.disk_cache_hit_weight),
            min_sharers: p.min_sharers,
            private: predicted_ttft::PredictedTtftScorer::default(),
        };
        WorkerSelectionPolicy::new(
            config.clone(),
            worker_type.as_str(),
            vec![Box::new(scorer)],
            Box::new(LowestCostRandomTiesPicker::new(PolicyRng::for_partition(
                p.seed.unwrap_or(config.seed),
                partition,
            ))),
        )
    }))
}

fn least_kv_usage_provider(parameters: &WorkerSelectionPolicyParameters) -> ProviderResult {
    seeded(parameters, |rng| {
        (
            vec![Box::new(KvUsageScorer)],
            Box::new(LowestCostRandomTiesPicker::new(rng)),
        )
    })
}

fn default_abs_threshold() -> f64 {
    32.0
}
fn default_rel_threshold() -> f64 {
    1.5
}
fn default_cache_threshold() -> f64 {
    0.5
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheAwareParameters {
    #[serde(default = "default_abs_threshold")]
    balance_abs_threshold: f64,
    #[serde(default = "default_rel_threshold")]
    balance_rel_threshold: f64,
    #[serde(default = "default_cache_threshold")]
    cache_threshold: f64,
}

fn cache_aware_provider(parameters: &WorkerSelectionPolicyParameters) -> ProviderResult {
    let p: CacheAwareParameters = parameters.deserialize()?;
    non_negative("balance_abs_threshold", p.balance_abs_threshold)?;
    non_negative("balance_rel_threshold", p.balance_rel_threshold)?;
    non_negative("cache_threshold", p.cache_threshold)?;
    if p.cache_threshold > 1.0 {
        return Err(WorkerSelectionPolicyProviderError::new(format!(
            "cache_threshold is a fraction of the request's blocks and must be at most 1, got {}",
            p.cache_threshold
        )));
    }
    Ok(Arc::new(move |config, worker_type, _partition| {
        WorkerSelectionPolicy::new(
            config.clone(),
            worker_type.as_str(),
            Vec::new(),
            Box::new(CacheAwarePicker {
                balance_abs_threshold: p.balance_abs_threshold,
                balance_rel_threshold: p.balance_rel_threshold,
                cache_threshold: p.cache_threshold,
            }),
        )
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SoftPinParameters {
    max_active_requests: u32,
    seed: Option<u64>,
}

fn soft_pin_provider(parameters: &WorkerSelectionPolicyParameters) -> ProviderResult {
    let p: SoftPinParameters = parameters.deserialize()?;
    Ok(Arc::new(move |config, worker_type, partition| {
        let rng = PolicyRng::for_partition(p.seed.unwrap_or(config.seed), partition);
        WorkerSelectionPolicy::new(
            config.clone(),
            worker_type.as_str(),
            Vec::new(),
            Box::new(SoftPinPicker::new(p.max_active_requests, rng)),
        )
    }))
}
