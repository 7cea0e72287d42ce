//! Worker-selection benchmarks on the fixture of NVIDIA Dynamo 1.6.1's
//! `worker_selection` bench, so the figures compare directly: a 2,048-token
//! prompt in 16-token blocks and N workers, worker i having (i % 32) * 64
//! cached tokens ((i % 32) * 4 device blocks), i * 16 active prefill tokens,
//! i % 127 active decode blocks and i % 17 active requests.
//!
//! Groups:
//! - `default_worker_selection/temperature_{0,0.7}/N`: the built-in
//!   `dynamo-default-cost-fn` for the prefill role, over a filled table;
//! - `default_worker_selection_with_table_fill/temperature_0/N`: the same
//!   plus refilling the table from N host rows first (the host-side work a
//!   request adds in the daemon, which Dynamo's figure also contains);
//! - `custom_worker_selection/10000/{no_filter,keep_all_filter}`: Dynamo's
//!   custom bench policy (one scorer over the per-candidate API, lowest-cost
//!   picker), written against our API;
//! - `predicted_ttft_with_table_fill/N`: the `predicted-ttft` policy with
//!   the host's work for it: predicting each candidate's TTFT
//!   (`TtftPredictor::terms`) while refilling the table, then selecting;
//!   beside `default_worker_selection_with_table_fill`;
//! - `plain_columnar_loop/N`: the default cost and an argmin as one bare loop
//!   over plain vectors, the floor the pipeline's overhead is measured from;
//! - with `--features dynamo-peer`: `dynamo_1.6.1/...`, Dynamo's own selector
//!   and custom policy on the same fixture, in the same run.
//!
//! `cargo bench --bench worker_selection [--features dynamo-peer]`
//!
//! `... -- --select-loop N TEMPERATURE ITERATIONS` skips criterion and runs
//! that many default selections over the N-worker fixture, for counting
//! instructions under `valgrind --tool=callgrind` (a count does not drift
//! with the machine's speed as a time does).

#![forbid(unsafe_code)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkGroup, BenchmarkId, Criterion, Throughput, measurement::WallTime};
use kvedge_policies::builtin::simple::LowestCostPicker;
use kvedge_policies::plugins::worker_selection::*;
use kvedge_policies::{
    CacheRow, CandidateRow, CandidateTable, LoadRow, OccupancyRow, RouterPlugins,
};

const SIZES: [usize; 5] = [2, 32, 1_024, 2_048, 10_000];
const PROMPT_TOKENS: u32 = 2_048;
const BLOCK_SIZE: u32 = 16;

fn rows(n: usize) -> Vec<CandidateRow> {
    (0..n as u64)
        .map(|i| CandidateRow {
            worker: WorkerWithDpRank::new(i, 0),
            cache: CacheRow {
                device_blocks: ((i % 32) * 64 / 16) as u32,
                ..CacheRow::default()
            },
            load: LoadRow {
                active_requests: (i % 17) as u32,
                waiting_requests: 0,
                active_prefill_tokens: i * 16,
                active_decode_blocks: i % 127,
            },
            occupancy: OccupancyRow {
                kv_used_blocks: 0,
                kv_total_blocks: 131_072,
            },
            preferred_taint_multiplier: None,
            predicted_ttft_s: None,
            predicted_prefill_s: None,
            recent_selections: None,
        })
        .collect()
}

fn fill(table: &mut CandidateTable, rows: &[CandidateRow]) {
    table.reset(WorkerInputs::ALL);
    for r in rows {
        table.push(*r);
    }
}

fn context() -> WorkerSelectionContext<'static> {
    WorkerSelectionContext::new("bench", PROMPT_TOKENS, BLOCK_SIZE).with_expected_output_tokens(256)
}

fn default_policy(temperature: f64) -> WorkerSelectionPolicy {
    RouterPlugins::builtin_only(RouterConfig {
        router_temperature: temperature,
        ..RouterConfig::default()
    })
    .build(&RoutingPartition::new(WorkerType::Prefill, "bench"))
}

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(50);
    g
}

