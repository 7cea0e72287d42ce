//! One focused test per decision of each shipped policy, through the same
//! YAML -> registry -> factory path an operator uses.

#![forbid(unsafe_code)]

mod common;

use common::*;
use kvedge_policies::{
    AffinityMode, AffinityTarget, InputTrigger, RouterConfig, SessionAffinityTable, SessionContext,
    WorkerSelectionContext, WorkerType, WorkerWithDpRank,
};

fn ctx(prompt_tokens: u32) -> WorkerSelectionContext<'static> {
    WorkerSelectionContext::new("req", prompt_tokens, 16)
}

fn pick(
    p: &mut kvedge_policies::WorkerSelectionPolicy,
    c: &WorkerSelectionContext<'_>,
    rows: &[W],
) -> u64 {
    p.select(c, &table(rows)).unwrap().worker.worker_id
}

// ---- dynamo-default-cost-fn ----

#[test]
fn default_cost_trades_overlap_against_decode_load() {
    // Seed 000's worked example: 10 prompt blocks each; device overlap 2/5/8;
    // decode load 10/5/9. Costs (10-2)+(10+10), (10-5)+(5+10), (10-8)+(9+10).
    let mut p = policy("dynamo-default-cost-fn", "{}");
    let rows = [
        w(1).device(2).decode(10),
        w(2).device(5).decode(5),
        w(3).device(8).decode(9),
    ];
    let s = p.select(&ctx(160), &table(&rows)).unwrap();
    assert_eq!((s.worker.worker_id, s.cost), (2, 20.0));
}

#[test]
fn default_cost_credits_host_and_disk_tiers_at_their_weights() {
    // 10 prompt blocks. Worker 1: 8 host blocks (credit 6); worker 2: 8 disk
    // blocks (credit 2); worker 3: 5 device blocks (credit 5).
    let mut p = policy("dynamo-default-cost-fn", "{}");
    let rows = [w(1).host(8), w(2).disk(8), w(3).device(5)];
    let s = p.select(&ctx(160), &table(&rows)).unwrap();
    assert_eq!((s.worker.worker_id, s.cost), (1, 4.0 + 10.0));
    let mut heavy_disk = policy("dynamo-default-cost-fn", "{disk_cache_hit_weight: 1.0}");
    assert_eq!(pick(&mut heavy_disk, &ctx(160), &rows), 2);
}

#[test]
fn default_cost_prefill_backlog_and_scale() {
    // Same overlap; worker 2 carries 160 tokens of prefill backlog (10 blocks).
    let mut p = policy("dynamo-default-cost-fn", "{prefill_load_scale: 2.0}");
    let rows = [w(1).prefill(160).decode(0), w(2).decode(15)];
    // worker 1: 2*(10+10) + 10 = 50; worker 2: 2*10 + 25 = 45.
    let s = p.select(&ctx(160), &table(&rows)).unwrap();
    assert_eq!((s.worker.worker_id, s.cost), (2, 45.0));
}

#[test]
fn default_cost_decay_halves_credit_at_one_request_of_excess_prefill() {
    // Worker 1: 8 device blocks but 10 blocks (one request) of excess prefill;
    // decay 1 halves its credit to 4. Worker 2: no overlap, no backlog.
    let rows = [w(1).device(8).prefill(160), w(2)];
    let mut decayed = policy(
        "dynamo-default-cost-fn",
        "{overlap_score_credit_decay: 1.0}",
    );
    let s = decayed.select(&ctx(160), &table(&rows)).unwrap();
    // worker 1: (20 - 4) + 10 = 26; worker 2: 10 + 10 = 20.
    assert_eq!((s.worker.worker_id, s.cost), (2, 20.0));
    let mut plain = policy("dynamo-default-cost-fn", "{}");
    // Without decay worker 1 costs (20 - 8) + 10 = 22: still 2, so shrink the backlog.
    let rows = [w(1).device(8).prefill(48), w(2)];
    // plain: (13 - 8) + 10 = 15 < 20 -> 1; decayed: excess 0.3 req -> credit 8/1.3.
    assert_eq!(pick(&mut plain, &ctx(160), &rows), 1);
    let s = decayed.select(&ctx(160), &table(&rows)).unwrap();
    assert_eq!(s.worker.worker_id, 1);
    assert!(
        (s.cost - ((13.0 - 8.0 / 1.3) + 10.0)).abs() < 1e-9,
        "{}",
        s.cost
    );
}

