//! The machine's floors that the latency benches measure beside kvedge, so
//! that a figure can be read against what this host charges for the bare
//! work on the same day: loads of random cache lines, independent of each
//! other, with nothing else to do; and the sweep that evicts the caches
//! before a "swept" row. Each bench uses the part it needs.

#![allow(dead_code)]

use std::hint::black_box;
use std::time::{Duration, Instant};

/// Deterministic, well-mixed 64-bit values (splitmix64).
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The cold floors' array, 32 MiB (the size of a million-block index's
/// tables), and 4,096 sets of 128 random lines of it, to be taken in turn.
pub fn random_line_sets() -> (Vec<[u64; 8]>, Vec<[u32; 128]>) {
    let lines: Vec<[u64; 8]> = vec![[1; 8]; (32 << 20) / 64];
    let sets = (0..4096u64)
        .map(|r| std::array::from_fn(|i| (mix(r << 8 | i as u64) % lines.len() as u64) as u32))
        .collect();
    (lines, sets)
}

/// The floor's work: one load from each line of `set`, independent of
/// each other.
pub fn load_lines(lines: &[[u64; 8]], set: &[u32]) -> u64 {
    set.iter()
        .fold(0u64, |acc, &i| acc.wrapping_add(lines[i as usize][0]))
}

/// What a sweep writes: 64 MiB, twice the last-level cache.
pub fn sweep_buffer() -> Vec<u64> {
    vec![0; (64 << 20) / 8]
}

/// Writes a word of every line of `buf`, so that what runs next finds its
/// code, its data and the page tables out of the caches, as after a sleep
/// among busy neighbours.
pub fn sweep(buf: &mut [u64], round: u64) {
    for x in buf.iter_mut().step_by(8) {
        *x = x.wrapping_add(round);
    }
    black_box(&buf);
}

/// `iters` runs of `f`, each after a sweep of `buf`; the time of the runs
/// alone (criterion's `iter_custom`).
pub fn after_sweeps(buf: &mut [u64], iters: u64, f: &mut dyn FnMut()) -> Duration {
    let mut took = Duration::ZERO;
    for round in 0..iters {
        sweep(buf, round);
        let t = Instant::now();
        f();
        took += t.elapsed();
    }
    took
}
