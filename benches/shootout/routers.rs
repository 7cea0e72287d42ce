//! The shoot-out's processes: the mock engines every router shares, and
//! each router in front of them (kvedge's picker behind a real Envoy,
//! plain Envoy round robin, sglang-router, vllm-router), with the CPU time
//! and memory of each router's processes read from `/proc`.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvedge_epp::testing::{Bodies, Envoy, VllmNode, free_port, round_robin_config};

/// The engines' shape: the same for every router.
#[derive(Clone, Debug)]
pub struct EngineShape {
    pub engines: u32,
    pub block_size: u32,
    pub device_blocks: u32,
    pub prefill_tokens_per_s: f64,
    pub step_base_us: f64,
    pub max_running: u32,
}

/// Children killed (last first) on drop.
#[derive(Default)]
pub struct Processes(pub Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for c in self.0.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One running mock engine.
pub struct Engine {
    pub http: SocketAddr,
    /// Its `engines:` entry for kvedge.
    pub entry: String,
    /// Its KV event publisher and replay socket (ZeroMQ endpoints).
    pub events: String,
    pub replay: String,
    pub block_size: u32,
}

/// Starts the engines on 127.0.0.2, .3, ...: HTTP front, vLLM events and
/// replay over ZeroMQ, Prometheus metrics.
pub fn start_engines(
    kvedge: &Path,
    dir: &Path,
    tokenizer: &Path,
    shape: &EngineShape,
    procs: &mut Processes,
) -> Result<Vec<Engine>, String> {
    let mut out = Vec::new();
    for worker in 1..=shape.engines {
        let node = VllmNode::new(u64::from(worker));
        let log = std::fs::File::create(dir.join(format!("engine-{worker}.log")))
            .map_err(|e| e.to_string())?;
        procs.0.push(
            node.command(kvedge, dir, tokenizer)
                .args(["--block-size", &shape.block_size.to_string()])
                .args(["--device-blocks", &shape.device_blocks.to_string()])
                .args([
                    "--prefill-tokens-per-s",
                    &shape.prefill_tokens_per_s.to_string(),
                ])
                .args(["--step-base-us", &shape.step_base_us.to_string()])
                .args(["--max-running", &shape.max_running.to_string()])
                // Prompts rendered into token ids on request, which
                // vllm-router's `kv_aware` needs from its engines.
                .arg("--enable-scale-out")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .map_err(|e| format!("{}: {e}", kvedge.display()))?,
        );
        wait_listening(node.http, "a mock engine")?;
        out.push(Engine {
            http: node.http,
            entry: node.entry(shape.block_size),
            events: format!("tcp://{}:{}", node.ip, node.events),
            replay: format!("tcp://{}:{}", node.ip, node.replay),
            block_size: shape.block_size,
        });
    }
    Ok(out)
}

fn wait_listening(addr: SocketAddr, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(addr).is_err() {
        if Instant::now() > deadline {
            return Err(format!("{what} did not listen on {addr}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// As [`wait_listening`], with the process's log (at `log`) in the error.
fn wait_logged(addr: SocketAddr, what: &str, log: &Path) -> Result<(), String> {
    wait_listening(addr, what).map_err(|e| {
        format!(
            "{e}; its log: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
    })
}

/// A router the shoot-out can run.
#[derive(Clone, Debug, PartialEq)]
pub enum Router {
    /// kvedge's picker behind Envoy; `None` is the default policy, else
    /// `TYPE` or `TYPE:key=value,...` (the policy's parameters).
    Kvedge(Option<String>),
    /// kvedge's picker behind Envoy with the response body streamed to it
    /// too (`response_body_mode: STREAMED`), for its first token.
    KvedgeStreamed(Option<String>),
    /// kvedge's own HTTP front door, no Envoy (the policy as above).
    KvedgeHttp(Option<String>),
    EnvoyRoundRobin,
    /// Envoy with the shipped configuration in front of a processor that
    /// picks round robin and does nothing else (`floor.rs`): what the
    /// gateway path costs before any picker's own work.
    EnvoyFloor,
    /// sglang-router with a policy.
    Sglang(String),
    /// vllm-router with a policy.
    Vllm(String),
}

impl Router {
    /// Whether this is a kvedge daemon (behind Envoy or its front door).
    pub fn is_kvedge(&self) -> bool {
        matches!(
            self,
            Router::Kvedge(_) | Router::KvedgeStreamed(_) | Router::KvedgeHttp(_)
        )
    }

    pub fn parse(s: &str) -> Result<Router, String> {
        let (name, policy) = s.split_once(':').unwrap_or((s, ""));
        let policy = (!policy.is_empty()).then(|| policy.to_owned());
        match name {
            "kvedge" => Ok(Router::Kvedge(policy)),
            "kvedge-streamed" => Ok(Router::KvedgeStreamed(policy)),
            "kvedge-http" => Ok(Router::KvedgeHttp(policy)),
            "envoy-rr" => Ok(Router::EnvoyRoundRobin),
            "envoy-floor" => Ok(Router::EnvoyFloor),
            "sglang" => Ok(Router::Sglang(
                policy.unwrap_or_else(|| "cache_aware".into()),
            )),
            "vllm" => Ok(Router::Vllm(policy.unwrap_or_else(|| "cache_aware".into()))),
            _ => Err(format!(
                "unknown router `{s}` (kvedge[:POLICY[:key=value,...]], kvedge-streamed[:POLICY...], kvedge-http[:POLICY...], envoy-rr, envoy-floor, sglang[:POLICY], vllm[:POLICY])"
            )),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Router::Kvedge(None) => "kvedge".into(),
            Router::Kvedge(Some(p)) => format!("kvedge:{p}"),
            Router::KvedgeStreamed(None) => "kvedge-streamed".into(),
            Router::KvedgeStreamed(Some(p)) => format!("kvedge-streamed:{p}"),
            Router::KvedgeHttp(None) => "kvedge-http".into(),
            Router::KvedgeHttp(Some(p)) => format!("kvedge-http:{p}"),
            Router::EnvoyRoundRobin => "envoy-rr".into(),
            Router::EnvoyFloor => "envoy-floor".into(),
            Router::Sglang(p) => format!("sglang:{p}"),
            Router::Vllm(p) => format!("vllm:{p}"),
        }
    }

    pub fn needs_peers(&self) -> bool {
        matches!(self, Router::Sglang(_) | Router::Vllm(_))
    }
}

/// Where the tools are.
pub struct Tools {
    pub kvedge: PathBuf,
    /// More of kvedge's configuration (top-level sections, e.g. `ttft:`
    /// or `daemon:`), put before what the harness writes.
    pub kvedge_extra: String,
    /// More keys for each of kvedge's `engines:` entries (`key: value`
    /// lines, e.g. `scrape_interval_ms: 250`).
    pub entry_extra: Vec<String>,
    pub envoy: Option<String>,
    /// The virtual environment with the peers (its `bin/`).
    pub peers: PathBuf,
}

/// A running router: where it listens and the processes it is.
pub struct Running {
    pub addr: SocketAddr,
    pub pids: Vec<u32>,
    _procs: Processes,
    _envoy: Option<Envoy>,
}

/// Starts `router` in front of `engines`.
pub fn start(
    router: &Router,
    tools: &Tools,
    dir: &Path,
    tokenizer: &Path,
    engines: &[Engine],
) -> Result<Running, String> {
    let mut procs = Processes::default();
    let urls: Vec<String> = engines
        .iter()
        .map(|e| format!("http://{}", e.http))
        .collect();
    let envoy_bin = || {
        tools
            .envoy
            .clone()
            .ok_or("no Envoy: set KVEDGE_ENVOY or pass --envoy")
    };
    let running = match router {
        Router::Kvedge(policy) | Router::KvedgeStreamed(policy) | Router::KvedgeHttp(policy) => {
            let epp = free_port(Ipv4Addr::LOCALHOST);
            // The front door's port, when it is kvedge's own.
            let door =
                matches!(router, Router::KvedgeHttp(_)).then(|| free_port(Ipv4Addr::LOCALHOST));
            let http_listen = door
                .map(|p| format!("  http_listen: 127.0.0.1:{p}\n"))
                .unwrap_or_default();
            let extra: String = tools
                .entry_extra
                .iter()
                .map(|kv| format!("    {kv}\n"))
                .collect();
            let entries: String = engines
                .iter()
                .map(|e| format!("{}{extra}", e.entry))
                .collect();
            let policy = policy
                .as_ref()
                .map(|p| {
                    // `TYPE` or `TYPE:key=value,key=value` (its parameters).
                    let (kind, params) = p.split_once(':').unwrap_or((p, ""));
                    let params: String = params
                        .split(',')
                        .filter_map(|kv| kv.split_once('='))
                        .map(|(k, v)| format!("        {k}: {v}\n"))
                        .collect();
                    let params = if params.is_empty() {
                        params
                    } else {
                        format!("      parameters:\n{params}")
                    };
                    format!(
                        "worker_selection:\n  aggregated: shootout\n  instances:\n    - name: shootout\n      type: {kind}\n{params}"
                    )
                })
                .unwrap_or_default();
            let config = dir.join("kvedge.yaml");
            std::fs::write(
                &config,
                format!(
                    "{}{policy}epp:\n  listen: 127.0.0.1:{epp}\n{http_listen}  models:\n    - name: m\n      tokenizer: {}\nengines:\n{entries}",
                    tools.kvedge_extra,
                    tokenizer.display()
                ),
            )
            .map_err(|e| e.to_string())?;
            let log = std::fs::File::create(dir.join("kvedge.log")).map_err(|e| e.to_string())?;
            procs.0.push(
                Command::new(&tools.kvedge)
                    .arg("run")
                    .arg("--config")
                    .arg(&config)
                    .arg("--runtime-dir")
                    .arg(dir.join("run"))
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .map_err(|e| e.to_string())?,
            );
            let daemon = procs.0[0].id();
            wait_logged(
                SocketAddr::from((Ipv4Addr::LOCALHOST, epp)),
                "kvedge's picker",
                &dir.join("kvedge.log"),
            )?;
            if let Some(port) = door {
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                wait_listening(addr, "kvedge's HTTP front door")?;
                return Ok(Running {
                    addr,
                    pids: vec![daemon],
                    _procs: procs,
                    _envoy: None,
                });
            }
            let bodies = if matches!(router, Router::KvedgeStreamed(_)) {
                Bodies::StreamedResponse
            } else {
                Bodies::Shipped
            };
            let envoy = Envoy::start_with(&envoy_bin()?, dir, epp, false, bodies);
            Running {
                addr: SocketAddr::from((Ipv4Addr::LOCALHOST, envoy.port)),
                pids: vec![daemon, envoy.pid()],
                _procs: procs,
                _envoy: Some(envoy),
            }
        }
        Router::EnvoyRoundRobin => {
            let endpoints: Vec<SocketAddr> = engines.iter().map(|e| e.http).collect();
            let config = round_robin_config(&endpoints);
            let envoy = Envoy::start_config(&envoy_bin()?, dir, &config);
            Running {
                addr: SocketAddr::from((Ipv4Addr::LOCALHOST, envoy.port)),
                pids: vec![envoy.pid()],
                _procs: procs,
                _envoy: Some(envoy),
            }
        }
        Router::EnvoyFloor => {
            let port = free_port(Ipv4Addr::LOCALHOST);
            // Started through a link named `floor`, the process's name in
            // the CPU split.
            let exe = dir.join("floor");
            std::os::unix::fs::symlink(std::env::current_exe().map_err(|e| e.to_string())?, &exe)
                .map_err(|e| e.to_string())?;
            let log = std::fs::File::create(dir.join("floor.log")).map_err(|e| e.to_string())?;
            procs.0.push(
                Command::new(exe)
                    .arg(crate::floor::ARG)
                    .arg(format!("127.0.0.1:{port}"))
                    .args(engines.iter().map(|e| e.http.to_string()))
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .map_err(|e| e.to_string())?,
            );
            let processor = procs.0[0].id();
            wait_logged(
                SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
                "the floor's processor",
                &dir.join("floor.log"),
            )?;
            let envoy = Envoy::start_with(&envoy_bin()?, dir, port, false, Bodies::Shipped);
            Running {
                addr: SocketAddr::from((Ipv4Addr::LOCALHOST, envoy.port)),
                pids: vec![processor, envoy.pid()],
                _procs: procs,
                _envoy: Some(envoy),
            }
        }
        Router::Sglang(policy) | Router::Vllm(policy) => {
            let port = free_port(Ipv4Addr::LOCALHOST);
            let (program, args): (PathBuf, Vec<String>) = match router {
                Router::Sglang(_) => (
                    tools.peers.join("bin/python"),
                    vec!["-m".into(), "sglang_router.launch_router".into()],
                ),
                _ => (tools.peers.join("bin/vllm-router"), Vec::new()),
            };
            // vllm-router's `kv_aware` reads the engines' KV events, as
            // kvedge does: each engine's publisher and replay socket.
            let mut events = Vec::new();
            if matches!(router, Router::Vllm(p) if p == "kv_aware") {
                for (url, e) in urls.iter().zip(engines) {
                    events.push("--kv-event-source".to_owned());
                    events.push(format!("{url}={}", e.events));
                    events.push("--kv-event-replay-source".to_owned());
                    events.push(format!("{url}={}", e.replay));
                }
                events.extend(["--kv-event-model".to_owned(), "m".to_owned()]);
                events.push("--kv-event-block-size".to_owned());
                events.push(engines.first().map_or(16, |e| e.block_size).to_string());
            }
            let log = std::fs::File::create(dir.join("router.log")).map_err(|e| e.to_string())?;
            procs.0.push(
                Command::new(&program)
                    .args(&args)
                    .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                    .arg("--worker-urls")
                    .args(&urls)
                    .args(["--policy", policy])
                    .args(&events)
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .map_err(|e| format!("{}: {e}", program.display()))?,
            );
            let pid = procs.0[0].id();
            wait_logged(
                SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
                "the router",
                &dir.join("router.log"),
            )?;
            Running {
                addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
                pids: vec![pid],
                _procs: procs,
                _envoy: None,
            }
        }
    };
    Ok(running)
}

/// The processes `roots` and all their descendants.
fn tree(roots: &[u32]) -> Vec<u32> {
    let mut parents = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            if let Some(close) = stat.rfind(')') {
                let ppid = stat[close + 2..]
                    .split_whitespace()
                    .nth(1)
                    .and_then(|p| p.parse::<u32>().ok());
                if let Some(ppid) = ppid {
                    parents.push((pid, ppid));
                }
            }
        }
    }
    let mut out: Vec<u32> = roots.to_vec();
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    out
}

/// A process's name (`/proc/<pid>/comm`), or its pid when it is gone.
pub fn name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|n| n.trim().to_owned())
        .unwrap_or_else(|_| pid.to_string())
}

/// CPU time (user and system, all threads) of `roots` and their
/// descendants, in ms.
pub fn cpu_ms(roots: &[u32]) -> f64 {
    let ticks: u64 = tree(roots)
        .iter()
        .map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let Some(close) = stat.rfind(')') else {
                return 0;
            };
            let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
            let n = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
            n(11) + n(12)
        })
        .sum();
    // Clock ticks a second (`getconf CLK_TCK`).
    ticks as f64 * 10.0
}

/// Peak resident memory (VmHWM) of `roots` and their descendants, MiB.
pub fn peak_rss_mib(roots: &[u32]) -> f64 {
    tree(roots)
        .iter()
        .map(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        })
        .sum::<f64>()
        / 1024.0
}