fn default_selection(c: &mut Criterion) {
    for (label, temperature) in [("0", 0.0), ("0.7", 0.7)] {
        let mut g = group(c, &format!("default_worker_selection/temperature_{label}"));
        for n in SIZES {
            let mut table = CandidateTable::new();
            fill(&mut table, &rows(n));
            let mut policy = default_policy(temperature);
            let ctx = context();
            g.throughput(Throughput::Elements(n as u64));
            g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
                b.iter(|| black_box(policy.select(black_box(&ctx), black_box(&table)).unwrap()))
            });
        }
        g.finish();
    }
    let mut g = group(c, "default_worker_selection_with_table_fill/temperature_0");
    for n in SIZES {
        let host_rows = rows(n);
        let mut table = CandidateTable::new();
        let mut policy = default_policy(0.0);
        let ctx = context();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                fill(&mut table, black_box(&host_rows));
                black_box(policy.select(black_box(&ctx), &table).unwrap())
            })
        });
    }
    g.finish();
}

/// Dynamo's bench scorer, on the per-candidate API.
struct BenchScorer;

impl WorkerScorer for BenchScorer {
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
            let uncached_blocks =
                (context.request_blocks() as f64 - cache.device_overlap_blocks()).max(0.0);
            let load_blocks = load.active_prefill_tokens() as f64 / context.block_size() as f64
                + load.active_decode_blocks() as f64
                + load.active_requests() as f64;
            *cost = (uncached_blocks + load_blocks)
                * candidate.preferred_taint_multiplier().unwrap_or(1.0);
        }
        Ok(())
    }
}

struct KeepAllFilter;

impl WorkerFilter for KeepAllFilter {
    fn keep(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        _candidate: WorkerCandidate<'_>,
    ) -> Result<bool, WorkerSelectionPolicyError> {
        Ok(true)
    }
}

fn custom_selection(c: &mut Criterion) {
    const N: usize = 10_000;
    let mut table = CandidateTable::new();
    fill(&mut table, &rows(N));
    let ctx = context();
    let mut no_filter = WorkerSelectionPolicy::new(
        RouterConfig::default(),
        "prefill",
        vec![Box::new(BenchScorer)],
        Box::new(LowestCostPicker),
    );
    let mut keep_all = WorkerSelectionPolicy::new_with_filters(
        RouterConfig::default(),
        "prefill",
        vec![Box::new(KeepAllFilter)],
        vec![Box::new(BenchScorer)],
        Box::new(LowestCostPicker),
    );
    let mut g = group(c, "custom_worker_selection/10000");
    g.throughput(Throughput::Elements(N as u64));
    g.bench_function("no_filter", |b| {
        b.iter(|| {
            black_box(
                no_filter
                    .select(black_box(&ctx), black_box(&table))
                    .unwrap(),
            )
        })
    });
    g.bench_function("keep_all_filter", |b| {
        b.iter(|| black_box(keep_all.select(black_box(&ctx), black_box(&table)).unwrap()))
    });
    g.finish();
}

/// The default cost at temperature 0 and an argmin, as one loop over plain
/// vectors: no pipeline, no validation. The floor the pipeline's overhead is
/// measured from.
struct PlainColumns {
    device: Vec<f64>,
    prefill: Vec<f64>,
    decode: Vec<f64>,
}

impl PlainColumns {
    fn new(n: usize) -> PlainColumns {
        let r = rows(n);
        PlainColumns {
            device: r.iter().map(|r| f64::from(r.cache.device_blocks)).collect(),
            prefill: r
                .iter()
                .map(|r| r.load.active_prefill_tokens as f64)
                .collect(),
            decode: r
                .iter()
                .map(|r| r.load.active_decode_blocks as f64)
                .collect(),
        }
    }

