//! `kvedge run`: the daemon's event loop. One thread owns the [`Router`]:
//! it accepts engines on `control.sock` (Hello, ring by SCM_RIGHTS), drains
//! their rings into the index and load table, notices closed control
//! connections (the worker leaves routing at once), and answers frontends on
//! `query.sock` in JSON lines or the binary protocol ([`kvedge_wire`]).
//! Each busy turn asks one `epoll` set (every socket, kept across turns)
//! which sockets are readable; when nothing has been pending for a while it
//! sleeps in the same set, which also holds every ring's wake eventfd.
//!
//! Query protocol (one JSON object per line, one reply line each):
//!
//! ```text
//! {"op":"select","model":"m","tokens":[1,2,3],"role":"aggregated","session":"s","dry_run":false}
//! {"op":"select","model":"m","hashes":[123,456]}
//! {"op":"prefill_done","request_id":7}   {"op":"finish","request_id":7}
//! {"op":"workers"}   {"op":"stats"}
//! ```
//!
//! Errors come back as `{"error":{"code":"...","message":"..."}}`; a bad
//! line never closes the connection or disturbs other clients. A line longer
//! than the frame limit closes that connection (its framing is lost).

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvedge_policies::{InputTrigger, SessionContext, WorkerType, WorkerWithDpRank};
use kvedge_shm::Consumer;
use kvedge_shm::channel::{self as query_channel, ServerChannel};
use kvedge_shm::control::{connection_closed, read_hello, send_reject, send_welcome};
use kvedge_shm::messages::Role;
use kvedge_shm::messages::control::{Welcome, reject};
use rustix::event::epoll;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::framing::{self, Mode, Next};
use kvedge_core::config::Config;
use kvedge_core::index::Slot;
use kvedge_core::router::{Router, SelectRequest, WorkerInfo};

/// Sockets of one daemon.
#[derive(Clone, Debug)]
pub struct RuntimeDir {
    pub dir: PathBuf,
}

impl RuntimeDir {
    pub fn control(&self) -> PathBuf {
        self.dir.join("control.sock")
    }
    pub fn query(&self) -> PathBuf {
        self.dir.join("query.sock")
    }
}

/// Binds a socket, refusing to take over a live daemon's and removing a
/// stale one.
fn bind(path: &Path) -> io::Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} belongs to a running daemon", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let l = UnixListener::bind(path)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

struct Engine {
    slot: Slot,
    stream: UnixStream,
    ring: Consumer,
    /// Snapshot id asked for after a gap; `None` when in sync.
    resync: Option<u64>,
    /// A gap inside the snapshot being received: it must be asked again.
    resync_broken: bool,
    /// Records known lost when the last resync was asked for. Their gap
    /// shows on the next committed record (the snapshot's first, when the
    /// drops ended a burst); it is already covered and is not a new loss.
    acked_missing: u64,
    /// Last time a record arrived (heartbeats included), ms.
    last_seen_ms: u64,
    /// The control stream had something (or hung up) at the last check.
    readable: bool,
}

struct Client {
    stream: UnixStream,
    buf: Vec<u8>,
    readable: bool,
    mode: Mode,
    /// Last request or data, for the idle timeout.
    last_active: Instant,
    /// The query channel this connection attached, if any.
    rings: Option<ServerChannel>,
}

/// The daemon.
pub struct Server {
    router: Router,
    config: Config,
    control: UnixListener,
    /// `None` when another frontend (the io_uring listener) owns it and
    /// hands requests over as [`Job`]s.
    query: Option<UnixListener>,
    /// Requests from another frontend, and the eventfd it signals.
    jobs: Option<(std::sync::mpsc::Receiver<Job>, OwnedFd)>,
    engines: Vec<Engine>,
    clients: Vec<Client>,
    started: Instant,
    /// The clock as read once at the top of the current loop turn: the
    /// turn's hot paths (ingest, client reads) use it instead of reading
    /// the clock themselves, which perf showed at ~10% of a round trip.
    turn: Instant,
    epoch: u64,
    selects: u64,
    errors: u64,
    /// Time in the router core per selection.
    select_latency: kvedge_core::latency::Histogram,
    /// Retained buffers of the binary protocol.
    reply: Vec<u8>,
    hashes: Vec<u64>,
    /// Every socket (listeners, engine control streams, clients), keyed by
    /// its fd: one `epoll_wait` per loop turn answers which are readable.
    epoll: OwnedFd,
    /// Scratch of the readiness check, indexed by fd.
    ready_fds: Vec<bool>,
    /// Where client reads land before they join the client's buffer
    /// (retained: a fresh 16 KiB array per client per turn was a memset
    /// that showed up as a tenth of the loop's time).
    scratch: Vec<u8>,
    /// Loads the configuration again (SIGHUP, `kvedge reload`).
    reloader: Option<Reloader>,
    reloads: u64,
    reload_failures: u64,
    /// The jobs eventfd was readable at the last readiness check.
    jobs_ready: bool,
    /// Engine connections whose Hello has not fully arrived, since when.
    pending: Vec<(UnixStream, Instant)>,
    refused_registrations: u64,
    refused_connections: u64,
    last_refusal_log: Instant,
    /// Ring records applied, by `EVENT_KINDS` index.
    events: [u64; 7],
    ring_gaps: u64,
    resyncs: u64,
    /// Drops counted by engines that have left.
    departed_drops: u64,
    /// (policy, rule, outcome, count): grows by one entry per new
    /// combination, so the selection path does not allocate after warm-up.
    selections: Vec<(String, Option<String>, &'static str, u64)>,
}

/// Names of the ring record kinds, for metrics.
const EVENT_KINDS: [&str; 7] = [
    "stored",
    "removed",
    "cleared",
    "load",
    "heartbeat",
    "snapshot_begin",
    "snapshot_end",
];

fn event_kind(e: &kvedge_shm::EventRef<'_>) -> usize {
    use kvedge_shm::EventRef as E;
    match e {
        E::Stored(_) => 0,
        E::Removed(_) => 1,
        E::Cleared(_) => 2,
        E::Load(_) => 3,
        E::Heartbeat(_) => 4,
        E::SnapshotBegin(_) => 5,
        E::SnapshotEnd(_) => 6,
    }
}

/// Engine connections waiting for their Hello at once, at most.
const MAX_PENDING_REGISTRATIONS: usize = 64;

/// One request from a frontend other than the loop's own query socket
/// handling: a JSON line (without its newline) or a binary frame body, and
/// where the reply bytes go.
pub struct Job {
    pub request: Vec<u8>,
    pub binary: bool,
    pub reply: Box<dyn FnOnce(Vec<u8>) + Send>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("bytes", &self.request.len())
            .field("binary", &self.binary)
            .finish_non_exhaustive()
    }
}

/// The sending end of [`Server::take_query_listener`]: queue a job, then
/// signal the eventfd so a sleeping loop wakes.
#[derive(Debug)]
pub struct JobSender {
    tx: std::sync::mpsc::Sender<Job>,
    wake: OwnedFd,
}

impl JobSender {
    /// Queues `job`; false once the server is gone.
    pub fn send(&self, job: Job) -> bool {
        if self.tx.send(job).is_err() {
            return false;
        }
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
        true
    }
}

