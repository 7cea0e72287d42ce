//! The router core fed through real rings: engines publish through the
//! shared-memory protocol, the router applies what the consumer reads, and
//! selections follow the index and the load accounting.

#![forbid(unsafe_code)]

use kvedge_core::index::Slot;
use kvedge_core::router::{
    RegisterError, Router, RouterError, SelectRequest, SelectResult, WorkerInfo,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use kvedge_policies::plugins::worker_selection::{
    RouterConfig, RoutingPartition, WorkerInputView, WorkerPicker, WorkerSelectionContext,
    WorkerSelectionPolicy, WorkerSelectionPolicyError, WorkerSelectionPolicyFactory,
};
use kvedge_policies::{InputTrigger, SessionContext, WorkerType, WorkerWithDpRank};
use kvedge_schema::hash::sequence_hashes;
use kvedge_schema::messages::{Load, Tier};
use kvedge_shm::segment::Segment;
use kvedge_shm::{Consumer, Producer, Publisher};

struct Engine {
    publisher: Publisher,
    consumer: Consumer,
    slot: Slot,
}

fn engine(router: &mut Router, id: u64) -> Engine {
    let consumer = Consumer::create(1 << 16, 1).unwrap();
    let seg = Segment::open(consumer.segment_fd().try_clone_to_owned().unwrap()).unwrap();
    let publisher = Publisher::new(None, Producer::new(seg, None).unwrap());
    let slot = router
        .register(WorkerInfo {
            worker: WorkerWithDpRank::new(id, 0),
            model: "llama".into(),
            role: WorkerType::Aggregated,
            endpoint: format!("http://engine-{id}"),
            block_size: 16,
            available: true,
            labels: Vec::new(),
            taints: Vec::new(),
        })
        .unwrap();
    Engine {
        publisher,
        consumer,
        slot,
    }
}

/// The daemon's ingest step: drain the ring into the router.
fn ingest(router: &mut Router, e: &mut Engine) {
    ingest_at(router, e, 0);
}

/// [`ingest`] at `now_ms`.
fn ingest_at(router: &mut Router, e: &mut Engine, now_ms: u64) {
    while let Some(r) = e.consumer.poll().unwrap() {
        let event = kvedge_schema::decode(r.kind, r.payload).unwrap();
        router.apply(e.slot, &event, now_ms);
    }
}

fn prompt(prefix: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| prefix * 100_000 + i).collect()
}

fn req<'a>(hashes: &'a [u64], tokens: u32) -> SelectRequest<'a> {
    SelectRequest::new("llama", WorkerType::Aggregated, hashes, tokens)
}

#[test]
fn selection_follows_the_published_prefixes_and_finish_restores_the_report() {
    let mut router = Router::with_defaults();
    let mut a = engine(&mut router, 1);
    let mut b = engine(&mut router, 2);
    let seed = kvedge_schema::hash::block_seed(None, None);
    // Engine A caches prefix 1 (32 blocks); engine B prefix 2.
    a.publisher
        .publish_stored_tokens(Tier::Device, None, &prompt(1, 512), 16, seed)
        .unwrap();
    b.publisher
        .publish_stored_tokens(Tier::Device, None, &prompt(2, 512), 16, seed)
        .unwrap();
    b.publisher
        .publish_stored_tokens(Tier::Host, None, &prompt(1, 256), 16, seed)
        .unwrap();
    let load = Load {
        active_requests: 3,
        active_prefill_tokens: 100,
        active_decode_blocks: 40,
        kv_total_blocks: 1000,
        ..Load::default()
    };
    a.publisher.publish_load(&load).unwrap();
    b.publisher.publish_load(&load).unwrap();
    ingest(&mut router, &mut a);
    ingest(&mut router, &mut b);

    // A request sharing 24 blocks of prefix 1, then diverging.
    let mut tokens = prompt(1, 384);
    tokens.extend(prompt(9, 128));
    let hashes = sequence_hashes(&tokens, 16, None, None);
    let r = router.select(&req(&hashes, tokens.len() as u32)).unwrap();
    assert_eq!(r.worker.worker_id, 1);
    assert_eq!(r.overlap_blocks, [24, 0, 0]);
    // B's host tier holds 16 blocks of prefix 1: computed too.
    let dry = SelectRequest {
        dry_run: true,
        pinned: Some(WorkerWithDpRank::new(2, 0)),
        ..req(&hashes, tokens.len() as u32)
    };
    assert_eq!(router.select(&dry).unwrap().overlap_blocks, [0, 16, 0]);
    // A subset hint keeps the pick inside it, whatever the prefix says;
    // one naming every worker changes nothing; one naming no worker leaves
    // nothing to pick.
    let free = router
        .select(&SelectRequest {
            dry_run: true,
            ..req(&hashes, tokens.len() as u32)
        })
        .unwrap()
        .worker
        .worker_id;
    let other = 3 - free;
    let named = |id: u64| if id == 1 { "engine-1" } else { "engine-2" };
    let only_other = [named(other)];
    let url = [format!("http://{}", named(other))];
    let url = [url[0].as_str()];
    for (subset, expected) in [
        (&only_other[..], Some(other)),
        (&url[..], Some(other)),
        (&["engine-1", "engine-2"][..], Some(free)),
        (&["engine-9"][..], None),
    ] {
        let hinted = SelectRequest {
            dry_run: true,
            subset: kvedge_wire::Strs::new(subset),
            ..req(&hashes, tokens.len() as u32)
        };
        assert_eq!(
            router.select(&hinted).ok().map(|r| r.worker.worker_id),
            expected,
            "{subset:?}"
        );
    }

    // The reservation shows in A's projected load until finish.
    let projected = router.load.projected(a.slot);
    assert_eq!(r.slot, Some(a.slot));
    assert_eq!(projected.active_requests, 4);
    assert_eq!(projected.active_prefill_tokens, 100 + (512 - 24 * 16));
    router.load.finish(r.request_id).unwrap();
    let after = router.load.projected(a.slot);
    assert_eq!(
        (
            after.active_requests,
            after.active_prefill_tokens,
            after.active_decode_blocks
        ),
        (3, 100, 40),
        "back to the engine's report"
    );
}

