//! KV index benchmarks (their targets are in BENCHMARKS.md): applying block events, the
//! prefix-overlap query of a 2,048-token request (128 blocks of 16) against
//! 64 workers and a 1-million-block index (warm: the same request again;
//! cold: 4,096 requests in turn, 1.5 million entries in all, beside the
//! machine's floor for 128 independent cache misses; swept: the same after
//! 64 MiB were written, beside the floor after the same), and the memory
//! per entry at 10 million entries (printed; counted by allocation-counter).
//!
//! `cargo bench --bench index`
//!
//! `... -- --walk-loop warm|cold ITERATIONS` skips criterion and runs that
//! many overlap walks over the fixture, for counting a walk's instructions
//! under `valgrind --tool=callgrind`, or its misses under `perf stat`.
//!
//! `... -- --stalls ENTRIES [CHURN]` skips criterion, fills an index to
//! that many entries with 16-block Stored events (one worker, random
//! hashes) and prints every store that took over a millisecond (a table
//! doubling, or the eviction queues starting at half the capacity), then
//! the longest and how many took at least 10 µs, 20 µs, 50 µs and so on.
//! With CHURN, it then runs that many events of an engine whose cache is
//! full: a 16-block store and the removal of its 16 oldest blocks, each
//! timed the same way. The routing thread answers no select while one
//! runs.

#![forbid(unsafe_code)]

mod floor;

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput};
use kvedge_core::index::{KvIndex, MAX_WORKERS, Overlap, Slot};
use kvedge_schema::messages::Tier;

use floor::mix;

/// An index of `blocks` blocks: 64 workers, each holding its own chains.
fn filled(blocks: u64) -> KvIndex {
    let mut ix = KvIndex::new(usize::MAX);
    let per_worker = blocks / MAX_WORKERS as u64;
    let mut batch = Vec::with_capacity(1024);
    for w in 0..MAX_WORKERS as u64 {
        let slot = Slot::new(w as usize).unwrap();
        for start in (0..per_worker).step_by(1024) {
            batch.clear();
            batch.extend((start..(start + 1024).min(per_worker)).map(|i| mix(w << 40 | i)));
            ix.store(slot, Tier::Device, &batch);
        }
    }
    ix
}

/// Overlap: worker 0 holds the request's whole 128-block chain; the
/// request's blocks are also scattered over other workers' chains, in a
/// 1-million-block index.
fn overlap_fixture() -> (KvIndex, Vec<u64>) {
    let mut ix = filled(1_000_000);
    let request: Vec<u64> = (0..128u64).map(|i| mix(0xF00D << 40 | i)).collect();
    ix.store(Slot::new(0).unwrap(), Tier::Device, &request);
    for w in 1..MAX_WORKERS {
        let held = w * 2; // worker w holds a prefix of 2w blocks
        ix.store(
            Slot::new(w).unwrap(),
            Tier::Device,
            &request[..held.min(128)],
        );
    }
    (ix, request)
}

/// The cold walk's requests: 4,096 different fully cached ones, stored into
/// `ix`, taken in turn so that their entries are not in the CPU caches
/// from the last walk.
fn cold_requests(ix: &mut KvIndex) -> Vec<Vec<u64>> {
    let requests: Vec<Vec<u64>> = (0..4096u64)
        .map(|r| {
            (0..128u64)
                .map(|i| mix(0xC01D << 44 | r << 8 | i))
                .collect()
        })
        .collect();
    for (r, req) in requests.iter().enumerate() {
        ix.store(Slot::new(r % MAX_WORKERS).unwrap(), Tier::Device, req);
    }
    requests
}

/// `--walk-loop warm|cold ITERATIONS`, if given: builds the overlap
/// fixture (and the cold requests), runs that many walks and returns true.
/// For counting a walk's instructions under callgrind, or its cache and
/// TLB misses under `perf stat` where the CPU exposes counters: the
/// difference between two iteration counts is the walks' own.
fn walk_loop() -> bool {
    let args: Vec<String> = std::env::args().collect();
    let Some(at) = args.iter().position(|a| a == "--walk-loop") else {
        return false;
    };
    let usage = "--walk-loop warm|cold ITERATIONS";
    let cold = match args.get(at + 1).map(String::as_str) {
        Some("warm") => false,
        Some("cold") => true,
        _ => panic!("{usage}"),
    };
    let iterations: usize = args.get(at + 2).and_then(|n| n.parse().ok()).expect(usage);
    let (mut ix, request) = overlap_fixture();
    let requests = if cold {
        cold_requests(&mut ix)
    } else {
        vec![request]
    };
    let mut out = Overlap::default();
    for k in 0..iterations {
        ix.overlap(black_box(&requests[k % requests.len()]), u64::MAX, &mut out);
        black_box(out.blocks[0][0]);
    }
    true
}