impl Clone for JobSender {
    fn clone(&self) -> Self {
        JobSender {
            tx: self.tx.clone(),
            wake: self.wake.try_clone().expect("dup of an eventfd"),
        }
    }
}

/// Produces a freshly loaded configuration, or the loader's error.
pub type Reloader = Box<dyn FnMut() -> Result<Config, String> + Send>;

/// Whether a new query connection may stay, with `open` connections
/// already served: the connection limit and the peer-credential policy.
/// `Some((code, message))` refuses it. Shared by the epoll loop and the
/// io_uring listener.
pub(crate) fn admission(
    stream: &UnixStream,
    d: &kvedge_core::config::DaemonSection,
    open: usize,
) -> Option<(&'static str, String)> {
    if open >= d.max_query_connections {
        return Some((
            "too_many_connections",
            format!(
                "the daemon serves at most {} connections",
                d.max_query_connections
            ),
        ));
    }
    if !d.client_policy() {
        return None;
    }
    match kvedge_shm::control::peer_credentials(stream) {
        Ok(c) if d.client_allowed(c.uid, c.gid) => None,
        Ok(c) => Some((
            "not_permitted",
            format!(
                "uid {} gid {} (pid {}) is not in query_allowed_uids/gids",
                c.uid, c.gid, c.pid
            ),
        )),
        Err(e) => Some(("not_permitted", format!("no peer credentials: {e}"))),
    }
}

/// One JSON error line to a refused connection, never blocking (the caller
/// then drops it).
pub(crate) fn send_refusal(stream: &UnixStream, code: &str, message: &str) {
    let line = format!("{}\n", error(code, message));
    let _ = stream.set_nonblocking(true);
    let _ = rustix::net::send(stream, line.as_bytes(), rustix::net::SendFlags::NOSIGNAL);
}

/// The epoll key of a ring's wake eventfd: it only ends a sleep, so
/// readiness checks skip it.
const WAKE_KEY: u64 = u64::MAX;

/// Adds a ring's wake eventfd to the loop's epoll set, so that sleeping is
/// one `epoll_wait` on the set (no per-sleep poll list to build). It must
/// be removed explicitly ([`unwatch_engine`], [`unwatch_client`]): the
/// peer holds a copy of the eventfd, so closing ours does not remove it.
fn watch_wake(epoll: &OwnedFd, fd: impl AsFd) -> io::Result<()> {
    watch_as(epoll, fd, WAKE_KEY)
}

/// Takes a departing engine's sockets and wake eventfd out of the epoll set.
fn unwatch_engine(epoll: &OwnedFd, e: &Engine) {
    let _ = epoll::delete(epoll, &e.stream);
    let _ = epoll::delete(epoll, e.ring.wake_fd());
}

/// Takes a departing client's socket (and its query channel's wake
/// eventfd) out of the epoll set.
fn unwatch_client(epoll: &OwnedFd, c: &Client) {
    let _ = epoll::delete(epoll, &c.stream);
    if let Some(r) = &c.rings {
        let _ = epoll::delete(epoll, r.requests.wake_fd());
    }
}

/// Adds `fd` to the loop's epoll set, keyed by its number.
fn watch(epoll: &OwnedFd, fd: impl AsFd) -> io::Result<()> {
    let key = fd.as_fd().as_raw_fd() as u64;
    watch_as(epoll, fd, key)
}

