//! The network surfaces under attack: a real `kvedge run` with engines
//! read over ZeroMQ and the endpoint picker on TCP, attacked over real
//! loopback sockets the way a hostile or clumsy peer would, while a
//! well-behaved engine (libzmq, through `fixtures/fake_vllm.py`) and
//! well-behaved gateway requests keep using it.
//!
//! Each test states what must hold: the daemon stays up, its memory stays
//! under a bound, strangers change no engine's view, the well-behaved
//! requests' decisions stay fast (a bound far above their usual few
//! milliseconds, far below the second-long stalls these attacks caused),
//! and query.sock keeps answering. Every attack is bounded in time and
//! count.

#![forbid(unsafe_code)]

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::fake_engine::{FakeEngine, notice, overlap, tokens, wait, worker};
use common::{Conn, Daemon, ask, envoy_binary, grpc, start, wait_for};
use kvedge_bridge::encode::{EventOut, Layout, write_batch};
use kvedge_epp::testing::free_port;
use kvedge_zmtp::codec::{self, SocketType};
use serde_json::{Value, json};

// ---------------------------------------------------------------- helpers

/// The daemon's resident memory, in bytes.
fn rss(d: &Daemon) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.child.id())).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

/// The daemon's open file descriptors.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// CPU time the process has used (user and system), in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command's closing parenthesis; utime and stime
    // are the 14th and 15th of the whole line.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// The daemon runs and query.sock answers.
fn alive(d: &mut Daemon) -> bool {
    d.child.try_wait().unwrap().is_none()
        && ask(&d.query(), json!({"op": "stats"}))["index_entries"].is_u64()
}

/// A raw TCP peer from `from` that greeted as a PUB (what it sends next
/// is up to the test).
fn raw_pub(to: SocketAddr, from: Ipv4Addr) -> TcpStream {
    let s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5));
    // Binding a source address needs a socket built by hand.
    let s = if from == Ipv4Addr::LOCALHOST {
        s.unwrap()
    } else {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.bind(&SocketAddr::from((from, 0)).into()).unwrap();
        sock.connect(&to.into()).unwrap();
        sock.into()
    };
    let mut s = s;
    let mut out = codec::greeting(false).to_vec();
    codec::encode_ready(&mut out, SocketType::Pub, b"");
    s.write_all(&out).unwrap();
    s
}

/// A vLLM-format batch storing one block of `tokens` as engine hash `h`.
fn batch(h: u64, t: &[u32]) -> Vec<u8> {
    let hashes = [h];
    let mut b = Vec::new();
    write_batch(
        &mut b,
        1.0,
        &[EventOut::Stored {
            hashes: &hashes,
            parent: None,
            tokens: t,
            block_size: 16,
            medium: "GPU",
        }],
        Layout::Map,
        Some(0),
    );
    b
}

/// Sends [topic, seq, payload] as a ZMTP message on a raw peer.
fn send_batch(s: &mut TcpStream, seq: u64, payload: &[u8]) {
    let mut out = Vec::new();
    codec::encode_message(&mut out, &[&b"kv-events"[..], &seq.to_be_bytes(), payload]);
    let _ = s.write_all(&out);
}

/// Whether the other end closed `s` within 10 s.
fn closed(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
    }
}

fn engine_entry(id: u64, events: &str, replay: &str, extra: &str) -> String {
    format!(
        "  - kind: vllm\n    model: llama\n    worker_id: {id}\n    block_size: 16\n    endpoint: http://127.0.0.1:8000\n    events: {events}\n    replay: {replay}\n    topic: kv-events\n{extra}"
    )
}

// ------------------------------------------------------------ ZeroMQ side

