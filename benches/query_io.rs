//! The query socket served by the epoll loop and by the io_uring listener
//! in the same run: one blocking client's select round
//! trip (JSON lines and binary) and 16 binary clients in parallel.
//!
//! `cargo bench -p kvedge-benches --features io-uring --bench query_io`

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};

struct Node {
    /// The engine goes before the daemon.
    _engine: kvedge_shm::Publisher,
    daemon: kvedge_testkit::Running,
}

fn node(name: &str, uring: bool) -> Node {
    let mut bound = kvedge_testkit::Bound::new(
        &format!("bench-io-{name}"),
        "daemon:\n  heartbeat_timeout_ms: 600000\n",
    );
    if uring {
        let (listener, jobs) = bound.server.take_query_listener().unwrap().unwrap();
        let max_frame_bytes = bound.server.core().config().daemon.max_frame_bytes;
        if let Err((_, e)) = kvedge_daemon::uring::start(listener, jobs, max_frame_bytes) {
            panic!("io_uring is not available here: {e}");
        }
    }
    let daemon = bound.run();
    let hello = kvedge_schema::messages::control::Hello {
        kv_blocks: [1 << 20, 0, 0],
        endpoint: "http://engine-1".into(),
        ..kvedge_schema::messages::control::Hello::new(1, "llama")
    };
    let engine = kvedge_testkit::register(daemon.control(), &hello);
    Node {
        _engine: engine,
        daemon,
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let epoll = node("epoll", false);
    let uring = node("uring", true);
    let hashes: Vec<u64> = (1..=128).collect();
    let line = format!(
        "{}\n",
        serde_json::json!({"op": "select", "model": "llama", "hashes": hashes, "prompt_tokens": 2048, "dry_run": true})
    );
    let mut g = c.benchmark_group("query_io");
    for round in 1..=2 {
        for (name, n) in [("epoll", &epoll), ("io_uring", &uring)] {
            let mut s = UnixStream::connect(n.daemon.query()).unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut reply = String::new();
            g.bench_function(format!("json_select_blocking/{name}/{round}"), |b| {
                b.iter(|| {
                    s.write_all(line.as_bytes()).unwrap();
                    reply.clear();
                    r.read_line(&mut reply).unwrap();
                })
            });
            let mut w = kvedge_wire::Client::connect(n.daemon.query()).unwrap();
            g.bench_function(format!("binary_select_blocking/{name}/{round}"), |b| {
                b.iter(|| {
                    w.select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 2048, true)
                        .unwrap()
                        .unwrap()
                })
            });
        }
    }
    g.throughput(Throughput::Elements(16 * 100));
    for (name, n) in [("epoll", &epoll), ("io_uring", &uring)] {
        let path = n.daemon.query();
        g.bench_function(format!("binary_select_16_clients_x100/{name}"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    let threads: Vec<_> = (0..16)
                        .map(|_| {
                            let (path, hashes) = (path.clone(), hashes.clone());
                            std::thread::spawn(move || {
                                let mut w = kvedge_wire::Client::connect(&path).unwrap();
                                for _ in 0..100 {
                                    w.select_hashes(
                                        "llama",
                                        kvedge_wire::Role::Aggregated,
                                        &hashes,
                                        2048,
                                        true,
                                    )
                                    .unwrap()
                                    .unwrap();
                                }
                            })
                        })
                        .collect();
                    for t in threads {
                        t.join().unwrap();
                    }
                    total += start.elapsed();
                }
                total
            })
        });
    }
    g.finish();
    drop(epoll);
    drop(uring);
    c.final_summary();
}
