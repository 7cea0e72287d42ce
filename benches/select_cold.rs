//! One router-core select with its caches warm and with them cold: the
//! paced bench's request (a 2,048-token prompt, 128 blocks, held by the
//! first of four workers; a dry run without a session) against the
//! router alone, without sockets or threads. Hot: the same select back to
//! back. Swept: the same select after 64 MiB were written, twice the last
//! level cache, so that its code, its data, the index's lines and the page
//! tables all come back from memory, as after a sleep among busy
//! neighbours. Beside it, the machine's floor in the same state: 128
//! loads of random lines from a 32 MiB array. The swept select is what a
//! paced select becomes when nothing of it stays cached between requests;
//! unlike the paced bench, it does not depend on what the host does
//! between requests, so changes to the select's footprint can be compared
//! by it.
//!
//! The `swept_1_block` row is the same request with its first block alone:
//! the part of a select that is not the overlap walk.
//!
//! `... -- --footprint N [BLOCKS]` skips criterion and runs N hot selects
//! (of the prompt's first BLOCKS blocks, 128 unless given), each
//! between two writes of a marker word whose address it prints, for a
//! memory trace (`valgrind --tool=lackey --trace-mem=yes`) from which
//! `benches/footprint.py` counts the cache lines and pages one select
//! touches.
//!
//! `... -- --swept N` skips criterion and prints the median of N swept
//! selects of each kind, interleaved with each other and the floor: also
//! with the select's code warm (a select on a second router, same code,
//! other data, between the sweep and the timed select), which splits what
//! a cold select waits for between its code and its own data.
//!
//! `cargo bench --bench select_cold [-- --footprint N [BLOCKS] | --swept N]`

#![forbid(unsafe_code)]

mod floor;

use std::hint::black_box;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::Criterion;
use kvedge_core::router::{Router, SelectRequest, WorkerInfo};
use kvedge_policies::{WorkerType, WorkerWithDpRank};
use kvedge_schema::messages::Tier;

/// Written before and after each select of `--footprint`.
static MARK: AtomicU64 = AtomicU64::new(0);

/// Workers registered; the first holds the prompt.
const WORKERS: u64 = 4;

/// The router on the heap, as in the daemon, so that the stack a select
/// touches is its own frames.
fn router() -> (Box<Router>, Vec<u64>) {
    let mut router = Box::new(Router::with_defaults());
    let tokens: Vec<u32> = (0..2048).collect();
    let hashes = kvedge_schema::hash::sequence_hashes(&tokens, 16, None, None);
    for id in 1..=WORKERS {
        let slot = router
            .register(WorkerInfo {
                worker: WorkerWithDpRank::new(id, 0),
                model: "llama".into(),
                role: WorkerType::Aggregated,
                endpoint: format!("http://engine-{id}"),
                block_size: 16,
                available: true,
                labels: Vec::new(),
                taints: Vec::new(),
            })
            .unwrap();
        if id == 1 {
            router.apply_stored(slot, Tier::Device, &hashes);
        } else {
            // Other prompts, so that the index is not the prompt alone.
            let other: Vec<u32> = (0..2048).map(|t| t + id as u32 * 100_000).collect();
            let theirs = kvedge_schema::hash::sequence_hashes(&other, 16, None, None);
            router.apply_stored(slot, Tier::Device, &theirs);
        }
    }
    (router, hashes)
}

fn request(hashes: &[u64]) -> SelectRequest<'_> {
    SelectRequest {
        dry_run: true,
        ..SelectRequest::new("llama", WorkerType::Aggregated, hashes, 2048)
    }
}

/// `--footprint N`, if given: runs N marked selects and returns true.
fn footprint(args: &[String]) -> bool {
    let Some(at) = args.iter().position(|a| a == "--footprint") else {
        return false;
    };
    let n: u64 = args
        .get(at + 1)
        .and_then(|s| s.parse().ok())
        .expect("--footprint N");
    let blocks: usize = args.get(at + 2).and_then(|s| s.parse().ok()).unwrap_or(128);
    let (mut router, hashes) = router();
    let req = request(&hashes[..blocks.min(hashes.len())]);
    for _ in 0..100 {
        black_box(router.select(&req).unwrap());
    }
    // One write, so that valgrind's trace on the same stream cannot split it.
    let line = format!("marker {:p}\n", &MARK);
    std::io::stderr().write_all(line.as_bytes()).unwrap();
    for i in 0..n {
        MARK.store(2 * i + 1, Ordering::SeqCst);
        black_box(router.select(black_box(&req)).unwrap());
        MARK.store(2 * i + 2, Ordering::SeqCst);
    }
    true
}