#[test]
fn removed_cleared_and_departure_leave_routing_at_once() {
    let mut router = Router::with_defaults();
    let mut a = engine(&mut router, 1);
    let tokens = prompt(1, 256);
    let hashes = sequence_hashes(&tokens, 16, None, None);
    a.publisher
        .publish_stored_hashes(Tier::Device, None, &hashes)
        .unwrap();
    ingest(&mut router, &mut a);
    assert_eq!(
        router.select(&req(&hashes, 256)).unwrap().overlap_blocks[0],
        16
    );
    a.publisher
        .publish_removed(Tier::Device, &hashes[8..])
        .unwrap();
    ingest(&mut router, &mut a);
    assert_eq!(
        router.select(&req(&hashes, 256)).unwrap().overlap_blocks[0],
        8
    );
    a.publisher.publish_cleared(None).unwrap();
    ingest(&mut router, &mut a);
    assert_eq!(
        router.select(&req(&hashes, 256)).unwrap().overlap_blocks[0],
        0
    );

    a.publisher
        .publish_stored_hashes(Tier::Device, None, &hashes)
        .unwrap();
    ingest(&mut router, &mut a);
    assert_eq!(router.index.entries(), 16);
    router.unregister(a.slot).unwrap();
    assert_eq!(
        router.index.entries(),
        0,
        "a departed worker's blocks leave the index"
    );
    assert!(matches!(
        router.select(&req(&hashes, 256)),
        Err(RouterError::NoWorkers { .. })
    ));
}

#[test]
fn registration_refuses_duplicates_and_reuses_slots() {
    let mut router = Router::with_defaults();
    let a = engine(&mut router, 1);
    let info = router.worker(a.slot).unwrap().clone();
    assert_eq!(
        router.register(info.clone()),
        Err(RegisterError::Duplicate(info.worker))
    );
    router.unregister(a.slot);
    assert_eq!(
        router.register(info),
        Ok(a.slot),
        "the same identity may come back"
    );
}

#[test]
fn sessions_stick_to_their_worker_under_hard_affinity() {
    let mut router = Router::with_defaults();
    let mut a = engine(&mut router, 1);
    let mut b = engine(&mut router, 2);
    let hashes = sequence_hashes(&prompt(1, 256), 16, None, None);
    b.publisher
        .publish_stored_hashes(Tier::Device, None, &hashes)
        .unwrap();
    ingest(&mut router, &mut b);
    ingest(&mut router, &mut a);
    let session = SessionContext::new("s1", InputTrigger::UserMessage);
    let first = router
        .select(&SelectRequest {
            session: Some(session),
            ..req(&hashes, 256)
        })
        .unwrap();
    assert_eq!(first.worker.worker_id, 2, "the cached worker");
    // B's cache is now useless for this prompt, but the session stays on B.
    let other = sequence_hashes(&prompt(7, 256), 16, None, None);
    a.publisher
        .publish_stored_hashes(Tier::Device, None, &other)
        .unwrap();
    ingest(&mut router, &mut a);
    let next = router
        .select(&SelectRequest {
            session: Some(session),
            ..req(&other, 256)
        })
        .unwrap();
    assert_eq!(next.worker.worker_id, 2);
}

#[test]
fn a_warm_select_allocates_nothing() {
    let mut router = Router::with_defaults();
    let mut engines: Vec<Engine> = (0..8).map(|i| engine(&mut router, i)).collect();
    for (i, e) in engines.iter_mut().enumerate() {
        let hashes = sequence_hashes(&prompt(i as u32, 1024), 16, None, None);
        e.publisher
            .publish_stored_hashes(Tier::Device, None, &hashes)
            .unwrap();
        ingest(&mut router, e);
    }
    let hashes = sequence_hashes(&prompt(3, 2048), 16, None, None);
    let mut r = req(&hashes, 2048);
    r.dry_run = true;
    router.select(&r).unwrap();
    let info = allocation_counter::measure(|| {
        for _ in 0..100 {
            std::hint::black_box(router.select(&r).unwrap());
            // And the idle loop's warm-up, with the same request.
            router.warm(&r);
        }
    });
    assert_eq!(info.count_total, 0, "{info:?}");
    // Real selections too: reserve, then finish, with a session rebinding.
    let session = SessionContext::new("s", InputTrigger::UserMessage);
    let mut real = req(&hashes, 2048);
    real.session = Some(session);
    let id = router.select(&real).unwrap().request_id;
    router.load.finish(id).unwrap();
    let info = allocation_counter::measure(|| {
        for _ in 0..100 {
            let id = router.select(&real).unwrap().request_id;
            router.load.finish(id).unwrap();
        }
    });
    assert_eq!(info.count_total, 0, "{info:?}");
}

/// A picker that takes the first row and counts its picks and warm-ups.
struct Counting {
    picks: Arc<AtomicUsize>,
    warms: Arc<AtomicUsize>,
}

impl WorkerPicker for Counting {
    fn pick(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        _input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        self.picks.fetch_add(1, Ordering::Relaxed);
        Ok(0)
    }

    fn warm(&mut self, _context: &WorkerSelectionContext<'_>, _input: WorkerInputView<'_>) {
        self.warms.fetch_add(1, Ordering::Relaxed);
    }
}

/// A scorer that counts its calls and scores every row 0.
struct CountingScorer(Arc<AtomicUsize>);

impl kvedge_policies::WorkerScorer for CountingScorer {
    fn required_worker_inputs(&self) -> kvedge_policies::WorkerInputs {
        kvedge_policies::WorkerInputs::NONE
    }

    fn score(
        &mut self,
        _context: &WorkerSelectionContext<'_>,
        _candidates: kvedge_policies::view::WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        costs.fill(0.0);
        Ok(())
    }
}

/// Registers `counting` (a counting scorer and picker; with `side_passes`
/// it allows calls outside selections) and returns its counters: picks,
/// warm-ups, scorer calls.
fn counting_router(side_passes: bool) -> (Router, [Arc<AtomicUsize>; 3]) {
    let counters = [0; 3].map(|_| Arc::new(AtomicUsize::new(0)));
    let mut registry = kvedge_policies::router_plugin_registry();
    let c = counters.clone();
    registry
        .register_worker_selection(
            "counting",
            Arc::new(move |_parameters| {
                let c = c.clone();
                let factory: WorkerSelectionPolicyFactory = Arc::new(
                    move |config: &RouterConfig, role: WorkerType, _: &RoutingPartition| {
                        let picker = Counting {
                            picks: Arc::clone(&c[0]),
                            warms: Arc::clone(&c[1]),
                        };
                        let policy = WorkerSelectionPolicy::new(
                            config.clone(),
                            role.as_str(),
                            vec![Box::new(CountingScorer(Arc::clone(&c[2])))],
                            Box::new(picker),
                        );
                        if side_passes {
                            policy.allow_side_passes()
                        } else {
                            policy
                        }
                    },
                );
                Ok(factory)
            }),
        )
        .unwrap();
    (router_of(&registry, "counting"), counters)
}

#[test]
fn a_warm_up_runs_the_pickers_warm_and_never_its_pick() {
    let (mut router, [picks, warms, scores]) = counting_router(true);
    let _e = engine(&mut router, 1);
    let hashes = sequence_hashes(&prompt(1, 256), 16, None, None);
    let r = req(&hashes, 256);
    router.select(&r).unwrap();
    for _ in 0..3 {
        router.warm(&r);
    }
    let counts = || [&picks, &warms, &scores].map(|c| c.load(Ordering::Relaxed));
    assert_eq!(counts(), [1, 3, 4]);
    router.select(&r).unwrap();
    assert_eq!(counts(), [2, 3, 5]);
    // An explained select scores a second time, for the costs it shows.
    router.set_explain_costs(true);
    router.select(&r).unwrap();
    assert_eq!(counts(), [3, 3, 7]);
}

