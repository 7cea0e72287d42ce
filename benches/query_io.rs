//! The query socket served by the epoll loop and by the io_uring listener
//! in the same run: one blocking client's select round
//! trip (JSON lines and binary) and 16 binary clients in parallel.
//!
//! `cargo bench -p kvedge-benches --features io-uring --bench query_io`

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvedge_config::Config;
use kvedge_daemon::server::{RuntimeDir, Server};
use kvedge_policies::{SelectionOverrides, router_plugin_registry};

struct Node {
    dir: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    _engine: kvedge_shm::Publisher,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn node(name: &str, uring: bool) -> Node {
    let dir = std::env::temp_dir().join(format!("kvedge-bench-io-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = Config::load(
        "bench.yaml",
        "daemon:\n  heartbeat_timeout_ms: 600000\n",
        &router_plugin_registry(),
        &SelectionOverrides::default(),
    )
    .unwrap();
    let limits = config.daemon.clone();
    let mut server = Server::bind(config, &RuntimeDir { dir: dir.clone() }).unwrap();
    if uring {
        let (listener, jobs) = server.take_query_listener().unwrap().unwrap();
        if let Err((_, e)) = kvedge_daemon::uring::start(listener, jobs, limits.max_frame_bytes) {
            panic!("io_uring is not available here: {e}");
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let stop = stop.clone();
        std::thread::spawn(move || server.run(|| stop.load(Ordering::Relaxed)).unwrap())
    };
    let hello = kvedge_shm::messages::control::Hello {
        worker_id: 1,
        dp_rank: 0,
        model: "llama".into(),
        role: kvedge_shm::messages::Role::Aggregated,
        block_size: 16,
        kv_blocks: [1 << 20, 0, 0],
        labels: vec![],
        taints: vec![],
        endpoint: "http://engine-1".into(),
        ring_capacity: 0,
    };
    let engine = kvedge_tools::publish::connect(&dir, None, &hello).unwrap();
    Node {
        dir,
        stop,
        thread: Some(thread),
        _engine: engine,
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
            let mut s = UnixStream::connect(n.dir.join("query.sock")).unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut reply = String::new();
            g.bench_function(format!("json_select_blocking/{name}/{round}"), |b| {
                b.iter(|| {
                    s.write_all(line.as_bytes()).unwrap();
                    reply.clear();
                    r.read_line(&mut reply).unwrap();
                })
            });
            let mut w = kvedge_wire::Client::connect(n.dir.join("query.sock")).unwrap();
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
        let path = n.dir.join("query.sock");
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
