//! The routing core driven in virtual time, with no process, socket or
//! sleep: a [`Harness`] plays the drivers (engines connect and send ring
//! records, clients ask, time passes) and collects what the core asks of
//! them. Each test walks one lifecycle: registration, resync after a gap,
//! heartbeat loss, a broken ring, idle clients, reservations, limits,
//! reload.

#![forbid(unsafe_code)]
// The harness starts its virtual clock with one real `Instant::now()`.
#![allow(clippy::disallowed_methods)]

use std::time::{Duration, Instant};

use kvedge_config::Config;
use kvedge_core::{
    ClientId, Core, EngineId, EngineState, MAX_PENDING_PER_UID, MAX_PENDING_REGISTRATIONS, Output,
    REGISTRATION_DEADLINE, RESYNC_ANSWER_DEADLINE, RegistrationError, ReloadError,
};
use kvedge_policies::{SelectionOverrides, router_plugin_registry};
use kvedge_schema::messages::control::{Hello, reject};
use kvedge_schema::messages::{
    Event, Heartbeat, KvCleared, KvStored, Notice, Role, SnapshotBegin, SnapshotEnd, StoredBlock,
    Tier, notice,
};
use kvedge_shm::control::PeerCred;
use kvedge_shm::ring::Record;
use kvedge_wire::{Ids, Reply, Request, Select, Status};

fn config(yaml: &str) -> Config {
    Config::load(
        "test.yaml",
        yaml,
        &router_plugin_registry(),
        &SelectionOverrides::default(),
    )
    .unwrap()
}

/// The drivers around one core, in virtual time.
struct Harness {
    core: Core,
    now: Instant,
    /// What the core asked, in order, not yet looked at.
    outputs: Vec<Output>,
    seq: u64,
}

/// Credentials no test should need: reading them means the core asked
/// without a policy.
fn no_peer() -> std::io::Result<PeerCred> {
    panic!("the core asked for credentials without a policy")
}

fn hello(worker_id: u64) -> Hello {
    Hello {
        kv_blocks: [1024, 0, 0],
        endpoint: format!("http://engine-{worker_id}"),
        ..Hello::new(worker_id, "m")
    }
}

fn stored(hashes: &[u64]) -> Event {
    Event::Stored(KvStored {
        parent: None,
        blocks: hashes
            .iter()
            .map(|&h| StoredBlock {
                sequence_hash: h,
                local_hash: 0,
            })
            .collect(),
        tier: Tier::Device,
        salt: None,
    })
}

impl Harness {
    fn new(yaml: &str) -> Harness {
        let now = Instant::now();
        Harness {
            core: Core::new(config(yaml), now),
            now,
            outputs: Vec::new(),
            seq: 0,
        }
    }

    /// Collects what the core asks.
    fn collect(&mut self) {
        while let Some(o) = self.core.poll_output() {
            self.outputs.push(o);
        }
    }

    /// What the core asked since the last look.
    fn take_outputs(&mut self) -> Vec<Output> {
        self.collect();
        std::mem::take(&mut self.outputs)
    }

    /// Lets `by` pass, handling every timeout at the moment it is due.
    fn advance(&mut self, by: Duration) {
        let until = self.now + by;
        while let Some(due) = self.core.poll_timeout().filter(|&t| t <= until) {
            self.now = self.now.max(due);
            self.core.handle_timeout(self.now);
            self.collect();
        }
        self.now = until;
    }

    /// An engine connects and registers as `worker_id`.
    fn engine(&mut self, worker_id: u64) -> EngineId {
        let id = self.core.handle_engine_connected(self.now, Some(1000));
        self.core
            .handle_hello(self.now, id, &hello(worker_id), no_peer)
            .unwrap();
        id
    }

    /// Engine `e` commits `event` after `missing_before` lost records.
    fn record(&mut self, e: EngineId, missing_before: u64, event: Event) {
        self.seq += 1 + missing_before;
        let payload = event.to_payload();
        let record = Record {
            kind: event.kind(),
            flags: 0,
            seq: self.seq,
            missing_before,
            payload: &payload,
        };
        self.core.handle_engine_record(self.now, e, &record);
    }

    /// Engine `e`'s ring was read to its end; its producer claims
    /// `dropped` records dropped so far.
    fn drained(&mut self, e: EngineId, dropped: u64) {
        self.core.handle_engine_drained(self.now, e, dropped, true);
        self.collect();
    }

    fn client(&mut self) -> ClientId {
        self.core
            .handle_client_connected(self.now, no_peer)
            .unwrap()
    }

    /// A select of `hashes` for model `m`: (worker, device overlap,
    /// request id), or the error's status.
    fn select(
        &mut self,
        c: ClientId,
        hashes: &[u64],
        dry_run: bool,
    ) -> Result<(u64, u32, u64), Status> {
        let mut s = Select::new("m", Role::Aggregated, Ids::hashes(hashes));
        s.dry_run = dry_run;
        match self.core.handle_request(self.now, c, &Request::Select(s)) {
            Reply::Selected(r) => Ok((
                r.worker.expect("a worker").0,
                r.overlap_blocks[0],
                r.request_id,
            )),
            Reply::Error(e) => Err(e.status),
            other => panic!("unexpected reply {other:?}"),
        }
    }

