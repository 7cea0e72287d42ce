//! An example custom policy, as an operator's team would write it: keep
//! workers holding at least N device-resident prefix blocks, prefer the one
//! with the fewest active requests. Registered as `acme-least-busy`. And
//! an example request classifier, `acme-tier-gate`, that admits, lowers
//! the priority of, defers or rejects a request by the tier its caller
//! names in a header.
//!
//! Written against `kvedge_policies::plugins::worker_selection`, the same
//! module layout as Dynamo's plugin API, so a Dynamo policy ports by
//! changing its imports.

#![forbid(unsafe_code)]

use std::sync::Arc;

use kvedge_policies::plugins::request_classifier::{
    Classification, ClassifyRequest, RequestClassifier, RequestClassifierFactory,
};
use kvedge_policies::plugins::worker_selection::{
    RouterConfig, RoutingPartition, SelectionErrorKind, WorkerCandidate, WorkerCandidates,
    WorkerFilter, WorkerInputView, WorkerInputs, WorkerPicker, WorkerScorer,
    WorkerSelectionContext, WorkerSelectionPolicy, WorkerSelectionPolicyError,
    WorkerSelectionPolicyFactory, WorkerSelectionPolicyParameters,
    WorkerSelectionPolicyProviderError, WorkerType,
};
use kvedge_policies::plugins::{RouterPluginRegistry, WorkerSelectionPolicyRegistryError};

/// The type name operators write in YAML.
pub const TYPE_NAME: &str = "acme-least-busy";

/// Keeps workers with at least `minimum_blocks` device-resident overlap blocks.
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
        let cache = candidate
            .cache()
            .ok_or_else(|| WorkerSelectionPolicyError::failed("cache input unavailable"))?;
        Ok(cache.device_overlap_blocks() >= self.minimum_blocks)
    }
}

/// Cost = active requests above the least busy candidate's.
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
        let mut minimum = usize::MAX;
        for candidate in candidates.iter() {
            let load = candidate
                .load()
                .ok_or_else(|| WorkerSelectionPolicyError::failed("load input unavailable"))?;
            minimum = minimum.min(load.active_requests());
        }
        for (candidate, cost) in candidates.iter().zip(costs) {
            let load = candidate
                .load()
                .ok_or_else(|| WorkerSelectionPolicyError::failed("load input unavailable"))?;
            *cost = (load.active_requests() - minimum) as f64;
        }
        Ok(())
    }
}

/// The first row of lowest cost.
pub struct LowestCostPicker;

