//! A self-contained tour of the ring: this process plays the daemon (control
//! socket, one ring per engine) and re-executes itself as two engine
//! processes that register, publish KV events and load for a few seconds, and
//! exit. Prints what arrived, the rates, and what the engines dropped.
//!
//! `cargo run --release -p kvedge-shm --example ring-demo`

#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::os::unix::net::UnixListener;
use std::process::Command;
use std::time::{Duration, Instant};

use kvedge_schema::hash;
use kvedge_schema::messages::control::{Hello, ResyncRequest};
use kvedge_schema::messages::{EventRef, Load, Tier};
use kvedge_shm::Publisher;
use kvedge_shm::control::{accept_registration, connection_closed, send_resync};

const ENGINES: u64 = 2;
const RUN: Duration = Duration::from_secs(3);

fn engine(socket: &str, worker_id: u64) {
    let hello = Hello {
        kv_blocks: [32_768, 0, 0],
        endpoint: format!("http://127.0.0.1:{}", 8000 + worker_id),
        ..Hello::new(worker_id, "demo-8b")
    };
    let mut p = Publisher::connect(socket, &hello, Duration::from_secs(5)).expect("register");
    let start = Instant::now();
    let mut tokens: Vec<u32> = Vec::with_capacity(2048);
    let mut request = 0u32;
    let prefix: Vec<u32> = (0..1024).map(|i| i + worker_id as u32 * 100_000).collect();
    while start.elapsed() < RUN {
        // About 20,000 prompts a second: a busy engine's pace, in bursts.
        if request.is_multiple_of(20) {
            std::thread::sleep(Duration::from_millis(1));
        }
        // A prompt: a shared 1024-token system prefix (per engine) plus a
        // unique tail; the engine caches it, later evicts it.
        tokens.clear();
        tokens.extend_from_slice(&prefix);
        tokens.extend((0..1024).map(|i| i ^ request.wrapping_mul(2_654_435_761)));
        p.publish_stored_tokens(Tier::Device, None, &tokens, 16, hash::SEED)
            .unwrap();
        let seqs = hash::sequence_hashes(&tokens, 16, None, None);
        p.publish_removed(Tier::Device, &seqs[64..]).unwrap();
        p.publish_load(&Load {
            active_requests: request % 17,
            kv_used_blocks: 64 + u64::from(request % 512),
            kv_total_blocks: 32_768,
            ..Load::default()
        })
        .unwrap();
        request = request.wrapping_add(1);
        // A resync request: re-publish what the engine holds (the prefix).
        p.serve_resync(|p| {
            p.publish_stored_tokens(Tier::Device, None, &prefix, 16, hash::SEED)
                .map(|_| ())
        })
        .unwrap();
    }
    println!(
        "engine {worker_id}: {request} prompts published, {} records dropped",
        p.dropped()
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 3 {
        engine(&args[1], args[2].parse().unwrap());
        return;
    }
    let dir = tempfile_dir();
    let path = dir.join("control.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let children: Vec<_> = (1..=ENGINES)
        .map(|id| {
            Command::new(std::env::current_exe().unwrap())
                .args([path.to_str().unwrap(), &id.to_string()])
                .spawn()
                .unwrap()
        })
        .collect();
    let mut engines = Vec::new();
    for _ in 0..ENGINES {
        let (stream, _) = listener.accept().unwrap();
        let (hello, ring) = accept_registration(&stream, 1 << 20, 1, 1000).unwrap();
        println!(
            "registered worker {} ({}) at {}",
            hello.worker_id, hello.model, hello.endpoint
        );
        engines.push((
            stream,
            hello,
            ring,
            HashSet::<u64>::new(),
            0u64,
            0u64,
            false,
        ));
    }
    let start = Instant::now();
    let mut events = 0u64;
    while engines.iter().any(|e| !e.6) {
        let mut idle = true;
        for (stream, _, ring, blocks, loads, resyncs, done) in engines.iter_mut().filter(|e| !e.6) {
            for _ in 0..256 {
                let Some(r) = ring.poll().expect("ring") else {
                    break;
                };
                idle = false;
                events += 1;
                if r.missing_before > 0 {
                    // Lost events: the view is stale, ask for a snapshot.
                    let req = ResyncRequest {
                        snapshot_id: r.seq,
                        missing_from_seq: r.seq - r.missing_before,
                    };
                    send_resync(stream, &req).unwrap();
                    *resyncs += 1;
                }
                match kvedge_schema::decode(r.kind, r.payload) {
                    Ok(EventRef::Stored(s)) => {
                        blocks.extend(s.blocks.iter().map(|b| b.sequence_hash.to_native()))
                    }
                    Ok(EventRef::Removed(rm)) => rm.hashes.iter().for_each(|h| {
                        blocks.remove(&h.to_native());
                    }),
                    Ok(EventRef::Load(_)) => *loads += 1,
                    Ok(EventRef::Cleared(_)) => blocks.clear(),
                    Ok(_) => {}
                    Err(e) => eprintln!("bad record: {e}"),
                }
            }
            if idle && ring.unreported_drops() > 0 {
                let req = ResyncRequest {
                    snapshot_id: 0,
                    missing_from_seq: 0,
                };
                let _ = send_resync(stream, &req);
                *resyncs += 1;
            }
            if idle && connection_closed(stream).unwrap() && !ring.has_pending() {
                *done = true;
            }
        }
        if idle {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    let secs = start.elapsed().as_secs_f64();
    for mut c in children {
        c.wait().unwrap();
    }
    for (_, hello, ring, blocks, loads, resyncs, _) in &engines {
        println!(
            "worker {}: {} blocks resident (its 64-block shared prefix), {loads} load reports, {} records missing in gaps, {resyncs} resyncs",
            hello.worker_id,
            blocks.len(),
            ring.missing_total()
        );
    }
    println!(
        "{events} events consumed in {secs:.1} s ({:.2} M events/s)",
        events as f64 / secs / 1e6
    );
    let _ = std::fs::remove_dir_all(dir);
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvedge-ring-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