#[test]
fn a_custom_policy_is_called_only_for_selections_unless_it_allows_more() {
    let (mut router, [picks, warms, scores]) = counting_router(false);
    let e = engine(&mut router, 1);
    let hashes = sequence_hashes(&prompt(1, 256), 16, None, None);
    let r = req(&hashes, 256);
    router.select(&r).unwrap();
    for _ in 0..3 {
        router.warm(&r);
    }
    router.set_explain_costs(true);
    router.select(&r).unwrap();
    assert_eq!(
        [&picks, &warms, &scores].map(|c| c.load(Ordering::Relaxed)),
        [2, 0, 2],
        "one scorer call and one pick per selection, nothing else"
    );
    assert_eq!(router.last_cost(e.slot), None, "no costs to explain");
}

const RULES: &str = "
policy:
  rules:
    - name: pii-local
      matches: [{ tag: pii-confirmed }]
      route:
        select: [{ type: Local, minimize: PredictedTTFT }]
    - name: default
      route:
        consider: [{ backends: {} }, { providers: {} }]
        exclude:
          - drop: { activeRequests: { greaterThan: 4 } }
        select:
          - { type: Local, minimize: PredictedTTFT }
          - { type: Provider, order: [cloud] }
providers:
  - { name: cloud, models: [llama], endpoint: 'https://cloud.example' }
";

#[test]
fn rules_choose_between_local_workers_and_providers() {
    let mut router = Router::with_defaults();
    router.set_rules(kvedge_policies::rules::load(RULES).unwrap());
    let mut a = engine(&mut router, 1);
    let hashes = sequence_hashes(&prompt(1, 256), 16, None, None);
    a.publisher
        .publish_stored_hashes(Tier::Device, None, &hashes)
        .unwrap();
    a.publisher
        .publish_load(&Load {
            active_requests: 1,
            ..Load::default()
        })
        .unwrap();
    ingest(&mut router, &mut a);
    let r = router.select(&req(&hashes, 256)).unwrap();
    assert_eq!(
        (r.slot, r.rule, r.overlap_blocks[0]),
        (Some(a.slot), Some(1), 16)
    );
    // Busy worker: excluded, so the provider tier decides.
    a.publisher
        .publish_load(&Load {
            active_requests: 9,
            ..Load::default()
        })
        .unwrap();
    ingest(&mut router, &mut a);
    let r = router.select(&req(&hashes, 256)).unwrap();
    assert_eq!((r.slot, r.provider, r.rule), (None, Some(0), Some(1)));
    // PII stays local, however busy.
    let tags = ["pii-confirmed"];
    let pii = SelectRequest {
        tags: &tags,
        ..req(&hashes, 256)
    };
    assert_eq!(router.select(&pii).unwrap().slot, Some(a.slot));
    // Warm rule decisions allocate nothing either.
    let dry = SelectRequest {
        dry_run: true,
        ..req(&hashes, 256)
    };
    router.select(&dry).unwrap();
    let info = allocation_counter::measure(|| {
        for _ in 0..100 {
            std::hint::black_box(router.select(&dry).unwrap());
        }
    });
    assert_eq!(info.count_total, 0, "{info:?}");
    router.unregister(a.slot);
    let r = router.select(&pii);
    assert!(
        matches!(r, Err(RouterError::RejectedByRule { .. })),
        "{r:?}"
    );
}

/// A router whose aggregated workers are selected by one instance of
/// `type_name` from `registry`.
fn router_of(registry: &kvedge_policies::RouterPluginRegistry, type_name: &str) -> Router {
    let config = kvedge_config::Config::load(
        "test",
        &format!(
            "worker_selection:\n  aggregated: p\n  instances:\n    - name: p\n      type: {type_name}\n"
        ),
        registry,
        &Default::default(),
    )
    .unwrap();
    Router::from_config(&config)
}

/// A router with the `predicted-ttft` policy everywhere, with no price on
/// recomputation nor on recent traffic: its cost is exactly the predicted
/// TTFT.
fn predicted_ttft_router() -> Router {
    router_of(
        &kvedge_policies::router_plugin_registry(),
        "predicted-ttft\n      parameters:\n        recompute_weight: 0\n        balance_weight: 0",
    )
}

/// A router of the built-in policies, with `yaml` as its configuration.
fn configured(yaml: &str) -> Router {
    let config = kvedge_config::Config::load(
        "test",
        yaml,
        &kvedge_policies::router_plugin_registry(),
        &Default::default(),
    )
    .unwrap();
    Router::from_config(&config)
}

/// Teaches the router that worker `slot` does a 4,096-token prefill in
/// `ms` milliseconds, `n` times (requests pinned to it, first token
/// reported `ms` after the select, then finished). Each prompt is new:
/// a prompt sent again would count as cached where it went before.
fn teach(router: &mut Router, worker: u64, ms: u64, n: u64, clock: &mut u64) {
    for i in 0..n {
        let hashes = sequence_hashes(
            &prompt(1000 * worker as u32 + i as u32, 4096),
            16,
            None,
            None,
        );
        let r = router
            .select(&SelectRequest {
                pinned: Some(WorkerWithDpRank::new(worker, 0)),
                now_ms: *clock,
                ..req(&hashes, 4096)
            })
            .unwrap();
        assert_eq!(r.worker.worker_id, worker);
        *clock += ms;
        router.prefill_done(r.request_id, *clock).unwrap();
        router.finish(r.request_id).unwrap();
    }
}

