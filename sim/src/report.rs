//! The figures of one run: per-request outcomes in, one [`Summary`] row
//! out (prefix hit rate, TTFT and end-to-end percentiles, throughput, load
//! imbalance, router time), and the table that `kvedge sim` and
//! `kvedge demo` print.

use serde::Serialize;

/// What happened to one request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outcome {
    pub arrival_us: u64,
    pub first_token_us: u64,
    pub finish_us: u64,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub output_tokens: u32,
}

/// Time-weighted active requests per worker: call [`observe`] whenever a
/// worker's count changes.
///
/// [`observe`]: LoadIntegral::observe
#[derive(Clone, Debug, Default)]
pub struct LoadIntegral {
    /// Per worker: (last change, count since, integral in request·µs).
    workers: Vec<(u64, u32, f64)>,
}

impl LoadIntegral {
    pub fn new(workers: usize) -> Self {
        LoadIntegral {
            workers: vec![(0, 0, 0.0); workers],
        }
    }
    pub fn observe(&mut self, worker: usize, now_us: u64, active: u32) {
        let w = &mut self.workers[worker];
        w.2 += f64::from(w.1) * now_us.saturating_sub(w.0) as f64;
        *w = (now_us.max(w.0), active, w.2);
    }
    /// Max over mean of the time-averaged active requests, up to `end_us`;
    /// 1.0 is perfect balance.
    pub fn imbalance(&self, end_us: u64) -> f64 {
        let totals: Vec<f64> = self
            .workers
            .iter()
            .map(|&(t, n, i)| i + f64::from(n) * end_us.saturating_sub(t) as f64)
            .collect();
        let mean = totals.iter().sum::<f64>() / totals.len().max(1) as f64;
        let max = totals.iter().copied().fold(0.0, f64::max);
        if mean > 0.0 { max / mean } else { 1.0 }
    }
    /// Time-averaged active requests of each worker, up to `end_us`.
    pub fn averages(&self, end_us: u64) -> Vec<f64> {
        self.workers
            .iter()
            .map(|&(t, n, i)| {
                (i + f64::from(n) * end_us.saturating_sub(t) as f64) / end_us.max(1) as f64
            })
            .collect()
    }
}

/// One row of the table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub policy: String,
    pub requests: usize,
    /// Cached prompt tokens / prompt tokens.
    pub hit_rate: f64,
    /// `hit_rate` over the oracle's.
    pub oracle_fraction: f64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p90: f64,
    pub ttft_ms_p99: f64,
    pub e2e_ms_p50: f64,
    pub e2e_ms_p99: f64,
    /// Output tokens per second of virtual (or wall) time.
    pub output_tokens_per_s: f64,
    pub requests_per_s: f64,
    /// Max over mean of time-averaged active requests per worker.
    pub load_imbalance: f64,
    /// Router (select) time per request, mean, microseconds of real time.
    pub router_us_mean: f64,
    pub router_us_p99: f64,
}

