//! Selects as frontends send them: paced at fixed rates and in bursts, not
//! back to back, with an engine publishing in the background, so the
//! daemon sleeps between requests and its caches go cold. For each pace,
//! over the binary socket and over a query channel: the round trip's p50
//! and p99, and the router core's own time per select (the daemon's
//! latency histogram over the timed selects alone, a fresh daemon per
//! row). Beside them, with the same pacing, a kernel socket echo (a thread
//! that reads a frame and writes it back): the floor of a socket round
//! trip with a sleeping peer. And a memory floor: that thread, after each
//! reply, times a read of the same 256 lines (on 32 pages; `--floor-lines
//! N` for N on N / 8) it read at the previous request, about the data a
//! 128-block select reads: what the pause between requests leaves of a
//! request's data, without any code or computation. The selects are dry
//! runs without a session; with `--reserve` they are real (load reserved,
//! a session bound) and each is finished after it, the part of a select
//! that changes state.
//!
//! Not criterion: criterion sizes its samples by the measured time, which a
//! paced loop (mostly waiting) defeats, and reports a mean where these
//! figures are percentiles. Each row times every call on the monotonic
//! clock and sorts the samples.
//!
//! With `--engines N`, N engines publish (the first holds the prompt), as
//! on a node of several GPUs: the daemon then reads N rings. With
//! `--spinning-client` the client spins while it waits
//! (`Client::set_spinning`) instead of blocking; the echo still blocks.
//! With `--flood` the engines publish bursts of single-block stores of
//! new blocks instead, hundreds of thousands a second: the selects then
//! wait for the routing thread's turns of ingest. With `--held N` the
//! first engine first stores N blocks of other prompts, so that the index
//! is the size of a full cache rather than of the few thousand blocks the
//! engines publish during a row.
//!
//! `cargo bench --bench paced [-- --quick] [--reserve] [--spinning-client] [--engines N] [--flood] [--held N] [--floor-lines N] [--only <pace label prefix>] [--spin <µs,...>] [--warm <µs,...>]`

#![forbid(unsafe_code)]

mod floor;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvedge_core::latency::Histogram;
use kvedge_daemon::server::Server;
use kvedge_schema::messages::control::Hello;
use kvedge_schema::messages::{Load, Role, Tier};
use kvedge_testkit::Percentiles;
use kvedge_wire::{Client, Ids, Select};

/// How requests are spaced.
#[derive(Clone, Copy)]
enum Pace {
    /// Back to back.
    Hot,
    /// One every `1 / rate` seconds.
    Rate(u32),
    /// `n` back to back every `every`.
    Burst { n: u32, every: Duration },
}

impl Pace {
    fn label(self) -> String {
        match self {
            Pace::Hot => "hot (back to back)".into(),
            Pace::Rate(r) => format!("{r}/s"),
            Pace::Burst { n, every } => format!("bursts of {n} every {} ms", every.as_millis()),
        }
    }

    /// When request `i` is due, from `start`.
    fn due(self, start: Instant, i: u32) -> Instant {
        match self {
            Pace::Hot => start,
            Pace::Rate(r) => start + Duration::from_secs_f64(f64::from(i) / f64::from(r)),
            Pace::Burst { n, every } => start + every * (i / n),
        }
    }
}

fn wait_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

struct Daemon {
    /// Dropped last: the engines stop before the daemon does.
    running: Option<kvedge_testkit::Running>,
    /// Stops the engines' threads.
    stop: Arc<AtomicBool>,
    latency: Arc<LatencyTap>,
    engines: Vec<std::thread::JoinHandle<()>>,
}

