//! After warm-up a selection allocates nothing, for every shipped policy
//! (with and without filters that remove rows, at temperature 0 and above),
//! and so do the session-affinity lookups and binds around it.

#![forbid(unsafe_code)]

mod common;

use common::*;
use kvedge_policies::{
    AffinityMode, InputTrigger, SessionAffinityTable, SessionContext, WorkerSelectionContext,
};

const TYPES: [(&str, &str); 14] = [
    ("dynamo-default-cost-fn", "{}"),
    ("dynamo-default-cost-fn", "{router_temperature: 0.7}"),
    (
        "dynamo-default-cost-fn",
        "{overlap_score_credit_decay: 1.0}",
    ),
    ("least-busy", "{min_device_overlap_blocks: 2}"),
    ("round-robin", "{}"),
    ("random", "{}"),
    ("power-of-two", "{}"),
    ("least-kv-usage", "{}"),
    ("cache-aware", "{}"),
    ("soft-pin", "{max_active_requests: 3}"),
    ("tool-result-cache-local", "{}"),
    ("predicted-ttft", "{}"),
    ("prefill-times-requests", "{}"),
    ("prefill-times-requests", "{min_sharers: 0}"),
];

fn rows(n: u64) -> Vec<W> {
    (0..n)
        .map(|i| {
            w(i).device((i % 5) as u32)
                .active((i % 7) as u32)
                .prefill(i * 16)
                .decode(i % 11)
                .kv(i % 50, 100)
                .ttft((i % 13) as f64 * 0.1)
        })
        .collect()
}

#[test]
fn warm_selections_allocate_nothing() {
    let t = table(&rows(64));
    let session = SessionContext::new("session-1", InputTrigger::ToolResult);
    for (type_name, params) in TYPES {
        let mut p = policy(type_name, params);
        let c = WorkerSelectionContext::new("r", 2048, 16).with_session(session);
        for _ in 0..3 {
            p.select(&c, &t).unwrap();
        }
        let info = allocation_counter::measure(|| {
            for _ in 0..100 {
                std::hint::black_box(p.select(&c, &t).unwrap());
                // A warm-up between selects (the picker's `warm` copies and
                // restores its state) allocates nothing either.
                p.warm(&c, &t);
            }
        });
        assert_eq!(info.count_total, 0, "{type_name} {params}: {info:?}");
    }
}

#[test]
fn smaller_tables_after_a_larger_one_allocate_nothing() {
    let big = table(&rows(256));
    let small = table(&rows(10));
    let mut p = policy("least-busy", "{min_device_overlap_blocks: 1}");
    let c = WorkerSelectionContext::new("r", 2048, 16);
    p.select(&c, &big).unwrap();
    let info = allocation_counter::measure(|| {
        for _ in 0..50 {
            p.select(&c, &small).unwrap();
            p.select(&c, &big).unwrap();
        }
    });
    assert_eq!(info.count_total, 0);
}

#[test]
fn affinity_lookups_and_binds_allocate_nothing() {
    let t = table(&rows(8));
    let mut affinity = SessionAffinityTable::new(AffinityMode::Soft, 1_000, 4);
    let mut p = policy("soft-pin", "{max_active_requests: 3}");
    let ids = ["a", "b", "c", "d", "e", "f"];
    // Warm-up: the policy's buffers reach the table's size.
    p.select(&WorkerSelectionContext::new("r", 64, 16), &t)
        .unwrap();
    let info = allocation_counter::measure(|| {
        for (now, id) in ids.iter().cycle().take(600).enumerate() {
            let session = SessionContext::new(id, InputTrigger::UserMessage);
            let c = WorkerSelectionContext::new("r", 64, 16)
                .with_session(session)
                .with_now_ms(now as u64);
            let c = affinity.apply(c).unwrap();
            let s = p.select(&c, &t).unwrap();
            affinity.bind(id, s.worker, now as u64).unwrap();
        }
    });
    assert_eq!(info.count_total, 0, "{info:?}");
    assert_eq!(
        affinity.len(),
        4,
        "capacity holds with six sessions cycling"
    );
}

#[test]
fn rebinding_the_same_sessions_for_long_allocates_nothing() {
    // Every rebind leaves its old place in the table's bind order behind
    // and takes a new one; 20,000 binds go around its ring of 130 places
    // about 150 times.
    let mut affinity = SessionAffinityTable::new(AffinityMode::Hard, 1_000, 64);
    let w = kvedge_policies::WorkerWithDpRank::new(1, 0);
    let ids: Vec<String> = (0..48).map(|i| format!("session-{i}")).collect();
    let info = allocation_counter::measure(|| {
        for (now, id) in ids.iter().cycle().take(20_000).enumerate() {
            affinity.bind(id, w, now as u64).unwrap();
        }
    });
    assert_eq!(info.count_total, 0, "{info:?}");
    // A reload to a larger capacity reserves for it; binds after it (and
    // their eviction once full) do not allocate.
    affinity.reconfigure(AffinityMode::Hard, 1_000, 4_096);
    let ids: Vec<String> = (0..8_192).map(|i| format!("new-session-{i}")).collect();
    let info = allocation_counter::measure(|| {
        for (i, id) in ids.iter().enumerate() {
            affinity.bind(id, w, 20_000 + i as u64).unwrap();
        }
    });
    assert_eq!(info.count_total, 0, "{info:?}");
    assert_eq!(affinity.len(), 4_096);
}

#[test]
fn new_sessions_evicting_others_for_long_allocate_nothing() {
    // Capacities whose map would be more than half full: under churn its
    // removals leave tombstones, and a map out of room grows.
    for capacity in [1_500, 3_000, 5_000] {
        let mut affinity = SessionAffinityTable::new(AffinityMode::Hard, 1 << 40, capacity);
        let w = kvedge_policies::WorkerWithDpRank::new(1, 0);
        let ids: Vec<String> = (0..3 * capacity).map(|i| format!("s-{i}")).collect();
        for id in &ids[..capacity] {
            affinity.bind(id, w, 0).unwrap();
        }
        let info = allocation_counter::measure(|| {
            for (now, id) in ids.iter().cycle().take(60_000).enumerate() {
                affinity.bind(id, w, now as u64).unwrap();
            }
        });
        assert_eq!(info.count_total, 0, "capacity {capacity}: {info:?}");
        assert_eq!(affinity.len(), capacity);
    }
}
