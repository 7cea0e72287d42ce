//! The custom binary accepts a configuration using the custom type, which
//! the stock `kvedge` binary rejects.

use std::process::Command;

#[test]
fn the_custom_binary_knows_the_custom_type() {
    let yaml = concat!(env!("CARGO_MANIFEST_DIR"), "/../worker-selection.yaml");
    let ours = Command::new(env!("CARGO_BIN_EXE_acme-kvedge"))
        .args(["check-config", yaml])
        .output()
        .unwrap();
    assert_eq!(
        ours.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ours.stderr)
    );
    let stock = std::path::Path::new(env!("CARGO_BIN_EXE_acme-kvedge")).with_file_name("kvedge");
    if stock.exists() {
        let out = Command::new(&stock)
            .args(["check-config", yaml])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&out.stderr).contains("unknown type `acme-least-busy`"));
        // Without the policy, the stock binary stops at the classifier.
        let only_classifier =
            std::env::temp_dir().join(format!("acme-classifier-{}.yaml", std::process::id()));
        std::fs::write(
            &only_classifier,
            "request_classifier:\n  type: acme-tier-gate\n",
        )
        .unwrap();
        let out = Command::new(&stock)
            .arg("check-config")
            .arg(&only_classifier)
            .output()
            .unwrap();
        let _ = std::fs::remove_file(&only_classifier);
        assert_eq!(out.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(
                "request_classifier: unknown type `acme-tier-gate` (registered: prompt-limit)"
            ),
            "{stderr}"
        );
    }
}

/// `acme-kvedge run` with the shipped YAML: the ACME classifier admits,
/// re-prioritises (a rule sends low priorities to a provider), defers and
/// rejects, and the ACME policy makes the daemon's real selections.
#[test]
fn the_custom_binary_routes_with_the_custom_policy_and_classifier() {
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixStream;

    let dir = kvedge_testkit::temp_dir("acme-embedding");
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../worker-selection.yaml"
    ))
    .unwrap();
    let yaml = format!(
        "{shipped}daemon:\n  heartbeat_timeout_ms: 600000\npolicy:\n  rules:\n    - name: batch\n      matches: [{{ priority: {{ lessThan: 0 }} }}]\n      route:\n        consider: [{{ providers: {{}} }}]\n        select: [{{ type: Provider }}]\n    - name: local\n      route:\n        select: [{{ type: Local, minimize: {{ policy: least-busy }} }}]\nproviders:\n  - {{ name: batch-cloud, models: [llama], endpoint: 'https://batch.example' }}\n"
    );
    std::fs::write(dir.join("kvedge.yaml"), yaml).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_acme-kvedge"))
        .arg("run")
        .arg("--config")
        .arg(dir.join("kvedge.yaml"))
        .arg("--runtime-dir")
        .arg(&dir)
        .spawn()
        .unwrap();
    let query = dir.join("query.sock");
    let started = std::time::Instant::now();
    while UnixStream::connect(&query).is_err() {
        assert!(child.try_wait().unwrap().is_none(), "acme-kvedge exited");
        assert!(started.elapsed().as_secs() < 30, "no query socket");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let engine = |id: u64, active: u32| {
        let hello = kvedge_schema::messages::control::Hello {
            kv_blocks: [1024, 0, 0],
            endpoint: format!("http://engine-{id}"),
            ..kvedge_schema::messages::control::Hello::new(id, "llama")
        };
        let mut p = kvedge_testkit::register(dir.join("control.sock"), &hello);
        p.publish_load(&kvedge_schema::messages::Load {
            active_requests: active,
            kv_total_blocks: 1024,
            ..Default::default()
        })
        .unwrap();
        p
    };
    // Engine 2 is the less busy: the ACME policy's choice.
    let _engines = (engine(1, 9), engine(2, 1));
    let conn = UnixStream::connect(&query).unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut writer = conn;
    let mut ask = |tier: Option<&str>, tokens: usize| {
        let mut q = serde_json::json!({"op": "select", "model": "llama",
            "tokens": (0..tokens as u32).collect::<Vec<_>>(), "dry_run": true});
        if let Some(t) = tier {
            q["headers"] = serde_json::json!({ "X-Acme-Tier": t });
        }
        writeln!(writer, "{q}").unwrap();
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        serde_json::from_str::<serde_json::Value>(&line).unwrap()
    };
    let started = std::time::Instant::now();
    while ask(None, 64)["worker_id"] != 2 {
        assert!(started.elapsed().as_secs() < 5, "the engines' loads");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let r = ask(None, 64);
    assert_eq!((&r["rule"], &r["worker_id"]), (&"local".into(), &2.into()));
    let r = ask(Some("batch"), 64);
    assert_eq!(
        (&r["rule"], &r["provider"]),
        (&"batch".into(), &"batch-cloud".into()),
        "{r}"
    );
    let r = ask(Some("overflow"), 64);
    assert_eq!(r["error"]["code"], "too_many_requests", "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("retry after 500 ms"),
        "{r}"
    );
    let r = ask(Some("blocked"), 64);
    assert_eq!(r["error"]["code"], "rejected", "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("this tier is blocked"),
        "{r}"
    );
    let r = ask(None, 40_000);
    assert_eq!(r["error"]["code"], "rejected", "{r}");
    // The connection and the daemon go on serving.
    assert_eq!(ask(Some("gold"), 64)["worker_id"], 2);
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
