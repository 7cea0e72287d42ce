//! `kvedge publish`: a command-line engine. It registers over the control
//! socket, publishes the KV events of a JSON-lines file through its ring,
//! then holds the registration, answering resync requests from what it
//! published, until stdin closes or the hold time passes; when the daemon
//! closes the registration (it restarted, or dropped the engine), it
//! registers again and publishes what it holds. For trying policies by
//! hand and for scripted tests.

use std::collections::BTreeSet;
use std::io::BufRead;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvedge_schema::messages::control::Hello;
use kvedge_schema::messages::{Load, Role, Tier};
use kvedge_shm::control::ProducerSession;
use kvedge_shm::{Link, PublishError, Publisher};
use serde::Deserialize;

/// The command's arguments.
#[derive(Debug, clap::Args)]
pub struct PublishArgs {
    #[arg(long)]
    pub worker_id: u64,
    #[arg(long)]
    pub model: String,
    #[arg(long, default_value_t = 0)]
    pub dp_rank: u32,
    #[arg(long, default_value = "aggregated")]
    pub role: String,
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    #[arg(long, default_value = "")]
    pub endpoint: String,
    /// JSON lines: {"stored":{"tokens":[..]}} or {"stored":{"hashes":[..],"parent":null}}
    /// (optional "tier": device|host|disk), {"removed":{"hashes":[..]}},
    /// {"cleared":{}}, {"load":{"active_requests":3,...}}.
    #[arg(long)]
    pub events: PathBuf,
    /// Seconds to hold the registration (default: until stdin closes).
    #[arg(long)]
    pub hold: Option<f64>,
    /// The daemon's runtime directory (its `control.sock`).
    #[arg(long, default_value = "/run/kvedge")]
    pub runtime_dir: PathBuf,
    /// The control socket itself (overrides `--runtime-dir`).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Print a JSON summary (events published, records dropped) at the end.
    #[arg(long)]
    pub json: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum Line {
    Stored(Stored),
    Removed(Removed),
    Cleared(Cleared),
    Load(LoadLine),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    tokens: Option<Vec<u32>>,
    hashes: Option<Vec<u64>>,
    #[serde(default)]
    parent: Option<u64>,
    #[serde(default)]
    tier: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Removed {
    hashes: Vec<u64>,
    #[serde(default)]
    tier: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Cleared {
    #[serde(default)]
    tier: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct LoadLine {
    active_requests: u32,
    waiting_requests: u32,
    active_prefill_tokens: u64,
    active_decode_blocks: u64,
    kv_used_blocks: u64,
    kv_total_blocks: u64,
}

fn tier(name: Option<&str>) -> Result<Tier, String> {
    match name.unwrap_or("device") {
        "device" => Ok(Tier::Device),
        "host" => Ok(Tier::Host),
        "disk" => Ok(Tier::Disk),
        other => Err(format!("unknown tier `{other}` (device, host, disk)")),
    }
}

/// What this engine holds, per tier, to answer a resync.
#[derive(Default)]
struct Held([BTreeSet<u64>; 3]);

impl Held {
    /// Publishes everything held, after a Cleared (a snapshot's body, or a
    /// new registration's start).
    fn republish(&self, p: &mut Publisher) -> Result<(), PublishError> {
        p.publish_cleared(None)?;
        for (t, set) in Tier::ALL.iter().zip(&self.0) {
            let all: Vec<u64> = set.iter().copied().collect();
            for chunk in all.chunks(64) {
                p.publish_stored_hashes(*t, None, chunk)?;
            }
        }
        Ok(())
    }
}

/// Registers `hello` with the daemon of `runtime_dir` (or at the control
/// socket `socket`) and returns the engine's publisher.
pub fn connect(
    runtime_dir: &std::path::Path,
    socket: Option<&std::path::Path>,
    hello: &Hello,
) -> Result<Publisher, String> {
    let control = socket.map_or_else(|| runtime_dir.join("control.sock"), Into::into);
    let (session, producer) = ProducerSession::connect(&control, hello, Duration::from_secs(5))
        .map_err(|e| format!("{}: {e}", control.display()))?;
    Ok(Publisher::new(Some(session), producer))
}

/// Runs the command; returns a summary of what was published.
pub fn run(args: PublishArgs) -> Result<serde_json::Value, String> {
    let role = match args.role.as_str() {
        "aggregated" => Role::Aggregated,
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        "encode" => Role::Encode,
        other => return Err(format!("unknown role `{other}`")),
    };
    if args.block_size == 0 {
        return Err("--block-size must be positive".into());
    }
    let file =
        std::fs::File::open(&args.events).map_err(|e| format!("{}: {e}", args.events.display()))?;
    let hello = Hello {
        worker_id: args.worker_id,
        dp_rank: args.dp_rank,
        model: args.model,
        role,
        block_size: args.block_size,
        kv_blocks: [0, 0, 0],
        labels: vec![],
        taints: vec![],
        endpoint: args.endpoint,
        ring_capacity: 0,
    };
    let control = args
        .socket
        .clone()
        .unwrap_or_else(|| args.runtime_dir.join("control.sock"));
    let mut link = Link::connect(&control, hello.clone())
        .map_err(|e| format!("{}: {e}", control.display()))?;
    let publisher = link.publisher().expect("registered by connect");
    let mut held = Held::default();
    let mut events = 0u64;
    let publish_err = |e: PublishError| e.to_string();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| e.to_string())?;
        if line.trim().is_empty() {
            continue;
        }
        let at = |m: String| format!("{}:{}: {m}", args.events.display(), n + 1);
        let parsed: Line = serde_json::from_str(&line).map_err(|e| at(e.to_string()))?;
        events += 1;
        match parsed {
            Line::Stored(s) => {
                let t = tier(s.tier.as_deref()).map_err(at)?;
                let hashes = match (s.tokens, s.hashes) {
                    (Some(tokens), None) => kvedge_schema::hash::sequence_hashes(
                        &tokens,
                        hello.block_size as usize,
                        None,
                        None,
                    ),
                    (None, Some(h)) => h,
                    _ => {
                        return Err(at(
                            "`stored` takes exactly one of `tokens` and `hashes`".into()
                        ));
                    }
                };
                publisher
                    .publish_stored_hashes(t, s.parent, &hashes)
                    .map_err(publish_err)?;
                held.0[t as usize].extend(hashes);
            }
            Line::Removed(r) => {
                let t = tier(r.tier.as_deref()).map_err(at)?;
                publisher
                    .publish_removed(t, &r.hashes)
                    .map_err(publish_err)?;
                for h in &r.hashes {
                    held.0[t as usize].remove(h);
                }
            }
            Line::Cleared(c) => {
                let t = c
                    .tier
                    .as_deref()
                    .map(|t| tier(Some(t)))
                    .transpose()
                    .map_err(at)?;
                publisher.publish_cleared(t).map_err(publish_err)?;
                match t {
                    Some(t) => held.0[t as usize].clear(),
                    None => held = Held::default(),
                }
            }
            Line::Load(l) => {
                publisher
                    .publish_load(&Load {
                        active_requests: l.active_requests,
                        waiting_requests: l.waiting_requests,
                        active_prefill_tokens: l.active_prefill_tokens,
                        active_decode_blocks: l.active_decode_blocks,
                        kv_used_blocks: l.kv_used_blocks,
                        kv_total_blocks: l.kv_total_blocks,
                        timestamp_ns: 0,
                    })
                    .map_err(publish_err)?;
            }
        }
    }
    // Hold: the session answers resync requests, heartbeats, and
    // registers again (publishing what is held) whenever the daemon
    // closes the registration.
    let start = Instant::now();
    let done = || match args.hold {
        Some(secs) => start.elapsed().as_secs_f64() >= secs,
        None => stdin_closed(),
    };
    while !done() {
        let tick = link.tick(Instant::now(), |p| held.republish(p));
        if tick.closed {
            eprintln!("kvedge publish: the daemon closed the registration; registering again");
        }
        if tick.registered {
            eprintln!("kvedge publish: registered again");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(serde_json::json!({
        "events": events,
        "dropped_records": link.publisher().map_or(0, |p| p.dropped()),
        "registrations": link.session().registrations(),
    }))
}

/// True once stdin reached end of file (a closed pipe or terminal).
fn stdin_closed() -> bool {
    use rustix::event::{PollFd, PollFlags};
    let stdin = std::io::stdin();
    let mut fds = [PollFd::new(&stdin, PollFlags::IN)];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    if rustix::event::poll(&mut fds, Some(&zero)).unwrap_or(0) == 0 {
        return false;
    }
    let revents = fds[0].revents();
    if revents.contains(PollFlags::HUP) || revents.contains(PollFlags::NVAL) {
        return true;
    }
    // Readable: EOF only if a read returns nothing.
    let mut buf = [0u8; 256];
    matches!(rustix::io::read(&stdin, &mut buf), Ok(0))
}