#[test]
fn default_cost_applies_the_preferred_taint_multiplier() {
    let mut p = policy("dynamo-default-cost-fn", "{}");
    let rows = [w(1).taint(3.0), w(2).decode(15)];
    // worker 1: (10 + 10) * 3 = 60; worker 2: 10 + 25 = 35.
    let s = p.select(&ctx(160), &table(&rows)).unwrap();
    assert_eq!((s.worker.worker_id, s.cost), (2, 35.0));
}

#[test]
fn default_cost_decode_pool_without_prefill_tracking_prefers_cache_hot_workers() {
    let router = RouterConfig {
        track_prefill_tokens: false,
        ..RouterConfig::default()
    };
    let mut p = policy_for(
        "dynamo-default-cost-fn",
        "{}",
        WorkerType::Decode,
        router.clone(),
    );
    assert!(
        p.required_worker_inputs()
            .contains(kvedge_policies::WorkerInputs::CACHE)
    );
    let rows = [w(1).device(9).decode(5), w(2).decode(2)];
    // worker 1: max(15 - 9, 0) = 6; worker 2: 12.
    let s = p.select(&ctx(160), &table(&rows)).unwrap();
    assert_eq!((s.worker.worker_id, s.cost), (1, 6.0));
    // Plain disaggregated decode (no credit): no cache input at all.
    let plain = policy_for(
        "dynamo-default-cost-fn",
        "{overlap_score_credit: 0, host_cache_hit_weight: 0, disk_cache_hit_weight: 0}",
        WorkerType::Decode,
        router,
    );
    assert!(
        !plain
            .required_worker_inputs()
            .contains(kvedge_policies::WorkerInputs::CACHE)
    );
}

#[test]
fn default_cost_breaks_exact_ties_randomly_but_reproducibly() {
    let rows = [w(1), w(2), w(3)];
    let run = || {
        let mut p = policy("dynamo-default-cost-fn", "{seed: 42}");
        (0..200)
            .map(|_| pick(&mut p, &ctx(160), &rows))
            .collect::<Vec<_>>()
    };
    let a = run();
    assert_eq!(a, run(), "same seed, same decisions");
    for id in 1..=3 {
        let n = a.iter().filter(|&&x| x == id).count();
        assert!((40..=95).contains(&n), "worker {id} chosen {n}/200");
    }
    let mut other = policy("dynamo-default-cost-fn", "{seed: 43}");
    let b: Vec<_> = (0..200)
        .map(|_| pick(&mut other, &ctx(160), &rows))
        .collect();
    assert_ne!(a, b, "another seed, another stream");
}

#[test]
fn default_cost_softmax_samples_in_proportion_to_exp_of_normalised_cost() {
    // Costs 20 and 21 (range 1); T = 1: p(first) = 1 / (1 + e^-1) = 0.7311.
    let mut p = policy(
        "dynamo-default-cost-fn",
        "{router_temperature: 1.0, seed: 7}",
    );
    let rows = [w(1), w(2).decode(1)];
    let n = 20_000;
    let first = (0..n)
        .filter(|_| pick(&mut p, &ctx(160), &rows) == 1)
        .count();
    let share = first as f64 / n as f64;
    assert!((share - 0.7311).abs() < 0.015, "{share}");
    // Equal costs: uniform.
    let even = [w(1), w(2)];
    let first = (0..n)
        .filter(|_| pick(&mut p, &ctx(160), &even) == 1)
        .count();
    assert!((first as f64 / n as f64 - 0.5).abs() < 0.015);
}

