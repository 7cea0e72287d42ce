//! Unmodified-engine feeds end to end: a real `kvedge run` reading a real
//! ZeroMQ publisher and a real Prometheus exporter (`fixtures/fake_vllm.py`:
//! pyzmq, msgspec and prometheus_client, following vLLM's publisher on the
//! wire), checked through selects and `workers` over the query socket.

#![forbid(unsafe_code)]

mod common;

use std::time::Duration;

use common::fake_engine::{FakeEngine, notice, overlap, tokens, wait, wait_nudging, worker};
use common::{Conn, start, start_with_env};
use serde_json::json;

fn config(engine: &FakeEngine, extra: &str) -> String {
    let metrics = match engine.ports.get("metrics") {
        Some(p) => format!("    metrics: http://127.0.0.1:{p}/metrics\n"),
        None => String::new(),
    };
    let (events, replay) = match engine.ports.get("events") {
        Some(_) => (engine.port("events"), engine.port("replay")),
        // Nothing listens on port 1.
        None => (1, 1),
    };
    format!(
        "daemon:\n  heartbeat_timeout_ms: 1500\nengines:\n  - kind: vllm\n    model: llama\n    worker_id: 10\n    block_size: 16\n    endpoint: http://127.0.0.1:8000\n    events: tcp://127.0.0.1:{events}\n    replay: tcp://127.0.0.1:{replay}\n    topic: kv-events\n{metrics}{extra}"
    )
}

#[test]
fn vllm_events_metrics_gaps_restarts_and_mismatches() {
    let mut e = FakeEngine::spawn(&["--layout", "map"]);
    let d = start("engines-vllm", &config(&e, ""));
    let mut c = Conn::connect(&d.query());
    wait(
        || worker(&mut c, 10)["available"] == true,
        "the engine's worker",
    );

    // Stored: four blocks, found by kvedge's own hashes of the tokens.
    e.send(
        json!({"op": "stored", "hashes": [1, 2, 3, 4], "parent": null, "tokens": tokens(0, 64)}),
    );
    wait_nudging(
        &mut e,
        || overlap(&mut c, &tokens(0, 64)) == 4,
        "four stored blocks",
    );
    let r =
        c.ask(json!({"op": "select", "model": "llama", "tokens": tokens(0, 64), "dry_run": true}));
    assert_eq!(r["worker_id"], 10);
    assert_eq!(r["endpoint"], "http://127.0.0.1:8000");

    // Removed, through the engine-hash map.
    e.send(json!({"op": "removed", "hashes": [3, 4]}));
    wait(
        || overlap(&mut c, &tokens(0, 64)) == 2,
        "two blocks removed",
    );

    // Cleared.
    e.send(json!({"op": "cleared"}));
    wait(
        || overlap(&mut c, &tokens(0, 64)) == 0,
        "everything cleared",
    );

    // A gap: batch 6 never reaches kvedge live; batch 7 shows the gap, the
    // replay socket supplies 6, and the chain is whole.
    e.send(json!({"op": "stored", "hashes": [5], "parent": null, "tokens": tokens(100, 116)}));
    wait(
        || overlap(&mut c, &tokens(100, 116)) == 1,
        "the chain's root",
    );
    e.send(json!({"op": "drop_next"}));
    e.send(json!({"op": "stored", "hashes": [6], "parent": 5, "tokens": tokens(116, 132)}));
    e.send(json!({"op": "stored", "hashes": [7], "parent": 6, "tokens": tokens(132, 148)}));
    wait(
        || overlap(&mut c, &tokens(100, 148)) == 3,
        "the replayed chain",
    );
    wait(
        || notice(&worker(&mut c, 10), "replayed") >= 1,
        "a replayed notice",
    );
    assert_eq!(notice(&worker(&mut c, 10), "events_lost"), 0);

    // Restart: the sequence starts again at 0; the old blocks go.
    e.send(json!({"op": "restart"}));
    e.send(json!({"op": "stored", "hashes": [8], "parent": null, "tokens": tokens(200, 216)}));
    wait(
        || overlap(&mut c, &tokens(200, 216)) == 1,
        "the restarted engine's block",
    );
    assert_eq!(
        overlap(&mut c, &tokens(100, 148)),
        0,
        "blocks from before the restart"
    );
    // Notices follow on the bridge's next tick.
    wait(
        || notice(&worker(&mut c, 10), "restarted") == 1,
        "a restarted notice",
    );

    // A block size other than the configured one: loud, not indexed.
    e.send(json!({"op": "stored", "hashes": [9], "parent": null, "tokens": tokens(300, 332), "block_size": 32}));
    wait(
        || notice(&worker(&mut c, 10), "block_size_mismatch") == 1,
        "a block-size notice",
    );
    assert_eq!(overlap(&mut c, &tokens(300, 332)), 0);
    assert_eq!(overlap(&mut c, &tokens(200, 216)), 1, "earlier blocks stay");

    // Load from the exporter.
    e.send(json!({"op": "load", "running": 3, "waiting": 2, "usage": 0.5}));
    wait(
        || {
            let w = worker(&mut c, 10);
            w["waiting_requests"] == 2
                && w["kv_used_blocks"] == 2048
                && w["kv_total_blocks"] == 4096
        },
        "the scraped load",
    );
    assert!(worker(&mut c, 10)["active_requests"].as_u64().unwrap() >= 3);

    // Reservations work as for any worker.
    let r = c.ask(json!({"op": "select", "model": "llama", "tokens": tokens(200, 216)}));
    assert_eq!(r["worker_id"], 10);
    let id = r["request_id"].as_u64().unwrap();
    assert_eq!(
        c.ask(json!({"op": "prefill_done", "request_id": id}))["ok"],
        true
    );
    assert_eq!(c.ask(json!({"op": "finish", "request_id": id}))["ok"], true);
}

