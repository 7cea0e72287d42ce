//! The `kvedge sim` command: reads or generates the workload, runs one
//! replay per policy (in parallel, each on its own router and engines), and
//! prints the table, JSON, and optionally the charts.

use std::path::PathBuf;

use kvedge_policies::RouterPluginRegistry;
use kvedge_sim::engine::EngineParams;
use kvedge_sim::report::{Summary, table};
use kvedge_sim::workload::{
    Arrivals, SyntheticParams, TraceRequest, oracle_hit_rate, read_mooncake, synthetic,
};
use serde::Serialize;

use crate::sim::{PRESETS, Run, Setup, preset_config, run};
use kvedge_config::Config;
pub use kvedge_mock::EngineArgs;

/// The synthetic workload's knobs.
#[derive(Debug, Clone, clap::Args)]
pub struct SyntheticArgs {
    /// Requests to generate.
    #[arg(long, default_value_t = 2_000)]
    pub requests: usize,
    /// Seed of the generator.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Mean arrivals per second.
    #[arg(long, default_value_t = 12.0)]
    pub rate: f64,
    /// Bursty arrivals (2 s of every 8 at 2.5x the rate) instead of Poisson.
    #[arg(long)]
    pub bursty: bool,
    /// Shared-prefix groups.
    #[arg(long, default_value_t = 32)]
    pub prefix_groups: u32,
    /// Tokens of each shared prefix.
    #[arg(long, default_value_t = 2_048)]
    pub prefix_tokens: u32,
}

impl SyntheticArgs {
    pub fn params(&self, block_size: u32) -> Result<SyntheticParams, String> {
        if self.requests == 0
            || !(self.rate.is_finite() && self.rate > 0.0)
            || self.prefix_groups == 0
        {
            return Err("--requests, --rate and --prefix-groups must be positive".into());
        }
        Ok(SyntheticParams {
            requests: self.requests,
            seed: self.seed,
            rate_per_s: self.rate,
            arrivals: if self.bursty {
                Arrivals::Bursty
            } else {
                Arrivals::Poisson
            },
            prefix_groups: self.prefix_groups,
            prefix_tokens: self.prefix_tokens,
            block_size: block_size as usize,
            ..SyntheticParams::default()
        })
    }
}

/// `kvedge sim`'s arguments.
#[derive(Debug, clap::Args)]
pub struct SimArgs {
    /// A Mooncake-format trace (JSON lines with timestamp, input_length,
    /// output_length, hash_ids); without it, the synthetic workload.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Multiplies the trace's arrival times (0.5 replays twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Replay only the first N requests of the trace.
    #[arg(long)]
    pub limit: Option<usize>,
    #[command(flatten)]
    pub synthetic: SyntheticArgs,
    /// Engines on the simulated node.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// A shipped policy to compare (repeatable); default: all of them.
    #[arg(long = "policy")]
    pub policies: Vec<String>,
    /// A kvedge configuration file to compare (repeatable); its row is named
    /// after the file.
    #[arg(long = "config")]
    pub configs: Vec<PathBuf>,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also write PNG charts into this directory: hit rate and TTFT per
    /// policy, and active requests per worker over time for each policy.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Replay the workload at each of these offered loads (fractions of
    /// the node's nominal prefill capacity, comma-separated, e.g.
    /// 0.2,0.4,0.6) and print TTFT p50/p90 per policy per load in one
    /// table. The arrivals are stretched or compressed to the load; the
    /// nominal load is prompt tokens per second over workers × prefill
    /// tokens per second, as if nothing were cached.
    #[arg(long, value_delimiter = ',')]
    pub sweep: Vec<f64>,
    /// Also replay each policy as a frontend without the model's tokenizer
    /// routes (the gateway's approximate prefix mode): its selects carry
    /// approximate hashes, so the router knows only where it sent earlier
    /// prefixes, not what the engines hold. Rows `<policy> (approximate)`.
    #[arg(long)]
    pub approximate: bool,
}

/// The offered load of `requests` on `workers` engines of `engine`: prompt
/// tokens per second over the node's prefill capacity.
pub fn nominal_load(requests: &[TraceRequest], workers: usize, engine: &EngineParams) -> f64 {
    let (Some(first), Some(last)) = (requests.first(), requests.last()) else {
        return 0.0;
    };
    let span_s = (last.arrival_us.saturating_sub(first.arrival_us)) as f64 / 1e6;
    if span_s <= 0.0 {
        return 0.0;
    }
    let tokens: f64 = requests.iter().map(|r| f64::from(r.prompt_tokens())).sum();
    tokens / span_s / (workers as f64 * engine.prefill_tokens_per_s)
}

/// `requests` with their arrivals rescaled so their offered load is `load`.
fn at_load(requests: &[TraceRequest], nominal: f64, load: f64) -> Vec<TraceRequest> {
    let first = requests.first().map_or(0, |r| r.arrival_us);
    let scale = nominal / load;
    requests
        .iter()
        .map(|r| TraceRequest {
            arrival_us: first + ((r.arrival_us - first) as f64 * scale).round() as u64,
            ..r.clone()
        })
        .collect()
}