#[test]
fn prefill_speed_is_learned_from_prefill_done_and_the_policy_and_rules_agree() {
    let rules = kvedge_policies::rules::load(
        "policy:\n  rules:\n    - name: fastest\n      route:\n        select: [{ type: Local, minimize: PredictedTTFT }]\n",
    )
    .unwrap();
    let mut by_rules = Router::with_defaults();
    by_rules.set_rules(rules);
    let mut by_policy = predicted_ttft_router();
    for router in [&mut by_rules, &mut by_policy] {
        let a = engine(router, 1);
        let b = engine(router, 2);
        // Nothing learned yet: both at the prior.
        assert_eq!(router.learned_speed(a.slot), None);
        // Worker 1 prefills 4,096 tokens in 200 ms (20,480/s), worker 2 in
        // 1,000 ms (4,096/s).
        let mut clock = 0;
        teach(router, 1, 200, 30, &mut clock);
        teach(router, 2, 1000, 30, &mut clock);
        let fast = router.learned_speed(a.slot).unwrap();
        let slow = router.learned_speed(b.slot).unwrap();
        assert!(fast > 15_000.0 && slow < 6_000.0, "{fast} {slow}");
        // Equal load and no overlap: the faster worker wins, by rules and
        // by the policy alike.
        let hashes = sequence_hashes(&prompt(7, 2048), 16, None, None);
        let r = router
            .select(&SelectRequest {
                dry_run: true,
                now_ms: clock,
                ..req(&hashes, 2048)
            })
            .unwrap();
        assert_eq!(r.worker.worker_id, 1);
        // A prefill reported twice teaches once; an unknown id is an error.
        let r = router
            .select(&SelectRequest {
                pinned: Some(WorkerWithDpRank::new(2, 0)),
                now_ms: clock,
                ..req(&hashes, 2048)
            })
            .unwrap();
        router.prefill_done(r.request_id, clock + 1).unwrap();
        let before = router.learned_speed(b.slot);
        router.prefill_done(r.request_id, clock + 50_000).unwrap();
        assert_eq!(router.learned_speed(b.slot), before);
        assert!(router.prefill_done(9_999_999, clock).is_err());
    }
    // The same learned state gives the same prediction either way: the
    // policy's cost is the rules' PredictedTTFT.
    let hashes = sequence_hashes(&prompt(8, 1024), 16, None, None);
    let r = by_policy
        .select(&SelectRequest {
            dry_run: true,
            ..req(&hashes, 1024)
        })
        .unwrap();
    let slot = r.slot.unwrap();
    by_policy.set_explain_costs(true);
    let again = by_policy
        .select(&SelectRequest {
            dry_run: true,
            ..req(&hashes, 1024)
        })
        .unwrap();
    assert_eq!(again.worker, r.worker);
    let terms = by_policy.last_ttft(slot);
    assert!(
        (terms.total_s() - r.cost).abs() < 1e-12,
        "{terms:?} {}",
        r.cost
    );
    assert_eq!(
        terms.speed_source,
        kvedge_policies::predict::SpeedSource::Learned
    );
    // The rules path explains the same terms for the same state.
    by_rules.set_explain_costs(true);
    let by_rule = by_rules
        .select(&SelectRequest {
            dry_run: true,
            ..req(&hashes, 1024)
        })
        .unwrap();
    assert_eq!(by_rule.worker, r.worker);
    assert_eq!(by_rules.last_ttft(by_rule.slot.unwrap()), terms);
}

/// A select pinned to worker 1 at `now_ms`.
fn on_worker_1(router: &mut Router, hashes: &[u64], tokens: u32, now_ms: u64) -> SelectResult {
    router
        .select(&SelectRequest {
            pinned: Some(WorkerWithDpRank::new(1, 0)),
            now_ms,
            ..req(hashes, tokens)
        })
        .unwrap()
}

/// Engine `e` stores `hashes` on its device; the router reads it at
/// `now_ms`.
fn store(router: &mut Router, e: &mut Engine, hashes: &[u64], now_ms: u64) {
    e.publisher
        .publish_stored_hashes(Tier::Device, None, hashes)
        .unwrap();
    ingest_at(router, e, now_ms);
}

#[test]
fn an_engine_storing_a_prompts_last_block_marks_its_prefill_done() {
    let mut router = predicted_ttft_router();
    let mut a = engine(&mut router, 1);
    let mut b = engine(&mut router, 2);
    let slot = a.slot;
    let prefill = |router: &Router| router.load.projected(slot).active_prefill_tokens;
    let prior = router.prefill_speed(slot).0;
    // Worker 1 computes a new 4,096-token prompt in 200 ms, thirty times:
    // its engine stores the prompt's blocks, the last one 200 ms after
    // the pick. No client says prefill_done.
    let mut clock = 0;
    for i in 0..30 {
        let hashes = sequence_hashes(&prompt(100 + i, 4096), 16, None, None);
        let r = on_worker_1(&mut router, &hashes, 4096, clock);
        assert_eq!(prefill(&router), 4096);
        let (last, first) = hashes.split_last().unwrap();
        a.publisher
            .publish_stored_hashes(Tier::Device, None, first)
            .unwrap();
        // The last block on another tier, or on another worker, is not it.
        a.publisher
            .publish_stored_hashes(Tier::Host, None, &[*last])
            .unwrap();
        b.publisher
            .publish_stored_hashes(Tier::Device, None, &[*last])
            .unwrap();
        ingest_at(&mut router, &mut a, clock + 100);
        ingest_at(&mut router, &mut b, clock + 100);
        assert_eq!(prefill(&router), 4096, "the prefill is not over yet");
        clock += 200;
        store(&mut router, &mut a, &[*last], clock);
        assert_eq!(prefill(&router), 0, "the last block came: prefill done");
        // A client's word after the event changes nothing.
        router.prefill_done(r.request_id, clock + 5_000).unwrap();
        router.finish(r.request_id).unwrap();
    }
    assert_eq!(router.prefills_from_events(), 30);
    // The only worker that learned: its speed is its peers' (the pooled).
    let (learned, _) = router.prefill_speed(slot);
    assert!(
        (learned - 4096.0 / 0.2).abs() < 1_000.0,
        "4,096 tokens in 200 ms: {learned} (the prior: {prior})"
    );
    assert!((prior - learned).abs() > 5_000.0);

    // A client's prefill_done first: the block's event later is inert.
    let hashes = sequence_hashes(&prompt(900, 256), 16, None, None);
    let r = on_worker_1(&mut router, &hashes, 256, clock);
    router.prefill_done(r.request_id, clock + 10).unwrap();
    store(&mut router, &mut a, &hashes, clock + 10_000);
    assert_eq!(router.prefills_from_events(), 30);
    assert_eq!(router.prefill_speed(slot).0, learned);
    router.finish(r.request_id).unwrap();

    // A prompt the worker holds whole has nothing to store, and no watch:
    // it waits for its prefill_done or finish as before.
    let r = on_worker_1(&mut router, &hashes, 256 + 8, clock);
    assert_eq!(r.overlap_blocks[0], 16);
    assert_eq!(prefill(&router), 8);
    store(&mut router, &mut a, &hashes, clock + 20_000);
    assert_eq!(prefill(&router), 8);
    assert_eq!(router.prefills_from_events(), 30);
    // A reservation that finished before its block came: inert too.
    let hashes = sequence_hashes(&prompt(901, 256), 16, None, None);
    let r = on_worker_1(&mut router, &hashes, 256, clock);
    router.finish(r.request_id).unwrap();
    store(&mut router, &mut a, &hashes, clock + 30_000);
    assert_eq!(router.prefills_from_events(), 30);
}

