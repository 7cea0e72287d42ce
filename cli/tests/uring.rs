//! The io_uring query listener (`--features io-uring`, `daemon.query_io:
//! io-uring`): JSON lines and binary frames are answered by the routing
//! loop through it, bad input gets its error, and an oversized frame closes
//! only its connection. Where the kernel refuses io_uring, the daemon logs
//! the fallback and serves the same on epoll, so the test holds either way.

#![forbid(unsafe_code)]
#![cfg(feature = "io-uring")]

mod common;

use std::io::Read;

use common::{Conn, engine, start, wait_for};
use kvedge_schema::messages::Tier;
use serde_json::json;

#[test]
fn queries_are_answered_through_the_io_uring_listener() {
    let d = start(
        "uring",
        "daemon:\n  query_io: io-uring\n  max_frame_bytes: 4096\n  max_query_connections: 4\n  heartbeat_timeout_ms: 600000\n  idle_timeout_ms: 1500\n",
    );
    let mut e = engine(&d.control(), 1, "m");
    e.publish_stored_hashes(Tier::Device, None, &[1, 2, 3])
        .unwrap();
    let mut c = Conn::connect(&d.query());
    let q = json!({"op": "select", "model": "m", "hashes": [1, 2, 3], "dry_run": true});
    wait_for(
        || c.ask(&q)["overlap_blocks"]["device"] == 3,
        "the published blocks",
    );
    // Pipelined requests come back in order.
    for _ in 0..50 {
        c.send(&q);
    }
    for _ in 0..50 {
        assert_eq!(c.recv()["worker_id"], 1);
    }
    assert_eq!(c.raw(b"{not json\n")["error"]["code"], "bad_request");
    // The binary protocol through the same listener.
    let mut w = kvedge_wire::Client::connect(d.query()).unwrap();
    let r = w
        .select_hashes("m", kvedge_wire::Role::Aggregated, &[1, 2, 3], 48, false)
        .unwrap()
        .unwrap();
    assert_eq!((r.worker_id, r.overlap_blocks[0]), (1, 3));
    assert!(w.finish(r.request_id).unwrap().is_ok());
    // Query channels are the routing loop's: this listener refuses them,
    // and the connection stays on the socket.
    let refused = w.attach_rings().unwrap().unwrap_err();
    assert_eq!(refused.0, kvedge_wire::Status::RingsUnavailable);
    assert!(!w.rings_attached());
    assert!(
        w.select_hashes("m", kvedge_wire::Role::Aggregated, &[1], 16, true)
            .unwrap()
            .is_ok()
    );
    // A line over max_frame_bytes: an error, then that connection closes;
    // the others are untouched.
    let mut giant = Conn::connect(&d.query());
    assert_eq!(
        giant.raw(&vec![b'x'; 10_000])["error"]["code"],
        "frame_too_large"
    );
    assert_eq!(c.ask(&q)["worker_id"], 1);
    assert_eq!(c.ask(json!({"op": "stats"}))["reservations"], 0);
    // The connection limit (4): c and w are open, the giant one closed.
    let mut more: Vec<Conn> = (0..2).map(|_| Conn::connect(&d.query())).collect();
    for m in &mut more {
        assert_eq!(m.ask(json!({"op": "stats"}))["workers"], 1);
    }
    let mut refused = Conn::connect(&d.query());
    assert_eq!(refused.recv()["error"]["code"], "too_many_connections");
    assert_eq!(c.ask(&q)["worker_id"], 1);
    // A connection that sends nothing for idle_timeout_ms (1.5 s) is
    // closed: its read sees the end of the stream.
    drop(more);
    drop(w);
    let idle = wait_for_connect(&d.query());
    idle.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut byte = [0u8; 1];
    assert_eq!((&idle).read(&mut byte).unwrap(), 0, "closed when idle");
}

/// Connects once the listener has room again (closed connections are
/// counted down asynchronously).
fn wait_for_connect(path: &std::path::Path) -> std::os::unix::net::UnixStream {
    let mut stream = None;
    wait_for(
        || {
            let s = std::os::unix::net::UnixStream::connect(path).unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_millis(50)))
                .unwrap();
            let mut byte = [0u8; 1];
            // A refused connection gets an error line at once; an accepted
            // one stays silent.
            match (&s).read(&mut byte) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    stream = Some(s);
                    true
                }
                _ => false,
            }
        },
        "room under the connection limit",
    );
    stream.unwrap()
}
