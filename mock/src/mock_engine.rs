//! `kvedge mock-engine`: the engine model ([`kvedge_sim::engine`]) as a
//! real process. It registers over `control.sock` like any engine, publishes
//! Stored/Removed events exactly when its block pool changes and a Load
//! after every step through its shared-memory ring, answers resync requests
//! from its real block sets, and serves requests on its own Unix socket.
//!
//! Request protocol (JSON lines on `--listen`):
//!
//! ```text
//! -> {"id":7,"hashes":[..],"prompt_tokens":2048,"output_tokens":64}
//! <- {"id":7,"event":"first_token","ttft_ms":41.2,"cached_tokens":1024}
//! <- {"id":7,"event":"token"}         (with --http: each later token)
//! <- {"id":7,"event":"finished","e2e_ms":512.9}
//! <- {"id":7,"error":"..."}            (refused; nothing else changes)
//! ```
//!
//! Times are the engine's, in simulated milliseconds; `--speed` runs the
//! simulated clock that many times faster than the wall clock.
//!
//! With `--http` it also serves the OpenAI endpoints ([`crate::openai`]),
//! each HTTP request becoming one request line on that socket.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvedge_schema::messages::control::Hello;
use kvedge_schema::messages::{Role, Tier};
use kvedge_shm::{Link, Publisher};
use kvedge_sim::engine::{Completion, EngineModel, EngineRequest, KvEvent, Outputs};
use serde::Deserialize;
use serde_json::json;

use crate::EngineArgs;

/// The command's arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct MockEngineArgs {
    #[arg(long)]
    pub worker_id: u64,
    #[arg(long)]
    pub model: String,
    #[arg(long, default_value_t = 0)]
    pub dp_rank: u32,
    /// Where this engine takes requests (a Unix socket it creates).
    #[arg(long)]
    pub listen: PathBuf,
    /// The daemon's runtime directory (its `control.sock`).
    #[arg(long, default_value = "/run/kvedge")]
    pub runtime_dir: PathBuf,
    /// The control socket itself (overrides `--runtime-dir`).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Simulated seconds per wall-clock second.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Publish KV events as vLLM does (a ZeroMQ PUB socket bound here,
    /// e.g. `tcp://127.0.0.1:5557` or `ipc:///run/e1.events`) instead of
    /// registering with the daemon; kvedge's `engines:` section reads it.
    #[arg(long)]
    pub vllm_events: Option<String>,
    /// With `--vllm-events`: vLLM's replay ROUTER socket, bound here.
    #[arg(long, requires = "vllm_events")]
    pub vllm_replay: Option<String>,
    /// With `--vllm-events`: the topic of its batches (vLLM's
    /// `kv_events_config.topic`; vLLM's default is empty).
    #[arg(long, requires = "vllm_events", default_value = "kv-events")]
    pub vllm_topic: String,
    /// With `--vllm-events`: serve vLLM's metric names over HTTP at
    /// host:port (`/metrics`).
    #[arg(long, requires = "vllm_events")]
    pub vllm_metrics: Option<String>,
    /// Also serve the OpenAI endpoints (`/v1/completions`,
    /// `/v1/chat/completions`, streamed or not) over HTTP at host:port,
    /// so a gateway can route real requests here.
    #[arg(long)]
    pub http: Option<String>,
    /// With `--http`: the model's `tokenizer.json`, for text and chat
    /// prompts (without it only token-id prompts are served).
    #[arg(long, requires = "http")]
    pub tokenizer: Option<PathBuf>,
    /// With `--http`: the model's Jinja chat template.
    #[arg(long, requires = "http")]
    pub chat_template: Option<PathBuf>,
    /// With `--http`: also render requests into their prompts' token ids
    /// (`POST /v1/completions/render` and `/v1/chat/completions/render`),
    /// as vLLM started with this flag does; without it they answer 403.
    #[arg(long, requires = "http")]
    pub enable_scale_out: bool,
    /// `bos_token` and `eos_token` for the chat template.
    #[arg(long, default_value = "", requires = "http")]
    pub bos_token: String,
    #[arg(long, default_value = "", requires = "http")]
    pub eos_token: String,
    #[command(flatten)]
    pub engine: EngineArgs,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestLine {
    id: u64,
    hashes: Vec<u64>,
    prompt_tokens: u32,
    output_tokens: u32,
}