#[test]
fn older_engines_positional_events_and_replay_frames() {
    let mut e = FakeEngine::spawn(&[
        "--layout",
        "array",
        "--replay-format",
        "old",
        "--no-metrics",
    ]);
    let d = start("engines-old", &config(&e, ""));
    let mut c = Conn::connect(&d.query());
    wait(
        || worker(&mut c, 10)["available"] == true,
        "the engine's worker",
    );
    e.send(json!({"op": "stored", "hashes": [1], "parent": null, "tokens": tokens(0, 16)}));
    wait_nudging(
        &mut e,
        || overlap(&mut c, &tokens(0, 16)) == 1,
        "the root block",
    );
    e.send(json!({"op": "drop_next"}));
    e.send(json!({"op": "stored", "hashes": [2], "parent": 1, "tokens": tokens(16, 32)}));
    e.send(json!({"op": "stored", "hashes": [3], "parent": 2, "tokens": tokens(32, 48)}));
    wait(
        || overlap(&mut c, &tokens(0, 48)) == 3,
        "the replayed chain",
    );
    e.send(json!({"op": "removed", "hashes": [2, 3]}));
    wait(
        || overlap(&mut c, &tokens(0, 48)) == 1,
        "removals by engine hash",
    );
}

#[test]
fn blocks_stored_before_kvedge_started_come_from_the_replay_buffer() {
    let mut e = FakeEngine::spawn(&["--no-metrics"]);
    // Published before any subscriber: lost live, kept in the buffer.
    e.send(json!({"op": "stored", "hashes": [1, 2], "parent": null, "tokens": tokens(0, 32)}));
    let d = start("engines-history", &config(&e, ""));
    let mut c = Conn::connect(&d.query());
    wait(
        || worker(&mut c, 10)["available"] == true,
        "the engine's worker",
    );
    // The next batch is the first kvedge hears: it asks for history.
    let mut n = 3;
    wait(
        || {
            e.send(json!({"op": "stored", "hashes": [n], "parent": null, "tokens": tokens(1000 + n as u32 * 16, 1016 + n as u32 * 16)}));
            n += 1;
            overlap(&mut c, &tokens(0, 32)) == 2
        },
        "the blocks from before kvedge started",
    );
}

