//! The ring across two real processes: a child producer registered through
//! the real control handshake pushes a verifiable stream through a small ring
//! while this process consumes it.

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
        assert!(stress_payload_ok(r.seq, r.payload), "record {} corrupted", r.seq);
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
    let mut child = Command::new(CHILD)
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
    let nums: Vec<u64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    let (committed, dropped) = (nums[0], nums[1]);
    eprintln!("committed {committed} dropped {dropped} received {}", t.received);
    assert_eq!(committed + dropped, N);
    assert!(committed >= 10_000, "the consumer kept up with at least some of the stream");
    assert_eq!(t.received, committed, "every committed record arrived once");
    // Drops after the last committed record leave no later record to carry
    // the gap, so count them from the final sequence number.
    let trailing = N - t.next_seq;
    assert_eq!(t.missing + trailing, dropped, "gaps equal the producer's drops");
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
    while t.received < 200_000 {
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