impl Daemon {
    /// A daemon in a thread, and `engines` engines that each publish a
    /// 16-block Stored and a Load every millisecond; the first holds a
    /// 2,048-token prompt.
    fn start(
        name: &str,
        spin_us: u64,
        warm_us: u64,
        engines: u64,
        flood: bool,
        held: u64,
    ) -> (Daemon, Vec<u64>) {
        let stop = Arc::new(AtomicBool::new(false));
        let latency = Arc::new(LatencyTap::default());
        let tap = Arc::clone(&latency);
        let running = kvedge_testkit::Bound::new(
            &format!("paced-{name}"),
            &format!(
                "daemon:\n  heartbeat_timeout_ms: 600000\n  spin_us: {spin_us}\n  warm_us: {warm_us}\n"
            ),
        )
        .run_with(move |server| {
            tap.serve(server);
            false
        });
        let control = running.control();
        let tokens: Vec<u32> = (0..2048).collect();
        let hashes = kvedge_schema::hash::sequence_hashes(&tokens, 16, None, None);
        let engines = (1..=engines.max(1))
            .map(|id| {
                let hello = Hello {
                    kv_blocks: [1 << 20, 0, 0],
                    endpoint: format!("http://engine-{id}"),
                    ..Hello::new(id, "llama")
                };
                let mut p = kvedge_testkit::register(&control, &hello);
                if id == 1 {
                    // Blocks of other prompts first, paced so the ring
                    // never fills (a drop would start a resync).
                    for (i, first) in (0..held).step_by(16).enumerate() {
                        let blocks: Vec<u64> = (first..(first + 16).min(held))
                            .map(|b| (3 << 40) | b)
                            .collect();
                        let push = p
                            .publish_stored_hashes(Tier::Device, None, &blocks)
                            .unwrap();
                        assert!(
                            matches!(push, kvedge_shm::Push::Committed { .. }),
                            "the ring filled while the engine stored its other blocks"
                        );
                        if i % 16 == 15 {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                    p.publish_stored_hashes(Tier::Device, None, &hashes)
                        .unwrap();
                }
                let s = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut next = (1u64 << 40) + (id << 32);
                    while !s.load(Ordering::Relaxed) {
                        if flood {
                            for _ in 0..FLOOD_RECORDS {
                                let _ = p.publish_stored_hashes(Tier::Device, None, &[next]);
                                next += 1;
                            }
                            std::thread::sleep(FLOOD_EVERY);
                            continue;
                        }
                        let blocks: Vec<u64> = (next..next + 16).collect();
                        next += 16;
                        let _ = p.publish_stored_hashes(Tier::Device, None, &blocks);
                        let _ = p.publish_load(&Load::default());
                        std::thread::sleep(Duration::from_millis(1));
                    }
                })
            })
            .collect();
        (
            Daemon {
                running: Some(running),
                stop,
                latency,
                engines,
            },
            hashes,
        )
    }

    fn query(&self) -> PathBuf {
        self.running.as_ref().expect("running").query()
    }

