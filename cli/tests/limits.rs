//! A hostile or broken neighbour: a connection flood beyond the limit is
//! refused while existing clients keep their answers; peers outside the
//! allowed uids/gids are refused on both sockets; a silent engine connection
//! cannot stall the daemon, nor can a flood of them push out an engine
//! whose Hello has arrived; an engine that stops heartbeating is marked
//! unavailable and recovers when it resumes; a worker cannot register under
//! a live worker's identity; reservations are bounded.

#![forbid(unsafe_code)]

mod common;

use std::io::BufRead;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::{Conn, engine, start, try_engine};
use kvedge_schema::messages::Tier;
use serde_json::json;

#[test]
fn a_connection_flood_is_refused_and_existing_clients_keep_their_answers() {
    let d = start(
        "flood",
        "daemon:\n  max_query_connections: 8\n  heartbeat_timeout_ms: 600000\n",
    );
    let query = d.dir.join("query.sock");
    let _engine = engine(&d.control(), 1, "m");
    let mut kept: Vec<Conn> = (0..8).map(|_| Conn::connect(&query)).collect();
    for c in &mut kept {
        assert_eq!(c.ask(json!({"op": "stats"}))["workers"], 1);
    }
    // 100 more: each gets one error line and is closed.
    for _ in 0..100 {
        let mut extra = Conn::connect(&query);
        let refused = extra.recv();
        assert_eq!(
            refused["error"]["code"], "too_many_connections",
            "{refused}"
        );
        let mut rest = String::new();
        assert_eq!(extra.reader.read_line(&mut rest).unwrap(), 0, "closed");
    }
    // The 8 are still served.
    let select = json!({"op": "select", "model": "m", "hashes": [1, 2], "dry_run": true});
    for c in &mut kept {
        assert_eq!(c.ask(&select)["worker_id"], 1);
    }
    let stats = kept[0].ask(json!({"op": "stats"}));
    assert_eq!(stats["refused_connections"], 100, "{stats}");
    assert_eq!(stats["clients"], 8);
    // Closing one frees a place.
    kept.pop();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut c = Conn::connect(&query);
        let r = c.ask(json!({"op": "stats"}));
        if r.get("error").is_none() {
            break;
        }
        assert!(Instant::now() < deadline, "no place freed: {r}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn peers_outside_the_allowed_uids_and_gids_are_refused() {
    // Nobody's uid: every peer is outside.
    let d = start(
        "creds",
        "daemon:\n  allowed_uids: [4000000001]\n  query_allowed_uids: [4000000001]\n  query_allowed_gids: [4000000002]\n",
    );
    let mut c = Conn::connect(&d.dir.join("query.sock"));
    let r = c.recv();
    assert_eq!(r["error"]["code"], "not_permitted", "{r}");
    assert!(
        r["error"]["message"].as_str().unwrap().contains("uid"),
        "{r}"
    );
    match try_engine(&d.control(), 1, "m") {
        Err(kvedge_shm::ControlError::Rejected { message, .. }) => {
            assert!(message.contains("not allowed"), "{message}")
        }
        other => panic!("expected a rejection, got {:?}", other.map(|_| ())),
    }
    // Our own uid allowed: served.
    let uid = rustix::process::getuid().as_raw();
    let d2 = start(
        "creds-ok",
        &format!("daemon:\n  allowed_uids: [{uid}]\n  query_allowed_uids: [{uid}]\n"),
    );
    let mut c = Conn::connect(&d2.dir.join("query.sock"));
    assert_eq!(c.ask(json!({"op": "stats"}))["workers"], 0);
    assert!(try_engine(&d2.control(), 1, "m").is_ok());
}

#[test]
fn a_silent_engine_connection_does_not_stall_the_daemon() {
    let d = start("silent", "daemon:\n  heartbeat_timeout_ms: 600000\n");
    // Connect to control.sock and say nothing.
    let _silent: Vec<UnixStream> = (0..5)
        .map(|_| UnixStream::connect(d.dir.join("control.sock")).unwrap())
        .collect();
    let mut c = Conn::connect(&d.dir.join("query.sock"));
    for _ in 0..50 {
        let t = Instant::now();
        assert_eq!(c.ask(json!({"op": "stats"}))["workers"], 0);
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "stalled {:?}",
            t.elapsed()
        );
    }
    // A real engine registers meanwhile.
    let _e = engine(&d.control(), 9, "m");
    assert_eq!(c.ask(json!({"op": "stats"}))["workers"], 1);
    // After the 1 s deadline the silent ones are dropped and counted.
    std::thread::sleep(Duration::from_millis(1600));
    let stats = c.ask(json!({"op": "stats"}));
    assert_eq!(stats["refused_registrations"], 5, "{stats}");
}

