//! The C library from C: programs in `tests/c/` compiled with the system
//! compiler against `include/kvedge.h` and `libkvedge.so`, and run: the
//! header as C99 and C++17 (included twice, -Wall -Werror), the API without
//! a daemon (hashing, NULL and bogus arguments), and a live run against a
//! daemon (publish, select, release, a deliberate ring overflow and its
//! resync, then use after the daemon died). The same programs run under
//! AddressSanitizer and under valgrind's memcheck.

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

mod support;

use support::Daemon;

const DIR: &str = env!("CARGO_MANIFEST_DIR");

/// Whether an external tool is installed. A newcomer's machine may lack
/// one (the test then says so and passes); CI installs them all and sets
/// KVEDGE_REQUIRE_TOOLS, which turns a missing tool into a failure.
fn have(tool: &str) -> bool {
    let ok = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("KVEDGE_REQUIRE_TOOLS").is_none(),
            "{tool} is required (KVEDGE_REQUIRE_TOOLS is set) but not installed"
        );
        eprintln!("{tool} is not installed: skipped (CI installs it and requires it)");
    }
    ok
}

/// Builds `libkvedge.so` (cargo test builds only the rlib) with the test
/// profile, whose dependencies are already compiled; returns its directory.
fn lib_dir() -> &'static Path {
    static DIR_: OnceLock<PathBuf> = OnceLock::new();
    DIR_.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--profile", "test", "-p", "kvedge-c", "--lib"])
            .current_dir(DIR)
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building libkvedge failed");
        // This test binary is target/debug/deps/c_programs-*.
        let exe = std::env::current_exe().unwrap();
        let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
        assert!(
            dir.join("libkvedge.so").exists(),
            "no libkvedge.so in {}",
            dir.display()
        );
        dir
    })
}