/// Adds `fd` to the loop's epoll set (readable, level-triggered) as `key`.
fn watch_as(epoll: &OwnedFd, fd: impl AsFd, key: u64) -> io::Result<()> {
    epoll::add(
        epoll,
        fd,
        epoll::EventData::new_u64(key),
        epoll::EventFlags::IN,
    )?;
    Ok(())
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("engines", &self.engines.len())
            .field("clients", &self.clients.len())
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Binds both sockets in `dir` (created if missing).
    pub fn bind(config: Config, dir: &RuntimeDir) -> io::Result<Server> {
        std::fs::create_dir_all(&dir.dir)?;
        let control = bind(&dir.control())?;
        let query = bind(&dir.query())?;
        Server::from_listeners(config, control, query)
    }

    /// Serves on sockets bound elsewhere (socket activation).
    pub fn from_listeners(
        config: Config,
        control: UnixListener,
        query: UnixListener,
    ) -> io::Result<Server> {
        control.set_nonblocking(true)?;
        query.set_nonblocking(true)?;
        let router = Router::from_config(&config);
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        watch(&epoll, &control)?;
        watch(&epoll, &query)?;
        Ok(Server {
            router,
            config,
            control,
            query: Some(query),
            jobs: None,
            engines: Vec::new(),
            clients: Vec::new(),
            started: Instant::now(),
            turn: Instant::now(),
            epoch: 0,
            selects: 0,
            errors: 0,
            select_latency: Default::default(),
            reply: Vec::with_capacity(4096),
            hashes: Vec::with_capacity(4096),
            epoll,
            ready_fds: Vec::new(),
            scratch: vec![0; 16384],
            reloader: None,
            reloads: 0,
            reload_failures: 0,
            jobs_ready: false,
            pending: Vec::new(),
            refused_registrations: 0,
            refused_connections: 0,
            last_refusal_log: Instant::now()
                .checked_sub(Duration::from_secs(10))
                .unwrap_or_else(Instant::now),
            events: [0; 7],
            ring_gaps: 0,
            resyncs: 0,
            departed_drops: 0,
            selections: Vec::new(),
        })
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Client connections with a query channel attached.
    fn query_channels(&self) -> usize {
        self.clients.iter().filter(|c| c.rings.is_some()).count()
    }

    /// Milliseconds since start at the top of the current loop turn.
    fn turn_ms(&self) -> u64 {
        self.turn
            .saturating_duration_since(self.started)
            .as_millis() as u64
    }

    /// Closes clients idle longer than the idle timeout (checked once a
    /// millisecond, not per turn).
    fn close_idle_clients(&mut self) {
        let idle = Duration::from_millis(self.config.daemon.idle_timeout_ms);
        let now = self.turn;
        let epoll = &self.epoll;
        self.clients.retain(|c| {
            let keep = now.saturating_duration_since(c.last_active) <= idle;
            if !keep {
                unwatch_client(epoll, c);
            }
            keep
        });
    }

    /// Runs until `stop` returns true (checked every loop).
    pub fn run(&mut self, mut stop: impl FnMut() -> bool) -> io::Result<()> {
        self.run_with(|_| stop())
    }

    /// Runs until `tick` returns true. `tick` is called about once a
    /// millisecond while busy and at least every 100 ms while idle, with
    /// the server, so it can reload, report status and ping a watchdog. On
    /// the way out, requests already received are answered (a drain).
    pub fn run_with(&mut self, mut tick: impl FnMut(&mut Server) -> bool) -> io::Result<()> {
        // Spin this long after the last activity before sleeping: waking a
        // sleeping thread costs tens of microseconds here, and a busy engine
        // would otherwise pay it on every burst.
        const SPIN: Duration = Duration::from_micros(200);
        let mut last_busy = Instant::now();
        let mut last_expiry = u64::MAX;
        loop {
            self.turn = Instant::now();
            let now = self.turn_ms();
            if now != last_expiry {
                self.router.load.expire(now);
                self.close_idle_clients();
                last_expiry = now;
                if tick(self) {
                    break;
                }
            }
            // One readiness check for every socket, instead of a syscall per
            // socket per turn (accept, peek, read), which dominated latency.
            let (control_ready, query_ready) = self.readiness();
            let mut busy = false;
            if control_ready {
                busy |= self.accept_engines();
            } else if !self.pending.is_empty() {
                busy |= self.progress_registrations();
            }
            if query_ready {
                busy |= self.accept_clients();
            }
            busy |= self.ingest();
            busy |= self.serve_clients();
            if self.jobs_ready {
                busy |= self.serve_jobs();
            }
            if busy {
                last_busy = self.turn;
            } else if self.turn.saturating_duration_since(last_busy) > SPIN {
                self.sleep(Duration::from_millis(100));
                last_busy = Instant::now();
            } else {
                std::hint::spin_loop();
            }
        }
        // Drain: answer what the clients already sent.
        let _ = self.readiness();
        self.serve_clients();
        self.serve_jobs();
        Ok(())
    }

    /// Hands the query socket to another frontend (the io_uring listener):
    /// from now on requests arrive through the returned sender.
    pub fn take_query_listener(&mut self) -> io::Result<Option<(UnixListener, JobSender)>> {
        let Some(query) = self.query.take() else {
            return Ok(None);
        };
        let _ = epoll::delete(&self.epoll, &query);
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )?;
        watch(&self.epoll, &wake)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let sender = JobSender {
            tx,
            wake: wake.try_clone()?,
        };
        self.jobs = Some((rx, wake));
        Ok(Some((query, sender)))
    }

    /// Gives the query socket back (the other frontend could not start).
    pub fn restore_query_listener(&mut self, query: UnixListener) -> io::Result<()> {
        if let Some((_, wake)) = self.jobs.take() {
            let _ = epoll::delete(&self.epoll, &wake);
        }
        query.set_nonblocking(true)?;
        watch(&self.epoll, &query)?;
        self.query = Some(query);
        Ok(())
    }

    /// Answers every queued job.
    fn serve_jobs(&mut self) -> bool {
        let Some((rx, wake)) = self.jobs.take() else {
            return false;
        };
        let mut counter = [0u8; 8];
        let _ = rustix::io::read(&wake, &mut counter);
        let mut any = false;
        let mut out = std::mem::take(&mut self.reply);
        while let Ok(job) = rx.try_recv() {
            any = true;
            let mode = if job.binary { Mode::Binary } else { Mode::Json };
            self.answer(mode, &job.request, &mut out);
            let bytes = out.clone();
            (job.reply)(bytes);
        }
        self.reply = out;
        self.jobs = Some((rx, wake));
        any
    }

    /// Sets how the configuration is loaded again (SIGHUP, `kvedge reload`).
    pub fn set_reloader(&mut self, reloader: Reloader) {
        self.reloader = Some(reloader);
    }

    /// Loads the configuration again and, if it is valid, applies it
    /// between two requests (fresh policy instances; index, load,
    /// reservations and session bindings kept). An invalid one is logged
    /// and the old one keeps serving. Tells systemd RELOADING=1, then
    /// READY=1 either way.
    pub fn reload(&mut self) -> Result<(), String> {
        let Some(reloader) = self.reloader.as_mut() else {
            return Err("this daemon has no configuration file to reload".into());
        };
        crate::notify::reloading();
        let result = reloader();
        let outcome = match result {
            Ok(config) => {
                self.router.reconfigure(&config);
                self.config = config;
                self.reloads += 1;
                tracing::info!(reloads = self.reloads, "configuration reloaded");
                Ok(())
            }
            Err(e) => {
                self.reload_failures += 1;
                tracing::error!("reload refused, the previous configuration keeps serving: {e}");
                Err(e)
            }
        };
        crate::notify::ready(&self.status());
        outcome
    }

    /// Counts a selection for the metrics (allocates only for a new
    /// (policy, rule, outcome) combination).
    fn count_selection(&mut self, role: WorkerType, rule: Option<usize>, outcome: &'static str) {
        let policy = self.router.policy_name(role).0;
        let rule = rule
            .and_then(|i| self.router.rules().and_then(|p| p.rules.get(i)))
            .map(|r| r.name.as_str());
        match self
            .selections
            .iter_mut()
            .find(|(p, r, o, _)| p == policy && r.as_deref() == rule && *o == outcome)
        {
            Some(e) => e.3 += 1,
            None => self
                .selections
                .push((policy.to_owned(), rule.map(str::to_owned), outcome, 1)),
        }
    }

    /// Every registered worker with its load and index counts, as
    /// `workers` and the metrics report them.
    fn worker_rows(&self) -> Vec<kvedge_core::metrics::WorkerRow> {
        self.router
            .workers()
            .map(|(slot, w)| {
                let load = self.router.load.projected(slot);
                let report = self.router.load.reported(slot);
                kvedge_core::metrics::WorkerRow {
                    worker_id: w.worker.worker_id,
                    dp_rank: w.worker.dp_rank,
                    model: w.model.clone(),
                    role: w.role.as_str(),
                    endpoint: w.endpoint.clone(),
                    available: w.available,
                    active_requests: load.active_requests,
                    waiting_requests: report.waiting_requests,
                    active_prefill_tokens: load.active_prefill_tokens,
                    kv_used_blocks: report.kv_used_blocks,
                    kv_total_blocks: report.kv_total_blocks,
                    device_blocks: self
                        .router
                        .index
                        .worker_blocks(slot, kvedge_shm::messages::Tier::Device)
                        as u64,
                }
            })
            .collect()
    }

    /// The counters and gauges a scrape reports.
    pub fn metrics(&self) -> kvedge_core::metrics::Snapshot {
        let workers = self.worker_rows();
        kvedge_core::metrics::Snapshot {
            selections: self
                .selections
                .iter()
                .map(|(p, r, o, n)| {
                    (
                        p.clone(),
                        r.clone().unwrap_or_default(),
                        (*o).to_owned(),
                        *n,
                    )
                })
                .collect(),
            select_latency: self.select_latency.clone(),
            events: EVENT_KINDS.iter().copied().zip(self.events).collect(),
            ring_gaps: self.ring_gaps,
            ring_drops: self.departed_drops
                + self
                    .engines
                    .iter()
                    .map(|e| e.ring.producer_dropped())
                    .sum::<u64>(),
            resyncs: self.resyncs,
            index_entries: self.router.index.entries() as u64,
            index_refused_full: self.router.index.refused_full(),
            workers,
            clients: self.clients.len() as u64,
            query_channels: self.query_channels() as u64,
            reservations: self.router.load.reservations() as u64,
            reservations_expired: self.router.load.expired(),
            reloads: self.reloads,
            reload_failures: self.reload_failures,
            refused_connections: self.refused_connections,
            refused_registrations: self.refused_registrations,
        }
    }

    fn too_many_requests(&self) -> String {
        format!(
            "{} requests are selected and not finished (daemon.max_reservations); finish some first",
            self.router.load.reservations()
        )
    }

    /// One line for `systemctl status`.
    pub fn status(&self) -> String {
        format!(
            "{} workers, {} clients, {} selects, {} index entries",
            self.engines.len(),
            self.clients.len(),
            self.selects,
            self.router.index.entries()
        )
    }

    /// Asks the epoll set, without waiting, which sockets are readable (or
    /// hung up); records it on every engine control stream and client, and
    /// returns whether the control and query listeners are. One syscall a
    /// turn, whatever the number of sockets, and no allocation.
    fn readiness(&mut self) -> (bool, bool) {
        let zero = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // On the stack: `epoll::Event` carries a raw pointer, which would
        // make a retained buffer (and so the server) not `Send`. Level
        // triggered: sockets beyond 256 ready ones are reported next turn.
        let mut buf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 256];
        // EINTR reports nothing this turn; the next turn asks again.
        if let Ok((events, _)) = epoll::wait(&self.epoll, &mut buf[..], Some(&zero)) {
            for ev in events.iter() {
                if ev.data.u64() == WAKE_KEY {
                    continue;
                }
                let fd = ev.data.u64() as usize;
                if fd >= self.ready_fds.len() {
                    self.ready_fds.resize(fd + 1, false);
                }
                self.ready_fds[fd] = true;
            }
        }
        let ready = &mut self.ready_fds;
        let mut take = |fd: std::os::fd::BorrowedFd<'_>| -> bool {
            ready
                .get_mut(fd.as_raw_fd() as usize)
                .is_some_and(|r| std::mem::replace(r, false))
        };
        let control = take(self.control.as_fd());
        let query = self.query.as_ref().is_some_and(|q| take(q.as_fd()));
        let jobs = self.jobs.as_ref().is_some_and(|(_, fd)| take(fd.as_fd()));
        self.jobs_ready = jobs;
        for e in &mut self.engines {
            e.readable = take(e.stream.as_fd());
        }
        for c in &mut self.clients {
            c.readable = take(c.stream.as_fd());
        }
        (control, query)
    }

    /// Accepts engine connections into `pending`: their Hello is read only
    /// once it has fully arrived, so a slow or silent peer on control.sock
    /// cannot stall the routing loop.
    fn accept_engines(&mut self) -> bool {
        let mut any = false;
        loop {
            match self.control.accept() {
                Ok((stream, _)) => {
                    any = true;
                    if self.pending.len() >= MAX_PENDING_REGISTRATIONS {
                        self.refused_registrations += 1;
                        tracing::warn!(
                            "engine connection refused: {MAX_PENDING_REGISTRATIONS} registrations already pending"
                        );
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() || watch(&self.epoll, &stream).is_err()
                    {
                        continue;
                    }
                    self.pending.push((stream, Instant::now()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!("accept on control socket: {e}");
                    break;
                }
            }
        }
        any | self.progress_registrations()
    }

    /// Registers the pending connections whose Hello has arrived; drops the
    /// ones that closed or stayed silent past the deadline.
    fn progress_registrations(&mut self) -> bool {
        const DEADLINE: Duration = Duration::from_secs(2);
        let mut any = false;
        let mut i = 0;
        while i < self.pending.len() {
            let state = kvedge_shm::control::frame_ready(&self.pending[i].0);
            let late = self.pending[i].1.elapsed() > DEADLINE;
            match state {
                Ok(kvedge_shm::control::FrameReady::NotYet) if !late => {
                    i += 1;
                    continue;
                }
                _ => {}
            }
            let (stream, _) = self.pending.swap_remove(i);
            let _ = epoll::delete(&self.epoll, &stream);
            any = true;
            match state {
                Ok(kvedge_shm::control::FrameReady::Ready) => {
                    if let Err(e) = self.register(stream) {
                        self.refused_registrations += 1;
                        tracing::warn!("engine registration refused: {e}");
                    }
                }
                Ok(kvedge_shm::control::FrameReady::NotYet) => {
                    self.refused_registrations += 1;
                    tracing::warn!("engine connection closed: no Hello within {DEADLINE:?}");
                }
                Ok(kvedge_shm::control::FrameReady::Closed) | Err(_) => {}
            }
        }
        any
    }

    fn register(&mut self, stream: UnixStream) -> Result<(), Box<dyn std::error::Error>> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        stream.set_write_timeout(Some(Duration::from_secs(2)))?;
        let hello = read_hello(&stream)?;
        if self.config.daemon.engine_policy() {
            let cred = kvedge_shm::control::peer_credentials(&stream)?;
            if !self.config.daemon.engine_allowed(cred.uid, cred.gid) {
                send_reject(&stream, reject::NOT_PERMITTED, "uid/gid not allowed")?;
                return Err(format!(
                    "worker {} (pid {}, uid {}, gid {}) is not in allowed_uids/allowed_gids",
                    hello.worker_id, cred.pid, cred.uid, cred.gid
                )
                .into());
            }
        }
        let role = match hello.role {
            Role::Aggregated => WorkerType::Aggregated,
            Role::Prefill => WorkerType::Prefill,
            Role::Decode => WorkerType::Decode,
            Role::Encode => WorkerType::Encode,
        };
        let info = WorkerInfo {
            worker: WorkerWithDpRank::new(hello.worker_id, hello.dp_rank),
            model: hello.model.clone(),
            role,
            endpoint: hello.endpoint.clone(),
            block_size: hello.block_size,
            available: true,
        };
        let slot = match self.router.register(info) {
            Ok(slot) => slot,
            Err(e) => {
                send_reject(
                    &stream,
                    match e {
                        kvedge_core::router::RegisterError::Full(_) => reject::TOO_MANY_WORKERS,
                        kvedge_core::router::RegisterError::Duplicate(_) => {
                            reject::DUPLICATE_WORKER
                        }
                        kvedge_core::router::RegisterError::BlockSize => reject::INVALID_HELLO,
                    },
                    &e.to_string(),
                )?;
                return Err(e.into());
            }
        };
        self.epoch += 1;
        let capacity = self.config.daemon.ring_capacity;
        let ring = match Consumer::create(capacity, self.epoch) {
            Ok(r) => r,
            Err(e) => {
                self.router.unregister(slot);
                return Err(e.into());
            }
        };
        let welcome = Welcome {
            worker_id: hello.worker_id,
            dp_rank: hello.dp_rank,
            attach_epoch: self.epoch,
            ring_capacity: capacity,
            heartbeat_interval_ms: 1000,
        };
        if let Err(e) = send_welcome(&stream, &welcome, &ring) {
            self.router.unregister(slot);
            return Err(e.into());
        }
        stream.set_nonblocking(true)?;
        if let Err(e) = watch(&self.epoll, &stream) {
            self.router.unregister(slot);
            return Err(e.into());
        }
        if let Err(e) = watch_wake(&self.epoll, ring.wake_fd()) {
            let _ = epoll::delete(&self.epoll, &stream);
            self.router.unregister(slot);
            return Err(e.into());
        }
        let now = self.now_ms();
        self.engines.push(Engine {
            slot,
            stream,
            ring,
            resync: None,
            resync_broken: false,
            acked_missing: 0,
            last_seen_ms: now,
            readable: false,
        });
        Ok(())
    }

    fn accept_clients(&mut self) -> bool {
        let mut any = false;
        loop {
            let Some(query) = self.query.as_ref() else {
                return any;
            };
            match query.accept() {
                Ok((stream, _)) => {
                    any = true;
                    let refusal = admission(&stream, &self.config.daemon, self.clients.len());
                    if let Some((code, message)) = refusal {
                        self.refuse_client(stream, code, &message);
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() || watch(&self.epoll, &stream).is_err()
                    {
                        continue; // dropped: closes the connection
                    }
                    self.clients.push(Client {
                        stream,
                        buf: Vec::with_capacity(4096),
                        readable: true,
                        mode: Mode::Unknown,
                        last_active: Instant::now(),
                        rings: None,
                    });
                }
                Err(_) => return any,
            }
        }
    }

    /// Closes a refused query connection after its error line, and logs
    /// it; a flood is logged once a second.
    fn refuse_client(&mut self, stream: UnixStream, code: &str, message: &str) {
        self.refused_connections += 1;
        send_refusal(&stream, code, message);
        if self.last_refusal_log.elapsed() >= Duration::from_secs(1) {
            tracing::warn!(
                refused_total = self.refused_connections,
                "query connection refused ({code}): {message}"
            );
            self.last_refusal_log = Instant::now();
        }
    }

    /// Drains every ring (bounded per ring, so queries are not starved),
    /// handles gaps (resync), heartbeats and closed control connections.
    fn ingest(&mut self) -> bool {
        let mut any = false;
        let now = self.turn_ms();
        let heartbeat_timeout = self.config.daemon.heartbeat_timeout_ms;
        let mut i = 0;
        while i < self.engines.len() {
            let e = &mut self.engines[i];
            let mut n = 0;
            let mut gap = false;
            while n < 4096 {
                let missing_so_far = e.ring.missing_total();
                match e.ring.poll() {
                    Ok(Some(r)) => {
                        let missing = missing_so_far.saturating_add(r.missing_before);
                        self.ring_gaps += r.missing_before;
                        if r.missing_before > 0 && missing > e.acked_missing {
                            gap = true;
                            e.resync_broken |= e.resync.is_some();
                        }
                        if let Ok(event) = kvedge_shm::decode(r.kind, r.payload) {
                            self.events[event_kind(&event)] += 1;
                            self.router.apply(e.slot, &event);
                            if let kvedge_shm::EventRef::SnapshotEnd(end) = &event
                                && e.resync == Some(end.snapshot_id.to_native())
                            {
                                // Complete only if nothing went missing inside.
                                if e.resync_broken {
                                    gap = true;
                                }
                                e.resync = None;
                                e.resync_broken = false;
                            }
                        }
                        n += 1;
                    }
                    Ok(None) => {
                        // Drops at the end of a burst show only as a count.
                        gap |= e.ring.unreported_drops() > 0;
                        break;
                    }
                    Err(err) => {
                        tracing::warn!(
                            slot = e.slot.index(),
                            "ring is broken, dropping the worker: {err}"
                        );
                        break;
                    }
                }
            }
            if n > 0 {
                any = true;
                e.last_seen_ms = now;
            }
            // A gap: the worker's view is unknown, so it counts as empty (not
            // stale) until the snapshot it is asked for has arrived whole.
            if gap && e.resync.is_none() {
                self.router.index.clear(e.slot, None);
                self.epoch += 1;
                let request = kvedge_shm::messages::control::ResyncRequest {
                    snapshot_id: self.epoch,
                    missing_from_seq: 0,
                };
                e.resync = Some(self.epoch);
                self.resyncs += 1;
                e.acked_missing = e.ring.missing_total().max(e.ring.producer_dropped());
                let _ = e.stream.set_nonblocking(false);
                let _ = kvedge_shm::control::send_resync(&e.stream, &request);
                let _ = e.stream.set_nonblocking(true);
            }
            let late = now.saturating_sub(e.last_seen_ms) > heartbeat_timeout;
            self.router.set_available(e.slot, !late);
            let closed = (e.readable && connection_closed(&e.stream).unwrap_or(true))
                || e.ring.poisoned().is_some();
            if closed {
                let e = self.engines.swap_remove(i);
                self.departed_drops += e.ring.producer_dropped();
                unwatch_engine(&self.epoll, &e);
                self.router.unregister(e.slot);
                any = true;
                continue;
            }
            i += 1;
        }
        any
    }

    /// Reads every readable client socket and answers its complete
    /// requests, then the requests in its query channel, if any.
    fn serve_clients(&mut self) -> bool {
        let mut any = false;
        let limit = self.config.daemon.max_frame_bytes;
        let mut i = 0;
        while i < self.clients.len() {
            let mut closed = false;
            let chunk = &mut self.scratch[..];
            while self.clients[i].readable {
                match self.clients[i].stream.read(chunk) {
                    Ok(0) => {
                        closed = true;
                        break;
                    }
                    Ok(n) => {
                        any = true;
                        self.clients[i].buf.extend_from_slice(&chunk[..n]);
                        self.clients[i].last_active = self.turn;
                        // A short read drained the socket: skip the read
                        // that would only say EAGAIN (a syscall per
                        // request). Anything newer shows at the next
                        // readiness check (level-triggered).
                        if n < chunk.len() {
                            break;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        closed = true;
                        break;
                    }
                }
            }
            {
                let c = &mut self.clients[i];
                framing::detect(&mut c.mode, &mut c.buf);
            }
            closed |= self.serve_requests(i, limit);
            if !closed {
                match self.serve_ring(i) {
                    Ok(served) => any |= served,
                    Err(e) => {
                        tracing::warn!(
                            "a query channel's request ring is broken, closing its connection: {e}"
                        );
                        any = true;
                        closed = true;
                    }
                }
            }
            if closed {
                let c = self.clients.swap_remove(i);
                unwatch_client(&self.epoll, &c);
            } else {
                i += 1;
            }
        }
        any
    }

    /// Answers every complete request of client `i` (JSON lines or binary
    /// frames); returns whether the connection must close.
    fn serve_requests(&mut self, i: usize, limit: usize) -> bool {
        let mode = self.clients[i].mode;
        let mut buf = std::mem::take(&mut self.clients[i].buf);
        let mut out = std::mem::take(&mut self.reply);
        let mut closed = false;
        let mut consumed = 0;
        loop {
            match framing::next(mode, &buf[consumed..], limit) {
                Next::NeedMore => break,
                Next::TooLarge => {
                    let _ = write_reply(
                        &mut self.clients[i].stream,
                        &framing::too_large(mode, limit),
                    );
                    closed = true;
                    break;
                }
                Next::Request { body, used } => {
                    let body = &buf[consumed + body.start..consumed + body.end];
                    if mode == Mode::Binary
                        && body.get(..2) == Some(&kvedge_wire::op::ATTACH_RINGS.to_le_bytes()[..])
                    {
                        consumed += used;
                        if self.attach_rings(i, body).is_err() {
                            closed = true;
                            break;
                        }
                        continue;
                    }
                    self.answer(mode, body, &mut out);
                    consumed += used;
                    if write_reply(&mut self.clients[i].stream, &out).is_err() {
                        closed = true;
                        break;
                    }
                }
            }
        }
        buf.drain(..consumed);
        self.clients[i].buf = buf;
        self.reply = out;
        closed
    }

    /// Answers an `attach_rings` frame from client `i`: creates its query
    /// channel and sends the four descriptors with the reply, or refuses
    /// (`RINGS_UNAVAILABLE`) and leaves the connection as it was. An error
    /// means the reply could not be sent: close the connection.
    fn attach_rings(&mut self, i: usize, body: &[u8]) -> io::Result<()> {
        use kvedge_wire::status;
        let mut out = Vec::new();
        let limit = self.config.daemon.max_query_rings;
        let attached = self.query_channels();
        let refusal = if let Err((code, message)) = kvedge_wire::parse_request(body) {
            Some((code, message.to_owned()))
        } else if self.clients[i].rings.is_some() {
            Some((
                status::RINGS_UNAVAILABLE,
                "this connection already has a query channel".to_owned(),
            ))
        } else if limit == 0 {
            Some((
                status::RINGS_UNAVAILABLE,
                "query channels are turned off (daemon.max_query_rings: 0); use the socket"
                    .to_owned(),
            ))
        } else if attached >= limit {
            Some((
                status::RINGS_UNAVAILABLE,
                format!(
                    "{attached} query channels are attached, the limit (daemon.max_query_rings: {limit}); use the socket"
                ),
            ))
        } else {
            None
        };
        if let Some((code, message)) = refusal {
            self.errors += 1;
            kvedge_wire::write_error(&mut out, code, &message);
            return write_reply(&mut self.clients[i].stream, &out);
        }
        self.epoch += 1;
        let capacity = self.config.daemon.query_ring_capacity;
        let rings = match ServerChannel::create(capacity, self.epoch) {
            Ok(r) => r,
            Err(e) => {
                self.errors += 1;
                tracing::warn!("cannot create a query channel: {e}");
                kvedge_wire::write_error(
                    &mut out,
                    status::RINGS_UNAVAILABLE,
                    &format!("the daemon cannot create the rings: {e}"),
                );
                return write_reply(&mut self.clients[i].stream, &out);
            }
        };
        kvedge_wire::write_frame(&mut out, status::OK, |o| {
            o.extend_from_slice(&capacity.to_le_bytes())
        });
        // The descriptors go with the reply's first byte.
        blocking_for_a_second(&mut self.clients[i].stream, |s| {
            query_channel::send_with_fds(s, &out, &rings.fds())
        })?;
        watch_wake(&self.epoll, rings.requests.wake_fd())?;
        self.clients[i].rings = Some(rings);
        Ok(())
    }

    /// Answers the requests waiting in client `i`'s query channel, if it
    /// has one (at most 64 a turn, so one client cannot starve the rest).
    /// Returns whether it served any, or the error that broke the
    /// request ring's framing (the connection must close). Any other bad
    /// record gets an error reply.
    fn serve_ring(&mut self, i: usize) -> Result<bool, kvedge_shm::RingError> {
        use kvedge_wire::status;
        let Some(mut rings) = self.clients[i].rings.take() else {
            return Ok(false);
        };
        let mut out = std::mem::take(&mut self.reply);
        let mut result = Ok(false);
        for _ in 0..64 {
            let record = match rings.requests.poll() {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            result = Ok(true);
            out.clear();
            if record.kind == query_channel::FRAME {
                self.answer(Mode::Binary, record.payload, &mut out);
            } else {
                self.errors += 1;
                kvedge_wire::write_error(
                    &mut out,
                    status::BAD_REQUEST,
                    "unknown record type in the request ring",
                );
            }
            if out.len() - 4 > rings.replies.max_payload() {
                out.clear();
                kvedge_wire::write_error(
                    &mut out,
                    status::FRAME_TOO_LARGE,
                    "the reply does not fit the reply ring; send this request over the socket",
                );
            }
            // Dropped only when the client stopped reading its replies
            // (it then sees a gap): its loss, nobody else's.
            let _ = rings.replies.try_push(query_channel::FRAME, 0, &out[4..]);
        }
        self.reply = out;
        if result == Ok(true) {
            self.clients[i].last_active = self.turn;
        }
        self.clients[i].rings = Some(rings);
        result
    }

    /// The reply bytes to one request body in `mode`, into `out`.
    fn answer(&mut self, mode: Mode, body: &[u8], out: &mut Vec<u8>) {
        out.clear();
        if mode == Mode::Binary {
            self.handle_binary(body, out);
        } else {
            let reply = self.handle(body);
            // Writing a Value into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut *out, &reply);
            out.push(b'\n');
        }
    }

    /// Block size of the workers serving `model` in `role` (16 when none is
    /// registered): how token ids are cut into blocks.
    fn block_size_for(&self, model: &str, role: WorkerType) -> u32 {
        self.router
            .workers()
            .find(|(_, w)| w.model == model && w.role == role)
            .map_or(16, |(_, w)| w.block_size)
    }

    /// Where a selection sends the request: the endpoint, and the provider's
    /// name when a rule chose a provider rather than a worker.
    fn target(&self, r: &kvedge_core::router::SelectResult) -> (&str, Option<&str>) {
        match (r.slot, r.provider) {
            (Some(slot), _) => (
                self.router.worker(slot).map_or("", |w| w.endpoint.as_str()),
                None,
            ),
            (None, Some(p)) => match self.router.rules() {
                Some(rules) => (
                    rules.providers[p].endpoint.as_str(),
                    Some(rules.providers[p].name.as_str()),
                ),
                None => ("", None),
            },
            (None, None) => ("", None),
        }
    }

    fn handle_binary(&mut self, body: &[u8], out: &mut Vec<u8>) {
        use kvedge_wire::{Ids, Request, SelectView, status};
        let request = match kvedge_wire::parse_request(body) {
            Ok(r) => r,
            Err((code, message)) => {
                self.errors += 1;
                kvedge_wire::write_error(out, code, message);
                return;
            }
        };
        let result = match request {
            Request::AttachRings => {
                self.errors += 1;
                kvedge_wire::write_error(
                    out,
                    status::RINGS_UNAVAILABLE,
                    "query channels are attached over query.sock served by the routing loop (daemon.query_io: epoll)",
                );
                return;
            }
            Request::PrefillDone(id) => self.router.load.prefill_done(id),
            Request::Finish(id) => self.router.load.finish(id),
            Request::Select {
                dry_run,
                role,
                model,
                session,
                prompt_tokens,
                ids,
                context,
            } => {
                let Some(role) = WorkerType::ALL.get(usize::from(role)).copied() else {
                    self.errors += 1;
                    kvedge_wire::write_error(out, status::BAD_REQUEST, "unknown role");
                    return;
                };
                let mut hashes = std::mem::take(&mut self.hashes);
                hashes.clear();
                let tokens_given = match ids {
                    Ids::Hashes(bytes) => {
                        hashes.extend(
                            bytes
                                .chunks_exact(8)
                                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))),
                        );
                        hashes.len() as u32 * self.block_size_for(model, role)
                    }
                    Ids::Tokens(bytes) => {
                        let tokens: Vec<u32> = bytes
                            .chunks_exact(4)
                            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
                            .collect();
                        let bs = self.block_size_for(model, role) as usize;
                        hashes.extend(kvedge_shm::hash::sequence_hashes(&tokens, bs, None, None));
                        tokens.len() as u32
                    }
                };
                // Tags on the stack (at most MAX_TAGS); headers only when sent.
                let mut tag_buf = [""; kvedge_wire::MAX_TAGS];
                for (slot, tag) in tag_buf.iter_mut().zip(context.tags()) {
                    *slot = tag;
                }
                let headers = (context.header_count() > 0)
                    .then(|| kvedge_policies::AgentHeaders::from_pairs(context.headers()));
                let req = SelectRequest {
                    model,
                    tenant: context.tenant,
                    tags: &tag_buf[..context.tag_count()],
                    headers: headers.as_ref(),
                    priority: context.priority,
                    role,
                    hashes: &hashes,
                    prompt_tokens: if prompt_tokens > 0 {
                        prompt_tokens
                    } else {
                        tokens_given
                    },
                    session: session.map(|s| SessionContext::new(s, InputTrigger::UserMessage)),
                    pinned: None,
                    now_ms: self.started.elapsed().as_millis() as u64,
                    dry_run,
                };
                if !req.dry_run
                    && self.router.load.reservations() >= self.config.daemon.max_reservations
                {
                    self.hashes = hashes;
                    self.errors += 1;
                    let m = self.too_many_requests();
                    kvedge_wire::write_error(out, status::TOO_MANY_REQUESTS, &m);
                    return;
                }
                let t = Instant::now();
                let r = self.router.select(&req);
                self.select_latency.record(t.elapsed().as_nanos() as u64);
                self.hashes = hashes;
                match r {
                    Ok(r) => {
                        self.selects += 1;
                        self.count_selection(role, r.rule, "ok");
                        let (endpoint, provider) = self.target(&r);
                        kvedge_wire::write_select_reply(
                            out,
                            &SelectView {
                                worker_id: r.worker.worker_id,
                                dp_rank: r.worker.dp_rank,
                                request_id: r.request_id,
                                cost: r.cost,
                                overlap_blocks: r.overlap_blocks,
                                provider: provider.is_some(),
                                endpoint,
                            },
                        );
                        return;
                    }
                    Err(e) => {
                        self.errors += 1;
                        self.count_selection(role, None, error_code(&e).0);
                        kvedge_wire::write_error(out, error_code(&e).1, &e.to_string());
                        return;
                    }
                }
            }
        };
        match result {
            Ok(_) => kvedge_wire::write_frame(out, status::OK, |_| {}),
            Err(e) => {
                self.errors += 1;
                kvedge_wire::write_error(out, status::UNKNOWN_REQUEST, &e.to_string());
            }
        }
    }

    /// Every ring this loop reads: the engines' and the query channels'
    /// request rings.
    fn consumers(&mut self) -> impl Iterator<Item = &mut Consumer> {
        let engines = self.engines.iter_mut().map(|e| &mut e.ring);
        let channels = self
            .clients
            .iter_mut()
            .filter_map(|c| c.rings.as_mut().map(|r| &mut r.requests));
        engines.chain(channels)
    }

    fn sleep(&mut self, timeout: Duration) {
        // A ring whose prepare_sleep says records arrived meanwhile clears
        // its own flag; the ones before it are woken back up.
        let prepared = self
            .consumers()
            .map(|r| r.prepare_sleep())
            .take_while(|&ok| ok)
            .count();
        if prepared < self.consumers().count() {
            // Records arrived meanwhile: do not sleep at all.
            for ring in self.consumers().take(prepared) {
                ring.end_sleep();
            }
            return;
        }
        // Every socket and every ring's wake eventfd is in the epoll set:
        // one wait, no list to build. What woke us is found again by the
        // next readiness check (level-triggered).
        let ts = rustix::time::Timespec::try_from(timeout).unwrap_or(rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 100_000_000,
        });
        let mut buf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 8];
        let _ = epoll::wait(&self.epoll, &mut buf[..], Some(&ts));
        for ring in self.consumers() {
            ring.end_sleep();
        }
    }

    fn handle(&mut self, line: &[u8]) -> Value {
        let reply = match serde_json::from_slice::<Request>(line) {
            Ok(r) => r.into_query().and_then(|q| self.dispatch(q)),
            Err(e) => Err(("bad_request", format!("not a valid request: {e}"))),
        };
        match reply {
            Ok(v) => v,
            Err((code, message)) => {
                self.errors += 1;
                error(code, &message)
            }
        }
    }

    fn dispatch(&mut self, q: Query) -> Result<Value, (&'static str, String)> {
        match q {
            Query::Select(s) => self.select(*s),
            Query::PrefillDone { request_id } => self
                .router
                .load
                .prefill_done(request_id)
                .map(|_| json!({"ok": true}))
                .map_err(|e| ("unknown_request", e.to_string())),
            Query::Finish { request_id } => self
                .router
                .load
                .finish(request_id)
                .map(|_| json!({"ok": true}))
                .map_err(|e| ("unknown_request", e.to_string())),
            Query::Workers => {
                let list: Vec<Value> = self
                    .worker_rows()
                    .into_iter()
                    .map(|w| {
                        json!({
                            "worker_id": w.worker_id,
                            "dp_rank": w.dp_rank,
                            "model": w.model,
                            "role": w.role,
                            "endpoint": w.endpoint,
                            "available": w.available,
                            "device_blocks": w.device_blocks,
                            "active_requests": w.active_requests,
                            "active_prefill_tokens": w.active_prefill_tokens,
                        })
                    })
                    .collect();
                Ok(json!({ "workers": list }))
            }
            Query::Metrics => Ok(json!({"text": kvedge_core::metrics::render(&self.metrics())})),
            Query::Reload => self
                .reload()
                .map(|_| json!({"ok": true, "reloads": self.reloads}))
                .map_err(|e| ("reload_failed", e)),
            Query::Stats => Ok(json!({
                "workers": self.engines.len(),
                "clients": self.clients.len(),
                "query_channels": self.query_channels(),
                "index_entries": self.router.index.entries(),
                "index_refused_full": self.router.index.refused_full(),
                "reservations": self.router.load.reservations(),
                "selects": self.selects,
                "errors": self.errors,
                "select_latency": self.select_latency.to_json(),
                "reloads": self.reloads,
                "reload_failures": self.reload_failures,
                "refused_registrations": self.refused_registrations,
                "refused_connections": self.refused_connections,
            })),
        }
    }

    fn select(&mut self, s: SelectQuery) -> Result<Value, (&'static str, String)> {
        let role = match s.role.as_deref() {
            None => WorkerType::Aggregated,
            Some(r) => {
                WorkerType::parse(r).ok_or(("bad_request", format!("unknown role `{r}`")))?
            }
        };
        let block_size = self.block_size_for(&s.model, role);
        let (hashes, prompt_tokens) = match (s.tokens, s.hashes) {
            (Some(tokens), None) => {
                let bs = block_size as usize;
                let h = kvedge_shm::hash::sequence_hashes(&tokens, bs, s.lora.as_deref(), None);
                (h, tokens.len() as u32)
            }
            (None, Some(hashes)) => {
                let tokens = s.prompt_tokens.unwrap_or(hashes.len() as u32 * block_size);
                (hashes, tokens)
            }
            _ => {
                return Err((
                    "bad_request",
                    "give exactly one of `tokens` and `hashes`".into(),
                ));
            }
        };
        let session = s
            .session
            .as_deref()
            .map(|id| SessionContext::new(id, InputTrigger::UserMessage));
        let tags: Vec<&str> = s.tags.iter().map(String::as_str).collect();
        let headers = (!s.headers.is_empty()).then(|| {
            kvedge_policies::AgentHeaders::from_pairs(
                s.headers.iter().map(|(k, v)| (k, v.as_str())),
            )
        });
        let req = SelectRequest {
            model: &s.model,
            tenant: s.tenant.as_deref(),
            tags: &tags,
            headers: headers.as_ref(),
            priority: s.priority,
            role,
            hashes: &hashes,
            prompt_tokens,
            session,
            pinned: None,
            now_ms: self.now_ms(),
            dry_run: s.dry_run,
        };
        if !req.dry_run && self.router.load.reservations() >= self.config.daemon.max_reservations {
            return Err(("too_many_requests", self.too_many_requests()));
        }
        self.router.set_explain_costs(s.explain);
        let t = Instant::now();
        let r = self.router.select(&req);
        self.select_latency.record(t.elapsed().as_nanos() as u64);
        self.router.set_explain_costs(false);
        let r = match r {
            Ok(r) => {
                self.count_selection(role, r.rule, "ok");
                r
            }
            Err(e) => {
                self.count_selection(role, None, error_code(&e).0);
                return Err((error_code(&e).0, e.to_string()));
            }
        };
        self.selects += 1;
        let rules = self.router.rules();
        let rule = r
            .rule
            .and_then(|i| rules.and_then(|p| p.rules.get(i)))
            .map_or(Value::Null, |rule| json!(rule.name));
        let (endpoint, provider) = self.target(&r);
        let (endpoint, provider) = (endpoint.to_owned(), json!(provider));
        let local = r.slot.is_some();
        let explain = if s.explain {
            let e = self.router.last_explain();
            let candidates: Vec<Value> = self
                .router
                .workers()
                .filter(|(_, w)| w.available && w.role == role)
                .map(|(slot, w)| {
                    let load = self.router.load.projected(slot);
                    let overlap = self.router.last_overlap(slot);
                    json!({
                        "worker_id": w.worker.worker_id,
                        "dp_rank": w.worker.dp_rank,
                        "model": w.model,
                        "cost": self.router.last_cost(slot),
                        "overlap_blocks": {"device": overlap[0], "host": overlap[1], "disk": overlap[2]},
                        "active_requests": load.active_requests,
                        "active_prefill_tokens": load.active_prefill_tokens,
                        "active_decode_blocks": load.active_decode_blocks,
                    })
                })
                .collect();
            json!({
                "candidates": e.candidates,
                "survivors": e.survivors,
                "tier": e.tier,
                "considered": e.considered,
                "after_exclude": e.after_exclude,
                "fell_through": e.fell_through,
                "workers": candidates,
            })
        } else {
            Value::Null
        };
        Ok(json!({
            "explain": explain,
            "worker_id": if local { json!(r.worker.worker_id) } else { Value::Null },
            "dp_rank": if local { json!(r.worker.dp_rank) } else { Value::Null },
            "provider": provider,
            "endpoint": endpoint,
            "overlap_blocks": {"device": r.overlap_blocks[0], "host": r.overlap_blocks[1], "disk": r.overlap_blocks[2]},
            "cost": if r.cost.is_finite() { json!(r.cost) } else { Value::Null },
            "policy": self.router.policy_name(role).0,
            "rule": rule,
            "request_id": r.request_id,
        }))
    }
}

