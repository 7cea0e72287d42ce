//! Single-process behaviour of the ring: framing, wrap and padding, drops and
//! gaps, invisibility of uncommitted writes, message round trips, wake-ups,
//! and a consumer that survives whatever a hostile producer writes.

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvedge_schema::DecodeError;
use kvedge_schema::messages::{EventRef, Load, StoredBlock, Tier, kind};
use kvedge_shm::layout::{HEADER_SIZE, PADDING_TYPE, RecordHeader};
use kvedge_shm::segment::Segment;
use kvedge_shm::testing::{FAULT_ALLOWANCE, minor_faults};
use kvedge_shm::{Consumer, Fencing, Producer, Publisher, Push, PushError, RingError};
use proptest::prelude::*;

fn pair(capacity: u64) -> (Producer, Consumer) {
    pair_with(capacity, Fencing::Asymmetric)
}

fn pair_with(capacity: u64, fencing: Fencing) -> (Producer, Consumer) {
    let consumer = Consumer::create(capacity, 3).unwrap();
    let seg = Segment::open(consumer.segment_fd().try_clone_to_owned().unwrap()).unwrap();
    let wake = consumer.wake_fd().try_clone_to_owned().unwrap();
    (
        Producer::with_fencing(seg, Some(wake), fencing).unwrap(),
        consumer,
    )
}

fn pattern(seq: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seq as usize * 31 + i) as u8).collect()
}

#[test]
fn records_round_trip_across_many_wraps() {
    let (mut p, mut c) = pair(4096);
    let mut rng = 0x9e3779b97f4a7c15u64;
    for seq in 0..20_000u64 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let len = (rng % 700) as usize;
        let payload = pattern(seq, len);
        assert_eq!(
            p.try_push(9, (seq % 3) as u16, &payload).unwrap(),
            Push::Committed { seq }
        );
        let r = c.poll().unwrap().expect("record");
        assert_eq!(
            (r.kind, r.flags, r.seq, r.missing_before),
            (9, (seq % 3) as u16, seq, 0)
        );
        assert_eq!(r.payload, &payload[..]);
        assert_eq!(r.payload.as_ptr() as usize % 16, 0, "payload is 16-aligned");
        assert!(c.poll().unwrap().is_none());
    }
}

#[test]
fn full_ring_drops_and_consumer_sees_exact_gap() {
    let (mut p, mut c) = pair(4096);
    let payload = [7u8; 200];
    let mut committed = 0;
    let mut dropped = 0;
    for _ in 0..40 {
        match p.try_push(1, 0, &payload).unwrap() {
            Push::Committed { .. } => committed += 1,
            Push::Dropped { .. } => dropped += 1,
        }
    }
    assert!(dropped > 0 && committed > 0);
    assert_eq!(p.dropped(), dropped);
    assert_eq!(c.producer_dropped(), dropped);
    let mut seen = 0;
    while let Some(r) = c.poll().unwrap() {
        assert_eq!(r.missing_before, 0, "drops come after the committed run");
        seen += 1;
    }
    assert_eq!(seen, committed);
    // After draining, the next record reports the whole gap.
    assert!(matches!(p.try_push(1, 0, &payload).unwrap(), Push::Committed { seq } if seq == 40));
    let r = c.poll().unwrap().unwrap();
    assert_eq!(r.missing_before, dropped);
    assert_eq!(c.missing_total(), dropped);
}

