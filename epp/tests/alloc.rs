//! What one request costs the picker in heap allocations on its warm path:
//! the request headers, the body (parsed, its prompt read), the select it
//! asks for, and the pick's reply with its headers, driven through the
//! stream's state machine ([`Exchange`]) as the server drives it. Not zero
//! (the reply is a protobuf message of owned strings, the body's other
//! fields owned values), but a stated bound that does not grow with the
//! prompt: its list of token ids is sized from the body once, so a
//! 2,048-token prompt costs what a 64-token one does, not one allocation
//! per token.

#![forbid(unsafe_code)]

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders};
use kvedge_epp::picker::{Exchange, Limits, Picked, Step, prompt};
use kvedge_epp::tokenize::{ModelSpec, Models};

/// The most allocations one token-id request may make on the warm path.
/// Measured: 39 for 64 token ids and for 2,048 (the body's fields, its
/// prompt read straight into a list of ids, the select's owned strings and
/// headers, the replies).
const BOUND: u64 = 48;

fn models() -> Models {
    Models::load(&[ModelSpec {
        engine: Default::default(),
        name: "m".into(),
        tokenizer: None,
        chat_template: None,
        bos_token: String::new(),
        eos_token: String::new(),
    }])
    .unwrap()
}

fn limits() -> Limits {
    Limits {
        max_body_bytes: 1 << 20,
        max_prompt_tokens: 1 << 16,
        tenant_header: Some("x-tenant".into()),
        session_header: Some("x-session-id".into()),
        target_header: None,
        tolerations_header: None,
        debug_header: None,
        approximate_chunk_bytes: 64,
        classify_text_bytes: Default::default(),
    }
}

fn headers() -> HttpHeaders {
    let h = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    };
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                h(":path", "/v1/completions"),
                h(":method", "POST"),
                h("content-type", "application/json"),
                h("x-tenant", "acme"),
                h("x-session-id", "s-1"),
            ],
        }),
        ..Default::default()
    }
}

/// One request through the state machine; the pick's replies.
fn request(models: &Models, limits: &Limits, h: &HttpHeaders, b: &HttpBody) -> usize {
    let mut ex = Exchange::new(false, false);
    let Step::Reply(_) = ex.handle_request_headers(h) else {
        panic!("headers answered");
    };
    let select = match ex.handle_request_body(b, limits) {
        Step::Prompt(body) => ex.handle_prompt(prompt(&body, models, limits), limits),
        other => other,
    };
    let Step::Select(args) = select else {
        panic!("a select: {select:?}");
    };
    assert!(!args.tokens.is_empty());
    let replies = ex.handle_picked(Picked::Worker {
        endpoint: "http://10.0.0.7:8000".into(),
        request_id: 42,
        decision: None,
    });
    replies.len()
}

/// Allocations of one warm request whose prompt has `n` token ids.
fn allocations(n: u32) -> u64 {
    let (models, limits, h) = (models(), limits(), headers());
    let ids: Vec<u32> = (0..n).map(|i| (i * 7919) % 32_000).collect();
    let body = HttpBody {
        body: serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 16, "stream": true})
            .to_string()
            .into_bytes(),
        end_of_stream: true,
        ..Default::default()
    };
    for _ in 0..100 {
        request(&models, &limits, &h, &body);
    }
    let info = allocation_counter::measure(|| {
        assert_eq!(request(&models, &limits, &h, &body), 1);
    });
    info.count_total
}

#[test]
fn a_warm_request_allocates_at_most_its_bound_whatever_its_length() {
    let short = allocations(64);
    let long = allocations(2048);
    eprintln!("allocations: {short} for 64 tokens, {long} for 2,048");
    assert!(short <= BOUND, "{short} allocations, bound {BOUND}");
    assert!(long <= BOUND, "{long} allocations, bound {BOUND}");
    // A longer prompt costs no more allocations (a vector that had to
    // double once or twice would still pass), never one per token.
    assert!(long <= short + 2, "{short} for 64 tokens, {long} for 2,048");
}
