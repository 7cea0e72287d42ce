//! `kvedge demo` and the mock engines as real processes: the demo smoke test
//! (every request answered, dispatched and finished; nothing left behind)
//! and the soft-pin walkthrough (docs/policies.md) with two mock engines.

#![forbid(unsafe_code)]

mod common;

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use common::{Conn, wait_for};
use serde_json::{Value, json};

#[test]
fn demo_with_two_engines_and_200_requests_answers_everything_and_cleans_up() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args([
            "demo",
            "--engines",
            "2",
            "--requests",
            "200",
            "--speed",
            "8",
        ])
        .arg("--json")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in [
        "answered",
        "dispatched",
        "first_tokens",
        "finished",
        "released",
    ] {
        assert_eq!(v[key], 200, "{key}: {v}");
    }
    assert_eq!(v["errors"], 0);
    assert_eq!(v["daemon"]["selects"], 200);
    assert_eq!(v["daemon"]["reservations"], 0, "every reservation released");
    assert_eq!(v["summary"]["requests"], 200);
    let hit = v["summary"]["hit_rate"].as_f64().unwrap();
    assert!(
        hit > 0.3,
        "shared prefixes and sessions hit the cache: {hit}"
    );
    // Nothing left behind: the daemon and engines exited, the runtime
    // directory (sockets, logs, config) is gone. Rings are sealed memfds,
    // which die with their processes.
    let dir = PathBuf::from(v["runtime_dir"].as_str().unwrap());
    assert!(!dir.exists(), "{} left behind", dir.display());
    let pids = v["pids"].as_array().unwrap();
    assert_eq!(pids.len(), 3);
    for pid in pids {
        let proc = PathBuf::from(format!("/proc/{}", pid.as_u64().unwrap()));
        assert!(!proc.exists(), "process {pid} still exists");
    }
}

/// The same workload through vLLM-style engines: ZeroMQ events and
/// Prometheus load, read by the daemon's bridge; the cache still hits,
/// which it can only do if kvedge's hashes of the published token ids
/// match the frontend's.
#[test]
fn demo_with_vllm_engines_runs_the_bridge_path() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args([
            "demo",
            "--engines",
            "vllm:2",
            "--requests",
            "200",
            "--speed",
            "8",
            "--json",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["finished"], 200, "{v}");
    assert_eq!(v["errors"], 0);
    assert_eq!(v["daemon"]["reservations"], 0);
    let hit = v["summary"]["hit_rate"].as_f64().unwrap();
    assert!(hit > 0.3, "kvedge sees the engines' blocks: {hit}");
}

struct Node {
    dir: PathBuf,
    children: Vec<Child>,
}

impl Drop for Node {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Seed 000's walkthrough: soft session affinity with the `soft-pin`
/// policy (threshold 0 active requests). The first request is held open on
/// A; the second, same session, finds A overloaded and goes to B, which
/// rebinds the session; after everything drained the third stays on B.
#[test]
fn soft_pin_walkthrough_with_two_mock_engines_goes_a_b_b() {
    let dir = std::env::temp_dir().join(format!("kvedge-softpin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut node = Node {
        dir: dir.clone(),
        children: vec![],
    };
    let config = dir.join("kvedge.yaml");
    std::fs::write(
        &config,
        "session_affinity:\n  mode: soft\nworker_selection:\n  aggregated: pin\n  instances:\n    - name: pin\n      type: soft-pin\n      parameters:\n        max_active_requests: 0\n",
    )
    .unwrap();
    let run = dir.join("run");
    node.children.push(
        Command::new(env!("CARGO_BIN_EXE_kvedge"))
            .arg("run")
            .arg("--config")
            .arg(&config)
            .arg("--runtime-dir")
            .arg(&run)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(
        || UnixStream::connect(run.join("query.sock")).is_ok(),
        "the daemon",
    );
    for id in [1, 2] {
        node.children.push(
            Command::new(env!("CARGO_BIN_EXE_kvedge"))
                .args([
                    "mock-engine",
                    "--worker-id",
                    &id.to_string(),
                    "--model",
                    "m",
                ])
                .arg("--listen")
                .arg(dir.join(format!("engine-{id}.sock")))
                .arg("--runtime-dir")
                .arg(&run)
                .args(["--speed", "4"])
                .spawn()
                .unwrap(),
        );
    }
    let mut q = Conn::connect(&run.join("query.sock"));
    wait_for(
        || {
            q.ask(json!({"op": "workers"}))["workers"]
                .as_array()
                .is_some_and(|w| w.len() == 2)
        },
        "two engines",
    );
    let mut engines: Vec<Conn> = [1, 2]
        .iter()
        .map(|id| {
            let p = dir.join(format!("engine-{id}.sock"));
            wait_for(|| p.exists(), "the engine socket");
            Conn::connect(&p)
        })
        .collect();
    let tokens: Vec<u32> = (0..256).collect();
    let hashes = kvedge_schema::hash::sequence_hashes(&tokens, 16, None, None);
    let select = |q: &mut Conn| -> (u64, u64) {
        let r = q.ask(json!({"op": "select", "model": "m", "hashes": hashes,
            "prompt_tokens": 256, "session": "conversation-1"}));
        (
            r["worker_id"].as_u64().unwrap(),
            r["request_id"].as_u64().unwrap(),
        )
    };
    let dispatch = |engines: &mut [Conn], worker: u64, id: u64, output: u32| {
        engines[worker as usize - 1].send(json!({"id": id, "hashes": hashes,
            "prompt_tokens": 256, "output_tokens": output}));
    };
    let mut sequence = Vec::new();

    // 1: held open (a long answer).
    let (a, r1) = select(&mut q);
    sequence.push(a);
    dispatch(&mut engines, a, 1, 4_000);
    // 2: A has one active request (> 0): moved to the least-loaded worker.
    let (b, r2) = select(&mut q);
    sequence.push(b);
    dispatch(&mut engines, b, 2, 1);
    let e2 = &mut engines[b as usize - 1];
    assert_eq!(e2.recv()["event"], "first_token");
    assert_eq!(
        q.ask(json!({"op": "prefill_done", "request_id": r2}))["ok"],
        true
    );
    assert_eq!(e2.recv()["event"], "finished");
    assert_eq!(q.ask(json!({"op": "finish", "request_id": r2}))["ok"], true);
    // Drain 1 as well: both workers idle.
    let e1 = &mut engines[a as usize - 1];
    assert_eq!(e1.recv()["event"], "first_token");
    assert_eq!(e1.recv()["event"], "finished");
    assert_eq!(q.ask(json!({"op": "finish", "request_id": r1}))["ok"], true);
    wait_for(
        || {
            q.ask(json!({"op": "workers"}))["workers"]
                .as_array()
                .unwrap()
                .iter()
                .all(|w| w["active_requests"] == 0)
        },
        "the load to drain",
    );
    // 3: no overload anywhere; the session's binding says B.
    let (c, _) = select(&mut q);
    sequence.push(c);
    assert_ne!(a, b);
    assert_eq!(sequence, vec![a, b, b], "A -> B -> B");
}
