//! The gateway shoot-out: the same mock engines, the same trace, and each
//! router in front of them in turn (kvedge's picker behind Envoy, plain
//! Envoy round robin, Envoy with a picker that does nothing,
//! sglang-router, vllm-router), reporting per router
//! and request rate the prefix hit rate the engines found, TTFT and
//! end-to-end percentiles, errors, and the router's CPU time per request
//! and peak memory. See `benches/shootout/README.md`.
//!
//! Not criterion: what is measured is whole systems of processes over a
//! trace, not the time of an operation.

#![forbid(unsafe_code)]

mod client;
#[path = "../support/ext_proc.rs"]
mod ext_proc;
mod floor;
mod routers;
mod trace;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use routers::{EngineShape, Processes, Router, Tools};
use serde_json::json;
use trace::{Shape, Words};

/// The peers' pinned versions.
const SGLANG_ROUTER: &str = "sglang-router==0.3.2";
const VLLM_ROUTER: &str = "vllm-router==0.1.17";

struct Args {
    routers: Vec<Router>,
    shapes: Vec<Shape>,
    rates: Vec<f64>,
    requests: usize,
    runs: usize,
    out: PathBuf,
    smoke: bool,
    install: bool,
    tools: Tools,
    engines: EngineShape,
    seed: u64,
}

fn usage() -> &'static str {
    "cargo bench --bench shootout -- [--routers kvedge,envoy-rr,envoy-floor,sglang,sglang:round_robin,vllm]
    [--shapes multi-turn,system-prompts] [--rates 4,10,16] [--requests 1000] [--runs 2]
    [--out target/shootout] [--kvedge PATH] [--kvedge-config YAML] [--engine-entry KEY=VALUE,...] [--envoy PATH] [--peers VENV] [--install-peers]
    [--prefill-tokens-per-s 2000] [--device-blocks 2048] [--seed 1] [--smoke]"
}