/// Frame headers declaring 200 GB, messages of endless frames, and a
/// connected "engine" that does the same: each peer is cut off at the
/// header, the daemon's memory does not follow what they declare or send,
/// and a well-behaved engine's events keep flowing.
#[test]
fn zmq_peers_declaring_huge_frames_or_endless_messages_are_cut_off() {
    let mut good = FakeEngine::spawn(&["--no-metrics"]);
    // A hostile "engine" kvedge connects to: it greets, then declares a
    // 200 GB frame, on every connection.
    let hostile = TcpListener::bind("127.0.0.1:0").unwrap();
    let hostile_port = hostile.local_addr().unwrap().port();
    let served = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    {
        let served = std::sync::Arc::clone(&served);
        std::thread::spawn(move || {
            for mut s in hostile.incoming().flatten() {
                let mut out = codec::greeting(true).to_vec();
                codec::encode_ready(&mut out, SocketType::Pub, b"");
                out.push(0x02);
                out.extend_from_slice(&200_000_000_000u64.to_be_bytes());
                let _ = s.write_all(&out);
                served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
    }
    let bind_port = free_port(Ipv4Addr::LOCALHOST);
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\nengines:\n{}{}{}",
        engine_entry(
            10,
            &format!("tcp://127.0.0.1:{}", good.port("events")),
            &format!("tcp://127.0.0.1:{}", good.port("replay")),
            ""
        ),
        engine_entry(
            11,
            &format!("tcp://127.0.0.1:{bind_port}"),
            "tcp://127.0.0.1:1",
            "    events_bind: true\n"
        ),
        engine_entry(
            12,
            &format!("tcp://127.0.0.1:{hostile_port}"),
            "tcp://127.0.0.1:1",
            ""
        ),
    );
    let mut d = start("hostile-zmq-frames", &yaml);
    let mut c = Conn::connect(&d.query());
    wait(
        || worker(&mut c, 10)["available"] == true,
        "the good engine",
    );
    wait(
        || TcpStream::connect(("127.0.0.1", bind_port)).is_ok(),
        "the bound events port",
    );
    let before = rss(&d);
    let to = SocketAddr::from(([127, 0, 0, 1], bind_port));
    // 20 peers declaring 200 GB frames, one after another.
    for _ in 0..20 {
        let mut s = raw_pub(to, Ipv4Addr::LOCALHOST);
        let mut header = vec![0x02];
        header.extend_from_slice(&200_000_000_000u64.to_be_bytes());
        let _ = s.write_all(&header);
        assert!(closed(&mut s), "a peer declaring 200 GB is cut off");
    }
    // A peer whose message never ends: MORE frames for as long as the
    // daemon reads them (256 MiB at most, 10 s at most).
    let mut endless = raw_pub(to, Ipv4Addr::LOCALHOST);
    let frame: Vec<u8> = [0x03u8]
        .into_iter()
        .chain(65_536u64.to_be_bytes())
        .chain(std::iter::repeat_n(0u8, 65_536))
        .collect();
    endless
        .set_write_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let started = Instant::now();
    let mut sent = 0usize;
    while sent < 256 << 20 && started.elapsed() < Duration::from_secs(10) {
        if endless.write_all(&frame).is_err() {
            break;
        }
        sent += frame.len();
    }
    assert!(
        sent < 256 << 20,
        "the endless message was read on and on ({sent} bytes)"
    );
    // Meanwhile the good engine is served.
    good.store(1, &tokens(0, 16));
    let mut n = 2;
    wait(
        || {
            if overlap(&mut c, &tokens(0, 16)) == 1 {
                return true;
            }
            good.store(n, &tokens(1000 + n as u32 * 16, 1016 + n as u32 * 16));
            n += 1;
            false
        },
        "the good engine's block",
    );
    wait(
        || notice(&worker(&mut c, 11), "events_refused") >= 21,
        "the cut-off peers counted on the bound engine",
    );
    wait(
        || served.load(std::sync::atomic::Ordering::Relaxed) >= 2,
        "the hostile engine connected to (and cut off) again",
    );
    wait(
        || notice(&worker(&mut c, 12), "events_refused") >= 1,
        "the hostile engine's cut-off counted",
    );
    let after = rss(&d);
    assert!(
        after < before + (64 << 20),
        "RSS grew from {before} to {after} bytes"
    );
    assert!(alive(&mut d));
}

/// With `events_bind`, a stranger cannot add blocks to the engine's view
/// or wipe it: not while the engine is connected (one source at a time),
/// not before it connects (the engine's replay socket disowns its
/// batches), and not from an address the entry does not allow. A flood of
/// connections is bounded and leaves the daemon idle.
#[test]
fn strangers_cannot_rewrite_an_engines_view_through_a_bound_port() {
    let mut e = FakeEngine::spawn(&["--no-metrics"]);
    let port = free_port(Ipv4Addr::LOCALHOST);
    let strict_port = free_port(Ipv4Addr::LOCALHOST);
    let replay = format!("tcp://127.0.0.1:{}", e.port("replay"));
    // No spinning or warming between requests: the CPU measured below is
    // then the bridge's alone.
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\n  spin_us: 0\n  warm_us: 0\nengines:\n{}{}",
        engine_entry(
            10,
            &format!("tcp://127.0.0.1:{port}"),
            &replay,
            "    events_bind: true\n"
        ),
        engine_entry(
            11,
            &format!("tcp://127.0.0.1:{strict_port}"),
            "tcp://127.0.0.1:1",
            "    events_bind: true\n    events_allow: [127.0.0.1/32]\n"
        ),
    );
    let mut d = start("hostile-zmq-strangers", &yaml);
    let mut c = Conn::connect(&d.query());
    wait(|| !worker(&mut c, 10).is_null(), "the worker");
    for p in [port, strict_port] {
        wait(
            || TcpStream::connect(("127.0.0.1", p)).is_ok(),
            "the bound events ports",
        );
    }
    let to = SocketAddr::from(([127, 0, 0, 1], port));

    // A stranger comes first, with an invented block under number 5: the
    // engine's replay socket does not hold it, so it is not taken.
    let invented = tokens(9000, 9016);
    let mut early = raw_pub(to, Ipv4Addr::LOCALHOST);
    send_batch(&mut early, 5, &batch(66, &invented));
    wait(
        || notice(&worker(&mut c, 10), "foreign_batches") >= 1,
        "the early stranger disowned",
    );
    assert_eq!(overlap(&mut c, &invented), 0);

    // The engine connects (as vLLM with a concrete endpoint does) and
    // stores four blocks.
    e.send(json!({"op": "connect", "endpoint": format!("tcp://127.0.0.1:{port}")}));
    let prompt = tokens(0, 64);
    let mut k = 0u32;
    wait(
        || {
            if overlap(&mut c, &prompt) == 4 {
                return true;
            }
            // Batches before the subscription arrive are lost; history
            // comes from the replay socket once one is heard.
            e.send(
                json!({"op": "stored", "hashes": [1, 2, 3, 4], "parent": null, "tokens": prompt}),
            );
            k += 1;
            std::thread::sleep(Duration::from_millis(50 * u64::from(k.min(10))));
            false
        },
        "the engine's four blocks",
    );
    assert_eq!(overlap(&mut c, &prompt), 4);
    let stats = || ask(&d.query(), json!({"op": "stats"}))["index_entries"].clone();
    let entries = stats();

    // While it is connected, a stranger sends the next numbers: an
    // invented block, then a wipe (number 0, a cleared cache).
    let mut stranger = raw_pub(to, Ipv4Addr::LOCALHOST);
    for seq in 1000..1010 {
        send_batch(&mut stranger, seq, &batch(77, &invented));
    }
    let mut wipe = Vec::new();
    write_batch(&mut wipe, 1.0, &[], Layout::Map, Some(0));
    send_batch(&mut stranger, 0, &wipe);
    wait(
        || notice(&worker(&mut c, 10), "foreign_batches") >= 12,
        "the stranger's batches ignored",
    );
    assert_eq!(overlap(&mut c, &invented), 0, "no invented block routes");
    assert_eq!(overlap(&mut c, &prompt), 4, "nothing wiped");
    assert_eq!(stats(), entries);

    // A strict entry takes no one but 127.0.0.1.
    let mut other = raw_pub(
        SocketAddr::from(([127, 0, 0, 1], strict_port)),
        Ipv4Addr::new(127, 0, 0, 3),
    );
    assert!(closed(&mut other));
    wait(
        || notice(&worker(&mut c, 11), "events_refused") >= 1,
        "the refused address counted",
    );

    // A flood of 1,000 connections: four are held, the rest closed at
    // once; the daemon's descriptors stay few and, with the held ones
    // idle, it does no more than it did before them.
    let pid = d.child.id();
    let ticks = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(2));
    let quiet = cpu_ticks(pid) - ticks;
    let mut held = Vec::new();
    for _ in 0..1000 {
        if let Ok(s) = TcpStream::connect(to) {
            held.push(s);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(fds(pid) < 200, "{} descriptors", fds(pid));
    let ticks = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(2));
    let used = cpu_ticks(pid) - ticks;
    // 2 s is 200 ticks: at most a twentieth of a core more.
    assert!(
        used <= quiet + 10,
        "{used} ticks of CPU in 2 s with idle peers held, {quiet} without"
    );
    drop(held);
    // The engine is still heard.
    e.store(5, &tokens(500, 516));
    wait(
        || overlap(&mut c, &tokens(500, 516)) == 1,
        "the engine's next block",
    );
    assert!(alive(&mut d));
}

/// Restart storms and stalling replay sockets: the log stays quiet (one
/// line a second per kind), and a replay that trickles is abandoned at its
/// deadline with the engine resynced from its next live batch.
#[test]
fn restart_storms_are_rate_limited_and_a_stalled_replay_is_abandoned() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // A publisher that restarts on every connection: it greets, says
    // batch 0, and resets.
    let storm = TcpListener::bind("127.0.0.1:0").unwrap();
    let storm_port = storm.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut s in storm.incoming().flatten() {
            let mut out = codec::greeting(true).to_vec();
            codec::encode_ready(&mut out, SocketType::Pub, b"");
            codec::encode_message(
                &mut out,
                &[
                    &b"kv-events"[..],
                    &0u64.to_be_bytes(),
                    &batch(1, &tokens(0, 16)),
                ],
            );
            let _ = s.write_all(&out);
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    // An engine (our own sockets) whose replay answers one message every
    // 1.9 s.
    let opts = kvedge_zmtp::Options::default();
    let publisher = rt
        .block_on(kvedge_zmtp::Pub::bind("tcp://127.0.0.1:0", &opts))
        .unwrap();
    let mut router = rt
        .block_on(kvedge_zmtp::Router::bind("tcp://127.0.0.1:0", &opts))
        .unwrap();
    let replay = router.endpoint().to_string();
    rt.spawn(async move {
        while let Some(ask) = router.recv().await {
            for seq in 0u64.. {
                tokio::time::sleep(Duration::from_millis(1900)).await;
                let frames = [
                    ask[0].clone(),
                    bytes::Bytes::new(),
                    bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
                    bytes::Bytes::from(batch(100 + seq, &tokens(0, 16))),
                ];
                if router.send(&frames).await.is_err() {
                    break;
                }
                if seq > 20 {
                    break;
                }
            }
        }
    });
    let log = common::temp_dir("hostile-zmq-storm-log").join("stderr.log");
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\nengines:\n{}{}",
        engine_entry(
            20,
            &format!("tcp://127.0.0.1:{storm_port}"),
            "tcp://127.0.0.1:1",
            ""
        ),
        engine_entry(21, &publisher.endpoint().to_string(), &replay, ""),
    );
    let mut d = common::start_logging(
        "hostile-zmq-storm",
        &yaml,
        std::fs::File::create(&log).unwrap(),
    );
    let mut c = Conn::connect(&d.query());
    // The stalled replay: the history asked at start trickles; the live
    // batches wait behind it until its deadline (10 s).
    rt.block_on(async {
        while publisher.subscribers() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    let started = Instant::now();
    let block = tokens(700, 716);
    let mut seq = 50u64;
    wait(
        || {
            publisher.send(&[&b"kv-events"[..], &seq.to_be_bytes(), &batch(seq, &block)]);
            seq += 1;
            std::thread::sleep(Duration::from_millis(200));
            overlap(&mut c, &block) == 1
        },
        "the live batch applied after the stalled replay",
    );
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "the stalled replay held the engine for {took:?}"
    );
    // Meanwhile the storm went on for all that time: hundreds of
    // restarts, a few lines of log.
    let restarts = notice(&worker(&mut c, 20), "restarted");
    assert!(restarts >= 20, "{restarts} restarts seen");
    drop(c);
    assert!(alive(&mut d));
    let text = std::fs::read_to_string(&log).unwrap();
    let went_back = text.matches("sequence went back").count();
    let lines = text.lines().count();
    let secs = took.as_secs() + 2;
    assert!(
        went_back as u64 <= secs + 2,
        "{went_back} restart lines in {secs} s ({restarts} restarts)"
    );
    assert!(lines < 40 * secs as usize, "{lines} log lines in {secs} s");
    if let Some(dir) = log.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

// ------------------------------------------------------------- the picker

fn train_tokenizer(path: &std::path::Path) {
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    kvedge_epp::testing::train_tokenizer(&docs, 4000, path);
}

/// An engine registered over control.sock serving model `m` at
/// `http://127.0.0.<1 + worker>:8000`.
fn register(d: &Daemon, worker: u64) -> kvedge_shm::Publisher {
    register_at(d, worker, &format!("http://127.0.0.{}:8000", 1 + worker))
}

fn register_at(d: &Daemon, worker: u64, endpoint: &str) -> kvedge_shm::Publisher {
    let mut hello = common::hello(worker, "m");
    hello.endpoint = endpoint.to_owned();
    let (s, p) =
        kvedge_shm::control::ProducerSession::connect(d.control(), &hello, Duration::from_secs(5))
            .unwrap();
    kvedge_shm::Publisher::new(Some(s), p)
}

fn completion(prompt: &Value) -> Vec<u8> {
    json!({"model": "m", "prompt": prompt, "max_tokens": 4})
        .to_string()
        .into_bytes()
}

/// A prompt several megabytes long, tokenized on the pool, does not hold
/// up a normal request's decision; bodies held unfinished share one
/// budget; an approximate prompt is held to the token limit.
#[test]
fn a_huge_prompt_does_not_stall_other_requests_and_bodies_are_bounded() {
    let dir = common::temp_dir("hostile-epp-prompt");
    let tokenizer = dir.join("tokenizer.json");
    train_tokenizer(&tokenizer);
    let port = free_port(Ipv4Addr::LOCALHOST);
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\nepp:\n  listen: 127.0.0.1:{port}\n  max_body_bytes: 8388608\n  max_prompt_tokens: 2000000\n  max_buffered_body_bytes: 33554432\n  tokenize_timeout_ms: 30000\n  models:\n    - name: m\n      tokenizer: {}\n    - name: plain\n",
        tokenizer.display()
    );
    let d = start("hostile-epp-prompt-d", &yaml);
    let _engine = register(&d, 1);
    let mut plain = common::hello(2, "plain");
    plain.endpoint = "http://127.0.0.3:8000".into();
    let (s, p) =
        kvedge_shm::control::ProducerSession::connect(d.control(), &plain, Duration::from_secs(5))
            .unwrap();
    let _plain = kvedge_shm::Publisher::new(Some(s), p);
    let before = rss(&d);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // The huge prompt: 4 MB of words.
        let words = "the quick brown fox jumps over the lazy dog and routes ";
        let huge = words.repeat((4 << 20) / words.len());
        let mut big_client = grpc::connect(port).await;
        let big = tokio::spawn(async move {
            let started = Instant::now();
            let (r, _) = grpc::pick_held(&mut big_client, &completion(&json!(huge))).await;
            (grpc::status(&r), started.elapsed())
        });
        // Normal requests on another connection while it is read.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut client = grpc::connect(port).await;
        let mut times = Vec::new();
        for i in 0..30 {
            let prompt = json!(format!("a normal question number {i} about routing"));
            let started = Instant::now();
            let (r, _) = grpc::pick_held(&mut client, &completion(&prompt)).await;
            times.push(started.elapsed());
            assert_eq!(grpc::status(&r), 0, "a normal request is picked");
        }
        let (status, took) = big.await.unwrap();
        times.sort();
        let p99 = times[times.len() * 99 / 100];
        eprintln!(
            "huge prompt: {status} after {took:?}; normal decisions: p50 {:?}, p99 {p99:?}",
            times[times.len() / 2]
        );
        // The huge prompt takes a second or more to tokenize; a normal
        // decision waited that long behind it before.
        assert!(
            p99 < Duration::from_millis(250),
            "a normal decision took {p99:?}"
        );

        // Without a tokenizer, a prompt over the token limit is refused
        // rather than hashed and picked.
        let (r, _) = grpc::pick_held(&mut client, &{
            let text = "x".repeat(8_100_000);
            json!({"model": "plain", "prompt": text})
                .to_string()
                .into_bytes()
        })
        .await;
        assert_eq!(grpc::status(&r), 400);

        // 100 streams each holding an unfinished 1 MiB body: the budget
        // (32 MiB) refuses the rest at once.
        let mut held = Vec::new();
        let mut refused = 0;
        let chunk = vec![b' '; 1 << 20];
        for _ in 0..100 {
            let (tx, mut s) = grpc::open_request(&mut client).await.unwrap();
            tx.send(grpc::body(&chunk, false)).await.unwrap();
            let r = s.message().await.unwrap().unwrap();
            if grpc::status(&r) == 503 {
                refused += 1;
            }
            held.push((tx, s));
        }
        assert!(refused >= 60, "only {refused} bodies refused");
        // A normal request still goes through.
        let (r, _) = grpc::pick_held(&mut client, &completion(&json!("still served"))).await;
        assert_eq!(grpc::status(&r), 0);
        drop(held);
    });
    let after = rss(&d);
    // The huge prompt's tokens and text are transient; the held bodies
    // are bounded by the budget.
    assert!(
        after < before + (400 << 20),
        "RSS grew from {before} to {after} bytes"
    );
    assert!(ask(&d.query(), json!({"op": "stats"}))["index_entries"].is_u64());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Streams held open after their pick give their reservations back; the