#[test]
fn default_cost_softmax_matches_the_exact_distribution_over_three_rows() {
    // Costs 20, 20.5, 21 via decode 0/0.5... decode is whole blocks, so use
    // a range of 2: costs 20, 21, 22 and T = 0.5 -> weights 1, e^-1, e^-2.
    let mut p = policy(
        "dynamo-default-cost-fn",
        "{router_temperature: 0.5, seed: 11}",
    );
    let rows = [w(1), w(2).decode(1), w(3).decode(2)];
    let n = 30_000;
    let mut counts = [0usize; 3];
    for _ in 0..n {
        counts[(pick(&mut p, &ctx(160), &rows) - 1) as usize] += 1;
    }
    let z = 1.0 + (-1.0f64).exp() + (-2.0f64).exp();
    let expected = [1.0 / z, (-1.0f64).exp() / z, (-2.0f64).exp() / z];
    for k in 0..3 {
        let share = counts[k] as f64 / n as f64;
        assert!(
            (share - expected[k]).abs() < 0.012,
            "row {k}: {share} vs {}",
            expected[k]
        );
    }
}

#[test]
fn default_cost_softmax_at_a_tiny_temperature_still_finds_the_minimum() {
    // 1,000 candidates, one far cheaper: rejection nearly always fails and
    // the full pass decides.
    let mut p = policy(
        "dynamo-default-cost-fn",
        "{router_temperature: 0.001, seed: 5}",
    );
    let mut rows: Vec<W> = (0..1000).map(|i| w(i).decode(50)).collect();
    rows[637].decode = 0;
    for _ in 0..200 {
        assert_eq!(pick(&mut p, &ctx(160), &rows), 637);
    }
}

// ---- least-busy (the smallest example policy) ----

#[test]
fn least_busy_filters_on_device_overlap_then_takes_fewest_requests() {
    let mut p = policy("least-busy", "{min_device_overlap_blocks: 2}");
    let rows = [
        w(1).device(1).active(0),
        w(2).device(2).active(5),
        w(3).device(4).active(3),
    ];
    assert_eq!(
        pick(&mut p, &ctx(160), &rows),
        3,
        "worker 1 is filtered out"
    );
    // A long queue is not idle: 1 running + 6 waiting is busier than 3.
    let rows = [
        w(2).device(2).active(1).waiting(6),
        w(3).device(4).active(3),
    ];
    assert_eq!(pick(&mut p, &ctx(160), &rows), 3);
    let cold = [w(1).device(1), w(2).device(0)];
    assert!(matches!(
        p.select(&ctx(160), &table(&cold))
            .map_err(|e| e.into_kind()),
        Err(kvedge_policies::SelectionErrorKind::AllRejected { filter_index: 0 })
    ));
}

// ---- round-robin / random / power-of-two / least-kv-usage ----

#[test]
fn round_robin_cycles_in_identity_order_whatever_the_row_order() {
    let mut p = policy("round-robin", "{}");
    let mut rows = vec![w(30), w(10), w(20)];
    let mut seen = Vec::new();
    for i in 0..6 {
        shuffle(&mut rows, i + 1);
        seen.push(pick(&mut p, &ctx(16), &rows));
    }
    assert_eq!(seen, [10, 20, 30, 10, 20, 30]);
    // A worker leaving does not reset the cycle.
    assert_eq!(pick(&mut p, &ctx(16), &[w(30), w(20)]), 20);
}

#[test]
fn random_is_uniform_and_reproducible() {
    let rows: Vec<W> = (1..=4).map(w).collect();
    let run = |seed: u64| {
        let mut p = policy("random", &format!("{{seed: {seed}}}"));
        (0..4000)
            .map(|_| pick(&mut p, &ctx(16), &rows))
            .collect::<Vec<_>>()
    };
    let a = run(5);
    assert_eq!(a, run(5));
    for id in 1..=4 {
        let n = a.iter().filter(|&&x| x == id).count();
        assert!((850..=1150).contains(&n), "worker {id}: {n}");
    }
}

