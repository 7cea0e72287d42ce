//! The configuration loader under hostile input, as property tests (the
//! same entry point as the cargo-fuzz target `config_loader`): arbitrary
//! bytes, and YAML assembled from fragments of real configurations,
//! values out of range, deep nesting and aliases. Every input must end in
//! a configuration or an error, never a panic.

#![forbid(unsafe_code)]

use kvedge_config::fuzzing::load_hostile_config;
use proptest::prelude::*;

/// Pieces of configurations, good and bad, for the loader to meet in any
/// order and nesting.
const FRAGMENTS: &[&str] = &[
    "daemon:\n",
    "  ring_capacity: 65536\n",
    "  heartbeat_timeout_ms: 0\n",
    "  max_frame_bytes: 18446744073709551615\n",
    "  runtime_dir_mode: \"0777\"\n",
    "  index_capacity: -1\n",
    "router:\n  overlap_score_credit: .nan\n",
    "session_affinity: { mode: soft, ttl_ms: 1000 }\n",
    "worker_selection:\n  aggregated: lb\n  instances:\n    - name: lb\n      type: least-busy\n",
    "policy:\n  rules:\n    - name: r\n      route:\n        select:\n          - { type: Provider, order: [a] }\n",
    "providers:\n  - name: a\n    models: [m]\n    endpoint: http://a\n",
    "providers:\n  - name: ''\n    models: []\n    endpoint: x\n",
    "classifiers:\n  length: { low: 10, high: 5 }\n  regex:\n    patterns:\n      pii: '(unclosed'\n",
    "ttft: { prefill_tokens_per_second: 0, queue_wait_per_request: 5parsecs }\n",
    "engines:\n  - kind: vllm\n    model: m\n    worker_id: 1\n    endpoint: tcp://127.0.0.1:5557\n",
    "log: { level: 'not a filter[' }\n",
    "metrics: { listen: nowhere }\n",
    "x: &a [1, 2, *a]\n",
    "[[[[[[[[[[[[[[[[",
    "]]]]]]]]",
    "{ a: { b: { c: ",
    "'unterminated\n",
    "\"\\u00e9\\t\"\n",
    "# a comment\n",
    "- - - - -\n",
    "    ",
    "\t",
    ":\n",
];

fn assembled() -> impl Strategy<Value = String> {
    proptest::collection::vec(0..FRAGMENTS.len(), 0..12)
        .prop_map(|picks| picks.into_iter().map(|i| FRAGMENTS[i]).collect())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = load_hostile_config(&bytes);
    }

    #[test]
    fn assembled_configurations_load_or_fail_cleanly(text in assembled()) {
        match load_hostile_config(text.as_bytes()) {
            Ok(_) => {}
            // Every error names a line or says what is wrong with the file.
            Err(e) => prop_assert!(!e.is_empty()),
        }
    }
}

#[test]
fn deep_nesting_and_alias_bombs_are_refused_quickly() {
    let deep = format!(
        "policy: {}{}\n",
        "[".repeat(1_000_000),
        "]".repeat(1_000_000)
    );
    assert!(
        load_hostile_config(deep.as_bytes())
            .unwrap_err()
            .contains("nested")
    );
    let mut bomb = String::from("ttft:\n");
    bomb.push_str("  a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..10 {
        let refs = vec![format!("*a{}", i - 1); 10].join(", ");
        bomb.push_str(&format!("  a{i}: &a{i} [{refs}]\n"));
    }
    let e = load_hostile_config(bomb.as_bytes()).unwrap_err();
    assert!(e.contains("line"), "{e}");
}
