//! The ring across two real processes: a child producer registered through
//! the real control handshake pushes a verifiable stream through a small ring
//! while this process consumes it.

#![forbid(unsafe_code)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvedge_shm::Consumer;
use kvedge_shm::control::connection_closed;
use kvedge_tests::{ControlListener, stress_payload_ok};

const CHILD: &str = env!("CARGO_BIN_EXE_ring-child");

#[derive(Debug, Default)]
struct Tally {
    received: u64,
    missing: u64,
    next_seq: u64,
}

/// Drains everything committed; checks order, gaps and every payload byte.
fn drain(ring: &mut Consumer, t: &mut Tally) -> u64 {
    let mut n = 0;
    while let Some(r) = ring.poll().expect("ring stays valid") {
        assert_eq!(r.seq, t.next_seq + r.missing_before, "gap accounting");
        assert!(
            stress_payload_ok(r.seq, r.payload),
            "record {} corrupted",
            r.seq
        );
        assert_eq!(r.kind, 42);
        t.missing += r.missing_before;
        t.next_seq = r.seq + 1;
        t.received += 1;
        n += 1;
    }
    n
}

#[test]
fn ten_million_records_arrive_in_order_or_as_counted_gaps() {
    const N: u64 = 10_000_000;
    let control = ControlListener::bind();
    let child = Command::new(CHILD)
        .args([control.path.to_str().unwrap(), "stress", &N.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // 64 KiB: with records up to 272 bytes the ring wraps ~40,000 times.
    let (stream, hello, mut ring) = control.accept(1 << 16);
    assert_eq!(hello.worker_id, 7);
    let mut t = Tally::default();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if drain(&mut ring, &mut t) == 0 {
            if connection_closed(&stream).unwrap() {
                drain(&mut ring, &mut t);
                break;
            }
            ring.wait(Duration::from_micros(50), Duration::from_millis(10));
        }
        assert!(Instant::now() < deadline, "stress run timed out");
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let line = String::from_utf8(out.stdout).unwrap();
    let nums: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let (committed, dropped) = (nums[0], nums[1]);
    eprintln!(
        "committed {committed} dropped {dropped} received {}",
        t.received
    );
    assert_eq!(committed + dropped, N);
    assert!(
        committed >= 10_000,
        "the consumer kept up with at least some of the stream"
    );
    assert_eq!(t.received, committed, "every committed record arrived once");
    // Drops after the last committed record leave no later record to carry
    // the gap, so count them from the final sequence number.
    let trailing = N - t.next_seq;
    assert_eq!(
        t.missing + trailing,
        dropped,
        "gaps equal the producer's drops"
    );
    assert_eq!(ring.producer_dropped(), dropped);
}

#[test]
fn sigkilled_producer_leaves_only_whole_records_then_a_clean_end() {
    let control = ControlListener::bind();
    let mut child = Command::new(CHILD)
        .args([control.path.to_str().unwrap(), "forever"])
        .spawn()
        .unwrap();
    let (stream, _hello, mut ring) = control.accept(1 << 14);
    let mut t = Tally::default();
    // Let it run hot for a while, then kill it mid-stream.
    let warmup = Instant::now() + Duration::from_secs(60);
    while t.received < 200_000 {
        assert!(
            Instant::now() < warmup,
            "child producer stalled before the kill"
        );
        if drain(&mut ring, &mut t) == 0 {
            ring.wait(Duration::from_micros(50), Duration::from_millis(10));
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        drain(&mut ring, &mut t);
        if connection_closed(&stream).unwrap() {
            break;
        }
        assert!(Instant::now() < deadline, "death not observed");
        std::thread::sleep(Duration::from_millis(1));
    }
    // After the end-of-producer condition: nothing more, and no error.
    assert_eq!(drain(&mut ring, &mut t), 0);
    assert!(ring.poll().unwrap().is_none());
    assert!(ring.poisoned().is_none());
    assert_eq!(t.missing, ring.missing_total());
}

#[test]
fn overflow_gap_resync_restores_the_exact_block_set() {
    use std::collections::BTreeSet;

    use kvedge_schema::hash;
    use kvedge_schema::messages::control::ResyncRequest;
    use kvedge_schema::messages::{EventRef, Tier};
    use kvedge_shm::Publisher;
    use kvedge_shm::control::send_resync;

    let control = ControlListener::bind();
    let path = control.path.clone();
    // The reader waits for the whole burst before it reads, so the ring
    // overflows however the two threads are scheduled.
    let (burst_done, burst_seen) = std::sync::mpsc::channel();
    let engine = std::thread::spawn(move || {
        let mut p = Publisher::connect(&path, &kvedge_tests::test_hello(3), Duration::from_secs(5))
            .unwrap();
        // Overflow the ring on purpose: 64 Stored events of 8 blocks.
        let mut held = Vec::new();
        for i in 0..64u32 {
            let tokens: Vec<u32> = (0..128).map(|t| t + i * 1000).collect();
            p.publish_stored_tokens(Tier::Device, None, &tokens, 16, hash::SEED)
                .unwrap();
            held.push(tokens);
        }
        assert!(p.dropped() > 0, "the ring must overflow for this test");
        // Keep only every other prompt, as an engine evicting would.
        let mut kept = Vec::new();
        for (i, t) in held.iter().enumerate() {
            if i % 2 == 1 {
                let seqs = hash::sequence_hashes(t, 16, None, None);
                // Removal may be dropped too; the snapshot is what counts.
                let _ = p.publish_removed(Tier::Device, &seqs);
            } else {
                kept.push(t.clone());
            }
        }
        burst_done.send(()).unwrap();
        // Serve the daemon's resync request once it arrives.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !p
            .serve_resync(|p| {
                for t in &kept {
                    p.publish_stored_tokens(Tier::Device, None, t, 16, hash::SEED)?;
                }
                Ok(())
            })
            .unwrap()
        {
            assert!(Instant::now() < deadline, "no resync request arrived");
            std::thread::sleep(Duration::from_millis(1));
        }
        let truth: BTreeSet<u64> = kept
            .iter()
            .flat_map(|t| hash::sequence_hashes(t, 16, None, None))
            .collect();
        // Hold the connection until the daemon side has read everything.
        std::thread::sleep(Duration::from_millis(200));
        truth
    });
    // 8 KiB: the 11 KB burst overflows it; the 5.7 KB snapshot fits.
    let (stream, _, mut ring) = control.accept(8192);
    burst_seen
        .recv_timeout(Duration::from_secs(10))
        .expect("the engine published its burst");
    let mut view = BTreeSet::new();
    let mut requested = false;
    let mut in_snapshot = false;
    let mut completed = false;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !completed {
        assert!(Instant::now() < deadline, "snapshot never completed");
        let Some(r) = ring.poll().unwrap() else {
            // Idle: drops at the end of the burst are only in the counter.
            if !requested && ring.unreported_drops() > 0 {
                let req = ResyncRequest {
                    snapshot_id: 1,
                    missing_from_seq: 0,
                };
                send_resync(&stream, &req).unwrap();
                requested = true;
            }
            std::thread::sleep(Duration::from_micros(200));
            continue;
        };
        if r.missing_before > 0 && !requested && !in_snapshot {
            send_resync(
                &stream,
                &ResyncRequest {
                    snapshot_id: 1,
                    missing_from_seq: r.seq - r.missing_before,
                },
            )
            .unwrap();
            requested = true;
        }
        match kvedge_schema::decode(r.kind, r.payload).unwrap() {
            EventRef::SnapshotBegin(b) => {
                assert_eq!(b.snapshot_id, 1);
                in_snapshot = true;
            }
            EventRef::Cleared(_) => view.clear(),
            EventRef::Stored(s) => {
                view.extend(s.blocks.iter().map(|b| b.sequence_hash.to_native()))
            }
            EventRef::Removed(rm) => rm.hashes.iter().for_each(|h| {
                view.remove(&h.to_native());
            }),
            EventRef::SnapshotEnd(e) => {
                assert!(in_snapshot);
                assert_eq!(e.blocks, 32 * 8, "snapshot counts the blocks it carried");
                assert_eq!(r.missing_before, 0, "the snapshot itself arrived whole");
                completed = true;
            }
            _ => {}
        }
    }
    let truth = engine.join().unwrap();
    assert!(requested);
    assert_eq!(
        view, truth,
        "index equals the engine's real state after resync"
    );
}