#[test]
fn head_is_handed_back_in_batches_and_whenever_the_ring_runs_dry() {
    // 4096-byte ring: the consumer publishes its head every 512 bytes.
    let (mut p, mut c) = pair(4096);
    let head = |c: &Consumer| c.segment().header().head.0.load(Ordering::Acquire);
    let payload = [1u8; 48]; // 64-byte footprint
    for _ in 0..20 {
        assert!(matches!(
            p.try_push(1, 0, &payload).unwrap(),
            Push::Committed { .. }
        ));
    }
    for i in 1..=7u64 {
        c.poll().unwrap().expect("record");
        assert_eq!(head(&c), 0, "record {i}: below the stride, head stays put");
    }
    c.poll().unwrap().expect("record");
    assert_eq!(head(&c), 512, "eighth record crosses the stride");
    for _ in 8..20 {
        c.poll().unwrap().expect("record");
    }
    assert_eq!(head(&c), 1024);
    assert!(c.poll().unwrap().is_none());
    assert_eq!(head(&c), 20 * 64, "an empty ring shows all its space free");
    // The producer can now fill the whole ring again.
    for _ in 0..64 {
        assert!(matches!(
            p.try_push(1, 0, &payload).unwrap(),
            Push::Committed { .. }
        ));
    }
    assert!(matches!(
        p.try_push(1, 0, &payload).unwrap(),
        Push::Dropped { .. }
    ));
}

#[test]
fn oversized_and_reserved_pushes_are_refused_without_using_a_sequence() {
    let (mut p, _c) = pair(4096);
    let limit = p.max_payload();
    assert_eq!(
        p.try_push(1, 0, &vec![0; limit + 1]),
        Err(PushError::TooLarge {
            len: limit + 1,
            limit
        })
    );
    assert_eq!(
        p.try_push(PADDING_TYPE, 0, &[]),
        Err(PushError::ReservedType(PADDING_TYPE))
    );
    assert_eq!(p.next_seq(), 0);
    assert!(matches!(
        p.try_push(1, 0, &vec![0; limit]),
        Ok(Push::Committed { seq: 0 })
    ));
}

#[test]
fn uncommitted_bytes_are_invisible() {
    // What a producer killed between writing and committing leaves behind.
    let (mut p, mut c) = pair(4096);
    p.try_push(1, 0, b"whole").unwrap();
    let data = c.segment().data_ptr();
    let h = RecordHeader {
        len: 8,
        kind: 1,
        flags: 0,
        seq: 1,
    };
    // SAFETY: offset 32 is inside the 4096-byte data area and 8-aligned.
    unsafe {
        let w = data.add(32).cast::<u64>();
        w.write(h.word0());
        w.add(1).write(1);
        w.add(2).write(0xdead);
    }
    assert_eq!(c.poll().unwrap().unwrap().payload, b"whole");
    assert!(c.poll().unwrap().is_none());
    assert!(c.poll().unwrap().is_none());
}

#[test]
fn attaching_twice_or_to_a_used_ring_is_refused() {
    let (mut p, c) = pair(4096);
    p.try_push(1, 0, b"x").unwrap();
    let seg = Segment::open(c.segment_fd().try_clone_to_owned().unwrap()).unwrap();
    assert!(matches!(
        Producer::new(seg, None),
        Err(kvedge_shm::SegmentError::NotFresh { tail: 32, head: 0 })
    ));
}