#[test]
fn an_unknown_worker_is_neutral_not_slow() {
    // Worker 1 has learned a speed well above the prior; worker 2, new,
    // has learned none. It must not look slower than its peer (it would
    // get no request and never learn): it gets its peers' speed.
    let mut router = predicted_ttft_router();
    let _a = engine(&mut router, 1);
    let mut clock = 0;
    teach(&mut router, 1, 100, 20, &mut clock);
    let b = engine(&mut router, 2);
    assert_eq!(router.learned_speed(b.slot), None);
    // What its predictions use, and what metrics and `workers` show.
    let (speed, source) = router.prefill_speed(b.slot);
    assert_eq!(source, kvedge_policies::predict::SpeedSource::Peers);
    assert!(speed > 30_000.0, "{speed}");
    let mut to_new = 0;
    for i in 0..20 {
        let hashes = sequence_hashes(&prompt(7000 + i, 2048), 16, None, None);
        let r = router
            .select(&SelectRequest {
                now_ms: clock,
                ..req(&hashes, 2048)
            })
            .unwrap();
        to_new += u32::from(r.worker.worker_id == 2);
    }
    assert!(to_new >= 8, "the new worker got {to_new} of 20");
}

#[test]
fn approximate_selects_follow_where_earlier_ones_went_and_ignore_engine_events() {
    let mut router = Router::with_defaults();
    let mut a = engine(&mut router, 1);
    let mut b = engine(&mut router, 2);
    let load = Load {
        kv_total_blocks: 1000,
        ..Load::default()
    };
    a.publisher.publish_load(&load).unwrap();
    b.publisher.publish_load(&load).unwrap();
    ingest(&mut router, &mut a);
    ingest(&mut router, &mut b);
    fn approx(hashes: &[u64], dry_run: bool) -> SelectRequest<'_> {
        SelectRequest {
            approximate: true,
            dry_run,
            ..req(hashes, hashes.len() as u32 * 16)
        }
    }
    // Text-chunk hashes: 40 chunks of a shared document, then a question.
    let document: Vec<u64> = (1..=40).collect();
    let first: Vec<u64> = document.iter().copied().chain([9001]).collect();
    let first_pick = router.select(&approx(&first, false)).unwrap();
    assert_eq!(
        first_pick.overlap_blocks,
        [0, 0, 0],
        "nothing was sent anywhere before"
    );
    let went = first_pick.worker.worker_id;
    router.finish(first_pick.request_id).unwrap();
    // The same document with another question goes where the first went,
    // whose 40 chunks are remembered there.
    let second: Vec<u64> = document.iter().copied().chain([9002]).collect();
    let r = router.select(&approx(&second, true)).unwrap();
    assert_eq!((r.worker.worker_id, r.overlap_blocks), (went, [40, 0, 0]));

    // Engine events do not feed the approximate memory, nor it the
    // precise index: the other engine holding the same hashes as blocks
    // changes nothing for approximate selects, and a precise select of the
    // document's hashes sees only what the engines published.
    let other = if went == 1 { &mut b } else { &mut a };
    other
        .publisher
        .publish_stored_hashes(Tier::Device, None, &document)
        .unwrap();
    let other_id = 3 - went;
    ingest(&mut router, if went == 1 { &mut b } else { &mut a });
    let r = router.select(&approx(&second, true)).unwrap();
    assert_eq!((r.worker.worker_id, r.overlap_blocks), (went, [40, 0, 0]));
    let precise = router
        .select(&SelectRequest {
            dry_run: true,
            ..req(&second, 41 * 16)
        })
        .unwrap();
    assert_eq!(
        (precise.worker.worker_id, precise.overlap_blocks),
        (other_id, [40, 0, 0])
    );

    // A dry run remembers nothing.
    let fresh: Vec<u64> = (500..520).collect();
    router.select(&approx(&fresh, true)).unwrap();
    let r = router.select(&approx(&fresh, true)).unwrap();
    assert_eq!(r.overlap_blocks, [0, 0, 0]);

    // The worker clearing its cache forgets what was sent there.
    let slot = if went == 1 { a.slot } else { b.slot };
    router.apply_cleared(slot, None);
    let r = router.select(&approx(&second, true)).unwrap();
    assert_eq!(r.overlap_blocks, [0, 0, 0]);
    // And a worker that leaves takes its memory with it.
    router.select(&approx(&first, false)).unwrap();
    assert_eq!(router.approx.entries(), 41);
    router.unregister(a.slot);
    router.unregister(b.slot);
    assert_eq!(router.approx.entries(), 0);
}

/// Four engines reporting the same idle load.
fn four_idle(router: &mut Router) -> Vec<Engine> {
    let mut engines: Vec<Engine> = (1..=4).map(|id| engine(router, id)).collect();
    for e in &mut engines {
        e.publisher
            .publish_load(&Load {
                kv_total_blocks: 10_000,
                ..Load::default()
            })
            .unwrap();
        ingest(router, e);
    }
    engines
}

/// A 64-block document nobody holds, then an 8-block question `q`
/// (1,152 tokens).
fn document_and(q: u32) -> Vec<u64> {
    let mut tokens = prompt(5, 1024);
    tokens.extend(prompt(600 + q, 128));
    sequence_hashes(&tokens, 16, None, None)
}

#[test]
fn a_new_prefix_goes_where_it_was_just_sent_before_its_engine_reports_it() {
    // The default policy, with prefix reservations (the default) and
    // without.
    for window in [10_000, 0] {
        let mut router = configured(&format!("daemon:\n  prefix_reservation_ms: {window}\n"));
        let engines = four_idle(&mut router);
        let (first, second) = (document_and(1), document_and(2));
        let a = router
            .select(&SelectRequest {
                now_ms: 1_000,
                ..req(&first, 1152)
            })
            .unwrap();
        assert_eq!(a.overlap_blocks[0], 0);
        // 1 ms later, long before any engine could have published the
        // document's blocks.
        let b = router
            .select(&SelectRequest {
                now_ms: 1_001,
                ..req(&second, 1152)
            })
            .unwrap();
        if window == 0 {
            // The load alone decides: the first worker is busy with the
            // document's prefill, so the second computes it again.
            assert_ne!(b.worker, a.worker);
            assert_eq!(b.overlap_blocks[0], 0);
            continue;
        }
        assert_eq!(b.worker, a.worker, "the same new prefix, the same engine");
        assert_eq!(b.overlap_blocks[0], 64, "counted as about to be cached");
        // The engine's word beats the reservation: evicting the document's
        // second half leaves 32 blocks.
        let slot = a.slot.unwrap();
        let held = engines.iter().find(|e| e.slot == slot).unwrap();
        router.apply_removed(held.slot, Tier::Device, &first[32..64]);
        let probe = document_and(3);
        let c = router
            .select(&SelectRequest {
                dry_run: true,
                now_ms: 1_002,
                pinned: Some(a.worker),
                ..req(&probe, 1152)
            })
            .unwrap();
        assert_eq!(c.overlap_blocks[0], 32);
        // And a reservation its engine never confirms ends with its window.
        let d = router
            .select(&SelectRequest {
                dry_run: true,
                now_ms: 1_001 + window,
                pinned: Some(a.worker),
                ..req(&probe, 1152)
            })
            .unwrap();
        assert_eq!(d.overlap_blocks[0], 0);
    }
}

