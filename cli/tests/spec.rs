//! The two specifications' request-side features reach a real daemon:
//! what started a session's turn (a trigger-keyed policy sees it), a
//! session's last turn (its binding ends), an explicit target (no policy
//! runs), over JSON lines and binary frames alike.

#![forbid(unsafe_code)]

mod common;

use common::{Conn, Daemon, start, wait_for};
use kvedge_schema::messages::{Load, Tier};
use kvedge_shm::Publisher;
use kvedge_wire::{Ids, Role, Select, Target, Trigger};
use serde_json::{Value, json};

const BASE: &str = "daemon:\n  heartbeat_timeout_ms: 600000\n";

fn engine(d: &Daemon, id: u64) -> Publisher {
    common::engine(&d.control(), id, "llama")
}

fn prompt(prefix: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| prefix * 100_000 + i).collect()
}

fn select(tokens: &[u32], extra: Value) -> Value {
    let mut q = json!({"op": "select", "model": "llama", "tokens": tokens, "dry_run": true});
    for (k, v) in extra.as_object().unwrap() {
        q[k] = v.clone();
    }
    q
}

/// `tool-result-cache-local` sends tool-result turns to the most device
/// overlap and every other turn through the default cost: worker 1 holds
/// two of the prompt's blocks but is busy decoding, so a user's turn goes
/// to idle worker 2 and a tool's result comes back to worker 1, whether
/// the client speaks JSON or binary frames.
#[test]
fn a_tool_turn_reaches_a_trigger_keyed_policy() {
    let d = start(
        "spec-trigger",
        &format!(
            "{BASE}router:\n  router_temperature: 0\nworker_selection:\n  aggregated: tools\n  instances:\n    - name: tools\n      type: tool-result-cache-local\n"
        ),
    );
    let seed = kvedge_schema::hash::block_seed(None, None);
    let tokens = prompt(1, 512);
    let mut a = engine(&d, 1);
    let mut b = engine(&d, 2);
    a.publish_stored_tokens(Tier::Device, None, &tokens[..32], 16, seed)
        .unwrap();
    let busy = Load {
        active_requests: 40,
        active_decode_blocks: 5000,
        kv_total_blocks: 1024,
        ..Load::default()
    };
    a.publish_load(&busy).unwrap();
    b.publish_load(&Load {
        kv_total_blocks: 1024,
        ..Load::default()
    })
    .unwrap();
    let mut c = Conn::connect(&d.query());
    wait_for(
        || c.ask(select(&tokens, json!({})))["worker_id"] == 2,
        "the busy worker's load",
    );
    let user = c.ask(select(&tokens, json!({"session": "agent-1"})));
    assert_eq!(user["worker_id"], 2, "{user}");
    let tool = c.ask(select(
        &tokens,
        json!({"session": "agent-1", "trigger": "tool"}),
    ));
    assert_eq!(
        (&tool["worker_id"], &tool["overlap_blocks"]["device"]),
        (&json!(1), &json!(2)),
        "{tool}"
    );
    // The same over binary frames.
    let mut w = kvedge_wire::Client::connect(d.query()).unwrap();
    let base = Select {
        dry_run: true,
        session: Some("agent-1"),
        ..Select::new("llama", Role::Aggregated, Ids::tokens(&tokens))
    };
    assert_eq!(w.select(&base).unwrap().unwrap().worker_id, 2);
    let tool = Select {
        trigger: Trigger::Tool,
        ..base
    };
    assert_eq!(w.select(&tool).unwrap().unwrap().worker_id, 1);
    // Session metadata without a session is refused, and changes nothing.
    let e = c.ask(select(&tokens, json!({"trigger": "tool"})));
    assert_eq!(e["error"]["code"], "bad_request", "{e}");
    assert_eq!(c.ask(select(&tokens, json!({})))["worker_id"], 2);
    drop((a, b));
}