    /// The row of least cost, and that cost.
    #[inline(always)]
    fn argmin(&self) -> (usize, f64) {
        let (prompt, bs) = (black_box(f64::from(PROMPT_TOKENS)), f64::from(BLOCK_SIZE));
        let request_blocks = (prompt / bs).ceil();
        let mut best = (0usize, f64::INFINITY);
        for i in 0..self.device.len() {
            let raw = (self.prefill[i] + prompt) / bs;
            let cost = (raw - self.device[i]).max(0.0) + self.decode[i] + request_blocks;
            if cost < best.1 {
                best = (i, cost);
            }
        }
        best
    }
}

fn plain_columnar_loop(c: &mut Criterion) {
    let mut g = group(c, "plain_columnar_loop");
    for n in SIZES {
        let columns = PlainColumns::new(n);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| black_box(columns.argmin()))
        });
    }
    g.finish();
}

fn predicted_ttft_selection(c: &mut Criterion) {
    use kvedge_policies::predict::{TtftInputs, TtftPredictor};
    let registry = kvedge_policies::router_plugin_registry();
    let config = kvedge_policies::WorkerSelectionConfig::from_yaml_str(
        "worker_selection:\n  prefill: p\n  instances:\n    - name: p\n      type: predicted-ttft\n",
    )
    .unwrap();
    let plugins = registry
        .resolve_plugins(&config, &Default::default(), &RouterConfig::default())
        .unwrap();
    let predictor = TtftPredictor::default();
    let mut g = group(c, "predicted_ttft_with_table_fill");
    for n in SIZES {
        let host_rows = rows(n);
        let mut table = CandidateTable::new();
        let mut policy = plugins.build(&RoutingPartition::new(WorkerType::Prefill, "bench"));
        let ctx = context();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                table.reset(WorkerInputs::ALL);
                for r in black_box(&host_rows) {
                    let t = predictor.terms(&TtftInputs {
                        prompt_tokens: PROMPT_TOKENS,
                        block_size: BLOCK_SIZE,
                        device_blocks: r.cache.device_blocks,
                        host_blocks: r.cache.host_blocks,
                        disk_blocks: r.cache.disk_blocks,
                        queued_prefill_tokens: r.load.active_prefill_tokens,
                        waiting_requests: r.load.waiting_requests,
                        decode_blocks: r.load.active_decode_blocks,
                        learned_tokens_per_second: None,
                        peer_tokens_per_second: Some(25_000.0),
                    });
                    table.push(CandidateRow {
                        predicted_ttft_s: Some(t.total_s()),
                        predicted_prefill_s: Some(t.prefill_s),
                        ..*r
                    });
                }
                black_box(policy.select(black_box(&ctx), &table).unwrap())
            })
        });
    }
    g.finish();
}

#[cfg(feature = "dynamo-peer")]
mod peer;

/// `--select-loop N TEMPERATURE ITERATIONS`, if given: runs the selections
/// and returns true.
fn select_loop() -> bool {
    let args: Vec<String> = std::env::args().collect();
    let Some(at) = args.iter().position(|a| a == "--select-loop") else {
        return false;
    };
    let arg = |k: usize| -> &str {
        args.get(at + k)
            .map(String::as_str)
            .expect("--select-loop N TEMPERATURE ITERATIONS")
    };
    let n: usize = arg(1).parse().expect("N: a number of workers");
    let temperature: f64 = arg(2).parse().expect("TEMPERATURE: a number");
    let iterations: u64 = arg(3).parse().expect("ITERATIONS: a count");
    let mut table = CandidateTable::new();
    fill(&mut table, &rows(n));
    let mut policy = default_policy(temperature);
    let ctx = context();
    for _ in 0..iterations {
        black_box(policy.select(black_box(&ctx), black_box(&table)).unwrap());
    }
    true
}

fn main() {
    if select_loop() {
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    default_selection(&mut c);
    custom_selection(&mut c);
    predicted_ttft_selection(&mut c);
    plain_columnar_loop(&mut c);
    #[cfg(feature = "dynamo-peer")]
    peer::benches(&mut c);
    c.final_summary();
    #[cfg(feature = "dynamo-peer")]
    peer::interleaved_ratios();
}
