//! The seam for drivers on other threads, on the default build: a test
//! thread plays such a driver against a real routing loop. Its connection
//! is admitted by the core, its JSON and binary requests are answered from
//! the same state as the loop's own sockets (an engine registered over the
//! real control socket), and the core's idle timeout reaches it through
//! the closer it gave.

#![forbid(unsafe_code)]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvedge_core::ClientId;
use kvedge_daemon::jobs::{Job, JobSender};
use kvedge_schema::messages::control::Hello;
use kvedge_schema::messages::{Role, Tier};
use kvedge_shm::control::PeerCred;
use kvedge_wire::framing::Mode;
use kvedge_wire::{Ids, Request, Select, binary};

const PATIENCE: Duration = Duration::from_secs(5);

fn connect(jobs: &JobSender, closed: mpsc::Sender<()>) -> ClientId {
    let (tx, rx) = mpsc::channel();
    assert!(jobs.send(Job::Connect {
        peer: Ok(PeerCred {
            pid: 1,
            uid: 0,
            gid: 0
        }),
        warms: true,
        admitted: Box::new(move |outcome| {
            let _ = tx.send(outcome);
        }),
        close: Box::new(move || {
            let _ = closed.send(());
        }),
    }));
    rx.recv_timeout(PATIENCE).unwrap().unwrap()
}

fn ask(jobs: &JobSender, client: ClientId, request: Vec<u8>, mode: Mode) -> Vec<u8> {
    let (tx, rx) = mpsc::channel();
    assert!(jobs.send(Job::Request {
        client,
        request,
        mode,
        reply: Box::new(move |bytes| {
            let _ = tx.send(bytes);
        }),
    }));
    rx.recv_timeout(PATIENCE).unwrap()
}

fn ask_json(jobs: &JobSender, client: ClientId, line: &str) -> serde_json::Value {
    let reply = ask(jobs, client, line.as_bytes().to_vec(), Mode::Json);
    serde_json::from_slice(&reply).unwrap()
}

#[test]
fn a_driver_on_another_thread_is_served_through_jobs() {
    let mut bound = kvedge_testkit::Bound::new(
        "jobs",
        "daemon:\n  idle_timeout_ms: 300\n  heartbeat_timeout_ms: 600000\n",
    );
    let jobs = bound.server.job_sender().unwrap();
    let daemon = bound.run();

    let hello = Hello {
        kv_blocks: [1024, 0, 0],
        endpoint: "http://engine-5".into(),
        ..Hello::new(5, "m")
    };
    let mut engine = kvedge_testkit::register(daemon.control(), &hello);
    engine
        .publish_stored_hashes(Tier::Device, None, &[1, 2, 3])
        .unwrap();

    let (closed_tx, closed) = mpsc::channel();
    let client = connect(&jobs, closed_tx);
    let select = r#"{"op":"select","model":"m","hashes":[1,2,3],"dry_run":true}"#;
    let start = Instant::now();
    let reply = loop {
        let reply = ask_json(&jobs, client, select);
        if reply["overlap_blocks"]["device"] == 3 || start.elapsed() > PATIENCE {
            break reply;
        }
    };
    assert_eq!(reply["worker_id"], 5, "{reply}");
    assert_eq!(
        ask_json(&jobs, client, "{nope")["error"]["code"],
        "bad_request"
    );

    // The same request as a binary frame body.
    let mut frame = Vec::new();
    let mut s = Select::new("m", Role::Aggregated, Ids::hashes(&[1, 2, 3]));
    s.dry_run = true;
    binary::encode_request(&mut frame, &Request::Select(s)).unwrap();
    // The reply is a whole frame: length, status, version, payload.
    let reply = ask(&jobs, client, frame[4..].to_vec(), Mode::Binary);
    assert_eq!(u16::from_le_bytes([reply[4], reply[5]]), 0, "status ok");
    let view = binary::decode_select_reply(&reply[8..]).unwrap();
    assert_eq!((view.worker_id, view.overlap_blocks[0]), (5, 3));

    // Silent for the idle timeout: the core closes it through its closer.
    closed.recv_timeout(PATIENCE).unwrap();
    let (other_tx, _other_closed) = mpsc::channel();
    let other = connect(&jobs, other_tx);
    let stats = ask_json(&jobs, other, r#"{"op":"stats"}"#);
    assert_eq!(
        (stats["clients"].as_u64(), stats["workers"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(jobs.send(Job::Disconnect { client: other }));

    daemon.stop();
    drop(engine);
}