struct Conn {
    stream: UnixStream,
    buf: Vec<u8>,
    out: Vec<u8>,
    closed: bool,
}

/// Hashes per Stored/Removed record (well under the ring's record limit).
const CHUNK: usize = 256;

/// Runs the engine until SIGTERM/SIGINT. When the daemon goes away it
/// says so on stderr and registers again once the daemon is back.
pub fn run(args: MockEngineArgs) -> Result<(), String> {
    let params = args.engine.params()?;
    if !(args.speed.is_finite() && args.speed > 0.0) {
        return Err("--speed must be positive".into());
    }
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, Arc::clone(&stop)).map_err(|e| e.to_string())?;
    }
    if args.listen.exists() {
        std::fs::remove_file(&args.listen)
            .map_err(|e| format!("{}: {e}", args.listen.display()))?;
    }
    let listener =
        UnixListener::bind(&args.listen).map_err(|e| format!("{}: {e}", args.listen.display()))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let _cleanup = RemoveOnDrop(args.listen.clone());
    let hello = Hello {
        worker_id: args.worker_id,
        dp_rank: args.dp_rank,
        model: args.model.clone(),
        role: Role::Aggregated,
        block_size: params.block_size,
        kv_blocks: [
            u64::from(params.device_blocks),
            u64::from(params.host_blocks),
            0,
        ],
        labels: vec![],
        taints: vec![],
        endpoint: format!("unix:{}", args.listen.display()),
        ring_capacity: 0,
    };
    // The token ids of blocks HTTP requests brought, for vLLM-format
    // events (several pools' worth: see `BlockTokens`).
    let blocks = Arc::new(std::sync::Mutex::new(crate::openai::BlockTokens::new(
        4 * (params.device_blocks as usize + params.host_blocks as usize),
    )));
    if let Some(addr) = &args.http {
        let models = crate::openai::load_models(
            &args.model,
            args.tokenizer.as_deref(),
            args.chat_template.as_deref(),
            &args.bos_token,
            &args.eos_token,
        )?;
        crate::openai::serve(
            addr,
            crate::openai::Front {
                worker_id: args.worker_id,
                model: args.model.clone(),
                block_size: params.block_size,
                engine: args.listen.clone(),
                blocks: Arc::clone(&blocks),
                scale_out: args.enable_scale_out,
            },
            models,
        )?;
    }
    let mut feed = match &args.vllm_events {
        Some(events) => Feed::Vllm(Box::new(crate::vllm_feed::VllmFeed::bind(
            &crate::vllm_feed::Sockets {
                events,
                replay: args.vllm_replay.as_deref(),
                metrics: args.vllm_metrics.as_deref(),
                topic: &args.vllm_topic,
            },
            params.block_size,
            u64::from(params.device_blocks),
            args.worker_id,
            Arc::clone(&blocks),
        )?)),
        None => {
            let control = args
                .socket
                .clone()
                .unwrap_or_else(|| args.runtime_dir.join("control.sock"));
            Feed::Ring(Box::new(
                Link::connect(&control, hello.clone())
                    .map_err(|e| format!("{}: {e}", control.display()))?,
            ))
        }
    };
    let mut engine = EngineModel::new(params);
    // The OpenAI front streams one event a token, as vLLM does.
    engine.report_tokens(args.http.is_some());
    let start = Instant::now();
    let sim_now = |speed: f64| (start.elapsed().as_secs_f64() * 1e6 * speed) as u64;
    // Connections by a number of their own (never reused), so that one
    // that closed can go, descriptor and all, while requests of others
    // are in flight.
    let mut conns: HashMap<u64, Conn> = HashMap::new();
    let mut next_conn = 0u64;
    // Request id -> (connection, arrival in simulated µs).
    let mut owners: HashMap<u64, (u64, u64)> = HashMap::new();
    let mut out = Outputs::default();
    let mut next_step: Option<u64> = None;
    while !stop.load(Ordering::Relaxed) {
        // New connections and request lines.
        loop {
            match listener.accept() {
                Ok((s, _)) => {
                    if s.set_nonblocking(true).is_ok() {
                        next_conn += 1;
                        conns.insert(
                            next_conn,
                            Conn {
                                stream: s,
                                buf: Vec::new(),
                                out: Vec::new(),
                                closed: false,
                            },
                        );
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(format!("accept: {e}")),
            }
        }
        let now = sim_now(args.speed);
        let mut submitted = false;
        for (&ci, c) in conns.iter_mut() {
            read_available(c);
            while let Some(pos) = c.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = c.buf.drain(..=pos).collect();
                let reply = match serde_json::from_slice::<RequestLine>(&line) {
                    Err(e) => Some(json!({"id": null, "error": e.to_string()})),
                    Ok(r) if owners.contains_key(&r.id) => {
                        Some(json!({"id": r.id, "error": "duplicate request id"}))
                    }
                    Ok(r) => {
                        let id = r.id;
                        match engine.submit(
                            EngineRequest {
                                id,
                                hashes: r.hashes,
                                prompt_tokens: r.prompt_tokens,
                                output_tokens: r.output_tokens,
                            },
                            now,
                        ) {
                            Ok(()) => {
                                owners.insert(id, (ci, now));
                                submitted = true;
                                None
                            }
                            Err(e) => Some(json!({"id": id, "error": e.to_string()})),
                        }
                    }
                };
                if let Some(v) = reply {
                    c.out.extend_from_slice(format!("{v}\n").as_bytes());
                }
            }
        }
        // Steps due.
        if submitted || next_step.is_some_and(|t| t <= now) {
            out.clear();
            next_step = engine.advance(now, &mut out);
            match &mut feed {
                Feed::Ring(link) => {
                    // While the daemon is away the events go nowhere:
                    // registering again publishes what is held.
                    if let Some(p) = link.publisher() {
                        publish(p, &out)?;
                        link.sent(Instant::now());
                    }
                }
                Feed::Vllm(v) => {
                    v.publish(&out.events)?;
                    if let Some(l) = out.loads.last() {
                        v.set_load(l);
                    }
                }
            }
            for c in &out.completions {
                let (id, line) = match *c {
                    Completion::FirstToken {
                        id,
                        at_us,
                        cached_tokens,
                    } => {
                        let arrival = owners.get(&id).map_or(at_us, |o| o.1);
                        (
                            id,
                            json!({"id": id, "event": "first_token",
                                "ttft_ms": at_us.saturating_sub(arrival) as f64 / 1e3,
                                "cached_tokens": cached_tokens}),
                        )
                    }
                    Completion::Token { id, .. } => (id, json!({"id": id, "event": "token"})),
                    Completion::Finished { id, at_us } => {
                        let arrival = owners.get(&id).map_or(at_us, |o| o.1);
                        (
                            id,
                            json!({"id": id, "event": "finished",
                                "e2e_ms": at_us.saturating_sub(arrival) as f64 / 1e3}),
                        )
                    }
                };
                let Some(&(ci, _)) = owners.get(&id) else {
                    continue;
                };
                if matches!(c, Completion::Finished { .. }) {
                    owners.remove(&id);
                }
                if let Some(conn) = conns.get_mut(&ci) {
                    conn.out.extend_from_slice(format!("{line}\n").as_bytes());
                }
            }
        }
        for c in conns.values_mut() {
            flush(c);
        }
        // A connection that hung up goes (what its requests still say is
        // dropped: no one is there to read it).
        conns.retain(|_, c| !c.closed);
        // Resync requests: republish every block held, per tier.
        // Over ZeroMQ there is no resync and no heartbeat: the bridge
        // replays and probes.
        let Feed::Ring(link) = &mut feed else {
            let wait_us = match next_step {
                Some(t) => ((t.saturating_sub(sim_now(args.speed))) as f64 / args.speed) as u64,
                None => 50_000,
            }
            .min(50_000);
            wait_readable(&listener, &conns, Duration::from_micros(wait_us));
            continue;
        };
        // The session: heartbeats, resync snapshots, and, when the daemon
        // went away (a restart, a crash), registering again once it is
        // back and telling it every block held.
        let tick = link.tick(Instant::now(), |p| {
            p.publish_cleared(None)?;
            republish(p, &engine)
        });
        if tick.closed {
            eprintln!("kvedge mock-engine: the daemon went away; registering again");
        }
        if tick.registered {
            eprintln!("kvedge mock-engine: registered again");
        }
        // Sleep until the next step is due or a socket has something.
        let wait_us = match next_step {
            Some(t) => ((t.saturating_sub(sim_now(args.speed))) as f64 / args.speed) as u64,
            None => 50_000,
        }
        .min(50_000);
        wait_readable(&listener, &conns, Duration::from_micros(wait_us));
    }
    Ok(())
}