#[test]
fn an_engine_whose_hello_arrived_is_not_pushed_out_by_a_flood_behind_it() {
    let d = start("hello-first", "daemon:\n  heartbeat_timeout_ms: 600000\n");
    // With the daemon stopped, the engine connects and sends its Hello, and
    // then 40 silent connections (same uid) queue up behind it: when the
    // daemon resumes, all are waiting at once.
    d.signal("STOP");
    let control = d.control();
    let registering = std::thread::spawn(move || try_engine(&control, 7, "m").map(|_| ()));
    std::thread::sleep(Duration::from_millis(200));
    let _flood: Vec<UnixStream> = (0..40)
        .map(|_| UnixStream::connect(d.dir.join("control.sock")).unwrap())
        .collect();
    d.signal("CONT");
    registering
        .join()
        .unwrap()
        .expect("the engine's Hello is read before newer connections can push it out");
}

#[test]
fn an_engine_that_stops_heartbeating_is_unavailable_until_it_resumes() {
    let d = start("heartbeat", "daemon:\n  heartbeat_timeout_ms: 300\n");
    let mut e = engine(&d.control(), 4, "m");
    e.publish_stored_hashes(Tier::Device, None, &[1, 2])
        .unwrap();
    let mut c = Conn::connect(&d.dir.join("query.sock"));
    let select = json!({"op": "select", "model": "m", "hashes": [1, 2], "dry_run": true});
    assert_eq!(c.ask(&select)["worker_id"], 4);
    // Silence: past the deadline the worker leaves routing (still registered).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = c.ask(&select);
        if r["error"]["code"] == "no_worker" {
            break;
        }
        assert!(Instant::now() < deadline, "never marked unavailable: {r}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let workers = c.ask(json!({"op": "workers"}));
    assert_eq!(workers["workers"][0]["available"], false, "{workers}");
    // A heartbeat: available again, with its blocks.
    e.heartbeat(0).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = c.ask(&select);
        if r["worker_id"] == 4 {
            assert_eq!(r["overlap_blocks"]["device"], 2, "{r}");
            break;
        }
        assert!(Instant::now() < deadline, "never recovered: {r}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_worker_cannot_register_under_a_live_workers_identity() {
    let d = start("identity", "daemon:\n  heartbeat_timeout_ms: 600000\n");
    let _first = engine(&d.control(), 5, "m");
    match try_engine(&d.control(), 5, "m") {
        Err(kvedge_shm::ControlError::Rejected { message, .. }) => {
            assert!(message.contains("already registered"), "{message}")
        }
        other => panic!("expected a rejection, got {:?}", other.map(|_| ())),
    }
    // Events reach the index only through the ring the daemon handed to the
    // registration, so they are always the registered worker's own.
    let mut c = Conn::connect(&d.dir.join("query.sock"));
    assert_eq!(c.ask(json!({"op": "stats"}))["workers"], 1);
}

#[test]
fn reservations_are_bounded() {
    let d = start(
        "reservations",
        "daemon:\n  max_reservations: 3\n  heartbeat_timeout_ms: 600000\n",
    );
    let _e = engine(&d.control(), 1, "m");
    let mut c = Conn::connect(&d.dir.join("query.sock"));
    let select = json!({"op": "select", "model": "m", "hashes": [1]});
    let ids: Vec<u64> = (0..3)
        .map(|_| c.ask(&select)["request_id"].as_u64().unwrap())
        .collect();
    let r = c.ask(&select);
    assert_eq!(r["error"]["code"], "too_many_requests", "{r}");
    // Dry runs reserve nothing and still work; finishing one frees a place.
    let dry = json!({"op": "select", "model": "m", "hashes": [1], "dry_run": true});
    assert_eq!(c.ask(&dry)["worker_id"], 1);
    assert_eq!(
        c.ask(json!({"op": "finish", "request_id": ids[0]}))["ok"],
        true
    );
    assert!(c.ask(&select)["request_id"].as_u64().is_some());
}
