//! The C library's figures (targets in BENCHMARKS.md), calling the exported functions: publish
//! of 16 hashes, hashing 2,048 tokens, and a select round trip through
//! `kvedge_select` next to the Rust client (`kvedge_wire::Client`) in the
//! same run, against one daemon in a thread of this process.
//!
//! `cargo bench -p kvedge-c --bench c_api`

#[path = "../tests/support/mod.rs"]
mod support;

use std::ffi::CString;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvedge::*;
use support::{Daemon, hello, select_request};

fn main() {
    let mut c = Criterion::default().configure_from_args();
    // A 4 MiB ring: a measured batch (4,000 records, ~1.2 MB) never fills
    // it, so no record is dropped (dropping is cheaper than publishing and
    // would flatter), and it stays in the last-level cache as a busy ring
    // does. The daemon's loop can be held, so a publish batch can be
    // measured with no consumer racing for the ring's cache lines, as
    // `ring/publish_stored_16` is; the ring is drained between batches.
    let daemon = Daemon::start(
        "bench",
        "daemon:\n  ring_capacity: 4194304\n  heartbeat_timeout_ms: 600000\n",
    );
    let dir = daemon.dir.clone();
    let hold = |on: bool| daemon.hold(on);
    let (control, query) = (daemon.control(), daemon.query());
    let model = CString::new("llama").unwrap();
    let hello = hello(model.as_ptr());
    let mut p = std::ptr::null_mut();
    // SAFETY: valid strings and out pointer.
    let rc = unsafe { kvedge_publisher_open(control.as_ptr(), &hello, &mut p) };
    assert_eq!(rc, KVEDGE_OK);

    let mut g = c.benchmark_group("c_api");
    let hashes: Vec<u64> = (1..=16).collect();
    // Publishes `n` Stored records of 16 hashes with `publish`, in batches
    // that fit the ring, the daemon held during each batch when `held`;
    // returns the time spent publishing.
    let batches = |iters: u64, held: bool, publish: &mut dyn FnMut()| {
        let mut total = Duration::ZERO;
        let mut left = iters;
        while left > 0 {
            let batch = left.min(4_000);
            if held {
                hold(true);
            }
            let start = Instant::now();
            for _ in 0..batch {
                publish();
            }
            total += start.elapsed();
            left -= batch;
            if held {
                hold(false);
            }
            // Let the daemon drain the ring (not measured).
            std::thread::sleep(Duration::from_millis(10));
        }
        total
    };
    let mut publish_c = || {
        // SAFETY: a live publisher and 16 readable hashes.
        let rc = unsafe {
            kvedge_publish_stored(p, KVEDGE_TIER_DEVICE, std::ptr::null(), hashes.as_ptr(), 16)
        };
        black_box(rc);
    };
    // The Rust publisher, registered as a second engine, for the ratio.
    let rust_hello = kvedge_schema::messages::control::Hello {
        kv_blocks: [1 << 20, 0, 0],
        ..kvedge_schema::messages::control::Hello::new(2, "llama")
    };
    let mut rust_pub = kvedge_mock::publish::connect(&dir, None, &rust_hello).unwrap();
    let mut publish_rust = || {
        black_box(
            rust_pub
                .publish_stored_hashes(kvedge_schema::Tier::Device, None, &hashes)
                .unwrap(),
        );
    };
    for round in 1..=2 {
        g.bench_function(format!("kvedge_publish_stored_16/{round}"), |b| {
            b.iter_custom(|iters| batches(iters, true, &mut publish_c))
        });
        g.bench_function(format!("rust_publish_stored_hashes_16/{round}"), |b| {
            b.iter_custom(|iters| batches(iters, true, &mut publish_rust))
        });
    }
    g.bench_function("kvedge_publish_stored_16_daemon_draining", |b| {
        b.iter_custom(|iters| batches(iters, false, &mut publish_c))
    });
    assert_eq!(rust_pub.dropped(), 0);
    // SAFETY: a live publisher.
    let dropped = unsafe { kvedge_publisher_dropped(p) };
    assert_eq!(dropped, 0, "records were dropped: the figure would flatter");

    let tokens: Vec<u32> = (0..2048).map(|i| i * 7 + 3).collect();
    let mut out = vec![0u64; 128];
    let mut n = 0usize;
    g.throughput(Throughput::Bytes(2048 * 4));
    g.bench_function("kvedge_hash_blocks_2048_tokens", |b| {
        b.iter(|| {
            // SAFETY: 2048 readable tokens, 128 writable outputs.
            unsafe {
                kvedge_hash_blocks(
                    tokens.as_ptr(),
                    tokens.len(),
                    16,
                    std::ptr::null(),
                    std::ptr::null(),
                    out.as_mut_ptr(),
                    out.len(),
                    &mut n,
                )
            }
        })
    });

    // Select round trips: the C API and the Rust client, one blocking
    // client each, the same 128-hash dry-run request.
    g.throughput(Throughput::Elements(1));
    let mut client = std::ptr::null_mut();
    // SAFETY: a valid path and out pointer.
    let rc = unsafe { kvedge_client_connect(query.as_ptr(), &mut client) };
    assert_eq!(rc, KVEDGE_OK);
    let req = select_request(model.as_ptr(), &out, true);
    // SAFETY: all-zero bytes are a valid kvedge_select_result.
    let mut res: kvedge_select_result = unsafe { std::mem::zeroed() };
    let mut rust = kvedge_wire::Client::connect(dir.join("query.sock")).unwrap();
    let mut q = kvedge_wire::Select::new(
        "llama",
        kvedge_wire::Role::Aggregated,
        kvedge_wire::Ids::hashes(&out),
    );
    q.prompt_tokens = Some(2048);
    q.dry_run = true;
    // Alternating, three rounds each, so drift on this shared machine hits
    // both alike.
    for round in 1..=3 {
        g.bench_function(format!("kvedge_select_round_trip/{round}"), |b| {
            // SAFETY: a live client, a valid request and result.
            b.iter(|| unsafe { kvedge_select(client, &req, &mut res) })
        });
        g.bench_function(format!("rust_client_select_round_trip/{round}"), |b| {
            b.iter(|| rust.select(&q).unwrap().unwrap().request_id)
        });
    }
    // The same over query channels (shared-memory rings), both clients
    // attached: no system call per round trip.
    let mut ring_client = std::ptr::null_mut();
    // SAFETY: a valid path and out pointer, then a live client.
    unsafe {
        assert_eq!(
            kvedge_client_connect(query.as_ptr(), &mut ring_client),
            KVEDGE_OK
        );
        assert_eq!(kvedge_client_attach_rings(ring_client), KVEDGE_OK);
    }
    let mut rust_ring = kvedge_wire::Client::connect(dir.join("query.sock")).unwrap();
    rust_ring.attach_rings().unwrap().unwrap();
    for round in 1..=3 {
        g.bench_function(format!("kvedge_select_ring_round_trip/{round}"), |b| {
            // SAFETY: a live client, a valid request and result.
            b.iter(|| unsafe { kvedge_select(ring_client, &req, &mut res) })
        });
        g.bench_function(format!("rust_client_select_ring_round_trip/{round}"), |b| {
            b.iter(|| rust_ring.select(&q).unwrap().unwrap().request_id)
        });
    }
    g.finish();
    // SAFETY: live handles, closed once.
    unsafe {
        kvedge_client_close(ring_client);
        kvedge_client_close(client);
        kvedge_publisher_close(p);
    }
    drop(daemon);
    c.final_summary();
}