#[test]
fn publisher_messages_decode_to_what_was_sent() {
    let (p, mut c) = pair(1 << 16);
    let mut publisher = Publisher::new(None, p);
    let blocks: Vec<StoredBlock> = (0..16)
        .map(|i| StoredBlock {
            sequence_hash: 1000 + i,
            local_hash: 2000 + i,
        })
        .collect();
    publisher
        .publish_stored(Tier::Host, Some(99), &blocks, Some(5))
        .unwrap();
    publisher.publish_removed(Tier::Disk, &[1, 2, 3]).unwrap();
    publisher.publish_cleared(Some(Tier::Device)).unwrap();
    let load = Load {
        active_requests: 3,
        waiting_requests: 1,
        active_prefill_tokens: 4096,
        active_decode_blocks: 77,
        kv_used_blocks: 10,
        kv_total_blocks: 100,
        timestamp_ns: 123,
    };
    publisher.publish_load(&load).unwrap();
    publisher.heartbeat(456).unwrap();
    publisher
        .publish_notice(
            kvedge_schema::messages::notice::BLOCK_SIZE_MISMATCH,
            3,
            "use 32",
        )
        .unwrap();
    publisher.begin_snapshot(8).unwrap();
    publisher
        .publish_stored_tokens(
            Tier::Device,
            None,
            &(0..40).collect::<Vec<u32>>(),
            16,
            kvedge_schema::hash::SEED,
        )
        .unwrap();
    publisher.end_snapshot().unwrap();

    let mut seen = Vec::new();
    while let Some(r) = c.poll().unwrap() {
        match kvedge_schema::decode(r.kind, r.payload).unwrap() {
            EventRef::Stored(s) => {
                let hashes: Vec<u64> = s
                    .blocks
                    .iter()
                    .map(|b| b.sequence_hash.to_native())
                    .collect();
                seen.push(format!(
                    "stored {:?} {:?} {:?} {:?}",
                    s.tier.to_native(),
                    s.parent.as_ref().map(|p| p.to_native()),
                    s.salt.as_ref().map(|p| p.to_native()),
                    hashes.len()
                ));
                if hashes.len() == 16 {
                    assert_eq!(hashes, (1000..1016).collect::<Vec<u64>>());
                    assert_eq!(s.blocks[3].local_hash, 2003);
                } else {
                    let want = kvedge_schema::hash::sequence_hashes(
                        &(0..40).collect::<Vec<u32>>(),
                        16,
                        None,
                        None,
                    );
                    assert_eq!(hashes, want);
                }
            }
            EventRef::Removed(r) => seen.push(format!(
                "removed {:?} {:?}",
                r.tier.to_native(),
                r.hashes.iter().map(|h| h.to_native()).collect::<Vec<_>>()
            )),
            EventRef::Cleared(cl) => seen.push(format!(
                "cleared {:?}",
                cl.tier.as_ref().map(|t| t.to_native())
            )),
            EventRef::Load(l) => {
                assert_eq!(l.active_prefill_tokens, 4096);
                seen.push(format!("load {} {}", l.active_requests, l.kv_total_blocks));
            }
            EventRef::Heartbeat(h) => seen.push(format!("heartbeat {}", h.timestamp_ns)),
            EventRef::SnapshotBegin(b) => seen.push(format!("begin {}", b.snapshot_id)),
            EventRef::SnapshotEnd(e) => seen.push(format!("end {} {}", e.snapshot_id, e.blocks)),
            EventRef::Notice(n) => {
                seen.push(format!("notice {} {} {}", n.code, n.count, n.message))
            }
        }
    }
    assert_eq!(
        seen,
        [
            "stored Host Some(99) Some(5) 16",
            "removed Disk [1, 2, 3]",
            "cleared Some(Device)",
            "load 3 100",
            "heartbeat 456",
            "notice 1 3 use 32",
            "begin 8",
            "cleared None",
            "stored Device None None 2",
            "end 8 2",
        ]
    );
}

#[test]
fn bad_payloads_are_per_record_errors() {
    let (mut p, mut c) = pair(4096);
    p.try_push(kind::KV_STORED, 0, &[0xff; 40]).unwrap();
    p.try_push(999, 0, b"future record type").unwrap();
    p.try_push(kind::LOAD, 0, &[]).unwrap();
    let r = c.poll().unwrap().unwrap();
    assert!(matches!(
        kvedge_schema::decode(r.kind, r.payload),
        Err(DecodeError::Invalid { kind: 1, .. })
    ));
    let r = c.poll().unwrap().unwrap();
    assert!(matches!(
        kvedge_schema::decode(r.kind, r.payload),
        Err(DecodeError::UnknownType(999))
    ));
    let r = c.poll().unwrap().unwrap();
    assert!(kvedge_schema::decode(r.kind, r.payload).is_err());
    assert!(c.poll().unwrap().is_none());
}

#[test]
fn sleeping_consumer_is_woken_by_a_push() {
    let (mut p, mut c) = pair(4096);
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        p.try_push(1, 0, b"wake").unwrap();
        p
    });
    // Must return because of the push, long before the 30 s timeout.
    let start = std::time::Instant::now();
    assert!(c.wait(Duration::ZERO, Duration::from_secs(30)));
    assert!(start.elapsed() < Duration::from_secs(20));
    assert_eq!(c.poll().unwrap().unwrap().payload, b"wake");
    assert_eq!(t.join().unwrap().wakes(), 1, "the push found it asleep");
    assert_eq!(
        c.segment()
            .header()
            .consumer_sleeping
            .0
            .load(Ordering::Relaxed),
        0
    );
}