fn parse_args() -> Result<Args, String> {
    let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut a = Args {
        routers: ["kvedge", "envoy-rr", "sglang", "sglang:round_robin", "vllm"]
            .iter()
            .map(|r| Router::parse(r))
            .collect::<Result<_, _>>()?,
        shapes: vec![Shape::MultiTurn, Shape::SystemPrompts],
        rates: vec![4.0, 10.0, 16.0],
        requests: 1000,
        runs: 2,
        out: root.join("target/shootout"),
        smoke: false,
        install: false,
        tools: Tools {
            // The most recently built of the two profiles' binaries.
            kvedge: ["release", "debug"]
                .iter()
                .map(|p| root.join("target").join(p).join("kvedge"))
                .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
                .max()
                .map_or_else(|| root.join("target/release/kvedge"), |(_, p)| p),
            kvedge_extra: String::new(),
            entry_extra: Vec::new(),
            envoy: std::env::var("KVEDGE_ENVOY").ok(),
            peers: root.join("target/shootout-venv"),
        },
        engines: EngineShape {
            engines: 4,
            block_size: 16,
            device_blocks: 2048,
            prefill_tokens_per_s: 2000.0,
            step_base_us: 6000.0,
            max_running: 64,
        },
        seed: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            // What `cargo bench` adds.
            "--bench" => {}
            "--routers" => {
                a.routers = value()?
                    .split(',')
                    .map(Router::parse)
                    .collect::<Result<_, _>>()?
            }
            "--shapes" => {
                a.shapes = value()?
                    .split(',')
                    .map(Shape::parse)
                    .collect::<Result<_, _>>()?
            }
            "--rates" => {
                a.rates = value()?
                    .split(',')
                    .map(|r| r.parse::<f64>().map_err(|e| format!("--rates {r}: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--requests" => a.requests = value()?.parse().map_err(|e| format!("{e}"))?,
            "--runs" => a.runs = value()?.parse().map_err(|e| format!("{e}"))?,
            "--seed" => a.seed = value()?.parse().map_err(|e| format!("{e}"))?,
            "--out" => a.out = value()?.into(),
            "--kvedge" => a.tools.kvedge = value()?.into(),
            "--kvedge-config" => {
                let path = value()?;
                let mut text =
                    std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
                if !text.ends_with('\n') {
                    text.push('\n');
                }
                a.tools.kvedge_extra = text;
            }
            "--engine-entry" => {
                a.tools.entry_extra = value()?
                    .split(',')
                    .map(|kv| match kv.split_once('=') {
                        Some((k, v)) => Ok(format!("{}: {}", k.trim(), v.trim())),
                        None => Err(format!("--engine-entry {kv}: not KEY=VALUE")),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--envoy" => a.tools.envoy = Some(value()?),
            "--peers" => a.tools.peers = value()?.into(),
            "--install-peers" => a.install = true,
            "--prefill-tokens-per-s" => {
                a.engines.prefill_tokens_per_s = value()?.parse().map_err(|e| format!("{e}"))?
            }
            "--device-blocks" => {
                a.engines.device_blocks = value()?.parse().map_err(|e| format!("{e}"))?
            }
            "--smoke" => {
                a.smoke = true;
                a.routers = vec![Router::Kvedge(None), Router::EnvoyRoundRobin];
                a.shapes = vec![Shape::MultiTurn];
                a.rates = vec![8.0];
                a.requests = 240;
                a.runs = 1;
            }
            "-h" | "--help" => return Err(usage().into()),
            other => return Err(format!("unknown argument `{other}`\n{}", usage())),
        }
    }
    if a.rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) || a.requests == 0 || a.runs == 0 {
        return Err("rates, --requests and --runs must be positive".into());
    }
    Ok(a)
}

/// Creates the peers' virtual environment and installs the pinned peers.
fn install_peers(venv: &Path) -> Result<(), String> {
    let run = |c: &mut Command| -> Result<(), String> {
        let status = c.status().map_err(|e| e.to_string())?;
        status
            .success()
            .then_some(())
            .ok_or(format!("{c:?} failed: {status}"))
    };
    if !venv.join("bin/python").exists() {
        run(Command::new("python3").arg("-m").arg("venv").arg(venv))?;
    }
    run(Command::new(venv.join("bin/python")).args([
        "-m",
        "pip",
        "install",
        "--quiet",
        SGLANG_ROUTER,
        VLLM_ROUTER,
    ]))
}

/// One configuration's figures.
#[derive(Clone, Debug)]
struct Figures {
    shape: &'static str,
    rate: f64,
    router: String,
    run: usize,
    requests: usize,
    errors: usize,
    first_error: Option<String>,
    hit_rate: f64,
    ttft: [f64; 3],
    e2e: [f64; 2],
    cpu_ms_per_request: f64,
    /// The same, per process the router is (with its descendants), by
    /// name, when it is more than one: `kvedge` and `envoy`.
    cpu_split: Vec<(String, f64)>,
    peak_rss_mib: f64,
    ttfts: Vec<f64>,
    /// Every request in trace order: engine, prompt and cached tokens, TTFT
    /// (null when it failed).
    requests_seen: Vec<serde_json::Value>,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i]
}

/// A router's name as a directory name: `:` as `-`, and one longer than
/// 24 bytes cut to 16 and a hash of the whole, so that the sockets under it
/// (the daemon's, the engines') stay within a Unix socket path's 108 bytes.
fn dir_label(name: &str) -> String {
    let label = name.replace(':', "-");
    if label.len() <= 24 {
        return label;
    }
    let cut = (0..=16)
        .rev()
        .find(|&i| label.is_char_boundary(i))
        .unwrap_or(0);
    let hash = label.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    format!("{}-{:08x}", &label[..cut], hash as u32)
}

#[allow(clippy::too_many_arguments)]
fn run_one(
    args: &Args,
    router: &Router,
    shape: Shape,
    rate: f64,
    run: usize,
    sends: &[client::Send],
    tokenizer: &Path,
) -> Result<Figures, String> {
    let dir = args.out.join(format!(
        "{}-{rate}-{}-{run}",
        shape.name(),
        dir_label(&router.name())
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("run")).map_err(|e| e.to_string())?;
    let mut procs = Processes::default();
    let engines = routers::start_engines(
        &args.tools.kvedge,
        &dir,
        tokenizer,
        &args.engines,
        &mut procs,
    )?;
    let running = routers::start(router, &args.tools, &dir, tokenizer, &engines)?;
    // Ready when a request goes through (up to 60 s: kvedge waits for the
    // engines' first metrics, the peers for their health checks).
    let probe = [client::Send {
        at_ms: 0,
        prompt: "ready".into(),
        max_tokens: 1,
    }];
    let mut ready = false;
    for _ in 0..120 {
        if client::replay(running.addr, "m", &probe)[0].error.is_none() {
            ready = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    if !ready {
        return Err(format!(
            "{} did not serve a request within 60 s (logs in {})",
            router.name(),
            dir.display()
        ));
    }
    let per_process = |pids: &[u32]| {
        pids.iter()
            .map(|&p| routers::cpu_ms(&[p]))
            .collect::<Vec<_>>()
    };
    let cpu0 = per_process(&running.pids);
    let outcomes = client::replay(running.addr, "m", sends);
    let split: Vec<f64> = per_process(&running.pids)
        .iter()
        .zip(&cpu0)
        .map(|(after, before)| after - before)
        .collect();
    let cpu: f64 = split.iter().sum();
    let cpu_split = if split.len() > 1 {
        running
            .pids
            .iter()
            .zip(&split)
            .map(|(&pid, ms)| (routers::name(pid), ms / outcomes.len() as f64))
            .collect()
    } else {
        Vec::new()
    };
    let rss = routers::peak_rss_mib(&running.pids);
    if router.is_kvedge() {
        // kvedge's own counters after the run (the picker's stage
        // durations among them), beside its log.
        let metrics = Command::new(&args.tools.kvedge)
            .args(["stats", "--prometheus", "--runtime-dir"])
            .arg(dir.join("run"))
            .output()
            .map_err(|e| e.to_string())?;
        std::fs::write(dir.join("metrics.txt"), metrics.stdout).map_err(|e| e.to_string())?;
    }
    drop(running);
    drop(procs);
    let ok: Vec<&client::Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
    let mut ttft: Vec<f64> = ok.iter().map(|o| o.ttft_ms).collect();
    let mut e2e: Vec<f64> = ok.iter().map(|o| o.e2e_ms).collect();
    ttft.sort_by(f64::total_cmp);
    e2e.sort_by(f64::total_cmp);
    let prompt: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|o| o.cached_tokens).sum();
    Ok(Figures {
        shape: shape.name(),
        rate,
        router: router.name(),
        run,
        requests: outcomes.len(),
        errors: outcomes.len() - ok.len(),
        first_error: outcomes.iter().find_map(|o| o.error.clone()),
        hit_rate: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
        ttft: [0.5, 0.9, 0.99].map(|q| percentile(&ttft, q)),
        e2e: [0.5, 0.99].map(|q| percentile(&e2e, q)),
        cpu_ms_per_request: cpu / outcomes.len() as f64,
        cpu_split,
        peak_rss_mib: rss,
        ttfts: ttft,
        requests_seen: outcomes
            .iter()
            .map(|o| {
                json!([
                    o.engine,
                    o.prompt_tokens,
                    o.cached_tokens,
                    o.error.is_none().then_some(o.ttft_ms)
                ])
            })
            .collect(),
    })
}

fn table(figures: &[Figures]) -> String {
    let mut t = String::from(
        "| trace | rate/s | router | run | hit rate | TTFT p50 / p90 / p99 (ms) | e2e p50 / p99 (ms) | errors | router CPU ms/request | router peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for f in figures {
        // A router of several processes: its CPU as the sum of theirs.
        let split: Vec<String> = f
            .cpu_split
            .iter()
            .map(|(name, ms)| format!("{name} {ms:.2}"))
            .collect();
        let split = if split.is_empty() {
            String::new()
        } else {
            format!(" ({})", split.join(" + "))
        };
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {:.1} % | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} | {} | {:.2}{split} | {:.0} |",
            f.shape,
            f.rate,
            f.router,
            f.run,
            f.hit_rate * 100.0,
            f.ttft[0],
            f.ttft[1],
            f.ttft[2],
            f.e2e[0],
            f.e2e[1],
            f.errors,
            f.cpu_ms_per_request,
            f.peak_rss_mib
        );
    }
    t
}

fn main() -> ExitCode {
    // The floor's processor is this binary started again (`floor.rs`).
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(floor::ARG) {
        return match floor::serve(&argv[2..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("shootout {}: {e}", floor::ARG);
                ExitCode::FAILURE
            }
        };
    }
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shootout: {e}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<(), String> {
    let args = parse_args()?;
    if !args.tools.kvedge.exists() {
        return Err(format!(
            "no kvedge binary at {} (cargo build --release --bin kvedge, or --kvedge PATH)",
            args.tools.kvedge.display()
        ));
    }
    if args.install && args.routers.iter().any(Router::needs_peers) {
        install_peers(&args.tools.peers)?;
    }
    for r in args.routers.iter().filter(|r| r.needs_peers()) {
        if !args.tools.peers.join("bin/python").exists() {
            return Err(format!(
                "{} needs the peers' virtual environment at {} (--install-peers makes it)",
                r.name(),
                args.tools.peers.display()
            ));
        }
    }
    std::fs::create_dir_all(&args.out).map_err(|e| e.to_string())?;
    let tokenizer = args.out.join("tokenizer.json");
    let docs = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs"));
    let t = kvedge_epp::testing::train_tokenizer(docs, 4000, &tokenizer);
    let words = Words::from_tokenizer(&t)?;
    // Said, because the newest of the two profiles' binaries is taken: a
    // debug build costs several times the CPU of a release one.
    eprintln!("shootout: kvedge is {}", args.tools.kvedge.display());
    let mut figures = Vec::new();
    for &shape in &args.shapes {
        for &rate in &args.rates {
            let trace = trace::generate(shape, args.requests, rate, args.seed);
            let path = args.out.join(format!("{}-{rate}.jsonl", shape.name()));
            trace::write(&path, &trace).map_err(|e| e.to_string())?;
            // What runs is what the file says (and the file can be replayed
            // elsewhere).
            let trace = trace::read(&path)?;
            let sends: Vec<client::Send> = trace
                .iter()
                .map(|r| client::Send {
                    at_ms: r.timestamp_ms,
                    prompt: words.prompt(&r.hash_ids),
                    max_tokens: r.output_length,
                })
                .collect();
            for run in 1..=args.runs {
                for router in &args.routers {
                    eprintln!(
                        "shootout: {} at {rate}/s, {} (run {run})",
                        shape.name(),
                        router.name()
                    );
                    let f = run_one(&args, router, shape, rate, run, &sends, &tokenizer)?;
                    eprintln!(
                        "{}",
                        table(std::slice::from_ref(&f)).lines().nth(2).unwrap_or("")
                    );
                    figures.push(f);
                }
            }
        }
    }
    let t = table(&figures);
    println!("{t}");
    std::fs::write(args.out.join("table.md"), &t).map_err(|e| e.to_string())?;
    let json: Vec<_> = figures
        .iter()
        .map(|f| {
            json!({"trace": f.shape, "rate": f.rate, "router": f.router, "run": f.run,
                   "requests": f.requests, "errors": f.errors, "first_error": f.first_error,
                   "hit_rate": f.hit_rate, "ttft_ms": f.ttft, "e2e_ms": f.e2e,
                   "cpu_ms_per_request": f.cpu_ms_per_request,
                   "cpu_ms_per_request_by_process": f.cpu_split.iter().map(|(n, ms)| json!({"process": n, "cpu_ms_per_request": ms})).collect::<Vec<_>>(),
                   "peak_rss_mib": f.peak_rss_mib,
                   "ttft_samples_ms": f.ttfts,
                   "per_request": {"fields": ["engine", "prompt_tokens", "cached_tokens", "ttft_ms"],
                                   "rows": f.requests_seen}})
        })
        .collect();
    std::fs::write(
        args.out.join("results.json"),
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    )
    .map_err(|e| e.to_string())?;
    // A TTFT CDF per trace and rate: every router's first run.
    let mut keys: Vec<(&str, String)> = Vec::new();
    for f in &figures {
        let key = (f.shape, format!("{}", f.rate));
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    for (shape, rate) in &keys {
        let series: Vec<(String, Vec<f64>)> = figures
            .iter()
            .filter(|f| f.shape == *shape && format!("{}", f.rate) == *rate && f.run == 1)
            .map(|f| (f.router.clone(), f.ttfts.clone()))
            .collect();
        let path = args.out.join(format!("ttft-cdf-{shape}-{rate}.png"));
        if let Err(e) = kvedge_tools::plot::write_cdf(
            &path,
            &format!("Time to first token, {shape} at {rate} requests/s"),
            &series,
        ) {
            eprintln!("shootout: {}: {e}", path.display());
        }
    }
    for f in &figures {
        if let Some(e) = &f.first_error {
            eprintln!(
                "shootout: {} {} at {}/s: {} errors, the first: {e}",
                f.router, f.shape, f.rate, f.errors
            );
        }
    }
    if args.smoke {
        let hit = |name: &str| {
            figures
                .iter()
                .find(|f| f.router == name)
                .map_or(0.0, |f| f.hit_rate)
        };
        if figures.iter().any(|f| f.errors > 0) {
            return Err("the smoke run had errors".into());
        }
        for (shape, rate) in &keys {
            let png = args.out.join(format!("ttft-cdf-{shape}-{rate}.png"));
            let size = std::fs::metadata(&png).map_or(0, |m| m.len());
            if size < 1000 {
                return Err(format!("no TTFT CDF chart at {}", png.display()));
            }
        }
        if hit("kvedge") <= hit("envoy-rr") {
            return Err(format!(
                "kvedge's hit rate {:.3} is not above round robin's {:.3}",
                hit("kvedge"),
                hit("envoy-rr")
            ));
        }
        eprintln!(
            "shootout smoke: kvedge's hit rate {:.1} % against round robin's {:.1} %",
            hit("kvedge") * 100.0,
            hit("envoy-rr") * 100.0
        );
    }
    Ok(())
}
