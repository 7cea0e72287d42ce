//! [`Core`]: every piece of routing state behind one type that does no
//! I/O. Drivers feed it what happened (`handle_*`: an engine connected or
//! registered, a ring record, a drained ring, a client's request, a
//! reload, the passing of time) and ask it what to do (`poll_output`: send
//! a resync, close a connection; `poll_timeout`: when to call
//! `handle_timeout` next). Time is always passed in; the core reads no
//! clock, opens no socket and starts no thread, so a test drives it
//! through any sequence of events in virtual time.
//!
//! This module holds the core's state and the lifecycles of engines and
//! clients; [`crate::answer`] answers requests.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvedge_policies::{WorkerType, WorkerWithDpRank};
use kvedge_schema::messages::control::{ResyncRequest, Welcome, reject};
use kvedge_schema::messages::kind;
use kvedge_schema::{EventRef, decode};
use kvedge_shm::control::PeerCred;
use kvedge_shm::ring::Record;

use crate::client::{Client, ClientId};
use crate::counters::{Counters, event_kind};
use crate::engine::{Engine, EngineId, EngineState};
use crate::router::{RegisterError, Router, SelectRequest, WorkerInfo};
use crate::table::Table;
use crate::warm::Warmth;
use crate::warn::{Warn, Warnings};
use kvedge_config::Config;

/// Engine connections waiting for their Hello at once, at most; the
/// oldest one yields to a new one.
pub const MAX_PENDING_REGISTRATIONS: usize = 64;
/// Engine connections of one peer uid waiting for their Hello at once, at
/// most; that uid's oldest one yields to its new one. A flood from one
/// user therefore evicts only its own connections.
pub const MAX_PENDING_PER_UID: usize = 8;
/// How long a connection on the control socket has to send its Hello (a
/// real engine sends it as soon as it connects).
pub const REGISTRATION_DEADLINE: Duration = Duration::from_secs(1);
/// How long an engine has to begin the snapshot it was asked for before
/// it is asked again (it may have missed the request).
pub const RESYNC_ANSWER_DEADLINE: Duration = Duration::from_secs(5);
/// How often an engine must send a record (a heartbeat, if nothing else).
pub const HEARTBEAT_INTERVAL_MS: u32 = 1000;

/// What the core asks its driver to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Send `request` on the engine's control connection.
    Resync {
        engine: EngineId,
        request: ResyncRequest,
    },
    /// Close the engine's connection and release its ring, then report
    /// [`Core::handle_engine_closed`].
    CloseEngine(EngineId),
    /// Close the client's connection; the core has forgotten it.
    CloseClient(ClientId),
}

/// Why an engine's registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistrationError {
    #[error(
        "uid {uid} gid {gid} (worker {worker}, pid {pid}) is not allowed by allowed_uids/allowed_gids"
    )]
    NotPermitted {
        worker: u64,
        pid: u32,
        uid: u32,
        gid: u32,
    },
    #[error("no peer credentials: {0}")]
    NoCredentials(String),
    #[error(transparent)]
    Refused(#[from] RegisterError),
    #[error("the connection is not waiting for its Hello")]
    NotRegistering,
    #[error(
        "the connection was closed before its Hello was read (newer connections of the same uid took its place, or the registration deadline passed); connect again"
    )]
    Displaced,
}

impl RegistrationError {
    /// The reject code the engine is told.
    pub fn reject_code(&self) -> u32 {
        match self {
            RegistrationError::NotPermitted { .. } | RegistrationError::NoCredentials(_) => {
                reject::NOT_PERMITTED
            }
            RegistrationError::Refused(RegisterError::Full(_)) => reject::TOO_MANY_WORKERS,
            RegistrationError::Refused(RegisterError::Duplicate(_)) => reject::DUPLICATE_WORKER,
            RegistrationError::Refused(
                RegisterError::BlockSize | RegisterError::Label(_) | RegisterError::Taint(_),
            ) => reject::INVALID_HELLO,
            RegistrationError::NotRegistering => reject::INTERNAL,
            RegistrationError::Displaced => reject::DISPLACED,
        }
    }
}

/// Retained buffers of the select path.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    pub hashes: Vec<u64>,
    pub tokens: Vec<u32>,
    /// Engines whose resync request is due (in `handle_timeout`).
    pub resync: Vec<EngineId>,
}

