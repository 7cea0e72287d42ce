//! `kvedge top --once` against a real daemon with two `kvedge mock-engine`
//! processes: every worker's row and the totals show what the daemon
//! reports through `workers`, `stats` and `metrics`.

#![forbid(unsafe_code)]

mod common;

use std::process::{Child, Command, Stdio};

use common::{ask, start, wait_for};
use serde_json::{Value, json};

struct Engine(Child);

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn mock_engine(dir: &std::path::Path, worker: u64, model: &str) -> Engine {
    Engine(
        Command::new(env!("CARGO_BIN_EXE_kvedge"))
            .args([
                "mock-engine",
                "--worker-id",
                &worker.to_string(),
                "--model",
                model,
            ])
            .arg("--listen")
            .arg(dir.join(format!("engine-{worker}.sock")))
            .arg("--runtime-dir")
            .arg(dir)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn top(socket: &std::path::Path, extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .arg("top")
        .arg("--socket")
        .arg(socket)
        .args(["--once", "--interval-ms", "200"])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The cells of the row of `worker` (rank 0).
fn row(text: &str, worker: u64) -> Vec<&str> {
    text.lines()
        .find(|l| l.starts_with(&format!("{worker}/0 ")))
        .unwrap_or_else(|| panic!("no row for worker {worker}: {text}"))
        .split_whitespace()
        .collect()
}

#[test]
fn top_once_shows_every_worker_and_the_totals_the_daemon_reports() {
    let d = start("top", "{}");
    let q = d.query();
    let _a = mock_engine(&d.dir, 1, "llama");
    let _b = mock_engine(&d.dir, 2, "qwen");
    wait_for(
        || ask(&q, json!({"op": "stats"}))["workers"] == 2,
        "two engines",
    );
    // Three picks of worker 1, one of worker 2, a rejected select.
    for _ in 0..3 {
        let r = ask(
            &q,
            json!({"op": "select", "model": "llama", "tokens": (0..64).collect::<Vec<u32>>()}),
        );
        assert_eq!(r["worker_id"], 1, "{r}");
    }
    let r = ask(
        &q,
        json!({"op": "select", "model": "qwen", "tokens": (0..48).collect::<Vec<u32>>()}),
    );
    assert_eq!(r["worker_id"], 2, "{r}");
    let r = ask(
        &q,
        json!({"op": "select", "model": "mistral", "tokens": [1, 2, 3]}),
    );
    assert_eq!(r["error"]["code"], "no_worker", "{r}");

    let text = top(&q, &[]);
    let workers: Value = ask(&q, json!({"op": "workers"}));
    let header = text.lines().next().unwrap();
    assert!(header.contains("workers 2 (2 live)"), "{text}");
    assert!(header.contains("rejects: no_worker 1"), "{text}");
    let stats = ask(&q, json!({"op": "stats"}));
    let p50 = stats["select_latency"]["p50_us"].as_f64().unwrap();
    assert!(
        header.contains(&format!("decision p50 {p50:.0} µs")),
        "{header} / {stats}"
    );
    for w in workers["workers"].as_array().unwrap() {
        let id = w["worker_id"].as_u64().unwrap();
        let cells = row(&text, id);
        assert_eq!(cells[1], w["model"].as_str().unwrap(), "{text}");
        assert_eq!(cells[2], "live", "{text}");
        assert_eq!(cells[3], "ok", "{text}");
        assert_eq!(cells[4], w["waiting_requests"].to_string(), "{text}");
        assert_eq!(cells[5], w["active_requests"].to_string(), "{text}");
        let blocks = w["device_blocks"].to_string();
        assert!(cells.contains(&blocks.as_str()), "blocks {blocks}: {text}");
        let picks = w["picks"].as_u64().unwrap();
        assert_eq!(picks, if id == 1 { 3 } else { 1 });
        // Its picks found nothing cached: a hit rate of 0 over its blocks.
        assert_eq!(
            w["picked_prompt_blocks"],
            picks * if id == 1 { 4 } else { 3 }
        );
        assert!(text.contains("0.0 %"), "{text}");
    }
    // The recent decisions, newest first: the refusal, then the picks.
    let recent = text.split("recent decisions\n").nth(1).unwrap();
    let rows: Vec<Vec<&str>> = recent
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 5, "{recent}");
    assert_eq!(rows[0][2], "no_worker", "{recent}");
    assert_eq!(
        (rows[1][2], rows[1][3], rows[1][4]),
        ("ok", "2/0", "policy"),
        "{recent}"
    );
    assert_eq!(rows[1][7], "0/3", "cached/prompt blocks: {recent}");
    assert!(rows[2..].iter().all(|r| r[3] == "1/0"), "{recent}");
    // The same prompt three times: each pick saw the picks before it send
    // its deepest held block (the newest first); the other model's prompt
    // none.
    let sharers: Vec<&str> = rows[1..].iter().map(|r| r[8]).collect();
    assert_eq!(sharers, ["0", "2", "1", "0"], "{recent}");
    let d = ask(&q, json!({"op": "decisions"}));
    assert_eq!(d["decisions"][0]["outcome"], "no_worker", "{d}");
    // What that refusal saw, not what the pick before it did.
    assert_eq!(d["decisions"][0]["candidates"], 0, "{d}");
    assert_eq!(d["decisions"][1]["candidates"], 1, "{d}");
    assert_eq!(d["decisions"][1]["worker_id"], 2, "{d}");
    assert_eq!(d["decisions"][1]["stage"], "policy", "{d}");
    // Filtered and sorted.
    let only = top(&q, &["--model", "qwen", "--sort", "queue"]);
    assert!(only.lines().any(|l| l.starts_with("2/0 ")), "{only}");
    assert!(!only.lines().any(|l| l.starts_with("1/0 ")), "{only}");
}

#[test]
fn top_says_when_the_daemon_is_not_there() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args(["top", "--once", "--socket", "/nonexistent/query.sock"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("kvedge top: unreachable"), "{err}");
}