#[test]
fn producer_registers_for_asymmetric_fences_where_the_kernel_allows() {
    use kvedge_shm::layout::{CONSUMER_FORCE_FENCE, PRODUCER_ASYMMETRIC_FENCE};
    use rustix::thread::{MembarrierQuery, membarrier_query};
    let (mut p, c) = pair(4096);
    let supported = membarrier_query().contains(MembarrierQuery::REGISTER_GLOBAL_EXPEDITED);
    let flags = c
        .segment()
        .header()
        .identity
        .0
        .producer_flags
        .load(Ordering::Relaxed);
    assert_eq!(p.asymmetric_fence(), supported);
    assert_eq!(flags == PRODUCER_ASYMMETRIC_FENCE, supported);
    // A consumer that asks for full fences gets them from the next commit on.
    c.segment()
        .header()
        .consumer_sleeping
        .0
        .store(CONSUMER_FORCE_FENCE, Ordering::Relaxed);
    p.try_push(1, 0, b"x").unwrap();
    assert!(!p.asymmetric_fence());
}

#[test]
fn a_fully_fenced_producer_asks_the_sleeping_consumer_for_no_barrier() {
    use kvedge_shm::layout::CONSUMER_SLEEPING;
    let (mut p, mut c) = pair_with(4096, Fencing::Full);
    assert!(!p.asymmetric_fence());
    let flags = |c: &Consumer| {
        let h = c.segment().header();
        (
            h.identity.0.producer_flags.load(Ordering::Relaxed),
            h.consumer_sleeping.0.load(Ordering::Relaxed),
        )
    };
    assert_eq!(flags(&c), (0, 0));
    // No barrier is asked for, and sleeping without one does not make the
    // consumer ask the producer to change how it fences.
    assert!(!c.announce_sleep());
    assert!(c.confirm_sleep(false));
    assert_eq!(flags(&c), (0, CONSUMER_SLEEPING));
    // A commit still finds the consumer asleep and wakes it.
    p.try_push(1, 0, b"wake").unwrap();
    assert_eq!(p.wakes(), 1);
    assert!(c.wait(Duration::ZERO, Duration::from_secs(30)));
    c.end_sleep();
    assert_eq!(c.poll().unwrap().unwrap().payload, b"wake");
    assert!(!p.asymmetric_fence());
}

#[test]
fn no_wake_up_is_lost_across_thousands_of_sleeps() {
    no_wake_up_is_lost(Fencing::Asymmetric);
}

#[test]
fn no_wake_up_is_lost_across_thousands_of_sleeps_with_full_fences() {
    no_wake_up_is_lost(Fencing::Full);
}

fn no_wake_up_is_lost(fencing: Fencing) {
    // The consumer sleeps before every record; the producer commits at
    // varying moments around that. A lost wake-up would leave the consumer
    // asleep for the whole 20 s timeout, so every wait must end well before.
    let (mut p, mut c) = pair_with(1 << 16, fencing);
    let rounds = 3000u64;
    let producer = std::thread::spawn(move || {
        for i in 0..rounds {
            for _ in 0..(i % 7) * 50 {
                std::hint::spin_loop();
            }
            while !matches!(
                p.try_push(1, 0, &i.to_le_bytes()).unwrap(),
                Push::Committed { .. }
            ) {
                std::thread::yield_now();
            }
            if i % 64 == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    });
    let mut seen = 0u64;
    while seen < rounds {
        // A wake-up may be spurious (a signal meant for an earlier sleep);
        // it may not be missing.
        let start = std::time::Instant::now();
        c.wait(Duration::ZERO, Duration::from_secs(20));
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "wake-up lost at record {seen}"
        );
        while let Some(r) = c.poll().unwrap() {
            assert_eq!(r.payload, seen.to_le_bytes());
            seen += 1;
        }
    }
    producer.join().unwrap();
}