/// Stores taking at least 10, 20, 50, 100, ... µs (a 1-2-5 series).
const BANDS_US: [u64; 9] = [10, 20, 50, 100, 200, 500, 1_000, 10_000, 100_000];

/// How long each of a run of index changes took: every one over a
/// millisecond (with the entries held before it), the longest, and how
/// many took at least each of [`BANDS_US`].
struct Stalls {
    bands: [u64; BANDS_US.len()],
    longest: Duration,
    changes: u64,
}

impl Stalls {
    fn start(what: &str) -> Self {
        println!("\n{what}\n\n| entries held before | took |\n|---|---|");
        Stalls {
            bands: [0; BANDS_US.len()],
            longest: Duration::ZERO,
            changes: 0,
        }
    }

    fn time(&mut self, ix: &mut KvIndex, change: impl FnOnce(&mut KvIndex)) {
        let before = ix.entries();
        let t = std::time::Instant::now();
        change(ix);
        let took = t.elapsed();
        self.changes += 1;
        self.longest = self.longest.max(took);
        for (band, &us) in self.bands.iter_mut().zip(&BANDS_US) {
            *band += u64::from(took >= Duration::from_micros(us));
        }
        if took > Duration::from_millis(1) {
            println!("| {before} | {:.1} ms |", took.as_secs_f64() * 1e3);
        }
    }

    fn report(&self, ix: &KvIndex, started: std::time::Instant) {
        println!(
            "\n{} entries after {} changes in {:.2} s; the longest {:.1} ms\n",
            ix.entries(),
            self.changes,
            started.elapsed().as_secs_f64(),
            self.longest.as_secs_f64() * 1e3
        );
        println!("| at least | changes |\n|---|---|");
        for (band, &us) in self.bands.iter().zip(&BANDS_US) {
            println!("| {us} µs | {band} |");
        }
    }
}

/// `--stalls ENTRIES [CHURN]`, if given: see the module documentation.
/// Returns true when it ran.
fn stalls() -> bool {
    let args: Vec<String> = std::env::args().collect();
    let Some(at) = args.iter().position(|a| a == "--stalls") else {
        return false;
    };
    let usage = "--stalls ENTRIES [CHURN]";
    let entries: u64 = args.get(at + 1).and_then(|n| n.parse().ok()).expect(usage);
    // Not a flag that follows (`cargo bench` appends `--bench`).
    let churn: u64 = args
        .get(at + 2)
        .filter(|a| !a.starts_with("--"))
        .map_or(0, |n| n.parse().expect(usage));
    // The daemon's default capacity.
    let mut ix = KvIndex::new(16 * 1024 * 1024).quiet();
    let slot = Slot::new(0).unwrap();
    let block = |i: u64| -> [u64; 16] { std::array::from_fn(|k| mix(i * 16 + k as u64)) };
    let started = std::time::Instant::now();
    let mut fill = Stalls::start("Filling: 16-block stores.");
    for event in 0..entries / 16 {
        let hashes = block(event);
        fill.time(&mut ix, |ix| {
            ix.store(slot, Tier::Device, &hashes);
        });
    }
    fill.report(&ix, started);
    if churn == 0 {
        return true;
    }
    // An engine whose cache is full: each new block evicts its oldest.
    let started = std::time::Instant::now();
    let mut churned =
        Stalls::start("Churn: each 16-block store followed by the removal of the 16 oldest.");
    for event in 0..churn {
        let (new, old) = (block(entries / 16 + event), block(event));
        churned.time(&mut ix, |ix| {
            ix.store(slot, Tier::Device, &new);
        });
        churned.time(&mut ix, |ix| {
            ix.remove(slot, Tier::Device, &old);
        });
    }
    churned.report(&ix, started);
    true
}

