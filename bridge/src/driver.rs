//! The bridge's I/O: a thread of its own running tokio, where each
//! configured engine rank is an ordinary kvedge engine. A rank registers
//! over `control.sock` like any engine and gets its ring; its ZeroMQ SUB
//! socket feeds a [`Feed`], whose translated events go into the ring; its
//! replay DEALER answers gaps; the engine's `/metrics` become Load records.
//! The routing thread sees nothing but engines and rings.
//!
//! Liveness: a rank heartbeats while its engine shows life (an event, a
//! successful scrape, or, while its events are idle, a probe connection to
//! its PUB socket that succeeds). When none has come for the heartbeat
//! timeout, its blocks are dropped and a `silent` notice takes it out of
//! routing until the engine is heard again. A probe that fails and later
//! succeeds means the engine's socket went away and came back (a restart):
//! the SUB socket is opened again, since the old connection is dead.
//!
//! The sockets are `kvedge-zmtp`'s: every message is capped
//! (`max_message_bytes`) before it is read, and a bound events port takes
//! peers only from its allowed addresses, a few at a time. Which peer's
//! messages count is the [`Feed`]'s decision. Every repeated warning goes
//! through a rate limit, one line a second per kind.

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvedge_config::{EngineRank, EngineSpec};
use kvedge_schema::messages::control::{Hello, Label};
use kvedge_schema::messages::{StoredBlock, Tier, notice};
use kvedge_shm::ratelimit::{RateLimit, held_back};
use kvedge_shm::session::{Action, Session};
use kvedge_shm::{Fencing, Publisher};
use kvedge_zmtp::{Allow, Dealer, Limits, Options, Sub, SubEvent};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinSet;
use tracing::{debug, error, info, warn};

use crate::feed::{Feed, Live, LogKind, Sender};
use crate::scrape::{self, Reading};
use crate::translate::{COUNTED, Sink};

/// What every rank needs from the daemon's configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The daemon's control socket.
    pub control_socket: PathBuf,
    /// `daemon.heartbeat_timeout_ms`.
    pub heartbeat_timeout: Duration,
    /// Blocks remembered per rank at most (`daemon.index_capacity`).
    pub index_capacity: usize,
}

/// Events idle this long start the probes of the PUB socket (one per
/// interval).
const IDLE_PROBE: Duration = Duration::from_secs(1);
/// How long one connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a replay may wait for its next message.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a whole replay may take: one that stalls past it is abandoned
/// (its gap counts as lost, the engine's blocks are dropped and rebuilt
/// from the next live batch), so a replay socket that trickles cannot
/// hold a rank.
pub const REPLAY_DEADLINE: Duration = Duration::from_secs(10);
/// How long a peer of a bound events port may stay silent before it is
/// disconnected (an engine's publisher reconnects at once; a connection
/// held open for nothing does not keep its place).
const BOUND_IDLE: Duration = Duration::from_secs(300);
/// Largest metrics page read (vLLM's is tens of kilobytes).
const MAX_METRICS_PAGE: usize = 16 << 20;
/// Most messages one replay may send (vLLM buffers 10,000 batches); an
/// engine that sends more is cut off and the replay counts as failed.
const MAX_REPLAY_MESSAGES: usize = 100_000;
/// The replay end marker's sequence number.
const END_SEQ: [u8; 8] = [0xff; 8];

/// The running bridge; dropping it stops every rank (their workers leave
/// the daemon).
#[derive(Debug)]
pub struct Bridge {
    configure: Option<mpsc::UnboundedSender<Vec<EngineSpec>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Bridge {
    /// Starts the bridge's thread with `engines`.
    pub fn start(settings: Settings, engines: Vec<EngineSpec>) -> io::Result<Bridge> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(engines);
        let thread = std::thread::Builder::new()
            .name("kvedge-bridge".into())
            .spawn(move || runtime.block_on(supervise(Arc::new(settings), rx)))?;
        Ok(Bridge {
            configure: Some(tx),
            thread: Some(thread),
        })
    }

