//! What a clumsy user, a restart or a hung daemon meets, each against a
//! real daemon: classifiers' tags reaching the rules over every
//! transport, the runtime directory's mode under any umask, the command
//! line against a stopped daemon, a closed stdout and a refused uid, a
//! mock engine that outlives its daemon, and a hung engine replaced.

#![forbid(unsafe_code)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kvedge_schema::messages::Tier;
use serde_json::json;

fn kvedge() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvedge"))
}

const RULES: &str = "daemon:
  heartbeat_timeout_ms: 600000
policy:
  rules:
    - name: pii-stays-home
      matches: [{ tag: [pii-confirmed, pii-unknown] }]
      route:
        select: [{ type: Local, minimize: PredictedTTFT }]
    - name: long-prompts-to-cloud
      matches: [{ tag: complexity-high }]
      route:
        consider: [{ providers: {} }]
        select: [{ type: Provider }]
    - name: local
      route:
        select: [{ type: Local, minimize: PredictedTTFT }]
providers:
  - { name: cloud, models: [m], endpoint: 'https://cloud.example' }
classifiers:
  length: { low: 16, high: 48 }
  regex:
    patterns:
      pii: '\\b\\d{3}-\\d{2}-\\d{4}\\b'
";

#[test]
fn classifier_tags_reach_the_rules_over_json_and_binary() {
    let d = start("rel-tags", RULES);
    let _e = engine(&d.control(), 1, "m");
    let mut c = Conn::connect(&d.query());
    let ask = |c: &mut Conn, blocks: u64, text: Option<&str>| {
        let hashes: Vec<u64> = (1..=blocks).collect();
        let mut q = json!({"op": "select", "model": "m", "hashes": hashes, "dry_run": true});
        if let Some(t) = text {
            q["text"] = json!(t);
        }
        c.ask(q)
    };
    wait_for(|| ask(&mut c, 1, None)["worker_id"] == 1, "the engine");
    // Four blocks of 16 tokens: 64 >= high, so complexity-high.
    let long = ask(&mut c, 4, None);
    assert_eq!(
        (long["provider"].as_str(), long["rule"].as_str()),
        (Some("cloud"), Some("long-prompts-to-cloud")),
        "{long}"
    );
    let short = ask(&mut c, 1, None);
    assert_eq!(short["rule"], "local", "{short}");
    // The regex classifier reads the JSON text: a match keeps even a long
    // prompt home.
    let pii = ask(&mut c, 4, Some("my ssn is 123-45-6789"));
    assert_eq!(
        (pii["worker_id"].as_u64(), pii["rule"].as_str()),
        (Some(1), Some("pii-stays-home")),
        "{pii}"
    );
    let clean = ask(&mut c, 4, Some("no numbers here"));
    assert_eq!(clean["rule"], "long-prompts-to-cloud", "{clean}");
    // Over the binary protocol (no text), the length classifier decides.
    let mut b = kvedge_wire::Client::connect(d.query()).unwrap();
    let hashes: Vec<u64> = (1..=4).collect();
    let r = b
        .select_hashes("m", kvedge_wire::Role::Aggregated, &hashes, 0, true)
        .unwrap()
        .unwrap();
    assert!(r.provider, "a long prompt goes to the provider: {r:?}");
    let r = b
        .select_hashes("m", kvedge_wire::Role::Aggregated, &[1], 0, true)
        .unwrap()
        .unwrap();
    assert_eq!((r.provider, r.worker_id), (false, 1));
}