#[test]
fn power_of_two_never_takes_the_busier_of_its_two_draws() {
    let mut p = policy("power-of-two", "{seed: 1}");
    // With two candidates both are always drawn: the idle one must win.
    for _ in 0..100 {
        assert_eq!(
            pick(&mut p, &ctx(16), &[w(1).active(3), w(2).waiting(1)]),
            2
        );
    }
    // With many, the busiest can never win (it loses every pairing).
    let rows: Vec<W> = (1..=8).map(|i| w(i).active(i as u32)).collect();
    assert!((0..500).all(|_| pick(&mut p, &ctx(16), &rows) != 8));
}

#[test]
fn least_kv_usage_takes_the_emptiest_cache_and_counts_its_queue() {
    let mut p = policy("least-kv-usage", "{}");
    let rows = [w(1).kv(50, 100), w(2).kv(10, 100)];
    assert_eq!(pick(&mut p, &ctx(16), &rows), 2);
    // Worker 2 holds less but has a queue that will need as much again
    // per request as its running one: 10 + 8 x 10 = 90 of 100.
    let rows = [
        w(1).kv(50, 100).active(5),
        w(2).kv(10, 100).active(1).waiting(8),
    ];
    assert_eq!(pick(&mut p, &ctx(16), &rows), 1);
}

#[test]
fn least_kv_usage_treats_an_unreported_capacity_as_unknown_not_full() {
    let mut p = policy("least-kv-usage", "{}");
    // Worker 3 has not reported yet and has nothing: it is the emptiest.
    let unknown = w(3).kv(0, 0);
    let rows = [
        w(1).kv(50, 100).active(5),
        w(2).kv(10, 100).active(1),
        unknown,
    ];
    assert_eq!(pick(&mut p, &ctx(16), &rows), 3);
    // Busy by kvedge's own count (10 requests at the others' 10% each),
    // it is estimated full, not idle.
    let rows = [
        w(1).kv(50, 100).active(5),
        w(2).kv(10, 100).active(1),
        unknown.active(10),
    ];
    assert_eq!(pick(&mut p, &ctx(16), &rows), 2);
}

// ---- predicted-ttft ----

#[test]
fn predicted_ttft_takes_the_lowest_prediction_whatever_the_overlap_or_load() {
    let mut p = policy("predicted-ttft", "{}");
    // The host's prediction decides: not the overlap, not the request count.
    let rows = [
        w(1).device(30).active(1).ttft(0.8),
        w(2).active(9).ttft(0.3),
        w(3).ttft(0.5),
    ];
    assert_eq!(pick(&mut p, &ctx(64), &rows), 2);
    // Exact ties go to either, by the seeded RNG.
    let rows = [w(1).ttft(0.5), w(2).ttft(0.5), w(3).ttft(0.9)];
    let mut seen = [false; 4];
    for _ in 0..200 {
        seen[pick(&mut p, &ctx(64), &rows) as usize] = true;
    }
    assert_eq!(seen, [false, true, true, false]);
}