/// All routing state, without I/O (see the module documentation).
///
/// Its public surface, by what it is for:
///
/// - **inputs**, what happened: [`Core::handle_engine_connected`],
///   [`Core::handle_hello`], [`Core::handle_registration_failed`],
///   [`Core::handle_engine_record`], [`Core::handle_engine_drained`],
///   [`Core::handle_engine_broken`], [`Core::handle_engine_closed`] (engines);
///   [`Core::handle_client_connected`], [`Core::handle_client_active`],
///   [`Core::handle_client_dropped`], [`Core::handle_client_closed`]
///   (clients); [`Core::handle_request`], [`Core::handle_undecodable`],
///   [`Core::handle_attach_rings`], [`Core::handle_rings_detached`]
///   (requests); [`Core::handle_reload`], [`Core::handle_timeout`],
///   [`Core::handle_picker_stats`], [`Core::note_select_time`] (the rest);
/// - **outputs**, what to do: [`Core::poll_output`],
///   [`Core::poll_timeout`], [`Core::take_retired_config`];
/// - **queries**, what it holds: [`Core::config`], [`Core::router`],
///   [`Core::engine_state`], [`Core::engines`], [`Core::clients`],
///   [`Core::query_channels`], [`Core::worker_rows`], [`Core::stats`],
///   [`Core::metrics`], [`Core::status`].
#[derive(Debug)]
pub struct Core {
    pub(crate) router: Router,
    pub(crate) config: Config,
    /// The configuration a reload replaced, until the driver takes it.
    pub(crate) retired: Option<Config>,
    /// The origin of the router's millisecond clock.
    start: Instant,
    engines: Table<Engine>,
    pub(crate) clients: Table<Client>,
    /// Ring attach epochs and snapshot ids: one increasing sequence.
    epoch: u64,
    outputs: VecDeque<Output>,
    /// No deadline falls before this; `handle_timeout` recomputes it, and
    /// anything new lowers it.
    next_timeout: Option<Instant>,
    pub(crate) counters: Counters,
    pub(crate) scratch: Scratch,
    /// Rate limits of the warnings a peer can provoke.
    pub(crate) warnings: Warnings,
    /// What the idle loop warms the select path with.
    pub(crate) warmth: Warmth,
    /// The most recent selections (`decisions`).
    pub(crate) recent: crate::recent::Recent,
}

