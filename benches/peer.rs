//! The peer: NVIDIA Dynamo 1.6.1's own worker selection on the same fixture,
//! benchmarked in the same run (`--features dynamo-peer`), so the ratio is
//! measured rather than taken from a figure recorded elsewhere. Besides
//! criterion's rows, which run minutes apart on a VM whose speed drifts, the
//! default selection's ratio at 32 workers is also measured interleaved:
//! batches of ours and of Dynamo's in alternation, a ratio per pair, and
//! their spread (`ratio_interleaved/...`, printed); and so is the bare
//! columnar loop's (`plain_columnar_loop`), for scale: the cost formula
//! and an argmin written plainly, without the pipeline or its checks.

#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use dynamo_kv_router::protocols::{
    RoutingConstraints, WorkerConfigLike, WorkerId, WorkerWithDpRank,
};
use dynamo_kv_router::scheduling::{OverlapSignals, ScheduleMode};
use dynamo_kv_router::{
    DefaultWorkerSelector, KvRouterConfig, SchedulingRequest, WorkerCandidate, WorkerCandidates,
    WorkerFilter, WorkerInputView, WorkerInputs, WorkerLoadProjection, WorkerPicker, WorkerScorer,
    WorkerSelectionContext, WorkerSelectionInput, WorkerSelectionPolicy,
    WorkerSelectionPolicyError, WorkerSelector,
};
use rustc_hash::FxHashMap;

use super::{PROMPT_TOKENS, PlainColumns, SIZES, context, default_policy, fill, group, rows};

#[derive(Default)]
struct Config {
    taints: HashSet<String>,
}

impl WorkerConfigLike for Config {
    fn data_parallel_start_rank(&self) -> u32 {
        0
    }
    fn data_parallel_size(&self) -> u32 {
        1
    }
    fn max_num_batched_tokens(&self) -> Option<u64> {
        None
    }
    fn total_kv_blocks(&self) -> Option<u64> {
        Some(131_072)
    }
    fn taints(&self) -> &HashSet<String> {
        &self.taints
    }
}

/// Workers and a request exactly as in the kvedge fixture.
fn fixture(n: usize) -> (HashMap<WorkerId, Config>, SchedulingRequest) {
    let mut workers = HashMap::with_capacity(n);
    let mut overlap = FxHashMap::default();
    let mut cached = FxHashMap::default();
    let mut loads = FxHashMap::default();
    for id in 0..n as WorkerId {
        let worker = WorkerWithDpRank::from_worker_id(id);
        let cached_tokens = (id as usize % 32) * 64;
        workers.insert(id, Config::default());
        overlap.insert(worker, cached_tokens as f64 / 16.0);
        cached.insert(worker, cached_tokens);
        loads.insert(
            worker,
            WorkerLoadProjection {
                active_prefill_tokens: id as usize * 16,
                active_decode_blocks: id as usize % 127,
                active_requests: id as usize % 17,
                ..Default::default()
            },
        );
    }
    let request = SchedulingRequest {
        mode: ScheduleMode::QueryOnly { request_id: None },
        token_seq: None,
        isl_tokens: PROMPT_TOKENS as usize,
        lora_name: None,
        expected_output_tokens: Some(256),
        affinity_target: None,
        pinned_worker: None,
        allowed_worker_ids: None,
        routing_constraints: RoutingConstraints {
            required_taints: HashSet::new(),
            preferred_taints: HashMap::new(),
        },
        router_config_override: None,
        track_prefill_tokens: true,
        priority_jump: 0.0,
        strict_priority: 0,
        policy_class: None,
        session_context: None,
        overlap: OverlapSignals {
            tier_overlap_blocks: Default::default(),
            effective_overlap_blocks: overlap,
            effective_cached_tokens: cached,
        },
        kv_transfer_candidates: None,
        retain_kv_transfer_chain: false,
        shared_cache_hits: None,
        worker_loads: loads,
        resp_tx: None,
    };
    (workers, request)
}

struct Scorer;

impl WorkerScorer for Scorer {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::CACHE | WorkerInputs::LOAD | WorkerInputs::PREFERRED_TAINT
    }

    fn score(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        for (candidate, cost) in candidates.iter().zip(costs) {
            let cache = candidate
                .cache()
                .ok_or_else(|| WorkerSelectionPolicyError::failed("cache input unavailable"))?;
            let load = candidate
                .load()
                .ok_or_else(|| WorkerSelectionPolicyError::failed("load input unavailable"))?;
            let uncached =
                (context.request_blocks() as f64 - cache.device_overlap_blocks()).max(0.0);
            let busy = load.active_prefill_tokens() as f64 / context.block_size() as f64
                + load.decode_cost_blocks()
                + load.active_requests() as f64;
            *cost = (uncached + busy) * candidate.preferred_taint_multiplier().unwrap_or(1.0);
        }
        Ok(())
    }
}

struct KeepAll;

impl WorkerFilter for KeepAll {
    fn keep(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        _candidate: WorkerCandidate<'_>,
    ) -> Result<bool, WorkerSelectionPolicyError> {
        Ok(true)
    }
}

struct Lowest;

impl WorkerPicker for Lowest {
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
            .ok_or_else(|| WorkerSelectionPolicyError::failed("no eligible worker"))
    }
}