#[test]
fn predicted_ttft_prices_own_prefill_and_new_work_by_recent_traffic() {
    // cost = ttft + recompute_weight * own + balance_weight * share * new,
    // with `new` the smallest own prefill and `share` the candidate's recent
    // selections over their mean.
    let costs = |params: &str, rows: &[W]| {
        let mut p = policy("predicted-ttft", params);
        let mut out = Vec::new();
        p.costs_into(&ctx(64), &table(rows), &mut out).unwrap();
        out
    };
    let close = |got: &[f64], want: &[f64]| {
        got.len() == want.len() && got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-9)
    };
    // A cold prompt (0.2 s of prefill everywhere): worker 1 is idle but got
    // 6 of the last 8 requests (share 6 / (8/3) = 2.25), worker 2 waits
    // 0.1 s and got 2 (share 0.75), worker 3 waits 0.2 s and got none.
    let rows = [
        w(1).ttft(0.2).own(0.2).recent(6.0),
        w(2).ttft(0.3).own(0.2).recent(2.0),
        w(3).ttft(0.4).own(0.2).recent(0.0),
    ];
    let got = costs("{}", &rows);
    // The default weights: recompute 4, balance 1.
    let want = [0.2 + 0.8 + 0.2 * 2.25, 0.3 + 0.8 + 0.2 * 0.75, 0.4 + 0.8];
    assert!(close(&got, &want), "{got:?} vs {want:?}");
    assert_eq!(
        pick(&mut policy("predicted-ttft", "{}"), &ctx(64), &rows),
        3
    );
    // Without the balance the momentarily idle worker wins.
    let got = costs("{balance_weight: 0}", &rows);
    assert!(close(&got, &[1.0, 1.1, 1.2]), "{got:?}");
    assert_eq!(
        pick(
            &mut policy("predicted-ttft", "{balance_weight: 0}"),
            &ctx(64),
            &rows
        ),
        1
    );
    // A warm request: cached on worker 1 (own 0.01 s), new elsewhere. The
    // new work is 0.01 s, so the balance barely moves it: it stays.
    let rows = [
        w(1).ttft(0.05).own(0.01).recent(6.0),
        w(2).ttft(0.3).own(0.2).recent(2.0),
        w(3).ttft(0.4).own(0.2).recent(0.0),
    ];
    assert_eq!(
        pick(&mut policy("predicted-ttft", "{}"), &ctx(64), &rows),
        1
    );
    // A host that counts no recent selections (NaN) balances nothing: every
    // share is 1.
    let rows = [w(1).ttft(0.2).own(0.2), w(2).ttft(0.3).own(0.2)];
    let got = costs("{recompute_weight: 1, balance_weight: 3}", &rows);
    assert!(close(&got, &[0.2 + 0.2 + 0.6, 0.3 + 0.2 + 0.6]), "{got:?}");
    // Negative weights are refused.
    let e = refused("predicted-ttft", "{ balance_weight: -1 }");
    assert!(e.contains("balance_weight"), "{e}");
}

#[test]
fn predicted_ttft_fails_cleanly_without_a_prediction() {
    let mut p = policy("predicted-ttft", "{}");
    let rows = [w(1).ttft(0.5), w(2)];
    let e = p.select(&ctx(64), &table(&rows)).unwrap_err();
    assert!(e.to_string().contains("predicted no TTFT"), "{e}");
    // Unknown parameters are refused.
    let e = refused("predicted-ttft", "{ speed: 3 }");
    assert!(e.contains("speed"), "{e}");
}

// ---- prefill-times-requests ----

/// The product without a price on recomputing (`kv_aware`'s shape), for
/// every request.
const PLAIN: &str = "{recompute_weight: 0, min_sharers: 0}";

#[test]
fn prefill_times_requests_multiplies_prefill_work_by_the_batch_it_joins() {
    // 640 prompt tokens (40 blocks of 16). cost = (uncached + queued
    // prefill) * (active + waiting + 1).
    let costs = |params: &str, rows: &[W]| {
        let mut p = policy("prefill-times-requests", params);
        let mut out = Vec::new();
        p.costs_into(&ctx(640), &table(rows), &mut out).unwrap();
        out
    };
    let rows = [
        // 30 blocks cached, 3 requests running and 1 queued, 100 tokens of
        // prefill queued: (160 + 100) * 5.
        w(1).device(30).active(3).waiting(1).prefill(100),
        // Nothing cached, idle: 640 * 1.
        w(2),
        // 10 blocks cached, 1 request: (480 + 0) * 2.
        w(3).device(10).active(1),
    ];
    assert_eq!(costs(PLAIN, &rows), [1300.0, 640.0, 960.0]);
    // The product spreads the prefix off the busy worker where a sum of the
    // same terms (260 + 4 against 640 + 0) would keep it there.
    assert_eq!(
        pick(
            &mut policy("prefill-times-requests", PLAIN),
            &ctx(640),
            &rows
        ),
        2
    );
    // With one request on it instead of four, the cached worker wins:
    // (160 + 100) * 2 = 520.
    let rows = [
        w(1).device(30).active(1).prefill(100),
        w(2),
        w(3).device(10).active(1),
    ];
    assert_eq!(
        pick(
            &mut policy("prefill-times-requests", PLAIN),
            &ctx(640),
            &rows
        ),
        1
    );
}

