//! ARCHITECTURE.md's table of crates states what each depends on; this
//! checks it against the workspace as `cargo metadata` sees it, so the
//! document cannot drift from the crate graph, and no dependency can run
//! back up it unnoticed.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// The table's short names for the workspace's crates.
fn package(short: &str) -> Option<&'static str> {
    Some(match short {
        "shm" => "kvedge-shm",
        "policies" => "kvedge-policies",
        "wire" => "kvedge-wire",
        "core" => "kvedge-core",
        "config" => "kvedge-config",
        "daemon" => "kvedge-daemon",
        "bridge" => "kvedge-bridge",
        "zmtp" => "kvedge-zmtp",
        "epp" => "kvedge-epp",
        "tools" => "kvedge-tools",
        "mock" => "kvedge-mock",
        "cli" => "kvedge-cli",
        "sim" => "kvedge-sim",
        "testkit" => "kvedge-testkit",
        "schema" => "kvedge-schema",
        _ => return None,
    })
}

/// Each package the table names, with the workspace crates it says the
/// package depends on.
fn stated(architecture: &str) -> BTreeMap<String, BTreeSet<String>> {
    let table = architecture
        .split("## Crates")
        .nth(1)
        .expect("a Crates section")
        .split("\n\n")
        .nth(1)
        .expect("its table");
    let mut out = BTreeMap::new();
    for row in table.lines().skip(2) {
        let cells: Vec<&str> = row
            .trim()
            .trim_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        let [_, packages, _, depends] = cells[..] else {
            panic!("a row of four cells: {row}");
        };
        if depends == "everything" {
            continue;
        }
        let names: BTreeSet<String> = if depends == "(leaf)" {
            BTreeSet::new()
        } else {
            depends
                .split(", ")
                .map(|d| {
                    // "core (configuration)": the crate, then why.
                    let short = d.split(' ').next().unwrap();
                    package(short)
                        .unwrap_or_else(|| panic!("`{short}` in `{row}` names no crate"))
                        .to_owned()
                })
                .collect()
        };
        // The package cell: `kvedge-x`, or several in backquotes.
        for p in packages.split('`').skip(1).step_by(2) {
            if p.starts_with("kvedge-") {
                out.insert(p.to_owned(), names.clone());
            }
        }
    }
    out
}

#[test]
fn architecture_states_the_crate_graph() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let architecture = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let stated = stated(&architecture);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(&root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut actual = BTreeMap::new();
    for p in metadata["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let deps: BTreeSet<String> = p["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["kind"].is_null())
            .filter_map(|d| d["name"].as_str())
            .filter(|d| d.starts_with("kvedge-"))
            .map(str::to_owned)
            .collect();
        actual.insert(name.to_owned(), deps);
    }
    for (package, deps) in &stated {
        let Some(real) = actual.get(package) else {
            // The Python module is a workspace of its own.
            assert_eq!(
                package, "kvedge-python",
                "{package} is not in the workspace"
            );
            continue;
        };
        assert_eq!(
            deps, real,
            "ARCHITECTURE.md says {package} depends on {deps:?}; Cargo.toml says {real:?}"
        );
    }
    // Every workspace crate of kvedge's own is in the table.
    for package in actual.keys().filter(|p| p.starts_with("kvedge-")) {
        assert!(
            stated.contains_key(package)
                || package == "kvedge-benches"
                || package == "kvedge-tests",
            "{package} is not in ARCHITECTURE.md's table"
        );
    }
}

/// `unsafe` lives only where memory is shared or exported: every other
/// crate root (library or binary) forbids it.
#[test]
fn only_the_shared_memory_and_exported_crates_may_use_unsafe() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let allowed = ["shm-protocol", "client-c", "python"];
    let mut checked = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let dir = entry.unwrap().path();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        if !dir.join("Cargo.toml").is_file() || allowed.contains(&name.as_str()) {
            continue;
        }
        for file in ["src/lib.rs", "src/main.rs"] {
            let Ok(text) = std::fs::read_to_string(dir.join(file)) else {
                continue;
            };
            checked += 1;
            assert!(
                text.contains("#![forbid(unsafe_code)]"),
                "{name}/{file} does not forbid unsafe code"
            );
        }
    }
    assert!(checked >= 12, "only {checked} crate roots found");
}