#[test]
fn a_dead_exporter_takes_its_worker_out_of_routing() {
    let mut e = FakeEngine::spawn(&["--no-events"]);
    let d = start("engines-exporter", &config(&e, ""));
    let mut c = Conn::connect(&d.query());
    e.send(json!({"op": "load", "running": 1, "waiting": 4, "usage": 0.25}));
    wait(
        || {
            let w = worker(&mut c, 10);
            w["available"] == true && w["waiting_requests"] == 4
        },
        "the worker, live on its metrics alone",
    );
    let metrics_port = e.port("metrics").to_string();
    drop(e);
    wait(
        || {
            let w = worker(&mut c, 10);
            w["available"] == false && notice(&w, "silent") == 1
        },
        "the worker out of routing after its exporter died",
    );
    // The bridge goes on reporting the load it cannot read (its exact
    // count, at most once a second); those reports are no sign of the
    // engine's life.
    let reported = notice(&worker(&mut c, 10), "load_unreadable");
    wait(
        || notice(&worker(&mut c, 10), "load_unreadable") > reported,
        "a report of the unreadable load after the silence",
    );
    assert_eq!(worker(&mut c, 10)["available"], false);
    let r =
        c.ask(json!({"op": "select", "model": "llama", "tokens": tokens(0, 16), "dry_run": true}));
    assert!(r["error"].is_object(), "no worker to pick: {r}");
    // The exporter back where it was: the worker returns, and both
    // notices are shown as over, their counts kept.
    let _e = FakeEngine::spawn(&["--no-events", "--metrics-port", &metrics_port]);
    wait(
        || worker(&mut c, 10)["available"] == true,
        "the worker back with its exporter",
    );
    // Over no later than it is back: the bridge says so before the load
    // that brings it back.
    let w = worker(&mut c, 10);
    assert_eq!(active(&w, "load_unreadable"), Some(false), "{w}");
    assert_eq!(active(&w, "silent"), Some(false), "{w}");
    let failed = notice(&w, "load_unreadable");
    assert!(
        failed >= reported,
        "the count kept: {failed} after {reported}"
    );
    let text = c.ask(json!({"op": "metrics"}))["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        text.lines()
            .any(|l| l.starts_with("kvedge_worker_notices_active{")
                && l.contains("code=\"load_unreadable\"")
                && l.ends_with(" 0")),
        "{text}"
    );
}

/// An operator's `HTTP_PROXY` (say, for model downloads) is not used for
/// the engines' metrics: they are read directly, and a proxy sees nothing.
#[test]
fn the_engines_metrics_are_read_directly_whatever_proxy_the_environment_names() {
    let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    proxy.set_nonblocking(true).unwrap();
    let url = format!("http://{}", proxy.local_addr().unwrap());
    let mut e = FakeEngine::spawn(&["--no-events"]);
    let d = start_with_env(
        "engines-proxy",
        &config(&e, ""),
        &[
            ("HTTP_PROXY", &url),
            ("http_proxy", &url),
            ("ALL_PROXY", &url),
            ("all_proxy", &url),
        ],
    );
    let mut c = Conn::connect(&d.query());
    e.send(json!({"op": "load", "running": 1, "waiting": 3, "usage": 0.5}));
    wait(
        || worker(&mut c, 10)["waiting_requests"] == 3,
        "the load read from the engine itself",
    );
    assert!(
        matches!(proxy.accept(), Err(ref err) if err.kind() == std::io::ErrorKind::WouldBlock),
        "the proxy named in the environment was connected to"
    );
}

#[test]
fn a_killed_engine_leaves_routing_long_before_its_heartbeat_timeout_and_its_restart_comes_back() {
    let mut e = FakeEngine::spawn(&[]);
    // A heartbeat timeout the test never reaches (`wait` gives up after
    // 20 s): only the closed events connection can take the engine out.
    let yaml = config(&e, "").replace("heartbeat_timeout_ms: 1500", "heartbeat_timeout_ms: 60000");
    let d = start("engines-down", &yaml);
    let mut c = Conn::connect(&d.query());
    let old = tokens(0, 16);
    e.store(1, &old);
    wait_nudging(
        &mut e,
        || overlap(&mut c, &old) == 1,
        "the engine's block indexed",
    );
    let ports: Vec<String> = ["events", "replay", "metrics"]
        .iter()
        .map(|p| e.port(p).to_string())
        .collect();
    drop(e);
    wait(
        || {
            let w = worker(&mut c, 10);
            w["available"] == false && notice(&w, "silent") == 1
        },
        "the killed engine out of routing (down_after_ms, 2 s by default)",
    );
    assert_eq!(overlap(&mut c, &old), 0, "its blocks dropped");
    let w = worker(&mut c, 10);
    assert_eq!(active(&w, "silent"), Some(true), "{w}");
    assert!(
        w["notices"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["code"] == "silent"
                && n["message"]
                    .as_str()
                    .unwrap()
                    .contains("events connection has been closed")),
        "{w}"
    );
    // Restarted where it was, it publishes one batch, likely before kvedge
    // has connected again: the replay asked for on reconnection brings it.
    let mut e = FakeEngine::spawn(&[
        "--events-port",
        &ports[0],
        "--replay-port",
        &ports[1],
        "--metrics-port",
        &ports[2],
    ]);
    let new = tokens(100, 116);
    e.store(2, &new);
    wait(
        || {
            let w = worker(&mut c, 10);
            w["available"] == true && overlap(&mut c, &new) == 1
        },
        "the restarted engine back in routing with its first batch",
    );
    assert_eq!(
        overlap(&mut c, &old),
        0,
        "no stale block of the killed process"
    );
    wait(
        || {
            let w = worker(&mut c, 10);
            active(&w, "silent") == Some(false) && active(&w, "load_unreadable") == Some(false)
        },
        "silent and load_unreadable over",
    );
    assert_eq!(notice(&worker(&mut c, 10), "silent"), 1);
}

