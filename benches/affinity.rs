//! Session-affinity table benchmarks: what a select's session part costs
//! as the table fills.
//!
//! Groups, each at a capacity of 1,024 and of 65,536 sessions (the
//! default and the most `session_affinity.max_sessions` allows):
//! - `session_affinity/lookup_hit/N`: a bound session's next turn finds
//!   its worker, over a full table;
//! - `session_affinity/rebind/N`: a bound session's binding is refreshed
//!   after its turn was dispatched, over a full table;
//! - `session_affinity/new_session_when_full/N`: a session the table has
//!   not seen is bound while the table holds `N` live sessions, so one of
//!   them has to go (the ids cycle through twice the capacity, so every
//!   bind is of a session evicted earlier);
//! - `session_affinity_daemon/{bound,new_when_full}_session_select/65536`:
//!   the same through a daemon (the `Server` `kvedge run` runs, in a thread
//!   of this process) over a query channel: a real select round trip of a
//!   session already bound, and of a new session while the daemon's table
//!   holds 65,536 live ones. Each select is finished, untimed, after it.
//!
//! `cargo bench --bench affinity`

#![forbid(unsafe_code)]

mod support;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use kvedge_policies::{AffinityMode, SessionAffinityTable, WorkerWithDpRank};
use kvedge_schema::messages::Role;
use kvedge_wire::{Client, Ids, Select};

const CAPACITIES: [usize; 2] = [1_024, 65_536];
/// Long enough that nothing expires during a run.
const TTL_MS: u64 = 1 << 40;

fn ids(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("conversation-{i:08x}-7d1c"))
        .collect()
}

/// A table of `capacity` sessions, all bound and live at `now` = capacity.
fn full_table(capacity: usize, ids: &[String]) -> SessionAffinityTable {
    let mut t = SessionAffinityTable::new(AffinityMode::Hard, TTL_MS, capacity);
    for (now, id) in ids[..capacity].iter().enumerate() {
        t.bind(id, WorkerWithDpRank::new(now as u64 % 8, 0), now as u64)
            .unwrap();
    }
    assert_eq!(t.len(), capacity);
    t
}

/// Selects (`q` names its session) and finishes the request; returns how
/// long the select's round trip took.
fn select_in(c: &mut Client, q: &Select<'_>) -> Duration {
    let t = Instant::now();
    let id = c.select(q).unwrap().unwrap().request_id;
    let took = t.elapsed();
    c.finish(id).unwrap().unwrap();
    took
}

fn through_the_daemon(c: &mut Criterion) {
    const CAPACITY: usize = kvedge_policies::affinity::MAX_SESSIONS;
    let dir = tempfile::tempdir().unwrap();
    let daemon = kvedge_testkit::Bound::at(
        dir.path().join("run"),
        kvedge_testkit::config("daemon:\n  heartbeat_timeout_ms: 600000\n"),
    )
    .run();
    let _engine = support::engine(&daemon.control(), 1, "http://engine-1", &[]);
    let mut client = Client::connect(daemon.query()).unwrap();
    client.attach_rings().unwrap().unwrap();
    let hashes: Vec<u64> = (1..=128).collect();
    let ids = ids(2 * CAPACITY);
    let mut q = Select::new("m", Role::Aggregated, Ids::hashes(&hashes));
    // The engine is registered before the first select.
    while client.select(&q).unwrap().is_err() {
        std::thread::sleep(Duration::from_millis(1));
    }
    for id in &ids[..CAPACITY] {
        q.session = Some(id);
        select_in(&mut client, &q);
    }
    let mut g = c.benchmark_group("session_affinity_daemon");
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(20);
    let mut i = 0usize;
    g.bench_function(BenchmarkId::new("bound_session_select", CAPACITY), |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| {
                    i = (i + 7919) % CAPACITY;
                    let mut q = q;
                    q.session = Some(&ids[i]);
                    select_in(&mut client, &q)
                })
                .sum()
        })
    });
    let mut next = CAPACITY;
    g.bench_function(
        BenchmarkId::new("new_when_full_session_select", CAPACITY),
        |b| {
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| {
                        next = (next + 1) % ids.len();
                        let mut q = q;
                        q.session = Some(&ids[next]);
                        select_in(&mut client, &q)
                    })
                    .sum()
            })
        },
    );
    g.finish();
    daemon.stop();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("session_affinity");
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(30);
    for capacity in CAPACITIES {
        let ids = ids(2 * capacity);
        let mut t = full_table(capacity, &ids);
        let bound = &ids[..capacity];
        let mut now = capacity as u64;
        let mut i = 0usize;
        g.bench_function(BenchmarkId::new("lookup_hit", capacity), |b| {
            b.iter(|| {
                i = (i + 7919) % capacity;
                black_box(t.lookup(&bound[i], now).unwrap())
            })
        });
        g.bench_function(BenchmarkId::new("rebind", capacity), |b| {
            b.iter(|| {
                i = (i + 7919) % capacity;
                now += 1;
                t.bind(&bound[i], WorkerWithDpRank::new(3, 0), now).unwrap()
            })
        });
        let mut t = full_table(capacity, &ids);
        let mut next = capacity;
        g.bench_function(BenchmarkId::new("new_session_when_full", capacity), |b| {
            b.iter(|| {
                next = (next + 1) % ids.len();
                now += 1;
                t.bind(&ids[next], WorkerWithDpRank::new(5, 0), now)
                    .unwrap()
            })
        });
        assert_eq!(t.len(), capacity);
    }
    g.finish();
    through_the_daemon(&mut c);
    c.final_summary();
}
