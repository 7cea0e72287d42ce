//! `kvedge run` as a systemd service: the unit files verify clean and are
//! hardened, sd_notify messages reach a NOTIFY_SOCKET passed to the child,
//! socket activation with `systemd-socket-activate`, SIGHUP reloads, SIGTERM
//! drains and exits 0.

#![forbid(unsafe_code)]

mod common;

use std::io::Write;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Conn, Daemon, ask, engine, start, temp_dir};
use serde_json::{Value, json};

const UNITS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/systemd");

/// Whether a systemd tool is here; CI installs and requires them
/// (KVEDGE_REQUIRE_TOOLS).
fn have(tool: &str) -> bool {
    let ok = Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("KVEDGE_REQUIRE_TOOLS").is_none(),
            "{tool} is required (KVEDGE_REQUIRE_TOOLS is set) but missing"
        );
        eprintln!("{tool} not installed: skipped (CI installs and requires it)");
    }
    ok
}

/// The units as shipped, with `/usr/bin/kvedge` pointed at the binary
/// under test (verify checks that ExecStart is executable).
fn units_for_test(dir: &Path) -> (PathBuf, PathBuf) {
    let service = std::fs::read_to_string(format!("{UNITS}/kvedge.service"))
        .unwrap()
        .replace("/usr/bin/kvedge", env!("CARGO_BIN_EXE_kvedge"));
    let s = dir.join("kvedge.service");
    std::fs::write(&s, service).unwrap();
    let k = dir.join("kvedge.socket");
    std::fs::copy(format!("{UNITS}/kvedge.socket"), &k).unwrap();
    (s, k)
}