/// Whether the worker's notice `code` stands (None: never raised).
fn active(row: &serde_json::Value, code: &str) -> Option<bool> {
    row["notices"]
        .as_array()?
        .iter()
        .find(|n| n["code"] == code)
        .and_then(|n| n["active"].as_bool())
}

#[test]
fn hostile_feeds_hurt_no_one_else_and_reloads_add_and_remove_engines() {
    let mut good = FakeEngine::spawn(&["--no-metrics"]);
    let mut bad = FakeEngine::spawn(&["--no-metrics"]);
    let entry = |id: u64, e: &FakeEngine| {
        format!(
            "  - kind: vllm\n    model: llama\n    worker_id: {id}\n    block_size: 16\n    endpoint: http://engine-{id}\n    events: tcp://127.0.0.1:{}\n    replay: tcp://127.0.0.1:{}\n    topic: kv-events\n",
            e.port("events"),
            e.port("replay")
        )
    };
    let head = "daemon:\n  heartbeat_timeout_ms: 1500\nengines:\n";
    let d = start("engines-hostile", &format!("{head}{}", entry(11, &good)));
    let mut c = Conn::connect(&d.query());
    wait(
        || worker(&mut c, 11)["available"] == true,
        "the good engine",
    );

    // A reload adds the hostile engine.
    std::fs::write(
        d.config(),
        format!("{head}{}{}", entry(11, &good), entry(10, &bad)),
    )
    .unwrap();
    d.signal("HUP");
    wait(
        || worker(&mut c, 10)["available"] == true,
        "the reloaded engine",
    );
    assert_eq!(worker(&mut c, 11)["available"], true);
    bad.send(json!({"op": "stored", "hashes": [7], "parent": null, "tokens": tokens(500, 516)}));
    wait_nudging(
        &mut bad,
        || overlap(&mut c, &tokens(500, 516)) == 1,
        "the subscription in place",
    );

    // Garbage: a one-frame message, a short sequence number, and, as the
    // next batches, payloads that are truncated, claim 4 G elements, or
    // nest without end, and 300,000 removals of blocks never stored.
    for frames in [
        vec![hex(b"kv-events")],
        vec![hex(b"kv-events"), "0102".into(), "90".into()],
    ] {
        bad.send(json!({"op": "raw", "frames": frames}));
    }
    for payload in [
        "93cb41".to_owned(),
        "92cb3ff0000000000000ddffffffff".into(),
        "91".repeat(5000),
        "c1".into(),
    ] {
        bad.send(json!({"op": "raw_payload", "payload": payload}));
    }
    bad.send(json!({"op": "bogus_removals", "n": 300_000}));
    // A batch over `max_message_bytes` (4 MiB by default): the connection
    // is cut at its header, counted, and opened again.
    bad.send(json!({"op": "bogus_removals", "n": 1_200_000}));

    // The good engine is served as before.
    good.send(json!({"op": "stored", "hashes": [1, 2], "parent": null, "tokens": tokens(0, 32)}));
    wait_nudging(
        &mut good,
        || overlap(&mut c, &tokens(0, 32)) == 2,
        "the good engine's blocks",
    );
    wait(
        || {
            let w = worker(&mut c, 10);
            notice(&w, "undecodable") >= 5
                && notice(&w, "unknown_removal") >= 300_000
                && notice(&w, "events_refused") >= 1
        },
        "the hostile feed counted",
    );
    assert_eq!(
        worker(&mut c, 10)["available"],
        true,
        "bad input is no reason to drop an engine"
    );

    // A reload without it removes its worker.
    std::fs::write(d.config(), format!("{head}{}", entry(11, &good))).unwrap();
    d.signal("HUP");
    wait(|| worker(&mut c, 10).is_null(), "the removed engine gone");
    assert_eq!(overlap(&mut c, &tokens(0, 32)), 2);
}

