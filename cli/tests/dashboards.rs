//! What operators import from `deploy/`: the Grafana dashboard and the
//! Prometheus alert rules query only metrics a running daemon exports
//! (checked against a live scrape of a daemon with an engine and the
//! endpoint picker on), and the rules pass `promtool check rules`.
//!
//! `promtool` comes from the Debian `prometheus` package (`.ci/run`
//! installs it). Without it the rules' metric names are still checked;
//! with `KVEDGE_REQUIRE_TOOLS` set (as in CI) its absence fails the test.

#![forbid(unsafe_code)]

mod common;

use std::collections::BTreeSet;
use std::process::Command;

use common::{ask, engine};
use kvedge_schema::messages::notice;
use serde_json::{Value, json};

const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/grafana/kvedge.json");
const ALERTS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/prometheus/alerts.yaml"
);

/// The metric families a daemon with an engine and the picker exports
/// (their `# TYPE` names: counters without `_total`).
fn exported() -> BTreeSet<String> {
    let (d, _) = common::start_with_picker("dashboards");
    // A family shows in the text once it has a series: a worker, a pick
    // and a notice make every one appear.
    let mut engine = engine(&d.control(), 3, "m");
    engine
        .publish_notice(notice::LOAD_UNREADABLE, 1, "connection refused")
        .unwrap();
    let r = ask(
        &d.query(),
        json!({"op": "select", "model": "m", "tokens": (0..64).collect::<Vec<u32>>()}),
    );
    assert_eq!(r["worker_id"], 3, "{r}");
    let mut text = String::new();
    common::wait_for(
        || {
            text = ask(&d.query(), json!({"op": "metrics"}))["text"]
                .as_str()
                .expect("the metrics text")
                .to_owned();
            text.contains("kvedge_worker_notices_active{")
        },
        "the engine's notice in the metrics",
    );
    assert!(
        text.contains("kvedge_worker_picks_total{"),
        "a worker's series: {text}"
    );
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// Every `kvedge_...` metric name in `text`.
fn names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("kvedge_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        out.insert(name);
    }
    out
}

/// The family a sample name belongs to, if the daemon exports it.
fn family<'a>(name: &str, exported: &'a BTreeSet<String>) -> Option<&'a String> {
    let base = ["_total", "_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
    exported.get(name).or_else(|| exported.get(base))
}

fn exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", Value::String(e)) => out.push(e.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

#[test]
fn the_dashboard_and_the_alerts_query_only_what_the_daemon_exports() {
    let exported = exported();
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap()).expect("valid JSON");
    let mut queries = Vec::new();
    exprs(&dashboard["panels"], &mut queries);
    assert!(queries.len() >= 40, "{} queries", queries.len());
    // Each panel queries something; each query names a kvedge metric.
    for p in dashboard["panels"].as_array().unwrap() {
        if p["type"] != "row" {
            assert!(
                p["targets"].as_array().is_some_and(|t| !t.is_empty()),
                "{p}"
            );
        }
    }
    let mut used = BTreeSet::new();
    for q in &queries {
        let n = names(q);
        assert!(!n.is_empty(), "a query of no kvedge metric: {q}");
        used.extend(n);
    }
    let alerts = std::fs::read_to_string(ALERTS).unwrap();
    let in_alerts = names(&alerts);
    assert!(in_alerts.len() >= 8, "{in_alerts:?}");
    used.extend(in_alerts);
    let unknown: Vec<&String> = used
        .iter()
        .filter(|n| family(n, &exported).is_none())
        .collect();
    assert!(
        unknown.is_empty(),
        "queried but not exported: {unknown:?}; exported: {exported:?}"
    );
    // The per-worker load, hit rate, sync and notice families are all on
    // the dashboard.
    for needed in [
        "kvedge_worker_picked_cached_blocks",
        "kvedge_worker_active_requests",
        "kvedge_worker_in_sync",
        "kvedge_worker_notices_active",
        "kvedge_index_evicted",
        "kvedge_selection_duration_seconds",
        "kvedge_epp_overloaded",
        "kvedge_epp_prompt_duration_seconds",
        "kvedge_epp_select_duration_seconds",
    ] {
        assert!(
            used.iter()
                .any(|u| family(u, &exported).is_some_and(|f| f == needed)),
            "{needed} is not on the dashboard"
        );
    }
}

#[test]
fn the_alert_rules_pass_promtool() {
    let promtool = std::env::var("KVEDGE_PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let out = match Command::new(&promtool)
        .args(["check", "rules", ALERTS])
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            assert!(
                std::env::var_os("KVEDGE_REQUIRE_TOOLS").is_none(),
                "{promtool}: {e} (install the prometheus package, or set KVEDGE_PROMTOOL)"
            );
            eprintln!(
                "skipped: no promtool ({e}); the rules' metric names are checked by the other test"
            );
            return;
        }
    };
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("SUCCESS: 9 rules found"));
}