    /// Applies a reloaded `engines:` section: ranks whose entry changed or
    /// went away stop (their workers leave), new ones start, the rest run
    /// on undisturbed.
    pub fn configure(&self, engines: Vec<EngineSpec>) {
        if let Some(tx) = &self.configure {
            let _ = tx.send(engines);
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.configure = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An entry without its line number (a reload that only moves lines
/// changes nothing).
fn key(spec: &EngineSpec) -> EngineSpec {
    EngineSpec {
        line: None,
        ..spec.clone()
    }
}

async fn supervise(settings: Arc<Settings>, mut rx: mpsc::UnboundedReceiver<Vec<EngineSpec>>) {
    let mut running: Vec<(EngineSpec, tokio::task::JoinHandle<()>)> = Vec::new();
    while let Some(engines) = rx.recv().await {
        let wanted: Vec<EngineSpec> = engines.iter().map(key).collect();
        running.retain(|(spec, task)| {
            let keep = wanted.contains(spec);
            if !keep {
                info!(
                    worker = spec.worker_id,
                    "engine removed from the configuration"
                );
                task.abort();
            }
            keep
        });
        for spec in wanted {
            if !running.iter().any(|(s, _)| *s == spec) {
                let task = tokio::spawn(run_engine(spec.clone(), Arc::clone(&settings)));
                running.push((spec, task));
            }
        }
    }
    for (_, task) in running {
        task.abort();
    }
}

/// What a rank hears from its engine's scraper.
#[derive(Debug, Clone, Default)]
enum Scraped {
    #[default]
    Nothing,
    Read(Reading),
    Failed(String),
}

/// One engine: its ranks and its scraper, restarted together if any of
/// them fails unexpectedly.
async fn run_engine(spec: EngineSpec, settings: Arc<Settings>) {
    loop {
        let mut tasks = JoinSet::new();
        let mut senders = Vec::new();
        let events = Arc::new(Activity::default());
        for rank in spec.ranks() {
            let (tx, rx) = watch::channel(Scraped::Nothing);
            senders.push(tx);
            tasks.spawn(run_rank(
                rank,
                Arc::clone(&settings),
                rx,
                Arc::clone(&events),
            ));
        }
        if let Some(url) = spec.metrics.clone() {
            let pace = ScrapePace::new(&spec, settings.heartbeat_timeout);
            tasks.spawn(run_scraper(spec.clone(), url, senders, pace, events));
        }
        match tasks.join_next().await {
            Some(Err(e)) if e.is_panic() => {
                error!(
                    worker = spec.worker_id,
                    "engine bridge failed ({e}); restarting it"
                );
            }
            _ => warn!(
                worker = spec.worker_id,
                "engine bridge stopped; restarting it"
            ),
        }
        drop(tasks);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// How often an engine's metrics are read: every `scrape_interval_ms`
/// while its load moves or it publishes KV events; while neither, the
/// interval doubles after each read up to `scrape_idle_interval_ms` (and
/// a third of the heartbeat timeout, so that the reads alone keep an idle
/// engine alive). An idle node then costs a few reads a second, not ten
/// per engine. Time is passed in.
#[derive(Debug)]
struct ScrapePace {
    busy: Duration,
    idle: Duration,
    now: Duration,
    last: Option<Vec<Reading>>,
}

impl ScrapePace {
    fn new(spec: &EngineSpec, heartbeat_timeout: Duration) -> Self {
        let busy = Duration::from_millis(spec.scrape_interval_ms);
        let idle = Duration::from_millis(spec.scrape_idle_interval_ms())
            .min(heartbeat_timeout / 3)
            .max(busy);
        ScrapePace {
            busy,
            idle,
            now: busy,
            last: None,
        }
    }

    /// A read gave `readings` (none: it failed); `events` says whether
    /// the engine published since the last read. Returns the wait until
    /// the next read.
    fn read(&mut self, readings: Option<Vec<Reading>>, events: bool) -> Duration {
        let unchanged = readings.is_some() && readings == self.last;
        self.now = if unchanged && !events {
            (self.now * 2).min(self.idle)
        } else {
            self.busy
        };
        self.last = readings;
        self.now
    }

    /// The engine published: the next read is due one busy interval after
    /// the last (`since` ago), at once if that passed.
    fn woken(&mut self, since: Duration) -> Duration {
        self.now = self.busy;
        self.busy.saturating_sub(since)
    }

    fn slowed(&self) -> bool {
        self.now > self.busy
    }
}

/// Whether an engine published KV events since its metrics were last
/// read: set by its ranks, taken by its scraper.
#[derive(Debug, Default)]
struct Activity {
    published: AtomicBool,
    wake: Notify,
}

impl Activity {
    /// A rank heard the engine publish.
    fn published(&self) {
        if !self.published.swap(true, Ordering::Relaxed) {
            // Wakes a scraper that waits at the idle pace; one that does
            // not wait finds the flag at its next read. (Ranks and scraper
            // share one thread: no wake-up falls between the two.)
            self.wake.notify_waiters();
        }
    }

    fn take(&self) -> bool {
        self.published.swap(false, Ordering::Relaxed)
    }
}

/// Reads the engine's metrics at its pace ([`ScrapePace`]) and hands each
/// rank its part.
async fn run_scraper(
    spec: EngineSpec,
    url: String,
    ranks: Vec<watch::Sender<Scraped>>,
    mut pace: ScrapePace,
    events: Arc<Activity>,
) {
    let interval = Duration::from_millis(spec.scrape_interval_ms);
    // No redirects: a metrics endpoint that sends kvedge elsewhere is
    // misconfigured, and following it would let it point kvedge at any
    // host. No proxy either: an `HTTP_PROXY` in the daemon's environment
    // (set for model downloads, say) would otherwise carry every read of a
    // local engine through it, or fail it. The page and the time are capped.
    let client = match reqwest::Client::builder()
        .no_proxy()
        .timeout(interval.max(Duration::from_millis(500)))
        .connect_timeout(CONNECT_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            error!(worker = spec.worker_id, "no HTTP client for {url}: {e}");
            return std::future::pending().await;
        }
    };
    loop {
        let started = tokio::time::Instant::now();
        let text = match client.get(&url).send().await {
            Ok(r) if r.status().is_success() => read_page(r).await,
            Ok(r) if r.status().is_redirection() => Err(format!(
                "HTTP {} (a redirect, which kvedge does not follow: point `metrics` at the page itself)",
                r.status()
            )),
            Ok(r) => Err(format!("HTTP {}", r.status())),
            Err(e) => Err(e.to_string()),
        };
        let readings = text
            .as_ref()
            .ok()
            .map(|t| scrape::read(spec.kind, t, ranks.len()));
        for (rank, tx) in ranks.iter().enumerate() {
            let scraped = match (&text, readings.as_ref().and_then(|r| r.get(rank))) {
                (Ok(_), Some(reading)) if reading.found() => Scraped::Read(*reading),
                (Ok(_), _) => Scraped::Failed(format!(
                    "{url} has none of {}'s load metrics",
                    spec.kind.as_str()
                )),
                (Err(e), _) => Scraped::Failed(format!("{url}: {e}")),
            };
            let _ = tx.send(scraped);
        }
        let wait = pace.read(readings, events.take());
        let next = on_grid(started + wait, interval);
        if pace.slowed() {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                _ = events.wake.notified() => {
                    let wait = pace.woken(started.elapsed());
                    tokio::time::sleep(wait).await;
                }
            }
        } else {
            tokio::time::sleep_until(next).await;
        }
    }
}

/// A rank's housekeeping tick (liveness, notices, heartbeats, the
/// session), four times in a heartbeat timeout and at least every 250 ms, on
/// the process's grid as the scrapers' reads are: every rank's tick comes
/// in the same wake-up of the bridge's thread, and their heartbeats in one
/// of the daemon's, rather than one each. A late tick is skipped, not
/// shifted off the grid.
fn housekeeping(timeout: Duration) -> tokio::time::Interval {
    let period = (timeout / 4)
        .min(Duration::from_millis(250))
        .max(Duration::from_millis(1));
    let mut tick = tokio::time::interval_at(on_grid(tokio::time::Instant::now(), period), period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tick
}

/// The first instant at or after `at` on a grid of `step` shared by every
/// scraper of the process: engines whose reads fall due in the same step
/// are read together, one wake-up of the bridge's thread for all of them
/// rather than one each (on a busy node that was most of the bridge's
/// CPU). A read is never more than one step late.
fn on_grid(at: tokio::time::Instant, step: Duration) -> tokio::time::Instant {
    static EPOCH: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(tokio::time::Instant::now);
    grid_point(at, epoch, step)
}

fn grid_point(
    at: tokio::time::Instant,
    epoch: tokio::time::Instant,
    step: Duration,
) -> tokio::time::Instant {
    let step_ns = step.as_nanos().max(1);
    let since = at.saturating_duration_since(epoch).as_nanos();
    let steps = since.div_ceil(step_ns);
    let ns = u64::try_from(steps * step_ns).unwrap_or(u64::MAX);
    (epoch + Duration::from_nanos(ns)).max(at)
}

/// A metrics page, refused past [`MAX_METRICS_PAGE`] bytes.
async fn read_page(mut response: reqwest::Response) -> Result<String, String> {
    let mut page = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| e.to_string())? {
        if page.len() + chunk.len() > MAX_METRICS_PAGE {
            return Err(format!("a metrics page over {MAX_METRICS_PAGE} bytes"));
        }
        page.extend_from_slice(&chunk);
    }
    String::from_utf8(page).map_err(|_| "a metrics page that is not UTF-8".to_owned())
}

/// The ring side of a rank: translated events become ring records.
struct Ring<'a>(&'a mut Publisher);

impl Sink for Ring<'_> {
    fn stored(&mut self, tier: Tier, blocks: &[StoredBlock], seed: u64) {
        let salt = (seed != kvedge_schema::hash::SEED).then_some(seed);
        for chunk in blocks.chunks(256) {
            // A full ring drops the record; the daemon sees the gap and
            // asks for a snapshot, which `republish` answers.
            let _ = self.0.publish_stored(tier, None, chunk, salt);
        }
    }

    fn removed(&mut self, tier: Tier, hashes: &[u64]) {
        for chunk in hashes.chunks(256) {
            let _ = self.0.publish_removed(tier, chunk);
        }
    }

    fn cleared(&mut self) {
        let _ = self.0.publish_cleared(None);
    }
}

fn hello(rank: &EngineRank) -> Hello {
    Hello {
        worker_id: rank.worker_id,
        dp_rank: rank.dp_rank,
        model: rank.model.clone(),
        role: rank.role,
        block_size: rank.block_size,
        kv_blocks: [0; 3],
        labels: std::iter::once(("engine", rank.kind.as_str()))
            .filter(|(k, _)| !rank.labels.contains_key(*k))
            .chain(rank.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .map(|(key, value)| Label {
                key: key.into(),
                value: value.into(),
            })
            .collect(),
        taints: rank.taints.clone(),
        endpoint: rank.endpoint.clone(),
        ring_capacity: 0,
    }
}

/// Registers the rank with the daemon when its session says so (at once,
/// then backing off from 100 ms to 5 s); the first failure is logged.
async fn register(rank: &EngineRank, settings: &Settings, session: &mut Session) -> Publisher {
    let mut logged = false;
    loop {
        if let Some(Action::Register) = session.poll_action(Instant::now()) {
            let control = settings.control_socket.clone();
            let h = hello(rank);
            // Full fences: the bridge commits an engine's messages and
            // load reads, about as often as the routing loop sleeps, which
            // would otherwise run a membarrier (an interrupt on every CPU
            // running the daemon) before each sleep.
            let done = tokio::task::spawn_blocking(move || {
                Publisher::connect_with(
                    &control,
                    &h,
                    kvedge_shm::session::REGISTER_TIMEOUT,
                    Fencing::Full,
                )
            })
            .await;
            match done {
                Ok(Ok(p)) => {
                    let interval = p
                        .session()
                        .map_or(1000, |s| s.welcome().heartbeat_interval_ms);
                    session.handle_registered(Instant::now(), interval);
                    return p;
                }
                Ok(Err(e)) => {
                    if !std::mem::replace(&mut logged, true) {
                        warn!(
                            worker = rank.worker_id,
                            dp_rank = rank.dp_rank,
                            "cannot register with the daemon ({e}); retrying"
                        );
                    }
                    session.handle_register_failed(Instant::now());
                }
                Err(_) => session.handle_register_failed(Instant::now()),
            }
        }
        let wait = session
            .poll_timeout()
            .map_or(Duration::from_millis(100), |t| {
                t.saturating_duration_since(Instant::now())
            });
        tokio::time::sleep(wait).await;
    }
}

/// The socket options of a rank's sockets.
fn options(rank: &EngineRank, allow: Allow) -> Options {
    Options {
        limits: Limits {
            max_frame_bytes: rank.max_message_bytes,
            max_message_bytes: rank.max_message_bytes,
            // topic, sequence number, payload (and a replay's envelope).
            max_message_frames: 8,
        },
        connect_timeout: CONNECT_TIMEOUT,
        max_peers: rank.events_max_peers,
        allow,
        idle_timeout: rank.events_bind.then_some(BOUND_IDLE),
        ..Options::default()
    }
}

/// The addresses a bound events port takes peers from: each entry of
/// `events_allow` as an address, a range, or a host name looked up now
/// (a name that does not resolve is logged and left out).
async fn allow_list(rank: &EngineRank) -> Allow {
    let mut nets = Vec::new();
    for entry in &rank.events_allow {
        if let Ok(net) = entry.parse::<ipnet::IpNet>() {
            nets.push(net);
        } else if let Ok(ip) = entry.parse::<std::net::IpAddr>() {
            nets.push(ipnet::IpNet::from(ip));
        } else {
            match tokio::net::lookup_host((entry.as_str(), 0)).await {
                Ok(addrs) => nets.extend(addrs.map(|a| ipnet::IpNet::from(a.ip().to_canonical()))),
                Err(e) => warn!(
                    worker = rank.worker_id,
                    dp_rank = rank.dp_rank,
                    "events_allow: `{entry}` does not resolve ({e}); no connection from it is taken"
                ),
            }
        }
    }
    Allow::only(nets)
}

async fn open_sub(rank: &EngineRank, allow: &Allow) -> Result<Sub, String> {
    let topics = [rank.topic.as_bytes()];
    let options = options(rank, allow.clone());
    let opened = if rank.events_bind {
        Sub::bind(&rank.events, &topics, &options).await
    } else {
        Sub::connect(&rank.events, &topics, &options).await
    };
    opened.map_err(|e| format!("{}: {e}", rank.events))
}

/// A live message's sequence number and payload, if it has the engines'
/// three-frame shape.
fn frames(msg: &[Bytes]) -> Result<(u64, Bytes), String> {
    let [_, seq, payload] = msg else {
        return Err(format!(
            "a message of {} frames, not 3 (topic, seq, payload)",
            msg.len()
        ));
    };
    Ok((seq_of(seq)?, payload.clone()))
}

fn seq_of(frame: &[u8]) -> Result<u64, String> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| format!("a sequence number of {} bytes, not 8", frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// How a replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReplayEnd {
    /// Its end marker arrived within [`REPLAY_DEADLINE`].
    Complete,
    /// It timed out, stalled past its deadline, or broke off.
    Incomplete,
    /// Nothing accepted a connection at the replay socket: the engine is
    /// not there.
    Unreachable,
}

/// Asks the replay socket for every batch from `from` on and hands them
/// to the feed.
async fn replay(
    rank: &EngineRank,
    endpoint: &str,
    from: u64,
    feed: &mut Feed,
    publisher: &mut Publisher,
) -> ReplayEnd {
    let run = async {
        let options = options(rank, Allow::loopback());
        let Ok(mut dealer) = Dealer::connect(endpoint, &options).await else {
            return ReplayEnd::Unreachable;
        };
        if dealer.send(&[&b""[..], &from.to_be_bytes()]).await.is_err() {
            return ReplayEnd::Incomplete;
        }
        for _ in 0..MAX_REPLAY_MESSAGES {
            let msg = match tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv()).await {
                Ok(Ok(m)) => m,
                _ => return ReplayEnd::Incomplete,
            };
            // ["", seq, payload] (older engines) or ["", topic, seq, payload].
            let (seq, payload) = match msg.as_slice() {
                [_, seq, payload] | [_, _, seq, payload] => (seq, payload),
                _ => return ReplayEnd::Incomplete,
            };
            if seq.as_ref() == END_SEQ {
                return ReplayEnd::Complete;
            }
            let Ok(seq) = seq_of(seq) else {
                return ReplayEnd::Incomplete;
            };
            feed.handle_replayed(seq, payload, &mut Ring(publisher));
        }
        ReplayEnd::Incomplete
    };
    tokio::time::timeout(REPLAY_DEADLINE, run)
        .await
        .unwrap_or(ReplayEnd::Incomplete)
}

/// Hands a live message to the feed, and runs the replays it asks for
/// one after another.
async fn feed_live(
    rank: &EngineRank,
    from: Sender,
    seq: u64,
    payload: &[u8],
    feed: &mut Feed,
    publisher: &mut Publisher,
) -> Live {
    let step = feed.handle_live(from, seq, payload, &mut Ring(publisher));
    replays(rank, step, feed, publisher).await
}

/// Runs the replays the feed asks for, one after another; the last step.
async fn replays(
    rank: &EngineRank,
    mut step: Live,
    feed: &mut Feed,
    publisher: &mut Publisher,
) -> Live {
    while let Live::Replay { from } = step {
        let end = match &rank.replay {
            Some(endpoint) => replay(rank, endpoint, from, feed, publisher).await,
            None => ReplayEnd::Incomplete,
        };
        step = match end {
            ReplayEnd::Unreachable => feed.handle_replay_unreachable(&mut Ring(publisher)),
            end => feed.handle_replay_end(end == ReplayEnd::Complete, &mut Ring(publisher)),
        };
    }
    step
}

/// Whether something accepts connections at `endpoint` (the engine's PUB
/// socket, for a connecting SUB).
async fn probe(endpoint: &str) -> bool {
    let attempt = async {
        if let Some(path) = endpoint.strip_prefix("ipc://") {
            tokio::net::UnixStream::connect(path).await.map(drop)
        } else {
            let addr = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
            tokio::net::TcpStream::connect(addr).await.map(drop)
        }
    };
    matches!(
        tokio::time::timeout(CONNECT_TIMEOUT, attempt).await,
        Ok(Ok(()))
    )
}

/// Whether a rank's engine counts as alive, from every signal it gives:
/// when it was last heard (an event, a scrape, an accepted probe or
/// connection), whether its events connection is down and since when,
/// whether its metrics reads have been failing and since when; and
/// whether the rank has declared it silent (out of routing, its blocks
/// dropped) until those signals say otherwise.
#[derive(Debug)]
struct Liveness {
    timeout: Duration,
    /// Zero: only silence counts.
    down_after: Duration,
    heard: Option<Instant>,
    /// Whether the events connection was ever made: one never made is an
    /// engine that does not publish (routed on its load alone), not one
    /// that went down.
    events_seen: bool,
    events_down: Option<Instant>,
    scrapes_failing: Option<Instant>,
    silent: bool,
}

/// What [`Liveness::check`] found changed.
#[derive(Debug, PartialEq, Eq)]
enum Change {
    /// The engine is dead to routing now, for this reason.
    Silent(String),
    /// The engine is alive again.
    Back,
}

impl Liveness {
    fn new(timeout: Duration, down_after: Duration) -> Liveness {
        Liveness {
            timeout,
            down_after,
            heard: None,
            events_seen: false,
            events_down: None,
            scrapes_failing: None,
            silent: false,
        }
    }

    fn hear(&mut self, now: Instant) {
        self.heard = Some(now);
    }

    /// The events connection is (again) made, or a message came over it.
    fn events_up(&mut self, now: Instant) {
        self.events_seen = true;
        self.events_down = None;
        self.hear(now);
    }

    /// The events connection closed, or could not be made again (the
    /// first time counts).
    fn events_lost(&mut self, now: Instant) {
        if self.events_seen {
            self.events_down.get_or_insert(now);
        }
    }

    fn scrape_read(&mut self, now: Instant) {
        self.scrapes_failing = None;
        self.hear(now);
    }

    fn scrape_failed(&mut self, now: Instant) {
        self.scrapes_failing.get_or_insert(now);
    }

    /// Why the engine counts as dead at `now`, if it does.
    fn dead(&self, now: Instant) -> Option<String> {
        let down_for = |since: Option<Instant>| {
            since
                .map(|t| now.duration_since(t))
                .filter(|d| !self.down_after.is_zero() && *d >= self.down_after)
        };
        if let Some(d) = down_for(self.events_down) {
            return Some(format!(
                "its events connection has been closed for {:.1} s",
                d.as_secs_f64()
            ));
        }
        if let Some(d) = down_for(self.scrapes_failing) {
            return Some(format!(
                "its metrics have not been read for {:.1} s",
                d.as_secs_f64()
            ));
        }
        match self.heard {
            Some(h) if now.duration_since(h) < self.timeout => None,
            _ => Some(format!(
                "no events, metrics or connection from the engine for {:?}",
                self.timeout
            )),
        }
    }

    fn alive(&self, now: Instant) -> bool {
        self.dead(now).is_none()
    }

    /// Whether the engine has just gone dead (once per death, and only
    /// after it was heard at all) or come back.
    fn check(&mut self, now: Instant) -> Option<Change> {
        match (self.silent, self.dead(now)) {
            (false, Some(why)) if self.heard.is_some() => {
                self.silent = true;
                Some(Change::Silent(why))
            }
            (true, None) => {
                self.silent = false;
                Some(Change::Back)
            }
            _ => None,
        }
    }
}

fn monotonic_ns(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

/// Tells the daemon of a change in the engine's liveness: silent (its
/// blocks dropped, out of routing) or heard again (the notice over, and a
/// heartbeat that brings it back at once).
fn report(
    change: Option<Change>,
    rank: &EngineRank,
    feed: &mut Feed,
    publisher: &mut Publisher,
    reported: &mut Reported,
    start: Instant,
) {
    match change {
        Some(Change::Silent(why)) => {
            let message = format!(
                "{why}: its blocks were dropped and it is out of routing until it is heard again"
            );
            warn!(worker = rank.worker_id, dp_rank = rank.dp_rank, "{message}");
            feed.forget(&mut Ring(publisher));
            reported.silent += 1;
            let _ = publisher.publish_notice(notice::SILENT, reported.silent, &message);
        }
        Some(Change::Back) => {
            info!(
                worker = rank.worker_id,
                dp_rank = rank.dp_rank,
                "engine heard again"
            );
            let _ = publisher.publish_notice(notice::over(notice::SILENT), reported.silent, "");
            let _ = publisher.heartbeat(monotonic_ns(start));
        }
        None => {}
    }
}

/// The rate limits of a rank's repeated warnings, one per kind.
#[derive(Debug, Default)]
struct Logs {
    feed: HashMap<LogKind, RateLimit>,
    refused: RateLimit,
    dropped: RateLimit,
}

/// One rank, for as long as it is configured.
async fn run_rank(
    rank: EngineRank,
    settings: Arc<Settings>,
    mut loads: watch::Receiver<Scraped>,
    events: Arc<Activity>,
) {
    let mut session = Session::new(Instant::now());
    let mut publisher = register(&rank, &settings, &mut session).await;
    info!(
        worker = rank.worker_id,
        dp_rank = rank.dp_rank,
        events = %rank.events,
        "{} engine registered through the bridge",
        rank.kind.as_str()
    );
    let start = Instant::now();
    let timeout = settings.heartbeat_timeout;
    let mut feed = Feed::new(
        rank.block_size,
        settings.index_capacity,
        rank.replay.is_some(),
    );
    let allow = if rank.events_bind {
        allow_list(&rank).await
    } else {
        Allow::loopback()
    };
    let mut sub: Option<Sub> = None;
    let mut last_message = Instant::now();
    let mut last_probe = Instant::now();
    let mut probe_failed = false;
    let mut liveness = Liveness::new(timeout, Duration::from_millis(rank.down_after_ms));
    // Connections to a bound events port open now.
    let mut peers = 0usize;
    let mut sub_problem_logged = false;
    // Ask the replay socket what was missed: at start (the engine's
    // history), and each time the connection to its publisher is made
    // again (what passed meanwhile, or a restart).
    let mut catch_up = true;
    let mut reported = Reported::default();
    let mut logs = Logs::default();
    let mut scraper_gone = false;
    let mut tick = housekeeping(timeout);
    loop {
        if sub.is_none() {
            match open_sub(&rank, &allow).await {
                Ok(s) => {
                    sub = Some(s);
                    last_message = Instant::now();
                    if !rank.events_bind {
                        liveness.events_up(Instant::now());
                        catch_up = true;
                    }
                    sub_problem_logged = false;
                }
                Err(e) if !sub_problem_logged => {
                    liveness.events_lost(Instant::now());
                    let level_warn = rank.events_bind;
                    if level_warn {
                        warn!(
                            worker = rank.worker_id,
                            dp_rank = rank.dp_rank,
                            "events: {e}"
                        );
                    } else {
                        debug!(
                            worker = rank.worker_id,
                            dp_rank = rank.dp_rank,
                            "events: {e}"
                        );
                    }
                    sub_problem_logged = true;
                }
                Err(_) => liveness.events_lost(Instant::now()),
            }
        }
        if std::mem::take(&mut catch_up) {
            let step = feed.handle_connected();
            replays(&rank, step, &mut feed, &mut publisher).await;
        }
        let recv = async {
            match sub.as_mut() {
                Some(s) => s.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            event = recv => {
                let now = Instant::now();
                match event {
                    // A connecting socket's one connection ended: open it
                    // again (the engine is down until that works).
                    None => {
                        close(&mut sub, &mut reported);
                        liveness.events_lost(now);
                    }
                    Some(SubEvent::Message { peer, frames: msg }) => {
                        let from = Sender { peer, trusted: !rank.events_bind };
                        match frames(&msg) {
                            Ok((seq, payload)) => {
                                let step = feed_live(&rank, from, seq, &payload, &mut feed, &mut publisher).await;
                                if step != Live::Ignored {
                                    last_message = Instant::now();
                                    liveness.events_up(last_message);
                                    report(liveness.check(last_message), &rank, &mut feed, &mut publisher, &mut reported, start);
                                    // The engine works: its load is read at
                                    // the busy pace.
                                    events.published();
                                }
                            }
                            Err(why) => feed.handle_malformed(from, &why),
                        }
                    }
                    Some(SubEvent::Joined { peer, addr }) => {
                        // Only allowed addresses get this far: the engine's
                        // own hosts.
                        peers += 1;
                        liveness.events_up(now);
                        debug!(worker = rank.worker_id, dp_rank = rank.dp_rank, "events: peer {peer} ({addr}) connected");
                    }
                    Some(SubEvent::Left { peer, error }) => {
                        feed.handle_left(peer);
                        peers = peers.saturating_sub(1);
                        if peers == 0 {
                            liveness.events_lost(now);
                        }
                        if error.is_protocol() {
                            if let Some(n) = logs.dropped.allow(now) {
                                warn!(worker = rank.worker_id, dp_rank = rank.dp_rank, "events: peer {peer} was disconnected: {error}{}", held_back(n));
                            }
                        } else {
                            debug!(worker = rank.worker_id, dp_rank = rank.dp_rank, "events: peer {peer} left: {error}");
                        }
                    }
                    Some(SubEvent::Refused { addr, why }) => {
                        if let Some(n) = logs.refused.allow(now) {
                            warn!(worker = rank.worker_id, dp_rank = rank.dp_rank, "events: a connection from {addr} was refused: {why}{}", held_back(n));
                        }
                    }
                }
            }
            changed = loads.changed(), if !scraper_gone => {
                if changed.is_err() {
                    // The scraper is gone: nothing more to hear from it.
                    scraper_gone = true;
                    continue;
                }
                let scraped = loads.borrow_and_update().clone();
                match scraped {
                    Scraped::Read(reading) => {
                        let now = Instant::now();
                        liveness.scrape_read(now);
                        // Back before the load that brings it back, so no
                        // one sees it routed with `silent` standing.
                        report(liveness.check(now), &rank, &mut feed, &mut publisher, &mut reported, start);
                        if reported.unreadable.end() {
                            info!(worker = rank.worker_id, dp_rank = rank.dp_rank, "the engine's load is read again");
                            let _ = publisher.publish_notice(notice::over(notice::LOAD_UNREADABLE), reported.unreadable.count, "");
                        }
                        // A load is a sign of life to the daemon: none
                        // while another signal says the engine is down.
                        if liveness.alive(now) {
                            let _ = publisher.publish_load(&scrape::load(&reading, monotonic_ns(start)));
                        }
                        if let Some(bs) = reading.block_size
                            && bs != u64::from(rank.block_size)
                            && !reported.block_size_warned
                        {
                            reported.block_size_warned = true;
                            let message = format!("the engine's metrics say its blocks hold {bs} tokens but kvedge is configured for {}: set `block_size: {bs}`", rank.block_size);
                            warn!(worker = rank.worker_id, dp_rank = rank.dp_rank, "{message}");
                            let _ = publisher.publish_notice(notice::BLOCK_SIZE_MISMATCH, 1, &message);
                        }
                    }
                    Scraped::Failed(why) => {
                        let now = Instant::now();
                        liveness.scrape_failed(now);
                        if let Some(first) = reported.unreadable.fail(now) {
                            if first {
                                warn!(worker = rank.worker_id, dp_rank = rank.dp_rank, "cannot read the engine's load: {why}");
                            }
                            let _ = publisher.publish_notice(notice::LOAD_UNREADABLE, reported.unreadable.count, &why);
                        }
                    }
                    Scraped::Nothing => {}
                }
            }
            _ = tick.tick() => {
                let now = Instant::now();
                report(liveness.check(now), &rank, &mut feed, &mut publisher, &mut reported, start);
                // A count still climbing is published at most once a second.
                if reported.unreadable.due(now) {
                    let _ = publisher.publish_notice(notice::LOAD_UNREADABLE, reported.unreadable.count, "");
                }
                if !rank.events_bind
                    && sub.is_some()
                    && now.duration_since(last_message) >= IDLE_PROBE
                    && now.duration_since(last_probe) >= IDLE_PROBE
                {
                    last_probe = now;
                    if probe(&rank.events).await {
                        liveness.hear(Instant::now());
                        if std::mem::take(&mut probe_failed) {
                            debug!(worker = rank.worker_id, "events socket is back; re-opening");
                            close(&mut sub, &mut reported);
                        }
                    } else {
                        probe_failed = true;
                        liveness.events_lost(now);
                    }
                }
                reported.refused_now = reported.refused_before + sub.as_ref().map_or(0, refusals);
                flush_notices(&rank, &mut feed, &mut publisher, &mut reported, &mut logs, now);
                // The session with the daemon: a resync it asks for (after
                // our ring overflowed), or a registration it closed.
                match publisher.poll() {
                    Ok(Some(req)) => session.handle_resync_requested(req.snapshot_id),
                    Ok(None) => {}
                    Err(_) => {
                        warn!(worker = rank.worker_id, dp_rank = rank.dp_rank, "the daemon closed the engine's registration; registering again");
                        session.handle_closed(now);
                        publisher = register(&rank, &settings, &mut session).await;
                    }
                }
                while let Some(action) = session.poll_action(Instant::now()) {
                    match action {
                        // Heartbeats only while the engine shows life.
                        Action::Heartbeat if liveness.alive(now) => {
                            let _ = publisher.heartbeat(monotonic_ns(start));
                        }
                        Action::Heartbeat | Action::Register => {}
                        Action::Resync { snapshot_id } => {
                            let _ = publisher.begin_snapshot(snapshot_id);
                            feed.translator().republish(&mut Ring(&mut publisher));
                            let _ = publisher.end_snapshot();
                        }
                        // Registered again: the daemon knows none of the
                        // engine's blocks; tell it every one still known.
                        Action::Republish => feed.translator().republish(&mut Ring(&mut publisher)),
                    }
                }
            }
        }
    }
}

/// Connections a rank's events socket refused or cut off.
fn refusals(sub: &Sub) -> u64 {
    let s = sub.stats();
    [
        &s.refused_address,
        &s.refused_full,
        &s.failed_handshakes,
        &s.broke_protocol,
    ]
    .iter()
    .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    .sum()
}

/// Closes the events socket, keeping its counts for the next one's.
fn close(sub: &mut Option<Sub>, reported: &mut Reported) {
    if let Some(s) = sub.take() {
        reported.refused_before += refusals(&s);
    }
}

/// Counts already published as notices.
#[derive(Debug, Default)]
struct Reported {
    counted: [u64; COUNTED.len()],
    feed: [u64; 6],
    silent: u64,
    /// Connections the events socket refused or cut off: those of sockets
    /// closed before, in all now, and as last published.
    refused_before: u64,
    refused_now: u64,
    refused: u64,
    /// The sentence each code was first reported with.
    messages: HashMap<u16, String>,
    block_size_warned: bool,
    unreadable: Unreadable,
}

/// The engine's failed metrics reads, as notices: the first failure at
/// once, a climbing count at most once a second, the end when a read
/// works again.
#[derive(Debug, Default)]
struct Unreadable {
    /// Failed reads so far (the notice's count).
    count: u64,
    /// Whether reads are failing now.
    failing: bool,
    /// When the count was last published, and whether it moved since.
    published: Option<Instant>,
    unpublished: bool,
}

impl Unreadable {
    /// A read failed: `Some(first)` when the count is to be published now
    /// (`first`: the first failure of this run).
    fn fail(&mut self, now: Instant) -> Option<bool> {
        self.count += 1;
        let first = !std::mem::replace(&mut self.failing, true);
        if first
            || self
                .published
                .is_none_or(|t| now.duration_since(t) >= NOTICE_EVERY)
        {
            self.published = Some(now);
            self.unpublished = false;
            return Some(first);
        }
        self.unpublished = true;
        None
    }

    /// Whether a count that moved since it was last published is due.
    fn due(&mut self, now: Instant) -> bool {
        let due = self.failing
            && self.unpublished
            && self
                .published
                .is_none_or(|t| now.duration_since(t) >= NOTICE_EVERY);
        if due {
            self.published = Some(now);
            self.unpublished = false;
        }
        due
    }

    /// A read worked: whether that ends a run of failures.
    fn end(&mut self) -> bool {
        self.unpublished = false;
        std::mem::take(&mut self.failing)
    }
}

/// How often a count still climbing is published again.
const NOTICE_EVERY: Duration = Duration::from_secs(1);

/// Publishes a notice for each count that moved, and logs each reason
/// (the feed's lines at most once a second per kind, skips the first time
/// each happens).
fn flush_notices(
    rank: &EngineRank,
    feed: &mut Feed,
    publisher: &mut Publisher,
    reported: &mut Reported,
    logs: &mut Logs,
    now: Instant,
) {
    for (kind, line) in feed.take_log() {
        if let Some(n) = logs.feed.entry(kind).or_default().allow(now) {
            warn!(
                worker = rank.worker_id,
                dp_rank = rank.dp_rank,
                "{line}{}",
                held_back(n)
            );
        }
    }
    for (code, why) in feed.translator().take_first_skips() {
        warn!(
            worker = rank.worker_id,
            dp_rank = rank.dp_rank,
            reason = notice::name(code),
            "{why}"
        );
        reported.messages.insert(code, why);
    }
    let counts = *feed.translator().counts();
    for (i, &code) in COUNTED.iter().enumerate() {
        let n = counts.0[i];
        if n != reported.counted[i] {
            reported.counted[i] = n;
            let message = reported.messages.get(&code).map_or("", String::as_str);
            let _ = publisher.publish_notice(code, n, message);
        }
    }
    for (i, (code, n)) in feed.notices().into_iter().enumerate() {
        if n != reported.feed[i] {
            reported.feed[i] = n;
            let message = match code {
                notice::RESTARTED => {
                    "the engine restarted; its blocks were dropped and rebuilt from its events"
                }
                notice::REPLAYED => "event batches lost in transit were replayed",
                notice::FOREIGN_BATCHES => {
                    "batches from a peer that is not the engine's publisher were ignored"
                }
                notice::STALE_SEQUENCE => {
                    "batches numbered back were ignored: the engine's replay socket showed it had not restarted"
                }
                notice::UNVERIFIED_PUBLISHER => {
                    "batches from a new publisher were ignored: the engine's replay socket did not answer to vouch for it"
                }
                _ => {
                    "events were lost and could not be replayed: the engine's blocks were dropped rather than kept stale"
                }
            };
            let _ = publisher.publish_notice(code, n, message);
        }
    }
    if reported.refused_now != reported.refused {
        reported.refused = reported.refused_now;
        let _ = publisher.publish_notice(
            notice::EVENTS_REFUSED,
            reported.refused,
            "connections to the events port were refused or cut off (an address not allowed, too many peers, a failed handshake, or a message over max_message_bytes)",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn an_engines_labels_ride_in_its_hello_with_its_kind_unless_set() {
        let hello_of = |labels: &str| {
            let spec: EngineSpec = serde_yaml::from_str(&format!(
                "kind: sglang\nmodel: m\nworker_id: 1\nblock_size: 16\nendpoint: http://e\n\
                 events: tcp://127.0.0.1:5557\n{labels}"
            ))
            .unwrap();
            let rank = spec.ranks().next().unwrap();
            hello(&rank)
                .labels
                .into_iter()
                .map(|l| format!("{}={}", l.key, l.value))
                .collect::<Vec<_>>()
        };
        assert_eq!(hello_of(""), ["engine=sglang"]);
        assert_eq!(
            hello_of("labels: { backend: fast, gpu: h100 }\n"),
            ["engine=sglang", "backend=fast", "gpu=h100"]
        );
        assert_eq!(hello_of("labels: { engine: mine }\n"), ["engine=mine"]);
    }

    fn pace(interval_ms: u64, idle_ms: Option<u64>, heartbeat: Duration) -> ScrapePace {
        let spec: EngineSpec = serde_yaml::from_str(&format!(
            "kind: vllm\nmodel: m\nworker_id: 1\nblock_size: 16\nendpoint: http://e\n\
             events: tcp://127.0.0.1:5557\nmetrics: http://e/metrics\n\
             scrape_interval_ms: {interval_ms}\n{}",
            idle_ms.map_or(String::new(), |i| format!("scrape_idle_interval_ms: {i}\n"))
        ))
        .unwrap();
        ScrapePace::new(&spec, heartbeat)
    }

    fn reading(running: f64) -> Option<Vec<Reading>> {
        Some(vec![Reading {
            running: Some(running),
            ..Reading::default()
        }])
    }

    #[test]
    fn reads_fall_on_a_shared_grid_never_more_than_a_step_late() {
        let ms = Duration::from_millis;
        let epoch = tokio::time::Instant::now();
        let step = ms(100);
        // Two engines whose reads fell due 13 and 87 ms into a step are
        // read at the same instant, the step's end.
        let a = grid_point(epoch + ms(213), epoch, step);
        let b = grid_point(epoch + ms(287), epoch, step);
        assert_eq!((a, b), (epoch + ms(300), epoch + ms(300)));
        // On the grid already: as it is. Before the epoch: the epoch.
        assert_eq!(grid_point(epoch + ms(400), epoch, step), epoch + ms(400));
        let before = epoch.checked_sub(ms(5)).unwrap();
        assert_eq!(grid_point(before, epoch, step), epoch);
        for due in 0..1000 {
            let at = epoch + Duration::from_micros(due * 731);
            let got = grid_point(at, epoch, step);
            assert!(got >= at && got - at < step, "{due}");
        }
    }

    /// Ranks started at different instants tick at the same instants, and
    /// one that missed ticks comes back on the same grid.
    #[tokio::test(start_paused = true)]
    async fn every_ranks_housekeeping_ticks_in_the_same_wake_up() {
        let ms = Duration::from_millis;
        let timeout = Duration::from_secs(30);
        let mut a = housekeeping(timeout);
        tokio::time::sleep(ms(70)).await;
        let mut b = housekeeping(timeout);
        tokio::time::sleep(ms(45)).await;
        let mut c = housekeeping(timeout);
        let mut at_a = Vec::new();
        for _ in 0..12 {
            at_a.push(a.tick().await);
        }
        let period = at_a[1] - at_a[0];
        assert_eq!(period, ms(250));
        assert!(at_a.windows(2).all(|w| w[1] - w[0] == period), "{at_a:?}");
        let on_grid = |t: tokio::time::Instant| {
            t.checked_duration_since(at_a[0])
                .is_some_and(|d| d.as_nanos() % period.as_nanos() == 0)
        };
        for _ in 0..6 {
            let t = b.tick().await;
            assert!(on_grid(t), "{t:?} off the grid of {at_a:?}");
        }
        // `c` ticks once, then misses two ticks' worth of time (its
        // thread was busy): its next ticks are on the grid, not 250 ms
        // apart from the late one.
        c.tick().await;
        tokio::time::sleep(ms(610)).await;
        let before = tokio::time::Instant::now();
        for _ in 0..3 {
            let t = c.tick().await;
            assert!(on_grid(t), "{t:?} off the grid of {at_a:?}");
        }
        assert!(tokio::time::Instant::now() - before < period * 3);
    }

    #[test]
    fn a_closed_events_connection_or_failing_reads_take_an_engine_down_and_back() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut l = Liveness::new(ms(30_000), ms(2_000));
        // Never heard: nothing to declare.
        assert_eq!(l.check(t0), None);
        l.events_up(t0);
        assert_eq!(l.check(t0 + ms(100)), None);
        // The connection closes; a failed attempt to make it again does not
        // move the start of the outage.
        l.events_lost(t0 + ms(1_000));
        l.events_lost(t0 + ms(2_500));
        l.scrape_read(t0 + ms(2_900));
        assert_eq!(l.check(t0 + ms(2_900)), None, "not down for 2 s yet");
        let Some(Change::Silent(why)) = l.check(t0 + ms(3_000)) else {
            panic!("down after 2 s of a closed connection, well within the 30 s heartbeat timeout");
        };
        assert!(
            why.contains("events connection has been closed for 2.0 s"),
            "{why}"
        );
        assert!(
            !l.alive(t0 + ms(3_100)),
            "metrics alone do not bring it back"
        );
        assert_eq!(l.check(t0 + ms(3_100)), None, "declared once");
        l.events_up(t0 + ms(4_000));
        assert_eq!(l.check(t0 + ms(4_000)), Some(Change::Back));
        // Reads failing in a row: down after the same time, back at the
        // first read that works.
        l.scrape_failed(t0 + ms(5_000));
        l.scrape_failed(t0 + ms(6_000));
        l.events_up(t0 + ms(6_900));
        let Some(Change::Silent(why)) = l.check(t0 + ms(7_000)) else {
            panic!("down after 2 s of failed reads");
        };
        assert!(why.contains("metrics have not been read"), "{why}");
        l.scrape_read(t0 + ms(7_200));
        assert_eq!(l.check(t0 + ms(7_200)), Some(Change::Back));
        // Silence still counts on its own.
        assert!(
            matches!(l.check(t0 + ms(37_300)), Some(Change::Silent(why)) if why.contains("no events"))
        );
    }

    #[test]
    fn an_events_connection_never_made_is_no_outage_and_zero_turns_the_signals_off() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        // An engine that does not publish events, routed on its metrics.
        let mut l = Liveness::new(ms(30_000), ms(2_000));
        l.events_lost(t0);
        l.scrape_read(t0 + ms(100));
        l.scrape_read(t0 + ms(5_000));
        assert_eq!(l.check(t0 + ms(5_000)), None);
        // down_after_ms: 0.
        let mut l = Liveness::new(ms(30_000), Duration::ZERO);
        l.events_up(t0);
        l.events_lost(t0 + ms(1));
        l.scrape_failed(t0 + ms(1));
        l.hear(t0 + ms(20_000));
        assert_eq!(l.check(t0 + ms(25_000)), None);
    }

    #[test]
    fn failed_reads_are_counted_exactly_at_most_once_a_second_and_end() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut u = Unreadable::default();
        assert_eq!(u.fail(t0), Some(true), "the first failure at once");
        for i in 1..10 {
            assert_eq!(u.fail(t0 + ms(i * 100)), None);
        }
        assert!(!u.due(t0 + ms(950)));
        assert!(
            u.due(t0 + ms(1_000)),
            "the count that moved, a second later"
        );
        assert_eq!(u.count, 10);
        assert!(!u.due(t0 + ms(3_000)), "nothing new to say");
        assert_eq!(u.fail(t0 + ms(3_000)), Some(false));
        assert_eq!(u.count, 11);
        assert!(u.end());
        assert!(!u.end(), "ended once");
        assert!(!u.due(t0 + ms(9_000)));
        assert_eq!(u.fail(t0 + ms(9_000)), Some(true), "a new run of failures");
        assert_eq!(u.count, 12, "counted on, not from zero");
    }

    #[test]
    fn an_idle_engine_is_read_less_often_and_a_busy_one_at_once_again() {
        let ms = Duration::from_millis;
        let mut p = pace(100, None, Duration::from_secs(10));
        // The first read has nothing to compare with.
        assert_eq!(p.read(reading(0.0), false), ms(100));
        let idle: Vec<Duration> = (0..6).map(|_| p.read(reading(0.0), false)).collect();
        assert_eq!(idle, [200, 400, 800, 1000, 1000, 1000].map(ms));
        assert!(p.slowed());
        // Its load moved: the busy pace at once.
        assert_eq!(p.read(reading(2.0), false), ms(100));
        assert!(!p.slowed());
        assert_eq!(p.read(reading(2.0), false), ms(200));
        // Events while the load figures stand still: busy.
        assert_eq!(p.read(reading(2.0), true), ms(100));
        // An event while slowed: the next read one busy interval after the
        // last, or at once.
        p.read(reading(2.0), false);
        assert_eq!(p.woken(ms(30)), ms(70));
        assert_eq!(p.woken(ms(500)), Duration::ZERO);
        assert!(!p.slowed());
        // A failed read is retried at the busy pace.
        assert_eq!(p.read(None, false), ms(100));
        assert_eq!(p.read(None, false), ms(100));
    }

    #[test]
    fn the_idle_pace_is_bounded_by_its_setting_and_the_heartbeat_timeout() {
        let ms = Duration::from_millis;
        let settle =
            |mut p: ScrapePace| (0..20).map(|_| p.read(reading(0.0), false)).last().unwrap();
        assert_eq!(settle(pace(100, Some(300), ms(10_000))), ms(300));
        assert_eq!(settle(pace(100, None, ms(1_500))), ms(500));
        assert_eq!(settle(pace(100, Some(100), ms(10_000))), ms(100), "off");
        assert_eq!(settle(pace(2_000, None, ms(60_000))), ms(2_000));
    }

    /// Serves one HTTP response with a `len`-byte body; returns its URL.
    fn serve_once(len: usize) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/metrics", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut head = [0u8; 1024];
            let _ = s.read(&mut head);
            let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\n\r\n");
            let line = b"vllm:num_requests_running 1\n";
            let mut sent = 0;
            while sent < len {
                let n = line.len().min(len - sent);
                if s.write_all(&line[..n]).is_err() {
                    return;
                }
                sent += n;
            }
        });
        url
    }

    #[tokio::test]
    async fn a_metrics_page_is_read_up_to_its_limit() {
        let client = reqwest::Client::new();
        let small = client.get(serve_once(1000)).send().await.unwrap();
        assert!(
            read_page(small)
                .await
                .unwrap()
                .starts_with("vllm:num_requests_running 1")
        );
        let huge = client
            .get(serve_once(MAX_METRICS_PAGE + 1))
            .send()
            .await
            .unwrap();
        let err = read_page(huge).await.unwrap_err();
        assert!(err.contains("over 16777216 bytes"), "{err}");
    }
}
