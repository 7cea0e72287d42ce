//! `kvedge explain` with an OpenAI request body, against a real daemon
//! with the endpoint picker configured: the body's prompt is read as the
//! picker reads it, and the daemon's dry-run decision is shown with the
//! worker it would choose and why; what the gateway would refuse is
//! refused the same way.

#![forbid(unsafe_code)]

mod common;

use std::path::Path;
use std::process::Command;

use common::{ask, engine, start, wait_for};
use kvedge_schema::messages::Tier;
use serde_json::json;

fn explain(config: &Path, socket: &Path, path: &str, body: &str) -> (i32, String, String) {
    let dir = config.parent().unwrap();
    let file = dir.join("body.json");
    std::fs::write(&file, body).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .arg("explain")
        .arg("--config")
        .arg(config)
        .arg("--socket")
        .arg(socket)
        .args(["--path", path])
        .arg(&file)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn explain_shows_what_the_picker_would_do_with_a_body() {
    let (d, tokenizer) = common::start_with_picker("explain");
    // Two engines; the second holds the prompt's first blocks.
    let _a = engine(&d.control(), 1, "m");
    let mut b = engine(&d.control(), 2, "m");
    let prompt = "The routing daemon answers which worker should serve this request, and why.";
    let ids = tokenizer.encode(prompt, true).unwrap().get_ids().to_vec();
    assert!(ids.len() >= 16, "{} tokens", ids.len());
    let seed = kvedge_schema::hash::block_seed(None, None);
    b.publish_stored_tokens(Tier::Device, None, &ids, 16, seed)
        .unwrap();
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 4}).to_string();
    let (code, out, err) = explain(&d.config(), &d.query(), "/v1/completions", &body);
    assert_eq!(code, 0, "{err}");
    // Retried while the engine's blocks reach the index.
    let mut out = out;
    wait_for(
        || {
            out = explain(&d.config(), &d.query(), "/v1/completions", &body).1;
            out.contains("worker 2")
        },
        "the worker holding the prompt",
    );
    assert!(
        out.starts_with(&format!("model m: {} prompt tokens", ids.len())),
        "{out}"
    );
    let blocks = ids.len() / 16;
    assert!(
        out.contains(&format!("overlap blocks: device {blocks}")),
        "{out}"
    );
    assert!(out.contains("candidates 2"), "{out}");
    // A dry run: nothing reserved.
    let w = ask(&d.query(), json!({"op": "workers"}));
    assert!(
        w["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["active_requests"] == 0),
        "{w}"
    );
    // What the gateway refuses, explain refuses alike.
    let (code, _, err) = explain(
        &d.config(),
        &d.query(),
        "/v1/completions",
        &json!({"model": "other", "prompt": "x"}).to_string(),
    );
    assert_eq!(code, 1);
    assert!(err.contains("the gateway would answer 404"), "{err}");
    let (code, _, err) = explain(&d.config(), &d.query(), "/v1/embeddings", &body);
    assert_eq!(code, 1);
    assert!(err.contains("404"), "{err}");
    let (code, _, err) = explain(&d.config(), &d.query(), "/v1/completions", "{not json");
    assert_eq!(code, 1);
    assert!(err.contains("the gateway would answer 400"), "{err}");
}

#[test]
fn explain_needs_the_picker_configured() {
    let d = start("explain-no-epp", "{}");
    let (code, _, err) = explain(&d.config(), &d.query(), "/v1/completions", "{}");
    assert_eq!(code, 1);
    assert!(err.contains("no `epp:` section"), "{err}");
}