    fn ask(&mut self, c: ClientId, request: Request<'_>) -> Status {
        self.core.handle_request(self.now, c, &request).status()
    }
}

/// A configuration whose heartbeat never expires during a test.
const NO_HEARTBEAT_TIMEOUT: &str = "daemon:\n  heartbeat_timeout_ms: 600000\n";

#[test]
fn an_engine_registers_and_its_records_route() {
    let mut h = Harness::new("daemon:\n  ring_capacity: 65536\n");
    let e = h.core.handle_engine_connected(h.now, Some(1000));
    assert!(matches!(
        h.core.engine_state(e),
        EngineState::Registering { .. }
    ));
    let welcome = h.core.handle_hello(h.now, e, &hello(7), no_peer).unwrap();
    assert_eq!((welcome.worker_id, welcome.ring_capacity), (7, 65536));
    assert_eq!(h.core.engine_state(e), EngineState::Live);
    let c = h.client();
    h.record(e, 0, stored(&[1, 2, 3]));
    h.drained(e, 0);
    assert_eq!(h.select(c, &[1, 2, 3, 4], true), Ok((7, 3, 1)));
    // A second registration of the same worker is refused and forgotten.
    let dup = h.core.handle_engine_connected(h.now, Some(1000));
    let err = h
        .core
        .handle_hello(h.now, dup, &hello(7), no_peer)
        .unwrap_err();
    assert_eq!(err.reject_code(), reject::DUPLICATE_WORKER);
    assert_eq!(h.core.engine_state(dup), EngineState::Gone);
    // Another worker gets a later attach epoch.
    let other = h.core.handle_engine_connected(h.now, Some(1000));
    let w2 = h
        .core
        .handle_hello(h.now, other, &hello(8), no_peer)
        .unwrap();
    assert!(w2.attach_epoch > welcome.attach_epoch);
    assert!(h.take_outputs().is_empty());
}

#[test]
fn a_silent_registration_is_closed_at_its_deadline_and_pending_ones_are_bounded() {
    let mut h = Harness::new("{}");
    let silent = h.core.handle_engine_connected(h.now, Some(1000));
    h.advance(REGISTRATION_DEADLINE - Duration::from_millis(1));
    assert!(h.take_outputs().is_empty(), "not yet");
    h.advance(Duration::from_millis(1));
    assert_eq!(h.take_outputs(), [Output::CloseEngine(silent)]);
    assert_eq!(h.core.engine_state(silent), EngineState::Broken);
    h.core.handle_engine_closed(h.now, silent, 0);
    assert_eq!(h.core.engine_state(silent), EngineState::Gone);
    assert_eq!(h.core.stats().refused_registrations, 1);
}

#[test]
fn a_flood_of_silent_connections_evicts_only_its_own_and_the_oldest() {
    let mut h = Harness::new("{}");
    // One uid floods: its oldest pending connection yields to each new one,
    // so it never holds more than MAX_PENDING_PER_UID.
    let flood: Vec<EngineId> = (0..3 * MAX_PENDING_PER_UID)
        .map(|_| {
            h.now += Duration::from_millis(1);
            h.core.handle_engine_connected(h.now, Some(666))
        })
        .collect();
    let closed = h.take_outputs();
    assert_eq!(closed.len(), 2 * MAX_PENDING_PER_UID);
    for (out, id) in closed.iter().zip(&flood) {
        assert_eq!(*out, Output::CloseEngine(*id), "oldest first");
    }
    // A displaced connection's Hello, read before the driver dropped the
    // socket, is told to connect again rather than an internal error.
    let err = h
        .core
        .handle_hello(h.now, flood[0], &hello(8), no_peer)
        .unwrap_err();
    assert_eq!(err, RegistrationError::Displaced);
    assert_eq!(err.reject_code(), reject::DISPLACED);
    // Another uid's engine connects meanwhile and registers: the flood did
    // not take its place.
    let real = h.core.handle_engine_connected(h.now, Some(1000));
    assert!(h.take_outputs().is_empty());
    assert!(h.core.handle_hello(h.now, real, &hello(9), no_peer).is_ok());
    // Many uids together: at most MAX_PENDING_REGISTRATIONS wait, the
    // oldest of all yields.
    let mut all = Vec::new();
    for u in 0..MAX_PENDING_REGISTRATIONS as u32 + 5 {
        h.now += Duration::from_millis(1);
        all.push(h.core.handle_engine_connected(h.now, Some(2000 + u)));
    }
    let pending = h
        .take_outputs()
        .into_iter()
        .filter(|o| matches!(o, Output::CloseEngine(_)))
        .count();
    // MAX_PENDING_PER_UID of the flood were still waiting, plus the new.
    assert_eq!(
        pending,
        MAX_PENDING_PER_UID + MAX_PENDING_REGISTRATIONS + 5 - MAX_PENDING_REGISTRATIONS
    );
    assert!(matches!(
        h.core.engine_state(*all.last().unwrap()),
        EngineState::Registering { .. }
    ));
}