#[test]
fn prefill_times_requests_recompute_weight_waits_for_a_prefix_being_computed() {
    // A new 1,600-token prompt went to worker 1 a moment ago: its 100
    // blocks are reserved there and still queued as prefill. A second
    // request with the same prompt and 64 tokens more (104 blocks):
    // worker 1 costs (64 + 1,600) * 2, an idle worker 1,664 * 1, so the
    // plain product computes the prefix a second time.
    let rows = [w(1).device(100).active(1).prefill(1600), w(2)];
    assert_eq!(
        pick(
            &mut policy("prefill-times-requests", PLAIN),
            &ctx(1664),
            &rows
        ),
        2
    );
    // Priced at four times again: (5 * 64 + 1,600) * 2 = 3,840 against
    // 5 * 1,664 = 8,320, so it waits where the prefix is being computed.
    let mut p = policy(
        "prefill-times-requests",
        "{recompute_weight: 4, min_sharers: 0}",
    );
    let mut out = Vec::new();
    p.costs_into(&ctx(1664), &table(&rows), &mut out).unwrap();
    assert_eq!(out, [3840.0, 8320.0]);
    assert_eq!(pick(&mut p, &ctx(1664), &rows), 1);
    // The default prices it once again: (2 * 64 + 1,600) * 2 = 3,456
    // against 2 * 1,664 = 3,328, just short of waiting.
    p = policy("prefill-times-requests", "{min_sharers: 0}");
    p.costs_into(&ctx(1664), &table(&rows), &mut out).unwrap();
    assert_eq!(out, [3456.0, 3328.0]);
    let e = refused("prefill-times-requests", "{ recompute_weight: -0.5 }");
    assert!(e.contains("recompute_weight"), "{e}");
}

#[test]
fn prefill_times_requests_scores_a_private_prefix_as_predicted_ttft() {
    // Worker 1 holds the prompt's prefix behind a queue (0.3 s) with four
    // requests; worker 2 is idle and would compute the prompt (0.2 s own,
    // predicted 0.2 s).
    let rows = [
        w(1).device(30).active(4).prefill(600).ttft(0.35).own(0.05),
        w(2).ttft(0.2).own(0.2),
    ];
    let costs = |params: &str, sharers: u32| {
        let mut p = policy("prefill-times-requests", params);
        let mut out = Vec::new();
        let c = ctx(640).with_prefix_sharers(sharers);
        p.costs_into(&c, &table(&rows), &mut out).unwrap();
        (out, pick(&mut p, &c, &rows))
    };
    // Sent by fewer than four recent picks (the default `min_sharers`): a
    // conversation's own history, a prefix only just shared, or nothing
    // held. `predicted-ttft`'s cost
    // (ttft + 4 own + 1 * share * new, every share 1 here): worker 1 0.35 +
    // 0.2 + 0.05 = 0.6, worker 2 0.2 + 0.8 + 0.05 = 1.05. It stays.
    let (out, picked) = costs("{}", 3);
    assert!(
        (out[0] - 0.6).abs() < 1e-9 && (out[1] - 1.05).abs() < 1e-9,
        "{out:?}"
    );
    assert_eq!(picked, 1);
    // Sent by four or more: a shared prefix. The product: worker 1
    // (2 * 160 + 600) * 5 = 4,600, worker 2 2 * 640 * 1 = 1,280. The
    // prefix gets a second home.
    let (out, picked) = costs("{}", 4);
    assert_eq!((out, picked), (vec![4600.0, 1280.0], 2));
    // `min_sharers: 0` takes the product for every request; a higher one
    // for fewer.
    assert_eq!(costs("{min_sharers: 0}", 0).1, 2);
    assert_eq!(costs("{min_sharers: 5}", 4).1, 1);
    assert_eq!(costs("{min_sharers: 2}", 2).1, 2);
}

