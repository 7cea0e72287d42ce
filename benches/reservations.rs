//! The load table's reservations under churn: one reservation nobody
//! releases (a frontend that forgot to finish), then a steady state of
//! `live` outstanding ones where every step reserves a new request,
//! finishes the oldest and runs the expiry, as the routing loop does. Each
//! operation is timed on its own, and the percentiles, the tenth slowest
//! and the slowest are reported, since the cost that matters here is the
//! rare one (a sweep of the whole queue would show only there). On a
//! shared machine the slowest is often the host's doing; the tenth slowest
//! is what recurs.
//!
//! Not criterion: criterion reports a mean, which an occasional long
//! pause hardly moves. The clock reads add about 20-30 ns to each figure.
//!
//! `cargo bench --bench reservations [-- --quick]`

#![forbid(unsafe_code)]

use std::time::Instant;

use kvedge_core::index::Slot;
use kvedge_core::load::LoadTable;

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let steps: u64 = if quick { 100_000 } else { 400_000 };
    println!("{steps} steps per row; ns per operation.\n");
    println!("| outstanding | operation | p50 | p99 | p99.99 | 10th slowest | slowest |");
    println!("|---|---|---|---|---|---|---|");
    for live in [1_000u64, 10_000, 100_000] {
        let mut t = LoadTable::new(600_000);
        let slot = Slot::new(0).unwrap();
        t.reserve(u64::MAX, slot, 1, 1, 0, 0.0, 0.0);
        let mut id = 1;
        for _ in 0..live {
            t.reserve(id, slot, 1, 1, 0, 0.0, 0.0);
            id += 1;
        }
        let mut times = [const { Vec::new() }; 3];
        for step in 0..steps {
            let now = 1 + step / 100;
            let t0 = Instant::now();
            t.reserve(id, slot, 1, 1, now, 0.0, 0.0);
            let t1 = Instant::now();
            t.finish(id - live).unwrap();
            let t2 = Instant::now();
            t.expire(now);
            let t3 = Instant::now();
            for (v, d) in times.iter_mut().zip([t1 - t0, t2 - t1, t3 - t2]) {
                v.push(d.as_nanos() as u64);
            }
            id += 1;
        }
        assert_eq!(t.reservations() as u64, live + 1);
        for (name, mut v) in ["reserve", "finish", "expire"].into_iter().zip(times) {
            v.sort_unstable();
            let n = v.len();
            println!(
                "| {live} | {name} | {} | {} | {} | {} | {} |",
                v[n / 2],
                v[n * 99 / 100],
                v[n * 9999 / 10000],
                v[n - 10],
                v[n - 1]
            );
        }
    }
}