#[test]
fn a_hot_prefix_spreads_only_when_the_queue_makes_it_pay() {
    // Requests for one hot document (64 blocks, then 8 of a question of
    // its own) arrive 1 ms apart and none has finished its prefill: each
    // waits behind the ones before it on the worker holding the document.
    let mut router = Router::with_defaults();
    let _engines = four_idle(&mut router);
    let mut picks = Vec::new();
    for q in 0..60 {
        let hashes = document_and(q);
        let r = router
            .select(&SelectRequest {
                now_ms: 10_000 + u64::from(q),
                ..req(&hashes, 1152)
            })
            .unwrap();
        picks.push((r.worker.worker_id, r.overlap_blocks[0]));
    }
    let first = picks[0].0;
    // The document's worker keeps it while waiting there is cheaper than
    // computing the document again elsewhere...
    let stayed = picks.iter().take_while(|p| p.0 == first).count();
    assert!(stayed >= 2, "{picks:?}");
    // ...then a second worker takes a share and computes it once: every
    // later request there finds it (reserved or cached), so the prefix
    // spreads to the few workers its queue needs, not to every request.
    assert!(stayed < 60, "the queue never made spreading pay: {picks:?}");
    let workers: std::collections::BTreeSet<u64> = picks.iter().map(|p| p.0).collect();
    let recomputed = picks.iter().filter(|p| p.1 == 0).count();
    assert_eq!(
        recomputed,
        workers.len(),
        "the document was computed once per worker it went to: {picks:?}"
    );
    assert!(workers.len() >= 2);
}

/// `tokens` sent to `worker` at `now_ms` (a pinned select).
fn sent_to(
    router: &mut Router,
    worker: u64,
    tokens: &[u32],
    now_ms: u64,
) -> kvedge_core::router::SelectResult {
    let hashes = sequence_hashes(tokens, 16, None, None);
    let r = router
        .select(&SelectRequest {
            pinned: Some(WorkerWithDpRank::new(worker, 0)),
            now_ms,
            ..req(&hashes, tokens.len() as u32)
        })
        .unwrap();
    assert_eq!(r.worker.worker_id, worker);
    r
}

#[test]
fn a_conversation_stays_with_its_history_until_the_queue_costs_five_times_recomputing_it() {
    // The built-in policy (recompute weight 4), nothing learned: every
    // worker at the prior speed of 10,000 tokens a second. A 1,024-token
    // history went to worker 1, then `filler` more tokens of new prompts,
    // none of them through their prefill yet. The next turn adds 64 tokens:
    // on worker 1 it waits for the queue (1,024 + filler tokens) and
    // computes 64, elsewhere it computes all 1,088. The cost prices the
    // request's own prefill five times over, so it stays while
    // queue + 5 x 64 < 5 x 1,088, i.e. while the queue is under 5,120
    // tokens (with a weight of 2 it would leave at 3,072). The balance
    // term moves that little: the turn's new work is its 64 tokens, priced
    // by worker 1's share of recent traffic (4: it got both requests), so
    // the queue it stays behind is under 5,120 - 4 x 64 = 4,864 tokens.
    // (The worker computes 10-20 of them in the 1-2 ms the test takes.)
    for (filler, stays) in [(3_584u32, true), (4_096, false)] {
        let mut router = Router::with_defaults();
        let _engines = four_idle(&mut router);
        let history = prompt(5, 1024);
        for (tokens, now_ms) in [(&history, 1_000), (&prompt(9, filler), 1_001)] {
            sent_to(&mut router, 1, tokens, now_ms);
        }
        let mut turn = history;
        turn.extend(prompt(6, 64));
        let hashes = sequence_hashes(&turn, 16, None, None);
        let r = router
            .select(&SelectRequest {
                now_ms: 1_002,
                ..req(&hashes, 1088)
            })
            .unwrap();
        assert_eq!(
            r.worker.worker_id == 1,
            stays,
            "a queue of {} tokens: went to worker {} (overlap {:?})",
            1024 + filler,
            r.worker.worker_id,
            r.overlap_blocks
        );
    }
}

#[test]
fn a_worker_deep_in_a_long_prefill_costs_only_what_is_left_of_it() {
    // As above: a 1,024-token history on worker 1, then 8,192 tokens of
    // other prompts behind it, none through its prefill (an engine read
    // from its metrics, whose reports do not count prefill tokens). Every
    // worker computes at the prior 10,000 tokens a second. Right away the
    // queue is 9,216 tokens, far over the 4,864 the next turn stays for.
    // 700 ms later the worker has computed about 7,000 of them: 2,216 are
    // left, and the turn stays with its history.
    let mut router = Router::with_defaults();
    let _engines = four_idle(&mut router);
    router.set_explain_costs(true);
    let history = prompt(5, 1024);
    let mut home = None;
    let mut filler = None;
    for tokens in [&history, &prompt(9, 8_192)] {
        let r = sent_to(&mut router, 1, tokens, 1_000);
        home = r.slot;
        filler = Some(r.request_id);
    }
    let home = home.unwrap();
    let mut turn = history;
    turn.extend(prompt(6, 64));
    let hashes = sequence_hashes(&turn, 16, None, None);
    let at = |router: &mut Router, now_ms: u64, dry_run: bool| {
        let r = router
            .select(&SelectRequest {
                now_ms,
                dry_run,
                ..req(&hashes, 1088)
            })
            .unwrap();
        (r.worker.worker_id, router.last_ttft(home).queue_s)
    };
    let (went, queue_s) = at(&mut router, 1_002, true);
    assert!((queue_s - 0.9196).abs() < 1e-9, "{queue_s}");
    assert_ne!(went, 1, "a 9,196-token queue is worth leaving");
    let (went, queue_s) = at(&mut router, 1_700, true);
    assert!((queue_s - 0.2216).abs() < 1e-9, "{queue_s}");
    assert_eq!(went, 1, "2,216 tokens left: the turn stays");
    // A prefill done takes its tokens out of what can be left: only the
    // history's 1,024 remain pending, so no more than that is queued.
    router.prefill_done(filler.unwrap(), 1_100).unwrap();
    let (went, queue_s) = at(&mut router, 1_100, false);
    assert!(queue_s <= 0.1024 + 1e-9, "{queue_s}");
    assert_eq!(went, 1);
    // A clock that went back computes nothing; and what is left never
    // falls below zero.
    let (_, now) = at(&mut router, 1_100, true);
    let (_, before) = at(&mut router, 1_050, true);
    assert!(now > 0.0 && before == now, "{before} then {now}");
    let (_, queue_s) = at(&mut router, 5_000, true);
    assert_eq!(queue_s, 0.0);
}

