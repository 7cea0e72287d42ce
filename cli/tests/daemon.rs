//! `kvedge run` as a real process: engines register over the control socket
//! and publish through their rings, frontends ask over the query socket.

#![forbid(unsafe_code)]

mod common;

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Conn, Daemon, start as start_with, wait_for};
use kvedge_schema::messages::Tier;
use kvedge_shm::Publisher;
use serde_json::{Value, json};

/// A daemon with the test defaults. Test engines send no heartbeats: a
/// long deadline keeps them available.
fn start(name: &str) -> Daemon {
    start_with(
        name,
        "daemon:\n  max_frame_bytes: 4096\n  ring_capacity: 1048576\n  heartbeat_timeout_ms: 600000\n",
    )
}

fn engine(d: &Daemon, id: u64) -> Publisher {
    common::engine(&d.control(), id, "llama")
}

fn prompt(prefix: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| prefix * 100_000 + i).collect()
}

#[test]
fn engines_publish_frontends_select_and_a_killed_engine_leaves_at_once() {
    let d = start("main");
    let seed = kvedge_schema::hash::block_seed(None, None);
    let mut a = engine(&d, 1);
    let mut b = engine(&d, 2);
    a.publish_stored_tokens(Tier::Device, None, &prompt(1, 512), 16, seed)
        .unwrap();
    b.publish_stored_tokens(Tier::Device, None, &prompt(2, 512), 16, seed)
        .unwrap();
    let mut c = Conn::connect(&d.query());
    let mut tokens = prompt(1, 384);
    tokens.extend(prompt(9, 128));
    let select = json!({"op": "select", "model": "llama", "tokens": tokens});
    // Polled with dry runs: a real select reserves, and would shift the load.
    let dry = json!({"op": "select", "model": "llama", "tokens": tokens, "dry_run": true});
    wait_for(
        || c.ask(dry.clone())["overlap_blocks"]["device"] == 24,
        "A's blocks",
    );
    let r = c.ask(select.clone());
    assert_eq!(r["worker_id"], 1);
    assert_eq!(r["endpoint"], "http://engine-1");
    assert_eq!(r["policy"], "default");
    assert!(r["rule"].is_null());
    let id = r["request_id"].as_u64().unwrap();
    assert_eq!(
        c.ask(json!({"op": "prefill_done", "request_id": id}))["ok"],
        true
    );
    assert_eq!(c.ask(json!({"op": "finish", "request_id": id}))["ok"], true);
    assert_eq!(
        c.ask(json!({"op": "finish", "request_id": id}))["error"]["code"],
        "unknown_request"
    );
    let workers = c.ask(json!({"op": "workers"}));
    assert_eq!(workers["workers"].as_array().unwrap().len(), 2);
    // Explain: the candidates and their signals, as the policy saw them.
    let mut explained = dry.clone();
    explained["explain"] = json!(true);
    let e = c.ask(explained)["explain"].clone();
    assert_eq!(
        (e["candidates"].as_u64(), e["survivors"].as_u64()),
        (Some(2), Some(2))
    );
    let rows = e["workers"].as_array().unwrap();
    let a_row = rows.iter().find(|w| w["worker_id"] == 1).unwrap();
    // A holds 24 of the prompt's blocks, and the select above sent it all
    // 32: until A reports them, they count as about to be cached there.
    assert_eq!(a_row["overlap_blocks"]["device"], 32);
    // That block was sent by one recent pick (the select above).
    assert_eq!(e["prefix_sharers"], 1);
    // Each candidate's cost under the policy; the chosen one is the lowest
    // (temperature 0) and equals the reply's cost.
    let b_row = rows.iter().find(|w| w["worker_id"] == 2).unwrap();
    let (a_cost, b_cost) = (
        a_row["cost"].as_f64().unwrap(),
        b_row["cost"].as_f64().unwrap(),
    );
    assert!(a_cost < b_cost, "A holds the prefix: {a_cost} vs {b_cost}");
    let chosen = c.ask(dry.clone())["cost"].as_f64().unwrap();
    assert_eq!(chosen, a_cost);
    assert!(c.ask(dry.clone())["explain"].is_null(), "only when asked");
    // A got the one real select (a count halving every 10 s), B none; dry
    // runs count nothing.
    let recent = |row: &Value| row["recent_selections"].as_f64().unwrap();
    assert!(recent(a_row) > 0.5 && recent(a_row) <= 1.0, "{a_row}");
    assert_eq!(recent(b_row), 0.0);
    // And each candidate's predicted TTFT, term by term: A holds the
    // prefix, so its own prefill is shorter; the terms add up.
    let t = |row: &Value, k: &str| row["ttft"][k].as_f64().unwrap();
    assert!(
        t(a_row, "prefill_ms") < t(b_row, "prefill_ms"),
        "{a_row} {b_row}"
    );
    for row in [a_row, b_row] {
        let sum =
            t(row, "queue_ms") + t(row, "prefill_ms") + t(row, "wait_ms") + t(row, "decode_ms");
        assert!((sum - t(row, "total_ms")).abs() < 1e-9, "{row}");
        assert!(t(row, "tokens_per_second") > 0.0);
        assert!(["learned", "peers", "prior"].contains(&row["ttft"]["speed"].as_str().unwrap()));
    }

    // Engine A dies (its control connection closes): its blocks stop
    // counting. A's reservations were finished above.
    drop(a);
    let gone = wait_for(
        || c.ask(dry.clone())["worker_id"] == 2,
        "A to leave routing",
    );
    assert!(gone < Duration::from_millis(500), "took {gone:?}");
    let r = c.ask(dry.clone());
    assert_eq!(r["overlap_blocks"]["device"], 0);
    drop(b);
}

