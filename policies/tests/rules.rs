//! The rule language: worked examples of every construct, each validation error with
//! its message, predicate forms and absence, FallThrough chains, tie breaks
//! with a fixed seed, and zero allocations per decision.

#![forbid(unsafe_code)]

use kvedge_policies::rules::{Outcome, RuleCandidate, RuleEngine, RuleRequest, TagBuf, load};
use kvedge_policies::{AgentHeaders, WorkerWithDpRank};

fn req<'a>(model: &'a str, tenant: Option<&'a str>, tags: &'a [&'a str]) -> RuleRequest<'a> {
    RuleRequest {
        model,
        tenant,
        role: None,
        prompt_tokens: 1024,
        block_size: 16,
        session_id: None,
        priority: 0,
        headers: None,
        tags,
        selection: None,
        pinned: None,
    }
}

/// A local worker with load: `queued` prefill tokens, `overlap` device blocks.
fn local(model: &'static str, id: u64, queued: u64, overlap: u32) -> RuleCandidate<'static> {
    let mut c = RuleCandidate::local(model, WorkerWithDpRank::new(id, 0));
    c.active_prefill_tokens = Some(queued);
    c.device_overlap_blocks = Some(overlap);
    c.waiting_requests = Some(0);
    c.active_requests = Some(0);
    c.kv_usage = Some(0.5);
    c.backend = Some(if model == "gemma-4" {
        "small-pool"
    } else {
        "big-pool"
    });
    c
}

fn engine(yaml: &str) -> RuleEngine {
    RuleEngine::new(load(yaml).unwrap_or_else(|e| panic!("{e}")))
}

fn chosen(d: kvedge_policies::rules::Decision) -> Option<usize> {
    match d.outcome {
        Outcome::Chosen(i) => Some(i),
        _ => None,
    }
}

// ---- worked examples ----

const MATCHES_EXAMPLE: &str = "
policy:
  rules:
    - name: alice-or-bob
      matches:
        - { model: qwen-2.5, tenant: alice } # alice's requests for qwen-2.5,
        - tenant: bob # or any request from bob
      route:
        select:
          - { type: Local }
        onEmpty: FallThrough
";

#[test]
fn matches_is_or_across_entries_and_and_within_one() {
    let mut e = engine(MATCHES_EXAMPLE);
    let cands = [local("qwen-2.5", 1, 0, 0), local("gemma-4", 2, 0, 0)];
    let cases = [
        ("qwen-2.5", Some("alice"), true),
        ("gemma-4", Some("alice"), false), // alice, but not for qwen-2.5
        ("gemma-4", Some("bob"), true),    // any request from bob
        ("qwen-2.5", Some("carol"), false),
        ("qwen-2.5", None, false), // no tenant: `tenant: alice` is false
    ];
    for (model, tenant, matches) in cases {
        let d = e.decide(&req(model, tenant, &[]), &cands);
        assert_eq!(d.rule.is_some(), matches, "{model} {tenant:?}: {d:?}");
    }
}

const CHEAPER_MODEL: &str = "
policy:
  rules:
    - name: simple-requests-to-the-small-model
      matches:
        - { tag: complexity-low }
      route:
        consider:
          - models: { names: [gemma-4] }
        select:
          - { type: Local, minimize: PredictedTTFT }
    - name: let-both-compete
      matches:
        - { tag: complexity-medium }
      route:
        consider:
          - models: { names: [gemma-4, qwen-2.5] }
        select:
          - { type: Local, minimize: PredictedTTFT }
    - name: default
      route:
        select:
          - { type: Local, minimize: PredictedTTFT }
classifiers:
  length: { low: 512, high: 4096 }
";

#[test]
fn a_low_complexity_request_goes_to_the_smaller_model_unless_caching_makes_the_big_one_faster() {
    let mut e = engine(CHEAPER_MODEL);
    // gemma-4 idle; qwen-2.5 busier but holding most of the prompt.
    let cands = [
        local("qwen-2.5", 1, 500, 60), // 960 of 1024 tokens cached
        local("gemma-4", 2, 0, 0),
    ];
    let mut tags = TagBuf::default();
    assert!(e.classify(300, &mut tags));
    assert_eq!(tags.as_slice(), ["complexity-low"]);
    let low = RuleRequest {
        prompt_tokens: 300,
        ..req("qwen-2.5", None, tags.as_slice())
    };
    let d = e.decide(&low, &cands);
    assert_eq!(
        (d.rule, chosen(d)),
        (Some(0), Some(1)),
        "only gemma-4 is considered"
    );
    // Medium: both compete; qwen's cache wins (500 + 64 tokens vs 1024).
    let medium = ["complexity-medium"];
    let d = e.decide(&req("qwen-2.5", None, &medium), &cands);
    assert_eq!((d.rule, chosen(d)), (Some(1), Some(0)));
    // Without a cache hit gemma-4 is faster.
    let cold = [local("qwen-2.5", 1, 500, 0), local("gemma-4", 2, 0, 0)];
    assert_eq!(
        chosen(e.decide(&req("qwen-2.5", None, &medium), &cold)),
        Some(1)
    );
    // High complexity: the default rule considers the request's own model.
    let high = ["complexity-high"];
    let d = e.decide(&req("qwen-2.5", None, &high), &cold);
    assert_eq!((d.rule, chosen(d)), (Some(2), Some(0)));
}

const PII_AND_PROVIDERS: &str = "
policy:
  seed: 7
  rules:
    - name: pii-never-leaves
      matches:
        - { tag: [pii-confirmed, pii-unknown] } # not just pii-confirmed
      route:
        consider:
          - backends: {}
        select:
          - { type: Local, minimize: PredictedTTFT }
        onEmpty: Reject
    - name: local-then-provider
      route:
        consider:
          - models: { names: [llama-70b] }
          - providers: { names: [databricks, together] }
        exclude:
          - if: { tenant: free-tier }
            drop: { type: Provider }
          - drop: { kvUsage: { greaterThan: 0.9 } }
        select:
          - { type: Local, minimize: PredictedTTFT }
          - { type: Provider, order: [databricks, together] }
        tieBreak: PreferLocal
        onEmpty: Reject
providers:
  - { name: together, models: [llama-70b], endpoint: 'https://api.together.example' }
  - { name: databricks, models: [llama-70b], endpoint: 'https://databricks.example', labels: { region: us } }
";

fn fleet(full: bool) -> Vec<RuleCandidate<'static>> {
    let mut a = local("llama-70b", 1, 100, 0);
    let mut b = local("llama-70b", 2, 0, 0);
    if full {
        a.kv_usage = Some(0.95);
        b.kv_usage = Some(0.99);
    }
    vec![
        a,
        b,
        RuleCandidate::provider("together", "llama-70b"),
        RuleCandidate::provider("databricks", "llama-70b"),
    ]
}

#[test]
fn local_first_then_providers_in_order() {
    let mut e = engine(PII_AND_PROVIDERS);
    let policy = e.policy();
    assert_eq!(policy.providers.len(), 2);
    assert_eq!(policy.providers[1].labels, ["region=us"]);
    let d = e.decide(&req("llama-70b", Some("acme"), &[]), &fleet(false));
    assert_eq!(
        (d.rule, d.tier, chosen(d)),
        (Some(1), Some(0), Some(1)),
        "the idle local worker"
    );
    // Every local worker's KV cache is nearly full: excluded; databricks
    // comes before together in `order`, whatever the candidate order.
    let d = e.decide(&req("llama-70b", Some("acme"), &[]), &fleet(true));
    assert_eq!((d.tier, chosen(d)), (Some(1), Some(3)));
    assert_eq!((d.considered, d.after_exclude), (4, 2));
}

#[test]
fn pii_never_leaves_the_cluster() {
    let mut e = engine(PII_AND_PROVIDERS);
    for tag in ["pii-confirmed", "pii-unknown"] {
        let tags = [tag];
        let d = e.decide(&req("llama-70b", None, &tags), &fleet(false));
        assert_eq!(d.rule, Some(0));
        assert!(
            matches!(d.outcome, Outcome::Chosen(i) if i < 2),
            "{tag}: a local worker"
        );
        // No local worker: rejected, not sent to a provider.
        let providers_only = &fleet(false)[2..];
        let d = e.decide(&req("llama-70b", None, &tags), providers_only);
        assert_eq!((d.rule, d.outcome), (Some(0), Outcome::Rejected));
    }
}

#[test]
fn free_tier_requests_never_go_to_providers() {
    let mut e = engine(PII_AND_PROVIDERS);
    let d = e.decide(&req("llama-70b", Some("free-tier"), &[]), &fleet(true));
    assert_eq!((d.rule, d.outcome), (Some(1), Outcome::Rejected));
    assert_eq!(d.after_exclude, 0);
}

#[test]
fn fall_through_chains_to_the_next_rule_and_counts_it() {
    let mut e = engine(
        "
policy:
  rules:
    - name: only-gpu-a
      matches: [{ model: m }]
      route:
        consider: [{ backends: { labels: { gpu: a } } }]
        select: [{ type: Local }]
        onEmpty: FallThrough
    - name: only-gpu-b
      matches: [{ model: m }]
      route:
        consider: [{ backends: { labels: { gpu: b } } }]
        select: [{ type: Local }]
        onEmpty: FallThrough
    - name: reject
      route:
        consider: [{ backends: { names: [nothing] } }]
        select: [{ type: Any }]
",
    );
    let (gpu_b, gpu_c) = (["gpu=b".to_owned()], ["gpu=c".to_owned()]);
    let mut b = RuleCandidate::local("m", WorkerWithDpRank::new(9, 0));
    b.labels = &gpu_b;
    let d = e.decide(&req("m", None, &[]), &[b]);
    assert_eq!((d.rule, d.fell_through, chosen(d)), (Some(1), 1, Some(0)));
    let mut c = b;
    c.labels = &gpu_c;
    let d = e.decide(&req("m", None, &[]), &[c]);
    assert_eq!(
        (d.rule, d.fell_through, d.outcome),
        (Some(2), 2, Outcome::Rejected)
    );
    let d = e.decide(&req("other", None, &[]), &[c]);
    assert_eq!((d.rule, d.fell_through), (Some(2), 0));
}

#[test]
fn no_matching_rule_is_its_own_outcome() {
    let mut e = engine(MATCHES_EXAMPLE);
    let d = e.decide(&req("x", Some("carol"), &[]), &[local("x", 1, 0, 0)]);
    assert_eq!((d.rule, d.outcome), (None, Outcome::NoRuleMatched));
}

// ---- tie breaks ----

const TIES: &str = "
policy:
  seed: 3
  rules:
    - name: any
      route:
        consider: [{ backends: {} }, { providers: {} }]
        select: [{ type: Any }]
        TIEBREAK
";

#[test]
fn tie_breaks_first_in_rank_order_prefer_local_and_seeded_random() {
    let cands = [
        RuleCandidate::provider("p", "m"),
        local("m", 1, 0, 0),
        local("m", 2, 0, 0),
    ];
    let r = req("m", None, &[]);
    let mut first = engine(&TIES.replace("TIEBREAK", ""));
    assert_eq!(chosen(first.decide(&r, &cands)), Some(0));
    let mut prefer = engine(&TIES.replace("TIEBREAK", "tieBreak: PreferLocal"));
    assert_eq!(chosen(prefer.decide(&r, &cands)), Some(1));
    let run = || {
        let mut e = engine(&TIES.replace("TIEBREAK", "tieBreak: Random"));
        (0..300)
            .map(|_| chosen(e.decide(&r, &cands)).unwrap())
            .collect::<Vec<_>>()
    };
    let a = run();
    assert_eq!(a, run(), "fixed seed, same choices");
    for i in 0..3 {
        let n = a.iter().filter(|&&x| x == i).count();
        assert!((60..=140).contains(&n), "candidate {i}: {n}/300");
    }
}

// ---- predicates ----

#[test]
fn every_predicate_form_and_absence() {
    let yaml = |pred: &str| {
        format!(
            "policy:\n  rules:\n    - name: r\n      matches:\n        - {pred}\n      route:\n        consider: [{{ backends: {{}} }}]\n        select: [{{ type: Local }}]\n        onEmpty: FallThrough\n"
        )
    };
    let headers = AgentHeaders::from_pairs([("X-Agent", "claude")]);
    let tags = ["code-high"];
    let base = RuleRequest {
        model: "m",
        tenant: Some("alice"),
        role: None,
        prompt_tokens: 3000,
        block_size: 16,
        session_id: None,
        priority: 2,
        headers: Some(&headers),
        tags: &tags,
        selection: None,
        pinned: None,
    };
    let cands = [local("m", 1, 0, 0)];
    let cases = [
        ("{ tenant: alice }", true),
        ("{ tenant: [bob, alice] }", true),
        ("{ tenant: { equal: alice } }", true),
        ("{ tenant: { notEqual: alice } }", false),
        ("{ tenant: { in: [bob] } }", false),
        ("{ tenant: { notIn: [bob] } }", true),
        ("{ promptTokens: { greaterThan: 2048 } }", true),
        ("{ promptTokens: { lessThan: 2048 } }", false),
        ("{ promptTokens: { greaterOrEqual: 3000 } }", true),
        ("{ priority: { lessOrEqual: 1 } }", false),
        ("{ requestBlocks: 188 }", true),
        ("{ tag: code-high }", true),
        ("{ tag: { notIn: [code-low] } }", true),
        ("{ header.x-agent: claude }", true),
        // Absent attributes: false whatever the operator, negated or not.
        ("{ role: { notEqual: prefill } }", false),
        ("{ sessionId: { notIn: [s1] } }", false),
        ("{ header.x-missing: { exists: true } }", false),
        ("{ header.x-missing: { exists: false } }", true),
        ("{ sessionId: { exists: false } }", true),
        ("{ tenant: { exists: false } }", false),
    ];
    for (pred, expected) in cases {
        let mut e = engine(&yaml(pred));
        let d = e.decide(&base, &cands);
        assert_eq!(d.rule.is_some(), expected, "{pred}");
    }
}

#[test]
fn duration_predicates_compare_in_seconds() {
    // PredictedTTFT of the busy worker: (10_000 + 1024) / 10_000 ≈ 1.1 s.
    let mut e = engine(
        "
policy:
  rules:
    - name: r
      route:
        consider: [{ backends: {} }]
        exclude:
          - drop: { PredictedTTFT: { greaterThan: 500ms } }
        select: [{ type: Local }]
",
    );
    let cands = [local("m", 1, 10_000, 0), local("m", 2, 0, 0)];
    assert_eq!(chosen(e.decide(&req("m", None, &[]), &cands)), Some(1));
    let d = e.decide(&req("m", None, &[]), &cands[..1]);
    assert_eq!(d.outcome, Outcome::Rejected);
}

// ---- validation ----

fn load_err(yaml: &str) -> String {
    load(yaml).unwrap_err().to_string()
}

#[test]
fn validation_errors_name_rule_field_and_line() {
    let cases = [
        (
            "policy:\n  rules:\n    - name: catch-all\n      route:\n        select: [{ type: Local }]\n    - name: later\n      matches: [{ tenant: a }]\n      route:\n        select: [{ type: Local }]\n",
            "rule `catch-all`, matches (line 3): a rule without `matches` matches every request, so it must be the last rule",
        ),
        (
            "policy:\n  rules:\n    - name: r\n      route:\n        consider: []\n        select: [{ type: Local }]\n",
            "rule `r`, route.consider (line 5): an empty list is not allowed",
        ),
        (
            "policy:\n  rules:\n    - name: r\n      route:\n        consider: [{ backends: {} }]\n",
            "rule `r`, route.select (line 3): every rule needs `select`",
        ),
        (
            "policy:\n  rules:\n    - name: r\n      matches:\n        - { tenant: { in: [a], notIn: [b] } }\n      route:\n        select: [{ type: Local }]\n",
            "rule `r`, matches (line 4): `tenant`: an operator map takes exactly one key, got 2",
        ),
        (
            "policy:\n  rules:\n    - name: r\n      matches:\n        - { tennant: a }\n      route:\n        select: [{ type: Local }]\n",
            "rule `r`, matches (line 4): unknown request attribute `tennant`",
        ),
        (
            "policy:\n  rules:\n    - name: r\n      route:\n        select:\n          - { type: Local, minimize: Latency }\n",
            "rule `r`, route.select[0] (line 5): unknown objective `Latency`",
        ),
        (
            "policy:\n  rules:\n    - name: r\n      route:\n        select:\n          - { type: Any, minimize: PredictedTTFT }\n",
            "rule `r`, route.select[0] (line 5): objective `PredictedTTFT` is defined only for Local candidates, so a `Any` tier cannot minimize it",
        ),
        (
            "policy:\n  rules:\n    - name: r\n      route:\n        exclude:\n          - drop: { colour: red }\n        select: [{ type: Local }]\n",
            "rule `r`, route.exclude.drop (line 6): unknown candidate attribute `colour`",
        ),
        (
            "policy:\n  rules:\n    - name: r\n      route:\n        select: [{ type: Local }]\n        tieBreak: Fastest\n",
            "unknown variant `Fastest`",
        ),
    ];
    for (yaml, expected) in cases {
        let msg = load_err(yaml);
        assert!(msg.contains(expected), "expected `{expected}` in:\n{msg}");
    }
}

// ---- allocation ----

#[test]
fn a_warm_decision_allocates_nothing() {
    let mut e = engine(PII_AND_PROVIDERS);
    let cands = fleet(true);
    let tags: [&str; 0] = [];
    let r = req("llama-70b", Some("acme"), &tags);
    e.decide(&r, &cands);
    let info = allocation_counter::measure(|| {
        for _ in 0..100 {
            std::hint::black_box(e.decide(&r, &cands));
        }
    });
    assert_eq!(info.count_total, 0, "{info:?}");
}

// ---- the regex classifier ----

#[test]
fn regex_classifier_tags_confirmed_unknown_or_nothing() {
    let policy = load(
        r#"
policy:
  rules:
    - name: pii-local
      matches: [{ tag: [pii-confirmed, pii-unknown] }]
      route:
        consider: [{ backends: {} }]
        select: [{ type: Local }]
    - name: anywhere
      route:
        consider: [{ providers: {} }]
        select: [{ type: Provider }]
classifiers:
  regex:
    max_text_bytes: 64
    unknown_when_skipped: true
    patterns:
      pii: '\b\d{3}-\d{2}-\d{4}\b'
      code: '```'
"#,
    )
    .unwrap();
    let regex = policy.regex.clone().expect("configured");
    let mut e = RuleEngine::new(policy);
    let cands = [local("m", 1, 0, 0), RuleCandidate::provider("p", "m")];
    let route = |e: &mut RuleEngine, text: Option<&str>| {
        let mut tags = TagBuf::default();
        regex.classify(text, &mut tags);
        let tags_now: Vec<String> = tags.as_slice().iter().map(|t| t.to_string()).collect();
        (
            tags_now,
            chosen(e.decide(&req("m", None, tags.as_slice()), &cands)),
        )
    };
    assert_eq!(
        route(&mut e, Some("my ssn is 123-45-6789")),
        (vec!["pii-confirmed".to_string()], Some(0))
    );
    assert_eq!(route(&mut e, Some("nothing to see")), (vec![], Some(1)));
    // Too long to scan within the budget, or no text: explicit unknown.
    let long = "x".repeat(65);
    let (tags, to) = route(&mut e, Some(&long));
    assert_eq!(
        (tags, to),
        (vec!["code-unknown".into(), "pii-unknown".into()], Some(0))
    );
    assert_eq!(route(&mut e, None).1, Some(0));
    // By default a skipped classifier emits nothing.
    let quiet =
        load("classifiers:\n  regex:\n    max_text_bytes: 4\n    patterns:\n      pii: 'x'\n")
            .unwrap();
    let mut tags = TagBuf::default();
    quiet
        .regex
        .as_ref()
        .unwrap()
        .classify(Some("xxxxxxxx"), &mut tags);
    assert!(tags.as_slice().is_empty());
    quiet
        .regex
        .as_ref()
        .unwrap()
        .classify(Some("xx"), &mut tags);
    assert_eq!(tags.as_slice(), ["pii-confirmed"]);
}

#[test]
fn invalid_regex_patterns_are_refused_at_load() {
    let msg = load_err("classifiers:\n  regex:\n    patterns:\n      pii: '(unclosed'\n");
    assert!(
        msg.starts_with("classifiers.regex.patterns.pii (line 4): regex parse error"),
        "{msg}"
    );
    let msg = load_err("classifiers:\n  regex:\n    patterns:\n      Bad-Name: 'x'\n");
    assert!(msg.contains("a tag type is lowercase"), "{msg}");
}

#[test]
fn providers_need_unique_non_empty_names_and_order_names_real_ones() {
    let base = "policy:\n  rules:\n    - name: r\n      route:\n        select:\n          - type: Provider\n            order: [a, ghost]\nproviders:\n  - name: a\n    models: [m]\n    endpoint: http://a\n";
    let msg = load_err(base);
    assert_eq!(
        msg,
        "rule `r`, route.select.order (line 7): `ghost` is not a provider in `providers:`"
    );
    let dup = format!(
        "{}  - name: a\n    models: [m]\n    endpoint: http://b\n",
        base.replace(", ghost", "")
    );
    assert_eq!(
        load_err(&dup),
        "providers.a (line 9): another provider has the same name (rules could not tell them apart)"
    );
    let empty = base.replace(", ghost", "").replace("name: a", "name: ''");
    assert!(
        load_err(&empty).starts_with("providers (line 8): a provider needs a non-empty name"),
        "{}",
        load_err(&empty)
    );
}

// ---- ranking by a worker-selection instance (the two seeds joined) ----

const JOINED: &str = "
worker_selection:
  instances:
    - name: fewest-requests
      type: least-busy
      parameters: { min_device_overlap_blocks: 1 }
policy:
  rules:
    - name: by-policy
      route:
        consider: [{ backends: {} }, { providers: {} }]
        select:
          - { type: Local, minimize: { policy: fewest-requests } }
          - { type: Provider }
";

fn plugins(yaml: &str) -> kvedge_policies::RouterPlugins {
    let config = kvedge_policies::WorkerSelectionConfig::from_yaml_str(yaml).unwrap();
    kvedge_policies::router_plugin_registry()
        .resolve_plugins(
            &config,
            &kvedge_policies::SelectionOverrides::default(),
            &kvedge_policies::RouterConfig::default(),
        )
        .unwrap()
}

#[test]
fn a_tier_can_minimize_the_cost_of_a_worker_selection_instance() {
    let p = plugins(JOINED);
    let policy = kvedge_policies::rules::load_with(JOINED, Some(&p)).unwrap();
    let mut e = RuleEngine::new(policy);
    let mut busy = local("m", 1, 0, 4);
    busy.active_requests = Some(9);
    let mut idle_cold = local("m", 2, 0, 0); // filtered: no device overlap
    idle_cold.active_requests = Some(0);
    let mut light = local("m", 3, 0, 2);
    light.active_requests = Some(2);
    let provider = RuleCandidate::provider("p", "m");
    let r = req("m", None, &[]);
    let d = e.decide(&r, &[busy, idle_cold, light, provider]);
    assert_eq!(
        (d.tier, chosen(d)),
        (Some(0), Some(2)),
        "fewest requests among those with overlap"
    );
    // Every local worker filtered out by the instance: the next tier.
    let d = e.decide(&r, &[idle_cold, provider]);
    assert_eq!((d.tier, chosen(d)), (Some(1), Some(1)));
    let info = allocation_counter::measure(|| {
        for _ in 0..50 {
            std::hint::black_box(e.decide(&r, &[busy, idle_cold, light, provider]));
        }
    });
    assert_eq!(info.count_total, 0, "{info:?}");
}

#[test]
fn policy_objectives_are_validated_at_load() {
    let msg = load_err(JOINED);
    assert!(
        msg.contains("needs the worker_selection configuration"),
        "{msg}"
    );
    let p = plugins(JOINED);
    let unknown = JOINED.replace("{ policy: fewest-requests }", "{ policy: nope }");
    let msg = kvedge_policies::rules::load_with(&unknown, Some(&p))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("`nope` is neither `default` nor a configured worker_selection instance"),
        "{msg}"
    );
    let any = JOINED.replace(
        "{ type: Local, minimize: { policy",
        "{ type: Any, minimize: { policy",
    );
    let msg = kvedge_policies::rules::load_with(&any, Some(&p))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("defined only for Local candidates"), "{msg}");
    let builtin = JOINED.replace("{ policy: fewest-requests }", "{ policy: default }");
    assert!(kvedge_policies::rules::load_with(&builtin, Some(&p)).is_ok());
}