/// One load of a sweep, as `--sweep --json` prints it.
#[derive(Debug, Serialize)]
pub struct SweepPoint {
    /// The offered load, a fraction of nominal prefill capacity.
    pub load: f64,
    /// The factor the arrival times were multiplied by.
    pub time_scale: f64,
    pub policies: Vec<PolicyRow>,
}

/// The JSON that `kvedge sim --sweep ... --json` prints.
#[derive(Debug, Serialize)]
pub struct SweepReport {
    pub workload: String,
    pub requests: usize,
    pub workers: usize,
    /// The workload's own offered load.
    pub nominal_load: f64,
    pub points: Vec<SweepPoint>,
}

fn policy_rows(runs: Vec<Run>) -> Vec<PolicyRow> {
    runs.into_iter()
        .map(|r| PolicyRow {
            summary: r.summary,
            unplaced: r.unplaced,
            refused: r.refused,
            requests_per_worker: r.requests_per_worker,
        })
        .collect()
}

fn sweep(
    args: &SimArgs,
    configs: &[(String, Config)],
    setup: &Setup,
    name: String,
    requests: &[TraceRequest],
) -> Result<String, String> {
    if let Some(bad) = args.sweep.iter().find(|l| !(l.is_finite() && **l > 0.0)) {
        return Err(format!(
            "--sweep loads must be positive fractions, got {bad}"
        ));
    }
    let nominal = nominal_load(requests, setup.workers, &setup.engine);
    if nominal <= 0.0 {
        return Err("--sweep needs a workload whose arrivals span some time".into());
    }
    let mut points = Vec::new();
    for &load in &args.sweep {
        let scaled = at_load(requests, nominal, load);
        let oracle = oracle_hit_rate(&scaled, setup.engine.block_size);
        let runs = run_all(configs, setup, &scaled, oracle);
        points.push(SweepPoint {
            load,
            time_scale: nominal / load,
            policies: policy_rows(runs),
        });
    }
    if args.json {
        let report = SweepReport {
            workload: name,
            requests: requests.len(),
            workers: setup.workers,
            nominal_load: nominal,
            points,
        };
        return serde_json::to_string_pretty(&report).map_err(|e| e.to_string());
    }
    let mut text = format!(
        "{name}: {} requests on {} workers; its own offered load is {:.0}% of nominal prefill capacity\nTTFT p50 / p90, ms, at each offered load (best of each column marked *)\n\n| policy |",
        requests.len(),
        setup.workers,
        nominal * 100.0
    );
    for p in &points {
        text.push_str(&format!(" {:.0}% p50 | p90 |", p.load * 100.0));
    }
    text.push_str("\n|---|");
    for _ in &points {
        text.push_str("---|---|");
    }
    text.push('\n');
    let best = |i: usize, f: fn(&PolicyRow) -> f64| {
        points[i]
            .policies
            .iter()
            .map(f)
            .fold(f64::INFINITY, f64::min)
    };
    for (row, (label, _)) in configs.iter().enumerate() {
        text.push_str(&format!("| {label} |"));
        for (i, p) in points.iter().enumerate() {
            let r = &p.policies[row];
            for (v, b) in [
                (r.summary.ttft_ms_p50, best(i, |r| r.summary.ttft_ms_p50)),
                (r.summary.ttft_ms_p90, best(i, |r| r.summary.ttft_ms_p90)),
            ] {
                let mark = if v <= b { "*" } else { "" };
                text.push_str(&format!(" {v:.1}{mark} |"));
            }
        }
        text.push('\n');
    }
    for p in &points {
        for r in &p.policies {
            if r.requests_per_worker.contains(&0) {
                text.push_str(&format!(
                    "warning: {} sent no request to some worker at {:.0}% load\n",
                    r.summary.policy,
                    p.load * 100.0
                ));
            }
        }
    }
    Ok(text)
}

/// The JSON that `kvedge sim --json` prints.
#[derive(Debug, Serialize)]
pub struct SimReport {
    pub workload: String,
    pub requests: usize,
    pub workers: usize,
    pub oracle_hit_rate: f64,
    pub policies: Vec<PolicyRow>,
}

#[derive(Debug, Serialize)]
pub struct PolicyRow {
    #[serde(flatten)]
    pub summary: Summary,
    pub unplaced: usize,
    pub refused: usize,
    /// Requests the router sent to each worker, in worker order.
    pub requests_per_worker: Vec<u64>,
}