/// Dynamo's default selector at `temperature`, as its bench builds it.
fn default_selector(temperature: f64) -> DefaultWorkerSelector {
    DefaultWorkerSelector::new(
        Some(KvRouterConfig {
            router_temperature: temperature,
            ..Default::default()
        }),
        "prefill",
    )
}

/// One selection by Dynamo's `selector` over the fixture.
fn select(
    selector: &impl WorkerSelector<Config>,
    workers: &HashMap<WorkerId, Config>,
    request: &SchedulingRequest,
) {
    black_box(
        selector
            .select_worker(WorkerSelectionInput::configured(
                black_box(workers),
                black_box(request),
                request.eligibility(),
                black_box(16),
            ))
            .unwrap(),
    );
}

/// Seconds per call of `f`, over a batch of `iters` calls after one
/// untimed call (the other side's batch has just had the caches).
fn per_call(f: &mut dyn FnMut(), iters: u32) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed().as_secs_f64() / f64::from(iters)
}

/// Times `ours` and `theirs` in alternating batches of about 2 ms (and at
/// least 4 calls) each, 201 pairs, and prints the median of the per-pair
/// ratios (theirs / ours) with its 10th and 90th percentiles, and the
/// median times. A drift in the machine's speed moves both sides of a pair
/// alike.
fn interleaved(label: &str, ours: &mut dyn FnMut(), theirs: &mut dyn FnMut()) {
    let size = |f: &mut dyn FnMut()| {
        let mut iters = 4u32;
        while per_call(f, iters) * f64::from(iters) < Duration::from_millis(2).as_secs_f64() {
            iters = iters.saturating_mul(2);
        }
        iters
    };
    let (n_ours, n_theirs) = (size(ours), size(theirs));
    let pairs: Vec<(f64, f64)> = (0..201)
        .map(|_| (per_call(ours, n_ours), per_call(theirs, n_theirs)))
        .collect();
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut ratios: Vec<f64> = pairs.iter().map(|(o, t)| t / o).collect();
    ratios.sort_by(f64::total_cmp);
    let pick = |q: f64| ratios[((ratios.len() - 1) as f64 * q) as usize];
    let mut o: Vec<f64> = pairs.iter().map(|p| p.0).collect();
    let mut t: Vec<f64> = pairs.iter().map(|p| p.1).collect();
    println!(
        "ratio_interleaved/{label}: Dynamo / kvedge {:.1}x (p10 {:.1}x, p90 {:.1}x); kvedge {:.1} ns, Dynamo {:.1} ns (medians)",
        pick(0.5),
        pick(0.1),
        pick(0.9),
        median(&mut o) * 1e9,
        median(&mut t) * 1e9,
    );
}

/// The default selection at 32 workers, ours and Dynamo's, interleaved.
pub fn interleaved_ratios() {
    for (label, temperature) in [("0", 0.0), ("0.7", 0.7)] {
        // Only where both working sets are a few cache lines: at 1,024
        // and 10,000 workers each side's batch evicts the other's data,
        // so alternating would measure cold caches, not selection.
        let n = 32;
        let mut table = kvedge_policies::CandidateTable::new();
        fill(&mut table, &rows(n));
        let mut policy = default_policy(temperature);
        let ctx = context();
        let (workers, request) = fixture(n);
        let selector = default_selector(temperature);
        interleaved(
            &format!("default_worker_selection/temperature_{label}/{n}"),
            &mut || {
                black_box(policy.select(black_box(&ctx), black_box(&table)).unwrap());
            },
            &mut || select(&selector, &workers, &request),
        );
    }
    // For scale, in the same run: the bare loop of the default cost and an
    // argmin, written plainly (a division per row, no pipeline, no checks),
    // against Dynamo.
    let n = 32;
    let columns = PlainColumns::new(n);
    let (workers, request) = fixture(n);
    let selector = default_selector(0.0);
    interleaved(
        &format!("plain_columnar_loop/{n} against Dynamo's temperature_0/{n}"),
        &mut || {
            black_box(black_box(&columns).argmin());
        },
        &mut || select(&selector, &workers, &request),
    );
}

pub fn benches(c: &mut Criterion) {
    for (label, temperature) in [("0", 0.0), ("0.7", 0.7)] {
        let mut g = group(
            c,
            &format!("dynamo_1.6.1/default_worker_selection/temperature_{label}"),
        );
        for n in SIZES {
            let (workers, request) = fixture(n);
            let selector = default_selector(temperature);
            g.throughput(Throughput::Elements(n as u64));
            g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
                b.iter(|| select(&selector, &workers, &request))
            });
        }
        g.finish();
    }
    const N: usize = 10_000;
    let (workers, request) = fixture(N);
    let config = KvRouterConfig::default();
    let no_filter = WorkerSelectionPolicy::new(
        config.clone(),
        "prefill",
        vec![Box::new(Scorer)],
        Box::new(Lowest),
    );
    let keep_all = WorkerSelectionPolicy::new_with_filters(
        config,
        "prefill",
        vec![Box::new(KeepAll)],
        vec![Box::new(Scorer)],
        Box::new(Lowest),
    );
    let mut g = group(c, "dynamo_1.6.1/custom_worker_selection/10000");
    g.throughput(Throughput::Elements(N as u64));
    for (name, policy) in [("no_filter", &no_filter), ("keep_all_filter", &keep_all)] {
        g.bench_function(name, |b| b.iter(|| select(policy, &workers, &request)));
    }
    g.finish();
}