#[test]
fn garbage_gets_error_replies_and_everyone_else_keeps_working() {
    let d = start("garbage");
    let seed = kvedge_schema::hash::block_seed(None, None);
    let mut a = engine(&d, 1);
    a.publish_stored_tokens(Tier::Device, None, &prompt(1, 64), 16, seed)
        .unwrap();
    let mut c = Conn::connect(&d.query());
    let ok = json!({"op": "select", "model": "llama", "tokens": prompt(1, 64), "dry_run": true});
    wait_for(
        || c.ask(ok.clone())["overlap_blocks"]["device"] == 4,
        "blocks",
    );
    for bad in [
        &b"\x00\x01\xff garbage\n"[..],
        b"{\"op\": \"select\"}\n",
        b"{\"op\": \"launch\"}\n",
        b"{\"op\": \"select\", \"model\": \"llama\", \"tokens\": [1], \"hashes\": [2]}\n",
        b"{\"op\": \"select\", \"model\": \"nope\", \"tokens\": [1]}\n",
        b"[1,2,3]\n",
    ] {
        let reply = c.raw(bad);
        assert!(reply["error"]["code"].is_string(), "{reply}");
        assert_eq!(
            c.ask(ok.clone())["worker_id"],
            1,
            "the connection still works"
        );
    }
    // A giant line closes only that connection.
    let mut giant = Conn::connect(&d.query());
    let reply = giant.raw(&vec![b'x'; 10_000]);
    assert_eq!(reply["error"]["code"], "frame_too_large");
    // 64 clients doing 10,000 selects each (binary protocol), while garbage
    // keeps arriving on other connections: every select gets its answer.
    let dir = d.dir.clone();
    let hashes = kvedge_schema::hash::sequence_hashes(&prompt(1, 64), 16, None, None);
    let threads: Vec<_> = (0..64)
        .map(|_| {
            let path = dir.join("query.sock");
            let hashes = hashes.clone();
            std::thread::spawn(move || {
                let mut w = kvedge_wire::Client::connect(path).unwrap();
                for _ in 0..10_000 {
                    let r = w
                        .select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 64, true)
                        .unwrap()
                        .unwrap();
                    assert_eq!(r.worker_id, 1);
                }
            })
        })
        .collect();
    let mut noisy = Conn::connect(&d.query());
    for _ in 0..200 {
        assert!(noisy.raw(b"{not json\n")["error"]["code"].is_string());
    }
    for t in threads {
        t.join().unwrap();
    }
    let stats = c.ask(json!({"op": "stats"}));
    assert!(stats["errors"].as_u64().unwrap() >= 206, "{stats}");
    assert!(stats["selects"].as_u64().unwrap() >= 640_000, "{stats}");
    drop(a);
}