/// Loads the workload `args` describe.
pub fn workload(args: &SimArgs) -> Result<(String, Vec<TraceRequest>), String> {
    let block_size = args.engine.block_size;
    match &args.trace {
        Some(path) => {
            if !(args.time_scale.is_finite() && args.time_scale > 0.0) {
                return Err("--time-scale must be positive".into());
            }
            let name = path.display().to_string();
            let file = std::fs::File::open(path).map_err(|e| format!("{name}: {e}"))?;
            let mut r = read_mooncake(
                &name,
                std::io::BufReader::new(file),
                args.time_scale,
                block_size as usize,
            )
            .map_err(|e| e.to_string())?;
            if let Some(n) = args.limit {
                r.truncate(n);
            }
            Ok((format!("{name} (time scale {})", args.time_scale), r))
        }
        None => {
            let p = args.synthetic.params(block_size)?;
            let name = format!(
                "synthetic ({} requests, seed {}, {} req/s{})",
                p.requests,
                p.seed,
                p.rate_per_s,
                if args.synthetic.bursty {
                    ", bursty"
                } else {
                    ""
                }
            );
            Ok((name, synthetic(&p)))
        }
    }
}

/// Runs the command; returns the text to print.
pub fn execute(args: &SimArgs, registry: &RouterPluginRegistry) -> Result<String, String> {
    if args.workers == 0 || args.workers > kvedge_core::index::MAX_WORKERS {
        return Err(format!(
            "--workers must be 1..={}",
            kvedge_core::index::MAX_WORKERS
        ));
    }
    let engine = args.engine.params()?;
    // The policies first: a bad name fails before the workload is built.
    let mut configs: Vec<(String, Config)> = Vec::new();
    let names: Vec<String> = if args.policies.is_empty() && args.configs.is_empty() {
        PRESETS.iter().map(|(n, _)| (*n).to_owned()).collect()
    } else {
        args.policies.clone()
    };
    for name in names {
        let c = preset_config(&name, registry).map_err(|e| e.to_string())?;
        configs.push((name, c));
    }
    for path in &args.configs {
        let file = path.display().to_string();
        let source =
            std::fs::read_to_string(path).map_err(|e| format!("{file}: cannot read: {e}"))?;
        let c = Config::load(&file, &source, registry, &Default::default())
            .map_err(|e| e.to_string())?;
        configs.push((path.display().to_string(), c));
    }
    let (name, requests) = workload(args)?;
    let setup = Setup {
        workers: args.workers,
        engine,
        sample_us: 1_000_000,
        approximate: false,
    };
    if !args.sweep.is_empty() {
        if args.approximate {
            return Err(
                "--approximate compares at one load; it does not combine with --sweep".into(),
            );
        }
        if args.plot.is_some() {
            return Err("--plot draws one replay; it does not combine with --sweep".into());
        }
        return sweep(args, &configs, &setup, name, &requests);
    }
    let oracle = oracle_hit_rate(&requests, setup.engine.block_size);
    let mut runs = run_all(&configs, &setup, &requests, oracle);
    if args.approximate {
        let approximate: Vec<(String, Config)> = configs
            .iter()
            .map(|(label, c)| (format!("{label} (approximate)"), c.clone()))
            .collect();
        let setup = Setup {
            approximate: true,
            ..setup.clone()
        };
        let approx = run_all(&approximate, &setup, &requests, oracle);
        // Each policy's approximate row under its precise one.
        runs = runs
            .into_iter()
            .zip(approx)
            .flat_map(|(p, a)| [p, a])
            .collect();
    }
    let charts = match &args.plot {
        Some(dir) => crate::plot::write_charts(dir, &runs, oracle)
            .map_err(|e| format!("--plot {}: {e}", dir.display()))?,
        None => Vec::new(),
    };
    if args.json {
        let report = SimReport {
            workload: name,
            requests: requests.len(),
            workers: args.workers,
            oracle_hit_rate: oracle,
            policies: policy_rows(runs),
        };
        return serde_json::to_string_pretty(&report).map_err(|e| e.to_string());
    }
    for chart in &charts {
        eprintln!("kvedge sim: wrote {}", chart.display());
    }
    let mut text = format!(
        "{name}: {} requests on {} workers\n",
        requests.len(),
        args.workers
    );
    let rows: Vec<Summary> = runs.iter().map(|r| r.summary.clone()).collect();
    text.push_str(&table(&rows, oracle));
    for r in &runs {
        if r.unplaced + r.refused > 0 {
            text.push_str(&format!(
                "{}: {} requests not placed by the router, {} refused by an engine\n",
                r.summary.policy, r.unplaced, r.refused
            ));
        }
        let idle: Vec<String> = r
            .requests_per_worker
            .iter()
            .enumerate()
            .filter(|(_, n)| **n == 0)
            .map(|(w, _)| (w + 1).to_string())
            .collect();
        if !idle.is_empty() {
            text.push_str(&format!(
                "warning: {} sent no request to worker {}\n",
                r.summary.policy,
                idle.join(", ")
            ));
        }
    }
    Ok(text)
}

/// Runs every configuration, on as many threads as there are cores; rows
/// come back in the order given.
pub fn run_all(
    configs: &[(String, Config)],
    setup: &Setup,
    requests: &[TraceRequest],
    oracle: f64,
) -> Vec<Run> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(configs.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: std::sync::Mutex<Vec<Option<Run>>> =
        std::sync::Mutex::new((0..configs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((label, config)) = configs.get(i) else {
                        return;
                    };
                    let r = run(config, label, setup, requests, oracle);
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|r| r.expect("every configuration ran"))
        .collect()
}