/// Hard affinity keeps a session on its worker until the session's final
/// turn, which is placed there and ends the binding; an explicit target
/// takes the exact-target path over both the policy and the binding.
#[test]
fn a_final_turn_ends_its_binding_and_a_target_is_served_exactly() {
    let d = start("spec-session", BASE);
    let seed = kvedge_schema::hash::block_seed(None, None);
    let tokens = prompt(2, 256);
    let a = engine(&d, 1);
    let b = engine(&d, 2);
    let mut c = Conn::connect(&d.query());
    wait_for(
        || c.ask(json!({"op": "stats"}))["workers"] == 2,
        "both engines",
    );
    // The session is bound to wherever its first turn goes.
    let first = c.ask(json!({"op": "select", "model": "llama", "tokens": tokens, "session": "s"}));
    let bound = first["worker_id"].as_u64().expect("a worker");
    let id = first["request_id"].as_u64().unwrap();
    assert_eq!(c.ask(json!({"op": "finish", "request_id": id}))["ok"], true);
    // The other worker comes to hold the whole prompt: a select without
    // the session goes there, one with it stays where it is bound.
    let other = 3 - bound;
    let mut holder = if other == 2 { b } else { a };
    holder
        .publish_stored_tokens(Tier::Device, None, &tokens, 16, seed)
        .unwrap();
    wait_for(
        || c.ask(select(&tokens, json!({})))["worker_id"] == other,
        "the other worker's blocks",
    );
    assert_eq!(
        c.ask(select(&tokens, json!({"session": "s"})))["worker_id"],
        bound
    );
    // A target overrides both; one that is not registered is no worker.
    let t = c.ask(select(
        &tokens,
        json!({"session": "s", "target": {"worker_id": other}}),
    ));
    assert_eq!(t["worker_id"], other, "{t}");
    let t = c.ask(select(&tokens, json!({"target": {"worker_id": bound}})));
    assert_eq!(t["worker_id"], bound, "{t}");
    let t = c.ask(select(&tokens, json!({"target": {"worker_id": 9}})));
    assert_eq!(t["error"]["code"], "no_worker", "{t}");
    let mut w = kvedge_wire::Client::connect(d.query()).unwrap();
    let targeted = Select {
        dry_run: true,
        target: Some(Target {
            worker_id: bound,
            dp_rank: 0,
        }),
        ..Select::new("llama", Role::Aggregated, Ids::tokens(&tokens))
    };
    assert_eq!(w.select(&targeted).unwrap().unwrap().worker_id, bound);
    // A dry run of the final turn ends nothing.
    let last = json!({"session": "s", "final": true});
    assert_eq!(c.ask(select(&tokens, last.clone()))["worker_id"], bound);
    assert_eq!(
        c.ask(select(&tokens, json!({"session": "s"})))["worker_id"],
        bound
    );
    // The final turn goes to the bound worker and ends the binding: the
    // session's next select is the policy's.
    let mut fin = select(&tokens, last);
    fin["dry_run"] = json!(false);
    let r = c.ask(fin);
    assert_eq!(r["worker_id"], bound, "{r}");
    assert_eq!(
        c.ask(select(&tokens, json!({"session": "s"})))["worker_id"],
        other
    );
    drop(holder);
}