impl Core {
    /// A core for `config`, whose clock starts at `now`.
    pub fn new(config: Config, now: Instant) -> Core {
        Core {
            router: Router::from_config(&config),
            config,
            retired: None,
            start: now,
            engines: Table::default(),
            clients: Table::default(),
            epoch: 0,
            outputs: VecDeque::with_capacity(64),
            next_timeout: None,
            counters: Counters::default(),
            scratch: Scratch {
                hashes: Vec::with_capacity(4096),
                tokens: Vec::with_capacity(4096),
                resync: Vec::new(),
            },
            warnings: Warnings::default(),
            warmth: Warmth::new(now),
            recent: crate::recent::Recent::default(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The router (index, load table, workers), for inspection.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Milliseconds since the core started, at `now`.
    pub(crate) fn ms(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.start).as_millis() as u64
    }

    /// The next number of the epoch sequence.
    pub(crate) fn next_epoch(&mut self) -> u64 {
        self.epoch += 1;
        self.epoch
    }

    /// What the driver should do next, if anything.
    #[inline]
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// When [`Core::handle_timeout`] is due (it may find nothing to do:
    /// deadlines only move later between two calls).
    #[inline]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_timeout
    }

    /// Something new is due at `at`.
    pub(crate) fn due(&mut self, at: Instant) {
        self.next_timeout = Some(self.next_timeout.map_or(at, |t| t.min(at)));
    }

    /// Logs a warning of `kind`, at most once a second per kind (with how
    /// many were held back since the last one).
    pub(crate) fn warn(&mut self, now: Instant, kind: Warn, what: std::fmt::Arguments<'_>) {
        if let Some(held_back) = self.warnings.allow(now, kind) {
            if held_back > 0 {
                tracing::warn!("{what} (and {held_back} more like it in the last second or more)");
            } else {
                tracing::warn!("{what}");
            }
        }
    }

    // ---------------------------------------------------------- engines

    /// A connection arrived on the control socket from a peer of `uid`
    /// (`None`: its credentials could not be read); its Hello is awaited
    /// for [`REGISTRATION_DEADLINE`]. It is always admitted: when
    /// [`MAX_PENDING_PER_UID`] connections of its uid, or
    /// [`MAX_PENDING_REGISTRATIONS`] in all, are already waiting, the
    /// oldest of them is closed instead ([`Output::CloseEngine`]), so
    /// silent connections cannot lock real engines out.
    pub fn handle_engine_connected(&mut self, now: Instant, uid: Option<u32>) -> EngineId {
        let mut pending = 0;
        let mut same_uid = 0;
        let mut oldest: Option<(Instant, (u32, u32))> = None;
        let mut oldest_same: Option<(Instant, (u32, u32))> = None;
        for (key, e) in self.engines.iter() {
            if let EngineState::Registering { since } = e.state {
                pending += 1;
                if oldest.is_none_or(|(t, _)| since < t) {
                    oldest = Some((since, key));
                }
                if e.uid == uid {
                    same_uid += 1;
                    if oldest_same.is_none_or(|(t, _)| since < t) {
                        oldest_same = Some((since, key));
                    }
                }
            }
        }
        let evict = if same_uid >= MAX_PENDING_PER_UID {
            oldest_same
        } else if pending >= MAX_PENDING_REGISTRATIONS {
            oldest
        } else {
            None
        };
        if let Some((_, (index, generation))) = evict {
            if let Some(e) = self.engines.get_mut(index, generation) {
                e.state = EngineState::Broken;
            }
            self.counters.refused_registrations += 1;
            self.outputs
                .push_back(Output::CloseEngine(EngineId { index, generation }));
            self.warn(
                now,
                Warn::Registration,
                format_args!(
                    "engine connection closed before its Hello: a newer connection took its place ({} pending at most, {} per uid)",
                    MAX_PENDING_REGISTRATIONS, MAX_PENDING_PER_UID
                ),
            );
        }
        let (index, generation) = self.engines.insert(|_| Engine::registering(now, uid));
        self.due(now + REGISTRATION_DEADLINE);
        EngineId { index, generation }
    }

    /// Engine `id` sent its Hello: registers its worker and answers the
    /// Welcome to send with a fresh ring of the given epoch and capacity.
    /// `peer` is asked for the connection's credentials when the
    /// configuration restricts engines. A refusal forgets the connection.
    pub fn handle_hello(
        &mut self,
        now: Instant,
        id: EngineId,
        hello: &kvedge_schema::messages::control::Hello,
        peer: impl FnOnce() -> std::io::Result<PeerCred>,
    ) -> Result<Welcome, RegistrationError> {
        let result = self.register(now, id, hello, peer);
        if let Err(e) = &result {
            self.engines.remove(id.index, id.generation);
            self.counters.refused_registrations += 1;
            self.warn(
                now,
                Warn::Registration,
                format_args!("engine registration refused: {e}"),
            );
        }
        result
    }

    fn register(
        &mut self,
        now: Instant,
        id: EngineId,
        hello: &kvedge_schema::messages::control::Hello,
        peer: impl FnOnce() -> std::io::Result<PeerCred>,
    ) -> Result<Welcome, RegistrationError> {
        match self.engines.get(id.index, id.generation) {
            Some(e) if matches!(e.state, EngineState::Registering { .. }) => {}
            // Closed by the core while waiting (displaced or past its
            // deadline); the driver has not dropped the socket yet.
            Some(e) if e.state == EngineState::Broken && e.slot.is_none() => {
                return Err(RegistrationError::Displaced);
            }
            _ => return Err(RegistrationError::NotRegistering),
        }
        let d = &self.config.daemon;
        if d.engine_policy() {
            let c = peer().map_err(|e| RegistrationError::NoCredentials(e.to_string()))?;
            if !d.engine_allowed(c.uid, c.gid) {
                return Err(RegistrationError::NotPermitted {
                    worker: hello.worker_id,
                    pid: c.pid,
                    uid: c.uid,
                    gid: c.gid,
                });
            }
        }
        // A registration of a worker whose engine is still connected but
        // silent past its heartbeat (hung, SIGSTOPped) replaces it: the
        // new process is the worker now.
        let worker = WorkerWithDpRank::new(hello.worker_id, hello.dp_rank);
        let hung = self.engines.iter().find_map(|(key, e)| {
            let slot = e.slot?;
            (e.late && self.router.worker(slot).is_some_and(|w| w.worker == worker)).then_some(key)
        });
        if let Some((index, generation)) = hung {
            let old = EngineId { index, generation };
            tracing::warn!(
                worker = ?worker,
                "a new engine registered as this worker while its previous engine was silent past its heartbeat: the previous one is closed and replaced"
            );
            if let Some(e) = self.engines.get_mut(index, generation) {
                e.state = EngineState::Broken;
                if let Some(slot) = e.slot.take() {
                    self.router.unregister(slot);
                }
            }
            self.outputs.push_back(Output::CloseEngine(old));
        }
        if let Some(l) = hello
            .labels
            .iter()
            .find(|l| l.key.is_empty() || l.key.contains('='))
        {
            return Err(RegisterError::Label(format!("{}={}", l.key, l.value)).into());
        }
        let taints = hello
            .taints
            .iter()
            .map(|t| crate::router::Taint::parse(t).ok_or_else(|| RegisterError::Taint(t.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        let slot = self.router.register(WorkerInfo {
            worker: WorkerWithDpRank::new(hello.worker_id, hello.dp_rank),
            model: hello.model.clone(),
            role: WorkerType::ALL[hello.role as usize],
            endpoint: hello.endpoint.clone(),
            block_size: hello.block_size,
            available: true,
            labels: hello
                .labels
                .iter()
                .map(|l| format!("{}={}", l.key, l.value))
                .collect(),
            taints,
        })?;
        let attach_epoch = self.next_epoch();
        let e = self
            .engines
            .get_mut(id.index, id.generation)
            .expect("checked above");
        e.state = EngineState::Live;
        e.slot = Some(slot);
        e.last_seen = now;
        self.due(now + Duration::from_millis(self.config.daemon.heartbeat_timeout_ms));
        Ok(Welcome {
            worker_id: hello.worker_id,
            dp_rank: hello.dp_rank,
            attach_epoch,
            ring_capacity: self.config.daemon.ring_capacity,
            heartbeat_interval_ms: HEARTBEAT_INTERVAL_MS,
        })
    }

    /// Engine `id`'s handshake failed on its driver's side (its Hello
    /// unreadable, its ring or Welcome not made): counted as a refused
    /// registration, and forgotten.
    pub fn handle_registration_failed(
        &mut self,
        now: Instant,
        id: EngineId,
        why: &dyn std::fmt::Display,
    ) {
        if let Some(e) = self.engines.remove(id.index, id.generation) {
            if let Some(slot) = e.slot {
                self.router.unregister(slot);
            }
            self.counters.refused_registrations += 1;
            self.warn(
                now,
                Warn::Registration,
                format_args!("engine registration refused: {why}"),
            );
        }
    }

    /// Where engine `id` is in its lifecycle.
    pub fn engine_state(&self, id: EngineId) -> EngineState {
        self.engines
            .get(id.index, id.generation)
            .map_or(EngineState::Gone, |e| e.state)
    }

    /// One record from engine `id`'s ring: applied to the index or the
    /// load table, its gap (if any) noted. Records of an engine that is
    /// not registered are ignored.
    pub fn handle_engine_record(&mut self, now: Instant, id: EngineId, record: &Record<'_>) {
        let now_ms = self.ms(now);
        let Some(e) = self.engines.get_mut(id.index, id.generation) else {
            return;
        };
        let Some(slot) = e.slot.filter(|_| e.registered()) else {
            return;
        };
        // A notice is the producer's report on its feed, not a sign of
        // the engine's life (a bridge keeps reporting a load it cannot
        // read about an engine it no longer hears): it neither moves the
        // heartbeat deadline nor brings a worker back into routing.
        let alive = record.kind != kind::NOTICE;
        if alive {
            e.last_seen = now;
        }
        let back = alive && std::mem::take(&mut e.late);
        e.note_gap(record.missing_before);
        self.counters.ring_gaps += record.missing_before;
        // A record that does not decode is skipped; its sequence number
        // still counted, so it is no gap.
        if let Ok(event) = decode(record.kind, record.payload) {
            self.counters.events[event_kind(&event)] += 1;
            self.router.apply(slot, &event, now_ms);
            match &event {
                EventRef::SnapshotBegin(b) => e.snapshot_begun(b.snapshot_id.to_native()),
                EventRef::SnapshotEnd(end) if e.snapshot_ended(end.snapshot_id.to_native()) => {
                    self.router.set_syncing(slot, false);
                }
                EventRef::Notice(n) => {
                    let code = n.code.to_native();
                    e.notice(code, n.count.to_native(), &n.message);
                    if code == kvedge_schema::messages::notice::SILENT {
                        // The producer says its engine went silent (a
                        // bridge that stopped hearing from it): out of
                        // routing now, not a heartbeat timeout later.
                        e.late = true;
                        self.router.set_available(slot, false);
                    }
                }
                _ => {}
            }
        }
        if back {
            // Its engine spoke again: routable again, and its next
            // deadline counts.
            self.router.set_available(slot, true);
            tracing::info!(
                worker = ?self.router.worker(slot).map(|w| w.worker),
                "worker available again: its engine spoke"
            );
            self.due(now + Duration::from_millis(self.config.daemon.heartbeat_timeout_ms));
        }
    }

    /// Engine `id`'s ring was read until empty (`drained`) or until its
    /// per-turn budget; `producer_dropped` is the producer's own count of
    /// dropped records. If records were lost since the engine was last in
    /// sync, its view is cleared (it counts as empty, not stale) and a
    /// snapshot is asked for ([`Output::Resync`]).
    pub fn handle_engine_drained(
        &mut self,
        now: Instant,
        id: EngineId,
        producer_dropped: u64,
        drained: bool,
    ) {
        let Some(e) = self.engines.get_mut(id.index, id.generation) else {
            return;
        };
        if !e.registered() || !e.end_batch(producer_dropped, drained) {
            return;
        }
        self.begin_resync(now, id);
    }

    /// Engine `id` lost records (or its snapshot did): its view is cleared
    /// and counts as empty from now on, and a snapshot is asked for, at
    /// once or after its backoff ([`Engine::backoff`]).
    fn begin_resync(&mut self, now: Instant, id: EngineId) {
        let Some(e) = self.engines.get_mut(id.index, id.generation) else {
            return;
        };
        let Some(slot) = e.slot else { return };
        e.resync_attempts = e.resync_attempts.saturating_add(1);
        let attempts = e.resync_attempts;
        let wait = Engine::backoff(attempts);
        self.router.index.clear(slot, None);
        self.router.set_syncing(slot, true);
        if wait.is_zero() {
            self.send_resync(now, id);
        } else {
            e.resyncing(0, now + wait);
            self.due(now + wait);
            let worker = self.router.worker(slot).map(|w| w.worker);
            self.warn(
                now,
                Warn::Resync,
                format_args!(
                    "worker {worker:?}: resync attempt {attempts} lost records again; asking again in {wait:?}"
                ),
            );
        }
    }

    /// Asks engine `id` for snapshot under a fresh id ([`Output::Resync`]).
    fn send_resync(&mut self, now: Instant, id: EngineId) {
        self.epoch += 1;
        let snapshot_id = self.epoch;
        let Some(e) = self.engines.get_mut(id.index, id.generation) else {
            return;
        };
        e.resyncing(snapshot_id, now);
        self.counters.resyncs += 1;
        self.due(now + RESYNC_ANSWER_DEADLINE);
        self.outputs.push_back(Output::Resync {
            engine: id,
            request: ResyncRequest {
                snapshot_id,
                missing_from_seq: 0,
            },
        });
    }

    /// Engine `id`'s ring failed validation: the worker leaves routing at
    /// once and its connection is to be closed ([`Output::CloseEngine`]).
    pub fn handle_engine_broken(
        &mut self,
        _now: Instant,
        id: EngineId,
        why: &dyn std::fmt::Display,
    ) {
        let Some(e) = self.engines.get_mut(id.index, id.generation) else {
            return;
        };
        if e.state == EngineState::Broken {
            return;
        }
        tracing::warn!(
            slot = e.slot.map(|s| s.index()),
            "ring is broken, dropping the worker: {why}"
        );
        e.state = EngineState::Broken;
        if let Some(slot) = e.slot.take() {
            self.router.unregister(slot);
        }
        self.outputs.push_back(Output::CloseEngine(id));
    }

    /// Engine `id`'s connection closed (or the driver closed it): its
    /// worker, blocks, load, reservations and session bindings go at once.
    pub fn handle_engine_closed(&mut self, _now: Instant, id: EngineId, producer_dropped: u64) {
        let Some(e) = self.engines.remove(id.index, id.generation) else {
            return;
        };
        self.counters.departed_drops += producer_dropped.max(e.producer_dropped);
        if let Some(slot) = e.slot {
            self.router.unregister(slot);
        }
    }

    /// Registered engines (live or resyncing).
    pub fn engines(&self) -> usize {
        self.engines.iter().filter(|(_, e)| e.registered()).count()
    }

    /// Each registered engine, by router slot.
    pub(crate) fn engines_by_slot(&self) -> [Option<&Engine>; crate::index::MAX_WORKERS] {
        let mut out = [None; crate::index::MAX_WORKERS];
        for (_, e) in self.engines.iter() {
            if let Some(slot) = e.slot {
                out[slot.index()] = Some(e);
            }
        }
        out
    }

    /// The producers' dropped counts of the engines still here.
    pub(crate) fn live_drops(&self) -> u64 {
        self.engines.iter().map(|(_, e)| e.producer_dropped).sum()
    }

    // ---------------------------------------------------------- time

    /// Time passed: reservations past their TTL expire, engines whose
    /// heartbeat is overdue leave routing, connections silent past the
    /// registration deadline or the idle timeout are closed.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now_ms = self.ms(now);
        self.router.load.expire(now_ms);
        let heartbeat = Duration::from_millis(self.config.daemon.heartbeat_timeout_ms);
        let idle = Duration::from_millis(self.config.daemon.idle_timeout_ms);
        let mut next: Option<Instant> = self
            .router
            .load
            .next_expiry_ms()
            .map(|ms| self.start + Duration::from_millis(ms));
        let mut soonest = |at: Instant| next = Some(next.map_or(at, |t| t.min(at)));
        let mut silent = 0;
        let mut resync = std::mem::take(&mut self.scratch.resync);
        for ((index, generation), e) in self.engines.iter_mut() {
            // A deferred resync request is due, or an asked one went
            // unanswered: ask (again).
            if let EngineState::Resyncing {
                snapshot_id,
                begun: false,
                ..
            } = e.state
                && e.slot.is_some()
            {
                let due = if snapshot_id == 0 {
                    e.resync_at
                } else {
                    e.resync_at + RESYNC_ANSWER_DEADLINE
                };
                if now >= due {
                    resync.push(EngineId { index, generation });
                } else {
                    soonest(due);
                }
            }
            match e.state {
                EngineState::Registering { since } => {
                    if now.saturating_duration_since(since) >= REGISTRATION_DEADLINE {
                        e.state = EngineState::Broken;
                        self.counters.refused_registrations += 1;
                        silent += 1;
                        self.outputs
                            .push_back(Output::CloseEngine(EngineId { index, generation }));
                    } else {
                        soonest(since + REGISTRATION_DEADLINE);
                    }
                }
                EngineState::Live | EngineState::Resyncing { .. } if !e.late => {
                    if now.saturating_duration_since(e.last_seen) >= heartbeat {
                        e.late = true;
                        if let Some(slot) = e.slot {
                            self.router.set_available(slot, false);
                            tracing::warn!(
                                worker = ?self.router.worker(slot).map(|w| w.worker),
                                "worker unavailable: nothing from its engine for {heartbeat:?} (heartbeat_timeout_ms); it returns with its next event, load or heartbeat"
                            );
                        }
                    } else {
                        soonest(e.last_seen + heartbeat);
                    }
                }
                _ => {}
            }
        }
        for id in resync.drain(..) {
            self.send_resync(now, id);
            soonest(now + RESYNC_ANSWER_DEADLINE);
        }
        self.scratch.resync = resync;
        if silent > 0 {
            self.warn(
                now,
                Warn::Registration,
                format_args!(
                    "{silent} engine connection(s) closed: no Hello within {REGISTRATION_DEADLINE:?}"
                ),
            );
        }
        let outputs = &mut self.outputs;
        self.clients.retain(|(index, generation), c| {
            let idle_for = now.saturating_duration_since(c.last_active);
            if idle_for >= idle {
                outputs.push_back(Output::CloseClient(ClientId { index, generation }));
                return false;
            }
            soonest(c.last_active + idle);
            true
        });
        if self.warm_next().is_some_and(|at| at <= now) {
            self.warm(now);
        }
        if let Some(at) = self.warm_next() {
            soonest(at);
        }
        self.next_timeout = next;
    }

    /// When the select path is next due to be warmed, if at all.
    pub(crate) fn warm_next(&self) -> Option<Instant> {
        let d = &self.config.daemon;
        self.warmth.next(
            Duration::from_micros(d.warm_us),
            Duration::from_millis(d.warm_for_ms),
        )
    }

    /// Runs the undecided part of a select with what the last one asked
    /// (see [`crate::warm`]).
    fn warm(&mut self, now: Instant) {
        let w = &self.warmth;
        let req = SelectRequest {
            now_ms: self.ms(now),
            dry_run: true,
            approximate: w.approximate,
            ..SelectRequest::new(&w.model, w.role, &w.hashes, w.prompt_tokens)
        };
        self.router.warm(&req);
        self.warmth.ran(now);
    }
}
