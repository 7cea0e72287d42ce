//! Property tests: for any candidate table and request, every shipped policy
//! returns a valid row or a typed error, never a panic; and the cost of the
//! default policy's choice does not depend on row order.

#![forbid(unsafe_code)]

mod common;

use common::*;
use kvedge_policies::{
    AffinityTarget, InputTrigger, SelectionErrorKind, SessionContext, WorkerSelectionContext,
};
use proptest::prelude::*;

const TYPES: [(&str, &str); 13] = [
    ("dynamo-default-cost-fn", "{}"),
    (
        "dynamo-default-cost-fn",
        "{router_temperature: 0.5, overlap_score_credit_decay: 2}",
    ),
    ("least-busy", "{min_device_overlap_blocks: 3}"),
    ("round-robin", "{}"),
    ("random", "{}"),
    ("power-of-two", "{}"),
    ("least-kv-usage", "{}"),
    ("cache-aware", "{}"),
    ("soft-pin", "{max_active_requests: 1}"),
    ("tool-result-cache-local", "{}"),
    ("predicted-ttft", "{}"),
    ("prefill-times-requests", "{}"),
    ("prefill-times-requests", "{min_sharers: 0}"),
];

fn any_worker() -> impl Strategy<Value = W> {
    (
        0u64..40,
        any::<u32>(),
        any::<u32>(),
        0u32..100,
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        (any::<u64>(), any::<u64>()),
        prop_oneof![
            Just(None),
            (0.0f64..10.0).prop_map(Some),
            Just(Some(f64::INFINITY)),
            Just(Some(-1.0)),
        ],
    )
        .prop_map(
            |(id, device, host, active, waiting, prefill, decode, (used, total), taint)| W {
                id,
                device,
                host,
                disk: device / 3,
                active,
                waiting,
                prefill,
                decode,
                kv_used: used,
                kv_total: total,
                taint,
                // A prediction the way the host makes one: work over speed.
                ttft: Some(
                    (prefill as f64 + 16.0 * f64::from(64u32.saturating_sub(device))) / 10_000.0,
                ),
                own: Some(16.0 * f64::from(64u32.saturating_sub(device)) / 10_000.0),
                // Recent selections, as the host counts them: some history.
                recent: Some(f64::from(active) * 1.5),
            },
        )
}

fn small_worker() -> impl Strategy<Value = W> {
    (0u64..1000, 0u32..64, 0u32..20, 0u64..5000, 0u64..200).prop_map(
        |(id, device, active, prefill, decode)| {
            w(id)
                .device(device)
                .active(active)
                .prefill(prefill)
                .decode(decode)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn any_table_gives_a_valid_row_or_a_typed_error(
        rows in prop::collection::vec(any_worker(), 0..24),
        prompt in any::<u32>(),
        block_size in 0u32..64,
        trigger in prop_oneof![Just(InputTrigger::UserMessage), Just(InputTrigger::ToolResult)],
        target in prop::option::of((0u64..40, prop::option::of(0u32..2))),
    ) {
        let t = table(&rows);
        let session = SessionContext::new("s", trigger);
        let mut c = WorkerSelectionContext::new("r", prompt, block_size).with_session(session);
        if let Some((worker_id, dp_rank)) = target {
            c = c.with_affinity_target(AffinityTarget { worker_id, dp_rank });
        }
        for (type_name, params) in TYPES {
            let mut p = policy(type_name, params);
            match p.select(&c, &t).map_err(|e| e.into_kind()) {
                Ok(s) => {
                    prop_assert!(s.row < rows.len());
                    prop_assert_eq!(s.worker, t.worker(s.row));
                    prop_assert!(s.cost.is_finite());
                }
                Err(
                    SelectionErrorKind::NoCandidates
                    | SelectionErrorKind::InvalidContext(_)
                    | SelectionErrorKind::AllRejected { .. }
                    | SelectionErrorKind::InvalidCost { .. }
                    | SelectionErrorKind::NonFiniteTotal { .. },
                ) => {}
                Err(e) => prop_assert!(false, "{type_name}: unexpected {e}"),
            }
        }
    }

    #[test]
    fn default_choice_costs_the_same_whatever_the_row_order(
        rows in prop::collection::vec(small_worker(), 1..40),
        seed in any::<u64>(),
    ) {
        // Identities must be distinct for "the same worker" to mean anything.
        let mut rows = rows;
        for (i, r) in rows.iter_mut().enumerate() {
            r.id = i as u64;
        }
        let c = WorkerSelectionContext::new("r", 512, 16);
        let mut p = policy("dynamo-default-cost-fn", "{}");
        let s = p.select(&c, &table(&rows)).unwrap();
        let mut shuffled = rows.clone();
        shuffle(&mut shuffled, seed | 1);
        let s2 = p.select(&c, &table(&shuffled)).unwrap();
        // Equal-cost rows may be broken either way; the cost may not change.
        prop_assert_eq!(s.cost, s2.cost);
    }
}