/// Sleeps on several rings the way the daemon does: every flag set, one
/// barrier, every ring checked; then a wait on all their eventfds, drained
/// only when one was readable. Returns whether the wait ended in time.
fn sleep_on_all(rings: &mut [Consumer], timeout: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut barrier = false;
    for c in rings.iter_mut() {
        barrier |= c.announce_sleep();
    }
    let barrier = barrier && kvedge_shm::ring::sleep_barrier();
    let mut pending = false;
    for c in rings.iter_mut() {
        pending |= !c.confirm_sleep(barrier);
    }
    if pending {
        rings.iter_mut().for_each(Consumer::end_sleep);
        return true;
    }
    let start = std::time::Instant::now();
    let woke = {
        let wake: Vec<_> = rings.iter().map(Consumer::wake_fd).collect();
        let mut fds: Vec<PollFd<'_>> = wake
            .iter()
            .map(|fd| PollFd::new(fd, PollFlags::IN))
            .collect();
        let ts = rustix::time::Timespec::try_from(timeout).unwrap();
        poll(&mut fds, Some(&ts)).unwrap() > 0
    };
    for c in rings.iter_mut() {
        if woke {
            c.end_sleep();
        } else {
            c.clear_sleep();
        }
    }
    start.elapsed() < timeout / 2
}