    /// The router core's select latency histogram so far, copied by the
    /// routing thread at its next tick (within 100 ms when idle).
    fn core_latency(&self) -> Histogram {
        self.latency.want.store(true, Ordering::Release);
        loop {
            if let Some(h) = self.latency.got.lock().unwrap().take() {
                return h;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A copy of the daemon's latency histogram, asked for by the bench and
/// made by the routing thread in its tick (a `stats` reply has only the
/// quantiles since start, which the warm-up selects would be part of).
#[derive(Default)]
struct LatencyTap {
    want: AtomicBool,
    got: Mutex<Option<Histogram>>,
}

impl LatencyTap {
    fn serve(&self, server: &Server) {
        if self.want.swap(false, Ordering::Acquire) {
            *self.got.lock().unwrap() = Some(server.core().metrics().select_latency);
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.engines.drain(..) {
            let _ = t.join();
        }
        self.running.take();
    }
}

/// How a row runs: real selects (`--reserve`) or dry runs, a client
/// spinning while it waits (`--spinning-client`) or blocking, engines
/// flooding the daemon meanwhile (`--flood`) or not, and how many other
/// blocks the first engine holds (`--held N`).
#[derive(Clone, Copy)]
struct Mode {
    reserve: bool,
    spinning: bool,
    flood: bool,
    held: u64,
}

/// With `--flood`, each engine publishes this many single-block Stored
/// records back to back ...
const FLOOD_RECORDS: u64 = 1_000;
/// ... and then sleeps this long: about 400,000 records a second each,
/// in bursts the ring holds without dropping.
const FLOOD_EVERY: Duration = Duration::from_millis(2);

/// Sessions the selects of `--reserve` take turns with.
const SESSIONS: usize = 64;

/// One row: `n` paced selects over the socket or a query channel. Dry runs
/// without a session, or with `reserve` real selects, each in one of
/// [`SESSIONS`] sessions and finished (untimed) right after it.
fn selects(
    pace: Pace,
    rings: bool,
    n: u32,
    spin_us: u64,
    warm_us: u64,
    client: Mode,
    engines: u64,
) -> (Duration, Duration, f64, f64) {
    let Mode {
        reserve,
        spinning,
        flood,
        held,
    } = client;
    let name = if rings { "rings" } else { "socket" };
    let (d, hashes) = Daemon::start(name, spin_us, warm_us, engines, flood, held);
    let mut c = Client::connect(d.query()).unwrap();
    c.set_spinning(spinning).unwrap();
    if rings {
        c.attach_rings().unwrap().unwrap();
    }
    let sessions: Vec<String> = (0..SESSIONS).map(|i| format!("session-{i}")).collect();
    let mut q = Select::new("llama", Role::Aggregated, Ids::hashes(&hashes));
    q.dry_run = true;
    // The engine's blocks are in before the clock starts.
    while c.select(&q).unwrap().unwrap().overlap_blocks[0] != 128 {
        std::thread::sleep(Duration::from_millis(1));
    }
    q.dry_run = !reserve;
    let mut select = |c: &mut Client, i: usize| {
        if reserve {
            q.session = Some(&sessions[i % SESSIONS]);
        }
        let t = Instant::now();
        let r = c.select(&q).unwrap().unwrap();
        let took = t.elapsed();
        assert_eq!(r.worker_id, 1);
        let id = r.request_id;
        if reserve {
            c.finish(id).unwrap().unwrap();
        }
        took
    };
    for i in 0..200 {
        select(&mut c, i);
    }
    // The router core's figures are over the timed selects alone: the
    // warm-up's back-to-back selects are in the histogram before.
    let before = d.core_latency();
    let mut samples = Vec::with_capacity(n as usize);
    let start = Instant::now();
    for i in 0..n {
        wait_until(pace.due(start, i));
        samples.push(select(&mut c, i as usize));
    }
    let (p50, p99) = Percentiles::of(samples).p50_p99();
    let core = d.core_latency().since(&before);
    assert_eq!(
        core.count(),
        u64::from(n),
        "one router-core sample per timed select"
    );
    let us = |q: f64| core.quantile_ns(q) as f64 / 1e3;
    (p50, p99, us(0.5), us(0.99))
}

/// Lines the memory floor reads unless `--floor-lines` says otherwise: as
/// many data lines as a 128-block select reads (246 in its memory trace,
/// see `benches/select_cold.rs`), on about as many pages (30).
const FLOOR_LINES: usize = 256;

/// The same `count` lines of a 4 MiB array every time: eight random lines
/// on each of `count / 8` random pages.
fn floor_lines(count: usize) -> (Vec<[u64; 8]>, Vec<u32>) {
    let lines = vec![[1u64; 8]; (4 << 20) / 64];
    let pages = lines.len() as u64 / 64;
    let set = (0..count as u64)
        .map(|j| {
            let page = floor::mix(j / 8) % pages;
            (page * 64 + floor::mix(1 << 32 | j) % 64) as u32
        })
        .collect();
    (lines, set)
}

/// The kernel's floor: a 64-byte frame to a thread that reads it and
/// writes it back, paced the same way. And, timed by that thread after
/// each reply, the memory floor: it reads the same `floor_lines` lines
/// it read at the previous request, so paced, they are what the pause
/// left of them, as a select finds its own data. Returns the echo's round
/// trip and the floor's time, p50 and p99 each.
fn echo(pace: Pace, n: u32, floor_lines: usize) -> ((Duration, Duration), (Duration, Duration)) {
    let (mut a, mut b) = UnixStream::pair().unwrap();
    let warm_up = 200;
    let peer = std::thread::spawn(move || {
        let (lines, set) = self::floor_lines(floor_lines);
        // Room for every sample, so that no copy of a growing vector runs
        // between two reads of the lines.
        let mut floor = Vec::with_capacity(warm_up + n as usize);
        let mut buf = [0u8; 64];
        while b.read_exact(&mut buf).is_ok() {
            if b.write_all(&buf).is_err() {
                break;
            }
            let t = Instant::now();
            std::hint::black_box(floor::load_lines(&lines, std::hint::black_box(&set)));
            floor.push(t.elapsed());
        }
        floor
    });
    let frame = [7u8; 64];
    let mut back = [0u8; 64];
    for _ in 0..warm_up {
        a.write_all(&frame).unwrap();
        a.read_exact(&mut back).unwrap();
    }
    let mut samples = Vec::with_capacity(n as usize);
    let start = Instant::now();
    for i in 0..n {
        wait_until(pace.due(start, i));
        let t = Instant::now();
        a.write_all(&frame).unwrap();
        a.read_exact(&mut back).unwrap();
        samples.push(t.elapsed());
    }
    drop(a);
    let mut floor = peer.join().unwrap();
    // The timed requests' floors, not the warm-up's.
    let timed = floor.split_off(floor.len() - n as usize);
    (
        Percentiles::of(samples).p50_p99(),
        Percentiles::of(timed).p50_p99(),
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--reserve`: real selects (load reserved, a session bound), each
    // finished after it, instead of dry runs.
    let reserve = args.iter().any(|a| a == "--reserve");
    let spinning = args.iter().any(|a| a == "--spinning-client");
    // `--flood`: the engines publish in bursts of single-block stores
    // (new blocks, so the index grows, and evicts once full) instead.
    let flood = args.iter().any(|a| a == "--flood");
    // `--only <label prefix>` runs the matching rows (for profiling one).
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    // `--spin 0,200,1000` and `--warm 0,1000` compare daemon.spin_us and
    // daemon.warm_us settings (default: the shipped ones).
    let list = |flag: &str, default: u64| -> Vec<u64> {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map(|v| {
                v.split(',')
                    .map(|x| x.parse().expect("a list of µs"))
                    .collect()
            })
            .unwrap_or(vec![default])
    };
    let spins = list("--spin", kvedge_config::DEFAULT_SPIN_US);
    let engines = list("--engines", 1)[0];
    let warms = list("--warm", kvedge_config::DEFAULT_WARM_US);
    // `--held N`: the first engine also holds N blocks of other prompts
    // (an index the size of a full cache, not a few thousand blocks).
    let held = list("--held", 0)[0];
    // `--floor-lines N`: the memory floor reads N lines (on N / 8 pages).
    let floor = list("--floor-lines", FLOOR_LINES as u64)[0] as usize;
    let client = Mode {
        reserve,
        spinning,
        flood,
        held,
    };
    // About 2 s per row and at least 1,000 samples, so that a p99 is the
    // tenth slowest (hence 10 s at 100/s; 10/s, 30 s, has a p99 of three
    // samples); --quick halves both (at least 200 samples).
    let paces = [
        (Pace::Hot, 20_000),
        (Pace::Rate(10_000), 20_000),
        (Pace::Rate(1_000), 2_000),
        (Pace::Rate(100), 1_000),
        (Pace::Rate(10), 300),
        (
            Pace::Burst {
                n: 16,
                every: Duration::from_millis(20),
            },
            1_600,
        ),
    ];
    if reserve {
        println!(
            "Selects: real (load reserved, one of {SESSIONS} sessions bound), each finished after it.\n"
        );
    } else {
        println!("Selects: dry runs without a session.\n");
    }
    if flood {
        println!(
            "Engines: {engines}, each publishing {FLOOD_RECORDS} single-block Stored records every {} ms.\n",
            FLOOD_EVERY.as_millis()
        );
    } else {
        println!(
            "Engines: {engines}, each publishing a 16-block Stored and a Load every millisecond.\n"
        );
    }
    if held > 0 {
        println!("The first engine also holds {held} blocks of other prompts.\n");
    }
    if spinning {
        println!("Clients: spinning while they wait (the echo blocks).\n");
    }
    println!(
        "| pace | path | spin | warm | round trip p50 | p99 | router core p50 | p99 | kernel echo p50 | p99 | memory floor p50 | p99 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (pace, n) in paces {
        if only
            .as_ref()
            .is_some_and(|o| !pace.label().starts_with(o.as_str()))
        {
            continue;
        }
        let n = if quick { (n / 2).max(200) } else { n };
        let ((e50, e99), (f50, f99)) = echo(pace, n, floor);
        for rings in [false, true] {
            for (&spin, &warm) in spins.iter().flat_map(|s| warms.iter().map(move |w| (s, w))) {
                let (p50, p99, c50, c99) = selects(pace, rings, n, spin, warm, client, engines);
                println!(
                    "| {} | {} | {spin} µs | {warm} µs | {:.1} µs | {:.1} µs | {c50:.2} µs | {c99:.2} µs | {:.1} µs | {:.1} µs | {:.2} µs | {:.2} µs |",
                    pace.label(),
                    if rings { "query channel" } else { "socket" },
                    p50.as_secs_f64() * 1e6,
                    p99.as_secs_f64() * 1e6,
                    e50.as_secs_f64() * 1e6,
                    e99.as_secs_f64() * 1e6,
                    f50.as_secs_f64() * 1e6,
                    f99.as_secs_f64() * 1e6,
                );
            }
        }
    }
}
