//! The daemon over its sockets (targets in BENCHMARKS.md): a select round trip over
//! `query.sock` with a client that spins on the socket and with one that
//! sleeps until its reply arrives; 16 clients in parallel; and an engine's commit until
//! the next select sees it. The server runs in a thread of this process
//! (the same `Server` that `kvedge run` runs).
//!
//! `cargo bench --bench query`

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvedge_schema::messages::Tier;
use kvedge_schema::messages::control::Hello;
use kvedge_shm::Publisher;

fn engine(control: &std::path::Path, id: u64) -> Publisher {
    let hello = Hello {
        kv_blocks: [1 << 20, 0, 0],
        endpoint: format!("http://engine-{id}"),
        ..Hello::new(id, "llama")
    };
    kvedge_testkit::register(control, &hello)
}

/// Sends a line and reads the reply, spinning on a non-blocking socket.
fn ask_spinning(s: &mut UnixStream, line: &[u8], buf: &mut Vec<u8>) {
    s.write_all(line).unwrap();
    buf.clear();
    let mut chunk = [0u8; 4096];
    loop {
        match s.read(&mut chunk) {
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                if buf.last() == Some(&b'\n') {
                    return;
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => panic!("{e}"),
        }
    }
}

/// Commit to visible, `iters` times: `engine` stores a block nobody has
/// seen, then `client` selects it (dry run) until the overlap shows it.
fn commit_to_visible(
    iters: u64,
    k: &mut u64,
    engine: &mut Publisher,
    client: &mut kvedge_wire::Client,
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        *k += 1;
        let hash = 0xBEEF_0000_0000 + *k;
        let start = Instant::now();
        engine
            .publish_stored_hashes(Tier::Device, None, &[hash])
            .unwrap();
        while client
            .select_hashes("llama", kvedge_wire::Role::Aggregated, &[hash], 16, true)
            .unwrap()
            .unwrap()
            .overlap_blocks[0]
            != 1
        {}
        total += start.elapsed();
    }
    total
}