/// Registers worker `id` with `labels` (`key=value`).
fn labelled(d: &Daemon, id: u64, labels: &[(&str, &str)]) -> Publisher {
    let hello = kvedge_schema::messages::control::Hello {
        labels: labels
            .iter()
            .map(|(k, v)| kvedge_schema::messages::control::Label {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..common::hello(id, "llama")
    };
    kvedge_testkit::register(d.control(), &hello)
}

/// The rule language's backends are the engines' labels: `backends:
/// { names }` and a Local tier's `order` read the `backend` label,
/// `backends: { labels }` and `backend.labels.<key>` every label, and
/// providers' labels are matched the same way.
#[test]
fn rules_match_the_backend_names_and_labels_engines_register_with() {
    let rules = "policy:\n  rules:\n    - name: h100\n      matches: [{ tenant: gold }]\n      route:\n        consider: [{ backends: { labels: { gpu: h100 } } }]\n        select: [{ type: Local }]\n    - name: named\n      matches: [{ tenant: silver }]\n      route:\n        consider: [{ backends: { names: [slow] } }]\n        select: [{ type: Local }]\n    - name: not-h100\n      matches: [{ tenant: bronze }]\n      route:\n        exclude: [{ drop: { backend.labels.gpu: h100 } }]\n        select: [{ type: Local }]\n    - name: fast-first\n      matches: [{ tenant: fast-first }]\n      route:\n        consider: [{ backends: {} }]\n        select: [{ type: Local, order: [fast, slow] }]\n    - name: slow-first\n      matches: [{ tenant: slow-first }]\n      route:\n        consider: [{ backends: {} }]\n        select: [{ type: Local, order: [slow, fast] }]\n    - name: eu\n      matches: [{ tenant: eu }]\n      route:\n        consider: [{ providers: {} }]\n        exclude: [{ drop: { backend.labels.region: us } }]\n        select: [{ type: Provider }]\n    - name: nowhere\n      matches: [{ tenant: nowhere }]\n      route:\n        consider: [{ backends: { names: [absent] } }]\n        select: [{ type: Local }]\n    - name: rest\n      route:\n        select: [{ type: Local, minimize: PredictedTTFT }]\nproviders:\n  - { name: us-cloud, models: [llama], endpoint: 'https://us.example', labels: { region: us } }\n  - { name: eu-cloud, models: [llama], endpoint: 'https://eu.example', labels: { region: eu } }\n";
    let d = start("spec-labels", &format!("{BASE}{rules}"));
    let a = labelled(&d, 1, &[("backend", "fast"), ("gpu", "h100")]);
    let b = labelled(&d, 2, &[("backend", "slow"), ("gpu", "a10")]);
    let mut c = Conn::connect(&d.query());
    wait_for(
        || c.ask(json!({"op": "stats"}))["workers"] == 2,
        "both engines",
    );
    let tokens = prompt(3, 64);
    let mut pick = |tenant: &str| {
        let r = c.ask(select(&tokens, json!({"tenant": tenant})));
        (
            r["rule"].clone(),
            r["worker_id"].clone(),
            r["provider"].clone(),
        )
    };
    assert_eq!(pick("gold"), (json!("h100"), json!(1), json!(null)));
    assert_eq!(pick("silver"), (json!("named"), json!(2), json!(null)));
    assert_eq!(pick("bronze"), (json!("not-h100"), json!(2), json!(null)));
    assert_eq!(
        pick("fast-first"),
        (json!("fast-first"), json!(1), json!(null))
    );
    assert_eq!(
        pick("slow-first"),
        (json!("slow-first"), json!(2), json!(null))
    );
    assert_eq!(pick("eu"), (json!("eu"), json!(null), json!("eu-cloud")));
    let r = c.ask(select(&tokens, json!({"tenant": "nowhere"})));
    assert_eq!(r["error"]["code"], "rejected", "{r}");
    // A label whose key is empty is refused at registration.
    let bad = kvedge_schema::messages::control::Hello {
        labels: vec![kvedge_schema::messages::control::Label {
            key: String::new(),
            value: "x".into(),
        }],
        ..common::hello(3, "llama")
    };
    assert!(
        kvedge_shm::control::ProducerSession::connect(
            d.control(),
            &bad,
            std::time::Duration::from_secs(5)
        )
        .is_err()
    );
    let workers = c.ask(json!({"op": "workers"}));
    let labels = |id: u64| {
        workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["worker_id"] == id)
            .map(|w| w["labels"].clone())
    };
    assert_eq!(labels(1), Some(json!(["backend=fast", "gpu=h100"])));
    assert_eq!(labels(3), None);
    drop((a, b));
}

/// The policy each role gets: `--prefill-policy` / `--decode-policy`
/// and their environment variables before `--worker-selection-policy`
/// and its variable, before the YAML; an option before its variable; an
/// unknown instance stops the daemon with the option named.
#[test]
fn role_overrides_from_the_command_line_and_the_environment_choose_the_policy() {
    let yaml = format!(
        "{BASE}worker_selection:\n  prefill: yaml-choice\n  instances:\n    - name: yaml-choice\n      type: random\n    - name: rr\n      type: round-robin\n    - name: lb\n      type: least-busy\n      parameters: {{ min_device_overlap_blocks: 0 }}\n"
    );
    let policy_of = |d: &Daemon, role: &str, id: u64| {
        let hello = kvedge_schema::messages::control::Hello {
            role: match role {
                "prefill" => kvedge_schema::messages::Role::Prefill,
                "decode" => kvedge_schema::messages::Role::Decode,
                _ => kvedge_schema::messages::Role::Aggregated,
            },
            ..common::hello(id, "llama")
        };
        let p = kvedge_testkit::register(d.control(), &hello);
        let mut c = Conn::connect(&d.query());
        let r = c.ask(json!({"op": "select", "model": "llama", "tokens": [1, 2, 3], "role": role, "dry_run": true}));
        drop(p);
        r["policy"].as_str().unwrap_or_default().to_owned()
    };
    let d = common::start_with_args("spec-overrides-yaml", &yaml, &[], &[]);
    assert_eq!(policy_of(&d, "prefill", 1), "yaml-choice");
    assert_eq!(policy_of(&d, "decode", 2), "default");
    drop(d);
    let d = common::start_with_args(
        "spec-overrides-flags",
        &yaml,
        &["--prefill-policy", "rr", "--worker-selection-policy", "lb"],
        &[
            ("KVEDGE_ROUTER_PREFILL_POLICY", "yaml-choice"),
            ("KVEDGE_ROUTER_DECODE_POLICY", "rr"),
        ],
    );
    assert_eq!(
        policy_of(&d, "prefill", 1),
        "rr",
        "the option beats its variable"
    );
    assert_eq!(
        policy_of(&d, "decode", 2),
        "rr",
        "the role's variable beats the all-roles option"
    );
    assert_eq!(policy_of(&d, "aggregated", 3), "lb");
    drop(d);
    let d = common::start_with_args(
        "spec-overrides-env",
        &yaml,
        &["--router-decode-policy", "default"],
        &[("KVEDGE_ROUTER_WORKER_SELECTION_POLICY", "rr")],
    );
    assert_eq!(
        policy_of(&d, "prefill", 1),
        "rr",
        "all roles, before the YAML"
    );
    assert_eq!(policy_of(&d, "decode", 2), "default");
    drop(d);
    // An unknown instance: the daemon does not start, and says which
    // option named it.
    let dir = common::temp_dir("spec-overrides-bad");
    std::fs::write(dir.join("kvedge.yaml"), &yaml).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args(["run", "--decode-policy", "nope", "--config"])
        .arg(dir.join("kvedge.yaml"))
        .arg("--runtime-dir")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--decode-policy / KVEDGE_ROUTER_DECODE_POLICY: selects `nope`"),
        "{stderr}"
    );
}