/// Publishes every block the engine holds (after registering again, the
/// daemon knows none of them).
fn republish(p: &mut Publisher, engine: &EngineModel) -> Result<(), kvedge_shm::PublishError> {
    let device: Vec<u64> = engine.device_hashes().collect();
    let host: Vec<u64> = engine.host_hashes().collect();
    for (tier, set) in [(Tier::Device, device), (Tier::Host, host)] {
        for chunk in set.chunks(CHUNK) {
            p.publish_stored_hashes(tier, None, chunk)?;
        }
    }
    Ok(())
}

/// Where the engine's events go.
enum Feed {
    /// kvedge's own ring, registered over control.sock and kept so.
    Ring(Box<Link>),
    /// vLLM's ZeroMQ publisher and metrics (`--vllm-events`).
    Vllm(Box<crate::vllm_feed::VllmFeed>),
}

fn publish(p: &mut Publisher, out: &Outputs) -> Result<(), String> {
    let err = |e: kvedge_shm::PublishError| format!("publish: {e}");
    for e in &out.events {
        match e {
            KvEvent::Stored {
                tier,
                parent,
                hashes,
            } => {
                let mut parent = *parent;
                for chunk in hashes.chunks(CHUNK) {
                    p.publish_stored_hashes(*tier, parent, chunk).map_err(err)?;
                    parent = chunk.last().copied();
                }
            }
            KvEvent::Removed { tier, hashes } => {
                for chunk in hashes.chunks(CHUNK) {
                    p.publish_removed(*tier, chunk).map_err(err)?;
                }
            }
        }
    }
    for l in &out.loads {
        p.publish_load(l).map_err(err)?;
    }
    Ok(())
}

fn read_available(c: &mut Conn) {
    if c.closed {
        return;
    }
    let mut chunk = [0u8; 8192];
    loop {
        match c.stream.read(&mut chunk) {
            Ok(0) => {
                c.closed = true;
                return;
            }
            Ok(n) => c.buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                c.closed = true;
                return;
            }
        }
    }
}

fn flush(c: &mut Conn) {
    while !c.out.is_empty() && !c.closed {
        match c.stream.write(&c.out) {
            Ok(n) => {
                c.out.drain(..n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                c.closed = true;
                c.out.clear();
            }
        }
    }
}

fn wait_readable(listener: &UnixListener, conns: &HashMap<u64, Conn>, timeout: Duration) {
    use rustix::event::{PollFd, PollFlags};
    let mut fds = Vec::with_capacity(1 + conns.len());
    fds.push(PollFd::new(listener, PollFlags::IN));
    for c in conns.values().filter(|c| !c.closed) {
        let flags = if c.out.is_empty() {
            PollFlags::IN
        } else {
            PollFlags::IN | PollFlags::OUT
        };
        fds.push(PollFd::new(&c.stream, flags));
    }
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    let _ = rustix::event::poll(&mut fds, Some(&ts));
}

/// Removes the request socket when the engine exits.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