/// Runs `client` on `clients` threads at once, `iters` times; the total
/// wall time.
fn in_parallel(iters: u64, clients: usize, client: &(impl Fn() + Sync)) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let start = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..clients {
                s.spawn(client);
            }
        });
        total += start.elapsed();
    }
    total
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    // The bench's engines send no heartbeats: keep them available.
    let daemon =
        kvedge_testkit::Bound::new("bench-query", "daemon:\n  heartbeat_timeout_ms: 86400000\n")
            .run();
    let rd = &daemon.runtime;

    // 8 engines, each caching a different 2,048-token prompt.
    let seed = kvedge_schema::hash::block_seed(None, None);
    let mut engines: Vec<Publisher> = (0..8).map(|i| engine(&rd.control(), i)).collect();
    for (i, e) in engines.iter_mut().enumerate() {
        let tokens: Vec<u32> = (0..2048).map(|t| i as u32 * 100_000 + t).collect();
        e.publish_stored_tokens(Tier::Device, None, &tokens, 16, seed)
            .unwrap();
    }
    let tokens: Vec<u32> = (0..2048).map(|t| 300_000 + t).collect();
    let line = format!(
        "{}\n",
        serde_json::json!({"op": "select", "model": "llama", "tokens": tokens, "dry_run": true})
    );
    // Wait until the index has everything.
    let mut probe = UnixStream::connect(rd.query()).unwrap();
    let mut reader = BufReader::new(probe.try_clone().unwrap());
    loop {
        probe.write_all(line.as_bytes()).unwrap();
        let mut reply = String::new();
        reader.read_line(&mut reply).unwrap();
        if reply.contains("\"device\":128") {
            break;
        }
    }

    let mut g = c.benchmark_group("query");
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    let mut spinning = UnixStream::connect(rd.query()).unwrap();
    spinning.set_nonblocking(true).unwrap();
    let mut buf = Vec::new();
    g.bench_function("select_2048_tokens_round_trip_spinning_client", |b| {
        b.iter(|| ask_spinning(&mut spinning, line.as_bytes(), &mut buf))
    });
    let hashes = kvedge_schema::hash::sequence_hashes(&tokens, 16, None, None);
    let hash_line = format!(
        "{}\n",
        serde_json::json!({"op": "select", "model": "llama", "hashes": hashes, "prompt_tokens": 2048, "dry_run": true})
    );
    g.bench_function("select_128_hashes_round_trip_spinning_client", |b| {
        b.iter(|| ask_spinning(&mut spinning, hash_line.as_bytes(), &mut buf))
    });
    let mut wire = kvedge_wire::Client::connect(rd.query()).unwrap();
    if let Err(e) = wire
        .select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 2048, true)
        .unwrap()
    {
        panic!("binary select failed: {e:?}");
    }
    g.bench_function("binary_select_128_hashes_round_trip_blocking_client", |b| {
        b.iter(|| {
            wire.select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 2048, true)
                .unwrap()
                .unwrap()
        })
    });
    g.bench_function("select_2048_tokens_round_trip_blocking_client", |b| {
        b.iter(|| {
            probe.write_all(line.as_bytes()).unwrap();
            let mut reply = String::new();
            reader.read_line(&mut reply).unwrap();
        })
    });

    // 16 clients in parallel: throughput of the whole daemon.
    g.throughput(Throughput::Elements(16 * 100));
    let binary_client = {
        let path = rd.query();
        let hashes = hashes.clone();
        move || {
            let mut c = kvedge_wire::Client::connect(&path).unwrap();
            for _ in 0..100 {
                c.select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 2048, true)
                    .unwrap()
                    .unwrap();
            }
        }
    };
    g.bench_function("binary_select_16_clients_x100", |b| {
        b.iter_custom(|iters| in_parallel(iters, 16, &binary_client))
    });
    let json_client = {
        let path = rd.query();
        let line = line.clone();
        move || {
            // Blocking clients: 16 spinning threads on this 2-vCPU VM would
            // take the daemon's CPU.
            let mut s = UnixStream::connect(&path).unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut reply = String::new();
            for _ in 0..100 {
                s.write_all(line.as_bytes()).unwrap();
                reply.clear();
                r.read_line(&mut reply).unwrap();
            }
        }
    };
    g.bench_function("select_16_clients_x100", |b| {
        b.iter_custom(|iters| in_parallel(iters, 16, &json_client))
    });

    // Commit to visible: an engine stores a new block; a spinning client
    // selects (dry run) until the overlap shows it.
    g.throughput(Throughput::Elements(1));
    let mut k = 0u64;
    g.bench_function("engine_commit_to_visible_in_select", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                k += 1;
                let hash = 0xBEEF_0000_0000 + k;
                let q = format!(
                    "{}\n",
                    serde_json::json!({"op": "select", "model": "llama", "hashes": [hash], "prompt_tokens": 16, "dry_run": true})
                );
                let start = Instant::now();
                engines[0].publish_stored_hashes(Tier::Device, None, &[hash]).unwrap();
                loop {
                    ask_spinning(&mut spinning, q.as_bytes(), &mut buf);
                    if buf.windows(10).any(|w| w == b"\"device\":1") {
                        break;
                    }
                }
                total += start.elapsed();
            }
            total
        })
    });
    // The same over the binary protocol, the path for programs: first the
    // floor (a one-hash select round trip with nothing new to see), then
    // commit-to-visible.
    let mut fast = kvedge_wire::Client::connect(rd.query()).unwrap();
    fast.set_spinning(true).unwrap();
    g.bench_function("binary_select_1_hash_round_trip_spinning_client", |b| {
        b.iter(|| {
            fast.select_hashes("llama", kvedge_wire::Role::Aggregated, &[1], 16, true)
                .unwrap()
                .unwrap()
        })
    });
    g.bench_function("engine_commit_to_visible_in_binary_select", |b| {
        b.iter_custom(|iters| commit_to_visible(iters, &mut k, &mut engines[0], &mut fast))
    });
    // The same two over a query channel (shared-memory rings): no system
    // call per round trip while both sides spin.
    let mut ring = kvedge_wire::Client::connect(rd.query()).unwrap();
    ring.set_spinning(true).unwrap();
    ring.attach_rings().unwrap().unwrap();
    g.bench_function("ring_select_1_hash_round_trip_spinning_client", |b| {
        b.iter(|| {
            ring.select_hashes("llama", kvedge_wire::Role::Aggregated, &[1], 16, true)
                .unwrap()
                .unwrap()
        })
    });
    g.bench_function("engine_commit_to_visible_in_ring_select", |b| {
        b.iter_custom(|iters| commit_to_visible(iters, &mut k, &mut engines[0], &mut ring))
    });
    // The same while another client keeps the daemon busy: a blocking
    // binary client selecting a 128-hash prompt back to back.
    let busy_stop = Arc::new(AtomicBool::new(false));
    let background = {
        let stop = Arc::clone(&busy_stop);
        let path = rd.query();
        let hashes = hashes.clone();
        std::thread::spawn(move || {
            let mut c = kvedge_wire::Client::connect(&path).unwrap();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                c.select_hashes("llama", kvedge_wire::Role::Aggregated, &hashes, 2048, true)
                    .unwrap()
                    .unwrap();
                n += 1;
            }
            n
        })
    };
    let busy_start = Instant::now();
    g.bench_function("engine_commit_to_visible_in_ring_select_daemon_busy", |b| {
        b.iter_custom(|iters| commit_to_visible(iters, &mut k, &mut engines[0], &mut ring))
    });
    // The same client blocking while it waits, as most frontends' clients
    // do: with another thread wanting the CPU, what a blocking client does
    // while it polls (hold the CPU or yield it) shows here.
    ring.set_spinning(false).unwrap();
    g.bench_function(
        "engine_commit_to_visible_in_blocking_ring_select_daemon_busy",
        |b| b.iter_custom(|iters| commit_to_visible(iters, &mut k, &mut engines[0], &mut ring)),
    );
    g.bench_function(
        "ring_select_1_hash_round_trip_blocking_client_daemon_busy",
        |b| {
            b.iter(|| {
                ring.select_hashes("llama", kvedge_wire::Role::Aggregated, &[1], 16, true)
                    .unwrap()
                    .unwrap()
            })
        },
    );
    busy_stop.store(true, Ordering::Relaxed);
    let background_selects = background.join().unwrap();
    eprintln!(
        "background client: {:.0} selects/s during the busy row",
        background_selects as f64 / busy_start.elapsed().as_secs_f64()
    );
    // The peer for the socket rows: the kernel's own floor, two threads
    // echoing a 40-byte message over a Unix socket pair, both spinning on
    // non-blocking reads (no daemon, no epoll, no parsing).
    {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        let echo = std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            loop {
                match b.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => b.write_all(&buf[..n]).unwrap(),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
                    Err(_) => return,
                }
            }
        });
        let msg = [7u8; 40];
        let mut buf = [0u8; 64];
        g.bench_function("unix_socket_echo_40_bytes_spinning_floor", |bch| {
            bch.iter(|| {
                a.write_all(&msg).unwrap();
                let mut got = 0;
                while got < msg.len() {
                    match a.read(&mut buf[got..]) {
                        Ok(n) => got += n,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
                        Err(e) => panic!("{e}"),
                    }
                }
            })
        });
        drop(a);
        echo.join().unwrap();
    }
    g.finish();
    drop(engines);
    daemon.stop();
    c.final_summary();
}