/// The shipped classifier, configured in YAML, runs before every select
/// (dry runs included) and a reload replaces it; a bad classifier stops
/// the daemon from starting.
#[test]
fn the_configured_request_classifier_runs_before_every_select() {
    let yaml = |limit: u32| {
        format!(
            "{BASE}request_classifier:\n  type: prompt-limit\n  parameters: {{ max_prompt_tokens: {limit} }}\n"
        )
    };
    let d = start("spec-classifier", &yaml(100));
    let _a = engine(&d, 1);
    let mut c = Conn::connect(&d.query());
    wait_for(
        || c.ask(json!({"op": "stats"}))["workers"] == 1,
        "the engine",
    );
    let short = prompt(4, 64);
    let long = prompt(4, 200);
    assert_eq!(c.ask(select(&short, json!({})))["worker_id"], 1);
    let r = c.ask(select(&long, json!({})));
    assert_eq!(r["error"]["code"], "rejected", "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("prompt exceeds the configured token limit"),
        "{r}"
    );
    let mut real = select(&long, json!({}));
    real["dry_run"] = json!(false);
    assert_eq!(c.ask(real.clone())["error"]["code"], "rejected");
    assert_eq!(c.ask(json!({"op": "stats"}))["reservations"], 0);
    // A reload with a higher limit admits it.
    std::fs::write(d.config(), yaml(1000)).unwrap();
    assert_eq!(c.ask(json!({"op": "reload"}))["ok"], true);
    assert_eq!(c.ask(select(&long, json!({})))["worker_id"], 1);
    // Unknown types and bad parameters are refused at load.
    for (bad, says) in [
        (
            "request_classifier:\n  type: nope\n",
            "request_classifier: unknown type `nope` (registered: prompt-limit)",
        ),
        (
            "request_classifier:\n  type: prompt-limit\n  parameters: { max_prompt_tokens: -1 }\n",
            "request_classifier: type `prompt-limit`: invalid parameters: max_prompt_tokens",
        ),
    ] {
        std::fs::write(d.config(), format!("{BASE}{bad}")).unwrap();
        let r = c.ask(json!({"op": "reload"}));
        assert!(
            r["error"]["message"].as_str().unwrap_or("").contains(says),
            "{bad}: {r}"
        );
    }
    assert_eq!(c.ask(select(&long, json!({})))["worker_id"], 1);
}