#[test]
fn a_second_daemon_is_refused_and_sigterm_cleans_up() {
    let mut d = start("twice");
    let config = d.dir.join("kvedge.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args([
            "run",
            "--config",
            config.to_str().unwrap(),
            "--runtime-dir",
            d.dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("belongs to a running daemon"));
    // The CLI client.
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args(["stats", "--json", "--runtime-dir", d.dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(stats["index_entries"], 0);
    // For people; and `--socket` names the query socket directly.
    let socket = d.dir.join("query.sock");
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args(["stats", "--socket", socket.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().eq(["index_entries", "0"])),
        "{text}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args([
            "query",
            "select",
            "--model",
            "none",
            "--tokens",
            "1,2,3",
            "--json",
            "--runtime-dir",
            d.dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reply["error"]["code"], "no_worker");
    // Without --json the error goes to stderr for people.
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args(["query", "select", "--model", "none", "--tokens", "1"])
        .args(["--runtime-dir", d.dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("kvedge: no_worker: "));
    // A daemon that is not there: the same error shape, exit code 1.
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args(["workers", "--json", "--socket", "/nonexistent/query.sock"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reply["error"]["code"], "unreachable");
    // SIGTERM: a clean exit that removes the sockets.
    let pid = d.child.id();
    Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let status = d.child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(!d.dir.join("query.sock").exists());
}

#[test]
fn an_overflowed_ring_is_resynced_to_the_engines_real_state() {
    // A 64 KiB ring: publishing 2,000 events of 40 blocks (1.6 MB) back to
    // back overflows it (the daemon indexes an event slower than it is
    // pushed).
    let d = start_with(
        "resync",
        "daemon:\n  ring_capacity: 65536\n  heartbeat_timeout_ms: 600000\n",
    );
    let mut a = engine(&d, 1);
    let mut held: Vec<u64> = Vec::new();
    for i in 0..2000u64 {
        let hashes: Vec<u64> = (0..40).map(|k| (i << 8 | k) + 1).collect();
        let _ = a
            .publish_stored_hashes(Tier::Device, None, &hashes)
            .unwrap();
        held.extend(&hashes);
        if i % 500 == 499 {
            // The engine evicts some of what it stored.
            let evict: Vec<u64> = held.drain(..40).collect();
            let _ = a.publish_removed(Tier::Device, &evict).unwrap();
        }
    }
    let dropped = a.dropped();
    assert!(
        dropped > 0,
        "the ring must have overflowed for this test to mean anything"
    );
    let mut c = Conn::connect(&d.query());
    let blocks =
        |c: &mut Conn| c.ask(json!({"op": "workers"}))["workers"][0]["device_blocks"].as_u64();
    // The engine answers resync requests with its real state, until the
    // daemon's view matches it exactly.
    wait_for(
        || {
            let _ = a
                .serve_resync(|p| {
                    p.publish_cleared(None)?;
                    for chunk in held.chunks(40) {
                        p.publish_stored_hashes(Tier::Device, None, chunk)?;
                        // Paced, so the snapshot fits the small ring (if it
                        // does not, the daemon asks again).
                        std::thread::sleep(Duration::from_micros(20));
                    }
                    Ok(())
                })
                .unwrap();
            blocks(&mut c) == Some(held.len() as u64)
        },
        "the resynced view",
    );
    assert_eq!(blocks(&mut c), Some(held.len() as u64));
}

#[test]
fn rules_from_the_config_answer_with_the_rule_and_provider() {
    let d = start_with(
        "rules",
        "daemon:\n  heartbeat_timeout_ms: 600000\npolicy:\n  rules:\n    - name: to-cloud\n      matches: [{ tenant: burst }, { header.x-team: research }, { priority: { greaterThan: 5 } }]\n      route:\n        consider: [{ providers: {} }]\n        select: [{ type: Provider }]\n    - name: local\n      route:\n        select: [{ type: Local, minimize: PredictedTTFT }]\nproviders:\n  - { name: cloud, models: [llama], endpoint: 'https://cloud.example' }\n",
    );
    let mut a = engine(&d, 1);
    a.publish_load(&kvedge_schema::messages::Load::default())
        .unwrap();
    let mut c = Conn::connect(&d.query());
    let local = json!({"op": "select", "model": "llama", "tokens": [1, 2, 3], "dry_run": true});
    wait_for(|| c.ask(local.clone())["worker_id"] == 1, "the engine");
    let r = c.ask(local.clone());
    assert_eq!(r["rule"], "local");
    let burst = json!({"op": "select", "model": "llama", "tokens": [1, 2, 3], "tenant": "burst"});
    let r = c.ask(burst);
    assert_eq!(
        (r["rule"].as_str(), r["provider"].as_str()),
        (Some("to-cloud"), Some("cloud"))
    );
    assert_eq!(r["endpoint"], "https://cloud.example");
    assert!(r["worker_id"].is_null());
    let e = c.ask(json!({"op": "select", "model": "llama", "tokens": [1, 2, 3], "tenant": "burst", "dry_run": true, "explain": true}))["explain"].clone();
    assert_eq!(
        (
            e["tier"].as_u64(),
            e["considered"].as_u64(),
            e["after_exclude"].as_u64()
        ),
        (Some(0), Some(1), Some(1))
    );
    // The binary protocol carries the same context: tenant, a header, a
    // priority each send the request to the provider; none keeps it local.
    let mut w = kvedge_wire::Client::connect(d.dir.join("query.sock")).unwrap();
    let base = kvedge_wire::Select {
        dry_run: true,
        ..kvedge_wire::Select::new(
            "llama",
            kvedge_wire::Role::Aggregated,
            kvedge_wire::Ids::tokens(&[1, 2, 3]),
        )
    };
    let target = |w: &mut kvedge_wire::Client, q| {
        let r = w.select(&q).unwrap().unwrap();
        (r.provider, r.endpoint.to_owned())
    };
    assert_eq!(target(&mut w, base), (false, "http://engine-1".to_owned()));
    let cloud = (true, "https://cloud.example".to_owned());
    let burst = kvedge_wire::Select {
        tenant: Some("burst"),
        tags: kvedge_wire::Strs::new(&["pii-none", "len-short"]),
        ..base
    };
    assert_eq!(target(&mut w, burst), cloud);
    let team = kvedge_wire::Select {
        headers: kvedge_wire::Pairs::new(&[("X-Team", "research")]),
        ..base
    };
    assert_eq!(target(&mut w, team), cloud);
    let urgent = kvedge_wire::Select {
        priority: 9,
        ..base
    };
    assert_eq!(target(&mut w, urgent), cloud);
    // Malformed context: an error reply, and the connection keeps working.
    let (code, _) = w
        .raw(&{
            let mut f = Vec::new();
            kvedge_wire::binary::write_frame(&mut f, kvedge_wire::op::SELECT, |o| {
                o.extend_from_slice(&[4, 0]); // context follows
                o.extend_from_slice(&5u16.to_le_bytes());
                o.extend_from_slice(b"llama");
                o.extend_from_slice(&0u16.to_le_bytes());
                o.extend_from_slice(&0u32.to_le_bytes());
                o.extend_from_slice(&0u32.to_le_bytes());
                o.extend_from_slice(&1i32.to_le_bytes());
                o.extend_from_slice(&9u16.to_le_bytes()); // tenant of 9 bytes, 2 sent
                o.extend_from_slice(b"ab");
            });
            f
        })
        .unwrap();
    assert_eq!(
        kvedge_wire::Status::from_code(code),
        Some(kvedge_wire::Status::BadRequest)
    );
    assert_eq!(target(&mut w, base), (false, "http://engine-1".to_owned()));
    drop(a);
}

/// `kvedge publish` as worker 5 (`http://five`) of `d`, holding for `hold`
/// seconds.
fn publish(d: &Daemon, events: &std::path::Path, hold: &str) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args(["publish", "--worker-id", "5", "--model", "llama"])
        .args(["--endpoint", "http://five", "--hold", hold])
        .arg("--events")
        .arg(events)
        .arg("--runtime-dir")
        .arg(&d.dir)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn kvedge_publish_registers_publishes_and_leaves_when_killed() {
    let d = start("publish");
    let events = d.dir.join("events.jsonl");
    let tokens: Vec<u32> = (0..64).collect();
    std::fs::write(
        &events,
        format!(
            "{}\n{}\n{}\n",
            json!({"stored": {"tokens": tokens}}),
            json!({"stored": {"hashes": [11, 12], "tier": "host"}}),
            json!({"load": {"active_requests": 2, "kv_total_blocks": 100}}),
        ),
    )
    .unwrap();
    let mut publish = publish(&d, &events, "30");
    let mut c = Conn::connect(&d.query());
    let q = json!({"op": "select", "model": "llama", "tokens": tokens, "dry_run": true});
    wait_for(
        || c.ask(q.clone())["overlap_blocks"]["device"] == 4,
        "the published blocks",
    );
    let r = c.ask(q.clone());
    assert_eq!(
        (r["worker_id"].as_u64(), r["endpoint"].as_str()),
        (Some(5), Some("http://five"))
    );
    // The load record follows the blocks; it may land a turn later.
    wait_for(
        || c.ask(json!({"op": "workers"}))["workers"][0]["active_requests"] == 2,
        "the published load",
    );
    // SIGKILL: the kernel closes its control connection; its blocks stop
    // counting at once.
    publish.kill().unwrap();
    publish.wait().unwrap();
    let gone = wait_for(
        || c.ask(q.clone())["error"]["code"] == "no_worker",
        "the engine to leave",
    );
    assert!(gone < Duration::from_millis(100), "took {gone:?}");
    // A bad events file: a clear error naming the line.
    std::fs::write(
        &events,
        "{\"stored\": {\"tokens\": [1]}}\n{\"sotred\": {}}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args([
            "publish",
            "--worker-id",
            "6",
            "--model",
            "llama",
            "--events",
            events.to_str().unwrap(),
            "--hold",
            "0",
            "--runtime-dir",
            d.dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("events.jsonl:2: unknown variant `sotred`"),
        "{err}"
    );
}

#[test]
fn kvedge_publish_registers_again_when_the_daemon_restarts() {
    let mut d = start("publish-again");
    let events = d.dir.join("events.jsonl");
    let tokens: Vec<u32> = (0..64).collect();
    std::fs::write(
        &events,
        format!("{}\n", json!({"stored": {"tokens": tokens}})),
    )
    .unwrap();
    let mut publish = publish(&d, &events, "60");
    let q = json!({"op": "select", "model": "llama", "tokens": tokens, "dry_run": true});
    let blocks =
        |d: &Daemon| Conn::connect(&d.query()).ask(q.clone())["overlap_blocks"]["device"] == 4;
    wait_for(|| blocks(&d), "the published blocks");
    // The daemon goes away and a new one starts in the same place.
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    for sock in ["query.sock", "control.sock"] {
        let _ = std::fs::remove_file(d.dir.join(sock));
    }
    d.child = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .arg("run")
        .arg("--config")
        .arg(d.config())
        .arg("--runtime-dir")
        .arg(&d.dir)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let up = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(d.query()).is_err() {
        assert!(
            up.elapsed() < Duration::from_secs(10),
            "daemon did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let start = std::time::Instant::now();
    while !blocks(&d) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "kvedge publish did not register again"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    publish.kill().unwrap();
    publish.wait().unwrap();
}

#[test]
fn the_binary_protocol_answers_and_survives_bad_frames() {
    use kvedge_wire::{self as wire, Client as Wire, Status};
    let d = start("binary");
    let mut a = engine(&d, 1);
    let hashes = kvedge_schema::hash::sequence_hashes(&prompt(1, 256), 16, None, None);
    a.publish_stored_hashes(Tier::Device, None, &hashes)
        .unwrap();
    let mut w = Wire::connect(d.dir.join("query.sock")).unwrap();
    wait_for(
        || {
            w.select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 256, true)
                .unwrap()
                .is_ok_and(|r| r.overlap_blocks[0] == 16)
        },
        "the blocks",
    );
    let r = w
        .select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 256, false)
        .unwrap()
        .unwrap();
    assert_eq!(
        (r.worker_id, r.endpoint.as_str(), r.provider),
        (1, "http://engine-1", false)
    );
    assert_eq!(w.finish(r.request_id).unwrap(), Ok(()));
    assert_eq!(
        w.finish(r.request_id).unwrap().unwrap_err().0,
        Status::UnknownRequest
    );
    let err = w
        .select_hashes("nope", kvedge_wire::Role::Aggregated, &hashes, 256, true)
        .unwrap()
        .unwrap_err();
    assert_eq!(err.0, Status::NoWorker);

    // Bad frames: each gets its error, and the connection keeps working.
    let frame = |op: u16, version: u16, payload: &[u8]| {
        let mut out = Vec::new();
        let mut f = Vec::new();
        f.extend_from_slice(&op.to_le_bytes());
        f.extend_from_slice(&version.to_le_bytes());
        f.extend_from_slice(payload);
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(&f);
        out
    };
    let cases = [
        (frame(wire::op::SELECT, 9, &[]), Status::UnsupportedVersion),
        (frame(77, wire::VERSION, &[]), Status::UnknownOp),
        (
            frame(wire::op::SELECT, wire::VERSION, &[0, 0, 200, 0]),
            Status::BadRequest,
        ),
        (
            frame(wire::op::FINISH, wire::VERSION, &[1, 2, 3]),
            Status::BadRequest,
        ),
        (
            frame(
                wire::op::SELECT,
                wire::VERSION,
                &[0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            ),
            Status::BadRequest,
        ),
    ];
    for (bytes, expected) in cases {
        let (code, _) = w.raw(&bytes).unwrap();
        assert_eq!(Status::from_code(code), Some(expected));
        assert!(
            w.select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 256, true)
                .unwrap()
                .is_ok()
        );
    }
    // A giant length: that connection is answered and closed, others go on.
    let mut giant = Wire::connect(d.dir.join("query.sock")).unwrap();
    let (code, _) = giant.raw(&u32::MAX.to_le_bytes()).unwrap();
    assert_eq!(code, Status::FrameTooLarge.code());
    let mut json = Conn::connect(&d.query());
    assert_eq!(json.ask(json!({"op": "stats"}))["workers"], 1);
    assert!(
        w.select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 256, true)
            .unwrap()
            .is_ok()
    );
    drop(a);
}

#[test]
fn idle_clients_are_closed_and_max_workers_is_enforced() {
    let d = start_with(
        "limits",
        "daemon:\n  idle_timeout_ms: 200\n  max_workers: 1\n  heartbeat_timeout_ms: 600000\n",
    );
    let _a = engine(&d, 1);
    let refused = common::try_engine(&d.control(), 2, "llama").map(drop);
    let msg = refused.expect_err("a second worker is refused").to_string();
    assert!(
        msg.contains("no free worker slot (at most 1 workers)"),
        "{msg}"
    );
    let mut c = Conn::connect(&d.query());
    assert_eq!(c.ask(json!({"op": "stats"}))["workers"], 1);
    std::thread::sleep(Duration::from_millis(600));
    // The daemon closed the idle connection: the next read sees EOF.
    c.writer.write_all(b"{\"op\": \"stats\"}\n").ok();
    let mut line = String::new();
    let n = c.reader.read_line(&mut line).unwrap_or(0);
    assert_eq!(n, 0, "expected EOF, got {line}");
}

/// A raw query channel: the attach frame sent by hand, the descriptors
/// mapped, so a test can put anything into the request ring.
fn raw_channel(
    query: &std::path::Path,
) -> (
    std::os::unix::net::UnixStream,
    kvedge_shm::channel::ClientChannel,
) {
    use kvedge_shm::channel;
    use kvedge_wire::{self as wire, Status};
    let s = std::os::unix::net::UnixStream::connect(query).unwrap();
    let mut frame = wire::MAGIC.to_vec();
    wire::binary::write_frame(&mut frame, wire::op::ATTACH_RINGS, |_| {});
    (&s).write_all(&frame).unwrap();
    let mut reply = [0u8; 16]; // len 12 | status | version | capacity: u64
    let fds = channel::recv_with_fds(&s, &mut reply, false).unwrap();
    assert_eq!(u16::from_le_bytes([reply[4], reply[5]]), Status::Ok.code());
    (s, channel::ClientChannel::open(fds).unwrap())
}

/// Pushes one record into the request ring and waits for its reply
/// frame body.
fn ring_ask(ch: &mut kvedge_shm::channel::ClientChannel, kind: u16, body: &[u8]) -> Vec<u8> {
    ch.requests.try_push(kind, 0, body).unwrap();
    let mut reply = None;
    wait_for(
        || match ch.replies.poll().unwrap() {
            Some(r) => {
                assert_eq!(r.missing_before, 0);
                reply = Some(r.payload.to_vec());
                true
            }
            None => false,
        },
        "a reply in the reply ring",
    );
    reply.unwrap()
}

#[test]
fn query_channels_answer_like_the_socket_and_survive_bad_records() {
    use kvedge_shm::channel::FRAME;
    use kvedge_wire::{self as wire, Client as Wire, Status};
    let d = start_with(
        "rings",
        "daemon:\n  heartbeat_timeout_ms: 600000\n  max_query_rings: 2\n  query_ring_capacity: 4096\n",
    );
    let mut a = engine(&d, 1);
    let hashes = kvedge_schema::hash::sequence_hashes(&prompt(1, 256), 16, None, None);
    a.publish_stored_hashes(Tier::Device, None, &hashes)
        .unwrap();
    let mut socket = Wire::connect(d.query()).unwrap();
    let mut ring = Wire::connect(d.query()).unwrap();
    assert_eq!(ring.attach_rings().unwrap(), Ok(()));
    assert!(ring.rings_attached());
    wait_for(
        || {
            ring.select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 256, true)
                .unwrap()
                .is_ok_and(|r| r.overlap_blocks[0] == 16)
        },
        "the blocks, over the rings",
    );
    // The same answer both ways; a reservation made over the ring is
    // released over it too.
    let over_socket = socket
        .select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 256, true)
        .unwrap()
        .unwrap();
    let r = ring
        .select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 256, false)
        .unwrap()
        .unwrap();
    assert_eq!(
        (r.worker_id, &r.endpoint, r.overlap_blocks),
        (
            over_socket.worker_id,
            &over_socket.endpoint,
            over_socket.overlap_blocks
        )
    );
    // The daemon told the client which CPU its loop runs on: one the
    // daemon may run on (it inherited this process's CPUs).
    let cpu = ring.channel().unwrap().requests.consumer_cpu();
    let allowed = rustix::thread::sched_getaffinity(None).unwrap();
    assert!(
        cpu.is_some_and(|c| allowed.is_set(c)),
        "the loop's CPU: {cpu:?}"
    );
    let mut json = Conn::connect(&d.query());
    assert_eq!(json.ask(json!({"op": "stats"}))["reservations"], 1);
    assert_eq!(ring.finish(r.request_id).unwrap(), Ok(()));
    assert_eq!(
        ring.finish(r.request_id).unwrap().unwrap_err().0,
        Status::UnknownRequest
    );
    // A request larger than a quarter of the 4 KiB ring goes over the
    // socket, transparently.
    let long = kvedge_schema::hash::sequence_hashes(&prompt(1, 16 * 200), 16, None, None);
    let r = ring
        .select_hashes(
            "llama",
            kvedge_wire::Role::Aggregated,
            &long,
            16 * 200,
            true,
        )
        .unwrap()
        .unwrap();
    assert_eq!(r.overlap_blocks[0], 16);
    // A request that finds the loop asleep wakes it through the ring's
    // eventfd (the client then waits for the reply yielding its CPU), and
    // is answered like any other.
    let woken = ring.channel().unwrap().requests.wakes();
    wait_for(
        || {
            std::thread::sleep(Duration::from_millis(20));
            let r = ring
                .select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 256, true)
                .unwrap()
                .unwrap();
            assert_eq!((r.worker_id, r.overlap_blocks[0]), (1, 16));
            ring.channel().unwrap().requests.wakes() > woken
        },
        "a select that woke the sleeping loop",
    );

    // Bad records in a raw channel: each gets its error reply.
    let (raw_stream, mut raw) = raw_channel(&d.query());
    let body = |op: u16, version: u16, payload: &[u8]| {
        let mut f = op.to_le_bytes().to_vec();
        f.extend_from_slice(&version.to_le_bytes());
        f.extend_from_slice(payload);
        f
    };
    let code =
        |reply: Vec<u8>| Status::from_code(u16::from_le_bytes([reply[0], reply[1]])).unwrap();
    let cases = [
        (FRAME, vec![1u8], Status::BadRequest),
        (
            FRAME,
            body(wire::op::SELECT, 9, &[]),
            Status::UnsupportedVersion,
        ),
        (FRAME, body(77, wire::VERSION, &[]), Status::UnknownOp),
        (
            FRAME,
            body(wire::op::FINISH, wire::VERSION, &[1, 2]),
            Status::BadRequest,
        ),
        (
            FRAME,
            body(wire::op::ATTACH_RINGS, wire::VERSION, &[]),
            Status::RingsUnavailable,
        ),
        (
            7,
            body(wire::op::FINISH, wire::VERSION, &[0; 8]),
            Status::BadRequest,
        ),
    ];
    for (kind, bytes, expected) in cases {
        assert_eq!(code(ring_ask(&mut raw, kind, &bytes)), expected);
    }
    // A sleeping daemon is woken by the request ring's eventfd, not by its
    // 100 ms poll timeout: five requests, each pushed while the daemon is
    // seen asleep, take far less than the ~400 ms the timeouts would.
    let seg =
        kvedge_shm::segment::Segment::open(raw.requests.segment_fd().try_clone_to_owned().unwrap())
            .unwrap();
    let asleep = || {
        seg.header()
            .consumer_sleeping
            .0
            .load(std::sync::atomic::Ordering::Acquire)
            & kvedge_shm::layout::CONSUMER_SLEEPING
            != 0
    };
    let mut waited = Duration::ZERO;
    for _ in 0..5 {
        wait_for(asleep, "the daemon to sleep");
        let t = std::time::Instant::now();
        let reply = ring_ask(
            &mut raw,
            FRAME,
            &body(wire::op::FINISH, wire::VERSION, &[0; 8]),
        );
        waited += t.elapsed();
        assert_eq!(code(reply), Status::UnknownRequest);
    }
    assert!(
        waited < Duration::from_millis(250),
        "five wake-ups took {waited:?}"
    );

    // The limit (2 channels) is reached: a third connection is refused and
    // stays usable over the socket.
    let mut third = Wire::connect(d.query()).unwrap();
    let refused = third.attach_rings().unwrap().unwrap_err();
    assert_eq!(refused.0, Status::RingsUnavailable, "{}", refused.1);
    assert!(!third.rings_attached());
    assert!(
        third
            .select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 256, true)
            .unwrap()
            .is_ok()
    );

    // A request ring whose framing is broken (a misaligned tail): that
    // connection is closed, and nobody else notices.
    let seg =
        kvedge_shm::segment::Segment::open(raw.requests.segment_fd().try_clone_to_owned().unwrap())
            .unwrap();
    seg.header()
        .tail
        .0
        .store(7, std::sync::atomic::Ordering::Release);
    wait_for(
        || kvedge_shm::control::connection_closed(&raw_stream).unwrap_or(true),
        "the broken channel's connection to close",
    );
    assert!(
        ring.select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 256, true)
            .unwrap()
            .is_ok()
    );
    // Its slot is free again.
    assert_eq!(third.attach_rings().unwrap(), Ok(()));
    assert_eq!(
        json.ask(json!({"op": "stats"}))["query_channels"],
        2,
        "the ring client and the third"
    );
    let text = json.ask(json!({"op": "metrics"}))["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        text.lines().any(|l| l == "kvedge_query_channels 2"),
        "{text}"
    );

    // The daemon dies: a ring client waiting for a reply gets an error, it
    // does not hang.
    let mut d = d;
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let err = ring
        .select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 256, true)
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    drop(a);
}

