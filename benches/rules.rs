//! Rule-language decision cost: ten rules of which only the last matches,
//! 64 local candidates and 4 providers, one exclude and a PredictedTTFT
//! tier (target: at most 1 µs per decision, zero allocations; the
//! allocation half is proven by `policies/tests/rules.rs`).
//!
//! `cargo bench --bench rules`

#![forbid(unsafe_code)]

use std::hint::black_box;
use std::time::Duration;

use criterion::Criterion;
use kvedge_policies::WorkerWithDpRank;
use kvedge_policies::rules::{RuleCandidate, RuleEngine, RuleRequest, load};

fn policy_yaml() -> String {
    let mut y = String::from("policy:\n  rules:\n");
    for i in 0..9 {
        y.push_str(&format!(
            "    - name: tenant-{i}\n      matches:\n        - {{ tenant: t{i}, tag: [pii-confirmed, pii-unknown] }}\n        - {{ tenant: t{i}x }}\n      route:\n        select: [{{ type: Local, minimize: PredictedTTFT }}]\n"
        ));
    }
    y.push_str(
        "    - name: default
      route:
        consider:
          - models: { names: [llama-70b] }
          - providers: {}
        exclude:
          - drop: { kvUsage: { greaterThan: 0.9 } }
        select:
          - { type: Local, minimize: PredictedTTFT }
          - { type: Provider, order: [p0, p1, p2, p3] }
        tieBreak: PreferLocal
providers:
  - { name: p0, models: [llama-70b], endpoint: 'https://p0' }
  - { name: p1, models: [llama-70b], endpoint: 'https://p1' }
  - { name: p2, models: [llama-70b], endpoint: 'https://p2' }
  - { name: p3, models: [llama-70b], endpoint: 'https://p3' }
",
    );
    y
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let mut engine = RuleEngine::new(load(&policy_yaml()).unwrap());
    let mut candidates: Vec<RuleCandidate<'static>> = (0..64u64)
        .map(|i| {
            let mut c = RuleCandidate::local("llama-70b", WorkerWithDpRank::new(i, 0));
            c.active_prefill_tokens = Some(i * 97 % 4096);
            c.device_overlap_blocks = Some((i % 32) as u32 * 4);
            c.waiting_requests = Some((i % 5) as u32);
            c.active_requests = Some((i % 17) as u32);
            c.kv_usage = Some((i % 100) as f64 / 100.0);
            c
        })
        .collect();
    for name in ["p0", "p1", "p2", "p3"] {
        candidates.push(RuleCandidate::provider(name, "llama-70b"));
    }
    let tags = ["complexity-medium"];
    let request = RuleRequest {
        model: "llama-70b",
        tenant: Some("acme"),
        role: None,
        prompt_tokens: 2048,
        block_size: 16,
        session_id: None,
        priority: 0,
        headers: None,
        tags: &tags,
        selection: None,
        pinned: None,
    };
    let d = engine.decide(&request, &candidates);
    assert_eq!(d.rule, Some(9), "the last rule decides");
    let mut g = c.benchmark_group("rules");
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("ten_rules_last_matches_64_local_4_providers", |b| {
        b.iter(|| black_box(engine.decide(black_box(&request), black_box(&candidates))))
    });
    g.finish();
    c.final_summary();
}