/// A dispatch that fails before a response stream (`abort`) leaves the
/// session's previous binding intact; one that worked (`prefill_done`)
/// keeps the new one, and `finish` alone keeps it too.
#[test]
fn an_aborted_dispatch_leaves_the_previous_binding_intact() {
    let d = start("spec-abort", BASE);
    let seed = kvedge_schema::hash::block_seed(None, None);
    let tokens = prompt(5, 256);
    let a = engine(&d, 1);
    let mut b = engine(&d, 2);
    let mut c = Conn::connect(&d.query());
    wait_for(
        || c.ask(json!({"op": "stats"}))["workers"] == 2,
        "both engines",
    );
    // Worker 2 holds the prompt: the policy's choice.
    b.publish_stored_tokens(Tier::Device, None, &tokens, 16, seed)
        .unwrap();
    wait_for(
        || c.ask(select(&tokens, json!({})))["worker_id"] == 2,
        "worker 2's blocks",
    );
    let real = |extra: Value| {
        let mut q = select(&tokens, extra);
        q["dry_run"] = json!(false);
        q
    };
    let bound = |c: &mut Conn, session: &str| {
        c.ask(select(&tokens, json!({"session": session})))["worker_id"].clone()
    };
    // A new session sent to worker 1 whose dispatch fails: no binding
    // is left, so its next turn is the policy's.
    let r = c.ask(real(json!({"session": "new", "target": {"worker_id": 1}})));
    assert_eq!(bound(&mut c, "new"), 1, "bound at the select");
    let id = r["request_id"].clone();
    assert_eq!(c.ask(json!({"op": "abort", "request_id": id}))["ok"], true);
    assert_eq!(bound(&mut c, "new"), 2, "the failed dispatch bound nothing");
    assert_eq!(
        c.ask(json!({"op": "abort", "request_id": id}))["error"]["code"],
        "unknown_request"
    );
    // A session bound to worker 2 (its dispatch worked) moved to worker 1
    // by a target whose dispatch fails: back on worker 2.
    let r = c.ask(real(json!({"session": "s"})));
    assert_eq!(r["worker_id"], 2);
    c.ask(json!({"op": "prefill_done", "request_id": r["request_id"]}));
    c.ask(json!({"op": "finish", "request_id": r["request_id"]}));
    let r = c.ask(real(json!({"session": "s", "target": {"worker_id": 1}})));
    assert_eq!(bound(&mut c, "s"), 1);
    c.ask(json!({"op": "abort", "request_id": r["request_id"]}));
    assert_eq!(bound(&mut c, "s"), 2, "the previous binding is back");
    // A binding moved by a dispatch that finished stands.
    let r = c.ask(real(json!({"session": "s", "target": {"worker_id": 1}})));
    c.ask(json!({"op": "finish", "request_id": r["request_id"]}));
    assert_eq!(
        bound(&mut c, "s"),
        1,
        "the moved binding stands after finish"
    );
    // A final turn whose dispatch fails does not end the session (ended,
    // the policy would send its next turn to worker 2).
    let r = c.ask(real(json!({"session": "s", "final": true})));
    assert_eq!(r["worker_id"], 1);
    assert_eq!(bound(&mut c, "s"), 2, "ended at the select");
    c.ask(json!({"op": "abort", "request_id": r["request_id"]}));
    assert_eq!(bound(&mut c, "s"), 1, "the final turn failed: still bound");
    // Once the prefill is done, an abort is a finish: the binding stays.
    let r = c.ask(real(json!({"session": "s", "target": {"worker_id": 2}})));
    c.ask(json!({"op": "prefill_done", "request_id": r["request_id"]}));
    c.ask(json!({"op": "abort", "request_id": r["request_id"]}));
    assert_eq!(bound(&mut c, "s"), 2);
    // The same over binary frames.
    let mut w = kvedge_wire::Client::connect(d.query()).unwrap();
    let q = Select {
        session: Some("s"),
        target: Some(Target {
            worker_id: 1,
            dp_rank: 0,
        }),
        ..Select::new("llama", Role::Aggregated, Ids::tokens(&tokens))
    };
    let r = w.select(&q).unwrap().unwrap();
    let id = r.request_id;
    assert_eq!(bound(&mut c, "s"), 1);
    w.abort(id).unwrap().unwrap();
    assert_eq!(bound(&mut c, "s"), 2);
    assert_eq!(c.ask(json!({"op": "stats"}))["reservations"], 0);
    drop((a, b));
}

