//! The `kvedge` binary's offline tools, run as real processes.

#![forbid(unsafe_code)]

use std::process::Command;

fn kvedge(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .args(args)
        .output()
        .expect("run kvedge");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn hash_prints_the_sequence_hashes_of_full_blocks() {
    let tokens: Vec<u32> = (0..40).collect();
    let expected: Vec<String> = kvedge_schema::hash::sequence_hashes(&tokens, 16, None, None)
        .iter()
        .map(u64::to_string)
        .collect();
    assert_eq!(
        expected.len(),
        2,
        "two full blocks of 16; the partial one is not hashed"
    );
    let list = tokens.iter().map(u32::to_string).collect::<Vec<_>>();
    // Commas, spaces, several arguments: all the same.
    let (code, out, _) = kvedge(&["hash", "--block-size", "16", &list.join(",")]);
    assert_eq!(code, 0);
    assert_eq!(out.lines().collect::<Vec<_>>(), expected);
    let (_, spaced, _) = kvedge(&[
        "hash",
        "--block-size",
        "16",
        &list[..20].join(" "),
        &list[20..].join(","),
    ]);
    assert_eq!(spaced, out);
    // A LoRA name changes the seed, so the hashes.
    let (_, lora, _) = kvedge(&["hash", "--block-size", "16", "--lora", "a", &list.join(",")]);
    assert_ne!(lora, out);
    // --json: the same hashes as one object.
    let (code, json, _) = kvedge(&["hash", "--json", "--block-size", "16", &list.join(",")]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let from_json: Vec<String> = v["hashes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap().to_string())
        .collect();
    assert_eq!(from_json, expected);
}

#[test]
fn hash_rejects_bad_input_with_a_message() {
    let (code, _, err) = kvedge(&["hash", "--block-size", "16", "1,2,x"]);
    assert_eq!(code, 2);
    assert!(err.contains("`x` is not a token id"), "{err}");
    let (code, _, err) = kvedge(&["hash", "--block-size", "0", "1"]);
    assert_eq!(code, 2);
    assert!(err.contains("--block-size must be positive"), "{err}");
}

#[test]
fn check_config_warns_of_template_constructs_kvedge_cannot_render() {
    let dir = std::env::temp_dir().join(format!("kvedge-cli-tpl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let template = dir.join("chat.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m.content | wordwrap(40) }}\n{% endfor %}",
    )
    .unwrap();
    let config = dir.join("epp.yaml");
    std::fs::write(
        &config,
        format!(
            "epp:\n  models:\n    - name: m\n      chat_template: {}\n",
            template.display()
        ),
    )
    .unwrap();
    let (code, out, err) = kvedge(&["check-config", config.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        err.contains("warning: epp model `m`: chat template")
            && err.contains("filter `wordwrap`: kvedge cannot render it as the engine does"),
        "{err}"
    );
    let (code, out, _) = kvedge(&["check-config", "--json", config.to_str().unwrap()]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["warnings"].as_array().map(Vec::len), Some(1), "{out}");
    // A template kvedge renders as the engine does: no warning.
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m.content | trim }}{% endfor %}",
    )
    .unwrap();
    let (code, _, err) = kvedge(&["check-config", config.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(!err.contains("warning"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_config_exit_codes_and_messages() {
    let dir = std::env::temp_dir().join(format!("kvedge-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.yaml");
    std::fs::write(
        &good,
        "worker_selection:\n  aggregated: rr\n  instances:\n    - name: rr\n      type: round-robin\npolicy:\n  rules:\n    - name: all\n      route:\n        select: [{ type: Local }]\n",
    )
    .unwrap();
    let (code, out, _) = kvedge(&["check-config", good.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.ends_with("ok (1 rules)\n"), "{out}");

    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "worker_selection:\n  instances:\n    - name: a\n      type: nope\n",
    )
    .unwrap();
    let (code, _, err) = kvedge(&["check-config", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("bad.yaml: worker_selection instance `a` (line 3): unknown type `nope`"),
        "{err}"
    );
    let (code, out, _) = kvedge(&["check-config", "--json", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["error"]["code"], "config");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown type `nope`"),
        "{out}"
    );

    let (code, _, err) = kvedge(&["check-config", dir.join("missing.yaml").to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot read"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_all_roles_environment_variable_is_honoured() {
    let dir = std::env::temp_dir().join(format!("kvedge-cli-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("k.yaml");
    std::fs::write(
        &file,
        "worker_selection:\n  instances:\n    - name: rr\n      type: round-robin\n",
    )
    .unwrap();
    let run = |value: &str| {
        Command::new(env!("CARGO_BIN_EXE_kvedge"))
            .args(["check-config", file.to_str().unwrap()])
            .env("KVEDGE_ROUTER_WORKER_SELECTION_POLICY", value)
            .output()
            .unwrap()
    };
    assert_eq!(run("rr").status.code(), Some(0));
    let out = run("nope");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("KVEDGE_ROUTER_WORKER_SELECTION_POLICY): selects `nope`"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