#[test]
fn query_channels_can_be_turned_off() {
    use kvedge_wire::{Client as Wire, Status};
    let d = start_with("rings-off", "daemon:\n  max_query_rings: 0\n");
    let mut w = Wire::connect(d.query()).unwrap();
    let (code, message) = w.attach_rings().unwrap().unwrap_err();
    assert_eq!(code, Status::RingsUnavailable);
    assert!(message.contains("turned off"), "{message}");
    assert!(!w.rings_attached());
    // The connection goes on over the socket.
    let err = w
        .select_hashes("m", kvedge_wire::Role::Aggregated, &[1], 16, true)
        .unwrap()
        .unwrap_err();
    assert_eq!(err.0, Status::NoWorker);
}

/// CPU time (user and system) the process `pid` has used so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which ends at the last ')': state is
    // the first, utime and stime the 12th and 13th, in clock ticks.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<u64> = rest
        .split(' ')
        .skip(11)
        .take(2)
        .map(|f| f.parse().unwrap())
        .collect();
    let out = Command::new("getconf").arg("CLK_TCK").output().unwrap();
    let hz: u64 = String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    Duration::from_micros((fields[0] + fields[1]) * 1_000_000 / hz)
}

#[test]
fn between_engine_records_the_daemon_sleeps() {
    // Three engines publish a record each every 50 ms, so every record
    // comes while the loop sleeps and its ring's eventfd wakes it. A wake-up
    // left undrained would keep the eventfd readable and the loop from
    // sleeping again: the daemon would spend the whole second on the CPU.
    let d = start("sleeps");
    let mut engines: Vec<Publisher> = (1..=3).map(|id| engine(&d, id)).collect();
    wait_for(
        || common::ask(&d.query(), json!({"op": "stats"}))["workers"] == json!(3),
        "three engines",
    );
    let before = cpu_time(d.child.id());
    let start = std::time::Instant::now();
    for round in 0..20u64 {
        for (i, e) in engines.iter_mut().enumerate() {
            e.publish_stored_hashes(Tier::Device, None, &[round * 8 + i as u64 + 1])
                .unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let used = cpu_time(d.child.id()) - before;
    let wall = start.elapsed();
    assert!(
        used < wall / 4,
        "the daemon used {used:?} of CPU in {wall:?} of sparse engine records"
    );
    // And it saw every record.
    let blocks = common::ask(&d.query(), json!({"op": "stats"}))["index_entries"].clone();
    assert_eq!(blocks, json!(60), "{blocks}");
}
