//! Publishing and consuming allocate nothing after warm-up: a counting global
//! allocator watches a steady stream of every message kind.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use kvedge_schema::messages::{EventRef, Load, StoredBlock, Tier};
use kvedge_shm::segment::Segment;
use kvedge_shm::{Consumer, Producer, Publisher};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn round(
    publisher: &mut Publisher,
    consumer: &mut Consumer,
    blocks: &[StoredBlock],
    tokens: &[u32],
) -> u64 {
    let mut seen = 0;
    publisher
        .publish_stored(Tier::Device, Some(1), blocks, None)
        .unwrap();
    publisher
        .publish_stored_hashes(Tier::Host, None, &[1, 2, 3])
        .unwrap();
    publisher
        .publish_stored_tokens(Tier::Device, None, tokens, 16, kvedge_schema::hash::SEED)
        .unwrap();
    publisher
        .publish_removed(Tier::Device, &[1, 2, 3, 4])
        .unwrap();
    publisher.publish_cleared(None).unwrap();
    publisher.publish_load(&Load::default()).unwrap();
    publisher.heartbeat(5).unwrap();
    publisher.begin_snapshot(1).unwrap();
    publisher.end_snapshot().unwrap();
    while let Some(r) = consumer.poll().unwrap() {
        match kvedge_schema::decode(r.kind, r.payload).unwrap() {
            EventRef::Stored(s) => seen += s.blocks.len() as u64,
            _ => seen += 1,
        }
    }
    seen
}

#[test]
fn warm_publish_and_consume_allocate_nothing() {
    let mut consumer = Consumer::create(1 << 16, 1).unwrap();
    let seg = Segment::open(consumer.segment_fd().try_clone_to_owned().unwrap()).unwrap();
    let mut publisher = Publisher::new(None, Producer::new(seg, None).unwrap());
    let blocks: Vec<StoredBlock> = (0..16)
        .map(|i| StoredBlock {
            sequence_hash: i,
            local_hash: i,
        })
        .collect();
    let tokens: Vec<u32> = (0..2048).collect();
    for _ in 0..10 {
        round(&mut publisher, &mut consumer, &blocks, &tokens);
    }
    let before = ALLOCS.load(Ordering::Relaxed);
    let mut seen = 0;
    for _ in 0..1000 {
        seen += round(&mut publisher, &mut consumer, &blocks, &tokens);
    }
    let allocs = ALLOCS.load(Ordering::Relaxed) - before;
    // stored(16) + hashes(3) + tokens(2048/16) + removed, cleared, load,
    // heartbeat, snapshot begin, its cleared, snapshot end.
    assert_eq!(seen, 1000 * (16 + 3 + 128 + 7));
    assert_eq!(allocs, 0, "{allocs} allocations in 1000 warm rounds");
}