#[test]
fn units_verify_clean_and_exposure_is_at_most_3() {
    if !have("systemd-analyze") {
        return;
    }
    let dir = temp_dir("units");
    let (service, socket) = units_for_test(&dir);
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no", "--generators=no"])
        .arg(&service)
        .arg(&socket)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "",
        "systemd-analyze verify warned"
    );
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(&service)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| panic!("no exposure line in:\n{text}"));
    let exposure: f64 = line
        .split(':')
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("cannot read `{line}`"));
    assert!(exposure <= 3.0, "{line}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Receives notify datagrams until one contains `what`.
fn expect_notify(sock: &UnixDatagram, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = [0u8; 4096];
    loop {
        assert!(Instant::now() < deadline, "no `{what}` from the daemon");
        if let Ok(n) = sock.recv(&mut buf) {
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            if msg.lines().any(|l| l == what || l.starts_with(what)) {
                return msg;
            }
        }
    }
}

#[test]
fn sd_notify_ready_watchdog_reload_and_stopping() {
    let dir = temp_dir("notify");
    let notify_path = dir.join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let config = dir.join("kvedge.yaml");
    std::fs::write(&config, "worker_selection:\n  aggregated: default\n").unwrap();
    let run = dir.join("run");
    // The child alone gets NOTIFY_SOCKET and a 200 ms watchdog; this
    // process's environment is not touched.
    let child = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .arg("run")
        .arg("--config")
        .arg(&config)
        .arg("--runtime-dir")
        .arg(&run)
        .env("NOTIFY_SOCKET", &notify_path)
        .env("WATCHDOG_USEC", "200000")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut d = Daemon {
        child,
        dir: dir.clone(),
    };
    let ready = expect_notify(&notify, "READY=1");
    assert!(ready.contains("STATUS=0 workers"), "{ready}");
    // The sockets are up when READY=1 arrives.
    assert_eq!(
        ask(&run.join("query.sock"), json!({"op": "stats"}))["workers"],
        0
    );
    expect_notify(&notify, "WATCHDOG=1");

    // A valid new configuration: RELOADING=1 with MONOTONIC_USEC, READY=1.
    std::fs::write(
        &config,
        "worker_selection:\n  aggregated: rr\n  instances:\n    - name: rr\n      type: round-robin\n",
    )
    .unwrap();
    d.signal("HUP");
    let reloading = expect_notify(&notify, "RELOADING=1");
    assert!(reloading.contains("MONOTONIC_USEC="), "{reloading}");
    expect_notify(&notify, "READY=1");
    let stats = ask(&run.join("query.sock"), json!({"op": "stats"}));
    assert_eq!(
        (stats["reloads"].as_u64(), stats["reload_failures"].as_u64()),
        (Some(1), Some(0))
    );

    // An invalid one: refused, READY=1 again, the old one serves on.
    std::fs::write(&config, "worker_selection:\n  aggregated: nope\n").unwrap();
    d.signal("HUP");
    expect_notify(&notify, "RELOADING=1");
    expect_notify(&notify, "READY=1");
    let stats = ask(&run.join("query.sock"), json!({"op": "stats"}));
    assert_eq!(
        (stats["reloads"].as_u64(), stats["reload_failures"].as_u64()),
        (Some(1), Some(1))
    );
    // The same through `kvedge reload`: an error with the loader's message.
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args(["reload", "--json", "--runtime-dir"])
        .arg(&run)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let reply: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reply["error"]["code"], "reload_failed");
    assert!(
        reply["error"]["message"].as_str().unwrap().contains("nope"),
        "{reply}"
    );

    // SIGTERM: STOPPING=1, exit 0, sockets removed.
    d.signal("TERM");
    expect_notify(&notify, "STOPPING=1");
    let status = d.child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(!run.join("query.sock").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn socket_activation_with_systemd_socket_activate() {
    if !have("systemd-socket-activate") {
        return;
    }
    let dir = temp_dir("activate");
    let config = dir.join("kvedge.yaml");
    std::fs::write(&config, "daemon:\n  heartbeat_timeout_ms: 600000\n").unwrap();
    let (control, query) = (dir.join("control.sock"), dir.join("query.sock"));
    // systemd-socket-activate binds both sockets, waits for the first
    // connection, then runs the daemon with LISTEN_FDS=2 and the names.
    let child = Command::new("systemd-socket-activate")
        .arg("-l")
        .arg(&control)
        .arg("-l")
        .arg(&query)
        .arg("--fdname=control:query")
        .arg(env!("CARGO_BIN_EXE_kvedge"))
        .arg("run")
        .arg("--config")
        .arg(&config)
        .arg("--runtime-dir")
        .arg(dir.join("unused"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let guard = Daemon {
        child,
        dir: dir.clone(),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !query.exists() {
        assert!(Instant::now() < deadline, "no socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The first query starts the daemon and is answered by it.
    let stats = ask(&query, json!({"op": "stats"}));
    assert_eq!(stats["workers"], 0, "{stats}");
    // An engine registers on the passed control socket and is routed to.
    let _engine = engine(&control, 3, "m");
    let r = ask(
        &query,
        json!({"op": "select", "model": "m", "hashes": [1, 2], "dry_run": true}),
    );
    assert_eq!(r["worker_id"], 3, "{r}");
    // The daemon did not bind in its --runtime-dir: it used what it was given.
    assert!(!dir.join("unused/query.sock").exists());
    drop(guard);
    let _ = std::fs::remove_dir_all(&dir);
}

const POLICY_A: &str = "daemon:\n  heartbeat_timeout_ms: 600000\nworker_selection:\n  aggregated: a\n  instances:\n    - name: a\n      type: least-busy\n      parameters: { min_device_overlap_blocks: 0 }\n";
const POLICY_B: &str = "daemon:\n  heartbeat_timeout_ms: 600000\nworker_selection:\n  aggregated: b\n  instances:\n    - name: b\n      type: round-robin\n";

#[test]
fn reload_under_continuous_load_loses_no_request() {
    let d = start("reload", POLICY_A);
    let run = d.dir.clone();
    let _engines = [engine(&d.control(), 1, "m"), engine(&d.control(), 2, "m")];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (run, stop) = (run.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut c = Conn::connect(&run.join("query.sock"));
                let (mut answered, mut policies) = (0u64, std::collections::BTreeSet::new());
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = c.ask(json!({"op": "select", "model": "m", "hashes": [1, 2, 3]}));
                    let id = r["request_id"]
                        .as_u64()
                        .unwrap_or_else(|| panic!("select failed: {r}"));
                    policies.insert(r["policy"].as_str().unwrap().to_owned());
                    let f = c.ask(json!({"op": "finish", "request_id": id}));
                    assert_eq!(f["ok"], true, "{f}");
                    answered += 1;
                }
                (answered, policies)
            })
        })
        .collect();
    let config = d.config();
    let (mut good, mut bad) = (0, 0);
    for i in 0..20 {
        std::thread::sleep(Duration::from_millis(15));
        let yaml = match i {
            7 | 13 => {
                bad += 1;
                "worker_selection:\n  aggregated: missing\n"
            }
            i if i % 2 == 0 => POLICY_B,
            _ => POLICY_A,
        };
        std::fs::write(&config, yaml).unwrap();
        if i % 3 == 0 {
            d.signal("HUP");
        } else {
            let _ = Command::new(env!("CARGO_BIN_EXE_kvedge"))
                .args(["reload", "--runtime-dir"])
                .arg(&run)
                .output()
                .unwrap();
        }
        if !matches!(i, 7 | 13) {
            good += 1;
        }
        // Let this reload land before the next file is written.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let s = ask(&run.join("query.sock"), json!({"op": "stats"}));
            if s["reloads"].as_u64() == Some(good) && s["reload_failures"].as_u64() == Some(bad) {
                break;
            }
            assert!(Instant::now() < deadline, "reload {i} did not land: {s}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    std::thread::sleep(Duration::from_millis(20));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    let mut seen = std::collections::BTreeSet::new();
    for c in clients {
        let (n, p) = c.join().unwrap();
        total += n;
        seen.extend(p);
    }
    assert!(total > 100, "only {total} selects ran during the reloads");
    // Both policies served, each swap between two requests.
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), ["a", "b"]);
    let s = ask(&run.join("query.sock"), json!({"op": "stats"}));
    // The only error replies were the two refused reloads.
    assert_eq!(s["errors"], bad, "{s}");
    assert_eq!(
        s["reservations"], 0,
        "reservations survived the reloads: {s}"
    );
}

#[test]
fn prometheus_metrics_over_the_socket_and_http() {
    // A free loopback port for the HTTP listener.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let d = start(
        "metrics",
        &format!("daemon:\n  heartbeat_timeout_ms: 600000\nmetrics:\n  listen: 127.0.0.1:{port}\n"),
    );
    let run = d.dir.clone();
    let mut e = engine(&d.control(), 6, "m");
    e.publish_stored_hashes(kvedge_schema::Tier::Device, None, &[1, 2, 3])
        .unwrap();
    let q = run.join("query.sock");
    let deadline = Instant::now() + Duration::from_secs(5);
    while ask(
        &q,
        json!({"op": "select", "model": "m", "hashes": [1, 2, 3], "dry_run": true}),
    )["overlap_blocks"]["device"]
        != 3
    {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = ask(&q, json!({"op": "select", "model": "nope", "hashes": [1]}));
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args(["stats", "--prometheus", "--runtime-dir"])
        .arg(&run)
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let has = |text: &str, prefix: &str| text.lines().any(|l| l.starts_with(prefix));
    for line in [
        "kvedge_selections_total{policy=\"default\",rule=\"\",outcome=\"ok\"} ",
        "kvedge_selections_total{policy=\"default\",rule=\"\",outcome=\"no_worker\"} 1",
        "kvedge_ring_events_applied_total{kind=\"stored\"} 1",
        "kvedge_index_entries 3",
        "kvedge_workers_live 1",
        "kvedge_worker_device_blocks{worker_id=\"6\",dp_rank=\"0\",model=\"m\"} 3",
        "kvedge_selection_duration_seconds_count ",
        "# EOF",
    ] {
        assert!(has(&text, line), "no `{line}` in:\n{text}");
    }
    // The HTTP listener serves the same families (refreshed each second).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut body = String::new();
        std::io::Read::read_to_string(&mut s, &mut body).unwrap();
        assert!(body.starts_with("HTTP/1.0 200 OK"), "{body}");
        if has(&body, "kvedge_index_entries 3") {
            break;
        }
        assert!(Instant::now() < deadline, "{body}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn sigterm_answers_what_clients_already_sent_then_exits_0() {
    let mut d = start("drain", "daemon:\n  heartbeat_timeout_ms: 600000\n");
    let _e = engine(&d.control(), 1, "m");
    let mut c = Conn::connect(&d.query());
    // Let the engine register, then pipeline 200 requests in one write
    // and signal at once.
    assert_eq!(c.ask(json!({"op": "stats"}))["workers"], 1);
    let mut burst = String::new();
    for _ in 0..200 {
        burst.push_str(
            &json!({"op": "select", "model": "m", "hashes": [1, 2], "dry_run": true}).to_string(),
        );
        burst.push('\n');
    }
    c.writer.write_all(burst.as_bytes()).unwrap();
    d.signal("TERM");
    for i in 0..200 {
        let r = c.recv();
        assert_eq!(r["worker_id"], 1, "reply {i}: {r}");
    }
    assert_eq!(d.child.wait().unwrap().code(), Some(0));
}