#[test]
fn prefill_times_requests_counts_at_least_one_token_so_load_still_decides() {
    // The prompt is cached whole on both: the engine still computes its last
    // token, so the worker with fewer requests wins, every time.
    let rows = [w(1).device(4).active(7), w(2).device(4).active(2)];
    let mut p = policy("prefill-times-requests", PLAIN);
    let mut out = Vec::new();
    p.costs_into(&ctx(64), &table(&rows), &mut out).unwrap();
    assert_eq!(out, [8.0, 3.0]);
    for _ in 0..50 {
        assert_eq!(pick(&mut p, &ctx(64), &rows), 2);
    }
    // Exact ties go to either, by the seeded RNG.
    let rows = [w(1).active(1), w(2).active(1), w(3).active(2)];
    let mut seen = [false; 4];
    for _ in 0..200 {
        seen[pick(&mut p, &ctx(64), &rows) as usize] = true;
    }
    assert_eq!(seen, [false, true, true, false]);
}

#[test]
fn prefill_times_requests_credits_host_and_disk_blocks_at_their_weights() {
    // 10 blocks of 16. Host 8 blocks at the router's 0.75: 6 blocks cached,
    // 64 tokens left; disk 8 blocks at 0.25: 2 cached, 128 left.
    let rows = [w(1).host(8), w(2).disk(8)];
    let mut p = policy("prefill-times-requests", PLAIN);
    let mut out = Vec::new();
    p.costs_into(&ctx(160), &table(&rows), &mut out).unwrap();
    assert_eq!(out, [64.0, 128.0]);
    let mut p = policy(
        "prefill-times-requests",
        "{recompute_weight: 0, min_sharers: 0, host_cache_hit_weight: 0, disk_cache_hit_weight: 1}",
    );
    p.costs_into(&ctx(160), &table(&rows), &mut out).unwrap();
    assert_eq!(out, [160.0, 32.0]);
    // Negative weights and unknown parameters are refused.
    let e = refused("prefill-times-requests", "{ host_cache_hit_weight: -1 }");
    assert!(e.contains("host_cache_hit_weight"), "{e}");
    let e = refused("prefill-times-requests", "{ balance_weight: 1 }");
    assert!(e.contains("balance_weight"), "{e}");
}

// ---- cache-aware ----

#[test]
fn cache_aware_balances_when_load_is_imbalanced() {
    let mut p = policy(
        "cache-aware",
        "{balance_abs_threshold: 4, balance_rel_threshold: 1.5}",
    );
    // Load 10 vs 2: imbalanced, so the big overlap on worker 1 is ignored.
    let rows = [w(1).device(10).active(10), w(2).active(2)];
    assert_eq!(pick(&mut p, &ctx(160), &rows), 2);
}

#[test]
fn cache_aware_follows_overlap_when_balanced_and_above_threshold() {
    let mut p = policy(
        "cache-aware",
        "{balance_abs_threshold: 4, cache_threshold: 0.5}",
    );
    let rows = [w(1).device(6).active(3), w(2).active(1)];
    assert_eq!(pick(&mut p, &ctx(160), &rows), 1, "6/10 blocks >= 0.5");
    let rows = [w(1).device(4).active(3), w(2).active(1)];
    assert_eq!(
        pick(&mut p, &ctx(160), &rows),
        2,
        "4/10 < 0.5: least loaded"
    );
}

// ---- soft-pin, with the affinity table in soft mode ----

#[test]
fn soft_pin_without_a_target_counts_queued_requests() {
    let mut p = policy("soft-pin", "{max_active_requests: 4}");
    let rows = [w(1).active(1).waiting(5), w(2).active(3)];
    assert_eq!(pick(&mut p, &ctx(16), &rows), 2);
}

#[test]
fn soft_pin_keeps_the_target_until_it_is_overloaded_a_b_b() {
    let mut p = policy("soft-pin", "{max_active_requests: 0}");
    let mut affinity = SessionAffinityTable::new(AffinityMode::Soft, 60_000, 16);
    let session = SessionContext::new("s1", InputTrigger::UserMessage);
    let (a, b) = (WorkerWithDpRank::new(1, 0), WorkerWithDpRank::new(2, 0));
    let mut sequence = Vec::new();
    // Turn 1: no binding; A is the only idle worker.
    let mut load = [w(1), w(2).active(1)];
    for turn in 0..3 {
        let c = affinity
            .apply(ctx(16).with_session(session).with_now_ms(turn))
            .unwrap();
        let s = p.select(&c, &table(&load)).unwrap();
        affinity.bind("s1", s.worker, turn).unwrap();
        sequence.push(s.worker);
        load = match turn {
            // The first request is still running on A; B drained.
            0 => [w(1).active(1), w(2)],
            // Everything drained.
            _ => [w(1), w(2)],
        };
    }
    assert_eq!(sequence, [a, b, b]);
}

