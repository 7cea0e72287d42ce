//! Ring benchmarks: publishing a 16-block Stored event, consuming it (copy +
//! validate + decode), cross-process sustained throughput against a child
//! producer registered through the real handshake, commit-to-consume latency
//! with both sides spinning, and block hashing.
//!
//! `cargo bench --bench ring`. The child producer is this same binary,
//! re-executed with `KVEDGE_BENCH_CHILD=<control socket>`.

#![forbid(unsafe_code)]

use std::hint::black_box;
use std::os::unix::net::UnixListener;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use kvedge_schema::messages::control::Hello;
use kvedge_schema::messages::{EventRef, StoredBlock, Tier};
use kvedge_shm::control::accept_registration;
use kvedge_shm::segment::Segment;
use kvedge_shm::{Consumer, Producer, Publisher, Push};

const CHILD_ENV: &str = "KVEDGE_BENCH_CHILD";

fn blocks16() -> Vec<StoredBlock> {
    (0..16)
        .map(|i| StoredBlock {
            sequence_hash: 0x1000 + i,
            local_hash: 0x2000 + i,
        })
        .collect()
}

fn local_pair(capacity: u64) -> (Publisher, Consumer) {
    let consumer = Consumer::create(capacity, 1).unwrap();
    let seg = Segment::open(consumer.segment_fd().try_clone_to_owned().unwrap()).unwrap();
    let wake = consumer.wake_fd().try_clone_to_owned().unwrap();
    (
        Publisher::new(None, Producer::new(seg, Some(wake)).unwrap()),
        consumer,
    )
}

fn consume_one(consumer: &mut Consumer) -> Option<usize> {
    let r = consumer.poll().unwrap()?;
    match kvedge_schema::decode(r.kind, r.payload).unwrap() {
        EventRef::Stored(s) => Some(s.blocks.len()),
        _ => Some(0),
    }
}

const BATCH: u64 = 2048;

/// Runs `iters` operations on `state` in batches that fit the ring:
/// `before(n)` runs untimed (to fill the ring), `timed(n)` is measured,
/// `after(n)` runs untimed (to drain it).
fn batched<S>(
    iters: u64,
    state: &mut S,
    before: impl Fn(&mut S, u64),
    timed: impl Fn(&mut S, u64),
    after: impl Fn(&mut S, u64),
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(BATCH);
        before(state, n);
        let start = Instant::now();
        timed(state, n);
        total += start.elapsed();
        after(state, n);
        left -= n;
    }
    total
}

fn publish_n(publisher: &mut Publisher, blocks: &[StoredBlock], n: u64) {
    for _ in 0..n {
        black_box(
            publisher
                .publish_stored(Tier::Device, Some(7), black_box(blocks), None)
                .unwrap(),
        );
    }
}

fn consume_n(consumer: &mut Consumer, n: u64) {
    for _ in 0..n {
        assert_eq!(black_box(consume_one(consumer)), Some(16));
    }
}

fn publish_and_consume(c: &mut Criterion) {
    let blocks = blocks16();
    let mut g = c.benchmark_group("ring");
    g.throughput(Throughput::Elements(1));
    g.bench_function("publish_stored_16", |b| {
        let mut rings = local_pair(1 << 20);
        b.iter_custom(|iters| {
            batched(
                iters,
                &mut rings,
                |_, _| {},
                |(p, _), n| publish_n(p, &blocks, n),
                |(p, c), n| {
                    assert_eq!(p.dropped(), 0, "bench must not measure drops");
                    consume_n(c, n);
                },
            )
        })
    });
    g.bench_function("consume_stored_16", |b| {
        let mut rings = local_pair(1 << 20);
        b.iter_custom(|iters| {
            batched(
                iters,
                &mut rings,
                |(p, _), n| {
                    publish_n(p, &blocks, n);
                    assert_eq!(p.dropped(), 0);
                },
                |(_, c), n| consume_n(c, n),
                |_, _| {},
            )
        })
    });
    g.finish();
}
fn cross_process(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("control.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(CHILD_ENV, &path)
        .spawn()
        .unwrap();
    let (stream, _) = listener.accept().unwrap();
    let (_, mut consumer) = accept_registration(&stream, 1 << 20, 1, 1000).unwrap();
    let mut g = c.benchmark_group("ring");
    g.throughput(Throughput::Elements(1));
    g.bench_function("cross_process_stored_16_throughput", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            let mut got = 0;
            while got < iters {
                if consume_one(&mut consumer).is_some() {
                    got += 1;
                }
            }
            start.elapsed()
        })
    });
    g.finish();
    drop(stream);
    child.wait().unwrap();
    eprintln!(
        "cross-process: producer dropped {} records while the consumer was busy elsewhere",
        consumer.producer_dropped()
    );
}

/// The child side of `cross_process`: publish Stored(16) as fast as possible
/// until the parent closes the control connection.
fn child(path: &str) {
    let hello = Hello::new(1, "bench");
    let mut publisher = Publisher::connect(path, &hello, Duration::from_secs(10)).unwrap();
    let blocks = blocks16();
    loop {
        for _ in 0..4096 {
            publisher
                .publish_stored(Tier::Device, None, &blocks, None)
                .unwrap();
        }
        if publisher.poll().is_err() {
            return;
        }
    }
}

fn latency(c: &mut Criterion) {
    let (mut ping, mut ping_rx) = local_pair(1 << 16);
    let (mut pong, mut pong_rx) = local_pair(1 << 16);
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let echo = std::thread::spawn(move || {
        while !stop2.load(Ordering::Relaxed) {
            if let Some(r) = ping_rx.poll().unwrap() {
                let seq = r.seq;
                assert!(matches!(
                    pong.heartbeat(seq).unwrap(),
                    Push::Committed { .. }
                ));
            }
        }
    });
    let mut g = c.benchmark_group("ring");
    g.bench_function("round_trip_spinning", |b| {
        b.iter(|| {
            ping.heartbeat(0).unwrap();
            loop {
                if let Some(r) = pong_rx.poll().unwrap() {
                    break black_box(r.seq);
                }
                std::hint::spin_loop();
            }
        })
    });
    g.finish();
    stop.store(true, Ordering::Relaxed);
    echo.join().unwrap();
}

fn hashing(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..2048).map(|i| i * 7919).collect();
    let mut out = vec![(0u64, 0u64); 128];
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Bytes(2048 * 4));
    g.bench_function("hash_blocks_2048_tokens_bs16", |b| {
        b.iter(|| {
            kvedge_schema::hash::hash_blocks_into(
                black_box(&tokens),
                16,
                kvedge_schema::hash::SEED,
                None,
                &mut out,
            )
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    publish_and_consume,
    cross_process,
    latency,
    hashing
);

fn main() {
    if let Ok(path) = std::env::var(CHILD_ENV) {
        child(&path);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