#[test]
fn the_runtime_directory_is_0750_whatever_the_umask_and_refused_if_foreign() {
    let base = temp_dir("rel-umask");
    let dir = base.join("run");
    std::fs::write(
        base.join("k.yaml"),
        "daemon:\n  heartbeat_timeout_ms: 600000\n",
    )
    .unwrap();
    // Started under umask 000 by a shell.
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 000; exec {} run --config {} --runtime-dir {}",
            env!("CARGO_BIN_EXE_kvedge"),
            base.join("k.yaml").display(),
            dir.display()
        ))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(dir.join("query.sock")).is_err() {
        assert!(Instant::now() < deadline, "daemon did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o7777;
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(mode, 0o750);
    // A directory of another user is refused (only root can make one).
    if rustix::process::geteuid().is_root() {
        let foreign = base.join("foreign");
        std::fs::create_dir(&foreign).unwrap();
        std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
        let out = kvedge()
            .args(["run", "--config"])
            .arg(base.join("k.yaml"))
            .arg("--runtime-dir")
            .arg(&foreign)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("belongs to uid 65534"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn the_cli_times_out_on_a_stopped_daemon_survives_a_closed_stdout_and_shows_refusals() {
    let d = start("rel-cli", "daemon:\n  heartbeat_timeout_ms: 600000\n");
    // stdout closed at once: no panic, no backtrace.
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{} stats --runtime-dir {} | head -c 0",
            env!("CARGO_BIN_EXE_kvedge"),
            d.dir.display()
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    // A stopped daemon: an answer within the timeout, not a hang.
    d.signal("STOP");
    let started = Instant::now();
    let out = kvedge()
        .args(["stats", "--timeout", "1", "--runtime-dir"])
        .arg(&d.dir)
        .output()
        .unwrap();
    d.signal("CONT");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no answer within"), "{err}");
    // A refused uid sees the daemon's refusal.
    let me = rustix::process::geteuid().as_raw();
    let d = start(
        "rel-refused",
        &format!(
            "daemon:\n  heartbeat_timeout_ms: 600000\n  query_allowed_uids: [{}]\n",
            me + 1
        ),
    );
    let out = kvedge()
        .args(["stats", "--runtime-dir"])
        .arg(&d.dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not_permitted"), "{err}");
}

#[test]
fn a_mock_engine_registers_again_after_the_daemon_restarts() {
    let yaml = "daemon:\n  heartbeat_timeout_ms: 600000\n";
    let d = start("rel-restart", yaml);
    let listen = d.dir.join("engine.sock");
    let mut engine = kvedge()
        .args([
            "mock-engine",
            "--worker-id",
            "4",
            "--model",
            "m",
            "--listen",
        ])
        .arg(&listen)
        .arg("--runtime-dir")
        .arg(&d.dir)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let workers = |dir: &std::path::Path| {
        ask(&dir.join("query.sock"), json!({"op": "stats"}))["workers"].clone()
    };
    wait_for(|| workers(&d.dir) == 1, "the engine");
    // The daemon is killed and started again in the same directory.
    let dir = d.dir.clone();
    let mut old = d;
    let _ = old.child.kill();
    let _ = old.child.wait();
    std::thread::sleep(Duration::from_millis(300));
    assert!(engine.try_wait().unwrap().is_none(), "the engine waits");
    let mut again = kvedge()
        .args(["run", "--config"])
        .arg(dir.join("kvedge.yaml"))
        .arg("--runtime-dir")
        .arg(&dir)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(std::os::unix::net::UnixStream::connect(dir.join("query.sock")).is_ok()
        && workers(&dir) == 1)
    {
        assert!(
            Instant::now() < deadline,
            "the engine did not register again"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = again.kill();
    let _ = again.wait();
    let _ = engine.kill();
    let out = engine.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("registered again"), "{err}");
    // `old` removes the directory on drop.
    drop(old);
}

#[test]
fn a_sigstopped_engine_is_replaced_by_its_restart_after_its_heartbeat() {
    let d = start("rel-hung", "daemon:\n  heartbeat_timeout_ms: 1500\n");
    let mut first = engine(&d.control(), 9, "m");
    first
        .publish_stored_hashes(Tier::Device, None, &[1])
        .unwrap();
    // While it beats, a second registration is a duplicate.
    let _ = first.heartbeat(0);
    assert!(try_engine(&d.control(), 9, "m").is_err());
    // It goes silent (hung); past its heartbeat a new one takes over.
    std::thread::sleep(Duration::from_millis(1800));
    let mut second = try_engine(&d.control(), 9, "m").expect("the restart registers");
    second
        .publish_stored_hashes(Tier::Device, None, &[2])
        .unwrap();
    let _ = second.heartbeat(0);
    let q = json!({"op": "select", "model": "m", "hashes": [2], "dry_run": true});
    wait_for(
        || ask(&d.query(), &q)["overlap_blocks"]["device"] == 1,
        "the new engine's blocks",
    );
    // The old connection was closed by the daemon.
    assert!(
        first.poll().is_err(),
        "the hung engine's connection is closed"
    );
}