/// Writes a reply: straight through when the socket has room (the usual
/// case), else blocking for at most a second.
fn write_reply(stream: &mut UnixStream, bytes: &[u8]) -> io::Result<()> {
    let written = match stream.write(bytes) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(e) => return Err(e),
    };
    if written == bytes.len() {
        return Ok(());
    }
    blocking_for_a_second(stream, |s| s.write_all(&bytes[written..]))
}

/// Runs `send` on `stream` switched to blocking with a one-second write
/// timeout (a client whose socket is full gets that long), then switches
/// it back to non-blocking.
fn blocking_for_a_second<T>(
    stream: &mut UnixStream,
    send: impl FnOnce(&mut UnixStream) -> io::Result<T>,
) -> io::Result<T> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(Duration::from_secs(1)))?;
    let result = send(stream);
    stream.set_nonblocking(true)?;
    result
}

/// A selection error's code in JSON replies and in binary status codes.
fn error_code(e: &kvedge_core::router::RouterError) -> (&'static str, u16) {
    use kvedge_core::router::RouterError;
    use kvedge_wire::status;
    match e {
        RouterError::RejectedByRule { .. } => ("rejected", status::REJECTED),
        RouterError::NoRuleMatched => ("no_rule", status::NO_RULE),
        RouterError::Session(_) => ("bad_request", status::BAD_REQUEST),
        RouterError::NoWorkers { .. } | RouterError::Selection(_) => {
            ("no_worker", status::NO_WORKER)
        }
    }
}