/// Registers worker `id` with `taints`.
fn tainted(d: &Daemon, id: u64, taints: &[&str]) -> Publisher {
    let hello = kvedge_schema::messages::control::Hello {
        taints: taints.iter().map(|t| (*t).to_owned()).collect(),
        ..common::hello(id, "llama")
    };
    kvedge_testkit::register(d.control(), &hello)
}

/// Engines' taints: `PreferNoSchedule` multiplies the default cost of a
/// request that does not tolerate it (the preferred-taint signal), so it
/// goes elsewhere unless it tolerates the taint; `NoSchedule` keeps every
/// request that does not tolerate it away, targets included.
#[test]
fn taints_steer_the_default_cost_and_keep_untolerating_requests_away() {
    let d = start(
        "spec-taints",
        &format!(
            "{BASE}router:\n  router_temperature: 0\n  preferred_taint_multiplier: 3\nworker_selection:\n  aggregated: cost\n  instances:\n    - name: cost\n      type: dynamo-default-cost-fn\n"
        ),
    );
    let seed = kvedge_schema::hash::block_seed(None, None);
    let tokens = prompt(6, 64);
    let mut spot = tainted(&d, 1, &["spot:PreferNoSchedule"]);
    let _plain = tainted(&d, 2, &[]);
    let mut c = Conn::connect(&d.query());
    // Worker 1 holds half the prompt: the cheaper one, but for its taint.
    spot.publish_stored_tokens(Tier::Device, None, &tokens[..32], 16, seed)
        .unwrap();
    wait_for(
        || c.ask(select(&tokens, json!({"tolerations": ["spot"]})))["worker_id"] == 1,
        "worker 1's blocks",
    );
    let r = c.ask(select(&tokens, json!({})));
    assert_eq!(r["worker_id"], 2, "{r}");
    let r = c.ask(select(&tokens, json!({"tolerations": ["spot=other"]})));
    assert_eq!(r["worker_id"], 2, "a toleration of another value: {r}");
    // Binary frames carry tolerations too.
    let mut w = kvedge_wire::Client::connect(d.query()).unwrap();
    let q = Select {
        dry_run: true,
        tolerations: kvedge_wire::Strs::new(&["spot"]),
        ..Select::new("llama", Role::Aggregated, Ids::tokens(&tokens))
    };
    assert_eq!(w.select(&q).unwrap().unwrap().worker_id, 1);
    // A draining engine: no request comes unless it tolerates that.
    let _draining = tainted(&d, 3, &["draining=yes:NoSchedule"]);
    wait_for(
        || c.ask(json!({"op": "stats"}))["workers"] == 3,
        "the third engine",
    );
    let r = c.ask(select(&tokens, json!({"target": {"worker_id": 3}})));
    assert_eq!(r["error"]["code"], "no_worker", "{r}");
    let r = c.ask(select(
        &tokens,
        json!({"target": {"worker_id": 3}, "tolerations": ["draining=yes"]}),
    ));
    assert_eq!(r["worker_id"], 3, "{r}");
    // A taint the daemon cannot read is refused at registration.
    let bad = kvedge_schema::messages::control::Hello {
        taints: vec!["spot".into()],
        ..common::hello(4, "llama")
    };
    assert!(
        kvedge_shm::control::ProducerSession::connect(
            d.control(),
            &bad,
            std::time::Duration::from_secs(5)
        )
        .is_err()
    );
}
