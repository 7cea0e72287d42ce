//! `kvedge sim` end to end: the same seed gives the same table; policies
//! that use the cache beat the ones that ignore it on a shared-prefix
//! workload; bad arguments fail with a message.

#![forbid(unsafe_code)]

use std::process::Command;

use serde_json::Value;

fn sim(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .arg("sim")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The rows without the router's wall-clock time, which is measured.
fn rows_without_timing(json: &str) -> Vec<Value> {
    let v: Value = serde_json::from_str(json).unwrap();
    v["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let mut r = r.clone();
            let o = r.as_object_mut().unwrap();
            o.remove("router_us_mean");
            o.remove("router_us_p99");
            r
        })
        .collect()
}

#[test]
fn same_seed_same_table() {
    let args = [
        "--requests",
        "400",
        "--workers",
        "4",
        "--json",
        "--policy",
        "default",
        "--policy",
        "random",
        "--policy",
        "soft-pin",
    ];
    let (code, a, err) = sim(&args);
    assert_eq!(code, 0, "{err}");
    let (_, b, _) = sim(&args);
    let (ra, rb) = (rows_without_timing(&a), rows_without_timing(&b));
    assert_eq!(ra.len(), 3);
    assert_eq!(ra, rb);
    // A different seed is a different workload.
    let mut other = args.to_vec();
    other.extend(["--seed", "9"]);
    let (_, c, _) = sim(&other);
    assert_ne!(rows_without_timing(&c), ra);
    // Every request ran to completion.
    for r in &ra {
        assert_eq!(r["requests"], 400);
        assert_eq!(r["unplaced"], 0);
        assert_eq!(r["refused"], 0);
    }
}

#[test]
fn cache_aware_routing_beats_round_robin_on_shared_prefixes() {
    let (code, out, err) = sim(&[
        "--requests",
        "1500",
        "--json",
        "--policy",
        "default",
        "--policy",
        "round-robin",
    ]);
    assert_eq!(code, 0, "{err}");
    let rows = rows_without_timing(&out);
    let (default, rr) = (&rows[0], &rows[1]);
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap();
    assert!(f(default, "hit_rate") > f(rr, "hit_rate") + 0.05, "{out}");
    assert!(f(default, "ttft_ms_p90") < f(rr, "ttft_ms_p90"), "{out}");
    assert!(f(default, "oracle_fraction") <= 1.0 + 1e-9);
    assert!(f(default, "load_imbalance") >= 1.0);
}

#[test]
fn bad_arguments_fail_with_a_message() {
    let (code, _, err) = sim(&["--policy", "nope"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("--policy nope: unknown policy (shipped: default,"),
        "{err}"
    );
    let (code, _, err) = sim(&["--workers", "0"]);
    assert_eq!(code, 1);
    assert!(err.contains("--workers must be 1..=64"), "{err}");
    let (code, _, err) = sim(&["--trace", "/nonexistent.jsonl"]);
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent.jsonl: No such file"), "{err}");
}

#[test]
fn plot_writes_png_charts() {
    let dir = std::env::temp_dir().join(format!("kvedge-plot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (code, _, err) = sim(&[
        "--requests",
        "200",
        "--workers",
        "2",
        "--policy",
        "default",
        "--policy",
        "round-robin",
        "--plot",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "hit_rate.png",
            "load-default.png",
            "load-round-robin.png",
            "ttft.png"
        ]
    );
    for n in &names {
        let bytes = std::fs::read(dir.join(n)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{n} is not a PNG");
        assert!(bytes.len() > 5_000, "{n} is nearly empty");
    }
    assert!(err.contains("wrote"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn no_shipped_policy_leaves_a_worker_without_traffic_on_a_4_worker_replay() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/mooncake/synthetic_trace.jsonl"
    );
    // Every shipped policy (no --policy: the presets).
    let (code, out, err) = sim(&["--trace", trace, "--workers", "4", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let rows = v["policies"].as_array().unwrap();
    assert!(rows.len() >= 8, "{out}");
    for r in rows {
        let per_worker: Vec<u64> = r["requests_per_worker"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .collect();
        assert_eq!(per_worker.len(), 4);
        assert!(
            per_worker.iter().all(|&n| n > 0),
            "{} left a worker without traffic: {per_worker:?}",
            r["policy"]
        );
    }
    // The table says so when it happens; here it must not.
    let (_, text, _) = sim(&["--trace", trace, "--workers", "4", "--limit", "500"]);
    assert!(!text.contains("sent no request"), "{text}");
}

#[test]
fn a_sweep_prints_ttft_per_policy_per_load_and_refuses_bad_loads() {
    let args = [
        "--requests",
        "300",
        "--workers",
        "2",
        "--policy",
        "default",
        "--policy",
        "predicted-ttft",
        "--sweep",
        "0.2,0.6",
    ];
    let (code, out, err) = sim(&args);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("| policy | 20% p50 | p90 | 60% p50 | p90 |"),
        "{out}"
    );
    for policy in ["default", "predicted-ttft"] {
        assert!(out.contains(&format!("| {policy} |")), "{out}");
    }
    // Each column's best is marked.
    assert!(out.matches('*').count() >= 4, "{out}");
    let (code, out, err) = sim(&[&args[..], &["--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    // The higher load replays the same requests faster: later arrivals
    // are squeezed, so TTFT does not fall.
    let p90 = |i: usize, policy: &str| {
        points[i]["policies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["policy"] == policy)
            .unwrap()["ttft_ms_p90"]
            .as_f64()
            .unwrap()
    };
    assert!(p90(1, "default") >= p90(0, "default"), "{out}");
    assert!(points[0]["time_scale"].as_f64().unwrap() > points[1]["time_scale"].as_f64().unwrap());
    for bad in ["--sweep=0", "--sweep=-1", "--sweep=x"] {
        let (code, _, err) = sim(&["--requests", "50", bad]);
        assert_ne!(code, 0, "--sweep {bad} was accepted");
        assert!(err.contains("sweep"), "{err}");
    }
}

#[test]
fn approximate_routing_learns_from_its_own_picks_and_trails_the_precise_index() {
    let (code, out, err) = sim(&[
        "--requests",
        "1500",
        "--json",
        "--approximate",
        "--policy",
        "cache-aware",
        "--policy",
        "round-robin",
    ]);
    assert_eq!(code, 0, "{err}");
    let rows = rows_without_timing(&out);
    let names: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "cache-aware",
            "cache-aware (approximate)",
            "round-robin",
            "round-robin (approximate)"
        ]
    );
    let hit = |i: usize| rows[i]["hit_rate"].as_f64().unwrap();
    // Knowing only where it sent earlier prefixes, the router still finds
    // the caches: far above round-robin, and near the precise index.
    assert!(hit(1) > hit(2) + 0.05, "{out}");
    assert!(hit(1) > hit(0) - 0.05, "{out}");
    // Round-robin looks at no prefix: the mode changes nothing for it.
    assert!((hit(2) - hit(3)).abs() < 1e-9, "{out}");
    // --approximate compares at one load.
    let (code, _, err) = sim(&["--approximate", "--sweep", "0.2"]);
    assert_ne!(code, 0);
    assert!(err.contains("--sweep"), "{err}");
}