#[test]
fn engine_credentials_are_checked_only_under_a_policy() {
    let mut h = Harness::new("daemon:\n  allowed_uids: [1000]\n");
    let e = h.core.handle_engine_connected(h.now, Some(1000));
    let stranger = || {
        Ok(PeerCred {
            pid: 42,
            uid: 1001,
            gid: 1001,
        })
    };
    let err = h
        .core
        .handle_hello(h.now, e, &hello(1), stranger)
        .unwrap_err();
    assert_eq!(err.reject_code(), reject::NOT_PERMITTED);
    assert!(err.to_string().contains("not allowed"), "{err}");
    let e = h.core.handle_engine_connected(h.now, Some(1000));
    let friend = || {
        Ok(PeerCred {
            pid: 43,
            uid: 1000,
            gid: 1000,
        })
    };
    assert!(h.core.handle_hello(h.now, e, &hello(1), friend).is_ok());
}

#[test]
fn a_gap_clears_the_view_and_a_complete_snapshot_restores_it() {
    let mut h = Harness::new("{}");
    let e = h.engine(1);
    let c = h.client();
    h.record(e, 0, stored(&[1, 2]));
    h.drained(e, 0);
    assert_eq!(h.select(c, &[1, 2], true).map(|r| r.1), Ok(2));
    // Two records were lost: the view counts as empty, a snapshot is asked.
    h.record(e, 2, stored(&[3]));
    h.drained(e, 2);
    let [Output::Resync { engine, request }] = h.take_outputs()[..] else {
        panic!("one resync request")
    };
    assert_eq!(engine, e);
    assert_eq!(
        h.core.engine_state(e),
        EngineState::Resyncing {
            snapshot_id: request.snapshot_id,
            begun: false,
            gap_inside: false
        }
    );
    assert_eq!(h.select(c, &[1, 2], true).map(|r| r.1), Ok(0));
    // The snapshot arrives whole: live again, with the engine's blocks.
    let id = request.snapshot_id;
    h.record(
        e,
        0,
        Event::SnapshotBegin(SnapshotBegin { snapshot_id: id }),
    );
    h.record(e, 0, Event::Cleared(KvCleared { tier: None }));
    h.record(e, 0, stored(&[1, 2, 3]));
    h.drained(e, 2);
    // Part of the snapshot is in: the view still counts as empty.
    assert_eq!(h.select(c, &[1, 2, 3], true).map(|r| r.1), Ok(0));
    h.record(
        e,
        0,
        Event::SnapshotEnd(SnapshotEnd {
            snapshot_id: id,
            blocks: 3,
        }),
    );
    h.drained(e, 2);
    assert!(h.take_outputs().is_empty(), "no second resync");
    assert_eq!(h.core.engine_state(e), EngineState::Live);
    assert_eq!(h.select(c, &[1, 2, 3], true).map(|r| r.1), Ok(3));
    assert_eq!(h.core.metrics().resyncs, 1);
}

#[test]
fn a_loss_inside_a_snapshot_asks_for_another_and_trailing_drops_count() {
    let mut h = Harness::new("{}");
    let e = h.engine(1);
    // Drops at the end of a burst show only in the producer's count.
    h.drained(e, 5);
    let [Output::Resync { request, .. }] = h.take_outputs()[..] else {
        panic!("a resync for the trailing drops")
    };
    let id = request.snapshot_id;
    h.record(
        e,
        0,
        Event::SnapshotBegin(SnapshotBegin { snapshot_id: id }),
    );
    // A record lost inside the snapshot: it cannot complete, so a fresh
    // one is asked for at once (its end may be what was lost).
    h.record(e, 1, stored(&[9]));
    h.drained(e, 6);
    let [Output::Resync { request: again, .. }] = h.take_outputs()[..] else {
        panic!("a fresh snapshot for the incomplete one")
    };
    assert!(again.snapshot_id > id);
    // The old snapshot's end changes nothing.
    h.record(
        e,
        0,
        Event::SnapshotEnd(SnapshotEnd {
            snapshot_id: id,
            blocks: 1,
        }),
    );
    h.drained(e, 6);
    assert!(h.take_outputs().is_empty());
    assert!(matches!(
        h.core.engine_state(e),
        EngineState::Resyncing { .. }
    ));
}