/// `--swept N`, if given: N rounds of a swept select of 128 blocks and of
/// 1 block, each also with its code warm (right after the sweep, a select
/// on a second router: the same code and static data, other heap data),
/// and of the floor, interleaved; prints the median and the 90th
/// percentile of each and returns true. Medians of single timings, where
/// criterion's estimate is a mean: one swept select is a few microseconds
/// and a slow host adds tens to some.
fn swept(args: &[String]) -> bool {
    let Some(at) = args.iter().position(|a| a == "--swept") else {
        return false;
    };
    let n: usize = args
        .get(at + 1)
        .and_then(|s| s.parse().ok())
        .expect("--swept N");
    let (mut router, hashes) = router();
    let (long, short) = (request(&hashes), request(&hashes[..1]));
    let mut buf = floor::sweep_buffer();
    let (lines, sets) = floor::random_line_sets();
    let (mut other, theirs) = self::router();
    let theirs = request(&theirs);
    let mut took: [Vec<Duration>; 5] = Default::default();
    for round in 0..n {
        for (k, t) in took.iter_mut().enumerate() {
            floor::sweep(&mut buf, round as u64);
            if k == 2 || k == 3 {
                black_box(other.select(black_box(&theirs)).unwrap());
            }
            let start = Instant::now();
            match k {
                0 | 2 => drop(black_box(router.select(black_box(&long)).unwrap())),
                1 | 3 => drop(black_box(router.select(black_box(&short)).unwrap())),
                _ => drop(black_box(floor::load_lines(
                    &lines,
                    &sets[round % sets.len()],
                ))),
            }
            t.push(start.elapsed());
        }
    }
    let names = [
        "128 blocks",
        "1 block",
        "128 blocks, code warm",
        "1 block, code warm",
        "floor",
    ];
    for (name, t) in names.iter().zip(&mut took) {
        t.sort();
        println!(
            "swept {name}: p50 {:.2} µs, p90 {:.2} µs",
            t[t.len() / 2].as_secs_f64() * 1e6,
            t[t.len() * 9 / 10].as_secs_f64() * 1e6
        );
    }
    true
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if footprint(&args) || swept(&args) {
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    let (mut router, hashes) = router();
    let req = request(&hashes);
    let chosen = router.select(&req).unwrap();
    assert_eq!(chosen.worker, WorkerWithDpRank::new(1, 0));

    let mut g = c.benchmark_group("select_128_blocks_4_workers");
    g.bench_function("hot", |b| {
        b.iter(|| black_box(router.select(black_box(&req)).unwrap()))
    });
    let mut buf = floor::sweep_buffer();
    let mut after_sweeps =
        |iters: u64, f: &mut dyn FnMut()| floor::after_sweeps(&mut buf, iters, f);
    g.sample_size(30);
    g.bench_function("swept", |b| {
        b.iter_custom(|iters| {
            after_sweeps(iters, &mut || {
                black_box(router.select(black_box(&req)).unwrap());
            })
        })
    });
    // The part of a select that is not the walk: the same request with
    // its first block alone.
    let first = request(&hashes[..1]);
    g.bench_function("swept_1_block", |b| {
        b.iter_custom(|iters| {
            after_sweeps(iters, &mut || {
                black_box(router.select(black_box(&first)).unwrap());
            })
        })
    });
    let (lines, sets) = floor::random_line_sets();
    let mut k = 0usize;
    g.bench_function("swept_floor_128_random_lines_32mib", |b| {
        b.iter_custom(|iters| {
            after_sweeps(iters, &mut || {
                black_box(floor::load_lines(&lines, &sets[k % sets.len()]));
                k += 1;
            })
        })
    });
    g.finish();
    c.final_summary();
}