/// The `q`-quantile (0..=1) of sorted `v`, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Summarises a run.
pub fn summarise(
    policy: &str,
    outcomes: &[Outcome],
    oracle_hit_rate: f64,
    load: &LoadIntegral,
    router_ns: &[u64],
) -> Summary {
    let start = outcomes.iter().map(|o| o.arrival_us).min().unwrap_or(0);
    let end = outcomes.iter().map(|o| o.finish_us).max().unwrap_or(0);
    let span_s = (end.saturating_sub(start)) as f64 / 1e6;
    let prompt: u64 = outcomes.iter().map(|o| u64::from(o.prompt_tokens)).sum();
    let cached: u64 = outcomes.iter().map(|o| u64::from(o.cached_tokens)).sum();
    let output: u64 = outcomes.iter().map(|o| u64::from(o.output_tokens)).sum();
    let ttft = sorted(
        outcomes
            .iter()
            .map(|o| o.first_token_us.saturating_sub(o.arrival_us) as f64 / 1e3)
            .collect(),
    );
    let e2e = sorted(
        outcomes
            .iter()
            .map(|o| o.finish_us.saturating_sub(o.arrival_us) as f64 / 1e3)
            .collect(),
    );
    let router = sorted(router_ns.iter().map(|&n| n as f64 / 1e3).collect());
    let hit_rate = if prompt > 0 {
        cached as f64 / prompt as f64
    } else {
        0.0
    };
    Summary {
        policy: policy.into(),
        requests: outcomes.len(),
        hit_rate,
        oracle_fraction: if oracle_hit_rate > 0.0 {
            hit_rate / oracle_hit_rate
        } else {
            1.0
        },
        ttft_ms_p50: quantile(&ttft, 0.5),
        ttft_ms_p90: quantile(&ttft, 0.9),
        ttft_ms_p99: quantile(&ttft, 0.99),
        e2e_ms_p50: quantile(&e2e, 0.5),
        e2e_ms_p99: quantile(&e2e, 0.99),
        output_tokens_per_s: if span_s > 0.0 {
            output as f64 / span_s
        } else {
            0.0
        },
        requests_per_s: if span_s > 0.0 {
            outcomes.len() as f64 / span_s
        } else {
            0.0
        },
        load_imbalance: load.imbalance(end),
        // Not measured (a run without access to the router): NaN, shown as
        // "-" in the table and null in JSON.
        router_us_mean: if router.is_empty() {
            f64::NAN
        } else {
            router.iter().sum::<f64>() / router.len() as f64
        },
        router_us_p99: quantile(&router, 0.99),
    }
}

/// The table, one row per policy, with the oracle bound underneath.
pub fn table(rows: &[Summary], oracle_hit_rate: f64) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    // The policy column fits the longest name (at least 24).
    let w = rows
        .iter()
        .map(|r| r.policy.chars().count())
        .max()
        .unwrap_or(0)
        .max(24);
    let _ = writeln!(
        s,
        "{:<w$} {:>8} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9}",
        "policy",
        "requests",
        "hit %",
        "oracle%",
        "ttft p50",
        "ttft p90",
        "ttft p99",
        "e2e p50",
        "e2e p99",
        "out tok/s",
        "imbal.",
        "router µs"
    );
    for r in rows {
        let router = if r.router_us_mean.is_nan() {
            "-".to_owned()
        } else {
            format!("{:.2}", r.router_us_mean)
        };
        let _ = writeln!(
            s,
            "{:<w$} {:>8} {:>7.1} {:>7.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.0} {:>8.2} {:>9}",
            r.policy,
            r.requests,
            r.hit_rate * 100.0,
            r.oracle_fraction * 100.0,
            r.ttft_ms_p50,
            r.ttft_ms_p90,
            r.ttft_ms_p99,
            r.e2e_ms_p50,
            r.e2e_ms_p99,
            r.output_tokens_per_s,
            r.load_imbalance,
            router
        );
    }
    let _ = writeln!(
        s,
        "oracle (unlimited shared cache): hit {:.1} %   (times in ms; imbal. = max/mean time-averaged active requests)",
        oracle_hit_rate * 100.0
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 5.0);
        assert_eq!(quantile(&v, 0.9), 9.0);
        assert_eq!(quantile(&v, 0.99), 10.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
    }

    #[test]
    fn imbalance_weights_by_time() {
        let mut l = LoadIntegral::new(2);
        // Worker 0: 2 active for 10 µs; worker 1: 1 active for 10 µs.
        l.observe(0, 0, 2);
        l.observe(1, 0, 1);
        l.observe(0, 10, 0);
        l.observe(1, 10, 0);
        // Means 2 and 1 (over 10 µs): max/mean = 2 / 1.5.
        assert!((l.imbalance(10) - 2.0 / 1.5).abs() < 1e-12);
        assert_eq!(l.averages(10), vec![2.0, 1.0]);
    }
}