#[test]
fn a_snapshot_whose_end_is_lost_is_asked_again_and_repeated_failures_back_off() {
    let mut h = Harness::new(NO_HEARTBEAT_TIMEOUT);
    let e = h.engine(1);
    let c = h.client();
    // A trailing drop: the producer's count shows it, and the next
    // record committed (each snapshot's begin) carries it as a gap.
    let mut drops = 1;
    h.drained(e, drops);
    let mut asked = Vec::new();
    for _ in 0..2 {
        let [Output::Resync { request, .. }] = h.take_outputs()[..] else {
            panic!("asked at once")
        };
        asked.push(request.snapshot_id);
        h.record(
            e,
            1,
            Event::SnapshotBegin(SnapshotBegin {
                snapshot_id: request.snapshot_id,
            }),
        );
        h.record(e, 0, stored(&[1]));
        // The end was dropped.
        drops += 1;
        h.drained(e, drops);
    }
    // The third attempt waits for its backoff (a second), then goes.
    assert!(h.take_outputs().is_empty(), "backing off");
    assert_eq!(h.select(c, &[1], true).map(|r| r.1), Ok(0), "still empty");
    h.advance(Duration::from_secs(1));
    let [Output::Resync { request, .. }] = h.take_outputs()[..] else {
        panic!("asked after the backoff")
    };
    assert!(request.snapshot_id > asked[1]);
    // This one completes: live, with its blocks, and the backoff resets.
    let id = request.snapshot_id;
    h.record(
        e,
        1,
        Event::SnapshotBegin(SnapshotBegin { snapshot_id: id }),
    );
    h.record(e, 0, stored(&[1, 2]));
    h.record(
        e,
        0,
        Event::SnapshotEnd(SnapshotEnd {
            snapshot_id: id,
            blocks: 2,
        }),
    );
    h.drained(e, drops);
    assert_eq!(h.core.engine_state(e), EngineState::Live);
    assert_eq!(h.select(c, &[1, 2], true).map(|r| r.1), Ok(2));
    assert_eq!(h.core.metrics().resyncs, 3);
}

#[test]
fn an_unanswered_resync_is_asked_again_after_its_deadline() {
    let mut h = Harness::new(NO_HEARTBEAT_TIMEOUT);
    let e = h.engine(1);
    h.drained(e, 1);
    let [Output::Resync { request: first, .. }] = h.take_outputs()[..] else {
        panic!("asked")
    };
    h.advance(RESYNC_ANSWER_DEADLINE - Duration::from_millis(1));
    assert!(h.take_outputs().is_empty());
    h.advance(Duration::from_millis(1));
    let [Output::Resync { request: again, .. }] = h.take_outputs()[..] else {
        panic!("asked again")
    };
    assert!(again.snapshot_id > first.snapshot_id);
}

#[test]
fn a_late_heartbeat_takes_the_worker_out_until_it_speaks_again() {
    let mut h = Harness::new("daemon:\n  heartbeat_timeout_ms: 5000\n");
    let e = h.engine(1);
    let c = h.client();
    h.advance(Duration::from_millis(4000));
    h.record(e, 0, Event::Heartbeat(Heartbeat { timestamp_ns: 1 }));
    h.advance(Duration::from_millis(4999));
    assert!(h.select(c, &[1], true).is_ok(), "a beat 4999 ms ago");
    h.advance(Duration::from_millis(1));
    assert_eq!(h.select(c, &[1], true), Err(Status::NoWorker));
    assert!(!h.core.worker_rows()[0].available);
    // Any record brings it back, and its next deadline is kept.
    h.record(e, 0, Event::Heartbeat(Heartbeat { timestamp_ns: 2 }));
    assert!(h.select(c, &[1], true).is_ok());
    h.advance(Duration::from_millis(5000));
    assert_eq!(h.select(c, &[1], true), Err(Status::NoWorker));
}

#[test]
fn a_notice_is_no_sign_of_life_and_brings_no_worker_back() {
    let mut h = Harness::new("daemon:\n  heartbeat_timeout_ms: 5000\n");
    let e = h.engine(1);
    let c = h.client();
    let report = |code, count| {
        Event::Notice(Notice {
            code,
            count,
            message: "the engine's metrics endpoint refused the connection".into(),
        })
    };
    // A bridge reporting about its engine does not move the deadline.
    h.advance(Duration::from_millis(4000));
    h.record(e, 0, report(notice::LOAD_UNREADABLE, 1));
    h.advance(Duration::from_millis(1000));
    assert_eq!(h.select(c, &[1], true), Err(Status::NoWorker));
    // Nor does its report bring the worker back, however many come.
    for count in [2, 4, 8] {
        h.record(e, 0, report(notice::LOAD_UNREADABLE, count));
        assert_eq!(h.select(c, &[1], true), Err(Status::NoWorker));
    }
    h.record(e, 0, Event::Heartbeat(Heartbeat { timestamp_ns: 1 }));
    assert!(
        h.select(c, &[1], true).is_ok(),
        "a heartbeat brings it back"
    );
    // Declared silent by its producer: out at once, and a later report
    // about it (the load it cannot read) leaves it out.
    h.record(e, 0, report(notice::SILENT, 1));
    assert_eq!(h.select(c, &[1], true), Err(Status::NoWorker));
    h.record(e, 0, report(notice::LOAD_UNREADABLE, 16));
    assert_eq!(h.select(c, &[1], true), Err(Status::NoWorker));
    assert!(!h.core.worker_rows()[0].available);
    h.record(e, 0, stored(&[7]));
    let (worker, overlap, _) = h.select(c, &[7], true).expect("an event brings it back");
    assert_eq!((worker, overlap), (1, 1));
}

