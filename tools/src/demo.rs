//! `kvedge demo`: the whole system on one machine with no GPU. It starts the
//! daemon (`kvedge run`) on a bundled configuration, N mock engines
//! (`kvedge mock-engine`) as real processes over real rings, and a load
//! generator that sends a synthetic workload through the real query socket:
//! select, dispatch to the chosen engine, `prefill_done` at the first token,
//! `finish` at the last. It ends with the routing table of `kvedge sim` and
//! the daemon's own latency figures, and removes every process and file it
//! made, on success, on error and on Ctrl-C.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvedge_sim::report::{LoadIntegral, Outcome, summarise, table};
use kvedge_sim::workload::{SyntheticParams, TraceRequest, oracle_hit_rate, synthetic};
use kvedge_wire::{Ids, Request, Role, Select};
use serde_json::{Value, json};

use crate::sim_cmd::EngineArgs;
use kvedge_core::latency::Histogram;

/// The configuration the demo's daemon runs with.
pub const BUNDLED_CONFIG: &str = include_str!("../demo/kvedge-demo.yaml");

const MODEL: &str = "demo";

/// `kvedge demo`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Mock engines to start: a count (they feed kvedge's rings), or
    /// `vllm` / `vllm:N` (they publish as vLLM does, over ZeroMQ and
    /// Prometheus, and the daemon reads them through its `engines:`
    /// section).
    #[arg(long, default_value = "4")]
    pub engines: Engines,
    /// Requests of the synthetic workload.
    #[arg(long, default_value_t = 600)]
    pub requests: usize,
    /// Mean arrivals per simulated second.
    #[arg(long, default_value_t = 8.0)]
    pub rate: f64,
    /// Simulated seconds per wall-clock second, for the engines and the
    /// arrivals alike.
    #[arg(long, default_value_t = 2.0)]
    pub speed: f64,
    /// Seed of the workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Run the daemon with this configuration instead of the bundled one.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print one JSON object at the end instead of the table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// `--engines`: how many mock engines, and how they feed the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Engines {
    pub count: usize,
    /// Publish as vLLM does instead of through rings.
    pub vllm: bool,
}

impl std::str::FromStr for Engines {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (vllm, count) = match s.strip_prefix("vllm") {
            Some("") => (true, "4"),
            Some(rest) => (true, rest.strip_prefix(':').ok_or("expected vllm:N")?),
            None => (false, s),
        };
        let count = count
            .parse()
            .map_err(|_| format!("`{s}` is not a count, `vllm` or `vllm:N`"))?;
        Ok(Engines { count, vllm })
    }
}