#[test]
fn a_new_prompt_goes_to_a_worker_with_little_recent_traffic_not_the_idle_home_of_a_busy_stream() {
    // Worker 1 is the home of a hot system prompt: it served eight of its
    // requests, all finished, so it is idle right now. Workers 2-4 got one
    // 512-token request each, still queued (or `queued` tokens). A new
    // 2,048-token prompt arrives: its first token comes soonest on the idle
    // worker 1, but the prompt will bring a stream, and worker 1 already
    // has most of the recent traffic. With the balance (the default) the
    // prompt goes elsewhere while the queues there are short; a long queue
    // still outweighs it; without the balance it goes to worker 1.
    for (balance_weight, queued, home) in [
        (None, 512, false),
        (None, 8_192, true),
        (Some(0), 512, true),
    ] {
        let mut router = match balance_weight {
            None => Router::with_defaults(),
            Some(b) => router_of(
                &kvedge_policies::router_plugin_registry(),
                &format!("predicted-ttft\n      parameters:\n        balance_weight: {b}"),
            ),
        };
        let _engines = four_idle(&mut router);
        let system = prompt(7, 1024);
        let with_question = |q: u32| {
            let mut tokens = system.clone();
            tokens.extend(prompt(700 + q, 64));
            tokens
        };
        let mut now_ms = 1_000;
        for q in 0..8 {
            let r = sent_to(&mut router, 1, &with_question(q), now_ms);
            router.finish(r.request_id).unwrap();
            now_ms += 10;
        }
        for worker in 2..=4 {
            sent_to(
                &mut router,
                worker,
                &prompt(20 + worker as u32, queued),
                now_ms,
            );
        }
        let cold = sequence_hashes(&prompt(9, 2048), 16, None, None);
        let r = router
            .select(&SelectRequest {
                now_ms: now_ms + 1,
                ..req(&cold, 2048)
            })
            .unwrap();
        assert_eq!(
            r.worker.worker_id == 1,
            home,
            "balance {balance_weight:?}, {queued} tokens queued elsewhere: went to worker {}",
            r.worker.worker_id
        );
        // The hot prompt's next request stays home whatever the balance:
        // what it brings that no worker holds is its 64-token question.
        let hashes = sequence_hashes(&with_question(99), 16, None, None);
        let r = router
            .select(&SelectRequest {
                now_ms: now_ms + 2,
                ..req(&hashes, 1088)
            })
            .unwrap();
        assert_eq!(r.worker.worker_id, 1, "the hot prompt left its home");
    }
}

#[test]
fn the_default_policy_prices_recomputation_and_the_rules_see_pure_ttft() {
    // The built-in policy for aggregated workers is predicted-ttft with a
    // recompute weight of 4 and a balance weight of 1: with no traffic yet
    // (every share 1) and a prompt nobody holds (its own prefill is all
    // new), its cost is the predicted TTFT plus five times the request's
    // own prefill.
    let mut router = Router::with_defaults();
    assert_eq!(
        router.policy_name(WorkerType::Aggregated),
        ("default", "predicted-ttft")
    );
    assert_eq!(
        router.policy_name(WorkerType::Decode),
        ("default", "dynamo-default-cost-fn")
    );
    let _engines = four_idle(&mut router);
    let hashes = document_and(1);
    router.set_explain_costs(true);
    let r = router
        .select(&SelectRequest {
            dry_run: true,
            ..req(&hashes, 1152)
        })
        .unwrap();
    let terms = router.last_ttft(r.slot.unwrap());
    assert!(terms.prefill_s > 0.0);
    assert!(
        (r.cost - (terms.total_s() + 5.0 * terms.prefill_s)).abs() < 1e-12,
        "{} vs {terms:?}",
        r.cost
    );
}

/// A picker that takes the first row and keeps what the last pick's
/// context said of the prompt's sharers.
struct Sharers(Arc<AtomicU32>);

impl WorkerPicker for Sharers {
    fn required_worker_inputs(&self) -> kvedge_policies::WorkerInputs {
        kvedge_policies::WorkerInputs::CACHE
    }

    fn pick(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        _input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        self.0.store(context.prefix_sharers(), Ordering::Relaxed);
        Ok(0)
    }
}

#[test]
fn a_policy_is_told_how_many_recent_picks_sent_the_deepest_prefix_a_worker_holds() {
    let seen = Arc::new(AtomicU32::new(u32::MAX));
    let mut registry = kvedge_policies::router_plugin_registry();
    let s = Arc::clone(&seen);
    registry
        .register_worker_selection(
            "sharers",
            Arc::new(move |_parameters| {
                let s = Arc::clone(&s);
                let factory: WorkerSelectionPolicyFactory = Arc::new(
                    move |config: &RouterConfig, role: WorkerType, _: &RoutingPartition| {
                        WorkerSelectionPolicy::new(
                            config.clone(),
                            role.as_str(),
                            Vec::new(),
                            Box::new(Sharers(Arc::clone(&s))),
                        )
                    },
                );
                Ok(factory)
            }),
        )
        .unwrap();
    let mut router = router_of(&registry, "sharers");
    let mut e = engine(&mut router, 1);
    let p = sequence_hashes(&prompt(1, 256), 16, None, None);
    // The same 16 blocks, then 8 of them with another tail.
    let mut branch = sequence_hashes(&prompt(1, 128), 16, None, None);
    branch.extend(
        sequence_hashes(&prompt(2, 256), 16, None, None)
            .into_iter()
            .skip(8),
    );
    let q = sequence_hashes(&prompt(3, 256), 16, None, None);
    // Nothing held; then the prompt the first pick sent (its reservation),
    // then two; the branch's deepest held block is the eighth, which all
    // three sent; a prompt nobody sent has none.
    let mut said = Vec::new();
    for hashes in [&p, &p, &p, &branch, &q] {
        router.select(&req(hashes, 256)).unwrap();
        said.push(seen.load(Ordering::Relaxed));
    }
    assert_eq!(said, [0, 1, 2, 3, 0]);
    // A prefix the engine reported, that no pick sent, has no sharers.
    let r = sequence_hashes(&prompt(4, 256), 16, None, None);
    store(&mut router, &mut e, &r, 0);
    seen.store(u32::MAX, Ordering::Relaxed);
    router.select(&req(&r, 256)).unwrap();
    assert_eq!(seen.load(Ordering::Relaxed), 0);
}