impl WorkerPicker for LowestCostPicker {
    fn pick(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        input
            .candidates()
            .iter()
            .enumerate()
            .min_by(|(_, left), (_, right)| left.cost().total_cmp(&right.cost()))
            .map(|(row, _)| row)
            .ok_or_else(|| SelectionErrorKind::NoCandidates.into())
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Parameters {
    min_device_overlap_blocks: f64,
}

/// Validates the parameters once, at startup, and returns the factory that
/// builds one policy per routing partition.
pub fn provider(
    parameters: &WorkerSelectionPolicyParameters,
) -> Result<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError> {
    let parameters: Parameters = parameters.deserialize()?;
    let minimum_blocks = parameters.min_device_overlap_blocks;
    if !minimum_blocks.is_finite() || minimum_blocks < 0.0 {
        return Err(WorkerSelectionPolicyProviderError::new(
            "min_device_overlap_blocks must be a finite non-negative number",
        ));
    }
    Ok(Arc::new(
        move |config: &RouterConfig, worker_type: WorkerType, _partition: &RoutingPartition| {
            let filters: Vec<Box<dyn WorkerFilter>> =
                vec![Box::new(MinimumDeviceOverlapFilter { minimum_blocks })];
            let scorers: Vec<Box<dyn WorkerScorer>> = vec![Box::new(ActiveRequestsScorer)];
            // Its filter and scorer keep no state, so the daemon may call
            // them to warm up and to explain.
            WorkerSelectionPolicy::new_with_filters(
                config.clone(),
                worker_type.as_str(),
                filters,
                scorers,
                Box::new(LowestCostPicker),
            )
            .allow_side_passes()
        },
    ))
}

/// The classifier's type name operators write in YAML.
pub const CLASSIFIER_TYPE_NAME: &str = "acme-tier-gate";

/// Reads the `x-acme-tier` header: `batch` requests are admitted with
/// `batch_priority`, `overflow` ones deferred for `retry_after_ms`,
/// `blocked` ones rejected, anything else (or no header) admitted as is.
/// Prompts longer than `max_prompt_tokens` are rejected whatever the tier.
#[derive(Debug)]
pub struct TierGate {
    pub batch_priority: i32,
    pub retry_after_ms: u64,
    pub max_prompt_tokens: u32,
}

impl RequestClassifier for TierGate {
    fn classify(&mut self, request: &ClassifyRequest<'_>) -> Classification {
        if request.prompt_tokens > self.max_prompt_tokens {
            return Classification::Reject {
                reason: "the prompt is longer than ACME admits".into(),
            };
        }
        match request.agent_headers.and_then(|h| h.get("x-acme-tier")) {
            Some("batch") => Classification::AdmitWithPriority(self.batch_priority),
            Some("overflow") => Classification::Defer {
                retry_after_ms: self.retry_after_ms,
            },
            Some("blocked") => Classification::Reject {
                reason: "this tier is blocked".into(),
            },
            _ => Classification::Admit,
        }
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct GateParameters {
    batch_priority: i32,
    retry_after_ms: u64,
    max_prompt_tokens: u32,
}

/// Validates the classifier's parameters once, at startup.
pub fn classifier_provider(
    parameters: &WorkerSelectionPolicyParameters,
) -> Result<RequestClassifierFactory, WorkerSelectionPolicyProviderError> {
    let p: GateParameters = parameters.deserialize()?;
    if p.retry_after_ms == 0 {
        return Err(WorkerSelectionPolicyProviderError::new(
            "retry_after_ms must be positive",
        ));
    }
    Ok(Arc::new(move || {
        Box::new(TierGate {
            batch_priority: p.batch_priority,
            retry_after_ms: p.retry_after_ms,
            max_prompt_tokens: p.max_prompt_tokens,
        })
    }))
}

/// Registers this crate's type names.
pub fn register(
    registry: &mut RouterPluginRegistry,
) -> Result<(), WorkerSelectionPolicyRegistryError> {
    registry.register_worker_selection(TYPE_NAME, Arc::new(provider))?;
    registry.register_request_classifier(CLASSIFIER_TYPE_NAME, Arc::new(classifier_provider))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvedge_policies::{CacheRow, CandidateRow, CandidateTable, LoadRow, WorkerWithDpRank};

    fn table(rows: &[(u64, u32, u32)]) -> CandidateTable {
        let mut t = CandidateTable::new();
        t.reset(WorkerInputs::CACHE | WorkerInputs::LOAD);
        for &(id, device, active) in rows {
            t.push(CandidateRow {
                worker: WorkerWithDpRank::new(id, 0),
                cache: CacheRow {
                    device_blocks: device,
                    ..CacheRow::default()
                },
                load: LoadRow {
                    active_requests: active,
                    ..LoadRow::default()
                },
                ..CandidateRow::default()
            });
        }
        t
    }

    fn policy(minimum_blocks: f64) -> WorkerSelectionPolicy {
        WorkerSelectionPolicy::new_with_filters(
            RouterConfig::default(),
            "aggregated",
            vec![Box::new(MinimumDeviceOverlapFilter { minimum_blocks })],
            vec![Box::new(ActiveRequestsScorer)],
            Box::new(LowestCostPicker),
        )
    }

    #[test]
    fn workers_below_the_overlap_minimum_are_filtered_out() {
        let ctx = WorkerSelectionContext::new("r", 64, 16);
        // Worker 1 is idle but holds no prefix: filtered.
        let s = policy(2.0)
            .select(&ctx, &table(&[(1, 0, 0), (2, 3, 4)]))
            .unwrap();
        assert_eq!(s.worker.worker_id, 2);
    }

    #[test]
    fn among_survivors_the_fewest_active_requests_win() {
        let ctx = WorkerSelectionContext::new("r", 64, 16);
        let s = policy(0.0)
            .select(&ctx, &table(&[(1, 0, 5), (2, 3, 4), (3, 1, 2)]))
            .unwrap();
        assert_eq!((s.worker.worker_id, s.cost), (3, 0.0));
    }

    #[test]
    fn no_worker_with_enough_overlap_is_an_error() {
        let ctx = WorkerSelectionContext::new("r", 64, 16);
        let e = policy(9.0).select(&ctx, &table(&[(1, 0, 0)])).unwrap_err();
        assert!(matches!(e.kind(), SelectionErrorKind::AllRejected { .. }));
    }

    #[test]
    fn negative_minimum_is_refused_at_startup() {
        let params =
            WorkerSelectionPolicyParameters::from_yaml_str("p", "min_device_overlap_blocks: -1")
                .unwrap();
        let e = provider(&params).err().expect("refused");
        assert!(e.message().contains("non-negative"));
        let typo =
            WorkerSelectionPolicyParameters::from_yaml_str("p", "min_device_overlap_block: 1")
                .unwrap();
        let e = provider(&typo).err().expect("refused");
        assert!(e.message().contains("unknown field"), "{}", e.message());
    }
}