fn error(code: &str, message: &str) -> Value {
    json!({"error": {"code": code, "message": message}})
}

/// One request line. A flat struct rather than an internally tagged enum:
/// serde buffers a tagged enum's whole content before dispatching, which for
/// a 2,048-token prompt cost most of the round trip.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Request {
    op: String,
    model: Option<String>,
    role: Option<String>,
    tokens: Option<Vec<u32>>,
    hashes: Option<Vec<u64>>,
    prompt_tokens: Option<u32>,
    session: Option<String>,
    tenant: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    lora: Option<String>,
    #[serde(default)]
    dry_run: bool,
    #[serde(default)]
    explain: bool,
    #[serde(default)]
    priority: i32,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
    request_id: Option<u64>,
}

enum Query {
    Select(Box<SelectQuery>),
    PrefillDone { request_id: u64 },
    Finish { request_id: u64 },
    Workers,
    Stats,
    Reload,
    Metrics,
}

struct SelectQuery {
    model: String,
    role: Option<String>,
    tokens: Option<Vec<u32>>,
    hashes: Option<Vec<u64>>,
    prompt_tokens: Option<u32>,
    session: Option<String>,
    tenant: Option<String>,
    tags: Vec<String>,
    lora: Option<String>,
    dry_run: bool,
    explain: bool,
    priority: i32,
    headers: std::collections::BTreeMap<String, String>,
}