fn out_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvedge-c-tests-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compiles `tests/c/NAME.c` into an executable; `extra` flags (a
/// sanitizer) are added.
fn compile(name: &str, extra: &[&str], tag: &str) -> PathBuf {
    let lib = lib_dir();
    let out = out_dir().join(format!("{name}{tag}"));
    let result = Command::new("cc")
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-g"])
        .args(extra)
        .arg(format!("-I{DIR}/include"))
        .arg(format!("-I{DIR}/tests/c"))
        .arg(format!("{DIR}/tests/c/{name}.c"))
        .arg("-o")
        .arg(&out)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lkvedge")
        .output()
        .expect("a C compiler (cc)");
    assert!(
        result.status.success(),
        "compiling {name}.c failed:\n{}",
        String::from_utf8_lossy(&result.stderr)
    );
    out
}

fn expected_hashes() -> Vec<String> {
    let tokens: Vec<u32> = (0..40).collect();
    let mut v: Vec<String> = kvedge_schema::hash::sequence_hashes(&tokens, 16, None, None)
        .iter()
        .map(u64::to_string)
        .collect();
    v.extend(
        kvedge_schema::hash::sequence_hashes(&tokens, 16, Some("a"), None)
            .iter()
            .map(u64::to_string),
    );
    v
}

/// Runs `exe` (optionally under `wrapper`) with `args`; asserts success.
fn run_api(exe: &Path, wrapper: &[&str]) {
    let mut cmd = match wrapper.split_first() {
        Some((w, rest)) => {
            let mut c = Command::new(w);
            c.args(rest).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    let out = cmd.args(expected_hashes()).output().unwrap();
    assert!(
        out.status.success(),
        "{} failed ({}):\n{}\n{}",
        exe.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
}

/// Runs the live program (optionally under `wrapper`), answering its
/// "pause", "resume" and "stop" lines.
fn run_live(exe: &Path, wrapper: &[&str], name: &str) {
    // A 4 KiB ring, so the live test can overflow it.
    let mut daemon = Daemon::start(
        name,
        "daemon:\n  ring_capacity: 4096\n  heartbeat_timeout_ms: 600000\n",
    );
    let mut cmd = match wrapper.split_first() {
        Some((w, rest)) => {
            let mut c = Command::new(w);
            c.args(rest).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    let mut child = cmd
        .arg(daemon.dir.join("control.sock"))
        .arg(daemon.dir.join("query.sock"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut said = Vec::new();
    let mut last = String::new();
    while let Some(Ok(line)) = lines.next() {
        match line.as_str() {
            "pause" => daemon.hold(true),
            "resume" => daemon.hold(false),
            "stop" => daemon.stop(),
            _ => {
                last = line;
                continue;
            }
        }
        said.push(line);
        let _ = writeln!(stdin, "go");
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{} failed ({}) after {said:?}:\n{}",
        exe.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(said, ["pause", "resume", "stop"]);
    assert_eq!(last, "ok");
}

#[test]
fn header_compiles_as_c99_and_cpp17_included_twice() {
    if !have("cc") || !have("c++") {
        return;
    }
    compile("twice", &[], "");
    let out = out_dir().join("twice-cpp");
    let result = Command::new("c++")
        .args([
            "-x",
            "c++",
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
        ])
        .arg(format!("-I{DIR}/include"))
        .arg(format!("{DIR}/tests/c/twice.c"))
        .arg("-o")
        .arg(&out)
        .arg(format!("-L{}", lib_dir().display()))
        .arg(format!("-Wl,-rpath,{}", lib_dir().display()))
        .arg("-lkvedge")
        .output()
        .expect("a C++ compiler (c++)");
    assert!(
        result.status.success(),
        "C++17: {}",
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(Command::new(&out).status().unwrap().success());
}

#[test]
fn api_without_a_daemon() {
    if !have("cc") {
        return;
    }
    run_api(&compile("api", &[], ""), &[]);
}

#[test]
fn live_against_a_daemon() {
    if !have("cc") {
        return;
    }
    run_live(&compile("live", &[], ""), &[], "live");
}

const ASAN: &[&str] = &["-fsanitize=address,undefined", "-fno-omit-frame-pointer"];

#[test]
fn under_address_sanitizer() {
    if !have("cc") {
        return;
    }
    // Leaks are checked too (LeakSanitizer is on by default on Linux).
    run_api(&compile("api", ASAN, "-asan"), &[]);
    run_live(&compile("live", ASAN, "-asan"), &[], "live-asan");
}

#[test]
fn under_valgrind() {
    if !have("cc") || !have("valgrind") {
        return;
    }
    let vg = [
        "valgrind",
        "--quiet",
        "--error-exitcode=99",
        "--leak-check=full",
        "--errors-for-leak-kinds=definite",
    ];
    run_api(&compile("api", &[], ""), &vg);
    run_live(&compile("live", &[], ""), &vg, "live-valgrind");
}

/// `install.sh` into a temporary prefix; the two examples build with
/// `cc $(pkg-config --cflags --libs kvedge)` and, against a daemon, the
/// query example finds the publisher example's blocks.
#[test]
fn examples_build_with_pkg_config_and_find_each_other() {
    if !have("cc") || !have("pkg-config") {
        return;
    }
    lib_dir();
    let prefix = out_dir().join("prefix");
    let out = Command::new(format!("{DIR}/install.sh"))
        .arg(&prefix)
        .env("KVEDGE_PROFILE", "test")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "install.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in [
        "lib/libkvedge.so",
        "lib/libkvedge.a",
        "include/kvedge.h",
        "lib/pkgconfig/kvedge.pc",
    ] {
        assert!(prefix.join(f).exists(), "{f} not installed");
    }
    let pc = prefix.join("lib/pkgconfig");
    let flags = Command::new("pkg-config")
        .args(["--cflags", "--libs", "kvedge"])
        .env("PKG_CONFIG_PATH", &pc)
        .output()
        .expect("pkg-config");
    assert!(flags.status.success());
    let flags = String::from_utf8(flags.stdout).unwrap();
    assert!(flags.contains("-lkvedge"), "{flags}");
    let build = |name: &str| -> PathBuf {
        let exe = out_dir().join(format!("example-{name}"));
        let status = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "cc -std=c99 -Wall -Wextra -Werror {DIR}/examples/{name}.c $(pkg-config --cflags --libs kvedge) -o {}",
                exe.display()
            ))
            .env("PKG_CONFIG_PATH", &pc)
            .status()
            .unwrap();
        assert!(status.success(), "building examples/{name}.c");
        exe
    };
    let (publisher, query) = (build("publisher"), build("query"));
    let daemon = Daemon::start("examples", "daemon:\n  heartbeat_timeout_ms: 600000\n");
    let libs = prefix.join("lib");
    let mut engine = Command::new(&publisher)
        .arg(daemon.dir.join("control.sock"))
        .arg("7")
        .env("LD_LIBRARY_PATH", &libs)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(engine.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert_eq!(first.trim(), "published 16 blocks as worker 7");
    let mut answer = String::new();
    for _ in 0..500 {
        let out = Command::new(&query)
            .arg(daemon.dir.join("query.sock"))
            .env("LD_LIBRARY_PATH", &libs)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        answer = String::from_utf8(out.stdout).unwrap();
        if answer.contains("overlap device 16") {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        answer.starts_with(
            "worker 7 dp 0 endpoint http://127.0.0.1:8000 overlap device 16 host 0 disk 0 request "
        ),
        "{answer}"
    );
    drop(engine.stdin.take());
    assert!(engine.wait().unwrap().success());
}