/// streams a peer may hold are bounded; idle connections make room for new
/// ones, so a flood of them does not lock out a gateway: a real Envoy's
/// requests are served through it, and an engine registers meanwhile.
#[test]
fn held_streams_and_idle_connections_cannot_lock_out_the_gateway() {
    let port = free_port(Ipv4Addr::LOCALHOST);
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\n  max_reservations: 100\nepp:\n  listen: 127.0.0.1:{port}\n  max_streams: 64\n  max_connections: 32\n  pick_timeout_ms: 1000\n  models:\n    - name: m\n"
    );
    let d = start("hostile-epp-streams", &yaml);
    let http_engine = kvedge_epp::testing::HttpEngine::start(Ipv4Addr::new(127, 0, 0, 2));
    let _engine = register_at(&d, 1, &http_engine.endpoint());
    let envoy =
        envoy_binary().map(|bin| kvedge_epp::testing::Envoy::start(&bin, &d.dir, port, false));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let idle = rt.block_on(async {
        let mut hog = grpc::connect(port).await;
        // 64 picks held open: reserved, then released by the pick timeout
        // although their streams stay.
        let mut held = Vec::new();
        for i in 0..64u32 {
            let (r, open) = grpc::pick_held(&mut hog, &completion(&json!([i, i + 1]))).await;
            assert_eq!(grpc::status(&r), 0);
            held.push(open);
        }
        // The 65th stream is refused.
        assert!(
            grpc::open_request(&mut hog).await.is_err(),
            "past max_streams"
        );
        let reservations = || ask(&d.query(), json!({"op": "stats"}))["reservations"].clone();
        assert_eq!(reservations(), 64);
        let started = Instant::now();
        while reservations() != 0 {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "held picks keep their reservations"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(held);
        tokio::time::sleep(Duration::from_millis(300)).await;

        // 500 idle connections, never a byte: the oldest make room.
        let mut idle = Vec::new();
        for _ in 0..500 {
            if let Ok(s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                idle.push(s);
            }
        }
        // query.sock answers meanwhile, control.sock takes an engine,
        // and a gateway's new connection is taken and served.
        assert_eq!(ask(&d.query(), json!({"op": "stats"}))["reservations"], 0);
        let _late = register(&d, 2);
        let mut gateway = grpc::connect(port).await;
        // A gateway without Envoy's header limit: the picker's own (96 KiB
        // of headers) answers 431.
        {
            use envoy_types::pb::envoy::config::core::v3::HeaderValue;
            use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
            let mut h = grpc::headers("/v1/completions");
            if let Some(Msg::RequestHeaders(hh)) = &mut h.request {
                hh.headers.as_mut().unwrap().headers.push(HeaderValue {
                    key: "x-big".into(),
                    raw_value: vec![b'v'; 100_000],
                    ..Default::default()
                });
            }
            let (tx, rx) = tokio::sync::mpsc::channel(2);
            let mut s = gateway
                .process(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            tx.send(h).await.unwrap();
            let r = s.message().await.unwrap().unwrap();
            assert_eq!(grpc::status(&r), 431);
        }
        let (r, _) = grpc::pick_held(&mut gateway, &completion(&json!([7, 8, 9]))).await;
        assert_eq!(grpc::status(&r), 0, "the gateway is served");
        idle
    });
    // Through a real Envoy too, with the idle connections still held: a
    // request reaches the engine, and one with oversized headers gets a
    // 4xx, not a 500.
    if let Some(envoy) = &envoy {
        let before = http_engine.hits();
        let (status, body) = envoy.post("/v1/completions", &completion(&json!([1, 2, 3])), &[]);
        assert_eq!(status, 200, "{body}");
        assert_eq!(http_engine.hits(), before + 1);
        // Envoy's own limit (60 KiB) is below the picker's: headers up to
        // it are served, larger ones refused with a 431.
        for (n, expected) in [(58_000, 200), (70_000, 431), (200_000, 431)] {
            let value = "v".repeat(n);
            let (status, body) = envoy.post(
                "/v1/completions",
                &completion(&json!([1, 2, 3])),
                &[("x-big", value.as_str())],
            );
            assert_eq!(status, expected, "a {n}-byte header: {body}");
        }
    }
    drop(idle);

    // What the bounds did is in the metrics (the picker reports once a
    // second).
    let metric = |name: &str| {
        let m = ask(&d.query(), json!({"op": "metrics"}));
        m["text"]
            .as_str()
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    wait_for(
        || metric("kvedge_epp_picks_expired_total") >= 64.0,
        "the expired picks in the metrics",
    );
    assert!(metric("kvedge_epp_streams_refused_total") >= 1.0);
    assert!(metric("kvedge_epp_connections_evicted_total") >= 1.0);
}

/// Model files that are not regular files, or are too big, are refused by
/// `check-config` and by `run` before it creates a socket.
#[test]
fn model_files_that_are_not_regular_files_are_refused_before_any_socket() {
    let dir = common::temp_dir("hostile-model-files");
    let fifo = dir.join("fifo.json");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let sparse = dir.join("huge.json");
    let f = std::fs::File::create(&sparse).unwrap();
    f.set_len(2 << 30).unwrap();
    for (path, expected) in [
        ("/dev/zero".to_owned(), "is not a regular file"),
        (fifo.display().to_string(), "is not a regular file"),
        (sparse.display().to_string(), "more than the"),
    ] {
        let run_dir = dir.join("run");
        let _ = std::fs::remove_dir_all(&run_dir);
        std::fs::create_dir_all(&run_dir).unwrap();
        let config = run_dir.join("kvedge.yaml");
        std::fs::write(
            &config,
            format!(
                "epp:\n  listen: 127.0.0.1:0\n  models:\n    - name: m\n      tokenizer: {path}\n"
            ),
        )
        .unwrap();
        let check = Command::new(env!("CARGO_BIN_EXE_kvedge"))
            .arg("check-config")
            .arg(&config)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&check.stderr);
        assert!(
            !check.status.success() && err.contains(expected),
            "{path}: {err}"
        );
        let started = Instant::now();
        let run = Command::new(env!("CARGO_BIN_EXE_kvedge"))
            .arg("run")
            .arg("--config")
            .arg(&config)
            .arg("--runtime-dir")
            .arg(&run_dir)
            .output()
            .unwrap();
        assert_eq!(run.status.code(), Some(1), "{path}");
        assert!(started.elapsed() < Duration::from_secs(5), "{path}: hung");
        for sock in ["query.sock", "control.sock"] {
            assert!(!run_dir.join(sock).exists(), "{path}: {sock} was created");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------- the rest

/// A metrics endpoint that redirects is not followed (kvedge would
/// otherwise fetch any host it names), and the worker says why its load is
/// unreadable.
#[test]
fn the_scraper_follows_no_redirect() {
    let elsewhere = TcpListener::bind("127.0.0.1:0").unwrap();
    let target = elsewhere.local_addr().unwrap();
    elsewhere.set_nonblocking(true).unwrap();
    let redirect = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = redirect.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut s in redirect.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            let _ = write!(
                s,
                "HTTP/1.1 302 Found\r\nLocation: http://{target}/metrics\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
    });
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\nengines:\n{}    metrics: http://127.0.0.1:{port}/metrics\n",
        engine_entry(30, "tcp://127.0.0.1:1", "tcp://127.0.0.1:1", "")
    );
    let d = start("hostile-scrape-redirect", &yaml);
    let mut c = Conn::connect(&d.query());
    wait(
        || notice(&worker(&mut c, 30), "load_unreadable") >= 2,
        "the unreadable load",
    );
    assert!(
        elsewhere.accept().is_err(),
        "the redirect's target was fetched"
    );
}

/// A `kvedge mock-engine --http` for the daemon `d` (token-id prompts only,
/// no tokenizer), with `extra` flags; returned once its port answers.
fn mock_engine_over_http(d: &Daemon, worker: &str, extra: &[&str]) -> (std::process::Child, u16) {
    let http = free_port(Ipv4Addr::LOCALHOST);
    let child = Command::new(env!("CARGO_BIN_EXE_kvedge"))
        .arg("mock-engine")
        .args(["--worker-id", worker, "--model", "m"])
        .arg("--listen")
        .arg(d.dir.join(format!("engine-{worker}.sock")))
        .arg("--runtime-dir")
        .arg(&d.dir)
        .args(["--http", &format!("127.0.0.1:{http}")])
        .args(["--speed", "50", "--block-size", "16"])
        .args(extra)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait(
        || TcpStream::connect(("127.0.0.1", http)).is_ok(),
        "the mock engine's HTTP port",
    );
    (child, http)
}

/// One JSON POST on a connection of its own; the whole response.
fn post_once(http: u16, path: &str, body: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", http)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: e\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// `kvedge mock-engine --http` keeps a bounded number of descriptors over
/// hundreds of requests (it used to keep one per request).
#[test]
fn the_mock_engine_does_not_leak_a_descriptor_per_request() {
    let d = start(
        "hostile-mock-fds",
        "daemon:\n  heartbeat_timeout_ms: 600000\n",
    );
    let (mut engine, http) = mock_engine_over_http(&d, "1", &[]);
    let body = json!({"model": "m", "prompt": tokens(0, 64), "max_tokens": 2}).to_string();
    for _ in 0..300 {
        let out = post_once(http, "/v1/completions", &body);
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    }
    std::thread::sleep(Duration::from_millis(300));
    let open = fds(engine.id());
    let _ = engine.kill();
    let _ = engine.wait();
    assert!(open < 64, "{open} descriptors after 300 requests");
}

/// `kvedge mock-engine --http --enable-scale-out` renders a request into
/// its prompt's token ids without running it, as vLLM started with that
/// flag does (vllm-router's `kv_aware` asks engines for this); without the
/// flag the render paths answer 403, as a default vLLM's do, and a bad
/// body gets a 400 either way.
#[test]
fn the_mock_engine_renders_prompts_only_with_scale_out_on() {
    let d = start(
        "hostile-mock-render",
        "daemon:\n  heartbeat_timeout_ms: 600000\n",
    );
    let post = |http: u16, path: &str, body: &str| -> (u16, Value) {
        let out = post_once(http, path, body);
        let status = out[9..12].parse().unwrap();
        let json = out.split_once("\r\n\r\n").map_or(Value::Null, |(_, b)| {
            serde_json::from_str(b).unwrap_or(Value::Null)
        });
        (status, json)
    };
    let prompt = tokens(7, 40);
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 5, "stream": true}).to_string();

    let (mut on, http) = mock_engine_over_http(&d, "1", &["--enable-scale-out"]);
    let (status, rendered) = post(http, "/v1/completions/render", &body);
    assert_eq!(status, 200, "{rendered}");
    let one = &rendered.as_array().expect("a list")[..];
    assert_eq!(one.len(), 1, "{rendered}");
    assert_eq!(one[0]["token_ids"], json!(prompt), "{rendered}");
    assert_eq!(one[0]["model"], "m");
    assert_eq!(one[0]["stream"], true);
    assert_eq!(one[0]["sampling_params"]["max_tokens"], 5);
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let (status, e) = post(http, "/v1/chat/completions/render", &chat);
    assert_eq!(status, 400, "no tokenizer, no text: {e}");
    let (status, e) = post(http, "/v1/completions/render", "{\"model\": \"m\"}");
    assert_eq!(status, 400, "{e}");
    let (status, e) = post(
        http,
        "/v1/completions/render",
        &body.replace("\"m\"", "\"x\""),
    );
    assert_eq!(status, 404, "another model: {e}");
    // The engine still serves.
    let (status, done) = post(http, "/v1/completions", &body.replace("true", "false"));
    assert_eq!(status, 200, "{done}");

    let (mut off, http) = mock_engine_over_http(&d, "2", &[]);
    let (status, e) = post(http, "/v1/completions/render", &body);
    assert_eq!(status, 403, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--enable-scale-out"),
        "{e}"
    );
    for c in [&mut on, &mut off] {
        let _ = c.kill();
        let _ = c.wait();
    }
}