#[test]
fn no_wake_up_is_lost_with_one_barrier_for_several_rings() {
    // Three producers commit at varying moments around the consumer's
    // sleeps on all three rings. A lost wake-up would leave it asleep for
    // the whole 20 s timeout.
    let rounds = 1500u64;
    let (producers, mut consumers): (Vec<Producer>, Vec<Consumer>) =
        (0..3).map(|_| pair(1 << 16)).unzip();
    let threads: Vec<_> = producers
        .into_iter()
        .enumerate()
        .map(|(k, mut p)| {
            std::thread::spawn(move || {
                for i in 0..rounds {
                    for _ in 0..((i + k as u64) % 5) * 80 {
                        std::hint::spin_loop();
                    }
                    while !matches!(
                        p.try_push(1, 0, &i.to_le_bytes()).unwrap(),
                        Push::Committed { .. }
                    ) {
                        std::thread::yield_now();
                    }
                    if i % 50 == k as u64 {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                }
            })
        })
        .collect();
    let mut seen = [0u64; 3];
    while seen.iter().any(|&n| n < rounds) {
        assert!(
            sleep_on_all(&mut consumers, Duration::from_secs(20)),
            "wake-up lost after {seen:?}"
        );
        for (c, n) in consumers.iter_mut().zip(&mut seen) {
            while let Some(r) = c.poll().unwrap() {
                assert_eq!(r.payload, n.to_le_bytes());
                *n += 1;
            }
        }
    }
    for t in threads {
        t.join().unwrap();
    }
    for c in &consumers {
        let flag = c
            .segment()
            .header()
            .consumer_sleeping
            .0
            .load(Ordering::Relaxed);
        assert_eq!(flag & kvedge_shm::layout::CONSUMER_SLEEPING, 0);
    }
}

#[test]
fn a_sleep_flag_cleared_without_a_read_leaves_the_wake_up_for_the_next_sleep() {
    let (mut p, mut c) = pair(4096);
    let barrier = c.announce_sleep() && kvedge_shm::ring::sleep_barrier();
    assert!(c.confirm_sleep(barrier), "nothing pending: may sleep");
    // The producer sees the flag and writes the eventfd; the consumer, woken
    // by something else, clears its flag without reading it.
    p.try_push(1, 0, b"x").unwrap();
    assert_eq!(p.wakes(), 1);
    c.clear_sleep();
    let wake = c.wake_fd();
    let mut fds = [rustix::event::PollFd::new(
        &wake,
        rustix::event::PollFlags::IN,
    )];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    assert_eq!(rustix::event::poll(&mut fds, Some(&zero)).unwrap(), 1);
    // An awake consumer is not signalled again; end_sleep drains the counter.
    p.try_push(1, 0, b"y").unwrap();
    assert_eq!(p.wakes(), 1);
    c.end_sleep();
    let mut buf = [0u8; 8];
    assert!(rustix::io::read(c.wake_fd(), &mut buf).is_err());
    // And a sleep announced with records pending is refused.
    let barrier = c.announce_sleep() && kvedge_shm::ring::sleep_barrier();
    assert!(!c.confirm_sleep(barrier));
}

#[test]
fn producer_does_not_signal_an_awake_consumer() {
    let (mut p, c) = pair(4096);
    p.try_push(1, 0, b"x").unwrap();
    let mut buf = [0u8; 8];
    // No wake-up was written: the eventfd is empty (non-blocking read fails).
    assert!(rustix::io::read(c.wake_fd(), &mut buf).is_err());
    assert_eq!(p.wakes(), 0);
}

#[test]
fn the_consumer_tells_the_producer_its_cpu() {
    let (p, c) = pair(4096);
    assert_eq!(p.consumer_cpu(), None, "nothing published yet");
    c.publish_cpu(0);
    assert_eq!(p.consumer_cpu(), Some(0));
    c.publish_cpu(3);
    assert_eq!(p.consumer_cpu(), Some(3));
    // A number the field cannot hold is published as none.
    c.publish_cpu(u32::MAX as usize);
    assert_eq!(p.consumer_cpu(), None);
    // Whatever a hostile consumer writes is some CPU number, never a panic.
    c.segment()
        .header()
        .consumer_cpu
        .0
        .store(u32::MAX, Ordering::Relaxed);
    assert_eq!(p.consumer_cpu(), Some(u32::MAX as usize - 1));
}

#[test]
fn tail_corruptions_poison_the_ring() {
    // Misaligned, beyond capacity, and wrapped around.
    for tail in [8, 1 << 20, u64::MAX - 15] {
        let (_p, mut c) = pair(4096);
        c.segment().header().tail.0.store(tail, Ordering::Release);
        let e = c.poll().unwrap_err();
        assert!(
            matches!(
                e,
                RingError::TailMisaligned(_) | RingError::TailOutOfRange { .. }
            ),
            "{e}"
        );
        assert_eq!(c.poll().unwrap_err(), e, "poison is sticky");
    }
}

fn hostile_write(c: &Consumer, offset: usize, bytes: &[u8]) {
    let total = HEADER_SIZE + c.segment().capacity() as usize;
    let base = c.segment().header() as *const _ as *mut u8;
    for (i, b) in bytes.iter().enumerate() {
        let at = (offset + i) % total;
        // SAFETY: `at` < mapping length; a byte store into the shared mapping
        // stands in for another process writing arbitrary bytes.
        unsafe { base.add(at).write_volatile(*b) };
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Whatever bytes land in the header and data area (and whatever tail is
    /// claimed), polling terminates with records, `None` or a typed error.
    #[test]
    fn hostile_producer_cannot_crash_or_hang_the_consumer(
        valid_prefix in 0usize..20,
        writes in proptest::collection::vec((0usize..(HEADER_SIZE + 4096), proptest::collection::vec(any::<u8>(), 1..64)), 0..24),
        tail in prop_oneof![any::<u64>(), (0u64..512).prop_map(|t| t * 16)],
    ) {
        let (mut p, mut c) = pair(4096);
        for i in 0..valid_prefix {
            let _ = p.try_push(kind::HEARTBEAT, 0, &pattern(i as u64, i * 7));
        }
        for (offset, bytes) in &writes {
            hostile_write(&c, *offset, bytes);
        }
        c.segment().header().tail.0.store(tail, Ordering::Release);
        let mut polls = 0;
        loop {
            polls += 1;
            prop_assert!(polls <= 4096 / 16 + 2, "consumer made no progress");
            match c.poll() {
                Ok(Some(r)) => { let _ = kvedge_schema::decode(r.kind, r.payload); }
                Ok(None) => break,
                Err(e) => {
                    prop_assert_eq!(c.poll().unwrap_err(), e);
                    break;
                }
            }
        }
    }

    /// Garbage payloads under every record type decode to a typed error or
    /// a valid view, never a panic.
    #[test]
    fn decode_never_panics(kind in 0u16..10, words in proptest::collection::vec(any::<u128>(), 0..32), len_cut in 0usize..16) {
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let n = bytes.len().saturating_sub(len_cut);
        let _ = kvedge_schema::decode(kind, &bytes[..n]);
    }
}

proptest! {
    /// The fuzz target's entry point, driven by proptest in every CI run.
    #[test]
    fn fuzz_entry_point_terminates(input in proptest::collection::vec(any::<u8>(), 0..4200)) {
        let out = kvedge_shm::fuzzing::consume_hostile_bytes(&input);
        prop_assert!(out.decoded <= out.records);
    }
}

#[test]
fn fuzz_entry_point_reads_a_valid_stream() {
    // A real record stream laid down by a producer parses fully.
    let (p, c) = pair(4096);
    let mut publisher = Publisher::new(None, p);
    publisher.heartbeat(1).unwrap();
    publisher.publish_removed(Tier::Host, &[1, 2]).unwrap();
    let tail = c.segment().header().tail.0.load(Ordering::Acquire);
    let mut input = tail.to_le_bytes().to_vec();
    let data = c.segment().data_ptr();
    for i in 0..tail as usize {
        // SAFETY: i < tail <= capacity: inside the data area.
        input.push(unsafe { data.add(i).read_volatile() });
    }
    let out = kvedge_shm::fuzzing::consume_hostile_bytes(&input);
    assert_eq!(
        out,
        kvedge_shm::fuzzing::Outcome {
            records: 2,
            decoded: 2,
            poisoned: false
        }
    );
}

#[test]
fn hostile_sequence_numbers_do_not_overflow() {
    // Found by the fuzzer: seq = u64::MAX used to overflow `seq + 1`.
    let (_p, mut c) = pair(4096);
    let data = c.segment().data_ptr();
    let h = RecordHeader {
        len: 0,
        kind: 1,
        flags: 0,
        seq: u64::MAX,
    };
    // SAFETY: offset 0 of the data area, 8-aligned, 16 bytes.
    unsafe {
        data.cast::<u64>().write(h.word0());
        data.cast::<u64>().add(1).write(u64::MAX);
    }
    c.segment().header().tail.0.store(16, Ordering::Release);
    assert_eq!(c.poll().unwrap_err(), RingError::SequenceExhausted);

    // Two huge forward jumps: the gap total saturates instead of wrapping.
    let (_p, mut c) = pair(4096);
    let data = c.segment().data_ptr();
    for (i, seq) in [u64::MAX - 2, u64::MAX - 1].into_iter().enumerate() {
        let h = RecordHeader {
            len: 0,
            kind: 1,
            flags: 0,
            seq,
        };
        // SAFETY: offsets 0 and 16 of the data area, 8-aligned.
        unsafe {
            data.add(i * 16).cast::<u64>().write(h.word0());
            data.add(i * 16).cast::<u64>().add(1).write(seq);
        }
    }
    c.segment().header().tail.0.store(32, Ordering::Release);
    assert_eq!(c.poll().unwrap().unwrap().missing_before, u64::MAX - 2);
    assert_eq!(c.poll().unwrap().unwrap().missing_before, 0);
    assert_eq!(c.missing_total(), u64::MAX - 2);
}

#[test]
fn the_first_pass_over_a_ring_takes_no_page_fault() {
    // 1 MiB: 256 pages, each mapped by both sides. Unpopulated, the first
    // pass took a fault per page on each side.
    let (mut p, mut c) = pair(1 << 20);
    let payload = [5u8; 1000];
    // The push and poll code, and the stack, touched once.
    p.try_push(1, 0, &payload).unwrap();
    c.poll().unwrap().expect("record");
    let before = minor_faults();
    for _ in 0..1_100 {
        assert!(matches!(
            p.try_push(1, 0, &payload).unwrap(),
            Push::Committed { .. }
        ));
        c.poll().unwrap().expect("record");
    }
    let faults = minor_faults() - before;
    assert!(
        faults <= FAULT_ALLOWANCE,
        "{faults} page faults in a pass over the ring"
    );
}