#[test]
fn a_broken_ring_leaves_routing_at_once_and_is_closed() {
    let mut h = Harness::new("{}");
    let e = h.engine(1);
    let c = h.client();
    h.core
        .handle_engine_broken(h.now, e, &"a record overran the ring");
    assert_eq!(h.core.engine_state(e), EngineState::Broken);
    assert_eq!(h.take_outputs(), [Output::CloseEngine(e)]);
    assert_eq!(h.select(c, &[1], true), Err(Status::NoWorker));
    // Records that were still in flight are ignored.
    h.record(e, 0, stored(&[1]));
    h.core.handle_engine_closed(h.now, e, 3);
    assert_eq!(h.core.engine_state(e), EngineState::Gone);
    assert_eq!(h.core.metrics().ring_drops, 3);
    assert_eq!(h.core.engines(), 0);
}

#[test]
fn an_idle_client_is_closed_and_activity_keeps_one_open() {
    let mut h = Harness::new("daemon:\n  idle_timeout_ms: 1000\n");
    let busy = h.client();
    let idle = h.client();
    h.advance(Duration::from_millis(600));
    h.core.handle_client_active(h.now, busy);
    h.advance(Duration::from_millis(400));
    assert_eq!(h.take_outputs(), [Output::CloseClient(idle)]);
    assert_eq!(h.core.clients(), 1);
    // A request is activity too.
    h.advance(Duration::from_millis(500));
    assert_eq!(h.ask(busy, Request::Stats), Status::Ok);
    h.advance(Duration::from_millis(999));
    assert!(h.take_outputs().is_empty());
    h.advance(Duration::from_millis(1));
    assert_eq!(h.take_outputs(), [Output::CloseClient(busy)]);
}

#[test]
fn reservations_expire_and_are_bounded() {
    let mut h = Harness::new(
        "daemon:\n  reservation_ttl_ms: 10000\n  max_reservations: 2\n  heartbeat_timeout_ms: 600000\n  idle_timeout_ms: 600000\n",
    );
    let _e = h.engine(1);
    let c = h.client();
    let (_, _, first) = h.select(c, &[1], false).unwrap();
    h.advance(Duration::from_millis(5000));
    let (_, _, second) = h.select(c, &[1], false).unwrap();
    assert_eq!(h.select(c, &[1], false), Err(Status::TooManyRequests));
    assert!(
        h.select(c, &[1], true).is_ok(),
        "a dry run reserves nothing"
    );
    assert_eq!(h.core.stats().reservations, 2);
    // The first expires at its TTL; the second is finished by hand.
    h.advance(Duration::from_millis(5000));
    assert_eq!(h.core.stats().reservations, 1);
    assert_eq!(
        h.ask(c, Request::Finish { request_id: first }),
        Status::UnknownRequest
    );
    assert_eq!(
        h.ask(c, Request::PrefillDone { request_id: second }),
        Status::Ok
    );
    assert_eq!(h.ask(c, Request::Finish { request_id: second }), Status::Ok);
    assert_eq!(h.core.stats().reservations, 0);
    assert_eq!(h.core.metrics().reservations_expired, 1);
}

#[test]
fn connections_and_query_channels_are_bounded() {
    let mut h = Harness::new("daemon:\n  max_query_connections: 2\n  max_query_rings: 1\n");
    let a = h.client();
    let b = h.client();
    let refused = h.core.handle_client_connected(h.now, no_peer).unwrap_err();
    assert_eq!(refused.status, Status::TooManyConnections);
    let grant = h.core.handle_attach_rings(h.now, a).unwrap();
    assert_eq!(grant.capacity, h.core.config().daemon.query_ring_capacity);
    assert_eq!(
        h.core.handle_attach_rings(h.now, b).unwrap_err().status,
        Status::RingsUnavailable
    );
    assert_eq!(
        h.core.handle_attach_rings(h.now, a).unwrap_err().status,
        Status::RingsUnavailable,
        "one channel per connection"
    );
    // The channel could not be set up: the slot is free again.
    h.core.handle_rings_detached(a);
    assert!(h.core.handle_attach_rings(h.now, b).is_ok());
    h.core.handle_client_closed(b);
    assert_eq!(h.core.query_channels(), 0);
    assert!(h.core.handle_client_connected(h.now, no_peer).is_ok());
    assert_eq!(h.core.stats().refused_connections, 1);
}