#[test]
fn reloads_keep_an_unchanged_engine_and_one_added_back_gets_its_history_at_once() {
    let mut e = FakeEngine::spawn(&["--no-metrics"]);
    let yaml = config(&e, "");
    let d = start("engines-reload", &yaml);
    let mut c = Conn::connect(&d.query());
    wait(
        || worker(&mut c, 10)["available"] == true,
        "the engine's worker",
    );
    e.send(json!({"op": "stored", "hashes": [1, 2, 3], "parent": null, "tokens": tokens(0, 48)}));
    wait_nudging(
        &mut e,
        || overlap(&mut c, &tokens(0, 48)) == 3,
        "three blocks",
    );
    let reload = |c: &mut Conn, yaml: &str| {
        std::fs::write(d.config(), yaml).unwrap();
        let r = c.ask(json!({"op": "reload"}));
        assert_eq!(r["ok"], true, "{r}");
    };
    // A reload that leaves the entry as it was (a comment added, lines
    // moved) keeps the worker and its blocks.
    reload(&mut c, &format!("# reloaded\n\n{yaml}"));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(overlap(&mut c, &tokens(0, 48)), 3);
    // Removed, then added back while the engine publishes nothing: its
    // blocks come back from the replay socket, asked at once.
    reload(&mut c, "daemon:\n  heartbeat_timeout_ms: 1500\n");
    wait(|| worker(&mut c, 10).is_null(), "the removed engine gone");
    reload(&mut c, &yaml);
    wait(
        || overlap(&mut c, &tokens(0, 48)) == 3,
        "the blocks back without a new batch",
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `kvedge mock-engine` publishes the block hashes vLLM itself computes:
/// an independent subscriber (`fixtures/vllm_hash_check.py`: pyzmq,
/// msgspec, Python's own pickle and hashlib) hashes every Stored event's
/// token ids as vLLM does, from the parent the event names, and finds each
/// published hash; every Removed event, after a device pool small enough to
/// evict and a host tier that takes the evicted blocks, names blocks it
/// was told about.
#[test]
fn the_mock_engine_publishes_vllms_own_block_hashes() {
    use std::io::BufRead;
    let dir = common::temp_dir("mock-vllm-hashes");
    let tokenizer = dir.join("tokenizer.json");
    kvedge_epp::testing::train_tokenizer(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs")),
        4000,
        &tokenizer,
    );
    let node = kvedge_epp::testing::VllmNode::new(9);
    let _engine = Killed(
        node.command(
            std::path::Path::new(env!("CARGO_BIN_EXE_kvedge")),
            &dir,
            &tokenizer,
        )
        .args(["--speed", "20", "--block-size", "16"])
        .args(["--device-blocks", "64", "--host-blocks", "32"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap(),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(node.http).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the engine did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut check = Killed(
        std::process::Command::new("python3")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/vllm_hash_check.py"
            ))
            .arg(format!("tcp://{}:{}", node.ip, node.events))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 (with pyzmq and msgspec) is needed for these tests"),
    );
    let mut lines = std::io::BufReader::new(check.0.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "ready");

    // Conversations sharing a long opening, each growing over turns: far
    // more blocks than the device pool holds.
    let opening = "You are a careful assistant for operators of inference fleets. ".repeat(6);
    for turn in 0..3 {
        for user in 0..8 {
            let notes: String = (0..12 * (turn + 1))
                .map(|i| format!("Note {user} {i} on routing, caches and tiers. "))
                .collect();
            let prompt = format!("{opening} User {user} asks: {notes}");
            let body = json!({"model": "m", "prompt": prompt, "max_tokens": 2}).to_string();
            let (status, _, reply) =
                kvedge_epp::testing::post(node.http, "/v1/completions", body.as_bytes(), &[]);
            assert_eq!(status, 200, "{reply}");
        }
    }
    let summary: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let n = |k: &str| summary[k].as_u64().unwrap();
    assert!(
        n("stored") > 80,
        "more blocks than the pools hold: {summary}"
    );
    assert_eq!(n("matched"), n("stored"), "{summary}");
    assert_eq!(n("unknown_parents"), 0, "{summary}");
    assert_eq!(n("other_topics"), 0, "vLLM's default topic: {summary}");
    assert!(n("removed") > 0, "the device pool evicted: {summary}");
    assert_eq!(n("removed_known"), n("removed"), "{summary}");
}

/// A child process killed and reaped on drop, a failing test included.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