#[test]
fn soft_pin_target_without_rank_takes_its_least_loaded_rank() {
    let mut p = policy("soft-pin", "{max_active_requests: 4}");
    let c = ctx(16).with_affinity_target(AffinityTarget {
        worker_id: 7,
        dp_rank: None,
    });
    let mut t = kvedge_policies::CandidateTable::new();
    t.reset(kvedge_policies::WorkerInputs::ALL);
    for (rank, active) in [(0, 3), (1, 1)] {
        let mut r = w(7).active(active).row();
        r.worker.dp_rank = rank;
        t.push(r);
    }
    t.push(w(8).row());
    let s = p.select(&c, &t).unwrap();
    assert_eq!(s.worker, WorkerWithDpRank::new(7, 1));
}

// ---- tool-result-cache-local ----

#[test]
fn tool_result_turns_go_to_the_most_device_overlap() {
    let mut p = policy("tool-result-cache-local", "{}");
    // Worker 1 has more overlap but a heavy decode load: default cost picks 2.
    let rows = [w(1).device(8).decode(40), w(2).device(2)];
    let user = SessionContext::new("s", InputTrigger::UserMessage);
    let tool = SessionContext::new("s", InputTrigger::ToolResult);
    assert_eq!(pick(&mut p, &ctx(160).with_session(user), &rows), 2);
    assert_eq!(pick(&mut p, &ctx(160).with_session(tool), &rows), 1);
    assert_eq!(pick(&mut p, &ctx(160), &rows), 2, "no session: default");
}

// ---- warm-ups ----

#[test]
fn a_warm_up_between_selects_changes_no_pick_of_any_shipped_policy() {
    // Four equal workers: every decision is a tie, so each seeded picker
    // draws from its generator and round-robin moves on at every select.
    let rows: Vec<W> = (1..=4)
        .map(|i| w(i).device(2).decode(5).active(1).kv(10, 100).ttft(0.5))
        .collect();
    let t = table(&rows);
    let types = [
        ("dynamo-default-cost-fn", "{seed: 3}"),
        (
            "dynamo-default-cost-fn",
            "{router_temperature: 1.0, seed: 3}",
        ),
        ("least-busy", "{min_device_overlap_blocks: 0}"),
        ("round-robin", "{}"),
        ("random", "{seed: 3}"),
        ("power-of-two", "{seed: 3}"),
        ("least-kv-usage", "{seed: 3}"),
        ("cache-aware", "{}"),
        ("soft-pin", "{max_active_requests: 0, seed: 3}"),
        ("tool-result-cache-local", "{seed: 3}"),
        ("predicted-ttft", "{seed: 3}"),
        ("prefill-times-requests", "{seed: 3}"),
    ];
    for (type_name, params) in types {
        let mut plain = policy(type_name, params);
        let mut warmed = policy(type_name, params);
        let mut a = Vec::new();
        let mut b = Vec::new();
        for i in 0..40 {
            a.push(plain.select(&ctx(160), &t).unwrap().worker.worker_id);
            for _ in 0..i % 3 {
                warmed.warm(&ctx(160), &t);
            }
            b.push(warmed.select(&ctx(160), &t).unwrap().worker.worker_id);
        }
        assert_eq!(a, b, "{type_name} {params}");
        // The seeded and cycling pickers did move: the comparison can fail.
        let moving = !matches!(type_name, "least-busy" | "cache-aware");
        assert_eq!(
            a.iter().any(|&x| x != a[0]),
            moving,
            "{type_name} {params}: {a:?}"
        );
    }
}