impl Request {
    fn into_query(self) -> Result<Query, (&'static str, String)> {
        let need_id = |id: Option<u64>, op: &str| {
            id.ok_or(("bad_request", format!("`{op}` needs `request_id`")))
        };
        Ok(match self.op.as_str() {
            "select" => Query::Select(Box::new(SelectQuery {
                model: self
                    .model
                    .ok_or(("bad_request", "`select` needs `model`".to_owned()))?,
                role: self.role,
                tokens: self.tokens,
                hashes: self.hashes,
                prompt_tokens: self.prompt_tokens,
                session: self.session,
                tenant: self.tenant,
                tags: self.tags,
                lora: self.lora,
                dry_run: self.dry_run,
                explain: self.explain,
                priority: self.priority,
                headers: self.headers,
            })),
            "prefill_done" => Query::PrefillDone {
                request_id: need_id(self.request_id, "prefill_done")?,
            },
            "finish" => Query::Finish {
                request_id: need_id(self.request_id, "finish")?,
            },
            "workers" => Query::Workers,
            "stats" => Query::Stats,
            "reload" => Query::Reload,
            "metrics" => Query::Metrics,
            other => {
                return Err((
                    "bad_request",
                    format!(
                        "unknown op `{other}` (select, prefill_done, finish, workers, stats, metrics, reload)"
                    ),
                ));
            }
        })
    }
}