/// The rules' `PredictedTTFT` is the policy's prediction: a worker whose
/// earlier prompt's prefill has mostly drained by now (at the predictor's
/// speed) is as near as the `predicted-ttft` policy says, not as far as
/// that prompt's whole length; and the explanation shows the same order.
#[test]
fn the_rules_and_the_policy_predict_the_same_ttft() {
    let rules = "policy:\n  rules:\n    - name: fastest\n      route:\n        select: [{ type: Local, minimize: PredictedTTFT }]\n";
    let mut plain = predicted_ttft_router();
    let mut with_rules = predicted_ttft_router();
    with_rules.set_rules(kvedge_policies::rules::load(rules).unwrap());
    for (router, ruled) in [(&mut plain, false), (&mut with_rules, true)] {
        let mut a = engine(router, 1);
        let b = engine(router, 2);
        // A holds 120 of the new prompt's 128 blocks.
        let new = sequence_hashes(&prompt(7, 2048), 16, None, None);
        a.publisher
            .publish_stored_hashes(Tier::Device, None, &new[..120])
            .unwrap();
        ingest(router, &mut a);
        // At 0 s, a 30,000-token prompt goes to A: three seconds of
        // prefill at the predictor's 10,000 tokens a second.
        let big = sequence_hashes(&prompt(8, 30_000), 16, None, None);
        let first = SelectRequest {
            pinned: Some(WorkerWithDpRank::new(1, 0)),
            ..req(&big, 30_000)
        };
        assert_eq!(router.select(&first).unwrap().slot, Some(a.slot));
        // At 2.9 s about 1,000 of its tokens are left: A is nearer than
        // B, which would compute the whole new prompt.
        router.set_explain_costs(true);
        let r = router
            .select(&SelectRequest {
                now_ms: 2_900,
                dry_run: true,
                ..req(&new, 2048)
            })
            .unwrap();
        assert_eq!(r.slot, Some(a.slot), "rules: {ruled}");
        assert_eq!(r.rule.is_some(), ruled);
        let (ta, tb) = (router.last_ttft(a.slot), router.last_ttft(b.slot));
        assert!(
            ta.total_s() < tb.total_s() && ta.total_s() < 0.2,
            "{ta:?} {tb:?}"
        );
    }
}

const COMPOSED: &str = "
policy:
  rules:
    - name: blocked
      matches: [{ tenant: blocked }]
      route:
        consider: [{ backends: { names: [none] } }]
        select: [{ type: Local }]
    - name: not-two
      matches: [{ tenant: picky }]
      route:
        exclude:
          - drop: { workerId: 2 }
        select: [{ type: Local, minimize: PredictedTTFT }]
    - name: everyone
      route:
        select: [{ type: Local, minimize: PredictedTTFT }]
";

/// Rules and pins together: a hard session binding and an explicit target
/// pass through the matching rule's consider and exclude. A binding the
/// rule keeps stands; one it drops gives way to the rule's choice (and the
/// session is bound there); a rule that rejects rejects a bound session
/// too; a target the rule drops is refused, one it keeps is served.
#[test]
fn a_binding_or_a_target_goes_through_the_rules_consider_and_exclude() {
    let mut router = Router::with_defaults();
    router.set_rules(kvedge_policies::rules::load(COMPOSED).unwrap());
    let _a = engine(&mut router, 1);
    let mut b = engine(&mut router, 2);
    let hashes = sequence_hashes(&prompt(3, 256), 16, None, None);
    b.publisher
        .publish_stored_hashes(Tier::Device, None, &hashes)
        .unwrap();
    ingest(&mut router, &mut b);
    let session = SessionContext::new("s", InputTrigger::UserMessage);
    let turn = |tenant: Option<&'static str>| SelectRequest {
        tenant,
        session: Some(session),
        ..req(&hashes, 256)
    };
    // Bound to worker 2, the prefix's holder.
    let r = router.select(&turn(None)).unwrap();
    assert_eq!(r.worker.worker_id, 2);
    router.finish(r.request_id).unwrap();
    // A rejecting rule rejects the bound session.
    let r = router.select(&turn(Some("blocked")));
    assert!(
        matches!(&r, Err(RouterError::RejectedByRule { rule }) if rule == "blocked"),
        "{r:?}"
    );
    // A rule that drops worker 2: the binding gives way, and moves.
    let r = router.select(&turn(Some("picky"))).unwrap();
    assert_eq!((r.worker.worker_id, r.rule), (1, Some(1)));
    router.finish(r.request_id).unwrap();
    let r = router.select(&turn(None)).unwrap();
    assert_eq!(r.worker.worker_id, 1, "the session moved with its turn");
    router.finish(r.request_id).unwrap();
    // An explicit target the rule drops is refused; one it keeps is served.
    let target = |id: u64| SelectRequest {
        tenant: Some("picky"),
        pinned: Some(WorkerWithDpRank::new(id, 0)),
        dry_run: true,
        ..req(&hashes, 256)
    };
    let r = router.select(&target(2));
    assert!(
        matches!(&r, Err(RouterError::TargetExcluded { rule }) if rule == "not-two"),
        "{r:?}"
    );
    assert_eq!(router.select(&target(1)).unwrap().worker.worker_id, 1);
}

/// Scores 0 for the worker the `x-prefer` header names and 1 for others.
struct PreferHeader;

impl kvedge_policies::WorkerScorer for PreferHeader {
    fn required_worker_inputs(&self) -> kvedge_policies::WorkerInputs {
        kvedge_policies::WorkerInputs::NONE
    }

    fn score(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        candidates: kvedge_policies::view::WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        let preferred: Option<u64> = context
            .agent_headers()
            .and_then(|h| h.get("x-prefer"))
            .and_then(|v| v.parse().ok());
        for (c, cost) in candidates.iter().zip(costs) {
            *cost = if Some(c.worker().worker_id) == preferred {
                0.0
            } else {
                1.0
            };
        }
        Ok(())
    }
}

/// A tier that ranks by a worker-selection instance ranks with the
/// request's own context: its headers reach the instance's scorers.
#[test]
fn a_tier_ranking_by_a_policy_sees_the_requests_context() {
    let mut registry = kvedge_policies::router_plugin_registry();
    registry
        .register_worker_selection(
            "prefer-header",
            Arc::new(|_parameters| {
                let factory: WorkerSelectionPolicyFactory = Arc::new(
                    |config: &RouterConfig, role: WorkerType, _: &RoutingPartition| {
                        WorkerSelectionPolicy::new(
                            config.clone(),
                            role.as_str(),
                            vec![Box::new(PreferHeader)],
                            Box::new(Counting {
                                picks: Arc::default(),
                                warms: Arc::default(),
                            }),
                        )
                    },
                );
                Ok(factory)
            }),
        )
        .unwrap();
    let config = kvedge_config::Config::load(
        "test",
        "worker_selection:\n  instances:\n    - name: pref\n      type: prefer-header\npolicy:\n  rules:\n    - name: by-pref\n      route:\n        select: [{ type: Local, minimize: { policy: pref } }]\n",
        &registry,
        &Default::default(),
    )
    .unwrap();
    let mut router = Router::from_config(&config);
    let _a = engine(&mut router, 1);
    let _b = engine(&mut router, 2);
    let hashes = sequence_hashes(&prompt(4, 64), 16, None, None);
    for preferred in ["2", "1", "2"] {
        let headers = kvedge_policies::AgentHeaders::from_pairs([("X-Prefer", preferred)]);
        let r = router
            .select(&SelectRequest {
                headers: Some(&headers),
                dry_run: true,
                ..req(&hashes, 64)
            })
            .unwrap();
        assert_eq!(r.worker.worker_id.to_string(), preferred);
    }
}
