//! The stand-in for a vLLM engine (`fixtures/fake_vllm.py`: pyzmq,
//! msgspec and prometheus_client, following vLLM's publisher on the wire)
//! and what the engine tests ask the daemon about it.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::Conn;

/// The fixture process: commands on stdin, `ok` on stdout.
pub struct FakeEngine {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub ports: Value,
}

impl FakeEngine {
    pub fn spawn(args: &[&str]) -> FakeEngine {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/fake_vllm.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect(
                "python3 (with pyzmq, msgspec and prometheus_client) is needed for these tests",
            );
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let ports: Value = serde_json::from_str(&line).unwrap_or_else(|_| {
            panic!("the fake engine did not start (missing pyzmq, msgspec or prometheus_client?): {line:?}")
        });
        FakeEngine {
            child,
            stdin,
            stdout,
            ports,
        }
    }

    pub fn port(&self, which: &str) -> u64 {
        self.ports[which].as_u64().unwrap()
    }

    pub fn send(&mut self, cmd: Value) {
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ok", "fake engine answered {line:?} to {cmd}");
    }
}

impl FakeEngine {
    /// Publishes one block of `t` (16 tokens) as engine hash `h`.
    pub fn store(&mut self, h: u64, t: &[u32]) {
        self.send(json!({"op": "stored", "hashes": [h], "parent": null, "tokens": t}));
    }
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn tokens(from: u32, to: u32) -> Vec<u32> {
    (from..to).collect()
}

pub fn wait(mut cond: impl FnMut() -> bool, what: &str) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `cond` while the engine publishes a harmless batch every half
/// second: delivery is at most once, and a first batch sent while the
/// subscription is still on its way is lost; the next one shows the gap,
/// which the replay socket fills.
pub fn wait_nudging(e: &mut FakeEngine, mut cond: impl FnMut() -> bool, what: &str) {
    let start = Instant::now();
    let mut nudged = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        if nudged.elapsed() > Duration::from_millis(500) {
            e.send(json!({"op": "removed", "hashes": [424242]}));
            nudged = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The device blocks of `t` (model `llama`) the index holds.
pub fn overlap(c: &mut Conn, t: &[u32]) -> u64 {
    let r = c.ask(json!({"op": "select", "model": "llama", "tokens": t, "dry_run": true}));
    r["overlap_blocks"]["device"].as_u64().unwrap_or(0)
}

pub fn worker(c: &mut Conn, id: u64) -> Value {
    let w = c.ask(json!({"op": "workers"}));
    w["workers"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["worker_id"] == id).cloned())
        .unwrap_or(Value::Null)
}

pub fn notice(row: &Value, code: &str) -> u64 {
    row["notices"]
        .as_array()
        .and_then(|n| n.iter().find(|n| n["code"] == code))
        .and_then(|n| n["count"].as_u64())
        .unwrap_or(0)
}