fn main() {
    if walk_loop() || stalls() {
        return;
    }
    let mut c = Criterion::default().configure_from_args();

    // Memory at 10 million entries (one worker per block: the worst case).
    let info = allocation_counter::measure(|| {
        let ix = filled(10_000_000);
        assert_eq!(ix.entries(), 10_000_000);
        black_box(&ix);
    });
    println!(
        "index/memory_10m_entries: {:.1} bytes per (block, worker) entry (peak {:.0} MiB)",
        info.bytes_max as f64 / 1e7,
        info.bytes_max as f64 / (1 << 20) as f64
    );

    // A worker's death in that index: one of 64 workers, 156,250 blocks.
    // Timed once (it takes the index apart), not by criterion.
    let mut ix = filled(10_000_000);
    let t = std::time::Instant::now();
    let dropped = ix.remove_worker(Slot::new(5).unwrap());
    let took = t.elapsed();
    assert_eq!(dropped, 10_000_000 / MAX_WORKERS);
    println!(
        "index/remove_worker_156k_of_10m_entries: {:.1} ms",
        took.as_secs_f64() * 1e3
    );
    drop(ix);

    let mut g = c.benchmark_group("index");
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));

    // Apply: a Stored event of 16 blocks and the matching Removed, against a
    // 1-million-block index (32 block events per iteration).
    let mut ix = filled(1_000_000);
    let batches: Vec<Vec<u64>> = (0..256u64)
        .map(|b| (0..16).map(|i| mix(0xABCD << 40 | b << 8 | i)).collect())
        .collect();
    let slot = Slot::new(7).unwrap();
    let mut k = 0usize;
    g.throughput(Throughput::Elements(32));
    g.bench_function("apply_stored_and_removed_16_blocks", |b| {
        b.iter(|| {
            let batch = &batches[k % batches.len()];
            k += 1;
            black_box(ix.store(slot, Tier::Device, batch));
            black_box(ix.remove(slot, Tier::Device, batch));
        })
    });

    let (mut ix, request) = overlap_fixture();
    let mut out = Overlap::default();
    g.throughput(Throughput::Elements(128));
    g.bench_function("overlap_128_blocks_64_workers_1m_index", |b| {
        b.iter(|| {
            ix.overlap(black_box(&request), u64::MAX, &mut out);
            black_box(out.blocks[0][0])
        })
    });
    // Checked on a query of its own, so a filter that skips the bench above
    // does not leave `out` empty.
    ix.overlap(&request, u64::MAX, &mut out);
    assert_eq!(out.get(Slot::new(0).unwrap(), Tier::Device), 128);
    assert_eq!(out.get(Slot::new(5).unwrap(), Tier::Device), 10);

    let requests = cold_requests(&mut ix);
    let mut k = 0usize;
    g.bench_function("overlap_128_blocks_64_workers_1m_index_cold", |b| {
        b.iter(|| {
            let req = &requests[k % requests.len()];
            k += 1;
            ix.overlap(black_box(req), u64::MAX, &mut out);
            black_box(out.blocks[0][0])
        })
    });
    // The floor of that cold walk on this machine: 128 loads of random
    // cache lines from an array as large as the cold index's tables (32
    // MiB), independent of each other and with nothing else in the loop,
    // 4,096 different sets in turn. The VM's memory latency moves from day
    // to day (the cold walk measured 2.3 and 6 µs on two days with the same
    // code), so the walk is compared with this floor, measured beside it.
    let (lines, sets) = floor::random_line_sets();
    let mut k = 0usize;
    g.bench_function("cold_floor_128_random_lines_32mib", |b| {
        b.iter(|| {
            let set = &sets[k % sets.len()];
            k += 1;
            black_box(floor::load_lines(&lines, set))
        })
    });
    // Colder still: before each walk, 64 MiB are written (twice the last
    // level cache), so the walk also finds the page tables and the tables'
    // headers out of the caches, as after a sleep among busy neighbours.
    // Only the walk is timed. Beside it, the floor in the same state: 128
    // loads of random lines from the 32 MiB array.
    let mut sweep = floor::sweep_buffer();
    let mut after_sweeps =
        |iters: u64, f: &mut dyn FnMut()| floor::after_sweeps(&mut sweep, iters, f);
    let mut k = 0usize;
    g.sample_size(30);
    g.bench_function("overlap_128_blocks_64_workers_1m_index_swept", |b| {
        b.iter_custom(|iters| {
            after_sweeps(iters, &mut || {
                ix.overlap(black_box(&requests[k % requests.len()]), u64::MAX, &mut out);
                k += 1;
                black_box(out.blocks[0][0]);
            })
        })
    });
    g.bench_function("swept_floor_128_random_lines_32mib", |b| {
        b.iter_custom(|iters| {
            after_sweeps(iters, &mut || {
                black_box(floor::load_lines(&lines, &sets[k % sets.len()]));
                k += 1;
            })
        })
    });
    g.sample_size(100);
    drop((lines, sets));
    // Keys are untrusted: an engine publishing 500,000 sequential hashes
    // must not slow lookups that land near them (with identity hashing they
    // filled one probe run, and a lookup of an absent hash walked it).
    let mut ix = KvIndex::new(1 << 22);
    let sequential: Vec<u64> = (0..500_000u64).map(|k| 0xBEEF_0000_0000 + k).collect();
    ix.store(Slot::new(0).unwrap(), Tier::Device, &sequential);
    g.bench_function("overlap_absent_hash_after_500k_sequential_hashes", |b| {
        b.iter(|| {
            ix.overlap(black_box(&[1]), u64::MAX, &mut out);
            black_box(out.blocks[0][0])
        })
    });
    g.finish();
    c.final_summary();
}
