//! The daemon's served path allocates nothing after warm-up. The `Server`
//! that `kvedge run` runs is driven in a thread of this test, and
//! allocation-counter counts that thread's allocations while an engine
//! publishes (Stored, Removed, Load) and two clients select, finish and
//! release: one over the binary socket protocol, one over a query channel.
//! JSON lines build serde values per request and are outside this claim.

#![forbid(unsafe_code)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use common::{engine, temp_dir, wait_for};
use kvedge_schema::messages::{Load, Tier};
use kvedge_shm::Publisher;
use kvedge_wire::{Client, Ids, Role, Select};

/// One round of traffic: the engine re-publishes 16 of its blocks and a
/// load report; each client selects (reserving), releases the prefill and
/// finishes.
fn round(e: &mut Publisher, blocks: &[u64], clients: &mut [&mut Client], q: &Select<'_>) {
    e.publish_removed(Tier::Device, &blocks[..16]).unwrap();
    e.publish_stored_hashes(Tier::Device, None, &blocks[..16])
        .unwrap();
    e.publish_load(&Load {
        active_requests: 1,
        kv_used_blocks: 128,
        kv_total_blocks: 1024,
        ..Load::default()
    })
    .unwrap();
    for c in clients.iter_mut() {
        let id = c.select(q).unwrap().unwrap().request_id;
        c.prefill_done(id).unwrap().unwrap();
        c.finish(id).unwrap().unwrap();
    }
}

#[test]
fn a_warm_daemon_serves_binary_and_ring_requests_without_allocating() {
    serves_without_allocating("alloc", "daemon:\n  heartbeat_timeout_ms: 600000\n");
}

#[test]
fn the_predicted_ttft_policy_and_its_learning_allocate_nothing_either() {
    serves_without_allocating(
        "alloc-ttft",
        "daemon:\n  heartbeat_timeout_ms: 600000\nworker_selection:\n  aggregated: p\n  instances:\n    - name: p\n      type: predicted-ttft\n",
    );
}

/// Selects, prefill_done and finish over the socket and query channels
/// while an engine publishes: nothing allocated once warm.
fn serves_without_allocating(name: &str, yaml: &str) {
    let dir = temp_dir(name);
    let kvedge_testkit::Bound {
        mut server,
        runtime: rd,
    } = kvedge_testkit::Bound::at(dir.clone(), kvedge_testkit::config(yaml));
    // 0: warming up, 1: measuring, 2: stop.
    let phase = Arc::new(AtomicU8::new(0));
    let loop_phase = Arc::clone(&phase);
    let daemon = std::thread::spawn(move || {
        server
            .run_with(|_| loop_phase.load(Ordering::Acquire) >= 1)
            .unwrap();
        let before = server.core().metrics().warmups;
        let info = allocation_counter::measure(|| {
            server
                .run_with(|_| loop_phase.load(Ordering::Acquire) >= 2)
                .unwrap();
        });
        (info, server.core().metrics().warmups - before)
    });

    let mut e = engine(&rd.control(), 1, "m");
    let tokens: Vec<u32> = (0..2048).collect();
    let blocks = kvedge_schema::hash::sequence_hashes(&tokens, 16, None, None);
    e.publish_stored_hashes(Tier::Device, None, &blocks)
        .unwrap();
    let mut socket = Client::connect(rd.query()).unwrap();
    let mut ring = Client::connect(rd.query()).unwrap();
    ring.attach_rings().unwrap().unwrap();
    let mut q = Select::new("m", Role::Aggregated, Ids::hashes(&blocks));
    q.prompt_tokens = Some(2048);
    let dry = Select { dry_run: true, ..q };
    wait_for(
        || socket.select(&dry).unwrap().unwrap().overlap_blocks[0] == 128,
        "the engine's blocks",
    );
    for _ in 0..300 {
        round(&mut e, &blocks, &mut [&mut socket, &mut ring], &q);
    }
    // Switch to the measured stretch (the loop notices within a tick).
    phase.store(1, Ordering::Release);
    std::thread::sleep(Duration::from_millis(50));
    for _ in 0..300 {
        round(&mut e, &blocks, &mut [&mut socket, &mut ring], &q);
    }
    let (overlap, id) = {
        let r = ring.select(&q).unwrap().unwrap();
        (r.overlap_blocks[0], r.request_id)
    };
    assert_eq!(overlap, 128, "the index kept up");
    ring.finish(id).unwrap().unwrap();
    phase.store(2, Ordering::Release);
    let (info, warmups) = daemon.join().unwrap();
    assert_eq!(
        info.count_total, 0,
        "the daemon's loop allocated while serving: {info:?}"
    );
    // The idle stretch after the switch had the select path warmed, so
    // its warm-ups are inside the count too.
    assert!(warmups > 0, "no warm-up ran in the measured stretch");
    let _ = std::fs::remove_dir_all(&dir);
}