#[test]
fn a_reload_applies_a_valid_configuration_and_keeps_state() {
    let mut h = Harness::new("daemon:\n  heartbeat_timeout_ms: 600000\n");
    let e = h.engine(1);
    let c = h.client();
    h.record(e, 0, stored(&[1, 2]));
    let (_, _, reserved) = h.select(c, &[1, 2], false).unwrap();
    let policy = |h: &mut Harness| {
        let s = Select::new("m", Role::Aggregated, Ids::hashes(&[1]));
        match h
            .core
            .handle_request(h.now, c, &Request::Select(Select { dry_run: true, ..s }))
        {
            Reply::Selected(r) => r.policy.to_owned(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(policy(&mut h), "default");
    let new = config(
        "daemon:\n  heartbeat_timeout_ms: 600000\nworker_selection:\n  aggregated: rr\n  instances:\n    - name: rr\n      type: round-robin\n",
    );
    assert_eq!(h.core.handle_reload(h.now, Ok(new)), Ok(1));
    assert_eq!(policy(&mut h), "rr");
    // The index and the reservation survived.
    assert_eq!(h.core.worker_rows()[0].device_blocks, 2);
    assert_eq!(
        h.ask(
            c,
            Request::Finish {
                request_id: reserved
            }
        ),
        Status::Ok
    );
    // An invalid file is refused; the configuration in force stays.
    let invalid = Config::load(
        "bad.yaml",
        "demon: {}\n",
        &router_plugin_registry(),
        &SelectionOverrides::default(),
    )
    .unwrap_err();
    let refused = h.core.handle_reload(h.now, Err(ReloadError::from(invalid)));
    assert!(
        matches!(refused, Err(ReloadError::Invalid(_))),
        "{refused:?}"
    );
    assert_eq!(policy(&mut h), "rr");
    let stats = h.core.stats();
    assert_eq!((stats.reloads, stats.reload_failures), (1, 1));
}

#[test]
fn the_core_says_when_it_is_due() {
    let mut h = Harness::new("daemon:\n  heartbeat_timeout_ms: 1000\n  idle_timeout_ms: 60000\n");
    assert_eq!(h.core.poll_timeout(), None, "nothing to wait for");
    let _e = h.engine(1);
    let _c = h.client();
    // The heartbeat deadline comes first; the idle deadline after it.
    assert_eq!(
        h.core.poll_timeout(),
        Some(h.now + Duration::from_millis(1000))
    );
    h.advance(Duration::from_millis(1000));
    assert_eq!(
        h.core.poll_timeout(),
        Some(h.now + Duration::from_millis(59_000))
    );
}

#[test]
fn each_worker_counts_what_it_was_picked_for_and_its_hits() {
    let mut h = Harness::new(NO_HEARTBEAT_TIMEOUT);
    let e = h.engine(7);
    let c = h.client();
    h.record(e, 0, stored(&[1, 2, 3]));
    h.drained(e, 0);
    assert_eq!(h.select(c, &[1, 2, 3, 4], false).map(|s| s.1), Ok(3));
    assert_eq!(h.select(c, &[9], false).map(|s| s.1), Ok(0));
    // A dry run is no pick.
    assert_eq!(h.select(c, &[1, 2], true).map(|s| s.1), Ok(2));
    let row = &h.core.worker_rows()[0];
    assert_eq!(
        (
            row.picks,
            row.picked_prompt_blocks,
            row.picked_cached_blocks
        ),
        (2, 5, 3)
    );
    let text = kvedge_core::metrics::render(&h.core.metrics());
    for (name, value) in [
        ("kvedge_worker_picks_total{", " 2"),
        ("kvedge_worker_picked_prompt_blocks_total{", " 5"),
        ("kvedge_worker_picked_cached_blocks_total{", " 3"),
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(name)
                && l.contains("worker_id=\"7\"")
                && l.ends_with(value)),
            "{name}: {text}"
        );
    }
    // A worker registered again in the slot starts from zero.
    h.core.handle_engine_closed(h.now, e, 0);
    h.engine(8);
    let row = &h.core.worker_rows()[0];
    assert_eq!((row.worker_id, row.picks), (8, 0));
}

#[test]
fn a_notice_is_raised_cleared_and_counted() {
    let mut h = Harness::new("{}");
    let e = h.engine(1);
    let report = |code: u16, count: u64, message: &str| {
        Event::Notice(Notice {
            code,
            count,
            message: message.into(),
        })
    };
    let row = |h: &Harness| {
        let n = &h.core.worker_rows()[0].notices[0];
        (n.code, n.count, n.active, n.message.clone())
    };
    let unreadable = "http://10.0.0.5:8000/metrics: connection refused";
    h.record(e, 0, report(notice::LOAD_UNREADABLE, 1, unreadable));
    h.record(e, 0, report(notice::LOAD_UNREADABLE, 1234, unreadable));
    assert_eq!(row(&h), ("load_unreadable", 1234, true, unreadable.into()));
    let metrics = |h: &Harness| kvedge_core::metrics::render(&h.core.metrics());
    let has = |text: &str, name: &str, value: &str| {
        text.lines().any(|l| {
            l.starts_with(name) && l.contains("code=\"load_unreadable\"") && l.ends_with(value)
        })
    };
    let text = metrics(&h);
    assert!(has(&text, "kvedge_worker_notices_active{", " 1"), "{text}");
    // Over: the count is kept (in the row and the metric), the standing
    // flag goes, the last explanation stays when the notice brings none.
    h.record(
        e,
        0,
        report(notice::over(notice::LOAD_UNREADABLE), 1300, ""),
    );
    assert_eq!(row(&h), ("load_unreadable", 1300, false, unreadable.into()));
    let text = metrics(&h);
    assert!(has(&text, "kvedge_worker_notices_active{", " 0"), "{text}");
    assert!(has(&text, "kvedge_worker_notices{", " 1300"), "{text}");
    // Raised again: standing, counting on.
    h.record(e, 0, report(notice::LOAD_UNREADABLE, 1301, "HTTP 500"));
    assert_eq!(row(&h), ("load_unreadable", 1301, true, "HTTP 500".into()));
    // An end of a condition never raised is kept as over, not standing.
    h.record(e, 0, report(notice::over(notice::SILENT), 2, ""));
    let rows = h.core.worker_rows();
    let silent = rows[0].notices.iter().find(|n| n.code == "silent").unwrap();
    assert_eq!((silent.count, silent.active), (2, false));
}

#[test]
fn an_engines_notices_reach_workers_and_are_bounded() {
    let mut h = Harness::new("{}");
    let e = h.engine(1);
    let notice = |code: u16, count: u64, message: &str| {
        Event::Notice(kvedge_schema::messages::Notice {
            code,
            count,
            message: message.into(),
        })
    };
    h.record(e, 0, notice(1, 1, "use block_size: 32"));
    h.record(e, 0, notice(1, 5, "use block_size: 32"));
    let row = &h.core.worker_rows()[0];
    assert_eq!(row.notices.len(), 1);
    assert_eq!(
        (
            row.notices[0].code,
            row.notices[0].count,
            row.notices[0].message.as_str()
        ),
        ("block_size_mismatch", 5, "use block_size: 32")
    );
    // A producer cannot grow the daemon's memory with made-up codes.
    for code in 100..200 {
        h.record(e, 0, notice(code, 1, "x"));
    }
    assert_eq!(h.core.worker_rows()[0].notices.len(), 16);
    let text = kvedge_core::metrics::render(&h.core.metrics());
    assert!(
        text.lines().any(|l| l.starts_with("kvedge_worker_notices{")
            && l.contains("code=\"block_size_mismatch\"")
            && l.ends_with(" 5")),
        "{text}"
    );
}

#[test]
fn a_hung_engine_is_replaced_by_a_new_one_of_the_same_worker() {
    let mut h = Harness::new("daemon:\n  heartbeat_timeout_ms: 1000\n");
    let old = h.engine(7);
    // While it beats, a second engine of the same worker is a duplicate.
    let dup = h.core.handle_engine_connected(h.now, Some(1000));
    let err = h
        .core
        .handle_hello(h.now, dup, &hello(7), no_peer)
        .unwrap_err();
    assert_eq!(err.reject_code(), reject::DUPLICATE_WORKER);
    // Silent past its heartbeat (SIGSTOPped): the restarted engine takes
    // the worker over and the old connection is closed.
    h.advance(Duration::from_millis(1000));
    let new = h.core.handle_engine_connected(h.now, Some(1000));
    assert!(h.core.handle_hello(h.now, new, &hello(7), no_peer).is_ok());
    assert!(h.take_outputs().contains(&Output::CloseEngine(old)));
    assert_eq!(h.core.engine_state(old), EngineState::Broken);
    h.core.handle_engine_closed(h.now, old, 0);
    assert_eq!(h.core.engine_state(new), EngineState::Live);
    let c = h.client();
    h.record(new, 0, stored(&[4]));
    h.drained(new, 0);
    assert_eq!(h.select(c, &[4], true).map(|r| r.0), Ok(7));
}

#[test]
fn paced_selects_keep_the_select_path_warm_and_back_to_back_ones_do_not() {
    let mut h = Harness::new(
        "daemon:\n  heartbeat_timeout_ms: 600000\n  warm_us: 1000\n  warm_for_ms: 50\n",
    );
    let e = h.engine(1);
    h.record(e, 0, stored(&[1, 2, 3]));
    let c = h.client();
    h.advance(Duration::from_millis(100));
    assert_eq!(
        h.core.metrics().warmups,
        0,
        "no select yet: nothing to warm"
    );

    // Back to back (every 0.5 ms): never idle for a millisecond.
    for _ in 0..20 {
        h.select(c, &[1, 2, 3], true).unwrap();
        h.advance(Duration::from_micros(500));
    }
    assert_eq!(h.core.metrics().warmups, 0);

    // Paced every 8 ms: once the mean gap has followed (a few selects),
    // warm-ups close in on the next select: at 4, 6 and 7 ms, then at 8
    // (warm_us apart at the closest), just before it.
    let paced_selects = |h: &mut Harness, n: usize| {
        for _ in 0..n {
            h.select(c, &[1, 2, 3], true).unwrap();
            h.advance(Duration::from_millis(8));
        }
    };
    paced_selects(&mut h, 20);
    let before = h.core.metrics().warmups;
    paced_selects(&mut h, 10);
    let paced = h.core.metrics().warmups;
    assert!(
        (38..=40).contains(&(paced - before)),
        "{} warm-ups for 10 gaps",
        paced - before
    );

    // Selects stop: warm-ups go on for four mean gaps (32 ms) or 100 ms,
    // whichever is longer, but no longer than warm_for_ms (50 ms here):
    // closing in on the next expected select, every warm_us for an eighth
    // of a gap, then every 2 ms. Then the core sleeps again.
    h.select(c, &[1, 2, 3], true).unwrap();
    let last = h.now;
    assert!(h.core.poll_timeout() <= Some(last + Duration::from_millis(2)));
    h.advance(Duration::from_millis(200));
    let after = h.core.metrics().warmups - paced;
    assert!(
        (23..=27).contains(&after),
        "{after} warm-ups after the last select"
    );
    assert!(asleep(&h), "{:?}", h.core.poll_timeout().map(|t| t - h.now));

    // Warm-ups count as nothing a client sees.
    let m = h.core.metrics();
    assert_eq!(m.reservations, 0);
    assert_eq!(
        m.selections.iter().map(|s| s.3).sum::<u64>(),
        51,
        "only the clients' selects are counted"
    );
}

/// Ten selects a second, as a gateway in front of a few engines sees them:
/// seven warm-ups between two selects, closing in on the next one, not a
/// hundred; and none at all once they stop.
#[test]
fn slow_selects_are_warmed_a_few_times_per_gap_and_idle_costs_nothing() {
    let mut h = Harness::new("daemon:\n  heartbeat_timeout_ms: 600000\n");
    let e = h.engine(1);
    h.record(e, 0, stored(&[1, 2, 3]));
    let c = h.client();
    for _ in 0..50 {
        h.select(c, &[1, 2, 3], true).unwrap();
        h.advance(Duration::from_millis(100));
    }
    let paced = h.core.metrics().warmups;
    // The first gap is unknown (a warm-up would be due 5 s after it);
    // then at 50, 75, 87.5, 93.75, 96.9, 98.4 and 99.4 ms.
    assert_eq!(paced, 49 * 7, "warm-ups for 50 gaps");
    h.advance(Duration::from_secs(60));
    // After the last: those seven, twelve around the time the next was
    // expected, then one each 25 ms until four gaps passed.
    let after = h.core.metrics().warmups - paced;
    assert!(
        (25..=35).contains(&after),
        "{after} warm-ups after the last select"
    );
    assert!(asleep(&h));
    let idle = h.core.metrics().warmups;
    h.advance(Duration::from_secs(60));
    assert_eq!(h.core.metrics().warmups, idle, "idle: no warm-up");
}

/// Nothing is due within the next 10 ms (warm-ups would be due within
/// one).
fn asleep(h: &Harness) -> bool {
    h.core
        .poll_timeout()
        .is_none_or(|t| t >= h.now + Duration::from_millis(10))
}

/// A client told not to warm (the endpoint picker, whose every request
/// costs far more than a select) schedules no warm-up; another client's
/// paced selects still do.
#[test]
fn a_client_that_does_not_warm_wakes_nothing_between_its_selects() {
    let mut h = Harness::new("daemon:\n  heartbeat_timeout_ms: 600000\n");
    let e = h.engine(1);
    h.record(e, 0, stored(&[1, 2, 3]));
    let picker = h.client();
    h.core.set_client_warms(picker, false);
    for _ in 0..20 {
        h.select(picker, &[1, 2, 3], true).unwrap();
        h.advance(Duration::from_millis(100));
        assert!(asleep(&h), "{:?}", h.core.poll_timeout().map(|t| t - h.now));
    }
    assert_eq!(h.core.metrics().warmups, 0);
    let other = h.client();
    for _ in 0..3 {
        h.select(other, &[1, 2, 3], true).unwrap();
        h.advance(Duration::from_millis(100));
    }
    assert!(
        h.core.metrics().warmups > 0,
        "a client that warms still does"
    );
}

#[test]
fn warming_is_off_at_zero() {
    let mut h = Harness::new("daemon:\n  heartbeat_timeout_ms: 600000\n  warm_us: 0\n");
    let e = h.engine(1);
    h.record(e, 0, stored(&[1, 2, 3]));
    let c = h.client();
    h.select(c, &[1, 2, 3], true).unwrap();
    h.advance(Duration::from_millis(100));
    assert!(asleep(&h), "{:?}", h.core.poll_timeout().map(|t| t - h.now));
    assert_eq!(h.core.metrics().warmups, 0);
}

/// Warm-ups run the filters and scorers, never the picker: a seeded random
/// pick makes the same choices and request ids with and without them.
#[test]
fn warm_ups_change_no_decision() {
    let run = |warm_us: u64| {
        let mut h = Harness::new(&format!(
            "daemon:\n  heartbeat_timeout_ms: 600000\n  warm_us: {warm_us}\n\
             router:\n  router_temperature: 1.0\n  seed: 7\n\
             worker_selection:\n  aggregated: cost\n  instances:\n    - name: cost\n      type: dynamo-default-cost-fn\n"
        ));
        for w in 1..=3 {
            let e = h.engine(w);
            h.record(e, 0, stored(&[1, 2, 3]));
        }
        let c = h.client();
        let picks: Vec<(u64, u64)> = (0..40)
            .map(|_| {
                let (worker, _, id) = h.select(c, &[1, 2, 3, 4], false).unwrap();
                h.advance(Duration::from_millis(5));
                (worker, id)
            })
            .collect();
        (picks, h.core.metrics().warmups)
    };
    let (cold, none) = run(0);
    let (warm, warmups) = run(1000);
    assert_eq!(none, 0);
    // Selects 5 ms apart: a warm-up every 1.25 ms, three per gap (none
    // in the first, whose gap was not known yet).
    assert!(
        warmups >= 39 * 3,
        "about three warm-ups between selects: {warmups}"
    );
    assert_eq!(warm, cold);
    let workers: std::collections::HashSet<u64> = cold.iter().map(|p| p.0).collect();
    assert!(workers.len() > 1, "the picks were random: {workers:?}");
}
