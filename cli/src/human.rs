//! Renders the daemon's JSON replies for people: what `kvedge query`,
//! `kvedge workers` and `kvedge stats` print without `--json`. Scripts
//! should use `--json`; this layout may change.

use serde_json::Value;
use std::fmt::Write;

/// The text for `reply`, the daemon's answer to a request of `op`.
pub fn render(op: &str, reply: &Value) -> String {
    let mut out = String::new();
    match op {
        "select" => select(&mut out, reply),
        "workers" => workers(&mut out, reply),
        "stats" => stats(&mut out, reply),
        _ => out.push_str("ok\n"),
    }
    out
}

/// A JSON value as a table cell: strings bare, null and empty as `-`.
pub(crate) fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) if s.is_empty() => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn select(out: &mut String, r: &Value) {
    let target = if r["worker_id"].is_null() {
        format!("provider {}", text(&r["provider"]))
    } else {
        format!(
            "worker {} (dp rank {})",
            text(&r["worker_id"]),
            text(&r["dp_rank"])
        )
    };
    let o = &r["overlap_blocks"];
    let _ = writeln!(out, "{target} at {}", text(&r["endpoint"]));
    let _ = writeln!(
        out,
        "overlap blocks: device {}, host {}, disk {}",
        text(&o["device"]),
        text(&o["host"]),
        text(&o["disk"])
    );
    let _ = writeln!(
        out,
        "cost {}  policy {}  rule {}  request id {}",
        text(&r["cost"]),
        text(&r["policy"]),
        text(&r["rule"]),
        text(&r["request_id"])
    );
    let e = &r["explain"];
    if !e.is_null() {
        let _ = writeln!(
            out,
            "candidates {}, survivors {}, tier {}, considered {}, after exclude {}, fell through {}, prefix sharers {}",
            text(&e["candidates"]),
            text(&e["survivors"]),
            text(&e["tier"]),
            text(&e["considered"]),
            text(&e["after_exclude"]),
            text(&e["fell_through"]),
            text(&e["prefix_sharers"])
        );
        let _ = writeln!(
            out,
            "{:>10} {:>4} {:>10} {:>8} {:>6} {:>6} {:>8} {:>14} {:>8} {:>10} {:>10} {:>8} {:>10} {:>9}",
            "worker",
            "dp",
            "cost",
            "device",
            "host",
            "disk",
            "active",
            "prefill tokens",
            "recent",
            "ttft ms",
            "queue ms",
            "own ms",
            "tokens/s",
            "speed"
        );
        for w in e["workers"].as_array().into_iter().flatten() {
            let o = &w["overlap_blocks"];
            let cost = w["cost"]
                .as_f64()
                .map_or_else(|| "-".to_owned(), |c| format!("{c:.3}"));
            let t = &w["ttft"];
            let ms = |v: &Value| {
                v.as_f64()
                    .map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"))
            };
            let _ = writeln!(
                out,
                "{:>10} {:>4} {:>10} {:>8} {:>6} {:>6} {:>8} {:>14} {:>8} {:>10} {:>10} {:>8} {:>10} {:>9}",
                text(&w["worker_id"]),
                text(&w["dp_rank"]),
                cost,
                text(&o["device"]),
                text(&o["host"]),
                text(&o["disk"]),
                text(&w["active_requests"]),
                text(&w["active_prefill_tokens"]),
                ms(&w["recent_selections"]),
                ms(&t["total_ms"]),
                ms(&t["queue_ms"]),
                ms(&t["prefill_ms"]),
                t["tokens_per_second"]
                    .as_f64()
                    .map_or_else(|| "-".to_owned(), |x| format!("{x:.0}")),
                text(&t["speed"])
            );
        }
    }
}

fn workers(out: &mut String, r: &Value) {
    let list = r["workers"].as_array().map_or(&[][..], Vec::as_slice);
    if list.is_empty() {
        out.push_str("no workers registered\n");
        return;
    }
    let _ = writeln!(
        out,
        "{:>10} {:>4} {:<16} {:<10} {:<9} {:>13} {:>8} {:>14}  endpoint",
        "worker", "dp", "model", "role", "available", "device blocks", "active", "prefill tokens"
    );
    for w in list {
        let _ = writeln!(
            out,
            "{:>10} {:>4} {:<16} {:<10} {:<9} {:>13} {:>8} {:>14}  {}",
            text(&w["worker_id"]),
            text(&w["dp_rank"]),
            text(&w["model"]),
            text(&w["role"]),
            text(&w["available"]),
            text(&w["device_blocks"]),
            text(&w["active_requests"]),
            text(&w["active_prefill_tokens"]),
            text(&w["endpoint"])
        );
        if w["state"].as_str().is_some_and(|s| s != "live") {
            let _ = writeln!(out, "{:>15} state: {}", "", text(&w["state"]));
        }
        for n in w["notices"].as_array().map_or(&[][..], Vec::as_slice) {
            let over = if n["active"] == false { ", over" } else { "" };
            let _ = writeln!(
                out,
                "{:>15} {} ({}x{over}): {}",
                "",
                text(&n["code"]),
                text(&n["count"]),
                text(&n["message"])
            );
        }
    }
}

fn stats(out: &mut String, r: &Value) {
    if let Some(map) = r.as_object() {
        let width = map.keys().map(String::len).max().unwrap_or(0);
        for (k, v) in map {
            let _ = writeln!(out, "{k:<width$}  {}", text(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_select_reply_reads_as_one_line_per_fact() {
        let r = json!({"worker_id": 5, "dp_rank": 0, "provider": null, "endpoint": "http://five",
            "overlap_blocks": {"device": 4, "host": 2, "disk": 0}, "cost": 0.5,
            "policy": "default", "rule": null, "request_id": 9, "explain": null});
        let text = render("select", &r);
        assert_eq!(
            text,
            "worker 5 (dp rank 0) at http://five\noverlap blocks: device 4, host 2, disk 0\n\
             cost 0.5  policy default  rule -  request id 9\n"
        );
    }

    #[test]
    fn an_off_cluster_answer_names_the_provider() {
        let r = json!({"worker_id": null, "provider": "openai", "endpoint": "https://x",
            "overlap_blocks": {"device": 0, "host": 0, "disk": 0}, "cost": null,
            "policy": "default", "rule": "burst", "request_id": 1, "explain": null});
        assert!(render("select", &r).starts_with("provider openai at https://x\n"));
    }

    #[test]
    fn no_workers_says_so() {
        let text = render("workers", &json!({"workers": []}));
        assert_eq!(text, "no workers registered\n");
    }
}
