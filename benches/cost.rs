//! What `kvedge run` costs in CPU when little happens: four mock engines
//! publishing as vLLM does (ZeroMQ events, replay, Prometheus metrics), the
//! endpoint picker on, and first no request at all for 10 s, then dry-run
//! selects paced at 10 a second for 10 s over the JSON socket. The
//! daemon's CPU time (user and system, all threads) comes from
//! `/proc/<pid>/stat`, and the threads that used it are named. With
//! `--baseline <kvedge binary>` a second build runs the same scenarios,
//! alternating with the first in each run, so that the machine's drift
//! hits both alike.
//!
//! Not criterion: what is measured is CPU time over wall-clock seconds of a
//! separate process, not the time of an operation.
//!
//! With `--warm-us N` both builds run with `daemon.warm_us: N`.
//!
//! `cargo build --release --bin kvedge && cargo bench --bench cost [-- --kvedge <path>] [--baseline <path>] [--runs N] [--warm-us N]`

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvedge_epp::testing::free_port;
use serde_json::{Value, json};

const ENGINES: u64 = 4;
const MEASURE: Duration = Duration::from_secs(10);
const PACE: Duration = Duration::from_millis(100);
/// Clock ticks a second (`getconf CLK_TCK`).
const TICKS_PER_S: f64 = 100.0;

/// Children killed on drop.
struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for c in self.0.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn ticks(stat: &Path) -> u64 {
    let text = std::fs::read_to_string(stat).unwrap_or_default();
    let Some(close) = text.rfind(')') else {
        return 0;
    };
    let fields: Vec<&str> = text[close + 2..].split_whitespace().collect();
    let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    field(11).unwrap_or(0) + field(12).unwrap_or(0)
}

/// Each thread's name and CPU ticks.
fn threads(pid: u32) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in dir.flatten() {
            let name = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            out.push((name.trim().to_owned(), ticks(&t.path().join("stat"))));
        }
    }
    out
}

/// CPU ms per second over `during`, and the threads that used any.
fn cpu(pid: u32, during: impl FnOnce()) -> (f64, String) {
    let before = threads(pid);
    let t0 = Instant::now();
    during();
    let after = threads(pid);
    let s = t0.elapsed().as_secs_f64();
    let mut total = 0.0;
    let mut named = Vec::new();
    for ((name, a), (_, b)) in before.iter().zip(&after) {
        let ms = b.saturating_sub(*a) as f64 * 1000.0 / TICKS_PER_S / s;
        total += ms;
        if ms > 0.0 {
            named.push(format!("{name} {ms:.1}"));
        }
    }
    (total, named.join(", "))
}

fn ask(query: &Path, v: &Value) -> Value {
    let Ok(mut s) = UnixStream::connect(query) else {
        return Value::Null;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = writeln!(s, "{v}");
    let mut line = String::new();
    let _ = BufReader::new(s).read_line(&mut line);
    serde_json::from_str(&line).unwrap_or(Value::Null)
}

/// One scenario run with `kvedge`: (idle ms/s, threads), (paced ms/s,
/// threads).
fn run(kvedge: &Path, daemon_section: &str) -> ((f64, String), (f64, String)) {
    let dir = tempfile::tempdir().unwrap();
    let ip = Ipv4Addr::LOCALHOST;
    let mut procs = Processes(Vec::new());
    let mut entries = String::new();
    for worker in 1..=ENGINES {
        let [events, replay, metrics] = [0; 3].map(|_| free_port(ip));
        procs.0.push(
            Command::new(kvedge)
                .arg("mock-engine")
                .args(["--worker-id", &worker.to_string(), "--model", "m"])
                .arg("--listen")
                .arg(dir.path().join(format!("e{worker}.sock")))
                .args(["--vllm-events", &format!("tcp://{ip}:{events}")])
                .args(["--vllm-replay", &format!("tcp://{ip}:{replay}")])
                .args(["--vllm-metrics", &format!("{ip}:{metrics}")])
                .stderr(Stdio::null())
                .spawn()
                .expect("the kvedge binary (cargo build --release --bin kvedge)"),
        );
        entries.push_str(&format!(
            "  - kind: vllm\n    model: m\n    worker_id: {worker}\n    block_size: 16\n    endpoint: http://engine-{worker}\n    events: tcp://{ip}:{events}\n    replay: tcp://{ip}:{replay}\n    metrics: http://{ip}:{metrics}/metrics\n"
        ));
    }
    let epp = free_port(ip);
    let config = dir.path().join("k.yaml");
    std::fs::write(
        &config,
        format!(
            "{daemon_section}epp:\n  listen: 127.0.0.1:{epp}\n  approximate_chunk_bytes: 64\n  models:\n    - name: m\nengines:\n{entries}"
        ),
    )
    .unwrap();
    let daemon = Command::new(kvedge)
        .arg("run")
        .arg("--config")
        .arg(&config)
        .arg("--runtime-dir")
        .arg(dir.path())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = daemon.id();
    procs.0.push(daemon);
    let query = dir.path().join("query.sock");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let workers = ask(&query, &json!({"op": "workers"}));
        let up = workers["workers"]
            .as_array()
            .map_or(0, |w| w.iter().filter(|w| w["available"] == true).count());
        if up == ENGINES as usize {
            break;
        }
        assert!(Instant::now() < deadline, "the engines did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(3));
    let idle = cpu(pid, || std::thread::sleep(MEASURE));
    let paced = cpu(pid, || {
        let s = UnixStream::connect(&query).unwrap();
        let mut reader = BufReader::new(s.try_clone().unwrap());
        let mut writer = s;
        let start = Instant::now();
        let mut i = 0u32;
        while start.elapsed() < MEASURE {
            let tokens: Vec<u32> = (0..256).map(|t| (t * 7 + i * 13) % 1000).collect();
            let req = json!({"op": "select", "model": "m", "tokens": tokens, "dry_run": true});
            writeln!(writer, "{req}").unwrap();
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            i += 1;
            let due = start + PACE * i;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
    });
    (idle, paced)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let kvedge = arg("--kvedge").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/kvedge"),
        PathBuf::from,
    );
    let baseline = arg("--baseline").map(PathBuf::from);
    let runs: u32 = arg("--runs").and_then(|r| r.parse().ok()).unwrap_or(2);
    let daemon_section = arg("--warm-us")
        .map(|w| format!("daemon:\n  warm_us: {w}\n"))
        .unwrap_or_default();
    println!(
        "{ENGINES} vLLM-style mock engines, the picker on; daemon CPU over {} s.\n",
        MEASURE.as_secs()
    );
    println!(
        "| run | binary | idle, ms of CPU/s | threads | 10 selects/s, ms of CPU/s | threads |"
    );
    println!("|---|---|---|---|---|---|");
    for r in 1..=runs {
        let mut bins = vec![("kvedge", &kvedge)];
        if let Some(b) = &baseline {
            bins.push(("baseline", b));
        }
        for (label, bin) in bins {
            let ((idle, it), (paced, pt)) = run(bin, &daemon_section);
            println!("| {r} | {label} | {idle:.1} | {it} | {paced:.1} | {pt} |");
        }
    }
}