/// A free TCP port on the loopback (for an engine's metrics page).
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// Child processes and the runtime directory, torn down on drop.
struct Cleanup {
    dir: PathBuf,
    children: Vec<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_child(c),
                rustix::process::Signal::TERM,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        for c in &mut self.children {
            loop {
                match c.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    Ok(None) => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One request line to the daemon, one reply.
struct Query {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    out: Vec<u8>,
    line: String,
}

impl Query {
    fn connect(path: &Path) -> std::io::Result<Query> {
        let s = UnixStream::connect(path)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(Query {
            reader: BufReader::new(s.try_clone()?),
            writer: s,
            out: Vec::new(),
            line: String::new(),
        })
    }
    /// Sends `request` as a JSON line and reads the reply line.
    fn ask(&mut self, request: &Request<'_>) -> std::io::Result<Value> {
        self.out.clear();
        kvedge_wire::json::encode_request(&mut self.out, request).map_err(std::io::Error::other)?;
        self.writer.write_all(&self.out)?;
        self.line.clear();
        self.reader.read_line(&mut self.line)?;
        serde_json::from_str(&self.line).map_err(std::io::Error::other)
    }
}

#[derive(Clone, Copy, Default)]
struct Record {
    router_id: u64,
    dispatched: bool,
    ttft_ms: Option<f64>,
    e2e_ms: Option<f64>,
    cached_tokens: u32,
    released: u32,
}

struct Shared {
    records: Mutex<Vec<Record>>,
    finished: AtomicU64,
    first_tokens: AtomicU64,
    cached: AtomicU64,
    prompt: AtomicU64,
    errors: AtomicU64,
}

/// Waits for `what` to become true, failing after `limit`.
fn wait_until(
    limit: Duration,
    stop: &AtomicBool,
    what: &str,
    mut f: impl FnMut() -> Result<bool, String>,
) -> Result<(), String> {
    let start = Instant::now();
    loop {
        if f()? {
            return Ok(());
        }
        if stop.load(Ordering::Relaxed) {
            return Err("interrupted".into());
        }
        if start.elapsed() > limit {
            return Err(format!("timed out waiting for {what}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join("\n")
}

/// Runs the demo; returns what to print.
pub fn run(args: &DemoArgs) -> Result<String, String> {
    let vllm = args.engines.vllm;
    let n_engines = args.engines.count;
    if n_engines == 0 || n_engines > kvedge_core::index::MAX_WORKERS {
        return Err(format!(
            "--engines must be 1..={}",
            kvedge_core::index::MAX_WORKERS
        ));
    }
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if !positive(args.speed) || !positive(args.rate) {
        return Err("--speed and --rate must be positive".into());
    }
    if args.requests == 0 {
        return Err("--requests must be positive".into());
    }
    let params = args.engine.params()?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, Arc::clone(&stop)).map_err(|e| e.to_string())?;
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find my own binary: {e}"))?;
    let dir = std::env::temp_dir().join(format!("kvedge-demo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut cleanup = Cleanup {
        dir: dir.clone(),
        children: Vec::new(),
    };
    let run_dir = dir.join("run");
    // vLLM-style engines: where each publishes, and the daemon's
    // `engines:` entries that read them.
    let mut vllm_endpoints = Vec::new();
    let mut engines_yaml = String::from("\nengines:\n");
    if vllm {
        for i in 1..=n_engines {
            let events = format!("ipc://{}/engine-{i}.events", dir.display());
            let replay = format!("ipc://{}/engine-{i}.replay", dir.display());
            let metrics = format!("127.0.0.1:{}", free_port()?);
            let sock = dir.join(format!("engine-{i}.sock"));
            engines_yaml.push_str(&format!(
                "  - kind: vllm\n    model: {MODEL}\n    worker_id: {i}\n    block_size: {}\n    endpoint: unix:{}\n    events: {events}\n    replay: {replay}\n    topic: kv-events\n    metrics: http://{metrics}/metrics\n",
                params.block_size,
                sock.display()
            ));
            vllm_endpoints.push((events, replay, metrics));
        }
    }
    let config = match (&args.config, vllm) {
        (Some(p), false) => p.clone(),
        (given, _) => {
            let mut text = match given {
                Some(p) => {
                    std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?
                }
                None => BUNDLED_CONFIG.to_owned(),
            };
            if vllm {
                text.push_str(&engines_yaml);
            }
            let p = dir.join("kvedge.yaml");
            std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
            p
        }
    };
    let log = |name: &str| -> Result<Stdio, String> {
        let p = dir.join(name);
        std::fs::File::create(&p)
            .map(Stdio::from)
            .map_err(|e| format!("{}: {e}", p.display()))
    };
    // The daemon.
    let daemon = Command::new(&exe)
        .arg("run")
        .arg("--config")
        .arg(&config)
        .arg("--runtime-dir")
        .arg(&run_dir)
        .stdin(Stdio::null())
        .stdout(log("daemon.log")?)
        .stderr(log("daemon.log")?)
        .spawn()
        .map_err(|e| format!("cannot start the daemon: {e}"))?;
    cleanup.children.push(daemon);
    let query_sock = run_dir.join("query.sock");
    wait_until(Duration::from_secs(10), &stop, "the daemon", || {
        if let Ok(Some(status)) = cleanup.children[0].try_wait() {
            return Err(format!(
                "the daemon exited ({status}):\n{}",
                tail(&dir.join("daemon.log"))
            ));
        }
        Ok(UnixStream::connect(&query_sock).is_ok())
    })?;
    // The engines.
    let mut engine_socks = Vec::new();
    for i in 0..n_engines {
        let sock = dir.join(format!("engine-{}.sock", i + 1));
        let e = &args.engine;
        let mut cmd = Command::new(&exe);
        cmd.arg("mock-engine");
        if let Some((events, replay, metrics)) = vllm_endpoints.get(i) {
            cmd.args(["--vllm-events", events, "--vllm-replay", replay])
                .args(["--vllm-metrics", metrics]);
        }
        let child = cmd
            .args(["--worker-id", &(i + 1).to_string(), "--model", MODEL])
            .arg("--listen")
            .arg(&sock)
            .arg("--runtime-dir")
            .arg(&run_dir)
            .args(["--speed", &args.speed.to_string()])
            .args(["--block-size", &e.block_size.to_string()])
            .args(["--device-blocks", &e.device_blocks.to_string()])
            .args(["--host-blocks", &e.host_blocks.to_string()])
            .args([
                "--prefill-tokens-per-s",
                &e.prefill_tokens_per_s.to_string(),
            ])
            .args(["--step-base-us", &e.step_base_us.to_string()])
            .args([
                "--decode-us-per-context-token",
                &e.decode_us_per_context_token.to_string(),
            ])
            .args(["--max-batch-tokens", &e.max_batch_tokens.to_string()])
            .args(["--max-running", &e.max_running.to_string()])
            .stdin(Stdio::null())
            .stdout(log(&format!("engine-{}.log", i + 1))?)
            .stderr(log(&format!("engine-{}.log", i + 1))?)
            .spawn()
            .map_err(|e| format!("cannot start engine {}: {e}", i + 1))?;
        cleanup.children.push(child);
        engine_socks.push(sock);
    }
    let mut control = Query::connect(&query_sock).map_err(|e| format!("query socket: {e}"))?;
    wait_until(Duration::from_secs(15), &stop, "the engines", || {
        for (i, c) in cleanup.children.iter_mut().enumerate().skip(1) {
            if let Ok(Some(status)) = c.try_wait() {
                return Err(format!(
                    "engine {i} exited ({status}):\n{}",
                    tail(&dir.join(format!("engine-{i}.log")))
                ));
            }
        }
        let w = control
            .ask(&Request::Workers)
            .map_err(|e| format!("workers: {e}"))?;
        let n = w["workers"].as_array().map_or(0, Vec::len);
        Ok(n == n_engines && engine_socks.iter().all(|s| s.exists()))
    })?;

    // The workload, and one connection per engine with a reader thread
    // that releases requests in the daemon as the engine reports them.
    let workload = synthetic(&SyntheticParams {
        requests: args.requests,
        seed: args.seed,
        rate_per_s: args.rate,
        block_size: params.block_size as usize,
        ..SyntheticParams::default()
    });
    let oracle = oracle_hit_rate(&workload, params.block_size);
    let shared = Arc::new(Shared {
        records: Mutex::new(vec![Record::default(); workload.len()]),
        finished: AtomicU64::new(0),
        first_tokens: AtomicU64::new(0),
        cached: AtomicU64::new(0),
        prompt: AtomicU64::new(0),
        errors: AtomicU64::new(0),
    });
    let mut writers = Vec::new();
    let mut readers = Vec::new();
    for sock in &engine_socks {
        let s = UnixStream::connect(sock).map_err(|e| format!("{}: {e}", sock.display()))?;
        let reader = s.try_clone().map_err(|e| e.to_string())?;
        reader
            .set_read_timeout(Some(Duration::from_millis(200)))
            .map_err(|e| e.to_string())?;
        writers.push(s);
        let shared = Arc::clone(&shared);
        let stop = Arc::clone(&stop);
        let mut q = Query::connect(&query_sock).map_err(|e| format!("query socket: {e}"))?;
        let total = workload.len() as u64;
        readers.push(std::thread::spawn(move || {
            engine_replies(reader, &mut q, &shared, &stop, total)
        }));
    }

    let bar = indicatif::ProgressBar::new(workload.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} finished  {msg}",
        )
        .map_err(|e| e.to_string())?
        .progress_chars("=> "),
    );
    if args.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let started = Instant::now();
    let mut rtt = Histogram::default();
    let mut integral = LoadIntegral::new(n_engines);
    let mut last_sample = Instant::now() - Duration::from_secs(1);
    let mut sent = 0u64;
    let mut session = String::new();
    let mut tokens: Vec<u32> = Vec::new();
    let sim_us = |t: Instant| (t.duration_since(started).as_secs_f64() * 1e6 * args.speed) as u64;
    let sample = |control: &mut Query, integral: &mut LoadIntegral, now_sim: u64| {
        if let Ok(w) = control.ask(&Request::Workers) {
            for x in w["workers"].as_array().into_iter().flatten() {
                let id = x["worker_id"].as_u64().unwrap_or(0) as usize;
                if (1..=n_engines).contains(&id) {
                    let a = x["active_requests"].as_u64().unwrap_or(0) as u32;
                    integral.observe(id - 1, now_sim, a);
                }
            }
        }
    };
    let progress = |bar: &indicatif::ProgressBar, sent: u64| {
        let done = shared.finished.load(Ordering::Relaxed);
        let secs = started.elapsed().as_secs_f64().max(1e-3);
        let prompt = shared.prompt.load(Ordering::Relaxed).max(1);
        bar.set_position(done);
        bar.set_message(format!(
            "sent {sent} ({:.1}/s)  done {:.1}/s  prefix hit {:.1} %",
            sent as f64 / secs,
            done as f64 / secs,
            shared.cached.load(Ordering::Relaxed) as f64 * 100.0 / prompt as f64
        ));
    };
    for (i, r) in workload.iter().enumerate() {
        let due = started + Duration::from_secs_f64(r.arrival_us as f64 / 1e6 / args.speed);
        while Instant::now() < due {
            if stop.load(Ordering::Relaxed) {
                return Err("interrupted".into());
            }
            if last_sample.elapsed() >= Duration::from_millis(100) {
                sample(&mut control, &mut integral, sim_us(Instant::now()));
                progress(&bar, sent);
                last_sample = Instant::now();
            }
            std::thread::sleep(
                due.saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(20)),
            );
        }
        session.clear();
        session.push_str(&format!("s{}", r.session.unwrap_or(i as u64)));
        let t = Instant::now();
        // vLLM engines are read by their token ids: the frontend sends the
        // same tokens the engines publish for each block.
        if vllm {
            tokens.clear();
            for &h in &r.hashes {
                tokens.extend(kvedge_mock::vllm_feed::block_tokens(h, params.block_size));
            }
        }
        let ids = if vllm {
            Ids::tokens(&tokens)
        } else {
            Ids::hashes(&r.hashes)
        };
        let reply = control
            .ask(&Request::Select(Select {
                prompt_tokens: Some(r.prompt_tokens()),
                session: Some(session.as_str()),
                ..Select::new(MODEL, Role::Aggregated, ids)
            }))
            .map_err(|e| format!("select: {e}"))?;
        rtt.record(t.elapsed().as_nanos() as u64);
        sent += 1;
        let (Some(worker), Some(router_id)) =
            (reply["worker_id"].as_u64(), reply["request_id"].as_u64())
        else {
            shared.errors.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let Some(w) = (worker as usize)
            .checked_sub(1)
            .filter(|&w| w < writers.len())
        else {
            shared.errors.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        shared.records.lock().unwrap_or_else(|e| e.into_inner())[i].router_id = router_id;
        shared
            .prompt
            .fetch_add(u64::from(r.prompt_tokens()), Ordering::Relaxed);
        let line = json!({"id": i, "hashes": r.hashes, "prompt_tokens": r.prompt_tokens(),
            "output_tokens": r.output_tokens});
        if writers[w]
            .write_all(format!("{line}\n").as_bytes())
            .is_err()
        {
            return Err(format!(
                "engine {} went away:\n{}",
                w + 1,
                tail(&dir.join(format!("engine-{}.log", w + 1)))
            ));
        }
        shared.records.lock().unwrap_or_else(|e| e.into_inner())[i].dispatched = true;
    }
    // Drain: everything dispatched finishes.
    let dispatched = shared
        .records
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|r| r.dispatched)
        .count() as u64;
    let drain_limit = Duration::from_secs_f64(600.0 / args.speed).max(Duration::from_secs(30));
    let drain_start = Instant::now();
    while shared.finished.load(Ordering::Relaxed) < dispatched {
        if stop.load(Ordering::Relaxed) {
            return Err("interrupted".into());
        }
        if drain_start.elapsed() > drain_limit {
            return Err(format!(
                "{} of {dispatched} requests did not finish in {drain_limit:?}",
                dispatched - shared.finished.load(Ordering::Relaxed)
            ));
        }
        if last_sample.elapsed() >= Duration::from_millis(100) {
            sample(&mut control, &mut integral, sim_us(Instant::now()));
            progress(&bar, sent);
            last_sample = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    progress(&bar, sent);
    bar.finish();
    let wall = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        let _ = r.join();
    }
    // Every reservation released?
    let stats = control
        .ask(&Request::Stats)
        .map_err(|e| format!("stats: {e}"))?;
    let records = shared
        .records
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let outcomes: Vec<Outcome> = workload
        .iter()
        .zip(&records)
        .filter(|(_, rec)| rec.e2e_ms.is_some())
        .map(|(r, rec)| outcome(r, rec))
        .collect();
    let end_sim = sim_us(Instant::now());
    let summary = summarise("default (demo)", &outcomes, oracle, &integral, &[]);
    let pids: Vec<u32> = cleanup.children.iter().map(Child::id).collect();
    let released = records.iter().filter(|r| r.released == 2).count();
    let result = json!({
        "requests": workload.len(),
        "answered": sent - shared.errors.load(Ordering::Relaxed),
        "dispatched": dispatched,
        "first_tokens": shared.first_tokens.load(Ordering::Relaxed),
        "finished": shared.finished.load(Ordering::Relaxed),
        "released": released,
        "errors": shared.errors.load(Ordering::Relaxed),
        "wall_s": wall.as_secs_f64(),
        "summary": &summary,
        "oracle_hit_rate": oracle,
        "daemon": stats,
        "client_select_round_trip": rtt.summary(),
        "runtime_dir": dir,
        "pids": pids,
        "simulated_s": end_sim as f64 / 1e6,
    });
    drop(control);
    drop(writers);
    drop(cleanup);
    if args.json {
        return Ok(result.to_string());
    }
    let lat = &result["daemon"]["select_latency"];
    let rt = &result["client_select_round_trip"];
    Ok(format!(
        "kvedge demo: {} mock engines{}, {} requests in {:.1} s ({:.0} simulated s at speed {})\n{}\
         daemon: {} selects, {} errors; router core per select: p50 {:.1} µs, p90 {:.1} µs, p99 {:.1} µs\n\
         client select round trip (JSON over query.sock): p50 {:.1} µs, p99 {:.1} µs\n\
         all {} requests answered, dispatched and finished; {} reservations released; processes and {} removed\n",
        n_engines,
        if vllm {
            " (vLLM feeds: ZeroMQ events, Prometheus load)"
        } else {
            ""
        },
        workload.len(),
        wall.as_secs_f64(),
        end_sim as f64 / 1e6,
        args.speed,
        table(std::slice::from_ref(&summary), oracle),
        result["daemon"]["selects"],
        result["daemon"]["errors"],
        lat["p50_us"].as_f64().unwrap_or(0.0),
        lat["p90_us"].as_f64().unwrap_or(0.0),
        lat["p99_us"].as_f64().unwrap_or(0.0),
        rt["p50_us"].as_f64().unwrap_or(0.0),
        rt["p99_us"].as_f64().unwrap_or(0.0),
        result["finished"],
        released,
        dir.display(),
    ))
}

fn outcome(r: &TraceRequest, rec: &Record) -> Outcome {
    let ms = |x: Option<f64>| (x.unwrap_or(0.0) * 1e3) as u64;
    Outcome {
        arrival_us: r.arrival_us,
        first_token_us: r.arrival_us + ms(rec.ttft_ms),
        finish_us: r.arrival_us + ms(rec.e2e_ms),
        prompt_tokens: r.prompt_tokens(),
        cached_tokens: rec.cached_tokens,
        output_tokens: r.output_tokens,
    }
}

/// Reads an engine's replies; releases each request in the daemon.
fn engine_replies(
    reader: UnixStream,
    q: &mut Query,
    shared: &Shared,
    stop: &AtomicBool,
    total: u64,
) {
    let mut reader = BufReader::new(reader);
    let mut line = String::new();
    while !stop.load(Ordering::Relaxed) && shared.finished.load(Ordering::Relaxed) < total {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(_) => return,
        }
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            shared.errors.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let Some(id) = v["id"].as_u64() else {
            shared.errors.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let (release, finished) = {
            let mut records = shared.records.lock().unwrap_or_else(|e| e.into_inner());
            let Some(rec) = records.get_mut(id as usize) else {
                continue;
            };
            match v["event"].as_str() {
                Some("first_token") => {
                    rec.ttft_ms = v["ttft_ms"].as_f64();
                    rec.cached_tokens = v["cached_tokens"].as_u64().unwrap_or(0) as u32;
                    shared
                        .cached
                        .fetch_add(u64::from(rec.cached_tokens), Ordering::Relaxed);
                    shared.first_tokens.fetch_add(1, Ordering::Relaxed);
                    (
                        Request::PrefillDone {
                            request_id: rec.router_id,
                        },
                        false,
                    )
                }
                Some("finished") => {
                    rec.e2e_ms = v["e2e_ms"].as_f64();
                    (
                        Request::Finish {
                            request_id: rec.router_id,
                        },
                        true,
                    )
                }
                _ => {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
        };
        let ok = q.ask(&release).is_ok_and(|r| r["ok"] == true);
        let mut records = shared.records.lock().unwrap_or_else(|e| e.into_inner());
        if ok {
            records[id as usize].released += 1;
        }
        if finished {
            shared.finished.fetch_add(1, Ordering::Relaxed);
        }
    }
}
